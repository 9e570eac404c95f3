"""Activations, both directions: exact TF functions (:class:`ExactActivation`), native Keras
activation layers where they compute the same function, and reading Keras activations back.

Keras' activation defaults are not dense_bridge's (``leaky_relu`` 0.2, ``LeakyReLU()`` 0.3),
``tf.nn.leaky_relu`` stores its slope as a float32 attribute and ``tf.nn.gelu`` passes
1/sqrt(2) through float32: both are ~1e-8 off in float64. Compiled layers therefore apply
:class:`ExactActivation` (explicit parameters, constants made in the tensor's dtype); native
Keras activation layers are used only where they compute the same function. Reading, every
Keras default is read from Keras itself, never assumed.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import keras
import numpy as np
from keras import ops

from dense_bridge._errors import ConversionError
from dense_bridge.activations import NAMES as ACTIVATION_NAMES
from dense_bridge.activations import Activation

from ._engine import ENGINE, erfc, logaddexp, minimum, tanh


REGISTRATION_PACKAGE = "dense_bridge"  # keras.saving registration package: saved .keras files name it


def _dtype(x) -> str:
    return keras.backend.standardize_dtype(x.dtype)


def _const(value: float, x):
    # A constant made directly in x's dtype: some engines route Python floats through float32
    # (docs/FACTS.md: TF's gelu 1/sqrt(2) is 5e-9 off in float64).
    return ops.convert_to_tensor(value, dtype=_dtype(x))


def _leaky_relu(x, negative_slope):
    # not the engines' leaky_relu: TF holds its alpha as a float32 attribute (2e-9 off in float64)
    return ops.where(x > 0, x, x * _const(negative_slope, x))


def _elu(x, alpha):
    return ops.where(x > 0, x, _const(alpha, x) * ops.expm1(minimum(x, _const(0.0, x))))


def _gelu(x):
    # erfc, not 1 + erf: no cancellation in the negative tail (erfc is the engine's own: _engine)
    return _const(0.5, x) * x * erfc(-x * _const(1.0 / math.sqrt(2.0), x))


def _gelu_tanh(x):
    inner = _const(math.sqrt(2.0 / math.pi), x) * (x + _const(0.044715, x) * x * x * x)
    return _const(0.5, x) * x * (_const(1.0, x) + tanh(inner))


def _hard_sigmoid(x):
    return ops.relu6(x + _const(3.0, x)) / _const(6.0, x)


def _softplus(x):
    # torch's softplus returns x above a threshold of 20 (docs/FACTS.md); logaddexp(x, 0) is exact
    return logaddexp(x, _const(0.0, x)) if ENGINE == "torch" else ops.softplus(x)


# canonical name -> f(x, **params), each the exact function with every parameter explicit
_TF_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "linear": lambda x: x,
    "relu": ops.relu,
    "relu6": ops.relu6,
    "leaky_relu": _leaky_relu,
    "elu": _elu,
    "selu": lambda x, alpha, scale: _const(scale, x) * _elu(x, alpha),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": ops.silu,
    "sigmoid": ops.sigmoid,
    "hard_sigmoid": _hard_sigmoid,
    "hard_silu": lambda x: x * _hard_sigmoid(x),
    "tanh": tanh,  # keras.ops.tanh returns float32 for float64 on JAX (_engine)
    "softplus": _softplus,
    "softsign": ops.softsign,
    "mish": lambda x: x * tanh(_softplus(x)),
    "softmax": lambda x, axis: ops.softmax(x, axis=axis),
    "log_softmax": lambda x, axis: ops.log_softmax(x, axis=axis),
    "exponential": ops.exp,
}
assert set(_TF_FUNCTIONS) == set(ACTIVATION_NAMES)


@keras.saving.register_keras_serializable(package=REGISTRATION_PACKAGE)
class ExactActivation:
    """A dense_bridge activation as a Keras activation callable: exact function, explicit params.

    float16/bfloat16 input is computed in float32 and rounded once, as the numpy reference does.
    Serialises as the activation's config, so ``.keras`` files keep every parameter.
    """

    def __init__(self, activation: Any) -> None:
        self.activation = activation if isinstance(activation, Activation) else Activation.from_config(activation)
        self._fn = _TF_FUNCTIONS[self.activation.name]
        self._params = dict(self.activation.params)

    def __call__(self, x):
        x = ops.convert_to_tensor(x)
        dtype = _dtype(x)
        if dtype in ("float16", "bfloat16"):
            return ops.cast(self._fn(ops.cast(x, "float32"), **self._params), dtype)
        return self._fn(x, **self._params)

    def get_config(self) -> dict:
        return self.activation.to_config()

    @classmethod
    def from_config(cls, config: dict) -> "ExactActivation":
        return cls(Activation.from_config(config))

    def __repr__(self) -> str:
        return f"ExactActivation({self.activation!r})"


# Keras activation functions whose function equals a dense_bridge name with no parameters.
_KERAS_FUNCTIONS: dict[Callable, str] = {
    keras.activations.linear: "linear",
    keras.activations.relu: "relu",
    keras.activations.relu6: "relu6",
    keras.activations.selu: "selu",  # tf.nn.selu: the exact constants, as Activation("selu")
    keras.activations.silu: "silu",  # also "swish"
    keras.activations.sigmoid: "sigmoid",
    keras.activations.hard_sigmoid: "hard_sigmoid",  # Keras 3: relu6(x + 3) / 6
    keras.activations.hard_silu: "hard_silu",  # also "hard_swish"
    keras.activations.tanh: "tanh",
    keras.activations.softplus: "softplus",
    keras.activations.softsign: "softsign",
    keras.activations.mish: "mish",
    keras.activations.exponential: "exponential",
}
_KERAS_FUNCTIONS_BY_NAME = {v: k for k, v in _KERAS_FUNCTIONS.items()}


def _keras_default(fn: Callable, parameter: str):
    """The default Keras itself gives ``parameter`` of ``fn`` (read, never assumed)."""
    return inspect.signature(fn).parameters[parameter].default


#: Third-party activation functions that are one of the table's, by dotted name (no import):
#: keras-hub's BERT/GPT-2 feed-forward use ``gelu_approximate`` = keras.activations.gelu(x,
#: approximate=True) (keras_hub/src/utils/keras_utils.py).
THIRD_PARTY_ACTIVATIONS = {"keras_hub.src.utils.keras_utils.gelu_approximate": "gelu_tanh"}


def activation_of_function(fn: Any, where: str) -> Activation:
    """The db Activation that a Keras activation callable computes, its defaults made explicit."""
    if fn is None:
        return Activation("linear")
    if isinstance(fn, ExactActivation):
        return fn.activation
    if fn in _KERAS_FUNCTIONS:
        return Activation(_KERAS_FUNCTIONS[fn])
    a = keras.activations
    if fn is a.leaky_relu:  # 0.2 in Keras 3, not the 0.01 of torch/MLX
        return Activation("leaky_relu", negative_slope=_keras_default(fn, "negative_slope"))
    if fn is a.elu:
        return Activation("elu", alpha=_keras_default(fn, "alpha"))
    if fn is a.gelu:  # keras.activations.gelu is exact (erf) by default; keras.ops.gelu is not
        return Activation("gelu_tanh" if _keras_default(fn, "approximate") else "gelu")
    if fn in (a.softmax, a.log_softmax):
        return Activation(fn.__name__, axis=_keras_default(fn, "axis"))
    third_party = THIRD_PARTY_ACTIVATIONS.get(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}")
    if third_party is not None:
        return Activation(third_party)
    readable = sorted({*_KERAS_FUNCTIONS.values(), "leaky_relu", "elu", "gelu", "softmax", "log_softmax"})
    raise ConversionError(
        f"{where} uses the activation {getattr(fn, '__name__', fn)!r}, which dense_bridge cannot "
        f"express exactly. Readable: keras.activations {', '.join(readable)}, or an ExactActivation."
    )


def activation_layer(act: Activation, dtype: str) -> keras.layers.Layer:
    """A Keras layer computing ``act``: a native layer where it is the same function."""
    name, p = act.name, act.params
    if name == "relu":
        return keras.layers.ReLU(dtype=dtype)
    if name == "relu6":
        return keras.layers.ReLU(max_value=6.0, dtype=dtype)
    if name == "elu":
        return keras.layers.ELU(alpha=p["alpha"], dtype=dtype)
    if name == "softmax":
        return keras.layers.Softmax(axis=p["axis"], dtype=dtype)
    slope = p.get("negative_slope")
    if name == "leaky_relu" and (ENGINE != "tensorflow" or dtype != "float64" or float(np.float32(slope)) == slope):
        # (torch's F.leaky_relu and jax.nn.leaky_relu take the slope as a double)
        # tf.nn.leaky_relu holds its slope as float32: exact unless a float64 layer needs more
        return keras.layers.LeakyReLU(negative_slope=slope, dtype=dtype)
    native = (name in _KERAS_FUNCTIONS_BY_NAME and act == Activation(name)  # selu: only its exact constants
              or name == "log_softmax" and p["axis"] == -1)
    if ENGINE == "torch" and name in ("softplus", "mish"):
        native = False  # torch's F.softplus returns x above 20 (2e-9 off in float64)
    if ENGINE != "tensorflow" and dtype == "float64":
        native = False  # keras.ops rounds some float64 functions through float32 there (_engine)
    if native:
        return keras.layers.Activation(name, dtype=dtype)
    # gelu/gelu_tanh (tf.nn.gelu rounds its constants through float32), other axes and parameters
    return keras.layers.Activation(ExactActivation(act), dtype=dtype)


def activation_of_layer(layer) -> Activation | None:
    """The db Activation of a Keras activation layer; None when ``layer`` is not one."""
    t = type(layer)
    where = f"layer {getattr(layer, 'name', '?')!r} ({t.__module__}.{t.__qualname__})"
    if t is keras.layers.Activation:
        return activation_of_function(layer.activation, where)
    if t is keras.layers.LeakyReLU:  # LeakyReLU() is 0.3: read the layer, never assume
        return Activation("leaky_relu", negative_slope=float(layer.negative_slope))
    if t is keras.layers.ELU:
        return Activation("elu", alpha=float(layer.alpha))
    if t is keras.layers.Softmax:
        if not isinstance(layer.axis, int):
            raise ConversionError(f"{where} normalises over the axes {layer.axis!r}; dense_bridge "
                                  "supports softmax over one axis")
        return Activation("softmax", axis=layer.axis)
    if t is keras.layers.ReLU:
        slope, top, threshold = float(layer.negative_slope), layer.max_value, float(layer.threshold)
        if threshold == 0.0 and top is None:
            return Activation("leaky_relu", negative_slope=slope) if slope else Activation("relu")
        if threshold == 0.0 and slope == 0.0 and float(top) == 6.0:
            return Activation("relu6")
        raise ConversionError(f"{where} has max_value={top}, negative_slope={slope}, "
                              f"threshold={threshold}, which no dense_bridge activation computes")
    return None
