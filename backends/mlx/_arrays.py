"""numpy <-> MLX arrays and dtype names: bit-exact copies and views, every dtype passed explicitly.

``mx.array`` of a float64 numpy array silently makes float32 unless told otherwise, so every
conversion here passes its dtype. bfloat16 crosses to and from numpy bit for bit through a uint16
view (ml_dtypes on the numpy side), never widened.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError, SpecError

MX_DTYPES = {"float32": mx.float32, "float64": mx.float64, "float16": mx.float16,
              "bfloat16": mx.bfloat16}
_DTYPE_NAMES = {v: k for k, v in MX_DTYPES.items()}


# ------------------------------------------------------------------ numpy <-> mx
def to_mx(array: np.ndarray, dtype: str) -> mx.array:
    """A fresh MLX-owned copy of ``array`` in ``dtype`` (strided views are fine)."""
    if dtype == "bfloat16":
        # bit-exact on every MLX version: uint16 carries the bits, the view relabels them
        bits = np.asarray(array).astype(numpy_dtype("bfloat16"), copy=False).view(np.uint16)
        out = mx.array(bits, dtype=mx.uint16).view(mx.bfloat16)
    else:
        # dtype always explicit: mx.array(float64 array) silently gives float32 otherwise
        out = mx.array(np.asarray(array), dtype=MX_DTYPES[dtype])
    mx.eval(out)
    return out


def from_numpy(array) -> mx.array:
    """The adapter verb: a fresh MLX array of ``array`` in its own dtype (bfloat16 bit for bit)."""
    a = np.asarray(array)
    if a.dtype.name in MX_DTYPES:
        return to_mx(a, a.dtype.name)
    out = mx.array(a)  # integers and bools keep their dtype
    mx.eval(out)
    return out


def to_numpy(array: mx.array) -> np.ndarray:
    """The adapter verb: a read-only zero-copy numpy view of an evaluated MLX array (bfloat16 as ml_dtypes)."""
    if array.dtype == mx.bfloat16:
        # numpy's buffer protocol has no bfloat16: view the bits as uint16, relabel in numpy
        out = np.asarray(array.view(mx.uint16)).view(numpy_dtype("bfloat16"))
    else:
        out = np.asarray(array)
    out.flags.writeable = False  # MLX owns this memory; writing into it would bypass MLX
    return out


def dtype_name(dtype: mx.Dtype, where: str) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ConversionError(f"{where} has dtype {dtype}; dense_bridge supports "
                              f"{', '.join(MX_DTYPES)}") from None


def check_dtype(dtype: str) -> None:
    if dtype == "float64" and mx.default_device().type != mx.DeviceType.cpu:
        raise SpecError("dtype='float64' needs MLX's CPU device (MLX GPUs have no float64); call "
                        f"mx.set_default_device(mx.cpu) first. Received: dtype={dtype!r}")

