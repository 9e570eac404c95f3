"""``db.load`` and ``open_checkpoint``: a checkpoint file, shard index or model directory opened
for reading, recognised by content and never by extension:

- a canonical checkpoint (``_canonical.CanonicalCheckpoint``; with codes of quantized layers
  ``_quantized.QuantizedCheckpoint``), single or sharded with an index;
- a backend's own file (``_native.NativeCheckpoint``), its format found among the formats the
  backends' manifests declare (``_native.identify``), a hub's index of native shards included;
- a quantized model directory a backend's manifest declares (``_model_dir.QuantizedDirectory``).

Readers take no lock: every safetensors file is opened once and mapped from that descriptor
(``_safetensors.SafetensorsFile``), an index is read once, and when a concurrent save removes a
shard (or the file) between reading the index and opening it, the read starts over (a few
times) from the then current index (see ``_canonical_write``). Reading maps one tensor at a
time, so loading onto a backend holds one tensor of the source in memory beyond the model.
"""
from __future__ import annotations

import os

from .._errors import CheckpointError, ConversionError, SpecError, received
from ..activations import Activation
from ..params._memory_budget import check_load_fits
from ..params._source import check_masks_match, validate_params
from ..specs import Spec, from_config
from ._canonical import FORMAT, check_finite_params
from ._io import path_arg
from ._model_dir import QuantizedDirectory, find_model_dir
from ._native import NativeCheckpoint, format_names, is_native, open_native
from ._quantized import QuantizedCheckpoint, canonical_checkpoint
from ._open_files import Changed, open_shards, open_sniffed, probe, read_all
from ._safetensors import SafetensorsFile

__all__ = ["load", "open_checkpoint"]


def load(path: str | os.PathLike, backend: str | None = None, *, spec=None, like=None, format: str | None = None,
         allow_nonfinite: bool = False, parallel=None, group=None, device=None):
    """A native model on ``backend`` from a checkpoint, or ``(spec, params)`` when backend is None.

    Reads canonical checkpoints (single or sharded), torch state dicts (.pt/.pth/.bin, read with
    weights_only=True) and torch safetensors, Keras .weights.h5/.keras, MLX .safetensors/.npz,
    Flax .msgpack and Equinox .eqx.
    Files that do not carry a spec need ``spec=`` or ``like=`` (a native model of the same
    architecture). ``params`` are in-memory numpy arrays in the canonical layout; a checkpoint
    saved without a spec gives ``(None, params)``. NaN/Inf parameters raise a CheckpointError
    unless ``allow_nonfinite=True``, with or without ``backend``; so does a stored mask that
    differs from the spec's.

    ``parallel``/``group`` (tensor parallelism, every rank calls it): a sharded directory saved
    at any world size, a DCP directory, or a dense_bridge checkpoint one process saved (single
    .safetensors or its index); each rank reads only its own blocks (dense_bridge/parallel/).

    ``device`` (with ``backend``): where the model's arrays live, the framework's device object or
    "cpu", "cuda", "cuda:N", "gpu", "gpu:N" (checked before the file is read); None: the
    framework's default device. The parameters are read into host memory, then placed: one
    transfer per array.
    """
    from .. import parallel as tensor_parallel
    from ..registry._backends import check_backend_name

    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"allow_nonfinite must be True or False. {received('allow_nonfinite', allow_nonfinite)}")
    if tensor_parallel.is_parallel_dir(path, format):  # a sharded (parallel) or DCP directory
        return tensor_parallel.load(path, backend, spec=spec, like=like, format=format, parallel=parallel, group=group,
                                    allow_nonfinite=allow_nonfinite)
    if backend is not None:
        backend = check_backend_name(backend)
    if device is not None:
        from ..registry._devices import device_for, place

        if backend is None or parallel is not None or group is not None:
            raise SpecError(f"device= places the native model load builds: it needs a backend and no parallel=. "
                            f"{received('device', device)}")
        target = device_for(backend, device)
        return place(load(path, backend, spec=spec, like=like, format=format, allow_nonfinite=allow_nonfinite),
                     backend, target)
    ckpt = open_checkpoint(path, spec=spec, like=like, format=format)
    try:
        if parallel is not None or group is not None:  # each rank reads its blocks of the file
            return tensor_parallel.load_file(ckpt, backend, parallel, group, allow_nonfinite)
        if backend is None:
            if ckpt.spec is not None:
                check_load_fits(ckpt.spec, ckpt.path)
            params = ckpt.params()
            _check_loaded(ckpt, params, allow_nonfinite)
            return ckpt.spec, params
        return ckpt.native(backend, allow_nonfinite=allow_nonfinite)
    finally:
        ckpt.close()  # everything is copied out by now


def _check_loaded(ckpt, params: dict, allow_nonfinite: bool) -> None:
    """The rules ``compile(params=)`` applies, for params handed out as numpy arrays."""
    if isinstance(ckpt, QuantizedCheckpoint):  # codes of quantized layers: their own rules
        return ckpt.check_loaded(params, allow_nonfinite)
    try:
        if ckpt.spec is not None:
            validate_params(ckpt.spec, params, allow_nonfinite=allow_nonfinite)
            check_masks_match(ckpt.spec, params)
            return
    except ConversionError as exc:
        raise CheckpointError(f"{ckpt.path}: {exc}") from None
    if not allow_nonfinite:
        check_finite_params(params, ckpt.path)


