"""The MLX adapter against real MLX: classes, layouts, activations, masks under training, lazy
layers, Bilinear, to_spec, parameter round trips and autograd traces vs the numpy reference.

Shapes stay <= 64 wide: MLX's Linux CPU matmul is 50-70x slower than numpy's (FACTS).
"""
from __future__ import annotations

import functools
import subprocess
import sys
import zlib

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
optim = pytest.importorskip("mlx.optimizers")
ml_dtypes = pytest.importorskip("ml_dtypes")
from mlx.utils import tree_flatten  # noqa: E402

import dense_bridge as db  # noqa: E402
from dense_bridge._dtypes import numpy_dtype  # noqa: E402
from dense_bridge.activations import NAMES, Activation  # noqa: E402
from dense_bridge.backends import mlx as adapter  # noqa: E402
from dense_bridge.backends import numpy as reference  # noqa: E402
from dense_bridge.testing import C_GRADIENT, C_OUTPUT, error_units  # noqa: E402
from conftest import KINKS, away_from_kinks  # noqa: E402

NON_DEFAULT = [
    Activation("leaky_relu", negative_slope=0.2),
    Activation("leaky_relu", negative_slope=2.5),  # above 1: nn.LeakyReLU's maximum() is wrong there
    Activation("leaky_relu", negative_slope=-0.5),
    Activation("elu", alpha=0.5),
    Activation("selu", alpha=1.5, scale=1.25),
    Activation("softmax", axis=0),
    Activation("log_softmax", axis=0),
]
ALL_ACTS = [Activation(n) for n in NAMES] + NON_DEFAULT


def _rng(tag: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(tag.encode()))


def _away_from_kinks(x: np.ndarray) -> np.ndarray:
    return away_from_kinks(x, margin=1e-2)


def _np(a) -> np.ndarray:
    """An mx.array as a numpy array (bfloat16 through ml_dtypes)."""
    mx.eval(a)
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(a)


def _mx(x: np.ndarray, dtype: str) -> mx.array:
    """x (exactly representable in dtype) as an mx.array of that dtype."""
    return mx.array(np.asarray(x, np.float64), dtype=mx.float64).astype(getattr(mx, dtype))


def _eps(dtype: str) -> float:
    return float(ml_dtypes.finfo(numpy_dtype(dtype)).eps)


def _assert_close(actual, expected, dtype: str, fan_in: int, c: float, what: str = "",
                  atol: float = 0.0) -> None:
    err, units = error_units(actual, expected, dtype, fan_in, c, atol)
    assert units <= 1.0, f"{what}: max abs error {err:.3g} is {units:.3g} tolerance units ({dtype}, K={fan_in})"


# ------------------------------------------------------------------ classes and names
def test_plain_dense_is_exactly_nn_linear():
    for spec in (db.Dense(4, in_features=8), db.Dense(4, in_features=8, activation="linear"),
                 db.Dense(4, in_features=8, use_bias=False)):
        assert type(db.compile(spec, "mlx", seed=0)) is nn.Linear


def test_activation_or_mask_gives_a_thin_linear_subclass():
    act = db.compile(db.Dense(4, in_features=8, activation="relu"), "mlx", seed=0)
    masked = db.compile(db.Dense(4, mask=db.wiring.banded(8, 4, 2)), "mlx", seed=0)
    lazy = db.compile(db.Dense(4), "mlx", seed=0)
    for layer in (act, masked, lazy):
        assert isinstance(layer, nn.Linear) and type(layer) is not nn.Linear
    assert type(lazy) is adapter.LazyDenseLinear


