"""Keras 3 adapter (TensorFlow backend): dense_bridge specs <-> Keras layers and models.

Layouts (canonical == Keras for every parameter: this adapter never transposes):

==========  ============================  ===========================================
spec        Keras object                  weights (Keras name: shape)
==========  ============================  ===========================================
Dense       keras.layers.Dense            kernel: (in_features, units), bias: (units,)
 + act/mask DenseBridgeDense (subclass)   + mask: (in_features, units), non-trainable
Bilinear    Bilinear (registered layer)   kernel: (units, in1, in2), bias: (units,)
Identity    keras.layers.Identity         -
Activation  ReLU/LeakyReLU/ELU/Softmax/   -
            Activation(name or exact fn)
Sequential  keras.Sequential              keys "<position>.<name>" by position in .layers
==========  ============================  ===========================================

Keras quirks handled here (measured in FACTS.md and below):

- Keras' activation defaults are not dense_bridge's (``leaky_relu`` 0.2, ``LeakyReLU()`` 0.3),
  ``tf.nn.leaky_relu`` stores its slope as a float32 attribute and ``tf.nn.gelu`` passes
  1/sqrt(2) through float32: both are ~1e-8 off in float64. Compiled layers therefore apply
  :class:`ExactActivation` (explicit parameters, constants made in the tensor's dtype); native
  Keras activation layers are used only where they compute the same function.
- ``kernel_constraint`` runs only after an optimizer step, so a mask is multiplied into the
  kernel in ``call``; its gradient is then zero on masked entries and the stored zeros stay
  zero under SGD (momentum, decoupled weight decay), Adam and custom GradientTape loops.
- Layers compute in their dtype policy's compute dtype and cast floating inputs to it, so
  activation and identity layers in a Sequential take the dtype of the Dense before them.
- Parameters are written straight into the variables at creation: the layer's initializers
  hand out the ParamSource's arrays once, then the lasting initializer (a native Keras one
  where it samples the same distribution, else :class:`DenseBridgeInitializer`) is put back.
  A lazy plain Dense stays exactly ``keras.layers.Dense`` this way. The arrays handed out are
  fresh 64-byte aligned buffers (``ParamSource.native_layer``) given to TF through DLPack, so
  each variable adopts its buffer: one copy in all, and no Keras random init to throw away.
- ``get_params`` arrays are zero-copy, read-only snapshots of the variables: TF copies a
  variable's buffer on write while another tensor still references it, so later training
  does not show in them (the first update after costs that one copy).
"""
from __future__ import annotations

import inspect
import math
import re
from typing import Any, Callable, Sequence

import numpy as np

import keras
import tensorflow as tf

from dense_bridge._dtypes import DTYPE_NAMES, numpy_dtype
from dense_bridge._errors import BackendUnavailableError, ConversionError, SpecError, received
from dense_bridge._params import ParamSource
from dense_bridge._transfer import native_copy
from dense_bridge._trace import LayerTrace, Trace
from dense_bridge.activations import NAMES as ACTIVATION_NAMES
from dense_bridge.activations import Activation
from dense_bridge.initializers import Init
from dense_bridge.specs import Bilinear as BilinearSpec
from dense_bridge.specs import Dense, Identity, Sequential
from dense_bridge.wiring import Wiring

if keras.backend.backend() != "tensorflow":  # pragma: no cover - depends on KERAS_BACKEND
    raise BackendUnavailableError(
        f"the 'keras' backend of dense_bridge needs Keras' TensorFlow backend, but Keras runs on "
        f"{keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before importing keras."
    )

__all__ = ["DenseBridgeDense", "Bilinear", "ExactActivation", "DenseBridgeInitializer"]

_PACKAGE = "dense_bridge"


# ================================================================== memory
_GIVE_MIN_BYTES = 1 << 20  # below this TF's own copy of a numpy array costs next to nothing
_GIVEABLE = {np.dtype(t) for t in (np.float16, np.float32, np.float64)} | {np.dtype(numpy_dtype("bfloat16"))}


def _to_tensor(array: Any) -> tf.Tensor:
    """A fresh TF tensor holding a copy of ``array``, in memory TF alone owns.

    Large arrays are copied by dense_bridge (a cache-blocked transpose for views such as
    torch's weight.T: 2-3x tf.transpose here) into a new buffer that TF then adopts (:func:`_give`).
    """
    a = np.asarray(array)
    if a.nbytes < _GIVE_MIN_BYTES or a.dtype not in _GIVEABLE or not tf.executing_eagerly():
        return tf.convert_to_tensor(a)  # TF copies (numpy memory is not 64-byte aligned)
    fresh, _ = native_copy(a)
    return _give(fresh)


