"""The one way the library opens a file it reads: inside its folder, regular, bounded.

Every reader (safetensors, JSON, npz, and the adapters' HDF5, ONNX, torch, MLX, Flax and
Equinox files) opens its input here, so every input gets the same checks, in this order:

1. ``inside`` (a model or adapter directory): the path, symlinks resolved, must lie in it; a
   symlink out of the folder is refused before anything is opened, and on Linux the descriptor
   actually opened is checked again (``/proc/self/fd``), so a swap after the first check
   cannot slip a file from elsewhere in;
2. opened ``O_RDONLY | O_NONBLOCK`` (a FIFO or a device cannot block the open), then refused
   unless ``fstat`` of the descriptor says it is a regular file (a directory named like a weight
   file, a FIFO, ``/dev/zero``, a socket): checked on the descriptor, not the name;
3. ``limit`` bytes at most, and with ``whole=True`` (the reader holds the file's bytes at once)
   no more than the memory available (``MemAvailable``);
4. every ``OSError`` becomes a ``CheckpointError`` naming the file and what it was read as.

Libraries that insist on opening a path themselves (h5py, torch.load with ``mmap``, mx.load)
get :func:`input_path`: the descriptor is opened and checked here and the library is handed
``/proc/self/fd/N``, which re-opens that same inode (not the name again), so nothing can be
swapped in between the check and the library's open. Where ``/proc/self/fd`` does not exist
(not Linux) the checked name is handed over instead.
"""
from __future__ import annotations

import contextlib
import os
import stat
from typing import Iterator

from .._errors import CheckpointError
from ..params._memory_budget import available_memory

__all__ = ["open_input", "input_path", "input_file", "open_readonly", "file_kind", "check_inside"]

_FD_DIR = "/proc/self/fd"


def file_kind(mode: int) -> str:
    """Words for a non-regular file's type (FIFO, device, directory, socket)."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def open_readonly(path: str) -> int:
    """A read-only descriptor of the regular file ``path``: the bare primitive under
    :func:`open_input`, for callers that tell a missing file from a bad one themselves.

    Opened with O_NONBLOCK so a FIFO or a device cannot block the open, then refused with a
    CheckpointError unless ``fstat`` says it is a regular file (checked on the descriptor, not
    the name). OSError (FileNotFoundError included) as the OS raises it otherwise.
    """
    return _open_regular(path, path)


def _open_regular(path: str, label: str) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"cannot read {label}: it is {file_kind(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _within(real: str, folder: str) -> bool:
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def check_inside(path: str, inside: str, what: str) -> None:
    """CheckpointError unless ``path`` (symlinks resolved) lies in the folder ``inside``."""
    folder = os.path.realpath(inside)
    real = os.path.realpath(path)
    if not _within(real, folder):
        raise CheckpointError(f"cannot read the {what} {path}: it resolves to {real}, outside the folder "
                              f"{inside} it was read from (a symlink out of the folder is refused)")


def open_input(path: str | os.PathLike, *, what: str, inside: str | os.PathLike | None = None,
               limit: int | None = None, whole: bool = False) -> int:
    """A checked read-only descriptor of the file ``path`` (the caller closes it).

    Args:
        path: the file to read.
        what: what it is read as ("safetensors file", "Keras .weights.h5 file"): in every message.
        inside: a folder (model or adapter directory) the file must lie in, symlinks resolved.
        limit: the most bytes the file may hold.
        whole: the reader holds all of the file's bytes at once: refused above the memory available.

    Returns:
        A blocking, read-only descriptor of a regular file, positioned at 0.

    Raises:
        CheckpointError naming the file and ``what``: missing, unreadable, not a regular file,
        outside ``inside``, larger than ``limit`` or than the memory available.
    """
    path = os.fspath(path)
    if inside is not None:
        check_inside(path, os.fspath(inside), what)
    try:
        fd = _open_regular(path, f"the {what} {path}")
    except OSError as exc:
        raise CheckpointError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    try:
        if inside is not None:
            _check_opened_inside(fd, path, os.fspath(inside), what)
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise CheckpointError(f"the {what} {path} holds {size:,} bytes, more than the {limit:,} allowed: refused")
        if whole:
            available = available_memory()
            if available is not None and size > available:
                raise CheckpointError(f"the {what} {path} holds {size:,} bytes, read whole, but only {available:,} "
                                      "bytes of memory are available (MemAvailable): refused")
    except OSError as exc:
        os.close(fd)
        raise CheckpointError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_opened_inside(fd: int, path: str, inside: str, what: str) -> None:
    """The descriptor's own path (Linux) lies in ``inside``: a swap after check_inside is caught."""
    link = os.path.join(_FD_DIR, str(fd))
    try:
        real = os.readlink(link)
    except OSError:
        return  # no /proc: check_inside's look before the open stands
    if real.endswith(" (deleted)"):
        real = real[:-len(" (deleted)")]
    if not _within(real, os.path.realpath(inside)):
        raise CheckpointError(f"cannot read the {what} {path}: the file opened is {real}, outside the folder "
                              f"{inside} it was read from")


@contextlib.contextmanager
def input_path(path: str | os.PathLike, *, what: str, inside: str | os.PathLike | None = None,
               limit: int | None = None, whole: bool = False) -> Iterator[str]:
    """A path for a library that opens files by name (h5py, torch.load, mx.load), to the file
    :func:`open_input` opened and checked: ``/proc/self/fd/N`` while the block runs (the same
    inode, whatever happens to the name), or the checked name where /proc is missing.

    Yields:
        The path to hand to the library; the descriptor is closed when the block ends.
    """
    fd = open_input(path, what=what, inside=inside, limit=limit, whole=whole)
    try:
        by_fd = os.path.join(_FD_DIR, str(fd))
        yield by_fd if os.path.exists(by_fd) else os.fspath(path)
    finally:
        os.close(fd)


@contextlib.contextmanager
def input_file(path: str | os.PathLike, *, what: str, inside: str | os.PathLike | None = None,
               limit: int | None = None, whole: bool = False):
    """A binary file object of the file :func:`open_input` opened and checked (closed at the end).

    Yields:
        ``io.BufferedReader`` positioned at 0.
    """
    fd = open_input(path, what=what, inside=inside, limit=limit, whole=whole)
    with os.fdopen(fd, "rb") as f:
        yield f
