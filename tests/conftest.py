"""Shared fixtures: backend parametrization that skips cleanly where a framework is missing."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dense_bridge as db  # noqa: E402

ALL_BACKENDS = ("numpy", "torch", "keras", "mlx", "flax", "equinox")


def require_backend(name: str):
    """Import the adapter for ``name`` or skip the test with the reason."""
    if name not in db.available_backends():
        pytest.skip(f"framework for backend {name!r} is not installed")
    from dense_bridge.registry._backends import get_adapter

    return get_adapter(name)


def require_lazy(name: str) -> None:
    """Skip a lazy-width test on a backend that refuses lazy widths by design, after checking it does.

    Equinox modules are immutable with shapes fixed when made: compiling a lazy Dense
    raises a SpecError asking for in_features.
    """
    if name in ("equinox", "onnx"):  # immutable shapes (equinox), weights fixed in the graph (onnx)
        with pytest.raises(db.SpecError, match="in_features"):
            db.compile(db.Dense(3), name, seed=0)
        pytest.skip(f"{name} refuses lazy widths with a SpecError (checked)")


@pytest.fixture(params=ALL_BACKENDS)
def backend(request) -> str:
    require_backend(request.param)
    return request.param


#: Points where some activation is not differentiable (relu, relu6, hard_sigmoid, hard_silu).
KINKS = (-3.0, 0.0, 3.0, 6.0)


def away_from_kinks(x, margin: float):
    """A copy of ``x`` with every entry pushed at least ``margin`` away from every kink."""
    import numpy as np

    x = x.copy()
    for k in KINKS:
        near = np.abs(x - k) < margin
        x[near] = k + 2 * margin * np.where(x[near] >= k, 1.0, -1.0)
    return x
