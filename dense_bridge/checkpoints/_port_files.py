"""The bytes of a port (dense_bridge/ports/): weight files streamed through the one safetensors
writer and the one atomic writer, small files copied and written, files hashed, a whole output
directory built beside its target and moved into place at the end.

Nothing here knows a model or a library: the port hands names, tensors (as
:class:`~dense_bridge.checkpoints._safetensors.PendingTensor`) and paths.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from typing import Callable, Mapping

from .._errors import CheckpointError
from ._io import AtomicFiles, replace_directory, replace_files
from ._safetensors import PendingTensor, open_readonly, read_json_file, write_safetensors

__all__ = ["Hashes", "sha256_file", "write_weights", "write_json", "copy_file", "new_output_dir", "finish_output_dir",
           "discard_dir", "read_json", "free_bytes"]

_CHUNK = 8 << 20


def sha256_file(path: str) -> str:
    """The sha256 hex digest of the file ``path`` (read in 8 MB chunks); CheckpointError naming it."""
    h = hashlib.sha256()
    try:
        fd = open_readonly(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    return h.hexdigest()


class Hashes:
    """sha256 of files computed in background threads (hashlib releases the GIL), so hashing the
    source overlaps the twins and hashing each written shard overlaps writing the next one."""

    def __init__(self, workers: int = 2) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dense-bridge-sha256")
        self._jobs: dict = {}

    def add(self, key, path: str) -> None:
        if key not in self._jobs:
            self._jobs[key] = self._pool.submit(sha256_file, path)

    def get(self, key) -> str:
        return self._jobs[key].result()

    def forget(self, key) -> None:
        """Drop ``key``'s hash (its file was rewritten: the next ``add`` hashes it again)."""
        self._jobs.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def write_weights(path: str, tensors: Mapping[str, PendingTensor], metadata: Mapping[str, str] | None,
                  on_tensor: Callable[[str, int], None] | None = None) -> int:
    """A safetensors file at ``path`` written through :class:`AtomicFiles` (temporary, fsync,
    rename), each tensor produced when its turn comes; returns the bytes written."""
    with AtomicFiles(path) as tx:
        with open(tx.temp_for(path, ".safetensors"), "wb") as f:
            return write_safetensors(f, tensors, metadata, on_tensor=on_tensor)


def write_json(path: str, value) -> None:
    """``value`` as indented JSON at ``path``, atomically."""
    with AtomicFiles(path) as tx:
        with open(tx.temp_for(path), "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, sort_keys=False)
            f.write("\n")


def read_json(path: str, what: str):
    """A small JSON object file, read the safe way (``read_json_file``)."""
    return read_json_file(path, what)


def copy_file(src: str, dst: str) -> None:
    """The bytes of ``src`` (a regular file, symlinks followed: a cache snapshot's blobs) at ``dst``, atomically."""
    try:
        fd = open_readonly(src)
    except OSError as exc:
        raise CheckpointError(f"cannot read {src}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb", closefd=True) as fin, AtomicFiles(dst) as tx:
        with open(tx.temp_for(dst), "wb") as fout:
            shutil.copyfileobj(fin, fout, _CHUNK)


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem holding ``path`` (None where unknown)."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def new_output_dir(out: str) -> str:
    """A fresh, empty directory beside ``out`` (``.<name>.port-<random>``) to build it in."""
    parent = os.path.dirname(os.path.abspath(out)) or "."
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.port-{secrets.token_hex(4)}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as exc:
        raise CheckpointError(f"cannot create a directory beside {out}: {exc.strerror or exc}") from None
    return tmp


def discard_dir(path: str) -> None:
    """Remove a directory this port built (on failure, or the output it replaced)."""
    shutil.rmtree(path, ignore_errors=True)


def finish_output_dir(tmp: str, out: str, *, overwrite: bool) -> None:
    """``tmp`` becomes ``out`` in one rename; an existing ``out`` (``overwrite``) is moved aside
    first and removed after."""
    previous = None
    empty = os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)
    if os.path.lexists(out) and not empty:  # an empty directory is replaced by the rename itself
        if not overwrite:
            raise CheckpointError(f"{out} appeared while the port ran: refused to replace it (nothing was written)")
        previous = os.path.join(os.path.dirname(tmp), os.path.basename(tmp) + ".old")
    try:
        replace_directory(tmp, out, previous=previous)
    except OSError as exc:
        raise CheckpointError(f"cannot move the finished port into {out}: {exc.strerror or exc}") from None
    if previous is not None:
        if os.path.isdir(previous) and not os.path.islink(previous):
            discard_dir(previous)
        else:
            os.remove(previous)


def finish_output_file(tmp: str, out: str, certificate: str, *, overwrite: bool) -> None:
    """A one-file port built in the directory ``tmp`` (the file named as ``out``, and
    ``port_certificate.json``) moved into place: the certificate to ``certificate``, then the file
    to ``out`` (each one rename), then ``tmp`` removed. An existing ``out`` is replaced only with
    ``overwrite``."""
    name = os.path.join(tmp, os.path.basename(out))
    for path in (out, certificate):
        if os.path.lexists(path) and not overwrite:
            raise CheckpointError(f"{path} appeared while the port ran: refused to replace it (nothing was written)")
    try:
        replace_files([(os.path.join(tmp, "port_certificate.json"), certificate), (name, out)])
    except OSError as exc:
        raise CheckpointError(f"cannot move the finished port into {out}: {exc.strerror or exc}") from None
    discard_dir(tmp)
