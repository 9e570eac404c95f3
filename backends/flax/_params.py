"""Canonical parameters <-> Flax NNX variables: ``get_params``/``set_params``.

Flax's layouts are the canonical ones: ``nnx.Linear.kernel`` is (in_features, units), the
:class:`~._layers.Mask` likewise, and dense_bridge's Bilinear keeps kernel (units, in1, in2).
Nothing is transposed. ``nnx.Sequential`` keeps its layers in ``.layers``; canonical keys are
"<position>.<name>" ("0.kernel"), Flax's own paths "layers.0.kernel".
"""
from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from dense_bridge._errors import SpecError

from ._arrays import device_of_leaves, dtype_name, to_jax, to_numpy
from ._layers import Bilinear, LazyDenseLinear, Mask, is_dense


def positions(native) -> list[tuple[str, Any]]:
    """(key prefix, layer) for each position: "" for a lone layer, "0.", "1.", ... in a Sequential."""
    if type(native) is nnx.Sequential:
        return [(f"{i}.", m) for i, m in enumerate(native.layers)]
    return [("", native)]


def _layer_params(m, to_numpy=to_numpy) -> dict[str, np.ndarray]:
    """Canonical params of one layer, each variable read by ``to_numpy`` (numpy views; the JAX
    arrays themselves for :func:`device_params`)."""
    if isinstance(m, LazyDenseLinear) and not m.built:
        raise SpecError("this lazy Flax layer has no parameters yet (in_features is fixed by its first "
                        "input): run one input through it before reading or saving them")
    if is_dense(m) or type(m) is Bilinear:
        out = {"kernel": to_numpy(m.kernel)}
        if m.bias is not None:
            out["bias"] = to_numpy(m.bias)
        if isinstance(getattr(m, "mask", None), Mask):
            out["mask"] = to_numpy(m.mask)
        return out
    return {}


def get_params(native) -> dict[str, np.ndarray]:
    """Canonical params as read-only views of JAX's (immutable) arrays: a snapshot by nature."""
    out: dict[str, np.ndarray] = {}
    for prefix, m in positions(native):
        for key, value in _layer_params(m).items():
            out[prefix + key] = value
    return out


def _set_layer(m, params: dict[str, np.ndarray], prefix: str) -> None:
    get = {k: params[prefix + k] for k in ("kernel", "bias", "mask") if prefix + k in params}
    if not get:
        return
    dtype = dtype_name(m.kernel.get_value().dtype, "kernel")
    new = {k: to_jax(v, dtype, like=getattr(m, k)) for k, v in get.items()}  # on the layer's own device
    masked = isinstance(getattr(m, "mask", None), Mask)
    if masked and ("kernel" in new or "mask" in new):
        # masked kernel entries are exactly 0 by contract, whatever was passed for them
        new["kernel"] = new.get("kernel", m.kernel.get_value()) * new.get("mask", m.mask.get_value())
    for key, value in new.items():
        getattr(m, key).set_value(value)


def set_params(native, params: dict[str, np.ndarray]) -> None:
    """Write validated canonical params into the layers' variables (new JAX arrays, set in place)."""
    for prefix, m in positions(native):
        _set_layer(m, params, prefix)


def device_params(native) -> dict:
    """Canonical params as the JAX arrays the variables hold, where they live (nothing copied)."""
    return {prefix + k: v for prefix, m in positions(native)
            for k, v in _layer_params(m, lambda var: var.get_value()).items()}


def device_of(native) -> str | None:
    """Where the model's variables live ("cpu:0", "cuda:0", ...); None when it holds none."""
    import jax

    return device_of_leaves(jax.tree_util.tree_leaves(nnx.state(native)))


def place(native, device):
    """``native`` with every variable moved to ``device`` (a ``jax.Device``): one transfer per array,
    the module itself returned (its variables updated in place)."""
    import jax

    nnx.update(native, jax.device_put(nnx.state(native), device))
    return native
