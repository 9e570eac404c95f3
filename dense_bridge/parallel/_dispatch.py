"""The one place the core calls the adapters' tensor-parallel and distributed-checkpoint verbs.

A backend declares tensor parallelism in its manifest (capability ``parallel``); its adapter then
offers every verb of ``dense_bridge.registry._contract.PARALLEL_VERBS`` under those names, and each is looked
up through ``_registry.optional_verb`` (its error names the backend and the verb). Nothing else in
the core names a parallel verb (tests/architecture/test_architecture.py checks it): ``db.get_params``,
``set_params``, ``to_spec``, ``convert`` and ``testing.compare`` take their verbs from
:func:`verbs_for`, which hands a parallel model's collective versions under the plain names, so
no adapter wraps its plain verbs and no plain verb asks whether its model is parallel.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._errors import CheckpointError, DenseBridgeError, SpecError, received
from ..registry._manifest import DCP, PARALLEL
from ..registry._backends import backend_of, get_adapter, has_capability, names, optional_verb
from ._plan import Shard, spec_layers

_PURPOSE = "tensor parallelism (parallel=)"


def _verb(backend: str, verb: str):
    return optional_verb(backend, verb, _PURPOSE)


def parallel_backend(backend: str) -> str:
    """``backend`` when its manifest declares tensor parallelism; SpecError naming it otherwise."""
    if not has_capability(backend, PARALLEL):
        raise SpecError(f"parallel= is not supported on the {backend!r} backend (its manifest does not declare "
                        f"the {PARALLEL!r} capability). {received('backend', backend)}")
    return backend


def _state(backend: str, native: Any) -> dict | None:
    """``parallel_state`` of ``native`` (owned by ``backend``): None for anything but a parallel model,
    asked only of a backend whose manifest declares the capability."""
    return _verb(backend, "parallel_state")(native) if has_capability(backend, PARALLEL) else None


def _model_backend(obj: Any) -> str | None:
    """The backend of ``obj`` when it is a model ``parallel_compile`` made; None for anything
    else (a spec, params, a plain model, an object no backend owns)."""
    try:
        backend = backend_of(obj)
    except (TypeError, DenseBridgeError):
        return None
    return None if _state(backend, obj) is None else backend


def is_parallel_model(obj: Any) -> bool:
    """Whether ``obj`` is a model compiled (or loaded) with ``parallel=``."""
    return _model_backend(obj) is not None


def state_of(native: Any) -> dict | None:
    """``{"plan", "rank", "world_size", ...}`` of a parallel model, None for any other object."""
    try:
        backend = backend_of(native)
    except (TypeError, DenseBridgeError):
        return None
    return _state(backend, native)


class ParallelModelVerbs:
    """A parallel model's adapter as the core sees it: ``get_params``, ``set_params``, ``to_spec``
    and ``trace`` are the adapter's collective ``parallel_*`` verbs (full canonical arrays and
    gathered traces on every rank); every other name is the adapter module's own. ``params``
    is ``db.get_params``' side of it (``local`` blocks, ``copy``). The parallel kind of
    ``dense_bridge._handles`` wraps it."""

    def __init__(self, backend: str, adapter) -> None:
        self.backend = backend
        self.adapter = adapter

    def __getattr__(self, name: str):
        return getattr(self.adapter, name)

    def get_params(self, native) -> dict[str, np.ndarray]:
        return _verb(self.backend, "parallel_get_params")(native, local=False)

    def set_params(self, native, params) -> None:
        _verb(self.backend, "parallel_set_params")(native, params)

    def to_spec(self, native):
        return _verb(self.backend, "parallel_to_spec")(native)

    def trace(self, native, inputs, grad_out):
        return _verb(self.backend, "parallel_trace")(native, inputs, grad_out)

    def params(self, native, *, local: bool, copy: bool) -> dict:
        """Full arrays on every rank (collective), or with ``local`` this rank's blocks as
        :class:`Shard`; with ``copy`` snapshots the caller owns."""
        params = _verb(self.backend, "parallel_get_params")(native, local=local)
        if not copy:
            return params
        if local:
            return {k: Shard(np.array(v.array, copy=True), v.index) for k, v in params.items()}
        return {k: np.array(v, copy=True) for k, v in params.items()}


def parallel_verbs(backend: str, adapter, native: Any) -> ParallelModelVerbs | None:
    """:class:`ParallelModelVerbs` for ``native`` when it is a parallel model of ``backend``
    (whose ``adapter`` the caller resolved already), else None: the one parallel probe."""
    return None if _state(backend, native) is None else ParallelModelVerbs(backend, adapter)


def verbs_for(native: Any, argument: str = "native"):
    """The verbs to call on ``native``: its adapter module, or for a parallel model a
    :class:`ParallelModelVerbs` over it. TypeError naming ``argument`` when no backend owns it."""
    backend = backend_of(native, argument)
    adapter = get_adapter(backend)
    return parallel_verbs(backend, adapter, native) or adapter


# ------------------------------------------------------------------ compile, blocks, barrier
def compile_blocks(backend: str, spec, block, parallel: Any, group: Any):
    """``parallel_compile`` on ``backend`` (``parallel`` None means "auto")."""
    return _verb(parallel_backend(backend), "parallel_compile")(spec, block, "auto" if parallel is None else parallel,
                                                               group)


def compile_source(backend: str, source, parallel: Any, group: Any, agree_seed: bool = False):
    """``db.compile(..., parallel=, group=)``: parameters drawn (or given) whole, one layer at a
    time, each rank keeping only its blocks.

    ``agree_seed`` (``seed=None``): each rank drew its own fresh seed, so each would keep its block
    of a different random model; every rank takes rank 0's instead, through the adapter's
    ``parallel_agree_seed(group, seed)`` (a broadcast over the group; JAX, single-controller,
    needs none in one process). Collective, like the compile itself.
    """
    parallel_backend(backend)
    if agree_seed and source.draws:
        source.seed = int(_verb(backend, "parallel_agree_seed")(group, source.seed))
    cache: dict = {}

    def block(position: int, name: str, index: tuple) -> np.ndarray:
        # the whole layer is drawn (or read) once; each of its parameters is then sliced from it
        if cache.get("position") != position:
            layer = spec_layers(source.spec)[position]
            cache.clear()
            cache.update(position=position, params=source.for_layer(position, layer))
        return np.ascontiguousarray(cache["params"][name][index])

    native = compile_blocks(backend, source.spec, block, parallel, group)
    cache.clear()
    source.finish()
    return native


def local_blocks(native: Any) -> dict[str, Shard]:
    """This rank's blocks of a parallel model, views of its memory (no communication)."""
    return _verb(backend_of(native), "parallel_get_params")(native, local=True)


