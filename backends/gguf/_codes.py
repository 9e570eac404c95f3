"""GGUF block codes: quantized with gguf-py's own quantizers, dequantized with its own
dequantizers, and moved into MLX's quantized layouts (and back) without requantizing.

The block layouts (llama.cpp ``ggml-common.h``; gguf-py ``quants.py``), 32 values per block
unless said:

- Q4_0 (18 bytes): float16 ``d``, 16 bytes of 4-bit codes; value ``d * (q - 8)``.
- Q4_1 (20 bytes): float16 ``d``, float16 ``m``, 16 bytes of codes; value ``d * q + m``.
- Q8_0 (34 bytes): float16 ``d``, 32 int8 codes ``x``; value ``x * d``.
- Q4_K (256 values, 144 bytes): float16 ``d``, float16 ``dmin``, 12 bytes of 6-bit sub-scales
  ``sc`` and sub-mins ``m`` (8 of each, one per 32 values), 128 bytes of codes; value
  ``(d * sc) * q - (dmin * m)``.
- MXFP4 (17 bytes): one E8M0 exponent byte ``e``, 16 bytes of FP4 (E2M1) codes; value
  ``e2m1(q) * 2**(e - 127)`` (gguf reads code 8, E2M1's -0, as +0.0).

In a 32-value block of 16 code bytes, byte ``j`` holds value ``j`` in its low nibble and value
``j + 16`` in its high nibble (Q4_K: 32 bytes hold two 32-value sub-blocks, low then high
nibbles). MLX packs codes little-endian into uint32 along the input axis: value ``k`` of a row
sits in word ``k * bits // 32`` at bit ``(k * bits) % 32``; its scales and biases are
``(out, in // group_size)``, value ``scale * q + bias``.

Why the MLX layers are exact (float32 scales and biases): every product above of a float16
(or float16 times a 6-bit integer) scale with a code is exact in float32, so MLX's
``scale * q + bias`` rounds once, where gguf rounds once: Q4_1 and Q4_K agree bit for bit;
Q4_0 (bias ``-8 * d``) and Q8_0 (codes ``x + 128``, bias ``-128 * d``) agree in value
everywhere, the bit patterns differing only in the sign of some zeros (gguf's ``d * 0`` is
``-0.0`` for a negative ``d``; MLX's ``8d - 8d`` is ``+0.0``). With float16 or bfloat16 scales
MLX computes in that dtype and the values differ.
"""
from __future__ import annotations

import numpy as np

from dense_bridge._errors import ConversionError, SpecError, received

__all__ = ["QUANTIZABLE", "MLX_AFFINE_BITS", "quantize", "dequantize", "to_mlx_affine", "to_mlx_mxfp4",
           "from_mlx_affine_q4", "ggml_type_of"]

#: Values per processed chunk: quantizing or dequantizing a large tensor holds a few chunks' temporaries.
CHUNK = 1 << 22

#: The types ``quantize`` writes (gguf-py's own quantizers; K-quants need llama.cpp's).
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
#: GGUF types whose codes move into MLX affine group-32 layers, and their bits.
MLX_AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8}


def _gguf():
    import gguf

    return gguf


def ggml_type_of(value, argument: str = "ggml_type"):
    """A ``gguf.GGMLQuantizationType`` from itself, its name ("q4_0", "Q4_K") or its number."""
    T = _gguf().GGMLQuantizationType
    if isinstance(value, T):
        return value
    try:
        if isinstance(value, str):
            return T[value.upper()]
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return T(int(value))
    except (KeyError, ValueError):
        pass
    raise SpecError(f"{argument} must be a GGML type (gguf.GGMLQuantizationType, its name or number; known: "
                    f"{', '.join(t.name for t in T)}). {received(argument, value)}")


def _sizes(gtype) -> tuple[int, int]:
    return _gguf().GGML_QUANT_SIZES[gtype]


