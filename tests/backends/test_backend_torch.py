"""The torch adapter against real torch: classes, activations, masks, lazy layers, conversion, traces."""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
nn = torch.nn
F = torch.nn.functional

import dense_bridge as db  # noqa: E402
from dense_bridge.activations import NAMES  # noqa: E402
from dense_bridge.backends.torch import DenseLinear, ExactActivation, LazyDense  # noqa: E402


def _numpy_trace(spec, seed, inputs, g):
    """Reference forward/backward through the public numpy layers: (outputs, dL/dx, grads) per layer."""
    ref = db.compile(spec, "numpy", seed=seed)
    layers = ref.layers if isinstance(spec, db.Sequential) else [ref]
    outs, x = [], list(inputs)
    for layer in layers:
        x = [layer.forward(*x)]
        outs.append(x[0])
    dxs, grads = [None] * len(layers), [None] * len(layers)
    for i in range(len(layers) - 1, -1, -1):
        d = layers[i].backward(g)
        dxs[i] = d if isinstance(d, tuple) else (d,)
        grads[i] = layers[i].grads
        g = dxs[i][0]
    return outs, dxs, grads


def _trace(native, inputs, g):
    from dense_bridge.registry._backends import get_adapter

    return get_adapter("torch").trace(native, inputs, g)


def _mlp_spec(**dense_kw):
    return db.Sequential([db.Dense(6, in_features=5, activation="relu", **dense_kw), db.Activation("tanh"),
                          db.Dense(3, **dense_kw)])


# ------------------------------------------------------------------ classes and names
@pytest.mark.parametrize("spec, cls", [
    (db.Dense(4, in_features=3), nn.Linear),
    (db.Dense(4, in_features=3, use_bias=False, dtype="float64"), nn.Linear),
    (db.Dense(4, in_features=3, activation="relu"), DenseLinear),
    (db.Dense(4, in_features=3, mask=db.wiring.banded(3, 4, 1)), DenseLinear),
    (db.Bilinear(3, 5, 2), nn.Bilinear),
    (db.Identity(), nn.Identity),
    (_mlp_spec(), nn.Sequential),
])
def test_compile_gives_the_framework_class(spec, cls):
    native = db.compile(spec, "torch", seed=0)
    assert type(native) is cls
    assert isinstance(native, nn.Module)


def test_dense_subclass_is_a_linear_and_keeps_native_names():
    plain = db.compile(db.Dense(4, in_features=3), "torch", seed=0)
    assert [n for n, _ in plain.named_parameters()] == ["weight", "bias"]
    assert tuple(plain.weight.shape) == (4, 3)
    masked = db.compile(db.Dense(4, in_features=3, activation="gelu", mask=db.wiring.banded(3, 4, 1)), "torch", seed=0)
    assert isinstance(masked, nn.Linear)
    assert [n for n, _ in masked.named_parameters()] == ["weight", "bias"]
    assert set(masked.state_dict()) == {"weight", "bias", "mask"}
    nobias = db.compile(db.Dense(4, in_features=3, use_bias=False), "torch", seed=0)
    assert [n for n, _ in nobias.named_parameters()] == ["weight"] and nobias.bias is None
    seq = db.compile(_mlp_spec(), "torch", seed=0)
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sorted(db.get_params(seq)) == ["0.bias", "0.kernel", "2.bias", "2.kernel"]


def test_same_seed_params_bit_identical_to_numpy_reference():
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        spec = _mlp_spec(dtype=dtype, mask=None)
        ours = db.get_params(db.compile(spec, "torch", seed=11))
        ref = db.get_params(db.compile(spec, "numpy", seed=11))
        assert ours.keys() == ref.keys()
        for k in ref:
            assert ours[k].dtype == ref[k].dtype, k
            assert np.ascontiguousarray(ours[k]).tobytes() == np.ascontiguousarray(ref[k]).tobytes(), k


# ------------------------------------------------------------------ activations
_ACTIVATIONS = [db.Activation(n) for n in NAMES] + [
    db.Activation("leaky_relu", negative_slope=0.2), db.Activation("elu", alpha=0.5),
    db.Activation("selu", alpha=1.5, scale=1.1), db.Activation("softmax", axis=0),
    db.Activation("log_softmax", axis=0),
]


