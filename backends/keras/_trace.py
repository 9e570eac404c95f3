"""The autograd trace: forward through each layer, then per-layer backward with tf.GradientTape."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from dense_bridge._trace import LayerTrace, Trace

from ._arrays import _to_tensor
from ._models import einsum_call, einsum_canonical_grads
from ._params import _variables
from ._to_spec import _kind, _layers_of


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Forward, then per-layer backward with tf.GradientTape for L = sum(y * grad_out)."""
    layers, _ = _layers_of(native)
    for layer in layers:
        _kind(layer)
    dtype = layers[0].compute_dtype if layers else "float32"
    xs = [tf.cast(_to_tensor(np.asarray(x)), dtype) for x in inputs]
    steps = []
    for layer in layers:
        with tf.GradientTape() as tape:
            for x in xs:
                tape.watch(x)
            y = einsum_call(layer, xs[0]) if _kind(layer) == "einsum" else layer(*xs, training=False)
        steps.append((layer, tape, xs, y))
        xs = [y]
    records: list[LayerTrace] = [None] * len(steps)  # type: ignore[list-item]
    g = tf.cast(_to_tensor(np.asarray(grad_out)), steps[-1][3].dtype) if steps else None
    for i in range(len(steps) - 1, -1, -1):
        layer, tape, xs, y = steps[i]
        trainable = {k: v for k, v in _variables(layer).items() if k != "mask"}
        sources = list(xs) + [v.value for v in trainable.values()]
        grads = tape.gradient(y, sources, output_gradients=g)
        grads = [tf.zeros_like(s) if d is None else d for s, d in zip(sources, grads)]
        dxs = tuple(d.numpy() for d in grads[:len(xs)])
        pgrads = {k: d.numpy() for k, d in zip(trainable, grads[len(xs):])}
        if _kind(layer) == "einsum":
            pgrads = einsum_canonical_grads(layer, pgrads)
        records[i] = LayerTrace(y.numpy(), dxs, pgrads)
        g = grads[0]
    return Trace(records)
