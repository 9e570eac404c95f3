"""Memory pages behind numpy arrays (Linux ``madvise``): read ahead, and give back.

A checkpoint conversion reads its source through memory maps. Two hints make that fast and
small: ``prefetch`` asks the kernel to start reading a tensor's file pages now, in the
background, so the copy that follows finds them in the page cache instead of faulting them
in one at a time (random order, for a transposing copy); ``release_file_pages`` drops a
tensor's pages once it is written, so a conversion never holds the whole source resident.
Both are hints: off Linux, or where ``madvise`` refuses, nothing happens and values never change.
"""
from __future__ import annotations

import mmap
import sys

import numpy as np

_MADV_WILLNEED = 3  # Linux
_MADV_DONTNEED = 4  # Linux
_libc = None


def _madvise():
    """libc's ``madvise`` (None off Linux), loaded once."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.madvise


def byte_bounds(a: np.ndarray) -> tuple[int, int]:
    """(first byte address, one past the last) of the memory ``a`` spans, any strides."""
    try:
        from numpy.lib.array_utils import byte_bounds as bounds  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        bounds = np.byte_bounds
    return bounds(a)


def prefetch(a: np.ndarray) -> None:
    """Start reading the pages behind ``a`` in the background (``MADV_WILLNEED``).

    For a file mapping the kernel queues reads of the whole range and returns; for anonymous
    memory it is a no-op. Used one tensor ahead of the one being copied.
    """
    advise = _madvise()
    if advise is None or not isinstance(a, np.ndarray) or a.size == 0:
        return
    import ctypes

    lo, hi = byte_bounds(a)
    start = lo // mmap.PAGESIZE * mmap.PAGESIZE  # madvise wants a page-aligned start
    advise(ctypes.c_void_p(start), ctypes.c_size_t(hi - start), _MADV_WILLNEED)


def _private_file_mappings() -> list[tuple[int, int]]:
    """(start, end) of every private file mapping of this process (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            maps = [line.split(maxsplit=5) for line in f]
    except OSError:
        return []
    found = []
    for parts in maps:
        if len(parts) == 6 and parts[5].startswith("/") and parts[1][3] == "p":
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            found.append((lo, hi))
    return found


class FileMappings:
    """The private file mappings, read from /proc/self/maps once and again only when a range is
    not found in what was read (a mapping made since): a process with a large framework loaded
    has thousands of mappings, and a conversion releases pages once per tensor."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] | None = None

    def holds(self, start: int, end: int) -> bool:
        for fresh in (False, True):
            if self._ranges is None or fresh:
                self._ranges = _private_file_mappings()
            if any(lo <= start and end <= hi for lo, hi in self._ranges):
                return True
        return False


def release_file_pages(arrays, mappings: FileMappings | None = None) -> int:
    """Drop the resident pages behind ``arrays`` where they lie in a private FILE mapping (Linux).

    Clean pages of a private file mapping are a cache of the file: ``madvise(MADV_DONTNEED)``
    frees them and a later read faults them back in from the file, so the arrays' values never
    change; this only lowers resident memory. Anonymous memory (whose pages that call would
    zero) and shared mappings are never touched: each page range is checked against
    /proc/self/maps first (``mappings``: a :class:`FileMappings` reused across calls). Returns
    the bytes released (0 off Linux).
    """
    advise = _madvise()
    if advise is None or not arrays:
        return 0
    import ctypes

    mappings = mappings or FileMappings()
    page = mmap.PAGESIZE
    released = 0
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.size == 0:
            continue
        lo, hi = byte_bounds(a)
        start, end = -(-lo // page) * page, (hi // page) * page  # whole pages inside the array only
        if end <= start or not mappings.holds(start, end):
            continue
        if advise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0:
            released += end - start
    return released
