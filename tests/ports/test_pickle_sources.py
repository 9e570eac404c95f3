"""transformers directories whose weights are ``pytorch_model*.bin`` pickles (what transformers 4
wrote with ``safe_serialization=False``) port like safetensors ones: read by ``torch.load(weights_only=True,
mmap=True)`` only, streamed, bit-identical to porting the same model saved as safetensors, with the
certificate naming the .bin files and ``dense-bridge verify`` re-reading them the same safe way."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import mlx_lm_or_skip, transformers_or_skip
from _models import save, save_as_pickles


def _weights(path) -> dict[str, bytes]:
    """Every tensor of every safetensors file in ``path``: name -> (dtype, shape, bytes)."""
    from dense_bridge.checkpoints._safetensors import SafetensorsFile

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(path, name)) as f:
                for k in f.keys():
                    a = f.get(k)
                    out[k] = (str(a.dtype), a.shape, a.tobytes())
    return out


@pytest.mark.parametrize("name,dtype,shard", [("qwen2", None, None), ("qwen2", None, "40KB"),
                                              ("llama", "bfloat16", "40KB")])
def test_a_pickled_source_ports_bit_identical_to_its_safetensors_twin(tmp_path, name, dtype, shard):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import torch

    model = save(transformers, name, tmp_path / "st", dtype=getattr(torch, dtype) if dtype else None)
    bins = save_as_pickles(model, tmp_path / "bin", max_shard_size=shard)
    assert (len(bins) > 1) == bool(shard) and not list((tmp_path / "bin").glob("*.safetensors"))
    if name == "qwen2":  # tied: torch.save kept the head under its own name, sharing the embedding's storage
        state = torch.load(tmp_path / "bin" / bins[0], weights_only=True)
        assert "lm_head.weight" in state
    ref = db.port(tmp_path / "st", tmp_path / "from_st", to="mlx-lm", verify="twins")
    report = db.port(tmp_path / "bin", tmp_path / "from_bin", to="mlx-lm", verify="full")
    assert report.verification["passed"] and report.verification["mode"] == "full"
    assert report.verification["top1_agreement"] == 1.0 or dtype  # bfloat16 arithmetic differs between libraries
    a, b = _weights(tmp_path / "from_bin"), _weights(tmp_path / "from_st")
    assert a.keys() == b.keys() and len(a) == ref.tensors
    for k in a:
        assert a[k] == b[k], k
    cert = report.certificate
    assert cert["source"].get("aliases") == ({"lm_head.weight": "model.embed_tokens.weight"} if name == "qwen2" else None)
    assert set(cert["source"]["files"]) >= set(bins)
    files = {s["file"] for t in cert["tensors"].values() for s in t["sources"]}
    assert files == set(bins)
    if dtype:
        assert all(t["dtypes"] == ["bfloat16", "bfloat16"] and t["exact"] for t in cert["tensors"].values())
    # back to transformers: the model it was, loaded by from_pretrained
    db.port(tmp_path / "from_bin", tmp_path / "back", to="transformers", verify="twins")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    sd = back.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k
    # verify re-reads the .bin sources (weights_only, mapped) and names an edited one
    assert db.verify_port(tmp_path / "from_bin").passed


def test_verify_rereads_pickled_sources_and_names_an_edited_tensor(tmp_path, capsys):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import torch

    from dense_bridge.cli._main import main

    model = save(transformers, "llama", tmp_path / "st")
    save_as_pickles(model, tmp_path / "bin")
    db.port(tmp_path / "bin", tmp_path / "out", to="mlx-lm", verify="twins")
    assert main(["verify", str(tmp_path / "out")]) == 0
    path = tmp_path / "bin" / "pytorch_model.bin"
    state = torch.load(path, weights_only=True)
    state["model.layers.1.mlp.up_proj.weight"][0, 0] += 1.0
    torch.save(state, path)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out")]) == 1
    text = capsys.readouterr().out
    assert "pytorch_model.bin" in text and "model.layers.1.mlp.up_proj.weight" in text


def test_a_legacy_pickle_is_refused_naming_the_file_and_what_to_do(tmp_path):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import torch

    model = save(transformers, "llama", tmp_path / "st")
    (tmp_path / "src").mkdir()
    model.config.save_pretrained(tmp_path / "src")
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(db.CheckpointError, match=r"pytorch_model\.bin is a legacy.*cannot be memory-mapped.*"
                                                 r"safe_serialization=True"):
        db.port(tmp_path / "src", tmp_path / "out", to="mlx-lm", verify="twins")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "st"]


def test_a_pickle_is_memory_mapped_not_read(tmp_path):
    """Opening a 128 MB ``.bin`` for the port reads its pickle, not its tensors' bytes."""
    torch = pytest.importorskip("torch")
    if not os.path.exists("/proc/self/status"):
        pytest.skip("resident memory is read from /proc/self/status")
    from dense_bridge.ports._dirs import Format, open_weights

    path = tmp_path / "pytorch_model.bin"
    torch.save({"big": torch.ones(32, 1 << 20)}, path)

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    torch.save({"small": torch.ones(3)}, tmp_path / "small.bin")
    open_weights(Format("transformers"), str(tmp_path / "small.bin")).close()  # first-use imports done
    before = rss()
    f = open_weights(Format("transformers"), str(path))
    assert f.tensors["big"].shape == (32, 1 << 20) and f.tensors["big"].numpy_dtype == np.float32
    view = f.get("big")
    assert rss() - before < (16 << 20)  # the tensor's 128 MB are mapped, not read
    assert float(view[31, -1]) == 1.0  # and read where touched
    f.close()
