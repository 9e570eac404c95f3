"""Quantized codes in ``db.port`` (API.md "Whole checkpoints": ``keep_codes``, ``requantize``,
``quantize``), with no library named: each format's facts come from its adapter's verbs.

- A quantized SOURCE is read as the float model it stands for: its adapter's ``port_open`` gives
  a weight file whose quantized tensors read as their exact dequantization, by the library's own
  function (``code_info(name)`` says what stands behind one, ``codes_of(name)`` gives the codes,
  canonical: ``qkernel`` (units, in) unsigned codes, ``scale``/``offset`` (units, groups)). So
  the twins stay float, the recipes learnt on them apply to the real tensors, and by default the
  destination holds the exact dequantization (certificate ``"codes": "dequantized"``);
  :func:`annotate` records it.
- ``keep_codes=True``: the destination adapter's ``port_keep_codes(path, layers, requantize)``
  rewrites the float directory just written with its library's own quantized layout, moving the
  source's codes where its dequantization equals the source's bit for bit (``"moved"``), else
  refusing with the first differing value (``requantize=True``: its own quantizer, ``"quantized"``
  with the largest error). Codes move only along a recipe that copies the tensor as it is.
- ``quantize=``: the destination adapter's ``port_quantize(path, quantize, source_config, dtype)``
  quantizes the float directory just written with its library's own quantizer (``"quantized"``,
  the largest error per tensor).

Verification stays honest: the twins are float; the full comparison runs on the float directory
(the exact dequantization of a quantized source, or the float model before ``quantize=``) before
the codes are written, and the codes' own error is stated per tensor (``max_abs_error``) with the
loaded destination's next-token agreement with that float model.
"""
from __future__ import annotations

import os

import numpy as np

from .._errors import ConversionError, received


