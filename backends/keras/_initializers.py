"""Initializers, both directions, and the ParamSource hand-off through them.

Parameters are written straight into the variables at creation: the layer's initializers
hand out the ParamSource's arrays once (:class:`_Draw`), then the lasting initializer (a
native Keras one where it samples the same distribution, else :class:`DenseBridgeInitializer`)
is put back. The arrays handed out are fresh 64-byte aligned buffers
(``ParamSource.native_layer``) given to TF through DLPack, so each variable adopts its buffer:
one copy in all, and no Keras random init to throw away.
"""
from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import SpecError, received
from dense_bridge._params import ParamSource
from dense_bridge.initializers import Init
from dense_bridge.specs import Dense

from ._activations import _PACKAGE
from ._arrays import _give, _to_tensor


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
