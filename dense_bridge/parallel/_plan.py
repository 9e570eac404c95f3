"""Tensor parallelism, engine-neutral: the plan and the sharded-directory checkpoint format.

The plan (``resolve_plan``) turns ``parallel=`` into one :class:`LayerPlan` per Dense position
of a spec: ``"column"`` splits the canonical kernel (in, units) along units (axis 1; bias and
mask with it), ``"row"`` splits it along in_features (axis 0; the mask with it, the bias
replicated, outputs summed). Whether a layer's input arrives sharded along features and whether
its output is gathered follow from its neighbours, so every engine wires the same thing:

- a column layer's output stays sharded only when the next layer is a row layer and everything
  between them (its own activation, Activation/Identity layers) acts element by element;
  otherwise (softmax/log_softmax, Flatten, a replicated or column layer next, the end of the
  model) it is gathered: the last layer's output is always replicated.
- a row layer takes a sharded input when the layer before it left its output sharded, else a
  replicated input which each rank slices locally (no communication).

Shards are equal: the split width must divide by the world size (else SpecError). Rank r holds
block r of the split axis.

Sharded directory (``FORMAT``), readable without any engine (so MLX and JAX load what torch saved):

    path/
      rank-00000-of-00004.safetensors   each rank's own shards, canonical layout, keys = param names
      ...
      dense_bridge_parallel.json        the index, written by rank 0 after all ranks wrote theirs

    index = {"format": "dense_bridge.parallel", "version": 1, "world_size": 4,
             "spec": <spec config>, "plan": {"0": "column", "1": "row", ...},
             "tensors": {"0.kernel": {"dtype": "float32", "shape": [in, units],
                                      "shards": [{"file": "rank-00000-of-00004.safetensors",
                                                  "start": [0, 0], "stop": [in, units/4]}, ...]}}}

A replicated tensor (a row layer's bias) is written once, by rank 0. On load the slices of each
tensor must tile it exactly (no gap, no overlap, inside the shape: else CheckpointError), and a
rank reads only the byte ranges of the blocks its own slices overlap (``os.pread``, row runs).

Optional adapter verbs (backends/<fw>/_parallel.py: torch, MLX, Flax, Keras on JAX):
``compile_parallel(spec, block, parallel, group)`` where ``block(position, name, index)`` returns
this rank's canonical block (so a load never materialises a whole tensor), ``parallel_state(native)``
(None, or {"plan", "rank", "world_size", ...}), ``get_params_parallel(native, local)``,
``parallel_barrier(native)``, ``parallel_agree_seed(group, seed)`` (rank 0's seed on every rank
of ``group``: ``seed=None``); and the plain verbs (get/set_params, to_spec, trace) dispatching a
parallel model to collective versions.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from typing import Any, Mapping, NamedTuple

import numpy as np

from .._dtypes import numpy_dtype
from .._errors import CheckpointError, SpecError, received
from ..checkpoints._safetensors import MAX_RANK, SafetensorsFile, read_json_file, shorten
from ..activations import Activation
from ..specs import Dense, Flatten, Identity, Sequential, from_config

FORMAT = "dense_bridge.parallel"
INDEX_NAME = "dense_bridge_parallel.json"
STYLES = ("column", "row")
#: activations that need the whole feature axis: a column layer gathers before them
WHOLE_AXIS = ("softmax", "log_softmax")


class LayerPlan(NamedTuple):
    position: int          # position in the Sequential (0 for a lone Dense)
    style: str             # "column" or "row"
    input_sharded: bool    # row only: the input arrives split along features
    gather_output: bool    # column only: the output is gathered (replicated)


class Shard(NamedTuple):
    """``db.get_params(model, local=True)`` values: this rank's block and where it sits in the
    full canonical tensor (``full[index] == array``)."""
    array: np.ndarray
    index: tuple


def spec_layers(spec) -> tuple:
    return spec.layers if isinstance(spec, Sequential) else (spec,)


def elementwise(layer) -> bool:
    if isinstance(layer, Flatten):
        return False
    if isinstance(layer, Identity):
        return True
    if isinstance(layer, Activation):
        return layer.name not in WHOLE_AXIS
    return False


def resolve_plan(spec, parallel: Any, world_size: int) -> dict[int, LayerPlan]:
    """``parallel`` ("auto", "column"/"row" for a lone Dense, or {position: style}) -> the plan.

    Raises SpecError for a style that is not column/row, a position that is not a Dense, a lazy
    layer, or a split width that does not divide by ``world_size``.
    """
    layers = spec_layers(spec)
    dense = [i for i, l in enumerate(layers) if isinstance(l, Dense)]
    if isinstance(parallel, str):
        if parallel == "auto":
            styles = {}
            prev_sharded = False
            for i in dense:  # alternate column/row, restarting with column after a gather
                styles[i] = "row" if prev_sharded else "column"
                prev_sharded = styles[i] == "column"
                if prev_sharded:
                    nxt = [j for j in dense if j > i]
                    between = layers[i + 1:nxt[0]] if nxt else None
                    own = layers[i].activation.name not in WHOLE_AXIS
                    prev_sharded = bool(nxt) and own and all(elementwise(l) for l in between)
        elif parallel in STYLES and not isinstance(spec, Sequential):
            styles = {0: parallel}
        else:
            raise SpecError(f'parallel must be "auto", {{position: "column" | "row"}}, or "column"/"row" for a lone '
                            f"Dense. {received('parallel', parallel)}")
    elif isinstance(parallel, Mapping):
        styles = {}
        for k, v in parallel.items():
            if isinstance(k, str) and k.lstrip("-").isdigit():
                k = int(k)
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(layers) or not isinstance(layers[k], Dense):
                raise SpecError(f"parallel keys must be positions of Dense layers (0..{len(layers) - 1}). "
                                f"{received('parallel', dict(parallel))}")
            if v not in STYLES:
                raise SpecError(f'parallel values must be "column" or "row". {received("parallel", dict(parallel))}')
            styles[k] = v
    else:
        raise TypeError(f'parallel must be "auto" or a dict {{position: "column" | "row"}}. {received("parallel", parallel)}')
    plan: dict[int, LayerPlan] = {}
    prev_sharded = False
    for i, layer in enumerate(layers):
        style = styles.get(i)
        if style is None:
            if isinstance(layer, Dense) or not elementwise(layer):
                prev_sharded = False
            continue
        if layer.lazy:
            raise SpecError(f"a parallel layer needs its in_features: layer {i} is lazy. Received: {layer!r}")
        width = layer.units if style == "column" else layer.in_features
        if width % world_size:
            what = "units" if style == "column" else "in_features"
            raise SpecError(f"layer {i} is {style}-parallel over {world_size} ranks, so its {what} must divide by "
                            f"{world_size}. Received: {what}={width}")
        if style == "row":
            plan[i] = LayerPlan(i, "row", prev_sharded, False)
            prev_sharded = False
            continue
        nxt = [j for j in range(i + 1, len(layers)) if isinstance(layers[j], Dense)]
        keep = (bool(nxt) and styles.get(nxt[0]) == "row" and layer.activation.name not in WHOLE_AXIS
                and all(elementwise(l) for l in layers[i + 1:nxt[0]]))
        plan[i] = LayerPlan(i, "column", False, not keep)
        prev_sharded = keep
    return plan


def split_axis(style: str, name: str) -> int | None:
    """The canonical axis ``name`` ("kernel", "bias", "mask") is split along, None if replicated."""
    if style == "column":
        return 1 if name in ("kernel", "mask") else 0
    return 0 if name in ("kernel", "mask") else None


def shard_index(style: str, name: str, shape: tuple, rank: int, world_size: int) -> tuple:
    """Rank ``rank``'s block of a canonical tensor of ``shape``: a tuple of slices."""
    axis = split_axis(style, name)
    index = [slice(0, n) for n in shape]
    if axis is not None:
        step = shape[axis] // world_size
        index[axis] = slice(rank * step, (rank + 1) * step)
    return tuple(index)


