"""Backend registry: names -> adapter modules, imported on first use.

Adapters live in ``dense_bridge.backends.<name>`` and import their framework at the top.
Nothing here imports a framework: availability is checked with importlib.util.find_spec,
and a native object's backend is found by looking its framework up in ``sys.modules``
(an object of a framework that was never imported cannot exist).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from ._errors import BackendUnavailableError, SpecError, received, suggest


@dataclass(frozen=True)
class BackendInfo:
    name: str
    module: str  # dotted path of the adapter
    requires: tuple[str, ...]  # top-level framework modules that must be importable
    install: str  # what to run when they are missing
    # more modules needed, decided at call time without importing anything (keras: the package
    # its KERAS_BACKEND names)
    runtime_requires: Callable[[], tuple[str, ...]] | None = None

    def all_requires(self) -> tuple[str, ...]:
        extra = self.runtime_requires() if self.runtime_requires is not None else ()
        return self.requires + tuple(m for m in extra if m not in self.requires)


def keras_backend_package() -> str:
    """The package Keras 3 will run on, read as Keras reads it, without importing Keras:
    ``KERAS_BACKEND``, else ``"backend"`` in ``$KERAS_HOME/keras.json`` (``~/.keras``), else
    TensorFlow."""
    name = os.environ.get("KERAS_BACKEND")
    if not name:
        home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
        try:
            with open(os.path.join(home, "keras.json")) as f:
                name = json.load(f).get("backend")
        except (OSError, ValueError, AttributeError):
            name = None
    return {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch", "numpy": "numpy",
            "openvino": "openvino"}.get(str(name or "tensorflow").lower(), str(name))


BACKENDS: dict[str, BackendInfo] = {
    "numpy": BackendInfo("numpy", "dense_bridge.backends.numpy", ("numpy",), "pip install numpy"),
    "torch": BackendInfo("torch", "dense_bridge.backends.torch", ("torch",),
                         "pip install 'dense-bridge[torch]'"),
    "keras": BackendInfo("keras", "dense_bridge.backends.keras", ("keras",),
                         "pip install 'dense-bridge[keras]'",
                         runtime_requires=lambda: (keras_backend_package(),)),
    "mlx": BackendInfo("mlx", "dense_bridge.backends.mlx", ("mlx",), "pip install 'dense-bridge[mlx]'"),
    "flax": BackendInfo("flax", "dense_bridge.backends.flax", ("flax", "jax"), "pip install 'dense-bridge[flax]'"),
    "equinox": BackendInfo("equinox", "dense_bridge.backends.equinox", ("equinox", "jax"),
                           "pip install 'dense-bridge[equinox]'"),
    "onnx": BackendInfo("onnx", "dense_bridge.backends.onnx", ("onnx", "onnxruntime"), "pip install 'dense-bridge[onnx]'"),
}
NAMES = tuple(BACKENDS)


def _installed(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_backends() -> list[str]:
    """Names of the backends whose framework packages are installed, in canonical order.

    Decided by package lookup, importing no framework not yet imported (for keras: Keras plus
    the package its ``KERAS_BACKEND`` names). ``dense_bridge.available_backends(check=True)``
    also tries each one.
    """
    return [n for n, info in BACKENDS.items() if all(_installed(m) for m in info.all_requires())]


def check_backend_name(name: object, argument: str = "backend") -> str:
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a backend name ({', '.join(NAMES)}). {received(argument, name)}")
    key = name.lower()
    if key not in BACKENDS:
        raise SpecError(f"Unknown backend {name!r}.{suggest(name, NAMES)} Known: {', '.join(NAMES)}. "
                        f"{received(argument, name)}")
    return key


def get_adapter(name: object, argument: str = "backend") -> ModuleType:
    """The adapter module for a backend name, imported now; BackendUnavailableError if missing."""
    info = BACKENDS[check_backend_name(name, argument)]
    missing = [m for m in info.all_requires() if not _installed(m)]
    if missing:
        raise BackendUnavailableError(
            f"Backend {info.name!r} needs {', '.join(missing)}, which is not installed. Install it with: "
            f"{info.install}"
        )
    return importlib.import_module(info.module)


def backend_of(native: object, argument: str = "native") -> str:
    """Name of the backend that owns ``native``; TypeError naming ``argument`` if none does.

    Keras is asked first: on its torch engine a Keras layer is also a ``torch.nn.Module`` (and
    with ``KERAS_NNX_ENABLED`` a Flax module), and it must be read as the Keras layer it is.
    """
    for name, info in sorted(BACKENDS.items(), key=lambda item: item[0] != "keras"):
        # only frameworks already imported can have made this object
        if name != "numpy" and info.requires[0] not in sys.modules:
            continue
        try:
            adapter = get_adapter(name)
        except BackendUnavailableError:
            continue
        if adapter.owns(native):
            return name
    raise TypeError(
        f"{argument} must be a layer or model of a supported framework (torch nn.Module, keras Layer/Model, "
        f"mlx nn.Module, dense_bridge numpy layer), got {type(native).__module__}.{type(native).__name__}. "
        f"{received(argument, native)}"
    )


def array_adapter(value: object) -> ModuleType | None:
    """The adapter of the framework that made the array ``value`` (tensor, variable), or None.

    Found by the top-level module of its type among the frameworks already imported; None for
    numpy and other array-likes, and when that adapter cannot load (``np.asarray`` serves then).
    """
    root = (getattr(type(value), "__module__", None) or "").split(".")[0]
    if not root or root == "numpy" or root not in sys.modules:
        return None
    for name, info in BACKENDS.items():
        if name != "numpy" and root in info.requires:
            try:
                return get_adapter(name)
            except BackendUnavailableError:
                return None
    return None


def adapter_for(native: object, argument: str = "native") -> ModuleType:
    """The adapter module that owns ``native``."""
    return get_adapter(backend_of(native, argument))
