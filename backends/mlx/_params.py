"""Canonical parameters <-> MLX arrays: ``get_params``/``set_params`` and the layout transposes.

The transposes follow the layouts table in the package docstring (``backends/mlx/__init__.py``):
weight = kernel.T for Dense (mask likewise), Bilinear swaps axes 1 and 2.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dense_bridge._errors import SpecError

from ._arrays import dtype_name, to_mx, to_numpy
from ._layers import declared_arrays, is_dense
from ._quant import quant_layer


def positions(native) -> list[tuple[str, Any]]:
    """(key prefix, module) for each position: "" for a lone layer, "0.", "1.", ... in a Sequential."""
    if type(native) is nn.Sequential:
        return [(f"{i}.", m) for i, m in enumerate(native.layers)]
    return [("", native)]


def layer_params(m) -> dict[str, np.ndarray]:
    quantized = quant_layer(m)
    if quantized is not None:  # the float kernel MLX's own mx.dequantize computes (_quant.py)
        return quantized.dequantized()
    decl = declared_arrays(m)
    if decl is not None:  # a third-party class declared with db.register_layout
        kernel = to_numpy(m[decl[0]])
        out = {"kernel": kernel.T if decl[2] else kernel}
        return out if decl[1] is None else {**out, "bias": to_numpy(m[decl[1]])}
    if is_dense(m):
        if "weight" not in m:
            raise SpecError("this lazy MLX layer has no parameters yet (in_features is fixed by its "
                                  "first input): run one input through it before reading or saving them")
        out = {"kernel": to_numpy(m["weight"]).T}
        if "bias" in m:
            out["bias"] = to_numpy(m["bias"])
        if "mask" in m:
            out["mask"] = to_numpy(m["mask"]).T
        return out
    if type(m) is nn.Bilinear:
        out = {"kernel": to_numpy(m["weight"]).transpose(0, 2, 1)}
        if "bias" in m:
            out["bias"] = to_numpy(m["bias"])
        return out
    return {}


def get_params(native) -> dict[str, np.ndarray]:
    """Canonical params as read-only zero-copy views of MLX's memory (MLX arrays are immutable,
    so a view stays a snapshot: training rebinds the module to new arrays)."""
    mx.eval(native.parameters())
    out: dict[str, np.ndarray] = {}
    for prefix, m in positions(native):
        for key, value in layer_params(m).items():
            out[prefix + key] = value
    return out


def layer_subset(params: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The kernel/bias/mask of ``params`` under key prefix ``prefix`` ("2."), without the prefix."""
    return {k: params[prefix + k] for k in ("kernel", "bias", "mask") if prefix + k in params}


def set_layer(m, params: dict[str, np.ndarray], prefix: str) -> None:
    """Write the params of ``params`` under ``prefix`` into the module ``m`` (one position)."""
    get = layer_subset(params, prefix)
    if not get:
        return
    quantized = quant_layer(m)
    if quantized is not None:  # float weights into codes: MLX's own quantizer (_quant.py)
        full = {**quantized.dequantized(), **get}
        quantized.quantize(full["kernel"], full.get("bias")).write()
        return
    decl = declared_arrays(m)
    if decl is not None:
        dtype = dtype_name(m[decl[0]].dtype, decl[0])
        new = {}
        if "kernel" in get:
            new[decl[0]] = to_mx(np.asarray(get["kernel"]).T if decl[2] else get["kernel"], dtype)
        if "bias" in get:
            new[decl[1]] = to_mx(get["bias"], dtype)
        m.update(new)
        return
    if type(m) is nn.Bilinear:
        dtype = dtype_name(m["weight"].dtype, "weight")
        new = {}
        if "kernel" in get:
            new["weight"] = to_mx(np.asarray(get["kernel"]).transpose(0, 2, 1), dtype)
        if "bias" in get:
            new["bias"] = to_mx(get["bias"], dtype)
        m.update(new)
        return
    dtype = dtype_name(m["weight"].dtype, "weight")
    new = {}
    if "kernel" in get:
        new["weight"] = to_mx(np.asarray(get["kernel"]).T, dtype)
    if "bias" in get:
        new["bias"] = to_mx(get["bias"], dtype)
    if "mask" in get:
        new["mask"] = to_mx(np.asarray(get["mask"]).T, dtype)
    if "mask" in m and ("kernel" in get or "mask" in get):
        # masked weights are exactly 0 by contract, whatever was passed for them
        weight = new.get("weight", m["weight"]) * new.get("mask", m["mask"])
        mx.eval(weight)
        new["weight"] = weight
    m.update(new)


def set_params(native, params: dict[str, np.ndarray]) -> None:
    """Copy validated canonical params into new MLX arrays (mx.array copies) and rebind them."""
    for prefix, m in positions(native):
        set_layer(m, params, prefix)
