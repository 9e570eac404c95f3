"""db.port between transformers and mlx-lm directories, against the libraries' own loaders.

Every tiny random model is saved by transformers' ``save_pretrained``, ported to mlx-lm, loaded by
mlx-lm's own ``load_model`` and compared weight for weight with what that loader makes of the
transformers directory itself, then ported back and loaded by ``from_pretrained``: bit-identical
to the original. Nothing is downloaded; nothing is mocked.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import _close, mlx_lm_or_skip, transformers_or_skip
from _models import V, save

ARCHITECTURES = ["llama", "qwen2", "mistral", "qwen3", "gemma", "phi3", "gpt2"]


class _Bits(np.ndarray):
    """An MLX array's bits as numpy holds them (bfloat16 through uint16), with its MLX dtype name."""


def _mlx_params(model) -> dict:
    """name -> numpy array of the bits (bfloat16 as uint16), tagged with the MLX dtype."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = {}
    for k, v in tree_flatten(model.parameters()):
        a = np.asarray(v.view(mx.uint16)) if v.dtype == mx.bfloat16 else np.asarray(v)
        out[k] = a.view(_Bits)
        out[k].mlx_dtype = str(v.dtype)
    return out


def _mlx_load(path):
    from pathlib import Path

    from mlx_lm.utils import load_model

    return load_model(Path(path))


def _torch_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def _mlx_logits(model, ids):
    import mlx.core as mx

    return np.asarray(model(mx.array(ids.astype(np.int32))))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_transformers_to_mlx_lm_and_back_is_bit_exact(tmp_path, name):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import torch

    src = save(transformers, name, tmp_path / "src")
    report = db.port(tmp_path / "src", tmp_path / "mlx", to="mlx-lm")
    assert report.verification["passed"] and report.verification["mode"] == "full"
    assert report.verification["positions"] >= 256
    assert report.verification["top1_agreement"] == 1.0 and report.verification["kl_divergence"] < 1e-5

    got, config = _mlx_load(tmp_path / "mlx")  # mlx-lm's own loader, as it is
    mine = _mlx_params(got)
    ids = np.random.default_rng(0).integers(0, V, (1, 300))
    if name == "gemma":  # mlx-lm's Gemma MLP uses exact gelu where transformers uses the tanh form
        assert any("different functions" in d and "mlp.down_proj" in d for d in report.discrepancies)
        assert any("different functions" in d for d in report.certificate["discrepancies"])
    else:
        _close(_torch_logits(src, ids), _mlx_logits(got, ids), f"{name} logits, mlx-lm vs transformers")
    if name != "gpt2":  # mlx-lm's loader reads a GPT2LMHeadModel directory only without its prefix
        ref, _ = _mlx_load(tmp_path / "src")  # what mlx-lm's own loader makes of the transformers directory
        theirs = _mlx_params(ref)
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert mine[k].mlx_dtype == theirs[k].mlx_dtype and np.array_equal(mine[k], theirs[k]), k

    back_report = db.port(tmp_path / "mlx", tmp_path / "back", to="transformers")
    assert back_report.verification["passed"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    a, b = src.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for out in ("mlx", "back"):
        assert db.verify_port(tmp_path / out).passed


def test_the_rope_base_transformers_5_writes_reaches_mlx_lm(tmp_path):
    """transformers 5 writes rope_theta under rope_parameters; mlx-lm 0.32 reads its default 10000
    from such a directory. The port writes it where mlx-lm reads it."""
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    save(transformers, "llama", tmp_path / "src")
    assert "rope_theta" not in json.loads((tmp_path / "src" / "config.json").read_text())
    ref, _ = _mlx_load(tmp_path / "src")
    assert ref.args.rope_theta == 10000  # mlx-lm's own loader, silently wrong
    db.port(tmp_path / "src", tmp_path / "out", to="mlx-lm")
    got, _ = _mlx_load(tmp_path / "out")
    assert got.args.rope_theta == 500000.0


def test_a_setting_lost_in_translation_fails_the_twins(tmp_path, monkeypatch):
    """Without mlx-lm's key table the destination twin, built from the config as written, runs with
    rope base 10000: the twins disagree at 256 positions and nothing is written."""
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    from dense_bridge.backends.mlx import _ports as _model_dirs

    save(transformers, "llama", tmp_path / "src")
    monkeypatch.setattr(_model_dirs, "READS_AS", {})
    with pytest.raises(db.ConversionError, match="twins disagree"):
        db.port(tmp_path / "src", tmp_path / "out", to="mlx-lm")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temporary directory left either


def test_a_sharded_source_gives_a_sharded_destination(tmp_path):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    src = save(transformers, "qwen2", tmp_path / "src")
    src.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    report = db.port(tmp_path / "sharded", tmp_path / "out", to="mlx-lm", verify="twins")
    assert report.verification["mode"] == "twins" and report.verification["full_skipped"]
    written = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(written) == len(shards)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(written)
    got, _ = _mlx_load(tmp_path / "out")
    ref, _ = _mlx_load(tmp_path / "src")
    a, b = _mlx_params(got), _mlx_params(ref)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # max_shard_size: as many files as it takes
    db.port(tmp_path / "src", tmp_path / "by_size", to="mlx-lm", verify="twins", max_shard_size="30KB")
    assert len(list((tmp_path / "by_size").glob("model-*.safetensors"))) > 1


def test_bfloat16_stays_bfloat16_and_dtype_casts_with_rounding_reported(tmp_path):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import torch

    save(transformers, "llama", tmp_path / "src", dtype=torch.bfloat16)
    db.port(tmp_path / "src", tmp_path / "bf16", to="mlx-lm", verify="twins")
    got, _ = _mlx_load(tmp_path / "bf16")
    ref, _ = _mlx_load(tmp_path / "src")
    a, b = _mlx_params(got), _mlx_params(ref)
    assert all(a[k].mlx_dtype == "mlx.core.bfloat16" and np.array_equal(a[k], b[k]) for k in a)

    save(transformers, "llama", tmp_path / "f32")
    report = db.port(tmp_path / "f32", tmp_path / "half", to="mlx-lm", verify="twins", dtype="float16")
    entry = report.certificate["tensors"]["model.layers.0.mlp.up_proj.weight"]
    assert entry["dtypes"] == ["float32", "float16"] and entry["exact"] is False and entry["max_ulp"] == 1
    assert "cast float32 -> float16" in entry["ops"]
    assert db.verify_port(tmp_path / "half").passed


def _tiny_tokenizer(path) -> None:
    """A word-level tokenizer built offline with the tokenizers library, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V - 3)}
    vocab.update({"<unk>": V - 3, "<s>": 1, "</s>": 2})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def test_a_cache_snapshot_of_symlinks_with_its_tokenizer_loads_with_mlx_lm_load(tmp_path):
    """A Hugging Face cache snapshot (every file a symlink into the blob store) is read through its
    links; the tokenizer files both libraries read are carried, so ``mlx_lm.load`` takes OUT as it is."""
    transformers = transformers_or_skip()
    mlx_lm = mlx_lm_or_skip()
    plain = tmp_path / "plain"
    save(transformers, "qwen2", plain)
    _tiny_tokenizer(plain)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for n, p in enumerate(sorted(plain.iterdir())):
        blob = blobs / f"{n:040x}"
        blob.write_bytes(p.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / p.name)
    report = db.port(snap, tmp_path / "out", to="mlx-lm", verify="twins")
    assert set(report.certificate["source"]["files"]) >= {"model.safetensors", "tokenizer.json"}
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (plain / "tokenizer.json").read_bytes()
    model, tokenizer = mlx_lm.load(str(tmp_path / "out"))
    want = transformers.AutoTokenizer.from_pretrained(plain)
    assert tokenizer.encode("w5 w7 w9") == want.encode("w5 w7 w9") and tokenizer.vocab_size == want.vocab_size
    ids = np.array([[5, 7, 9]])
    ref = transformers.AutoModelForCausalLM.from_pretrained(plain).eval()
    _close(_torch_logits(ref, ids), _mlx_logits(model, ids), "mlx_lm.load logits")
    assert db.verify_port(tmp_path / "out").passed


