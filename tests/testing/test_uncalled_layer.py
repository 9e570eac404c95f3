"""A layer one model uses by its weight alone (a fused kernel reads ``layer.weight``) and the other
calls as a layer: compare_models judges the layers after it and notes it, never an infinite row."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

torch = pytest.importorskip("torch")
nn = torch.nn


class _Net(nn.Module):
    """fc1 -> mid -> fc2; ``by_weight``: mid is applied as ``x @ mid.weight.T + mid.bias`` without
    calling it, the way transformers' Jamba applies its time-step projection."""

    def __init__(self, by_weight: bool):
        super().__init__()
        self.by_weight = by_weight
        self.fc1, self.mid, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = h @ self.mid.weight.T + self.mid.bias if self.by_weight else self.mid(h)
        return self.fc2(torch.relu(h))


def _pair(seed=0):
    torch.manual_seed(seed)
    a = _Net(by_weight=True).eval()
    b = _Net(by_weight=False).eval()
    b.load_state_dict(a.state_dict())
    return a, b


def test_a_layer_used_by_its_weight_is_noted_not_failed():
    a, b = _pair()
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    report = db.testing.compare_models(a, b, x, mapping=[(r"(.*)", r"\1")], grads=False)
    assert report.passed, str(report)
    assert any("mid" in n and "never called as a module" in n for n in report.notes), report.notes
    assert all(pb != "mid" for _, pb, _ in report.calls)  # fc1 and fc2 judged, mid not alone


def test_a_wrong_weight_of_the_uncalled_layer_still_fails_after_it():
    a, b = _pair()
    with torch.no_grad():
        b.mid.weight.mul_(1.5)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    report = db.testing.compare_models(a, b, x, mapping=[(r"(.*)", r"\1")], grads=False)
    assert not report.passed
    assert report.first_failure.layer_type == "fc2" and report.first_failure.quantity == "input", str(report)
