"""The canonical table of activations: explicit parameters and float64 numpy references.

Frameworks give the same name to different functions (leaky_relu's default slope is 0.01 in
torch and MLX but 0.2 in ``keras.activations``; ``keras.ops.gelu`` defaults to the tanh
approximation; MLX truncates the selu constants). An :class:`Activation` therefore always
carries every parameter explicitly, and its :meth:`~Activation.forward` and
:meth:`~Activation.vjp` are the exact math computed in float64, the yardstick every backend
is measured against.

Framework-neutral: this module imports only numpy and the standard library.
"""
from __future__ import annotations

import math
import numbers
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

from ._errors import SpecError, received, suggest

__all__ = ["Activation", "NAMES", "get"]

# The exact selu constants (Klambauer et al. 2017), as torch and Keras use them; MLX's
# 1.67326 / 1.0507 are off by up to 1.1e-5.
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_COEF = 0.044715


# --------------------------------------------------------------------------------------------
# Float64 building blocks
# --------------------------------------------------------------------------------------------


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic sigmoid: exp is only ever taken of -|x|."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _sigmoid_grad(x: np.ndarray) -> np.ndarray:
    """sigmoid'(x) = e / (1 + e)^2 with e = exp(-|x|); no cancellation in 1 - sigmoid."""
    e = np.exp(-np.abs(x))
    return e / (1.0 + e) ** 2


def _erfc(x: np.ndarray) -> np.ndarray:
    """Elementwise math.erfc: full float64 accuracy without scipy (about 6 ms per 1e5 values)."""
    flat = np.ravel(x).tolist()
    return np.fromiter(map(math.erfc, flat), dtype=np.float64, count=len(flat)).reshape(np.shape(x))


def _norm_cdf(x: np.ndarray) -> np.ndarray:
    """Phi(x) = erfc(-x/sqrt 2)/2, accurate in the left tail where 1 + erf(x) would cancel."""
    return 0.5 * _erfc(-x * _INV_SQRT_2)