def barrier(native: Any) -> None:
    """Every rank of a parallel model's group reaches this point."""
    _verb(backend_of(native), "parallel_barrier")(native)


# ------------------------------------------------------------------ distributed checkpoints
def dcp_backend(path: str) -> str:
    """The backend whose manifest declares the ``dcp`` capability (it reads DCP directories)."""
    found = [n for n in names() if has_capability(n, DCP)]
    if not found:
        raise CheckpointError(f"{path} is a DCP directory, which no registered backend reads")
    return found[0]


def write_dcp(obj: Any, path: str) -> None:
    """``obj`` written as a DCP directory by its adapter; CheckpointError when no adapter that
    writes them owns ``obj``."""
    try:
        backend = backend_of(obj)
    except (TypeError, DenseBridgeError):
        backend = None
    if backend is None or not has_capability(backend, DCP):
        raise CheckpointError(f'format="dcp" (a distributed checkpoint directory) saves models of a backend '
                              f"whose adapter writes them (a save_dcp verb). Received: obj of type {type(obj).__name__}")
    optional_verb(backend, "save_dcp", "saving a DCP directory")(obj, os.fspath(path))


def read_dcp(native: Any, path: str) -> None:
    """``native`` filled from the DCP directory ``path`` by its adapter."""
    optional_verb(backend_of(native), "load_dcp", "loading a DCP directory")(native, path)