def test_native_parameter_names():
    plain = db.compile(db.Dense(4, in_features=8), "mlx", seed=0)
    assert sorted(k for k, _ in tree_flatten(plain.parameters())) == ["bias", "weight"]
    assert plain.weight.shape == (4, 8)  # MLX layout (out, in)
    nobias = db.compile(db.Dense(4, in_features=8, use_bias=False), "mlx", seed=0)
    assert [k for k, _ in tree_flatten(nobias.parameters())] == ["weight"] and "bias" not in nobias
    masked = db.compile(db.Dense(4, mask=db.wiring.banded(8, 4, 2)), "mlx", seed=0)
    assert sorted(k for k, _ in tree_flatten(masked.parameters())) == ["bias", "mask", "weight"]
    seq = db.compile(db.Sequential([db.Dense(6, in_features=5), db.Activation("relu"), db.Dense(3)]), "mlx", seed=0)
    assert type(seq) is nn.Sequential
    assert [k for k, _ in tree_flatten(seq.parameters())] == [
        "layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]


def test_compile_leaves_mlx_random_state_alone():
    mx.random.seed(123)
    expected = _np(mx.random.uniform(shape=(3,)))
    mx.random.seed(123)
    db.compile(db.Sequential([db.Dense(8, in_features=4), db.Dense(2)]), "mlx", seed=0)
    db.compile(db.Bilinear(3, 5, 2), "mlx", seed=0)
    np.testing.assert_array_equal(_np(mx.random.uniform(shape=(3,))), expected)


def test_same_seed_same_bits_as_numpy_reference():
    spec = db.Sequential([db.Dense(16, in_features=8, activation="tanh"), db.Dense(4, use_bias=False)])
    got, ref = db.get_params(db.compile(spec, "mlx", seed=7)), db.compile(spec, "numpy", seed=7).params()
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype and np.array_equal(got[k], ref[k]), k


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_dtypes_compile_to_the_native_dtype_bit_exactly(dtype):
    spec = db.Dense(6, in_features=5, dtype=dtype)
    layer = db.compile(spec, "mlx", seed=1)
    assert layer.weight.dtype == getattr(mx, dtype) and layer.bias.dtype == getattr(mx, dtype)
    got, ref = db.get_params(layer), db.compile(spec, "numpy", seed=1).params()
    for k in ref:
        assert got[k].dtype == ref[k].dtype
        assert np.array_equal(got[k].view(np.uint8), np.ascontiguousarray(ref[k]).view(np.uint8)), k
    y = layer(mx.ones((2, 5), dtype=getattr(mx, dtype)))
    assert y.dtype == getattr(mx, dtype)


# ------------------------------------------------------------------ activations
@pytest.mark.parametrize("act", ALL_ACTS, ids=repr)
def test_activation_layer_matches_reference_float32(act):
    x = _away_from_kinks(_rng(repr(act)).normal(scale=3.0, size=(4, 6))).astype(np.float32)
    module = db.compile(act, "mlx")
    assert isinstance(module, nn.Module)
    _assert_close(_np(module(mx.array(x))), act.forward(x), "float32", 1, C_OUTPUT, repr(act))
    assert db.to_spec(module) == act


@pytest.mark.parametrize("act", ALL_ACTS, ids=repr)
def test_activation_layer_float64(act):
    """float64 runs, but MLX's CPU exp/sigmoid/erf are float32-accurate (FACTS): float32 tolerance."""
    x = _away_from_kinks(_rng(repr(act) + "64").normal(scale=3.0, size=(4, 6)))
    y = db.compile(act, "mlx")(mx.array(x, dtype=mx.float64))
    assert y.dtype == mx.float64
    _assert_close(_np(y), act.forward(x), "float32", 1, C_OUTPUT, repr(act))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", NAMES)
def test_activation_layer_half_precision(name, dtype):
    act = Activation(name)
    x = _away_from_kinks(_rng(name + dtype).normal(scale=2.0, size=(4, 6)))
    xd = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    y = db.compile(act, "mlx")(mx.array(xd.astype(np.float32)).astype(getattr(mx, dtype)))
    assert y.dtype == getattr(mx, dtype)
    _assert_close(_np(y), act.forward(xd.astype(np.float64)), dtype, 1, C_OUTPUT, name)


NATIVE = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh,
          "softplus": nn.Softplus, "softsign": nn.Softsign, "mish": nn.Mish, "softmax": nn.Softmax}


@pytest.mark.parametrize("act", ALL_ACTS, ids=repr)
def test_native_modules_where_exact_and_exact_modules_elsewhere(act):
    """Native only where MLX is exact, kinks and float16 included: nn.LeakyReLU (slope 1 at 0),
    nn.ELU (NaN gradients), nn.GELU/nn.Hardswish (float16 overflow), nn.LogSoftmax (segfault at
    width 1) and MLX's truncated selu, missing hard_sigmoid/exponential, axis-less Softmax are not."""
    module = db.compile(act, "mlx")
    native = NATIVE.get(act.name) if act.params.get("axis", -1) == -1 else None
    assert type(module) is (native or adapter.ExactActivation)
    assert db.to_spec(module) == act


def test_mlx_gelu_approx_is_the_tanh_formula():
    x = np.linspace(-6, 6, 61)
    expected = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    got = _np(nn.GELU(approx="precise")(mx.array(x, dtype=mx.float32)))
    _assert_close(got, expected, "float32", 1, C_OUTPUT, "gelu_approx")
    assert np.abs(_np(nn.GELU(approx="fast")(mx.array(x, dtype=mx.float32))) - expected).max() > 1e-3


