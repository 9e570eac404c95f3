"""The layer surface every reference layer shares, and :class:`ActivationLayer`.

The activation functions themselves (forward and vector-Jacobian product) are the core's
``dense_bridge.activations.Activation``: the reference is where they are defined.
"""
from __future__ import annotations

import numpy as np

from dense_bridge.adapter_kit import StateError
from dense_bridge.activations import Activation

from ._arrays import as_input


class Layer:
    """Common surface: ``forward``, ``backward``, ``__call__``, ``spec``, ``grads``."""

    spec = None

    def __call__(self, *inputs):
        return self.forward(*inputs)

    def _require_forward(self):
        if getattr(self, "_cache", None) is None:
            raise StateError(f"{type(self).__name__}.backward called before forward")

    @property
    def grads(self) -> dict[str, np.ndarray]:
        """Gradients of the parameters from the last backward (canonical names and layout)."""
        return dict(getattr(self, "_grads", {}))


class ActivationLayer(Layer):
    """y = f(x), computed in float64 and returned in x's dtype."""

    def __init__(self, spec: Activation) -> None:
        self.spec = spec
        self._cache = None

    def forward(self, x):
        x = as_input(x)
        y = self.spec.forward(x)
        self._cache = (x, y)
        return y

    def backward(self, grad_out):
        self._require_forward()
        x, y = self._cache
        return self.spec.vjp(x, y, np.asarray(grad_out).astype(x.dtype))

    def params(self) -> dict[str, np.ndarray]:
        return {}
