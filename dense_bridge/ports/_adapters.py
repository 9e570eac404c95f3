"""``db.port(..., adapter=DIR, adapter_mode="merge" | "keep")``: a LoRA adapter directory for the
source model carried through a port (API.md, "Whole checkpoints").

The adapter directory is read by the adapter-file flow of ``dense_bridge.lora._files`` (its format
detected from its content, declared by a backend's manifest) into canonical adapters keyed by the
source model's layer paths. It must be the source's own ecosystem's format (the adapter format the
source format's backend declares), and it is checked against the source model before anything is
written: every adapted layer is a linear layer of the source, its weight tensor exists in the
source's files and the factors' shapes agree with it; a refusal names the layer and the file.

Where each adapted layer's weight lies in the source's files is learnt, like every port rule, from
a tiny twin: the source library builds its model, every linear layer's canonical kernel
(in_features, units) is found by value among the tensors its saver wrote (as stored, or
transposed). No library or file format is named here.

- ``"merge"``: each adapted weight ``W`` is replaced, as the port streams it, by
  ``W + scale * B @ A`` (DoRA: ``m * (W + update) / norm``) computed in float64 from the stored
  values and rounded ONCE to the destination dtype (the moves after it copy, slice, transpose or
  concatenate: exact). The certificate entry says so: ``"merge_lora"`` in its ops and sources,
  ``exact: False``, ``max_ulp`` measured against the float64 merge; ``db.verify_port`` recomputes it.
  The full verification compares the destination with the source model loaded by its own loader,
  the adapter attached and merged by ``db.merge_lora``.
- ``"keep"``: the base weights are ported as usual and the adapter is written beside them, in
  ``out/adapter/``, in the destination's own adapter directory format (the one the destination
  format's backend declares), its layer paths moved by the twins' layer rules; its files are
  listed and hashed in the certificate (``destination.files`` and ``adapter.written``). A format
  that holds one scale for every layer gets the scales folded into ``lora_b`` where that is exact
  (:func:`single_rank_scale`).
"""
from __future__ import annotations

import math
import os
import re
import tempfile
from typing import Any

import numpy as np

from .._errors import CheckpointError, ConversionError, received
from . import _dirs, _rules

#: The directory inside ``out`` that a kept adapter is written into.
KEEP_DIR = "adapter"
MODES = ("merge", "keep")


# ----------------------------------------------------------------------------- single rank and scale
def _power_of_two(x: float) -> bool:
    if not math.isfinite(x) or x <= 0:
        return False
    mantissa, _ = math.frexp(x)
    return mantissa == 0.5


def pad_rank(lora: dict, rank: int) -> dict:
    """``lora`` (plain (in, r), (r, units) or per-head (in, heads, r), (r, head_dim)) padded with
    zero columns of ``lora_a`` and zero rows of ``lora_b`` to ``rank`` >= r: the same update exactly."""
    a, b = np.asarray(lora["lora_a"]), np.asarray(lora["lora_b"])
    r = a.shape[-1]
    if r == rank:
        return dict(lora)
    if r > rank:
        raise ConversionError(f"cannot pad rank {r} down to {rank}")
    pa = np.zeros(a.shape[:-1] + (rank,), dtype=a.dtype)
    pa[..., :r] = a
    pb = np.zeros((rank,) + b.shape[1:], dtype=b.dtype)
    pb[:r] = b
    return {**lora, "lora_a": pa, "lora_b": pb}