@pytest.mark.parametrize("act, cls, attrs", [
    (db.Activation("relu"), nn.ReLU, {}),
    (db.Activation("relu6"), nn.ReLU6, {}),
    (db.Activation("leaky_relu"), nn.LeakyReLU, {"negative_slope": 0.01}),
    (db.Activation("leaky_relu", negative_slope=0.2), nn.LeakyReLU, {"negative_slope": 0.2}),
    (db.Activation("elu", alpha=0.5), nn.ELU, {"alpha": 0.5}),
    (db.Activation("selu"), nn.SELU, {}),
    (db.Activation("gelu"), nn.GELU, {"approximate": "none"}),
    (db.Activation("gelu_tanh"), nn.GELU, {"approximate": "tanh"}),
    (db.Activation("hard_sigmoid"), nn.Hardsigmoid, {}),
    (db.Activation("hard_silu"), nn.Hardswish, {}),
    (db.Activation("softmax"), nn.Softmax, {"dim": -1}),
    (db.Activation("log_softmax", axis=1), nn.LogSoftmax, {"dim": 1}),
    (db.Activation("softplus"), ExactActivation, {}),
    (db.Activation("exponential"), ExactActivation, {}),
    (db.Activation("selu", alpha=1.5, scale=1.1), ExactActivation, {}),
])
def test_activation_compiles_to_native_module_with_explicit_params(act, cls, attrs):
    module = db.compile(act, "torch")
    assert type(module) is cls
    for name, value in attrs.items():
        assert getattr(module, name) == value
    assert db.to_spec(module) == act


def test_torch_selu_constants_are_the_exact_ones():
    p = db.Activation("selu").params
    x = torch.tensor([-1.0, -3.0, 2.0], dtype=torch.float64)
    expected = [p["scale"] * p["alpha"] * np.expm1(-1.0), p["scale"] * p["alpha"] * np.expm1(-3.0), p["scale"] * 2.0]
    assert F.selu(x).tolist() == expected


@pytest.mark.parametrize("act", _ACTIVATIONS, ids=repr)
def test_activation_float64_matches_reference(act):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-10, 10, 490), [25.0, 30.0, -30.0, 45.0, -45.0, 0.5, 2.9, -2.9, 5.9, -0.7]])
    x = x.reshape(50, 10)
    g = rng.normal(size=x.shape)
    natives = [db.compile(act, "torch")]
    if act.name != "linear":  # a Dense without activation is a plain nn.Linear
        natives.append(db.compile(db.Dense(10, in_features=10, activation=act), "torch").activation)
    for native in natives:
        xt = torch.from_numpy(x).requires_grad_(True)
        y = native(xt)
        y.backward(torch.from_numpy(g))
        ref = act.forward(x)
        np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-13, atol=1e-13)
        # torch's hardsigmoid backward uses 1/6 rounded to float32 even in float64 (3e-8 relative)
        rtol = 5e-8 if act.name == "hard_sigmoid" else 1e-12
        np.testing.assert_allclose(xt.grad.numpy(), act.vjp(x, ref, g), rtol=rtol, atol=1e-13)


def test_softplus_is_exact_where_torch_thresholds():
    x = torch.tensor([19.0, 21.0, 30.0, 100.0, 800.0], dtype=torch.float64)
    ours = db.compile(db.Activation("softplus"), "torch")(x).numpy()
    assert np.array_equal(ours, np.logaddexp(0.0, x.numpy()))
    assert not np.array_equal(F.softplus(x).numpy(), ours)  # the trap: torch returns x above 20


def test_activations_run_in_every_dtype():
    x = np.linspace(-4, 4, 24).reshape(3, 8)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for act in _ACTIVATIONS:
            y = db.compile(act, "torch")(torch.from_numpy(x).to(dtype))
            assert y.dtype == dtype
            ref = act.forward(x)
            tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-6}[dtype]
            np.testing.assert_allclose(y.float().numpy(), ref, rtol=tol, atol=tol * np.abs(ref).max())


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_dense_forward_in_each_dtype(dtype):
    spec = db.Dense(16, in_features=32, activation="gelu", mask=db.wiring.random(32, 16, 0.5, 1), dtype=dtype)
    native = db.compile(spec, "torch", seed=2)
    assert native.weight.dtype == native.mask.dtype == getattr(torch, dtype)
    x = np.random.default_rng(0).normal(size=(4, 32))
    y = native(torch.from_numpy(x).to(native.weight.dtype))
    assert y.dtype == native.weight.dtype
    ref = db.compile(spec, "numpy", seed=2).forward(x).astype(np.float64)
    eps = db._dtypes.EPS[dtype]
    rms = np.sqrt(np.mean(ref ** 2))
    bound = 4 * (eps * (np.abs(ref) + rms) + db._dtypes.EPS["float32"] * np.sqrt(32) * rms)
    assert np.all(np.abs(y.detach().float().double().numpy() - ref) <= bound)


