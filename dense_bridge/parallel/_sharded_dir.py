"""The sharded-directory checkpoint: each rank's blocks in its own safetensors file, plus an index.

Readable without any engine (so MLX and JAX load what torch saved), written and read through the
checkpoints package's one safetensors reader/writer and its one atomic writer:

    path/
      rank-00000-of-00004.safetensors   each rank's own blocks, canonical layout, keys = param names
      ...
      dense_bridge_parallel.json        the index, written by rank 0 after all ranks wrote theirs

    index = {"format": "dense_bridge.parallel", "version": 1, "world_size": 4,
             "spec": <spec config>, "plan": {"0": "column", "1": "row", ...},
             "tensors": {"0.kernel": {"dtype": "float32", "shape": [in, units],
                                      "shards": [{"file": "rank-00000-of-00004.safetensors",
                                                  "start": [0, 0], "stop": [in, units/4]}, ...]}}}

A replicated tensor (a row layer's bias) is written once, by rank 0. On load the slices of each
tensor must tile it exactly (no gap, no overlap, inside the shape: else CheckpointError), and a
rank reads only the byte ranges of the blocks its own slices overlap (``SafetensorsFile.read_block``).
"""
from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any, Mapping

import numpy as np

from .._dtypes import numpy_dtype
from .._errors import CheckpointError, SpecError
from ..checkpoints._io import AtomicFiles, write_text
from ..checkpoints._safetensors import (MAX_RANK, SafetensorsFile, pending, read_json_file, shorten, write_safetensors)
from ..specs import from_config
from ._plan import LayerPlan, owned_index, params_plan

FORMAT = "dense_bridge.parallel"
INDEX_NAME = "dense_bridge_parallel.json"


def rank_file(rank: int, world_size: int) -> str:
    """The name of rank ``rank``'s file among ``world_size``: ``rank-00001-of-00004.safetensors``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def write_file(path: str, write) -> None:
    """``write(f)`` fills a binary file that then replaces ``path`` atomically: the checkpoints
    package's one atomic writer (``AtomicFiles``: fsynced, renamed, the temporary removed on any
    error, an OSError reported as a CheckpointError naming ``path``)."""
    with AtomicFiles(path) as files:
        with open(files.temp_for(path), "wb") as f:
            write(f)


def write_json(path: str, value: Any, indent: int | None = None) -> None:
    """``value`` as the JSON file ``path``, written atomically (``checkpoints._io.write_text``)."""
    write_text(path, json.dumps(value, indent=indent))


def write_rank_file(directory: str, rank: int, world_size: int, shards: Mapping[str, np.ndarray]) -> str:
    """Write this rank's blocks (canonical layout) as one safetensors file through the one
    safetensors writer (``write_safetensors``): a block that is a transposed view of the
    framework's memory is rearranged piece by piece as it is written, so the extra memory is a
    few pieces, never the whole shard. Returns the file's name."""
    os.makedirs(directory, exist_ok=True)
    name = rank_file(rank, world_size)
    tensors = {key: pending(a) for key, a in shards.items()}
    write_file(os.path.join(directory, name), lambda f: write_safetensors(f, tensors, {"format": FORMAT}))
    return name


def build_index(spec, plan: Mapping[int, LayerPlan], world_size: int, dtypes: Mapping[str, str]) -> dict:
    """The index of a directory saved by ``world_size`` ranks under ``plan``: every tensor's
    dtype (``dtypes``: key -> dtype name), full shape and the block each rank file holds."""
    tensors = {}
    for key, (style, shape) in params_plan(spec, plan).items():
        shards = []
        for r in range(world_size):
            idx = owned_index(style, key, shape, r, world_size)
            if idx is not None:
                shards.append({"file": rank_file(r, world_size), "start": [s.start for s in idx],
                               "stop": [s.stop for s in idx]})
        tensors[key] = {"dtype": dtypes[key], "shape": list(shape), "shards": shards}
    return {"format": FORMAT, "version": 1, "world_size": world_size, "spec": spec.to_config(),
            "plan": {str(p.position): p.style for p in plan.values()}, "tensors": tensors}


def write_index(directory: str, index: dict) -> None:
    """The index (``build_index``) as ``directory``'s ``dense_bridge_parallel.json``, atomically."""
    write_json(os.path.join(directory, INDEX_NAME), index, indent=1)


def is_sharded_dir(path: Any) -> bool:
    # lexists: an index that is a FIFO or a dangling link still makes a sharded directory (refused by read_index)
    return isinstance(path, (str, os.PathLike)) and os.path.isdir(path) and os.path.lexists(os.path.join(path, INDEX_NAME))


