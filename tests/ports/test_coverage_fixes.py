"""Config completion and twin sizes the coverage table (benchmarks/coverage.py) re-measured at
the newest commit asked for, in their general form: one rope setting shared by every layer type;
a rotated head width computed from its parts; a string setting no weight decides taken from what
mlx-lm's own models assume; a per-layer list of switches (which layers hold experts) read from the
weights layer by layer; an integer no weight depends on; per-layer settings keyed by layer index,
state-space heads that tile the expanded width and a sparse-attention top-k in the twins' sizes.
Real transformers and mlx-lm, tiny configs, no downloads."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tp():
    from dense_bridge.backends.torch import _ports as tp

    return tp


def _mp():
    from dense_bridge.backends.mlx import _ports as mp

    return mp


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _harness():
    return _load("coverage_harness_", ("benchmarks", "coverage.py"))


def _default_shrunk(model_type: str) -> dict:
    """transformers' default config of ``model_type`` as the interchange form, shrunk by the port."""
    import transformers

    tp = _tp()
    d = {k: v for k, v in tp._plain_floats(transformers.CONFIG_MAPPING[model_type]().to_dict()).items()
         if k != "transformers_version"}
    d["model_type"] = model_type
    return tp.port_shrink("transformers", d)


def _destination(model_type: str) -> tuple[dict, dict]:
    """(the mlx-lm config the port writes for the harness's tiny ``model_type``, its transformers
    config as interchange), as the port makes it: transformers' config written out, carried into
    mlx-lm's names, completed from transformers' own model's tensor shapes."""
    tp, mp = _tp(), _mp()
    small, _ = _harness()._tiny_config(model_type)
    common = tp.port_common_config("transformers", tp.port_own_config("transformers", small))
    shapes = tp.port_shapes("transformers", tp.port_own_config("transformers", small))
    return mp.port_complete_config("mlx-lm", mp.port_own_config("mlx-lm", common), shapes), common