# ------------------------------------------------------------------ masks
def _masked_spec():
    return db.Sequential([
        db.Dense(12, in_features=10, activation="relu", mask=db.wiring.random(10, 12, 0.4, seed=3)),
        db.Dense(4, mask=db.wiring.banded(12, 4, 2), activation="tanh"),
    ])


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
    lambda p: torch.optim.Adam(p, lr=1e-2),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
], ids=["sgd_momentum_wd", "adam", "adamw"])
def test_masked_weights_stay_zero_through_training(make_opt):
    spec = _masked_spec()
    model = db.compile(spec, "torch", seed=5)
    masks = {k: v.copy() for k, v in db.get_params(model).items() if k.endswith("mask")}
    before = {k: v.copy() for k, v in db.get_params(model).items()}
    assert not any("mask" in name for name, _ in model.named_parameters())
    assert {"0.mask", "1.mask"} <= set(model.state_dict())
    opt = make_opt(model.parameters())
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = torch.from_numpy(rng.normal(size=(16, 10)).astype(np.float32))
        target = torch.from_numpy(rng.normal(size=(16, 4)).astype(np.float32))
        opt.zero_grad()
        F.mse_loss(model(x), target).backward()
        opt.step()
    after = db.get_params(model)
    for i in (0, 1):
        off = after[f"{i}.mask"] == 0
        assert off.any()
        assert np.all(after[f"{i}.kernel"][off] == 0.0)
        assert np.all(model[i].weight.detach().numpy().T[off] == 0.0)
        assert after[f"{i}.mask"].tobytes() == masks[f"{i}.mask"].tobytes()  # bit-identical
        assert not np.array_equal(after[f"{i}.kernel"], before[f"{i}.kernel"])  # it did train


def test_mask_holds_from_the_first_forward():
    spec = db.Dense(3, in_features=4, mask=np.eye(4, 3))
    native = db.compile(spec, "torch", seed=0)
    with torch.no_grad():
        native.weight.fill_(1.0)  # even if someone writes the masked weights directly
    y = native(torch.ones(1, 4))
    np.testing.assert_array_equal(y.detach().numpy(), 1.0 + db.get_params(native)["bias"][None])


def test_load_state_dict_rezeroes_masked_weights():
    native = db.compile(db.Dense(3, in_features=4, mask=np.eye(4, 3)), "torch", seed=0)
    state = {k: v.clone() for k, v in native.state_dict().items()}
    state["weight"].fill_(2.0)
    native.load_state_dict(state)
    kernel = db.get_params(native)["kernel"]
    np.testing.assert_array_equal(kernel, 2.0 * np.eye(4, 3))
    assert torch.all(state["weight"] == 2.0)  # the caller's tensors are not touched


def test_set_params_zeroes_masked_entries():
    native = db.compile(db.Dense(3, in_features=4, mask=np.eye(4, 3)), "torch", seed=0)
    db.set_params(native, {"kernel": np.full((4, 3), 5.0, np.float32)}, strict=False)
    np.testing.assert_array_equal(db.get_params(native)["kernel"], 5.0 * np.eye(4, 3))


def test_masked_module_deepcopies_and_pickles():
    model = db.compile(_masked_spec(), "torch", seed=1)
    clone = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 10)
    for other in (clone, loaded):
        assert torch.equal(other(x), model(x))
        assert db.to_spec(other) == _masked_spec()


# ------------------------------------------------------------------ lazy
def test_lazy_dense_draws_the_eager_params_at_first_call():
    lazy = db.compile(db.Dense(5), "torch", seed=7)
    assert type(lazy) is LazyDense and isinstance(lazy, nn.LazyLinear)
    assert db.to_spec(lazy) == db.Dense(5)
    with pytest.raises(db.ConversionError, match="first input"):
        db.get_params(lazy)
    lazy(torch.randn(2, 7))
    assert type(lazy) is nn.Linear  # like torch's LazyLinear, it becomes a plain Linear
    eager = db.get_params(db.compile(db.Dense(5, in_features=7), "torch", seed=7))
    got = db.get_params(lazy)
    assert all(np.array_equal(got[k], eager[k]) for k in eager)
    assert db.to_spec(lazy) == db.Dense(5, in_features=7)
    with pytest.raises(db.SpecError, match=r"in_features=7.*last dimension 6"):
        lazy(torch.randn(2, 6))


def test_lazy_sequential_with_activation():
    spec = db.Sequential([db.Dense(8, activation="relu"), db.Dense(3, activation="softmax")])
    model = db.compile(spec, "torch", seed=3)
    assert db.to_spec(model) == spec
    model(torch.randn(4, 6))
    assert type(model[0]) is DenseLinear and isinstance(model[0].activation, nn.ReLU)
    eager = db.get_params(db.compile(spec.with_in_features(6), "torch", seed=3))
    got = db.get_params(model)
    assert got.keys() == eager.keys() and all(np.array_equal(got[k], eager[k]) for k in eager)
    assert db.to_spec(model) == spec.with_in_features(6)


def test_lazy_spec_with_given_params_builds_eagerly():
    params = {"kernel": np.ones((7, 3), np.float32), "bias": np.zeros(3, np.float32)}
    native = db.compile(db.Dense(3), "torch", params=params)  # the given kernel fixes the width
    assert type(native) is nn.Linear and native.in_features == 7
    np.testing.assert_array_equal(db.get_params(native)["kernel"], params["kernel"])


