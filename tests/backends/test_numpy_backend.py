"""The numpy reference: backward against central finite differences in float64."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.activations import NAMES


def _loss(layer, x, g):
    return float(np.sum(layer.forward(x) * g))


def _fd_check(layer, x, g, params: dict, h=1e-6):
    """max relative error of backward vs central differences for dL/dx and every parameter."""
    layer.forward(x)
    dx = layer.backward(g)
    grads = layer.grads
    worst = 0.0
    targets = [("x", x, dx)] + [(k, params[k], grads[k]) for k in grads]
    for name, arr, analytic in targets:
        fd = np.zeros_like(arr)
        it = np.nditer(arr, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            old = arr[i]
            arr[i] = old + h
            up = _loss(layer, x, g)
            arr[i] = old - h
            down = _loss(layer, x, g)
            arr[i] = old
            fd[i] = (up - down) / (2 * h)
        if name == "kernel" and getattr(layer, "mask", None) is not None:
            fd = fd * layer.mask  # the reference's contract: masked weights get no gradient
        scale = max(1e-12, np.abs(fd).max())
        worst = max(worst, np.abs(fd - analytic).max() / scale)
    return worst


@pytest.mark.parametrize("activation", NAMES)
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_backward_matches_finite_differences(activation, use_bias, masked, rank):
    rng = np.random.default_rng(hash((activation, use_bias, masked, rank)) % 2**32)
    fan_in, units = 5, 4
    mask = db.wiring.random(fan_in, units, 0.5, seed=1) if masked else None
    spec = db.Dense(units, in_features=fan_in, use_bias=use_bias, activation=activation, mask=mask,
                    dtype="float64", bias_init="normal")
    layer = db.compile(spec, "numpy", seed=0)
    shape = {1: (fan_in,), 2: (3, fan_in), 3: (2, 3, fan_in)}[rank]
    x = rng.normal(size=shape)
    g = rng.normal(size=shape[:-1] + (units,))
    params = {"kernel": layer.kernel}
    if use_bias:
        params["bias"] = layer.bias
    assert _fd_check(layer, x, g, params) < 1e-6


def test_bilinear_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    layer = db.compile(db.Bilinear(3, 5, 4, dtype="float64"), "numpy", seed=1)
    x1, x2, g = rng.normal(size=(6, 3)), rng.normal(size=(6, 5)), rng.normal(size=(6, 4))

    def loss():
        return float(np.sum(layer.forward(x1, x2) * g))

    layer.forward(x1, x2)
    dx1, dx2 = layer.backward(g)
    analytic = {"x1": dx1, "x2": dx2, **layer.grads}
    arrays = {"x1": x1, "x2": x2, "kernel": layer.kernel, "bias": layer.bias}
    for name, arr in arrays.items():
        fd = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + 1e-6
            up = loss()
            arr[i] = old - 1e-6
            down = loss()
            arr[i] = old
            fd[i] = (up - down) / 2e-6
        assert np.abs(fd - analytic[name]).max() / np.abs(fd).max() < 1e-6, name


def test_sequential_chains_and_keys():
    spec = db.Sequential([db.Dense(6, in_features=4, activation="tanh"), db.Identity(),
                          db.Activation("gelu"), db.Dense(3)])
    model = db.compile(spec, "numpy", seed=2)
    x = np.random.default_rng(0).normal(size=(5, 4))
    y = model.forward(x)
    dx = model.backward(np.ones_like(y))
    assert y.shape == (5, 3) and dx.shape == (5, 4)
    assert sorted(model.grads) == ["0.bias", "0.kernel", "3.bias", "3.kernel"]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_forward_returns_layer_dtype(dtype):
    layer = db.compile(db.Dense(3, in_features=2, dtype=dtype), "numpy", seed=0)
    y = layer.forward(np.ones((4, 2), np.float32))
    assert y.dtype.name == dtype
    assert layer.backward(np.ones_like(y)).dtype.name == dtype


def test_float32_reference_close_to_float64():
    spec32 = db.Dense(16, in_features=64, activation="silu")
    x = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    p = db.get_params(db.compile(spec32, "numpy", seed=1))
    y32 = db.compile(spec32, "numpy", params=p).forward(x)
    spec64 = spec32.replace(dtype="float64")
    y64 = db.compile(spec64, "numpy", params={k: v.astype(np.float64) for k, v in p.items()}).forward(x)
    assert np.abs(y32 - y64).max() < 1e-5


def test_lazy_numpy_layer_builds_on_first_input_with_eager_params():
    eager = db.compile(db.Dense(3, in_features=5), "numpy", seed=4)
    lazy = db.compile(db.Dense(3), "numpy", seed=4)
    lazy.forward(np.ones((2, 5), np.float32))
    assert np.array_equal(lazy.kernel, eager.kernel)
    with pytest.raises(db.SpecError, match="in_features=5"):
        lazy.forward(np.ones((2, 6), np.float32))


def test_backward_before_forward_is_an_error():
    with pytest.raises(RuntimeError, match="before forward"):
        db.compile(db.Dense(2, in_features=2), "numpy").backward(np.ones(2))