def _give(fresh: np.ndarray) -> tf.Tensor:
    """TF's tensor over ``fresh``, a new 64-byte aligned array that no one else references.

    DLPack hands the buffer to TF without a copy (``tf.convert_to_tensor`` would copy it
    again), and a variable created from or assigned the tensor takes the buffer over: its
    only owner from then on. TF aborts on DLPack memory not aligned to 64 bytes (FACTS);
    ``ParamSource.native_layer`` and ``native_copy`` buffers are.
    """
    if fresh.dtype not in _GIVEABLE or not tf.executing_eagerly() or fresh.ndim == 0:
        return tf.convert_to_tensor(fresh)
    if fresh.dtype == numpy_dtype("bfloat16"):
        # numpy exports no ml_dtypes bfloat16 over DLPack: move the bits as uint16, relabel in TF
        # (tf.bitcast shares the buffer)
        return tf.bitcast(tf.experimental.dlpack.from_dlpack(fresh.view(np.uint16).__dlpack__()), tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(fresh.__dlpack__())


def _read(variable) -> np.ndarray:
    """A zero-copy, read-only numpy snapshot of a Keras variable (bfloat16 as ml_dtypes)."""
    out = np.asarray(tf.convert_to_tensor(variable.value))
    out.flags.writeable = False  # it is TF's buffer: never written through numpy
    return out


def _assign(variable, array: Any) -> None:
    """Copy a canonical array into a variable (the variable takes over the fresh buffer)."""
    variable.assign(_to_tensor(array))


# ================================================================ activations
def _const(value: float, x: tf.Tensor) -> tf.Tensor:
    # A constant made directly in x's dtype: TF routes some Python floats through float32
    # (FACTS: gelu's 1/sqrt(2) is 5e-9 off in float64).
    return tf.constant(value, dtype=x.dtype)


def _leaky_relu(x, negative_slope):
    # not tf.nn.leaky_relu: its alpha is a float32 attribute (0.01 -> 2e-9 relative in float64)
    return tf.where(x > 0, x, x * _const(negative_slope, x))


def _elu(x, alpha):
    return tf.where(x > 0, x, _const(alpha, x) * tf.math.expm1(tf.minimum(x, _const(0.0, x))))


def _gelu(x):
    return _const(0.5, x) * x * tf.math.erfc(-x * _const(1.0 / math.sqrt(2.0), x))


def _gelu_tanh(x):
    inner = _const(math.sqrt(2.0 / math.pi), x) * (x + _const(0.044715, x) * x * x * x)
    return _const(0.5, x) * x * (_const(1.0, x) + tf.math.tanh(inner))


def _hard_sigmoid(x):
    return tf.nn.relu6(x + _const(3.0, x)) / _const(6.0, x)


# canonical name -> f(x, **params), each the exact function with every parameter explicit
_TF_FUNCTIONS: dict[str, Callable[..., tf.Tensor]] = {
    "linear": lambda x: x,
    "relu": tf.nn.relu,
    "relu6": tf.nn.relu6,
    "leaky_relu": _leaky_relu,
    "elu": _elu,
    "selu": lambda x, alpha, scale: _const(scale, x) * _elu(x, alpha),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": tf.nn.silu,
    "sigmoid": tf.math.sigmoid,
    "hard_sigmoid": _hard_sigmoid,
    "hard_silu": lambda x: x * _hard_sigmoid(x),
    "tanh": tf.math.tanh,
    "softplus": tf.math.softplus,
    "softsign": tf.nn.softsign,
    "mish": lambda x: x * tf.math.tanh(tf.math.softplus(x)),
    "softmax": lambda x, axis: tf.nn.softmax(x, axis=axis),
    "log_softmax": lambda x, axis: tf.nn.log_softmax(x, axis=axis),
    "exponential": tf.math.exp,
}
assert set(_TF_FUNCTIONS) == set(ACTIVATION_NAMES)


@keras.saving.register_keras_serializable(package=_PACKAGE)
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
        x = tf.convert_to_tensor(x)
        if x.dtype in (tf.float16, tf.bfloat16):
            return tf.cast(self._fn(tf.cast(x, tf.float32), **self._params), x.dtype)
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


def _activation_of_function(fn: Any, where: str) -> Activation:
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
    readable = sorted({*_KERAS_FUNCTIONS.values(), "leaky_relu", "elu", "gelu", "softmax", "log_softmax"})
    raise ConversionError(
        f"{where} uses the activation {getattr(fn, '__name__', fn)!r}, which dense_bridge cannot "
        f"express exactly. Readable: keras.activations {', '.join(readable)}, or an ExactActivation."
    )


def _activation_layer(act: Activation, dtype: str) -> keras.layers.Layer:
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
    if name == "leaky_relu" and (dtype != "float64" or float(np.float32(slope)) == slope):
        # tf.nn.leaky_relu holds its slope as float32: exact unless a float64 layer needs more
        return keras.layers.LeakyReLU(negative_slope=slope, dtype=dtype)
    native = name in _KERAS_FUNCTIONS_BY_NAME and act == Activation(name)  # selu: only its exact constants
    if native or (name == "log_softmax" and p["axis"] == -1):
        return keras.layers.Activation(name, dtype=dtype)
    # gelu/gelu_tanh (tf.nn.gelu rounds its constants through float32), other axes and parameters
    return keras.layers.Activation(ExactActivation(act), dtype=dtype)


def _activation_of_layer(layer) -> Activation | None:
    """The db Activation of a Keras activation layer; None when ``layer`` is not one."""
    t, where = type(layer), _describe(layer)
    if t is keras.layers.Activation:
        return _activation_of_function(layer.activation, where)
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


# =============================================================== initializers
@keras.saving.register_keras_serializable(package=_PACKAGE)
class DenseBridgeInitializer(keras.initializers.Initializer):
    """A dense_bridge initializer (db.Init) with the layer's fans, as a Keras initializer.

    dense_bridge computes fans from the layer, also for the bias (fan_in = in_features), and
    has distributions Keras lacks ("torch_default", "mlx_default"). ``fan_in``/``fan_out`` of
    None (a lazy layer serialised before it was built) fall back to the weight's own shape.
    """

    def __init__(self, init: Any = "glorot_uniform", fan_in: int | None = None,
                 fan_out: int | None = None) -> None:
        self.init = init if isinstance(init, Init) else (Init.from_config(init) if isinstance(init, dict)
                                                          else Init(init))
        self.fan_in, self.fan_out = fan_in, fan_out
        self._draw: tuple[_Draw, str] | None = None  # first values from a ParamSource, once

    def __call__(self, shape, dtype=None):
        if self._draw is not None:
            draw, key = self._draw
            self._draw = None
            return draw.take(key, tuple(shape))
        fan_in = self.fan_in if self.fan_in is not None else shape[0]
        fan_out = self.fan_out if self.fan_out is not None else shape[-1]
        values = self.init.sample(tuple(shape), fan_in, fan_out, np.random.default_rng())
        # drawn in float64, rounded once to the variable dtype (as ParamSource does)
        return _to_tensor(values.astype(numpy_dtype(keras.backend.standardize_dtype(dtype or "float32"))))

    def get_config(self) -> dict:
        return {"init": self.init.to_config(), "fan_in": self.fan_in, "fan_out": self.fan_out}

    def __repr__(self) -> str:
        return f"DenseBridgeInitializer({self.init!r}, fan_in={self.fan_in}, fan_out={self.fan_out})"


# db name -> (scale, mode, distribution) of Keras' VarianceScaling family
_VARIANCE_SCALING = {
    "glorot_uniform": (1.0, "fan_avg", "uniform"), "glorot_normal": (1.0, "fan_avg", "truncated_normal"),
    "he_uniform": (2.0, "fan_in", "uniform"), "he_normal": (2.0, "fan_in", "truncated_normal"),
    "lecun_uniform": (1.0, "fan_in", "uniform"), "lecun_normal": (1.0, "fan_in", "truncated_normal"),
}


def _keras_initializer(init: Init, role: str, fan_in: int | None, fan_out: int | None):
    """A native Keras initializer with ``init``'s distribution, else a DenseBridgeInitializer.

    Keras computes fans from the weight's own shape: equal to the layer's for a Dense kernel,
    not for a bias (or a 3-D Bilinear kernel), so fan-dependent inits stay dense_bridge's there.
    """
    n, p = init.name, dict(init.params)
    ki = keras.initializers
    fanless = {"zeros": lambda: ki.Zeros(), "ones": lambda: ki.Ones(),
               "constant": lambda: ki.Constant(p["value"]),
               "normal": lambda: ki.RandomNormal(p["mean"], p["stddev"]),
               "uniform": lambda: ki.RandomUniform(p["minval"], p["maxval"]),
               "truncated_normal": lambda: ki.TruncatedNormal(p["mean"], p["stddev"])}
    if n in fanless:
        return fanless[n]()
    if role == "kernel" and n in _VARIANCE_SCALING:  # GlorotUniform(), HeNormal(), ...
        return getattr(ki, "".join(part.capitalize() for part in n.split("_")))()
    if role == "kernel" and n == "orthogonal":
        return ki.Orthogonal(gain=p["gain"])
    return DenseBridgeInitializer(init, fan_in, fan_out)


def _db_init(initializer, default: str) -> Init:
    """The db Init a Keras initializer samples; ``default`` where dense_bridge has no equal.

    Initializers do not change what a layer computes, so an unknown one is not an error.
    """
    ki = keras.initializers
    if isinstance(initializer, DenseBridgeInitializer):
        return initializer.init
    t = type(initializer)
    simple = {ki.Zeros: "zeros", ki.Ones: "ones"}
    if t in simple:
        return Init(simple[t])
    cfg = initializer.get_config() if hasattr(initializer, "get_config") else {}
    if t is ki.Constant and np.ndim(cfg.get("value")) == 0:
        return Init("constant", value=float(cfg["value"]))
    if t is ki.RandomNormal:
        return Init("normal", mean=float(cfg["mean"]), stddev=float(cfg["stddev"]))
    if t is ki.RandomUniform:
        return Init("uniform", minval=float(cfg["minval"]), maxval=float(cfg["maxval"]))
    if t is ki.TruncatedNormal:
        return Init("truncated_normal", mean=float(cfg["mean"]), stddev=float(cfg["stddev"]))
    if t is ki.Orthogonal:
        return Init("orthogonal", gain=float(cfg["gain"]))
    if isinstance(initializer, ki.VarianceScaling):  # GlorotUniform & co. are subclasses
        key = (float(initializer.scale), initializer.mode, initializer.distribution)
        for name, family in _VARIANCE_SCALING.items():
            if key == family:
                return Init(name)
    return Init(default)


class _Draw:
    """One layer's first parameters: drawn from the ParamSource when the input width is known.

    The layer's initializers each ``take`` their array once; when all are taken, ``on_done``
    installs the layer's lasting initializers (with the now-known fans).
    """

    def __init__(self, source: ParamSource, index: int, spec: Any,
                 on_done: Callable[[Any], None] | None = None) -> None:
        self.source, self.index, self.spec, self.on_done = source, index, spec, on_done
        self.params: dict[str, np.ndarray] | None = None
        self._left: set[str] = set()

    def take(self, key: str, shape: tuple[int, ...]) -> tf.Tensor:
        if self.params is None:
            if isinstance(self.spec, Dense):
                # the kernel is made first; its shape (in, units) fixes a lazy width
                self.spec = self.spec.with_in_features(int(shape[0]))
            # fresh aligned copies in Keras' layout (= canonical), NaN/Inf-checked while copied
            self.params = self.source.native_layer(self.index, self.spec)
            if "mask" in self.params and self.source.params is not None:
                # given kernels may hold values under the mask; stored masked weights are 0
                # (in place: the buffer is still ours alone)
                np.multiply(self.params["kernel"], self.params["mask"], out=self.params["kernel"])
            self._left = set(self.params)
        value = self.params[key]
        if tuple(value.shape) != tuple(shape):
            raise SpecError(f"parameter {key!r} of layer {self.index} has shape {tuple(value.shape)} but "
                            f"the layer needs {tuple(shape)} for its input. {received(key, value.shape)}")
        self._left.discard(key)
        del self.params[key]  # TF owns this buffer from here on: keep no writable alias of it
        tensor = _give(value)
        if not self._left and self.on_done is not None:
            self.on_done(self.spec)
            self.on_done = None
        return tensor

    def initializer(self, init: Init, key: str, fan_in, fan_out) -> DenseBridgeInitializer:
        out = DenseBridgeInitializer(init, fan_in, fan_out)
        out._draw = (self, key)
        return out


# ====================================================================== layers
@keras.saving.register_keras_serializable(package=_PACKAGE)
class DenseBridgeDense(keras.layers.Dense):
    """keras.layers.Dense with an exact activation and/or a fixed 0/1 mask on the kernel.

    y = activation(x @ (kernel * mask) + bias). ``mask`` is a dense_bridge wiring config (or
    None); built, the layer holds it as the non-trainable weight "mask" (in_features, units),
    so it is saved with the weights and the optimizer never touches it. The activation is an
    :class:`ExactActivation`, serialised with its parameters.
    """

    def __init__(self, units, *, mask: dict | None = None, **kwargs) -> None:
        super().__init__(units, **kwargs)
        self._wiring = None if mask is None else (mask if isinstance(mask, Wiring) else Wiring.from_config(mask))
        self._mask_init: Callable | None = None  # a _Draw's initializer, set by compile
        self.mask = None

    def build(self, input_shape):
        super().build(input_shape)
        if self._wiring is None:
            return
        shape = (int(input_shape[-1]), self.units)
        if shape != self._wiring.shape:
            raise SpecError(f"the mask of layer {self.name!r} has shape {self._wiring.shape} but the input "
                            f"gives a kernel of shape {shape}. {received('input_shape', input_shape)}")
        wiring = self._wiring
        init = self._mask_init or (lambda shape, dtype=None: _to_tensor(wiring.as_array(numpy_dtype(dtype))))
        self._mask_init = None
        self.mask = self.add_weight(name="mask", shape=shape, initializer=init, trainable=False)

    def call(self, inputs, training=None):
        kernel = self.kernel
        if self.mask is not None:
            # in the forward pass, not a kernel_constraint (that runs only after an update):
            # masked entries get zero gradient, so they stay exactly 0
            kernel = keras.ops.multiply(kernel, self.mask)
        x = keras.ops.matmul(inputs, kernel)
        if self.bias is not None:
            x = keras.ops.add(x, self.bias)
        return self.activation(x)

    def save_own_variables(self, store):
        # Dense saves only the variables it knows by name: without this the files drop the mask
        super().save_own_variables(store)
        if self.mask is not None:
            store["mask"] = self.mask

    def load_own_variables(self, store):
        super().load_own_variables(store)  # Dense checks the entry count: the mask is counted
        if self.mask is not None:
            self.mask.assign(store["mask"])

    def get_config(self) -> dict:
        config = super().get_config()
        config["mask"] = None if self._wiring is None else self.wiring().to_config()
        return config

    def wiring(self) -> Wiring | None:
        """The mask as a dense_bridge Wiring, read from the weight once built."""
        if self.mask is None or self._wiring is None:
            return self._wiring
        current = _read(self.mask) != 0
        if not np.array_equal(current, self._wiring.adjacency):
            self._wiring = Wiring(current, allow_empty_outputs=True)
        return self._wiring


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Bilinear(keras.layers.Layer):
    """y_k = x1 @ kernel[k] @ x2 + bias[k]; Keras has no bilinear layer.

    Called as ``layer(x1, x2)`` (like torch.nn.Bilinear and db.Bilinear), x1 (*, in1_features),
    x2 (*, in2_features) with equal leading dims -> y (*, units). Weights "kernel"
    (units, in1_features, in2_features) and "bias" (units,), created at construction since
    every shape is known. Default initializers are torch's: U(+-1/sqrt(in1)) for both.
    """

    def __init__(self, in1_features: int, in2_features: int, units: int, use_bias: bool = True,
                 kernel_initializer: Any = None, bias_initializer: Any = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.in1_features, self.in2_features, self.units = int(in1_features), int(in2_features), int(units)
        self.use_bias = bool(use_bias)
        default = DenseBridgeInitializer("torch_default", self.in1_features, self.units)
        self.kernel_initializer = keras.initializers.get(kernel_initializer or default)
        self.bias_initializer = keras.initializers.get(bias_initializer or default)
        self.kernel = self.add_weight(name="kernel", shape=(self.units, self.in1_features, self.in2_features),
                                      initializer=self.kernel_initializer)
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer=self.bias_initializer) \
            if self.use_bias else None
        self.built = True

    def call(self, x1, x2):
        y = tf.einsum("...i,kij,...j->...k", x1, tf.convert_to_tensor(self.kernel), x2)
        return y + self.bias if self.bias is not None else y

    def compute_output_shape(self, x1_shape, x2_shape):
        return tuple(x1_shape[:-1]) + (self.units,)

    def get_config(self) -> dict:
        return {**super().get_config(), "in1_features": self.in1_features, "in2_features": self.in2_features,
                "units": self.units, "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}


# ===================================================================== compile
def owns(obj) -> bool:
    return isinstance(obj, keras.layers.Layer)


def compile(spec, source: ParamSource):
    """The Keras layer or model for ``spec``, parameters from ``source`` (built when width known)."""
    if isinstance(spec, Sequential):
        return _compile_sequential(spec, source)
    return _compile_layer(spec, source, 0, getattr(spec, "dtype", "float32"))


def _compile_layer(spec, source: ParamSource, index: int, dtype: str):
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, BilinearSpec):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, Identity):
        return keras.layers.Identity(name=spec.name, dtype=dtype)
    if isinstance(spec, Activation):
        return _activation_layer(spec, dtype)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def _compile_dense(spec: Dense, source: ParamSource, index: int):
    """keras.layers.Dense (exactly, with no activation and no mask) or DenseBridgeDense."""
    exact = spec.activation.is_identity and spec.mask is None
    cls = keras.layers.Dense if exact else DenseBridgeDense
    layer = None

    def install_lasting_initializers(built: Dense) -> None:
        layer.kernel_initializer = _keras_initializer(built.kernel_init, "kernel", built.in_features, built.units)
        layer.bias_initializer = _keras_initializer(built.bias_init, "bias", built.in_features, built.units)

    draw = _Draw(source, index, spec, install_lasting_initializers)
    kwargs: dict[str, Any] = dict(
        use_bias=spec.use_bias, dtype=spec.dtype, name=spec.name,
        kernel_initializer=draw.initializer(spec.kernel_init, "kernel", spec.in_features, spec.units),
        bias_initializer=draw.initializer(spec.bias_init, "bias", spec.in_features, spec.units))
    if not exact:
        kwargs["activation"] = None if spec.activation.is_identity else ExactActivation(spec.activation)
        kwargs["mask"] = spec.mask
    layer = cls(spec.units, **kwargs)
    if spec.mask is not None:
        layer._mask_init = draw.initializer(Init("ones"), "mask", spec.in_features, spec.units)
    if spec.in_features is not None:
        layer.build((None, spec.in_features))
    return layer


