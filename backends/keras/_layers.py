"""The Keras layer classes, initializers and ``compile``: specs to Keras layers and models,
parameters from a ParamSource.

What compile builds: Dense with no activation and no mask -> exactly ``keras.layers.Dense``
(also when lazy); otherwise :class:`DenseBridgeDense`. Bilinear -> :class:`Bilinear` (Keras
has none); Identity -> ``keras.layers.Identity``; Activation -> see ``_activations``;
Sequential -> :class:`AnyRankSequential`, a ``keras.Sequential`` (with a ``keras.Input`` when the width
is known) that takes inputs of any rank, features last.

- ``kernel_constraint`` runs only after an optimizer step, so a mask is multiplied into the
  kernel in ``call``; its gradient is then zero on masked entries and the stored zeros stay
  zero under SGD (momentum, decoupled weight decay), Adam and custom GradientTape loops.
- Layers compute in their dtype policy's compute dtype and cast floating inputs to it, so
  activation and identity layers in a Sequential take the dtype of the Dense before them.
"""
from __future__ import annotations

import contextlib

from typing import Any, Callable, Sequence

import keras
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import SpecError, received
from dense_bridge.params._source import ParamSource
from dense_bridge.activations import Activation
from dense_bridge.initializers import Init
from dense_bridge.specs import Bilinear as BilinearSpec
from dense_bridge.specs import Dense, Flatten, Identity, Sequential
from dense_bridge.wiring import Wiring

from ._engine import change_key, check_dtype, einsum, inexact_float64_dense, matmul, recording, same_key
from ._activations import REGISTRATION_PACKAGE, ExactActivation, activation_layer
from ._arrays import give_array, read_array, to_tensor


# ------------------------------------------------------------------ initializers, both directions
# Parameters are written straight into the variables at creation: the layer's initializers hand
# out the ParamSource's arrays once (:class:`_Draw`), then the lasting initializer (a native Keras
# one where it samples the same distribution, else :class:`DenseBridgeInitializer`) is put back.
# The arrays handed out are fresh 64-byte aligned buffers (``ParamSource.native_layer``) given to TF
# through DLPack, so each variable adopts its buffer: one copy in all, no Keras random init.
@keras.saving.register_keras_serializable(package=REGISTRATION_PACKAGE)
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
        return to_tensor(values.astype(numpy_dtype(keras.backend.standardize_dtype(dtype or "float32"))))

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


def init_of(initializer, default: str) -> Init:
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

    def take(self, key: str, shape: tuple[int, ...]):
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
        tensor = give_array(value)
        if not self._left and self.on_done is not None:
            self.on_done(self.spec)
            self.on_done = None
        return tensor

    def initializer(self, init: Init, key: str, fan_in, fan_out) -> DenseBridgeInitializer:
        out = DenseBridgeInitializer(init, fan_in, fan_out)
        out._draw = (self, key)
        return out


# ------------------------------------------------------------------ layers


