"""The ``compile`` and ``owns`` verbs: a spec -> the torch module, parameters adopted from
``ParamSource`` without another copy.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

from dense_bridge._errors import received
from dense_bridge._params import ParamSource
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Identity, Sequential

from ._activations import _activation_module
from ._layers import _META, DenseLinear, LazyDense
from ._tensors import _TORCH_DTYPES, _from_numpy


def _adopt(module: nn.Module, arrays: dict[str, np.ndarray], parameters: dict[str, str],
           buffers: dict[str, str]) -> None:
    """Give a meta-device module real tensors made from fresh arrays (no copy).

    The arrays come from ``ParamSource.native_layer``: new memory in torch's layout that no
    one else references, so torch owning it through ``torch.from_numpy`` is safe. It is also
    the fast path: huge pages and a 64-byte start, which torch.empty (4 KiB pages) lacks.
    """
    for key, name in parameters.items():
        if key in arrays:
            setattr(module, name, nn.Parameter(_from_numpy(arrays[key])))
    for key, name in buffers.items():
        if key in arrays:
            setattr(module, name, _from_numpy(arrays[key]))


def _compile_dense(spec: Dense, source: ParamSource, index: int) -> nn.Module:
    dtype = _TORCH_DTYPES[spec.dtype]
    act = None if spec.activation.name == "linear" else _activation_module(spec.activation)
    if spec.lazy:
        # given params fix the width (ParamSource fills it), so a lazy layer always draws from the seed
        init = {"spec": spec.to_config(), "seed": source.seed, "index": index}
        module = LazyDense(spec.units, spec.use_bias, activation=act, init=init, dtype=dtype)
    else:
        # fresh memory already in torch's layout: weight (out, in) = kernel.T, mask like the weight
        params = source.native_layer(index, spec, {"kernel": (1, 0), "mask": (1, 0)})
        shape = (spec.units, spec.in_features)
        # Built on the meta device: torch's own init would be overwritten at once (skip_init).
        if act is None and spec.mask is None:
            module = nn.Linear(spec.in_features, spec.units, spec.use_bias, device="meta", dtype=dtype)
        else:
            mask = None if spec.mask is None else torch.empty(shape, device="meta", dtype=dtype)
            module = DenseLinear(spec.in_features, spec.units, spec.use_bias, activation=act, mask=mask,
                                 device="meta", dtype=dtype)
        _adopt(module, params, {"kernel": "weight", "bias": "bias"}, {"mask": "mask"})
    setattr(module, _META, {"kernel_init": spec.kernel_init.to_config(),
                            "bias_init": spec.bias_init.to_config(), "name": spec.name})
    return module


def _compile_bilinear(spec: Bilinear, source: ParamSource, index: int) -> nn.Bilinear:
    params = source.native_layer(index, spec)  # (out, in1, in2) is the canonical layout
    module = nn.Bilinear(spec.in1_features, spec.in2_features, spec.units, spec.use_bias, device="meta",
                         dtype=_TORCH_DTYPES[spec.dtype])
    _adopt(module, params, {"kernel": "weight", "bias": "bias"}, {})
    setattr(module, _META, {"init": spec.init.to_config(), "name": spec.name})
    return module


def _compile_layer(spec, source: ParamSource, index: int) -> nn.Module:
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, Bilinear):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, Identity):
        module = nn.Identity()
        setattr(module, _META, {"name": spec.name})
        return module
    if isinstance(spec, Activation):
        return _activation_module(spec)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def _is_keras(obj) -> bool:
    """Is ``obj`` a Keras object? Without importing keras: one that exists has been imported."""
    if (getattr(type(obj), "__module__", None) or "").split(".")[0] == "keras":
        return True
    keras = sys.modules.get("keras")
    layer = getattr(getattr(keras, "layers", None), "Layer", None)
    return isinstance(layer, type) and isinstance(obj, layer)


def owns(obj) -> bool:
    """Is ``obj`` a torch module (not a Keras layer, which is one under KERAS_BACKEND=torch)."""
    return isinstance(obj, nn.Module) and not _is_keras(obj)


def compile(spec, source: ParamSource) -> nn.Module:
    """The torch module for ``spec``, with parameters from ``source`` copied into torch memory."""
    if isinstance(spec, Sequential):
        module = nn.Sequential(*[_compile_layer(l, source, i) for i, l in enumerate(spec.layers)])
        setattr(module, _META, {"name": spec.name, "in_features": spec.in_features})
        return module
    return _compile_layer(spec, source, 0)