def _compile_bilinear(spec: BilinearSpec, source: ParamSource, index: int) -> Bilinear:
    draw = _Draw(source, index, spec)
    bias_init = spec.init if spec.init.name in ("torch_default", "mlx_default") else Init("zeros")
    k_init = draw.initializer(spec.init, "kernel", spec.in1_features, spec.units)
    b_init = draw.initializer(bias_init, "bias", spec.in1_features, spec.units)
    return Bilinear(spec.in1_features, spec.in2_features, spec.units, use_bias=spec.use_bias,
                    kernel_initializer=k_init, bias_initializer=b_init, dtype=spec.dtype, name=spec.name)


def _neighbour_dtypes(layers: Sequence) -> list[str]:
    """Each position's compute dtype: its own, else the Dense before it, else the one after."""
    own = [getattr(l, "dtype", None) for l in layers]
    out, last = [], None
    for d in own:
        last = d or last
        out.append(last)
    following = next((d for d in own if d), "float32")
    return [d or following for d in out]


def _compile_sequential(spec: Sequential, source: ParamSource):
    dtypes = _neighbour_dtypes(spec.layers)
    layers = [_compile_layer(l, source, i, dtypes[i]) for i, l in enumerate(spec.layers)]
    if spec.in_features is not None:
        # the Input's dtype is the first layer's: Keras casts model inputs to the Input dtype
        layers.insert(0, keras.Input((spec.in_features,), dtype=dtypes[0] if dtypes else "float32"))
    return keras.Sequential(layers, name=spec.name)


