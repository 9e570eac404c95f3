"""Checkpoints: ``db.save`` and ``db.load``, the canonical file format and the native ones.

Canonical checkpoint (format_version 1): a safetensors file whose tensors are the canonical
parameters ("0.kernel" (in_features, units), "0.bias" (units,), "0.mask", Bilinear kernel
(units, in1, in2)) in their own dtype (bfloat16 stored as BF16, never widened), and whose
string metadata holds

- ``format`` = "dense_bridge", ``format_version`` = "1";
- ``spec``: the JSON of ``spec.to_config()`` (rebuild with ``db.from_config``), or "null" when
  only parameters were saved (``spec_note`` then says so);
- ``layout``: JSON {name: "canonical"}, ``layout_note``: the canonical layout in words;
- ``dtypes``: JSON {name: dtype name}; ``num_params``, ``source_backend``, ``dense_bridge_version``.

Sharded (``max_shard_size``): ``model-<id>-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json`` = {"metadata": {the same keys, "total_size": bytes},
"weight_map": {name: shard file}} as model hubs write them; each shard's own metadata names
its index. ``<id>`` is a short random id, new for every save. Files are recognised by
content, not extension. A tensor may not be named ``__metadata__`` (safetensors reserves it).

Concurrency (several processes saving and loading one path):

- the index is the single commit point of a sharded save: its shards get names no other save
  uses and are complete on disk before the index is renamed over the old one, so a reader
  sees the old checkpoint or the new one, never a mix, and no save ever overwrites a file
  another save (or a reader's index) refers to;
- a save removes only files it can prove an earlier dense_bridge save of the same path wrote:
  shards named ``<stem>-<save id>-NNNNN-of-NNNNN.safetensors`` whose own metadata names the
  same index and save id, an index whose metadata says ``format: dense_bridge``, and
  temporaries ``<name>.tmp-<id>`` that no process holds locked (every save flocks its
  temporaries until they are renamed). Never a file an index merely lists, never a hub's own
  index or shards, never the files being written. Orphans of killed saves (temporaries,
  shards renamed before their index) are reclaimed by the next save to the path; the
  commit and the shard sweep happen under ``directory_lock`` (an flock on the directory),
  so concurrent saves to one path leave exactly the last one;
- readers take no lock: every safetensors file is opened once and mapped from that
  descriptor (``_safetensors.SafetensorsFile``), an index is read once, and when a save
  removes a shard (or the file) between reading the index and opening it, the read starts
  over (a few times) from the then current index.

Reading maps one tensor at a time, so loading onto a backend or converting a sharded
checkpoint holds one tensor of the source in memory beyond the output. Writes are atomic
(``_io.AtomicFiles``). Native formats (torch state dicts, Keras ``.weights.h5``/``.keras``, MLX
``.safetensors``/``.npz``, Flax ``.msgpack``, Equinox ``.eqx``, ONNX) are read and written by the
adapters' file verbs (``backends/<fw>/_files.py``) through ``_native``; every stream of a file's
tensors into a model or another file is checked layer by layer by ``_validate``.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from . import _extensions as extensions
from . import _native as native
from ._meta import check_finite_params, mismatches as _mismatches, spec_from_json as _spec_from_json
from ._meta import spec_json as _spec_json
from ._io import (AtomicFiles, check_writable, directory_lock, index_and_stem, new_save_id, parse_size, reclaim_temporaries, shard_names, shard_pattern, temp_pattern, write_limit_cause)
from .._dtypes import dtype_name
from .._errors import CheckpointError, ConversionError, DenseBridgeError, SpecError, received
from ..params._source import ParamSource, check_masks_match, expected_params, validate_params
from ..params._memory_budget import check_load_fits
from ._native_stream import stream_native
from ._validate import LayerStream
from ._path_guard import canonical_outputs, input_files, refuse_overwrite
from ._safetensors import (MAX_HEADER, RESERVED, PendingTensor, SafetensorsFile, is_safetensors, open_readonly, parse_json_object, pending, read_at, st_dtype, write_safetensors)
from ..activations import Activation
from ..specs import Dense, Sequential, Spec, from_config

__all__ = ["save", "load", "open_checkpoint", "convert_file", "FORMAT", "FORMAT_VERSION"]

FORMAT = "dense_bridge"
FORMAT_VERSION = "1"
LAYOUT_NOTE = ("canonical layout, y = x @ kernel + bias: Dense kernel (in_features, units), bias (units,), "
               "mask (in_features, units); Bilinear kernel (units, in1_features, in2_features), bias (units,); "
               "keys of a Sequential are '<position>.<name>'")
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


# ============================================================================ arguments
def _path_arg(path: object, argument: str = "path") -> str:
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if isinstance(text, str) and text:
            return text
    raise TypeError(f"{argument} must be a file path (str or os.PathLike). {received(argument, path)}")


def _spec_arg(spec: object, argument: str = "spec"):
    """A spec from a Spec, an Activation or a config dict/JSON string; None stays None."""
    if spec is None or isinstance(spec, (Spec, Activation)):
        return spec
    if isinstance(spec, (dict, str)):
        return from_config(spec)
    raise TypeError(f"{argument} must be a dense_bridge spec or its config dict. {received(argument, spec)}")


# ============================================================================ saving
def _is_native(obj: object) -> bool:
    from ..registry._backends import backend_of

    try:
        backend_of(obj)
    except TypeError:
        return False
    return True


def _as_array(value: object, name: str, path: str) -> np.ndarray:
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


def check_tensor_name(name: str, path: str) -> None:
    """CheckpointError when ``name`` cannot be a tensor of a safetensors file."""
    if name == RESERVED:
        raise CheckpointError(f"cannot save {path}: params key {name!r} is reserved by the safetensors format for "
                              "the file's metadata, so a tensor of that name could not be read back; rename it")


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
    if _is_native(obj):
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


def _metadata(spec, tensors: Mapping[str, PendingTensor], source: str) -> dict[str, str]:
    from .._version import __version__

    meta = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "spec": "null" if spec is None else _spec_json(spec),
            "layout": json.dumps({k: "canonical" for k in tensors}),
            "layout_note": LAYOUT_NOTE,
            "dtypes": json.dumps({k: dtype_name(t.dtype) for k, t in tensors.items()}),
            "num_params": str(sum(math.prod(t.shape) for k, t in tensors.items() if not k.endswith("mask"))),
            "source_backend": source, "dense_bridge_version": __version__}
    if spec is None:
        meta["spec_note"] = ("parameters only, saved without a spec: pass spec= to db.load (--spec on the "
                             "command line) to rebuild a model")
    return meta


def _plan_shards(tensors: Mapping[str, PendingTensor], limit: int | None) -> list[list[str]]:
    """Greedy, in order: a new shard starts when the next tensor would overflow the limit."""
    if limit is None:
        return [list(tensors)]
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += t.nbytes
    return groups


# ---------------------------------------------------------------------- what a save may remove
# A save removes only files it can prove an earlier dense_bridge save of the same path wrote:
# names of this library's scheme for that path (shard_pattern, temp_pattern) AND, for finished
# files, this library's metadata naming the same index and save id. Never the files being
# written, never an index or file another tool wrote, never anything an index merely lists.
def _our_index(index_path: str) -> bool:
    """Is ``index_path`` an index a dense_bridge save wrote (a hub's own index is not)?"""
    try:
        fd = open_readonly(index_path)
    except (OSError, CheckpointError):
        return False
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER:
            return False
        index = parse_json_object(read_at(fd, size, 0), CheckpointError, "index")
    except (OSError, CheckpointError):
        return False
    finally:
        os.close(fd)
    meta = index.get("metadata")
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _our_file_meta(path: str) -> dict[str, str] | None:
    """The metadata of ``path`` when it is a dense_bridge canonical safetensors file, else None."""
    try:
        with SafetensorsFile(path) as f:
            meta = f.metadata
    except (OSError, CheckpointError):
        return None
    return meta if meta.get("format") == FORMAT else None


def _our_shard(path: str, index_name: str, save_id: str) -> bool:
    """A shard written by a dense_bridge save for the index ``index_name`` with ``save_id``
    (a shard whose metadata holds no save id, as earlier dense_bridge versions wrote them,
    carries the id in its name only)."""
    meta = _our_file_meta(path)
    return (meta is not None and meta.get("index") == index_name
            and meta.get("save_id", save_id) == save_id)


def _temporaries_pattern(path: str):
    """Base names of every temporary a canonical save to ``path`` creates (file, index, shards)."""
    index, _ = index_and_stem(path)
    shards = shard_pattern(path).pattern.rstrip("$")
    parts = [temp_pattern(path).pattern.strip("^$"), temp_pattern(index).pattern.strip("^$"),
             shards.lstrip("^") + r"\.tmp-[0-9a-f]{8}"]
    return re.compile("^(?:" + "|".join(parts) + ")$")


def reclaim_leftovers(path: str) -> list[str]:
    """Remove what killed saves to ``path`` left behind: unlocked temporaries of this library's
    naming scheme. Orphan shards are removed by the next successful save (under its lock)."""
    return reclaim_temporaries(os.path.dirname(os.path.abspath(path)), _temporaries_pattern(path))


def _sweep_shards(path: str, keep: list[str]) -> list[str]:
    """Under the directory lock, after a commit: remove every shard of an earlier dense_bridge
    save to ``path`` (the replaced checkpoint's, and orphans of killed saves) except ``keep``."""
    directory = os.path.dirname(os.path.abspath(path))
    index, _ = index_and_stem(path)
    pattern = shard_pattern(path)
    kept = {os.path.abspath(k) for k in keep}
    doomed = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        match = pattern.match(name)
        full = os.path.join(directory, name)
        if match and os.path.abspath(full) not in kept and _our_shard(full, os.path.basename(index), match["id"]):
            doomed.append(full)
    _remove_quietly(doomed)
    return doomed


def _remove_quietly(paths) -> None:
    for p in paths:
        try:
            os.remove(p)
        except OSError:
            pass


def write_canonical(path: str, tensors: Mapping[str, PendingTensor], meta: Mapping[str, str],
                    max_shard_size: int | None = None, progress: Progress | None = None,
                    check_finite: bool = False) -> list[str]:
    """Write a canonical checkpoint atomically (sharded when asked); return the files written.

    See the module docstring for how concurrent saves and loads of one path stay consistent,
    and the section above for what a save removes.
    """
    for name in tensors:
        check_tensor_name(name, path)
    groups = _plan_shards(tensors, max_shard_size)
    total = sum(t.nbytes for t in tensors.values())
    done = [0]

    def tick(name: str, nbytes: int) -> None:
        done[0] += nbytes
        if progress is not None:
            progress(done[0], total)

    directory = os.path.dirname(os.path.abspath(path))
    reclaim_leftovers(path)
    if len(groups) == 1 and not path.endswith(".index.json"):
        stale_index, _ = index_and_stem(path)
        with AtomicFiles(path) as tx:
            tmp = tx.temp_for(path)
            with open(tmp, "wb") as f:
                write_safetensors(f, tensors, meta, tick, check_finite)
            tx.sync()
            with directory_lock(directory):
                tx.commit()
                # a sharded checkpoint saved earlier under this name would confuse its readers:
                # its index first, so a reader never finds an index whose shards are gone for good
                if _our_index(stale_index):
                    _remove_quietly([stale_index])
                _sweep_shards(path, keep=[])
        return [path]

    save_id = new_save_id()
    shards, index_path = shard_names(path, len(groups), save_id)
    shadow = path if path != index_path and os.path.lexists(path) else None
    # a concurrent sharded save may remove our own earlier single file between the two looks:
    # only a file still there after the metadata read failed is foreign
    if shadow is not None and _our_file_meta(path) is None and os.path.lexists(path):
        raise CheckpointError(f"cannot save {path} sharded: {path} exists and is not a dense_bridge checkpoint, "
                              f"so it would shadow the new index {index_path}; remove it or choose another path "
                              "(nothing was changed on disk)")
    index_meta: dict[str, Any] = dict(meta)
    index_meta["total_size"] = total
    index_meta["save_id"] = save_id
    weight_map = {}
    with AtomicFiles(path) as tx:
        for i, (names, shard) in enumerate(zip(groups, shards), start=1):
            tmp = tx.temp_for(shard, fresh=True)  # a name no other save uses
            shard_meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "shard": f"{i}/{len(groups)}",
                          "index": os.path.basename(index_path), "save_id": save_id}
            with open(tmp, "wb") as f:
                write_safetensors(f, {n: tensors[n] for n in names}, shard_meta, tick, check_finite)
            weight_map.update({n: os.path.basename(shard) for n in names})
        tmp = tx.temp_for(index_path)  # renamed last: the single commit point
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"metadata": index_meta, "weight_map": {n: weight_map[n] for n in tensors}}, f, indent=2)
            f.write("\n")
        tx.sync()
        with directory_lock(directory):
            tx.commit()
            if shadow is not None and _our_file_meta(path) is not None:
                _remove_quietly([path])  # an earlier single-file save here would shadow the new index
            _sweep_shards(path, keep=shards)
    return shards + [index_path]


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
    path = _path_arg(path)
    limit = parse_size(max_shard_size)
    check_writable(path)
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"allow_nonfinite must be True or False. {received('allow_nonfinite', allow_nonfinite)}")
    if (backend := _model_file_backend(path)) is not None:
        return _save_model_file(obj, path, backend, allow_nonfinite)
    if (written := extensions.quantized.save_hook(obj, path, limit, format, _metadata)) is not extensions.PASS:
        return written  # a model holding quantized layers: its codes (checkpoints/_quantized.py)
    spec, tensors, source = _resolve(obj, path, allow_nonfinite)
    for name in tensors:  # before anything is written
        check_tensor_name(name, path)
    try:
        return write_canonical(path, tensors, _metadata(spec, tensors, source), limit)
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
    from ._native import write_native

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


