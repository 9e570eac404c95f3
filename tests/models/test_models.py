"""db.linear_layers and db.register_layout: linear layers found inside whole models of every
framework, by path and in definition order, each usable like a lone layer."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from conftest import require_backend
from dense_bridge.models import walk


def _roundtrip(layer, targets=("numpy", "torch", "keras", "mlx")):
    """get_params -> convert to every backend bit-exactly -> compare passes -> set_params writes."""
    params = db.get_params(layer)
    spec = db.to_spec(layer)
    assert params["kernel"].shape == (spec.in_features, spec.units)
    for to in targets:
        if to not in db.available_backends():
            continue
        other = db.convert(layer, to)
        got = db.get_params(other)
        assert sorted(got) == sorted(params)
        for k in params:
            assert np.array_equal(np.asarray(got[k]), params[k]), (to, k)
        assert db.testing.compare(layer, other).passed, to
    db.set_params(layer, {k: v + 1 for k, v in params.items()})
    after = db.get_params(layer)
    for k in params:
        np.testing.assert_array_equal(after[k], params[k] + 1)


# ------------------------------------------------------------------------------------- torch
def _torch_model():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(6)
            self.up = nn.Linear(6, 6)  # square: only the declared layout can tell (in, out) apart
            self.down = nn.Linear(6, 4, bias=False)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.attn = nn.MultiheadAttention(4, 2)
            self.head = nn.Bilinear(4, 3, 2)

    torch.manual_seed(0)
    return Net()


def test_torch_paths_and_order():
    model = _torch_model()
    layers = db.linear_layers(model)
    assert list(layers) == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down",
                            "attn.out_proj", "head"]
    assert layers["blocks.1.down"] is model.blocks[1].down
    kinds = {e.path: e.kind for e in walk(model)}
    assert kinds["embed"] == kinds["blocks.0.norm"] == kinds["attn"] == "other"


def test_torch_layers_work_like_lone_layers():
    model = _torch_model()
    layers = db.linear_layers(model)
    up = layers["blocks.0.up"]
    np.testing.assert_array_equal(db.get_params(up)["kernel"], up.weight.detach().numpy().T)
    for path in ("blocks.0.up", "blocks.1.down", "attn.out_proj"):
        _roundtrip(layers[path])
    # the write went into the model's own parameter
    assert model.blocks[0].up is up


def test_a_lone_linear_layer_is_its_own_path():
    torch = pytest.importorskip("torch")
    lin = torch.nn.Linear(3, 2)
    assert db.linear_layers(lin) == {"": lin}


# ----------------------------------------------------------------------------- register_layout
def test_register_layout_by_dotted_name_makes_a_third_party_class_linear():
    torch = pytest.importorskip("torch")

    class InOut(torch.nn.Module):  # stores (in, out) under other names, like GPT-2's Conv1D
        def __init__(self, n_in, n_out):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(n_in, n_out))
            self.b = torch.nn.Parameter(torch.randn(n_out))

        def forward(self, x):
            return x @ self.w + self.b

    holder = torch.nn.Sequential(torch.nn.Linear(5, 5), InOut(5, 5))
    assert list(db.linear_layers(holder)) == ["0"]  # undeclared: not linear, not guessed from shape
    decl = db.register_layout(f"{InOut.__module__}.{InOut.__qualname__}", kernel="w", bias="b", layout="in_out")
    try:
        assert decl.layout == "in_out"
        layers = db.linear_layers(holder)
        assert list(layers) == ["0", "1"]
        layer = layers["1"]
        np.testing.assert_array_equal(db.get_params(layer)["kernel"], layer.w.detach().numpy())
        assert db.to_spec(layer) == db.Dense(5, in_features=5, kernel_init="torch_default")
        _roundtrip(layer)
        # a declared layer also reads inside a chain
        assert db.to_spec(holder).layers[1].units == 5
    finally:
        from dense_bridge.models import _layouts

        _layouts._DECLARED.pop(decl.cls)


@pytest.mark.parametrize("kwargs, error", [
    (dict(cls=3, kernel="w", layout="in_out"), TypeError),
    (dict(cls="NoDots", kernel="w", layout="in_out"), TypeError),
    (dict(cls="a.B", kernel="w", layout="transposed"), db.SpecError),
    (dict(cls="a.B", kernel="not a name", layout="in_out"), db.SpecError),
    (dict(cls="a.B", kernel="w", bias=1, layout="in_out"), TypeError),
])
def test_register_layout_rejects_bad_declarations(kwargs, error):
    cls = kwargs.pop("cls")
    with pytest.raises(error, match="Received"):
        db.register_layout(cls, **kwargs)


# ------------------------------------------------------------------------------------- keras
def _keras_attention(bias_axes_q="de"):
    require_backend("keras")
    import keras

    x = keras.Input((5, 8))
    q = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 2, 4), bias_axes=bias_axes_q, name="q")
    o = keras.layers.EinsumDense("abcd,cde->abe", output_shape=(None, 8), bias_axes="e", name="o")
    ff = keras.layers.Dense(8, name="ff")
    norm = keras.layers.LayerNormalization(name="ln")
    return keras.Model(x, norm(ff(o(q(x)))), name="attn_model")


def test_keras_einsum_dense_reads_as_a_linear_layer():
    model = _keras_attention()
    layers = db.linear_layers(model)
    assert list(layers) == ["q", "o", "ff"]  # the root model's name is not part of a path
    q, o = layers["q"], layers["o"]
    assert tuple(q.kernel.shape) == (8, 2, 4) and tuple(o.kernel.shape) == (2, 4, 8)
    assert db.to_spec(q) == db.Dense(8, in_features=8, name="q")
    pq, po = db.get_params(q), db.get_params(o)
    np.testing.assert_array_equal(pq["kernel"], np.asarray(q.kernel).reshape(8, 8))
    np.testing.assert_array_equal(pq["bias"], np.asarray(q.bias).reshape(8))
    np.testing.assert_array_equal(po["kernel"], np.asarray(o.kernel).reshape(8, 8))
    for layer in (q, o):
        _roundtrip(layer)


def test_keras_einsum_transposed_kernel_axes():
    require_backend("keras")
    import keras

    # kernel stored (out, in): canonical kernel is its transpose, by the equation, not by shape
    layer = keras.layers.EinsumDense("ab,cb->ac", output_shape=3, bias_axes="c")
    layer.build((None, 3))
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], np.asarray(layer.kernel).T)
    _roundtrip(layer, targets=("torch",))


def test_keras_partial_bias_axes_read_broadcast_and_refused_when_not_shared():
    model = _keras_attention(bias_axes_q="e")  # one bias of head_dim shared by both heads
    q = db.linear_layers(model)["q"]
    bias = np.asarray(q.bias)  # (4,)
    np.testing.assert_array_equal(db.get_params(q)["bias"], np.tile(bias, 2))
    params = db.get_params(q)
    db.set_params(q, {**params, "bias": np.tile(bias + 1, 2)})  # shared along heads: fine
    np.testing.assert_array_equal(np.asarray(q.bias), bias + 1)
    with pytest.raises(db.ConversionError, match="bias_axes 'e'"):
        db.set_params(q, {**params, "bias": np.arange(8, dtype=np.float32)})


def test_keras_einsum_that_is_not_a_linear_map_is_other():
    require_backend("keras")
    import keras

    layer = keras.layers.EinsumDense("abc,bc->ac", output_shape=(4,))  # contracts a batch axis
    layer.build((None, 3, 4))
    assert db.linear_layers(layer) == {}
    with pytest.raises(db.ConversionError, match="EinsumDense"):
        db.to_spec(layer)


def test_keras_subclassed_model_paths():
    require_backend("keras")
    import keras

    class Tower(keras.Model):
        def __init__(self):
            super().__init__(name="tower")
            self.a = keras.layers.Dense(4, name="a")
            self.b = keras.layers.Dense(2, name="b")

        def call(self, x):
            return self.b(self.a(x))

    model = Tower()
    model(np.zeros((1, 3), np.float32))
    layers = db.linear_layers(model)
    assert list(layers) == ["a", "b"]
    _roundtrip(layers["b"], targets=("torch",))


def test_keras_quantized_dense_is_listed_and_unreadable_modes_named():
    require_backend("keras")
    import keras

    inner = keras.layers.Dense(4, name="d")
    inner.build((None, 4))
    inner.quantize("int8")  # read through dense_bridge/quant.py (tests/quant/test_quantized.py)
    assert list(db.linear_layers(keras.Sequential([inner]))) == ["d"]
    other = keras.layers.Dense(4, name="f8")
    other.build((None, 4))
    other.quantize("float8")
    with pytest.raises(db.ConversionError, match="f8 .*Dense.*'float8' mode"):
        db.linear_layers(keras.Sequential([other]))


# --------------------------------------------------------------------------------------- mlx
def test_mlx_paths_in_definition_order_and_quantized_listed():
    require_backend("mlx")
    import mlx.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.layers = [nn.Linear(4, 4), nn.Linear(4, 3)]
            self.norm = nn.RMSNorm(3)
            self.out = nn.Linear(3, 2, bias=False)

    model = Net()
    layers = db.linear_layers(model)
    assert list(layers) == ["layers.0", "layers.1", "out"]
    assert {e.path: e.kind for e in walk(model)}["norm"] == "other"
    _roundtrip(layers["layers.0"])
    model.q = nn.QuantizedLinear(64, 64)  # read through dense_bridge/quant.py (tests/quant/test_quantized.py)
    assert list(db.linear_layers(model)) == ["layers.0", "layers.1", "out", "q"]


def _keras_declared_class(layout: str):
    """A custom Keras layer computing x @ kernel + bias, its kernel stored as ``layout`` says."""
    import keras

    class StoredKernel(keras.layers.Layer):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units

        def build(self, input_shape):
            n_in = int(input_shape[-1])
            shape = (self.units, n_in) if layout == "out_in" else (n_in, self.units)
            self.w = self.add_weight(shape=shape, initializer="random_normal", name="w")
            self.b = self.add_weight(shape=(self.units,), initializer="random_normal", name="b")

        def call(self, x):
            w = keras.ops.transpose(self.w) if layout == "out_in" else self.w
            return keras.ops.matmul(x, w) + self.b

    return StoredKernel


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_register_layout_for_a_keras_layer(layout):
    require_backend("keras")
    import keras

    cls = _keras_declared_class(layout)
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(cls(3, name="proj")(inputs)))
    assert "proj" not in db.linear_layers(model)  # undeclared: not linear, not guessed from its shapes
    with pytest.raises(db.ConversionError, match="StoredKernel"):
        db.to_spec(model.get_layer("proj"))
    decl = db.register_layout(cls, kernel="w", bias="b", layout=layout)
    try:
        layers = db.linear_layers(model)
        assert "proj" in layers
        layer = layers["proj"]
        stored = np.asarray(layer.w.numpy())
        kernel = db.get_params(layer)["kernel"]
        assert kernel.shape == (5, 3)
        np.testing.assert_array_equal(kernel, stored.T if layout == "out_in" else stored)
        assert db.to_spec(layer) == db.Dense(3, in_features=5, name="proj")
        _roundtrip(layer)  # every backend bit-exact, compare (outputs and gradients) passes, set_params writes
        stored_after = np.asarray(layer.w.numpy())
        np.testing.assert_array_equal(stored_after, (kernel + 1).T if layout == "out_in" else kernel + 1)
        # a torch twin of the whole model, moved over and checked layer by layer
        if "torch" in db.available_backends():
            import torch

            twin = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
            mapping = {"0": "proj", "1": "head"}
            db.transfer(model, twin, mapping={v: k for k, v in mapping.items()})
            np.testing.assert_array_equal(twin[0].weight.detach().numpy(), db.get_params(layer)["kernel"].T)
            x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
            report = db.testing.compare_models(model, twin, (x,), mapping={v: k for k, v in mapping.items()})
            assert report.passed, report
        # a declaration that does not fit the layer is refused, naming the attribute
        db.register_layout(cls, kernel="units", bias="b", layout=layout)
        with pytest.raises(db.ConversionError, match="'units'.*int, not a 2-D Keras variable"):
            db.get_params(layer)
        # the wrong layout on a non-square kernel: the bias does not fit its units
        db.register_layout(cls, kernel="w", bias="b", layout="in_out" if layout == "out_in" else "out_in")
        with pytest.raises(db.ConversionError, match="bias 'b' has 3 entries"):
            db.to_spec(layer)
    finally:
        from dense_bridge.models import _layouts

        _layouts._DECLARED.pop(decl.cls)


def test_register_layout_for_an_mlx_class_in_out():
    require_backend("mlx")
    import mlx.core as mx
    import mlx.nn as nn

    class InOut(nn.Module):  # kernel stored (in, out), as some ports of GPT-2 keep Conv1D's layout
        def __init__(self):
            super().__init__()
            self.w = mx.random.normal((5, 3))
            self.b = mx.random.normal((3,))

        def __call__(self, x):
            return x @ self.w + self.b

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = InOut()

    decl = db.register_layout(InOut, kernel="w", bias="b", layout="in_out")
    try:
        layer = db.linear_layers(Net())["proj"]
        np.testing.assert_array_equal(db.get_params(layer)["kernel"], np.array(layer.w))
        assert db.to_spec(layer).in_features == 5 and db.to_spec(layer).units == 3
        _roundtrip(layer)
    finally:
        from dense_bridge.models import _layouts

        _layouts._DECLARED.pop(decl.cls)
