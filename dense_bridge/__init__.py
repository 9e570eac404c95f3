"""dense_bridge: one backend-neutral Dense spec, compiled into each framework's own layer.

Backends: torch, Keras 3 (on TensorFlow, JAX or torch), MLX, Flax NNX, Equinox, ONNX and the numpy
reference, plus any registered with ``register_backend``.

Importing this package imports no framework, and not even numpy: every public name below is
loaded from its module on first use (PEP 562 ``__getattr__``), so ``import dense_bridge`` costs
a few milliseconds and a tool that only needs, say, the error classes never pays for the rest.
``db.Dense`` and friends import the spec modules (and numpy) the first time they are touched;
adapters load on the first ``compile`` for their backend. ``benchmarks/bench_import.py``
measures each step.
"""
from __future__ import annotations

import importlib

from ._errors import BackendUnavailableError, CheckpointError, ConversionError, DenseBridgeError, SpecError
from ._version import __version__

# public name -> (module relative to this package, attribute in it; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "Dense": (".specs", "Dense"), "Bilinear": (".specs", "Bilinear"), "Identity": (".specs", "Identity"),
    "Flatten": (".specs", "Flatten"), "Sequential": (".specs", "Sequential"),
    "from_config": (".specs", "from_config"),
    "Activation": (".activations", "Activation"), "Init": (".initializers", "Init"),
    "wiring": (".wiring", None), "testing": (".testing", None),
    "available_backends": ("._api", "available_backends"), "backend": ("._api", "backend"),
    "compile": ("._api", "compile"), "convert": ("._api", "convert"), "get_params": ("._api", "get_params"),
    "set_params": ("._api", "set_params"), "to_spec": ("._api", "to_spec"), "inference": ("._api", "inference"),
    "linear_layers": (".models", "linear_layers"), "register_layout": (".models", "register_layout"),
    "transfer": ("._transfer", "transfer"), "auto": (".models._infer", "auto"), "Quant": (".quant", "Quant"),
    "save": (".checkpoints", "save"), "load": (".checkpoints", "load"),
    "register_backend": (".registry._backends", "register_backend"),
    "lora": (".lora", None), "merge_lora": (".lora._merge", "merge_lora"),
    "load_adapter": (".lora._files", "load_adapter"), "save_adapter": (".lora._files", "save_adapter"),
    "convert_adapter": (".lora._files", "convert_adapter"),
    "ADAPTER_DIRECTORY_FORMATS": (".lora._files", "DIRECTORY_FORMATS"),
    "port": (".ports", "port"), "verify_port": (".ports", "verify_port"),
}

__all__ = [
    "Dense", "Bilinear", "Identity", "Flatten", "Sequential", "Activation", "Init", "wiring", "from_config",
    "available_backends", "backend", "compile", "get_params", "set_params", "to_spec", "convert",
    "save", "load", "testing", "linear_layers", "register_layout", "transfer", "inference", "register_backend", "Quant",
    "merge_lora", "load_adapter", "save_adapter", "convert_adapter", "ADAPTER_DIRECTORY_FORMATS", "auto", "port", "verify_port",
    "DenseBridgeError", "SpecError", "ConversionError", "CheckpointError", "BackendUnavailableError",
]


def __getattr__(name: str):
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'dense_bridge' has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