def single_rank_scale(layers: dict, *, scale: float | None = None, rank: int | None = None,
                      where: str = "adapter") -> tuple[dict, int, float]:
    """Adapters of per-layer ranks and scales as adapters of ONE rank and ONE scale, exactly.

    A format such as keras-hub's (``enable_lora(rank)``: one rank, ``lora_alpha = rank``, so scale 1
    for every layer) or mlx-lm's (one ``rank`` and one ``scale`` in ``lora_parameters``) holds one
    rank and one scale. Every adapter is zero-padded to the common rank (the same update exactly)
    and its scale ``s`` is folded into ``lora_b`` as ``lora_b * (s / scale)``, which is exact in
    floating point when the ratio is a power of two (and nothing under- or overflows: checked by
    value). ``lora_b`` keeps its dtype.

    Args:
        layers: ``{layer: {"lora_a" (in, r) or (in, heads, r), "lora_b" (r, units) or (r, head_dim),
            "lora_scale" 0-d[, ...]}}``; DoRA adapters (``lora_magnitude``) are refused (the scale
            sits inside their norm).
        scale: the common scale (None: the most frequent one, ties to the largest).
        rank: the common rank (None: the largest; a smaller one than some layer's is refused).
        where: what the adapters come from, for errors.

    Returns:
        (``{layer: adapter of rank ``rank`` and scale ``scale``}``, rank, scale). ConversionError naming
        the first layer whose ratio is not a power of two, or whose folded factor is not exact.
    """
    if not layers:
        raise ConversionError(f"{where}: no adapters")
    dora = sorted(p for p, e in layers.items() if "lora_magnitude" in e)
    if dora:
        raise ConversionError(f"{where}: layer {dora[0]!r} is a DoRA adapter: its scale sits inside the norm and "
                              f"cannot be folded into lora_b; merge it instead (adapter_mode='merge')")
    scales = {p: float(np.asarray(e["lora_scale"])) for p, e in layers.items()}
    if scale is None:
        counts: dict[float, int] = {}
        for s in scales.values():
            counts[s] = counts.get(s, 0) + 1
        scale = max(counts, key=lambda s: (counts[s], s))
    scale = float(scale)
    top = max(int(np.shape(e["lora_a"])[-1]) for e in layers.values())
    rank = top if rank is None else int(rank)
    if rank < top:
        raise ConversionError(f"{where}: rank {rank} is below the largest layer rank {top}")
    out = {}
    for p, e in layers.items():
        ratio = scales[p] / scale
        if not _power_of_two(ratio) or scales[p] != ratio * scale:
            raise ConversionError(
                f"{where}: layer {p!r} has scale {scales[p]!r} and the format holds one scale ({scale!r}) for every "
                f"layer: folding the ratio {ratio!r} into lora_b is exact only for powers of two, so it is refused "
                f"(merge the adapter instead: adapter_mode='merge')")
        b = np.asarray(e["lora_b"])
        if ratio != 1.0:
            with np.errstate(over="ignore", under="ignore"):
                folded = (b.astype(np.float64) * ratio).astype(b.dtype)
            if not np.array_equal(folded.astype(np.float64), b.astype(np.float64) * ratio):
                raise ConversionError(f"{where}: layer {p!r}: folding its scale ratio {ratio!r} into lora_b under- or "
                                      f"overflows {b.dtype} (not exact); merge the adapter instead")
            b = folded
        out[p] = pad_rank({**e, "lora_b": b, "lora_scale": np.array(scale, dtype=np.float64)}, rank)
    return out, rank, scale


# ----------------------------------------------------------------------------- the job
def _adapter_formats():
    from ..lora._files import adapter_formats

    return adapter_formats()


def _own_file_format(fmt) -> tuple[str, str] | None:
    """(name, suffix) of the single-file adapter format declared by the backend of the model format
    ``fmt`` whose adapter writes it from a model (``write_lora_file``), else None."""
    for name, (backend, declared) in _adapter_formats().items():
        if backend == fmt.backend and declared.suffix and not declared.files:
            from ..registry._backends import get_adapter

            if callable(getattr(get_adapter(backend), "write_lora_file", None)):
                return name, declared.suffix
    return None


def _own_directory_format(fmt, role: str) -> str | None:
    """The adapter directory format declared by the backend of the model format ``fmt``."""
    for name, (backend, declared) in _adapter_formats().items():
        if backend == fmt.backend and declared.files:
            return name
    return None