def test_exact_selu_differs_from_mlx_truncated_selu():
    x = mx.array(np.linspace(-10, -1, 50), dtype=mx.float64)
    exact = _np(db.compile(Activation("selu"), "mlx")(x))
    np.testing.assert_allclose(exact, Activation("selu").forward(np.linspace(-10, -1, 50)), rtol=1e-12)
    assert np.abs(_np(nn.selu(x)) - exact).max() > 1e-6


@pytest.mark.parametrize("act", ALL_ACTS, ids=repr)
def test_dense_activation_forward_and_grads_match_reference(act):
    spec = db.Dense(6, in_features=5, activation=act)
    rng = _rng("dense" + repr(act))
    x, g = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(3, 6)).astype(np.float32)
    got = adapter.trace(db.compile(spec, "mlx", seed=2), [x], g).layers[0]
    ref = reference.trace(db.compile(spec, "numpy", seed=2), [x], g).layers[0]
    _assert_close(got.output, ref.output, "float32", 5, C_OUTPUT, "output")
    _assert_close(got.input_grads[0], ref.input_grads[0], "float32", 6, C_GRADIENT, "dL/dx")
    _assert_close(got.param_grads["kernel"], ref.param_grads["kernel"], "float32", 3, C_GRADIENT, "dL/dkernel")
    # softmax/log_softmax over axis 0 make dL/dbias a sum that cancels to 0: judge it on the scale
    # of the summed terms (rounding of each), since the formula's rms(reference) is then ~0
    atol = C_GRADIENT * np.finfo(np.float32).eps * np.sqrt(3) * np.sqrt(np.mean(np.square(g)))
    _assert_close(got.param_grads["bias"], ref.param_grads["bias"], "float32", 3, C_GRADIENT, "dL/dbias", atol)


# Width 1 runs in a child process: MLX 0.32.4's nn.log_softmax segfaults over an axis of length 1,
# and a regression must fail this test, not kill the whole pytest run.
WIDTH_ONE = """
import numpy as np, dense_bridge as db
from dense_bridge.backends import mlx as adapter, numpy as reference
for name in ("softmax", "log_softmax"):
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        spec = db.Sequential([db.Dense(1, in_features=3, activation=name, dtype=dtype), db.Activation(name),
                              db.Activation(name, axis=0), db.Dense(2, dtype=dtype), db.Activation(name, axis=0)])
        x, g = np.array([[0.5, -1.0, 2.0]], np.float32), np.array([[1.5, -2.0]], np.float32)
        got = adapter.trace(db.compile(spec, "mlx", seed=3), [x], g).layers
        ref = reference.trace(db.compile(spec, "numpy", seed=3), [x], g).layers
        for i, (a, r) in enumerate(zip(got, ref)):
            for what, u, v in [("output", a.output, r.output), ("dL/dx", a.input_grads[0], r.input_grads[0]),
                               *[(k, a.param_grads[k], r.param_grads[k]) for k in r.param_grads]]:
                np.testing.assert_allclose(np.asarray(u, np.float64), np.asarray(v, np.float64), rtol=2e-2,
                                           atol=2e-2, err_msg=f"{name} {dtype} layer {i} {what}")
print("ok")
"""


