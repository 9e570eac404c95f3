"""Fast parameter copies for conversion: aligned buffers, blocked transposes, fused checks.

Adapters hand frameworks memory they no longer touch: :func:`native_copy` fills a FRESH
buffer with the parameter in the target framework's layout, and the adapter gives it away
through a supported zero-copy import (``torch.from_numpy``, TF DLPack). Nothing here ever
writes into memory a framework owns. Measured on the 2-core reference machine (docs/FACTS.md):

- Alignment: numpy's buffers are only 16-byte aligned and TF aborts (``Check failed:
  IsAligned()``) on a misaligned DLPack import, so every buffer here starts on 64 bytes.
- Huge pages: a new model needs new memory, and the kernel zero-fills every new page. numpy
  advises huge pages (MADV_HUGEPAGE) for its allocations of 4 MiB and more, which makes a
  fresh 64 MB layer about 1.6x cheaper to fill than 4 KiB pages (torch.empty's).
- Transposes: a cache-blocked numpy copy (strips of 64 source rows x 1024 columns, 256 KiB,
  written as 64 destination columns) beats torch's ``out.copy_(W.t())`` and is 5x numpy's
  plain ``ascontiguousarray(W.T)``; it needs no framework at all.
- Threads: large copies run in huge-page-sized work items on every core (numpy releases the
  GIL while copying), so the kernel's zero-filling of fresh pages runs in parallel too.
- Finiteness: NaN/Inf checks read the block just copied, while it is in the cache, with BLAS
  row sums, instead of a separate pass over all parameters (which cost as much as a copy).

Copies move raw bits (through same-width unsigned views), so every dtype, bfloat16 and NaN
payloads included, arrives bit-identical.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

__all__ = ["ALIGN", "empty", "native_copy", "count_nonfinite", "count_nonfinite_later", "is_aligned"]

ALIGN = 64  # bytes: Eigen's (TF's) EIGEN_MAX_ALIGN_BYTES on AVX-512 builds; torch allocates so too
_HUGE = 2 << 20  # one x86 huge page: large buffers start on one, so every page of them can be huge
_ROWS = 64  # source rows per transposed strip: 64 destination columns = one 256-byte run per row
_COLS = 1024  # source columns per strip (256 KiB of float32) = destination rows per work item
_CHUNK = _HUGE  # bytes per work item of a plain copy: one huge page, faulted by one thread only
_SMALL = 1 << 22  # bytes: below this one copy and one check beat blocking and threads
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_BLAS = (np.dtype(np.float32), np.dtype(np.float64))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_pool_pid = 0  # a forked child inherits the pool object but not its threads: it needs its own


def _workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))  # memory bandwidth, not cores, bounds a copy beyond a few threads


def _run(tasks: list[Callable[[], int]]) -> int:
    """Run the tasks (each returns a non-finite count) on the shared pool; their total.

    numpy releases the GIL inside copies and reductions, so threads fill separate huge pages
    in parallel: the kernel's zero-filling of fresh pages then runs on every core.
    """
    if _workers() == 1 or len(tasks) == 1:
        return sum(_quiet(t) for t in tasks)
    try:
        return sum(_executor().map(_quiet, tasks))
    except RuntimeError:  # no new threads after interpreter shutdown (an atexit hook): serial
        return sum(_quiet(t) for t in tasks)


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:  # two threads' first copies must not each start a pool
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_workers(), thread_name_prefix="dense_bridge_copy")
            _pool_pid = os.getpid()
        return _pool


def _quiet(task: Callable[[], int]) -> int:
    """Run a task without overflow/invalid warnings: a sum of huge finite values may overflow
    (then counted exactly), Inf + -Inf gives NaN; neither is an error. Per thread, as numpy's
    error state is."""
    with np.errstate(over="ignore", invalid="ignore"):
        return task()


def is_aligned(array: np.ndarray, align: int = ALIGN) -> bool:
    """Does ``array``'s data start on an ``align``-byte boundary."""
    return array.ctypes.data % align == 0


