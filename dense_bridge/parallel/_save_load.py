"""``db.save``/``db.load`` of tensor-parallel models through sharded directories (``_sharded_dir``),
and ``db.load(file, parallel=...)`` of a checkpoint one process saved, each rank reading only its
own blocks. DCP directories are ``_dcp``'s; ``dense_bridge.parallel`` routes between the two.

Every block a rank reads is checked as a whole-process load checks its tensor (NaN/Inf unless
``allow_nonfinite``, a mask block against the spec's wiring) by the checkpoints package's one layer
validator (``LayerValidator.check_block``).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._errors import CheckpointError, SpecError
from ..params._memory_budget import check_load_fits
from ..checkpoints._safetensors import shorten
from ..checkpoints._validate import LayerValidator
from ..specs import Sequential, from_config
from . import _dispatch
from ._plan import owned_index, params_plan
from ._sharded_dir import (INDEX_NAME, Reader, build_index, read_all, read_block, read_index, write_index, write_rank_file)


# ------------------------------------------------------------------ save
def save(native: Any, path: Any) -> list[str]:
    """Collective save of a parallel model into the sharded directory ``path`` (the same on every
    rank): each rank writes its own blocks; after a barrier rank 0 writes the index; a second
    barrier so no rank returns (and loads) before the index exists. Returns the files this rank wrote."""
    from .._api import to_spec

    state = _dispatch.state_of(native)
    rank, world, plan = state["rank"], state["world_size"], state["plan"]
    spec = to_spec(native)
    local = _dispatch.local_blocks(native)
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
    _dispatch.barrier(native)
    if rank == 0:
        write_index(path, build_index(spec, plan, world, dtypes))
    _dispatch.barrier(native)
    return [os.path.join(path, name)] + ([os.path.join(path, INDEX_NAME)] if rank == 0 else [])


# ------------------------------------------------------------------ checks every loaded tensor passes
def check_params(where: str, spec, params: dict, allow_nonfinite: bool) -> None:
    """What ``compile(params=)`` checks (and a file load): names, shapes, dtypes, NaN/Inf, masks
    against the spec; CheckpointError naming ``where``."""
    from .._errors import ConversionError
    from ..params._source import check_masks_match, validate_params

    try:
        validate_params(spec, params, allow_nonfinite=allow_nonfinite)
        check_masks_match(spec, params)
    except (ConversionError, SpecError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


# ------------------------------------------------------------------ load
def load_directory(path: Any, backend: str | None, parallel: Any, group: Any, allow_nonfinite: bool = False):
    """``db.load`` of a sharded directory: whole in one process without ``parallel``, else each
    rank reading only its blocks (any saved world size onto any world size). Every check a file
    load applies applies here, with and without a backend: tensors and dtypes against the spec,
    NaN/Inf (unless ``allow_nonfinite``), each mask against the spec's wiring."""
    from .._api import compile
    from ..params._source import expected_params
    from ..checkpoints._canonical import mismatches

    directory = os.fspath(path)
    index = read_index(directory)
    try:
        spec = from_config(index["spec"])
        expected = expected_params(spec)
    except Exception as exc:  # a malformed spec config is a bad file
        raise CheckpointError(f"{directory}: the index's spec cannot be read ({shorten(str(exc), 300)})") from None
    found = {k: (tuple(t["shape"]), t["dtype"]) for k, t in index["tensors"].items()}
    problems = mismatches(found, {k: (tuple(s), d) for k, (s, d) in expected.items()})
    if problems:
        raise CheckpointError(f"{directory}: the index's tensors do not match its spec: " + "; ".join(problems))
    if parallel is None and group is None:
        check_load_fits(spec, directory)  # read_all allocates every tensor whole
        spec, params = read_all(directory, index)
        check_params(directory, spec, params, allow_nonfinite)
        if backend is None:
            return spec, params
        return compile(spec, backend, params=params, allow_nonfinite=allow_nonfinite)
    if backend is None:
        raise SpecError("parallel= needs a backend to load onto. Received: backend=None")
    _dispatch.parallel_backend(backend)
    reader = Reader(directory)
    seq = isinstance(spec, Sequential)
    validator = LayerValidator(spec, allow_nonfinite=allow_nonfinite)

    def block(position: int, name: str, want: tuple) -> np.ndarray:
        key = (f"{position}." if seq else "") + name
        return validator.check_block(directory, position, name, key, want, read_block(directory, index, key, want, reader))

    try:
        return _dispatch.compile_blocks(backend, spec, block, parallel, group)
    finally:
        reader.close()


def load_file(ckpt, backend: str | None, parallel: Any, group: Any, allow_nonfinite: bool = False):
    """``db.load(file, backend, parallel=...)`` of a checkpoint that one process saved, opened by
    ``checkpoints.open_checkpoint`` (a single .safetensors file, or its index and shards): each
    rank reads only the bytes of its own blocks (``SafetensorsFile.read_block``), each block
    checked by ``LayerValidator.check_block``. Framework files are refused: they have no canonical blocks to read."""
    if backend is None:
        raise SpecError("parallel= needs a backend to load onto. Received: backend=None")
    _dispatch.parallel_backend(backend)
    if ckpt.framework is not None:
        raise CheckpointError(f"parallel= loads dense_bridge checkpoints (a .safetensors file or index saved by "
                              f"db.save, a sharded directory) and DCP directories; {ckpt.path} is a {ckpt.kind}: "
                              f"load it without parallel= and db.save it first")
    if ckpt.spec is None:
        raise CheckpointError(f"{ckpt.path} holds parameters only (saved without a spec): pass spec= to db.load")
    prefix = "{}." if isinstance(ckpt.spec, Sequential) else ""
    validator = LayerValidator(ckpt.spec, allow_nonfinite=allow_nonfinite)

    def block(position: int, name: str, want: tuple) -> np.ndarray:
        key = prefix.format(position) + name
        source = ckpt.where[key]
        return validator.check_block(source.path, position, name, key, want, source.read_block(key, want))

    return _dispatch.compile_blocks(backend, ckpt.spec, block, parallel, group)
