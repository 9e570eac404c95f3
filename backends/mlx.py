"""The MLX adapter: specs to ``mlx.nn`` modules and back, canonical parameters, autograd traces.

Layouts (canonical <-> MLX), by declaration and never by shape:

- Dense: canonical ``kernel`` (in_features, units) <-> ``nn.Linear.weight`` (units, in_features),
  i.e. weight = kernel.T; ``bias`` (units,) is the same in both. A mask is stored like the
  weight, (units, in_features) = canonical mask.T, as the frozen parameter ``mask``.
- Bilinear: canonical ``kernel`` (units, in1, in2) <-> ``nn.Bilinear.weight`` (units, in2, in1):
  MLX computes y_i = x2^T W_i x1 + b_i (mlx/nn/layers/linear.py), so weight = kernel with axes
  1 and 2 swapped.
- Sequential: ``nn.Sequential`` keeps its modules in ``.layers``; canonical keys are
  "<position>.<name>" ("0.kernel", "2.bias"), MLX's native ones "layers.0.weight".

What compile builds:

- Dense with no activation and no mask -> exactly ``nn.Linear``; otherwise :class:`DenseLinear`
  (an ``nn.Linear`` subclass applying weight * mask and the activation in ``__call__``); a lazy
  spec (in_features=None) -> :class:`LazyDenseLinear`, which draws its parameters on its first
  input. Bilinear -> ``nn.Bilinear``; Identity -> ``nn.Identity``; Sequential -> ``nn.Sequential``.
- Activation -> the ``mlx.nn`` module where MLX computes exactly that function, gradients at
  kinks and in float16 included (``nn.ReLU``, ``nn.SiLU``, ``nn.Softmax()`` for axis -1, ...),
  else :class:`ExactActivation`: MLX's ``selu`` uses truncated constants (1.0507, 1.67326), MLX
  has no ``hard_sigmoid``/``exponential``, ``nn.Softmax`` has no axis, ``nn.LeakyReLU``'s
  ``maximum(s*x, x)`` has slope 1 at 0 (and is leaky_relu only for slopes <= 1), ``nn.ELU``'s
  gradient is NaN for large x, ``nn.GELU`` and ``nn.Hardswish`` overflow in float16, and
  ``nn.log_softmax`` segfaults over an axis of length 1 (MLX 0.32.4). ``to_spec`` still reads
  all of these native modules when users build them by hand.

Masks: MLX makes every public ``mx.array`` attribute a trainable parameter (FACTS), so ``mask``
is frozen: ``save_weights``/``load_weights`` carry it, ``trainable_parameters``,
``nn.value_and_grad`` and the optimizers never see it, and ``unfreeze()`` cannot thaw it.

dtypes: float32, float16, bfloat16 and float64. float64 runs on the CPU only, and MLX computes
``exp``, ``sigmoid`` and ``erf`` there to float32 accuracy only (FACTS): float64 activations
built on them are float32-accurate. ``mx.array`` of a float64 numpy array silently makes float32
unless told otherwise, so every conversion here passes its dtype. bfloat16 crosses to and from
numpy bit for bit through a uint16 view (ml_dtypes on the numpy side), never widened.

Compiling never draws from MLX's global random state: modules are created without running
``nn.Linear.__init__`` (whose uniform draws would be thrown away) and given the numpy params.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError, SpecError, received
from dense_bridge._params import ParamSource
from dense_bridge._trace import LayerTrace, Trace
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Identity, Sequential
from dense_bridge.wiring import Wiring

__all__ = ["DenseLinear", "LazyDenseLinear", "ExactActivation",
           "owns", "compile", "get_params", "set_params", "to_spec", "trace"]

_MX_DTYPES = {"float32": mx.float32, "float64": mx.float64, "float16": mx.float16,
              "bfloat16": mx.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _MX_DTYPES.items()}
_SPEC_ATTR = "_dense_bridge_spec"  # the compiled spec: names and initializers MLX cannot hold


# ------------------------------------------------------------------ numpy <-> mx
def _to_mx(array: np.ndarray, dtype: str) -> mx.array:
    """A fresh MLX-owned copy of ``array`` in ``dtype`` (strided views are fine)."""
    if dtype == "bfloat16":
        # bit-exact on every MLX version: uint16 carries the bits, the view relabels them
        bits = np.asarray(array).astype(numpy_dtype("bfloat16"), copy=False).view(np.uint16)
        out = mx.array(bits, dtype=mx.uint16).view(mx.bfloat16)
    else:
        # dtype always explicit: mx.array(float64 array) silently gives float32 otherwise
        out = mx.array(np.asarray(array), dtype=_MX_DTYPES[dtype])
    mx.eval(out)
    return out


def _to_numpy(array: mx.array) -> np.ndarray:
    """A read-only zero-copy numpy view of an evaluated MLX array (bfloat16 as ml_dtypes)."""
    if array.dtype == mx.bfloat16:
        # numpy's buffer protocol has no bfloat16: view the bits as uint16, relabel in numpy
        out = np.asarray(array.view(mx.uint16)).view(numpy_dtype("bfloat16"))
    else:
        out = np.asarray(array)
    out.flags.writeable = False  # MLX owns this memory; writing into it would bypass MLX
    return out


def _dtype_name(dtype: mx.Dtype, where: str) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ConversionError(f"{where} has dtype {dtype}; dense_bridge supports "
                              f"{', '.join(_MX_DTYPES)}") from None


def _check_dtype(dtype: str) -> None:
    if dtype == "float64" and mx.default_device().type != mx.DeviceType.cpu:
        raise SpecError("dtype='float64' needs MLX's CPU device (MLX GPUs have no float64); call "
                        f"mx.set_default_device(mx.cpu) first. Received: dtype={dtype!r}")


# ------------------------------------------------------------------ activations
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


def _activation_module(act: Activation) -> nn.Module:
    """The MLX module for an Activation layer: native where exact, else ExactActivation."""
    factory = _NATIVE_MODULES.get(act.name)
    module = factory(act.params) if factory is not None else None
    return module if module is not None else ExactActivation(act)


def _activation_fn(act: Activation) -> Callable:
    """The callable a DenseLinear applies after its affine map (native module where exact).

    A bound method, not the module: a module attribute would become a child of the layer.
    """
    return _activation_module(act).__call__


# ------------------------------------------------------------------ Dense
class _FrozenKeys(set):
    """A Module._no_grad set that keeps "mask" through unfreeze(): the mask must never train."""

    _KEEP = frozenset({"mask"})

    def clear(self) -> None:
        super().clear()
        self.update(self._KEEP)

    def difference_update(self, *others) -> None:
        super().difference_update(*others)
        self.update(self._KEEP)

    def discard(self, key) -> None:
        if key not in self._KEEP:
            super().discard(key)

    def remove(self, key) -> None:
        if key not in self._KEEP:
            super().remove(key)

    def __isub__(self, other):
        self.difference_update(other)
        return self


class DenseLinear(nn.Linear):
    """``nn.Linear`` plus an activation and/or a frozen 0/1 mask: y = f(x @ (weight * mask).T + b).

    weight (units, in_features), bias (units,), mask (units, in_features) like the weight.
    The mask multiplies the weight in every forward, so its zeros hold from the first call and
    the weight's gradient is zero where the mask is (optimizers then leave those entries at 0).
    """

    def __init__(self, weight: mx.array | None, bias: mx.array | None, mask: mx.array | None,
                 activation: Activation) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: its random draws would be discarded
        self._no_grad = _FrozenKeys(self._no_grad)
        self._activation = activation
        self._act = None if activation.is_identity else _activation_fn(activation)
        self._set_arrays(weight, bias, mask)

    def _set_arrays(self, weight, bias, mask) -> None:
        if weight is not None:
            self.weight = weight
        if bias is not None:
            self.bias = bias
        if mask is not None:
            self.mask = mask
            self.freeze(keys=["mask"], recurse=False)

    @property
    def activation(self) -> Activation:
        return self._activation

    @property
    def to_quantized(self):
        # QuantizedLinear.from_linear would silently drop the mask and the activation; without
        # this attribute nn.quantize's default predicate leaves the layer in full precision
        raise AttributeError(f"{type(self).__name__} cannot be quantized: MLX's QuantizedLinear has no "
                             "mask and no activation")

    def _extra_repr(self) -> str:
        act = "" if self._activation.is_identity else f", activation={self._activation!r}"
        return super()._extra_repr() + act + (", masked=True" if "mask" in self else "")

    def _check_input(self, x: mx.array) -> None:
        expected = self["weight"].shape[1]
        if x.ndim == 0 or x.shape[-1] != expected:
            raise SpecError(f"x must have shape (*, in_features={expected}). "
                            f"Received: x of shape {tuple(x.shape)}")

    def __call__(self, x: mx.array) -> mx.array:
        self._check_input(x)
        w = self["weight"] * self["mask"] if "mask" in self else self["weight"]
        y = mx.addmm(self["bias"], x, w.T) if "bias" in self else x @ w.T
        return y if self._act is None else self._act(y)


class LazyDenseLinear(DenseLinear):
    """A DenseLinear whose in_features is fixed by its first input (like torch's LazyLinear).

    The parameters are drawn then, from the same source and position as an eager spec would
    use, so the same seed gives the same parameters. Run one input before building an optimizer
    or ``nn.value_and_grad``: until then the layer has no parameters to train.
    """

    def __init__(self, spec: Dense, source: ParamSource, index: int) -> None:
        super().__init__(None, None, None, spec.activation)
        self._spec, self._source, self._index = spec, source, index

    @property
    def built(self) -> bool:
        return "weight" in self

    def _extra_repr(self) -> str:
        if self.built:
            return super()._extra_repr()
        act = "" if self._activation.is_identity else f", activation={self._activation!r}"
        return f"input_dims=None (lazy), output_dims={self._spec.units}, bias={self._spec.use_bias}{act}"

    def _build(self, in_features: int) -> None:
        spec = self._spec.with_in_features(in_features)
        params = self._source.for_layer(self._index, spec)
        weight, bias, mask = _dense_arrays(params, spec.dtype)
        self._set_arrays(weight, bias, mask)
        self._spec, self._source = spec, None  # drop the source: it may hold every layer's params

    def _check_input(self, x: mx.array) -> None:
        expected = self["weight"].shape[1]
        if x.ndim == 0 or x.shape[-1] != expected:
            raise SpecError(f"x must have last dimension in_features={expected}, fixed by this lazy "
                            f"layer's first input. Received: x of shape {tuple(x.shape)}")

    def __call__(self, x: mx.array) -> mx.array:
        if not self.built:
            if x.ndim == 0:
                raise SpecError(f"x must have shape (*, in_features). Received: x of shape {tuple(x.shape)}")
            self._build(int(x.shape[-1]))
        return super().__call__(x)


def _dense_arrays(params: dict, dtype: str) -> tuple:
    """(weight, bias, mask) MLX arrays from canonical params; masked weights stored as 0."""
    kernel = params["kernel"]
    if "mask" in params:
        kernel = kernel * params["mask"]  # exact: the mask is 0/1
    weight = _to_mx(np.asarray(kernel).T, dtype)
    bias = _to_mx(params["bias"], dtype) if "bias" in params else None
    mask = _to_mx(np.asarray(params["mask"]).T, dtype) if "mask" in params else None
    return weight, bias, mask


def _bare(cls):
    """An instance of an mlx.nn class without its __init__ (no draws from MLX's random state)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    return module


def _resolve_lazy(spec: Dense, source: ParamSource, index: int) -> Dense:
    """A lazy Dense whose width the given params already fix gets it now."""
    if not spec.lazy or source.params is None:
        return spec
    prefix = f"{index}." if isinstance(source.spec, Sequential) else ""
    kernel = source.params.get(prefix + "kernel")
    return spec if kernel is None else spec.with_in_features(int(np.shape(kernel)[0]))


def _compile_dense(spec: Dense, source: ParamSource, index: int) -> nn.Module:
    _check_dtype(spec.dtype)
    spec = _resolve_lazy(spec, source, index)
    if spec.lazy:
        layer = LazyDenseLinear(spec, source, index)
    else:
        weight, bias, mask = _dense_arrays(source.for_layer(index, spec), spec.dtype)
        if spec.activation.is_identity and mask is None:
            layer = _bare(nn.Linear)  # exactly nn.Linear, as the contract requires
            layer.weight = weight
            if bias is not None:
                layer.bias = bias
        else:
            layer = DenseLinear(weight, bias, mask, spec.activation)
    setattr(layer, _SPEC_ATTR, spec)
    return layer


def _compile_bilinear(spec: Bilinear, source: ParamSource, index: int) -> nn.Module:
    _check_dtype(spec.dtype)
    params = source.for_layer(index, spec)
    layer = _bare(nn.Bilinear)
    # MLX's weight is (units, in2, in1): swap the canonical (units, in1, in2) axes 1 and 2
    layer.weight = _to_mx(np.asarray(params["kernel"]).transpose(0, 2, 1), spec.dtype)
    if "bias" in params:
        layer.bias = _to_mx(params["bias"], spec.dtype)
    setattr(layer, _SPEC_ATTR, spec)
    return layer


def _compile_layer(spec, source: ParamSource, index: int):
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, Bilinear):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, Identity):
        layer = nn.Identity()
        setattr(layer, _SPEC_ATTR, spec)
        return layer
    if isinstance(spec, Activation):
        return _activation_module(spec)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


