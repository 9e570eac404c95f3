"""``db.save``/``db.load`` of parallel models: the sharded directory (dense_bridge/parallel/_plan.py)
and torch.distributed.checkpoint (DCP) directories, a native format read and written through the
torch adapter's ``save_dcp``/``load_dcp``; and ``db.load(file, parallel=...)`` of a checkpoint one
process saved, each rank reading only its blocks (``load_checkpoint_parallel``). Hooked from
dense_bridge/checkpoints/_flows.py.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .._api import compile as _compile, get_params as _get_params, to_spec as _to_spec
from .._dtypes import numpy_dtype
from .._errors import CheckpointError, SpecError, received
from .._memory import check_load_fits
from ._plan import (Reader, spec_layers, is_sharded_dir, parallel_adapter, read_all, read_block, read_index,
                        save_parallel)
from .._registry import get_adapter
from ..checkpoints._safetensors import read_json_file, shorten
from .._transfer import count_nonfinite
from ..specs import Sequential, from_config


def load_parallel(path, backend: str | None, parallel: Any, group: Any, allow_nonfinite: bool = False):
    """``db.load`` of a sharded directory: whole in one process without ``parallel``, else each
    rank reading only its blocks (any saved world size onto any world size). Every check a file
    load applies applies here, with and without a backend: tensors and dtypes against the spec,
    NaN/Inf (unless ``allow_nonfinite``), each mask against the spec's wiring."""
    from ..checkpoints._meta import mismatches
    from .._params import expected_params

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
        _check_params(directory, spec, params, allow_nonfinite)
        if backend is None:
            return spec, params
        return _compile(spec, backend, params=params, allow_nonfinite=allow_nonfinite)
    if backend is None:
        raise SpecError("parallel= needs a backend to load onto. Received: backend=None")
    adapter = parallel_adapter(backend)
    reader = Reader(directory)
    seq = isinstance(spec, Sequential)
    checked = checked_block(directory, spec_layers(spec), allow_nonfinite)

    def block(position: int, name: str, want: tuple) -> np.ndarray:
        key = (f"{position}." if seq else "") + name
        return checked(position, name, key, want, read_block(directory, index, key, want, reader))

    try:
        return adapter.compile_parallel(spec, block, "auto" if parallel is None else parallel, group)
    finally:
        reader.close()


