"""A Keras model's fine-tuned weights moved into an ONNX graph exported from its torch twin.

The deployment story: the graph exists (exported once from torch), training went on in Keras,
and the new weights go into the graph in place, without exporting again. Run once per torch
exporter (legacy: Gemm ``transB=1``; dynamo: MatMul on folded (in, out) initializers).
"""
from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import dense_bridge as db  # noqa: E402

from conftest import require_backend  # noqa: E402


def _keras_model(rank: int):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((None,) * (rank - 2) + (6,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _torch_twin():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).eval()


@pytest.mark.parametrize("dynamo, shape, op", [(False, (32, 6), "Gemm"), (True, (8, 4, 6), "MatMul")],
                         ids=["legacy-rank2-gemm", "dynamo-rank3-matmul"])
def test_fine_tuned_keras_weights_into_the_torch_export(tmp_path, dynamo, shape, op):
    require_backend("onnx")
    require_backend("keras")
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    path = tmp_path / "twin.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(_torch_twin(), (torch.from_numpy(x[:4]),), str(path), dynamo=dynamo,
                          input_names=["x"], dynamic_axes=None if dynamo else {"x": {0: "batch"}},
                          dynamic_shapes=({0: torch.export.Dim("batch")},) if dynamo else None,
                          **({} if dynamo else {"opset_version": 18}))
    graph = db.load(str(path), "onnx")
    ops = {n.op_type for n in graph.graph.node}
    assert op in ops and ({"Gemm", "MatMul"} - {op}).isdisjoint(ops), ops  # the layout this case reads

    model = _keras_model(len(shape))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, rng.normal(size=shape[:-1] + (3,)).astype(np.float32), epochs=3, batch_size=8, verbose=0)

    report = db.transfer(model, graph)
    assert len(report.moved) == 3
    want = np.asarray(model.predict(x, verbose=0))
    got = require_backend("onnx").capture(graph, [x], {}).output
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the file on disk is untouched until saved; saved and read back, it computes the same
    db.save(graph, str(tmp_path / "tuned.onnx"))
    again = db.load(str(tmp_path / "tuned.onnx"), "onnx")
    np.testing.assert_array_equal(require_backend("onnx").capture(again, [x], {}).output, got)