def test_hand_built_lazy_linear_reads_as_lazy_dense():
    spec = db.to_spec(nn.LazyLinear(4, dtype=torch.float64))
    assert spec == db.Dense(4, dtype="float64", kernel_init="torch_default", bias_init="torch_default")


# ------------------------------------------------------------------ bilinear
def test_bilinear_matches_numpy_reference_on_non_square_shapes():
    spec = db.Bilinear(3, 5, 4, dtype="float64")
    native = db.compile(spec, "torch", seed=9)
    assert tuple(native.weight.shape) == (4, 3, 5)
    params = db.get_params(native)
    np.testing.assert_array_equal(params["kernel"], native.weight.detach().numpy())
    rng = np.random.default_rng(0)
    x1, x2, g = rng.normal(size=(6, 3)), rng.normal(size=(6, 5)), rng.normal(size=(6, 4))
    ref = np.einsum("ni,kij,nj->nk", x1, params["kernel"], x2) + params["bias"]
    np.testing.assert_allclose(native(torch.from_numpy(x1), torch.from_numpy(x2)).detach().numpy(), ref,
                               rtol=1e-13, atol=1e-13)
    t = _trace(native, [x1, x2], g).layers[0]
    outs, dxs, grads = _numpy_trace(spec, 9, [x1, x2], g)
    np.testing.assert_allclose(t.output, outs[0], rtol=1e-13, atol=1e-13)
    for ours, theirs in zip(t.input_grads, dxs[0]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-13)
    for k in ("kernel", "bias"):
        np.testing.assert_allclose(t.param_grads[k], grads[0][k], rtol=1e-12, atol=1e-13)
    assert db.to_spec(native) == spec and spec.num_params == 4 * 3 * 5 + 4


# ------------------------------------------------------------------ to_spec
_ROUND_TRIP = [db.Dense(4, in_features=3, activation=a) for a in _ACTIVATIONS] + [
    db.Dense(4, in_features=3, use_bias=False, name="head"),
    db.Dense(4, in_features=4, mask=db.wiring.block_diagonal(4, 4, 2)),
    db.Dense(4, in_features=3, kernel_init="he_normal", bias_init=db.Init("constant", value=0.5)),
    db.Dense(4, in_features=3, mask=db.wiring.banded(3, 4, 1), activation="relu", use_bias=False),
    db.Dense(4), db.Dense(4, activation="elu"),
] + [db.Dense(4, in_features=3, dtype=d) for d in ("float64", "float16", "bfloat16")] + [
    db.Dense(4, in_features=3, dtype=d, mask=db.wiring.banded(3, 4, 1)) for d in ("float64", "float16", "bfloat16")
] + [
    db.Bilinear(3, 5, 2), db.Bilinear(2, 2, 2, use_bias=False, dtype="bfloat16", init="glorot_uniform"),
    db.Identity(), db.Identity(name="skip"),
    _mlp_spec(), _masked_spec(),
    db.Sequential([db.Dense(5), db.Identity(), db.Activation("gelu_tanh"), db.Dense(2)], name="mlp"),
    db.Sequential([db.Activation("relu")], in_features=4),
]


@pytest.mark.parametrize("spec", _ROUND_TRIP, ids=lambda s: type(s).__name__)
def test_to_spec_of_compiled_equals_spec(spec):
    native = db.compile(spec, "torch", seed=0)
    assert db.to_spec(native) == spec
    # the adapter alone, without the spec hint db.compile leaves on the root object
    from dense_bridge.registry._backends import get_adapter

    assert get_adapter("torch").to_spec(native) == spec


def test_to_spec_of_hand_built_sequential():
    model = nn.Sequential(nn.Linear(8, 6), nn.LeakyReLU(0.2), nn.Dropout(0.1), nn.Linear(6, 6, bias=False),
                          nn.GELU(approximate="tanh"), nn.Hardtanh(0.0, 6.0), nn.ELU(alpha=0.3),
                          nn.Linear(6, 4), nn.Softmax(dim=-1))
    spec = db.to_spec(model)
    tor = dict(kernel_init="torch_default", bias_init="torch_default")
    assert spec == db.Sequential([
        db.Dense(6, in_features=8, **tor), db.Activation("leaky_relu", negative_slope=0.2), db.Identity(),
        db.Dense(6, use_bias=False, **tor), db.Activation("gelu_tanh"), db.Activation("relu6"),
        db.Activation("elu", alpha=0.3), db.Dense(4, **tor), db.Activation("softmax", axis=-1)])
    assert sorted(db.get_params(model)) == ["0.bias", "0.kernel", "3.kernel", "7.bias", "7.kernel"]
    model.eval()
    _assert_converts(model, torch.randn(5, 8))


