"""Autograd traces on Flax NNX: per-layer outputs and gradients of L = sum(y * grad_out) via ``jax.vjp``.

Each layer is split with ``nnx.split(layer, nnx.Param, ...)`` into its graph, its Params and the
rest; ``jax.vjp`` differentiates the pure function ``(params, *inputs) -> merge(...)(*inputs)``,
so only ``nnx.Param`` variables are differentiated and the Mask never is. Forward and backward of
each layer run as one ``jax.jit`` computation each: eager JAX compiles every primitive on its
first shape, which made a one-layer trace cost seconds. Each layer sees its input cast to its own
parameter dtype; Flax's layouts are canonical, so gradients need no transpose.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from dense_bridge._trace import LayerTrace, Trace

from ._arrays import DTYPES, to_jax, x64_enabled
from ._layers import LazyDenseLinear
from ._params import positions


def _param_dtype(m):
    kernel = getattr(m, "kernel", None) if isinstance(m, nnx.Module) else None
    return kernel.get_value().dtype if isinstance(kernel, nnx.Param) else None


def _apply(static, dynamic, xs):
    """One layer's forward: ``static`` is ("module", graphdef) or ("fn", callable)."""
    kind, what = static
    if kind == "module":
        params, rest = dynamic
        return nnx.merge(what, params, rest)(*xs)
    return what(*xs)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _trace_all(statics, casts, dynamics, xs, g):
    """Every layer's output, input grads and Param grads, in one XLA computation (one compile)."""
    layer_inputs, outputs = [], []
    for static, cast, dynamic in zip(statics, casts, dynamics):
        if cast is not None:
            xs = tuple(x.astype(cast) for x in xs)
        layer_inputs.append(xs)
        xs = (_apply(static, dynamic, xs),)
        outputs.append(xs[0])
    g = g.astype(outputs[-1].dtype)
    records = [None] * len(statics)
    for i in range(len(statics) - 1, -1, -1):
        y, vjp = jax.vjp(lambda d, *inputs: _apply(statics[i], d, inputs), dynamics[i], *layer_inputs[i])
        grads = vjp(g.astype(y.dtype))
        records[i] = (y, grads[1:], grads[0][0] if statics[i][0] == "module" else None)
        g = grads[1]
    return records


def _split(m):
    if isinstance(m, nnx.Module):
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        return ("module", graphdef), (params, rest)
    return ("fn", m), None


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Per-layer outputs and gradients of L = sum(y * grad_out) with JAX's autograd (jax.vjp)."""
    layers = [m for _, m in positions(native)]
    inputs = [np.asarray(x) for x in inputs]
    for m in layers:  # a lazy layer first in line builds from the input width, as its first call would
        if isinstance(m, LazyDenseLinear) and not m.built:
            m(to_jax(inputs[0][(0,) * (inputs[0].ndim - 1)][None], "float32").astype(m.param_dtype))
        break
    first = next((d for d in map(_param_dtype, layers) if d is not None), None)
    name = np.dtype(first).name if first is not None else np.dtype(inputs[0].dtype).name
    xs = [to_jax(x, _float_name(name)) for x in inputs]
    casts = []
    for m in layers:
        if isinstance(m, LazyDenseLinear) and not m.built:  # later in line: one eager call builds it
            m(_forward_eager(layers[:len(casts)], xs))
        casts.append(_param_dtype(m))
    split = [_split(m) for m in layers]
    records = _trace_all(tuple(s for s, _ in split), tuple(casts), tuple(d for _, d in split), tuple(xs),
                         to_jax(grad_out, _float_name(np.asarray(grad_out).dtype)))
    out = []
    for y, dxs, gparams in records:
        grads = {} if gparams is None else {k: np.array(v) for k, v in nnx.to_pure_dict(gparams).items()
                                            if v is not None}
        out.append(LayerTrace(np.array(y), tuple(np.array(d) for d in dxs), grads))
    return Trace(out)


def _float_name(dtype) -> str:
    name = np.dtype(dtype).name
    return name if name in DTYPES and (name != "float64" or x64_enabled()) else "float32"


def _forward_eager(layers, xs):
    """The input of the layer after ``layers`` (only for building a lazy layer late in a chain)."""
    for m in layers:
        dt = _param_dtype(m)
        xs = [m(*[x.astype(dt) if dt is not None else x for x in xs])]
    return xs[0]