class AdapterJob:
    """One adapter carried through one port: read and checked (:func:`open_job`), bound to the
    real source (:meth:`bind`), used by the full verification (:meth:`source_model`) and recorded
    in the certificate (:meth:`finish`)."""

    def __init__(self, path: str, mode: str, fmt: str, layers: dict, extra: dict, files: tuple[str, ...]) -> None:
        self.path, self.mode, self.format, self.layers, self.extra = path, mode, fmt, layers, extra
        self.files = files
        self.merges: dict[tuple[str, str], dict] = {}  # (source file, stored tensor) -> what merges into it
        self.ulps: dict[tuple[str, str], int] = {}
        self.kept: tuple[dict, list] | None = None  # keep: (adapters by destination layer, model paths)
        self.kept_format: str | None = None
        self.kept_info: dict = {}
        self.kept_file: str | None = None  # keep into a single-file format: its suffix
        self._dst_fmt = None
        self._dst_writer = None

    # ------------------------------------------------------------------ binding to the source
    def bind(self, src_fmt, dst_fmt, common: dict, real_src: dict, src_dtype: dict, opened: dict, weights: dict,
             file_keys: dict, rules: list, dtype: str | None, real_dst: dict) -> dict:
        """Check every adapted layer against the real source and prepare the mode's work. Returns
        ``opened`` as the port must read it (merge: the adapted weights merged as they are read)."""
        links, tied = linear_tensors(src_fmt, dst_fmt, common)
        problems = []
        placed: dict[str, tuple[str, bool]] = {}
        for layer, entry in self.layers.items():
            t, idx = _rules.template(layer)
            if t not in links:
                near = _near(t, list(links))
                problems.append(f"layer {layer!r}: no linear layer of the source model has this path"
                                + (f" (its linear layers are like {near})" if near else ""))
                continue
            key_t, transposed = links[t]
            key = _rules.fill(key_t, idx[:key_t.count("{}")])
            if t in tied:
                problems.append(f"layer {layer!r}: its weight is the source's {key!r}, shared with another layer "
                                f"(tied): an adapter on it cannot be carried")
                continue
            if key not in real_src:
                problems.append(f"layer {layer!r}: the source has no tensor {key!r} (its model has no such layer)")
                continue
            stored = tuple(real_src[key])
            n_in, units = (stored[1], stored[0]) if transposed else (stored[0], stored[1])
            a, b = np.shape(entry["lora_a"]), np.shape(entry["lora_b"])
            if a[0] != n_in or b[-1] != units:
                problems.append(f"layer {layer!r}: lora_a {a} and lora_b {b} do not fit its weight {key!r} {stored} "
                                f"(in_features {n_in}, units {units})")
                continue
            placed[layer] = (key, transposed)
        if problems:
            raise ConversionError(f"adapter {self.path} does not fit the source model (nothing was written):\n  - "
                                  + "\n  - ".join(problems[:20]))
        if self.mode == "merge":
            for layer, (key, transposed) in placed.items():
                stored_key = file_keys.get(key, key)
                target = np.dtype(_numpy_dtype(dtype)) if dtype else np.dtype(src_dtype[key])
                self.merges[(weights[key], stored_key)] = {"layer": layer, "transpose": transposed, "dtype": target}
            return {rel: (_Merged(f, rel, self) if any(k[0] == rel for k in self.merges) else f)
                    for rel, f in opened.items()}
        self._dst_fmt = dst_fmt
        self._prepare_keep(dst_fmt, rules, real_dst)
        if self.kept_file is not None:
            from ..registry._backends import get_adapter

            self._dst_writer = get_adapter(dst_fmt.backend).write_lora_file
        return opened

    def _prepare_keep(self, dst_fmt, rules: list, real_dst: dict) -> None:
        from ..lora._files import AdapterRefused, write_adapter_dir

        name = _own_directory_format(dst_fmt, "destination")
        file_format = None if name is not None else _own_file_format(dst_fmt)
        if file_format is not None:
            self._prepare_keep_file(file_format, rules)
            return
        if name is None:
            raise ConversionError(f"adapter_mode='keep': the {dst_fmt.name} format has no adapter directory format "
                                  f"of its own here (declared: {sorted(_adapter_formats())}); use adapter_mode='merge' "
                                  f"(nothing was written)")
        moved = self._moved_layers(rules, f"the {dst_fmt.name} model")
        info: dict = {}
        with tempfile.TemporaryDirectory(prefix="dense-bridge-adapter-") as tmp:
            # written aside once now, so that a refusal comes before any byte of the port is written
            target_dir = os.path.join(tmp, KEEP_DIR)
            try:
                write_adapter_dir(moved, target_dir, name, extra=self.extra, model_paths=list(real_dst))
            except AdapterRefused as first:
                # a format holding one scale for every layer: fold the scales where that is exact
                try:
                    moved, rank, scale = single_rank_scale(moved, where=self.path)
                except ConversionError as exc:
                    raise ConversionError(f"adapter_mode='keep': the {name} adapter format cannot hold {self.path} "
                                          f"as it is ({first}); {exc} (nothing was written)") from None
                write_adapter_dir(moved, target_dir, name, extra=self.extra, model_paths=list(real_dst))
                info = {"folded": {"rank": rank, "scale": scale}}
        self.kept = (moved, list(real_dst))
        self.kept_format = name
        self.kept_info = {**info, "layers": {layer: _move_path(layer, rules)[0] for layer in self.layers}}

    def _moved_layers(self, rules: list, onto: str) -> dict:
        """Every adapted layer keyed by its path in the destination (the port's rules moving it);
        ConversionError for DoRA (carried by merging only) or a layer the rules do not move."""
        dora = sorted(p for p, e in self.layers.items() if "lora_magnitude" in e)
        if dora:
            raise ConversionError(f"adapter_mode='keep': layer {dora[0]!r} of {self.path} is a DoRA adapter; DoRA is "
                                  f"carried by adapter_mode='merge' only (nothing was written)")
        return moved_layers(self.layers, rules, f"adapter_mode='keep': adapter {self.path} cannot be moved onto {onto}")

    def _prepare_keep_file(self, file_format: tuple[str, str], rules: list) -> None:
        """Keep into a format whose adapter file names layers by their place in the loaded model
        (keras-hub's ``.lora.h5``): the paths moved now, the file written by the destination
        framework's ``write_lora_file`` on the destination model as its own loader reads ``out``."""
        moved = self._moved_layers(rules, "the destination model")
        self.kept = (moved, None)
        self.kept_format = file_format[0]
        self.kept_file = file_format[1]
        self.kept_info = {"layers": {layer: _move_path(layer, rules)[0] for layer in self.layers}}

    # ------------------------------------------------------------------ verification
    def source_model(self, model: Any) -> Any:
        """The source model as the destination should compute: merge mode attaches the adapter with
        ``db.load_adapter`` and merges it with ``db.merge_lora`` (float64, one rounding); keep mode
        leaves the base model (the destination's base is compared with it)."""
        if self.mode != "merge":
            return model
        from ..lora._files import load_adapter
        from ..lora._merge import merge_lora

        load_adapter(self.path, model)
        merge_lora(model)
        return model

    # ------------------------------------------------------------------ certificate
    def finish(self, tmp: str, certificate: dict) -> None:
        """Write a kept adapter into ``tmp/adapter/`` and record the adapter in ``certificate``."""
        from ..checkpoints import _port_files as files

        record = {"path": os.path.abspath(self.path), "format": self.format, "mode": self.mode,
                  "layers": len(self.layers),
                  "files": {n: files.sha256_file(os.path.join(self.path, n)) for n in self.files}}
        if self.mode == "merge":
            tensors = certificate["tensors"]
            merged_into = {}
            for target, entry in tensors.items():
                hits = [(s, self.merges[(s["file"], s["tensor"])]) for s in entry["sources"]
                        if (s["file"], s["tensor"]) in self.merges]
                if not hits:
                    continue
                for s, m in hits:
                    s["merge_lora"] = {"adapter": os.path.abspath(self.path), "layer": m["layer"],
                                       "transpose": m["transpose"], "computed_in": "float64"}
                    merged_into.setdefault(m["layer"], []).append(target)
                ulps = [self.ulps.get((s["file"], s["tensor"])) for s, _ in hits]
                entry["ops"] = [f"merge_lora {m['layer']} (float64: W + scale * B @ A, rounded once to "
                                f"{entry['dtypes'][-1]})" for _, m in hits] + entry["ops"]
                entry["dtypes"] = [entry["dtypes"][0], "float64", entry["dtypes"][-1]]
                entry["exact"] = False
                entry["max_ulp"] = None if any(u is None for u in ulps) else max(ulps)
            record["merged"] = {layer: {"scale": float(np.asarray(self.layers[layer]["lora_scale"])),
                                        "into": targets} for layer, targets in sorted(merged_into.items())}
            record["rounding"] = "the merge is computed in float64 from the stored weight and factors and rounded " \
                                 "once to the destination tensor's dtype"
        else:
            from ..lora._files import write_adapter_dir

            where = os.path.join(tmp, KEEP_DIR)
            moved, model_paths = self.kept
            if self.kept_file is not None:  # one file naming layers of the loaded model: written from it
                os.makedirs(where)
                written = self._dst_writer(self._dst_fmt.port_load(tmp), os.path.join(where, KEEP_DIR + self.kept_file),
                                           moved)
                self.kept_info.update({k: v for k, v in written.items() if k != "layers"},
                                      loaded="the destination was loaded by its own loader to name its layers")
            else:
                write_adapter_dir(moved, where, self.kept_format, extra=self.extra, model_paths=model_paths)
            hashed = {f"{KEEP_DIR}/{n}": files.sha256_file(os.path.join(where, n)) for n in sorted(os.listdir(where))}
            certificate["destination"]["files"].update(hashed)
            record["written"] = {"format": self.kept_format, "path": KEEP_DIR, "files": hashed, **self.kept_info}
        certificate["adapter"] = record


