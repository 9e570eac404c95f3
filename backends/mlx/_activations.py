"""Activations on MLX, both directions: canonical Activation -> exact ``mlx.nn`` module or function,
and native MLX activation modules / bare functions -> canonical Activation.

Compiling picks the ``mlx.nn`` module where MLX computes exactly that function, gradients at
kinks and in float16 included (``nn.ReLU``, ``nn.SiLU``, ``nn.Softmax()`` for axis -1, ...),
else :class:`ExactActivation` (see ``_NATIVE_MODULES`` for why each other MLX module is not
exact). Reading still accepts all of these native modules and functions when users build them
by hand.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from dense_bridge._errors import ConversionError, SpecError, received
from dense_bridge.activations import Activation


# ------------------------------------------------------------------ canonical -> MLX
def _gelu_tanh(x):
    """0.5x(1 + tanh(u)), u = sqrt(2/pi)(x + 0.044715x^3), with x clipped to +-10 inside u only.

    nn.gelu_approx cubes x as it is: x^3 overflows float16 above |x| = 40 (float32 above 7e12),
    and tanh's vjp then multiplies 0 by inf (NaN gradients). At |x| = 10, u = 43.7 and tanh(u)
    is +-1 to float64 precision, so the clip changes no value and no gradient.
    """
    c = mx.clip(x, -10.0, 10.0)
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (c + 0.044715 * c * c * c)))


@functools.cache
def _mlx_gelu_approx_is_tanh() -> bool:
    """Does nn.gelu_approx compute the tanh formula? (Older MLX used a sigmoid fit instead.)"""
    x = mx.array([-3.0, -1.5, -0.5, 0.7, 2.0, 4.0], dtype=mx.float32)
    diff = mx.max(mx.abs(nn.gelu_approx(x) - _gelu_tanh(x))).item()
    return diff < 1e-5  # the two formulas differ by ~1e-4; float32 rounding is ~1e-7


@mx.custom_function
def _expm1(x):
    """mx.expm1 with the gradient exp(x): MLX's expm1 vjp is (expm1(x) + 1), which cancels in
    low precision (bfloat16 elu'(-6) 0.0039 instead of 0.0025)."""
    return mx.expm1(x)


@_expm1.vjp
def _expm1_vjp(x, cotangent, output):
    return (cotangent * mx.exp(x),)


@_expm1.jvp
def _expm1_jvp(x, tangent):
    return (tangent * mx.exp(x),)


def _elu(alpha: float, scale: float = 1.0) -> Callable:
    """scale * (x if x > 0 else alpha*expm1(x)): elu (scale 1) and selu, finite in every dtype.

    Not nn.elu: it takes exp of every x, so the unused branch overflows (float16 above 11,
    float32 above 88) and where()'s vjp turns 0 * inf into NaN gradients; expm1 here only
    sees x <= 0. where(x > 0, 0, x) rather than minimum(x, 0): MLX's minimum gives a tie's
    gradient to its second argument, making elu'(0) 0 instead of alpha (torch, reference).
    """
    neg_scale = scale * alpha  # one rounded constant, as the float64 reference multiplies
    if scale == 1.0:
        return lambda x: mx.where(x > 0, x, neg_scale * _expm1(mx.where(x > 0, 0, x)))
    return lambda x: mx.where(x > 0, scale * x, neg_scale * _expm1(mx.where(x > 0, 0, x)))


def _gelu_erf(x):
    """x * Phi(x) with Phi = (1 + erf(x/sqrt 2))/2 formed first: nn.gelu's x * (1 + erf) / 2
    overflows float16 for x above 32752."""
    return x * ((1 + mx.erf(x / math.sqrt(2))) * 0.5)


def _hard_sigmoid(x):
    """relu6(x + 3) / 6, as torch and Keras 3 (gradient 0 at the kinks -3 and 3)."""
    return mx.minimum(mx.maximum(x + 3, 0), 6) / 6


def _log_softmax(axis: int) -> Callable:
    """(x - max) - logsumexp(x - max), the formula of nn.log_softmax, run uncompiled.

    nn.log_softmax is mx.compile(shapeless=True)'d, and MLX 0.32.4 segfaults in it when the
    axis has length 1 (any dtype). Subtracting the max first keeps float16 exact-ish where
    x - logsumexp(x) loses the normaliser to the rounding of a large max (0.2 off at 1000).
    """
    def log_softmax(x):
        shifted = x - mx.stop_gradient(mx.max(x, axis=axis, keepdims=True))
        return shifted - mx.logsumexp(shifted, axis=axis, keepdims=True)
    return log_softmax


def _exact_fn(act: Activation) -> Callable:
    """The exact function for activations MLX lacks or defines differently."""
    n, p = act.name, act.params
    if n == "linear":
        return lambda x: x
    if n == "elu":
        return _elu(p["alpha"])
    if n == "selu":  # MLX's selu truncates the constants to 1.0507 and 1.67326
        return _elu(p["alpha"], p["scale"])
    if n == "gelu":
        return _gelu_erf
    if n == "hard_sigmoid":
        return _hard_sigmoid
    if n == "hard_silu":  # x * hard_sigmoid(x): nn.hardswish's x * min(.., 6) / 6 overflows float16
        return lambda x: x * _hard_sigmoid(x)
    if n == "exponential":
        return mx.exp
    if n == "leaky_relu":  # where(), not maximum(s*x, x): right for any slope, and slope at 0
        s = p["negative_slope"]
        return lambda x: mx.where(x > 0, x, s * x)
    if n == "gelu_tanh":
        return _gelu_tanh
    if n == "softmax":
        axis = p["axis"]
        return lambda x: mx.softmax(x, axis=axis)
    if n == "log_softmax":
        return _log_softmax(p["axis"])
    raise SpecError(f"no exact MLX function for {act!r}")  # pragma: no cover - table complete


# name -> factory(params) -> native module; only where the module computes exactly that function,
# including its gradient at kinks and in low precision. Elsewhere ExactActivation (see _exact_fn):
# nn.LeakyReLU's maximum(s*x, x) has slope 1 at 0 (reference: s); nn.ELU gives NaN gradients for
# large x; nn.GELU overflows float16 (x*(1+erf) above 32752, x^3 in the tanh form above 40);
# nn.Hardswish overflows float16 above ~10920 (6x); nn.LogSoftmax segfaults over an axis of length 1.
_NATIVE_MODULES: dict[str, Callable[[dict], nn.Module | None]] = {
    "relu": lambda p: nn.ReLU(),
    "relu6": lambda p: nn.ReLU6(),
    "silu": lambda p: nn.SiLU(),
    "sigmoid": lambda p: nn.Sigmoid(),
    "tanh": lambda p: nn.Tanh(),
    "softplus": lambda p: nn.Softplus(),  # logaddexp(x, 0): no threshold
    "softsign": lambda p: nn.Softsign(),
    "mish": lambda p: nn.Mish(),
    # nn.Softmax acts on the last axis only
    "softmax": lambda p: nn.Softmax() if p["axis"] == -1 else None,
}


class ExactActivation(nn.Module):
    """A parameter-free module computing ``activation`` exactly where no MLX module does."""

    def __init__(self, activation: Activation) -> None:
        super().__init__()
        self._activation = activation
        self._fn = _exact_fn(activation)

    @property
    def activation(self) -> Activation:
        return self._activation

    def _extra_repr(self) -> str:
        return repr(self._activation)

    def __call__(self, x: mx.array) -> mx.array:
        return self._fn(x)


def activation_module(act: Activation) -> nn.Module:
    """The MLX module for an Activation layer: native where exact, else ExactActivation."""
    factory = _NATIVE_MODULES.get(act.name)
    module = factory(act.params) if factory is not None else None
    return module if module is not None else ExactActivation(act)


def activation_fn(act: Activation) -> Callable:
    """The callable a DenseLinear applies after its affine map (native module where exact).

    A bound method, not the module: a module attribute would become a child of the layer.
    """
    return activation_module(act).__call__



# ------------------------------------------------------------------ MLX -> canonical
def conversion_error(where: str, m, why: str) -> ConversionError:
    return ConversionError(f"{where} ({type(m).__module__}.{type(m).__qualname__}) {why}. "
                           f"{received(where, m)}")


def activation_of_module(m, where: str) -> Activation:
    """The canonical Activation an MLX activation module computes, parameters read exactly."""
    t = type(m)
    if isinstance(m, ExactActivation):
        return m.activation
    simple = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.SiLU: "silu", nn.Sigmoid: "sigmoid",
              nn.Tanh: "tanh", nn.Softplus: "softplus", nn.Softsign: "softsign", nn.Mish: "mish",
              nn.Hardswish: "hard_silu"}
    if t in simple:
        return Activation(simple[t])
    if t is nn.Softmax:
        return Activation("softmax", axis=-1)
    if t is nn.LogSoftmax:
        return Activation("log_softmax", axis=-1)
    if t is nn.SELU:  # MLX's truncated constants, read as the explicit parameters they are
        return Activation("selu", alpha=1.67326, scale=1.0507)
    if t is nn.LeakyReLU:
        return _leaky(m._negative_slope, m, where)
    if t is nn.ELU:
        return _checked(lambda: Activation("elu", alpha=m._alpha), m, where)
    if t is nn.GELU:
        return _gelu(m._approx, m, where)
    raise conversion_error(where, m, "is not a layer or activation dense_bridge can describe")


