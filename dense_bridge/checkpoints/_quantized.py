"""Checkpoints that keep a quantized model's codes: the canonical checkpoint with codes, and the
frameworks' own quantized files (read by their adapters' ``quant_file_*`` verbs through
``_native.NativeCheckpoint.held_codes``). A quantized model directory (mlx-lm's) is
``_model_dir.QuantizedDirectory``; :func:`summary` describes all three for ``dense-bridge inspect``.

Canonical checkpoint with codes (format_version 1, every key of ``_canonical``'s module doc, plus):

- a quantized linear layer at chain position ``p`` stores its canonical codes
  (``dense_bridge/quant.py``) instead of ``p.kernel``: ``p.qkernel`` (in_features, units), one
  integer per weight, unpacked (uint8: unsigned codes, MLX; int8: signed codes, torchao and
  Keras), ``p.scale`` (G, units), ``p.offset`` (scheme "affine") or ``p.zero`` ("zero_point")
  (G, units), and ``p.bias`` as any layer does (G = in_features / group_size, one group when
  group_size is None);
- metadata ``quant``: JSON {position: {"bits", "group_size", "scheme"}} (``db.Quant.to_config``),
  the position "0", "1", ... in a Sequential, "" for a lone layer. ``spec`` stays the float
  ``Dense`` the layer stands for: the spec is the function, ``quant`` how its kernel is stored.

Reading one (:class:`QuantizedCheckpoint`): ``db.load(path)`` gives ``(spec, params)`` with each
quantized position's codes and its ``db.Quant`` under ``p.quant`` (what
``get_params(layer, quantized=True)`` gives for one layer); ``db.load(path, backend)`` builds the
spec's float model and then, position by position, the backend's own quantized layer
(``quant_position_build``) holding the codes moved exactly (``quant.move``, requantize=False):
MLX affine/microscaling codes into MLX, torchao codes into torch, Keras codes into Keras. Where
the backend has no quantized layers, or none that dequantizes these codes to the same floats bit
for bit (MLX affine codes into torchao: another arithmetic), that position is the float layer
holding the exact dequantization (``quant.reference_dequantize``, the numpy copy of each
framework's arithmetic): a load never requantizes. ``db.linear_layers`` says which became which.

Everything a file says about its codes is checked before any array reaches a framework: the
``quant`` JSON, each Quant (bits 1-8, a group size dividing in_features), every tensor's shape
and dtype against the spec, and the codes' range for their bits: a CheckpointError naming the
tensor and the value.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from .._errors import CheckpointError, ConversionError, DenseBridgeError, SpecError, received
from ..quant import Quant, code_range, move, reference_dequantize
from ._canonical import CanonicalCheckpoint, check_finite_params, metadata, mismatches
from ._canonical_write import write_canonical
from ._model_dir import QuantizedDirectory
from ._native import NativeCheckpoint, file_adapter, format_names, is_native, write_native
from ._safetensors import parse_json, pending

__all__ = ["META_KEY", "QuantizedCheckpoint", "canonical_checkpoint", "save_codes", "canonical_codes",
           "convert_codes", "summary", "format_summary", "correct_linear_rows"]

META_KEY = "quant"
_CODE_KEYS = ("qkernel", "scale", "offset", "zero")


# ============================================================================ adapters' verbs
def _adapter(backend: str):
    from ..registry._backends import get_adapter

    return get_adapter(backend)


def quantized_positions(native: Any) -> dict[str, Any]:
    """Key prefix ("" or "0.", "1.", ...) -> quantized-layer handle of each quantized position of
    ``native`` (empty where its adapter has no ``quant_positions`` verb)."""
    from .. import _api

    verb = getattr(_adapter(_api.backend(native)), "quant_positions", None)
    return {} if verb is None else verb(native)


def _position(prefix: str) -> str:
    return prefix[:-1] if prefix.endswith(".") else prefix


def _prefix(position: str) -> str:
    return f"{position}." if position else ""


# ============================================================================ saving
def codes_tensors(native: Any, spec: Any = None) -> tuple[Any, dict, dict[str, dict]] | None:
    """(spec, tensors to write, {position: Quant config}) of a native model holding quantized
    layers: their codes, every other parameter as ``get_params`` reads it; None without any."""
    from .. import _api

    positions = quantized_positions(native)
    if not positions:
        return None
    spec = spec if spec is not None else _api.to_spec(native)
    tensors: dict = {}
    quant: dict[str, dict] = {}
    for key, value in _api.get_params(native, copy=False).items():
        prefix = key[:key.rfind(".") + 1]
        handle = positions.get(prefix)
        if handle is None:
            tensors[key] = pending(np.asarray(value))
        elif _position(prefix) not in quant:  # the codes once, where the layer's kernel would be
            for name, v in handle.codes().items():
                if name == "quant":
                    quant[_position(prefix)] = v.to_config()
                else:
                    tensors[prefix + name] = pending(np.asarray(v))
    return spec, tensors, quant


def save_codes(obj: Any, path: str, limit: int | None, format: str | None) -> list[str] | None:
    """``db.save`` of a native model holding quantized layers: its codes in a canonical checkpoint,
    or with ``format`` naming its own backend (or a file name only that backend writes: MLX
    ``.npz``, Keras ``.weights.h5``), that framework's own file (MLX: ``weight`` uint32 packed,
    ``scales``, ``biases``; Keras: int8 ``kernel``, ``kernel_scale``, ...). Returns the files
    written; None for anything else (a plain save)."""
    from .. import _api

    if not is_native(obj) or not quantized_positions(obj):
        return None
    backend = _api.backend(obj)
    try:
        spec = _api.to_spec(obj)
    except DenseBridgeError as exc:
        raise CheckpointError(f"cannot save {path}: {exc}") from None
    if format is None and _own_file_name(backend, path):
        format = backend
    if format not in (None, "dense_bridge"):
        if format not in format_names():
            return None
        if format != backend:
            why = f"its codes go into {backend} files only (or canonical ones)"
        elif not _reads_own_codes(backend, path):
            why = f"{format} files are not read back with codes (its adapter has no quant_file_template verb)"
        else:
            return write_native(obj, backend, path, spec=spec)
        raise CheckpointError(f"cannot save {path} as {format} files: the model is a {backend} model holding "
                              f"quantized layers, and {why}; save it canonical (format=None: codes kept), or move "
                              f"it first (db.transfer/db.convert). Received: format={format!r}")
    spec, tensors, quant = codes_tensors(obj, spec)
    meta = metadata(spec, tensors, backend)
    meta[META_KEY] = json.dumps(quant, separators=(",", ":"))
    return write_canonical(path, tensors, meta, limit)


def _reads_own_codes(backend: str, path: str) -> bool:
    """Does ``backend``'s adapter read its own quantized files back (``quant_file_template``)?"""
    return getattr(file_adapter(backend, f"writing {path}"), "quant_file_template", None) is not None


