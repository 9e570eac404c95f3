"""The jitted per-layer forward/backward the JAX-family ``trace`` verbs share (Flax NNX, Equinox).

Each adapter splits its layers into a static half (hashable: jit keys static arguments by
``==``/hash) and a dynamic half (the parameter pytree, or None for a bare function) and gives an
``apply(static, dynamic, xs)`` that runs one layer; this module runs the whole chain forward and
then backward with ``jax.vjp`` in ONE XLA computation (eager JAX would compile every primitive
separately: seconds for a few layers).
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from .arrays import DTYPES, x64_enabled


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def trace_layers(apply, statics: tuple, casts: tuple, dynamics: tuple, xs: tuple, g):
    """Per layer ``(y, dL/d inputs, dL/d dynamic)`` for L = sum(y_last * g).

    ``casts[i]``: the dtype layer i's inputs are cast to (its parameter dtype), or None.
    ``xs``: the first layer's inputs, (batch, width) each; ``g``: like the last output.
    """
    layer_inputs, outputs = [], []
    for static, cast, dynamic in zip(statics, casts, dynamics):
        if cast is not None:
            xs = tuple(x.astype(cast) for x in xs)
        layer_inputs.append(xs)
        xs = (apply(static, dynamic, xs),)
        outputs.append(xs[0])
    g = g.astype(outputs[-1].dtype)
    records = [None] * len(statics)
    for i in range(len(statics) - 1, -1, -1):
        y, vjp = jax.vjp(lambda d, *inputs: apply(statics[i], d, inputs), dynamics[i], *layer_inputs[i])
        grads = vjp(g.astype(y.dtype))
        records[i] = (y, grads[1:], grads[0])
        g = grads[1]
    return records


def float_name(dtype) -> str:
    """The float dtype JAX computes ``dtype`` in: float64 only with 64-bit mode on, else float32
    for anything that is not a float dtype JAX knows."""
    name = np.dtype(dtype).name
    return name if name in DTYPES and (name != "float64" or x64_enabled()) else "float32"
