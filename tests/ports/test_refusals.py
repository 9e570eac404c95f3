"""db.port refuses before any byte is written, naming what it found; OUT is absent afterwards and
no temporary directory is left beside it."""
from __future__ import annotations

import json
import os
import struct

import pytest

import dense_bridge as db

from _port_helpers import mlx_lm_or_skip, transformers_or_skip
from _models import save


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    path = tmp_path_factory.mktemp("llama") / "src"
    save(transformers, "llama", path)
    return path


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _refused(src, out, error, match, **kw):
    before = sorted(os.listdir(os.path.dirname(os.path.abspath(out))))
    with pytest.raises(error, match=match):
        db.port(src, out, **{"to": "mlx-lm", "verify": "twins", **kw})
    after = sorted(os.listdir(os.path.dirname(os.path.abspath(out))))
    assert after == before, f"left behind: {set(after) - set(before)}"


def test_an_architecture_the_destination_does_not_implement(tmp_path):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                                 max_position_embeddings=64, word_embed_proj_dim=32)
    transformers.OPTForCausalLM(cfg).save_pretrained(tmp_path / "opt")
    # names the architecture and what mlx-lm offers
    _refused(tmp_path / "opt", tmp_path / "out", db.ConversionError, r"model_type 'opt'.*offers \d+ model types.*llama")
    assert not (tmp_path / "out").exists()


def test_a_destination_module_that_exits_the_process_is_refused_not_obeyed(tmp_path):
    # mlx-lm's OLMo module calls sys.exit when the ai2-olmo package is missing: the port refuses,
    # the caller's process lives on
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import importlib.util

    if importlib.util.find_spec("hf_olmo") is not None:
        pytest.skip("ai2-olmo is installed here: mlx-lm's OLMo module imports")
    cfg = transformers.OlmoConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                  num_attention_heads=4, max_position_embeddings=64)
    transformers.OlmoForCausalLM(cfg).save_pretrained(tmp_path / "olmo")
    _refused(tmp_path / "olmo", tmp_path / "out", db.ConversionError,
             r"model_type 'olmo' cannot be loaded here: its module needs what this machine lacks \(SystemExit")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value", [("auto_map", {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}),
                                        ("trust_remote_code", True)])
def test_a_config_asking_for_remote_code(tmp_path, llama_dir, key, value):
    src = _copy(llama_dir, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(src, tmp_path / "out", db.ConversionError, f"{key}.*never run")


def test_out_existing_and_not_empty_unless_overwrite(tmp_path, llama_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(llama_dir, out, db.CheckpointError, "exists and is not empty")
    assert (out / "keep.txt").read_text() == "mine"
    db.port(llama_dir, out, to="mlx-lm", verify="twins", overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "port_certificate.json").exists()
    (tmp_path / "empty").mkdir()  # an empty directory is taken
    db.port(llama_dir, tmp_path / "empty", to="mlx-lm", verify="twins")


def test_out_inside_src_or_holding_it(tmp_path, llama_dir):
    src = _copy(llama_dir, tmp_path / "src")
    _refused(src, src / "sub", db.CheckpointError, "inside src")
    assert not (src / "sub").exists()
    _refused(src, tmp_path, db.CheckpointError, "holds src", overwrite=True)


@pytest.mark.parametrize("entry", ["/etc/passwd", "../elsewhere/model.safetensors"])
def test_index_entries_absolute_or_climbing_out(tmp_path, llama_dir, entry):
    src = _copy(llama_dir, tmp_path / "src")
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "np") as f:
        keys = list(f.keys())
    weight_map = {k: "model.safetensors" for k in keys}
    weight_map[keys[0]] = entry
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _refused(src, tmp_path / "out", db.CheckpointError, "absolute path or one climbing out")


def test_a_missing_shard(tmp_path, llama_dir):
    src = _copy(llama_dir, tmp_path / "src")
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "np") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _refused(src, tmp_path / "out", db.CheckpointError, "missing shard")


def test_a_lying_safetensors_header(tmp_path, llama_dir):
    src = _copy(llama_dir, tmp_path / "src")
    raw = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [s * 4 for s in header[name]["shape"]]  # claims more than its offsets span
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    _refused(src, tmp_path / "out", db.CheckpointError, "needs .* bytes but its offsets span")


def test_not_a_model_directory_and_bad_arguments(tmp_path, llama_dir):
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", tmp_path / "out", db.CheckpointError, "no model directory")
    _refused(llama_dir, tmp_path / "out", db.ConversionError, "unknown model-directory format", to="onnx")
    _refused(llama_dir, tmp_path / "out", db.ConversionError, "verify must be one of", verify="sometimes")
    _refused(llama_dir, tmp_path / "out", db.ConversionError, "affine quantization has bits", quantize="affine:7:64")
    with pytest.raises(TypeError, match="to must be"):
        db.port(llama_dir, tmp_path / "out", to=3)


def test_a_bin_pickle_holding_anything_but_tensors(tmp_path, llama_dir):
    import torch

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    torch.save({"model.norm.weight": torch.ones(3), "optimizer": {"step": 3, "note": object.__name__}},
               src / "pytorch_model.bin")
    _refused(src, tmp_path / "out", db.CheckpointError, "pytorch_model.bin")
    torch.save({"model.norm.weight": torch.ones(3)}, src / "pytorch_model.bin")  # tensors only: read, not enough
    _refused(src, tmp_path / "out", db.ConversionError, "model.norm.weight.*shapes disagree|source lacks")


def test_a_multimodal_checkpoint(tmp_path, llama_dir):
    src = _copy(llama_dir, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["vision_config"] = {"hidden_size": 16, "num_hidden_layers": 1}
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(src, tmp_path / "out", db.ConversionError, "multimodal checkpoint.*vision_config.*only its text part")