def test_width_one_softmax_and_log_softmax_forward_and_backward():
    run = subprocess.run([sys.executable, "-c", WIDTH_ONE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stdout, run.stderr[-3000:])


_LARGE = {"float16": (20, 100, 1000, 30000, 60000), "bfloat16": (20, 100, 1000, 1e30),
          "float32": (20, 100, 1000, 1e30)}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("act", ALL_ACTS, ids=repr)
def test_gradients_finite_and_right_at_large_inputs(act, dtype):
    """No unused branch or intermediate overflows: wherever the true value and gradient are finite
    in the dtype (exponential's are not beyond ~11 in float16), MLX's are, and match."""
    big = np.array(_LARGE[dtype], np.float64)
    # two rows, so softmax over axis 0 never has length 1 here (that case runs in a child process)
    x = np.concatenate([-big[::-1], big]).astype(numpy_dtype(dtype)).reshape(2, -1)
    g = np.resize(np.array([1.0, -0.5, 2.0, 0.25]), x.shape).astype(x.dtype)
    (y,), (dx,) = mx.vjp(db.compile(act, "mlx"), [_mx(x, dtype)], [_mx(g, dtype)])
    with np.errstate(over="ignore"):
        ry, rdx = (np.asarray(a, np.float64) for a in (act.forward(x), act.vjp(x, None, g)))
    eps = _eps(dtype)
    for what, got, ref in (("output", _np(y), ry), ("dL/dx", _np(dx), rdx)):
        ok = np.isfinite(ref)
        got, ref = np.asarray(got, np.float64)[ok], ref[ok]
        assert np.isfinite(got).all(), f"{what} not finite at x={x[ok][~np.isfinite(got)]}"
        assert np.all(np.abs(got - ref) <= 8 * eps * (1 + np.abs(ref))), (what, x[ok], got, ref)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("act", [a for a in ALL_ACTS if "axis" not in a.params], ids=repr)
def test_gradients_at_exact_kinks_match_reference(act, dtype):
    """relu'(0)=0, leaky_relu'(0)=slope, elu'(0)=alpha, selu'(0)=scale*alpha, relu6'(6)=0,
    hard_sigmoid'(+-3)=0, hard_silu'(-3)=0 and '(3)=1: the one-sided values torch and the reference use."""
    x = np.array(KINKS + tuple(-k for k in KINKS), np.float64).astype(numpy_dtype(dtype))
    (dx,) = mx.vjp(db.compile(act, "mlx"), [_mx(x, dtype)], [mx.ones(x.shape, getattr(mx, dtype))])[1]
    ref = act.vjp(x, None, np.ones_like(x)).astype(np.float64)
    # a few ulps (float64: MLX's exp/erf are float32-accurate, FACTS); a wrong one-sided value is off by O(slope)
    tol = dict(rtol=8 * max(_eps(dtype), 2.0 ** -23), atol=2 * max(_eps(dtype), 2.0 ** -23))
    np.testing.assert_allclose(_np(dx).astype(np.float64), ref, **tol, err_msg=f"{act!r} gradient at {x}")
    # the same through a Dense layer: an identity kernel puts the kinks exactly at the activation
    dense = db.compile(db.Dense(x.size, in_features=x.size, activation=act, use_bias=False, dtype=dtype),
                       "mlx", params={"kernel": np.eye(x.size, dtype=x.dtype)})
    dense_dx = adapter.trace(dense, [x[None, :]], np.ones((1, x.size), x.dtype)).layers[0].input_grads[0]
    np.testing.assert_allclose(np.asarray(dense_dx, np.float64)[0], ref, **tol, err_msg=f"Dense {act!r} at {x}")


# ------------------------------------------------------------------ masks
MASK_SPEC = db.Sequential([db.Dense(12, mask=db.wiring.random(10, 12, 0.4, 3), activation="tanh"),
                           db.Dense(5, mask=db.wiring.banded(12, 5, 2))])


def _train(model, opt, steps: int = 20) -> None:
    rng = _rng("train")
    x = mx.array(rng.normal(size=(16, 10)).astype(np.float32))
    target = mx.array(rng.normal(size=(16, 5)).astype(np.float32))

    def loss_fn(m, x, y):
        return mx.mean(mx.square(m(x) - y))

    step = nn.value_and_grad(model, loss_fn)
    for _ in range(steps):
        _, grads = step(model, x, target)
        assert not any(k.endswith("mask") for k, _ in tree_flatten(grads))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)


@pytest.mark.parametrize("make_opt", [
    lambda: optim.SGD(learning_rate=0.1, momentum=0.9, weight_decay=1e-2),
    lambda: optim.Adam(learning_rate=0.05),
    lambda: optim.AdamW(learning_rate=0.05, weight_decay=1e-2),
], ids=["sgd_momentum_wd", "adam", "adamw"])
def test_masked_weights_stay_exactly_zero_through_training(make_opt):
    model = db.compile(MASK_SPEC, "mlx", seed=4)
    before = {k: np.array(v) for k, v in db.get_params(model).items()}
    _train(model, make_opt())
    after = db.get_params(model)
    for i in (0, 1):
        mask = before[f"{i}.mask"]
        assert np.array_equal(after[f"{i}.mask"], mask)  # the mask itself never trains
        assert np.all(after[f"{i}.kernel"][mask == 0] == 0.0)
        assert not np.array_equal(after[f"{i}.kernel"], before[f"{i}.kernel"])  # the rest did train


