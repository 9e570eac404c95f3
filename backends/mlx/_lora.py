"""mlx-lm's ``LoRALinear`` and ``DoRALinear`` as one linear layer: the ``dense_bridge.lora`` verbs on MLX.

Both wrap ``linear`` (an ``nn.Linear``) and hold ``lora_a`` (in, r), ``lora_b`` (r, out) in the
canonical layout already, and ``scale``, an absolute Python float (not alpha / r):
y = linear(x) + scale * (x @ lora_a) @ lora_b. ``DoRALinear`` adds ``m`` (out,), the magnitude:
y = m / ||W + scale * (lora_a @ lora_b).T||_row * (x @ W.T + scale * x @ lora_a @ lora_b) + bias.
"""
from __future__ import annotations

import contextlib
import sys

import mlx.core as mx
import numpy as np

from dense_bridge._errors import ConversionError

from ._arrays import MX_DTYPES, to_mx, to_numpy


def _classes() -> tuple:
    out = []
    for mod, name in (("mlx_lm.tuner.lora", "LoRALinear"), ("mlx_lm.tuner.dora", "DoRALinear")):
        cls = getattr(sys.modules.get(mod), name, None)
        if cls is not None:
            out.append(cls)
    return tuple(out)


def is_lora(m) -> bool:
    """An mlx-lm LoRALinear/DoRALinear (decided without importing mlx-lm)."""
    return type(m) in _classes()


def _is_dora(m) -> bool:
    return type(m).__name__ == "DoRALinear"


@contextlib.contextmanager
def lora_base(m):
    yield m.linear if is_lora(m) else None


def read_lora(m) -> dict[str, np.ndarray]:
    arrays = [m.lora_a, m.lora_b] + ([m.m] if _is_dora(m) else [])
    mx.eval(arrays)
    out = {"lora_a": to_numpy(m.lora_a), "lora_b": to_numpy(m.lora_b),
           "lora_scale": np.array(float(m.scale), dtype=np.float64)}
    if _is_dora(m):
        out["lora_magnitude"] = to_numpy(m.m)
    return out


def _like(value, current):
    dtype = next((k for k, v in MX_DTYPES.items() if v == current.dtype), None)
    return to_mx(np.ascontiguousarray(value), dtype) if dtype is not None else mx.array(np.asarray(value), dtype=current.dtype)


def write_lora(m, lora: dict) -> None:
    arrays = {}
    if "lora_a" in lora:
        arrays["lora_a"] = _like(lora["lora_a"], m.lora_a)
    if "lora_b" in lora:
        arrays["lora_b"] = _like(lora["lora_b"], m.lora_b)
    if "lora_magnitude" in lora:
        arrays["m"] = _like(lora["lora_magnitude"], m.m)
    if arrays:
        m.update(arrays)
    if "lora_scale" in lora:
        m.scale = float(np.asarray(lora["lora_scale"]))


def lora_dora() -> bool:
    """Does this framework have a DoRA adapter class (a magnitude vector)?"""
    return True


def lora_heads(m):
    return None


def _step(node, key: str):
    return node[int(key)] if isinstance(node, list) else getattr(node, key)


def _put(model, path: str, value) -> None:
    if not path:
        raise ConversionError("the model itself is the linear layer: an adapter cannot be attached to or removed "
                              "from the root in place; wrap it in a module first")
    keys = path.split(".")
    parent = model
    for k in keys[:-1]:
        parent = _step(parent, k)
    if isinstance(parent, list):
        parent[int(keys[-1])] = value
    else:
        setattr(parent, keys[-1], value)


def attach_lora(model, path: str, layer, *, rank: int, dora: bool):
    """Replace ``layer`` at ``path`` by mlx-lm's own LoRALinear (DoRALinear) around it."""
    try:
        if dora:
            from mlx_lm.tuner.dora import DoRALinear as cls
        else:
            from mlx_lm.tuner.lora import LoRALinear as cls
    except ImportError as exc:
        raise ConversionError(f"attaching a LoRA adapter on MLX needs mlx-lm (pip install mlx-lm): {exc}") from None
    wrapped = cls.from_base(layer, r=rank, scale=1.0)
    dtype = layer.weight.dtype
    wrapped.update({k: v.astype(dtype) for k, v in (("lora_a", wrapped.lora_a), ("lora_b", wrapped.lora_b))})
    if dora:
        wrapped.update({"m": wrapped.m.astype(dtype)})
    _put(model, path, wrapped)
    return wrapped


def detach_lora(model, path: str, m):
    _put(model, path, m.linear)
    return m.linear


# ----------------------------------------------------------------------------- quantized bases
# The three functions below are the whole of what merging into a quantized base needs from MLX;
# a general quantize/dequantize layer (backends/mlx/_quant.py) can take their place.
def lora_quantized(base) -> bool:
    """Is the wrapped layer quantized (``nn.QuantizedLinear``: packed codes, scales, biases)?"""
    return type(base).__name__ == "QuantizedLinear"


def lora_dequantize(base) -> np.ndarray:
    """The float kernel (in, units) MLX computes from a QuantizedLinear's codes (its own dequantize)."""
    w = mx.dequantize(base.weight, base.scales, base.get("biases"), group_size=base.group_size, bits=base.bits,
                      mode=base.mode)
    mx.eval(w)
    return np.array(to_numpy(w)).T


def lora_requantize(base, kernel: np.ndarray):
    """(a QuantizedLinear like ``base`` holding ``kernel`` (in, units) quantized by MLX in the same format,
    the float kernel (in, units) it dequantizes to)."""
    import mlx.nn as nn

    out_dims, in_dims = int(base.scales.shape[0]), int(kernel.shape[0])
    plain = nn.Linear(in_dims, out_dims, bias="bias" in base)
    dtype = base.scales.dtype
    plain.update({"weight": mx.array(np.ascontiguousarray(kernel.T)).astype(dtype)})
    if "bias" in base:
        plain.update({"bias": base.bias})
    requantized = nn.QuantizedLinear.from_linear(plain, group_size=base.group_size, bits=base.bits, mode=base.mode)
    return requantized, lora_dequantize(requantized)


def replace_lora(model, path: str, m, layer):
    """Put ``layer`` in the place of the wrapper ``m`` (the merged, requantized base)."""
    _put(model, path, layer)
    return layer
