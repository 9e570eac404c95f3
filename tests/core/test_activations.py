"""Tests of dense_bridge.activations: the canonical table and its float64 numpy references."""
from __future__ import annotations

import copy
import json
import math
import pickle
import warnings
import zlib

import numpy as np
import pytest

from dense_bridge._errors import SpecError
from dense_bridge.activations import NAMES, Activation, get

from conftest import KINKS, away_from_kinks

# Points where some activation is not differentiable; finite differences stay away from them.

NON_DEFAULT = {
    "leaky_relu": {"negative_slope": 0.2},
    "elu": {"alpha": 0.5},
    "selu": {"alpha": 1.5, "scale": 1.25},
    "softmax": {"axis": 0},
    "log_softmax": {"axis": 0},
}


def _away_from_kinks(x: np.ndarray) -> np.ndarray:
    return away_from_kinks(x, margin=1e-3)


def _acts_with_non_defaults() -> list[Activation]:
    """Every activation with default params, plus the non-default variants."""
    return [Activation(n) for n in NAMES] + [Activation(n, **p) for n, p in NON_DEFAULT.items()]


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", _acts_with_non_defaults(), ids=repr)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)], ids=lambda s: f"rank{len(s)}")
def test_vjp_matches_central_finite_differences(act, shape):
    """grad_out-weighted central differences in float64 agree with vjp to 1e-6 relative."""
    rng = np.random.default_rng(zlib.crc32(f"{act!r}{shape}".encode()))
    x = _away_from_kinks(rng.normal(scale=3.0, size=shape))
    g = rng.normal(size=shape)
    h = 1e-6
    fd = np.empty_like(x)
    for idx in np.ndindex(*shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        fd[idx] = (np.sum(g * act.forward(xp)) - np.sum(g * act.forward(xm))) / (2 * h)
    got = act.vjp(x, act.forward(x), g)
    rel = np.max(np.abs(fd - got)) / max(1e-12, np.max(np.abs(fd)))
    assert rel < 1e-6, (act, rel)


# Kink derivatives, measured with torch 2.13 autograd in float64.
KINK_GRADS = [
    (Activation("relu"), 0.0, 0.0),
    (Activation("relu6"), 0.0, 0.0),
    (Activation("relu6"), 6.0, 0.0),
    (Activation("leaky_relu"), 0.0, 0.01),
    (Activation("leaky_relu", negative_slope=0.2), 0.0, 0.2),
    (Activation("elu"), 0.0, 1.0),
    (Activation("elu", alpha=2.0), 0.0, 2.0),
    (
        Activation("selu"),
        0.0,
        1.6732632423543772848170429916717 * 1.0507009873554804934193349852946,
    ),
    (Activation("hard_sigmoid"), -3.0, 0.0),
    (Activation("hard_sigmoid"), 3.0, 0.0),
    (Activation("hard_silu"), -3.0, 0.0),
    (Activation("hard_silu"), 3.0, 1.0),
]


@pytest.mark.parametrize("act,x,expected", KINK_GRADS, ids=lambda v: repr(v))
def test_kink_derivatives_match_torch_convention(act, x, expected):
    """At kinks the vjp takes the one-sided value torch's autograd gives."""
    got = act.vjp(np.array([x]), None, np.array([1.0]))
    assert got[0] == pytest.approx(expected, rel=1e-15, abs=0)


# --------------------------------------------------------------------------------------------
# Independent reference: torch in float64
# --------------------------------------------------------------------------------------------


def _torch_reference(act: Activation):
    """torch functional with the same explicit parameters (float64 tensors in and out)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    p = act.params
    return {
        "linear": lambda t: t,
        "relu": F.relu,
        "relu6": F.relu6,
        "leaky_relu": lambda t: F.leaky_relu(t, p.get("negative_slope", 0.0)),
        "elu": lambda t: F.elu(t, alpha=p.get("alpha", 1.0)),
        "selu": F.selu,
        "gelu": lambda t: F.gelu(t, approximate="none"),
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu,
        "sigmoid": torch.sigmoid,
        "hard_sigmoid": F.hardsigmoid,
        "hard_silu": F.hardswish,
        "tanh": torch.tanh,
        # torch's F.softplus returns x above its threshold (20); the exact function is this.
        "softplus": lambda t: torch.log1p(torch.exp(t)),
        "softsign": F.softsign,
        "mish": F.mish,
        "softmax": lambda t: F.softmax(t, dim=p.get("axis", -1)),
        "log_softmax": lambda t: F.log_softmax(t, dim=p.get("axis", -1)),
        "exponential": torch.exp,
    }[act.name]


TORCH_CASES = [Activation(n) for n in NAMES] + [
    Activation("leaky_relu", negative_slope=0.2),
    Activation("elu", alpha=0.5),
    Activation("softmax", axis=0),
    Activation("log_softmax", axis=1),
]


def _torch_inputs() -> np.ndarray:
    """Random (4, 6, 5) values in [-10, 10] with the kinks themselves included."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-10, 10, size=(4, 6, 5))
    x.flat[: 2 * len(KINKS)] = KINKS + tuple(k + 1e-9 for k in KINKS)
    return x


@pytest.mark.parametrize("act", TORCH_CASES, ids=repr)
def test_forward_matches_torch_float64(act):
    """forward agrees with torch's functional in float64 to 1e-12 (relative above 1)."""
    torch = pytest.importorskip("torch")
    fn = _torch_reference(act)
    x = _torch_inputs()
    want = fn(torch.from_numpy(x)).numpy()
    got = act.forward(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_array_less(np.abs(got - want), 1e-12 * np.maximum(1.0, np.abs(want)))


@pytest.mark.parametrize("act", TORCH_CASES, ids=repr)
def test_vjp_matches_torch_autograd_float64(act):
    """vjp agrees with torch autograd in float64, kinks included."""
    torch = pytest.importorskip("torch")
    fn = _torch_reference(act)
    x = _torch_inputs()
    g = np.random.default_rng(1).normal(size=x.shape)
    t = torch.from_numpy(x.copy()).requires_grad_(True)
    (fn(t) * torch.from_numpy(g)).sum().backward()
    want = t.grad.numpy()
    got = act.vjp(x, act.forward(x), g)
    # torch's hardsigmoid backward rounds its 1/6 to float32 (3e-8 relative); we keep the exact 1/6.
    tol = 1e-7 if act.name == "hard_sigmoid" else 1e-12
    np.testing.assert_array_less(np.abs(got - want), tol * np.maximum(1.0, np.abs(want)))


def test_leaky_relu_default_slope_is_torch_and_mlx_value():
    """The default slope is 0.01 (torch, MLX), not Keras' 0.2 or 0.3."""
    assert Activation("leaky_relu").params == {"negative_slope": 0.01}


def test_selu_constants_are_exact_not_mlx_truncated():
    """selu carries the full-precision constants."""
    p = Activation("selu").params
    assert p["alpha"] == 1.6732632423543772848170429916717
    assert p["scale"] == 1.0507009873554804934193349852946


def test_softplus_has_no_threshold():
    """softplus(30) is log(1 + e^30), not 30 as torch's thresholded version returns."""
    y = Activation("softplus").forward(np.array([30.0]))[0]
    assert y == pytest.approx(30.0 + math.log1p(math.exp(-30.0)), rel=1e-16)
    assert y != 30.0


def test_gelu_is_exact_erf_not_tanh():
    """gelu and gelu_tanh are different functions (about 1e-3 apart somewhere)."""
    x = np.linspace(-5, 5, 1001)
    diff = np.max(np.abs(Activation("gelu").forward(x) - Activation("gelu_tanh").forward(x)))
    assert 1e-4 < diff < 1e-2
    want = 0.5 * (1 + math.erf(1 / math.sqrt(2)))
    assert Activation("gelu").forward(np.array([1.0]))[0] == pytest.approx(want, rel=1e-15)


# --------------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_output_dtype_follows_input(name, dtype):
    """forward and vjp return x's dtype; the float64 result is rounded once."""
    act = Activation(name)
    x64 = np.linspace(-4, 4, 12).reshape(3, 4)
    x = x64.astype(dtype)
    y = act.forward(x)
    dx = act.vjp(x, y, np.ones_like(x))
    assert y.dtype == dtype and dx.dtype == dtype
    np.testing.assert_array_equal(y, act.forward(x.astype(np.float64)).astype(dtype))


def test_bfloat16_output_dtype():
    """ml_dtypes bfloat16 in gives bfloat16 out."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.linspace(-3, 3, 8).astype(ml_dtypes.bfloat16)
    act = Activation("gelu")
    assert act.forward(x).dtype == x.dtype
    assert act.vjp(x, None, np.ones_like(x)).dtype == x.dtype


def test_integer_input_gives_float64():
    """Integer input is computed and returned in float64 (casting back to int would truncate)."""
    y = Activation("sigmoid").forward(np.array([0, 1, 2]))
    assert y.dtype == np.float64 and y[0] == 0.5


def test_vjp_rejects_mismatched_shapes():
    """grad_out (and y when given) must have the shape of x."""
    act = Activation("relu")
    with pytest.raises(ValueError, match="grad_out"):
        act.vjp(np.zeros(3), None, np.zeros(4))
    with pytest.raises(ValueError, match="y"):
        act.vjp(np.zeros(3), np.zeros(2), np.zeros(3))


# --------------------------------------------------------------------------------------------
# Spec: config, equality, aliases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", _acts_with_non_defaults(), ids=repr)
def test_config_json_round_trip(act):
    """to_config survives JSON and from_config rebuilds an equal spec."""
    text = json.dumps(act.to_config())
    back = Activation.from_config(json.loads(text))
    assert back == act and hash(back) == hash(act)
    assert get(json.loads(text)) == act
    assert back.to_config() == act.to_config()
    assert eval(repr(act), {"Activation": Activation}) == act


def test_config_types_are_plain_python():
    """Float params are Python floats and ints are ints, even when numpy scalars came in."""
    cfg = Activation("elu", alpha=np.float32(0.5)).to_config()
    assert type(cfg["params"]["alpha"]) is float
    cfg = Activation("softmax", axis=np.int64(1)).to_config()
    assert type(cfg["params"]["axis"]) is int
    assert cfg == {"name": "softmax", "params": {"axis": 1}}


def test_equality_and_hash():
    """ints are stored as floats; different params are different specs."""
    assert Activation("elu", alpha=1) == Activation("elu", alpha=1.0) == Activation("elu")
    assert hash(Activation("elu", alpha=1)) == hash(Activation("elu"))
    assert Activation("elu", alpha=2.0) != Activation("elu")
    assert Activation("leaky_relu") != Activation("leaky_relu", negative_slope=0.2)
    assert Activation("relu") != "relu"
    specs = {Activation("swish"), Activation("silu"), Activation("SiLU"), Activation("relu")}
    assert len(specs) == 2


def test_immutable_and_picklable():
    """Attributes cannot be set, params cannot be mutated, and copies stay equal."""
    act = Activation("leaky_relu", negative_slope=0.2)
    with pytest.raises(AttributeError):
        act.name = "relu"
    with pytest.raises(TypeError):
        act.params["negative_slope"] = 0.3
    assert act.params == {"negative_slope": 0.2}
    assert pickle.loads(pickle.dumps(act)) == act
    assert copy.deepcopy(act) == act


@pytest.mark.parametrize(
    "alias,canonical",
    [
        ("swish", "silu"),
        ("hard_swish", "hard_silu"),
        ("gelu_exact", "gelu"),
        ("identity", "linear"),
        (None, "linear"),
        ("ReLU", "relu"),
        ("Leaky_ReLU", "leaky_relu"),
        ("SWISH", "silu"),
    ],
)
def test_aliases_canonicalise(alias, canonical):
    """Aliases and case variants store the canonical name."""
    assert Activation(alias).name == canonical
    assert get(alias) == Activation(canonical)
    assert get(alias).to_config()["name"] == canonical


def test_get_passes_activations_through():
    """get returns an Activation itself, and None/"linear" is the identity."""
    act = Activation("elu", alpha=0.3)
    assert get(act) is act
    assert get(None).is_identity and get("linear").is_identity
    assert not get("relu").is_identity


def test_names_and_params_table():
    """Every canonical name is present, and params list every default."""
    assert set(NAMES) == {
        "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "gelu", "gelu_tanh", "silu",
        "sigmoid", "hard_sigmoid", "hard_silu", "tanh", "softplus", "softsign", "mish",
        "softmax", "log_softmax", "exponential",
    }
    assert Activation("elu").params == {"alpha": 1.0}
    assert Activation("softmax").params == {"axis": -1}
    assert Activation("relu").params == {}
    assert all(Activation(n).num_params == 0 for n in NAMES)


def test_flops():
    """Rough counts: 0 for linear, scaling with batch and features."""
    assert Activation("linear").flops(32, 64) == 0
    relu = Activation("relu")
    assert relu.flops() > 0
    assert relu.flops(batch_size=4, features=8) == 32 * relu.flops()
    assert Activation("gelu").flops(2, 3) > relu.flops(2, 3)
    with pytest.raises(TypeError, match="batch_size"):
        relu.flops(batch_size=1.5)
    with pytest.raises(SpecError, match="features=-1"):
        relu.flops(features=-1)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_unknown_name_suggests():
    """A typo gets a suggestion, the list of known names, and the value echoed."""
    with pytest.raises(SpecError) as info:
        get("rleu")
    msg = str(info.value)
    assert "Did you mean 'relu'?" in msg and "Known:" in msg and "leaky_relu" in msg
    assert "Received: activation='rleu'" in msg
    with pytest.raises(SpecError, match="Received: name='geluu'"):
        Activation("geluu")


def test_unknown_param_names_activation_and_param():
    """An unknown parameter names the activation and the parameter, with a suggestion."""
    with pytest.raises(SpecError) as info:
        Activation("leaky_relu", slope=0.2)
    msg = str(info.value)
    assert "'leaky_relu'" in msg and "'slope'" in msg and "negative_slope" in msg
    assert "Received: slope=0.2" in msg
    with pytest.raises(SpecError, match="'relu'.*'alpha'.*Received: alpha=1.0"):
        Activation("relu", alpha=1.0)


@pytest.mark.parametrize(
    "name,params,shown",
    [
        ("leaky_relu", {"negative_slope": "a"}, "negative_slope='a'"),
        ("leaky_relu", {"negative_slope": True}, "negative_slope=True"),
        ("elu", {"alpha": None}, "alpha=None"),
        ("softmax", {"axis": 1.5}, "axis=1.5"),
        ("softmax", {"axis": True}, "axis=True"),
        ("log_softmax", {"axis": "-1"}, "axis='-1'"),
    ],
)
def test_wrong_param_type_is_type_error(name, params, shown):
    """Wrong types (bools included) raise TypeError naming the parameter and echoing the value."""
    with pytest.raises(TypeError) as info:
        Activation(name, **params)
    assert f"Received: {shown}" in str(info.value)


@pytest.mark.parametrize(
    "name,params,shown",
    [
        ("leaky_relu", {"negative_slope": float("nan")}, "negative_slope=nan"),
        ("leaky_relu", {"negative_slope": float("inf")}, "negative_slope=inf"),
        ("elu", {"alpha": -1.0}, "alpha=-1.0"),
        ("elu", {"alpha": 0}, "alpha=0"),
        ("selu", {"scale": -0.5}, "scale=-0.5"),
        ("selu", {"alpha": float("nan")}, "alpha=nan"),
    ],
)
def test_bad_param_value_is_spec_error(name, params, shown):
    """Non-finite floats and non-positive elu/selu constants raise SpecError echoing the value."""
    with pytest.raises(SpecError) as info:
        Activation(name, **params)
    assert f"Received: {shown}" in str(info.value)


def test_negative_slope_may_be_any_finite_float():
    """negative_slope has no sign constraint."""
    assert Activation("leaky_relu", negative_slope=-0.5).params["negative_slope"] == -0.5
    assert Activation("leaky_relu", negative_slope=2).params["negative_slope"] == 2.0


@pytest.mark.parametrize("value", [3, 1.5, ["relu"], object()])
def test_get_wrong_type_is_type_error(value):
    """get() of a non-spec raises TypeError naming `activation` and echoing the value."""
    with pytest.raises(TypeError) as info:
        get(value)
    assert f"Received: activation={value!r}" in str(info.value)


def test_bad_configs():
    """from_config rejects non-dicts, missing names and unknown keys."""
    with pytest.raises(TypeError, match="config"):
        Activation.from_config("relu")
    with pytest.raises(SpecError, match="name"):
        Activation.from_config({"params": {}})
    with pytest.raises(SpecError, match="unknown keys"):
        Activation.from_config({"name": "relu", "extra": 1})
    with pytest.raises(SpecError, match="rleu"):
        get({"name": "rleu"})


# --------------------------------------------------------------------------------------------
# Numerical robustness
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_no_warnings_at_extremes(name, dtype):
    """Inputs at +-1000 (and 0) produce no numpy warnings in forward or vjp."""
    act = Activation(name)
    x = np.array([[-1000.0, 0.0, 1000.0], [1000.0, -1000.0, 0.0]], dtype=dtype)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        y = act.forward(x)
        act.vjp(x, y, np.ones_like(x))
        act.vjp(x, y, np.zeros_like(x))
        if name not in ("exponential",):
            assert np.all(np.isfinite(y.astype(np.float64)))


def test_extreme_values_are_right():
    """Saturating functions reach their exact limits at +-1000."""
    x = np.array([-1000.0, 1000.0])
    np.testing.assert_array_equal(Activation("sigmoid").forward(x), [0.0, 1.0])
    np.testing.assert_array_equal(Activation("softplus").forward(x), [0.0, 1000.0])
    np.testing.assert_array_equal(Activation("silu").forward(x), [-0.0, 1000.0])
    np.testing.assert_array_equal(Activation("gelu").forward(x), [-0.0, 1000.0])
    np.testing.assert_array_equal(Activation("gelu_tanh").forward(x), [-0.0, 1000.0])
    np.testing.assert_array_equal(Activation("mish").forward(x), [-0.0, 1000.0])
    np.testing.assert_array_equal(Activation("softmax").forward(x), [0.0, 1.0])
    np.testing.assert_array_equal(Activation("log_softmax").forward(x), [-2000.0, 0.0])
    np.testing.assert_array_equal(Activation("sigmoid").vjp(x, None, np.ones(2)), [0.0, 0.0])
    assert Activation("exponential").forward(x)[1] == np.inf


def test_left_tails_keep_relative_accuracy():
    """gelu(-30) and sigmoid(-700) are tiny but not flushed by 1 + erf / 1 - x cancellation."""
    g = Activation("gelu").forward(np.array([-30.0]))[0]
    assert g == pytest.approx(-30.0 * 0.5 * math.erfc(30.0 / math.sqrt(2)), rel=1e-14) and g < 0
    s = Activation("sigmoid").forward(np.array([-700.0]))[0]
    assert s == pytest.approx(math.exp(-700.0), rel=1e-12)
