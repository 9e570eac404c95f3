"""Bilinear, Identity and lazy Dense through every verb, on every backend."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend, require_lazy

BACKENDS = ("numpy", "torch", "keras", "mlx")


@pytest.mark.parametrize("src,dst", list(itertools.permutations(BACKENDS, 2)))
def test_bilinear_converts_exactly_and_equivalently(src, dst):
    require_backend(src), require_backend(dst)
    spec = db.Bilinear(3, 5, 4)  # in1 != in2: a swapped axis cannot pass unnoticed
    a = db.compile(spec, src, seed=2)
    b = db.convert(a, to=dst)
    assert db.to_spec(b) == spec
    for k, v in db.get_params(a).items():
        assert np.asarray(db.get_params(b)[k]).tobytes() == np.ascontiguousarray(v).tobytes()
    rng = np.random.default_rng(0)
    db.testing.assert_equivalent(a, b, inputs=(rng.normal(size=(6, 3)).astype(np.float32),
                                               rng.normal(size=(6, 5)).astype(np.float32)))


def test_bilinear_param_count_matches_seed_formula():
    assert db.Bilinear(3, 5, 4).num_params == 4 * 3 * 5 + 4
    assert db.Bilinear(3, 5, 4, use_bias=False).num_params == 4 * 3 * 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_inside_sequential_everywhere(backend):
    require_backend(backend)
    spec = db.Sequential([db.Identity(), db.Dense(3, in_features=4), db.Identity()])
    model = db.compile(spec, backend, seed=0)
    assert sorted(db.get_params(model)) == ["1.bias", "1.kernel"]
    assert db.to_spec(model) == spec
    reference = db.compile(spec, "numpy", seed=0)
    db.testing.assert_equivalent(model, reference)


@pytest.mark.parametrize("backend", ("torch", "keras", "mlx"))
def test_lazy_dense_builds_to_the_eager_params_and_converts(backend):
    adapter = require_backend(backend)
    require_lazy(backend)
    lazy = db.compile(db.Sequential([db.Dense(6, activation="relu"), db.Dense(2)]), backend, seed=4)
    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    adapter.trace(lazy, [x], np.ones((3, 2), np.float32))
    eager = db.compile(db.Sequential([db.Dense(6, in_features=5, activation="relu"), db.Dense(2)]), "numpy", seed=4)
    got, want = db.get_params(lazy), db.get_params(eager)
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(np.asarray(got[k]), want[k]) for k in want)
    db.testing.assert_equivalent(db.convert(lazy, to="numpy"), eager, inputs=x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbuilt_lazy_layer_says_its_parameters_do_not_exist_yet(backend, tmp_path):
    require_backend(backend)
    require_lazy(backend)
    lazy = db.compile(db.Dense(3), backend, seed=0)
    with pytest.raises(db.DenseBridgeError, match="(?i)first input|lazy|not built|no parameters"):
        db.get_params(lazy)
    with pytest.raises(db.DenseBridgeError, match="(?i)first input|lazy|not built|no parameters"):
        db.save(lazy, tmp_path / "lazy.safetensors")
    assert not (tmp_path / "lazy.safetensors").exists()
