"""``dense-bridge check A B --mapping MAP.json --inputs X.npz``: whole model files, layer by layer.

A transformers BERT saved whole with ``torch.save`` and its keras-hub port saved as ``.keras``;
the mapping is the JSON form of the port's regex rules. Run in-process (``cli.main``) to spare a
second framework start-up.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import _compare_ports as P
import dense_bridge as db
from dense_bridge.cli import _main as cli

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("keras_hub")
    import torch

    d = tmp_path_factory.mktemp("models")
    src = P.torch_bert(0)
    port = P.keras_bert()
    P.port_bert(src, port)
    torch.save(src, d / "bert.pt")
    port.save(d / "port.keras")
    # a wrong port: one square projection transposed
    layer = db.linear_layers(port)["transformer_layer_0/self_attention_layer/value"]
    params = db.get_params(layer)
    db.set_params(layer, {**params, "kernel": np.ascontiguousarray(params["kernel"].T)})
    port.save(d / "wrong.keras")
    (d / "map.json").write_text(json.dumps([list(r) for r in P.BERT_RULES]))
    ins_torch, ins_keras = P.bert_inputs(0)
    np.savez(d / "torch_in.npz", **ins_torch)
    np.savez(d / "keras_in.npz", **ins_keras)
    return d


def _check(d, b, *extra):
    return cli.main(["check", str(d / "bert.pt"), str(d / b), "--mapping", str(d / "map.json"),
                     "--inputs", str(d / "torch_in.npz"), "--inputs-b", str(d / "keras_in.npz"),
                     "--trust-pickle", *extra])


def test_check_two_model_files_with_a_mapping(files, capsys, tmp_path):
    assert _check(files, "port.keras", "--html", str(tmp_path / "r.html")) == 0
    out = capsys.readouterr().out
    assert "encoder.layer.0.attention.self.query" in out and out.strip().endswith("equivalent")
    assert "<svg" in (tmp_path / "r.html").read_text()

    assert _check(files, "wrong.keras", "--json") == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["equivalent"] is False
    assert doc["report"]["first_divergence"] == "transformer_layer_0/self_attention_layer/value"
    assert doc["report"]["first_divergence_a"] == "encoder.layer.0.attention.self.value"


def test_check_model_files_refuses_what_it_cannot_read(files, capsys):
    # unpickling runs code: never without --trust-pickle
    code = cli.main(["check", str(files / "bert.pt"), str(files / "port.keras"), "--mapping",
                     str(files / "map.json"), "--inputs", str(files / "torch_in.npz")])
    assert code == 2 and "--trust-pickle" in capsys.readouterr().err
    (files / "bad.json").write_text('{"a": 1}')
    assert _check(files, "port.keras", "--mapping", str(files / "bad.json")) == 2
    assert "--mapping" in capsys.readouterr().err
    # well-formed rules that pair nothing: the error names the file they came from
    (files / "nomatch.json").write_text('{"no.such.layer": "transformer_layer_0/self_attention_layer/value"}')
    assert _check(files, "port.keras", "--mapping", str(files / "nomatch.json")) == 2
    err = capsys.readouterr().err
    assert f"--mapping {files / 'nomatch.json'}" in err and "no.such.layer" in err
    code = cli.main(["check", str(files / "bert.pt"), str(files / "map.json"), "--inputs",
                     str(files / "torch_in.npz"), "--trust-pickle"])
    assert code == 2 and "whole model" in capsys.readouterr().err
