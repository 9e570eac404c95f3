"""The public verbs: compile, get_params, set_params, to_spec, convert.

Each one finds the adapter through the registry and leaves framework work to it; the
checks that must hold for every backend (names, shapes, dtypes, all-or-nothing loading)
live here, once.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ._errors import received
from ._params import ParamSource, validate_params
from ._registry import adapter_for, backend_of, check_backend_name, get_adapter
from .activations import Activation
from .specs import Spec


def _check_spec(spec: object) -> None:
    if not isinstance(spec, (Spec, Activation)):
        raise TypeError(f"spec must be a dense_bridge spec (Dense, Bilinear, Identity, Sequential). "
                        f"{received('spec', spec)}")


def compile(spec: Any, backend: str, *, seed: int | None = None, params: Mapping | None = None):
    """The framework's own layer or model for ``spec``.

    Dense -> torch.nn.Linear / keras.layers.Dense / mlx.nn.Linear (a thin subclass only when
    an activation or mask needs one); Sequential -> that framework's Sequential; "numpy" -> the
    reference layer. Initial parameters are drawn in numpy from ``seed`` (bit-identical on every
    backend), or loaded from canonical ``params``.
    """
    _check_spec(spec)
    adapter = get_adapter(backend)
    return adapter.compile(spec, ParamSource(spec, seed=seed, params=params))


def get_params(native: Any) -> dict[str, np.ndarray]:
    """Canonical parameters of a native layer or model: kernel (in, units), bias (units,), mask.

    Sequential keys are prefixed with the layer position ("0.kernel"). bfloat16 stays bfloat16.
    Arrays may share memory with the framework: copy before mutating them.
    """
    return adapter_for(native).get_params(native)


def set_params(native: Any, params: Mapping, *, strict: bool = True) -> None:
    """Load canonical ``params`` into ``native``.

    All keys, shapes and values are checked before anything is written: on any offender one
    ConversionError lists them all and ``native`` is unchanged. ``strict=False`` allows a
    subset of the keys (unexpected ones still raise).
    """
    adapter = adapter_for(native)
    spec = adapter.to_spec(native)
    checked = validate_params(spec, params, strict=strict)
    adapter.set_params(native, checked)


def to_spec(native: Any):
    """The backend-neutral spec of a native layer or model (activation parameters read exactly)."""
    if isinstance(native, (Spec, Activation)):
        return native
    return adapter_for(native).to_spec(native)


def convert(native: Any, to: str):
    """A new native object on backend ``to`` with ``native``'s spec and parameters.

    float32 parameters arrive bit-identical; layouts are transposed by declaration, never by
    shape, so square layers convert correctly and A -> B -> A gives back A's values.
    """
    target = check_backend_name(to, "to")
    source = adapter_for(native)
    spec = source.to_spec(native)
    params = source.get_params(native)
    return get_adapter(target).compile(spec, ParamSource(spec, params=params))


def backend(native: Any) -> str:
    """The backend name of a native object ("torch", "keras", "mlx" or "numpy")."""
    return backend_of(native)
