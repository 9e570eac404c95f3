"""Tensor parallelism: a spec's Dense layers split over ranks on each framework's own machinery,
and the checkpoints of such models. The face ``db.save``/``db.load`` route to:

- :func:`is_parallel_model` / :func:`save`: a parallel model saves as a sharded directory (every
  rank writes its own blocks), any native model with ``format="dcp"`` as a DCP directory;
- :func:`is_parallel_dir` / :func:`load`: a sharded or DCP directory;
- :func:`load_file`: a checkpoint one process saved, loaded with ``parallel=`` (each rank reads
  only its blocks).

The modules, one job each: ``_plan`` (which layer is split how, which block each rank holds),
``_dispatch`` (the one place the core calls the adapters' ``parallel_*`` and DCP verbs, and
``compile(..., parallel=)`` / ``get_params`` of a parallel model), ``_sharded_dir`` (the
sharded-directory format: rank files, index, tiling checks, block reads), ``_save_load`` (save
and load through it, each block checked by ``checkpoints._validate``), ``_dcp`` (DCP directories). The engines:
backends/<fw>/_parallel.py.
"""
from __future__ import annotations

import os
from typing import Any

from .._errors import CheckpointError
from ._dispatch import is_parallel_model
from ._plan import Shard

__all__ = ["Shard", "is_parallel_model", "is_parallel_dir", "save", "load", "load_file"]


def save(obj: Any, path: Any, format: str | None = None) -> list[str]:
    """``db.save`` of a parallel model (``format`` None or "dense_bridge": the sharded directory)
    or of any native model with ``format="dcp"``. Collective on a parallel model."""
    from . import _dcp, _save_load

    if format == "dcp":
        return _dcp.save(obj, path)
    if format not in (None, "dense_bridge"):
        raise CheckpointError(f'a parallel model saves as a sharded directory (format=None) or a DCP directory '
                              f'(format="dcp"). Received: format={format!r}')
    return _save_load.save(obj, path)


def is_parallel_dir(path: Any, format: str | None = None) -> bool:
    """Whether ``db.load(path, format=format)`` reads a DCP or sharded directory."""
    from ._dcp import is_dcp_dir
    from ._sharded_dir import is_sharded_dir

    return format == "dcp" or (format is None and is_dcp_dir(path)) or \
        (format in (None, "dense_bridge") and is_sharded_dir(path))


def load(path: Any, backend: str | None, *, spec=None, like=None, format: str | None = None, parallel=None,
         group=None, allow_nonfinite: bool = False):
    """``db.load`` of a DCP directory or a sharded directory (``is_parallel_dir``)."""
    from . import _dcp, _save_load

    if format == "dcp" or (format is None and _dcp.is_dcp_dir(path)):
        return _dcp.load(os.fspath(path), backend, spec, like, parallel, group, allow_nonfinite)
    return _save_load.load_directory(path, backend, parallel, group, allow_nonfinite)


def load_file(ckpt, backend: str | None, parallel: Any, group: Any, allow_nonfinite: bool = False):
    """``db.load(file, backend, parallel=...)`` of a checkpoint one process saved (``ckpt``, opened
    by ``checkpoints.open_checkpoint``): each rank reads only its own blocks."""
    from ._save_load import load_file as load_blocks

    return load_blocks(ckpt, backend, parallel, group, allow_nonfinite)
