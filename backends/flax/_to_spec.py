"""Reading live Flax NNX modules back into specs: ``to_spec`` for a layer or a flat ``nnx.Sequential``.

Structure comes from the module itself (shapes, dtypes, the mask, the activation); names and
initializers, which Flax cannot hold, come from the spec ``compile`` stored on it, if any.
Activations in an ``nnx.Sequential`` are ``jax.nn`` callables, read with jax.nn's own defaults
(a bare ``jax.nn.gelu`` is ``gelu_tanh``, ``jax.nn.leaky_relu`` has slope 0.01).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dense_bridge._errors import ConversionError, SpecError
from dense_bridge.models._layouts import warn_dropout
from dense_bridge.registry._remembered_spec import remembered_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear as BilinearSpec
from dense_bridge.specs import Dense, Identity as IdentitySpec, Sequential
from dense_bridge.specs import Flatten as FlattenSpec
from dense_bridge.wiring import Wiring

from ._activations import activation_of_function, conversion_error
from ._arrays import dtype_name, to_numpy
from ._layers import Bilinear, DenseLinear, Flatten, Identity, LazyDenseLinear, Mask, is_dense


def _dense_spec(m, where: str) -> Dense:
    if isinstance(m, LazyDenseLinear) and not m.built:
        return m._lazy[0]
    kernel = m.kernel.get_value()
    if kernel.ndim != 2:
        raise conversion_error(where, m, f"has a kernel of shape {tuple(kernel.shape)}, not (in, units)")
    dtype = dtype_name(kernel.dtype, f"{where}.kernel")
    if m.dtype is not None and jnp.dtype(m.dtype) != kernel.dtype:
        raise conversion_error(where, m, f"computes in {jnp.dtype(m.dtype)} with {dtype} parameters (mixed "
                               "precision), which a Dense spec cannot describe")
    if m.dot_general is not jax.lax.dot_general or getattr(m, "preferred_element_type", None) is not None:
        raise conversion_error(where, m, "uses a custom dot_general or preferred_element_type (quantized or "
                               "mixed-precision matmul), which a Dense spec cannot describe")
    in_features, units = (int(s) for s in kernel.shape)
    stored = remembered_spec(m, Dense)
    mask = None
    if isinstance(getattr(m, "mask", None), Mask):
        adjacency = np.asarray(to_numpy(m.mask)) != 0
        kind = stored.mask.kind if stored is not None and stored.mask is not None and \
            np.array_equal(stored.mask.adjacency, adjacency) else "custom"
        mask = Wiring(adjacency, kind=kind, allow_empty_outputs=True)
    activation = m.activation if isinstance(m, DenseLinear) else Activation("linear")
    # nnx.Linear's defaults: lecun_normal kernel, zeros bias
    return Dense(units, in_features=in_features, use_bias=m.bias is not None, activation=activation,
                 kernel_init=stored.kernel_init if stored else "lecun_normal",
                 bias_init=stored.bias_init if stored else "zeros",
                 mask=mask, dtype=dtype, name=stored.name if stored else None)


def _bilinear_spec(m, where: str) -> BilinearSpec:
    kernel = m.kernel.get_value()
    units, in1, in2 = (int(s) for s in kernel.shape)
    stored = remembered_spec(m, BilinearSpec)
    return BilinearSpec(in1, in2, units, use_bias=m.bias is not None,
                        init=stored.init if stored else "torch_default",
                        dtype=dtype_name(kernel.dtype, f"{where}.kernel"), name=stored.name if stored else None)


def _layer_spec(m, where: str):
    if is_dense(m):
        return _dense_spec(m, where)
    if type(m) is Bilinear:
        return _bilinear_spec(m, where)
    if type(m) is Flatten:
        stored = remembered_spec(m, FlattenSpec)
        return FlattenSpec(name=stored.name if stored else None)
    if type(m) is Identity:
        stored = remembered_spec(m, IdentitySpec)
        return IdentitySpec(name=stored.name if stored else None)
    if type(m) is nnx.Dropout:  # the identity at inference, as torch's, Keras' and MLX's Dropout are read
        warn_dropout(f"{where} (flax.nnx.Dropout)", m.rate)
        return IdentitySpec()
    if isinstance(m, nnx.Linear):
        raise conversion_error(where, m, "subclasses nnx.Linear with a forward dense_bridge cannot read")
    if isinstance(m, nnx.Module):
        raise conversion_error(where, m, "is not a layer dense_bridge can describe (nnx.Linear, nnx.Sequential, "
                               "dense_bridge's Flax layers)")
    if callable(m):
        return activation_of_function(m, where)
    raise conversion_error(where, m, "is not a Flax module or a jax.nn function")


def to_spec(native):
    """The spec of a Flax NNX layer or ``nnx.Sequential``, structure read from the live module."""
    if type(native) is not nnx.Sequential:
        return _layer_spec(native, "native")
    layers = []
    for i, m in enumerate(native.layers):
        where = f"native.layers[{i}]"
        if isinstance(m, nnx.Sequential):
            raise conversion_error(where, m, "is a nested nnx.Sequential; flatten it (parameter keys are "
                                   "positions in one Sequential)")
        if type(m) is Bilinear:
            raise conversion_error(where, m, "takes two inputs and cannot sit in a Sequential chain")
        layers.append(_layer_spec(m, where))
    stored = remembered_spec(native, Sequential)
    has_dense = any(isinstance(l, Dense) for l in layers)
    try:
        return Sequential(layers, in_features=None if has_dense or stored is None else stored.in_features,
                          name=stored.name if stored else None)
    except SpecError as exc:
        raise ConversionError(f"native (flax.nnx.Sequential) does not chain: {exc}") from None
