"""Reading chains from real user code: get_params never answers {},
Dropout is the inference identity everywhere (with a warning), transformers' activation modules
read as the table's, and unreadable models point at linear_layers/transfer."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from conftest import require_backend


# ------------------------------------------------------------------------ get_params never {}
def test_get_params_on_torch_layers_without_linear_parameters_raises_naming_the_class():
    torch = pytest.importorskip("torch")
    for module, name in ((torch.nn.LayerNorm(4), "LayerNorm"), (torch.nn.Conv1d(2, 3, 3), "Conv1d")):
        with pytest.raises(db.ConversionError, match=rf"(?s){name}.*db.linear_layers\(model\).*db.transfer"):
            db.get_params(module)
    with pytest.raises(db.ConversionError, match="ReLU has no linear parameters"):
        db.get_params(torch.nn.ReLU())


def test_get_params_on_a_custom_mlx_module_names_its_linear_layers():
    require_backend("mlx")
    import mlx.nn as nn

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 2)

        def __call__(self, x):
            return self.inner(x)

    with pytest.raises(db.ConversionError, match=r"(?s)Custom.*\[.inner.\].*linear_layers"):
        db.get_params(Custom())
    assert list(db.linear_layers(Custom())) == ["inner"]


def test_a_chain_of_parameterless_layers_still_has_empty_params():
    model = db.compile(db.Sequential([db.Identity(), db.Activation("relu")]), "numpy")
    assert db.get_params(model) == {}


def test_unreadable_models_suggest_linear_layers_and_transfer():
    torch = pytest.importorskip("torch")

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return x + self.lin(x)

    with pytest.raises(db.ConversionError, match=r"(?s)Residual.*db.linear_layers\(model\)"):
        db.to_spec(Residual())
    with pytest.raises(db.ConversionError, match=r"db.transfer"):
        db.convert(Residual(), "numpy")


# ------------------------------------------------------------------------ dropout everywhere
def _dropout_chain(backend):
    if backend == "torch":
        torch = pytest.importorskip("torch")
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5), torch.nn.Linear(3, 2))
    if backend == "keras":
        require_backend("keras")
        import keras

        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5),
                                 keras.layers.Dense(2)])
    require_backend("mlx")
    import mlx.nn as nn

    return nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5), nn.Linear(3, 2))  # MLX modules start in training mode


@pytest.mark.parametrize("backend", ["torch", "keras", "mlx"])
def test_dropout_is_the_inference_identity_with_a_warning(backend):
    model = _dropout_chain(backend)
    with pytest.warns(UserWarning, match="Dropout .*rate 0.5.* read as the identity"):
        spec = db.to_spec(model)
    assert spec.layers[1] == db.Identity()
    with pytest.warns(UserWarning, match="read as the identity"):
        other = db.convert(model, "numpy")
        report = db.testing.compare(model, other)  # the native Dropout runs as the identity too
    assert report.passed


def test_functional_dropout_warns_too():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.b(F.dropout(self.a(x), 0.25, self.training))

    with pytest.warns(UserWarning, match="rate 0.25"):
        assert db.to_spec(Net()).layers[1] == db.Identity()


# ------------------------------------------------------------------------ transformers activations
@pytest.mark.parametrize("cls, name", [("NewGELUActivation", "gelu_tanh"), ("GELUTanh", "gelu_tanh"),
                                       ("FastGELUActivation", "gelu_tanh"), ("GELUActivation", "gelu"),
                                       ("SiLUActivation", "silu")])
def test_transformers_activation_modules_read_as_the_table(cls, name):
    torch = pytest.importorskip("torch")
    activations = pytest.importorskip("transformers.activations")
    act = getattr(activations, cls)()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), act, torch.nn.Linear(8, 2))
    assert db.to_spec(model).layers[1] == db.Activation(name)
    assert db.testing.compare(model, db.convert(model, "numpy")).passed


def test_transformers_activation_inside_a_traced_module():
    torch = pytest.importorskip("torch")
    from transformers.activations import NewGELUActivation

    class MLP(torch.nn.Module):  # GPT-2's MLP shape, with Linear layers
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.proj = torch.nn.Linear(4, 16), NewGELUActivation(), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.proj(self.act(self.fc(x)))

    assert db.to_spec(MLP()).layers[1] == db.Activation("gelu_tanh")


# ------------------------------------------------------------------------ Flatten and any rank
def _forward(model, backend, x):
    if backend == "torch":
        import torch

        with torch.no_grad():
            return model(torch.tensor(x)).numpy()
    if backend == "mlx":
        import mlx.core as mx

        return np.asarray(model(mx.array(x)))
    if backend == "numpy":
        return model.forward(x)
    return np.asarray(model(x))


@pytest.mark.parametrize("backend", ["numpy", "torch", "keras", "mlx"])
def test_flatten_spec_compiles_and_reads_back_on_every_backend(backend):
    require_backend(backend)
    spec = db.Sequential([db.Flatten(), db.Dense(5, in_features=12, activation="relu"), db.Dense(2)])
    assert db.from_config(spec.to_config()) == spec and spec.layers[0] != db.Identity()
    model = db.compile(spec, backend, seed=0)
    assert db.to_spec(model) == spec
    x = np.random.default_rng(0).standard_normal((3, 3, 4)).astype(np.float32)  # images: (batch, h, w)
    want = db.compile(spec, "numpy", seed=0).forward(x)
    assert want.shape == (3, 2)
    np.testing.assert_allclose(_forward(model, backend, x), want, rtol=1e-5, atol=1e-6)
    assert db.testing.compare(model, db.convert(model, "numpy")).passed


def test_torch_flattening_idioms_read_as_flatten_and_port_with_the_same_input():
    torch = pytest.importorskip("torch")
    require_backend("keras")

    class ViewMLP(torch.nn.Module):  # the seed documents' MNIST MLP
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(12, 2)

        def forward(self, x):
            return self.fc(x.view(-1, 12))

    class FlattenMLP(ViewMLP):
        def forward(self, x):
            return self.fc(torch.flatten(x, 1))

    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    for model in (ViewMLP(), FlattenMLP(), torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))):
        spec = db.to_spec(model)
        assert spec.layers[0] == db.Flatten() and spec.in_features == 12
        want = _forward(model, "torch", x)
        for backend in ("keras", "mlx", "numpy"):
            if backend in db.available_backends():
                np.testing.assert_allclose(_forward(db.convert(model, backend), backend, x), want, atol=1e-6)
    with pytest.raises(db.ConversionError, match="start_dim=2"):
        db.to_spec(torch.nn.Sequential(torch.nn.Flatten(2), torch.nn.Linear(4, 2)))


def test_keras_models_take_inputs_of_any_rank_features_last():
    torch = pytest.importorskip("torch")
    require_backend("keras")
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    converted = db.convert(src, "keras")
    compiled = db.compile(db.to_spec(src), "keras", params=db.get_params(src))
    for shape in ((5, 4), (2, 5, 4), (4,), (2, 2, 3, 4)):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        want = _forward(src, "torch", x)
        for model in (converted, compiled):
            got = np.asarray(model(x))
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ torch.export fallback
def test_a_forward_branching_on_the_input_rank_reads_through_torch_export():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional

    class SimpleMLP(torch.nn.Module):  # the seed documents' MNIST model
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = torch.nn.Linear(12, 6), torch.nn.GELU(approximate="tanh"), \
                torch.nn.Linear(6, 3)

        def forward(self, x):
            x = x.view(-1, 12) if x.ndim > 2 else x
            return F.softmax(self.fc2(torch.relu(self.act(self.fc1(x)))), dim=-1)

    torch.manual_seed(0)
    model = SimpleMLP()
    with pytest.warns(UserWarning, match=r"torch.export on an example input of shape \(2, 12\).*branch"):
        spec = db.to_spec(model)
    # the example (batch, 12) takes the `else x` branch: no Flatten in the spec
    assert spec == db.Sequential([db.Dense(6, in_features=12, kernel_init="torch_default",
                                           bias_init="torch_default", activation="linear"),
                                  db.Activation("gelu_tanh"), db.Activation("relu"),
                                  db.Dense(3, kernel_init="torch_default", bias_init="torch_default"),
                                  db.Activation("softmax", axis=-1)])
    with pytest.warns(UserWarning, match="torch.export"):
        assert sorted(db.get_params(model)) == ["0.bias", "0.kernel", "3.bias", "3.kernel"]
        other = db.convert(model, "numpy")
        assert db.testing.compare(model, other).passed
    x = np.random.default_rng(0).standard_normal((4, 12)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(other.forward(x), model(torch.tensor(x)).numpy(), atol=1e-6)


def test_control_flow_that_is_not_a_chain_still_fails_clearly():
    torch = pytest.importorskip("torch")

    class Skip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return x + self.fc(x) if x.ndim > 1 else x

    with pytest.raises(db.ConversionError, match="(?s)not a single chain.*linear_layers"):
        db.to_spec(Skip())


# ------------------------------------------------------------------------ dropped regularizers
def test_keras_regularizers_and_constraints_are_named_when_dropped():
    torch = pytest.importorskip("torch")  # noqa: F841 - the port's target
    require_backend("keras")
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, kernel_regularizer="l2", bias_constraint="non_neg", name="reg")])
    with pytest.warns(UserWarning, match="'reg'.*kernel_regularizer=L2, bias_constraint=NonNeg dropped"):
        converted = db.convert(model, "torch")
    np.testing.assert_array_equal(converted[0].weight.detach().numpy().T, model.layers[0].kernel.numpy())


# ------------------------------------------------------------------------ inspect on plain weights files
def test_inspect_lists_linear_layers_of_a_plain_state_dict_with_assumed_layouts(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from dense_bridge.cli import _main as cli
    from dense_bridge.models import file_linear_layers

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 8, bias=False))
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "linear layers recognised by name (2" in out
    # the (8,) bias names the output axis of the (8, 4) weight; the square (8, 8) one without bias is unknown
    assert "in=4      units=8      bias=yes" in out and "layout out_in (from its bias)" in out
    assert "layout unknown (square, no bias)" in out
    assert cli.main(["inspect", str(path), "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["linear_layers"]
    assert [(r["layer"], r["in_features"], r["units"], r["bias"]) for r in rows] == [("0", 4, 8, True),
                                                                                    ("3", 8, 8, False)]
    assert [r["layout"] for r in rows] == ["out_in", "unknown"]
    # Keras weights files store kernels (in, out) by position; embedding-like 2-D tables are left out
    keras_rows = file_linear_layers([("layers/dense/vars/0", (4, 8), "float32"), ("layers/dense/vars/1", (8,), "float32"),
                                     ("layers/embedding/vars/0", (10, 4), "float32")], "keras")
    assert [(r["layer"], r["in_features"], r["units"], r["layout"]) for r in keras_rows] == [
        ("layers/dense", 4, 8, "in_out")]


def test_a_given_example_picks_the_other_branch_and_is_remembered():
    torch = pytest.importorskip("torch")

    class SimpleMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(12, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            x = x.view(-1, 12) if x.ndim > 2 else x
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = SimpleMLP()
    images = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    with pytest.warns(UserWarning, match=r"example input of shape \(2, 3, 4\)"):
        spec = db.to_spec(model, example=images)
    assert spec.layers[0] == db.Flatten() and spec.in_features == 12
    with pytest.warns(UserWarning, match=r"\(2, 3, 4\)"):  # remembered: the same branch, the same keys
        assert sorted(db.get_params(model)) == ["1.bias", "1.kernel", "3.bias", "3.kernel"]
        numpy_model = db.convert(model, "numpy")
    with torch.no_grad():
        np.testing.assert_allclose(numpy_model.forward(images), model(torch.tensor(images)).numpy(), atol=1e-6)
    with pytest.raises(TypeError, match="example"):
        db.to_spec(model, example="images")
