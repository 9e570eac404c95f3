"""Initializers: seeded determinism, distribution statistics, framework-default bounds."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dense_bridge as db
from dense_bridge.params._source import initial_layer_params
from dense_bridge.initializers import NAMES, Init

RANDOM = [n for n in NAMES if n not in ("zeros", "ones", "constant")]


@given(name=st.sampled_from(RANDOM), fan_in=st.integers(40, 200), fan_out=st.integers(40, 200),
       seed=st.integers(0, 2**32 - 1))
@settings(max_examples=80, deadline=None)
def test_sample_mean_and_std_within_sampling_error(name, fan_in, fan_out, seed):
    init = Init(name)
    x = init.sample((fan_in, fan_out), fan_in, fan_out, np.random.default_rng(seed))
    mean, std = init.moments(fan_in, fan_out)
    n = x.size
    # 6-sigma bounds on the sample mean and on the sample std (std of s ~ sigma/sqrt(2n), with a
    # kurtosis margin for uniform and truncated shapes); orthogonal entries are close to iid too
    assert abs(x.mean() - mean) <= 6 * std / math.sqrt(n) + 1e-12
    assert abs(x.std() - std) <= 6 * std * math.sqrt(2.0 / n) + 1e-12


@pytest.mark.parametrize("name", ["torch_default", "mlx_default"])
def test_framework_defaults_are_uniform_inv_sqrt_fan_in(name):
    x = Init(name).sample((1000, 64), 1000, 64, np.random.default_rng(0))
    bound = 1 / math.sqrt(1000)
    assert x.max() <= bound and x.min() >= -bound and x.max() > 0.99 * bound


@pytest.mark.parametrize("shape", [(8, 8), (16, 4), (4, 16)])
def test_orthogonal_is_orthogonal(shape):
    q = Init("orthogonal", gain=2.0).sample(shape, shape[0], shape[1], np.random.default_rng(1))
    small = min(shape)
    gram = q.T @ q if shape[0] >= shape[1] else q @ q.T
    np.testing.assert_allclose(gram, 4.0 * np.eye(small), atol=1e-12)


def test_truncated_normal_is_within_two_std():
    x = Init("truncated_normal", stddev=0.5).sample((100_000,), 1, 1, np.random.default_rng(0))
    assert np.abs(x).max() <= 1.0


def test_same_seed_same_bits_and_dtypes():
    spec = db.Dense(32, in_features=16, kernel_init="he_normal", bias_init="torch_default", dtype="bfloat16")
    a, b = initial_layer_params(spec, 7), initial_layer_params(spec, 7)
    assert a["kernel"].dtype.name == "bfloat16"
    assert all(np.array_equal(a[k].view(np.uint16), b[k].view(np.uint16)) for k in a)
    c = initial_layer_params(spec, 8)
    assert not np.array_equal(a["kernel"].view(np.uint16), c["kernel"].view(np.uint16))


def test_masked_kernel_starts_exactly_zero():
    w = db.wiring.block_diagonal(8, 8, 2)
    p = initial_layer_params(db.Dense(8, mask=w, kernel_init="ones"), 0)
    assert np.array_equal(p["kernel"] != 0, w.adjacency) and np.array_equal(p["mask"], w.as_array())


def test_lone_dense_draws_what_position_zero_draws():
    d = db.Dense(5, in_features=3)
    s = db.Sequential([d, db.Dense(2)])
    assert np.array_equal(db.get_params(db.compile(d, "numpy", seed=3))["kernel"],
                          db.get_params(db.compile(s, "numpy", seed=3))["0.kernel"])


def test_init_config_roundtrip_and_params():
    i = Init("normal", mean=1, stddev=2)
    assert i.params == {"mean": 1.0, "stddev": 2.0}
    assert Init.from_config(i.to_config()) == i
    assert Init("xavier_uniform") == Init("glorot_uniform")