def test_mask_is_saved_but_never_trainable(tmp_path):
    model = db.compile(MASK_SPEC, "mlx", seed=4)
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    saved = [k for k, _ in tree_flatten(model.parameters())]
    assert "layers.0.mask" in saved and "layers.1.mask" in saved
    assert not any(k.endswith("mask") for k in trainable)
    model.unfreeze()  # a fine-tuning habit: the mask must stay frozen through it
    assert not any(k.endswith("mask") for k, _ in tree_flatten(model.trainable_parameters()))
    model.layers[0].unfreeze(keys=["mask"], recurse=False)
    assert not any(k.endswith("mask") for k, _ in tree_flatten(model.trainable_parameters()))
    _train(model, optim.SGD(learning_rate=0.1, weight_decay=0.1), steps=3)

    path = str(tmp_path / "masked.safetensors")
    model.save_weights(path)
    fresh = db.compile(MASK_SPEC, "mlx", seed=99)
    fresh.load_weights(path)
    for k, v in db.get_params(model).items():
        assert np.array_equal(db.get_params(fresh)[k], v), k


def test_mask_holds_from_the_first_forward():
    spec = db.Dense(4, mask=db.wiring.banded(6, 4, 1), use_bias=False)
    layer = db.compile(spec, "mlx", seed=0)
    k = np.arange(24, dtype=np.float32).reshape(6, 4) + 1
    layer.weight = mx.array(k.T)  # a user writes unmasked weights straight into the module
    x = np.ones((1, 6), np.float32)
    np.testing.assert_array_equal(_np(layer(mx.array(x))), x @ (k * spec.mask.as_array()))


def test_set_params_stores_masked_entries_as_zero():
    spec = db.Dense(4, mask=db.wiring.banded(6, 4, 1))
    layer = db.compile(spec, "mlx", seed=0)
    ones = np.ones((6, 4), np.float32)
    db.set_params(layer, {"kernel": ones}, strict=False)
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], spec.mask.as_array())
    np.testing.assert_array_equal(_np(layer.weight), spec.mask.as_array().T)
    new_mask = np.zeros((6, 4), np.float32)
    new_mask[0] = 1
    with pytest.raises(db.ConversionError, match="mask entries differ"):  # the mask is the spec's
        db.set_params(layer, {"kernel": ones, "mask": new_mask}, strict=False)
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], spec.mask.as_array())
    assert db.to_spec(layer).mask == spec.mask


# ------------------------------------------------------------------ lazy
def test_lazy_same_seed_same_params_and_width_check():
    lazy = db.compile(db.Dense(5, activation="relu", dtype="bfloat16"), "mlx", seed=11)
    with pytest.raises(db.ConversionError, match="first input"):
        db.get_params(lazy)
    assert db.to_spec(lazy) == db.Dense(5, activation="relu", dtype="bfloat16")
    lazy(mx.ones((2, 7), dtype=mx.bfloat16))
    eager = db.compile(db.Dense(5, in_features=7, activation="relu", dtype="bfloat16"), "mlx", seed=11)
    for k, v in db.get_params(eager).items():
        assert db.get_params(lazy)[k].dtype == v.dtype and np.array_equal(db.get_params(lazy)[k], v), k
    assert db.to_spec(lazy) == db.Dense(5, in_features=7, activation="relu", dtype="bfloat16")
    with pytest.raises(db.SpecError, match=r"in_features=7.*\(2, 6\)"):
        lazy(mx.ones((2, 6), dtype=mx.bfloat16))


def test_lazy_sequential_builds_on_first_input():
    spec = db.Sequential([db.Dense(8, activation="gelu"), db.Dense(3)])
    model = db.compile(spec, "mlx", seed=5)
    assert db.to_spec(model) == spec
    model(mx.ones((2, 4)))
    eager = db.compile(spec.with_in_features(4), "mlx", seed=5)
    for k, v in db.get_params(eager).items():
        assert np.array_equal(db.get_params(model)[k], v), k


def test_lazy_spec_with_params_takes_its_width_from_them():
    k = np.arange(12, dtype=np.float32).reshape(3, 4)
    layer = db.compile(db.Dense(4, use_bias=False), "mlx", params={"kernel": k})
    assert type(layer) is nn.Linear
    np.testing.assert_array_equal(_np(layer.weight), k.T)


