"""torch ``nn.Linear`` holding a torchao weight-only quantized weight, in dense_bridge's canonical
quantized form (``dense_bridge/quant.py``).

torchao (0.18) replaces ``linear.weight`` by a tensor subclass: ``Int8Tensor``
(``Int8WeightOnlyConfig``: int8 codes per output row) or ``IntxUnpackedToInt8Tensor``
(``IntxWeightOnlyConfig``: 1..8-bit codes, one int8 each, groups along in_features). Both keep
``qdata`` (units, in) int8, ``scale`` and ``zero_point`` (units, G), and dequantize as
f((q - zero) * scale) (``dequantize_affine``): scheme "zero_point", signed codes. Weights with
activation quantization, and other torchao tensors (int4 with its kernel packages, float8),
are refused by name. torchao is imported only once a model holds its tensors.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from dense_bridge._errors import ConversionError
from dense_bridge.quant import Candidate, Quant
from dense_bridge.specs import Dense

from ._arrays import dtype_name, to_numpy

_BITS = {getattr(torch, f"int{b}"): b for b in range(1, 9) if hasattr(torch, f"int{b}")}


def _torchao_tensor(w: Any) -> bool:
    return type(w).__module__.startswith("torchao.")


def is_quantized(m: nn.Module) -> bool:
    """An nn.Linear whose weight is a torchao tensor subclass."""
    return isinstance(m, nn.Linear) and _torchao_tensor(getattr(m, "weight", None))


def _fresh(a: np.ndarray) -> torch.Tensor:
    """A torch tensor owning a C-contiguous copy of ``a`` (numpy views may be read-only)."""
    return torch.from_numpy(np.array(a, order="C", copy=True))


def _np(t: torch.Tensor) -> np.ndarray:
    return to_numpy(t.detach())


class TorchaoQuantLayer:
    """dense_bridge's handle on an nn.Linear with a torchao weight-only tensor."""

    def __init__(self, m: nn.Module) -> None:
        self.m = m
        w = m.weight
        kind = type(w).__name__
        if kind == "Int8Tensor":
            if getattr(w, "act_quant_kwargs", None) is not None:
                raise ConversionError(f"{kind} with activation quantization (dynamic int8 activations) is not a "
                                      f"weight-only layer; dense_bridge reads torchao weight-only int8 and intx")
            self.bits = 8
        elif kind == "IntxUnpackedToInt8Tensor":
            if getattr(w, "activation_quantization", None) is not None:
                raise ConversionError(f"{kind} with activation_quantization={w.activation_quantization!r} is not "
                                      f"weight-only; dense_bridge reads torchao weight-only int8 and intx")
            self.bits = _BITS[w.target_dtype]
        else:
            raise ConversionError(f"torchao {kind} weights are not read by dense_bridge (it reads weight-only "
                                  f"Int8Tensor and IntxUnpackedToInt8Tensor)")
        self.kind = kind
        self.units, self.in_features = (int(s) for s in w.shape)
        block = tuple(int(b) for b in w.block_size)
        if block[0] != 1 or self.in_features % block[1]:
            raise ConversionError(f"torchao block_size {block} is not a grouping along in_features")
        self.quant = Quant(self.bits, None if block[1] == self.in_features else block[1], "zero_point")
        self.signed = True
        self.has_bias = m.bias is not None
        self.float_name = dtype_name(w.dtype, "weight")
        self.scale_dtype = _np(w.scale).dtype

    def spec(self) -> Dense:
        return Dense(self.units, in_features=self.in_features, use_bias=self.has_bias, kernel_init="torch_default",
                     bias_init="torch_default", dtype=self.float_name)

    def _zero(self, w) -> torch.Tensor:
        z = getattr(w, "zero_point", None)
        return torch.zeros_like(w.scale, dtype=torch.int8) if z is None else z

    def dequantized(self) -> dict[str, np.ndarray]:
        with torch.no_grad():
            out = {"kernel": np.array(_np(self.m.weight.dequantize()).T)}
        if self.has_bias:
            out["bias"] = np.array(_np(self.m.bias))
        return out

    def codes(self) -> dict[str, Any]:
        w = self.m.weight
        out: dict[str, Any] = {"quant": self.quant, "qkernel": np.ascontiguousarray(_np(w.qdata).T),
                               "scale": np.ascontiguousarray(_np(w.scale).reshape(self.units, -1).T),
                               "zero": np.ascontiguousarray(_np(self._zero(w)).reshape(self.units, -1).T)}
        if self.has_bias:
            out["bias"] = np.array(_np(self.m.bias))
        return out

    def _tensor(self, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        w = self.m.weight
        cls = type(w)
        if self.kind == "Int8Tensor":
            return cls(qdata, scale.reshape(w.scale.shape), list(w.block_size), w.dtype,
                       zero_point=zero.reshape(w.scale.shape))
        return cls(qdata, scale.reshape(w.scale.shape), zero.reshape(w.zero_point.shape), w.target_dtype,
                   tuple(w.block_size), w.dtype, None)

    def _candidate(self, tensor, bias: Any) -> Candidate:
        with torch.no_grad():
            kernel = np.array(_np(tensor.dequantize()).T)
        new_bias = None
        if self.has_bias:
            new_bias = _fresh(np.asarray(bias)).to(self.m.bias.dtype)

        def write():
            before_w, before_b = self.m.weight, self.m.bias
            self.m.weight = nn.Parameter(tensor, requires_grad=False)
            if new_bias is not None:
                self.m.bias = nn.Parameter(new_bias, requires_grad=before_b.requires_grad)

            def undo():
                self.m.weight = before_w
                if new_bias is not None:
                    self.m.bias = before_b
            return undo

        return Candidate(kernel, write)

    def encode(self, qp: dict) -> Candidate:
        sd = self.m.weight.scale.dtype
        tensor = self._tensor(_fresh(np.asarray(qp["qkernel"]).astype(np.int8).T),
                              _fresh(np.asarray(qp["scale"]).T).to(sd),
                              _fresh(np.asarray(qp["zero"]).astype(np.int8).T))
        return self._candidate(tensor, qp.get("bias"))

    def _config(self):
        """The torchao config that made this weight (symmetric unless a zero point is not 0)."""
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerAxis, PerGroup
        from torchao.quantization.quant_primitives import MappingType

        if self.kind == "Int8Tensor":
            return Int8WeightOnlyConfig()
        w = self.m.weight
        symmetric = not bool(torch.any(self._zero(w) != 0))
        granularity = PerAxis(0) if self.quant.group_size is None else PerGroup(self.quant.group_size)
        return IntxWeightOnlyConfig(weight_dtype=w.target_dtype, granularity=granularity,
                                    mapping_type=MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC)

    def quantize(self, kernel: np.ndarray, bias: Any = None) -> Candidate:
        from torchao.quantization import quantize_

        tmp = nn.Linear(self.in_features, self.units, bias=False, dtype=self.m.weight.dtype)
        with torch.no_grad():
            tmp.weight.copy_(_fresh(np.asarray(kernel).T))
        quantize_(tmp, self._config())
        return self._candidate(tmp.weight.data if isinstance(tmp.weight, nn.Parameter) else tmp.weight, bias)


def quant_layer(m: Any) -> TorchaoQuantLayer | None:
    """The handle on an nn.Linear with a torchao weight; None for anything else."""
    if "torchao" not in sys.modules or not is_quantized(m):
        return None
    return TorchaoQuantLayer(m)


def quant_build(layer: nn.Module, quant: Quant) -> nn.Module:
    """``layer`` (a float nn.Linear) quantized in place by torchao's ``quantize_`` as a
    weight-only intx tensor with ``quant``'s bits and groups (asymmetric: zero points free)."""
    if quant.scheme != "zero_point":
        raise ConversionError(f"torchao weight-only layers dequantize as (q - zero) * scale (scheme 'zero_point'), "
                              f"not {quant.scheme!r}. Received: quant={quant!r}")
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    granularity = PerAxis(0) if quant.group_size is None else PerGroup(quant.group_size)
    try:
        quantize_(layer, IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{quant.bits}"), granularity=granularity,
                                              mapping_type=MappingType.ASYMMETRIC))
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise ConversionError(f"torchao cannot quantize this layer as {quant!r}: {exc}") from None
    return layer