# ===================================================================== structure
def _describe(obj) -> str:
    t = type(obj)
    return f"layer {getattr(obj, 'name', '?')!r} ({t.__module__}.{t.__qualname__})"


def _snake(name: str) -> str:
    # keras.src.utils.naming.to_snake_case, which Keras uses for automatic layer names
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _spec_name(obj) -> str | None:
    """The layer's name, or None when Keras generated it ("dense_3", "sequential")."""
    name = getattr(obj, "name", None)
    if name is None or re.fullmatch(rf"{re.escape(_snake(type(obj).__name__))}(_\d+)?", name):
        return None
    return name


def _is_functional(model) -> bool:
    try:
        from keras.src.models.functional import Functional  # Keras exports no public name for it
    except ImportError:  # pragma: no cover - a future Keras layout
        return type(model).__name__ == "Functional"
    return type(model) is Functional


def _chain(model) -> list:
    """The layers of a Sequential or of a single-path functional model, input to output.

    Positions in this list are the parameter-key positions ("0.kernel"); InputLayers excluded.
    """
    if type(model) is keras.Sequential:
        layers = list(model.layers)
    elif _is_functional(model):
        layers = _functional_chain(model)
    else:
        raise ConversionError(
            f"{_describe(model)} is a subclassed keras.Model; dense_bridge reads keras.Sequential and "
            "functional models whose layers form one chain")
    seen: set[int] = set()
    for layer in layers:
        if id(layer) in seen:
            raise ConversionError(f"{_describe(layer)} is used twice in {_describe(model)}; shared layers "
                                  "cannot be expressed as a Sequential")
        seen.add(id(layer))
    return layers


