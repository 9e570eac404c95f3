"""Expert banks: one linear layer per expert on one side, one stored parameter holding them all on the other.

mlx-lm's DBRX keeps its experts as a list of modules (``ffn.experts.<e>.w1``/``v1``/``w2``, each
an ``nn.Linear``) that it calls only for the tokens routed to them; transformers 5's DBRX keeps
every expert's matrix of one projection flattened into one parameter ``(experts * ffn, hidden)``
(``ffn.experts.mlp.w1``, ``w2`` holding each expert's matrix transposed). ``mapping="auto"``
pairs the bank with the parameter (a join or split along axis 0 or 1), and the port learns the
per-tensor recipe through the per-head view of the flattened tensor. Real transformers and
mlx-lm, tiny configs, no downloads; every result is compared with mlx-lm's own conversion.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import mlx_lm_or_skip as _mlx_lm, randomize as _randomize  # noqa: F401
from _port_helpers import transformers_or_skip as _transformers

V, H, FF, EXPERTS = 64, 32, 24, 4
IDS = np.random.default_rng(0).integers(0, V, (2, 7))


def _dbrx(transformers, seed: int = 0):
    import torch

    cfg = transformers.DbrxConfig(d_model=H, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=V,
                                  attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                  ffn_config={"ffn_hidden_size": FF, "moe_num_experts": EXPERTS, "moe_top_k": 2},
                                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.DbrxForCausalLM(cfg).eval()
    _randomize(model, seed=seed)
    return model


def _mlx_params(model) -> dict:
    from mlx.utils import tree_flatten

    return {k: np.asarray(v) for k, v in tree_flatten(model.parameters())}


def test_a_bank_of_per_expert_linear_layers_pairs_with_the_flattened_parameter_both_ways(tmp_path):
    transformers = _transformers()
    _mlx_lm()
    import torch
    from mlx_lm.models import dbrx
    from mlx_lm.utils import load_model

    src = _dbrx(transformers)
    src.save_pretrained(tmp_path / "t")
    ref, _ = load_model(tmp_path / "t")  # mlx-lm's own conversion (its sanitize splits the experts)
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    dst = dbrx.Model(dbrx.ModelArgs.from_dict(cfg))
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    got, want = _mlx_params(dst), _mlx_params(ref)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert "verified" in report.verification and "NOT" not in report.verification
    assert report.not_moved_src == [] and report.not_moved_dst == []
    moves = [r for r in report.rules if isinstance(r[1], dict) and "axis" in r[1]]
    w2 = [r for r in moves if r[0].endswith(r"mlp\.w2")]
    assert len(w2) == 2 and all(r[1].get("swap") is True and r[1]["axis"] == 1 for r in w2), w2
    assert len(moves) == 6  # w1, v1, w2 of both blocks: each a split into the four experts

    back = _dbrx(transformers, seed=3)
    db.transfer(dst, back, mapping="auto", inputs=[IDS])
    a, b = back.state_dict(), src.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_bank_that_is_not_all_there_is_left_to_the_linear_pairing():
    """Experts numbered 0, 1 and 3 (no 2) are no bank: nothing is taken out of the linear layers."""
    from dense_bridge.models import _pair_banks

    class E:
        def __init__(self, path):
            self.path, self.names, self.shapes = path, ("weight",), {"weight": (8, 4)}

        def param_path(self, n):
            return f"{self.path}.{n}"

    class L:
        def __init__(self, path, order):
            self.entry, self.order, self.kind = E(path), order, "linear"

        @property
        def path(self):
            return self.entry.path

    whole = [L(f"blocks.0.experts.{i}.w1", i) for i in range(4)]
    assert [len(b.members) for b in _pair_banks._banks(whole)] == [4]
    assert _pair_banks._banks([x for x in whole if not x.path.endswith(".2.w1")]) == []
    # the layers of a model's blocks are no bank (their number is the block's)
    assert _pair_banks._banks([L(f"model.layers.{i}.q_proj", i) for i in range(4)]) == []


@pytest.mark.parametrize("transposed", [False, True])
def test_port_recipes_pick_from_and_stack_into_a_flattened_expert_tensor(transposed):
    """The twins' two experts teach the recipe; a real checkpoint with six experts is planned from it,
    each move made exactly as the certificate makes it."""
    from dense_bridge.ports import _certificate, _rules

    rng = np.random.default_rng(0)

    def per_expert(e_count, rows=3, cols=5):
        flat, split = {}, {}
        for layer in range(2):
            mats = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(e_count)]
            flat[f"b.{layer}.experts.mlp.w"] = np.concatenate(mats)
            split.update({f"b.{layer}.experts.{e}.w.weight": (m.T if transposed else m).copy()
                          for e, m in enumerate(mats)})
        return flat, split

    def made(moves, src):
        out = {}
        for m in moves:
            pieces = []
            for s_key, transpose, start, stop in m.sources:
                base, k = _rules.split_view(s_key)
                seen = src[base].shape if k is None else _rules.view_shape(src[base].shape, k)
                sl = _certificate._source_slice(seen, transpose and not m.pick, None if m.stack else m.axis,
                                                start, stop)
                pieces.append((src[base], sl, transpose, k))
            out[m.target] = _certificate.make(pieces, m.axis, np.dtype(np.float32), m.shape, m.view,
                                              stack=m.stack, pick=m.pick)
        return out

    twin_flat, twin_split = per_expert(2)
    real_flat, real_split = per_expert(6)
    shapes = lambda d: {k: tuple(v.shape) for k, v in d.items()}  # noqa: E731
    for src_t, dst_t, src_r, dst_r in ((twin_flat, twin_split, real_flat, real_split),
                                       (twin_split, twin_flat, real_split, real_flat)):
        recipes = _rules.learn(src_t, dst_t)
        assert all(r.pick or r.stack for r in recipes.values()), recipes
        stored = {_rules.template(k)[0] for k in dst_t}
        moves = _rules.plan(recipes, stored, stored, shapes(src_r), shapes(dst_r))
        got = made(moves, src_r)
        assert got.keys() == dst_r.keys()
        for k in dst_r:
            np.testing.assert_array_equal(got[k], dst_r[k], err_msg=k)


def _mlx_moe(stacked: bool, seed: int):
    """A one-block mlx model whose experts are a bank of mlx-lm's MLPs (one ``gate_proj``,
    ``up_proj``, ``down_proj`` linear layer each) or one mlx-lm ``SwitchGLU`` (three (experts, ., .)
    stacks), routed alike: softmax over the router's top-2 logits."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.llama4_text import MLP
    from mlx_lm.models.switch_layers import SwitchGLU

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(H, EXPERTS, bias=False)
            if stacked:
                self.experts = SwitchGLU(H, FF, EXPERTS)
            else:
                self.experts = [MLP(H, FF) for _ in range(EXPERTS)]

        def __call__(self, x):
            logits = self.router(x)
            inds = mx.argpartition(-logits, kth=1, axis=-1)[..., :2]
            scores = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1)
            if stacked:
                return (self.experts(x, inds) * scores[..., None]).sum(axis=-2)
            flat, fs, fi = x.reshape(-1, H), scores.reshape(-1, 2), inds.reshape(-1, 2).tolist()
            out = [sum(self.experts[e](xt) * st[k] for k, e in enumerate(it)) for xt, st, it in zip(flat, fs, fi)]
            return mx.stack(out).reshape(x.shape)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, H)
            self.layers = [Block()]
            self.head = nn.Linear(H, V, bias=False)

        def __call__(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = x + layer(x)
            return self.head(x)

    mx.random.seed(seed)
    net = Net()
    mx.eval(net.parameters())
    return net


def test_a_bank_of_per_expert_linear_layers_pairs_with_expert_stacks_along_a_new_axis():
    """A bank against ``SwitchGLU``'s (experts, ffn, hidden) stacks: stacked along a new axis 0 and
    unstacked back (``{"to", "axis": 0, "stack": True}``), bit for bit, the rules reusable as they are."""
    _mlx_lm()
    bank, stack = _mlx_moe(False, 0), _mlx_moe(True, 1)
    report = db.transfer(bank, stack, mapping="auto", inputs=[IDS])
    assert "verified" in report.verification and "NOT" not in report.verification
    moves = [r for r in report.rules if isinstance(r[1], dict) and r[1].get("stack")]
    assert len(moves) == 3 and all(r[1]["axis"] == 0 and not r[1].get("swap") for r in moves), report.rules
    got = _mlx_params(stack)
    for name in ("gate_proj", "up_proj", "down_proj"):
        want = np.stack([_mlx_params(bank)[f"layers.0.experts.{e}.{name}.weight"] for e in range(EXPERTS)])
        np.testing.assert_array_equal(got[f"layers.0.experts.{name}.weight"], want, err_msg=name)
    back = _mlx_moe(False, 2)
    db.transfer(stack, back, mapping="auto", inputs=[IDS])
    a, b = _mlx_params(back), _mlx_params(bank)
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    again = _mlx_moe(True, 3)
    db.transfer(bank, again, mapping=json.loads(json.dumps(report.rules)))  # the rules as plain data
    for k, v in got.items():
        np.testing.assert_array_equal(_mlx_params(again)[k], v, err_msg=k)


@pytest.mark.parametrize("bad", [{"to": "x", "axis": 0, "stack": "yes"}, {"to": "x", "axis": None, "stack": True}])
def test_a_stack_rule_that_is_not_one_is_refused_naming_it(bad):
    with pytest.raises(TypeError, match="'stack' must be a bool") as err:
        db.auto({"a.weight": bad})
    assert repr(bad["stack"]) in str(err.value)
