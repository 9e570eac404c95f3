"""Each model is walked once per call: ``compare_models`` pairs, infers and counts structure on one
walk of each model, and ``transfer(mapping="auto")`` carries out the inferred plan on the walks the
inference used (the verification's ``compare_models`` walks once more, no further).

Real torch models; the walk is counted by wrapping ``dense_bridge.models._walk.walk``, which every
reader of a model's layers goes through, and calling the real one.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.models import _walk


def _mlp(torch, seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.fixture
def walks(monkeypatch):
    """Counter: id(model) -> how many times it was walked."""
    counts: Counter = Counter()
    real = _walk.walk

    def counting(model, argument="model", adapter=None):
        counts[id(model)] += 1
        return real(model, argument, adapter)

    monkeypatch.setattr(_walk, "walk", counting)
    return counts


def test_compare_models_walks_each_model_once(walks):
    torch = pytest.importorskip("torch")
    a, b = _mlp(torch, 0), _mlp(torch, 0)
    inputs = [np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)]
    report = db.testing.compare_models(a, b, inputs, mapping=[(r"(.*)", r"\1")])
    assert report.passed and report.structure is not None, str(report)
    assert walks[id(a)] == 1 and walks[id(b)] == 1, dict(walks)


def test_auto_transfer_plans_and_writes_on_one_walk_and_verifies_on_another(walks):
    torch = pytest.importorskip("torch")
    src, dst = _mlp(torch, 0), _mlp(torch, 1)
    inputs = [np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)]
    report = db.transfer(src, dst, mapping="auto", inputs=inputs)
    assert "verified" in report.verification
    assert [m[:2] for m in report.moved] == [("0", "0"), ("2", "2")]
    for k, v in db.get_params(src).items():
        np.testing.assert_array_equal(db.get_params(dst)[k], v)
    assert walks[id(src)] == 2 and walks[id(dst)] == 2, dict(walks)  # inference + writes; verification