def _functional_chain(model) -> list:
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ConversionError(f"{_describe(model)} has {len(model.inputs)} inputs and {len(model.outputs)} "
                              "outputs; dense_bridge reads single-input, single-output chains")
    layers, tensor = [], model.outputs[0]
    while True:
        op, node_index, _ = tensor._keras_history  # Keras' own record of the op that made it
        if isinstance(op, keras.layers.InputLayer):
            break
        node = op._inbound_nodes[node_index]
        if len(node.input_tensors) != 1:
            raise ConversionError(
                f"{_describe(op)} in {_describe(model)} takes {len(node.input_tensors)} tensors; dense_bridge "
                "reads models whose layers form one chain (no residual or merge connections)")
        layers.append(op)
        tensor = node.input_tensors[0]
    if tensor is not model.inputs[0]:  # pragma: no cover - Keras guarantees a connected graph
        raise ConversionError(f"{_describe(model)}: the output does not lead back to the input")
    return layers[::-1]


def _kind(layer) -> str:
    """"dense", "bilinear" or "free" (no parameters); ConversionError for anything else."""
    t = type(layer)
    if t in (keras.layers.Dense, DenseBridgeDense):
        return "dense"
    if t is Bilinear:
        return "bilinear"
    if t in (keras.layers.Identity, keras.layers.Dropout) or _activation_of_layer(layer) is not None:
        return "free"
    raise ConversionError(
        f"cannot convert {_describe(layer)}: dense_bridge reads Dense, Bilinear, Identity, Dropout, "
        "Activation, ReLU, LeakyReLU, ELU and Softmax layers")


