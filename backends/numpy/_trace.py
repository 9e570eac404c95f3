"""The ``trace`` verb (the reference forward and hand-derived backward, layer by layer) and
``train_sgd`` (the demo's training loop on that backward)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dense_bridge.adapter_kit import LayerTrace, Trace

from ._layers import sublayers
from ._params import get_params, set_params


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Forward and reference backward of every layer for L = sum(y * grad_out)."""
    layers = sublayers(native)
    outputs, x = [], list(inputs)
    for layer in layers:
        y = layer.forward(*x)
        outputs.append(y)
        x = [y]
    records: list[LayerTrace] = [None] * len(layers)  # type: ignore[list-item]
    g = grad_out
    for i in range(len(layers) - 1, -1, -1):
        dx = layers[i].backward(g)
        dxs = tuple(dx) if isinstance(dx, tuple) else (dx,)
        records[i] = LayerTrace(outputs[i], dxs, layers[i].grads)
        g = dxs[0]
    return Trace(records)


def train_sgd(native, inputs: np.ndarray, labels: np.ndarray, *, steps: int,
              lr: float) -> tuple[np.ndarray, np.ndarray]:
    """Plain SGD on the reference backward for L = mean(-log p[label]), p = native(inputs).

    dL/dp = -onehot / p / N. inputs (N, in_features), labels (N,) integers. Returns the output
    probabilities (N, classes) before the first step and after the last.
    """
    labels = np.asarray(labels)
    before = np.array(native.forward(inputs))
    probs = before
    for _ in range(steps):
        onehot = np.eye(probs.shape[-1], dtype=probs.dtype)[labels]
        native.backward(-onehot / np.clip(probs, 1e-12, None) / len(labels))
        grads = native.grads
        set_params(native, {k: v - lr * grads[k] for k, v in get_params(native).items()})
        probs = native.forward(inputs)
    return before, np.array(probs)


def run_layer(layer, x: np.ndarray, grad_out: np.ndarray | None):
    """One call of the reference ``layer`` alone on ``x`` and its hand-derived backward from
    ``grad_out`` (dL/d(output)): ``(output, dL/dx, canonical parameter gradients)``; ``grad_out``
    None: forward only (``(output, None, {})``). The output is what ``capture`` records."""
    y = np.array(layer.forward(np.asarray(x)), copy=True)
    if grad_out is None:
        return y, None, {}
    dx = layer.backward(np.asarray(grad_out))
    dx = dx[0] if isinstance(dx, tuple) else dx
    return y, np.array(dx, copy=True), {k: np.array(v, copy=True) for k, v in (layer.grads or {}).items()}
