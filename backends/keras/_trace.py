"""The autograd trace: forward through each layer, then per-layer backward with the engine's own
autograd (tf.GradientTape, jax.vjp over a stateless call, torch.autograd: ``_engine.layer_vjp``).

Layers are traced back to front: each layer's call is re-run under the engine's autograd with
the cotangent that the layer after it produced, so every layer's input, output and parameter
gradients are that engine's own numbers.
"""
from __future__ import annotations

from typing import Sequence

import keras
import numpy as np

from dense_bridge.registry._trace import LayerTrace, Trace

from ._engine import layer_vjp, to_numpy, to_tensor
from ._models import einsum_call, einsum_canonical_grads, is_reversible
from ._params import layer_variables, stored_transposed
from ._to_spec import layer_kind, layers_of


def _call(layer, *xs):
    if is_reversible(layer):  # a ReversibleEmbedding read as a linear layer is its head: reverse=True
        return layer(*xs, reverse=True)
    return einsum_call(layer, xs[0]) if layer_kind(layer) == "einsum" else layer(*xs, training=False)


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Forward, then per-layer backward for L = sum(y * grad_out), with the engine's autograd."""
    layers, _ = layers_of(native)
    for layer in layers:
        layer_kind(layer)
    dtype = layers[0].compute_dtype if layers else "float32"
    xs = [to_tensor(np.asarray(x), dtype) for x in inputs]
    steps = []
    for layer in layers:  # forward once, keeping each layer's inputs
        y = _call(layer, *xs)
        steps.append((layer, xs, y))
        xs = [y]
    records: list[LayerTrace] = [None] * len(steps)  # type: ignore[list-item]
    g = to_tensor(np.asarray(grad_out), str(keras.backend.standardize_dtype(steps[-1][2].dtype))) if steps else None
    for i in range(len(steps) - 1, -1, -1):
        layer, xs, _ = steps[i]
        y, dxs, by_path = layer_vjp(layer, xs, g, _call)
        names = {v.path: k for k, v in layer_variables(layer).items() if k != "mask"}
        pgrads = {names[p]: to_numpy(d) for p, d in by_path.items() if p in names}
        if layer_kind(layer) == "einsum":
            pgrads = einsum_canonical_grads(layer, pgrads)
        elif "kernel" in pgrads and stored_transposed(layer):
            pgrads["kernel"] = pgrads["kernel"].T
        records[i] = LayerTrace(to_numpy(y), tuple(to_numpy(d) for d in dxs), pgrads)
        g = dxs[0]
    return Trace(records)


def run_layer(layer, x: np.ndarray, grad_out: np.ndarray | None):
    """One call of ``layer`` alone on ``x`` (its native input shape and dtype), and the engine's
    autograd backward from ``grad_out`` (dL/d(output)): ``(output, dL/dx, canonical parameter
    gradients)`` as numpy; ``grad_out`` None: forward only (``(output, None, {})``).

    The output is what ``capture`` records: a layer applying an activation inside itself
    (``Dense(activation=...)``) runs its linear map alone, and ``grad_out`` is dL/d(linear map).
    """
    from ._capture import canonical_grads as _canonical_grads

    act = getattr(layer, "activation", None)
    inside = act is not None and act is not keras.activations.linear
    if inside:
        layer.activation = keras.activations.linear
    try:
        xt = to_tensor(np.asarray(x), str(keras.backend.standardize_dtype(np.asarray(x).dtype)))
        if grad_out is None:
            y = layer(xt, training=False)
            return np.array(to_numpy(y), copy=True), None, {}
        y, dxs, by_path = layer_vjp(layer, [xt], to_tensor(np.asarray(grad_out)))  # in the output's dtype
    finally:
        if inside:
            layer.activation = act
    by_var = [(v, by_path[v.path]) for v in layer.trainable_variables if v.path in by_path]
    pgrads = _canonical_grads(layer, by_var) if by_var else {}
    return np.array(to_numpy(y), copy=True), np.array(to_numpy(dxs[0]), copy=True), pgrads