def _checked(make: Callable[[], Activation], m, where: str) -> Activation:
    try:
        return make()
    except (SpecError, TypeError) as exc:
        raise conversion_error(where, m, f"has parameters no canonical activation takes ({exc})") from None


def _leaky(slope, m, where: str) -> Activation:
    if slope > 1:
        raise conversion_error(where, m, f"computes maximum({slope}*x, x), which is not leaky_relu "
                                "for a slope above 1")
    return _checked(lambda: Activation("leaky_relu", negative_slope=slope), m, where)


def _gelu(approx: str, m, where: str) -> Activation:
    if approx == "none":
        return Activation("gelu")
    if approx in ("precise", "tanh") and _mlx_gelu_approx_is_tanh():
        return Activation("gelu_tanh")
    raise conversion_error(where, m, f"uses the approximation approx={approx!r}, which no canonical "
                            "activation computes (gelu is exact, gelu_tanh the tanh formula)")


def _function_table() -> list[tuple[Callable, Callable[[dict], Activation]]]:
    """Bare functions MLX's Sequential accepts, with the keyword arguments they may be bound to."""
    sel = lambda kw: Activation("selu", alpha=1.67326, scale=1.0507)  # noqa: E731
    return [
        (nn.relu, lambda kw: Activation("relu")), (nn.relu6, lambda kw: Activation("relu6")),
        (nn.leaky_relu, lambda kw: Activation("leaky_relu", negative_slope=kw.get("negative_slope", 0.01))),
        (nn.elu, lambda kw: Activation("elu", alpha=kw.get("alpha", 1.0))),
        (nn.selu, sel), (nn.gelu, lambda kw: Activation("gelu")),
        (nn.silu, lambda kw: Activation("silu")),
        (nn.sigmoid, lambda kw: Activation("sigmoid")), (mx.sigmoid, lambda kw: Activation("sigmoid")),
        (nn.tanh, lambda kw: Activation("tanh")), (mx.tanh, lambda kw: Activation("tanh")),
        (nn.softplus, lambda kw: Activation("softplus")), (nn.softsign, lambda kw: Activation("softsign")),
        (nn.mish, lambda kw: Activation("mish")), (nn.hardswish, lambda kw: Activation("hard_silu")),
        (nn.softmax, lambda kw: Activation("softmax", axis=kw.get("axis", -1))),
        (nn.log_softmax, lambda kw: Activation("log_softmax", axis=kw.get("axis", -1))),
        (mx.exp, lambda kw: Activation("exponential")),
    ]


def activation_of_function(fn, where: str) -> Activation:
    """The Activation of a bare callable in an nn.Sequential (optionally a functools.partial)."""
    base, kwargs = fn, {}
    if isinstance(fn, functools.partial):
        if fn.args:
            raise conversion_error(where, fn, "binds positional arguments; bind parameters by keyword")
        base, kwargs = fn.func, dict(fn.keywords)
    if base is nn.gelu_approx:
        if kwargs or not _mlx_gelu_approx_is_tanh():
            raise conversion_error(where, fn, "is not a canonical activation")
        return Activation("gelu_tanh")
    for known, make in _function_table():
        if base is known:
            if known is nn.leaky_relu and kwargs.get("negative_slope", 0.01) > 1:
                return _leaky(kwargs["negative_slope"], fn, where)
            try:
                act = make(kwargs)
                extra = set(kwargs) - set(act.params)
                if extra:
                    raise SpecError(f"unknown keyword(s) {sorted(extra)}")
            except (SpecError, TypeError) as exc:
                raise conversion_error(where, fn, f"has arguments no canonical activation takes ({exc})") from None
            return act
    raise conversion_error(where, fn, "is a Python callable dense_bridge cannot read; use an mlx.nn "
                            "activation module or a known function such as nn.relu")
