"""Parameter copies for conversion: aligned fresh buffers, a cache-blocked transpose, a fused check.

Adapters hand frameworks memory they no longer touch: :func:`native_copy` fills a FRESH
buffer with the parameter in the target framework's layout, and the adapter gives it away
through a supported zero-copy import (``torch.from_numpy``, TF DLPack). Nothing here ever
writes into memory a framework owns.

Only what measurably pays is here (``python benchmarks/bench_convert.py --ablation``, single
thread and all cores in the same run; ``benchmarks/results/transfer_ablation.md``):

- Alignment (correctness, not speed): numpy's buffers are only 16-byte aligned and TF aborts
  (``Check failed: IsAligned()``) on a misaligned DLPack import, so every buffer starts on 64 bytes.
- Transposes: a cache-blocked copy (tiles of 16 source rows x 2048 columns, written as 16
  destination columns: see :func:`_tile_rows` for the measured tile sizes) made the convert of
  every transposing pair faster than numpy's strided ``np.copyto`` of the transposed view in
  every run (median +149% time without it, with the earlier 64 x 1024 tiles, themselves 2x
  slower than 16 x 2048 for float32).
- The NaN/Inf check reads each 1 MiB of source rows just transposed, while it is in L2 (median
  +10% time for a separate pass after the copy, on a noisy shared machine: -66% to +209%).

- Threads (copies of 8 MiB and more): row strips of the output, each filled, page-faulted and
  checked on its own core. Measured again on a quiet machine (`--ablation --baseline-rev` with the
  single-thread code, same run, 7 rounds; `benchmarks/results/transfer_ablation.md`): +145% to
  +193% time without them on the transposing pairs, +16% on a plain copy. An earlier decision
  against them came from runs on a machine shared with six other test suites (+-40% noise).

Removed because their median gain was under 10% where they run (four runs): a shared thread pool
(threads are made per call: no fork handling), 2 MiB huge-page alignment (+8%); BLAS row sums
for the finiteness test (slower than numpy's sum outside the transposes).

- Where the optional C extension ``dense_bridge.params._copy_kernels`` is built (:data:`COPY_KERNELS`), contiguous
  copies test each word for NaN/Inf on its way through a register (``copy_count``), float32
  transposes run in AVX2 8 x 8 blocks with the same test (``transpose_count``, 2.6x numpy's
  tiles), and scans count exponent bits in C (``count``): the check then costs no pass of its
  own. Without it the numpy paths above give the same results. Measured:
  ``benchmarks/bench_scan_limits.py``, ``benchmarks/results/convert_plain.md``.

Copies move raw bits (through same-width unsigned views), so every dtype, bfloat16 and NaN
payloads included, arrives bit-identical.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Sequence

import numpy as np

from .._errors import ConversionError

try:  # optional: built by setup.py where a C compiler is found (see _copy_kernels.c)
    from . import _copy_kernels as COPY_KERNELS
except ImportError:  # pragma: no cover - exercised by forcing COPY_KERNELS = None in the tests
    COPY_KERNELS = None

__all__ = ["ALIGN", "COPY_KERNELS", "empty", "native_copy", "copy_into", "count_nonfinite", "is_aligned",
           "core_to_spare"]

ALIGN = 64  # bytes: Eigen's (TF's) EIGEN_MAX_ALIGN_BYTES on AVX-512 builds; torch allocates so too
_COLS = 2048  # source columns per transposed tile
_CHECK_BYTES = 1 << 20  # source bytes per NaN/Inf scan inside a transpose (read back from L2)
_SMALL = 1 << 20  # bytes: below this numpy's strided copy is as fast as blocking
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Largest row (elements after the first axis) summed into an accumulator row by count_nonfinite,
#: and the largest array (cache-resident blocks) it does so for.
_ROW_SUM_MAX = 1 << 16
_ROW_SUM_BYTES = 4 << 20
#: Exponent bits of each float dtype: all set means Inf or NaN.
_EXPONENT_MASKS = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000,
                   "float64": 0x7FF0000000000000}
_BITS_CHUNK = 1 << 20  # elements per scratch buffer of the bit test (2 MiB)


def _tile_rows(itemsize: int) -> int:
    """Source rows per transposed tile: each destination row then gets 16 (8 for 8-byte types)
    consecutive elements. Measured (single thread, prealloc, 4096x4096 and 768x3072): float32
    2.4-3.3 GB/s with 16 x 2048 tiles vs 1.3 with the previous 64 x 1024, float16 1.4-2.2 vs
    0.7-0.9, float64 3.6 vs 2.6; 32 rows fell back to 1.0-1.9 for 2- and 4-byte types."""
    return 8 if itemsize >= 8 else 16


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
    2-byte floats (float16, bfloat16) are read as bits instead: numpy sums them through a
    buffered cast, 4-5x slower than the copy they guard.
    """
    if value.dtype == bool or np.issubdtype(value.dtype, np.integer) or value.size == 0:
        return 0
    mask = _EXPONENT_MASKS.get(value.dtype.name)
    if COPY_KERNELS is not None and mask is not None and value.flags.c_contiguous and value.flags.aligned:
        return COPY_KERNELS.count(_raw(value).reshape(-1), value.dtype.itemsize, mask)
    if value.dtype.itemsize == 2:
        return _count_nonfinite_bits(value)
    acc = np.float64 if value.dtype == np.float64 else np.float32
    # a sum of huge finite values may overflow (then counted exactly); Inf + -Inf gives NaN
    with np.errstate(over="ignore", invalid="ignore"):
        if value.ndim >= 2 and value.nbytes <= _ROW_SUM_BYTES and value[0].size <= _ROW_SUM_MAX:
            # rows added into one accumulator row first: plain vertical SIMD adds, 2.2x numpy's
            # pairwise sum on the strided 1 MiB blocks of a threaded transpose (31 vs 70 us); on
            # arrays far beyond the caches the pairwise sum is faster (24.8 vs 16.0 GB/s, 64 MiB)
            total = np.add.reduce(np.add.reduce(value, axis=0, dtype=acc), axis=None, dtype=acc)
        else:
            total = np.sum(value, dtype=acc)
        if np.isfinite(total):
            return 0
        return int(value.size - np.count_nonzero(np.isfinite(value.astype(acc, copy=False))))