# ------------------------------------------------------------------ adapter verbs
def owns(obj) -> bool:
    """Is ``obj`` an mlx.nn module."""
    return isinstance(obj, nn.Module)


def compile(spec, source: ParamSource):
    """The mlx.nn module for ``spec`` with parameters from ``source`` (see the module docstring)."""
    if isinstance(spec, Sequential):
        model = nn.Sequential(*[_compile_layer(layer, source, i) for i, layer in enumerate(spec.layers)])
        setattr(model, _SPEC_ATTR, spec)
        return model
    return _compile_layer(spec, source, 0)


def _is_dense(m) -> bool:
    return type(m) is nn.Linear or isinstance(m, DenseLinear)


def _positions(native) -> list[tuple[str, Any]]:
    """(key prefix, module) for each position: "" for a lone layer, "0.", "1.", ... in a Sequential."""
    if type(native) is nn.Sequential:
        return [(f"{i}.", m) for i, m in enumerate(native.layers)]
    return [("", native)]


def _layer_params(m) -> dict[str, np.ndarray]:
    if _is_dense(m):
        if "weight" not in m:
            raise ConversionError("this lazy MLX layer has no parameters yet (in_features is fixed by its "
                                  "first input): run one input through it before reading or saving them")
        out = {"kernel": _to_numpy(m["weight"]).T}
        if "bias" in m:
            out["bias"] = _to_numpy(m["bias"])
        if "mask" in m:
            out["mask"] = _to_numpy(m["mask"]).T
        return out
    if type(m) is nn.Bilinear:
        out = {"kernel": _to_numpy(m["weight"]).transpose(0, 2, 1)}
        if "bias" in m:
            out["bias"] = _to_numpy(m["bias"])
        return out
    return {}


