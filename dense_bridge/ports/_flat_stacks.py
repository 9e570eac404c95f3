"""Port recipes for expert matrices one library stores flattened into one tensor, the other one per expert.

transformers' DBRX saves every expert's matrix of one projection as ONE tensor ``(E * F, H)``
(``experts.mlp.w1``: expert 0's ``(F, H)`` rows, then expert 1's, ...), where mlx-lm saves one
tensor per expert (``experts.<e>.w1.weight`` ``(F, H)``, or ``(H, F)``: the transpose). Matched by
value, the per-expert tensor is a run of rows of the flattened one whose start moves with the
expert index, which no recipe of fixed slices generalises; seen through the per-head view
(``_rules.HEADS``: ``(E * F, H)`` as ``(E, F, H)``) it is one entry along the new axis 0 (a pick),
and the flattened tensor is the per-expert tensors stacked along a new axis 0 and the view undone
(a stack). The count ``E`` is left to the real checkpoint's tensors (``"|h"`` without a number), so
the twin's few experts give the recipe for any number of them.
"""
from __future__ import annotations

from . import _rules

__all__ = ["recipes", "view_count"]


def recipes(name: str, d, src: dict, axis: int | None, found: list) -> list | None:
    """The pick or stack recipes (several where the indices agree by chance: layer 0's expert 0)
    that make the destination twin's tensor ``name`` from the pieces ``found`` along ``axis``
    (``_rules._match``), when they show a flattened expert stack; None otherwise.

    Args:
        name: the destination file key; ``d``: its float32 array (2-D).
        src: the source twin's file key -> array.
        axis, found: what ``_rules._match`` found: pieces ``(source, transpose, start, stop, whole)``
            concatenated along ``axis`` make ``d``.

    Returns:
        A list of :class:`~dense_bridge.ports._rules.Recipe` (``pick`` or ``stack`` with the view
        ``"h"``), or None.
    """
    if axis is None or getattr(d, "ndim", 0) != 2 or not found:
        return None
    t, idx = _rules.template(name)
    if len(found) == 1 and not found[0][4]:
        return _pick(t, idx, d, src, axis, found[0])
    if len(found) >= 2 and all(f[4] for f in found) and axis == 0:
        return _stack(t, idx, d, src, found)
    return None


def _pick(t: str, idx: tuple, d, src: dict, axis: int, piece) -> list | None:
    """``d`` as entry e of a source (E * r, c) seen as (E, r, c), its two axes exchanged when the
    piece is transposed: the run [e * r, (e + 1) * r) of the source's rows."""
    s_name, transpose, start, stop, _ = piece
    s = src[s_name]
    if s.ndim != 2:
        return None
    stored = (1 - axis) if transpose else axis
    length = stop - start
    if stored != 0 or length <= 0 or s.shape[0] % length or start % length or s.shape[0] // length < 2:
        return None
    entry = start // length
    st, s_idx = _rules.template(s_name)
    out = [_rules.Recipe(t, 0, (_rules.Piece(f"{st}{_rules.VIEW}{_rules.HEADS}", transpose, 0, 0, True),),
                         pick=True, vary=k)
           for k in range(len(idx)) if idx[k] == entry and idx[:k] + idx[k + 1:] == s_idx]
    return out or None


def _stack(t: str, idx: tuple, d, src: dict, found: list) -> list | None:
    """``d`` (E * r, c) as E whole sources of one template, one per value 0 .. E-1 of one of its
    indices, each (r, c) (or (c, r) transposed), stacked along a new axis 0 and flattened."""
    names = [f[0] for f in found]
    transposes = {f[1] for f in found}
    templates = {_rules.template(n)[0] for n in names}
    if len(transposes) != 1 or len(templates) != 1 or d.shape[0] % len(found):
        return None
    shapes = {_rules._shape_of(src[n].shape, found[0][1]) for n in names}
    if shapes != {(d.shape[0] // len(found), d.shape[1])}:
        return None
    indices = [_rules.template(n)[1] for n in names]
    varying = [k for k in range(len(indices[0])) if len({i[k] for i in indices}) > 1]
    if len(varying) != 1 or [i[varying[0]] for i in indices] != list(range(len(found))):
        return None
    vary = varying[0]
    if tuple(i for k, i in enumerate(indices[0]) if k != vary) != idx:
        return None
    st = templates.pop()
    return [_rules.Recipe(t, 0, (_rules.Piece(st, found[0][1], 0, 0, True),), view=_rules.HEADS, stack=True,
                         vary=vary)]


def view_count(view: str | None, count: int) -> str | None:
    """A recipe's symbolic per-head view (``"h"``) given the real count: ``"h<count>"``."""
    return f"{_rules.HEADS}{count}" if view == _rules.HEADS else view
