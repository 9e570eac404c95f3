"""compare_models on a layer one model runs once over a sequence and the other once per position.

A selective scan written as a loop (mlx-lm's Mamba) projects each position's row alone: its
``x_proj`` is called T times with (batch, in) where transformers' is called once with (batch, T,
in). The calls are joined into one over the same rows and compared with that call
(``testing/_row_calls``); a layer one model never calls as a module (transformers' Mamba reads
``dt_proj.weight`` directly) leaves the other model's calls uncompared, judged where its values
arrive. Real torch modules, and transformers' and mlx-lm's own tiny Mamba.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

torch = pytest.importorskip("torch")

PAIRS = {"lin": "lin", "head": "head"}


class _Whole(torch.nn.Module):
    """``lin`` once over every position."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):  # (batch, positions, 4)
        return self.head(torch.tanh(self.lin(x)))


class _Steps(_Whole):
    """``lin`` once per position (``order``: the positions in the order stacked back)."""

    def __init__(self, reverse: bool = False):
        super().__init__()
        self.reverse = reverse

    def forward(self, x):
        ys = [self.lin(x[:, t]) for t in range(x.shape[1])]
        if self.reverse:
            ys = ys[::-1]
        return self.head(torch.tanh(torch.stack(ys, 1)))


class _Direct(_Whole):
    """``lin``'s weights read directly, never called as a module."""

    def forward(self, x):
        return self.head(torch.tanh(torch.nn.functional.linear(x, self.lin.weight, self.lin.bias)))


def _x():
    return [np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32)]


def test_calls_once_per_position_are_joined_with_the_call_over_all_positions():
    for a, b in ((_Whole(), _Steps()), (_Steps(), _Whole())):
        report = db.testing.compare_models(a, b, _x(), mapping=PAIRS)
        assert report.passed, str(report)
        assert [pb for _, pb, _ in report.calls] == ["lin", "head"]
        assert any("joined into one" in n for n in report.notes)
        report = db.testing.compare_models(a, b, _x(), mapping=PAIRS, isolated=True)  # teacher forcing too
        assert report.passed, str(report)


def test_joined_calls_in_another_order_of_positions_fail():
    report = db.testing.compare_models(_Whole(), _Steps(reverse=True), _x(), mapping=PAIRS, grads=False)
    assert not report.passed and report.first_divergence == "head"


def test_calls_whose_rows_do_not_add_up_are_not_joined():
    a = _Steps()
    x = [np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32)]
    short = [x[0][:, :3]]
    report = db.testing.compare_models(a, _Whole(), (x, short), mapping=PAIRS, grads=False)
    assert not report.passed and not any("joined into one" in n for n in report.notes)


def test_a_layer_the_other_model_never_calls_is_judged_where_its_values_arrive():
    report = db.testing.compare_models(_Steps(), _Direct(), _x(), mapping=PAIRS)
    assert report.passed, str(report)
    assert [pb for _, pb, _ in report.calls] == ["head"]
    assert any("never called as a module" in n for n in report.notes)
    wrong = _Direct()
    with torch.no_grad():
        wrong.lin.weight.mul_(1.5)
    report = db.testing.compare_models(_Steps(), wrong, _x(), mapping=PAIRS, grads=False)
    assert not report.passed and report.first_divergence == "head"


def test_transformers_and_mlx_lm_mamba_compare_layer_by_layer():
    pytest.importorskip("transformers")
    pytest.importorskip("mlx_lm")
    from dense_bridge.backends.mlx import _ports as mp
    from dense_bridge.backends.torch import _ports as tp

    cfg = {"model_type": "mamba", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "state_size": 4,
           "num_hidden_layers": 1, "conv_kernel": 4, "time_step_rank": 4, "use_bias": False, "use_conv_bias": True,
           "tie_word_embeddings": True, "layer_norm_epsilon": 1e-5}
    a = tp.port_twin("transformers", tp.port_own_config("transformers", cfg), seed=0)
    b = mp.port_twin("mlx-lm", mp.port_own_config("mlx-lm", cfg), seed=1)
    ids = [np.random.default_rng(0).integers(0, 64, (1, 12)).astype(np.int64)]
    db.transfer(a, b, mapping="auto", inputs=ids)
    report = db.testing.compare_models(a, b, ids, mapping="auto", grads=False)
    assert report.passed, str(report)
    assert any("x_proj" in n and "joined into one" in n for n in report.notes)
    assert any("dt_proj" in n and "never called as a module" in n for n in report.notes)