# ====================================================================== to_spec
def to_spec(native):
    """The dense_bridge spec of a Keras layer, Sequential or single-chain functional model."""
    if isinstance(native, keras.Model):
        return _model_spec(native)
    return _layer_spec(native)


def _model_spec(model) -> Sequential:
    chain = _chain(model)
    specs = []
    for layer in chain:
        if _kind(layer) == "bilinear":
            raise ConversionError(f"{_describe(layer)} takes two inputs and cannot sit in a Sequential chain")
        specs.append(_layer_spec(layer))
    try:
        return Sequential(specs, in_features=_input_width(model), name=_spec_name(model))
    except SpecError as exc:
        raise ConversionError(f"{_describe(model)}: {exc}") from None


def _input_width(model) -> int | None:
    try:
        inputs = model.inputs  # a Sequential without an Input has none yet (lazy)
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    width = inputs[0].shape[-1]
    return None if width is None else int(width)


def _layer_spec(layer):
    kind = _kind(layer)
    if kind == "dense":
        return _dense_spec(layer)
    if kind == "bilinear":
        return BilinearSpec(layer.in1_features, layer.in2_features, layer.units, use_bias=layer.use_bias,
                            init=_db_init(layer.kernel_initializer, "torch_default"),
                            dtype=_dtype_of(layer), name=_spec_name(layer))
    if type(layer) in (keras.layers.Identity, keras.layers.Dropout):  # Dropout: identity at inference
        return Identity(name=_spec_name(layer))
    return _activation_of_layer(layer)


