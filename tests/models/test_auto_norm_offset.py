"""mapping="auto" on norms whose libraries store the scale differently: one multiplies by its
stored ``w``, the other by ``1 + w`` (transformers' zero-centred RMSNorm of Qwen3-Next against
mlx-lm's plain ``nn.RMSNorm``, which adds 1 to the weights as it loads them). The convention is
found by running the destination's norm on the source norm's recorded input, and the move adds
the offset; the transfer's verification judges the result like every pair."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")
nn_mx = pytest.importorskip("mlx.nn")

V, D, OUT = 40, 24, 12
IDS = np.random.default_rng(0).integers(0, V, (2, 9))


class ZeroCentredRMSNorm(torch.nn.Module):
    """Multiplies by 1 + weight (weight 0 is the identity scale)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)


class PlainRMSNorm(torch.nn.Module):
    """Multiplies by weight, as mlx's nn.RMSNorm does."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TorchNet(torch.nn.Module):
    def __init__(self, norm) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.norm = norm(D)
        self.head = torch.nn.Linear(D, OUT, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


class MlxNet(nn_mx.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn_mx.Embedding(V, D)
        self.norm = nn_mx.RMSNorm(D, eps=1e-6)
        self.head = nn_mx.Linear(D, OUT, bias=False)

    def __call__(self, ids):
        return self.head(self.norm(self.embed(ids)))


def _torch_net(norm, seed: int):
    torch.manual_seed(seed)
    net = TorchNet(norm).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.3)
    return net


def _mlx_net(seed: int):
    mx.random.seed(seed)
    net = MlxNet()
    net.update({"norm": {"weight": mx.random.normal((D,)) * 0.3 + 1.0}})
    mx.eval(net.parameters())
    return net


def test_a_zero_centred_norm_moves_into_a_plain_one_with_one_added_and_back():
    src, dst = _torch_net(ZeroCentredRMSNorm, 0), _mlx_net(1)
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    w = src.norm.weight.detach().numpy().astype(np.float64)
    np.testing.assert_array_equal(np.asarray(dst.norm.weight), (w + 1.0).astype(np.float32))
    offsets = [r for _, r in report.rules if isinstance(r, dict) and r.get("offset")]
    assert [r["offset"] for r in offsets] == [1.0] and offsets[0]["to"] == "norm.weight"
    # the rules carry over as an explicit mapping; and back, one subtracted (exactly: 1 + w holds w's bits here)
    again = _mlx_net(2)
    db.transfer(src, again, mapping=report.rules)
    np.testing.assert_array_equal(np.asarray(again.norm.weight), np.asarray(dst.norm.weight))
    back = _torch_net(ZeroCentredRMSNorm, 3)
    back_report = db.transfer(dst, back, mapping="auto", inputs=[IDS])
    assert [r["offset"] for _, r in back_report.rules if isinstance(r, dict) and r.get("offset")] == [-1.0]
    np.testing.assert_allclose(back.norm.weight.detach().numpy(), w, atol=2 ** -22)


def test_norms_of_one_convention_move_as_they_are():
    src, dst = _torch_net(PlainRMSNorm, 0), _mlx_net(1)
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    assert not [r for _, r in report.rules if isinstance(r, dict) and r.get("offset")]
    np.testing.assert_array_equal(np.asarray(dst.norm.weight), src.norm.weight.detach().numpy())


def test_an_offset_in_an_explicit_mapping_is_checked():
    src, dst = _torch_net(PlainRMSNorm, 0), _mlx_net(1)
    before = np.asarray(dst.norm.weight).copy()
    with pytest.raises(TypeError, match="'offset' must be a finite number; got 'one'"):
        db.transfer(src, dst, mapping={"embed": "embed", "head": "head",
                                       "norm.weight": {"to": "norm.weight", "axis": None, "offset": "one"}})
    with pytest.raises(TypeError, match="'offset' must be a finite number; got nan"):
        db.transfer(src, dst, mapping={"norm.weight": {"to": "norm.weight", "offset": float("nan")}})
    np.testing.assert_array_equal(np.asarray(dst.norm.weight), before)