def _count_nonfinite_bits(value: np.ndarray) -> int:
    """NaN/Inf count of a float16 or bfloat16 array: entries whose magnitude bits reach the
    all-ones exponent. First an exact yes/no from two integer maxima (see below), which reads
    the array twice with no scratch and no Python loop (each a single GIL-free numpy call);
    only then the count, in chunks along the first axis that keep the scratch small."""
    exponent = _EXPONENT_MASKS.get(value.dtype.name)
    if exponent is None:  # pragma: no cover - no other 2-byte float is a dense_bridge dtype
        return int(value.size - np.count_nonzero(np.isfinite(value.astype(np.float32))))
    bits = np.atleast_1d(value).view(np.uint16)
    # Unsigned, a NaN/Inf with the sign bit set is >= sign | exponent and nothing finite is;
    # signed, negatives sit below 0, so the maximum reaches the exponent only through a
    # positive NaN/Inf. Measured in one run, 4096^2 float16 on a busy 2-core machine: 2.0 ms for
    # both maxima, 16.5 ms for the chunked masked count alone, 121 ms for numpy's float32 sum of
    # float16 (a buffered cast); bfloat16 1.6 vs 16.2 ms.
    if bits.max() < (0x8000 | exponent) and bits.view(np.int16).max() < exponent:
        return 0
    step = max(1, _BITS_CHUNK // (bits[0].size if bits.ndim > 1 else 1))
    bad = 0
    for start in range(0, bits.shape[0], step):
        magnitude = np.bitwise_and(bits[start:start + step], 0x7FFF)
        if magnitude.max() >= exponent:
            bad += int(np.count_nonzero(magnitude >= exponent))
    return bad


def blocked_transpose(out: np.ndarray, swapped: np.ndarray, check: bool) -> int:
    """out (..., R, C) = swapped (..., C, R) transposed; the NaN/Inf count of what was copied
    when ``check``. ``swapped`` is read-only; any strides whose last axis is contiguous.

    Tiles of 16 source rows (8 for 8-byte types) x 2048 columns: numpy's strided copy then
    writes 16 consecutive elements of each destination row from lines that stay in L1. The
    scan reads back each 1 MiB group of source rows just copied, while it is still in L2.
    """
    raw_out, raw_src = _raw(out), _raw(swapped)
    rows_per_tile = _tile_rows(out.itemsize)
    bad = 0
    for index in np.ndindex(*swapped.shape[:-2]):
        o, s, v = raw_out[index], raw_src[index], swapped[index]
        rows, cols = s.shape
        group = max(rows_per_tile, _CHECK_BYTES // max(1, cols * s.itemsize) // rows_per_tile * rows_per_tile)
        for g in range(0, rows, group):
            for i in range(g, min(g + group, rows), rows_per_tile):
                for j in range(0, cols, _COLS):
                    o[j:j + _COLS, i:i + rows_per_tile] = s[i:i + rows_per_tile, j:j + _COLS].T
            if check:
                bad += count_nonfinite(v[g:g + group])
    return bad


def native_copy(src: np.ndarray, perm: Sequence[int] | None = None, *,
                check_finite: bool = False) -> tuple[np.ndarray, int]:
    """A fresh 64-byte aligned C-contiguous copy of ``src.transpose(perm)``, bit for bit,
    and its number of NaN/Inf entries (0 unless ``check_finite``). See :func:`copy_into`."""
    src = np.asarray(src)
    view = src if perm is None else src.transpose(tuple(perm))
    out = empty(view.shape, view.dtype)
    return out, copy_into(out, src, perm, check_finite=check_finite)


def copy_into(out: np.ndarray, src: np.ndarray, perm: Sequence[int] | None = None, *,
              check_finite: bool = False) -> int:
    """Write ``src.transpose(perm)`` into ``out`` bit for bit; its NaN/Inf count (0 unless
    ``check_finite``).

    ``out``: writable and C-contiguous, of the transposed shape and ``src``'s dtype (fresh
    memory from :func:`empty`). ``src`` may be any view, of any framework's memory: it is only
    read. Copies of at least :data:`_THREADED` bytes are split over the machine's cores (row
    strips of the output, each filled, page-faulted and checked on its own thread: numpy and
    :data:`COPY_KERNELS` release the GIL while copying).
    """
    src = np.asarray(src)
    view = src if perm is None else src.transpose(tuple(perm))
    if out.shape != view.shape or out.dtype != view.dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ConversionError(f"out must be a writable C-contiguous {view.dtype} array of shape {view.shape}. "
                              f"Received: out {out.dtype} {out.shape}, contiguous={out.flags.c_contiguous}, "
                              f"writable={out.flags.writeable}")
    transposed = view.nbytes >= _SMALL and view.ndim >= 2 and not view.flags.c_contiguous \
        and view.swapaxes(-1, -2).flags.c_contiguous  # e.g. torch's W.T
    cores = _cores()
    if cores > 1 and view.nbytes >= _THREADED and view.ndim >= 1 and (transposed or view.flags.c_contiguous):
        return _on_cores(out, view, transposed, check_finite, cores)
    if transposed:
        return _transpose_rows(out, view.swapaxes(-1, -2), 0, out.shape[-2], check_finite)
    if view.flags.c_contiguous:
        return _copy_counting(out, view, check_finite)
    np.copyto(_raw(out), _raw(view))
    return count_nonfinite(out) if check_finite else 0


def _transpose_rows(out: np.ndarray, swapped: np.ndarray, first: int, count: int, check: bool) -> int:
    """out[..., first:first + count, :] = swapped[..., :, first:first + count] transposed (``out`` and
    ``swapped`` whole and C-contiguous, ``swapped`` (..., n, m), ``out`` (..., m, n)); the NaN/Inf
    count of what was copied when ``check``. 4-byte words go through :data:`COPY_KERNELS`'s AVX2 8 x 8
    blocks where the CPU has them (2.6x numpy's tiles, 2048^2 float32, one thread), the test in
    the same registers; everything else through :func:`blocked_transpose`."""
    if (COPY_KERNELS is not None and out.itemsize == 4 and swapped.flags.c_contiguous and out.flags.c_contiguous
            and out.flags.aligned and swapped.flags.aligned and COPY_KERNELS.has_transpose()):
        mask = _EXPONENT_MASKS.get(out.dtype.name, 0) if check else 0
        n, m = swapped.shape[-2:]
        raw_out, raw_src = _raw(out), _raw(swapped)
        bad = 0
        for index in np.ndindex(*swapped.shape[:-2]):
            bad += COPY_KERNELS.transpose_count(raw_out[index], raw_src[index], n, m, mask, first, count)
        return bad if mask else 0
    return blocked_transpose(out[..., first:first + count, :], swapped[..., first:first + count], check)


def _copy_counting(out: np.ndarray, src: np.ndarray, check: bool) -> int:
    """out = src (both C-contiguous, same shape and dtype), with src's NaN/Inf count when ``check``:
    in the copy's own pass where :data:`COPY_KERNELS` is built, else a numpy copy and a scan of ``out``."""
    mask = _EXPONENT_MASKS.get(src.dtype.name, 0) if check else 0
    if COPY_KERNELS is not None and (mask or not check) and src.dtype.itemsize in (2, 4, 8) and src.size \
            and src.flags.aligned and out.flags.aligned:
        return COPY_KERNELS.copy_count(_raw(out).reshape(-1), _raw(src).reshape(-1), src.dtype.itemsize, mask)
    np.copyto(_raw(out), _raw(src))
    return count_nonfinite(out) if check else 0


#: Bytes from which a copy is split over the cores: below it the threads' start-up (~50 us
#: each) is a visible share of the copy.
_THREADED = 8 << 20


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def core_to_spare() -> bool:
    """Is a core likely idle for a helper thread: a 1-minute load average (runnable tasks, this
    process included) under the number of usable cores. Where none is, a helper only takes turns
    with the calling thread, and each hand-over of the GIL can wait a whole time slice."""
    try:
        return os.getloadavg()[0] < _cores()
    except (AttributeError, OSError):  # pragma: no cover - no load average on this platform
        return True


def _on_cores(out: np.ndarray, view: np.ndarray, transposed: bool, check_finite: bool, cores: int) -> int:
    """Fill ``out`` from ``view`` in ``cores`` strips at once (threads made for this call, so a
    forked child never inherits a pool); the NaN/Inf count of the whole."""
    if transposed:  # strips of output rows: out[..., a:b, :] = swapped[..., :, a:b].T
        swapped = view.swapaxes(-1, -2)
        rows = out.shape[-2]
        unit = _tile_rows(out.itemsize)
        step = -(-rows // (cores * unit)) * unit

        def job(a: int) -> int:
            return _transpose_rows(out, swapped, a, min(step, rows - a), check_finite)
        starts = range(0, rows, step)
    else:  # flat chunks of a plain copy
        flat_out, flat_in = out.reshape(-1), view.reshape(-1)
        step = -(-flat_out.size // (cores * 4096)) * 4096

        def job(a: int) -> int:
            return _copy_counting(flat_out[a:a + step], flat_in[a:a + step], check_finite)
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