def _dtype_of(layer) -> str:
    # the variables' dtype: a mixed policy ("mixed_float16") reads as its float32 parameters
    dtype = keras.backend.standardize_dtype(layer.dtype_policy.variable_dtype)
    if dtype not in DTYPE_NAMES:
        raise ConversionError(f"{_describe(layer)} has dtype {dtype}; dense_bridge supports "
                              f"{', '.join(DTYPE_NAMES)}")
    return dtype


def _dense_spec(layer) -> Dense:
    where = _describe(layer)
    if getattr(layer, "quantization_mode", None) is not None or getattr(layer, "lora_enabled", False):
        raise ConversionError(f"{where} is quantized or has LoRA enabled; dense_bridge reads plain kernels")
    wiring = layer.wiring() if isinstance(layer, DenseBridgeDense) else None
    in_features = int(layer.kernel.shape[0]) if layer.built else None
    return Dense(layer.units, in_features=in_features, use_bias=layer.use_bias,
                 activation=_activation_of_function(layer.activation, where),
                 kernel_init=_db_init(layer.kernel_initializer, "glorot_uniform"),
                 bias_init=_db_init(layer.bias_initializer, "zeros"),
                 mask=wiring, dtype=_dtype_of(layer), name=_spec_name(layer))


# ================================================================== parameters
def _layers_of(native) -> tuple[list, bool]:
    if isinstance(native, keras.Model):
        return _chain(native), True
    return [native], False


