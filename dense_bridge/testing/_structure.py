"""Structure first: what two models hold, parameter by parameter, before any number is compared.

A port that leaves a norm's scale at its initial value, ties an output head on one side only or
keeps one projection in another dtype can still pass a numeric check on one input. So before
running anything the report lists, from the adapters' ``walk`` (no forward pass):

- both models' parameter counts (each tied storage counted once);
- every parameter of either model left unmatched: the linear layers the mapping pairs are
  matched (their canonical kernel/bias/mask by name); the other layers (norms, embeddings) are
  paired by kind: the same parameter shapes, in definition order, aligned on the layer numbers
  in their paths where the two models hold different counts of them (so one extra norm in the
  middle of b is the one named, not the last);
- parameters tied to another (the same storage under two paths: GPT-2's head and its embedding);
- matched parameters whose dtypes differ.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Structure", "model_structure", "params_structure", "rows_structure"]


@dataclass
class Structure:
    """The structure section of a report (see the module docstring)."""

    params_a: int
    params_b: int
    unmatched_a: list[str] = field(default_factory=list)
    unmatched_b: list[str] = field(default_factory=list)
    tied_a: dict[str, str] = field(default_factory=dict)
    tied_b: dict[str, str] = field(default_factory=dict)
    #: (path in a, path in b, dtype in a, dtype in b) of matched parameters whose dtypes differ
    dtype_differences: list[tuple[str, str, str, str]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Nothing unmatched and no dtype difference (ties are facts, not faults)."""
        return not (self.unmatched_a or self.unmatched_b or self.dtype_differences)

    def lines(self) -> list[str]:
        """The section as text lines (the report's table prints them first)."""
        out = [f"structure: a has {self.params_a:,} parameters, b has {self.params_b:,}"
               + ("" if self.clean else " (see below)")]
        for side, items in (("a", self.unmatched_a), ("b", self.unmatched_b)):
            if items:
                out.append(f"  unmatched in {side} ({len(items)}): " + ", ".join(items))
        for side, tied in (("a", self.tied_a), ("b", self.tied_b)):
            if tied:
                out.append(f"  tied in {side}: " + ", ".join(f"{k} = {v}" for k, v in tied.items()))
        for pa, pb, da, db in self.dtype_differences:
            out.append(f"  dtype differs: {pa} ({da}) vs {pb} ({db})")
        return out

    def to_dict(self) -> dict:
        return {"params_a": self.params_a, "params_b": self.params_b, "unmatched_a": list(self.unmatched_a),
                "unmatched_b": list(self.unmatched_b), "tied_a": dict(self.tied_a), "tied_b": dict(self.tied_b),
                "dtype_differences": [{"a": pa, "b": pb, "dtype_a": da, "dtype_b": db}
                                      for pa, pb, da, db in self.dtype_differences]}


# ---------------------------------------------------------------------------- one side
class _Params:
    """One model's walk: every parameter path with its shape and dtype, and its ties."""

    def __init__(self, model: Any, argument: str, entries: list | None = None) -> None:
        from ..models import walk

        self.entries = walk(model, argument) if entries is None else entries
        self.info: dict[str, tuple[tuple[int, ...], str]] = {}
        self.tied: dict[str, str] = {}
        first: dict[Any, str] = {}
        count = 0
        for e in self.entries:
            # a quantized layer's tensors are codes in the framework's own packing (torchao
            # subclasses cannot even be read as arrays): its shapes are declared, its dtype is "quantized"
            values = e.read() if e.kind != "quantized" else {}
            for n in e.names:
                p = e.param_path(n)
                v = values.get(n)
                shape = tuple(int(s) for s in (e.shapes.get(n) or np.shape(v)))
                self.info[p] = (shape, "quantized" if e.kind == "quantized" else _dtype(v))
                key = e.ident.get(n, p)
                if key in first:
                    self.tied[p] = first[key]
                else:
                    first[key] = p
                    count += int(np.prod(shape)) if shape else 1
        self.count = count

    def paths(self, e) -> list[str]:
        return [e.param_path(n) for n in e.names]


def _dtype(v) -> str:
    dt = getattr(v, "dtype", None)
    if dt is None:
        return "?"
    name = str(dt)
    return name.rsplit(".", 1)[-1]


def _numbers(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def _align(a: list, b: list) -> list[tuple[Any, Any]]:
    """Pairs of entries of one kind: in order when the counts agree, else aligned on the layer
    numbers in their paths (difflib), the rest of equal-length gaps in order."""
    if len(a) == len(b):
        return list(zip(a, b))
    keys_a, keys_b = [_numbers(e.path) for e in a], [_numbers(e.path) for e in b]
    pairs = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False).get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            pairs += list(zip(a[i1:i2], b[j1:j2]))
    return pairs


def _signature(side: _Params, e) -> tuple:
    return tuple(side.info[p][0] for p in side.paths(e))