def _numpy_dtype(name: str):
    from .._dtypes import numpy_dtype

    return numpy_dtype(name)


def _near(t: str, known: list[str]) -> list[str]:
    import difflib

    return difflib.get_close_matches(t, known, n=3, cutoff=0.5) or known[:3]


#: a layer index inside a path of any separator ("layers.3.", "transformer_layer_3/")
_ANY_INDEX = re.compile(r"(?<=[._/])\d+(?=[._/]|$)")


def _indexed(src, dst):
    """``dst`` with its layer indices made back-references to ``src``'s groups, in order, where the
    rule generaliser left them literal (paths whose indices are not dot-delimited)."""
    if not isinstance(dst, str) or "\\" in dst:
        return dst
    groups = sum(re.compile(p).groups for p in (src if isinstance(src, (list, tuple)) else [src]))
    found = _ANY_INDEX.findall(dst)
    if not groups or len(found) != groups:
        return dst
    n = iter(range(1, groups + 1))
    return _ANY_INDEX.sub(lambda _m: f"\\{next(n)}", dst)


def moved_layers(layers: dict, rules: list, refusal: str) -> dict:
    """Every adapted layer of ``layers`` keyed by its path in the destination (``rules`` moving it);
    ConversionError starting with ``refusal`` and naming each layer the rules do not move."""
    moved, problems = {}, []
    for layer, entry in layers.items():
        target, why = _move_path(layer, rules)
        if target is None:
            problems.append(f"layer {layer!r}: {why}")
        else:
            moved[target] = entry
    if problems:
        raise ConversionError(f"{refusal} (nothing was written):\n  - " + "\n  - ".join(problems[:20]))
    return moved