# ------------------------------------------------------------------ rope shared by every layer type
def test_one_rope_setting_for_every_layer_type_is_read_as_the_one_mlx_lm_takes():
    mp = _mp()
    same = {"rope_type": "default", "rope_theta": 500000.0}
    common = {"model_type": "olmo3", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 96, "intermediate_size": 64, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
              "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
              "rope_parameters": {"sliding_attention": dict(same), "full_attention": dict(same)}}
    own = mp.port_own_config("mlx-lm", common)
    assert own["rope_theta"] == 500000.0
    assert mp.port_shapes("mlx-lm", own)  # mlx-lm builds it (it requires rope_theta)
    # bases that differ between layer types are written under the names one base per kind had before
    # transformers 5 (full attention's rope_theta, sliding attention's rope_local_base_freq): a model that
    # reads only rope_theta then computes otherwise, which the twins judge
    differ = dict(common, rope_parameters={"sliding_attention": dict(same),
                                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    own = mp.port_own_config("mlx-lm", differ)
    assert own["rope_theta"] == 1e6 and own["rope_local_base_freq"] == 500000.0


def test_an_olmo3_model_ports_both_ways_bit_identical(tmp_path):
    _load("test_coverage_sample_", ("tests", "ports", "test_coverage_sample.py"))._port_both_ways(tmp_path, "olmo3")


# ------------------------------------------------------------------ per-layer switches from the weights
def test_which_layers_hold_experts_is_read_from_the_weights_layer_by_layer():
    own, common = _destination("exaone_moe")
    want = [t == "sparse" for t in common["mlp_layer_types"]]
    assert True in want and False in want  # the tiny model has both kinds (the check can fail)
    assert own["is_moe_layer"] == want
    mp = _mp()
    flipped = dict(own, is_moe_layer=[not x for x in want])
    tp = _tp()
    small, _ = _harness()._tiny_config("exaone_moe")
    shapes = tp.port_shapes("transformers", tp.port_own_config("transformers", small))
    assert mp._fit(own, shapes) < mp._fit(flipped, shapes)


def test_an_exaone_moe_model_ports_both_ways_bit_identical(tmp_path):
    _load("test_coverage_sample_", ("tests", "ports", "test_coverage_sample.py"))._port_both_ways(tmp_path,
                                                                                                  "exaone_moe")


# ------------------------------------------------------------------ derived widths, unused widths
def test_the_rotated_width_is_computed_from_the_head_width_and_its_fraction():
    mp = _mp()
    own, common = _destination("minimax_m2")
    assert own["rotary_dim"] == common["head_dim"]  # transformers rotates every dimension here
    half = dict(own, rotary_dim=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                      "partial_rotary_factor": 0.5})
    assert mp.port_complete_config("mlx-lm", half, {"x": (1,)})["rotary_dim"] == common["head_dim"] // 2
    # a width no tensor depends on (mlx-lm declares it and never builds with it) is none: 0
    assert own["shared_intermediate_size"] == 0
    assert mp.port_shapes("mlx-lm", own)


# ------------------------------------------------------------------ strings no weight decides
def test_a_string_setting_takes_the_value_mlx_lm_s_own_models_assume():
    mp = _mp()
    own, _ = _destination("glm_moe_dsa")
    assert (own["topk_method"], own["scoring_func"], own["moe_layer_freq"]) == ("noaux_tc", "sigmoid", 1)
    assert mp.port_shapes("mlx-lm", own)
    assert mp._library_default("a_setting_no_model_has") is None
    # one model alone defaulting a field is no usual default
    assert mp._library_default("zero_expert_type") is None


# ------------------------------------------------------------------ twin sizes
def test_per_layer_settings_keyed_by_layer_index_keep_the_same_layers():
    import torch
    import transformers

    tp = _tp()
    small = _default_shrunk("gemma4_text")
    types = small["layer_types"]
    keys = sorted(small["per_layer_config"], key=int)
    assert [int(k) for k in keys] == [i for i, t in enumerate(types) if t == "full_attention"]
    assert all(len(k) == 2 for k in keys)  # written as the source writes them ("05")
    assert all(small["per_layer_config"][k]["head_dim"] == 2 * small["head_dim"] for k in keys)  # 512 / 256
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(tp._config(small))
    # a label map is no per-layer setting
    assert _default_shrunk("llama")["id2label"] in ({0: "LABEL_0", 1: "LABEL_1"}, {"0": "LABEL_0", "1": "LABEL_1"})


def test_state_space_heads_still_tile_the_expanded_width():
    import torch
    import transformers

    tp = _tp()
    mamba2 = _default_shrunk("mamba2")
    assert mamba2["num_heads"] * mamba2["head_dim"] == int(mamba2["expand"] * mamba2["hidden_size"])
    hybrid = _default_shrunk("granitemoehybrid")
    assert hybrid["mamba_n_heads"] * hybrid["mamba_d_head"] == hybrid["mamba_expand"] * hybrid["hidden_size"]
    for cfg in (mamba2, hybrid):
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(tp._config(cfg))


def test_a_sparse_attention_top_k_is_below_the_twins_positions():
    from dense_bridge.ports._port import POSITIONS

    small = _default_shrunk("glm_moe_dsa")
    assert small["index_topk"] < POSITIONS
    assert small["num_experts_per_tok"] == 8  # a top-k of experts is no count of positions: kept


def test_layers_of_one_kind_with_different_widths_are_copied_by_one_rule():
    # a norm of width 8 in most layers and 16 in the full-attention one (a per-layer head width):
    # the same whole copy in every layer, planned for the real widths
    import numpy as np

    from dense_bridge.ports import _rules

    rng = np.random.default_rng(0)
    widths = [8, 8, 16]
    src = {f"m.{i}.k_norm.weight": rng.standard_normal(w).astype(np.float32) for i, w in enumerate(widths)}
    dst = {f"model.{i}.k_norm.weight": v.copy() for i, v in enumerate(src.values())}
    recipes = _rules.learn(src, dst)
    assert list(recipes) == ["model.{}.k_norm.weight"]
    real = {f"m.{i}.k_norm.weight": (w,) for i, w in enumerate([32, 32, 64, 32])}
    moves = _rules.plan(recipes, {"model.{}.k_norm.weight"}, set(), real,
                        {f"model.{i}.k_norm.weight": (w,) for i, w in enumerate([32, 32, 64, 32])})
    assert sorted((m.target, m.shape) for m in moves) == [(f"model.{i}.k_norm.weight", (w,))
                                                          for i, w in enumerate([32, 32, 64, 32])]


def test_every_table_of_the_vocabulary_is_shrunk():
    # gemma4's per-layer input embedding (vocab x layers x width) kept at 262144 rows made its twins
    # take gigabytes
    small = _default_shrunk("gemma4_text")
    assert small["vocab_size_per_layer_input"] == small["vocab_size"] <= 64


def test_a_count_no_weight_decides_is_refused_by_name_not_guessed():
    # bailing_hybrid's group_norm_size decides no tensor's shape; 0 would divide by zero inside
    # mlx-lm (the process died of SIGFPE): it stays unset and building refuses naming it
    mp = _mp()
    own, _ = _destination("bailing_hybrid")
    assert own.get("group_norm_size") is None
    with pytest.raises(db.ConversionError, match="group_norm_size"):
        mp.port_shapes("mlx-lm", own)


def test_a_state_space_width_that_is_head_width_times_heads_stays_so_in_the_twins():
    # transformers' Falcon-H1 checks mamba_d_head * mamba_n_heads == mamba_d_ssm; the twins' head
    # width shrinks, so the width made of it follows
    import transformers

    small = _default_shrunk("falcon_h1")
    assert small["mamba_d_head"] * small["mamba_n_heads"] == small["mamba_d_ssm"]
    transformers.AutoModelForCausalLM.from_config(_tp()._config(small))


def test_norm_scales_stored_as_1_plus_w_port_with_the_offset_stated_and_checked(tmp_path):
    """Qwen3-Next: transformers multiplies by 1 + w and saves w; mlx-lm multiplies by w and adds 1
    as it loads. The port writes w + 1 summed in float64 and rounded once to float32, bit-identical
    to mlx-lm's own loader on the same files; the certificate names the offset and the rounding,
    verify_port recomputes it and catches a changed tensor; the way back subtracts 1 exactly."""
    from pathlib import Path

    import mlx_lm.utils as mu
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    h = _harness()
    t, p, back = tmp_path / "T", tmp_path / "P", tmp_path / "back"
    cfg, _ = h._tiny_config("qwen3_next")
    model = transformers.AutoModelForCausalLM.from_config(_tp()._config(cfg), dtype=torch.float32).eval()
    _tp()._randomize(model, seed=7)
    model.save_pretrained(t)
    r1 = db.port(t, p, to="mlx-lm", verify="twins", progress=False)
    written = json.loads((p / "config.json").read_text())
    ref, _ = mu.load_model(Path(t), model_config=written)
    got, _ = mu.load_model(Path(p))
    assert h._first_difference(h._params_mlx(got), h._params_mlx(ref), "vs mlx-lm's own load") is None
    shifted = {k: e for k, e in r1.certificate["tensors"].items() if e.get("offset")}
    assert shifted and all(e["offset"] == 1.0 and "add 1" in e["ops"] for e in shifted.values())
    assert "model.norm.weight" in shifted and "model.layers.0.input_layernorm.weight" in shifted
    assert any(not e["exact"] and e["max_ulp"] >= 1 for e in shifted.values())  # 1 + w rounds w's low bits
    assert db.verify_port(p)
    files = sorted(p.glob("model*.safetensors"))
    tensors = load_file(files[0])
    key = next(k for k in shifted if k in tensors)
    tensors[key] = tensors[key] - np.float32(1.0)  # the stored w, not 1 + w
    save_file(tensors, str(files[0]), metadata={"format": "mlx"})
    assert not db.verify_port(p)
    r1_back = db.port(t, tmp_path / "P2", to="mlx-lm", verify="twins", progress=False)
    r2 = db.port(tmp_path / "P2", back, to="transformers", verify="twins", progress=False)
    assert h._first_difference(h._files(str(back)), h._files(str(t)), "round trip", h._rounded_back(r1_back, r2)) is None
    assert all(e["exact"] for e in r2.certificate["tensors"].values())  # (1 + w) - 1 is exact in float32


def test_a_cycle_of_block_kinds_is_kept_whole_in_the_twins():
    # 26 layers cycling (recurrent, recurrent, attention): cut to two layers, the twin would have no
    # attention block, which transformers' own cache needs to run at all
    import transformers

    common = {**transformers.RecurrentGemmaConfig().to_dict(), "model_type": "recurrent_gemma"}
    small = _tp().port_shrink("transformers", common)
    assert small["num_hidden_layers"] == 3 and small["block_types"] == ["recurrent", "recurrent", "attention"]
    small_plain = _tp().port_shrink("transformers", {**common, "block_types": ["recurrent"]})
    assert small_plain["num_hidden_layers"] == _tp().TWIN_LAYERS  # one kind: nothing to keep whole