def _assert_converts(model, x):
    """convert() rebuilds the model: same params bit for bit, same outputs."""
    other = db.convert(model, "torch")
    assert type(other) is nn.Sequential
    src, dst = db.get_params(model), db.get_params(other)
    assert src.keys() == dst.keys() and all(np.array_equal(src[k], dst[k]) for k in src)
    torch.testing.assert_close(other(x), model(x), rtol=0, atol=1e-6)
    return other


class SeedMLP(nn.Module):
    """784->128->10, as seed 003 writes it: an inner nn.Sequential and MNIST flattening."""

    def __init__(self, input_dim=784, hidden=128, classes=10):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        x = x.view(-1, 784)
        return self.layers(x)


class MLPComponents(nn.Module):
    """784->128->64->10, as seed 003 writes it: a ModuleList loop, torch.relu and torch.softmax."""

    def __init__(self, input_size=784, hidden=(128, 64), output=10):
        super().__init__()
        self.hidden_layers = nn.ModuleList([nn.Linear(i, o) for i, o in zip([input_size, *hidden], hidden)])
        self.output_layer = nn.Linear(hidden[-1], output)

    def forward(self, x):
        x = x.view(-1, 784)
        for layer in self.hidden_layers:
            x = torch.relu(layer(x))
        return torch.softmax(self.output_layer(x), dim=1)


