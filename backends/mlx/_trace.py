"""Autograd traces on MLX: per-layer outputs and gradients of L = sum(y * grad_out) via ``mx.vjp``.

Each layer sees its input cast to its own parameter dtype; the mask is never differentiated;
gradients are returned in the canonical layout (see ``_params``).
"""
from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dense_bridge.registry._trace import LayerTrace, Trace

from ._arrays import MX_DTYPES, dtype_name, to_mx, to_numpy
from ._layers import declared_arrays, is_dense
from ._params import positions


def _param_dtype(m) -> mx.Dtype | None:
    """The dtype of a layer's weight (None for layers without parameters)."""
    decl = declared_arrays(m)
    if decl is not None:
        return m[decl[0]].dtype
    return m["weight"].dtype if isinstance(m, nn.Module) and "weight" in m else None


def _trace_dtype(layers: list, x: np.ndarray) -> str:
    """Inputs are cast to the first parameter layer's dtype; a parameter-free model keeps x's."""
    for m in layers:
        if _param_dtype(m) is not None:
            return dtype_name(_param_dtype(m), "weight")
    name = np.dtype(x.dtype).name
    return name if name in MX_DTYPES else "float32"


def _grad_params(m) -> list[tuple[str, mx.array]]:
    """The parameters to differentiate: everything but the mask (which never trains) and a
    quantized layer's codes, scales and offsets (MLX has no gradient for them: QuantizedMatmul's
    vjp raises), whose bias still has one."""
    if not isinstance(m, nn.Module):
        return []
    from ._quant import is_quantized

    codes = {(f"{name}." if name else "") + k for name, sub in m.named_modules() if is_quantized(sub)
             for k in ("weight", "scales", "biases")}
    return [(k, v) for k, v in tree_flatten(m.parameters()) if k != "mask" and k not in codes]


def canonical_grads(m, grads: dict[str, mx.array]) -> dict[str, np.ndarray]:
    """One module's parameter gradients (MLX names and layout) in the canonical layout."""
    decl = declared_arrays(m)
    if decl is not None:  # a third-party class declared with db.register_layout
        kernel = to_numpy(grads[decl[0]])
        out = {"kernel": kernel.T if decl[2] else kernel}
        return out if decl[1] is None else {**out, "bias": to_numpy(grads[decl[1]])}
    out = {}
    if "weight" in grads:
        w = to_numpy(grads["weight"])
        out["kernel"] = w.T if is_dense(m) else w.transpose(0, 2, 1)
    if "bias" in grads:
        out["bias"] = to_numpy(grads["bias"])
    return out


def _layer_vjp(m, xs: list[mx.array], g: mx.array) -> tuple[mx.array, list[mx.array], dict]:
    """(output, input grads, native param grads) of one layer for cotangent g, via mx.vjp."""
    named = _grad_params(m)
    names, arrays = [k for k, _ in named], [v for _, v in named]
    n = len(arrays)

    def fn(*primals):
        if n:
            m.update(tree_unflatten(list(zip(names, primals[:n]))))
        return m(*primals[n:])

    try:
        (y,), cotangents = mx.vjp(fn, arrays + xs, [g])
    finally:
        if n:  # put the real arrays back: the traced ones must not stay in the module
            m.update(tree_unflatten(list(zip(names, arrays))))
    mx.eval(y, cotangents)
    return y, cotangents[n:], dict(zip(names, cotangents[:n]))


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Per-layer outputs and gradients of L = sum(y * grad_out) with MLX's autograd (mx.vjp)."""
    return trace_chain(native, inputs, grad_out, canonical_grads)


def trace_chain(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray, layer_grads) -> Trace:
    """``trace``, each module's parameter gradients made canonical by ``layer_grads(m, grads)``."""
    # Dropout runs as what the spec says it is (the identity), whatever the module's training flag
    layers = [nn.Identity() if type(m) is nn.Dropout else m for _, m in positions(native)]
    inputs = [np.asarray(x) for x in inputs]
    dtype = _trace_dtype(layers, inputs[0])
    xs = [to_mx(x, dtype) for x in inputs]
    layer_inputs, outputs = [], []
    for m in layers:
        if _param_dtype(m) is not None:  # each layer sees its input in its own dtype
            xs = [x.astype(_param_dtype(m)) for x in xs]
        layer_inputs.append(xs)
        y = m(*xs)
        mx.eval(y)
        outputs.append(y)
        xs = [y]
    g = to_mx(np.asarray(grad_out), dtype_name(outputs[-1].dtype, "output"))
    records: list[LayerTrace] = [None] * len(layers)  # type: ignore[list-item]
    for i in range(len(layers) - 1, -1, -1):
        y, dxs, grads = _layer_vjp(layers[i], layer_inputs[i], g.astype(outputs[i].dtype))
        records[i] = LayerTrace(np.array(to_numpy(y)), tuple(np.array(to_numpy(d)) for d in dxs),
                                {k: np.array(v) for k, v in layer_grads(layers[i], grads).items()})
        g = dxs[0]
    return Trace(records)


def run_layer(layer, x: np.ndarray, grad_out: np.ndarray | None):
    """One call of ``layer`` alone on ``x`` (its native input shape and dtype), and ``mx.vjp``'s
    backward from ``grad_out`` (dL/d(output)): ``(output, dL/dx, canonical parameter gradients)``
    as numpy; ``grad_out`` None: forward only (``(output, None, {})``). The output is what
    ``capture`` records (the module's return value); the mask is never differentiated."""
    from ._capture import canonical_grads as canonical

    arr = np.asarray(x)
    xm = to_mx(arr, np.dtype(arr.dtype).name)
    modes = [(m, m.training) for _, m in layer.named_modules()] if isinstance(layer, nn.Module) else []
    try:
        if isinstance(layer, nn.Module):
            layer.eval()
        if grad_out is None:
            y = layer(xm)
            return np.array(to_numpy(y), copy=True), None, {}
        g = np.asarray(grad_out)  # in the output's dtype
        y, dxs, grads = _layer_vjp(layer, [xm], to_mx(g, np.dtype(g.dtype).name))
    finally:
        for m, training in modes:
            m._training = training
    pg = canonical(layer, tree_unflatten(list(grads.items()))) if grads else {}
    return np.array(to_numpy(y), copy=True), np.array(to_numpy(dxs[0]), copy=True), pg