def _move_path(layer: str, rules: list) -> tuple[str | None, str]:
    """The destination layer path of the source layer ``layer`` under the twins' generalised rules,
    or (None, why)."""
    for src, dst in rules:
        dst = _indexed(src, dst)
        if isinstance(src, (list, tuple)):
            pats = list(src)
        else:
            pats = [src]
        for p in pats:
            m = re.fullmatch(p, layer)
            if m is None:
                continue
            if isinstance(dst, list) or len(pats) > 1:
                return None, (f"the destination {'splits' if isinstance(dst, list) else 'fuses'} this layer "
                              f"({src!r} -> {dst!r}); its adapter is carried by adapter_mode='merge'")
            return m.expand(dst), ""
    return None, "no layer rule of the port moves it (it has no counterpart in the destination)"


def linear_tensors(src_fmt, dst_fmt, common: dict) -> tuple[dict[str, tuple[str, bool]], set[str]]:
    """Where each linear layer's weight lies in the source format's files, learnt on a tiny twin.

    Returns ({layer path template: (stored tensor key template, stored transposed)}, the layer
    templates whose weight is also another layer's (tied)). The canonical kernel is
    (in_features, units); ``transposed`` means the file stores (units, in_features)."""
    from .._api import get_params
    from ..checkpoints._safetensors import SafetensorsFile
    from ..models import walk

    small = _dirs.shrink(common, src_fmt, dst_fmt)
    twin = src_fmt.port_twin(src_fmt.port_own_config(small), seed=3)
    entries = walk(twin)
    with tempfile.TemporaryDirectory(prefix="dense-bridge-adapter-twin-") as tmp:
        src_fmt.port_save(twin, tmp)
        stored = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                with SafetensorsFile(os.path.join(tmp, name)) as f:
                    for key in f.keys():
                        stored[key] = np.array(f.get(key), np.float32)
    by_bytes: dict[tuple, list[str]] = {}
    for key, arr in stored.items():
        if arr.ndim == 2:
            by_bytes.setdefault((arr.shape, arr.tobytes()), []).append(key)
    links: dict[str, tuple[str, bool]] = {}
    owners: dict[str, set[str]] = {}
    others: list[bytes] = []
    for e in entries:
        try:
            params = get_params(e.layer)
        except Exception:  # noqa: BLE001 - a layer the walk lists but no reader takes: not an adapter target
            continue
        if e.kind != "linear":
            others += [np.ascontiguousarray(np.asarray(v, np.float32)).tobytes() for v in params.values()
                       if np.ndim(v) == 2]
            continue
        kernel = np.ascontiguousarray(np.asarray(params["kernel"], np.float32))
        if kernel.ndim != 2:
            continue
        # the file stores (units, in) or (in, units): found as the transpose or as it is
        hits = [(k, True) for k in by_bytes.get((kernel.T.shape, np.ascontiguousarray(kernel.T).tobytes()), [])]
        hits += [(k, False) for k in by_bytes.get((kernel.shape, kernel.tobytes()), [])]
        if not hits:
            continue
        key, transposed = hits[0]
        t, idx = _rules.template(e.path)
        kt, kidx = _rules.template(key)
        if kidx != idx[:len(kidx)]:
            continue
        links[t] = (kt, transposed)
        owners.setdefault(kt, set()).add(t)
        if kernel.tobytes() in others or np.ascontiguousarray(kernel.T).tobytes() in others:
            owners[kt].add("<other>")
    tied = {t for kt, ts in owners.items() if len(ts) > 1 for t in ts if t != "<other>"}
    return links, tied