#: How often a read starts over when a concurrent save replaces what it was reading.
_READ_ATTEMPTS = 20


def open_checkpoint(path: str | os.PathLike, *, spec=None, like=None, format: str | None = None):
    """A checkpoint opened for reading: canonical (CanonicalCheckpoint, QuantizedCheckpoint), native
    (NativeCheckpoint) or a quantized model directory a backend declares (QuantizedDirectory).

    ``spec`` (a spec or config dict) or ``like`` (a native model of the same architecture) say
    what the file holds when the file does not carry a spec itself; ``format`` forces the
    reading of a native file ("torch", "keras", "mlx"). Safetensors files are opened once
    and stay consistent while a concurrent save replaces them; ``close()`` the result (or
    let it be garbage collected) to release their descriptors.
    """
    path = path_arg(path)
    spec = _spec_arg(spec)
    if like is not None:
        if not is_native(like):
            from ..registry._backends import names

            raise TypeError("like must be a native model or layer of the checkpoint's architecture (of a registered "
                            f"backend: {', '.join(names())}); pass a dense_bridge spec as spec= instead. "
                            f"{received('like', like)}")
        if spec is None:
            from .. import _api

            spec = _api.to_spec(like)
    if format is not None and format not in format_names():
        raise SpecError(f"format must be one of {', '.join(format_names())}. {received('format', format)}")
    if os.path.isdir(path) and (opened := _open_model_dir(path)) is not None:
        return opened
    for _ in range(_READ_ATTEMPTS):
        try:
            return _open_once(path, spec, like, format)
        except Changed:
            continue
    raise CheckpointError(f"cannot read {path}: it was replaced by other saves {_READ_ATTEMPTS} times while being "
                          "read; try again when they are done")


def _open_once(path: str, spec, like, format):
    """The checkpoint at ``path`` (a file, or an index by its own name or the name it was saved
    under), read once; Changed when a concurrent save replaced it meanwhile."""
    target = path
    if not os.path.exists(path) and os.path.isfile(path + ".index.json"):
        target = path + ".index.json"  # a sharded save to "model.safetensors" is read back by that name
    try:
        kind, fd = open_sniffed(target)
    except CheckpointError:
        # a save switched between a single file and shards under this name since we looked
        if not os.path.exists(target) and (os.path.exists(path) or os.path.isfile(path + ".index.json")):
            raise Changed() from None
        raise
    if kind == "safetensors":
        st = SafetensorsFile(target, fd=fd)
        try:
            if st.metadata.get("format") == FORMAT and format in (None, "dense_bridge"):
                if "shard" in st.metadata:
                    index = os.path.join(os.path.dirname(target), st.metadata.get("index", "?"))
                    raise CheckpointError(f"{target} is shard {st.metadata['shard']} of a sharded checkpoint: load "
                                          f"its index {index} instead")
                return canonical_checkpoint(target, [st], st.metadata, spec)  # with codes of quantized layers, or plain
            return open_native(target, probe(target, [st]), spec=spec, like=like, format=format, files=[st])
        except BaseException:
            st.close()
            raise
    try:
        raw = read_all(target, fd) if kind == "index" else None
        sniffed = probe(target, [], fd) if kind == "native" else None
    finally:
        os.close(fd)  # other kinds are read by their framework, from the path
    if kind == "index":
        return _open_index(target, raw, spec, like, format)
    return open_native(target, sniffed, spec=spec, like=like, format=format)


def _open_index(path: str, raw: bytes, spec, like, format):
    """A sharded checkpoint from its index (read once, as ``raw``): canonical or a hub's native one."""
    index, files = open_shards(path, raw)
    meta = index.get("metadata") or {}
    try:
        if isinstance(meta, dict) and meta.get("format") == FORMAT and format in (None, "dense_bridge"):
            # with codes of quantized layers, or plain
            return canonical_checkpoint(path, list(files.values()), dict(meta), spec, index_path=path)
        # a hub index of native shards
        shards = list(files.values())
        return open_native(path, probe(path, shards), index=True, spec=spec, like=like, format=format, files=shards)
    except BaseException:
        for f in files.values():
            f.close()
        raise


def _open_model_dir(path: str) -> QuantizedDirectory | None:
    """The quantized model directory ``path`` is, as its backend's manifest declares it
    (``_model_dir``); None for any other directory."""
    found = find_model_dir(path)
    if found is None:
        return None
    backend, model_dir, weights, settings = found
    opened = open_checkpoint(weights, format=backend)  # read as that backend's file, whatever its metadata says
    if not isinstance(opened, NativeCheckpoint):  # a backend's format is never read as canonical
        opened.close()
        raise CheckpointError(f"cannot read {path}: {weights} is not a {backend} file")
    return QuantizedDirectory(path, opened, model_dir, settings)


def _spec_arg(spec: object, argument: str = "spec"):
    """A spec from a Spec, an Activation or a config dict/JSON string; None stays None."""
    if spec is None or isinstance(spec, (Spec, Activation)):
        return spec
    if isinstance(spec, (dict, str)):
        return from_config(spec)
    raise TypeError(f"{argument} must be a dense_bridge spec or its config dict. {received(argument, spec)}")
