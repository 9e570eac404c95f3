"""``db.save``: a native model, a (spec, params) tuple or a params dict as a canonical checkpoint
(``_canonical``, written by ``_canonical_write``); a whole-model file where the name asks for one;
a model holding quantized layers with its codes (``_quantized``); a parallel model or
``format="dcp"`` through dense_bridge/parallel/.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import CheckpointError, ConversionError, DenseBridgeError, received
from ..activations import Activation
from ..params._source import validate_params
from ..specs import Spec
from ._canonical import check_tensor_name, metadata
from ._canonical_write import write_canonical
from ._io import check_writable, parse_size, path_arg
from ._native import is_native, write_native
from ._quantized import save_codes
from ._safetensors import PendingTensor, pending, st_dtype

__all__ = ["save"]


def save(obj: Any, path: str | os.PathLike, *, max_shard_size: int | str | None = None,
         allow_nonfinite: bool = False, format: str | None = None) -> list[str]:
    """Save a native model, a (spec, params) tuple or a params dict as a canonical checkpoint.

    safetensors with the spec and layout in its metadata; bfloat16 kept bit for bit.
    ``max_shard_size`` (bytes, or "10MB"/"1GB") shards it hub-style with an index. Atomic: on
    any error nothing under ``path`` changes and no partial file is left. Returns the files written.
    A (spec, params) tuple is checked against its spec first (NaN/Inf refused unless
    ``allow_nonfinite=True``). A parallel model (every rank calls save with the same directory)
    and ``format="dcp"`` go to dense_bridge/parallel/ (a sharded or DCP directory).
    """
    from .. import parallel as tensor_parallel
    if format == "dcp" or tensor_parallel.is_parallel_model(obj):
        return tensor_parallel.save(obj, path, format)
    path = path_arg(path)
    limit = parse_size(max_shard_size)
    check_writable(path)
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"allow_nonfinite must be True or False. {received('allow_nonfinite', allow_nonfinite)}")
    if (backend := _model_file_backend(path)) is not None:
        return _save_model_file(obj, path, backend, allow_nonfinite)
    if (written := save_codes(obj, path, limit, format)) is not None:
        return written  # a model holding quantized layers: its codes
    spec, tensors, source = _resolve(obj, path, allow_nonfinite)
    for name in tensors:  # before anything is written
        check_tensor_name(name, path)
    try:
        return write_canonical(path, tensors, metadata(spec, tensors, source), limit)
    except DenseBridgeError:
        raise
    except Exception as exc:  # a producer failed mid-write: the temporaries are gone already
        raise CheckpointError(f"cannot save {path}: {type(exc).__name__}: {exc} (nothing was changed on disk)") \
            from exc


def _model_file_backend(path: str) -> str | None:
    """The backend whose declared whole-model format (``carries_model``) the name of ``path`` ends in."""
    from ..registry._backends import formats

    lower = path.lower()
    return next((name for name, fmt in formats()
                 if fmt.carries_model and fmt.write_kind and fmt.extensions and lower.endswith(fmt.extensions)), None)


def _save_model_file(obj: Any, path: str, backend: str, allow_nonfinite: bool) -> list[str]:
    """``obj`` as ``backend``'s whole-model file: written as it is when it is that backend's model,
    else its spec and parameters compiled there first."""
    from .. import _api

    try:
        own = _api.backend(obj) == backend
    except TypeError:
        own = False
    if not own:
        spec, tensors, _ = _resolve(obj, path, allow_nonfinite)
        if spec is None:
            raise CheckpointError(f"cannot save {path}: a whole-model file needs the model's spec, and the params "
                                  f"given carry none: pass (spec, params) or a model")
        try:
            obj = _api.compile(spec, backend, params={k: np.asarray(t.produce()) for k, t in tensors.items()},
                               allow_nonfinite=allow_nonfinite)
        except DenseBridgeError as exc:
            raise CheckpointError(f"cannot save {path}: {exc}") from None
    return write_native(obj, backend, path)


def _resolve(obj: object, path: str, allow_nonfinite: bool = False) -> tuple[Any, dict[str, PendingTensor], str]:
    """(spec or None, tensors to write, source backend) for what db.save was given."""
    from .. import _api

    if isinstance(obj, (Spec, Activation)):
        raise TypeError("obj is a spec without parameters: pass (spec, params), a compiled model, or a params "
                        f"dict. {received('obj', obj)}")
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], (Spec, Activation)):
        spec, params = obj
        if getattr(spec, "lazy", False):
            from ..params._source import fill_lazy_from_params

            spec = fill_lazy_from_params(spec, params)  # as db.compile does: the kernel fixes the width
        try:
            checked = validate_params(spec, params, allow_nonfinite=allow_nonfinite)
        except ConversionError as exc:
            raise CheckpointError(f"cannot save {path}: {exc}") from None
        return spec, {k: pending(v) for k, v in checked.items()}, "numpy"
    # natives first: an MLX module is a dict too
    if is_native(obj):
        try:
            spec = _api.to_spec(obj)
            params = _api.get_params(obj, copy=False)  # streamed to disk: no snapshot needed
        except DenseBridgeError as exc:
            raise CheckpointError(f"cannot save {path}: {exc}") from None
        return spec, {k: pending(np.asarray(v)) for k, v in params.items()}, _api.backend(obj)
    if isinstance(obj, Mapping):
        tensors = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"params keys must be strings. {received('key', k)}")
            check_tensor_name(k, path)
            tensors[k] = pending(_as_array(v, k, path))
        return None, tensors, "numpy"
    raise TypeError("obj must be a native model or layer, a (spec, params) tuple or a params dict. "
                    f"{received('obj', obj)}")


def _as_array(value: object, name: str, path: str) -> np.ndarray:
    """``params[name]`` as a numpy array a safetensors file can hold; a CheckpointError otherwise."""
    from ..params._source import array_to_numpy

    arr = array_to_numpy(value) if not isinstance(value, (list, tuple, int, float)) else np.asarray(value)
    if arr is None:
        raise CheckpointError(f"cannot save {path}: params[{name!r}] is a {type(value).__name__}, not a numeric "
                              "array")
    try:
        st_dtype(arr.dtype)
    except ValueError:
        raise CheckpointError(f"cannot save {path}: params[{name!r}] has dtype {arr.dtype}, which a "
                              "safetensors file cannot hold") from None
    return arr

