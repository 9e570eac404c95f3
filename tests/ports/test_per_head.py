"""A matrix one library keeps whole and another keeps per head, in parts: transformers' latent
attention stores ``kv_b_proj`` as one (heads * (nope + v), kv_lora_rank) matrix where mlx-lm keeps
(heads, kv_lora_rank, nope) and (heads, v, kv_lora_rank) arrays. The port learns the cut per head
(and the join back) from the twins by value; judged against mlx-lm's own load of the same
checkpoint, and the round trip against the source. A tiny real DeepSeek-V3, no downloads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402
from dense_bridge.ports import _rules  # noqa: E402


def _tiny(path):
    import torch
    import transformers

    from dense_bridge.backends.torch import _ports as tp

    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
        v_head_dim=10, n_group=1, topk_group=1, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tp._randomize(model, seed=3)
    model.save_pretrained(path)


def _tensors(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_a_matrix_kept_per_head_in_parts_ports_both_ways(tmp_path):
    import mlx.core as mx
    import mlx.utils
    import mlx_lm.utils as mu

    _tiny(tmp_path / "T")
    db.port(tmp_path / "T", tmp_path / "M", to="mlx-lm", verify="twins", progress=False)
    own, _ = mu.load_model(Path(tmp_path / "T"))  # mlx-lm's own reading of the transformers checkpoint
    want = {k: np.array(v.astype(mx.float32)) for k, v in mlx.utils.tree_flatten(own.parameters())}
    got = _tensors(tmp_path / "M")
    k = "model.layers.0.self_attn.embed_q.weight"
    assert got[k].shape == (4, 16, 12) and got["model.layers.0.self_attn.unembed_out.weight"].shape == (4, 10, 16)
    assert "model.layers.0.self_attn.kv_b_proj.weight" not in got
    for name, arr in got.items():
        assert np.array_equal(arr.astype(np.float32), want[name]), name
    checked = db.verify_port(tmp_path / "M")  # the certificate replays the cut per head from the files
    assert checked.passed and checked.tensors == len(got), checked.problems
    db.port(tmp_path / "M", tmp_path / "B", to="transformers", verify="twins", progress=False)
    checked = db.verify_port(tmp_path / "B")  # and the join
    assert checked.passed, checked.problems
    src, back = _tensors(tmp_path / "T"), _tensors(tmp_path / "B")
    assert set(back) <= set(src) and "model.layers.1.self_attn.kv_b_proj.weight" in back
    for name, arr in back.items():
        assert np.array_equal(arr, src[name]), name


def test_the_cut_per_head_is_learnt_by_value_and_sized_from_the_real_heads():
    rng = np.random.default_rng(0)
    heads, a, b, r = 3, 4, 2, 5
    w = rng.standard_normal((heads * (a + b), r)).astype(np.float32)
    per_head = w.reshape(heads, a + b, r)
    parts = {"l.0.k": np.ascontiguousarray(per_head[:, :a].swapaxes(1, 2)), "l.0.v": per_head[:, a:].copy()}
    cut = _rules.learn({"l.0.w": w}, parts)
    assert cut["l.{}.k"].pieces[0].source == "l.{}.w|h" and cut["l.{}.k"].pieces[0].transpose
    join = _rules.learn(parts, {"l.0.w": w})
    assert join["l.{}.w"].view == "h" and [p.transpose for p in join["l.{}.w"].pieces] == [True, False]
    # a real model with more heads and other widths: the widths come from its shapes
    moves = _rules.plan(cut, {"l.{}.k", "l.{}.v"}, set(), {"l.0.w": (8 * 9, 7)}, {"l.0.k": (8, 7, 6), "l.0.v": (8, 3, 7)})
    assert {m.target: m.sources for m in moves} == {"l.0.k": [("l.0.w|h8", True, 0, 6)], "l.0.v": [("l.0.w|h8", False, 6, 9)]}
    moves = _rules.plan(join, {"l.{}.w"}, set(), {"l.0.k": (8, 7, 6), "l.0.v": (8, 3, 7)}, {"l.0.w": (8 * 9, 7)})
    assert moves[0].view == "h8" and moves[0].made == (8, 9, 7)
    with pytest.raises(db.ConversionError, match="splits into destination tensors"):
        _rules.plan(cut, {"l.{}.k", "l.{}.v"}, set(), {"l.0.w": (8 * 10, 7)}, {"l.0.k": (8, 7, 6), "l.0.v": (8, 3, 7)})
