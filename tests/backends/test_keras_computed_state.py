"""Keras state a layer computes from its configuration (a rotary embedding's ``inv_freq``, made by
``add_weight(trainable=False)``) is no parameter to pair: a strict transfer asks no counterpart for it
and leaves it as the layer made it, and still names a frozen layer (``trainable = False`` after it
was built) that has no counterpart."""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")

import dense_bridge as db  # noqa: E402

FREQ = (1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)).repeat(2).astype(np.float32)  # (16,)


class _Frequencies(keras.layers.Layer):
    """Scales its input by frequencies it computes from its configuration (the way keras-hub's
    rotary embeddings hold ``inv_freq``)."""

    def __init__(self, width, **kw):
        super().__init__(**kw)
        base = (1.0 / 10000.0 ** (np.arange(0, width, 2) / width)).repeat(2).astype(np.float32)
        self.inv_freq = self.add_weight(name="inv_freq", shape=(width,), trainable=False,
                                        initializer=keras.initializers.Constant(base))

    def call(self, x):
        return x * self.inv_freq


def _keras_model(extra_frozen=False):
    x = keras.Input((8,))
    h = keras.layers.Dense(16, name="fc1")(x)
    h = _Frequencies(16, name="freq")(h)
    if extra_frozen:
        frozen = keras.layers.Dense(16, name="frozen")
        h = frozen(h)
        frozen.trainable = False
    y = keras.layers.Dense(4, name="fc2")(h)
    return keras.Model(x, y)


class _Torch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.register_buffer("freq", torch.from_numpy(FREQ), persistent=False)

    def forward(self, x):
        return self.fc2(self.fc1(x) * self.freq)


def test_computed_state_is_not_asked_for_and_kept():
    torch.manual_seed(0)
    src, dst = _Torch().eval(), _keras_model()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    db.transfer(src, dst, mapping="auto", inputs=x)  # strict: every parameter of dst written
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(dst.get_layer("freq").inv_freq), FREQ)
    with torch.no_grad():
        want = src(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(dst(x)), want, rtol=1e-5, atol=1e-6)


def test_a_frozen_layer_without_counterpart_is_still_named():
    src, dst = _Torch().eval(), _keras_model(extra_frozen=True)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    before = [keras.ops.convert_to_numpy(v) for v in dst.weights]
    with pytest.raises(db.DenseBridgeError, match="frozen"):
        db.transfer(src, dst, mapping="auto", inputs=x)
    assert all(np.array_equal(a, keras.ops.convert_to_numpy(v)) for a, v in zip(before, dst.weights))  # nothing changed