#: The index versions this reader knows (the writer's ``build_index``).
INDEX_VERSIONS = (1,)


def read_index(directory: str) -> dict:
    """The index, checked: format and version, every tensor's slices tile it exactly, each in its
    own file inside the directory. Read the safe way (``read_json_file``: a FIFO refused, deep
    nesting and duplicate keys refused)."""
    where = os.path.join(directory, INDEX_NAME)
    index = read_json_file(where, "sharded checkpoint index")
    if index.get("format") != FORMAT or not isinstance(index.get("tensors"), dict):
        raise CheckpointError(f"{where} is not a dense_bridge sharded checkpoint index (format {FORMAT!r})")
    version = index.get("version")
    if type(version) is not int or version not in INDEX_VERSIONS:
        raise CheckpointError(f"{where} is index version {shorten(version)}; this dense_bridge reads version "
                              f"{', '.join(map(str, INDEX_VERSIONS))} (a newer dense_bridge wrote it?)")
    for key, t in index["tensors"].items():
        validate_tiling(key, t, where)
    return index


def _blocks(key: str, tensor: Any, where: str) -> tuple[list[int], list[tuple[list[int], list[int], str]]]:
    """(shape, [(start, stop, file)]) of one index entry; CheckpointError for any malformed field."""
    def ints(value, what: str) -> list[int]:
        if not isinstance(value, list) or not all(type(n) is int for n in value):
            raise CheckpointError(f"{where}: tensor {shorten(key)}: {what} must be a list of integers. "
                                  f"Received: {shorten(value)}")
        return value

    if not isinstance(tensor, dict) or not isinstance(tensor.get("shards"), list) or not tensor["shards"]:
        raise CheckpointError(f"{where}: tensor {shorten(key)} is malformed (it needs dtype, shape and a list of "
                              f"shards). Received: {shorten(tensor)}")
    try:
        numpy_dtype(tensor.get("dtype"))
    except (SpecError, TypeError, ValueError):
        raise CheckpointError(f"{where}: tensor {shorten(key)} has dtype {shorten(tensor.get('dtype'))}, "
                              "which dense_bridge does not store") from None
    shape = ints(tensor.get("shape"), "shape")
    if any(n < 0 for n in shape) or len(shape) > MAX_RANK:
        raise CheckpointError(f"{where}: tensor {shorten(key)} has shape {shorten(shape)}")
    blocks = []
    for n, s in enumerate(tensor["shards"]):
        if not isinstance(s, dict) or not isinstance(s.get("file"), str):
            raise CheckpointError(f"{where}: tensor {shorten(key)}: shard {n} is malformed. Received: {shorten(s)}")
        blocks.append((ints(s.get("start"), f"shard {n}'s start"), ints(s.get("stop"), f"shard {n}'s stop"), s["file"]))
    return shape, blocks


def validate_tiling(key: str, tensor: Any, where: str = INDEX_NAME) -> None:
    """The shards of one tensor cover it exactly once, each read from its own file: every block
    inside the shape and non-empty, no two blocks in one file (a rank file holds one block per
    tensor, under the tensor's name: two blocks there would read the same bytes), no overlap and
    no gap. CheckpointError naming the tensor otherwise.

    Linear in the number of blocks (``_tiles_exactly``), where comparing every pair of blocks
    took more than 30 s for 20,000 blocks (benchmarks/bench_index_validation.py)."""
    shape, blocks = _blocks(key, tensor, where)
    total, files = 0, set()
    for n, (a, b, f) in enumerate(blocks):
        if len(a) != len(shape) or len(b) != len(shape) or any(not 0 <= x < y <= s for x, y, s in zip(a, b, shape)):
            raise CheckpointError(f"tensor {key!r}: shard {n} [{a}, {b}) lies outside its shape {shape} (or is empty)")
        if os.path.basename(f) != f or not f.endswith(".safetensors") or f in (".", ".."):
            raise CheckpointError(f"tensor {key!r}: shard {n} names a file outside the directory: {f!r}")
        if f in files:
            raise CheckpointError(f"tensor {key!r}: two shards name the same file {f!r} (they would read the same "
                                  "bytes): each rank file holds one block of a tensor")
        files.add(f)
        total += math.prod(y - x for x, y in zip(a, b))
    if total < math.prod(shape):
        raise CheckpointError(f"tensor {key!r}: its shards cover {total} of {math.prod(shape)} elements "
                              f"(a gap): the slices must tile the tensor exactly")
    if total > math.prod(shape) or not _tiles_exactly(shape, [(a, b) for a, b, _ in blocks]):
        raise CheckpointError(f"tensor {key!r}: its shards overlap ({total} elements in blocks for a tensor of "
                              f"{math.prod(shape)}, some counted twice): the slices must tile the tensor exactly")