def model_structure(a: Any, b: Any, pairs: list[tuple[str, str]],
                    groups: dict[str, Any] | None = None, entries: tuple[list, list] | None = None,
                    read: Any = None) -> Structure:
    """The :class:`Structure` of two whole models whose linear layers ``pairs`` matches.

    ``groups``: split or fused sides by label ("q+k+v", with ``.paths``): every member's
    parameters count as matched with the other side's (their joined arrays are compared).
    ``entries``: both models' walks when the caller has them (each model is walked once);
    ``read``: ``get_params(layer, copy=False)`` of the caller that has read them already."""
    groups = groups or {}
    from .._api import get_params

    get_params = read or get_params

    walked_a, walked_b = entries or (None, None)
    sa, sb = _Params(a, "a", walked_a), _Params(b, "b", walked_b)
    out = Structure(sa.count, sb.count, tied_a=dict(sa.tied), tied_b=dict(sb.tied))
    matched_a: set[str] = set()
    matched_b: set[str] = set()
    by_path_a = {e.path: e for e in sa.entries}
    by_path_b = {e.path: e for e in sb.entries}
    for pa, pb in pairs:
        if pa in groups or pb in groups:
            for side, label, by_path, matched in ((sa, pa, by_path_a, matched_a), (sb, pb, by_path_b, matched_b)):
                for path in (groups[label].paths if label in groups else (label,)):
                    if path in by_path:
                        matched.update(side.paths(by_path[path]))
            continue
        ea, eb = by_path_a.get(pa), by_path_b.get(pb)
        if ea is None or eb is None:
            continue
        ca, cb = get_params(ea.layer, copy=False), get_params(eb.layer, copy=False)
        names_a, names_b = sa.paths(ea), sb.paths(eb)
        # canonical names pair the native ones: kernel with kernel, bias with bias (in each layer's order)
        for k in ca:
            if k in cb:
                if _dtype(ca[k]) != _dtype(cb[k]):
                    out.dtype_differences.append((f"{pa} {k}", f"{pb} {k}", _dtype(ca[k]), _dtype(cb[k])))
        if set(ca) == set(cb):
            matched_a.update(names_a)
            matched_b.update(names_b)
        else:  # a bias on one side only: name the side's parameters by canonical role
            extra_a, extra_b = set(ca) - set(cb), set(cb) - set(ca)
            out.unmatched_a += [f"{pa} ({k})" for k in sorted(extra_a)]
            out.unmatched_b += [f"{pb} ({k})" for k in sorted(extra_b)]
            matched_a.update(names_a)
            matched_b.update(names_b)
    linear_a = {p for pa, _ in pairs for p in (groups[pa].paths if pa in groups else (pa,))}
    linear_b = {p for _, pb in pairs for p in (groups[pb].paths if pb in groups else (pb,))}
    other_a = [e for e in sa.entries if e.path not in linear_a and e.kind != "linear"]
    other_b = [e for e in sb.entries if e.path not in linear_b and e.kind != "linear"]
    by_signature: dict[tuple, tuple[list, list]] = {}  # other layers of one kind, a's and b's
    for e in other_a:
        by_signature.setdefault(_signature(sa, e), ([], []))[0].append(e)
    for e in other_b:
        by_signature.setdefault(_signature(sb, e), ([], []))[1].append(e)
    for ga, gb in by_signature.values():
        for ea, eb in _align(ga, gb):
            for p, q in zip(sa.paths(ea), sb.paths(eb)):
                matched_a.add(p)
                matched_b.add(q)
                if sa.info[p][1] != sb.info[q][1]:
                    out.dtype_differences.append((p, q, sa.info[p][1], sb.info[q][1]))
    # a tied parameter follows its tie
    out.unmatched_a += [p for p in sa.info if p not in matched_a and sa.tied.get(p) not in matched_a]
    out.unmatched_b += [p for p in sb.info if p not in matched_b and sb.tied.get(p) not in matched_b]
    return out


def params_structure(params_a: dict, params_b: dict) -> Structure:
    """The :class:`Structure` of two spec-described models from their canonical parameters
    ("0.kernel", ...): keys on one side only, dtypes that differ, counts (masks not counted)."""
    def count(params):
        return sum(int(np.size(v)) for k, v in params.items() if not k.endswith("mask"))

    out = Structure(count(params_a), count(params_b))
    out.unmatched_a = [k for k in params_a if k not in params_b]
    out.unmatched_b = [k for k in params_b if k not in params_a]
    for k in params_a:
        if k in params_b and _dtype(params_a[k]) != _dtype(params_b[k]):
            out.dtype_differences.append((k, k, _dtype(params_a[k]), _dtype(params_b[k])))
    return out


def rows_structure(rows: list[dict]) -> Structure:
    """The :class:`Structure` from per-parameter rows as ``dense-bridge check`` lists them while it
    streams two checkpoints ({"name", "shape_a", "shape_b", "dtype_a", "dtype_b"}, a side's shape
    None where it lacks the parameter)."""
    def count(side: str) -> int:
        return sum(int(np.prod(r[f"shape_{side}"])) for r in rows
                   if r[f"shape_{side}"] is not None and not r["name"].endswith("mask"))

    out = Structure(count("a"), count("b"))
    out.unmatched_a = [r["name"] for r in rows if r["shape_b"] is None]
    out.unmatched_b = [r["name"] for r in rows if r["shape_a"] is None]
    out.dtype_differences = [(r["name"], r["name"], r["dtype_a"], r["dtype_b"]) for r in rows
                             if r["shape_a"] is not None and r["shape_b"] is not None and r["dtype_a"] != r["dtype_b"]]
    return out
