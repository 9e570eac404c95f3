"""Pieces that interleave along an axis (GPT-OSS's experts keep gate and up in one ``gate_up_proj``,
gate at ``[..., ::2]``, up at ``[..., 1::2]``; mlx-lm keeps them apart), and a bare weight and bias
that a module's own code applies as a linear layer (GPT-OSS's router, a tuple-returning module in
transformers, an ``nn.Linear`` in mlx-lm): the rule language's ``"stride"``, checked; the transfer
cutting and interleaving by it; the port's recipes learning it by value and the certificate's
``make`` replaying it; the inference pairing the bare router with a linear layer. Real torch and
MLX, tiny arrays."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.models import _plan
from dense_bridge.ports import _rules
from dense_bridge.ports._certificate import make


# ------------------------------------------------------------------ the rule language
def test_stride_is_a_rule_word_checked_by_name():
    rules = _plan.parse({"e.gate_up": {"to": ["e.gate", "e.up"], "axis": 2, "stride": 2}})
    assert rules[0].target.stride == 2
    for bad in (1, True, "2", 2.0):
        with pytest.raises(TypeError, match="stride"):
            _plan.parse({"e.gate_up": {"to": ["e.gate", "e.up"], "axis": 2, "stride": bad}})
    with pytest.raises(TypeError, match="stride"):
        _plan.parse({"e.gate_up": {"to": ["e.gate", "e.up"], "axis": None, "stride": 2}})
    move = _plan.AxisMove(("a",), ("b", "c"), 1, False, stride=2)
    assert move.replacement()["stride"] == 2  # report.rules write it back


# ------------------------------------------------------------------ the transfer
def _torch_fused():
    import torch

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.gate_up = torch.nn.Parameter(torch.randn(2, 3, 8, generator=g))

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    return Fused()


def _mlx_apart():
    import mlx.core as mx
    import mlx.nn as nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = mx.zeros((2, 3, 4))
            self.up = mx.zeros((2, 3, 4))

    class Apart(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    return Apart()


def test_a_strided_cut_and_join_move_interleaved_pieces_exactly():
    pytest.importorskip("torch")
    pytest.importorskip("mlx")
    src, dst = _torch_fused(), _mlx_apart()
    fused = src.experts.gate_up.detach().numpy().copy()
    cut = {"experts.gate_up": {"to": ["experts.gate", "experts.up"], "axis": 2, "stride": 2}}
    db.transfer(src, dst, mapping=cut)
    np.testing.assert_array_equal(np.asarray(dst.experts.gate), fused[..., 0::2])
    np.testing.assert_array_equal(np.asarray(dst.experts.up), fused[..., 1::2])
    back = _torch_fused()
    with __import__("torch").no_grad():
        back.experts.gate_up.zero_()
    db.transfer(dst, back, mapping={("experts.gate", "experts.up"): {"to": "experts.gate_up", "axis": 2, "stride": 2}})
    np.testing.assert_array_equal(back.experts.gate_up.detach().numpy(), fused)
    # a stride that does not count the pieces is refused by name, nothing written
    other = _mlx_apart()
    with pytest.raises(db.DenseBridgeError, match="stride"):
        db.transfer(src, other, mapping={"experts.gate_up": {"to": ["experts.gate", "experts.up"], "axis": 2,
                                                             "stride": 3}})
    assert not np.any(np.asarray(other.experts.gate))


# ------------------------------------------------------------------ recipes learnt by value
def test_an_interleaving_is_learnt_from_the_twins_and_replayed_on_the_real_shapes():
    rng = np.random.default_rng(0)
    src, dst = {}, {}
    for i in range(2):
        gu = rng.standard_normal((4, 6, 10)).astype(np.float32)  # (experts, hidden, 2 * ffn)
        src[f"m.layers.{i}.experts.gate_up_proj"] = gu
        dst[f"m.layers.{i}.experts.gate_proj.weight"] = np.swapaxes(gu[..., 0::2], -1, -2).copy()
        dst[f"m.layers.{i}.experts.up_proj.weight"] = np.swapaxes(gu[..., 1::2], -1, -2).copy()
    recipes = _rules.learn(src, dst)
    gate, up = recipes["m.layers.{}.experts.gate_proj.weight"], recipes["m.layers.{}.experts.up_proj.weight"]
    assert gate.stride == up.stride == 2 and gate.pieces[0].start == 0 and up.pieces[0].start == 1
    # the real model: 8 experts, hidden 16, ffn 12, three layers
    real_src = {f"m.layers.{i}.experts.gate_up_proj": (8, 16, 24) for i in range(3)}
    real_dst = {f"m.layers.{i}.experts.{n}_proj.weight": (8, 12, 16) for i in range(3) for n in ("gate", "up")}
    moves = {m.target: m for m in _rules.plan(recipes, set(), set(), real_src, real_dst)}
    real = rng.standard_normal((8, 16, 24)).astype(np.float32)
    for name, k in (("gate", 0), ("up", 1)):
        m = moves[f"m.layers.2.experts.{name}_proj.weight"]
        (s_key, transpose, start, _), = m.sources
        assert transpose and start == k
        sl = [[0, 8], [0, 16], [start, 24, 2]]  # the stored source's axis 2, every second entry
        got = make([(real, sl, transpose)], m.axis, np.dtype(np.float32))
        np.testing.assert_array_equal(got, np.swapaxes(real[..., k::2], -1, -2))
    # the way back: the two interleaved into the fused tensor
    back = _rules.learn(dst, src)
    r = back["m.layers.{}.experts.gate_up_proj"]
    assert r.stride == 2 and [p.source for p in r.pieces] == ["m.layers.{}.experts.gate_proj.weight",
                                                            "m.layers.{}.experts.up_proj.weight"]
    g, u = np.swapaxes(real[..., 0::2], -1, -2), np.swapaxes(real[..., 1::2], -1, -2)
    m = {m.target: m for m in _rules.plan(back, set(), set(), real_dst, real_src)}["m.layers.2.experts.gate_up_proj"]
    assert m.stride == 2 and [s[0] for s in m.sources] == ["m.layers.2.experts.gate_proj.weight",
                                                           "m.layers.2.experts.up_proj.weight"]
    got = make([(g, None, True), (u, None, True)], m.axis, np.dtype(np.float32), stride=2)
    np.testing.assert_array_equal(got, real)


# ------------------------------------------------------------------ a bare router pairs with a linear layer
def test_a_bare_weight_and_bias_applied_as_a_linear_layer_pairs_with_one():
    torch = pytest.importorskip("torch")
    pytest.importorskip("mlx")
    import mlx.core as mx
    import mlx.nn as nn
    import torch.nn.functional as F

    class Router(torch.nn.Module):  # transformers' GPT-OSS router: bare parameters, a tuple out
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))
            self.bias = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            logits = F.linear(x, self.weight, self.bias)
            top, idx = torch.topk(logits, 2, dim=-1)
            return logits, top, idx

    class TorchBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.router = Router()

        def forward(self, x):
            h = self.proj(x)
            logits, _, _ = self.router(h)
            return logits

    class MlxBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.router = nn.Linear(8, 4)

        def __call__(self, x):
            return self.router(self.proj(x))

    torch.manual_seed(0)
    src, dst = TorchBlock(), MlxBlock()
    x = np.random.default_rng(0).standard_normal((1, 5, 8)).astype(np.float32)
    report = db.transfer(src, dst, mapping="auto", inputs=[x])
    np.testing.assert_array_equal(np.asarray(dst.router.weight), src.router.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(dst.router.bias), src.router.bias.detach().numpy())
    out = np.asarray(dst(mx.array(x)))
    np.testing.assert_allclose(out, src(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-5)
    assert "verified" in report.verification
