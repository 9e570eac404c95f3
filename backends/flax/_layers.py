"""The Flax NNX layer classes and ``compile``: specs to ``flax.nnx`` modules, parameters from a ParamSource.

- Dense with no activation and no mask -> exactly ``nnx.Linear`` (kernel (in_features, units),
  the canonical layout: no transpose anywhere), with ``dtype = param_dtype =`` the spec's dtype
  (inputs are cast to it, as ``nnx.Linear`` promotes them). Otherwise :class:`DenseLinear`, an
  ``nnx.Linear`` subclass applying ``kernel * mask`` and the activation.
- Lazy widths: :class:`LazyDenseLinear` draws its parameters on its first call, from the same
  source and position an eager spec uses (same seed, same bits). NNX modules are mutable Python
  objects, so that works eagerly; it cannot work under a JAX transform (``nnx.jit``, ``nnx.grad``:
  the graph is split before the call, so new Variables would be lost), so a first call with a
  traced input raises a SpecError asking for one eager call first. ``db.compile(params=...)`` and
  ``Sequential(in_features=...)`` build eagerly.
- Masks: :class:`Mask`, an ``nnx.Variable`` that is not an ``nnx.Param``:
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and ``nnx.grad``'s default filter never see it, so it
  never trains; masked kernel entries are stored as 0 and their gradient is 0, so they stay
  exactly 0 under ``optax.adamw`` with weight decay (decay of 0 is 0).
- Bilinear -> :class:`Bilinear` (Flax has none): kernel (units, in1, in2) as canonical.
- Identity -> :class:`Identity`; Flatten -> :class:`Flatten`; Activation -> the ``jax.nn`` callable
  (parameters bound explicitly, ``_activations``) as a plain element of ``nnx.Sequential``.
- Sequential -> ``nnx.Sequential``.

Compiling never draws from JAX's random state: ``nnx.Linear`` gets initialisers that return the
numpy parameters, and no PRNG key is made.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dense_bridge._errors import SpecError, received
from dense_bridge.params._source import ParamSource
from dense_bridge.registry._remembered_spec import remember_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear as BilinearSpec
from dense_bridge.specs import Dense, Identity as IdentitySpec, Sequential
from dense_bridge.specs import Flatten as FlattenSpec

from ._activations import activation_fn, identity
from ._arrays import check_dtype, to_jax


class Mask(nnx.Variable):
    """A Dense layer's 0/1 mask, (in_features, units) like the kernel; not a Param, so it never trains."""


class _NoRngs:
    """Stands in for ``nnx.Rngs`` in ``nnx.Linear.__init__``: the initialisers ignore the key."""

    @staticmethod
    def params():
        return None


def _const(value):
    return lambda key, shape, dtype: value


class DenseLinear(nnx.Linear):
    """``nnx.Linear`` plus an activation and/or a frozen mask: y = f(x @ (kernel * mask) + bias).

    kernel (in_features, units), bias (units,), mask (in_features, units) as a :class:`Mask`
    variable. Inputs of any leading shape (features last) are cast to the parameter dtype.
    """

    def __init__(self, kernel, bias, mask, activation: Activation, dtype: str) -> None:
        in_features, units = (int(s) for s in kernel.shape)
        super().__init__(in_features, units, use_bias=bias is not None, dtype=jnp.dtype(dtype),
                         param_dtype=jnp.dtype(dtype), kernel_init=_const(kernel),
                         bias_init=_const(bias), rngs=_NoRngs())
        self.activation = activation  # static: an immutable, hashable spec object
        if mask is not None:
            self.mask = Mask(mask)

    @property
    def masked(self) -> bool:
        return isinstance(getattr(self, "mask", None), Mask)

    def _check_input(self, x) -> None:
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise SpecError(f"x must have shape (*, in_features={self.in_features}). "
                            f"Received: x of shape {tuple(x.shape)}")

    def _linear(self, x):
        """x @ (kernel * mask) + bias, before the activation."""
        x = jnp.asarray(x)
        self._check_input(x)
        kernel = self.kernel[...]
        if self.masked:
            kernel = kernel * self.mask[...]
        y = jnp.matmul(x.astype(kernel.dtype), kernel)
        return y if self.bias is None else y + self.bias[...]

    def _activate(self, y):
        fn = activation_fn(self.activation)
        return y if fn is None else fn(y)

    def __call__(self, x):
        return self._activate(self._linear(x))


