"""The ``trace`` verb: the reference forward and hand-derived backward, layer by layer."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dense_bridge._trace import LayerTrace, Trace

from ._layers import sublayers


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
