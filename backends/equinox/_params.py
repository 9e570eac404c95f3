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

from ._arrays import device_of_leaves, dtype_name, to_jax, to_numpy
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


def _layer_params(m, to_numpy=to_numpy) -> dict[str, np.ndarray]:
    """Canonical params of one layer, each array read by ``to_numpy`` (numpy views; the JAX
    arrays themselves for :func:`device_params`)."""
    if is_dense(m):
        out = {"kernel": to_numpy(m.weight).T}
        if m.bias is not None:
            out["bias"] = to_numpy(m.bias)
        if isinstance(m, DenseLinear) and m.mask is not None:
            if to_numpy is _same:  # the mask as the kernel's dtype, on its device
                out["mask"] = m.mask.T.astype(m.weight.dtype)
                return out
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
        kernel = get["kernel"]  # numpy, or a device array of any DLPack framework (``.T``: a view)
        kernel = kernel if hasattr(kernel, "T") else np.asarray(kernel)
        new["weight"] = to_jax(kernel if type(m) is Bilinear else kernel.T, dtype, like=m.weight)
    if "bias" in get:
        new["bias"] = to_jax(get["bias"], dtype, like=m.weight)
    if "mask" in get:
        mask = get["mask"]
        mask = mask if hasattr(mask, "T") else np.asarray(mask)
        new["mask"] = to_jax(mask.T, dtype, like=m.weight) != 0
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


def _same(array):
    return array


def device_params(native) -> dict:
    """Canonical params as JAX arrays on the model's device (kernel = ``weight.T``, one device op)."""
    return {prefix + k: v for prefix, m in positions(native) for k, v in _layer_params(m, _same).items()}


def device_of(native) -> str | None:
    """Where the module's arrays live ("cpu:0", "cuda:0", ...); None when it holds none."""
    import jax

    return device_of_leaves(jax.tree_util.tree_leaves(native))


def place(native, device):
    """A copy of the (immutable) module with its arrays on ``device`` (a ``jax.Device``): one
    transfer per array."""
    import equinox as eqx
    import jax

    arrays, static = eqx.partition(native, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, device), static)
