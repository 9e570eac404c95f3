"""ONNX graphs other tools wrote, read as specs: MLPs exported by ``torch.onnx.export`` (the
TorchScript exporter, ``dynamo=False``, and the dynamo one) load, convert and run as the torch
model does; graphs that are not chains of linear layers and activations are refused naming the
node; hostile graphs (external data of nested graphs, duplicate initializer names, files too
large to read) are refused naming the file and the tensor.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import dense_bridge as db  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.external_data_helper import set_external_data  # noqa: E402
from torch import nn  # noqa: E402

from conftest import require_backend  # noqa: E402

EXPORTERS = ["legacy", "dynamo"]


def export(model, x, path, exporter: str, opset: int = 18, **kw) -> str:
    """torch.onnx.export, offline and quiet (both exporters print and warn)."""
    logging.disable(logging.WARNING)  # the dynamo exporter logs skipped torchvision ops
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x,), str(path), dynamo=exporter == "dynamo", opset_version=opset, **kw)
    finally:
        logging.disable(logging.NOTSET)
    return str(path)


def _strip(spec):
    """A spec without what no graph records (initializers, names)."""
    if isinstance(spec, db.Sequential):
        return db.Sequential([_strip(l) for l in spec.layers], in_features=spec.in_features)
    if isinstance(spec, db.Dense):
        return spec.replace(kernel_init="zeros", bias_init="zeros", name=None)
    return spec


def _every_activation():
    """An MLP with an activation module of every kind torch and the table share between its layers."""
    acts = [nn.ReLU(), nn.Tanh(), nn.Sigmoid(), nn.GELU(), nn.GELU(approximate="tanh"), nn.Softplus(), nn.ELU(0.7),
            nn.LeakyReLU(0.2), nn.SiLU(), nn.SELU(), nn.ReLU6(), nn.Hardsigmoid(), nn.Hardswish(), nn.Mish(),
            nn.Softsign(), nn.LogSoftmax(-1), nn.Softmax(-1)]
    layers = [nn.Linear(3, 6)]
    for i, act in enumerate(acts):
        layers += [act, nn.Linear(6, 6, bias=i % 3 != 1)]
    torch.manual_seed(0)
    return nn.Sequential(*layers).eval()


def _check_read(model, path, x, *, atol=0.0):
    """db.load(path) gives torch's spec and parameters, and the spec compiled with them computes what
    ``model`` does; returns (spec, params)."""
    spec, params = db.load(path)
    want = db.to_spec(model)
    assert _strip(spec) == _strip(want)
    torch_params = db.get_params(model)
    assert sorted(params) == sorted(torch_params)
    for k, v in torch_params.items():
        assert params[k].dtype == v.dtype and params[k].tobytes() == v.tobytes(), k
    rebuilt = db.compile(spec, "torch", params=params)
    with torch.no_grad():
        got, expected = rebuilt(x).float().numpy(), model(x).float().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)
    return spec, params


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_an_exported_mlp_with_every_activation_loads_as_torchs_spec(tmp_path, exporter):
    require_backend("onnx")
    model = _every_activation()
    x = torch.randn(5, 3) * 3
    path = export(model, x, tmp_path / "mlp.onnx", exporter)
    # torch's softplus (threshold 20) and the table's exact one differ by an ulp at most
    spec, params = _check_read(model, path, x, atol=1e-6)
    names = [l.name for l in spec.layers if isinstance(l, db.Activation)]
    assert names == ["relu", "tanh", "sigmoid", "gelu", "gelu_tanh", "softplus", "elu", "leaky_relu", "silu",
                     "selu", "relu6", "hard_sigmoid", "hard_silu", "mish", "softsign", "log_softmax", "softmax"]
    assert spec.layers[13] == db.Activation("elu", alpha=0.7)  # the float32 attribute read as the decimal given
    assert spec.layers[15] == db.Activation("leaky_relu", negative_slope=0.2)
    # the native object: onnxruntime runs it as torch does, layer by layer
    graph = db.load(path, "onnx")
    assert _strip(db.to_spec(graph)) == _strip(spec)
    report = db.testing.compare(graph, db.compile(spec, "numpy", params=params), inputs=x.numpy(), grads=False)
    assert report.passed, str(report)
    assert len(report.layers) == len(spec.layers)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("case", ["rank3-no-bias", "float16", "bfloat16", "opset17", "opset20", "lone-linear",
                                  "two-activations", "flatten", "softmax-dim1-unfolded", "dropout"])
def test_exported_layouts_dtypes_and_opsets(tmp_path, exporter, case):
    require_backend("onnx")
    torch.manual_seed(1)
    x, opset, atol, kw = torch.randn(4, 3), 18, 0.0, {}
    if case == "rank3-no-bias":  # MatMul on a folded (in, out) initializer, then Add
        model, x = nn.Sequential(nn.Linear(3, 5, bias=False), nn.GELU(), nn.Linear(5, 2)), torch.randn(2, 4, 3)
    elif case == "float16":
        model, x = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 2)).half(), x.half()
        atol = 2e-3  # torch computes float16 in float16, the compiled spec through float32
    elif case == "bfloat16":
        model, x = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).bfloat16(), x.bfloat16()
        atol = 2e-2
    elif case == "opset17":
        model, opset = nn.Sequential(nn.Linear(3, 5), nn.Mish(), nn.Linear(5, 2)), 17
    elif case == "opset20":  # Gelu is an operator from opset 20
        model, opset = nn.Sequential(nn.Linear(3, 5), nn.GELU(approximate="tanh"), nn.Linear(5, 2)), 20
    elif case == "lone-linear":
        model = nn.Linear(3, 5)
    elif case == "two-activations":
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Tanh(), nn.Linear(5, 2))
    elif case == "dropout":  # a position the graph loses: read back as Identity(), so the keys stay torch's
        model = nn.Sequential(nn.Dropout(0.1), nn.Linear(3, 5), nn.Dropout(0.2), nn.GELU(), nn.Linear(5, 2))
    elif case == "softmax-dim1-unfolded":  # axis 1 of a rank-2 value; without folding: MatMul on Transpose(W)
        model = nn.Sequential(nn.Linear(3, 5), nn.Softmax(dim=1), nn.Linear(5, 2, bias=False))
        kw = {"do_constant_folding": False} if exporter == "legacy" else {}
    else:
        if exporter == "dynamo":
            pytest.skip("the dynamo exporter writes nn.Flatten as a Reshape to the example's batch size")
        model, x = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.Sigmoid(), nn.Linear(5, 2)), torch.randn(4, 2, 3)
    model = model.eval()
    path = export(model, x, tmp_path / "m.onnx", exporter, opset, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's reading warns that Dropout is read as the identity
        spec, params = _check_read(model, path, x, atol=atol)
    if case == "dropout":
        assert sorted(params) == ["1.bias", "1.kernel", "4.bias", "4.kernel"]
    if kw:
        assert "Transpose" in [n.op_type for n in onnx.load(path).graph.node]
    if case == "lone-linear":
        assert isinstance(spec, db.Dense) and sorted(params) == ["bias", "kernel"]
    if case in ("float16", "bfloat16"):
        assert {l.dtype for l in spec.layers if isinstance(l, db.Dense)} == {case}


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_convert_set_params_and_the_cli_on_an_export(tmp_path, exporter):
    require_backend("onnx")
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 3, bias=False), nn.Softplus()).eval()
    x = torch.randn(6, 4)
    path = export(model, x, tmp_path / "m.onnx", exporter)
    graph = db.load(path, "onnx")
    back = db.convert(graph, to="torch")
    with torch.no_grad():
        np.testing.assert_allclose(back(x).numpy(), model(x).numpy(), rtol=0, atol=1e-6)
    # writes land in the graph's own initializers: onnxruntime then computes the new weights
    other = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 3, bias=False), nn.Softplus()).eval()
    db.set_params(graph, db.get_params(other))
    got = require_backend("onnx").capture(graph, [x.numpy()], {}).output
    with torch.no_grad():
        np.testing.assert_allclose(got, other(x).numpy(), rtol=1e-5, atol=1e-6)
    out = subprocess.run([sys.executable, "-m", "dense_bridge.cli", "convert", path, "--to", "torch", "-o",
                          str(tmp_path / "m.safetensors")], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    spec, params = db.load(str(tmp_path / "m.safetensors"), spec=db.to_spec(model))
    assert all(params[k].tobytes() == v.tobytes() for k, v in db.get_params(model).items())


# ------------------------------------------------------------------ graphs that are not chains
class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) + x)


class _Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h * torch.sigmoid(1.5 * h))  # no activation of the table


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("model, op", [(_Residual, "Add"), (_Unknown, "Mul"),
                                       (lambda: nn.Sequential(nn.Linear(4, 4), nn.Softplus(beta=2.0)), "Mul")])
def test_graphs_that_are_not_chains_are_refused_naming_the_node(tmp_path, exporter, model, op):
    require_backend("onnx")
    path = export(model().eval(), torch.randn(2, 4), tmp_path / "m.onnx", exporter)
    graph = onnx.load(path)
    with pytest.raises(db.ConversionError, match=f"not a chain of linear layers and activations: node '[^']+' "
                                                 f"\\({op}\\)") as info:
        db.to_spec(graph)
    assert "linear_layers" in str(info.value)
    with pytest.raises(db.ConversionError, match=f"not a chain of linear layers and activations: node '[^']+' "
                                                 f"\\({op}\\)"):
        db.load(path)
    assert isinstance(db.load(path, "onnx"), onnx.ModelProto)  # still a model of its own backend
    assert db.linear_layers(graph)  # its linear layers are still found one by one


def _model(nodes, inits, inputs=("x",), outputs=("y",)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def test_hand_built_layouts_constant_weights_and_refusals():
    require_backend("onnx")
    rng = np.random.default_rng(0)
    w1, b1, w2 = (rng.normal(size=s).astype(np.float32) for s in [(3, 5), (5,), (5, 2)])
    # a weight in a Constant node behind an Identity, a transposed one, erf-gelu, a LeakyRelu with alpha
    model = _model([
        helper.make_node("Constant", [], ["w1"], name="c1", value=numpy_helper.from_array(w1)),
        helper.make_node("Identity", ["w1"], ["w1i"], name="id"),
        helper.make_node("MatMul", ["x", "w1i"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["z"], name="add1"),
        helper.make_node("LeakyRelu", ["z"], ["a"], name="act", alpha=0.3),
        helper.make_node("Transpose", ["w2t"], ["w2"], name="tr", perm=[1, 0]),
        helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2")], {"b1": b1, "w2t": w2.T})
    spec = db.to_spec(model)
    assert spec == db.Sequential([db.Dense(5, in_features=3, kernel_init="zeros"),
                                  db.Activation("leaky_relu", negative_slope=0.3),
                                  db.Dense(2, in_features=5, use_bias=False, kernel_init="zeros")])
    params = db.get_params(model)
    assert params["0.kernel"].tobytes() == w1.tobytes() and params["2.kernel"].tobytes() == w2.tobytes()
    new = {k: v + 1 for k, v in params.items()}
    db.set_params(model, new)  # into the Constant node's tensor and the transposed initializer, in place
    x = rng.normal(size=(4, 3)).astype(np.float32)
    z = x @ new["0.kernel"] + new["0.bias"]
    want = np.where(z > 0, z, 0.3 * z) @ new["2.kernel"]
    np.testing.assert_allclose(require_backend("onnx").capture(model, [x], {}).output, want, rtol=1e-5, atol=1e-5)
    gemm = _model([helper.make_node("Gemm", ["x", "W", "b"], ["z"], name="g", transB=0),
                   helper.make_node("Tanh", ["z"], ["y"], name="t")], {"W": w1, "b": b1})
    assert db.to_spec(gemm) == db.Sequential([db.Dense(5, in_features=3, kernel_init="zeros"), db.Activation("tanh")])
    assert db.get_params(gemm)["0.kernel"].tobytes() == w1.tobytes()
    alpha = _model([helper.make_node("Gemm", ["x", "W"], ["y"], name="g", alpha=2.0)], {"W": w1})
    with pytest.raises(db.ConversionError, match=r"node 'g' \(Gemm\).*alpha=2"):
        db.to_spec(alpha)
    two = _model([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                  helper.make_node("Add", ["h", "x2"], ["y"], name="plus")], {"W": np.eye(3)}, inputs=("x", "x2"))
    with pytest.raises(db.ConversionError, match="takes 2 inputs"):
        db.to_spec(two)
    cos = _model([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                  helper.make_node("Cos", ["h"], ["y"], name="wave")], {"W": np.eye(3)})
    with pytest.raises(db.ConversionError, match=r"node 'wave' \(Cos\) is no operator of an activation"):
        db.to_spec(cos)
    # the output computed beside the chain (an If whose branches read the chain's value from the outer scope)
    then = helper.make_graph([helper.make_node("Relu", ["h"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    branch = _model([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                     helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=then)],
                    {"W": np.eye(3), "c": np.ones(())})
    with pytest.raises(db.ConversionError, match=r"node 'branch' \(If\)"):
        db.to_spec(branch)
    # built to exhaust: 3000 activations in a row, and products that double at every step when unfolded
    deep = _model([helper.make_node("MatMul", ["x", "W"], ["t0"], name="mm")]
                  + [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"r{i}") for i in range(3000)]
                  + [helper.make_node("Identity", ["t3000"], ["y"], name="out")], {"W": np.eye(3)})
    with pytest.raises(db.ConversionError, match="a path too long"):
        db.to_spec(deep)
    wide = _model([helper.make_node("MatMul", ["x", "W"], ["t0"], name="mm")]
                  + [helper.make_node("Mul", [f"t{i}", f"t{i}"], [f"t{i + 1}"], name=f"m{i}") for i in range(60)]
                  + [helper.make_node("Identity", ["t60"], ["y"], name="out")], {"W": np.eye(3)})
    with pytest.raises(db.ConversionError, match="node 'm0' \\(Mul\\) begins activations.*more than 512 terms"):
        db.to_spec(wide)
    text = _model([helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                   helper.make_node("Constant", [], ["s"], name="s", value=helper.make_tensor("s", TensorProto.STRING,
                                                                                            [], [b"x"])),
                   helper.make_node("Mul", ["h", "s"], ["y"], name="odd")], {"W": np.eye(3)})
    with pytest.raises(db.ConversionError, match="node 'odd' \\(Mul\\) reads 's', a constant of element type STRING"):
        db.to_spec(text)


# ------------------------------------------------------------------ hostile files
def _external(name: str, location: str, dims=(3, 3)) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(dims), raw_data=b"\0")
    set_external_data(t, location, offset=0, length=4 * int(np.prod(dims)))
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    return t


def _if_model(inner_init: TensorProto, extra_inits=()) -> onnx.ModelProto:
    """y = Gemm(x, I) @ (cond ? W : W): W an initializer of both branches' subgraphs."""
    def branch(name):
        return helper.make_graph([helper.make_node("Identity", [inner_init.name], [f"{name}_out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)],
                                 [inner_init, *extra_inits])

    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["w"], name="choose", then_branch=branch("then"), else_branch=branch("else")),
         helper.make_node("Gemm", ["x", "I"], ["h"], name="first"),
         helper.make_node("MatMul", ["h", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(True), "cond"), numpy_helper.from_array(np.eye(3, dtype=np.float32), "I")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def test_external_data_of_a_nested_graph_is_checked_and_read_like_the_main_graphs(tmp_path, monkeypatch):
    require_backend("onnx")
    inside, outside = tmp_path / "model", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    secret = np.arange(9, dtype=np.float32)
    (outside / "w.bin").write_bytes(secret.tobytes())
    path = inside / "m.onnx"
    path.write_bytes(_if_model(_external("W", "../elsewhere/w.bin")).SerializeToString())
    with pytest.raises(db.CheckpointError, match=r"m\.onnx.*initializer 'W' of the graph in attribute "
                                                 r"'(then|else)_branch' of node 'choose' \(If\).*outside"):
        db.load(str(path), "onnx")
    os.symlink(outside / "w.bin", inside / "link.bin")
    path.write_bytes(_if_model(_external("W", "link.bin")).SerializeToString())
    with pytest.raises(db.CheckpointError, match="initializer 'W' of the graph.*link leading outside"):
        db.load(str(path), "onnx")
    # inside the model's folder: read into the tensor, so onnxruntime resolves nothing itself
    (inside / "w.bin").write_bytes(np.eye(3, dtype=np.float32).tobytes())
    path.write_bytes(_if_model(_external("W", "w.bin")).SerializeToString())
    model = db.load(str(path), "onnx")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    monkeypatch.chdir(outside)  # a w.bin here too: never the one read
    (outside / "w.bin").write_bytes((2 * np.eye(3, dtype=np.float32)).tobytes())
    np.testing.assert_array_equal(require_backend("onnx").capture(model, [x], {}).output, x)
    # a model built in memory whose nested tensor is still external: onnxruntime is not let at it
    with pytest.raises(db.ConversionError, match="initializer 'W' of the graph in attribute.*external file"):
        require_backend("onnx").capture(onnx.load(str(path), load_external_data=False), [x], {})


def test_duplicate_initializer_names_are_refused_naming_the_name(tmp_path):
    require_backend("onnx")
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "W")
    main = _model([helper.make_node("MatMul", ["x", "W"], ["y"])], {"W": np.eye(3)})
    main.graph.initializer.append(w)
    (tmp_path / "main.onnx").write_bytes(main.SerializeToString())
    with pytest.raises(db.CheckpointError, match=r"main\.onnx: the main graph holds two initializers named 'W'"):
        db.load(str(tmp_path / "main.onnx"), "onnx")
    with pytest.raises(db.ConversionError, match="two initializers named 'W'"):
        db.linear_layers(main)
    nested = _if_model(w, extra_inits=[numpy_helper.from_array(2 * np.eye(3, dtype=np.float32), "W")])
    (tmp_path / "nested.onnx").write_bytes(nested.SerializeToString())
    with pytest.raises(db.CheckpointError, match=r"nested\.onnx: the graph in attribute '(then|else)_branch' of node "
                                                 r"'choose' \(If\) holds two initializers named 'W'"):
        db.load(str(tmp_path / "nested.onnx"), "onnx")


def test_a_file_larger_than_memory_allows_is_refused_before_reading(tmp_path):
    require_backend("onnx")
    from dense_bridge.params._memory_budget import available_memory

    available = available_memory()
    if available is None:
        pytest.skip("MemAvailable cannot be read here")
    path = tmp_path / "huge.onnx"
    with open(path, "wb") as f:  # sparse: no disk space, and a read of it would take minutes
        f.truncate(available // 2 + 1)
    with pytest.raises(db.CheckpointError, match=r"huge\.onnx is [\d,]+ bytes; reading it takes about .* more than "
                                                 r"the [\d,]+ bytes of memory available"):
        db.load(str(path), "onnx")
    if 2 * (3 << 30) < available:
        with open(path, "wb") as f:
            f.truncate(3 << 30)
        with pytest.raises(db.CheckpointError, match="past protobuf's 2 GiB limit"):
            db.load(str(path), "onnx")
