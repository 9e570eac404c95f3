"""The twins of a model whose trailing layers reuse earlier layers' key/value caches (a count of
layers from the end, coupled to the layer count), and a rotary base per layer type read by mlx-lm
at the top level. Real transformers and mlx-lm, tiny configs, no downloads."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")


def _tp():
    from dense_bridge.backends.torch import _ports as tp

    return tp


def _shared_cache_config() -> dict:
    import transformers

    return transformers.Gemma3nTextConfig().to_dict()  # 35 layers, the last 15 reuse caches, period 5


def test_the_count_of_cache_sharing_layers_shrinks_with_the_layers_and_transformers_accepts_it():
    tp = _tp()
    common = _shared_cache_config()
    small = tp.port_shrink("transformers", common)
    cfg = tp._config(small)
    modes = cfg.kv_sharing_modes  # raises when no producer of some layer kind is left before the sharers
    n = small["num_hidden_layers"]
    assert n < common["num_hidden_layers"] and n % 5 == 0
    assert 0 < small["num_kv_shared_layers"] < n
    reusing = [t for t, m in zip(small["layer_types"], modes) if m == "reuse"]
    producing = [t for t, m in zip(small["layer_types"], modes) if m != "reuse"]
    assert set(producing) == set(small["layer_types"]) and reusing
    for k in ("intermediate_size", "activation_sparsity_pattern"):  # per-layer lists follow the count
        assert len(small[k]) == n
    assert all(w < 1024 for w in small["intermediate_size"])  # per-layer widths shrink too
    assert set(small["activation_sparsity_pattern"]) == set(common["activation_sparsity_pattern"])


def test_a_count_of_separate_layers_is_left_alone():
    tp = _tp()
    common = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8,
              "intermediate_size": 128, "vocab_size": 100}
    assert tp._part_counts(common) == {}
    assert tp._part_counts({**common, "num_kv_shared_layers": 4}) == {}  # not a part: all of them
    assert tp._part_counts({**common, "num_kv_shared_layers": 2}) == {"num_kv_shared_layers": 2}
    # a count the config class does not couple to the layers (it accepts the twin as shrunk) is kept
    assert tp.port_shrink("transformers", {**common, "num_hidden_layers": 12,
                                           "num_kv_shared_layers": 7})["num_kv_shared_layers"] == 7


def test_a_rotary_base_per_layer_type_is_read_by_mlx_lm_under_its_top_level_names():
    from dense_bridge.backends.mlx import _ports as mp

    small = _tp().port_shrink("transformers", _shared_cache_config())
    own = mp.port_own_config("mlx-lm", small)
    text = own.get("text_config", own)
    rope = small["rope_parameters"]
    assert text["rope_theta"] == rope["full_attention"]["rope_theta"]
    assert text["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
    model_class, args_class = mp._classes(own)
    args_class.from_dict(own)  # mlx-lm's arguments build (they required both names)


def test_layers_one_library_builds_in_the_cache_sharing_layers_are_named_in_the_refusal(tmp_path):
    """transformers builds no key/value projections in the layers that reuse caches; mlx-lm's model
    has them (and computes with them when run without a cache): the port refuses, naming them."""
    import torch

    from dense_bridge.ports import PortMismatch

    import dense_bridge as db

    tp = _tp()
    small = tp.port_shrink("transformers", _shared_cache_config())
    model = __import__("transformers").AutoModelForCausalLM.from_config(tp._config(small), dtype=torch.float32)
    tp._randomize(model.eval(), seed=7)
    model.save_pretrained(tmp_path / "T")
    with pytest.raises(PortMismatch) as err:
        db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", progress=False)
    words = str(err.value)
    assert "dst's have ['self_attn.k_norm', 'self_attn.k_proj', 'self_attn.v_proj']" in words, words
    assert not (tmp_path / "P").exists()
