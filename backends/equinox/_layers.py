"""The Equinox layer classes and ``compile``: specs to ``equinox.nn`` modules, parameters from a ParamSource.

Equinox layers take ONE sample, (in_features,), and are batched with ``jax.vmap`` (the Equinox
convention, and the one exception to "any leading axes" in dense_bridge: ``trace``, ``compare``
and ``compare_models`` vmap over the leading axes for you). Calling one with a batch raises a
SpecError here rather than ``eqx.nn.Linear``'s silent ``weight @ x`` (which, for a square batch,
computes the wrong thing without complaint).

- Dense with no activation and no mask -> exactly ``eqx.nn.Linear`` (weight (units, in_features)
  = canonical kernel.T). Otherwise :class:`DenseLinear`: the same fields plus a bool ``mask``
  (units, in_features) and a static canonical activation.
- Masks are bool arrays: ``eqx.is_inexact_array`` is False for them, so
  ``eqx.filter(model, eqx.is_inexact_array)``/``eqx.filter_grad``/``eqx.filter_value_and_grad``
  leave them out and no optax optimizer sees them. Masked weights are stored as 0 and the
  forward uses ``where(mask, weight, 0)``, whose gradient is 0 there: they stay exactly 0 under
  ``optax.adamw`` with weight decay.
- Bilinear -> :class:`Bilinear` (Equinox has none): weight (units, in1, in2), the canonical layout
  (and torch's).
- Identity -> ``eqx.nn.Identity``; Flatten -> :class:`Flatten`; Activation ->
  ``eqx.nn.Lambda(jax.nn function)`` with its parameters bound explicitly (``_activations``).
  softmax/log_softmax over an axis other than the last cannot be per-sample: SpecError.
- Sequential -> ``eqx.nn.Sequential``.
- Lazy widths: Equinox modules are immutable pytrees whose shapes are fixed at construction: a
  lazy spec raises a SpecError asking for in_features.

Compiling never draws from JAX's random state: ``eqx.nn.Linear`` is made without its
``__init__`` (whose draws would be thrown away) and given the numpy parameters.
"""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import equinox as eqx
import numpy as np

from dense_bridge._errors import SpecError, received
from dense_bridge.params._source import ParamSource
from dense_bridge.registry._remembered_spec import remember_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear as BilinearSpec
from dense_bridge.specs import Dense, Identity as IdentitySpec, Sequential
from dense_bridge.specs import Flatten as FlattenSpec

from ._activations import activation_fn, identity
from ._arrays import check_dtype, to_jax


def _one_sample(x, expected: int, name: str = "x"):
    x = jnp.asarray(x)
    if x.ndim != 1 or x.shape[0] != expected:
        raise SpecError(f"{name} must have shape (in_features={expected},): Equinox layers take one sample; "
                        f"batch with jax.vmap(layer)(x). Received: {name} of shape {tuple(x.shape)}")
    return x


class DenseLinear(eqx.Module):
    """y = f((weight where mask) @ x + bias) for ONE sample x (in_features,).

    weight (units, in_features) like ``eqx.nn.Linear``, bias (units,) or None, mask a bool array
    (units, in_features) or None, activation the canonical Activation (static).
    """

    weight: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    activation: Activation = eqx.field(static=True)

    def __init__(self, weight, bias, mask, activation: Activation) -> None:
        self.weight, self.bias, self.mask = weight, bias, mask
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.use_bias = bias is not None
        self.activation = activation

    def _linear(self, x):
        """(weight where mask) @ x + bias, before the activation."""
        x = _one_sample(x, self.in_features)
        w = self.weight if self.mask is None else jnp.where(self.mask, self.weight, jnp.zeros((), self.weight.dtype))
        y = w @ x.astype(w.dtype)
        return y if self.bias is None else y + self.bias

    def _activate(self, y):
        fn = activation_fn(self.activation)
        return y if fn is None else fn(y)

    def __call__(self, x, *, key=None):
        return self._activate(self._linear(x))


class Bilinear(eqx.Module):
    """y_k = x1^T weight_k x2 + bias_k for ONE sample pair; weight (units, in1, in2), bias (units,).

    Equinox has no bilinear layer; this is dense_bridge's ``db.Bilinear`` there.
    """

    weight: jax.Array
    bias: jax.Array | None
    in1_features: int = eqx.field(static=True)
    in2_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)

    def __init__(self, weight, bias) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in1_features, self.in2_features = (int(s) for s in weight.shape)

    def __call__(self, x1, x2, *, key=None):
        x1 = _one_sample(x1, self.in1_features, "x1").astype(self.weight.dtype)
        x2 = _one_sample(x2, self.in2_features, "x2").astype(self.weight.dtype)
        y = (self.weight @ x2) @ x1
        return y if self.bias is None else y + self.bias