def get_params(native) -> dict[str, np.ndarray]:
    """Canonical params as read-only zero-copy views of MLX's memory (MLX arrays are immutable,
    so a view stays a snapshot: training rebinds the module to new arrays)."""
    mx.eval(native.parameters())
    out: dict[str, np.ndarray] = {}
    for prefix, m in _positions(native):
        for key, value in _layer_params(m).items():
            out[prefix + key] = value
    return out


def _set_layer(m, params: dict[str, np.ndarray], prefix: str) -> None:
    get = {k: params[prefix + k] for k in ("kernel", "bias", "mask") if prefix + k in params}
    if not get:
        return
    if type(m) is nn.Bilinear:
        dtype = _dtype_name(m["weight"].dtype, "weight")
        new = {}
        if "kernel" in get:
            new["weight"] = _to_mx(np.asarray(get["kernel"]).transpose(0, 2, 1), dtype)
        if "bias" in get:
            new["bias"] = _to_mx(get["bias"], dtype)
        m.update(new)
        return
    dtype = _dtype_name(m["weight"].dtype, "weight")
    new = {}
    if "kernel" in get:
        new["weight"] = _to_mx(np.asarray(get["kernel"]).T, dtype)
    if "bias" in get:
        new["bias"] = _to_mx(get["bias"], dtype)
    if "mask" in get:
        new["mask"] = _to_mx(np.asarray(get["mask"]).T, dtype)
    if "mask" in m and ("kernel" in get or "mask" in get):
        # masked weights are exactly 0 by contract, whatever was passed for them
        weight = new.get("weight", m["weight"]) * new.get("mask", m["mask"])
        mx.eval(weight)
        new["weight"] = weight
    m.update(new)


