"""What the coverage table (benchmarks/coverage.py) taught the port, in its general form: an mlx-lm
config field the source's config leaves unset filled by the source's weights or another name of the
same setting; a learned scalar stored (1,) by one library and () by the other; a constant every
layer holds alike taken at its own layer; the twins' sizes (latent-attention widths, inner widths
that are multiples, lists of layer indices); infinities in transformers' configs; the text part of a
multimodal model that mlx-lm reads through its composite. Tiny real models, no downloads."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402
from dense_bridge.ports import _rules  # noqa: E402


def _tp():
    from dense_bridge.backends.torch import _ports as tp

    return tp


def _mp():
    from dense_bridge.backends.mlx import _ports as mp

    return mp


def _save(config, path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _tp()._randomize(model, seed=3)
    model.save_pretrained(path)


def test_a_required_width_the_config_leaves_unset_is_read_from_the_weights(tmp_path):
    from pathlib import Path

    import transformers

    import mlx_lm.utils as mu

    # transformers computes the inner width from n_inner=None (4 x the width); mlx-lm requires the number
    cfg = transformers.GPTBigCodeConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=256, n_inner=None,
                                        bos_token_id=1, eos_token_id=2)
    _save(cfg, tmp_path / "T")
    db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    with open(tmp_path / "P" / "config.json") as f:
        written = json.load(f)
    assert written["n_inner"] == 128
    model, _ = mu.load_model(Path(tmp_path / "P"))
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (128, 32)


def test_a_field_the_weights_do_not_decide_is_refused_by_name():
    mp = _mp()
    config = {"model_type": "gpt_bigcode", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256,
              "layer_norm_epsilon": 1e-5, "vocab_size": 96, "n_inner": None}
    same = mp.port_complete_config("mlx-lm", config, {})  # no weights: nothing to read it from
    assert same["n_inner"] is None
    with pytest.raises(db.ConversionError, match="n_inner: required by its ModelArgs"):
        mp.port_shapes("mlx-lm", same)


def test_a_required_field_under_another_name_is_carried():
    mp = _mp()
    common = {"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 96, "intermediate_size": 128, "layer_norm_eps": 1e-5, "max_position_embeddings": 256,
              "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}}
    own = mp.port_complete_config("mlx-lm", mp.port_own_config("mlx-lm", common), {})
    assert own["rotary_emb_base"] == 5000.0 and own["rotary_pct"] == 0.5
    assert mp.port_shapes("mlx-lm", own)


def test_a_learned_scalar_stored_as_one_element_or_none_moves_both_ways():
    rng = np.random.default_rng(0)
    vec = {f"m.{i}.act.alpha": rng.standard_normal(1).astype(np.float32) for i in range(2)}
    w = {f"m.{i}.w": rng.standard_normal((3, 4)).astype(np.float32) for i in range(2)}
    src = {**vec, **w}
    dst = {**{k: v.reshape(()) for k, v in vec.items()}, **w}
    for a, b in ((src, dst), (dst, src)):
        recipes = _rules.learn(a, b)
        moves = _rules.plan(recipes, {_rules.template(k)[0] for k in b}, set(),
                            {k: v.shape for k, v in a.items()}, {k: v.shape for k, v in b.items()})
        for m in moves:
            from dense_bridge.ports._certificate import make

            parts = []
            for key, transpose, start, stop in m.sources:
                base, view = _rules.split_view(key)
                parts.append((a[base], None, transpose, view))
            got = make(parts, m.axis, np.dtype(np.float32), m.shape, m.view)
            assert got.shape == b[m.target].shape and np.array_equal(got, b[m.target]), m.target


def test_a_constant_every_layer_holds_alike_comes_from_its_own_layer():
    const = np.float32(0.5).reshape(())
    rng = np.random.default_rng(1)
    src = {f"m.{i}.beta": const.copy() for i in range(2)} | {f"m.{i}.w": rng.standard_normal((2, 2)).astype(np.float32)
                                                            for i in range(2)}
    recipes = _rules.learn(src, dict(src))
    assert recipes["m.{}.beta"].pieces[0].source == "m.{}.beta"


def test_an_apertus_style_model_ports_both_ways(tmp_path):
    # mlx-lm requires mlp_bias / qk_norm / post_norm, which transformers' config does not hold (read
    # from the weights); its learned activation keeps two scalars that transformers stores as (1,)
    # and mlx-lm as (), beside constants alike in every layer
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("test_coverage_sample_",
                                                  os.path.join(root, "tests", "ports", "test_coverage_sample.py"))
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    sample._port_both_ways(tmp_path, "apertus")


def test_twin_sizes_keep_latent_widths_multiples_and_layer_index_lists():
    tp = _tp()
    mla = tp.port_shrink("transformers", {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
                                          "num_key_value_heads": 128, "head_dim": 64, "qk_rope_head_dim": 64,
                                          "qk_nope_head_dim": 128, "v_head_dim": 128, "qk_head_dim": 192,
                                          "kv_lora_rank": 512, "q_lora_rank": 1536, "num_hidden_layers": 61,
                                          "vocab_size": 129280, "intermediate_size": 18432})
    assert (mla["qk_rope_head_dim"], mla["qk_nope_head_dim"], mla["v_head_dim"]) == (8, 16, 16)
    assert mla["qk_head_dim"] == mla["qk_rope_head_dim"] + mla["qk_nope_head_dim"]
    assert mla["kv_lora_rank"] == mla["q_lora_rank"] == 32
    neox = tp.port_shrink("transformers", {"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 8,
                                           "intermediate_size": 2048, "num_hidden_layers": 6, "vocab_size": 500})
    assert neox["intermediate_size"] == 4 * neox["hidden_size"]
    rotary = tp.port_shrink("transformers", tp.port_common_config("transformers", {
        "model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64, "n_layer": 4, "vocab_size": 500,
        "n_positions": 512}))
    assert rotary["rotary_dim"] * 256 == 64 * rotary["head_dim"]  # the rotated quarter of each head stays a quarter
    types = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]
    lfm = tp.port_shrink("transformers", {"model_type": "lfm2", "hidden_size": 256, "num_attention_heads": 8,
                                          "num_key_value_heads": 8, "num_hidden_layers": 16, "vocab_size": 500,
                                          "intermediate_size": 512, "layer_types": types,
                                          "full_attn_idxs": [2, 5, 8, 10, 12, 14]})
    assert lfm["full_attn_idxs"] == [i for i, t in enumerate(lfm["layer_types"]) if t == "full_attention"]
    assert lfm["full_attn_idxs"] and len(lfm["layer_types"]) == lfm["num_hidden_layers"]


def test_infinities_in_a_transformers_config_are_read_back():
    import transformers

    tp = _tp()
    cfg = transformers.FalconH1Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=96)
    common = tp.port_common_config("transformers", {**cfg.to_diff_dict(), "model_type": "falcon_h1"})
    assert any(isinstance(v, list) and math.inf in v for v in common.values())  # time_step_limit (0, inf)
    own = tp.port_own_config("transformers", common)
    assert "__float__" not in json.dumps(own, default=str)


def test_a_text_part_is_written_as_the_composite_mlx_lm_reads():
    mp = _mp()
    common = {"model_type": "qwen3_5_text", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 96}
    own = mp.port_own_config("mlx-lm", common)
    assert own["model_type"] == "qwen3_5" and own["text_config"]["model_type"] == "qwen3_5_text"
    assert mp.port_common_config("mlx-lm", own)["model_type"] == "qwen3_5_text"
    assert mp.port_describe("mlx-lm", own)["vocab_size"] == 96