# ------------------------------------------------------------------ Bilinear and Identity
def test_bilinear_layout_forward_and_grads():
    spec = db.Bilinear(3, 5, 4)  # in1 != in2: a swapped axis cannot pass
    layer = db.compile(spec, "mlx", seed=6)
    assert type(layer) is nn.Bilinear and layer.weight.shape == (4, 5, 3)
    kernel = db.get_params(layer)["kernel"]
    assert kernel.shape == (4, 3, 5)
    np.testing.assert_array_equal(kernel, db.compile(spec, "numpy", seed=6).params()["kernel"])
    np.testing.assert_array_equal(_np(layer.weight), kernel.transpose(0, 2, 1))
    rng = _rng("bilinear")
    x1, x2 = rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=(2, 5)).astype(np.float32)
    expected = np.einsum("ni,kij,nj->nk", x1, kernel, x2) + db.get_params(layer)["bias"]
    _assert_close(_np(layer(mx.array(x1), mx.array(x2))), expected, "float32", 15, C_OUTPUT, "bilinear")
    g = rng.normal(size=(2, 4)).astype(np.float32)
    got = adapter.trace(layer, [x1, x2], g).layers[0]
    ref = reference.trace(db.compile(spec, "numpy", seed=6), [x1, x2], g).layers[0]
    _assert_close(got.output, ref.output, "float32", 15, C_OUTPUT, "output")
    for a, b, k in zip(got.input_grads, ref.input_grads, (20, 12)):
        _assert_close(a, b, "float32", k, C_GRADIENT, "dL/dx")
    for key in ("kernel", "bias"):
        _assert_close(got.param_grads[key], ref.param_grads[key], "float32", 2, C_GRADIENT, key)
    assert db.to_spec(layer) == spec


def test_bilinear_set_params_transposes_by_declaration():
    spec = db.Bilinear(3, 3, 2, use_bias=False)  # square in1 == in2: shape cannot tell the axes apart
    layer = db.compile(spec, "mlx", seed=0)
    kernel = np.arange(18, dtype=np.float32).reshape(2, 3, 3)
    db.set_params(layer, {"kernel": kernel})
    np.testing.assert_array_equal(_np(layer.weight), kernel.transpose(0, 2, 1))
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], kernel)


def test_identity():
    layer = db.compile(db.Identity(name="skip"), "mlx")
    assert type(layer) is nn.Identity
    assert db.to_spec(layer) == db.Identity(name="skip") and db.to_spec(nn.Identity()) == db.Identity()


# ------------------------------------------------------------------ to_spec
ROUND_TRIP_SPECS = [
    *[db.Dense(6, in_features=5, activation=a) for a in ALL_ACTS],
    db.Dense(6, in_features=5, use_bias=False, kernel_init="he_normal", name="no_bias"),
    db.Dense(6, mask=db.wiring.block_diagonal(6, 6, 2), bias_init="ones"),
    *[db.Dense(3, in_features=4, dtype=d) for d in ("float64", "float16", "bfloat16")],
    db.Dense(3),
    db.Sequential([db.Dense(16, in_features=8), db.Activation("relu"), db.Identity(),
                   db.Dense(4, activation=Activation("leaky_relu", negative_slope=0.2))], name="mlp"),
    db.Sequential([db.Activation("softmax", axis=0)], in_features=3),
    db.Bilinear(3, 5, 4, init="glorot_uniform", name="bi"),
    db.Bilinear(2, 3, 4, use_bias=False, dtype="bfloat16"),
    db.Identity(),
]


@pytest.mark.parametrize("spec", ROUND_TRIP_SPECS, ids=repr)
def test_to_spec_of_compiled_equals_spec(spec):
    assert db.to_spec(db.compile(spec, "mlx", seed=0)) == spec


def test_to_spec_of_hand_built_sequential():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    spec = db.to_spec(model)
    assert spec == db.Sequential([
        db.Dense(16, in_features=8, kernel_init="mlx_default", bias_init="mlx_default"),
        Activation("relu"),
        db.Dense(4, kernel_init="mlx_default", bias_init="mlx_default")])
    params = db.get_params(model)
    assert sorted(params) == ["0.bias", "0.kernel", "2.bias", "2.kernel"]
    np.testing.assert_array_equal(params["0.kernel"], _np(model.layers[0].weight).T)
    converted = db.compile(spec, "mlx", params=params)
    x = mx.array(_rng("hand").normal(size=(2, 8)).astype(np.float32))
    np.testing.assert_array_equal(_np(converted(x)), _np(model(x)))


