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

- Threads (copies of 8 MiB and more): row strips of the output, each filled, page-faulted and
  checked on its own core. Measured again on a quiet machine (`--ablation --baseline-rev` with the
  single-thread code, same run, 7 rounds; `benchmarks/results/transfer_ablation.md`): +145% to
  +193% time without them on the transposing pairs, +16% on a plain copy. An earlier decision
  against them came from runs on a machine shared with six other test suites (+-40% noise).

Removed because their median gain was under 10% where they run (four runs): a shared thread pool
(threads are made per call: no fork handling), 2 MiB huge-page alignment (+8%); BLAS row sums
for the finiteness test (slower than numpy's sum outside the transposes).

Copies move raw bits (through same-width unsigned views), so every dtype, bfloat16 and NaN
payloads included, arrives bit-identical.
"""
from __future__ import annotations

import math
import os
import threading
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

    ``src`` may be any view, of any framework's memory: it is only read. Copies of at least
    :data:`_THREADED` bytes are split over the machine's cores (row strips of the output, each
    filled, page-faulted and checked on its own thread: numpy releases the GIL while copying).
    """
    src = np.asarray(src)
    view = src if perm is None else src.transpose(tuple(perm))
    out = empty(view.shape, view.dtype)
    transposed = view.nbytes >= _SMALL and view.ndim >= 2 and not view.flags.c_contiguous \
        and view.swapaxes(-1, -2).flags.c_contiguous  # e.g. torch's W.T
    cores = _cores()
    if cores > 1 and view.nbytes >= _THREADED and view.ndim >= 1 and (transposed or view.flags.c_contiguous):
        return out, _on_cores(out, view, transposed, check_finite, cores)
    if transposed:
        return out, blocked_transpose(out, view.swapaxes(-1, -2), check_finite)
    np.copyto(_raw(out), _raw(view))
    return out, count_nonfinite(out) if check_finite else 0


#: Bytes from which a copy is split over the cores: below it the threads' start-up (~50 us
#: each) is a visible share of the copy.
_THREADED = 8 << 20


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _on_cores(out: np.ndarray, view: np.ndarray, transposed: bool, check_finite: bool, cores: int) -> int:
    """Fill ``out`` from ``view`` in ``cores`` strips at once (threads made for this call, so a
    forked child never inherits a pool); the NaN/Inf count of the whole."""
    if transposed:  # strips of output rows: out[..., a:b, :] = swapped[..., :, a:b].T
        swapped = view.swapaxes(-1, -2)
        rows = out.shape[-2]
        step = -(-rows // (cores * _ROWS)) * _ROWS

        def job(a: int) -> int:
            return blocked_transpose(out[..., a:a + step, :], swapped[..., a:a + step], check_finite)
        starts = range(0, rows, step)
    else:  # flat chunks of a plain copy
        flat_out, flat_in = _raw(out).reshape(-1), _raw(view).reshape(-1)
        step = -(-flat_out.size // (cores * 4096)) * 4096

        def job(a: int) -> int:
            np.copyto(flat_out[a:a + step], flat_in[a:a + step])
            return count_nonfinite(out.reshape(-1)[a:a + step]) if check_finite else 0
        starts = range(0, flat_out.size, step)
    counts: list[int] = []
    errors: list[BaseException] = []

    def run(a: int) -> None:
        try:
            counts.append(job(a))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(a,), daemon=True) for a in list(starts)[1:]]
    for t in threads:
        t.start()
    run(starts[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts)
