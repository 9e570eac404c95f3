"""Flax ``nnx.LoRALinear`` as one linear layer: the ``dense_bridge.lora`` verbs on Flax NNX.

``nnx.LoRALinear`` is an ``nnx.Linear`` (``kernel`` (in, out), ``bias``) plus ``lora``, an
``nnx.LoRA`` with ``lora_a`` (in, r) and ``lora_b`` (r, out): y = x @ kernel + bias + x @ lora_a @ lora_b.
It has no scale: the canonical ``lora_scale`` reads 1, and a written scale is folded into
``lora_b`` (``dense_bridge.lora.fold_scale``: exact for powers of two, otherwise only when the
caller accepted rounding). No DoRA.
"""
from __future__ import annotations

import contextlib

import numpy as np
from flax import nnx

from dense_bridge._errors import ConversionError
from dense_bridge.lora import fold_scale

from ._arrays import dtype_name, to_jax, to_numpy


def is_lora(m) -> bool:
    return type(m) is nnx.LoRALinear


@contextlib.contextmanager
def lora_base(m):
    """The layer read as the ``nnx.Linear`` it extends: its class is nnx.Linear for the duration
    (the plain get/set_params and to_spec take exactly nnx.Linear; the adapter is left untouched)."""
    if not is_lora(m):
        yield None
        return
    m.__class__ = nnx.Linear
    try:
        yield m
    finally:
        m.__class__ = nnx.LoRALinear


def lora_folds_scale() -> bool:
    return True


def lora_dora() -> bool:
    """Does this framework have a DoRA adapter class (a magnitude vector)?"""
    return False


def lora_heads(m):
    return None


def read_lora(m) -> dict[str, np.ndarray]:
    return {"lora_a": to_numpy(m.lora.lora_a), "lora_b": to_numpy(m.lora.lora_b),
            "lora_scale": np.array(1.0, dtype=np.float64)}


def write_lora(m, lora: dict) -> None:
    if "lora_magnitude" in lora:
        raise ConversionError("Flax has no DoRA adapter (nnx.LoRALinear has no magnitude): use lora='merge'")
    if "lora_a" in lora:
        m.lora.lora_a.set_value(to_jax(np.ascontiguousarray(lora["lora_a"]),
                                       dtype_name(m.lora.lora_a.get_value().dtype, "lora_a")))
    b = lora.get("lora_b")
    scale = float(np.asarray(lora.get("lora_scale", 1.0)))
    if b is None and scale != 1.0:
        b = to_numpy(m.lora.lora_b)
    if b is not None:
        current = to_numpy(m.lora.lora_b)  # its numpy dtype (bfloat16 as ml_dtypes.bfloat16)
        folded = fold_scale(b, scale, "nnx.LoRALinear", current.dtype)
        m.lora.lora_b.set_value(to_jax(np.ascontiguousarray(folded), dtype_name(m.lora.lora_b.get_value().dtype,
                                                                                "lora_b")))


def _step(node, key: str):
    return node[int(key)] if isinstance(node, (list, tuple, nnx.List)) else getattr(node, key)


def _put(model, path: str, value) -> None:
    if not path:
        raise ConversionError("the model itself is the linear layer: an adapter cannot be attached to or removed "
                              "from the root in place; wrap it in a module first")
    keys = path.split(".")
    parent = model
    for k in keys[:-1]:
        parent = _step(parent, k)
    if isinstance(parent, (list, nnx.List)):
        parent[int(keys[-1])] = value
    else:
        setattr(parent, keys[-1], value)


def attach_lora(model, path: str, layer, *, rank: int, dora: bool):
    """Replace ``layer`` (an nnx.Linear) at ``path`` by an nnx.LoRALinear holding its kernel and bias."""
    if dora:
        raise ConversionError(f"{path}: Flax has no DoRA adapter class: use lora='merge'")
    if type(layer) is not nnx.Linear:
        raise ConversionError(f"{path}: nnx.LoRALinear replaces an nnx.Linear, not {type(layer).__name__}")
    kernel = layer.kernel.get_value()
    wrapped = nnx.LoRALinear(layer.in_features, layer.out_features, lora_rank=rank, use_bias=layer.bias is not None,
                             dtype=layer.dtype, param_dtype=kernel.dtype, lora_param_dtype=kernel.dtype,
                             rngs=nnx.Rngs(0))
    wrapped.kernel.set_value(kernel)
    if layer.bias is not None:
        wrapped.bias.set_value(layer.bias.get_value())
    _put(model, path, wrapped)
    return wrapped


def detach_lora(model, path: str, m):
    """Put an nnx.Linear with ``m``'s kernel and bias in its place; return it."""
    kernel = m.kernel.get_value()
    plain = nnx.Linear(m.in_features, m.out_features, use_bias=m.bias is not None, dtype=m.dtype,
                       param_dtype=kernel.dtype, rngs=nnx.Rngs(0))
    plain.kernel.set_value(kernel)
    if m.bias is not None:
        plain.bias.set_value(m.bias.get_value())
    _put(model, path, plain)
    return plain