# ============================================================================ reading
class _Changed(Exception):
    """What was being read was replaced or removed by a concurrent save: read it again."""


def _open_sniffed(path: str) -> tuple[str, int]:
    """(kind, open descriptor) of the file at ``path``, judged by content: "safetensors",
    "index" (a JSON index), or "native" (for the backends' declared formats to recognise:
    ``_native.identify``). The caller owns the descriptor."""
    if os.path.isdir(path):
        raise CheckpointError(f"cannot read {path}: it is a directory; give a checkpoint file "
                              "(model.safetensors, model.safetensors.index.json, ...)")
    try:
        fd = open_readonly(path)  # refuses FIFOs and devices without blocking
    except FileNotFoundError:
        raise CheckpointError(f"cannot read {path}: no such file or directory") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return _kind(path, fd), fd
    except BaseException:
        os.close(fd)
        raise


def _head(path: str, fd: int) -> tuple[bytes, int]:
    """(the first 64 bytes, the size) of the open file."""
    try:
        return read_at(fd, 64, 0), os.fstat(fd).st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None


def _kind(path: str, fd: int) -> str:
    head, size = _head(path, fd)
    if size == 0:
        raise CheckpointError(f"cannot read {path}: the file is empty (0 bytes)")
    if is_safetensors(head, size):
        return "safetensors"
    if head.lstrip()[:1] == b"{":
        return "index"
    return "native"