def _norm_pdf(x: np.ndarray) -> np.ndarray:
    """phi(x) = exp(-x^2/2)/sqrt(2 pi); underflows quietly to 0 for large |x|."""
    return np.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax with the max subtracted first, so exp never overflows."""
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """log_softmax as (x - max) - log(sum(exp(x - max))): no overflow, no log of 0."""
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _gelu_tanh_arg(x: np.ndarray) -> np.ndarray:
    """2u with u = sqrt(2/pi)(x + 0.044715 x^3), so that 1 + tanh(u) = 2 sigmoid(2u)."""
    return 2.0 * _SQRT_2_OVER_PI * (x + _GELU_TANH_COEF * x * x * x)


# --------------------------------------------------------------------------------------------
# Forward functions and their derivatives. Each takes float64 x and the (validated) params.
# Derivatives at kinks take the one-sided value torch's autograd gives (measured, torch 2.13,
# float64): relu'(0)=0; relu6'(0)=relu6'(6)=0 (gradient only on the open interval (0, 6));
# leaky_relu'(0)=negative_slope; elu'(0)=alpha and selu'(0)=scale*alpha (torch uses the x<=0
# branch); hard_sigmoid'(+-3)=0 (open interval (-3, 3)); hard_silu'(-3)=0, hard_silu'(3)=1.
# --------------------------------------------------------------------------------------------


def _elu(x: np.ndarray, alpha: float) -> np.ndarray:
    """alpha*expm1(x) for x<=0, else x; expm1 of min(x, 0) keeps the unused branch finite."""
    return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))


def _elu_grad(x: np.ndarray, alpha: float) -> np.ndarray:
    """elu'(x); at 0 the x<=0 branch (alpha), as torch's elu_backward."""
    return np.where(x > 0, 1.0, alpha * np.exp(np.minimum(x, 0.0)))


def _hard_sigmoid(x: np.ndarray) -> np.ndarray:
    """relu6(x + 3) / 6, the torch and Keras 3 definition (not the old 0.2x + 0.5)."""
    return np.minimum(np.maximum(x + 3.0, 0.0), 6.0) / 6.0


def _hard_sigmoid_grad(x: np.ndarray) -> np.ndarray:
    """1/6 on the open interval (-3, 3), else 0 (torch; torch itself rounds 1/6 to float32)."""
    return np.where((x > -3.0) & (x < 3.0), 1.0 / 6.0, 0.0)


def _hard_silu_grad(x: np.ndarray) -> np.ndarray:
    """x/3 + 1/2 on (-3, 3), 0 for x <= -3, 1 for x >= 3 (torch's hardswish_backward)."""
    return np.where(x <= -3.0, 0.0, np.where(x < 3.0, x / 3.0 + 0.5, 1.0))


def _mish(x: np.ndarray) -> np.ndarray:
    """x * tanh(softplus(x))."""
    return x * np.tanh(np.logaddexp(0.0, x))


def _mish_grad(x: np.ndarray) -> np.ndarray:
    """tanh(sp) + x * (1 - tanh(sp)^2) * sigmoid(x), sp = softplus(x)."""
    t = np.tanh(np.logaddexp(0.0, x))
    return t + x * (1.0 - t * t) * _sigmoid(x)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5x(1 + tanh(u)) written as x*sigmoid(2u): identical math, no cancellation for x << 0."""
    return x * _sigmoid(_gelu_tanh_arg(x))


def _gelu_tanh_grad(x: np.ndarray) -> np.ndarray:
    """d/dx x*sigmoid(2u) = sigmoid(2u) + x * sigmoid'(2u) * 2u'."""
    v = _gelu_tanh_arg(x)
    dv = 2.0 * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_COEF * x * x)
    return _sigmoid(v) + x * _sigmoid_grad(v) * dv


# Elementwise table: name -> (forward(x, **p), derivative(x, **p)). The vjp is grad_out * f'(x).
_Elementwise = Callable[..., np.ndarray]
_ELEMENTWISE: dict[str, tuple[_Elementwise, _Elementwise]] = {
    "linear": (lambda x: x.copy(), lambda x: np.ones_like(x)),
    "relu": (lambda x: np.maximum(x, 0.0), lambda x: np.where(x > 0, 1.0, 0.0)),
    "relu6": (
        lambda x: np.minimum(np.maximum(x, 0.0), 6.0),
        lambda x: np.where((x > 0) & (x < 6.0), 1.0, 0.0),
    ),
    "leaky_relu": (
        lambda x, negative_slope: np.where(x > 0, x, negative_slope * x),
        lambda x, negative_slope: np.where(x > 0, 1.0, negative_slope),
    ),
    "elu": (_elu, _elu_grad),
    "selu": (
        lambda x, alpha, scale: scale * _elu(x, alpha),
        lambda x, alpha, scale: scale * _elu_grad(x, alpha),
    ),
    "gelu": (
        lambda x: x * _norm_cdf(x),
        lambda x: _norm_cdf(x) + x * _norm_pdf(x),
    ),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_grad),
    "silu": (
        lambda x: x * _sigmoid(x),
        lambda x: _sigmoid(x) + x * _sigmoid_grad(x),
    ),
    "sigmoid": (_sigmoid, _sigmoid_grad),
    "hard_sigmoid": (_hard_sigmoid, _hard_sigmoid_grad),
    "hard_silu": (lambda x: x * _hard_sigmoid(x), _hard_silu_grad),
    "tanh": (np.tanh, lambda x: 1.0 - np.tanh(x) ** 2),
    # Exact log(1 + exp(x)): no threshold (torch returns x above 20, ~2e-9 off in float64).
    "softplus": (lambda x: np.logaddexp(0.0, x), _sigmoid),
    "softsign": (lambda x: x / (1.0 + np.abs(x)), lambda x: 1.0 / (1.0 + np.abs(x)) ** 2),
    "mish": (_mish, _mish_grad),
    "exponential": (np.exp, np.exp),
}


def _softmax_vjp(x: np.ndarray, g: np.ndarray, axis: int) -> np.ndarray:
    """J^T g for softmax: y * (g - sum(g * y))."""
    y = _softmax(x, axis)
    return y * (g - np.sum(g * y, axis=axis, keepdims=True))


def _log_softmax_vjp(x: np.ndarray, g: np.ndarray, axis: int) -> np.ndarray:
    """J^T g for log_softmax: g - softmax(x) * sum(g)."""
    return g - _softmax(x, axis) * np.sum(g, axis=axis, keepdims=True)


# Reductions along an axis: name -> (forward(x, axis), vjp(x, g, axis)).
_ALONG_AXIS: dict[str, tuple[Callable[..., np.ndarray], Callable[..., np.ndarray]]] = {
    "softmax": (_softmax, _softmax_vjp),
    "log_softmax": (_log_softmax, _log_softmax_vjp),
}


# --------------------------------------------------------------------------------------------
# The table of names, parameters and costs
# --------------------------------------------------------------------------------------------

# Parameter kinds: "float" accepts any real number but bool (ints are stored as float);
# "positive_float" additionally requires > 0; "int" accepts integers but bool.
_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    "linear": {},
    "relu": {},
    "relu6": {},
    # 0.01 as torch and MLX; keras.activations/tf.nn use 0.2 and keras.layers.LeakyReLU 0.3.
    "leaky_relu": {"negative_slope": ("float", 0.01)},
    "elu": {"alpha": ("positive_float", 1.0)},
    "selu": {"alpha": ("positive_float", _SELU_ALPHA), "scale": ("positive_float", _SELU_SCALE)},
    "gelu": {},
    "gelu_tanh": {},
    "silu": {},
    "sigmoid": {},
    "hard_sigmoid": {},
    "hard_silu": {},
    "tanh": {},
    "softplus": {},
    "softsign": {},
    "mish": {},
    # Always explicit: torch's softmax without dim normalises over dim 0 for 1-D and 3-D input.
    "softmax": {"axis": ("int", -1)},
    "log_softmax": {"axis": ("int", -1)},
    "exponential": {},
}

NAMES: tuple[str, ...] = tuple(_PARAMS)

_ALIASES: dict[str, str] = {
    "identity": "linear",
    "swish": "silu",
    "hard_swish": "hard_silu",
    "gelu_exact": "gelu",
}

# Rough floating-point operations per element (forward only), for cost estimates.
_FLOPS_PER_ELEMENT: dict[str, int] = {
    "linear": 0,
    "relu": 1,
    "relu6": 2,
    "leaky_relu": 2,
    "elu": 3,
    "selu": 4,
    "gelu": 8,
    "gelu_tanh": 9,
    "silu": 5,
    "sigmoid": 4,
    "hard_sigmoid": 4,
    "hard_silu": 5,
    "tanh": 5,
    "softplus": 4,
    "softsign": 3,
    "mish": 10,
    "softmax": 5,
    "log_softmax": 5,
    "exponential": 1,
}

assert set(_PARAMS) == set(_ELEMENTWISE) | set(_ALONG_AXIS) == set(_FLOPS_PER_ELEMENT)


def _canonical_name(value: object, argname: str) -> str:
    """Map a name or alias (any case; None means linear) to its canonical name."""
    if value is None:
        return "linear"
    if not isinstance(value, str):
        raise TypeError(
            f"{argname} must be an activation name (str), got {type(value).__name__}. "
            f"{received(argname, value)}"
        )
    key = value.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _PARAMS:
        raise SpecError(
            f"Unknown activation {value!r}.{suggest(value, NAMES + tuple(_ALIASES))} "
            f"Known: {', '.join(NAMES)}. {received(argname, value)}"
        )
    return key


def _check_param(act: str, pname: str, kind: str, value: object) -> float | int:
    """Validate one parameter value and return it normalised (float or int)."""
    is_bool = isinstance(value, (bool, np.bool_))
    if kind == "int":
        if is_bool or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"Activation {act!r}: parameter {pname} must be an integer, "
                f"got {type(value).__name__}. {received(pname, value)}"
            )
        return int(value)
    if is_bool or not isinstance(value, numbers.Real):
        raise TypeError(
            f"Activation {act!r}: parameter {pname} must be a real number, "
            f"got {type(value).__name__}. {received(pname, value)}"
        )
    number = float(value)
    if not math.isfinite(number):
        raise SpecError(
            f"Activation {act!r}: parameter {pname} must be finite. {received(pname, value)}"
        )
    if kind == "positive_float" and not number > 0:
        raise SpecError(
            f"Activation {act!r}: parameter {pname} must be > 0. {received(pname, value)}"
        )
    return number


# Overflow to inf (exponential of large x, a huge float64 cast down) and underflow to 0
# (exp(-1000), erfc(700)) are the IEEE answers, not bugs: keep them quiet even under
# np.seterr(all="raise"). Division by zero and invalid operations still report.
_QUIET = {"over": "ignore", "under": "ignore"}


def _as_float64(argname: str, value: object) -> np.ndarray:
    """Convert an input array to float64; complex input is rejected."""
    array = np.asarray(value)
    if array.dtype.kind == "c":
        raise TypeError(
            f"{argname} must be a real array, got dtype {array.dtype}. {received(argname, value)}"
        )
    return array.astype(np.float64, copy=False)


def _result_dtype(x: np.ndarray) -> np.dtype:
    """x's own dtype when it is floating (incl. ml_dtypes bfloat16), float64 for int/bool input."""
    return np.dtype(np.float64) if x.dtype.kind in "biuO" else x.dtype


def _count_argument(name: str, value: object) -> int:
    """Return ``value`` as int when it is a non-negative integer; else TypeError/SpecError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a non-negative integer, got {type(value).__name__}. "
            f"{received(name, value)}"
        )
    if value < 0:
        raise SpecError(f"{name} must be a non-negative integer. {received(name, value)}")
    return int(value)


# --------------------------------------------------------------------------------------------
# Public interface
# --------------------------------------------------------------------------------------------


class Activation:
    """Immutable, hashable activation spec: a canonical name plus its full, explicit parameters."""

    __slots__ = ("_name", "_params")

    def __init__(self, name: str | None, **params: Any) -> None:
        """Validate ``name`` (alias, any case) and ``params``; fill in every default."""
        canonical = _canonical_name(name, "name")
        spec = _PARAMS[canonical]
        for pname in params:
            if pname not in spec:
                if spec:
                    hint = suggest(pname, spec) + f" Known parameters: {', '.join(spec)}."
                else:
                    hint = " It takes no parameters."
                raise SpecError(
                    f"Activation {canonical!r} has no parameter {pname!r}.{hint} "
                    f"{received(pname, params[pname])}"
                )
        full = {
            pname: _check_param(canonical, pname, kind, params.get(pname, default))
            for pname, (kind, default) in spec.items()
        }
        object.__setattr__(self, "_name", canonical)
        object.__setattr__(self, "_params", full)

    # -- identity --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The canonical name, e.g. ``"leaky_relu"``."""
        return self._name

    @property
    def params(self) -> Mapping[str, float | int]:
        """Read-only view of all parameters, defaults included."""
        return MappingProxyType(self._params)

    @property
    def num_params(self) -> int:
        """Number of trainable parameters: always 0."""
        return 0

    @property
    def is_identity(self) -> bool:
        """True only for ``"linear"``."""
        return self._name == "linear"

    def __setattr__(self, key: str, value: object) -> None:
        """Refuse assignment: an Activation is immutable."""
        raise AttributeError(f"Activation is immutable; cannot set {key!r}")

    def __delattr__(self, key: str) -> None:
        """Refuse deletion: an Activation is immutable."""
        raise AttributeError(f"Activation is immutable; cannot delete {key!r}")

    def _key(self) -> tuple:
        """The (name, sorted params) tuple that equality and hashing use."""
        return (self._name, tuple(sorted(self._params.items())))

    def __eq__(self, other: object) -> bool:
        """Equal when name and all parameters are equal."""
        if not isinstance(other, Activation):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        """Hash of (name, params)."""
        return hash(self._key())

    def __repr__(self) -> str:
        """E.g. ``Activation('leaky_relu', negative_slope=0.01)``, with every parameter."""
        args = [repr(self._name)] + [f"{k}={v!r}" for k, v in self._params.items()]
        return f"Activation({', '.join(args)})"

    def __reduce__(self):
        """Pickle through the config, so unpickling re-validates."""
        return (_from_parts, (self._name, dict(self._params)))

    # -- config ----------------------------------------------------------------------------

    def to_config(self) -> dict:
        """``{"name": ..., "params": {...}}`` with plain Python floats and ints (JSON-able)."""
        return {"name": self._name, "params": dict(self._params)}

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> "Activation":
        """Rebuild from :meth:`to_config` output; missing params take their defaults."""
        if not isinstance(d, Mapping):
            raise TypeError(
                f"config must be a dict, got {type(d).__name__}. {received('config', d)}"
            )
        extra = set(d) - {"name", "params"}
        if extra:
            raise SpecError(
                f"Activation config has unknown keys {sorted(extra)}; "
                "expected 'name' and 'params'. "
                f"{received('config', d)}"
            )
        if "name" not in d:
            raise SpecError(f"Activation config needs a 'name'. {received('config', d)}")
        params = d.get("params") or {}
        if not isinstance(params, Mapping):
            raise TypeError(
                f"config['params'] must be a dict, got {type(params).__name__}. "
                f"{received('params', params)}"
            )
        return cls(d["name"], **params)

    # -- cost ------------------------------------------------------------------------------

    def flops(self, batch_size: int = 1, features: int | None = None) -> int:
        """Rough forward op count: per-element cost * batch_size * features (None counts as 1)."""
        batch = _count_argument("batch_size", batch_size)
        width = 1 if features is None else _count_argument("features", features)
        return _FLOPS_PER_ELEMENT[self._name] * batch * width

    # -- numpy reference -------------------------------------------------------------------

    def forward(self, x: np.ndarray) -> np.ndarray:
        """f(x) computed in float64, returned in x's floating dtype (float64 for int input)."""
        x64 = _as_float64("x", x)
        out_dtype = _result_dtype(np.asarray(x))
        with np.errstate(**_QUIET):
            if self._name in _ALONG_AXIS:
                y = _ALONG_AXIS[self._name][0](x64, self._params["axis"])
            else:
                y = _ELEMENTWISE[self._name][0](x64, **self._params)
            return np.asarray(y, dtype=np.float64).astype(out_dtype, copy=False)

    def vjp(self, x: np.ndarray, y: np.ndarray | None, grad_out: np.ndarray) -> np.ndarray:
        """dL/dx from input x, output y = forward(x) and dL/dy, in float64, returned in x's dtype.

        ``y`` is only checked for shape (``None`` is allowed): the reference recomputes what it
        needs from ``x`` in float64, so a low-precision ``y`` cannot degrade it.
        """
        x64 = _as_float64("x", x)
        g64 = _as_float64("grad_out", grad_out)
        if g64.shape != x64.shape:
            raise SpecError(
                f"grad_out must have the shape of x {x64.shape}, got {g64.shape}. "
                f"{received('grad_out.shape', g64.shape)}"
            )
        if y is not None and np.shape(y) != x64.shape:
            raise SpecError(
                f"y must have the shape of x {x64.shape}, got {np.shape(y)}. "
                f"{received('y.shape', np.shape(y))}"
            )
        out_dtype = _result_dtype(np.asarray(x))
        # exponential's vjp at overflowing x with grad_out 0 gives nan (0 * inf), as in torch.
        quiet = {**_QUIET, "invalid": "ignore"} if self._name == "exponential" else _QUIET
        with np.errstate(**quiet):
            if self._name in _ALONG_AXIS:
                dx = _ALONG_AXIS[self._name][1](x64, g64, self._params["axis"])
            else:
                dx = g64 * _ELEMENTWISE[self._name][1](x64, **self._params)
            return np.asarray(dx, dtype=np.float64).astype(out_dtype, copy=False)


def _from_parts(name: str, params: dict) -> Activation:
    """Unpickling helper."""
    return Activation(name, **params)


def get(value: object) -> Activation:
    """Coerce None, a name or alias, an Activation or a config dict to an :class:`Activation`."""
    if isinstance(value, Activation):
        return value
    if value is None or isinstance(value, str):
        return Activation(_canonical_name(value, "activation"))
    if isinstance(value, Mapping):
        return Activation.from_config(value)
    raise TypeError(
        "activation must be None, a name, an Activation or a config dict, "
        f"got {type(value).__name__}. {received('activation', value)}"
    )