class LazyDenseLinear(DenseLinear):
    """A DenseLinear whose in_features is fixed by its first (eager) input, like torch's LazyLinear."""

    def __init__(self, spec: Dense, source: ParamSource, index: int) -> None:
        # not nnx.Linear.__init__: the kernel's shape is unknown until the first input
        self.in_features = None
        self.out_features = spec.units
        self.use_bias = spec.use_bias
        self.dtype = self.param_dtype = jnp.dtype(spec.dtype)
        self.precision = None
        self.dot_general = jax.lax.dot_general
        self.preferred_element_type = None
        self.activation = spec.activation
        self.kernel = nnx.data(None)
        self.bias = nnx.data(None)
        self._lazy = (spec, source, index)

    @property
    def built(self) -> bool:
        return self.in_features is not None

    def _build(self, in_features: int) -> None:
        spec, source, index = self._lazy
        spec = spec.with_in_features(in_features)
        kernel, bias, mask = dense_arrays(source.for_layer(index, spec), spec.dtype)
        self.kernel = nnx.Param(kernel)
        if bias is not None:
            self.bias = nnx.Param(bias)
        if mask is not None:
            self.mask = Mask(mask)
        self.in_features = in_features
        self._lazy = None  # drop the source: it may hold every layer's params
        remember_spec(self, spec)

    def __call__(self, x):
        if not self.built:
            x = jnp.asarray(x)
            if x.ndim == 0:
                raise SpecError(f"x must have shape (*, in_features). Received: x of shape {tuple(x.shape)}")
            if isinstance(x, jax.core.Tracer):
                raise SpecError("this lazy Flax layer has no parameters yet and was first called under a JAX "
                                "transform (jit/grad/vmap), where new parameters cannot be created: call it "
                                "once eagerly on an input (or give in_features). Received: a traced x of "
                                f"shape {tuple(x.shape)}")
            self._build(int(x.shape[-1]))
        return super().__call__(x)


class Bilinear(nnx.Module):
    """y_k = x1^T kernel_k x2 + bias_k; kernel (units, in1, in2) (the canonical layout), bias (units,).

    Flax has no bilinear layer; this is dense_bridge's ``db.Bilinear`` there. Called as
    ``layer(x1, x2)`` with inputs of any matching leading shape.
    """

    def __init__(self, kernel, bias) -> None:
        self.out_features, self.in1_features, self.in2_features = (int(s) for s in kernel.shape)
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(bias) if bias is not None else nnx.data(None)

    def __call__(self, x1, x2):
        kernel = self.kernel[...]
        x1, x2 = jnp.asarray(x1).astype(kernel.dtype), jnp.asarray(x2).astype(kernel.dtype)
        if x1.shape[-1] != self.in1_features or x2.shape[-1] != self.in2_features:
            raise SpecError(f"x1, x2 must have shapes (*, {self.in1_features}) and (*, {self.in2_features}). "
                            f"Received: x1 of shape {tuple(x1.shape)}, x2 of shape {tuple(x2.shape)}")
        y = jnp.einsum("...j,kij->...ki", x2, kernel)
        y = jnp.einsum("...ki,...i->...k", y, x1)
        return y if self.bias is None else y + self.bias[...]


class Identity(nnx.Module):
    """y = x (Flax has no Identity module)."""

    def __call__(self, x):
        return x


class Flatten(nnx.Module):
    """Every axis after the first flattened: (batch, d1, ..., dn) -> (batch, d1*...*dn)."""

    def __call__(self, x):
        x = jnp.asarray(x)
        return x.reshape(x.shape[0], -1) if x.ndim > 2 else x


def dense_arrays(params: dict, dtype: str) -> tuple:
    """(kernel, bias, mask) JAX arrays from canonical params (numpy, or another framework's device
    arrays: copied on their device); masked kernel entries stored as 0."""
    kernel = to_jax(params["kernel"], dtype)
    mask = to_jax(params["mask"], dtype) if "mask" in params else None
    if mask is not None:
        kernel = kernel * mask  # exact: the mask is 0/1
    return kernel, to_jax(params["bias"], dtype) if "bias" in params else None, mask


def _compile_dense(spec: Dense, source: ParamSource, index: int):
    check_dtype(spec.dtype)
    if spec.lazy:
        layer = LazyDenseLinear(spec, source, index)
    else:
        kernel, bias, mask = dense_arrays(source.for_layer(index, spec), spec.dtype)
        if spec.activation.is_identity and mask is None:
            dt = jnp.dtype(spec.dtype)
            layer = nnx.Linear(spec.in_features, spec.units, use_bias=spec.use_bias, dtype=dt, param_dtype=dt,
                               kernel_init=_const(kernel), bias_init=_const(bias), rngs=_NoRngs())
        else:
            layer = DenseLinear(kernel, bias, mask, spec.activation, spec.dtype)
    remember_spec(layer, spec)
    return layer


def _compile_bilinear(spec: BilinearSpec, source: ParamSource, index: int):
    check_dtype(spec.dtype)
    params = source.for_layer(index, spec)
    layer = Bilinear(to_jax(params["kernel"], spec.dtype),
                     to_jax(params["bias"], spec.dtype) if "bias" in params else None)
    remember_spec(layer, spec)
    return layer


def _compile_layer(spec, source: ParamSource, index: int):
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, BilinearSpec):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, IdentitySpec):
        layer = Flatten() if isinstance(spec, FlattenSpec) else Identity()
        remember_spec(layer, spec)
        return layer
    if isinstance(spec, Activation):
        fn = activation_fn(spec)
        return identity if fn is None else fn
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def compile(spec, source: ParamSource):
    """The ``flax.nnx`` module for ``spec`` with parameters from ``source`` (see the module docstring)."""
    if isinstance(spec, Sequential):
        model = nnx.Sequential(*[_compile_layer(layer, source, i) for i, layer in enumerate(spec.layers)])
        remember_spec(model, spec)
        return model
    return _compile_layer(spec, source, 0)


def is_dense(m) -> bool:
    return type(m) is nnx.Linear or isinstance(m, DenseLinear)
