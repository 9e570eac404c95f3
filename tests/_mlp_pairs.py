"""A three-layer MLP with activations inside its layers, compiled in two backends (the same seed),
and its inputs: the pair the equivalence tests judge across frameworks."""
from __future__ import annotations

import numpy as np

import dense_bridge as db


def activated_mlp_pair(pair: tuple[str, str]):
    """``(a, b, inputs)``: gelu, tanh and linear layers (6 -> 16 -> 8 -> 4) compiled by the backends
    ``pair`` (each skipped where not installed), and one (5, 6) float64 batch."""
    from conftest import require_backend

    for name in pair:
        require_backend(name)
    spec = db.Sequential([db.Dense(16, activation="gelu"), db.Dense(8, activation="tanh"), db.Dense(4)],
                         in_features=6)
    a, b = (db.compile(spec, name, seed=0) for name in pair)
    return a, b, [np.random.default_rng(0).standard_normal((5, 6))]
