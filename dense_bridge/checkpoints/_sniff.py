"""A file's first bytes, and which backend's declared format holds it, read the safe way.

For callers that must look at a file before deciding what it is (the command line: a spec
JSON file or a checkpoint; which framework a file belongs to) without opening it themselves:
``open_readonly`` refuses a FIFO or a device instead of waiting on it.
"""
from __future__ import annotations

import os

from .._errors import DenseBridgeError
from ..registry._manifest import Probe
from ._native import identify
from ._guard import input_file
from ._safetensors import open_readonly, read_at

__all__ = ["read_head", "file_backend"]

#: bytes a format's ``sniff`` is shown (magic numbers, a safetensors header length, a zip header)
PROBE_BYTES = 64


def read_head(path: str, n: int) -> tuple[bytes, int]:
    """(the first ``n`` bytes of the regular file ``path``, its size in bytes).

    CheckpointError for a FIFO, device or directory; OSError as the OS raises it (no such file).
    """
    fd = open_readonly(path)
    try:
        return read_at(fd, n, 0), os.fstat(fd).st_size
    finally:
        os.close(fd)


def file_backend(path: str | None) -> str | None:
    """The backend whose declared format holds the file at ``path``, judged by its first bytes;
    None when it is no native file or cannot be read (the caller reports that itself)."""
    if not path or not os.path.isfile(path):
        return None
    try:
        head, size = read_head(path, PROBE_BYTES)
        return identify(Probe(path, head, size, reopen=lambda: input_file(path, what="checkpoint file")))[0]
    except (OSError, DenseBridgeError):
        return None