#: Above this rank a block has too many corners for the corner sum: blocks are compared pairwise,
#: at most this many of them.
_CORNER_RANK = 4
_PAIRWISE_MAX = 256


def _tiles_exactly(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether ``boxes`` ([start, stop) per axis, inside ``shape``) cover every element exactly once.

    The indicator of a box is the prefix sum (along every axis) of +-1 at its 2^d corners, the
    sign being (-1)^(number of stop coordinates). So the boxes' indicators add up to exactly the
    whole tensor's, which is the same as tiling it exactly, iff their signed corners add up to the
    whole tensor's corners: one dictionary pass, linear in the number of boxes."""
    d = len(shape)
    if d > _CORNER_RANK:
        if len(boxes) > _PAIRWISE_MAX:
            return False
        return not any(all(x < y2 and x2 < y for x, y, x2, y2 in zip(a, b, a2, b2))
                       for n, (a, b) in enumerate(boxes) for a2, b2 in boxes[:n])
    picks = [(pick, 1 if sum(pick) % 2 == 0 else -1) for pick in itertools.product((0, 1), repeat=d)]
    weight: dict[tuple, int] = {}

    def add(a, b, sign: int) -> None:
        for pick, parity in picks:
            corner = tuple([b[i] if p else a[i] for i, p in enumerate(pick)])
            weight[corner] = weight.get(corner, 0) + sign * parity

    for a, b in boxes:
        add(a, b, 1)
    add([0] * d, shape, -1)  # the whole tensor's corners: everything must cancel
    return not any(weight.values())


class Reader:
    """Byte-range reads from a directory's rank files, each opened once through the hardened
    safetensors reader every other file goes through (``SafetensorsFile``: the file opened the
    safe way, the header length exact, every tensor's offsets inside the data, no two tensors
    sharing bytes, the data covered exactly)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[str, SafetensorsFile] = {}

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(os.path.join(self.directory, name))
        return self._files[name]

    def read_into(self, out: np.ndarray, key: str, shard: dict, want: tuple) -> None:
        """Copy the part of ``shard`` (a block of tensor ``key``) inside ``want`` into ``out``
        (which holds the block ``want``), reading only those bytes."""
        start, stop = shard["start"], shard["stop"]
        lo = [max(a, w.start) for a, w in zip(start, want)]
        hi = [min(b, w.stop) for b, w in zip(stop, want)]
        f = self._file(shard["file"])
        info = f.tensors.get(key)
        shape = tuple(b - a for a, b in zip(start, stop))
        if info is None or info.shape != shape or info.numpy_dtype != out.dtype:
            found = "nothing" if info is None else f"{info.dtype} {list(info.shape)}"
            raise CheckpointError(f"{f.path}: tensor {key!r} is missing or does not match the index "
                                  f"(expected {out.dtype.name} {list(shape)}, found {found})")
        if any(l >= h for l, h in zip(lo, hi)):
            return
        block = f.read_block(key, tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, start)))
        out[tuple(slice(l - w.start, h - w.start) for l, h, w in zip(lo, hi, want))] = block

    def close(self) -> None:
        """Close every rank file opened so far."""
        for f in self._files.values():
            f.close()
        self._files.clear()


def read_block(directory: str, index: dict, key: str, want: tuple | None = None, reader: Reader | None = None) -> np.ndarray:
    """The block ``want`` (slices; None = whole) of tensor ``key``, assembled from the shards it overlaps."""
    t = index["tensors"].get(key)
    if t is None:
        raise CheckpointError(f"the sharded checkpoint has no tensor {key!r}")
    shape = tuple(t["shape"])
    want = tuple(slice(0, n) for n in shape) if want is None else want
    out = np.empty(tuple(w.stop - w.start for w in want), dtype=numpy_dtype(t["dtype"]))
    own = reader is None
    reader = reader or Reader(directory)
    try:
        for shard in t["shards"]:
            reader.read_into(out, key, shard, want)
    finally:
        if own:
            reader.close()
    return out


def read_all(directory: str, index: dict | None = None) -> tuple[Any, dict[str, np.ndarray]]:
    """(spec, full canonical params) of a sharded directory, read whole in one process."""
    index = index or read_index(directory)
    spec = from_config(index["spec"])
    reader = Reader(directory)
    try:
        return spec, {k: read_block(directory, index, k, reader=reader) for k in index["tensors"]}
    finally:
        reader.close()