def test_a_directory_mlx_lm_convert_wrote_ports_back_to_transformers(tmp_path):
    """The way back from a directory mlx-lm's own converter wrote (not one dense_bridge wrote): every
    tensor transformers loads equals what mlx-lm loads, bit for bit, in the dtype mlx-lm stored, and
    the config says what mlx-lm computes with (verified on the full models)."""
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import torch
    from mlx_lm import convert

    save(transformers, "llama", tmp_path / "hf")
    _tiny_tokenizer(tmp_path / "hf")
    convert(str(tmp_path / "hf"), mlx_path=str(tmp_path / "mlx"))
    report = db.port(tmp_path / "mlx", tmp_path / "back", to="transformers")
    assert report.source == "mlx-lm" and report.verification["passed"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    theirs, _ = _mlx_load(tmp_path / "mlx")
    want = _mlx_params(theirs)
    got = back.state_dict()
    assert set(want) == set(got)
    for k, v in got.items():
        bits = v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16 else v.numpy()
        assert np.array_equal(bits, np.asarray(want[k])), k
    assert (tmp_path / "back" / "tokenizer.json").exists()
    # mlx-lm 0.32 computes with rope base 10000 for this transformers-5 config (it reads rope_theta
    # only at the top level): the port writes the model mlx-lm runs, and says nothing else
    assert theirs.args.rope_theta == 10000 and back.config.rope_parameters["rope_theta"] == 10000
