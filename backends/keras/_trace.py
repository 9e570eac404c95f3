"""The ``trace`` verb: forward through each layer, then per-layer backward with the Keras backend's
own autograd (``tf.GradientTape``, ``jax.vjp``, ``torch.autograd.grad``) for L = sum(y * grad_out).

Each layer's forward runs once, recording what its backward needs; the backward then walks the
layers in reverse, handing each its output cotangent. Parameter gradients are taken with respect
to the trainable variables' values (the mask is not trainable: it gets none).
"""
from __future__ import annotations

from typing import Sequence

import keras
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._trace import LayerTrace, Trace

from ._arrays import BACKEND, _numpy, _to_tensor
from ._models import einsum_call, einsum_canonical_grads
from ._params import _variables
from ._to_spec import _kind, _layers_of


def _run(layer, xs):
    return einsum_call(layer, xs[0]) if _kind(layer) == "einsum" else layer(*xs, training=False)


def _input(x: np.ndarray, dtype: str):
    # cast in numpy first: a float64 input to a float32 layer must not need float64 on JAX
    return _to_tensor(np.asarray(x).astype(numpy_dtype(dtype), copy=False))


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Forward, then per-layer backward with the backend's autograd for L = sum(y * grad_out)."""
    layers, _ = _layers_of(native)
    for layer in layers:
        _kind(layer)
    dtype = keras.backend.standardize_dtype(layers[0].compute_dtype) if layers else "float32"
    xs = [_input(x, dtype) for x in inputs]
    step = {"tensorflow": _step_tf, "jax": _step_jax, "torch": _step_torch}[BACKEND]
    backwards = []
    for layer in layers:
        if not layer.built:  # lazy: one plain call builds it (its variables cannot be made under a trace)
            _run(layer, xs)
        trainable = {k: v for k, v in _variables(layer).items() if k != "mask"}
        y, backward = step(layer, xs, trainable)
        backwards.append((layer, y, backward, len(xs), list(trainable)))
        xs = [y]
    records: list[LayerTrace] = [None] * len(backwards)  # type: ignore[list-item]
    if not backwards:
        return Trace(records)
    g = _input(grad_out, keras.backend.standardize_dtype(backwards[-1][1].dtype))
    for i in range(len(backwards) - 1, -1, -1):
        layer, y, backward, n_x, names = backwards[i]
        grads = backward(g)
        dxs = tuple(np.array(_numpy(d)) for d in grads[:n_x])
        pgrads = {k: np.array(_numpy(d)) for k, d in zip(names, grads[n_x:])}
        if _kind(layer) == "einsum":
            pgrads = einsum_canonical_grads(layer, pgrads)
        records[i] = LayerTrace(np.array(_numpy(y)), dxs, pgrads)
        g = grads[0]
    return Trace(records)


def _step_tf(layer, xs, trainable):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        for x in xs:
            tape.watch(x)
        y = _run(layer, xs)
    sources = list(xs) + [v.value for v in trainable.values()]

    def backward(g):
        grads = tape.gradient(y, sources, output_gradients=g)
        return [tf.zeros_like(s) if d is None else d for s, d in zip(sources, grads)]

    return y, backward


def _step_jax(layer, xs, trainable):
    import jax

    variables = list(trainable.values())
    others = [v for v in layer.variables if all(v is not t for t in variables)]
    fixed = [(v, v.value) for v in others]

    def f(xs_, values):
        # the layer reads its variables from the scope: values are what jax.vjp differentiates
        with keras.StatelessScope(state_mapping=list(zip(variables, values)) + fixed):
            return _run(layer, xs_)

    y, vjp = jax.vjp(f, list(xs), [v.value for v in variables])

    def backward(g):
        dxs, dvalues = vjp(g)
        return list(dxs) + list(dvalues)

    return y, backward


def _step_torch(layer, xs, trainable):
    import torch

    xs = [x.detach().requires_grad_(True) for x in xs]
    with torch.enable_grad():
        y = _run(layer, xs)
    sources = list(xs) + [v.value for v in trainable.values()]

    def backward(g):
        if not y.requires_grad:
            return [torch.zeros_like(s) for s in sources]
        grads = torch.autograd.grad(y, sources, grad_outputs=g, allow_unused=True)
        return [torch.zeros_like(s) if d is None else d for s, d in zip(sources, grads)]

    return y, backward