@pytest.mark.parametrize("module, expected", [
    (nn.LeakyReLU(), Activation("leaky_relu", negative_slope=0.01)),
    (nn.LeakyReLU(0.2), Activation("leaky_relu", negative_slope=0.2)),
    (nn.ELU(alpha=0.7), Activation("elu", alpha=0.7)),
    (nn.GELU(), Activation("gelu")),
    (nn.GELU(approx="tanh"), Activation("gelu_tanh")),
    (nn.SELU(), Activation("selu", alpha=1.67326, scale=1.0507)),  # MLX's truncated constants, read exactly
    (nn.Softmax(), Activation("softmax", axis=-1)),
    (nn.LogSoftmax(), Activation("log_softmax", axis=-1)),
    (nn.Hardswish(), Activation("hard_silu")),
    (nn.relu, Activation("relu")),
    (nn.gelu_approx, Activation("gelu_tanh")),
    (functools.partial(nn.leaky_relu, negative_slope=0.3), Activation("leaky_relu", negative_slope=0.3)),
    (functools.partial(nn.softmax, axis=0), Activation("softmax", axis=0)),
    (mx.exp, Activation("exponential")),
], ids=repr)
def test_to_spec_reads_hand_built_activations_exactly(module, expected):
    spec = db.to_spec(nn.Sequential(nn.Linear(4, 3), module))
    assert spec.layers[1] == expected


@pytest.mark.parametrize("module", [
    nn.GELU(approx="fast"), nn.LeakyReLU(1.5), nn.PReLU(), nn.CELU(), lambda x: x * 2,
    nn.Sequential(nn.ReLU()), nn.Conv1d(2, 2, 1),
], ids=lambda m: type(m).__name__)
def test_to_spec_rejects_what_it_cannot_describe(module):
    with pytest.raises(db.ConversionError, match=r"native\.layers\[1\]"):
        db.to_spec(nn.Sequential(nn.Linear(4, 3), module))


def test_to_spec_of_plain_linear():
    assert db.to_spec(nn.Linear(5, 2, bias=False)) == db.Dense(
        2, in_features=5, use_bias=False, kernel_init="mlx_default", bias_init="mlx_default")


# ------------------------------------------------------------------ get/set params
def test_get_params_are_read_only_views_that_stay_snapshots():
    layer = db.compile(db.Dense(4, in_features=3), "mlx", seed=0)
    kernel = db.get_params(layer, copy=False)["kernel"]
    assert not kernel.flags.writeable
    assert np.shares_memory(kernel, np.asarray(layer.weight))
    before = kernel.copy()
    _, grads = nn.value_and_grad(layer, lambda m, x: m(x).sum())(layer, mx.ones((2, 3)))
    optim.SGD(learning_rate=1.0).update(layer, grads)
    mx.eval(layer.parameters())
    np.testing.assert_array_equal(kernel, before)  # MLX rebinds to a new array; the view is unchanged
    assert not np.array_equal(db.get_params(layer)["kernel"], before)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_set_get_round_trip_keeps_dtype_and_bits(dtype):
    spec = db.Sequential([db.Dense(5, in_features=4, dtype=dtype), db.Activation("relu"),
                          db.Dense(3, dtype=dtype, mask=db.wiring.banded(5, 3, 1))])
    model = db.compile(spec, "mlx", seed=0)
    source = db.compile(spec, "numpy", seed=8).params()
    db.set_params(model, source)
    got = db.get_params(model)
    assert got.keys() == source.keys()
    for k, v in source.items():
        assert got[k].dtype == v.dtype, k
        assert np.array_equal(np.ascontiguousarray(got[k]).view(np.uint8), np.ascontiguousarray(v).view(np.uint8)), k
    assert model.layers[0].weight.dtype == getattr(mx, dtype)


def test_square_layer_sets_kernel_transposed_exactly():
    layer = db.compile(db.Dense(4, in_features=4), "mlx", seed=0)
    k = np.arange(16, dtype=np.float32).reshape(4, 4)
    db.set_params(layer, {"kernel": k, "bias": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(_np(layer.weight), k.T)
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], k)


def test_set_params_copies_and_rejects_bad_input_atomically():
    layer = db.compile(db.Dense(3, in_features=2), "mlx", seed=0)
    before = {k: np.array(v) for k, v in db.get_params(layer).items()}
    with pytest.raises(db.ConversionError, match=r"missing keys.*unexpected keys.*expected shape"):
        db.set_params(layer, {"kernel": np.zeros((3, 2), np.float32), "extra": np.zeros(1)})
    for k, v in db.get_params(layer).items():
        np.testing.assert_array_equal(v, before[k])
    k = np.ones((2, 3), np.float32)
    db.set_params(layer, {"kernel": k, "bias": np.zeros(3, np.float32)})
    k[:] = 5  # the caller's array is not the layer's memory
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], np.ones((2, 3)))


def test_float64_params_stay_float64():
    layer = db.compile(db.Dense(3, in_features=2, dtype="float64"), "mlx", seed=0)
    k = np.array([[1 / 3, 2 / 3, 1e-300], [np.pi, np.e, -1 / 7]])
    db.set_params(layer, {"kernel": k, "bias": np.zeros(3)})
    assert layer.weight.dtype == mx.float64
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], k)


