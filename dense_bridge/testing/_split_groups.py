"""Fused and split projections in ``compare_models``: a fused layer is judged against the
concatenation of its split counterparts.

A layer move that splits (GPT-2's ``c_attn`` into keras-hub's ``query``/``key``/``value``) or
concatenates becomes ONE compared pair: the several layers' side is a *group*, labelled by its
paths joined with "+", whose calls are merged call by call into one call of a virtual fused
layer: the members' common input, their outputs (and dL/d(output)) joined along units, their
canonical parameters and parameter gradients joined the same way (per head when the move
declares ``heads``; ``dense_bridge.models._plan.join_arrays``). Everything after that is the plain
one-to-one comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._errors import ConversionError
from ..models._plan import join_arrays
from ..registry._captures import Call, Capture

__all__ = ["Group", "pairs_of", "members", "merge", "group_params", "as_units", "join_units"]


@dataclass(frozen=True)
class Group:
    """Several layers of one model compared as one fused layer (their units joined in order)."""

    paths: tuple[str, ...]
    heads: int | None

    @property
    def label(self) -> str:
        return "+".join(self.paths)


def pairs_of(moves) -> tuple[list[tuple[str, str]], dict[str, Group]]:
    """(path or group label in a, in b) per layer move, and every group by its label."""
    pairs, groups = [], {}
    for m in moves:
        ends = []
        for side in (m.src, m.dst):
            if len(side) == 1:
                ends.append(side[0].path)
                continue
            g = Group(tuple(e.path for e in side), m.heads)
            groups[g.label] = g
            ends.append(g.label)
        pairs.append((ends[0], ends[1]))
    return pairs, groups


def members(labels, groups: dict[str, Group]) -> list[str]:
    """The layer paths behind ``labels`` (a group's members in order, a plain path itself)."""
    out = []
    for label in labels:
        out += list(groups[label].paths) if label in groups else [label]
    return out


def group_params(label: str, groups: dict[str, Group], layers: dict, get_params) -> dict[str, np.ndarray]:
    """Canonical params of a plain layer, or of a group joined along units."""
    if label not in groups:
        return get_params(layers[label], copy=False)
    g = groups[label]
    joined, problem = join_arrays([get_params(layers[p], copy=False) for p in g.paths], g.heads)
    if problem:
        raise ConversionError(f"cannot compare {label} as one fused layer: {problem}")
    return joined


def merge(cap: Capture, groups: dict[str, Group], widths: dict[str, int], to_numpy=None) -> Capture:
    """``cap`` with every group's member calls merged into one call per call number, in the
    position of the first member's call; outputs and dL/d(output) as (rows, units) joined along
    units; parameter gradients joined like the parameters. ``widths``: path -> units.
    ``to_numpy``: the adapter's verb, for a capture holding its framework's arrays (``native``):
    the members' outputs, gradients and parameter gradients are joined on the host."""
    mine = {p: label for label, g in groups.items() for p in g.paths}
    if not any(c.path in mine for c in cap.calls):
        return cap
    if to_numpy is not None:
        host = lambda x: None if x is None else np.asarray(to_numpy(x))  # noqa: E731
        cap = Capture([Call(c.path, c.call, c.inputs, host(c.output), host(c.output_grad)) if c.path in mine else c
                       for c in cap.calls],
                      {k: ({n: host(v) for n, v in pg.items()} if k in mine else pg) for k, pg in cap.param_grads.items()},
                      cap.output, list(cap.notes), set(cap.pre_activation))
    by: dict[tuple[str, int], dict[str, Call]] = {}
    for c in cap.calls:
        if c.path in mine:
            by.setdefault((mine[c.path], c.call), {})[c.path] = c
    calls, done = [], set()
    for c in cap.calls:
        if c.path not in mine:
            calls.append(c)
            continue
        key = (mine[c.path], c.call)
        if key in done:
            continue
        done.add(key)
        g = groups[key[0]]
        got = by[key]
        if set(got) != set(g.paths):  # a member not called: leave the calls as they are, unmerged
            calls += list(got.values())
            continue
        parts = [got[p] for p in g.paths]
        out = join_units([as_units(p.output, widths[p.path]) for p in parts], g.heads)
        grads = [p.output_grad for p in parts]
        grad = None if any(x is None for x in grads) else \
            join_units([as_units(x, widths[p.path]) for x, p in zip(grads, parts)], g.heads)
        calls.append(Call(g.label, c.call, parts[0].inputs, out, grad))
    param_grads = {k: v for k, v in cap.param_grads.items() if k not in mine}
    for label, g in groups.items():
        pg = [cap.param_grads.get(p) for p in g.paths]
        if all(x is not None for x in pg) and pg:
            joined, problem = join_arrays(pg, g.heads)
            if not problem:
                param_grads[label] = joined
    pre = {p for p in cap.pre_activation if p not in mine}
    return Capture(calls, param_grads, cap.output, list(cap.notes), pre)


def as_units(x, width: int) -> np.ndarray:
    """A captured output as (rows, width): its trailing axes that hold ``width`` features."""
    x = np.asarray(x)
    size = 1
    for k in range(x.ndim - 1, -1, -1):
        size *= x.shape[k]
        if size == width:
            return x.reshape(-1, width)
    raise ConversionError(f"an output of shape {x.shape} cannot be read as (..., {width})")


def join_units(arrays: list[np.ndarray], heads: int | None) -> np.ndarray:
    """(rows, units_i) arrays joined along units into (rows, sum units_i), per head with ``heads``."""
    dtype = np.result_type(*[a.dtype for a in arrays])
    joined, _ = join_arrays([{"kernel": a.astype(dtype, copy=False)} for a in arrays], heads)
    return joined["kernel"]
