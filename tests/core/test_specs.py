"""Specs: validation, JSON round trips, value equality, num_params and flops."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dense_bridge as db
from dense_bridge import activations, initializers


def roundtrip(spec):
    return db.from_config(json.loads(json.dumps(spec.to_config())))


def test_dense_defaults_and_fields():
    d = db.Dense(4, in_features=3)
    assert (d.units, d.in_features, d.use_bias, d.dtype) == (4, 3, True, "float32")
    assert d.activation == db.Activation("linear") == db.Dense(4, activation="linear").activation
    assert d.kernel_init == db.Init("glorot_uniform") and d.bias_init == db.Init("zeros")
    assert d.num_params == 3 * 4 + 4
    assert db.Dense(4, in_features=3, use_bias=False).num_params == 12


def test_bare_leaky_relu_means_slope_001():
    assert db.Dense(2, activation="leaky_relu").activation.params["negative_slope"] == 0.01


def test_specs_are_immutable_and_hashable():
    d = db.Dense(4, in_features=3)
    with pytest.raises(AttributeError):
        d.units = 5
    assert hash(d) == hash(db.Dense(4, in_features=3))
    assert d != db.Dense(4, in_features=2)
    assert d.replace(units=5).units == 5 and d.units == 4


def test_flops_counts_multiply_adds_bias_and_activation():
    d = db.Dense(10, in_features=20)
    assert d.flops(3) == 2 * 3 * 20 * 10 + 3 * 10
    assert db.Dense(10, in_features=20, activation="relu").flops(3) > d.flops(3)
    b = db.Bilinear(3, 4, 5)
    assert b.num_params == 5 * 3 * 4 + 5  # seed 002's formula out*in1*in2 + out
    assert b.flops(2) > 0


def test_sequential_fills_in_features_and_keys():
    s = db.Sequential([db.Dense(8, in_features=4), db.Activation("relu"), db.Dense(3)])
    assert [getattr(l, "in_features", None) for l in s.layers] == [4, None, 8]
    assert list(s.param_shapes()) == ["0.kernel", "0.bias", "2.kernel", "2.bias"]
    assert s.num_params == 4 * 8 + 8 + 8 * 3 + 3
    assert s.flops(2) == sum(l.flops(2) if not isinstance(l, db.Activation) else l.flops(2, 8) for l in s.layers)
    assert roundtrip(s) == s


def test_sequential_in_features_given_on_container():
    s = db.Sequential([db.Dense(8), db.Dense(2)], in_features=5)
    assert s.layers[0].in_features == 5 and s.in_features == 5 and not s.lazy


def test_lazy_sequential():
    s = db.Sequential([db.Dense(8), db.Dense(2)])
    assert s.lazy and s.layers[1].in_features == 8
    with pytest.raises(db.SpecError, match="lazy"):
        s.num_params


def test_identity_and_bilinear_roundtrip():
    assert roundtrip(db.Identity()) == db.Identity()
    b = db.Bilinear(3, 4, 5, use_bias=False, init="glorot_uniform", dtype="bfloat16", name="bil")
    assert roundtrip(b) == b


def test_from_config_accepts_json_string():
    d = db.Dense(3, in_features=2, activation=db.Activation("elu", alpha=0.5))
    assert db.from_config(json.dumps(d.to_config())) == d


def test_mask_roundtrip_is_explicit_adjacency():
    w = db.wiring.random(16, 8, 0.25, seed=3)
    d = db.Dense(8, mask=w)
    assert d.in_features == 16  # taken from the mask
    cfg = d.to_config()
    assert "seed" not in json.dumps(cfg["config"]["mask"])
    back = roundtrip(d)
    assert back == d and np.array_equal(back.mask.adjacency, w.adjacency)


# ------------------------------------------------------------------ property-based
dense_specs = st.builds(
    lambda units, fan, bias, act, kinit, binit, dtype, masked, seed: db.Dense(
        units, in_features=fan, use_bias=bias, activation=act, kernel_init=kinit, bias_init=binit,
        dtype=dtype, mask=db.wiring.random(fan, units, 0.5, seed) if masked else None),
    st.integers(1, 12), st.integers(1, 12), st.booleans(), st.sampled_from(activations.NAMES),
    st.sampled_from(initializers.NAMES), st.sampled_from(initializers.NAMES),
    st.sampled_from(["float32", "float64", "float16", "bfloat16"]), st.booleans(), st.integers(0, 2**31),
)


@given(st.lists(dense_specs, min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_random_sequential_config_roundtrip(layers):
    # chain widths so the Sequential is valid: each layer's in_features = previous units
    fixed, width = [], None
    for layer in layers:
        layer = layer.replace(dtype=layers[0].dtype)  # a Sequential has one dtype
        if width is not None and layer.mask is None:
            layer = layer.replace(in_features=width)
        elif width is not None:
            layer = layer.replace(in_features=width, mask=db.wiring.random(width, layer.units, 0.5, 1))
        fixed.append(layer)
        width = layer.units
    s = db.Sequential(fixed)
    back = roundtrip(s)
    assert back == s and hash(back) == hash(s)
    assert back.to_config() == s.to_config()
    for a, b in zip(back.layers, s.layers):
        if a.mask is not None:
            assert np.array_equal(a.mask.adjacency, b.mask.adjacency)