def _own_file_name(backend: str, path: str) -> bool:
    """Does ``path`` end in a file name only ``backend``'s own quantized files use (MLX ``.npz``,
    Keras ``.weights.h5``; ``.safetensors`` stays canonical unless ``format=`` says otherwise)?"""
    from ..registry._backends import formats

    if not _reads_own_codes(backend, path):
        return False
    endings = [e for name, f in formats() if name == backend and f.write_kind
               for e in f.extensions or () if e != ".safetensors"]
    return path.lower().endswith(tuple(endings)) if endings else False


# ============================================================================ reading canonical
def canonical_checkpoint(path: str, files: list, meta: dict, spec: Any, index_path: str | None = None):
    """A :class:`QuantizedCheckpoint` when ``meta`` carries quantized layers, else a CanonicalCheckpoint."""
    cls = QuantizedCheckpoint if META_KEY in meta else CanonicalCheckpoint
    return cls(path, files, meta, spec, index_path=index_path)


def parse_quant_meta(text: Any, path: str) -> dict[str, Quant]:
    """The metadata ``quant`` JSON as {position: Quant}; a CheckpointError naming what is wrong."""
    if isinstance(text, str):  # one reading of a position: a key named twice is refused
        config = parse_json(text.encode("utf-8", "surrogatepass"), CheckpointError,
                            f"{path}: metadata {META_KEY!r}")
    else:
        config = text
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: metadata {META_KEY!r} must be a JSON object {{position: "
                              f"{{bits, group_size, scheme}}}}. {received(META_KEY, str(text)[:200])}")
    out = {}
    for position, layer in config.items():
        try:
            out[position] = Quant.from_config(layer)
        except (SpecError, TypeError) as exc:
            raise CheckpointError(f"{path}: metadata {META_KEY}[{position!r}] = {json.dumps(layer)[:200]} is not a "
                                  f"quantization scheme: {exc}") from None
    return out


class QuantizedCheckpoint(CanonicalCheckpoint):
    """A canonical checkpoint holding codes for some positions (see the module doc)."""

    def __init__(self, path: str, files: list, meta: dict, spec: Any = None, index_path: str | None = None) -> None:
        self.quant_layers = parse_quant_meta(meta.get(META_KEY), path)
        super().__init__(path, files, meta, spec, index_path=index_path)
        self.kind += f", {len(self.quant_layers)} quantized layer{'s' if len(self.quant_layers) != 1 else ''}"

    # -- structure
    def _layer_spec(self, position: str):
        from ..specs import Dense, Sequential

        spec = self.spec
        if isinstance(spec, Sequential):
            if not position.isdigit() or int(position) >= len(spec.layers):
                raise CheckpointError(f"{self.path}: metadata {META_KEY} names position {position!r}, which the "
                                      f"spec (a Sequential of {len(spec.layers)} layers) does not have")
            layer = spec.layers[int(position)]
        elif position != "":
            raise CheckpointError(f"{self.path}: metadata {META_KEY} names position {position!r}, but the spec is "
                                  f"one layer (position '')")
        else:
            layer = spec
        if not isinstance(layer, Dense) or layer.mask is not None:
            raise CheckpointError(f"{self.path}: metadata {META_KEY} quantizes position {position!r}, which the spec "
                                  f"describes as {type(layer).__name__}"
                                  f"{' with a mask' if isinstance(layer, Dense) else ''}"
                                  f", not a linear layer without a mask")
        return layer

    def _check(self, spec) -> None:
        from .._dtypes import dtype_name
        from ..params._source import expected_params

        try:
            expected = {k: (tuple(s), d) for k, (s, d) in expected_params(spec).items()}
        except SpecError as exc:
            raise CheckpointError(f"{self.path}: the spec cannot describe parameters: {exc}") from None
        got = {n: (tuple(self.info(n).shape), dtype_name(self.info(n).numpy_dtype)) for n in self.where}
        for position, quant in self.quant_layers.items():
            layer = self._layer_spec(position)
            p = _prefix(position)
            n, units = layer.in_features, layer.units
            if n is None or (quant.group_size or n) > n or n % (quant.group_size or n):
                raise CheckpointError(f"{self.path}: tensor {p + 'qkernel'!r}: group_size {quant.group_size} does not "
                                      f"divide in_features {n} (metadata {META_KEY}[{position!r}])")
            groups = quant.groups(n)
            expected.pop(p + "kernel", None)
            for name, dtypes in (("qkernel", ("uint8", "int8")), ("scale", None),
                                 ({"affine": "offset", "zero_point": "zero"}.get(quant.scheme), None)):
                if name is None:
                    continue
                shape = (n, units) if name == "qkernel" else (groups, units)
                stored = got.get(p + name)
                # the dtype is the file's own (checked below by kind), the shape the spec's
                expected[p + name] = (shape, stored[1] if stored else "float32")
                if stored is not None and dtypes is not None and stored[1] not in dtypes:
                    raise CheckpointError(f"{self.path}: tensor {p + name!r} holds codes and must be uint8 or int8; "
                                          f"the file has {stored[1]}")
                if stored is not None and name in ("scale", "offset") and not stored[1].startswith(("float", "bfloat")):
                    raise CheckpointError(f"{self.path}: tensor {p + name!r} must hold floats; the file has "
                                          f"{stored[1]}")
        problems = mismatches(got, expected)
        if problems:
            raise CheckpointError(f"{self.path} does not match the spec and its quantized layers: "
                                  + "; ".join(problems))

    # -- data
    def layer_codes(self, position: str) -> dict[str, Any]:
        """The canonical codes of the quantized layer at ``position`` (copies, range-checked)."""
        p = _prefix(position)
        quant = self.quant_layers[position]
        out: dict[str, Any] = {"quant": quant}
        for name in _CODE_KEYS + ("bias",):
            if p + name in self.where:
                out[name] = np.array(super().get(p + name))
        q = out["qkernel"]
        lo, hi = code_range(quant.bits, q.dtype.kind == "i")
        if q.size and (int(q.min()) < lo or int(q.max()) > hi):
            bad = int(q.min()) if int(q.min()) < lo else int(q.max())
            raise CheckpointError(f"{self.path}: tensor {p + 'qkernel'!r} holds the code {bad}, outside the "
                                  f"{quant.bits}-bit {'signed' if q.dtype.kind == 'i' else 'unsigned'} range "
                                  f"{lo}..{hi}")
        return out

    def get(self, name: str) -> np.ndarray:
        """A stored tensor, or for a quantized position's ``kernel`` its exact dequantization
        (what a float model of the spec, and a layer-by-layer comparison, read)."""
        position, _, key = name.rpartition(".")
        if key == "kernel" and position in self.quant_layers and name not in self.where:
            return reference_dequantize(self.layer_codes(position))
        return super().get(name)

    def layer_stream(self, allow_nonfinite: bool = False, progress=None):
        """As a canonical checkpoint's, each quantized position's ``kernel`` its exact
        dequantization (:meth:`get`)."""
        from ._validate import LayerStream

        if self.spec is None:
            return super().layer_stream(allow_nonfinite, progress)  # its error: no spec stored
        present = set(self.where) | {_prefix(p) + "kernel" for p in self.quant_layers}
        return LayerStream(self.spec, self.get, present, allow_nonfinite=allow_nonfinite, progress=progress,
                           total=self.total_bytes)

    def params(self) -> dict[str, Any]:
        """Every stored tensor (copies), each quantized position's codes range-checked, and its
        ``db.Quant`` under ``<position>.quant``."""
        out = super().params()
        for position in self.quant_layers:
            out.update({_prefix(position) + k: v for k, v in self.layer_codes(position).items()})
        return out

    def check_loaded(self, params: dict, allow_nonfinite: bool) -> None:
        """``db.load(path)``'s checks on what it hands out (the shapes were checked on opening)."""
        if not allow_nonfinite:
            check_finite_params({k: v for k, v in params.items() if not isinstance(v, Quant)}, self.path)

    def native(self, backend: str, progress=None, allow_nonfinite: bool = False):
        """The spec's model on ``backend``: float everywhere first (each quantized position its
        exact dequantization), then each quantized position the backend's own quantized layer
        holding the codes, where it dequantizes them to those floats bit for bit."""
        codes = {p: self.layer_codes(p) for p in self.quant_layers}
        specs = {p: self._layer_spec(p) for p in self.quant_layers}
        while True:
            model = super().native(backend, progress, allow_nonfinite)
            refused = install_codes(model, backend, codes, specs, self.path)
            if not isinstance(refused, str):
                return refused
            # the backend built a quantized layer its codes do not fit exactly (rare: the scheme
            # matched): build the float model again, that position left float
            codes.pop(refused)


def install_codes(model: Any, backend: str, codes: dict[str, dict], layer_specs: dict, where: str) -> Any:
    """``model`` (float, on ``backend``) with each position of ``codes`` turned into the backend's
    quantized layer holding those codes exactly; positions whose scheme the backend does not
    build stay float. Returns the model, or the position (a str) whose codes did not move
    exactly into the quantized layer the backend built for them (the model is then half-made)."""
    adapter = _adapter(backend)
    build = getattr(adapter, "quant_position_build", None)
    if build is None:
        return model
    for position, qp in codes.items():
        if not layer_specs[position].activation.is_identity:
            continue  # a quantized layer of these frameworks applies no activation of its own
        want = {"kernel": reference_dequantize(qp)}
        if "bias" in qp:
            want["bias"] = qp["bias"]
        try:
            model = build(model, _prefix(position), qp["quant"])
        except (ConversionError, SpecError):
            continue  # not a scheme this backend builds: the float layer, exactly the dequantization
        handle = adapter.quant_positions(model)[_prefix(position)]
        try:
            cand, _ = move(handle, want, qp, requantize=False, where=f"{where} position {position!r}")
        except ConversionError:
            return position
        cand.write()
    return model


# ============================================================================ native files
def canonical_codes(ckpt: Any) -> tuple[dict, dict] | None:
    """(tensors, metadata) of the canonical checkpoint with codes that ``ckpt`` converts into
    (``dense-bridge convert --to canonical``); None where ``ckpt`` holds no codes."""
    if isinstance(ckpt, QuantizedCheckpoint):
        tensors = ckpt.pending()
        quant = {p: q.to_config() for p, q in ckpt.quant_layers.items()}
        source = ckpt.meta.get("source_backend", "numpy")
    elif isinstance(ckpt, NativeCheckpoint) and ckpt.spec is not None and ckpt.held_codes() is not None:
        found = codes_tensors(ckpt.template(), ckpt.spec)
        if found is None:
            return None
        _, tensors, quant = found
        source = ckpt.framework
    else:
        return None
    meta = metadata(ckpt.spec, tensors, source)
    meta[META_KEY] = json.dumps(quant, separators=(",", ":"))
    return tensors, meta


def convert_codes(ckpt: Any, src: str, target: str, out: str, progress=None, allow_nonfinite: bool = False) -> dict:
    """``dense-bridge convert`` of a checkpoint with codes into ``target``'s file: the codes where
    that framework's files hold quantized layers (``quant_file_template``), else the exact
    dequantization."""
    model = ckpt.native(target, progress, allow_nonfinite=allow_nonfinite)
    if getattr(file_adapter(target, f"writing {out}"), "quant_file_template", None) is None:
        from .. import _api

        model = _api.compile(ckpt.spec, target, params=_api.get_params(model), allow_nonfinite=allow_nonfinite)
    files = write_native(model, target, out, spec=ckpt.spec)
    return {"src": src, "out": files, "to": target, "spec": True, "tensors": len(ckpt.entries()),
            "bytes": ckpt.total_bytes}


# ============================================================================ inspect
def summary(ckpt: Any) -> list[dict] | None:
    """One row per quantized layer a checkpoint holds ({"layer", "bits", "group_size", "scheme",
    "in_features", "units"}; None where the file alone does not say), for ``dense-bridge
    inspect``; None when it holds none."""
    rows = []
    if isinstance(ckpt, QuantizedCheckpoint):
        for position, quant in ckpt.quant_layers.items():
            layer = ckpt._layer_spec(position)
            rows.append({"layer": position, **quant.to_config(), "in_features": layer.in_features,
                         "units": layer.units})
    elif isinstance(ckpt, QuantizedDirectory):  # widths as the adapter reads them from the packing
        for name, (quant, in_features, units) in ckpt.quant_layers.items():
            rows.append({"layer": name, **quant.to_config(), "in_features": in_features, "units": units})
    else:
        found = ckpt.held_codes() if isinstance(ckpt, NativeCheckpoint) else None
        if not found:
            return None
        if ckpt.spec is None:
            rows = [{"layer": name, "bits": None, "group_size": None, "scheme": None, "in_features": None,
                     "units": None} for name in found]
        else:
            for prefix, handle in quantized_positions(ckpt.template()).items():
                rows.append({"layer": _position(prefix), **handle.quant.to_config(),
                             "in_features": handle.in_features, "units": handle.units})
    return rows or None


def correct_linear_rows(rows: list[dict], quantized: list[dict] | None) -> list[dict]:
    """``models.file_linear_layers`` rows with each quantized layer's packed shape replaced by
    its real widths (a packed uint32 ``weight`` is not an (out, in) kernel)."""
    known = {q["layer"]: q for q in quantized or [] if q["in_features"] is not None}
    out = []
    for r in rows:
        q = known.get(r["layer"])
        if q is not None:
            group = "per-channel" if q["group_size"] is None else f"group {q['group_size']}"
            r = dict(r, in_features=q["in_features"], units=q["units"], layout="out_in",
                     dtype=f"{r['dtype']} ({q['bits']}-bit {q['scheme']}, {group})",
                     layout_source="assumed from the file format (packed codes, one row per output unit)")
        out.append(r)
    return out


def format_summary(rows: list[dict]) -> str:
    """The ``dense-bridge inspect`` lines for :func:`summary`'s rows."""
    lines = [f"quantized layers ({len(rows)}; their codes are kept, see README 'Quantized layers'):"]
    width = max(len(r["layer"] or "<root>") for r in rows)
    for r in rows:
        what = ("scheme read when loaded with a spec" if r["bits"] is None else
                f"{r['bits']}-bit {r['scheme']}, " + ("per-channel" if r["group_size"] is None else
                                                       f"group {r['group_size']}"))
        widths = "" if r["in_features"] is None else f"  in={r['in_features']} units={r['units']}"
        lines.append(f"  {r['layer'] or '<root>':<{width}}  {what}{widths}")
    return "\n".join(lines)
