"""Conversion between every ordered pair of backends: exact parameters, equivalent models."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dense_bridge as db

from conftest import require_backend

FRAMEWORKS = ("torch", "keras", "mlx")
PAIRS = list(itertools.permutations(FRAMEWORKS + ("numpy",), 2))

SEED_MLPS = {
    # seed 003's MLPs: 784 -> 128 -> 10 and 784 -> 128 -> 64 -> 10, relu hidden, softmax out
    "784-128-10": db.Sequential([db.Dense(128, in_features=784, activation="relu"),
                                 db.Dense(10, activation="softmax")]),
    "784-128-64-10": db.Sequential([db.Dense(128, in_features=784, activation="relu"),
                                    db.Dense(64, activation="relu"), db.Dense(10, activation="softmax")]),
}


def _bits(params):
    return {k: np.ascontiguousarray(np.asarray(v)).tobytes() for k, v in params.items()}


def _pair(src, dst):
    require_backend(src)
    require_backend(dst)


@pytest.mark.parametrize("src,dst", PAIRS)
@pytest.mark.parametrize("name", sorted(SEED_MLPS))
def test_seed_mlps_convert_exactly_and_equivalently(src, dst, name):
    _pair(src, dst)
    spec = SEED_MLPS[name]
    a = db.compile(spec, src, seed=3)
    b = db.convert(a, to=dst)
    assert db.to_spec(b) == spec
    assert _bits(db.get_params(b)) == _bits(db.get_params(a))
    db.testing.assert_equivalent(a, b)


@pytest.mark.parametrize("src,dst", PAIRS)
def test_square_layer_is_transposed_by_layout_not_shape(src, dst):
    _pair(src, dst)
    kernel = np.arange(16, dtype=np.float32).reshape(4, 4)  # asymmetric: a wrong transpose shows
    a = db.compile(db.Dense(4, in_features=4), src, params={"kernel": kernel, "bias": np.zeros(4, np.float32)})
    b = db.convert(a, to=dst)
    np.testing.assert_array_equal(np.asarray(db.get_params(b)["kernel"]), kernel)
    x = np.eye(4, dtype=np.float32)[:1]  # e_0 @ kernel = kernel's first row
    out = db.compile(db.Dense(4, in_features=4), "numpy", params=db.get_params(b)).forward(x)
    np.testing.assert_array_equal(out[0], kernel[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_through_all_frameworks_is_bit_identical(dtype):
    for f in FRAMEWORKS:
        require_backend(f)
    spec = db.Sequential([db.Dense(12, in_features=6, activation="gelu", dtype=dtype,
                                   mask=db.wiring.random(6, 12, 0.5, 1)),
                          db.Activation("leaky_relu", negative_slope=0.2), db.Dense(5, dtype=dtype)])
    start = db.compile(spec, "torch", seed=5)
    reference = _bits(db.get_params(start))
    current = start
    for target in ("keras", "mlx", "torch", "mlx", "keras", "torch"):
        current = db.convert(current, to=target)
        got = db.get_params(current)
        assert {k: np.asarray(v).dtype.name for k, v in got.items()} == \
            {k: np.asarray(v).dtype.name for k, v in db.get_params(start).items()}
        assert _bits(got) == reference, target
    assert db.to_spec(current) == spec


@st.composite
def sequentials(draw):
    widths = draw(st.lists(st.integers(1, 12), min_size=2, max_size=4))
    layers = []
    for i, units in enumerate(widths[1:]):
        square = draw(st.booleans())
        units = widths[i] if square else units
        widths[i + 1] = units
        layers.append(db.Dense(units, activation=draw(st.sampled_from(["relu", "tanh", "gelu", "linear", "silu"])),
                               use_bias=draw(st.booleans()), bias_init="normal"))
    return db.Sequential(layers, in_features=widths[0])


@given(spec=sequentials(), pair=st.sampled_from([p for p in PAIRS if "numpy" not in p]),
       seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_sequentials_convert_exactly(spec, pair, seed):
    src, dst = pair
    if src not in db.available_backends() or dst not in db.available_backends():
        pytest.skip("framework missing")
    a = db.compile(spec, src, seed=seed)
    b = db.convert(a, to=dst)
    assert _bits(db.get_params(b)) == _bits(db.get_params(a))
    db.testing.assert_equivalent(a, b, seed=seed)
    back = db.convert(b, to=src)
    assert _bits(db.get_params(back)) == _bits(db.get_params(a))


# ------------------------------------------------------------------ trained models
def _train_torch(model, x, y, steps=5):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()


def _train_keras(model, x, y, steps=5):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=steps, verbose=0)


def _train_mlx(model, x, y, steps=5):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    opt = optim.SGD(learning_rate=0.1, momentum=0.9)
    step = nn.value_and_grad(model, lambda m, a, b: mx.mean(mx.square(m(a) - b)))
    xa, ya = mx.array(x), mx.array(y)
    for _ in range(steps):
        _, grads = step(model, xa, ya)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)


TRAIN = {"torch": _train_torch, "keras": _train_keras, "mlx": _train_mlx}


@pytest.mark.parametrize("src", FRAMEWORKS)
def test_trained_model_ports_to_the_other_frameworks(src):
    require_backend(src)
    spec = db.Sequential([db.Dense(16, in_features=8, activation="tanh",
                                   mask=db.wiring.banded(8, 16, 3)), db.Dense(4)])
    model = db.compile(spec, src, seed=1)
    before = _bits(db.get_params(model))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)
    TRAIN[src](model, x, y)
    trained = db.get_params(model)
    assert _bits(trained) != before  # it really trained
    assert (np.asarray(trained["0.kernel"])[~spec.layers[0].mask.adjacency] == 0).all()
    for dst in FRAMEWORKS:
        if dst == src or dst not in db.available_backends():
            continue
        port = db.convert(model, to=dst)
        assert _bits(db.get_params(port)) == _bits(trained)
        db.testing.assert_equivalent(model, port, inputs=x)
