"""Equinox's own checkpoint files: ``eqx.tree_serialise_leaves``; the ``file_info``/``read_file``/``write_file`` verbs.

``eqx.tree_serialise_leaves(path, model)`` writes the model's array leaves one after another as
``.npy`` records, in ``jax.tree_util`` leaf order, with no names (the Equinox format: the model's
structure is the template you deserialise into). ``file_info`` therefore names the records by
position ("leaf.0", "leaf.1", ...), read with ``np.load`` record by record; ``read_file`` checks
them against the template's leaves the same way, then ``eqx.tree_deserialise_leaves``. The bool
masks are leaves too and travel with the file. No metadata slot: a spec must come from the caller.

``file_views`` serves the records without any model: the leaf order of what :func:`compile`
builds is known from the spec alone (per layer: weight, then bias, then mask; activations,
Identity and Flatten are static and hold no leaf), so each record is mapped in place.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from typing import Callable, Mapping

import equinox as eqx
import jax
import numpy as np

from dense_bridge._errors import CheckpointError, DenseBridgeError, first_line
from dense_bridge.checkpoints._native import FileViews, canonical_shapes
from dense_bridge.checkpoints._guard import input_file, open_input
from dense_bridge.specs import Bilinear, Dense, Sequential, layer_param_shapes

Entries = dict  # name -> (native shape, dtype name)
KINDS = ("eqx",)


#: np.save writes version 1.0 (2.0 for headers over 64 KiB); numpy's readers for each
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_NOT_RECORDS = "cannot read {path} as an Equinox file (eqx.tree_serialise_leaves records)"

#: What an Equinox file is read as, in messages.
_WHAT = "Equinox (eqx.tree_serialise_leaves) file"


def _records(path: str, offsets: dict | None = None, handle=None) -> Entries:
    """Every record's (shape, dtype) from its .npy header alone: nothing is allocated, each
    record's data must lie inside the file (a header claiming more than the file holds is refused
    before anything reads it: a 2 KB file may not cost gigabytes), and object arrays are refused."""
    out = {}
    bad = _NOT_RECORDS.format(path=path)
    try:
        with contextlib.nullcontext(handle) if handle is not None else input_file(path, what=_WHAT) as f:
            size = f.seek(0, 2)
            f.seek(0)
            while f.tell() < size:
                where = f"record {len(out)} at byte {f.tell()}"
                version = np.lib.format.read_magic(f)
                read_header = _HEADER_READERS.get(version)
                if read_header is None:
                    raise CheckpointError(f"{bad}: {where}: unsupported .npy version {version}")
                shape, fortran, dtype = read_header(f)  # numpy caps the header at 10000 bytes
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
                if offsets is not None:
                    offsets[f"leaf.{len(out)}"] = (f.tell(), dtype, fortran)
                f.seek(nbytes, 1)
                out[f"leaf.{len(out)}"] = (tuple(int(d) for d in shape), dtype.name)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} as an Equinox file: {first_line(exc)}") from None
    except (ValueError, EOFError, SyntaxError, TypeError) as exc:
        raise CheckpointError(f"{bad}: {first_line(exc)}") from None
    return out


def _plan(spec) -> list[tuple[str, tuple[int, ...]]] | None:
    """(canonical name, axes) of each leaf of the model :func:`compile` builds for ``spec``, in
    ``jax.tree_util`` leaf order (the order ``tree_serialise_leaves`` writes); None for a layer
    these rules do not describe. A DenseLinear holds weight (units, in) = kernel.T, bias, then the
    bool mask (units, in) = mask.T; a Bilinear weight (units, in1, in2) is the canonical kernel."""
    layers = spec.layers if isinstance(spec, Sequential) else [spec]
    plan = []
    for i, layer in enumerate(layers):
        prefix = f"{i}." if isinstance(spec, Sequential) else ""
        if isinstance(layer, Dense):
            plan.append((prefix + "kernel", (1, 0)))
            if layer.use_bias:
                plan.append((prefix + "bias", (0,)))
            if layer.mask is not None:
                plan.append((prefix + "mask", (1, 0)))
        elif isinstance(layer, Bilinear):
            plan.append((prefix + "kernel", (0, 1, 2)))
            if layer.use_bias:
                plan.append((prefix + "bias", (0,)))
        elif layer_param_shapes(layer):
            return None
    return plan


def file_views(path: str, container: str, spec, *, files=None, check: Callable[[Entries, Entries], None]):
    """Canonical views of an ``.eqx`` file for ``spec``, no Equinox model built: each record mapped
    where it lies (read-only), named by its position in the leaf order :func:`_plan` gives.
    ``check(got, expected)`` compares every record's shape and dtype first; a mask record (bool)
    is served in the weight's dtype, as ``get_params`` gives it."""
    order = _plan(spec)
    if order is None:
        return None
    shapes = canonical_shapes(spec)
    plan, expected, as_dtype = {}, {}, {}
    for i, (canonical, axes) in enumerate(order):
        shape, dtype = shapes[canonical]
        native = tuple(shape[a] for a in np.argsort(axes))
        name = f"leaf.{i}"
        plan[canonical] = (name, axes)
        is_mask = canonical.rsplit(".", 1)[-1] == "mask"
        expected[name] = (native, "bool" if is_mask else dtype)
        if is_mask:
            as_dtype[name] = dtype
    offsets: dict = {}
    check(_records(path, offsets), expected)
    mapped = _map_readonly(path) if offsets else None

    def read(name: str) -> np.ndarray:
        start, dtype, fortran = offsets[name]
        shape = expected[name][0]
        count = int(np.prod(shape, dtype=np.int64))
        flat = np.frombuffer(mapped, dtype=dtype, count=count, offset=start)
        array = flat.reshape(shape, order="F" if fortran else "C")
        if name in as_dtype:
            return array.astype(as_dtype[name])
        # a record np.save wrote on a big-endian machine: the same values in this machine's order
        return array if dtype.isnative else array.astype(dtype.newbyteorder("="))

    return FileViews(plan, read)


def _map_readonly(path: str) -> mmap.mmap:
    """The whole file mapped read-only, opened the safe way (a FIFO or a device refused)."""
    fd = open_input(path, what=_WHAT)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot map {path}: {first_line(exc)}") from None
    finally:
        os.close(fd)


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
    try:  # records checked and leaves read from one descriptor: a swap in between cannot pair two files
        with input_file(path, what=_WHAT) as handle:
            check(_records(path, handle=handle), _expected(template))
            handle.seek(0)
            return eqx.tree_deserialise_leaves(handle, template)
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - equinox raises RuntimeError/ValueError for bad files
        raise CheckpointError(f"cannot load {path} into the Equinox model: {first_line(exc)}") from None


def write_file(model, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    """``eqx.tree_serialise_leaves(temp, model)`` (renamed to ``path`` by the core)."""
    if kind != "eqx":
        raise CheckpointError(f"cannot write {path}: Equinox writes eqx.tree_serialise_leaves files (.eqx), "
                              f"not {kind!r}")
    with open(temp, "wb") as f:
        eqx.tree_serialise_leaves(f, model)
