"""``transfer``'s step for a layer move with a quantized side (:func:`quantized_move`), splits
and concatenations included (dense_bridge/quant.py).

A split or a concatenation runs along units (``_mapping.split_arrays``/``join_arrays``, per head
where the fused side interleaves). Quantization groups run along in_features, so cutting or joining
along units never cuts a group: the canonical codes (``qkernel`` (in, units), ``scale``/``offset``/
``zero`` (G, units), ``bias``) split and join column by column exactly like the float params, and
each piece is then one code move of :func:`dense_bridge.quant.move` (exact, or refused, or
``requantize=True``). The pieces keep the source's groups along in_features; a destination with
coarser groups than the source (a destination group straddling two source groups) is refused by
that move with the group named.

- quantized into float layers: the source's exact dequantization, split or joined as floats;
- float into quantized layers: the floats, quantized by each destination's own quantizer;
- quantized into quantized: the codes, when every source layer stores one scheme (bits, groups,
  arithmetic, signedness); sources stored differently (one quantized, one float, or two schemes)
  have no codes in common: their floats are joined and quantized only with ``requantize=True``.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..models import _plan as _mapping
from .._errors import ConversionError, SpecError
from . import Quant, handle_of, into_quantized, max_error, move


def _codes(e: Any) -> dict | None:
    """The canonical codes of walk entry ``e`` without their Quant, or None for a float layer."""
    h = handle_of(e.layer)
    return None if h is None else {k: v for k, v in h.codes().items() if k != "quant"}


def _floats(e: Any) -> dict:
    h = handle_of(e.layer)
    if h is not None:
        return h.dequantized()
    from ..registry._backends import adapter_for

    return {k: v for k, v in adapter_for(e.layer).get_params(e.layer).items() if k in ("kernel", "bias")}


def _scheme(e: Any) -> tuple | None:
    h = handle_of(e.layer)
    return None if h is None else (h.quant, bool(h.signed))


def fused_move(m: Any, writes: list, report: Any, requantize: bool, casts: list,
               linear_move: Callable) -> tuple[str | None, list[tuple[str, str, str]]]:
    """Queue the writes of a split or concatenation ``m`` (a ``_mapping.LayerMove``) with a
    quantized side; (None, [(src label, dst path, what moved)]) or (a problem sentence, [])."""
    label = "+".join(e.path for e in m.src)
    names = f"{label!r} -> {'+'.join(e.path for e in m.dst)!r}"
    fused = m.src[0] if len(m.src) == 1 else m.dst[0]
    if m.heads is None and _mapping.interleaved(fused.path):
        return (f"{names}: {fused.path!r} is a fused projection whose units interleave per head; declare it: "
                f"{{'to': [...], 'heads': n}}"), []
    try:
        floats = [_floats(e) for e in m.src]
        schemes = [_scheme(e) for e in m.src]
        codes = [_codes(e) for e in m.src] if all(s is not None for s in schemes) else None
    except (ConversionError, SpecError) as exc:
        return f"{names}: {exc}", []
    if codes is not None and len(set(schemes)) > 1:
        codes = None
        mixed = "the source layers store their codes in different schemes " + str(sorted({str(s[0]) for s in schemes}))
    elif codes is None and any(s is not None for s in schemes):
        mixed = "the source layers are quantized and float in turn"
    else:
        mixed = None
    ins = sorted({int(np.shape(f["kernel"])[0]) for f in floats})
    if len(ins) > 1:
        return f"{names}: the src layers have in_features {ins}; layers joined along units share their input", []
    if any(sorted(f) != sorted(floats[0]) for f in floats):
        return f"{names}: the src layers differ in parameters (a bias on some only)", []
    dst_units = []
    for d in m.dst:
        h = handle_of(d.layer)
        dst_units.append(h.units if h is not None else int(_floats(d)["kernel"].shape[-1]))
    units = [int(f["kernel"].shape[-1]) for f in floats] if len(m.src) > 1 else dst_units
    problem = _mapping.check_widths(units, m.heads, names)
    if problem:
        return problem, []
    joined, problem = _mapping.join_arrays(floats, m.heads) if len(m.src) > 1 else (floats[0], None)
    if problem:
        return f"{names}: {problem}", []
    joined_codes = None
    if codes is not None:
        joined_codes, problem = _mapping.join_arrays(codes, m.heads) if len(m.src) > 1 else (codes[0], None)
        if problem:
            return f"{names}: {problem}", []
    total = int(joined["kernel"].shape[-1])
    if total != sum(dst_units):
        return (f"{names}: src has {total} units but the dst layers {[e.path for e in m.dst]} have {dst_units} "
                f"= {sum(dst_units)} (a split gives each as many units as it has)"), []
    float_pieces = _mapping.split_arrays(joined, dst_units, m.heads) if len(m.dst) > 1 else [joined]
    code_pieces = [None] * len(m.dst)
    if joined_codes is not None:
        code_pieces = _mapping.split_arrays(joined_codes, dst_units, m.heads) if len(m.dst) > 1 else [joined_codes]
        quant: Quant = schemes[0][0]
        code_pieces = [{**p, "quant": quant} for p in code_pieces]
    how = "split" if len(m.dst) > 1 else "concatenated"
    moved = []
    for d, fp, cp in zip(m.dst, float_pieces, code_pieces):
        where = f"{names} (into {d.path!r})"
        h = handle_of(d.layer)
        if h is None:
            problem = linear_move(m.src[0], d, writes, casts, params=fp)
            if problem:
                return f"{names}: {problem}", []
            moved.append((label, d.path, ", ".join(sorted(fp)) + f" (canonical, {how}, dequantized exactly)"))
            continue
        if mixed is not None and not requantize:
            return (f"{where}: {mixed}, so no codes move into {d.path!r}; pass requantize=True to quantize their "
                    f"joined floats with the destination's own quantizer"), []
        try:
            cand, what = move(h, fp, cp, requantize=requantize or mixed is not None, where=where)
        except (ConversionError, SpecError) as exc:
            return str(exc), []
        if "max error" in what:
            report.quant_errors[d.path] = max_error(fp["kernel"], cand.kernel)
        writes.append((d, "quantized", cand))
        moved.append((label, d.path, f"{what} ({how})"))
    return None, moved


def quantized_move(m: Any, writes: list, report: Any, requantize: bool, casts: list,
                   linear_move: Callable) -> tuple[str | None, list[tuple[str, str, str]]]:
    """``transfer``'s step for a planned layer move with a quantized side: (None, [(src, dst,
    what moved)]) with the writes queued, or (a problem, []). A split or a concatenation cuts or
    joins the codes along units, which never cuts a group (``_quant_fused``)."""
    if len(m.src) != 1 or len(m.dst) != 1:
        return fused_move(m, writes, report, requantize, casts, linear_move)
    s, d = m.src[0], m.dst[0]
    if d.kind == "quantized":
        problem, what = into_quantized(s, d, writes, report, requantize)
        return problem, [] if problem else [(s.path, d.path, what)]
    problem = linear_move(s, d, writes, casts)  # a quantized src into a float dst: its exact floats
    if problem:
        return problem, []
    return None, [(s.path, d.path, ", ".join(sorted(writes[-1][2])) + " (canonical, dequantized exactly)")]