# ------------------------------------------------------------------ trace
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_trace_matches_numpy_backward(dtype):
    spec = db.Sequential([
        db.Dense(24, in_features=12, activation="gelu", dtype=dtype),
        db.Dense(16, activation=Activation("leaky_relu", negative_slope=0.1),
                 mask=db.wiring.random(24, 16, 0.5, 1), dtype=dtype),
        db.Activation("softmax"),
        db.Identity(),
        db.Dense(6, use_bias=False, dtype=dtype),
    ])
    rng = _rng("trace" + dtype)
    x, g = rng.normal(size=(5, 12)).astype(np.float32), rng.normal(size=(5, 6)).astype(np.float32)
    got = adapter.trace(db.compile(spec, "mlx", seed=3), [x], g)
    ref = reference.trace(db.compile(spec, "numpy", seed=3), [x], g)
    assert len(got.layers) == len(ref.layers) == 5
    tol = "float32" if dtype == "float64" else dtype  # MLX float64 exp/erf: float32-accurate (FACTS)
    fan_in = [12, 24, 16, 16, 16]
    for i, (a, b) in enumerate(zip(got.layers, ref.layers)):
        assert a.output.dtype == b.output.dtype, i
        _assert_close(a.output, b.output, tol, fan_in[i], C_OUTPUT, f"layer {i} output")
        _assert_close(a.input_grads[0], b.input_grads[0], tol, 24, C_GRADIENT, f"layer {i} dL/dx")
        assert a.param_grads.keys() == b.param_grads.keys(), i
        for k in b.param_grads:
            _assert_close(a.param_grads[k], b.param_grads[k], tol, 5, C_GRADIENT, f"layer {i} dL/d{k}")
    masked = db.get_params(db.compile(spec, "mlx", seed=3))["1.mask"] == 0
    assert np.all(got.layers[1].param_grads["kernel"][masked] == 0)


def test_trace_restores_the_module_parameters():
    layer = db.compile(db.Dense(3, in_features=2, activation="tanh"), "mlx", seed=0)
    weight = layer.weight
    adapter.trace(layer, [np.ones((1, 2), np.float32)], np.ones((1, 3), np.float32))
    assert layer.weight is weight


def test_trace_of_hand_built_sequential_with_bare_functions():
    model = nn.Sequential(nn.Linear(6, 8), nn.relu, nn.Linear(8, 3), functools.partial(nn.softmax, axis=-1))
    rng = _rng("bare")
    x, g = rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    got = adapter.trace(model, [x], g)
    ref_model = db.compile(db.to_spec(model), "numpy", params=db.get_params(model))
    ref = reference.trace(ref_model, [x], g)
    for i, (a, b) in enumerate(zip(got.layers, ref.layers)):
        _assert_close(a.output, b.output, "float32", 8, C_OUTPUT, f"layer {i} output")
        _assert_close(a.input_grads[0], b.input_grads[0], "float32", 8, C_GRADIENT, f"layer {i} dL/dx")
        for k in b.param_grads:
            _assert_close(a.param_grads[k], b.param_grads[k], "float32", 4, C_GRADIENT, f"layer {i} {k}")


def test_compile_with_params_zeroes_masked_entries():
    spec = db.Dense(4, mask=db.wiring.banded(6, 4, 1))
    params = {"kernel": np.ones((6, 4), np.float32), "bias": np.zeros(4, np.float32),
              "mask": spec.mask.as_array()}
    layer = db.compile(spec, "mlx", params=params)
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], spec.mask.as_array())


def test_convert_through_numpy_and_back_is_exact():
    spec = db.Sequential([db.Dense(8, in_features=4, activation="selu"), db.Dense(5, mask=db.wiring.banded(8, 5, 2))])
    model = db.compile(spec, "mlx", seed=1)
    back = db.convert(db.convert(model, to="numpy"), to="mlx")
    assert db.to_spec(back) == spec
    for k, v in db.get_params(model).items():
        np.testing.assert_array_equal(db.get_params(back)[k], v)


def test_nn_quantize_skips_layers_it_would_break():
    model = db.compile(db.Sequential([db.Dense(64, in_features=64, activation="relu"), db.Dense(64)]), "mlx", seed=0)
    nn.quantize(model)  # QuantizedLinear has no activation/mask: only the plain nn.Linear converts
    assert type(model.layers[0]) is adapter.DenseLinear
    assert type(model.layers[1]) is nn.QuantizedLinear