def params_plan(spec, plan: Mapping[int, LayerPlan]) -> dict[str, tuple[str | None, tuple]]:
    """Every canonical param key -> (style or None for a replicated layer, full shape)."""
    out = {}
    seq = isinstance(spec, Sequential)
    for i, layer in enumerate(spec_layers(spec)):
        if not hasattr(layer, "param_shapes"):
            continue
        p = plan.get(i)
        for name, shape in layer.param_shapes().items():
            out[(f"{i}." if seq else "") + name] = (p.style if p else None, tuple(shape))
    return out


def owned_index(style: str | None, key: str, shape: tuple, rank: int, world_size: int) -> tuple | None:
    """The block rank ``rank`` writes to a checkpoint: its shard, a replicated tensor only on rank 0."""
    name = key.rsplit(".", 1)[-1]
    if style is None or split_axis(style, name) is None:
        return tuple(slice(0, n) for n in shape) if rank == 0 else None
    return shard_index(style, name, shape, rank, world_size)


# ------------------------------------------------------------------ sharded directory
def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def atomic_write(path: str, data_writer) -> None:
    """``data_writer(temporary)`` writes the file, which then replaces ``path`` atomically
    (``_checkpoint_io.AtomicFiles``: fsynced, renamed, the temporary removed on any error)."""
    from ..checkpoints._io import AtomicFiles

    with AtomicFiles(path) as files:
        data_writer(files.temp_for(path))


