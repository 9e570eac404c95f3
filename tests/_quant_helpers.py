"""The small float MLP and its 4-bit MLX twin that the quantized comparisons port between."""
from __future__ import annotations

import pytest

IN, OUT = 64, 8


def float_mlp():
    """torch: Linear(IN, IN) -> ReLU -> Linear(IN, OUT), seeded."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, IN), torch.nn.ReLU(), torch.nn.Linear(IN, OUT))


def empty_mlx_quantized_mlp():
    """MLX: QuantizedLinear(IN, IN) -> ReLU -> QuantizedLinear(IN, OUT), 4-bit, group 32, as MLX
    initialises them (the caller moves weights in); paths layers.0 and layers.2."""
    pytest.importorskip("mlx.core")
    import mlx.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.QuantizedLinear(IN, IN, group_size=32, bits=4), nn.ReLU(),
                           nn.QuantizedLinear(IN, OUT, group_size=32, bits=4)]

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return MLP()
