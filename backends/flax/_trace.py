"""Autograd traces on Flax NNX: per-layer outputs and gradients of L = sum(y * grad_out) via ``jax.vjp``.

Each layer is split with ``nnx.split(layer, nnx.Param, ...)`` into its graph, its Params and the
rest; ``jax.vjp`` differentiates the pure function ``(params, *inputs) -> merge(...)(*inputs)``,
so only ``nnx.Param`` variables are differentiated and the Mask never is. Forward and backward of
each layer run as one ``jax.jit`` computation each: eager JAX compiles every primitive on its
first shape, which made a one-layer trace cost seconds. Each layer sees its input cast to its own
parameter dtype; Flax's layouts are canonical, so gradients need no transpose.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from flax import nnx

from dense_bridge.registry._trace import LayerTrace, Trace
from dense_bridge.backends._jax.trace import float_name, trace_layers

from .._jax.arrays import full_precision
from .._jax.capture import first_array
from ._arrays import to_jax
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


def _split(m):
    if isinstance(m, nnx.Module):
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        return ("module", graphdef), (params, rest)
    return ("fn", m), None


@full_precision
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
    like = first_array(nnx.state(native))  # inputs and cotangent on the model's device
    xs = [to_jax(x, float_name(name), like=like) for x in inputs]
    casts = []
    for m in layers:
        if isinstance(m, LazyDenseLinear) and not m.built:  # later in line: one eager call builds it
            m(_forward_eager(layers[:len(casts)], xs))
        casts.append(_param_dtype(m))
    split = [_split(m) for m in layers]
    g = to_jax(grad_out, float_name(np.asarray(grad_out).dtype), like=like)
    records = trace_layers(_apply, tuple(s for s, _ in split), tuple(casts), tuple(d for _, d in split),
                           tuple(xs), g)
    out = []
    for (y, dxs, gdynamic), (_, dynamic) in zip(records, split):
        gparams = None if dynamic is None else gdynamic[0]  # (d params, d rest): the Params' part
        grads = {} if gparams is None else {k: np.array(v) for k, v in nnx.to_pure_dict(gparams).items()
                                            if v is not None}
        out.append(LayerTrace(np.array(y), tuple(np.array(d) for d in dxs), grads))
    return Trace(out)


def _forward_eager(layers, xs):
    """The input of the layer after ``layers`` (only for building a lazy layer late in a chain)."""
    for m in layers:
        dt = _param_dtype(m)
        xs = [m(*[x.astype(dt) if dt is not None else x for x in xs])]
    return xs[0]


@full_precision
def run_layer(layer, x: np.ndarray, grad_out: np.ndarray | None):
    """One call of ``layer`` alone on ``x`` (its native input shape and dtype), and ``jax.vjp``'s
    backward from ``grad_out`` (dL/d(output)): ``(output, dL/dx, canonical parameter gradients)``
    as numpy; ``grad_out`` None: forward only (``(output, None, {})``).

    The output is what ``capture`` records: a DenseLinear with an activation runs its linear map
    alone (``grad_out`` is then dL/d(linear map)). Flax's layouts are canonical already.
    """
    import jax

    from ._layers import DenseLinear

    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    linear_only = isinstance(layer, DenseLinear) and not layer.activation.is_identity

    def fn(params, xj):
        m = nnx.merge(graphdef, params, rest)
        return m._linear(xj) if linear_only else m(xj)

    arr = np.asarray(x)
    like = first_array(params)  # on the layer's device
    xj = to_jax(arr, float_name(arr.dtype), like=like)
    if grad_out is None:
        return np.array(jax.jit(fn)(params, xj)), None, {}
    y, vjp = jax.vjp(fn, params, xj)
    g = np.asarray(grad_out)
    gparams, dx = vjp(to_jax(g, float_name(g.dtype), like=like).astype(y.dtype))
    flat = {k: v for k, v in nnx.to_pure_dict(gparams).items() if k in ("kernel", "bias") and v is not None}
    return np.array(y), np.array(dx), {k: np.array(v) for k, v in flat.items()}
