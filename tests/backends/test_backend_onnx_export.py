"""ONNX graphs exported by torch's two exporters: linear layers found by module path, whole-model
comparisons against torch through onnxruntime (forward only), and weights moved in place.

A tiny random transformers BERT is exported offline with ``torch.onnx.export(dynamo=False)``
(TorchScript: Gemm/MatMul on constant-folded ``onnx::MatMul_N`` initializers, scopes in node
names) and ``dynamo=True`` (``val_N`` initializers, module paths in node metadata, equal
initializers merged, external data).
"""
from __future__ import annotations

import contextlib
import io
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import dense_bridge as db  # noqa: E402

from conftest import require_backend  # noqa: E402

VOCAB, SEQ = 50, 7


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=32, attn_implementation="eager")

    class Ids(transformers.BertModel):
        """BertModel taking token ids only (the legacy exporter passes arguments positionally)."""

        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, return_dict=True).last_hidden_state

    torch.manual_seed(0)
    # untrained: every bias is zero, and both exporters merge equal initializers into one tensor
    return Ids(cfg, add_pooling_layer=False).eval()


def export(model, args, path, dynamo: bool):
    """torch.onnx.export, offline and quiet (the exporters warn and print progress)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), dynamo=dynamo, input_names=["input_ids"],
                          **({} if dynamo else {"opset_version": 18}))


@pytest.fixture(scope="module", params=["legacy", "dynamo"])
def bert(request, tmp_path_factory):
    require_backend("onnx")
    model = _bert()
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ))
    path = tmp_path_factory.mktemp(request.param) / "bert.onnx"
    export(model, (torch.from_numpy(ids),), path, dynamo=request.param == "dynamo")
    return model, db.load(str(path), "onnx"), ids, path


def test_linear_layers_finds_every_projection_by_its_torch_path(bert):
    model, graph, _, _ = bert
    torch_layers = db.linear_layers(model)
    onnx_layers = db.linear_layers(graph)
    assert list(onnx_layers) == list(torch_layers)
    assert len(onnx_layers) == 2 * 6  # query, key, value, attention output, intermediate, output
    for path, layer in onnx_layers.items():
        want = db.get_params(torch_layers[path])
        got = db.get_params(layer)
        assert sorted(got) == sorted(want), path
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (path, k)


def test_compare_models_torch_vs_onnxruntime_passes_forward_only(bert):
    model, graph, ids, _ = bert
    # onnxruntime has no autograd: the default compares outputs only and the report says so
    report = db.testing.compare_models(model, graph, [ids])
    assert report.passed, str(report)
    assert {q.quantity for q in report.rows} == {"input", "output", "model output"}
    assert any("gradients were not compared" in n.lower() and "forward only" in n for n in report.to_dict()["notes"])


def test_a_transposed_square_projection_is_named(bert):
    model, graph, ids, _ = bert
    graph = _copy(graph)
    target = "encoder.layer.1.attention.self.value"
    layer = db.linear_layers(graph)[target]
    tensor = layer.initializer("kernel")
    assert tuple(tensor.dims) == (16, 16)
    stored = onnx.numpy_helper.to_array(tensor)
    tensor.CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(stored.T), tensor.name))
    report = db.testing.compare_models(model, graph, [ids], grads=False)
    assert not report.passed
    assert report.first_divergence == target, str(report)
    forced = db.testing.compare_models(model, graph, [ids], grads=False, isolated=True)  # run_layer, forward only
    assert forced.first_divergence == target, str(forced)


def _copy(graph):
    out = onnx.ModelProto()
    out.CopyFrom(graph)
    return out


def test_transfer_into_the_export_in_place_then_onnxruntime_matches_torch(bert):
    model, graph, ids, _ = bert
    graph = _copy(graph)
    other = _bert()
    with torch.no_grad():  # fine-tuned linear layers; norms and embeddings as exported
        for name, p in other.named_parameters():
            p.copy_(dict(model.named_parameters())[name])
            if name.rsplit(".", 1)[0] in db.linear_layers(other):
                p.add_(torch.randn_like(p) * 0.05)
    onnx_layers = db.linear_layers(graph)
    bias_names = {layer.slots["bias"].node.input[layer.slots["bias"].pos] for layer in onnx_layers.values()}
    assert len(bias_names) < len(onnx_layers)  # the exporter merged the zero biases
    norms_before = {e.path: e.read() for e in require_backend("onnx").walk(graph) if e.kind == "other"}
    # strict: complete or nothing; the exporter's renamed copies of shared norms have no counterpart
    with pytest.raises(db.ConversionError, match="unwritten|left"):
        db.transfer(other, graph)
    report = db.transfer(other, graph, strict=False)
    moved = {dst for _, dst, _ in report.moved}
    assert set(onnx_layers) <= moved  # every linear layer, and the non-linear parameters of the same path
    # what is left are the exporter's own initializers (renamed copies, baked constants): torch has no
    # parameter of that name
    torch_names = {n.rsplit(".", 1)[0] for n, _ in other.named_parameters()} | set(dict(other.named_parameters()))
    assert report.not_moved_dst and not set(report.not_moved_dst) & torch_names, report.not_moved_dst
    for path, layer in db.linear_layers(graph).items():  # every layer holds exactly what torch holds
        want = db.get_params(db.linear_layers(other)[path])
        assert all(db.get_params(layer)[k].tobytes() == want[k].tobytes() for k in want), path
    # a merged initializer was split, never written for all: what else reads it (norms) kept its value
    for e in require_backend("onnx").walk(graph):
        if e.kind == "other":
            assert all(np.array_equal(v, norms_before[e.path][k]) for k, v in e.read().items()), e.path
    with torch.no_grad():
        want = other(torch.from_numpy(ids)).numpy()
    got = require_backend("onnx").capture(graph, [ids], {}).output
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _TiedLM(torch.nn.Module):
    """An embedding, a body and an output head tied to the embedding (``head.weight = emb.weight``)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.body = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids))))


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_a_tied_head_exported_as_a_folded_copy_is_written_with_its_embedding(tmp_path, dynamo):
    adapter = require_backend("onnx")
    torch.manual_seed(0)
    ids = np.random.default_rng(0).integers(0, 11, size=(2, 5))
    export(_TiedLM().eval(), (torch.from_numpy(ids),), tmp_path / "lm.onnx", dynamo=dynamo)
    graph = db.load(str(tmp_path / "lm.onnx"), "onnx")
    entries = {e.path: e for e in adapter.walk(graph)}
    head_init = db.linear_layers(graph)["head"].initializer("kernel").name
    assert head_init not in [t.name for t in graph.graph.initializer if tuple(t.dims) == (11, 6)]  # a copy
    assert entries["head"].ident["kernel"] == entries["emb"].ident["weight"]  # read as tied
    torch.manual_seed(5)
    tuned = _TiedLM().eval()
    report = db.transfer(tuned, graph, mapping={"emb": "emb", "body": "body"})
    assert report.tied.get("head.kernel") == "emb.weight"
    with torch.no_grad():
        want = tuned(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(adapter.capture(graph, [ids], {}).output, want, rtol=1e-5, atol=1e-6)