class FunctionalMLP(nn.Module):
    """Every functional spelling the tracer reads."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.act = nn.SiLU()

    def forward(self, x):
        x = F.leaky_relu(self.fc1(x), 0.2)
        x = F.gelu(x, approximate="tanh").relu()
        x = self.act(torch.sigmoid(self.fc2(x)))
        x = F.dropout(F.softplus(x), 0.1, self.training)
        return F.log_softmax(self.fc3(x), dim=-1)


def test_to_spec_of_seed_mlp_classes():
    tor = dict(kernel_init="torch_default", bias_init="torch_default")
    small = SeedMLP()
    # x.view(-1, 784) reads as db.Flatten(): MNIST images port with the same input everywhere
    assert db.to_spec(small) == db.Sequential([db.Flatten(), db.Dense(128, in_features=784, **tor),
                                               db.Activation("relu"), db.Dense(10, **tor)])
    assert sorted(db.get_params(small)) == ["1.bias", "1.kernel", "3.bias", "3.kernel"]
    np.testing.assert_array_equal(db.get_params(small)["3.kernel"], small.layers[2].weight.detach().numpy().T)
    _assert_converts(small, torch.randn(3, 784))

    big = MLPComponents()
    assert db.to_spec(big) == db.Sequential([db.Flatten(),
        db.Dense(128, in_features=784, **tor), db.Activation("relu"), db.Dense(64, **tor), db.Activation("relu"),
        db.Dense(10, **tor), db.Activation("softmax", axis=1)])
    np.testing.assert_array_equal(db.get_params(big)["3.kernel"], big.hidden_layers[1].weight.detach().numpy().T)
    torch_copy = _assert_converts(big, torch.randn(3, 784))
    # set_params on the class uses the same chain keys
    new = {k: np.asarray(v) * 2 for k, v in db.get_params(torch_copy).items()}
    db.set_params(big, new)
    np.testing.assert_array_equal(big.output_layer.weight.detach().numpy(), new["5.kernel"].T)


def test_to_spec_of_functional_forward():
    model = FunctionalMLP().eval()
    assert [type(l).__name__ if not isinstance(l, db.Activation) else l for l in db.to_spec(model).layers] == [
        "Dense", db.Activation("leaky_relu", negative_slope=0.2), db.Activation("gelu_tanh"), db.Activation("relu"),
        "Dense", db.Activation("sigmoid"), db.Activation("silu"), db.Activation("softplus"), "Identity",
        "Dense", db.Activation("log_softmax", axis=-1)]
    _assert_converts(model, torch.randn(4, 6))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x))) + x


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.fc(x) * y


class ControlFlow(nn.Module):
    """Seed 003's SimpleMLP: a Python `if` on the input's rank."""

    def __init__(self):
        super().__init__()
        self.input_layer, self.output_layer = nn.Linear(784, 16), nn.Linear(16, 10)

    def forward(self, x):
        x = x.view(-1, 784) if x.ndim > 2 else x
        return self.output_layer(torch.relu(self.input_layer(x)))


class MidReshape(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.fc1(x).reshape(-1, 4))


class ImplicitSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.softmax(self.fc(x))


@pytest.mark.parametrize("model, match", [
    (Residual(), "add"),
    (TwoInputs(), "2 inputs"),
    # ControlFlow (seed 003's SimpleMLP) reads through torch.export now: tests/models/test_models_chains.py
    (MidReshape(), "reshape"),
    (ImplicitSoftmax(), "implicit dim"),
    (nn.Sequential(nn.Linear(4, 4), nn.Softmax()), "position 1.*implicit dim"),
    (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), "position 1.*LayerNorm"),
    (nn.Sequential(nn.Linear(4, 4), nn.Softplus(beta=2.0)), "beta=2"),
    (nn.Sequential(nn.Linear(4, 4), nn.Softplus(threshold=5.0)), "threshold"),
    (nn.Sequential(nn.Linear(4, 4), nn.Hardtanh()), "Hardtanh"),
    (nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2)), "valid Sequential"),
    (nn.Conv1d(1, 1, 1), "Conv1d"),
])
def test_to_spec_rejects_what_is_not_a_chain(model, match):
    with pytest.raises(db.ConversionError, match=match):
        db.to_spec(model)


def test_residual_error_names_the_node():
    with pytest.raises(db.ConversionError) as info:
        db.to_spec(Residual())
    assert "Residual" in str(info.value) and "'add'" in str(info.value)


# ------------------------------------------------------------------ get/set params
def test_get_params_are_read_only_views_of_torch_memory():
    native = db.compile(db.Dense(3, in_features=4, mask=np.ones((4, 3))), "torch", seed=0)
    params = db.get_params(native, copy=False)
    assert np.shares_memory(params["kernel"], native.weight.detach().numpy())
    assert np.shares_memory(params["bias"], native.bias.detach().numpy())
    assert np.shares_memory(params["mask"], native.mask.numpy())
    assert not params["kernel"].flags.writeable
    np.testing.assert_array_equal(params["kernel"], native.weight.detach().numpy().T)


def test_set_params_on_a_square_layer_transposes_by_layout():
    native = db.compile(db.Dense(4, in_features=4), "torch", seed=0)
    kernel = np.arange(16, dtype=np.float32).reshape(4, 4)
    db.set_params(native, {"kernel": kernel, "bias": np.arange(4, dtype=np.float32)})
    np.testing.assert_array_equal(native.weight.detach().numpy(), kernel.T)
    np.testing.assert_array_equal(native(torch.eye(4)).detach().numpy(), kernel + np.arange(4))
    np.testing.assert_array_equal(db.get_params(native)["kernel"], kernel)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_params_round_trip_keeps_the_dtype(dtype):
    spec = _mlp_spec(dtype=dtype)
    native = db.compile(spec, "torch", seed=0)
    params = db.get_params(native)
    assert all(v.dtype == db._dtypes.numpy_dtype(dtype) for v in params.values())
    rng = np.random.default_rng(4)
    new = {k: rng.normal(size=v.shape).astype(v.dtype) for k, v in params.items()}
    db.set_params(native, new)
    got = db.get_params(native)
    for k in new:
        assert got[k].dtype == new[k].dtype
        assert np.ascontiguousarray(got[k]).tobytes() == new[k].tobytes()
    if dtype == "bfloat16":
        assert native[0].weight.dtype == torch.bfloat16


def test_set_params_accepts_read_only_and_strided_views_without_warnings():
    native = db.compile(db.Sequential([db.Dense(6, in_features=5), db.Dense(3)]), "torch", seed=0)
    base = np.random.default_rng(0).normal(size=(10, 12)).astype(np.float32)
    k0 = base[::2, ::2][:, :6]  # non-contiguous view
    k1 = np.asfortranarray(base[:6, :3])
    k1.flags.writeable = False
    b0 = base[0, ::-2][:6]  # negative strides
    b1 = np.frombuffer(base[1, :3].tobytes(), dtype=np.float32)  # read-only memory
    bf = base[:5, :6].astype(ml_dtypes.bfloat16)[:, ::-1]
    db.set_params(native, {"0.kernel": k0, "0.bias": b0, "1.kernel": k1, "1.bias": b1})
    got = db.get_params(native)
    for key, value in {"0.kernel": k0, "0.bias": b0, "1.kernel": k1, "1.bias": b1}.items():
        np.testing.assert_array_equal(got[key], value)
    native_bf = db.compile(db.Dense(6, in_features=5, dtype="bfloat16"), "torch", seed=0)
    db.set_params(native_bf, {"kernel": bf}, strict=False)
    assert np.ascontiguousarray(db.get_params(native_bf)["kernel"]).tobytes() == np.ascontiguousarray(bf).tobytes()


def test_set_params_is_all_or_nothing():
    native = db.compile(_mlp_spec(), "torch", seed=0)
    before = {k: v.copy() for k, v in db.get_params(native).items()}
    bad = {k: np.zeros_like(v) for k, v in before.items()}
    bad["2.kernel"] = np.zeros((3, 3), np.float32)
    with pytest.raises(db.ConversionError, match="2.kernel"):
        db.set_params(native, bad)
    assert all(np.array_equal(db.get_params(native)[k], before[k]) for k in before)


def test_compile_copies_given_params():
    params = {"kernel": np.ones((3, 2), np.float32), "bias": np.zeros(2, np.float32)}
    native = db.compile(db.Dense(2, in_features=3), "torch", params=params)
    params["kernel"][:] = 5
    assert torch.all(native.weight == 1)


# ------------------------------------------------------------------ trace
@pytest.mark.parametrize("spec", [
    db.Sequential([db.Dense(7, in_features=5, activation="gelu", dtype="float64"),
                   db.Dense(6, activation=db.Activation("leaky_relu", negative_slope=0.2), use_bias=False,
                            mask=db.wiring.random(7, 6, 0.5, 0), dtype="float64"),
                   db.Activation("mish"), db.Identity(),
                   db.Dense(4, activation="softplus", dtype="float64"), db.Activation("log_softmax")]),
    db.Dense(3, in_features=4, activation="softmax", dtype="float64"),
    db.Dense(3, in_features=4, activation="selu", mask=db.wiring.banded(4, 3, 1), dtype="float64"),
], ids=["sequential", "dense_softmax", "dense_masked"])
def test_trace_matches_numpy_backward_in_float64(spec):
    native = db.compile(spec, "torch", seed=8)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(9, spec.in_features))
    out_dim = spec.output_features(spec.in_features)
    g = rng.normal(size=(9, out_dim))
    t = _trace(native, [x], g)
    outs, dxs, grads = _numpy_trace(spec, 8, [x], g)
    assert len(t.layers) == len(outs)
    for i, rec in enumerate(t.layers):
        np.testing.assert_allclose(rec.output, outs[i], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(rec.input_grads[0], dxs[i][0], rtol=1e-11, atol=1e-13)
        assert rec.param_grads.keys() == grads[i].keys()
        for k in grads[i]:
            np.testing.assert_allclose(rec.param_grads[k], grads[i][k], rtol=1e-11, atol=1e-13)
    assert all(p.grad is None for p in native.parameters())  # trace leaves .grad alone


def test_trace_of_a_traced_module_and_float32_input_cast():
    model = SeedMLP(input_dim=784, hidden=16, classes=3)
    x = np.random.default_rng(0).normal(size=(2, 784))  # float64 input: cast to the layer dtype
    t = _trace(model, [x], np.ones((2, 3)))
    assert len(t.layers) == 4 and t.layers[1].output.dtype == np.float32  # Flatten (x.view(-1, 784)) first
    assert t.layers[1].param_grads["kernel"].shape == (784, 16)
    with torch.no_grad():
        y = model(torch.from_numpy(x).float()).numpy()
    np.testing.assert_array_equal(t.layers[-1].output, y)


# ------------------------------------------------------------------ reparametrized, tied, keras-owned, mixed dtype
def _adapter():
    from dense_bridge.registry._backends import get_adapter

    return get_adapter("torch")


def _pruned():
    lin = nn.Linear(4, 3)
    torch.nn.utils.prune.l1_unstructured(lin, "weight", 0.5)
    return lin


def _weight_normed():
    return torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))


def _orthogonal():
    return torch.nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))


def _legacy_weight_norm():
    import warnings

    with warnings.catch_warnings():
        # torch deprecates this hook-based API (FutureWarning); users still have modules built with it
        warnings.filterwarnings("ignore", message=".*torch.nn.utils.weight_norm. is deprecated", category=FutureWarning)
        return torch.nn.utils.weight_norm(nn.Linear(4, 3))


@pytest.mark.parametrize("make, match", [
    (_pruned, r"weight pruned with torch.nn.utils.prune.*prune.remove\(module, 'weight'\)"),
    (_weight_normed, r"ParametrizedLinear.*parametrize.remove_parametrizations\(module, 'weight'\)"),
    (_orthogonal, r"ParametrizedLinear.*parametrize.remove_parametrizations\(module, 'weight'\)"),
    (_legacy_weight_norm, r"weight_norm hook.*remove_weight_norm\(module\)"),
], ids=["prune", "weight_norm", "orthogonal", "legacy_weight_norm"])
def test_reparametrized_linear_is_rejected_everywhere(make, match):
    lin = make()
    before = lin(torch.ones(1, lin.in_features)).detach().clone()
    params = {"kernel": np.zeros((lin.in_features, lin.out_features), np.float32),
              "bias": np.zeros(lin.out_features, np.float32)}
    # lone, in an nn.Sequential (the message names the position), in a traced module
    traced = SeedMLP(input_dim=784, hidden=4, classes=lin.out_features)
    traced.layers[2] = lin
    for native, where in [(lin, "Linear"), (nn.Sequential(nn.Linear(2, 4), nn.ReLU(), lin), "position 2"),
                          (traced, "layers.2")]:
        for verb in (db.to_spec, db.get_params, _adapter().get_params, lambda n: db.convert(n, "numpy"),
                     lambda n: _adapter().set_params(n, params), lambda n: db.set_params(n, params)):
            with pytest.raises(db.ConversionError, match=f"{where}.*{match}"):
                verb(native)
    # nothing was written: a silently accepted write would be lost at the next forward anyway
    torch.testing.assert_close(lin(torch.ones(1, lin.in_features)), before, rtol=0, atol=0)


def test_pruned_linear_converts_once_the_pruning_is_removed():
    lin = _pruned()
    torch.nn.utils.prune.remove(lin, "weight")
    kernel = np.arange(12, dtype=np.float32).reshape(4, 3)
    db.set_params(lin, {"kernel": kernel, "bias": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(lin(torch.eye(4)).detach().numpy(), kernel)  # the write survives a forward
    np.testing.assert_array_equal(db.get_params(lin)["kernel"], kernel)


class TiedMLP(nn.Module):
    """fc2 reuses fc1's weight Parameter (a different Linear): weight tying."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.fc2.weight = self.fc1.weight

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _tied_sequential():
    lin1, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)
    lin2.weight = lin1.weight
    return nn.Sequential(lin1, nn.ReLU(), lin2)


