"""The ONNX backend: compiled graphs, the layouts exporters write, in-place writes that split
shared initializers, conversions, and ``.onnx`` files (external data, hostile files refused).

The conformance suite (tests/testing/test_conformance.py) checks every activation and dtype of compiled
graphs against the numpy reference; exported transformers are in test_backend_onnx_export.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import dense_bridge as db  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.external_data_helper import set_external_data  # noqa: E402

from conftest import require_backend  # noqa: E402

RNG = np.random.default_rng(0)


def _model(nodes, inits, inputs=("x",), opset=18):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m


def _run(model, x):
    return require_backend("onnx").capture(model, [x], {}).output


# ------------------------------------------------------------------ compile
def test_compile_gives_a_checked_model_onnxruntime_runs_at_any_rank():
    adapter = require_backend("onnx")
    spec = db.Sequential([db.Dense(5, in_features=3, activation="gelu"), db.Dense(2, mask=db.wiring.banded(5, 2, 1))])
    model = db.compile(spec, "onnx", seed=0)
    assert isinstance(model, onnx.ModelProto)
    # the input and output ranks are left open (any rank runs); onnx.checker wants them fixed
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in list(fixed.graph.input) + list(fixed.graph.output):
        value.type.tensor_type.shape.dim.add().dim_param = "batch"
        value.type.tensor_type.shape.dim.add().dim_value = 3 if value in fixed.graph.input else 2
    onnx.checker.check_model(fixed, full_check=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", adapter.OPSET)]
    ref = db.compile(spec, "numpy", seed=0)
    for shape in [(3,), (4, 3), (2, 3, 3)]:
        x = RNG.normal(size=shape).astype(np.float32)
        np.testing.assert_allclose(_run(model, x), ref.forward(x), rtol=1e-5, atol=1e-6)
    ops = [n.op_type for n in model.graph.node]
    assert "Mul" in ops and ops.count("MatMul") == 2 and "Gelu" in ops  # the mask is a multiply


def test_bfloat16_and_lazy_layers_are_refused_with_clear_errors():
    require_backend("onnx")
    with pytest.raises(db.SpecError, match="onnxruntime.*bfloat16"):
        db.compile(db.Dense(3, in_features=2, dtype="bfloat16"), "onnx", seed=0)
    with pytest.raises(db.SpecError, match="in_features"):
        db.compile(db.Dense(3), "onnx", seed=0)
    with pytest.raises(db.SpecError, match="float64.*gelu"):
        db.compile(db.Dense(3, in_features=2, dtype="float64", activation="gelu"), "onnx", seed=0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_params_round_trip_bit_exact_and_convert_both_ways(dtype):
    require_backend("onnx")
    require_backend("torch")
    spec = db.Sequential([db.Dense(6, in_features=4, activation=db.Activation("leaky_relu", negative_slope=0.3),
                                   dtype=dtype, bias_init="normal"), db.Dense(3, dtype=dtype, use_bias=False)])
    model = db.compile(spec, "onnx", seed=3)
    want = db.get_params(db.compile(spec, "numpy", seed=3))
    got = db.get_params(model)
    assert {k: (v.dtype, v.tobytes()) for k, v in got.items()} == {k: (v.dtype, v.tobytes()) for k, v in want.items()}
    back = db.convert(db.convert(model, to="torch"), to="onnx")
    assert db.to_spec(back) == spec
    assert all(db.get_params(back)[k].tobytes() == want[k].tobytes() for k in want)
    new = {k: (np.asarray(v) * 2).astype(v.dtype) for k, v in want.items()}
    db.set_params(model, new)
    assert all(db.get_params(model)[k].tobytes() == new[k].tobytes() for k in new)


def test_set_params_is_all_or_nothing():
    require_backend("onnx")
    model = db.compile(db.Sequential([db.Dense(4, in_features=3), db.Dense(2)]), "onnx", seed=0)
    before = model.SerializeToString()
    bad = {k: np.zeros_like(v) for k, v in db.get_params(model).items()}
    bad["1.kernel"] = np.zeros((2, 4), np.float32)  # transposed: refused, and nothing else written
    with pytest.raises(db.ConversionError, match="1.kernel"):
        db.set_params(model, bad)
    assert model.SerializeToString() == before


# ------------------------------------------------------------------ the layouts exporters write
def _layouts():
    w = RNG.normal(size=(3, 5)).astype(np.float32)  # canonical (in, units)
    b = RNG.normal(size=(5,)).astype(np.float32)
    return w, b, {
        "gemm-transB1": _model([helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=1)], {"W": w.T, "b": b}),
        "gemm-transB0": _model([helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=0)], {"W": w, "b": b}),
        "matmul-in-out": _model([helper.make_node("MatMul", ["x", "onnx::MatMul_7"], ["z"]),
                                 helper.make_node("Add", ["b", "z"], ["y"])], {"onnx::MatMul_7": w, "b": b}),
        "matmul-transpose": _model([helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
                                    helper.make_node("MatMul", ["x", "wt"], ["z"]),
                                    helper.make_node("Add", ["z", "b"], ["y"])], {"W": w.T, "b": b}),
    }


@pytest.mark.parametrize("name", ["gemm-transB1", "gemm-transB0", "matmul-in-out", "matmul-transpose"])
def test_every_exporter_layout_reads_and_writes_canonically(name):
    require_backend("onnx")
    w, b, models = _layouts()
    model = models[name]
    layers = db.linear_layers(model)
    assert len(layers) == 1
    (path, layer), = layers.items()
    if name == "matmul-in-out":  # a generated name says nothing; the bias' own name is no layer path
        assert layer.generated and path == "onnx::MatMul_7"
    got = db.get_params(layer)
    assert got["kernel"].tobytes() == w.tobytes() and got["bias"].tobytes() == b.tobytes()
    assert db.to_spec(layer) == db.Dense(5, in_features=3, kernel_init="zeros")
    x = RNG.normal(size=(4, 3)).astype(np.float32)
    report = db.testing.compare(layer, db.compile(db.Dense(5, in_features=3), "numpy", params=got),
                                inputs=x[None], grads=False)  # (1, 4, 3): rank 3, which Gemm runs flattened
    assert report.passed and any("gradients were not compared" in n.lower() for n in report.notes)
    w2 = RNG.normal(size=w.shape).astype(np.float32)
    db.set_params(layer, {"kernel": w2, "bias": b})
    np.testing.assert_allclose(_run(model, x), x @ w2 + b, rtol=1e-5, atol=1e-6)


def test_gemm_with_alpha_or_transA_is_not_read_as_a_linear_layer():
    require_backend("onnx")
    w = RNG.normal(size=(3, 5)).astype(np.float32)
    model = _model([helper.make_node("Gemm", ["x", "W"], ["y"], alpha=2.0)], {"W": w})
    assert db.linear_layers(model) == {}
    entries = require_backend("onnx").walk(model)
    assert [e.kind for e in entries] == ["other"]  # its weight is still listed, as a parameter


def test_a_shared_initializer_is_split_when_its_users_get_different_values():
    require_backend("onnx")
    w1, w2 = RNG.normal(size=(4, 4)).astype(np.float32), RNG.normal(size=(4, 4)).astype(np.float32)
    zero = np.zeros(4, np.float32)
    model = _model([helper.make_node("Gemm", ["x", "w1", "shared"], ["h"], transB=1, name="/first/Gemm"),
                    helper.make_node("Gemm", ["h", "w2", "shared"], ["y"], transB=1, name="/second/Gemm")],
                   {"w1": w1, "w2": w2, "shared": zero})
    layers = db.linear_layers(model)
    assert list(layers) == ["first", "second"]
    db.set_params(layers["first"], {"kernel": w1.T, "bias": zero})  # the same value: no split
    assert len(model.graph.initializer) == 3
    bias = np.arange(4, dtype=np.float32)
    db.set_params(layers["second"], {"kernel": w2.T, "bias": bias})
    assert len(model.graph.initializer) == 4
    assert db.get_params(layers["first"])["bias"].tobytes() == zero.tobytes()
    assert db.get_params(layers["second"])["bias"].tobytes() == bias.tobytes()
    x = RNG.normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(model, x), (x @ w1.T) @ w2.T + bias, rtol=1e-5, atol=1e-6)


def test_transfer_from_torch_into_a_graph_by_order_and_all_or_nothing():
    torch = pytest.importorskip("torch")
    require_backend("onnx")
    w, b, models = _layouts()
    model = models["gemm-transB1"]
    src = torch.nn.Sequential(torch.nn.Linear(3, 5))
    db.transfer(src, model)
    assert db.get_params(db.linear_layers(model)["W"])["kernel"].tobytes() == \
        src[0].weight.detach().numpy().T.copy().tobytes()
    before = model.SerializeToString()
    with pytest.raises(db.ConversionError, match="nothing was written"):
        db.transfer(torch.nn.Sequential(torch.nn.Linear(3, 4)), model)
    assert model.SerializeToString() == before


# ------------------------------------------------------------------ files
def test_save_and_load_onnx_files_with_external_data(tmp_path):
    adapter = require_backend("onnx")
    spec = db.Sequential([db.Dense(40, in_features=30, activation="tanh"), db.Dense(3)])
    model = db.compile(spec, "onnx", seed=1)
    files = adapter.write_model(model, str(tmp_path / "m.onnx"), external=True)
    assert os.path.basename(files[1]) == "m.onnx.data" and os.path.getsize(files[1]) >= 4 * 30 * 40
    back = db.load(str(tmp_path / "m.onnx"), "onnx")
    assert db.to_spec(back) == spec
    assert all(db.get_params(back)[k].tobytes() == v.tobytes() for k, v in db.get_params(model).items())
    spec2, params = db.load(str(tmp_path / "m.onnx"))
    assert spec2 == spec and sorted(params) == sorted(db.get_params(model))
    # db.save: a .onnx path writes ONNX from any backend's model
    require_backend("torch")
    db.save(db.convert(model, to="torch"), str(tmp_path / "t.onnx"))
    assert db.to_spec(db.load(str(tmp_path / "t.onnx"), "onnx")) == spec


def _external_model(tmp_path, location, dims=(2, 3), offset=0, length=None):
    t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=list(dims), raw_data=b"\0")
    set_external_data(t, location, offset=offset, length=length)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [t])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    return str(path)


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink", "fifo", "huge", "short-file"])
def test_hostile_files_are_refused_and_nothing_outside_is_read(tmp_path, case):
    require_backend("onnx")
    inside = tmp_path / "model"
    inside.mkdir()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.ones(6, np.float32).tobytes())
    if case == "dotdot":
        path, why = _external_model(inside, "../secret.bin"), "outside the model's directory"
    elif case == "absolute":
        path, why = _external_model(inside, str(secret)), "outside the model's directory"
    elif case == "symlink":
        os.symlink(secret, inside / "w.bin")
        path, why = _external_model(inside, "w.bin"), "link leading outside"
    elif case == "fifo":
        os.mkfifo(inside / "w.bin")
        path, why = _external_model(inside, "w.bin"), "not a regular file"
    elif case == "huge":
        (inside / "w.bin").write_bytes(b"\0" * 24)
        path, why = _external_model(inside, "w.bin", dims=(1 << 30, 1 << 20)), "more memory"
    else:
        (inside / "w.bin").write_bytes(b"\0" * 8)
        path, why = _external_model(inside, "w.bin"), "truncated"
    with pytest.raises(db.CheckpointError, match=why):
        db.load(path, "onnx")


def test_truncated_protobuf_and_a_fifo_model_are_refused(tmp_path):
    require_backend("onnx")
    model = db.compile(db.Dense(30, in_features=20), "onnx", seed=0)
    data = model.SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(db.CheckpointError, match="cut.onnx"):
        db.load(str(tmp_path / "cut.onnx"), "onnx")
    os.mkfifo(tmp_path / "pipe.onnx")
    with pytest.raises(db.CheckpointError):
        db.load(str(tmp_path / "pipe.onnx"), "onnx")
    corrupt = onnx.ModelProto()
    corrupt.CopyFrom(model)
    corrupt.graph.initializer[0].dims[0] = 1 << 20  # claims far more values than its bytes hold
    (tmp_path / "claim.onnx").write_bytes(corrupt.SerializeToString())
    with pytest.raises(db.CheckpointError, match="corrupted"):
        db.load(str(tmp_path / "claim.onnx"), "onnx")


def test_cli_converts_checks_and_inspects_onnx(tmp_path):
    require_backend("onnx")
    spec = db.Sequential([db.Dense(8, in_features=5, activation="silu"), db.Dense(2, activation="softmax")])
    src = tmp_path / "m.safetensors"
    db.save((spec, db.get_params(db.compile(spec, "numpy", seed=0))), str(src))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dense_bridge.cli", *args], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})

    out = cli("convert", str(src), "--to", "onnx", "-o", str(tmp_path / "m.onnx"))
    assert out.returncode == 0, out.stderr
    out = cli("inspect", str(tmp_path / "m.onnx"))
    assert out.returncode == 0 and "ONNX model file" in out.stdout and "silu" in out.stdout, out.stdout + out.stderr
    out = cli("check", str(tmp_path / "m.onnx"), str(src))
    # onnxruntime has no gradients: the check compares outputs and says gradients were not compared
    assert out.returncode == 0 and "forward only" in out.stdout and "equivalent" in out.stdout, out.stdout + out.stderr
    out = cli("check", str(tmp_path / "m.onnx"), str(src), "--no-grads")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gradients were not compared" in out.stdout.lower() and "PASS" in out.stdout
