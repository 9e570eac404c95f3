"""Ports whose weights pair but whose two libraries compute different functions: refused as such.

transformers' GLM rotates half of each attention head (``partial_rotary_factor`` 0.5 in its
``rope_parameters``); mlx-lm's GLM rotates the whole head and its config has no setting for the
fraction. Every linear layer of the twins agrees run alone, the next-token distributions part:
the port refuses, saying that the libraries compute different functions (not that the mapping is
wrong), where (between the value projection and the output projection), and which setting
explains it (the source twin rebuilt with the fraction at 1 computes what mlx-lm computes). With
the fraction at 1 in the source's config the same model ports. mlx-lm's own GLM into transformers:
the fraction transformers' config adds is named the other way. A rope base lost in translating the
config is named as the port's fault, not the libraries'. Real transformers and mlx-lm, tiny
configs, no downloads.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402
from dense_bridge.ports._port import PortMismatch  # noqa: E402


def _glm(path, fraction: float) -> None:
    import torch
    import transformers

    from dense_bridge.backends.torch import _ports as tp

    cfg = transformers.GlmConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                                 max_position_embeddings=512, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": fraction})
    model = transformers.GlmForCausalLM(cfg).to(torch.float32).eval()
    tp._randomize(model, seed=7)
    model.save_pretrained(path)


def test_a_setting_the_destination_has_no_field_for_is_named_as_the_cause(tmp_path):
    _glm(tmp_path / "T", 0.5)
    with pytest.raises(PortMismatch) as got:
        db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    words = str(got.value)
    assert "compute different functions" in words and "the mapping was found" in words
    assert "mapping is wrong" not in words
    assert "self_attn.o_proj" in words and "KL" in words
    cause = ("mlx-lm's config for this model has no setting for rope_parameters.partial_rotary_factor=0.5; with it "
             "set to 1.0")
    assert cause in words and words.index(cause) < 300  # the cause first: a table keeps the first words
    assert not (tmp_path / "P").exists()  # nothing written


def test_the_same_model_without_the_setting_ports(tmp_path):
    _glm(tmp_path / "T", 1.0)
    report = db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    assert report.verification["passed"] and not report.discrepancies


def test_a_setting_lost_in_translation_is_named_as_the_port_s_fault(tmp_path, monkeypatch):
    """Without mlx-lm's key table the rope base (500000 in the source) never reaches mlx-lm's
    rope_theta (its default, 10000, is what it computes with): the source twin rebuilt with 10000
    computes what mlx-lm computes, so the translation is named, not the libraries."""
    import transformers  # noqa: F401

    from _models import save
    from dense_bridge.backends.mlx import _ports as mp

    save(transformers, "llama", tmp_path / "src")
    monkeypatch.setattr(mp, "READS_AS", {})
    with pytest.raises(PortMismatch) as got:
        db.port(tmp_path / "src", tmp_path / "out", to="mlx-lm", verify="twins", progress=False)
    words = str(got.value)
    assert "twins disagree because a setting was lost in translating the config" in words
    assert "rope_theta=500000.0 in the transformers config is 10000" in words
    assert "compute different functions" not in words


def test_a_setting_only_the_destination_has_is_named_the_other_way(tmp_path):
    """mlx-lm's own GLM (its loader's model of the same files, saved by mlx-lm) into transformers:
    transformers' config adds the rotary fraction 0.5 mlx-lm has no setting for; the destination
    twin rebuilt with it at 1 computes what mlx-lm computes, and the refusal says so first."""
    import json

    import mlx_lm.utils as mu

    _glm(tmp_path / "T", 0.5)
    model, config = mu.load_model(tmp_path / "T")
    mu.save_model(tmp_path / "M", model)
    (tmp_path / "M" / "config.json").write_text(json.dumps(config))
    with pytest.raises(PortMismatch) as got:
        db.port(tmp_path / "M", tmp_path / "Q", to="transformers", verify="twins", progress=False)
    words = str(got.value)
    cause = ("transformers's config for this model sets rope_parameters.partial_rotary_factor=0.5, which mlx-lm's "
             "config has no setting for; with it set to 1.0")
    assert "compute different functions" in words and cause in words and words.index(cause) < 300
    assert not (tmp_path / "Q").exists()
