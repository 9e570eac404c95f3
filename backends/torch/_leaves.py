"""Reading one torch module as a layer spec: the Linear family, Bilinear, Identity, Dropout and
activation modules (what a chain position can hold).
"""
from __future__ import annotations

from torch import nn

from dense_bridge._errors import ConversionError
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Identity

from ._activations import _module_activation
from ._layers import _META, DenseLinear, LazyDense
from ._tensors import _dtype_name


def _describe(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


_LINEAR_TYPES = (nn.Linear, DenseLinear, nn.LazyLinear, LazyDense)


def _has_params(m: nn.Module | None) -> bool:
    """Is ``m`` a layer whose parameters dense_bridge reads (Linear family or Bilinear)?"""
    return m is not None and type(m) in _LINEAR_TYPES + (nn.Bilinear,)


def _dense_spec(m: nn.Module, where: str) -> Dense:
    lazy = isinstance(m, nn.LazyLinear) and m.has_uninitialized_params()
    act = getattr(m, "activation", None)
    activation = Activation("linear") if act is None or type(act) is nn.Identity else \
        _module_activation(act, f"{where}.activation")
    if activation is None:
        raise ConversionError(f"{where}.activation is {_describe(act)}, not a known activation module")
    mask = getattr(m, "mask", None)
    meta = getattr(m, _META, None) or {}
    return Dense(
        m.out_features, in_features=None if lazy else m.in_features, use_bias=m.bias is not None,
        # read as bool: the mask is 0/1 in the layer dtype, and Wiring takes no bfloat16
        activation=activation, mask=None if mask is None else (mask.detach().cpu() != 0).numpy().T,
        # a hand-built nn.Linear was initialised with torch's U(+-1/sqrt(in)) for both
        kernel_init=meta.get("kernel_init", "torch_default"), bias_init=meta.get("bias_init", "torch_default"),
        dtype=_dtype_name(m.weight.dtype, where), name=meta.get("name"))


def _leaf_spec(m: nn.Module, where: str):
    """The spec of a single module, or None when ``m`` is not one dense_bridge knows as a layer."""
    kind = type(m)
    if kind in _LINEAR_TYPES:
        return _dense_spec(m, where)
    if kind is nn.Bilinear:
        meta = getattr(m, _META, None) or {}
        return Bilinear(m.in1_features, m.in2_features, m.out_features, use_bias=m.bias is not None,
                        init=meta.get("init", "torch_default"), dtype=_dtype_name(m.weight.dtype, where),
                        name=meta.get("name"))
    if kind is nn.Identity:
        return Identity(name=(getattr(m, _META, None) or {}).get("name"))
    if kind in (nn.Dropout, nn.AlphaDropout):
        return Identity()  # dropout's eval-mode function; training-time dropout is not carried over
    return _module_activation(m, where)
