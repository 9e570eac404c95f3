"""Opening the files behind a checkpoint path consistently against concurrent saves: which kind
a file is by content (:func:`open_sniffed`: "safetensors", a JSON "index", or "native" for the
backends' declared formats), what the formats' ``sniff`` see of it (:func:`probe`), and an
index's shards, each opened once (:func:`open_shards`). :class:`Changed` says a concurrent save
replaced what was being read, so the reader (``_load``) starts over.
"""
from __future__ import annotations

import os

from .._errors import CheckpointError
from ._guard import input_file
from ._safetensors import MAX_HEADER, SafetensorsFile, is_safetensors, open_readonly, parse_json_object, read_at

__all__ = ["Changed", "open_sniffed", "probe", "read_all", "open_shards"]


class Changed(Exception):
    """What was being read was replaced or removed by a concurrent save: read it again."""


def open_sniffed(path: str) -> tuple[str, int]:
    """(kind, open descriptor) of the file at ``path``, judged by content: "safetensors",
    "index" (a JSON index), or "native" (for the backends' declared formats to recognise:
    ``_native.identify``). The caller owns the descriptor."""
    if os.path.isdir(path):
        raise CheckpointError(f"cannot read {path}: it is a directory; give a checkpoint file "
                              "(model.safetensors, model.safetensors.index.json, ...)")
    try:
        fd = open_readonly(path)  # refuses FIFOs and devices without blocking
    except FileNotFoundError:
        raise CheckpointError(f"cannot read {path}: no such file or directory") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return _kind(path, fd), fd
    except BaseException:
        os.close(fd)
        raise


def _head(path: str, fd: int) -> tuple[bytes, int]:
    """(the first 64 bytes, the size) of the open file."""
    try:
        return read_at(fd, 64, 0), os.fstat(fd).st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None


def _kind(path: str, fd: int) -> str:
    head, size = _head(path, fd)
    if size == 0:
        raise CheckpointError(f"cannot read {path}: the file is empty (0 bytes)")
    if is_safetensors(head, size):
        return "safetensors"
    if head.lstrip()[:1] == b"{":
        return "index"
    return "native"


def probe(path: str, files: list[SafetensorsFile], fd: int | None = None):
    """What the backends' declared formats sniff (``_manifest.Probe``): the head of the file, or
    the opened safetensors files' metadata and tensor names."""
    from ..registry._manifest import Probe

    if fd is not None:
        head, size = _head(path, fd)
        return Probe(path, head, size, reopen=lambda: input_file(path, what="checkpoint file"))
    return Probe(path, b"", 0, metadata=dict(files[0].metadata) if files else {},
                 tensor_names=[n for f in files for n in f.tensors])


def read_all(path: str, fd: int) -> bytes:
    """The whole (index) file; refused beyond MAX_HEADER bytes, the limit a safetensors header has."""
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER:
            raise CheckpointError(f"cannot read {path}: a JSON index of {size} bytes is larger than the "
                                  f"{MAX_HEADER}-byte limit")
        return read_at(fd, size, 0)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None



def open_shards(path: str, raw: bytes) -> tuple[dict, dict[str, SafetensorsFile]]:
    """(index, shard file name -> opened shard) of the index at ``path`` whose bytes are ``raw``.

    Changed when a shard is missing and the index reads other bytes than ``raw`` (a save replaced it).
    """
    index = parse_json_object(raw, lambda why: CheckpointError(f"cannot read {path}: not a valid JSON index "
                                                                f"({why})"), "index")
    if not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"cannot read {path}: a JSON file but not a checkpoint index (no \"weight_map\")")
    d = os.path.dirname(path)
    files: dict[str, SafetensorsFile] = {}
    try:
        for name, fname in index["weight_map"].items():
            if not isinstance(fname, str) or not fname or os.path.basename(fname) != fname:
                raise CheckpointError(f"cannot read {path}: weight_map[{name!r}] must be a file name beside the "
                                      "index")
            if fname not in files:
                files[fname] = _open_shard(path, raw, os.path.join(d, fname), fname)
            if name not in files[fname].tensors:
                raise CheckpointError(f"cannot read {path}: the index maps {name!r} to {fname}, which does not "
                                      "hold it")
        for fname, f in files.items():
            extra = [n for n in f.tensors if index["weight_map"].get(n) != fname]
            if extra:
                raise CheckpointError(f"cannot read {path}: shard {fname} holds tensors the index does not list: "
                                      f"{extra}")
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return index, files


def _open_shard(path: str, raw: bytes, full: str, fname: str) -> SafetensorsFile:
    """The shard ``fname`` of the index at ``path``; errors name the index and the shard."""
    try:
        fd = open_readonly(full)
    except FileNotFoundError:
        if _read_index_again(path) != raw:
            raise Changed() from None  # a save replaced the index (and removed its old shards)
        raise CheckpointError(f"cannot read {path}: its shard {fname} is missing (expected at {full})") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: its shard {full}: {exc.strerror or exc}") from None
    except CheckpointError as exc:
        raise CheckpointError(f"cannot read {path}: its shard {exc}") from None
    try:
        return SafetensorsFile(full, fd=fd)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot read {path}: its shard {exc}") from None


def _read_index_again(path: str) -> bytes | None:
    """The index's bytes now (None when unreadable): has a concurrent save replaced it?"""
    try:
        fd = open_readonly(path)
    except (OSError, CheckpointError):
        return None
    try:
        size = os.fstat(fd).st_size
        return read_at(fd, size, 0) if size <= MAX_HEADER else None
    except OSError:
        return None
    finally:
        os.close(fd)
