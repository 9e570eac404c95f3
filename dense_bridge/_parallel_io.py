"""``db.save``/``db.load`` of parallel models: the sharded directory (dense_bridge/_parallel.py)
and torch.distributed.checkpoint (DCP) directories, a native format read and written through the
torch adapter's ``save_dcp``/``load_dcp``; and ``db.load(file, parallel=...)`` of a checkpoint one
process saved, each rank reading only its blocks (``load_checkpoint_parallel``). Hooked from
dense_bridge/checkpoint.py (issues 16, 17).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ._api import compile as _compile, get_params as _get_params, to_spec as _to_spec
from ._dtypes import numpy_dtype
from ._errors import CheckpointError, SpecError, received
from ._parallel import (Reader, spec_layers, is_sharded_dir, parallel_adapter, read_all, read_block, read_index,
                        params_plan, save_parallel)
from ._registry import get_adapter
from ._transfer import count_nonfinite
from .specs import Sequential, from_config


def load_parallel(path, backend: str | None, parallel: Any, group: Any):
    """``db.load`` of a sharded directory: whole in one process without ``parallel``, else each
    rank reading only its blocks (any saved world size onto any world size)."""
    directory = os.fspath(path)
    index = read_index(directory)
    try:
        spec = from_config(index["spec"])
    except Exception as exc:  # a malformed spec config is a bad file
        raise CheckpointError(f"{directory}: the index's spec cannot be read ({exc})") from None
    expected = params_plan(spec, {})
    if set(expected) != set(index["tensors"]) or any(tuple(index["tensors"][k]["shape"]) != s for k, (_, s) in expected.items()):
        raise CheckpointError(f"{directory}: the index's tensors do not match its spec "
                              f"(expected {sorted(expected)}, found {sorted(index['tensors'])})")
    if parallel is None and group is None:
        spec, params = read_all(directory, index)
        if backend is None:
            return spec, params
        return _compile(spec, backend, params=params)
    if backend is None:
        raise SpecError("parallel= needs a backend to load onto. Received: backend=None")
    adapter = parallel_adapter(backend)
    reader = Reader(directory)
    seq = isinstance(spec, Sequential)

    def block(position: int, name: str, want: tuple) -> np.ndarray:
        return read_block(directory, index, (f"{position}." if seq else "") + name, want, reader)

    try:
        return adapter.compile_parallel(spec, block, "auto" if parallel is None else parallel, group)
    finally:
        reader.close()


# ------------------------------------------------------------------ db.save / db.load hooks
DCP_SPEC = "dense_bridge_spec.json"
PASS = object()


def _adapter_of(obj):
    from ._registry import adapter_for

    try:
        return adapter_for(obj)
    except Exception:  # not a native object (a spec, params, a tuple): the plain save path decides
        return None


def is_dcp_dir(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, ".metadata"))


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


def load_hook(path: Any, backend: str | None, spec, like, format: str | None, parallel: Any, group: Any):
    """``db.load`` of a sharded directory or a DCP directory; ``PASS`` for anything else."""
    if format == "dcp" or (format is None and is_dcp_dir(path)):
        return _load_dcp(os.fspath(path), backend, spec, like, parallel, group)
    if format in (None, "dense_bridge") and is_sharded_dir(path):
        return load_parallel(path, backend, parallel, group)
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
        a = ckpt.where[key].read_block(key, want)
        if not allow_nonfinite and (bad := count_nonfinite(a)):
            raise CheckpointError(f"{where}: tensor {key!r} holds {bad} NaN/Inf values (allow_nonfinite=True loads them)")
        if name == "mask" and ((a != 0) != layers[position].mask.adjacency[want]).any():
            raise CheckpointError(f"{where}: tensor {key!r} differs from the spec's mask in rows {want[0].start}:"
                                  f"{want[0].stop}, columns {want[1].start}:{want[1].stop}")
        return a

    return adapter.compile_parallel(ckpt.spec, block, "auto" if parallel is None else parallel, group)


def _dcp_backend(path: str) -> str:
    """The backend whose manifest declares the "dcp" capability (it reads DCP directories)."""
    from ._registry import has_capability, names

    found = [n for n in names() if has_capability(n, "dcp")]
    if not found:
        raise CheckpointError(f"{path} is a DCP directory, which no registered backend reads")
    return found[0]


def _load_dcp(path: str, backend, spec, like, parallel, group):
    if spec is None and like is not None:
        spec = _to_spec(like)
    if spec is None:
        try:
            with open(os.path.join(path, DCP_SPEC), "rb") as f:
                spec = from_config(json.loads(f.read(1 << 24)))
        except FileNotFoundError:
            raise CheckpointError(f"{path} is a DCP directory without dense_bridge's {DCP_SPEC}: pass spec= or like=") from None
        except (OSError, ValueError, TypeError, SpecError) as exc:
            raise CheckpointError(f"{path}/{DCP_SPEC} cannot be read: {exc}") from None
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
        return native
    native = _compile(spec, dcp_backend, seed=0)
    dcp_adapter.load_dcp(native, path)
    if backend == dcp_backend:
        return native
    params = _get_params(native)
    return (spec, params) if backend is None else _compile(spec, backend, params=params)
