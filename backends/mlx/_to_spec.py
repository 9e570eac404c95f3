"""Reading live MLX modules back into specs: ``to_spec`` for a layer or a flat ``nn.Sequential``.

Structure comes from the module itself (shapes, dtypes, the mask, the activation); names and
initializers, which MLX cannot hold, come from the spec ``compile`` stored on it, if any.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dense_bridge._errors import ConversionError, SpecError
from dense_bridge.models._layouts import warn_dropout
from dense_bridge.registry._remembered_spec import remembered_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Identity, Sequential
from dense_bridge.specs import Flatten as FlattenSpec
from dense_bridge.wiring import Wiring

from ._activations import activation_of_function, activation_of_module, conversion_error
from ._arrays import dtype_name, to_numpy
from ._layers import DenseLinear, Flatten, LazyDenseLinear, declared_arrays, is_dense
from ._quant import quant_layer


def _stored(m, cls):
    return remembered_spec(m, cls)


def _dense_spec(m, where: str) -> Dense:
    if isinstance(m, LazyDenseLinear) and not m.built:
        return m._spec
    weight = m["weight"]
    if weight.ndim != 2:
        raise conversion_error(where, m, f"has a weight of shape {tuple(weight.shape)}, not (units, in)")
    units, in_features = (int(s) for s in weight.shape)
    stored = _stored(m, Dense)
    mask = None
    if "mask" in m:
        mx.eval(m["mask"])
        adjacency = to_numpy(m["mask"]).T != 0
        kind = stored.mask.kind if stored is not None and stored.mask is not None and \
            np.array_equal(stored.mask.adjacency, adjacency) else "custom"
        mask = Wiring(adjacency, kind=kind, allow_empty_outputs=True)
    activation = m.activation if isinstance(m, DenseLinear) else Activation("linear")
    return Dense(units, in_features=in_features, use_bias="bias" in m, activation=activation,
                 kernel_init=stored.kernel_init if stored else "mlx_default",
                 bias_init=stored.bias_init if stored else "mlx_default",
                 mask=mask, dtype=dtype_name(weight.dtype, f"{where}.weight"),
                 name=stored.name if stored else None)


def _bilinear_spec(m, where: str) -> Bilinear:
    units, in2, in1 = (int(s) for s in m["weight"].shape)
    stored = _stored(m, Bilinear)
    return Bilinear(in1, in2, units, use_bias="bias" in m,
                    init=stored.init if stored else "mlx_default",
                    dtype=dtype_name(m["weight"].dtype, f"{where}.weight"), name=stored.name if stored else None)


def layer_spec(m, where: str):
    """The spec of one MLX module (``where`` names it in errors)."""
    quantized = quant_layer(m)
    if quantized is not None:  # the float Dense a QuantizedLinear stands for
        return quantized.spec()
    decl = declared_arrays(m)
    if decl is not None:  # a third-party class declared with db.register_layout
        kernel = m[decl[0]]
        units, in_features = (int(s) for s in (kernel.shape if decl[2] else kernel.shape[::-1]))
        if decl[1] is not None and tuple(m[decl[1]].shape) != (units,):
            raise SpecError(f"{where}: its layout declaration names the bias {decl[1]!r} of shape "
                            f"{tuple(m[decl[1]].shape)}, but the kernel {decl[0]!r} of shape {tuple(kernel.shape)} "
                            f"has {units} units")
        return Dense(units, in_features=in_features, use_bias=decl[1] is not None, kernel_init="mlx_default",
                     bias_init="mlx_default", dtype=dtype_name(kernel.dtype, f"{where}.{decl[0]}"))
    if is_dense(m):
        return _dense_spec(m, where)
    if type(m) is nn.Bilinear:
        return _bilinear_spec(m, where)
    if type(m) is Flatten:
        stored = _stored(m, FlattenSpec)
        return FlattenSpec(name=stored.name if stored else None)
    if type(m) is nn.Dropout:  # the identity at inference, as torch's and Keras' Dropout are read
        warn_dropout(f"{where} (mlx.nn.Dropout)", 1.0 - m._p_1)
        return Identity()
    if type(m) is nn.Identity:
        stored = _stored(m, Identity)
        return Identity(name=stored.name if stored else None)
    if isinstance(m, nn.Linear):
        raise conversion_error(where, m, "subclasses nn.Linear with a forward dense_bridge cannot read")
    if isinstance(m, nn.Module):
        return activation_of_module(m, where)
    if callable(m):
        return activation_of_function(m, where)
    raise conversion_error(where, m, "is not an MLX module or activation function")


def to_spec(native):
    """The spec of an MLX layer or nn.Sequential, structure read from the live module."""
    return chain_spec(native, layer_spec)


def chain_spec(native, read_layer):
    """The spec of a layer or flat ``nn.Sequential``, each module read by ``read_layer(m, where)``."""
    if type(native) is not nn.Sequential:
        return read_layer(native, "native")
    layers = []
    for i, m in enumerate(native.layers):
        where = f"native.layers[{i}]"
        if isinstance(m, nn.Sequential):
            raise conversion_error(where, m, "is a nested nn.Sequential; flatten it (parameter keys are "
                                    "positions in one Sequential)")
        if type(m) is nn.Bilinear:
            raise conversion_error(where, m, "takes two inputs and cannot sit in a Sequential chain")
        layers.append(read_layer(m, where))
    stored = _stored(native, Sequential)
    has_dense = any(isinstance(l, Dense) for l in layers)
    try:
        return Sequential(layers, in_features=None if has_dense or stored is None else stored.in_features,
                          name=stored.name if stored else None)
    except SpecError as exc:
        raise ConversionError(f"native (mlx.nn.Sequential) does not chain: {exc}") from None
