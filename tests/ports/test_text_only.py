"""A multimodal checkpoint (a config with a text sub-config beside a vision tower) is refused unless
``text_only=True`` / ``--text-only``; then the text model alone is ported, with the tensors left out
listed in the certificate and said in the command's output.

Tested with transformers' Gemma 3 (``Gemma3ForConditionalGeneration``: a SigLIP vision tower,
a projector and a Gemma 3 text model whose stored keys, ``language_model.model.*``, differ from
its parameter paths), built tiny and random, into transformers (``Gemma3ForCausalLM``) and into
mlx-lm (``gemma3_text``). Six text layers: mlx-lm's Gemma 3 reads one full-attention layer every
``sliding_window_pattern`` (6) and cannot run fewer layers than that.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.cli._main import main

from _port_helpers import mlx_lm_or_skip, randomize, transformers_or_skip


def _gemma3(transformers, path):
    import torch

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=48, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=95, boi_token_index=93, eoi_token_index=94)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed=0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    transformers = transformers_or_skip()
    path = tmp_path_factory.mktemp("gemma3") / "src"
    return transformers, _gemma3(transformers, path), path


def test_refused_unless_asked_naming_the_opt_in(gemma3, tmp_path):
    _, _, src = gemma3
    with pytest.raises(db.ConversionError, match=r"multimodal checkpoint \(vision_config.*only its text part.*"
                                                 r"text_only=True, or --text-only"):
        db.port(src, tmp_path / "out", to="transformers", verify="twins")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="text_only"):
        db.port(src, tmp_path / "out", to="transformers", text_only="yes")


def test_text_only_ports_the_text_model_and_says_what_it_left_out(gemma3, tmp_path):
    transformers, whole, src = gemma3
    import torch
    from safetensors import safe_open

    report = db.port(src, tmp_path / "out", to="transformers", verify="full", text_only=True)
    assert report.verification["mode"] == "full" and report.verification["passed"]
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(text).__name__ == "Gemma3ForCausalLM"
    # every parameter is the whole model's text model's, bit for bit
    decoder = whole.get_decoder().state_dict()
    for k, v in text.get_decoder().state_dict().items():
        assert torch.equal(v, decoder[k]), k
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, 90, (1, 64)))
    with torch.no_grad():
        assert torch.equal(text(input_ids=ids).logits, whole(input_ids=ids).logits)
    # the certificate: text only, every stored tensor of the other towers listed, none ported
    with safe_open(str(src / "model.safetensors"), "np") as f:
        stored = set(f.keys())
    source = report.certificate["source"]
    assert source["text_only"] is True and source["kind"] == "gemma3_text"
    assert source["multimodal_architecture"] == ["Gemma3ForConditionalGeneration"]
    dropped = set(source["dropped"]["tensors"])
    assert source["dropped"]["count"] == len(dropped) > 0 and report.dropped == sorted(dropped)
    assert all(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in dropped)
    used = {s["tensor"] for t in report.certificate["tensors"].values() for s in t["sources"]}
    assert used | dropped == stored and not used & dropped
    assert all(k.startswith("language_model.") for k in used)  # the stored keys, as the certificate names them
    assert "text only" in report.summary() and str(len(dropped)) in report.summary()
    assert db.verify_port(tmp_path / "out").passed


def test_the_command_line_text_only(gemma3, tmp_path, capsys):
    _, _, src = gemma3
    assert main(["port", str(src), "--to", "transformers", "-o", str(tmp_path / "refused"), "--verify", "twins",
                 "--no-progress"]) == 2
    assert "--text-only" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    assert main(["port", str(src), "--to", "transformers", "-o", str(tmp_path / "out"), "--verify", "twins",
                 "--text-only", "--no-progress"]) == 0
    assert "text only: the text model alone was ported" in capsys.readouterr().out
    assert main(["port", str(src), "--to", "transformers", "-o", str(tmp_path / "out2"), "--verify", "twins",
                 "--text-only", "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["text_only"] is True and got["dropped"] and all("vision" in k or "projector" in k for k in got["dropped"])
    cert = json.loads((tmp_path / "out2" / "port_certificate.json").read_text())
    assert cert["source"]["text_only"] is True and cert["source"]["dropped"]["count"] == len(got["dropped"])


def test_text_only_into_mlx_lm(gemma3, tmp_path):
    _, whole, src = gemma3
    mlx_lm_or_skip()
    from pathlib import Path

    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    report = db.port(src, tmp_path / "mlx", to="mlx-lm", verify="full", text_only=True)
    assert report.verification["passed"] and report.verification["top1_agreement"] == 1.0
    # mlx-lm's Gemma MLP uses exact gelu where transformers uses the tanh form: named, as for Gemma
    assert any("different functions" in d for d in report.discrepancies)
    assert report.certificate["source"]["text_only"] is True and report.dropped
    model, _ = load_model(Path(tmp_path / "mlx"))  # mlx-lm's own loader
    got = dict(tree_flatten(model.parameters()))
    decoder = {f"model.{k}": v.numpy() for k, v in whole.get_decoder().state_dict().items()}
    # the source's head is tied: no lm_head is written, so mlx-lm's loader ties it as it does for the source
    assert whole.get_output_embeddings().weight.data_ptr() == whole.get_input_embeddings().weight.data_ptr()
    assert "lm_head.weight" not in report.certificate["tensors"]
    assert got.keys() == decoder.keys()
    for k, v in got.items():
        assert np.array_equal(np.asarray(v), decoder[k]), k
    assert db.verify_port(tmp_path / "mlx").passed
