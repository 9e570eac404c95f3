"""Canonical parameters <-> Equinox arrays: ``get_params``/``set_params`` and the layout transposes.

Layouts: ``eqx.nn.Linear.weight`` (units, in_features) = canonical kernel.T (the bool mask likewise,
as 0/1 in the layer's dtype canonically); dense_bridge's Bilinear keeps weight (units, in1, in2),
the canonical kernel. ``eqx.nn.Sequential`` keeps its layers in ``.layers`` ("0.kernel");
``eqx.nn.MLP`` is read as the chain Linear, activation, Linear, ..., so its i-th Linear is at
position 2*i ("0.kernel", "2.kernel", ...), the spec ``to_spec`` gives.

Equinox modules are immutable pytrees; ``set_params`` rebinds the array fields of the modules it
is given in place (``object.__setattr__``, as Equinox's own unflatten sets fields), so every
holder of the module sees the new arrays, like MLX's ``update``.
"""
from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from dense_bridge._dtypes import numpy_dtype

from ._arrays import dtype_name, to_jax, to_numpy
from ._layers import Bilinear, DenseLinear, is_dense, is_identity_fn


def positions(native) -> list[tuple[str, Any]]:
    """(key prefix, layer) per position: "" for a lone layer, "0.", "1.", ... in a chain."""
    if type(native) is eqx.nn.Sequential:
        return [(f"{i}.", m) for i, m in enumerate(native.layers)]
    if type(native) is eqx.nn.MLP:
        chain = []
        for i, layer in enumerate(native.layers):
            chain.append(layer)
            if i < len(native.layers) - 1:
                chain.append(native.activation)
        if not is_identity_fn(native.final_activation):
            chain.append(native.final_activation)
        return [(f"{i}.", m) for i, m in enumerate(chain)]
    return [("", native)]


def _layer_params(m) -> dict[str, np.ndarray]:
    if is_dense(m):
        out = {"kernel": to_numpy(m.weight).T}
        if m.bias is not None:
            out["bias"] = to_numpy(m.bias)
        if isinstance(m, DenseLinear) and m.mask is not None:
            mask = np.asarray(m.mask).T.astype(numpy_dtype(dtype_name(m.weight.dtype, "weight")))
            mask.flags.writeable = False
            out["mask"] = mask
        return out
    if type(m) is Bilinear:
        out = {"kernel": to_numpy(m.weight)}
        if m.bias is not None:
            out["bias"] = to_numpy(m.bias)
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
    if not get or not (is_dense(m) or type(m) is Bilinear):
        return
    dtype = dtype_name(m.weight.dtype, "weight")
    new = {}
    if "kernel" in get:
        kernel = np.asarray(get["kernel"])
        new["weight"] = to_jax(kernel if type(m) is Bilinear else kernel.T, dtype)
    if "bias" in get:
        new["bias"] = to_jax(get["bias"], dtype)
    if "mask" in get:
        new["mask"] = jnp.asarray(np.asarray(get["mask"]).T != 0)
    if isinstance(m, DenseLinear) and m.mask is not None and ("weight" in new or "mask" in new):
        # masked weights are exactly 0 by contract, whatever was passed for them
        mask = new.get("mask", m.mask)
        new["weight"] = jnp.where(mask, new.get("weight", m.weight), jnp.zeros((), m.weight.dtype))
    for name, value in new.items():
        object.__setattr__(m, name, value)


def set_params(native, params: dict[str, np.ndarray]) -> None:
    """Write validated canonical params: new JAX arrays rebound into the modules' fields in place."""
    for prefix, m in positions(native):
        _set_layer(m, params, prefix)
