"""``.npz`` archives read the safe way: every record's header checked before any array is made.

An ``.npz`` is a zip of ``.npy`` records. ``np.load`` trusts each record's header: a few bytes
claiming a (10**6, 10**6) float64 array make it allocate 8 TB before it notices the data is
missing, and a plain ``.npy`` given where an archive is expected comes back as an array rather
than a dict. Here the archive is opened the safe way (a FIFO or device refused), each record's
header is read alone and must describe exactly the bytes the zip says it holds (no object
arrays: no pickles), and the total must fit the memory available (MemAvailable), before
anything is read.
"""
from __future__ import annotations

import math
import os
import zipfile
from typing import Callable

import numpy as np

from ..params._memory_budget import available_memory
from ._guard import input_file

__all__ = ["npz_records", "read_npz"]

_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_NPY_MAGIC = b"\x93NUMPY"


def npz_records(path: str, error: Callable[[str], Exception], handle=None
                ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Record name (without ``.npy``) -> (shape, dtype) of the archive ``path``, every header
    checked as the module docstring says; ``error(reason)`` is raised otherwise. ``handle``: the
    archive already opened by :func:`input_file` (it stays open), else ``path`` is opened here."""
    if handle is not None:
        return _records_of(handle, error)
    with input_file(path, what="npz archive") as f:
        return _records_of(f, error)


def _records_of(f, error) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    f.seek(0)
    head = f.read(len(_NPY_MAGIC))
    f.seek(0)
    if head == _NPY_MAGIC:
        raise error("it is a single .npy array, not an .npz archive of named arrays (np.savez writes one)")
    try:
        with zipfile.ZipFile(f) as z:
            return _records(z, error)
    except zipfile.BadZipFile:
        raise error("it is not an .npz archive (a zip of .npy arrays, as np.savez writes)") from None
    except (OSError, EOFError, ValueError, SyntaxError, NotImplementedError) as exc:
        text = " ".join(str(exc).split())[:200]
        raise error(f"a damaged .npz archive ({type(exc).__name__}: {text})") from None


def _records(z: zipfile.ZipFile, error) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    out, total = {}, 0
    for info in z.infolist():
        if not info.filename.endswith(".npy"):
            raise error(f"member {info.filename!r} is not an .npy array")
        with z.open(info) as member:
            version = np.lib.format.read_magic(member)
            read_header = _HEADER_READERS.get(version)
            if read_header is None:
                raise error(f"member {info.filename!r} has .npy version {version}, not 1.0 or 2.0")
            shape, _, dtype = read_header(member)
            header_bytes = member.tell()
        if not all(type(n) is int and n >= 0 for n in shape):
            raise error(f"member {info.filename!r} claims the shape {shape!r:.80}")
        if dtype.hasobject:
            raise error(f"member {info.filename!r} holds Python objects (dtype {dtype}), not numbers")
        nbytes = math.prod(shape) * dtype.itemsize
        if header_bytes + nbytes != info.file_size:
            raise error(f"member {info.filename!r} claims {shape} {dtype} ({nbytes:,} bytes) but holds "
                        f"{max(info.file_size - header_bytes, 0):,}")
        total += nbytes
        out[info.filename[:-len(".npy")]] = (tuple(shape), dtype)
    available = available_memory()
    if available is not None and total > available:
        raise error(f"its arrays need {total:,} bytes but only {available:,} bytes of memory are available "
                    "(MemAvailable)")
    return out


def read_npz(path: str, error: Callable[[str], Exception]) -> dict[str, np.ndarray]:
    """Every array of the archive ``path``, after :func:`npz_records` checked it."""
    with input_file(path, what="npz archive") as f:  # checked and read from one descriptor
        npz_records(path, error, f)
        try:
            f.seek(0)
            with np.load(f, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise error(f"a damaged .npz archive ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
