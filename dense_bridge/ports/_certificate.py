"""The certificate of a port (``out/port_certificate.json``, API.md "Whole checkpoints") and its
check (``db.verify_port``): the destination tensors streamed from their sources with the
operations recorded, and every entry confirmed again later from the files alone.

A tensor entry: ``{"sources": [{"file", "tensor", "slice", "transpose"[, "view"]}], "axis", "ops",
"dtypes", "exact", "max_ulp", "codes", "file"[, "view", "shape"]}``; each source is first seen
through its ``view`` where it has one (``"<axis order>-<split>"``, ``_rules.apply_view``: a (heads,
in, head_dim) kernel seen as a matrix), then sliced (``slice``: one ``[start, stop]`` per axis of the
source as stored, or of its view), then transposed when ``transpose``; the pieces are concatenated
along ``axis`` (a single piece: taken as it is), the entry's ``view`` undone into ``shape`` where
it has one (``_rules.undo_view``), then cast to ``dtypes[-1]``. An entry with ``"stack": true``
stacks its pieces along the new axis ``axis`` instead (expert stacks); one with ``"pick": true``
takes one entry of the stored axis ``axis`` and drops that axis. A transpose exchanges the last
two axes. An entry with ``"offset": c`` adds c to every value (summed in float64, rounded once to
``dtypes[-1]``): a norm's scale one library stores as ``w`` and the other as ``1 + w``.
A slice may carry a step (``[start, stop, step]``: every step-th entry, a piece of an
interleaving); an entry with ``"stride": n`` interleaves its n pieces along ``axis`` (entry i of
piece k at i * n + k) instead of concatenating them. An entry with ``"zeros": true`` has no sources and holds exact zeros of its ``shape`` (``ops``
``["zeros"]``): a bias the destination's layer holds and the source's lacks (``_zeros``).
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import CheckpointError, received
from .._version import __version__
from ..checkpoints import _port_files as files
from ..checkpoints._safetensors import PendingTensor, SafetensorsFile
from . import _dirs, _rules, _zeros

NAME = "port_certificate.json"
VERSION = 1


def _dtype_name(dt: np.dtype) -> str:
    from .._dtypes import dtype_name

    return dtype_name(dt)


def _source_slice(shape: tuple[int, ...], transpose: bool, axis: int | None, start: int, stop: int | None):
    """The slice of the stored source (one [start, stop] per axis) a piece takes."""
    full = [[0, n] for n in shape]
    if axis is None or stop is None:
        return full
    n = len(shape)  # a transpose exchanges the last two axes
    stored_axis = (2 * n - 3 - axis) if transpose and axis >= n - 2 else axis
    full[stored_axis] = [start, stop]
    return full


def make(sources: list[tuple], axis: int | None, dtype: np.dtype, shape=None, view=None, stack: bool = False,
         pick: bool = False, offset: float = 0.0, stride: int | None = None) -> np.ndarray:
    """A destination tensor from its source pieces ``(array, slice, transpose[, view])``, its
    ``view`` undone into ``shape`` when given (see the module docstring). Views where the recipe
    allows (a single transposed piece is written from its view). ``stack``: the pieces stacked
    along a new axis ``axis`` (expert stacks); ``pick``: the one piece's stored axis ``axis``
    (sliced to one entry) dropped before any transpose. ``offset``: added to every value, summed in
    float64 (exact for any float32 + 1) and rounded once to ``dtype``. A slice may carry a step
    (``[start, stop, step]``: every step-th entry); ``stride``: the pieces interleaved along
    ``axis`` instead of concatenated."""
    parts = []
    for arr, sl, transpose, *source_view in sources:
        if source_view and source_view[0] is not None:
            arr = _rules.apply_view(arr, source_view[0])
        piece = arr[tuple(slice(*x) for x in sl)] if sl else arr
        if pick:
            piece = np.squeeze(piece, axis=axis)
        parts.append(np.swapaxes(piece, -1, -2) if transpose and piece.ndim >= 2 else piece)
    if stack:
        out = np.stack(parts, axis=axis)
    elif stride and len(parts) > 1:
        from ..models._stride import interleave

        out = interleave(parts, axis)
        if isinstance(out, str):
            raise CheckpointError(f"the pieces do not interleave: {out}")
    else:
        out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
    if view is not None:
        out = _rules.undo_view(out, view, tuple(shape))
    if offset:
        out = np.asarray(out, np.float64) + offset
    return out if out.dtype == dtype else out.astype(dtype)


def _ops(entry_sources: list[dict], axis, src_dt: np.dtype, dst_dt: np.dtype) -> list[str]:
    ops = []
    for s in entry_sources:
        shape_slice = s["slice"]
        full = s["shape"]
        if s.get("view") is not None:
            full = _rules.view_shape(tuple(s["shape"]), s["view"])
            ops.append(f"view {s['tensor']} as {full} (axes {s['view']})")
        if any(x[0] != 0 or x[1] != n or len(x) > 2 for x, n in zip(shape_slice, full)):
            ops.append(f"slice {s['tensor']} " + "[" + ", ".join(":".join(map(str, x)) for x in shape_slice) + "]")
        if s["transpose"]:
            ops.append(f"transpose {s['tensor']}")
    if len(entry_sources) > 1:
        ops.append(f"concatenate axis {axis}")
    if src_dt != dst_dt:
        ops.append(f"cast {_dtype_name(src_dt)} -> {_dtype_name(dst_dt)}")
    return ops or ["copy"]


def _exact(src_dt: np.dtype, dst_dt: np.dtype) -> bool:
    return src_dt == dst_dt or (src_dt.itemsize < dst_dt.itemsize and dst_dt.kind == "f")


def _max_ulp(a: np.ndarray, dtype: np.dtype) -> int:
    """Largest rounding, in units in the last place of ``dtype``, of ``a`` cast to ``dtype``."""
    wide = np.asarray(a, np.float64)
    narrow = np.asarray(a).astype(dtype).astype(np.float64)
    spacing = np.abs(np.spacing(np.asarray(narrow, np.float32).astype(dtype)).astype(np.float64))
    spacing[spacing == 0] = np.finfo(np.float64).tiny
    return int(np.ceil(np.max(np.abs(wide - narrow) / spacing))) if a.size else 0


def write_all(tmp: str, shards, layout: dict, opened: dict[str, SafetensorsFile], weights: dict[str, str],
              out_dtype: dict[str, np.dtype], nbytes, total: int, progress, hashes=None,
              file_keys: dict[str, str] | None = None, writer=None) -> tuple[dict, int]:
    """Every shard written into ``tmp``; returns (certificate tensor entries, bytes written).
    ``file_keys``: a source name the moves use -> the key stored in its file, where they differ
    (the certificate names the stored key). ``writer``: ``(path, tensors, on_tensor) -> bytes``
    for a destination that writes its own weight format (``_dirs.writer``), else safetensors."""
    file_keys = file_keys or {}
    bar = _Progress(progress, sum(len(s) for s in shards), total)
    entries: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    written = 0
    for moves, name in zip(shards, layout["shards"]):
        tensors = {}
        for m in moves:
            if getattr(m, "zeros", False):  # no source: exact zeros (a bias the source's layer lacks)
                dst_dt = out_dtype[m.target]
                entries[m.target] = _zeros.entry(tuple(m.shape), _dtype_name(dst_dt), name)
                tensors[m.target] = PendingTensor(dst_dt, tuple(m.shape),
                                                  lambda m=m, dt=dst_dt: np.zeros(tuple(m.shape), dt))
                weight_map[m.target] = name
                continue
            pieces = []
            for s_key, transpose, start, stop in m.sources:
                s_key, k = _rules.split_view(s_key)
                stored = file_keys.get(s_key, s_key)
                info = opened[weights[s_key]].tensors[stored]
                seen = tuple(info.shape) if k is None else _rules.view_shape(tuple(info.shape), k)
                pieces.append({"file": weights[s_key], "tensor": stored, "shape": list(info.shape),
                               "slice": _source_slice(seen, transpose and not getattr(m, "pick", False),
                                                      None if getattr(m, "stack", False) else m.axis, start, stop),
                               "transpose": transpose, "view": k})
            stride = getattr(m, "stride", None)
            if stride and len(pieces) == 1:  # every stride-th entry of the one source, along its stored axis
                n_ax = len(pieces[0]["shape"])
                tr = pieces[0]["transpose"]
                stored_axis = (2 * n_ax - 3 - m.axis) if tr and m.axis >= n_ax - 2 else m.axis
                pieces[0]["slice"][stored_axis] = [m.sources[0][2], pieces[0]["shape"][stored_axis], stride]
            first = _rules.split_view(m.sources[0][0])[0]
            src_dt = opened[weights[first]].tensors[file_keys.get(first, first)].numpy_dtype
            dst_dt = out_dtype[m.target]
            entry = {"sources": [{k: p[k] for k in ("file", "tensor", "slice", "transpose", "view")
                                  if k != "view" or p["view"] is not None} for p in pieces],
                     **({"view": m.view, "shape": list(m.shape)} if m.view is not None else {}),
                     "axis": m.axis, "ops": _ops(pieces, m.axis, src_dt, dst_dt),
                     "dtypes": [_dtype_name(src_dt), _dtype_name(dst_dt)], "exact": _exact(src_dt, dst_dt),
                     "max_ulp": 0 if _exact(src_dt, dst_dt) else None, "codes": None, "file": name}
            offset = float(getattr(m, "offset", 0.0) or 0.0)
            if offset:  # a sum: exact only where every value comes out unrounded (known once written)
                entry.update(offset=offset, exact=False, max_ulp=None)
                entry["ops"].append(f"add {offset:g}")
            if stride and len(pieces) > 1:
                entry["stride"] = stride
                entry["ops"] = [op if not op.startswith("concatenate") else f"interleave axis {m.axis} (stride {stride})"
                                for op in entry["ops"]]
            new_axis = {k: True for k in ("stack", "pick") if getattr(m, k, False)}
            if new_axis:  # along a new axis: stacked, or one entry taken (and the ops say so)
                entry.update(new_axis)
                entry["ops"].insert(0, f"{'stack along new' if 'stack' in new_axis else 'take one entry of'} axis {m.axis}")
            entries[m.target] = entry

            def produce(m=m, pieces=pieces, dst_dt=dst_dt, entry=entry, offset=offset):
                arrays = [(opened[p["file"]].get(p["tensor"]), p["slice"], p["transpose"], p["view"]) for p in pieces]
                flags = {k: bool(entry.get(k)) for k in ("stack", "pick")}
                flags["stride"] = entry.get("stride")
                if offset:  # the sum as float64, its rounding to the destination's dtype stated
                    exact = make(arrays, m.axis, np.dtype(np.float64), m.shape, m.view, **flags, offset=offset)
                    entry["max_ulp"] = _max_ulp(exact, dst_dt)
                    entry["exact"] = entry["max_ulp"] == 0
                    return exact.astype(dst_dt)
                value = make(arrays, m.axis, dst_dt, m.shape, m.view, **flags)
                if not entry["exact"]:
                    entry["max_ulp"] = _max_ulp(make(arrays, m.axis, arrays[0][0].dtype, m.shape, m.view, **flags), dst_dt)
                    entry["exact"] = entry["max_ulp"] == 0
                return value

            tensors[m.target] = PendingTensor(dst_dt, tuple(m.shape), produce)
            weight_map[m.target] = name
        if writer is not None:
            written += writer(os.path.join(tmp, name), tensors, on_tensor=bar.tensor)
        else:
            written += files.write_weights(os.path.join(tmp, name), tensors, layout["metadata"],
                                           on_tensor=bar.tensor)
        if hashes is not None:
            hashes.add(("destination", name), os.path.join(tmp, name))
    if layout["index"]:
        files.write_json(os.path.join(tmp, layout["index"]),
                         {"metadata": {"total_size": sum(nbytes(m) for s in shards for m in s)},
                          "weight_map": dict(sorted(weight_map.items()))})
    bar.close()
    return entries, written


class _Progress:
    """Bytes and tensors written, on stderr when asked (True, or a terminal by default) or to a callable."""

    def __init__(self, progress, tensors: int, total: int) -> None:
        import sys

        self.fn = progress if callable(progress) else None
        self.show = progress is True or (progress is None and sys.stderr.isatty())
        self.tensors, self.total, self.done_t, self.done_b = tensors, total, 0, 0

    def tensor(self, name: str, nbytes: int) -> None:
        self.done_t += 1
        self.done_b += nbytes
        if self.fn:
            self.fn(self.done_t, self.tensors, self.done_b, self.total)
        elif self.show:
            import sys

            sys.stderr.write(f"\rport: {self.done_t}/{self.tensors} tensors, {self.done_b / 1e6:.1f}/"
                             f"{self.total / 1e6:.1f} MB")
            sys.stderr.flush()

    def close(self) -> None:
        if self.show and not self.fn:
            import sys

            sys.stderr.write("\n")


def _libraries(*fmts) -> dict[str, str]:
    from importlib import metadata

    out = {"dense_bridge": __version__, "python": platform.python_version(), "numpy": np.__version__}
    for fmt in fmts:
        try:
            out[fmt.name] = metadata.version(fmt.name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _hashes(directory: str, names, hashes=None, where: str = "") -> dict[str, str]:
    if hashes is None:
        return {n: files.sha256_file(os.path.join(directory, n)) for n in sorted(names)}
    for n in names:
        hashes.add((where, n), os.path.join(directory, n))
    return {n: hashes.get((where, n)) for n in sorted(names)}


def source_names(src_fmt, src_paths, extras) -> list[str]:
    """The source files a certificate hashes: weights, config, carried extras."""
    config = src_fmt.port_layout(1)["config"]  # None: the weights file carries the config
    return list(dict.fromkeys(list(src_paths) + ([config] if config else []) + list(extras)))


def file_certificate(out: str) -> str:
    """Where the certificate of a one-file destination ``out`` lies: beside it."""
    return out + "." + NAME


def build(src: str, src_fmt, dst_fmt, tmp: str, src_paths: dict[str, str], contents: dict, report, rules,
          verification: dict, tensors: dict, discrepancies: list[str], extras: list[str], hashes=None) -> dict:
    """The certificate object (every destination file hashed as it lies in ``tmp``)."""
    dst_names = [os.path.relpath(os.path.join(d, n), tmp).replace(os.sep, "/") for d, _, names in os.walk(tmp)
                 for n in names if not n.startswith(".")]  # a format may write folders (tokenizer assets)
    dst_names = [n for n in dst_names if n != NAME]
    described = src_fmt.port_describe(contents["config"])
    return {
        "version": VERSION,
        "source": {"format": src_fmt.name, "path": os.path.abspath(src),
                   "architecture": described["architecture"], "kind": described["kind"],
                   "files": _hashes(src, source_names(src_fmt, src_paths, extras), hashes, "source"),
                   # names the source stores as another tensor's storage (a tied head in a pickle)
                   **({"aliases": contents["aliases"]} if contents.get("aliases") else {}),
                   # a text-only port of a multimodal source: the stored tensors of the other towers left out
                   **({"text_only": True, "multimodal_architecture": src_fmt.port_describe(
                       contents["whole_config"])["architecture"] if contents.get("whole_config") else None,
                       "dropped": {"count": len(contents.get("dropped", [])),
                                                      "tensors": list(contents.get("dropped", []))}}
                      if contents.get("file_keys") else {})},
        "destination": {"format": dst_fmt.name, "files": _hashes(tmp, dst_names, hashes, "destination")},
        "libraries": _libraries(src_fmt, dst_fmt),
        "rules": [[list(s) if isinstance(s, tuple) else s, d] for s, d in rules],
        "verification": verification,
        "discrepancies": discrepancies,
        "tensors": tensors,
    }


# ------------------------------------------------------------------------------ checking
@dataclass
class VerifyReport:
    """``db.verify_port``: ``passed``; ``problems`` (one line per tensor or file that does not
    hold, naming it); ``tensors`` and ``files`` checked."""

    out: str
    passed: bool
    problems: list[str] = field(default_factory=list)
    tensors: int = 0
    files: int = 0

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict:
        return {"out": self.out, "passed": self.passed, "problems": self.problems, "tensors": self.tensors,
                "files": self.files}

    def __str__(self) -> str:
        head = (f"{self.out}: {'all' if self.passed else 'NOT all'} entries hold ({self.tensors} tensors, "
                f"{self.files} files checked)")
        return "\n".join([head] + [f"  - {p}" for p in self.problems])


def _source_format(cert: dict, where: str = "source"):
    """The certificate's source (or destination) format, where an installed adapter knows it (else
    None: read as safetensors)."""
    from .._errors import DenseBridgeError

    try:
        return _dirs.Format(cert[where]["format"])
    except (DenseBridgeError, KeyError, TypeError):
        return None


def verify_port(out: Any) -> VerifyReport:
    """Re-read ``out`` and the source files its certificate names; confirm every file hash and every
    tensor (recomputed from its sources with the recorded operations, compared bit for bit).

    Args:
        out: a directory written by ``db.port``, or a one-file destination (its certificate beside it).

    Returns:
        A :class:`VerifyReport`. CheckpointError when ``out`` is no port (no readable certificate).
    """
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out must be a path. Received: out={out!r} ({type(out).__name__})")
    out = report_as = os.fspath(out)
    path = os.path.join(out, NAME)
    if os.path.isfile(out) and os.path.isfile(file_certificate(out)):  # one file: its names are beside it
        path, out = file_certificate(out), os.path.dirname(os.path.abspath(out))
    elif not os.path.isdir(out) or not os.path.isfile(path):
        raise CheckpointError(f"{out} holds no {NAME} (nor lies beside a {file_certificate('<file>')}): "
                              "not written by db.port")
    cert = files.read_json(path, "port certificate")
    try:
        src_dir = cert["source"]["path"]
        src_files, dst_files, tensors = cert["source"]["files"], cert["destination"]["files"], cert["tensors"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{path} is not a port certificate (source/destination/tensors missing)") from None
    problems: list[str] = []
    bad_files: set[str] = set()
    for where, directory, names in (("destination", out, dst_files), ("source", src_dir, src_files)):
        for name, digest in names.items():
            full = os.path.join(directory, name)
            if not os.path.isfile(full):
                problems.append(f"{where} file {name!r} is missing ({full})")
                bad_files.add(f"{where}:{name}")
            elif files.sha256_file(full) != digest:
                problems.append(f"{where} file {name!r} does not hold: its sha256 differs from the certificate's")
                bad_files.add(f"{where}:{name}")
    opened: dict[tuple[str, str], Any] = {}
    src_fmt = _source_format(cert)
    dst_fmt = _source_format(cert, "destination")
    from ._adapters import merged_value
    adapters: dict = {}  # adapter directory -> its layers (a port that merged one records it per source)
    if dst_fmt is not None and _dirs.optional(dst_fmt, "port_write_weights") is None \
            and _dirs.optional(dst_fmt, "port_write") is None:
        dst_fmt = None  # its weights are safetensors the port wrote: read as they lie (codes included)

    def open_(directory: str, name: str, where: str):
        key = (where, name)
        if key not in opened:
            try:
                full = os.path.join(directory, name)
                # the source's files are read as its format's adapter reads them (a .bin pickle:
                # weights_only, memory-mapped), never by running code from them
                fmt = src_fmt if where == "source" else dst_fmt
                opened[key] = _dirs.open_weights(fmt, full) if fmt else SafetensorsFile(full)
            except CheckpointError as exc:
                if f"{where}:{name}" not in bad_files:
                    problems.append(f"{where} file {name!r} cannot be read: {exc}")
                opened[key] = None
        return opened[key]

    for target, entry in tensors.items():
        dst = open_(out, entry.get("file", ""), "destination")
        if dst is None:
            problems.append(f"tensor {target!r}: its file {entry.get('file')!r} cannot be read")
            continue
        if target not in dst.tensors:
            problems.append(f"tensor {target!r} is missing from {entry.get('file')!r}")
            continue
        # new codes, or a format's own encoding: their library recomputes them (_codes), compared as
        # stored (``stored(name)``: the encoded bytes, where the opened destination offers them)
        if entry.get("codes") in ("moved", "quantized") or entry.get("recompute") is not None:
            from ._codes import verify_codes

            stored = getattr(dst, "stored", None)
            why = verify_codes(entry, stored(target) if callable(stored) else dst.get(target), lambda s: open_(src_dir, s["file"], "source"),
                               cert["destination"].get("format", ""), make)
            if why:
                problems.append(f"tensor {target!r} in {entry['file']!r} does not hold: it {why}")
            continue
        if entry.get("zeros"):
            got = dst.get(target)
            if list(got.shape) != list(entry.get("shape", [])) or np.any(got):
                problems.append(f"tensor {target!r} in {entry['file']!r} does not hold: it is not the "
                                f"{entry.get('shape')} zeros its entry states")
            continue
        arrays = []
        for s in entry["sources"]:
            f = open_(src_dir, s["file"], "source")
            if f is None or s["tensor"] not in f.tensors:
                arrays = None
                problems.append(f"tensor {target!r}: its source {s['tensor']!r} in {s['file']!r} cannot be read")
                break
            arrays.append((merged_value(f.get(s["tensor"]), s, adapters), s["slice"], s["transpose"], s.get("view")))
        if arrays is None:
            continue
        got = dst.get(target)
        offset = entry.get("offset", 0.0)
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not np.isfinite(offset):
            problems.append(f"tensor {target!r}: its 'offset' is not a number. {received('offset', offset)}")
            continue
        want = make(arrays, entry["axis"], got.dtype, entry.get("shape"), entry.get("view"),
                    stack=bool(entry.get("stack")), pick=bool(entry.get("pick")), offset=offset,
                    stride=entry.get("stride") if isinstance(entry.get("stride"), int) else None)
        if want.shape != got.shape or want.tobytes() != got.tobytes():
            problems.append(f"tensor {target!r} in {entry['file']!r} does not hold: it differs from what its sources "
                            f"{[s['tensor'] for s in entry['sources']]} give with {entry['ops']}")
    for f in opened.values():
        if f is not None:
            f.close()
    return VerifyReport(report_as, not problems, problems, len(tensors), len(src_files) + len(dst_files))
