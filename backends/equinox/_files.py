"""Equinox's own checkpoint files: ``eqx.tree_serialise_leaves``; the ``file_info``/``read_file``/``write_file`` verbs.

``eqx.tree_serialise_leaves(path, model)`` writes the model's array leaves one after another as
``.npy`` records, in ``jax.tree_util`` leaf order, with no names (the Equinox format: the model's
structure is the template you deserialise into). ``file_info`` therefore names the records by
position ("leaf.0", "leaf.1", ...), read with ``np.load`` record by record; ``read_file`` checks
them against the template's leaves the same way, then ``eqx.tree_deserialise_leaves``. The bool
masks are leaves too and travel with the file. No metadata slot: a spec must come from the caller.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

import equinox as eqx
import jax
import numpy as np

from dense_bridge._errors import CheckpointError, first_line
from dense_bridge.checkpoints._safetensors import open_readonly

Entries = dict  # name -> (native shape, dtype name)
KINDS = ("eqx",)


#: np.save writes version 1.0 (2.0 for headers over 64 KiB); numpy's readers for each
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_NOT_RECORDS = "cannot read {path} as an Equinox file (eqx.tree_serialise_leaves records)"


def _records(path: str) -> Entries:
    """Every record's (shape, dtype) from its .npy header alone: nothing is allocated, each
    record's data must lie inside the file (a header claiming more than the file holds is refused
    before anything reads it: a 2 KB file may not cost gigabytes), and object arrays are refused."""
    out = {}
    bad = _NOT_RECORDS.format(path=path)
    try:
        with os.fdopen(open_readonly(path), "rb") as f:  # a FIFO or a device is refused, never waited on
            size = f.seek(0, 2)
            f.seek(0)
            while f.tell() < size:
                where = f"record {len(out)} at byte {f.tell()}"
                version = np.lib.format.read_magic(f)
                read_header = _HEADER_READERS.get(version)
                if read_header is None:
                    raise CheckpointError(f"{bad}: {where}: unsupported .npy version {version}")
                shape, _, dtype = read_header(f)  # numpy caps the header at 10000 bytes
                # a negative dimension would make the byte count negative and the seek below go
                # back, reading the same records forever
                if not all(type(d) is int and 0 <= d for d in shape) or len(shape) > 32:
                    raise CheckpointError(f"{bad}: {where}: its header claims the shape {shape!r:.80}, not a list of "
                                          "non-negative integers")
                if dtype.hasobject:
                    raise CheckpointError(f"{bad}: {where}: holds Python objects (dtype {dtype}), not numbers")
                nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if f.tell() + nbytes > size:
                    raise CheckpointError(f"{bad}: {where}: its header claims {tuple(shape)} {dtype} ({nbytes} bytes) "
                                          f"but only {size - f.tell()} bytes are left in the file")
                f.seek(nbytes, 1)
                out[f"leaf.{len(out)}"] = (tuple(int(d) for d in shape), dtype.name)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} as an Equinox file: {first_line(exc)}") from None
    except (ValueError, EOFError, SyntaxError, TypeError) as exc:
        raise CheckpointError(f"{bad}: {first_line(exc)}") from None
    return out


def _expected(template) -> Entries:
    leaves = [l for l in jax.tree_util.tree_leaves(template) if eqx.is_array(l)]
    return {f"leaf.{i}": (tuple(l.shape), np.dtype(l.dtype).name) for i, l in enumerate(leaves)}


def file_info(path: str, container: str, *, files=None) -> tuple[Entries, dict[str, str]]:
    """("leaf.<i>" -> (shape, dtype name), {}) of an eqx.tree_serialise_leaves file."""
    return _records(path), {}


def read_file(path: str, container: str, template, *, files=None, check: Callable[[Entries, Entries], None],
              borrow: bool = False):
    """A model like ``template`` holding the file's leaves (Equinox modules are immutable: a new one)."""
    if template is None:
        raise CheckpointError(f"{path}: Equinox files need the model's structure (spec= or like=)")
    check(_records(path), _expected(template))
    try:
        return eqx.tree_deserialise_leaves(path, template)
    except Exception as exc:  # noqa: BLE001 - equinox raises RuntimeError/ValueError for bad files
        raise CheckpointError(f"cannot load {path} into the Equinox model: {first_line(exc)}") from None


def write_file(model, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    """``eqx.tree_serialise_leaves(temp, model)`` (renamed to ``path`` by the core)."""
    if kind != "eqx":
        raise CheckpointError(f"cannot write {path}: Equinox writes eqx.tree_serialise_leaves files (.eqx), "
                              f"not {kind!r}")
    with open(temp, "wb") as f:
        eqx.tree_serialise_leaves(f, model)
