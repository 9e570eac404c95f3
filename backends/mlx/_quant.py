"""MLX quantized layers (``nn.QuantizedLinear``, ``nn.QuantizedEmbedding``) in dense_bridge's
canonical quantized form (``dense_bridge/quant.py``).

MLX stores a (units, in) weight as uint32 words, ``bits`` bits per code packed little-endian
into one continuous bit stream per row (3-, 5- and 6-bit codes straddle words), with
``scales`` and, for ``mode="affine"``, ``biases`` of shape (units, in / group_size). Affine
dequantization is f(f(scale * q) + bias), in the scales' dtype (measured: bit-identical to the
numpy copy in :func:`unpack` + that formula for every bit width and group size MLX 0.32
offers). Microscaling modes (mxfp4, mxfp8, nvfp4) keep a small float's bits per code and a
uint8 scale per group (mxfp: an exponent, 2**(e - 127); nvfp4: float8 e4m3); their canonical
``"scale"`` is the decoded float32.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge.quant import MICROSCALING, Candidate, Quant
from dense_bridge.specs import Dense

from ._arrays import dtype_name, to_mx, to_numpy


def unpack(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """(rows, n * bits / 32) uint32 words -> (rows, n) uint8 codes (LSB-first bit stream)."""
    words = np.ascontiguousarray(np.asarray(words, dtype="<u4"))
    stream = np.unpackbits(words.view(np.uint8).reshape(words.shape[0], -1), axis=-1, bitorder="little")
    stream = stream[:, : n * bits].reshape(words.shape[0], n, bits).astype(np.uint16)
    return (stream << np.arange(bits, dtype=np.uint16)).sum(-1).astype(np.uint8)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, n) codes < 2**bits -> (rows, n * bits / 32) uint32 words, :func:`unpack`'s inverse."""
    codes = np.asarray(codes, dtype=np.uint8)
    stream = ((codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(codes.shape[0], -1)
    packed = np.packbits(stream, axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def _decode_scales(scales: np.ndarray, mode: str) -> np.ndarray:
    s = np.asarray(scales)
    if mode == "nvfp4":
        return s.view(_e4m3()).astype(np.float32)
    return np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32)


def _e4m3():
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def _encode_scales(scales: np.ndarray, mode: str) -> np.ndarray:
    s = np.asarray(scales, dtype=np.float32)
    if mode == "nvfp4":
        return s.astype(_e4m3()).view(np.uint8)
    mantissa, exponent = np.frexp(s)  # s = m * 2**e, m in [0.5, 1): a power of two has m == 0.5
    return np.clip(exponent - 1 + 127, 0, 255).astype(np.uint8)


def is_quantized(m: Any) -> bool:
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))