def _byte_shape(shape: tuple[int, ...], gtype) -> tuple[int, ...]:
    block, size = _sizes(gtype)
    return (*shape[:-1], shape[-1] // block * size)


def _check_shape(shape, gtype, argument: str = "shape") -> tuple[int, ...]:
    if not (isinstance(shape, (tuple, list)) and len(shape) >= 1
            and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise SpecError(f"{argument} must be a tuple of non-negative integers. {received(argument, shape)}")
    shape = tuple(int(d) for d in shape)
    block = _sizes(gtype)[0]
    if shape[-1] % block:
        raise ConversionError(f"a {gtype.name} tensor needs rows of a multiple of {block} values; "
                              f"{received(argument, shape)}")
    return shape


def _rows(n_values_per_row: int) -> int:
    """Rows per chunk for rows of ``n_values_per_row`` values."""
    return max(1, CHUNK // max(n_values_per_row, 1))


# ----------------------------------------------------------------------------- gguf's own codecs
def quantize(array: np.ndarray, ggml_type) -> np.ndarray:
    """``array`` (any float dtype, last axis = a row) in ``ggml_type`` (F32, F16, BF16, Q8_0, Q4_0,
    Q4_1) with gguf-py's own quantizers (``gguf.quants.quantize``; float16 by numpy's rounding, as
    llama.cpp's converter does, from float32).

    Returns:
        uint8 bytes of shape ``(*array.shape[:-1], row bytes)``, as a GGUF file stores them.
    """
    gguf = _gguf()
    gtype = ggml_type_of(ggml_type)
    if gtype.name not in QUANTIZABLE:
        raise ConversionError(f"GGUF type {gtype.name} is not written here (gguf-py has no quantizer for it; "
                              f"written: {', '.join(QUANTIZABLE)}). {received('ggml_type', ggml_type)}")
    arr = np.asarray(array)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise TypeError(f"array must hold floats to be quantized to {gtype.name}, not {arr.dtype}. "
                        f"{received('array.dtype', arr.dtype)}")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    shape = _check_shape(arr.shape, gtype, "array.shape")
    out = np.empty(_byte_shape(shape, gtype), np.uint8)
    rows_in, rows_out = arr.reshape(-1, shape[-1]), out.reshape(-1, out.shape[-1] if out.size else 0)
    step = _rows(shape[-1])
    for start in range(0, rows_in.shape[0], step):
        chunk = rows_in[start:start + step]
        if not (gtype.name == "F16" and chunk.dtype == np.float16):
            chunk = chunk.astype(np.float32)  # the converter's order: float32 first, then the type
        q = gguf.quants.quantize(np.ascontiguousarray(chunk), gtype)
        rows_out[start:start + step] = np.ascontiguousarray(q).view(np.uint8).reshape(chunk.shape[0], -1)
    return out


def dequantize(raw: np.ndarray, ggml_type, shape) -> np.ndarray:
    """The float32 values of GGUF block bytes ``raw`` of a tensor of numpy ``shape`` (gguf-py's own
    ``gguf.quants.dequantize``; float types widened exactly). ConversionError naming the type when
    gguf cannot dequantize it, or when ``raw`` is not the size ``shape`` needs."""
    gguf = _gguf()
    gtype = ggml_type_of(ggml_type)
    shape = _check_shape(shape, gtype)
    buf = np.ascontiguousarray(np.asarray(raw)).view(np.uint8).reshape(-1)
    need = int(np.prod(_byte_shape(shape, gtype), dtype=np.int64))
    if buf.size != need:
        raise ConversionError(f"a {gtype.name} tensor of shape {shape} takes {need} bytes; got {buf.size}")
    T = gguf.GGMLQuantizationType
    direct = {T.F32: "<f4", T.F16: "<f2", T.F64: "<f8"}
    if gtype in direct:
        return buf.view(direct[gtype]).astype(np.float32).reshape(shape)
    if gtype == T.BF16:
        return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if gtype in (T.I8, T.I16, T.I32, T.I64):
        raise ConversionError(f"GGUF type {gtype.name} holds integers, not values to dequantize")
    out = np.empty(shape, np.float32)
    row_bytes = _byte_shape(shape, gtype)[-1]
    rows_in, rows_out = buf.reshape(-1, row_bytes) if row_bytes else buf.reshape(0, 0), out.reshape(-1, shape[-1])
    step = _rows(shape[-1])
    try:
        for start in range(0, rows_in.shape[0], step):
            rows_out[start:start + step] = gguf.quants.dequantize(rows_in[start:start + step], gtype)
    except NotImplementedError:
        raise ConversionError(f"GGUF type {gtype.name} cannot be dequantized by gguf {_version()} "
                              "(no dequantizer for it)") from None
    return out


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001 - only for a message
        return "(version unknown)"


# ----------------------------------------------------------------------------- into MLX
def _blocks(raw, gtype, shape):
    """(blocks (n, type size) uint8, shape checked, rows) of ``raw``."""
    shape = _check_shape(shape, gtype)
    buf = np.ascontiguousarray(np.asarray(raw)).view(np.uint8).reshape(-1)
    block, size = _sizes(gtype)
    n = int(np.prod(shape, dtype=np.int64)) // block
    if buf.size != n * size:
        raise ConversionError(f"a {gtype.name} tensor of shape {shape} takes {n * size} bytes; got {buf.size}")
    return buf.reshape(n, size), shape


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) code bytes of 32-value blocks -> (n, 32) codes: low nibbles are values 0..15, high 16..31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, in) uint8 codes -> MLX's packing: (rows, in * bits // 32) uint32, little-endian along the row."""
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    return np.ascontiguousarray(codes).view("<u4").astype(np.uint32, copy=False)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view("<f2").astype(np.float32)


def to_mlx_affine(raw: np.ndarray, ggml_type, shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The codes of a Q4_0, Q4_1, Q8_0 or Q4_K tensor as an MLX affine group-32 layer, moved, not
    requantized: ``mx.dequantize(w, scales, biases, group_size=32, bits=MLX_AFFINE_BITS[type])``
    equals ``gguf.quants.dequantize`` of ``raw`` (bit for bit for Q4_1 and Q4_K; for Q4_0 and
    Q8_0 up to the sign of zeros; see the module docstring).

    Args:
        raw: the tensor's block bytes (``GGUFFile.raw``).
        ggml_type: its type.
        shape: its numpy shape ``(..., in)``.

    Returns:
        ``(w, scales, biases)``: ``w`` uint32 ``(..., in * bits // 32)``; ``scales`` and ``biases``
        float32 ``(..., in // 32)``. ConversionError naming the type for any other type.
    """
    gtype = ggml_type_of(ggml_type)
    if gtype.name not in MLX_AFFINE_BITS:
        raise ConversionError(f"keep_codes: GGUF type {gtype.name} has no exact MLX layout (codes move only from "
                              f"{', '.join(MLX_AFFINE_BITS)}; MXFP4 into mxfp4); dequantize instead")
    blocks, shape = _blocks(raw, gtype, shape)
    name = gtype.name
    if name == "Q4_0":
        d = _f16(blocks[:, :2])
        codes, scales, biases = _nibbles(blocks[:, 2:18]), d, np.float32(-8) * d
    elif name == "Q4_1":
        codes, scales, biases = _nibbles(blocks[:, 4:20]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    elif name == "Q8_0":
        d = _f16(blocks[:, :2])
        codes, scales, biases = blocks[:, 2:34] ^ np.uint8(0x80), d, np.float32(-128) * d  # x + 128 as uint8
    else:  # Q4_K: sub-block j of 32 values has scale d * sc[j] and bias -(dmin * m[j]), as gguf computes them
        gguf = _gguf()
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mins = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scales = d * sc.astype(np.float32)
        biases = -(dmin * mins.astype(np.float32))
        qs = blocks[:, 16:144].reshape(-1, 4, 32)
        codes = np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(-1, 256)
    bits = MLX_AFFINE_BITS[name]
    rows, width = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    w = _pack(np.ascontiguousarray(codes).reshape(rows, width), bits)
    lead = shape[:-1]
    return (w.reshape(*lead, width * bits // 32), scales.reshape(*lead, width // 32).astype(np.float32),
            biases.reshape(*lead, width // 32).astype(np.float32))


def to_mlx_mxfp4(raw: np.ndarray, shape) -> tuple[np.ndarray, np.ndarray]:
    """The codes of an MXFP4 tensor in MLX's ``mode="mxfp4"`` layout (group 32): the E8M0 exponent
    bytes are the scales as they are, the FP4 codes repacked along the row.

    Returns:
        ``(w, scales)``: ``w`` uint32 ``(..., in // 8)``, ``scales`` uint8 ``(..., in // 32)``;
        ``mx.dequantize(w, scales, group_size=32, bits=4, mode="mxfp4")`` equals gguf's dequantization
        in value (bit for bit but the sign of zero: FP4 code 8 is -0.0 to MLX, +0.0 to gguf). A block
        whose exponent byte is 255 (NaN in the MX spec, 2**127 in ggml) is a ConversionError.
    """
    gtype = _gguf().GGMLQuantizationType.MXFP4
    blocks, shape = _blocks(raw, gtype, shape)
    if (blocks[:, 0] == 255).any():  # E8M0 255 is NaN to MLX (the MX spec), 2**127 to ggml
        raise ConversionError("keep_codes: an MXFP4 block has the exponent byte 255, which MLX reads as NaN and "
                              "ggml as 2**127: its codes cannot move; dequantize instead")
    rows, width = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    w = _pack(_nibbles(blocks[:, 1:17]).reshape(rows, width), 4)
    return w.reshape(*shape[:-1], width // 8), np.ascontiguousarray(blocks[:, 0]).reshape(*shape[:-1], width // 32)


# ----------------------------------------------------------------------------- from MLX
def _unpack4(w: np.ndarray) -> np.ndarray:
    """MLX 4-bit packing (rows, in // 8) uint32 -> (rows, in) uint8 codes."""
    b = np.ascontiguousarray(w).astype("<u4", copy=False).view(np.uint8)
    out = np.empty((b.shape[0], b.shape[1] * 2), np.uint8)
    out[:, 0::2], out[:, 1::2] = b & np.uint8(0x0F), b >> np.uint8(4)
    return out


def from_mlx_affine_q4(w: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                       group_size: int) -> tuple[np.ndarray, dict]:
    """An MLX affine 4-bit layer's codes as Q4_1 blocks, without requantizing: the codes are copied,
    each group's scale and bias become the float16 ``d`` and ``m`` of its ``group_size // 32``
    blocks (group 64 = two Q4_1 blocks sharing scale and bias).

    Args:
        w: uint32 ``(out, in // 8)`` (MLX's packing).
        scales, biases: ``(out, in // group_size)``, float32, float16 or bfloat16.
        group_size: MLX's group size, a multiple of 32.

    Returns:
        ``(raw, report)``: ``raw`` uint8 ``(out, in // 32 * 20)``, the GGUF Q4_1 bytes; ``report``:
        ``{"exact": bool`` (every scale and bias is a float16 value, so every value gguf
        dequantizes equals ``scale * q + bias`` computed exactly, up to float32 rounding),
        ``"inexact_scales"``, ``"inexact_biases"`` (how many are not float16 values: out of
        range or too precise), ``"max_abs_error"`` (the largest ``|(d * q + m) - (scale * q +
        bias)|`` over the codes present, computed in float64: 0.0 when exact)``}``.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size <= 0 \
            or group_size % 32:
        raise ConversionError(f"group_size must be a positive multiple of 32 to become Q4_1 blocks of 32. "
                              f"{received('group_size', group_size)}")
    w, scales, biases = np.asarray(w), np.asarray(scales), np.asarray(biases)
    if w.ndim != 2 or w.dtype != np.uint32:
        raise ConversionError(f"w must be MLX's packed uint32 codes (out, in // 8). "
                              f"{received('w', f'{w.dtype} {w.shape}')}")
    rows, width = w.shape[0], w.shape[1] * 8
    groups = width // group_size
    if width % group_size or scales.shape != (rows, groups) or biases.shape != (rows, groups):
        raise ConversionError(f"scales and biases must be (out, in // group_size) = {(rows, groups)} for w of shape "
                              f"{w.shape} (in = {width}) and group_size={group_size}. "
                              f"{received('scales.shape', scales.shape)}, {received('biases.shape', biases.shape)}")
    per = group_size // 32
    raw = np.empty((rows, width // 32 * 20), np.uint8)
    report = {"exact": True, "inexact_scales": 0, "inexact_biases": 0, "max_abs_error": 0.0}
    step = _rows(width)
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            s64 = scales[start:stop].astype(np.float64)
            b64 = biases[start:stop].astype(np.float64)
            d = scales[start:stop].astype(np.float32).astype(np.float16)
            m = biases[start:stop].astype(np.float32).astype(np.float16)
            bad_s = d.astype(np.float64) != s64
            bad_b = m.astype(np.float64) != b64
            report["inexact_scales"] += int(np.count_nonzero(bad_s))
            report["inexact_biases"] += int(np.count_nonzero(bad_b))
            codes = _unpack4(w[start:stop])  # (r, width)
            if bad_s.any() or bad_b.any():
                q = codes.reshape(stop - start, groups, group_size).astype(np.float64)
                err = np.abs((d.astype(np.float64) - s64)[..., None] * q + (m.astype(np.float64) - b64)[..., None])
                report["max_abs_error"] = max(report["max_abs_error"], float(np.nan_to_num(err, nan=np.inf).max()))
            blocks = codes.reshape(stop - start, width // 32, 2, 16)
            qs = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << np.uint8(4))  # byte j: values j and j + 16
            out = raw[start:stop].reshape(stop - start, width // 32, 20)
            out[:, :, 0:2] = np.repeat(d, per, axis=1).astype("<f2").view(np.uint8).reshape(stop - start, -1, 2)
            out[:, :, 2:4] = np.repeat(m, per, axis=1).astype("<f2").view(np.uint8).reshape(stop - start, -1, 2)
            out[:, :, 4:20] = qs
    report["exact"] = report["inexact_scales"] == 0 and report["inexact_biases"] == 0
    return raw, report
