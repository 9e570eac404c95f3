"""Settings mlx-lm reads in another form than transformers writes them, found by value by the
port's config completion (backends/mlx/_port_kinds.py): a string of per-layer letters read from
transformers' list of layer kinds by the caches mlx-lm's model keeps; a settings mapping left None
that mlx-lm reads as a mapping; layer kinds renamed to the names mlx-lm's module compares them
with, chosen by the weights; and a required setting nothing carries refused naming it and saying
what to do. Real transformers and mlx-lm, the coverage harness's tiny configs, no downloads."""
from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

from dense_bridge import ConversionError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tp():
    from dense_bridge.backends.torch import _ports as tp

    return tp


def _mp():
    from dense_bridge.backends.mlx import _ports as mp

    return mp


def _tiny(model_type: str) -> dict:
    spec = importlib.util.spec_from_file_location("coverage_harness_forms_", os.path.join(ROOT, "benchmarks",
                                                                                          "coverage.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._tiny_config(model_type)[0]


def _destination(small: dict) -> tuple[dict, dict, dict]:
    """(mlx-lm's config as the port completes it, mlx-lm's config before completion, transformers'
    tensor shapes) for the transformers config ``small``."""
    tp, mp = _tp(), _mp()
    common = tp.port_common_config("transformers", tp.port_own_config("transformers", small))
    shapes = tp.port_shapes("transformers", tp.port_own_config("transformers", small))
    own = mp.port_own_config("mlx-lm", common)
    return mp.port_complete_config("mlx-lm", own, shapes), own, shapes


def _caches(config: dict) -> list[str]:
    return [type(c).__name__ for c in _mp()._build(config).make_cache()]


# ------------------------------------------------------------------ per-layer letters from layer_types
def test_a_string_of_per_layer_letters_is_read_from_the_list_of_layer_kinds():
    small = _tiny("exaone4")
    assert isinstance(small["sliding_window_pattern"], int)  # transformers' period: a type mlx-lm misreads
    kinds = small["layer_types"]
    assert "sliding_attention" in kinds and "full_attention" in kinds  # both kinds: the check can fail
    done, before, _ = _destination(small)
    assert done["sliding_window_pattern"] == "LLLG"
    # every layer keeps the cache of its kind: a rotating one where transformers slides a window
    assert _caches(done) == ["RotatingKVCache" if k == "sliding_attention" else "KVCache" for k in kinds]
    with pytest.raises(ConversionError, match="sliding_window_pattern"):
        _mp().port_shapes("mlx-lm", before)  # as transformers writes it, mlx-lm cannot build it


def test_without_a_list_of_layer_kinds_the_mistyped_setting_is_refused_by_name():
    mp = _mp()
    _, before, shapes = _destination(_tiny("exaone4"))
    bare = {k: v for k, v in before.items() if k != "layer_types"}
    done = mp.port_complete_config("mlx-lm", bare, shapes)
    assert done["sliding_window_pattern"] == before["sliding_window_pattern"]  # nothing invented
    with pytest.raises(ConversionError) as err:
        mp.port_shapes("mlx-lm", done)
    msg = str(err.value)
    assert f"sliding_window_pattern={before['sliding_window_pattern']!r} (int)" in msg and "reads a str" in msg, msg
    assert "config.json" in msg, msg  # what the user can do


# ------------------------------------------------------------------ a settings mapping left None
def test_a_settings_mapping_left_none_is_given_as_an_empty_one_where_mlx_lm_reads_a_mapping():
    mp = _mp()
    done, before, _ = _destination(_tiny("minicpm3"))
    assert before.get("rope_scaling") is None  # transformers' default rope: no scaling entry
    with pytest.raises(ConversionError, match="NoneType"):
        mp.port_shapes("mlx-lm", before)
    assert done["rope_scaling"] == {}
    assert mp.port_shapes("mlx-lm", done)


# ------------------------------------------------------------------ layer kinds under mlx-lm's names
def test_layer_kinds_take_the_names_mlx_lm_compares_them_with_chosen_by_the_weights():
    mp = _mp()
    small = _tiny("granitemoehybrid")
    assert small["layer_types"] == ["linear_attention", "full_attention"]
    done, before, _ = _destination(small)
    with pytest.raises(ConversionError, match="linear_attention"):
        mp.port_shapes("mlx-lm", before)
    assert done["layer_types"] == ["mamba", "attention"]
    # the other order of layers: the weights, not the order of the names, decide
    flipped = dict(small, layer_types=["full_attention", "linear_attention"])
    assert _destination(flipped)[0]["layer_types"] == ["attention", "mamba"]


# ------------------------------------------------------------------ a setting nothing carries
def test_a_required_setting_neither_config_nor_weights_carry_is_refused_saying_what_to_do():
    mp = _mp()
    done, _, _ = _destination(_tiny("bailing_hybrid"))
    with pytest.raises(ConversionError) as err:
        mp.port_shapes("mlx-lm", done)
    msg = str(err.value)
    assert "group_norm_size" in msg and "add it to the source's config.json under that name" in msg, msg