def set_params(native, params: dict[str, np.ndarray]) -> None:
    """Copy validated canonical params into new MLX arrays (mx.array copies) and rebind them."""
    for prefix, m in _positions(native):
        _set_layer(m, params, prefix)


# ------------------------------------------------------------------ to_spec
def _conversion_error(where: str, m, why: str) -> ConversionError:
    return ConversionError(f"{where} ({type(m).__module__}.{type(m).__qualname__}) {why}. "
                           f"{received(where, m)}")


def _activation_of_module(m, where: str) -> Activation:
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
    raise _conversion_error(where, m, "is not a layer or activation dense_bridge can describe")


def _checked(make: Callable[[], Activation], m, where: str) -> Activation:
    try:
        return make()
    except (SpecError, TypeError) as exc:
        raise _conversion_error(where, m, f"has parameters no canonical activation takes ({exc})") from None


def _leaky(slope, m, where: str) -> Activation:
    if slope > 1:
        raise _conversion_error(where, m, f"computes maximum({slope}*x, x), which is not leaky_relu "
                                "for a slope above 1")
    return _checked(lambda: Activation("leaky_relu", negative_slope=slope), m, where)


def _gelu(approx: str, m, where: str) -> Activation:
    if approx == "none":
        return Activation("gelu")
    if approx in ("precise", "tanh") and _mlx_gelu_approx_is_tanh():
        return Activation("gelu_tanh")
    raise _conversion_error(where, m, f"uses the approximation approx={approx!r}, which no canonical "
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


def _activation_of_function(fn, where: str) -> Activation:
    """The Activation of a bare callable in an nn.Sequential (optionally a functools.partial)."""
    base, kwargs = fn, {}
    if isinstance(fn, functools.partial):
        if fn.args:
            raise _conversion_error(where, fn, "binds positional arguments; bind parameters by keyword")
        base, kwargs = fn.func, dict(fn.keywords)
    if base is nn.gelu_approx:
        if kwargs or not _mlx_gelu_approx_is_tanh():
            raise _conversion_error(where, fn, "is not a canonical activation")
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
                raise _conversion_error(where, fn, f"has arguments no canonical activation takes ({exc})") from None
            return act
    raise _conversion_error(where, fn, "is a Python callable dense_bridge cannot read; use an mlx.nn "
                            "activation module or a known function such as nn.relu")


def _stored(m, cls):
    spec = getattr(m, _SPEC_ATTR, None)
    return spec if isinstance(spec, cls) else None


def _dense_spec(m, where: str) -> Dense:
    if isinstance(m, LazyDenseLinear) and not m.built:
        return m._spec
    weight = m["weight"]
    if weight.ndim != 2:
        raise _conversion_error(where, m, f"has a weight of shape {tuple(weight.shape)}, not (units, in)")
    units, in_features = (int(s) for s in weight.shape)
    stored = _stored(m, Dense)
    mask = None
    if "mask" in m:
        mx.eval(m["mask"])
        adjacency = _to_numpy(m["mask"]).T != 0
        kind = stored.mask.kind if stored is not None and stored.mask is not None and \
            np.array_equal(stored.mask.adjacency, adjacency) else "custom"
        mask = Wiring(adjacency, kind=kind, allow_empty_outputs=True)
    activation = m.activation if isinstance(m, DenseLinear) else Activation("linear")
    return Dense(units, in_features=in_features, use_bias="bias" in m, activation=activation,
                 kernel_init=stored.kernel_init if stored else "mlx_default",
                 bias_init=stored.bias_init if stored else "mlx_default",
                 mask=mask, dtype=_dtype_name(weight.dtype, f"{where}.weight"),
                 name=stored.name if stored else None)


def _bilinear_spec(m, where: str) -> Bilinear:
    units, in2, in1 = (int(s) for s in m["weight"].shape)
    stored = _stored(m, Bilinear)
    return Bilinear(in1, in2, units, use_bias="bias" in m,
                    init=stored.init if stored else "mlx_default",
                    dtype=_dtype_name(m["weight"].dtype, f"{where}.weight"), name=stored.name if stored else None)


def _layer_spec(m, where: str):
    if _is_dense(m):
        return _dense_spec(m, where)
    if type(m) is nn.Bilinear:
        return _bilinear_spec(m, where)
    if type(m) is nn.Identity:
        stored = _stored(m, Identity)
        return Identity(name=stored.name if stored else None)
    if isinstance(m, nn.Linear):
        raise _conversion_error(where, m, "subclasses nn.Linear with a forward dense_bridge cannot read")
    if isinstance(m, nn.Module):
        return _activation_of_module(m, where)
    if callable(m):
        return _activation_of_function(m, where)
    raise _conversion_error(where, m, "is not an MLX module or activation function")


def to_spec(native):
    """The spec of an MLX layer or nn.Sequential, structure read from the live module."""
    if type(native) is not nn.Sequential:
        spec = _layer_spec(native, "native")
        return spec
    layers = []
    for i, m in enumerate(native.layers):
        where = f"native.layers[{i}]"
        if isinstance(m, nn.Sequential):
            raise _conversion_error(where, m, "is a nested nn.Sequential; flatten it (parameter keys are "
                                    "positions in one Sequential)")
        if type(m) is nn.Bilinear:
            raise _conversion_error(where, m, "takes two inputs and cannot sit in a Sequential chain")
        layers.append(_layer_spec(m, where))
    stored = _stored(native, Sequential)
    has_dense = any(isinstance(l, Dense) for l in layers)
    try:
        return Sequential(layers, in_features=None if has_dense or stored is None else stored.in_features,
                          name=stored.name if stored else None)
    except SpecError as exc:
        raise ConversionError(f"native (mlx.nn.Sequential) does not chain: {exc}") from None


# ------------------------------------------------------------------ trace
def _param_dtype(m) -> mx.Dtype | None:
    """The dtype of a layer's weight (None for layers without parameters)."""
    return m["weight"].dtype if isinstance(m, nn.Module) and "weight" in m else None


def _trace_dtype(layers: list, x: np.ndarray) -> str:
    """Inputs are cast to the first parameter layer's dtype; a parameter-free model keeps x's."""
    for m in layers:
        if _param_dtype(m) is not None:
            return _dtype_name(_param_dtype(m), "weight")
    name = np.dtype(x.dtype).name
    return name if name in _MX_DTYPES else "float32"


def _grad_params(m) -> list[tuple[str, mx.array]]:
    """The parameters to differentiate: everything but the mask (which never trains)."""
    if not isinstance(m, nn.Module):
        return []
    return [(k, v) for k, v in tree_flatten(m.parameters()) if k != "mask"]


def _canonical_grads(m, grads: dict[str, mx.array]) -> dict[str, np.ndarray]:
    out = {}
    if "weight" in grads:
        w = _to_numpy(grads["weight"])
        out["kernel"] = w.T if _is_dense(m) else w.transpose(0, 2, 1)
    if "bias" in grads:
        out["bias"] = _to_numpy(grads["bias"])
    return out


def _layer_vjp(m, xs: list[mx.array], g: mx.array) -> tuple[mx.array, list[mx.array], dict]:
    """(output, input grads, native param grads) of one layer for cotangent g, via mx.vjp."""
    named = _grad_params(m)
    names, arrays = [k for k, _ in named], [v for _, v in named]
    n = len(arrays)

    def fn(*primals):
        if n:
            m.update(tree_unflatten(list(zip(names, primals[:n]))))
        return m(*primals[n:])

    try:
        (y,), cotangents = mx.vjp(fn, arrays + xs, [g])
    finally:
        if n:  # put the real arrays back: the traced ones must not stay in the module
            m.update(tree_unflatten(list(zip(names, arrays))))
    mx.eval(y, cotangents)
    return y, cotangents[n:], dict(zip(names, cotangents[:n]))


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Per-layer outputs and gradients of L = sum(y * grad_out) with MLX's autograd (mx.vjp)."""
    layers = [m for _, m in _positions(native)]
    inputs = [np.asarray(x) for x in inputs]
    dtype = _trace_dtype(layers, inputs[0])
    xs = [_to_mx(x, dtype) for x in inputs]
    layer_inputs, outputs = [], []
    for m in layers:
        if _param_dtype(m) is not None:  # each layer sees its input in its own dtype
            xs = [x.astype(_param_dtype(m)) for x in xs]
        layer_inputs.append(xs)
        y = m(*xs)
        mx.eval(y)
        outputs.append(y)
        xs = [y]
    g = _to_mx(np.asarray(grad_out), _dtype_name(outputs[-1].dtype, "output"))
    records: list[LayerTrace] = [None] * len(layers)  # type: ignore[list-item]
    for i in range(len(layers) - 1, -1, -1):
        y, dxs, grads = _layer_vjp(layers[i], layer_inputs[i], g.astype(outputs[i].dtype))
        records[i] = LayerTrace(np.array(_to_numpy(y)), tuple(np.array(_to_numpy(d)) for d in dxs),
                                {k: np.array(v) for k, v in _canonical_grads(layers[i], grads).items()})
        g = dxs[0]
    return Trace(records)