class MlxQuantLayer:
    """dense_bridge's handle on one ``QuantizedLinear`` (or ``QuantizedEmbedding`` read as the
    (dims, vocab) linear map of ``as_linear``); see ``dense_bridge.quant``."""

    def __init__(self, m: Any) -> None:
        self.m = m
        self.mode = m.mode
        scheme = "affine" if self.mode == "affine" else self.mode
        self.quant = Quant(int(m.bits), int(m.group_size), scheme)
        self.signed = False
        units, words = (int(s) for s in m["weight"].shape)
        self.units, self.in_features = units, words * 32 // self.quant.bits
        self.has_bias = "bias" in m
        if self.mode == "affine":
            self.float_name = dtype_name(m["scales"].dtype, "scales")
        else:
            self.float_name = dtype_name(m["bias"].dtype, "bias") if self.has_bias else "float32"
        self.scale_dtype = numpy_dtype(self.float_name) if self.mode == "affine" else np.float32

    # -- reading
    def _arrays(self) -> dict[str, mx.array]:
        keys = ("weight", "scales", "biases", "bias")
        out = {k: self.m[k] for k in keys if k in self.m and self.m[k] is not None}
        mx.eval(list(out.values()))
        return out

    def _dequantize(self, arrays: dict) -> np.ndarray:
        kw = {} if self.mode == "affine" else {"dtype": mx.float32}
        w = mx.dequantize(arrays["weight"], arrays["scales"], arrays.get("biases"), group_size=self.quant.group_size,
                          bits=self.quant.bits, mode=self.mode, **kw)
        mx.eval(w)
        return np.array(to_numpy(w).T)

    def spec(self) -> Dense:
        return Dense(self.units, in_features=self.in_features, use_bias=self.has_bias, kernel_init="mlx_default",
                     bias_init="mlx_default", dtype=self.float_name)

    def dequantized(self) -> dict[str, np.ndarray]:
        arrays = self._arrays()
        out = {"kernel": self._dequantize(arrays)}
        if self.has_bias:
            out["bias"] = to_numpy(arrays["bias"])
        return out

    def codes(self) -> dict[str, Any]:
        arrays = self._arrays()
        q = unpack(to_numpy(arrays["weight"]), self.quant.bits, self.in_features)
        out: dict[str, Any] = {"quant": self.quant, "qkernel": np.ascontiguousarray(q.T)}
        scales = to_numpy(arrays["scales"])
        if self.mode == "affine":
            out["scale"] = np.ascontiguousarray(scales.T)
            out["offset"] = np.ascontiguousarray(to_numpy(arrays["biases"]).T)
        else:
            out["scale"] = np.ascontiguousarray(_decode_scales(scales, self.mode).T)
        if self.has_bias:
            out["bias"] = np.array(to_numpy(arrays["bias"]))
        return out

    # -- writing
    def _candidate(self, storage: dict[str, mx.array], bias: Any) -> Candidate:
        if self.has_bias:
            storage["bias"] = to_mx(bias, dtype_name(self.m["bias"].dtype, "bias"))
        kernel = self._dequantize(storage)

        def write():
            before = self._arrays()
            self.m.update(storage)
            return lambda: self.m.update(before)

        return Candidate(kernel, write)

    def encode(self, qp: dict) -> Candidate:
        words = mx.array(pack(np.asarray(qp["qkernel"]).T, self.quant.bits))
        if self.mode == "affine":
            storage = {"weight": words, "scales": to_mx(np.asarray(qp["scale"]).T, self.float_name),
                   "biases": to_mx(np.asarray(qp["offset"]).T, self.float_name)}
        else:
            storage = {"weight": words, "scales": mx.array(_encode_scales(np.asarray(qp["scale"]).T, self.mode))}
        return self._candidate(storage, qp.get("bias"))

    def quantize(self, kernel: np.ndarray, bias: Any = None) -> Candidate:
        w = to_mx(np.ascontiguousarray(np.asarray(kernel).T), self.float_name)
        parts = mx.quantize(w, self.quant.group_size, self.quant.bits, mode=self.mode)
        storage = {"weight": parts[0], "scales": parts[1]}
        if self.mode == "affine":
            storage["biases"] = parts[2]
        return self._candidate(storage, bias)


def quant_layer(m: Any) -> MlxQuantLayer | None:
    """The handle on a ``QuantizedLinear``; None for anything else."""
    if isinstance(m, nn.QuantizedLinear):
        return MlxQuantLayer(m)
    return None


def embedding_table(m: Any) -> np.ndarray:
    """A ``QuantizedEmbedding``'s (vocab, dims) table as MLX itself dequantizes it."""
    return np.ascontiguousarray(MlxQuantLayer(m).dequantized()["kernel"].T)


def set_embedding_table(m: Any, table: Any) -> None:
    """Quantize a float (vocab, dims) table into a ``QuantizedEmbedding`` with its own settings."""
    MlxQuantLayer(m).quantize(np.asarray(table).T).write()


def quant_build(layer: Any, quant: Quant) -> Any:
    """A ``QuantizedLinear`` made from the float ``nn.Linear`` ``layer`` by MLX's own quantizer
    with ``quant``'s bits and groups ("affine" or a microscaling mode)."""
    from dense_bridge._errors import ConversionError

    if quant.scheme not in ("affine",) + tuple(MICROSCALING):
        raise ConversionError(f"MLX has no {quant.scheme!r} quantization (it offers affine, mxfp4, mxfp8, nvfp4). "
                              f"Received: quant={quant!r}")
    try:
        return nn.QuantizedLinear.from_linear(layer, group_size=quant.group_size, bits=quant.bits,
                                              mode=quant.scheme)
    except (ValueError, RuntimeError) as exc:
        raise ConversionError(f"MLX cannot quantize this layer as {quant!r}: {exc}") from None