@keras.saving.register_keras_serializable(package=REGISTRATION_PACKAGE)
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
        self._inference = False  # inside db.inference(model): the cached product is trusted
        self._masked_cache = None  # (kernel key, mask key, kernel * mask)

    def build(self, input_shape):
        super().build(input_shape)
        if self._wiring is None:
            return
        shape = (int(input_shape[-1]), self.units)
        if shape != self._wiring.shape:
            raise SpecError(f"the mask of layer {self.name!r} has shape {self._wiring.shape} but the input "
                            f"gives a kernel of shape {shape}. {received('input_shape', input_shape)}")
        wiring = self._wiring
        init = self._mask_init or (lambda shape, dtype=None: to_tensor(wiring.as_array(numpy_dtype(dtype))))
        self._mask_init = None
        self.mask = self.add_weight(name="mask", shape=shape, initializer=init, trainable=False)

    def call(self, inputs, training=None):
        kernel = self.kernel.value
        if self.mask is not None:
            # in the forward pass, not a kernel_constraint (that runs only after an update):
            # masked entries get zero gradient, so they stay exactly 0
            kernel = self._masked_kernel(inputs, training)
        # the engine's matmul and tensor operators: keras.ops.matmul/multiply/add compute float64
        # in float32 on torch (_engine)
        x = matmul(inputs, kernel)
        if self.bias is not None:
            x = x + self.bias.value
        return self.activation(x)

    def _masked_kernel(self, inputs, training):
        """kernel * mask, reused in inference while neither changed.

        Reused only in eager calls with ``training`` not True (on the torch engine also only with
        autograd off: ``torch.no_grad()``, as ``predict`` runs), and only when the engine can tell
        that neither variable changed since (JAX: a new array per assign; torch: version counter,
        data pointer, identity) or inside ``db.inference(model)``, which promises no writes but
        dense_bridge's own (``set_params``/``load_weights`` drop the cache) and no gradients.
        TensorFlow variables change in place without a counter, so on TensorFlow only
        ``db.inference`` caches. Never inside tf.function/jit tracing: a cached tensor would be
        frozen into the graph.
        """
        kernel, mask = self.kernel, self.mask
        if training or recording(inputs):
            return kernel.value * mask.value
        keys = (change_key(kernel), change_key(mask))
        cache = self._masked_cache
        if cache is not None and (self._inference or (same_key(cache[0], keys[0]) and same_key(cache[1], keys[1]))):
            return cache[2]
        product = kernel.value * mask.value
        if self._inference or keys[0] is not None:
            # straight into __dict__: Keras (and torch's Module) would otherwise track the tensors
            self.__dict__["_masked_cache"] = (keys[0], keys[1], product)
        return product

    def clear_masked_cache(self) -> None:
        """Forget the cached product (dense_bridge's own writes and db.inference's exit do this)."""
        self.__dict__["_masked_cache"] = None

    def set_inference(self, on: bool) -> None:
        """Trust the cached product until switched off (``db.inference(model)``)."""
        self.__dict__["_inference"] = bool(on)
        self.__dict__["_masked_cache"] = None

    def save_own_variables(self, store):
        # Dense saves only the variables it knows by name: without this the files drop the mask
        super().save_own_variables(store)
        if self.mask is not None:
            store["mask"] = self.mask

    def load_own_variables(self, store):
        self.clear_masked_cache()
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
        current = read_array(self.mask) != 0
        if not np.array_equal(current, self._wiring.adjacency):
            self._wiring = Wiring(current, allow_empty_outputs=True)
        return self._wiring


@keras.saving.register_keras_serializable(package=REGISTRATION_PACKAGE)
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
        y = einsum("...i,kij,...j->...k", x1, self.kernel.value, x2)
        return y + self.bias if self.bias is not None else y

    def compute_output_shape(self, x1_shape, x2_shape):
        return tuple(x1_shape[:-1]) + (self.units,)

    def get_config(self) -> dict:
        return {**super().get_config(), "in1_features": self.in1_features, "in2_features": self.in2_features,
                "units": self.units, "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}


def compile(spec, source: ParamSource):
    """The Keras layer or model for ``spec``, parameters from ``source`` (built when width known)."""
    for layer in (spec.layers if isinstance(spec, Sequential) else [spec]):
        check_dtype(getattr(layer, "dtype", "float32"))  # JAX without x64 would keep float32 silently
    if isinstance(spec, Sequential):
        return _compile_sequential(spec, source)
    return _compile_layer(spec, source, 0, getattr(spec, "dtype", "float32"))


def _compile_layer(spec, source: ParamSource, index: int, dtype: str):
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, BilinearSpec):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, Flatten):
        return keras.layers.Flatten(name=spec.name, dtype=dtype)
    if isinstance(spec, Identity):
        return keras.layers.Identity(name=spec.name, dtype=dtype)
    if isinstance(spec, Activation):
        return activation_layer(spec, dtype)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def _compile_dense(spec: Dense, source: ParamSource, index: int):
    """keras.layers.Dense (exactly, with no activation and no mask) or DenseBridgeDense."""
    # float64 on torch: keras.layers.Dense would compute in float32 (keras.ops.matmul, _engine)
    exact = spec.activation.is_identity and spec.mask is None and not inexact_float64_dense(spec.dtype)
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


