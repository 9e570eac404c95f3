"""The adapters' ``capture`` verb: per-call inputs, outputs and gradients inside a whole model.

One small model per framework, written as users write them (not a chain: a layer called twice,
an embedding fed integer token ids, keyword inputs), checked against numpy: every call in
execution order, dL/d(output) per call, parameter gradients summed over calls in the canonical
layout, and the layers restored afterwards, also when the forward pass raises.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import require_backend

VOCAB, WIDTH, UNITS = 11, 6, 5


def _cot(shape):
    return np.random.default_rng(7).standard_normal(shape)


def _torch_model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, WIDTH)
            self.shared = torch.nn.Linear(WIDTH, WIDTH)
            self.head = torch.nn.Linear(WIDTH, UNITS)
            self.boom = False

        def forward(self, ids, scale):
            if self.boom:
                raise RuntimeError("boom")
            h = self.embed(ids)
            h = torch.tanh(self.shared(h)) * scale
            return {"logits": self.head(self.shared(h)), "ids": ids}

    torch.manual_seed(0)
    m = Net()
    return m, {"shared": m.shared, "head": m.head}


def _keras_model():
    import keras

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.embed = keras.layers.Embedding(VOCAB, WIDTH)
            self.shared = keras.layers.Dense(WIDTH, bias_initializer="random_normal")
            self.head = keras.layers.Dense(UNITS, bias_initializer="random_normal")
            self.boom = False

        def call(self, ids, scale):
            if self.boom:
                raise RuntimeError("boom")
            h = self.embed(ids)
            h = keras.ops.tanh(self.shared(h)) * scale
            return {"logits": self.head(self.shared(h)), "ids": ids}

    keras.utils.set_random_seed(0)
    m = Net()
    m(np.zeros((1, 2), dtype="int32"), np.ones((1, 2, 1), dtype="float32"))
    return m, {"shared": m.shared, "head": m.head}


def _mlx_model():
    import mlx.core as mx
    import mlx.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.shared = nn.Linear(WIDTH, WIDTH)
            self.head = nn.Linear(WIDTH, UNITS)
            self.boom = False

        def __call__(self, ids, scale):
            if self.boom:
                raise RuntimeError("boom")
            h = self.embed(ids)
            h = mx.tanh(self.shared(h)) * scale
            return {"logits": self.head(self.shared(h)), "ids": ids}

    mx.random.seed(0)
    m = Net()
    return m, {"shared": m.shared, "head": m.head}


MODELS = {"torch": _torch_model, "keras": _keras_model, "mlx": _mlx_model}


def _restored(backend, layers) -> bool:
    if backend == "torch":
        return all(not layer._forward_hooks for layer in layers.values())
    if backend == "keras":
        return all("call" not in vars(layer) for layer in layers.values())
    import mlx.nn as nn

    return all(type(layer) is nn.Linear for layer in layers.values())


@pytest.mark.parametrize("backend", sorted(MODELS))
def test_capture_calls_grads_and_restore(backend):
    adapter = require_backend(backend)
    import dense_bridge as db

    model, layers = MODELS[backend]()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (2, 3))
    scale = rng.standard_normal((2, 3, 1))
    cap = adapter.capture(model, {"ids": ids, "scale": scale}, layers, cotangent=_cot)
    assert _restored(backend, layers)
    # execution order, call by call: shared twice, then head
    assert [(c.path, c.call) for c in cap.calls] == [("shared", 0), ("shared", 1), ("head", 0)]
    params = {p: db.get_params(layer) for p, layer in layers.items()}
    for c in cap.calls:
        x = c.inputs[0].astype(np.float64)
        want = x @ params[c.path]["kernel"] + params[c.path]["bias"]
        np.testing.assert_allclose(c.output, want, rtol=1e-5, atol=1e-5)
    # the backward starts from the first floating output (the "logits" value) with the cotangent
    np.testing.assert_array_equal(cap.output, cap.calls[-1].output)
    np.testing.assert_allclose(cap.calls[-1].output_grad, _cot(cap.output.shape).astype(np.float32), rtol=1e-6)
    # dL/dy of the first call: through tanh and the scale (the second call feeds the head)
    s0, s1 = cap.calls[0], cap.calls[1]
    g1 = s1.output_grad.astype(np.float64)
    want = (g1 @ params["shared"]["kernel"].T) * scale * (1 - np.tanh(s0.output.astype(np.float64)) ** 2)
    np.testing.assert_allclose(s0.output_grad, want, rtol=1e-4, atol=1e-5)
    # parameter gradients: canonical, summed over the calls of the layer
    for path in layers:
        calls = [c for c in cap.calls if c.path == path]
        dk = sum(c.inputs[0].reshape(-1, c.inputs[0].shape[-1]).T.astype(np.float64)
                 @ c.output_grad.reshape(-1, c.output_grad.shape[-1]) for c in calls)
        db_ = sum(c.output_grad.reshape(-1, c.output_grad.shape[-1]).sum(0) for c in calls)
        np.testing.assert_allclose(cap.param_grads[path]["kernel"], dk, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(cap.param_grads[path]["bias"], db_, rtol=1e-4, atol=1e-5)
    # the parameters themselves were put back exactly
    for path, layer in layers.items():
        for k, v in db.get_params(layer).items():
            np.testing.assert_array_equal(v, params[path][k])

    # forward only, and a selector naming the output
    cap2 = adapter.capture(model, {"ids": ids, "scale": scale}, layers, cotangent=_cot, select="logits",
                           grads=False)
    assert cap2.calls[0].output_grad is None and not cap2.param_grads
    np.testing.assert_array_equal(cap2.output, cap.output)


@pytest.mark.parametrize("backend", sorted(MODELS))
def test_capture_restores_layers_when_the_model_raises(backend):
    adapter = require_backend(backend)
    model, layers = MODELS[backend]()
    model.boom = True
    with pytest.raises(RuntimeError, match="boom"):
        adapter.capture(model, {"ids": np.zeros((1, 2), dtype=np.int64), "scale": np.ones((1, 2, 1))}, layers,
                        cotangent=_cot)
    assert _restored(backend, layers)


def test_capture_numpy_reference_chain():
    adapter = require_backend("numpy")
    import dense_bridge as db

    spec = db.Sequential([db.Dense(4, activation="tanh"), db.Dense(3)], in_features=5)
    model = db.compile(spec, "numpy", seed=0)
    x = np.random.default_rng(0).standard_normal((2, 5))
    layers = {"0": model.layers[0], "1": model.layers[1]}
    cap = adapter.capture(model, [x], layers, cotangent=_cot)
    assert [c.path for c in cap.calls] == ["0", "1"]
    np.testing.assert_allclose(cap.calls[1].output_grad, _cot((2, 3)))
    np.testing.assert_allclose(cap.param_grads["1"]["kernel"], cap.calls[1].inputs[0].T @ _cot((2, 3)))
    assert "forward" not in vars(model.layers[0])


def test_torch_capture_survives_in_place_ops_on_a_layer_output():
    """``y = lin(x); y += x`` (in place on the layer's output) must not change what was recorded."""
    adapter = require_backend("torch")
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            y += x  # in place on the layer's output
            return y * 2

    torch.manual_seed(0)
    net = Net()
    x = np.random.default_rng(0).standard_normal((2, 3))
    cap = adapter.capture(net, [x], {"lin": net.lin}, cotangent=_cot)
    p = {k: v.astype(np.float64) for k, v in __import__("dense_bridge").get_params(net.lin).items()}
    np.testing.assert_allclose(cap.calls[0].output, x @ p["kernel"] + p["bias"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap.calls[0].output_grad, 2 * _cot((2, 3)), rtol=1e-6)


def test_outputs_in_another_order_are_paired_by_shape_and_said_so():
    require_backend("torch")
    import torch

    import dense_bridge as db

    class TwoHeads(torch.nn.Module):
        def __init__(self, as_dict: bool):
            super().__init__()
            self.body, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)
            self.as_dict = as_dict

        def forward(self, x):
            hidden = torch.tanh(self.body(x))
            pooled = self.head(hidden)
            # like keras-hub's BertBackbone on the torch engine: the same outputs, the small one first
            return {"pooled": pooled, "hidden": hidden} if self.as_dict else (hidden, pooled)

    torch.manual_seed(0)
    a, b = TwoHeads(False), TwoHeads(True)
    b.load_state_dict(a.state_dict())
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    report = db.testing.compare_models(a, b, [x])
    assert report.passed, report
    assert any("compared a's floating output #0 with b's #1, both (2, 4)" in n for n in report.notes), report.notes
    # an explicit choice is taken as given: the two firsts differ in shape and fail
    chosen = db.testing.compare_models(a, b, [x], outputs=(0, "pooled"))
    assert not chosen.passed and "shape (2, 4) vs (2, 3)" in str(chosen)
    # a wrong port still fails after the re-pairing
    with torch.no_grad():
        b.body.weight.mul_(1.5)
    assert db.testing.compare_models(a, b, [x]).first_divergence == "body"
