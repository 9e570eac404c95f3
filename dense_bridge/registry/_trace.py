"""What an adapter's ``trace`` returns: per-layer outputs and gradients in canonical layout.

The loss is L = sum(y * grad_out) for the model's final output y, so dL/dy = grad_out.
For a lone layer the list has one entry; for a Sequential, one per position.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class LayerTrace:
    """One layer's forward output and gradients (numpy arrays, the backend's own dtype).

    ``input_grads``: dL/d(input) for each input of the layer (two for Bilinear).
    ``param_grads``: canonical names -> gradients in canonical layout, e.g. "kernel"
    (in_features, units) for Dense, "bias" (units,). Empty for layers without parameters.
    """

    output: np.ndarray
    input_grads: tuple[np.ndarray, ...]
    param_grads: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Trace:
    layers: list[LayerTrace]