def empty(shape: Sequence[int], dtype) -> np.ndarray:
    """A new writable C-contiguous array starting on a 64-byte boundary (huge-page boundary
    for large ones).

    Allocated by numpy (huge pages for large buffers), so whoever ends up holding it, through
    ``torch.from_numpy`` or a DLPack capsule, keeps the memory alive and frees it.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    align = _HUGE if nbytes >= _SMALL else ALIGN
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _raw(array: np.ndarray) -> np.ndarray:
    """The same memory as unsigned integers of the same width: copies then move bits only."""
    bits = _BITS.get(array.dtype.itemsize)
    return array if bits is None or array.dtype == bits else array.view(bits)


def _accumulator(dtype: np.dtype):
    """Sum dtype for the finiteness test, or None for dtypes that cannot hold NaN/Inf."""
    if dtype == bool or np.issubdtype(dtype, np.integer):
        return None
    return np.float64 if dtype == np.float64 else np.float32


def count_nonfinite(value: np.ndarray) -> int:
    """Number of NaN/Inf entries, found with one allocation-free pass in the common case.

    A sum is finite only if every term is (NaN and Inf propagate); only when it is not do we
    pay for the elementwise check, which also tells a real NaN from an overflowing sum.
    Large float32/64 arrays take BLAS row sums (x @ ones, on BLAS's threads, without the GIL):
    2.5x numpy's pairwise sum here.
    """
    acc = _accumulator(value.dtype)
    if acc is None or value.size == 0:
        return 0
    if value.nbytes >= _SMALL and value.dtype in _BLAS and value.ndim >= 1:
        # finiteness does not depend on the layout: read the memory in its own order
        rows = value if value.flags.c_contiguous else value.T if value.flags.f_contiguous else None
        width = None if rows is None else rows.shape[-1] if rows.shape[-1] <= 16384 else \
            _COLS if rows.size % _COLS == 0 else None  # bounded: a ones vector is kept per width
        if width is not None:
            return _quiet(lambda: _block_nonfinite(rows.reshape(-1, width)))
    return _quiet(lambda: _small_nonfinite(value))


def count_nonfinite_later(value: np.ndarray) -> Future:
    """:func:`count_nonfinite` on a worker thread: a Future of the count.

    The scan runs while the caller goes on (e.g. while MLX copies the same array into its own
    memory, a copy that holds the GIL but leaves a core and memory bandwidth free). Small
    arrays are scanned at once: a thread hand-off would cost more than the scan.
    """
    if value.nbytes < _SMALL:
        done: Future = Future()
        done.set_result(count_nonfinite(value))
        return done
    try:
        return _executor().submit(count_nonfinite, value)
    except RuntimeError:  # no new threads after interpreter shutdown: scan now
        done = Future()
        done.set_result(count_nonfinite(value))
        return done


def _small_nonfinite(value: np.ndarray) -> int:
    """count_nonfinite with numpy's own sum (callers silence overflow warnings)."""
    acc = _accumulator(value.dtype)
    if acc is None or value.size == 0 or np.isfinite(np.sum(value, dtype=acc)):
        return 0
    return int(value.size - np.count_nonzero(np.isfinite(value.astype(acc, copy=False))))


@functools.lru_cache(maxsize=8)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    out = np.ones(n, dtype)
    out.flags.writeable = False
    return out


def _block_nonfinite(block: np.ndarray) -> int:
    """count_nonfinite of a block just read (in cache), with a fast test for the common case.

    float32/64 use BLAS row sums (block @ ones: NaN and Inf propagate through x*1 + acc), 4x
    faster than numpy's pairwise sum; only a non-finite row sum (a NaN, an Inf or an
    overflowing sum) pays for the exact elementwise count.
    """
    if block.dtype in _BLAS and block.ndim == 2 and block.strides[-1] == block.itemsize:
        if np.isfinite(block @ _ones(block.shape[1], block.dtype)).all():
            return 0
        return int(block.size - np.count_nonzero(np.isfinite(block)))
    return _small_nonfinite(block)


def _plain_tasks(out: np.ndarray, src: np.ndarray, check: bool) -> list[Callable[[], int]]:
    """out = src (both C-contiguous) in huge-page work items; each 256 KiB piece is checked
    right after it is copied, while it is in L1/L2."""
    flat_out, flat_src = _raw(out).reshape(-1), _raw(src).reshape(-1)
    values = src.reshape(-1)
    step = max(1, _CHUNK // src.itemsize)
    piece = _ROWS * _COLS

    def chunk(start: int) -> int:
        stop = min(start + step, flat_src.size)
        if not check:
            np.copyto(flat_out[start:stop], flat_src[start:stop])
            return 0
        bad = 0
        for lo in range(start, stop, piece):
            hi = min(lo + piece, stop)
            np.copyto(flat_out[lo:hi], flat_src[lo:hi])
            part = values[lo:hi]
            # 64 x 1024 blocks: small enough that BLAS runs them on this thread (a large gemv
            # would start BLAS's own threads on top of ours)
            bad += _block_nonfinite(part.reshape(_ROWS, _COLS)) if part.size == piece else _small_nonfinite(part)
        return bad

    return [functools.partial(chunk, s) for s in range(0, flat_src.size, step)]


def _transposed_tasks(out: np.ndarray, swapped: np.ndarray, check: bool) -> list[Callable[[], int]]:
    """out (..., R, C) = swapped (..., C, R) transposed; ``swapped`` is C-contiguous.

    Strips of 64 x 1024 source elements are written as 1024 x 64 destination blocks: every
    source line is read once and every destination line written in full 256-byte runs, all
    inside L2. A work item is 1024 destination rows, so threads fault separate pages.
    """
    raw_out, raw_src = _raw(out), _raw(swapped)

    def rows(index: tuple, j: int) -> int:
        o, s, v = raw_out[index], raw_src[index], swapped[index]
        bad = 0
        for i in range(0, s.shape[0], _ROWS):
            o[j:j + _COLS, i:i + _ROWS] = s[i:i + _ROWS, j:j + _COLS].T
            if check:
                bad += _block_nonfinite(v[i:i + _ROWS, j:j + _COLS])
        return bad

    return [functools.partial(rows, index, j) for index in np.ndindex(*swapped.shape[:-2])
            for j in range(0, swapped.shape[-1], _COLS)]


def _swapped_contiguous(view: np.ndarray) -> bool:
    """Is ``view`` a C-contiguous array with its last two axes swapped (e.g. torch's W.T)."""
    return view.ndim >= 2 and view.swapaxes(-1, -2).flags.c_contiguous


def native_copy(src: np.ndarray, perm: Sequence[int] | None = None, *,
                check_finite: bool = False) -> tuple[np.ndarray, int]:
    """A fresh 64-byte aligned C-contiguous copy of ``src.transpose(perm)``, bit for bit,
    and its number of NaN/Inf entries (0 unless ``check_finite``).

    ``src`` may be any view, of any framework's memory: it is only read.
    """
    src = np.asarray(src)
    view = src if perm is None else src.transpose(tuple(perm))
    out = empty(view.shape, view.dtype)
    if view.nbytes < _SMALL:
        np.copyto(_raw(out), _raw(view))
        return out, _quiet(lambda: _small_nonfinite(view)) if check_finite else 0
    if view.flags.c_contiguous:
        return out, _run(_plain_tasks(out, view, check_finite))
    if _swapped_contiguous(view):
        return out, _run(_transposed_tasks(out, view.swapaxes(-1, -2), check_finite))
    np.copyto(_raw(out), _raw(view))  # other strides: rare (slices of slices); numpy's general copy
    return out, count_nonfinite(out) if check_finite else 0