@contextlib.contextmanager
def inference(native):
    """The ``inference`` verb: inside, masked layers of ``native`` keep kernel * mask from their
    first call and reuse it, on every engine TensorFlow included (which has no change counter);
    weights must not change inside except through dense_bridge (``set_params``, ``db.load``,
    ``load_weights``), which drop the cache. Calls with ``training=True`` and traced calls always
    compute the product. On exit every cache is dropped, and so are the model's compiled
    predict/evaluate functions, so none keeps a product traced inside."""
    layers = [l for l in _all_layers(native) if isinstance(l, DenseBridgeDense)]
    for layer in layers:
        layer.set_inference(True)
    _forget_traced_functions(native)
    try:
        yield native
    finally:
        for layer in layers:
            layer.set_inference(False)
        _forget_traced_functions(native)


def _all_layers(native) -> list:
    if isinstance(native, keras.Model):
        return list(native._flatten_layers(include_self=False))
    return [native]


def _forget_traced_functions(native) -> None:
    for name in ("predict_function", "test_function"):
        if getattr(native, name, None) is not None:
            setattr(native, name, None)  # Keras traces them again on the next predict/evaluate


def _neighbour_dtypes(layers: Sequence) -> list[str]:
    """Each position's compute dtype: its own, else the Dense before it, else the one after."""
    own = [getattr(l, "dtype", None) for l in layers]
    out, last = [], None
    for d in own:
        last = d or last
        out.append(last)
    following = next((d for d in own if d), "float32")
    return [d or following for d in out]


@keras.saving.register_keras_serializable(package=REGISTRATION_PACKAGE)
class AnyRankSequential(keras.Sequential):
    """``keras.Sequential`` that takes inputs of any rank, features last, as ``nn.Linear`` does.

    A Keras Sequential with an Input runs as a functional graph fixed to the Input's rank, so
    (batch, seq, features) or (features,) input is refused where the torch and MLX models take
    it. Dense, activations and Flatten act on the last axes of any rank, so for
    another rank this runs the layers one by one; 1-D input runs as a batch of one.
    """

    def call(self, inputs, training=None, mask=None, **kwargs):
        functional = getattr(self, "_functional", None)
        rank = len(getattr(inputs, "shape", ()))
        if functional is None or rank == len(functional.inputs[0].shape) or kwargs or \
                not hasattr(inputs, "shape"):
            return super().call(inputs, training=training, mask=mask, **kwargs)
        x = keras.ops.expand_dims(inputs, 0) if rank == 1 else inputs
        for layer in self.layers:
            x = layer(x, training=training) if layer._call_has_training_arg and training is not None else layer(x)
        return keras.ops.squeeze(x, 0) if rank == 1 else x

    def compute_output_spec(self, inputs, training=None, mask=None, **kwargs):
        functional = getattr(self, "_functional", None)
        if functional is None or len(inputs.shape) == len(functional.inputs[0].shape):
            return super().compute_output_spec(inputs, training=training, mask=mask, **kwargs)
        x = inputs
        for layer in self.layers:
            x = layer.compute_output_spec(x)
        return x


def _compile_sequential(spec: Sequential, source: ParamSource):
    dtypes = _neighbour_dtypes(spec.layers)
    layers = [_compile_layer(l, source, i, dtypes[i]) for i, l in enumerate(spec.layers)]
    if spec.in_features is not None:
        # the Input's dtype is the first layer's: Keras casts model inputs to the Input dtype
        layers.insert(0, keras.Input((spec.in_features,), dtype=dtypes[0] if dtypes else "float32"))
    return AnyRankSequential(layers, name=spec.name)