def _aliased_bias():
    lin1, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)
    lin2.bias = nn.Parameter(lin1.bias.detach())  # another Parameter over the same memory
    return nn.Sequential(lin1, nn.Tanh(), lin2)


@pytest.mark.parametrize("make, positions, match", [
    (_tied_sequential, (0, 2), "weight of chain position 0 and the weight of chain position 2 are the same Parameter"),
    (TiedMLP, (0, 2), "weight of chain position 0 and the weight of chain position 2 are the same Parameter"),
    (_aliased_bias, (0, 2), "bias of chain position 0 and the bias of chain position 2 are tensors sharing memory"),
], ids=["sequential", "traced", "aliased_memory"])
def test_parameters_shared_across_positions_are_rejected(make, positions, match):
    native = make()
    params = {f"{i}.{k}": np.full(shape, float(i), np.float32)
              for i in positions for k, shape in (("kernel", (4, 4)), ("bias", (4,)))}
    # set_params would keep only the last write and convert would untie them: refuse both
    for verb in (db.to_spec, db.get_params, lambda n: db.convert(n, "numpy"),
                 lambda n: db.set_params(n, params), lambda n: _adapter().set_params(n, params)):
        with pytest.raises(db.ConversionError, match=match):
            verb(native)


def test_distinct_parameters_are_not_mistaken_for_tied():
    lin = nn.Linear(4, 4)
    twin = nn.Linear(4, 4)
    twin.load_state_dict(lin.state_dict())  # equal values, own memory
    native = nn.Sequential(lin, nn.ReLU(), twin)
    assert len(db.to_spec(native).layers) == 3
    masked = db.compile(db.Sequential([db.Dense(4, in_features=3, mask=np.ones((3, 4))),
                                       db.Dense(4, mask=np.ones((4, 4)))]), "torch", seed=0)
    assert sorted(db.get_params(masked)) == ["0.bias", "0.kernel", "0.mask", "1.bias", "1.kernel", "1.mask"]


