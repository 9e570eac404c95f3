"""Crossing between numpy and torch memory: dtype names, zero-copy views both ways, copies in.

bfloat16 crosses as ``ml_dtypes.bfloat16`` through an int16 view (numpy has no bf16).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                 "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ConversionError(f"{what} has dtype {dtype}; dense_bridge supports float32, float64, float16 "
                              f"and bfloat16")
    return _DTYPE_NAMES[dtype]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor (a copy for other devices); bf16 as ml_dtypes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    else:
        arr = t.numpy()
    arr.flags.writeable = False  # torch's memory: callers copy before mutating
    return arr


def from_numpy(arr: np.ndarray) -> torch.Tensor:
    """A tensor viewing ``arr`` (no copy) for torch to read from; bf16 through an int16 view."""
    arr = np.asarray(arr)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    bf16 = arr.dtype == numpy_dtype("bfloat16")
    if bf16:
        arr = arr.view(np.int16)
    if any(s < 0 for s in arr.strides):  # torch.from_numpy rejects negative strides
        arr = np.ascontiguousarray(arr)
    with warnings.catch_warnings():
        # torch warns that a read-only array could be written through the tensor; we only read
        # it (it is the source of a copy_), so viewing it saves a full copy.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if bf16 else t


def copy_in(target: torch.Tensor, value: np.ndarray, transpose: bool = False) -> None:
    """Copy canonical ``value`` into ``target`` (transposed for torch's (out, in) layout)."""
    src = from_numpy(value)
    with torch.no_grad():
        target.copy_(src.t() if transpose else src)