def _variables(layer) -> dict[str, Any]:
    """Canonical name -> Keras variable of one layer (the mask included)."""
    kind = _kind(layer)
    if kind == "free":
        return {}
    if not layer.built:
        raise SpecError(f"{_describe(layer)} has in_features=None (lazy) and no parameters yet: run one "
                        "input through it (or build it) first")
    out = {"kernel": layer.kernel}
    if layer.bias is not None:
        out["bias"] = layer.bias
    if getattr(layer, "mask", None) is not None and kind == "dense":
        out["mask"] = layer.mask
    return out


def get_params(native) -> dict[str, np.ndarray]:
    """Canonical params as zero-copy read-only snapshots of the variables (see module doc)."""
    layers, keyed = _layers_of(native)
    return {(f"{i}." if keyed else "") + k: _read(v)
            for i, layer in enumerate(layers) for k, v in _variables(layer).items()}


def set_params(native, params: dict[str, np.ndarray]) -> None:
    """Write validated canonical params (possibly a subset) into the variables."""
    layers, keyed = _layers_of(native)
    for i, layer in enumerate(layers):
        prefix = f"{i}." if keyed else ""
        mine = {k: params[prefix + k] for k in ("kernel", "bias", "mask") if prefix + k in params}
        if mine:
            _set_layer(layer, mine)


def _set_layer(layer, params: dict[str, np.ndarray]) -> None:
    variables = _variables(layer)
    if "mask" in params:
        _assign(variables["mask"], params["mask"])
    if "kernel" in params or "mask" in params:
        kernel = _to_tensor(params["kernel"]) if "kernel" in params else tf.convert_to_tensor(variables["kernel"].value)
        if "mask" in variables:  # stored masked weights are exactly 0, whatever was given
            kernel = kernel * tf.convert_to_tensor(variables["mask"].value)
        variables["kernel"].assign(kernel)
    if "bias" in params:
        _assign(variables["bias"], params["bias"])


# ======================================================================= trace
def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Forward, then per-layer backward with tf.GradientTape for L = sum(y * grad_out)."""
    layers, _ = _layers_of(native)
    for layer in layers:
        _kind(layer)
    dtype = layers[0].compute_dtype if layers else "float32"
    xs = [tf.cast(_to_tensor(np.asarray(x)), dtype) for x in inputs]
    steps = []
    for layer in layers:
        with tf.GradientTape() as tape:
            for x in xs:
                tape.watch(x)
            y = layer(*xs, training=False)
        steps.append((layer, tape, xs, y))
        xs = [y]
    records: list[LayerTrace] = [None] * len(steps)  # type: ignore[list-item]
    g = tf.cast(_to_tensor(np.asarray(grad_out)), steps[-1][3].dtype) if steps else None
    for i in range(len(steps) - 1, -1, -1):
        layer, tape, xs, y = steps[i]
        trainable = {k: v for k, v in _variables(layer).items() if k != "mask"}
        sources = list(xs) + [v.value for v in trainable.values()]
        grads = tape.gradient(y, sources, output_gradients=g)
        grads = [tf.zeros_like(s) if d is None else d for s, d in zip(sources, grads)]
        dxs = tuple(d.numpy() for d in grads[:len(xs)])
        records[i] = LayerTrace(y.numpy(), dxs, {k: d.numpy() for k, d in zip(trainable, grads[len(xs):])})
        g = grads[0]
    return Trace(records)
