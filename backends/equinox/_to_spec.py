"""Reading live Equinox modules back into specs: ``to_spec`` for a layer, ``eqx.nn.Sequential`` or ``eqx.nn.MLP``.

Structure comes from the module itself (shapes, dtypes, the mask, the activation); names and
initializers, which Equinox cannot hold, come from the spec ``compile`` stored on it, if any
(Equinox's own tree operations make new modules without it: then ``eqx.nn.Linear``'s own
initialiser, U(+-1/sqrt(in)) for weight and bias, is reported).
Activations are ``eqx.nn.Lambda(jax.nn function)`` in a Sequential and plain functions in an MLP,
read with jax.nn's own defaults (a bare ``jax.nn.gelu`` is ``gelu_tanh``).

``eqx.nn.MLP`` applies its activation neuron by neuron (``vmap`` over the width): elementwise
activations are the same function, softmax/log_softmax are not (softmax of one number is 1), so
those raise a ConversionError. ``scan=True`` MLPs stack their hidden layers: not read.
"""
from __future__ import annotations

import equinox as eqx
import numpy as np

from dense_bridge._errors import ConversionError, SpecError
from dense_bridge.models._layouts import warn_dropout
from dense_bridge.registry._remembered_spec import remembered_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear as BilinearSpec
from dense_bridge.specs import Dense, Identity as IdentitySpec, Sequential
from dense_bridge.specs import Flatten as FlattenSpec
from dense_bridge.wiring import Wiring

from ._activations import activation_of_function, conversion_error
from ._arrays import dtype_name
from ._layers import Bilinear, DenseLinear, Flatten, is_dense, is_identity_fn


def _dense_spec(m, where: str) -> Dense:
    if m.in_features == "scalar" or m.out_features == "scalar":
        raise conversion_error(where, m, "takes or returns a scalar (in_features/out_features='scalar'), "
                               "which a Dense spec cannot describe")
    weight = m.weight
    units, in_features = (int(s) for s in weight.shape)
    stored = remembered_spec(m, Dense)
    mask = None
    if isinstance(m, DenseLinear) and m.mask is not None:
        adjacency = np.asarray(m.mask).T != 0
        kind = stored.mask.kind if stored is not None and stored.mask is not None and \
            np.array_equal(stored.mask.adjacency, adjacency) else "custom"
        mask = Wiring(adjacency, kind=kind, allow_empty_outputs=True)
    activation = m.activation if isinstance(m, DenseLinear) else Activation("linear")
    return Dense(units, in_features=in_features, use_bias=m.bias is not None, activation=activation,
                 kernel_init=stored.kernel_init if stored else "torch_default",
                 bias_init=stored.bias_init if stored else "torch_default",
                 mask=mask, dtype=dtype_name(weight.dtype, f"{where}.weight"), name=stored.name if stored else None)


def _bilinear_spec(m, where: str) -> BilinearSpec:
    units, in1, in2 = (int(s) for s in m.weight.shape)
    stored = remembered_spec(m, BilinearSpec)
    return BilinearSpec(in1, in2, units, use_bias=m.bias is not None,
                        init=stored.init if stored else "torch_default",
                        dtype=dtype_name(m.weight.dtype, f"{where}.weight"), name=stored.name if stored else None)


def _layer_spec(m, where: str):
    if is_dense(m):
        return _dense_spec(m, where)
    if type(m) is Bilinear:
        return _bilinear_spec(m, where)
    if type(m) is Flatten:
        stored = remembered_spec(m, FlattenSpec)
        return FlattenSpec(name=stored.name if stored else None)
    if type(m) is eqx.nn.Identity:
        stored = remembered_spec(m, IdentitySpec)
        return IdentitySpec(name=stored.name if stored else None)
    if type(m) is eqx.nn.Dropout:  # the identity at inference, as every other backend's Dropout is read
        warn_dropout(f"{where} (equinox.nn.Dropout)", m.p)
        return IdentitySpec()
    if type(m) is eqx.nn.Lambda:
        return activation_of_function(m.fn, f"{where}.fn")
    if isinstance(m, eqx.Module):
        raise conversion_error(where, m, "is not a layer dense_bridge can describe (eqx.nn.Linear, "
                               "eqx.nn.Sequential, eqx.nn.MLP, dense_bridge's Equinox layers)")
    if callable(m):
        if is_identity_fn(m):
            return Activation("linear")
        return activation_of_function(m, where)
    raise conversion_error(where, m, "is not an Equinox module or a jax.nn function")


def _mlp_activation(fn, where: str, mlp) -> Activation:
    act = Activation("linear") if is_identity_fn(fn) else _layer_spec(fn, where)
    if not isinstance(act, Activation):
        raise conversion_error(where, mlp, "has an activation that is a layer, not a function")
    if act.name in ("softmax", "log_softmax"):
        raise conversion_error(where, mlp, f"applies {act.name} one neuron at a time (eqx.nn.MLP vmaps its "
                               "activations over the width), which is not the canonical softmax")
    return act


def _mlp_spec(mlp) -> Sequential:
    if mlp.scan:
        raise conversion_error("native", mlp, "stacks its hidden layers for a scan (scan=True); make it "
                               "with scan=False to read it")
    layers = []
    for i, linear in enumerate(mlp.layers):
        layers.append(_dense_spec(linear, f"native.layers[{i}]"))
        if i < len(mlp.layers) - 1:
            layers.append(_mlp_activation(mlp.activation, "native.activation", mlp))
    if not is_identity_fn(mlp.final_activation):
        layers.append(_mlp_activation(mlp.final_activation, "native.final_activation", mlp))
    return Sequential(layers)


def to_spec(native):
    """The spec of an Equinox layer, ``eqx.nn.Sequential`` or ``eqx.nn.MLP``, read from the live module."""
    if type(native) is eqx.nn.MLP:
        return _mlp_spec(native)
    if type(native) is not eqx.nn.Sequential:
        return _layer_spec(native, "native")
    layers = []
    for i, m in enumerate(native.layers):
        where = f"native.layers[{i}]"
        if isinstance(m, (eqx.nn.Sequential, eqx.nn.MLP)):
            raise conversion_error(where, m, "is a nested chain; flatten it (parameter keys are positions "
                                   "in one Sequential)")
        if type(m) is Bilinear:
            raise conversion_error(where, m, "takes two inputs and cannot sit in a Sequential chain")
        layers.append(_layer_spec(m, where))
    stored = remembered_spec(native, Sequential)
    has_dense = any(isinstance(l, Dense) for l in layers)
    try:
        return Sequential(layers, in_features=None if has_dense or stored is None else stored.in_features,
                          name=stored.name if stored else None)
    except SpecError as exc:
        raise ConversionError(f"native (equinox.nn.Sequential) does not chain: {exc}") from None
