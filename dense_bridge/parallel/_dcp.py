"""Distributed-checkpoint (DCP) directories: a framework's native sharded format, written and read
by the adapter whose manifest declares the ``dcp`` capability (``save_dcp``/``load_dcp``), with
dense_bridge's spec beside the data as ``dense_bridge_spec.json``.

    path/
      .metadata                 the framework's index of every rank's slices (read through an
                                allow-list unpickler in the adapter: no code from the file runs)
      __0_0.distcp, ...         the data
      dense_bridge_spec.json    the spec, written by rank 0 after the framework's save

A DCP directory loads onto the ``dcp`` backend at any world size (the framework reads each rank's
slices itself), or whole in one process and from there onto any backend.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._dtypes import numpy_dtype
from .._errors import CheckpointError, received
from ..params._memory_budget import check_load_fits
from ..checkpoints._safetensors import read_json_file, shorten
from ..checkpoints._validate import LayerValidator
from ..specs import Sequential, from_config
from . import _dispatch
from ._plan import spec_layers
from ._save_load import check_params
from ._sharded_dir import write_json

SPEC_NAME = "dense_bridge_spec.json"


def is_dcp_dir(path: Any) -> bool:
    """Whether ``path`` is a directory holding a ``.metadata`` entry (lexists: one that is a FIFO
    or a dangling link still makes a DCP directory, refused by its reader)."""
    return isinstance(path, (str, os.PathLike)) and os.path.isdir(path) and os.path.lexists(os.path.join(path, ".metadata"))


def save(obj: Any, path: Any) -> list[str]:
    """``db.save(model, path, format="dcp")``: the framework's distributed checkpoint, then the spec
    (rank 0, atomically) and, on a parallel model, a barrier so no rank returns before the spec
    exists. Returns the directory's files."""
    from .._api import to_spec

    path = os.fspath(path)
    _dispatch.write_dcp(obj, path)
    state = _dispatch.state_of(obj)
    if state is None or state["rank"] == 0:
        write_json(os.path.join(path, SPEC_NAME), to_spec(obj).to_config())
    if state is not None:
        _dispatch.barrier(obj)
    return sorted(os.path.join(path, f) for f in os.listdir(path))


def _spec(path: str, spec, like):
    """The spec given, the one of ``like``, or the one stored beside the data."""
    from .._api import to_spec

    if spec is None and like is not None:
        spec = to_spec(like)
    if spec is not None:
        return spec
    where = os.path.join(path, SPEC_NAME)
    if not os.path.lexists(where):
        raise CheckpointError(f"{path} is a DCP directory without dense_bridge's {SPEC_NAME}: pass spec= or like=")
    config = read_json_file(where, "spec file")
    try:
        return from_config(config)
    except Exception as exc:  # a malformed spec config is a bad file
        raise CheckpointError(f"{where} cannot be read: {shorten(str(exc), 300)}") from None


def load(path: Any, backend, spec, like, parallel, group, allow_nonfinite: bool = False):
    """``db.load`` of a DCP directory: onto the ``dcp`` backend in parallel (each rank's slices
    read by the framework, then checked as a whole load checks them), or whole in one process
    (then onto ``backend``, or ``(spec, params)`` without one)."""
    from .._api import compile, get_params

    path = os.fspath(path)
    spec = _spec(path, spec, like)
    check_load_fits(spec, path)
    owner = _dispatch.dcp_backend(path)
    if parallel is not None or group is not None:
        if backend not in (None, owner):
            raise CheckpointError(f"a DCP directory loads in parallel onto {owner} only. {received('backend', backend)}")

        def zeros(position, name, index):  # the framework fills the tensors: no init draw needed
            layer = spec_layers(spec)[position]
            return np.zeros(tuple(s.stop - s.start for s in index), dtype=numpy_dtype(layer.dtype))

        native = _dispatch.compile_blocks(owner, spec, zeros, parallel, group)
        _dispatch.read_dcp(native, path)
        # each rank checks the blocks the framework filled in, as a whole-process load checks the tensors
        validator = LayerValidator(spec, allow_nonfinite=allow_nonfinite)
        seq = isinstance(spec, Sequential)
        for key, shard in _dispatch.local_blocks(native).items():
            position, name = key.split(".", 1) if seq else ("0", key)
            validator.check_block(path, int(position), name, key, tuple(shard.index), np.asarray(shard.array))
        return native
    native = compile(spec, owner, seed=0)
    _dispatch.read_dcp(native, path)
    params = get_params(native)
    check_params(path, spec, params, allow_nonfinite)
    if backend == owner:
        return native
    return (spec, params) if backend is None else compile(spec, backend, params=params, allow_nonfinite=allow_nonfinite)