def write_text(path: str, text: str) -> None:
    """``text`` as the file ``path``, written atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def write_rank_file(directory: str, rank: int, world_size: int, shards: Mapping[str, np.ndarray]) -> str:
    """Write this rank's blocks (canonical layout) as one safetensors file, streamed: each block
    (a transposed view of torch's memory) is rearranged piece by piece as it is written, so the
    extra memory is a few pieces, never the whole shard."""
    from ..checkpoints._safetensors import pending, write_safetensors

    os.makedirs(directory, exist_ok=True)
    name = rank_file(rank, world_size)

    def write(p: str) -> None:  # the one safetensors writer: transposed views rearranged piece by piece
        with open(p, "wb") as f:
            write_safetensors(f, {key: pending(a) for key, a in shards.items()}, {"format": FORMAT})

    atomic_write(os.path.join(directory, name), write)
    return name


def build_index(spec, plan: Mapping[int, LayerPlan], world_size: int, dtypes: Mapping[str, str]) -> dict:
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
    write_text(os.path.join(directory, INDEX_NAME), json.dumps(index, indent=1))


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


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "U8": "uint8",
              "I64": "int64", "I32": "int32", "BOOL": "bool"}


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
        if info is None or info.shape != shape or _ST_DTYPES.get(info.dtype) != out.dtype.name:
            found = "nothing" if info is None else f"{info.dtype} {list(info.shape)}"
            raise CheckpointError(f"{f.path}: tensor {key!r} is missing or does not match the index "
                                  f"(expected {out.dtype.name} {list(shape)}, found {found})")
        if any(l >= h for l, h in zip(lo, hi)):
            return
        block = f.read_block(key, tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, start)))
        out[tuple(slice(l - w.start, h - w.start) for l, h, w in zip(lo, hi, want))] = block

    def close(self) -> None:
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


# ------------------------------------------------------------------ verbs (engine-neutral orchestration)
def parallel_adapter(backend: str):
    from .._registry import get_adapter

    adapter = get_adapter(backend)
    if not hasattr(adapter, "compile_parallel"):
        raise SpecError(f"parallel= is not supported on the {backend!r} backend (its adapter has no "
                        f"compile_parallel verb). {received('backend', backend)}")
    return adapter


def compile_parallel(backend: str, source, parallel: Any, group: Any, agree_seed: bool = False):
    """``db.compile(..., parallel=, group=)``: parameters drawn (or given) whole, one layer at a
    time, each rank keeping only its blocks.

    ``agree_seed`` (``seed=None``): each rank drew its own fresh seed, so each would keep its block
    of a different random model; every rank takes rank 0's instead, through the adapter's
    ``parallel_agree_seed(group, seed)`` (a broadcast over the group; JAX, single-controller,
    needs none in one process). Collective, like the compile itself.
    """
    adapter = parallel_adapter(backend)
    if parallel is None:
        parallel = "auto"
    if agree_seed and source.draws:
        source.seed = int(adapter.parallel_agree_seed(group, source.seed))
    cache: dict = {}

    def block(position: int, name: str, index: tuple) -> np.ndarray:
        if cache.get("position") != position:
            layer = spec_layers(source.spec)[position]
            cache.clear()
            cache.update(position=position, params=source.for_layer(position, layer))
        return np.ascontiguousarray(cache["params"][name][index])

    native = adapter.compile_parallel(source.spec, block, parallel, group)
    cache.clear()
    source.finish()
    return native


def get_params_parallel(adapter, native, *, local: bool, copy: bool) -> dict:
    if not getattr(adapter, "parallel_state", None) or adapter.parallel_state(native) is None:
        if local:
            raise TypeError(f"local=True needs a parallel model (compiled with parallel=). "
                            f"Received: native of type {type(native).__name__}")
    params = adapter.get_params_parallel(native, local=local)
    if not copy:
        return params
    if local:
        return {k: Shard(np.array(v.array, copy=True), v.index) for k, v in params.items()}
    return {k: np.array(v, copy=True) for k, v in params.items()}


def save_parallel(adapter, native, path: str) -> list[str]:
    """Collective save: each rank writes its own blocks; after a barrier rank 0 writes the index;
    a second barrier so no rank returns (and loads) before the index exists."""
    state = adapter.parallel_state(native)
    rank, world = state["rank"], state["world_size"]
    spec = adapter.to_spec(native)
    plan = state["plan"]
    local = adapter.get_params_parallel(native, local=True)
    mine, dtypes = {}, {}
    for key, (style, shape) in params_plan(spec, plan).items():
        block = local[key]
        dtypes[key] = block.array.dtype.name
        want = owned_index(style, key, shape, rank, world)
        if want is None:
            continue
        if tuple(want) != tuple(block.index):
            raise CheckpointError(f"rank {rank}: tensor {key!r} holds {block.index}, expected {want}")
        mine[key] = block.array
    path = os.fspath(path)
    name = write_rank_file(path, rank, world, mine)
    adapter.parallel_barrier(native)
    if rank == 0:
        write_index(path, build_index(spec, plan, world, dtypes))
    adapter.parallel_barrier(native)
    return [os.path.join(path, name)] + ([os.path.join(path, INDEX_NAME)] if rank == 0 else [])
