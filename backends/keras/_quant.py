"""Keras ``Dense``/``EinsumDense`` after ``quantize("int8" | "int4")`` in dense_bridge's canonical
quantized form (``dense_bridge/quant.py``).

Keras 3.15 stores, for a Dense (kernel (in, units)):

- ``"int8"``: ``kernel`` int8 (in, units), ``kernel_scale`` (units,); w = q / scale (a
  division: scheme "divide"). EinsumDense keeps its kernel's einsum shape and a scale in the
  output's shape, read through the layer's einsum plan (``_models.einsum_plan``).
- ``"int4"``: ``kernel`` int8 (in, ceil(units / 2)), two signed 4-bit codes per byte along
  units (``quantizers.pack_int4``); an EinsumDense's kernel reshaped (not transposed) to
  (contracted, free) in kernel axis order first, read where that order is (in..., out...).
  Per-channel (block_size -1): ``kernel_scale`` (units,), w = q / scale. Grouped (block_size B,
  default 128): ``kernel_scale`` and ``kernel_zero`` (G, units), ``g_idx`` (in,) mapping each
  input row to its group; w = (q - zero) * scale (``dequantize_with_sz_map``: scheme
  "zero_point", the arithmetic torchao uses).

Keras' other modes (float8, gptq, awq) are refused by name, and so is an int4 EinsumDense whose
kernel axes are not contracted-first. Keras int8 also quantizes its inputs by default
(``inputs_quantizer``): its forward differs from x @ dequantized kernel by that rounding, which
``compare_models`` accounts for.
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError
from dense_bridge.quant import Candidate, Quant
from dense_bridge.specs import Dense

from ._arrays import assign_array, read_array
from ._models import einsum_plan, set_einsum_params

SUPPORTED = ("int8", "int4")


def is_quantized(layer: Any) -> bool:
    return (getattr(layer, "quantization_mode", None) is not None
            and isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)))


def _quantizers():
    from keras.src.quantizers import quantizers  # Keras' own pack/unpack and group dequantization

    return quantizers


class KerasQuantLayer:
    """dense_bridge's handle on a quantized Keras Dense or EinsumDense."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        mode = layer.quantization_mode
        where = f"layer {layer.name!r} ({type(layer).__name__})"
        if mode not in SUPPORTED:
            raise ConversionError(f"{where} is quantized in Keras' {mode!r} mode; dense_bridge reads the int8 and "
                                  f"int4 modes only")
        self.mode = mode
        self.einsum = type(layer) is keras.layers.EinsumDense
        if self.einsum:
            plan = einsum_plan(layer)
            if isinstance(plan, str):
                raise ConversionError(f"{where} is not a linear map: {plan}")
            # int4 keeps the kernel reshaped, not transposed, to (contracted, free) in kernel axis
            # order: the canonical (in, units) only where that order is already (in..., out...)
            if mode == "int4" and plan.perm != tuple(range(len(plan.perm))):
                raise ConversionError(f"{where}: its int4 kernel is flattened in kernel axis order, which for "
                                      f"equation {layer.equation!r} is not (in_features, units); dense_bridge "
                                      f"reads int4 EinsumDense whose kernel axes are contracted first")
            self.plan = plan
            self.in_features, self.units = plan.in_features, plan.units
        else:
            self.in_features = int(layer._kernel.shape[0])
            self.units = int(layer.units)
        self.block = getattr(layer, "_int4_block_size", None) if mode == "int4" else None
        grouped = mode == "int4" and self.block not in (None, -1)
        if grouped:
            groups = int(layer.kernel_scale.shape[0])
            size = self.in_features // groups
            g_idx = read_array(layer.g_idx)
            if self.in_features % groups or not np.array_equal(g_idx, np.arange(self.in_features) // size):
                raise ConversionError(f"{where}: its int4 groups (g_idx) are not contiguous blocks of equal size "
                                      f"along in_features")
            self.quant = Quant(4, None if groups == 1 else size, "zero_point")
        else:
            self.quant = Quant(8 if mode == "int8" else 4, None, "divide")
        self.signed = True
        self.has_bias = layer.bias is not None
        # int8 layers quantize their inputs by default: the forward multiplies round(x * s) / s
        self.quantizes_inputs = bool(getattr(layer, "inputs_quantizer", None))
        self.float_name = keras.backend.standardize_dtype(layer.variable_dtype)
        self.scale_dtype = numpy_dtype(keras.backend.standardize_dtype(layer.kernel_scale.dtype))

    def effective_input(self, x: np.ndarray) -> np.ndarray:
        """(rows, in_features) -> the input the layer's forward actually multiplies: Keras'
        ``inputs_quantizer`` codes divided by their per-row scale (float64)."""
        if not self.quantizes_inputs:
            return np.asarray(x, dtype=np.float64)
        x32 = np.asarray(x, dtype=numpy_dtype(self.layer.compute_dtype))
        q, s = self.layer.inputs_quantizer(ops.convert_to_tensor(x32), axis=-1)
        return np.asarray(ops.convert_to_numpy(q), dtype=np.float64) / np.asarray(ops.convert_to_numpy(s),
                                                                                    dtype=np.float64)

    def spec(self) -> Dense:
        return Dense(self.units, in_features=self.in_features, use_bias=self.has_bias, kernel_init="glorot_uniform",
                     bias_init="zeros", dtype=self.float_name)

    # -- canonical <-> Keras storage
    def _codes(self) -> np.ndarray:
        raw = read_array(self.layer._kernel)
        if self.einsum and self.mode == "int8":
            return raw.transpose(self.plan.perm).reshape(self.in_features, self.units)
        if self.mode == "int4":
            unpacked = _quantizers().unpack_int4(ops.convert_to_tensor(raw), self.units, axis=-1)
            return np.asarray(ops.convert_to_numpy(unpacked)).astype(np.int8)
        return raw

    def _bias(self) -> np.ndarray:
        if self.einsum:
            b = read_array(self.layer.bias)
            b = b.reshape((1,) * (len(self.plan.out_shape) - b.ndim) + b.shape)
            return np.array(np.broadcast_to(b, self.plan.out_shape).reshape(self.units))
        return np.array(read_array(self.layer.bias))

    def codes(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant": self.quant, "qkernel": np.ascontiguousarray(self._codes())}
        scale = read_array(self.layer.kernel_scale)
        out["scale"] = np.ascontiguousarray(scale.reshape(-1, self.units))
        if self.quant.scheme == "zero_point":
            out["zero"] = np.ascontiguousarray(read_array(self.layer.kernel_zero).reshape(-1, self.units))
        if self.has_bias:
            out["bias"] = self._bias()
        return out

    def _dequantize(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None) -> np.ndarray:
        """Keras' own arithmetic on canonical arrays (elementwise, so the layout does not matter)."""
        compute = self.layer.compute_dtype
        if self.quant.scheme == "divide":
            w = ops.divide(ops.cast(ops.convert_to_tensor(q), compute), ops.convert_to_tensor(scale.reshape(1, -1)))
        else:
            g_idx = np.arange(self.in_features) // (self.quant.group_size or self.in_features)
            w = _quantizers().dequantize_with_sz_map(ops.convert_to_tensor(q), ops.convert_to_tensor(scale),
                                                     ops.convert_to_tensor(zero),
                                                     ops.convert_to_tensor(g_idx.astype(np.float32)), group_axis=0)
            w = ops.cast(w, compute)
        return np.array(ops.convert_to_numpy(w))

    def dequantized(self) -> dict[str, np.ndarray]:
        qp = self.codes()
        out = {"kernel": self._dequantize(qp["qkernel"], qp["scale"], qp.get("zero"))}
        if self.has_bias:
            out["bias"] = qp["bias"]
        return out

    def _candidate(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bias: Any) -> Candidate:
        layer = self.layer
        q = np.asarray(q).astype(np.int8)
        kernel = self._dequantize(q, scale, zero)
        if self.einsum and self.mode == "int8":
            native_q = q.reshape(self.plan.in_shape + self.plan.out_shape).transpose(np.argsort(self.plan.perm))
        elif self.mode == "int4":
            packed = _quantizers().pack_int4(ops.convert_to_tensor(q), axis=-1)[0]
            native_q = np.asarray(ops.convert_to_numpy(packed))
        else:
            native_q = q
        targets = [(layer._kernel, native_q),
                   (layer.kernel_scale, np.asarray(scale).reshape(tuple(layer.kernel_scale.shape)))]
        if zero is not None:
            targets.append((layer.kernel_zero, np.asarray(zero).reshape(tuple(layer.kernel_zero.shape))))
        # an EinsumDense bias may span only some output axes: written through its einsum plan
        einsum_bias = bias if self.has_bias and self.einsum else None
        if self.has_bias and not self.einsum:
            targets.append((layer.bias, np.asarray(bias)))

        def write():
            before = [(v, np.array(read_array(v))) for v, _ in targets]
            before_bias = self._bias() if einsum_bias is not None else None
            for v, a in targets:
                assign_array(v, np.ascontiguousarray(np.asarray(a).astype(numpy_dtype(
                    keras.backend.standardize_dtype(v.dtype)), copy=False)))
            if einsum_bias is not None:
                set_einsum_params(layer, {"bias": einsum_bias})

            def undo():
                for v, a in before:
                    assign_array(v, a)
                if before_bias is not None:
                    set_einsum_params(layer, {"bias": before_bias})
            return undo

        return Candidate(kernel, write)

    def encode(self, qp: dict) -> Candidate:
        return self._candidate(qp["qkernel"], np.asarray(qp["scale"]), qp.get("zero"), qp.get("bias"))

    def quantize(self, kernel: np.ndarray, bias: Any = None) -> Candidate:
        """Keras' own quantizer: a float Dense with this kernel, quantized in this layer's mode."""
        tmp = keras.layers.Dense(self.units, use_bias=False, dtype=self.float_name)
        tmp.build((None, self.in_features))
        tmp.kernel.assign(np.asarray(kernel).astype(numpy_dtype(self.float_name)))
        config = getattr(self.layer, "quantization_config", None)
        if self.mode == "int4" and config is None:
            from keras.src.quantizers.quantization_config import Int4QuantizationConfig

            config = Int4QuantizationConfig(block_size=self.block if self.block is not None else -1)
        tmp.quantize(self.mode, config=config)
        handle = KerasQuantLayer(tmp)
        qp = handle.codes()
        return self._candidate(qp["qkernel"], qp["scale"], qp.get("zero"), bias)


def quant_layer(layer: Any) -> KerasQuantLayer | None:
    """The handle on a quantized Dense/EinsumDense; None for anything else."""
    return KerasQuantLayer(layer) if is_quantized(layer) else None


def quant_build(layer: Any, quant: Quant) -> Any:
    """``layer`` (a float Dense) quantized in place by Keras' own ``quantize``: "divide" 8-bit is
    int8, "divide" 4-bit is int4 per-channel, "zero_point" 4-bit is int4 in groups."""
    from keras.src.quantizers.quantization_config import Int4QuantizationConfig

    if (quant.scheme, quant.bits, quant.group_size) == ("divide", 8, None):
        layer.quantize("int8")
    elif quant.bits == 4 and (quant.scheme == "divide" and quant.group_size is None or quant.scheme == "zero_point"):
        block = -1 if quant.scheme == "divide" else (quant.group_size or int(layer.kernel.shape[0]))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block))
    else:
        raise ConversionError(f"Keras quantizes as int8 (8-bit 'divide', per-channel) or int4 (4-bit 'divide' "
                              f"per-channel, or 4-bit 'zero_point' in groups), not {quant!r}")
    return layer

