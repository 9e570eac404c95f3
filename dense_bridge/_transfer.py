"""Parameter copies for conversion: aligned fresh buffers, a cache-blocked transpose, a fused check.

Adapters hand frameworks memory they no longer touch: :func:`native_copy` fills a FRESH
buffer with the parameter in the target framework's layout, and the adapter gives it away
through a supported zero-copy import (``torch.from_numpy``, TF DLPack). Nothing here ever
writes into memory a framework owns.

Only what measurably pays is here (``python benchmarks/bench_convert.py --ablation``, single
thread and all cores in the same run; ``benchmarks/results/transfer_ablation.md``):

- Alignment (correctness, not speed): numpy's buffers are only 16-byte aligned and TF aborts
  (``Check failed: IsAligned()``) on a misaligned DLPack import, so every buffer starts on 64 bytes.
- Transposes: a cache-blocked copy (strips of 64 source rows x 1024 columns, 256 KiB, written
  as 64 destination columns) made the convert of every transposing pair faster than numpy's
  strided ``np.copyto`` of the transposed view in every run (median +149% time without it).
- The NaN/Inf check reads each block just transposed, while it is in the cache (median +10%
  time for a separate pass after the copy, on a noisy shared machine: -66% to +209%).

Removed because their median gain was under 10% where they run (four runs): threads, for
transposing copies (median +2%, -63% to +178%) and for plain ones (numpy's own ``np.copyto``
was as fast), with the shared pool, its fork handling and the deferred scans on worker
threads; 2 MiB huge-page alignment (+8%); BLAS row sums for the finiteness test (slower than
numpy's sum outside the transposes).

Copies move raw bits (through same-width unsigned views), so every dtype, bfloat16 and NaN
payloads included, arrives bit-identical.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["ALIGN", "empty", "native_copy", "count_nonfinite", "is_aligned"]

ALIGN = 64  # bytes: Eigen's (TF's) EIGEN_MAX_ALIGN_BYTES on AVX-512 builds; torch allocates so too
_ROWS = 64  # source rows per transposed strip: 64 destination columns = one 256-byte run per row
_COLS = 1024  # source columns per strip (256 KiB of float32)
_SMALL = 1 << 20  # bytes: below this numpy's strided copy is as fast as blocking
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def is_aligned(array: np.ndarray, align: int = ALIGN) -> bool:
    """Does ``array``'s data start on an ``align``-byte boundary."""
    return array.ctypes.data % align == 0


def empty(shape: Sequence[int], dtype) -> np.ndarray:
    """A new writable C-contiguous array starting on a 64-byte boundary.

    Allocated by numpy, so whoever ends up holding it, through ``torch.from_numpy`` or a DLPack
    capsule, keeps the memory alive and frees it.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _raw(array: np.ndarray) -> np.ndarray:
    """The same memory as unsigned integers of the same width: copies then move bits only."""
    bits = _BITS.get(array.dtype.itemsize)
    return array if bits is None or array.dtype == bits else array.view(bits)


def count_nonfinite(value: np.ndarray) -> int:
    """Number of NaN/Inf entries, with one allocation-free pass in the common case.

    A sum is finite only if every term is (NaN and Inf propagate); only when it is not do we
    pay for the elementwise check, which also tells a real NaN from an overflowing sum.
    """
    if value.dtype == bool or np.issubdtype(value.dtype, np.integer) or value.size == 0:
        return 0
    acc = np.float64 if value.dtype == np.float64 else np.float32
    # a sum of huge finite values may overflow (then counted exactly); Inf + -Inf gives NaN
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.sum(value, dtype=acc)):
            return 0
        return int(value.size - np.count_nonzero(np.isfinite(value.astype(acc, copy=False))))


def blocked_transpose(out: np.ndarray, swapped: np.ndarray, check: bool) -> int:
    """out (..., R, C) = swapped (..., C, R) transposed; the NaN/Inf count of what was copied
    when ``check``. ``swapped`` is read-only; any strides whose last axis is contiguous.

    Strips of 64 x 1024 source elements are written as 1024 x 64 destination blocks: every
    source line is read once and every destination line written in full 256-byte runs, all
    inside L2; each block is checked right after it is read, while it is in the cache.
    """
    raw_out, raw_src = _raw(out), _raw(swapped)
    bad = 0
    for index in np.ndindex(*swapped.shape[:-2]):
        o, s, v = raw_out[index], raw_src[index], swapped[index]
        for j in range(0, s.shape[1], _COLS):
            for i in range(0, s.shape[0], _ROWS):
                o[j:j + _COLS, i:i + _ROWS] = s[i:i + _ROWS, j:j + _COLS].T
                if check:
                    bad += count_nonfinite(v[i:i + _ROWS, j:j + _COLS])
    return bad


def native_copy(src: np.ndarray, perm: Sequence[int] | None = None, *,
                check_finite: bool = False) -> tuple[np.ndarray, int]:
    """A fresh 64-byte aligned C-contiguous copy of ``src.transpose(perm)``, bit for bit,
    and its number of NaN/Inf entries (0 unless ``check_finite``).

    ``src`` may be any view, of any framework's memory: it is only read.
    """
    src = np.asarray(src)
    view = src if perm is None else src.transpose(tuple(perm))
    out = empty(view.shape, view.dtype)
    if view.nbytes >= _SMALL and view.ndim >= 2 and not view.flags.c_contiguous \
            and view.swapaxes(-1, -2).flags.c_contiguous:  # e.g. torch's W.T
        return out, blocked_transpose(out, view.swapaxes(-1, -2), check_finite)
    np.copyto(_raw(out), _raw(view))
    return out, count_nonfinite(out) if check_finite else 0
