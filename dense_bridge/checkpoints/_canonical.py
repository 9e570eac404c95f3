"""The canonical checkpoint: its format, its metadata, and reading it (:class:`CanonicalCheckpoint`).

Canonical checkpoint (format_version 1): a safetensors file whose tensors are the canonical
parameters ("0.kernel" (in_features, units), "0.bias" (units,), "0.mask", Bilinear kernel
(units, in1, in2)) in their own dtype (bfloat16 stored as BF16, never widened), and whose
string metadata (:func:`metadata`) holds

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
Written by ``_canonical_write.write_canonical`` (atomic, safe against concurrent saves); a
quantized model's codes add the ``quant`` key (``_quantized``).

What native checkpoints share with canonical ones lives here too: the spec as JSON in a file's
metadata (:func:`spec_json`, :func:`spec_from_json`), comparing a file's tensors with what a
spec expects (:func:`mismatches`), and the NaN/Inf rule for loaded params
(:func:`check_finite_params`).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from .._dtypes import dtype_name
from .._errors import CheckpointError, ConversionError, SpecError
from ..params._source import ParamSource, expected_params, nonfinite_counts
from ..specs import Dense, Sequential, from_config, layer_config
from ._safetensors import RESERVED, PendingTensor, SafetensorsFile, parse_json_object, shorten
from ._validate import LayerStream

__all__ = ["FORMAT", "FORMAT_VERSION", "LAYOUT_NOTE", "Progress", "CanonicalCheckpoint", "metadata", "spec_json",
           "spec_from_json", "mismatches", "check_finite_params", "check_tensor_name"]

FORMAT = "dense_bridge"
FORMAT_VERSION = "1"
LAYOUT_NOTE = ("canonical layout, y = x @ kernel + bias: Dense kernel (in_features, units), bias (units,), "
               "mask (in_features, units); Bilinear kernel (units, in1_features, in2_features), bias (units,); "
               "keys of a Sequential are '<position>.<name>'")
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


# ============================================================================ metadata
def spec_json(spec) -> str:
    """The spec's config as compact JSON, as stored in a file's metadata."""
    return json.dumps(layer_config(spec), separators=(",", ":"))


def spec_from_json(text: str, where: str):
    """The spec stored in a file's metadata (None for "" or "null"); every way it can be
    malformed is a CheckpointError naming ``where``."""
    if text in ("", "null"):
        return None

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"{where} has a spec in its metadata that cannot be read: {reason}")

    config = parse_json_object(text.encode("utf-8", "surrogatepass"), bad, "spec JSON")
    try:
        return from_config(config)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a hostile config triggers is the file's fault
        raise bad(f"{type(exc).__name__}: {shorten(str(exc), 300)}") from None


def mismatches(got: Mapping[str, tuple], expected: Mapping[str, tuple], note: str = "") -> list[str]:
    """Every difference between stored and expected (name -> (shape, dtype)), in words."""
    problems = []
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for k in expected:
        if k in got:
            (gs, gd), (es, ed) = got[k], expected[k]
            if tuple(gs) != tuple(es):
                problems.append(f"{k}: file has shape {tuple(gs)}, the spec expects {tuple(es)}{note}")
            elif gd != ed:
                problems.append(f"{k}: file has dtype {gd}, the spec expects {ed}")
    return problems


def check_finite_params(params: Mapping, path: str) -> None:
    """CheckpointError naming ``path`` and each parameter that holds NaN or Inf."""
    bad = nonfinite_counts(params)
    if bad:
        raise CheckpointError(f"{path} holds NaN or Inf parameters ("
                              + "; ".join(f"{k}: {n} value(s)" for k, n in bad.items())
                              + "); pass allow_nonfinite=True to load them anyway")


def metadata(spec, tensors: Mapping[str, PendingTensor], source: str) -> dict[str, str]:
    """The string metadata of a canonical checkpoint of ``spec`` (None: parameters only) holding
    ``tensors`` (name -> PendingTensor) saved from backend ``source`` (see the module doc)."""
    from .._version import __version__

    meta = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "spec": "null" if spec is None else spec_json(spec),
            "layout": json.dumps({k: "canonical" for k in tensors}),
            "layout_note": LAYOUT_NOTE,
            "dtypes": json.dumps({k: dtype_name(t.dtype) for k, t in tensors.items()}),
            "num_params": str(sum(math.prod(t.shape) for k, t in tensors.items() if not k.endswith("mask"))),
            "source_backend": source, "dense_bridge_version": __version__}
    if spec is None:
        meta["spec_note"] = ("parameters only, saved without a spec: pass spec= to db.load (--spec on the "
                             "command line) to rebuild a model")
    return meta


def check_tensor_name(name: str, path: str) -> None:
    """CheckpointError when ``name`` cannot be a tensor of a safetensors file."""
    if name == RESERVED:
        raise CheckpointError(f"cannot save {path}: params key {name!r} is reserved by the safetensors format for "
                              "the file's metadata, so a tensor of that name could not be read back; rename it")


# ============================================================================ reading
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
        stored = spec_from_json(str(self.meta.get("spec", "null")), path)
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
        problems = mismatches({n: (self.info(n).shape, dtype_name(self.info(n).numpy_dtype)) for n in self.where},
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

