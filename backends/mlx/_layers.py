"""The MLX layer classes and ``compile``: specs to ``mlx.nn`` modules, parameters from a ParamSource.

What compile builds, how masks stay frozen and why compiling never draws from MLX's random
state: see the package docstring (``backends/mlx/__init__.py``).
Each compiled layer keeps its spec with the core's ``remember_spec`` (names and initializers MLX
cannot hold).
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dense_bridge._errors import SpecError, received
from dense_bridge.models._layouts import declared
from dense_bridge.params._source import ParamSource
from dense_bridge.registry._remembered_spec import remember_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Identity, Sequential
from dense_bridge.specs import Flatten as FlattenSpec

from ._activations import activation_fn, activation_module
from ._arrays import check_dtype, to_mx



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
    MLX arrays are immutable: every change of a parameter (optimizers, ``update``,
    ``load_weights``, ``db.set_params``) puts a new array in its place. So the masked weight of the
    last call is reused while the weight and mask are the very same arrays (held by the cache,
    so their ids cannot be reused): inference costs what an unmasked layer's does, for one extra
    weight-sized array. Under ``nn.value_and_grad`` the parameters are new arrays at every call,
    so the product is made afresh (and is part of the graph).
    """

    def __init__(self, weight: mx.array | None, bias: mx.array | None, mask: mx.array | None,
                 activation: Activation) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: its random draws would be discarded
        self._no_grad = _FrozenKeys(self._no_grad)
        self._activation = activation
        self._act = None if activation.is_identity else activation_fn(activation)
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

    def _masked_weight(self) -> mx.array:
        weight, mask = self["weight"], self["mask"]
        cache = self.__dict__.get("_masked_cache")
        if cache is not None and cache[0] is weight and cache[1] is mask:
            return cache[2]
        masked = weight * mask
        # object.__setattr__: MLX's Module.__setattr__ would make a tuple of arrays a parameter
        object.__setattr__(self, "_masked_cache", (weight, mask, masked))
        return masked

    def __call__(self, x: mx.array) -> mx.array:
        self._check_input(x)
        w = self._masked_weight() if "mask" in self else self["weight"]
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
    weight = to_mx(np.asarray(kernel).T, dtype)
    bias = to_mx(params["bias"], dtype) if "bias" in params else None
    mask = to_mx(np.asarray(params["mask"]).T, dtype) if "mask" in params else None
    return weight, bias, mask


def _bare(cls):
    """An instance of an mlx.nn class without its __init__ (no draws from MLX's random state)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    return module


def _compile_dense(spec: Dense, source: ParamSource, index: int) -> nn.Module:
    check_dtype(spec.dtype)
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
    remember_spec(layer, spec)
    return layer


def _compile_bilinear(spec: Bilinear, source: ParamSource, index: int) -> nn.Module:
    check_dtype(spec.dtype)
    params = source.for_layer(index, spec)
    layer = _bare(nn.Bilinear)
    # MLX's weight is (units, in2, in1): swap the canonical (units, in1, in2) axes 1 and 2
    layer.weight = to_mx(np.asarray(params["kernel"]).transpose(0, 2, 1), spec.dtype)
    if "bias" in params:
        layer.bias = to_mx(params["bias"], spec.dtype)
    remember_spec(layer, spec)
    return layer


class Flatten(nn.Module):
    """Every axis after the first flattened: (batch, d1, ..., dn) -> (batch, d1*...*dn).

    MLX has no Flatten module (mlx.nn 0.32); this is dense_bridge's ``db.Flatten()`` there.
    """

    def __call__(self, x: mx.array) -> mx.array:
        return x.reshape(x.shape[0], -1) if x.ndim > 2 else x


def _compile_layer(spec, source: ParamSource, index: int):
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, Bilinear):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, Identity):
        layer = Flatten() if isinstance(spec, FlattenSpec) else nn.Identity()
        remember_spec(layer, spec)
        return layer
    if isinstance(spec, Activation):
        return activation_module(spec)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def compile(spec, source: ParamSource):
    """The mlx.nn module for ``spec`` with parameters from ``source`` (see the module docstring)."""
    if isinstance(spec, Sequential):
        model = nn.Sequential(*[_compile_layer(layer, source, i) for i, layer in enumerate(spec.layers)])
        remember_spec(model, spec)
        return model
    return _compile_layer(spec, source, 0)


def is_dense(m) -> bool:
    return type(m) is nn.Linear or isinstance(m, DenseLinear)


def declared_arrays(m) -> tuple | None:
    """(kernel name, bias name or None, stored transposed?) of a class declared with
    db.register_layout, or None for every other module."""
    decl = declared(m)
    if decl is None or not isinstance(m, nn.Module):
        return None
    bias = decl.bias if decl.bias and decl.bias in m else None
    return decl.kernel, bias, decl.transposed