def _probe(path: str, files: list[SafetensorsFile], fd: int | None = None):
    """What the backends' declared formats sniff (``_manifest.Probe``): the head of the file, or
    the opened safetensors files' metadata and tensor names."""
    from ..registry._manifest import Probe

    if fd is not None:
        head, size = _head(path, fd)
        return Probe(path, head, size)
    return Probe(path, b"", 0, metadata=dict(files[0].metadata) if files else {},
                 tensor_names=[n for f in files for n in f.tensors])


def _read_all(path: str, fd: int) -> bytes:
    """The whole (index) file; refused beyond MAX_HEADER bytes, the limit a safetensors header has."""
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER:
            raise CheckpointError(f"cannot read {path}: a JSON index of {size} bytes is larger than the "
                                  f"{MAX_HEADER}-byte limit")
        return read_at(fd, size, 0)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None


class CanonicalCheckpoint:
    """A canonical checkpoint opened for reading: headers parsed, tensors mapped on demand."""

    framework = None

    def __init__(self, path: str, files: list[SafetensorsFile], meta: Mapping[str, Any], spec=None,
                 index_path: str | None = None) -> None:
        self.path = path
        self.index_path = index_path
        self.files = files
        self.meta = dict(meta)
        version = str(self.meta.get("format_version", "?"))
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{path} is a dense_bridge checkpoint of format_version {version}; this version "
                                  f"of dense_bridge reads format_version {FORMAT_VERSION} (upgrade dense_bridge)")
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                self.where[name] = f
        stored = _spec_from_json(str(self.meta.get("spec", "null")), path)
        self.stored_spec = stored
        self.spec = _fill_lazy(spec if spec is not None else stored, self)
        if self.spec is not None:
            self._check(self.spec)
        self.kind = "dense_bridge checkpoint" + (f" ({len(files)} shards)" if index_path else "")

    def close(self) -> None:
        """Close the files' descriptors; arrays already returned stay valid."""
        for f in self.files:
            f.close()

    def __enter__(self) -> "CanonicalCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- info
    def info(self, name: str):
        return self.where[name].tensors[name]

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(n, self.info(n).shape, dtype_name(self.info(n).numpy_dtype)) for n in self.where]

    @property
    def total_bytes(self) -> int:
        return sum(self.info(n).nbytes for n in self.where)

    @property
    def source_backend(self) -> str:
        """The backend the parameters were saved from (the file's ``source_backend``)."""
        return self.meta.get("source_backend", "numpy")

    def _check(self, spec) -> None:
        try:
            expected = expected_params(spec)
        except SpecError as exc:
            raise CheckpointError(f"{self.path}: the spec cannot describe parameters: {exc}") from None
        problems = _mismatches({n: (self.info(n).shape, dtype_name(self.info(n).numpy_dtype)) for n in self.where},
                               {k: (tuple(s), d) for k, (s, d) in expected.items()})
        if problems:
            raise CheckpointError(f"{self.path} does not match the spec ({_describe(spec)}): "
                                  + "; ".join(problems))

    # -- data
    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` mapped from its file (copy-on-write: writable, the file never changes)."""
        return self.where[name].get(name)

    def params(self) -> dict[str, np.ndarray]:
        """All canonical parameters as in-memory arrays (copies)."""
        return {n: np.array(self.get(n)) for n in self.where}

    def pending(self) -> dict[str, PendingTensor]:
        """Every tensor as a PendingTensor: read from the file only when written out."""
        return {n: PendingTensor(self.info(n).numpy_dtype, self.info(n).shape, _getter(self, n)) for n in self.where}

    def layer_stream(self, allow_nonfinite: bool = False, progress: Progress | None = None) -> LayerStream:
        """``stream(index, layer_spec)`` -> that layer's validated canonical params, read from the
        mapped file when asked (what ``native`` builds from, and a layer-by-layer comparison of
        two files reads)."""
        if self.spec is None:
            raise CheckpointError(f"{self.path} holds parameters only (saved without a spec): pass spec= "
                                  "(--spec SPEC.json on the command line)")
        return LayerStream(self.spec, self.get, self.where, allow_nonfinite=allow_nonfinite, progress=progress,
                           total=self.total_bytes)

    def native(self, backend: str, progress: Progress | None = None, allow_nonfinite: bool = False):
        """A native model on ``backend``, its parameters streamed in one tensor at a time."""
        from .. import _api

        if self.spec is None:
            raise CheckpointError(f"{self.path} holds parameters only (saved without a spec): pass spec= to "
                                  "db.load (--spec SPEC.json on the command line) to build a model from it")
        source = ParamSource(self.spec, stream=self.layer_stream(allow_nonfinite, progress))
        try:
            return _api.build(backend, source)
        except ConversionError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None


def _getter(ckpt: CanonicalCheckpoint, name: str):
    return lambda: ckpt.get(name)


def _fill_lazy(spec, ckpt: CanonicalCheckpoint):
    """A lazy spec (in_features=None) gets its width from the stored kernel."""
    if spec is None or not getattr(spec, "lazy", False):
        return spec
    key = "kernel"
    if isinstance(spec, Sequential):
        first = next((i for i, l in enumerate(spec.layers) if isinstance(l, Dense)), None)
        key = f"{first}.kernel"
    if key in ckpt.where and len(ckpt.info(key).shape) == 2:
        return spec.with_in_features(int(ckpt.info(key).shape[0]))
    return spec


def _describe(spec) -> str:
    if isinstance(spec, Sequential):
        return f"Sequential of {len(spec.layers)} layers"
    return type(spec).__name__


def _open_shards(path: str, raw: bytes) -> tuple[dict, dict[str, SafetensorsFile]]:
    """(index, shard file name -> opened shard) of the index at ``path`` whose bytes are ``raw``.

    _Changed when a shard is missing and the index reads other bytes than ``raw`` (a save replaced it).
    """
    index = parse_json_object(raw, lambda why: CheckpointError(f"cannot read {path}: not a valid JSON index "
                                                                f"({why})"), "index")
    if not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"cannot read {path}: a JSON file but not a checkpoint index (no \"weight_map\")")
    d = os.path.dirname(path)
    files: dict[str, SafetensorsFile] = {}
    try:
        for name, fname in index["weight_map"].items():
            if not isinstance(fname, str) or not fname or os.path.basename(fname) != fname:
                raise CheckpointError(f"cannot read {path}: weight_map[{name!r}] must be a file name beside the "
                                      "index")
            if fname not in files:
                files[fname] = _open_shard(path, raw, os.path.join(d, fname), fname)
            if name not in files[fname].tensors:
                raise CheckpointError(f"cannot read {path}: the index maps {name!r} to {fname}, which does not "
                                      "hold it")
        for fname, f in files.items():
            extra = [n for n in f.tensors if index["weight_map"].get(n) != fname]
            if extra:
                raise CheckpointError(f"cannot read {path}: shard {fname} holds tensors the index does not list: "
                                      f"{extra}")
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return index, files


def _open_shard(path: str, raw: bytes, full: str, fname: str) -> SafetensorsFile:
    """The shard ``fname`` of the index at ``path``; errors name the index and the shard."""
    try:
        fd = open_readonly(full)
    except FileNotFoundError:
        if _read_index_again(path) != raw:
            raise _Changed() from None  # a save replaced the index (and removed its old shards)
        raise CheckpointError(f"cannot read {path}: its shard {fname} is missing (expected at {full})") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: its shard {full}: {exc.strerror or exc}") from None
    except CheckpointError as exc:
        raise CheckpointError(f"cannot read {path}: its shard {exc}") from None
    try:
        return SafetensorsFile(full, fd=fd)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot read {path}: its shard {exc}") from None


def _read_index_again(path: str) -> bytes | None:
    """The index's bytes now (None when unreadable): has a concurrent save replaced it?"""
    try:
        fd = open_readonly(path)
    except (OSError, CheckpointError):
        return None
    try:
        size = os.fstat(fd).st_size
        return read_at(fd, size, 0) if size <= MAX_HEADER else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _open_index(path: str, raw: bytes, spec, like, format):
    """A sharded checkpoint from its index (read once, as ``raw``): canonical or a hub's native one."""
    index, files = _open_shards(path, raw)
    meta = index.get("metadata") or {}
    try:
        if isinstance(meta, dict) and meta.get("format") == FORMAT and format in (None, "dense_bridge"):
            # codes of quantized layers (checkpoints/_quantized.py), or plain
            return extensions.quantized.canonical_checkpoint(path, list(files.values()), dict(meta), spec,
                                                             index_path=path)
        # a hub index of native shards
        shards = list(files.values())
        return native.open_native(path, _probe(path, shards), index=True, spec=spec, like=like, format=format,
                                  files=shards)
    except BaseException:
        for f in files.values():
            f.close()
        raise


#: How often a read starts over when a concurrent save replaces what it was reading.
_READ_ATTEMPTS = 20


def open_checkpoint(path: str | os.PathLike, *, spec=None, like=None, format: str | None = None):
    """A checkpoint opened for reading: canonical (CanonicalCheckpoint) or native (NativeCheckpoint).

    ``spec`` (a spec or config dict) or ``like`` (a native model of the same architecture) say
    what the file holds when the file does not carry a spec itself; ``format`` forces the
    reading of a native file ("torch", "keras", "mlx"). Safetensors files are opened once
    and stay consistent while a concurrent save replaces them; ``close()`` the result (or
    let it be garbage collected) to release their descriptors.
    """
    path = _path_arg(path)
    spec = _spec_arg(spec)
    if like is not None:
        if not _is_native(like):
            from ..registry._backends import names

            raise TypeError("like must be a native model or layer of the checkpoint's architecture (of a registered "
                            f"backend: {', '.join(names())}); pass a dense_bridge spec as spec= instead. "
                            f"{received('like', like)}")
        if spec is None:
            from .. import _api

            spec = _api.to_spec(like)
    if format is not None and format not in native.format_names():
        raise SpecError(f"format must be one of {', '.join(native.format_names())}. {received('format', format)}")
    if os.path.isdir(path) and (opened := extensions.quantized.open_model_dir(path)) is not None:
        return opened  # a quantized model directory (config.json "quantization"): checkpoints/_quantized.py
    for _ in range(_READ_ATTEMPTS):
        try:
            return _open_once(path, spec, like, format)
        except _Changed:
            continue
    raise CheckpointError(f"cannot read {path}: it was replaced by other saves {_READ_ATTEMPTS} times while being "
                          "read; try again when they are done")


def _open_once(path: str, spec, like, format):
    target = path
    if not os.path.exists(path) and os.path.isfile(path + ".index.json"):
        target = path + ".index.json"  # a sharded save to "model.safetensors" is read back by that name
    try:
        kind, fd = _open_sniffed(target)
    except CheckpointError:
        # a save switched between a single file and shards under this name since we looked
        if not os.path.exists(target) and (os.path.exists(path) or os.path.isfile(path + ".index.json")):
            raise _Changed() from None
        raise
    if kind == "safetensors":
        st = SafetensorsFile(target, fd=fd)
        try:
            if st.metadata.get("format") == FORMAT and format in (None, "dense_bridge"):
                if "shard" in st.metadata:
                    index = os.path.join(os.path.dirname(target), st.metadata.get("index", "?"))
                    raise CheckpointError(f"{target} is shard {st.metadata['shard']} of a sharded checkpoint: load "
                                          f"its index {index} instead")
                # codes of quantized layers (checkpoints/_quantized.py), or plain
                return extensions.quantized.canonical_checkpoint(target, [st], st.metadata, spec)
            return native.open_native(target, _probe(target, [st]), spec=spec, like=like, format=format, files=[st])
        except BaseException:
            st.close()
            raise
    try:
        raw = _read_all(target, fd) if kind == "index" else None
        probe = _probe(target, [], fd) if kind == "native" else None
    finally:
        os.close(fd)  # other kinds are read by their framework, from the path
    if kind == "index":
        return _open_index(target, raw, spec, like, format)
    return native.open_native(target, probe, spec=spec, like=like, format=format)


def load(path: str | os.PathLike, backend: str | None = None, *, spec=None, like=None, format: str | None = None,
         allow_nonfinite: bool = False, parallel=None, group=None):
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
    if hasattr(ckpt, "check_loaded"):  # codes of quantized layers: checkpoints/_quantized.py
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


# ============================================================================ converting
CANONICAL_TARGETS = ("canonical", "dense_bridge", "numpy")


def convert_file(src: str, to: str, out: str, *, spec=None, like=None, format: str | None = None,
                 max_shard_size: int | str | None = None, progress: Progress | None = None,
                 allow_nonfinite: bool = False) -> dict:
    """Convert checkpoint ``src`` to backend ``to``'s file format at ``out``; return a summary.

    ``to`` is a backend ("torch", "keras", "mlx") or "canonical" (also "numpy": the reference
    backend's format is the canonical checkpoint). Canonical -> canonical streams tensor by
    tensor; canonical -> native builds the native model one mapped tensor at a time. NaN/Inf
    parameters are refused (CheckpointError, nothing written) unless ``allow_nonfinite=True``.
    An ``out`` that is (or resolves to) one of the source's files is refused before anything is written.
    """
    from ..registry._backends import check_backend_name

    src = _path_arg(src, "src")
    out = _path_arg(out, "out")
    target = to.lower() if isinstance(to, str) else to
    if target not in CANONICAL_TARGETS:
        target = check_backend_name(to, "to")
    limit = parse_size(max_shard_size)
    if limit is not None and target not in CANONICAL_TARGETS:
        raise SpecError(f"max_shard_size applies to canonical checkpoints only (--to canonical), not to "
                         f"{target} files. {received('max_shard_size', max_shard_size)}")
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"allow_nonfinite must be True or False. {received('allow_nonfinite', allow_nonfinite)}")
    outputs = {"out": canonical_outputs(out) if target in CANONICAL_TARGETS else [out]}
    refuse_overwrite(outputs, {"src": input_files(src)})
    check_writable(out)
    ckpt = open_checkpoint(src, spec=spec, like=like, format=format)
    try:  # the files the source turned out to stand for (an index's shards), before anything is written
        refuse_overwrite(outputs, {"src": [f.path for f in getattr(ckpt, "files", None) or []]})
        return _convert(ckpt, src, target, out, limit, progress, allow_nonfinite)
    except CheckpointError as exc:
        if "NaN/Inf" in str(exc) and src not in str(exc):  # the writer's scan knows the tensor, not the file
            what = str(exc).split(" (pass allow_nonfinite")[0]
            raise CheckpointError(f"cannot convert {src}: {what} (allow_nonfinite=True, on the command line "
                                  "--allow-nonfinite, writes them)") from None
        raise
    finally:
        ckpt.close()


def _convert(ckpt, src: str, target: str, out: str, limit: int | None, progress: Progress | None,
             allow_nonfinite: bool = False) -> dict:
    coded = extensions.quantized.canonical_codes(ckpt, _metadata)  # codes of quantized layers are kept
    if target in CANONICAL_TARGETS:
        if coded is not None:
            tensors, meta = coded
        else:
            # each tensor read from the source only when its turn to be written comes: mapped from a
            # canonical file, served by the adapter's file_views, or a view of a loaded native model
            tensors = ckpt.pending()
            meta = _metadata(ckpt.spec, tensors, ckpt.source_backend)
        try:
            files = write_canonical(out, tensors, meta, limit, progress, check_finite=not allow_nonfinite)
        except DenseBridgeError:
            raise
        except Exception as exc:
            cause = write_limit_cause(out)
            raise CheckpointError(f"cannot write {out}: {type(exc).__name__}: {exc}{f' ({cause})' if cause else ''} "
                                  "(nothing was changed on disk)") from exc
        return {"src": src, "out": files, "to": "canonical", "spec": ckpt.spec is not None,
                "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values())}
    if coded is not None:
        return extensions.quantized.convert_codes(ckpt, src, target, out, progress, allow_nonfinite)
    if ckpt.spec is not None:  # straight from the source's mapped views into the target's file layout
        files = stream_native(ckpt.pending(), ckpt.spec, target, out, progress=progress,
                              allow_nonfinite=allow_nonfinite)
        if files is not None:
            return {"src": src, "out": files, "to": target, "spec": True, "tensors": len(ckpt.entries()),
                    "bytes": ckpt.total_bytes}
    model = ckpt.native(target, progress, allow_nonfinite=allow_nonfinite)
    files = native.write_native(model, target, out, spec=ckpt.spec)
    return {"src": src, "out": files, "to": target, "spec": True, "tensors": len(ckpt.entries()),
            "bytes": ckpt.total_bytes}