def check(src_fmt, dst_fmt, contents: dict, opened: dict, *, quantize, keep_codes, requantize) -> dict | None:
    """The settings of ``quantize``/``keep_codes``/``requantize`` checked before anything is written;
    ConversionError/TypeError naming the argument and echoing the value. Returns the parsed
    ``quantize`` settings (None without it)."""
    for name, value in (("keep_codes", keep_codes), ("requantize", requantize)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool. {received(name, value)}")
    if requantize and not keep_codes:
        raise ConversionError(f"requantize=True allows new codes where keep_codes=True cannot move the source's: "
                              f"pass keep_codes=True with it. {received('requantize', requantize)}")
    settings = None
    if quantize is not None:
        if keep_codes:
            raise ConversionError(f"quantize= and keep_codes=True ask for two sets of codes: pass one. "
                                  f"{received('quantize', quantize)}")
        if not callable(getattr(_adapter(dst_fmt), "port_quantize", None)):
            raise ConversionError(f"quantize= quantizes with the destination library's own quantizer, and the "
                                  f"{dst_fmt.name!r} destination has none here (it is offered for "
                                  f"{_offering('port_quantize')}). {received('quantize', quantize)}")
        settings = dst_fmt.port_parse_quantize(quantize)
    if keep_codes:
        if not callable(getattr(_adapter(dst_fmt), "port_keep_codes", None)):
            raise ConversionError(f"keep_codes=True writes the source's codes in the destination library's own "
                                  f"quantized layout, which the {dst_fmt.name!r} destination has none of here (offered "
                                  f"for {_offering('port_keep_codes')}). {received('keep_codes', keep_codes)}")
        if not any(getattr(f, "quantized", None) for f in opened.values()):
            raise ConversionError(f"keep_codes=True, but the source {src_fmt.name!r} directory holds no quantized "
                                  f"tensors: there are no codes to keep. {received('keep_codes', keep_codes)}")
    return settings


def _adapter(fmt):
    from ..registry._backends import get_adapter

    return get_adapter(fmt.backend)


def _offering(verb: str) -> str:
    from . import _dirs

    names = []
    for fmt in _dirs.formats():
        try:
            if callable(getattr(_adapter(_dirs.Format(fmt)), verb, None)):
                names.append(fmt)
        except Exception:  # noqa: BLE001 - an adapter that cannot be imported offers nothing
            continue
    return ", ".join(names) or "no installed format"


def _info(opened: dict, source: dict) -> dict | None:
    f = opened.get(source["file"])
    fn = getattr(f, "code_info", None)
    return fn(source["tensor"]) if callable(fn) else None


def annotate(entries: dict, opened: dict) -> None:
    """Certificate entries of tensors made from a quantized source's dequantization: ``"codes":
    "dequantized"``, the dequantization first in ``"ops"``, the stored code tensors under
    ``"quantized_sources"``."""
    for entry in entries.values():
        infos = [(s, _info(opened, s)) for s in entry["sources"]]
        infos = [(s, i) for s, i in infos if i is not None]
        if not infos:
            continue
        if entry.get("codes") != "moved":  # "moved": the destination's own writer moved the codes (port_write)
            entry["codes"] = "dequantized"
            entry["ops"] = [f"dequantize {s['tensor']}: {i['dequantize']}" for s, i in infos] + \
                [op for op in entry["ops"] if op != "copy"]
        entry["quantized_sources"] = [{"file": i["files"][leaf], "tensor": t, "part": leaf}
                                      for s, i in infos for leaf, t in i["tensors"].items()]


def sources_of(moves, opened: dict, weights: dict, file_keys: dict) -> dict:
    """{destination tensor: (opened source file, stored key)} of every move that copies one whole
    quantized source tensor as it is (the only recipe codes move through): what a destination that
    writes its own file (``port_write``'s ``codes``) reads the source's codes from (``codes_of``)."""
    from . import _rules

    out = {}
    for m in moves:
        if len(m.sources) != 1 or m.view is not None or getattr(m, "stack", False) or getattr(m, "pick", False) \
                or getattr(m, "offset", 0.0):
            continue
        key, transpose, start, stop = m.sources[0]
        key, view = _rules.split_view(key)
        f = opened.get(weights.get(key))
        stored = file_keys.get(key, key)
        if view is not None or transpose or stop is not None or start not in (0, None) or f is None \
                or not callable(getattr(f, "code_info", None)) or f.code_info(stored) is None:
            continue
        out[m.target] = (f, stored)
    return out


def keep(tmp: str, dst_fmt, entries: dict, opened: dict, requantize: bool, hashes) -> dict:
    """``keep_codes=True``: the float directory ``tmp`` rewritten by the destination adapter with the
    source's codes (see the module docstring); certificate entries updated. Returns the summary
    for the certificate's verification (per tensor: codes, max_abs_error)."""
    layers: dict[str, dict] = {}
    reasons: dict[str, str] = {}
    for target, entry in entries.items():
        if entry.get("codes") != "dequantized":
            continue
        src = entry["sources"][0]
        whole = all(a == 0 and b == n for (a, b), n in zip(src["slice"], _shape(opened, src)))
        if len(entry["sources"]) != 1 or src["transpose"] or not whole:
            reasons[target] = "its recipe is not a copy of one whole tensor (codes do not move through it)"
            continue
        codes = opened[src["file"]].codes_of(src["tensor"])
        codes["reference"] = opened[src["file"]].get(src["tensor"])
        layers[target] = codes
    done = dst_fmt.port_keep_codes(tmp, layers, requantize)
    _rewrote(tmp, entries, done, hashes)
    per = {target: {"codes": info["codes"], "max_abs_error": info["max_abs_error"]}
           for target, info in done["tensors"].items()}
    for target, why in reasons.items():
        entries[target]["codes_kept"] = f"no: {why}"
    return {"kept": per, "dequantized": sorted(t for t, e in entries.items() if e.get("codes") == "dequantized"),
            "layout": done.get("layout")}


def _shape(opened: dict, source: dict) -> tuple[int, ...]:
    return tuple(opened[source["file"]].tensors[source["tensor"]].shape)


def quantize(tmp: str, dst_fmt, entries: dict, spec: str, source_config: dict, dtype, hashes) -> dict:
    """``quantize=``: the float directory ``tmp`` quantized by the destination adapter (see the
    module docstring); certificate entries updated. Returns the summary for the certificate."""
    done = dst_fmt.port_quantize(tmp, spec, source_config, dtype)
    _rewrote(tmp, entries, done, hashes)
    return {"settings": done["settings"], "max_abs_error": {t: i["max_abs_error"] for t, i in done["tensors"].items()
                                                            if i.get("max_abs_error") is not None}}


def _rewrote(tmp: str, entries: dict, done: dict, hashes) -> None:
    """Certificate entries after the adapter rewrote ``tmp``: ``done["tensors"]``: {float tensor
    name: {"codes", "stored": {stored name: dtype name}, "ops": [...], "max_abs_error"}};
    ``done["files"]``: {stored name: file}; every other tensor keeps its entry with its new file."""
    files_of = done["files"]
    for target, info in done["tensors"].items():
        old = entries.pop(target)
        for stored, dtype in info["stored"].items():
            entries[stored] = {**old, "ops": list(old["ops"]) + list(info["ops"]), "dtypes": [old["dtypes"][0], dtype],
                               "exact": info["codes"] == "moved", "max_ulp": 0 if info["codes"] == "moved" else None,
                               "codes": info["codes"], "max_abs_error": info["max_abs_error"],
                               "codes_of": target, "file": files_of[stored],
                               **({"recompute": info["recompute"][stored]} if stored in info.get("recompute", {})
                                  else {})}
    for name, entry in entries.items():
        if name in files_of:
            entry["file"] = files_of[name]
        elif entry.get("codes_of") is None:
            raise ConversionError(f"the destination library's rewrite lost tensor {name!r} (nothing was written)")
    if hashes is not None:
        for name in os.listdir(tmp):
            hashes.forget(("destination", name))


def verify_codes(entry: dict, got: np.ndarray, source, destination_format: str, make) -> str | None:
    """Why the stored codes ``got`` of a certificate entry (``"codes"`` "moved" or "quantized") do not
    hold, or None: recomputed by the destination adapter's ``port_recompute_codes(recipe, float
    value, source codes)`` from the entry's source (``source(s)`` opens it as the port read it: a
    quantized source as its exact dequantization, with its codes) and made as the certificate's
    ``make`` makes a tensor from its sources, compared bit for bit."""
    from .._dtypes import dtype_name, numpy_dtype
    from . import _dirs

    recipe = entry.get("recompute")
    if recipe is None:
        return "has no recipe to recompute its codes by"
    try:
        fmt = _dirs.Format(destination_format)
        arrays, codes = [], None
        for s in entry["sources"]:
            f = source(s)
            if f is None or s["tensor"] not in f.tensors:
                return f"cannot be recomputed: its source {s['tensor']!r} in {s['file']!r} cannot be read"
            arrays.append((f.get(s["tensor"]), s["slice"], s["transpose"]))
            fn = getattr(f, "codes_of", None)
            codes = fn(s["tensor"]) if callable(fn) else None
        value = make(arrays, entry["axis"], np.dtype(numpy_dtype(recipe["float_dtype"])))
        want = np.asarray(fmt.port_recompute_codes(recipe, value, codes))
    except Exception as exc:  # noqa: BLE001 - an adapter that cannot recompute: said, never a pass
        return f"cannot be recomputed: {type(exc).__name__}: {str(exc)[:200]}"
    if dtype_name(got.dtype) != dtype_name(want.dtype) or got.shape != want.shape or got.tobytes() != want.tobytes():
        return (f"differs from its codes recomputed from {[s['tensor'] for s in entry['sources']]} with "
                f"{entry['ops'][-1]!r}")
    return None


def active(quantize, keep_codes) -> bool:
    return quantize is not None or bool(keep_codes)


def finish(tmp: str, src_fmt, dst_fmt, entries: dict, opened: dict, *, quantize, keep_codes, requantize,
           source_config: dict, dtype, hashes, float_model_logits, verification: dict | None = None) -> dict:
    """The codes written into the verified float directory ``tmp`` (``keep_codes`` or ``quantize``),
    then the destination loaded by its own loader and its next-token distribution compared with the
    float model's (``float_model_logits(model) -> (kl, top1, max_abs_logit_error)``). Returns the
    certificate's ``verification["codes"]``."""
    if keep_codes:
        out = keep(tmp, dst_fmt, entries, opened, requantize, hashes)
    else:
        out = quantize_(tmp, dst_fmt, entries, quantize, source_config, dtype, hashes)
    errors = [e["max_abs_error"] for e in entries.values() if e.get("max_abs_error") is not None]
    out["largest_error"] = max(errors) if errors else 0.0
    model = dst_fmt.port_load(tmp)  # the destination's own loader reads the codes as written
    kl, top1, worst = float_model_logits(model)
    out.update({"loaded": True, "kl_divergence_vs_float": kl, "top1_agreement_vs_float": top1,
                "max_abs_logit_error_vs_float": worst,
                "judged": "the full comparison ran on the exact float model before the codes were written; the "
                          "codes' own error is the largest_error bound, per tensor in the certificate"})
    new = any(e.get("codes") == "quantized" for e in entries.values())
    # codes moved exactly compute the float model's function: the loaded destination must agree with it
    # (new codes move it by their stated error, which is reported, not judged)
    out["passed"] = bool(np.isfinite(kl)) and (new or (kl <= MOVED_KL and top1 >= MOVED_TOP1))
    if verification is not None:
        verification["codes"] = out
        if not out["passed"]:
            verification["passed"] = False
            verification["detail"] = (f"the destination with its codes, loaded by its own library, departs from the "
                                      f"float model it was written from: next-token KL {kl:.3g}, top-1 {top1:.4f}")
    return out


#: Codes moved bit for bit leave the function unchanged: the loaded destination's next-token
#: distribution agrees with the float model's this closely or the port fails.
MOVED_KL, MOVED_TOP1 = 1e-6, 0.999


quantize_ = quantize
