"""The port certificate and its check: db.verify_port and ``dense-bridge verify`` name a tensor edited
after the port, a missing shard, a swapped file; ``dense-bridge port`` exit codes."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.cli._main import main

from _port_helpers import mlx_lm_or_skip, transformers_or_skip
from _models import save


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """A sharded tiny Llama ported to mlx-lm (three weight files)."""
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    base = tmp_path_factory.mktemp("cert")
    model = save(transformers, "llama", base / "one")
    model.save_pretrained(base / "src", max_shard_size="40KB")
    report = db.port(base / "src", base / "out", to="mlx-lm", verify="twins")
    return base, report


def _fresh(ported, tmp_path):
    base, _ = ported
    out = tmp_path / "out"
    shutil.copytree(base / "out", out)
    cert = json.loads((out / "port_certificate.json").read_text())
    return out, cert


def test_the_certificate_holds_every_field(ported):
    base, report = ported
    cert = json.loads((base / "out" / "port_certificate.json").read_text())
    assert cert == json.loads(json.dumps(report.certificate))
    assert cert["source"]["format"] == "transformers" and cert["destination"]["format"] == "mlx-lm"
    assert cert["source"]["architecture"] == ["LlamaForCausalLM"]
    shards = sorted(p.name for p in (base / "src").glob("model-*.safetensors"))
    assert len(shards) > 1 and set(shards) <= set(cert["source"]["files"])
    assert all(len(h) == 64 for h in cert["destination"]["files"].values())
    assert {"transformers", "mlx-lm", "dense_bridge"} <= set(cert["libraries"])
    assert cert["rules"] and all(len(r) == 2 for r in cert["rules"])
    v = cert["verification"]
    assert v["mode"] == "twins" and v["passed"] and v["positions"] >= 256
    for key in ("worst_layer", "worst_tolerance_units", "kl_divergence", "top1_agreement"):
        assert key in v
    written = set()
    for p in (base / "out").glob("model*.safetensors"):
        from safetensors import safe_open

        with safe_open(str(p), "np") as f:
            written |= set(f.keys())
    assert set(cert["tensors"]) == written  # an entry for every tensor written, and no other
    entry = cert["tensors"]["model.layers.1.self_attn.k_proj.weight"]
    assert entry["sources"] == [{"file": entry["sources"][0]["file"], "tensor": "model.layers.1.self_attn.k_proj.weight",
                                 "slice": [[0, 16], [0, 32]], "transpose": False}]
    assert entry["ops"] == ["copy"] and entry["dtypes"] == ["float32", "float32"]
    assert entry["exact"] is True and entry["max_ulp"] == 0 and entry["codes"] is None


def test_verify_passes_on_an_untouched_port(ported, capsys):
    base, _ = ported
    report = db.verify_port(base / "out")
    assert report.passed and report.problems == [] and report.tensors > 20
    assert main(["verify", str(base / "out")]) == 0


def test_verify_names_a_tensor_edited_after_the_port(ported, tmp_path, capsys):
    out, cert = _fresh(ported, tmp_path)
    target = "model.layers.0.mlp.down_proj.weight"
    shard = out / cert["tensors"][target]["file"]
    from dense_bridge.checkpoints._safetensors import SafetensorsFile

    with SafetensorsFile(shard) as f:
        start = f.tensors[target].start
    raw = bytearray(shard.read_bytes())
    raw[start:start + 4] = np.float32(123.0).tobytes()
    shard.write_bytes(bytes(raw))
    report = db.verify_port(out)
    assert not report.passed
    assert any(target in p and "does not hold" in p for p in report.problems), report.problems
    assert sum(target in p for p in report.problems) == 1  # that tensor, no other
    assert main(["verify", str(out)]) == 1
    assert target in capsys.readouterr().out


def test_verify_names_a_missing_shard(ported, tmp_path, capsys):
    out, cert = _fresh(ported, tmp_path)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.unlink()
    report = db.verify_port(out)
    assert any(shard.name in p and "missing" in p for p in report.problems), report.problems
    assert main(["verify", str(out)]) == 1


def test_verify_names_swapped_files(ported, tmp_path):
    out, cert = _fresh(ported, tmp_path)
    a, b = sorted(out.glob("model-*.safetensors"))[:2]
    tmp = out / "swap"
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)
    report = db.verify_port(out)
    assert not report.passed
    assert any(a.name in p for p in report.problems) and any(b.name in p for p in report.problems)


def test_verify_bad_input_exits_2(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(db.CheckpointError, match="port_certificate.json"):
        db.verify_port(tmp_path / "nothing")
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "port_certificate.json" in capsys.readouterr().err


def test_the_port_command_exit_codes(ported, tmp_path, capsys, monkeypatch):
    base, _ = ported
    assert main(["port", str(base / "one"), "--to", "mlx-lm", "-o", str(tmp_path / "a"), "--verify", "twins",
                 "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ported"] and doc["destination"] == "mlx-lm" and doc["verification"]["passed"]
    assert main(["port", str(base / "one"), "--to", "mlx-lm", "-o", str(tmp_path / "p"), "--verify", "twins",
                 "--progress"]) == 0
    captured = capsys.readouterr()
    assert "tensors" in captured.err and "MB" in captured.err and "ported transformers -> mlx-lm" in captured.out
    assert main(["port", str(base / "one"), "--to", "mlx-lm", "-o", str(tmp_path / "a")]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err
    from dense_bridge.backends.mlx import _ports as _model_dirs

    monkeypatch.setattr(_model_dirs, "READS_AS", {})  # the rope base lost: the twins disagree
    assert main(["port", str(base / "one"), "--to", "mlx-lm", "-o", str(tmp_path / "b")]) == 1
    assert "twins disagree" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_check_takes_two_model_directories(ported, tmp_path, capsys):
    base, _ = ported
    assert main(["check", str(base / "src"), str(base / "out"), "--positions", "64"]) == 0
    assert "mlx-lm" in capsys.readouterr().out
    # a different model in B: exit 1 naming the first diverging layer
    transformers = transformers_or_skip()
    save(transformers, "llama", tmp_path / "other", seed=5)
    assert main(["check", str(base / "src"), str(tmp_path / "other"), "--positions", "64"]) == 1
    assert "first divergence at model.layers.0" in capsys.readouterr().out
