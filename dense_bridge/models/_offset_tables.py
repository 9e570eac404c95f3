"""Embedding tables that one library stores with a few more leading rows than the other.

A learned position table may reserve its first rows: positions start after a padding id
(``padding_idx + 1``), so a library that counts positions from the padding id stores
``max_positions + offset`` rows where another, counting from 0, stores ``max_positions``. The
rows before the offset are never looked up by a position the other library can express, so the
table moves as a slice of its last rows (:class:`Rows`); the other way round, the longer table's
first rows have no source, and the pair is left unpaired (named by the transfer).

Which tables pair is read off the shapes alone (same width, the source longer by at most
:data:`MAX_OFFSET` rows, several alike in execution order); the transfer's verification judges
the result like every other pair.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _plan as _mapping

__all__ = ["Rows", "MAX_OFFSET", "pair_offset_tables"]

#: The most leading rows a table may reserve (a padding id and the ids before it).
MAX_OFFSET = 4


@dataclass(frozen=True)
class Rows:
    """A table's rows from ``start`` on (canonical (rows, width) in, (rows - start, width) out)."""

    start: int

    def __call__(self, table: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(table)[self.start:])

    def __repr__(self) -> str:
        return f"rows[{self.start}:]"


def _table(layer) -> tuple[str, tuple[int, int]] | None:
    """(parameter path, (rows, width)) of a one-table layer, else None."""
    e = layer.entry
    if len(e.names) != 1 or len(e.shapes[e.names[0]]) != 2:
        return None
    return e.param_path(e.names[0]), tuple(int(n) for n in e.shapes[e.names[0]])


def pair_offset_tables(left_a: list, left_b: list, b, plan: _mapping.Plan) -> tuple[list, list]:
    """Embedding tables left unpaired by shape (``left_a``: src's, ``left_b``: dst's, execution
    order; ``b``: the destination walk): each src table with the next dst table of the same width
    that is 1 to :data:`MAX_OFFSET` rows shorter moves as its last rows (a :class:`Rows` move).
    Returns the tables still left (src, dst)."""
    rest_a, rest_b = [], list(left_b)
    for x in left_a:
        tx = _table(x)
        hit = None
        if tx is not None:
            for y in rest_b:
                ty = _table(y)
                if ty is not None and ty[1][1] == tx[1][1] and 0 < tx[1][0] - ty[1][0] <= MAX_OFFSET:
                    hit = (y, ty)
                    break
        if hit is None:
            rest_a.append(x)
            continue
        y, ty = hit
        rest_b.remove(y)
        plan.params.append(_mapping.ParamMove(tx[0], b.param(ty[0]), Rows(tx[1][0] - ty[1][0]), rule="auto"))
    return rest_a, rest_b


def _moved_sources(a, plan: _mapping.Plan) -> set[str]:
    """The src parameter paths the plan moves (layer moves, parameter moves, moves along an axis)."""
    out = {p.src for p in plan.params} | {s for m in plan.axis_moves for s in m.src}
    for m in plan.layers:
        for e in m.src:
            out.update(e.param_path(n) for n in e.names)
    return out


def drop_tied_copies(left: list[str], a, plan: _mapping.Plan) -> list[str]:
    """``left`` (src layer or parameter paths left unpaired) without those every parameter of which
    is the very storage of a parameter the plan moves (an encoder-decoder's one token table, held
    as ``shared`` and as each side's ``embed_tokens``): they move with it, once; the destination
    holds the table once. ``a``: the source walk (``tied_to``: path -> the first path of its storage)."""
    moved = _moved_sources(a, plan)
    groups = {a.tied_to.get(p, p) for p in moved}
    out = []
    for name in left:
        if name in a.params:
            params = [name]
        else:
            e = next((x for x in a.entries if x.path == name), None)
            params = [e.param_path(n) for n in e.names] if e is not None and e.names else []
        if params and all(p not in moved and a.tied_to.get(p, p) in groups for p in params):
            continue
        out.append(name)
    return out


def lacking_tables(left_a: list[str], left_b: list[str], a, b) -> str:
    """The sentence for src embedding tables (one 2-D parameter) looked up and left unpaired while dst leaves no
    table of their width: dst's model looks up no such table (a token-type table whose one row the
    source adds to every token), so its rows would be lost. "" when there is none."""
    def tables(left, side):
        out = []
        for name in left:
            hit = side.params.get(name)
            if hit is None:
                e = next((x for x in side.entries if x.path == name), None)
                hit = (e, e.names[0]) if e is not None and len(e.names) == 1 else None
            # a layer of its own: a parameter the model itself holds (a bias its code adds) is no table
            if hit is not None and hit[0].path and len(hit[0].names) == 1 and len(hit[0].shapes[hit[1]]) == 2:
                out.append((hit[0].param_path(hit[1]), tuple(int(n) for n in hit[0].shapes[hit[1]])))
        return out
    widths_b = {s[1] for _, s in tables(left_b, b)}
    lost = [(p, s) for p, s in tables(left_a, a) if s[1] not in widths_b]
    if not lost:
        return ""
    listed = ", ".join(f"{p!r} {s}" for p, s in lost)
    return (f"src's table(s) {listed} have no counterpart in dst: dst's model looks up no such table, so the rows "
            f"src adds to its embeddings (a token-type table adds one to every token) cannot be carried; the port is "
            f"exact only for a model whose rows there are zero (strict=False leaves the table out)")