class _Merged:
    """A source weight file read with the adapter merged into its adapted tensors (float64 values:
    the port's one cast rounds them to the destination dtype)."""

    def __init__(self, inner, rel: str, job: AdapterJob) -> None:
        self.inner, self.rel, self.job = inner, rel, job
        self.tensors = inner.tensors

    def keys(self):
        return self.inner.keys()

    def close(self) -> None:
        self.inner.close()

    def get(self, name: str):
        m = self.job.merges.get((self.rel, name))
        if m is None:
            return self.inner.get(name)
        merged = merge_weight(self.inner.get(name), self.job.layers[m["layer"]], m["transpose"], m["layer"])
        self.job.ulps[(self.rel, name)] = max_ulp(merged, m["dtype"])
        return merged


def merge_weight(stored: np.ndarray, lora: dict, transpose: bool, layer: str) -> np.ndarray:
    """The stored weight (as stored: (units, in) when ``transpose``, else (in, units)) with the
    adapter merged, in float64: ``W + scale * A @ B`` (DoRA: ``m * (W + update) / norm``)."""
    from .. import lora as _lora

    w = np.asarray(stored).astype(np.float64)
    kernel = w.T if transpose else w
    with np.errstate(invalid="ignore", over="ignore"):
        merged = _lora.effective_kernel(kernel, lora)
    if not np.isfinite(merged).all():
        raise ConversionError(f"merging the adapter into layer {layer!r} gives NaN/Inf (nothing was written)")
    return np.ascontiguousarray(merged.T if transpose else merged)


def max_ulp(wide: np.ndarray, dtype) -> int:
    """Largest rounding, in units in the last place of ``dtype``, of the float64 ``wide`` cast to ``dtype``."""
    dtype = np.dtype(dtype)
    narrow = wide.astype(dtype)
    back = narrow.astype(np.float64)
    spacing = np.abs(np.spacing(np.asarray(back, np.float32).astype(dtype)).astype(np.float64))
    spacing[spacing == 0] = np.finfo(np.float64).tiny
    return int(np.ceil(np.max(np.abs(wide - back) / spacing))) if wide.size else 0