def test_owns_leaves_keras_layers_to_keras_under_keras_backend_torch():
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed")
    # Under KERAS_BACKEND=torch every keras layer is a torch.nn.Module; the backend is fixed at
    # keras' import, hence a fresh process.
    script = (
        "import keras, torch\n"
        "from dense_bridge.backends import torch as adapter\n"
        "class Custom(keras.layers.Layer):\n"
        "    def call(self, x): return x\n"
        "dense = keras.layers.Dense(3); dense.build((None, 4))\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
        "objs = [dense, Custom(), model]\n"
        "assert all(isinstance(o, torch.nn.Module) for o in objs)\n"
        "print([adapter.owns(o) for o in objs], adapter.owns(torch.nn.Linear(2, 2)))\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "[False, False, False] True"


class MixedDtypeMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)).double())


@pytest.mark.parametrize("native, match", [
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2).double()), "position 0: float32, position 2: float64"),
    (nn.Sequential(nn.Linear(4, 4).half(), nn.Linear(4, 2).bfloat16()), "position 0: float16, position 1: bfloat16"),
], ids=["float32_float64", "float16_bfloat16"])
def test_mixed_dtype_sequential_is_a_conversion_error(native, match):
    with pytest.raises(db.ConversionError, match=f"mix dtypes.*{match}"):
        db.to_spec(native)
    with pytest.raises(db.ConversionError, match=match):
        db.convert(native, "numpy")


def test_mixed_dtype_traced_module_is_a_conversion_error():
    # .double() between layers is not a chain step the tracer reads: it already fails there
    with pytest.raises(db.ConversionError, match="double"):
        db.to_spec(MixedDtypeMLP())