class Flatten(eqx.Module):
    """One sample's axes flattened into one: (d1, ..., dn) -> (d1*...*dn,); under ``jax.vmap`` this
    is the batched Flatten (batch, d1, ..., dn) -> (batch, d1*...*dn)."""

    def __call__(self, x, *, key=None):
        return jnp.reshape(jnp.asarray(x), (-1,))


def linear(weight, bias) -> eqx.nn.Linear:
    """An ``eqx.nn.Linear`` holding ``weight`` (units, in) and ``bias``, made without random draws."""
    layer = object.__new__(eqx.nn.Linear)
    units, in_features = (int(s) for s in weight.shape)
    # the fields eqx.nn.Linear.__init__ sets (equinox/nn/_linear.py), set as its unflatten does
    for name, value in (("weight", weight), ("bias", bias), ("in_features", in_features),
                        ("out_features", units), ("use_bias", bias is not None)):
        object.__setattr__(layer, name, value)
    return layer


def _check_axis(act: Activation, where: str) -> None:
    if act.name in ("softmax", "log_softmax") and act.params["axis"] not in (-1,):
        raise SpecError(f"{where}: {act.name} over axis {act.params['axis']} cannot be computed one sample at a "
                        f"time (Equinox layers see one sample; only axis=-1). Received: activation={act!r}")


def dense_arrays(params: dict, dtype: str) -> tuple:
    """(weight, bias, bool mask) JAX arrays from canonical params (numpy, or another framework's
    device arrays: copied and transposed on their device); masked weights stored as 0."""
    weight = to_jax(params["kernel"].T, dtype)
    mask = None
    if "mask" in params:
        weight = weight * to_jax(params["mask"].T, dtype)  # exact: the mask is 0/1
        mask = jnp.asarray(np.asarray(params["mask"]).T != 0)
    return weight, to_jax(params["bias"], dtype) if "bias" in params else None, mask


def _compile_dense(spec: Dense, source: ParamSource, index: int):
    check_dtype(spec.dtype)
    if spec.lazy:
        raise SpecError("Equinox modules are immutable, with shapes fixed when they are made: a lazy Dense "
                        "(in_features=None) cannot be compiled for equinox. Give in_features (or "
                        f"Sequential(in_features=...)). Received: spec={spec!r}")
    _check_axis(spec.activation, "activation")
    weight, bias, mask = dense_arrays(source.for_layer(index, spec), spec.dtype)
    if spec.activation.is_identity and mask is None:
        layer = linear(weight, bias)
    else:
        layer = DenseLinear(weight, bias, mask, spec.activation)
    remember_spec(layer, spec)
    return layer


def _compile_layer(spec, source: ParamSource, index: int):
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, BilinearSpec):
        check_dtype(spec.dtype)
        params = source.for_layer(index, spec)
        layer = Bilinear(to_jax(params["kernel"], spec.dtype),
                         to_jax(params["bias"], spec.dtype) if "bias" in params else None)
        remember_spec(layer, spec)
        return layer
    if isinstance(spec, IdentitySpec):
        layer = Flatten() if isinstance(spec, FlattenSpec) else eqx.nn.Identity()
        remember_spec(layer, spec)
        return layer
    if isinstance(spec, Activation):
        _check_axis(spec, "spec")
        fn = activation_fn(spec)
        return eqx.nn.Lambda(identity if fn is None else fn)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def compile(spec, source: ParamSource):
    """The ``equinox.nn`` module for ``spec`` with parameters from ``source`` (see the module docstring)."""
    if isinstance(spec, Sequential):
        model = eqx.nn.Sequential([_compile_layer(layer, source, i) for i, layer in enumerate(spec.layers)])
        remember_spec(model, spec)
        return model
    return _compile_layer(spec, source, 0)


def is_dense(m) -> bool:
    return type(m) is eqx.nn.Linear or isinstance(m, DenseLinear)


# eqx.nn.MLP's default final activation (``lambda x: x``), read from its signature, not its module
_MLP_IDENTITY = inspect.signature(eqx.nn.MLP.__init__).parameters["final_activation"].default


def is_identity_fn(fn) -> bool:
    """Is ``fn`` the identity: dense_bridge's, or eqx.nn.MLP's default final activation."""
    return fn is identity or fn is _MLP_IDENTITY