# ----------------------------------------------------------------------------- verify_port's side
def merged_value(array: np.ndarray, source: dict, cache: dict) -> np.ndarray:
    """``db.verify_port``: a certificate source entry's stored tensor with its recorded merge
    recomputed (the adapter directory re-read; float64), or the array as it is."""
    m = source.get("merge_lora")
    if not m:
        return array
    from ..lora._files import read_adapter_dir

    path = m["adapter"]
    if path not in cache:
        cache[path] = read_adapter_dir(path)[1]
    layers = cache[path]
    if m["layer"] not in layers:
        raise CheckpointError(f"adapter {path} no longer holds layer {m['layer']!r}")
    return merge_weight(array, layers[m["layer"]], bool(m["transpose"]), m["layer"])


# ----------------------------------------------------------------------------- opening
def open_job(adapter: Any, mode: Any, src_fmt, dst_fmt, out: str | None = None) -> AdapterJob | None:
    """The adapter directory ``adapter`` read and checked for a port from ``src_fmt`` (None: no
    adapter). Refused before anything is written: not a directory, an adapter format that is not
    the source's ecosystem's, a file the format's reader refuses (named), DoRA in keep mode."""
    if mode not in MODES:
        raise ConversionError(f"adapter_mode must be 'merge' or 'keep'. {received('adapter_mode', mode)}")
    if adapter is None:
        return None
    if not isinstance(adapter, (str, os.PathLike)):
        raise TypeError(f"adapter must be an adapter directory path. {received('adapter', adapter)}")
    path = os.fspath(adapter)
    if not os.path.isdir(path):
        raise CheckpointError(f"adapter must be an adapter directory: {received('adapter', path)} "
                              f"({'a file' if os.path.exists(path) else 'does not exist'}; nothing was written)")
    if out is not None:
        inner, outer = os.path.realpath(path), os.path.realpath(out)
        if inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep):
            raise CheckpointError(f"adapter {path!r} lies inside out {out!r}, which the port replaces: refused "
                                  f"(nothing was written)")
    from ..lora._files import detect, read_adapter_dir

    name, backend, declared = detect(path)
    own = _own_directory_format(src_fmt, "source")
    if backend != src_fmt.backend or not declared.files:
        raise ConversionError(f"adapter {path} is a {name} adapter, but the source is a {src_fmt.name} directory, whose "
                              f"adapters are {own!r} directories: convert it first (dense-bridge adapter "
                              f"{path} --to {own} -o DIR). {received('adapter', path)}")
    _, layers, extra = read_adapter_dir(path)
    return AdapterJob(path, mode, name, layers, extra, tuple(declared.files))


# ----------------------------------------------------------------------------- single-file formats
def write_model_file(adapter: Any, rules: list, model: Any, path: Any) -> dict:
    """The adapter directory ``adapter`` (PEFT or mlx-lm) moved onto ``model``'s layers by the layer
    ``rules`` of a transfer or port (``report.rules``: source path pattern -> ``model`` path) and
    written as the single-file adapter format of ``model``'s framework (keras-hub's ``.lora.h5``:
    one rank, scale 1; ranks padded and scales folded where exact, refused naming the layer where not).

    Args:
        adapter: an adapter directory whose layer paths are the source model's.
        rules: ``[(source path regex, model path), ...]``; a layer no rule moves, or one a rule splits
            or fuses, is refused naming it.
        model: the destination model, built.
        path: the file to write.

    Returns:
        What the framework's writer reports (keras-hub: ``rank``, ``target_layer_names``...).
    """
    from ..lora._files import read_adapter_dir
    from ..registry._backends import adapter_for

    if not isinstance(adapter, (str, os.PathLike)) or not os.path.isdir(adapter):
        raise CheckpointError(f"adapter must be an adapter directory. {received('adapter', adapter)}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path. {received('path', path)}")
    _, layers, _ = read_adapter_dir(os.fspath(adapter))
    writer = getattr(adapter_for(model, "model"), "write_lora_file", None)
    if writer is None:
        raise ConversionError(f"{type(model).__name__}'s framework writes no single-file adapter format; write an "
                              f"adapter directory (db.save_adapter) instead")
    return writer(model, os.fspath(path),
                  moved_layers(layers, rules, f"adapter {os.fspath(adapter)} cannot be moved onto the model"))
