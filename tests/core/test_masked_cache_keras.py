"""The Keras masked-kernel cache: kernel * mask reused in inference, never stale.

Keras variables carry no change counter on TensorFlow, so there the product is reused only inside
``db.inference(model)``; on JAX (immutable arrays) and torch (version counters) the layer also
sees changes by itself and caches outside the scope. Every test compares with the product
computed afresh in numpy. tests/backends/test_keras_backends.py runs this module on every Keras engine.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend

SPEC = db.Dense(6, in_features=5, mask=db.wiring.random(5, 6, 0.5, seed=1), activation="tanh")
X = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)


@pytest.fixture
def keras_layer():
    require_backend("keras")
    return db.compile(SPEC, "keras", seed=0)


def _fresh(layer) -> np.ndarray:
    """tanh(x @ (kernel * mask) + bias) from the variables as they are now, in float64."""
    from dense_bridge.backends.keras import to_numpy

    k, m, b = (to_numpy(v.value).astype(np.float64) for v in (layer.kernel, layer.mask, layer.bias))
    return np.tanh(X.astype(np.float64) @ (k * m) + b)


def _out(layer, **kwargs) -> np.ndarray:
    """The layer's output as inference computes it (on the torch engine with autograd off, as
    ``predict`` runs: with autograd on the product is always computed afresh)."""
    import contextlib

    import keras

    from dense_bridge.backends.keras import to_numpy

    scope = contextlib.nullcontext()
    if keras.backend.backend() == "torch":
        import torch

        scope = torch.no_grad()
    with scope:
        return to_numpy(layer(X, **kwargs)).astype(np.float64)


def _new_kernel(layer, scale: float):
    from dense_bridge.backends.keras import to_numpy

    return (to_numpy(layer.kernel.value) * scale).astype(np.float32)


def test_keras_inference_scope_reuses_the_product_and_sees_dense_bridge_writes(keras_layer):
    with db.inference(keras_layer) as same:
        assert same is keras_layer
        first = _out(keras_layer)
        cached = keras_layer._masked_cache
        assert cached is not None
        np.testing.assert_allclose(_out(keras_layer), first, rtol=0, atol=0)
        assert keras_layer._masked_cache[2] is cached[2]  # the product itself was reused
        params = {k: np.array(v) for k, v in db.get_params(keras_layer).items()}
        params["kernel"] = params["kernel"] * 3
        db.set_params(keras_layer, params)
        np.testing.assert_allclose(_out(keras_layer), _fresh(keras_layer), rtol=1e-6, atol=1e-6)
        assert not np.allclose(_out(keras_layer), first)
    assert keras_layer._masked_cache is None and not keras_layer._inference


def test_keras_training_calls_never_use_the_cache(keras_layer):
    with db.inference(keras_layer):
        _out(keras_layer)
        keras_layer.kernel.assign(_new_kernel(keras_layer, -2.0))  # a write the scope does not see...
        # ...but a training call computes the product afresh all the same
        np.testing.assert_allclose(_out(keras_layer, training=True), _fresh(keras_layer), rtol=1e-6, atol=1e-6)


def test_keras_assign_outside_the_scope_is_never_stale(keras_layer):
    for scale in (2.0, -0.5, 3.0):
        _out(keras_layer)
        keras_layer.kernel.assign(_new_kernel(keras_layer, scale))
        np.testing.assert_allclose(_out(keras_layer), _fresh(keras_layer), rtol=1e-6, atol=1e-6)
    keras_layer.mask.assign(np.ones((5, 6), np.float32))
    np.testing.assert_allclose(_out(keras_layer), _fresh(keras_layer), rtol=1e-6, atol=1e-6)


def test_keras_fit_between_inference_calls_is_seen(tmp_path):
    require_backend("keras")
    import keras

    spec = db.Sequential([db.Dense(6, in_features=5, mask=db.wiring.random(5, 6, 0.5, seed=1), activation="tanh"),
                          db.Dense(2)])
    model = db.compile(spec, "keras", seed=0)
    layer = model.layers[0]
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    y = np.ones((3, 2), np.float32)
    before = _out(layer)
    model.fit(X, y, epochs=2, verbose=0)
    after = _out(layer)
    assert not np.allclose(after, before)  # the step changed the kernel...
    np.testing.assert_allclose(after, _fresh(layer), rtol=1e-6, atol=1e-6)  # ...and the call saw it
    # the masked entries stayed exactly 0 through training (the mask is in the forward pass)
    kernel = np.asarray(db.get_params(model)["0.kernel"])
    assert np.all(kernel[np.asarray(db.get_params(model)["0.mask"]) == 0] == 0)
    # load_weights inside the scope drops the cache
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    with db.inference(model):
        _out(layer)
        layer.kernel.assign(_new_kernel(layer, 5.0))
        model.load_weights(path)
        np.testing.assert_allclose(_out(layer), after, rtol=1e-6, atol=1e-6)


def test_keras_predict_traced_inside_the_scope_is_not_reused_after_it(keras_layer):
    require_backend("keras")
    import keras

    model = keras.Sequential([keras.Input((5,)), keras_layer])
    with db.inference(model):
        inside = model.predict(X, verbose=0)
    keras_layer.kernel.assign(_new_kernel(keras_layer, -1.0))
    after = model.predict(X, verbose=0)
    np.testing.assert_allclose(after, _fresh(keras_layer), rtol=1e-5, atol=1e-6)
    assert not np.allclose(after, inside)


def test_inference_scope_is_a_no_op_for_other_backends():
    require_backend("torch")
    layer = db.compile(SPEC, "torch", seed=0)
    with db.inference(layer) as same:
        assert same is layer


def test_keras_gradients_after_inference_calls_reach_the_kernel(keras_layer):
    """A cached product must never stand in for kernel * mask where a gradient is taken (on the
    torch engine it would also share one autograd graph between two backward passes)."""
    from dense_bridge.backends.keras import trace

    g = np.random.default_rng(1).standard_normal((3, 6))
    _out(keras_layer)
    _out(keras_layer)  # cached now, where the engine caches outside db.inference
    for _ in range(2):  # twice: a graph reused from the first pass would fail the second
        traced = trace(keras_layer, [X], g.astype(np.float32)).layers[-1]
        from dense_bridge.backends.keras import to_numpy

        k, m, b = (to_numpy(v.value).astype(np.float64) for v in (keras_layer.kernel, keras_layer.mask,
                                                                   keras_layer.bias))
        y = np.tanh(X.astype(np.float64) @ (k * m) + b)
        want = X.astype(np.float64).T @ (g * (1 - y * y)) * m
        np.testing.assert_allclose(np.asarray(traced.param_grads["kernel"], np.float64), want, rtol=1e-4, atol=1e-5)