def _check_params(where: str, spec, params: dict, allow_nonfinite: bool) -> None:
    """What ``compile(params=)`` checks (and a file load): NaN/Inf, masks against the spec."""
    from .._errors import ConversionError
    from .._params import check_masks_match, validate_params

    try:
        validate_params(spec, params, allow_nonfinite=allow_nonfinite)
        check_masks_match(spec, params)
    except (ConversionError, SpecError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def checked_block(where: str, layers, allow_nonfinite: bool):
    """``check(position, name, key, want, block)``: ``block`` (the slice ``want`` of tensor ``key``)
    checked as a whole-process load checks the tensor, NaN/Inf (unless ``allow_nonfinite``) and a
    mask block against the spec's wiring; returned unchanged."""
    def check(position: int, name: str, key: str, want: tuple, a: np.ndarray) -> np.ndarray:
        if not allow_nonfinite and (bad := count_nonfinite(a)):
            raise CheckpointError(f"{where}: tensor {key!r} holds {bad} NaN/Inf values (allow_nonfinite=True loads them)")
        if name == "mask" and ((a != 0) != layers[position].mask.adjacency[want]).any():
            raise CheckpointError(f"{where}: tensor {key!r} differs from the spec's mask in rows {want[0].start}:"
                                  f"{want[0].stop}, columns {want[1].start}:{want[1].stop}")
        return a

    return check


# ------------------------------------------------------------------ db.save / db.load hooks
DCP_SPEC = "dense_bridge_spec.json"
PASS = object()


def _adapter_of(obj):
    from .._registry import adapter_for

    try:
        return adapter_for(obj)
    except Exception:  # not a native object (a spec, params, a tuple): the plain save path decides
        return None


def is_dcp_dir(path: Any) -> bool:
    # lexists: a .metadata that is a FIFO or a dangling link still makes a DCP directory (refused by its reader)
    return isinstance(path, (str, os.PathLike)) and os.path.isdir(path) and os.path.lexists(os.path.join(path, ".metadata"))


def save_hook(obj: Any, path: Any, format: str | None):
    """``db.save``: a parallel model -> the sharded directory; ``format="dcp"`` -> torch DCP.
    Returns the files written, or ``PASS`` for everything else (the plain save path)."""
    if format not in (None, "dcp", "dense_bridge"):
        return PASS
    adapter = _adapter_of(obj)
    state = adapter.parallel_state(obj) if adapter is not None and hasattr(adapter, "parallel_state") else None
    if format == "dcp":
        if adapter is None or not hasattr(adapter, "save_dcp"):
            raise CheckpointError(f'format="dcp" (a distributed checkpoint directory) saves models of a backend '
                                  f"whose adapter writes them (a save_dcp verb). Received: obj of type {type(obj).__name__}")
        return adapter.save_dcp(obj, os.fspath(path), json.dumps(adapter.to_spec(obj).to_config()))
    if state is None:
        return PASS
    return save_parallel(adapter, obj, path)


def load_hook(path: Any, backend: str | None, spec, like, format: str | None, parallel: Any, group: Any,
              allow_nonfinite: bool = False):
    """``db.load`` of a sharded directory or a DCP directory; ``PASS`` for anything else."""
    if format == "dcp" or (format is None and is_dcp_dir(path)):
        return _load_dcp(os.fspath(path), backend, spec, like, parallel, group, allow_nonfinite)
    if format in (None, "dense_bridge") and is_sharded_dir(path):
        return load_parallel(path, backend, parallel, group, allow_nonfinite)
    return PASS  # with parallel=: checkpoint.load opens the file, then load_checkpoint_parallel


def load_checkpoint_parallel(ckpt, backend: str | None, parallel: Any, group: Any, allow_nonfinite: bool = False):
    """``db.load(file, backend, parallel=...)`` of a checkpoint that one process saved, opened by
    ``checkpoint.open_checkpoint`` (a single .safetensors file, or its index and shards): each
    rank reads only the bytes of its own blocks (``SafetensorsFile.read_block``), each block
    checked as a whole-process load checks the tensor: NaN/Inf (unless ``allow_nonfinite``), a
    mask block against the spec's wiring. Native files (torch, Keras, MLX formats) are refused: they have no
    canonical blocks to read."""
    if backend is None:
        raise SpecError("parallel= needs a backend to load onto. Received: backend=None")
    adapter = parallel_adapter(backend)
    if ckpt.framework is not None:
        raise CheckpointError(f"parallel= loads dense_bridge checkpoints (a .safetensors file or index saved by "
                              f"db.save, a sharded directory) and DCP directories; {ckpt.path} is a {ckpt.kind}: "
                              f"load it without parallel= and db.save it first")
    if ckpt.spec is None:
        raise CheckpointError(f"{ckpt.path} holds parameters only (saved without a spec): pass spec= to db.load")
    prefix = "{}." if isinstance(ckpt.spec, Sequential) else ""
    layers = spec_layers(ckpt.spec)

    def block(position: int, name: str, want: tuple) -> np.ndarray:
        key = prefix.format(position) + name
        where = ckpt.where[key].path
        return checked_block(where, layers, allow_nonfinite)(position, name, key, want,
                                                             ckpt.where[key].read_block(key, want))

    return adapter.compile_parallel(ckpt.spec, block, "auto" if parallel is None else parallel, group)


def _dcp_backend(path: str) -> str:
    """The backend whose manifest declares the "dcp" capability (it reads DCP directories)."""
    from .._registry import has_capability, names

    found = [n for n in names() if has_capability(n, "dcp")]
    if not found:
        raise CheckpointError(f"{path} is a DCP directory, which no registered backend reads")
    return found[0]


def _load_dcp(path: str, backend, spec, like, parallel, group, allow_nonfinite: bool = False):
    if spec is None and like is not None:
        spec = _to_spec(like)
    if spec is None:
        where = os.path.join(path, DCP_SPEC)
        if not os.path.lexists(where):
            raise CheckpointError(f"{path} is a DCP directory without dense_bridge's {DCP_SPEC}: pass spec= or like=")
        config = read_json_file(where, "spec file")
        try:
            spec = from_config(config)
        except Exception as exc:  # a malformed spec config is a bad file
            raise CheckpointError(f"{where} cannot be read: {shorten(str(exc), 300)}") from None
    check_load_fits(spec, path)
    dcp_backend = _dcp_backend(path)
    dcp_adapter = get_adapter(dcp_backend)
    if parallel is not None or group is not None:
        if backend not in (None, dcp_backend):
            raise CheckpointError(f"a DCP directory loads in parallel onto {dcp_backend} only. "
                                  f"{received('backend', backend)}")

        def zeros(position, name, index):  # DCP fills the tensors: no init draw needed
            layer = spec_layers(spec)[position]
            return np.zeros(tuple(s.stop - s.start for s in index), dtype=numpy_dtype(layer.dtype))

        native = dcp_adapter.compile_parallel(spec, zeros, "auto" if parallel is None else parallel, group)
        dcp_adapter.load_dcp(native, path)
        # each rank checks the blocks DCP filled in, as a whole-process load checks the tensors
        check = checked_block(path, spec_layers(spec), allow_nonfinite)
        seq = isinstance(spec, Sequential)
        for key, shard in dcp_adapter.get_params_parallel(native, local=True).items():
            position, name = key.split(".", 1) if seq else ("0", key)
            check(int(position), name, key, tuple(shard.index), np.asarray(shard.array))
        return native
    native = _compile(spec, dcp_backend, seed=0)
    dcp_adapter.load_dcp(native, path)
    params = _get_params(native)
    _check_params(path, spec, params, allow_nonfinite)
    if backend == dcp_backend:
        return native
    return (spec, params) if backend is None else _compile(spec, backend, params=params, allow_nonfinite=allow_nonfinite)
