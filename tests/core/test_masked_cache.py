"""The masked-kernel cache: inference reuses weight * mask, and never serves a stale one.

torch keys it on each tensor's identity, version counter and data pointer (autograd off only);
MLX on the identity of the weight and mask arrays (immutable: every change is a new array).
Every test compares against a layer that computes weight * mask afresh.
"""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend

SPEC = db.Dense(6, in_features=5, mask=db.wiring.random(5, 6, 0.5, seed=1), activation="tanh")


def _torch_reference(layer, x):
    import torch

    return torch.tanh(torch.nn.functional.linear(x, layer.weight * layer.mask, layer.bias))


# ------------------------------------------------------------------ torch
@pytest.fixture
def torch_layer():
    require_backend("torch")
    return db.compile(SPEC, "torch", seed=0)


def test_torch_inference_reuses_the_masked_weight(torch_layer):
    import torch

    x = torch.randn(3, 5)
    with torch.no_grad():
        y1 = torch_layer(x)
        first = torch_layer.__dict__["_masked_cache"][-1]
        y2 = torch_layer(x)
        assert torch_layer.__dict__["_masked_cache"][-1] is first  # not recomputed
    with torch.inference_mode():
        torch_layer(x)
    assert torch.equal(y1, y2) and torch.equal(y1, _torch_reference(torch_layer, x).detach())


def test_torch_training_builds_the_product_in_the_graph(torch_layer):
    import torch

    with torch.no_grad():
        torch_layer(torch.randn(2, 5))  # a cache exists
    torch_layer(torch.randn(2, 5)).sum().backward()
    grad = torch_layer.weight.grad
    assert grad is not None and torch.all(grad[torch_layer.mask == 0] == 0)


@pytest.mark.parametrize("change", ["optimizer", "set_params", "load_state_dict", "copy_", "data_assign",
                                    "new_parameter", "mask_buffer", "to_float64"])
def test_torch_cache_sees_every_supported_change(torch_layer, change):
    import torch

    x = torch.randn(4, 5)
    with torch.no_grad():
        torch_layer(x)  # fill the cache
    if change == "optimizer":
        opt = torch.optim.SGD(torch_layer.parameters(), lr=0.5)
        torch_layer(x).sum().backward()
        opt.step()
    elif change == "set_params":
        p = db.get_params(torch_layer)
        db.set_params(torch_layer, {**p, "kernel": p["kernel"] * 2})
    elif change == "load_state_dict":
        state = {k: v * 3 if k == "weight" else v for k, v in torch_layer.state_dict().items()}
        torch_layer.load_state_dict(state)
    elif change == "copy_":
        with torch.no_grad():
            torch_layer.weight.copy_(torch_layer.weight * -1)
    elif change == "data_assign":
        torch_layer.weight.data = torch_layer.weight.data * 4
    elif change == "new_parameter":
        torch_layer.weight = torch.nn.Parameter(torch_layer.weight.detach() + 1)
    elif change == "mask_buffer":
        with torch.no_grad():
            torch_layer.mask.fill_(1)
    elif change == "to_float64":
        torch_layer.to(torch.float64)
        x = x.double()
    with torch.no_grad():
        got = torch_layer(x)
        want = _torch_reference(torch_layer, x)
    assert torch.equal(got, want), change


def test_torch_writes_through_data_bypass_the_version_counter_and_clear_masked_cache_fixes_it(torch_layer):
    """Documented limit: ``weight.data.mul_(...)`` does not bump the version counter torch keeps
    for ``weight``, so the cache cannot see it; ``clear_masked_cache()`` is the remedy."""
    import torch

    x = torch.randn(4, 5)
    with torch.no_grad():
        before = torch_layer(x)
        torch_layer.weight.data.mul_(2)  # bypasses torch's version counter
        stale = torch_layer(x)
        assert torch.equal(stale, before)  # the documented staleness
        torch_layer.clear_masked_cache()
        fresh = torch_layer(x)
    assert torch.equal(fresh, _torch_reference(torch_layer, x).detach())
    assert not torch.equal(fresh, before)


def test_torch_forward_reads_parametrized_and_swapped_weights(torch_layer):
    """The forward reads weight/bias/mask from the module's dicts (fast); a parametrized weight
    (a property, not in _parameters) and functional_call's swapped tensors are still what it uses."""
    import torch
    from torch.nn.utils import parametrize

    x = torch.randn(3, 5)

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    with torch.no_grad():
        before = torch_layer(x)
    other = {k: v * 3 for k, v in torch_layer.state_dict().items() if k != "mask"}
    with torch.no_grad():
        swapped = torch.func.functional_call(torch_layer, other, (x,))
        expected = torch.tanh(torch.nn.functional.linear(x, other["weight"] * torch_layer.mask, other["bias"]))
    assert torch.allclose(swapped, expected)
    parametrize.register_parametrization(torch_layer, "weight", Double())
    with torch.no_grad():
        doubled = torch_layer(x)
        assert torch.allclose(doubled, _torch_reference(torch_layer, x))
    assert not torch.allclose(doubled, before)


def test_torch_pickles_and_deep_copies_carry_no_cache(torch_layer):
    import torch

    x = torch.randn(2, 5)
    with torch.no_grad():
        y = torch_layer(x)
    assert "_masked_cache" in torch_layer.__dict__
    for other in (copy.deepcopy(torch_layer), pickle.loads(pickle.dumps(torch_layer))):
        assert "_masked_cache" not in other.__dict__
        with torch.no_grad():
            other.weight.mul_(0.5)  # the copy is independent of the original's cache
            assert torch.equal(other(x), _torch_reference(other, x))
    with torch.no_grad():
        assert torch.equal(torch_layer(x), y)


# ------------------------------------------------------------------ MLX
def test_mlx_inference_reuses_the_masked_weight_and_sees_every_change():
    require_backend("mlx")
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    layer = db.compile(SPEC, "mlx", seed=0)
    x = mx.array(np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32))

    def reference():
        return mx.tanh(mx.addmm(layer["bias"], x, (layer["weight"] * layer["mask"]).T))

    y1 = layer(x)
    first = layer.__dict__["_masked_cache"][2]
    y2 = layer(x)
    assert layer.__dict__["_masked_cache"][2] is first
    assert mx.array_equal(y1, y2) and mx.array_equal(y1, reference())
    assert "_masked_cache" not in layer.parameters()  # never a parameter

    # a training step (new weight arrays) ...
    loss_and_grad = nn.value_and_grad(layer, lambda m, v: m(v).sum())
    _, grads = loss_and_grad(layer, x)
    optim.SGD(learning_rate=0.5).update(layer, grads)
    mx.eval(layer.parameters())
    assert mx.array_equal(layer(x), reference())
    # ... db.set_params, and update() with a new mask
    p = db.get_params(layer)
    db.set_params(layer, {**p, "kernel": np.asarray(p["kernel"]) * 2})
    assert mx.array_equal(layer(x), reference())
    layer.update({"mask": mx.ones_like(layer["mask"])})
    assert mx.array_equal(layer(x), reference())
