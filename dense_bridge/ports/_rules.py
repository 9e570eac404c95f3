"""Tensor recipes learnt from the twins' files, generalised over indices, applied to real names.

After the twins' verified transfer, every tensor the destination library's own saver wrote is a
rearrangement of tensors the source library's saver wrote. Their values are random and distinct,
so each destination tensor is found among the source tensors by value: the same tensor, its
transpose, a run of slices of one or several (split, concatenation), each exactly; or per head
(:data:`HEADS`): a matrix (heads * (a + b), r) seen as (heads, a + b, r), cut along its middle axis
into parts (heads, a, r) (or with their last two axes exchanged), or joined from them. A
:class:`Recipe` says which, with file keys in which every integer path component (a layer, an
expert) is a placeholder: the twin's two layers give one recipe for every layer of the real model.

:func:`learn` does the matching; :func:`plan` applies the recipes to a real checkpoint's names
and shapes: every source tensor used, every destination tensor written exactly once, shapes
agreeing, the slices of a split sized from the real destination shapes (a per-head split takes
its widths from the real config, not the twin's).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from .._errors import ConversionError
from . import _strided
from ._placed import oriented as _oriented, placed

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")
#: ``name|<perm>-<k>``: the tensor ``name`` seen through a view (:func:`apply_view`), where one
#: library keeps a projection as (in, heads, head_dim) or (heads, in, head_dim) and another as a matrix.
VIEW = "|"


#: ``name|h<n>``: the matrix ``name`` (heads * d, r) seen per head as (n, d, r), where one library
#: keeps a projection's heads apart ((heads, a, r) and (heads, b, r) arrays) and another as one
#: matrix; in a recipe ``h`` alone: the count comes from the real tensors' leading axis.
HEADS = "h"


def _heads(view: str) -> int | None:
    return int(view[1:]) if view.startswith(HEADS) and view[1:].isdigit() else None


def _parse_view(view: str) -> tuple[tuple[int, ...], int]:
    perm, _, k = view.partition("-")
    return tuple(int(c) for c in perm), int(k)


def view_shape(shape: tuple[int, ...], view: str) -> tuple[int, ...]:
    """The shape of a tensor of ``shape`` seen through ``view`` (``"<perm>-<k>"``): its axes put in
    the order ``perm``, then reshaped to ``(prod(axes[:k]), prod(axes[k:]))``, or flat for ``k == 0``."""
    h = _heads(view)
    if h is not None:
        return (h, shape[0] // h) + tuple(shape[1:])
    perm, k = _parse_view(view)
    axes = [shape[i] for i in perm]
    n = int(np.prod(axes, dtype=np.int64))
    return (n,) if k == 0 else (int(np.prod(axes[:k], dtype=np.int64)), int(np.prod(axes[k:], dtype=np.int64)))


def apply_view(a: np.ndarray, view: str) -> np.ndarray:
    """``a`` seen through ``view`` (see :func:`view_shape`)."""
    if _heads(view) is not None:
        return a.reshape(view_shape(a.shape, view))
    perm, _ = _parse_view(view)
    return np.transpose(a, perm).reshape(view_shape(a.shape, view))


def undo_view(made: np.ndarray, view: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor of ``shape`` that ``view`` shows as ``made``."""
    if _heads(view) is not None:
        return made.reshape(shape)
    perm, _ = _parse_view(view)
    return made.reshape([shape[i] for i in perm]).transpose(np.argsort(perm))


def split_view(key: str) -> tuple[str, str | None]:
    """``"w|021-1"`` -> ``("w", "021-1")``; ``"w"`` -> ``("w", None)``."""
    name, sep, view = key.rpartition(VIEW)
    return (name, view) if sep and re.fullmatch(r"\d*-\d+|h\d*", view) else (key, None)


def _views(a: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The views of ``a`` tried when it matches nothing as it is: of a tensor of three axes or
    more, a matrix for every order of its axes and split; of a matrix, the flat vector; of a scalar,
    a vector of one (``"-0"``: a learned scalar one library stores as (), another as (1,))."""
    import itertools

    if a.ndim >= 3:
        out = []
        for perm in itertools.permutations(range(a.ndim)):
            for k in range(1, a.ndim):
                view = "".join(map(str, perm)) + f"-{k}"
                out.append((view, apply_view(a, view)))
        return out
    if a.ndim == 0:
        return [("-0", a.reshape(1))]
    return [("01-0", a.reshape(-1))] if a.ndim == 2 else []


def template(name: str) -> tuple[str, tuple[int, ...]]:
    """``"model.layers.3.mlp.w"`` -> ``("model.layers.{}.mlp.w", (3,))``."""
    indices = tuple(int(m.group()) for m in _INDEX.finditer(name))
    return _INDEX.sub("{}", name), indices


def fill(tmpl: str, indices: tuple[int, ...]) -> str:
    return tmpl.format(*indices)


@dataclass(frozen=True)
class Piece:
    """One source tensor's part of a destination tensor: ``source`` (a template), transposed
    first when ``transpose``, then the run ``[start, stop)`` along the recipe's axis of the
    (transposed) source; ``whole``: the run is the whole axis."""

    source: str
    transpose: bool
    start: int
    stop: int
    whole: bool


@dataclass(frozen=True)
class Recipe:
    """A destination tensor (template) made of ``pieces`` concatenated along ``axis`` (None: one
    piece, the whole source, maybe transposed).

    Moves along a new axis (expert stacks): ``stack`` — the destination is the sources stacked
    along a new axis ``axis``, one per value of the source's index at position ``vary`` of its
    template (one piece, the template); ``pick`` — the destination is the one source's entry at
    the index of the destination's own index at position ``vary``, along the source's axis
    ``axis`` (that axis dropped)."""

    target: str
    axis: int | None
    pieces: tuple[Piece, ...]
    #: the pieces make the destination seen through this view (:func:`apply_view`), then undone
    view: str | None = None
    stack: bool = False
    pick: bool = False
    vary: int | None = None
    #: added to every value of the one whole source (a norm's scale stored as ``w`` on one side,
    #: ``1 + w`` on the other), the sum rounded once in the destination's dtype
    offset: float = 0.0
    #: a group repeated per entry (experts stacked, each a concatenation): the pieces, whole,
    #: filled for every value 0, 1, ... of the source index at position ``vary`` (as many as the
    #: real source holds), all concatenated along ``axis`` in that order, make the destination seen
    #: through ``view`` (``(E, H, 2F)`` seen as ``(E * 2F, H)``: gate_0, up_0, gate_1, up_1, ...)
    group: bool = False
    #: with ``group`` and ``pick``: the twin's entry width along the source view's ``axis`` (the
    #: one piece's run [start, stop) lies within it)
    width: int = 0
    #: no source: a tensor of exact zeros (a bias the source's layer lacks, ``_zeros``)
    zeros: bool = False
    #: the pieces interleave along ``axis`` (``_strided``): one piece, every ``stride``-th entry of
    #: its source from ``start``; or ``stride`` whole pieces interleaved
    stride: int | None = None

    def describe(self) -> str:
        if self.zeros:
            return f"{self.target} <- zeros"
        if self.stride:
            p = self.pieces
            if len(p) == 1:
                return (f"{self.target} <- {'transpose ' if p[0].transpose else ''}{p[0].source}"
                        f"[{p[0].start}::{self.stride} along axis {self.axis}]")
            return f"{self.target} <- interleave axis {self.axis}({', '.join(q.source for q in p)})"
        parts = [("transpose " if p.transpose else "") + p.source + ("" if p.whole else f"[{p.start}:{p.stop}]")
                 for p in self.pieces]
        if self.stack:
            return f"{self.target} <- stack axis {self.axis}({parts[0]} over index #{self.vary})"
        if self.pick:
            return f"{self.target} <- {parts[0]} entry [index #{self.vary}] of axis {self.axis}"
        if self.group and self.pick:
            return (f"{self.target} <- {parts[0]} of entry [index #{self.vary}] (width {self.width}) "
                    f"along axis {self.axis}")
        if self.group:
            return (f"{self.target} <- reshape(concat axis {self.axis}(for each index #{self.vary}: "
                    f"{', '.join(parts)}))")
        made = parts[0] if self.axis is None else f"concat axis {self.axis}({', '.join(parts)})"
        if self.offset:
            made = f"{made} + {self.offset:g}"
        return f"{self.target} <- " + (made if self.view is None else f"reshape({made})")


class _Index:
    """Where a float32 value lies among the source tensors, found by a vectorised scan of their bit
    patterns (no table of every value: a twin holds millions)."""

    def __init__(self, src: dict[str, np.ndarray]) -> None:
        self.src = src
        self.bits = {n: np.ascontiguousarray(a, np.float32).reshape(-1).view(np.uint32) for n, a in src.items()}

    def find(self, value) -> list[tuple[str, int]]:
        b = np.float32(value).view(np.uint32)
        out = []
        for name, bits in self.bits.items():
            out += [(name, int(i)) for i in np.flatnonzero(bits == b)[:64]]
        return out


def _cover(d: np.ndarray, axis: int, src: dict[str, np.ndarray], where: _Index):
    """``d`` as runs along ``axis`` of source tensors (or their transposes), or None."""
    pieces, cursor, n = [], 0, d.shape[axis]
    while cursor < n:
        lead = [0] * d.ndim
        lead[axis] = cursor
        found = None
        for name, transpose, so, coord in placed(where, src, d[tuple(lead)], d.ndim):
            if any(coord[k] != 0 or so.shape[k] != d.shape[k] for k in range(d.ndim) if k != axis):
                continue
            start = int(coord[axis])
            length = min(n - cursor, so.shape[axis] - start)
            a = np.take(d, range(cursor, cursor + length), axis=axis)
            b = np.take(so, range(start, start + length), axis=axis)
            if np.array_equal(a, b):
                found = (name, transpose, start, start + length, start == 0 and length == so.shape[axis])
                break
        if not found:
            return None
        pieces.append(found)
        cursor += found[3] - found[2]
    return pieces


def _whole(d: np.ndarray, src: dict[str, np.ndarray], where: _Index, exclude=()) -> tuple[str, bool] | None:
    """The source tensor equal to ``d`` (or to its transpose), found by its first value."""
    if d.size == 0:
        return None
    first = d.reshape(-1)[0]
    for name, flat in where.find(first):
        if flat != 0 and not (src[name].ndim == 2 and np.unravel_index(flat, src[name].shape) == (0, 0)):
            continue
        s = src[name]
        if s.shape == d.shape and np.array_equal(s, d):
            return name, False
        if s.ndim == 2 and s.T.shape == d.shape and np.array_equal(s.T, d):
            return name, True
    return None


def _stacked(name: str, d: np.ndarray, src: dict[str, np.ndarray], where: _Index):
    """``d`` as source tensors stacked along a new axis, one per value of one index of their
    template: (axis, the first source's name, transpose, index position), or None."""
    if d.ndim < 3:
        return None
    for axis in range(d.ndim):
        found = []
        for e in range(d.shape[axis]):
            hit = _whole(np.take(d, e, axis=axis), src, where)
            if hit is None:
                break
            found.append(hit)
        if len(found) != d.shape[axis] or len({template(n)[0] for n, _ in found}) != 1 or len({t for _, t in found}) != 1:
            continue
        idx = [template(n)[1] for n, _ in found]
        varying = [k for k in range(len(idx[0])) if len({i[k] for i in idx}) > 1]
        if len(varying) == 1 and [i[varying[0]] for i in idx] == list(range(d.shape[axis])):
            return axis, found[0][0], found[0][1], varying[0]
    return None


def _picked(name: str, d: np.ndarray, src: dict[str, np.ndarray], where: _Index):
    """``d`` as one entry along an axis of a source tensor with one axis more: (source name,
    axis, entry, transpose), or None."""
    if d.size == 0:
        return None
    for transpose in ((False, True) if d.ndim == 2 else (False,)):
        dd = d.T if transpose else d
        for s_name, flat in where.find(dd.reshape(-1)[0]):
            s = src[s_name]
            if s.ndim != dd.ndim + 1:
                continue
            coord = np.unravel_index(flat, s.shape)
            for axis in range(s.ndim):
                rest = [c for k, c in enumerate(coord) if k != axis]
                if any(rest) or tuple(x for k, x in enumerate(s.shape) if k != axis) != dd.shape:
                    continue
                if np.array_equal(np.take(s, coord[axis], axis=axis), dd):
                    return s_name, axis, int(coord[axis]), transpose
    return None


def _match(name: str, d: np.ndarray, src: dict[str, np.ndarray], where: _Index) -> tuple[int | None, list]:
    same = [s_name for s_name, s in src.items()  # the whole tensor, or its transpose: the usual case, checked first
            if s.shape == d.shape and s.reshape(-1)[:1].tobytes() == d.reshape(-1)[:1].tobytes() and np.array_equal(s, d)]
    if same:  # a constant every layer holds alike (a buffer): the one at the destination's own indices
        mine = template(name)[1]
        s_name = next((n for n in same if template(n)[1] == mine[:len(template(n)[1])] and template(n)[1]), same[0])
        return None, [(s_name, False, 0, d.shape[0] if d.ndim else 1, True)]
    for s_name, s in src.items():
        if s.ndim >= 2 and _oriented(s, True).shape == d.shape and s.reshape(-1)[0] == d.reshape(-1)[0] \
                and np.array_equal(_oriented(s, True), d):
            return None, [(s_name, True, 0, d.shape[0], True)]
    for axis in range(d.ndim):
        pieces = _cover(d, axis, src, where)
        if pieces is not None:
            return axis, pieces
    raise ConversionError(f"the destination twin's tensor {name!r} {tuple(d.shape)} is no rearrangement (copy, "
                          "transpose, split, concatenation) of the source twin's tensors: its library computes it "
                          "(nothing was written)")


def _zeros_made(d: np.ndarray, src: dict[str, np.ndarray]) -> bool:
    """Is the destination twin's tensor ``d`` a tensor of zeros that no source tensor is?

    Args:
        d: the destination twin's saved tensor (float32).
        src: the source twin's saved tensors (file key -> float32 array).
    Returns:
        True when every value of ``d`` is zero and no source tensor of its shape is all zeros
        (an all-zero source of its shape is a copy, which the value search finds).
    """
    if not d.size or np.any(d):
        return False
    return not any(np.shape(s) == d.shape and not np.any(s) for s in src.values())


def learn(src: dict[str, np.ndarray], dst: dict[str, np.ndarray]) -> dict[str, Recipe]:
    """One recipe per destination template, from the twins' saved tensors (``src``/``dst``: file
    key -> float32 array). ConversionError when a tensor has no recipe or two layers of one
    template disagree (the rule depends on the index in a way that does not generalise)."""
    where = _Index(src)
    wide = None  # the sources with their reshaped views, made when a tensor needs them
    recipes: dict[str, Recipe] = {}
    candidates: dict[str, list[Recipe]] = {}  # moves along a new axis: what every layer agrees on
    for name, d in dst.items():
        d = np.asarray(d, np.float32)
        t, idx = template(name)
        if _zeros_made(d, src):
            recipes[t] = Recipe(t, None, (), zeros=True)
            continue
        stride = None
        try:
            made = _made(name, d, src, where, wide, candidates, t)
        except ConversionError:
            interleaved = _strided.find(d, src, where)
            if interleaved is None:
                raise
            axis, parts, stride = interleaved
            made = (axis, [(n, tr, k, k + 1, len(parts) > 1) for n, tr, k in parts], None, None, 0.0)
        if made is None:
            continue
        axis, found, view, made_wide, offset = made
        wide = made_wide if made_wide is not None else wide
        pieces = []
        for s_name, transpose, start, stop, whole in found:
            st, s_idx = template(s_name)
            if idx == () and s_idx:  # one destination tensor from a layer at fixed indices (one block shared by all)
                st = s_name
            elif s_idx != idx[:len(s_idx)] or len(s_idx) > len(idx):
                raise ConversionError(f"the twins' tensor {name!r} comes from {s_name!r}: indices that do not "
                                      "carry over to the real model's layers (nothing was written)")
            # a whole source is the same piece whatever its width (layers of one kind may differ in it)
            pieces.append(Piece(_symbolic(st), transpose, 0 if whole else start, 0 if whole else stop, whole))
        recipe = Recipe(t, axis, tuple(pieces), view=HEADS if view is not None and _heads(view) else view,
                        offset=offset, stride=stride)
        if t in recipes and recipes[t] != recipe:
            raise ConversionError(f"the twins' layers disagree on how {t!r} is made: {recipes[t].describe()} vs "
                                  f"{recipe.describe()} (nothing was written)")
        recipes[t] = recipe
    for t, kept in candidates.items():  # indices that agree by chance in every layer: the deepest varies
        recipes[t] = max(kept, key=lambda r: r.vary)
    return recipes


def _symbolic(key: str) -> str:
    """A per-head view's count left to the real tensors: ``w|h4`` -> ``w|h``."""
    base, view = split_view(key)
    return f"{base}{VIEW}{HEADS}" if view is not None and _heads(view) is not None else key


def _per_head(name: str, d: np.ndarray, src: dict[str, np.ndarray]):
    """``d`` as a per-head cut or join (:data:`HEADS`): a (heads, a, r) tensor (or (heads, r, a))
    that is the slice [s, s + a) of every head of a source matrix (heads * (a + b), r); or a
    matrix (heads * (a + b), r) seen per head, the concatenation of (heads, a, r) sources (each
    maybe with its last two axes exchanged). (axis, pieces, view, None) as :func:`_made` returns,
    or None."""
    if d.ndim == 3:
        h = d.shape[0]
        seen = {f"{n}{VIEW}{HEADS}{h}": np.asarray(s).reshape((h, s.shape[0] // h) + s.shape[1:])
                for n, s in src.items() if np.ndim(s) == 2 and s.shape[0] % h == 0 and s.shape[0] > h}
        view = None
    elif d.ndim == 2:
        counts = sorted({np.shape(s)[0] for s in src.values() if np.ndim(s) == 3 and d.shape[0] % np.shape(s)[0] == 0})
        for h in counts:
            seen = {n: np.asarray(s) for n, s in src.items() if np.ndim(s) == 3 and s.shape[0] == h}
            try:
                axis, found = _match(name, d.reshape(h, d.shape[0] // h, d.shape[1]), seen, _Index(seen))
            except ConversionError:
                continue
            if axis == 1 and len(found) > 1 and all(f[4] for f in found):
                return axis, found, f"{HEADS}{h}", None
        return None
    else:
        return None
    if not seen:
        return None
    try:
        axis, found = _match(name, d, seen, _Index(seen))
    except ConversionError:
        return None
    return (axis, found, view, None) if axis is not None and len(found) == 1 else None


def _made(name, d, src, where, wide, candidates, t):
    """How the destination twin's tensor ``d`` is made: (axis, pieces found, view, the widened
    sources ``wide`` for the next tensor, the offset added), or None where it moves along a new
    axis (recorded in ``candidates``). ConversionError when no rearrangement of the sources makes it."""
    view = None
    try:
        axis, found = _match(name, d, src, where)
    except ConversionError as exc:
        shifted = _offset_source(d, src)
        if shifted is not None:
            s_name, offset = shifted
            return None, [(s_name, False, 0, d.shape[0], True)], None, wide, offset
        found_new = _along_new_axis(name, d, src, where)
        if found_new is not None:
            kept = [r for r in candidates.get(t, found_new) if r in found_new]
            if not kept:
                raise ConversionError(f"the twins' layers disagree on how {t!r} is made: "
                                      f"{candidates[t][0].describe()} vs {found_new[0].describe()} "
                                      "(nothing was written)") from None
            candidates[t] = kept
            return None
        per_head = _per_head(name, d, src)  # before the reshaped views: their search is far wider
        if per_head is not None:
            return per_head[:3] + (wide, 0.0)
        if wide is None:  # a tensor seen through a reshaped view of its own or of a source's
            extended = dict(src)
            for s_name, s in src.items():
                extended.update({f"{s_name}{VIEW}{k}": v for k, v in _views(np.asarray(s))})
            wide = (extended, _Index(extended))
        for k, dv in [(None, d)] + _views(d):
            try:
                axis, found = _match(name, dv, *wide)
                view = k
                break
            except ConversionError:
                continue
        else:
            raise exc from None
    flat = flat_stack_recipes(name, d, src, axis, found) if view is None \
        else grouped_stack_recipes(name, view, src, axis, found)  # experts flattened / stacked on one side
    if flat is None and view is None:
        flat = grouped_pick_recipes(name, d, src, axis, found)
    if flat is not None:
        kept = [r for r in candidates.get(t, flat) if r in flat]
        if kept:
            candidates[t] = kept
            return None
    if axis is not None and len(found) > 1 and not all(f[4] for f in found):
        raise ConversionError(f"the twins' tensor {name!r} interleaves slices of {sorted({f[0] for f in found})}: "
                              "an interleaving other than per head (nothing was written)")
    return axis, found, view, wide, 0.0


#: what a library may add to a stored vector as it loads it (a norm's scale kept as ``1 + w``)
OFFSETS = (1.0, -1.0)


def _offset_source(d: np.ndarray, src: dict[str, np.ndarray]) -> tuple[str, float] | None:
    """``d`` (a vector) as one source vector of its shape plus a constant of :data:`OFFSETS`,
    rounded to float32 as the twins' transfer wrote it: (source name, offset), or None."""
    if d.ndim != 1 or not d.size:
        return None
    for s_name, s in src.items():
        if s.shape != d.shape:
            continue
        wide = np.asarray(s, np.float64)
        for offset in OFFSETS:
            if np.array_equal((wide + offset).astype(np.float32), d):
                return s_name, offset
    return None


def _along_new_axis(name: str, d: np.ndarray, src: dict[str, np.ndarray], where: _Index) -> list[Recipe] | None:
    """The stack (sources along a new axis) or pick (one entry of a source with an axis more)
    recipes that make the destination twin's tensor ``name`` (several where its indices agree by
    chance: layer 0's expert 0), or None."""
    t, idx = template(name)
    stacked = _stacked(name, d, src, where)
    if stacked is not None:
        axis, first, transpose, vary = stacked
        st, s_idx = template(first)
        if tuple(i for k, i in enumerate(s_idx) if k != vary) == idx:
            return [Recipe(t, axis, (Piece(st, transpose, 0, 0, True),), stack=True, vary=vary)]
        return None
    picked = _picked(name, d, src, where)
    if picked is not None:
        s_name, axis, entry, transpose = picked
        st, s_idx = template(s_name)
        found = [Recipe(t, axis, (Piece(st, transpose, 0, 0, True),), pick=True, vary=vary) for vary in range(len(idx))
                 if idx[vary] == entry and tuple(i for k, i in enumerate(idx) if k != vary) == s_idx]
        return found or None
    return None


@dataclass
class Move:
    """One destination tensor of the real checkpoint: its name and shape, and its sources as
    (source name, transpose, slice start, slice stop or None for whole) along ``axis``."""

    target: str
    shape: tuple[int, ...]
    axis: int | None
    sources: list[tuple[str, bool, int, int | None]] = field(default_factory=list)
    #: the destination's view the sources make (:func:`apply_view`), None when they make it as it is
    view: str | None = None

    @property
    def made(self) -> tuple[int, ...]:
        return self.shape if self.view is None else view_shape(self.shape, self.view)
    #: the sources stacked along a new axis ``axis`` (expert stacks), each whole
    stack: bool = False
    #: the one source's entry ``sources[0][2]`` along its stored axis ``axis``, that axis dropped
    pick: bool = False
    #: added to every value (:attr:`Recipe.offset`), the sum rounded once in the destination's dtype
    offset: float = 0.0
    #: no sources: exact zeros (:attr:`Recipe.zeros`)
    zeros: bool = False
    #: interleaved along ``axis`` (:attr:`Recipe.stride`): one source's every stride-th entry from
    #: its ``start``, or the sources interleaved
    stride: int | None = None


def _shape_of(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    """``shape`` with its last two axes exchanged when ``transpose``."""
    shape = tuple(shape)
    return shape[:-2] + (shape[-1], shape[-2]) if transpose and len(shape) >= 2 else shape


def plan(recipes: dict[str, Recipe], stored_templates: set[str], twin_param_templates: set[str],
         real_src: dict[str, tuple[int, ...]], real_dst: dict[str, tuple[int, ...]],
         dropped: set[str] = frozenset()) -> list[Move]:
    """The moves for a real checkpoint: ``real_src`` (source file key -> shape), ``real_dst``
    (every parameter of the destination model built for the real config -> shape).

    A destination parameter whose template the destination twin's file did not hold but its model
    did (a tied head) is not written, as the library's saver does not write it. ConversionError
    naming what does not fit: a destination tensor no recipe makes, a missing or unused source
    tensor, a shape that disagrees. ``dropped``: templates of source tensors no destination tensor
    needs because every value is exactly zero (``_zeros.real_zero_templates``).
    """
    moves: list[Move] = []
    used: set[str] = set()
    splits: dict[tuple[str, bool, int], list[tuple[int, Move, int]]] = {}
    problems: list[str] = []
    covered: dict[str, int] = {}  # a source view's key -> the rows group picks take of it
    real_dst = dict(real_dst)
    dst_templates = {template(k)[0] for k in real_dst}
    for t, recipe in recipes.items():  # tensors the library's saver writes but its model does not hold
        if t in dst_templates or (recipe.group and not recipe.pick) or recipe.zeros or not (recipe.stack or recipe.pick or recipe.axis is None
                                      or all(p.whole for p in recipe.pieces)):
            continue
        real_dst.update(_saved_only(recipe, real_src))
    for key, shape in real_dst.items():
        t, idx = template(key)
        recipe = recipes.get(t)
        if recipe is not None and recipe.zeros:
            moves.append(Move(key, tuple(shape), None, zeros=True))
            continue
        if recipe is not None and (recipe.group or recipe.stride):
            if recipe.group:
                move = (_group_pick_move(key, tuple(shape), idx, recipe, real_src, used, covered, problems)
                        if recipe.pick else _group_move(key, tuple(shape), idx, recipe, real_src, used, problems))
            else:
                move = _strided_move(key, tuple(shape), idx, recipe, real_src, used, problems)
            if move is not None:
                moves.append(move)
            continue
        if recipe is not None and (recipe.stack or recipe.pick):
            move = _new_axis_move(key, tuple(shape), idx, recipe, real_src, used, problems)
            if move is not None:
                moves.append(move)
            continue
        if recipe is None:
            if t in twin_param_templates and t not in stored_templates:
                continue  # the library does not save it (tied to another parameter)
            problems.append(f"destination tensor {key!r}: no twin tensor of its kind (template {t!r})")
            continue
        view = recipe.view
        if view == HEADS:  # joined per head: as many heads as the real sources hold
            first = split_view(fill(recipe.pieces[0].source, idx[:recipe.pieces[0].source.count("{}")]))[0]
            view = f"{HEADS}{real_src[first][0]}" if first in real_src and real_src[first] else None
            if view is None or tuple(shape)[0] % real_src[first][0]:
                problems.append(f"destination tensor {key!r} {tuple(shape)} joins per head from {first!r}, which "
                                f"the source lacks or whose heads do not divide it")
                continue
        move = Move(key, tuple(shape), recipe.axis, view=view, offset=recipe.offset)
        shape = move.made
        want_len = 0
        for p in recipe.pieces:
            s_key = fill(p.source, idx[:p.source.count("{}")])
            base, k = split_view(s_key)
            if k == HEADS:  # cut per head: as many heads as the real destination holds
                k = f"{HEADS}{shape[0]}"
                s_key = f"{base}{VIEW}{k}"
            if base not in real_src:
                problems.append(f"destination tensor {key!r} needs source tensor {base!r}, which the source lacks")
                continue
            used.add(base)
            s_shape = _shape_of(real_src[base] if k is None else view_shape(real_src[base], k), p.transpose)
            if recipe.axis is None:
                move.sources.append((s_key, p.transpose, 0, None))
                if s_shape != tuple(shape):
                    problems.append(f"destination tensor {key!r} {tuple(shape)} from {s_key!r} "
                                    f"{'transposed ' if p.transpose else ''}{s_shape}: shapes disagree")
            elif p.whole and len(recipe.pieces) > 1:
                move.sources.append((s_key, p.transpose, 0, None))
                want_len += s_shape[recipe.axis]
            else:  # one slice of a split: its start comes from its siblings' real widths
                move.sources.append((s_key, p.transpose, -1, None))
                n = len(s_shape)  # siblings cut one stored axis, whichever of them reads it transposed
                stored = (2 * n - 3 - recipe.axis) if p.transpose and n >= 2 and recipe.axis >= n - 2 else recipe.axis
                splits.setdefault((s_key, stored), []).append((p.start, move, len(move.sources) - 1, recipe.axis))
        if recipe.axis is not None and len(recipe.pieces) > 1 and not problems:
            if want_len != shape[recipe.axis]:
                problems.append(f"destination tensor {key!r} {tuple(shape)}: its sources concatenate to "
                                f"{want_len} along axis {recipe.axis}")
        moves.append(move)
    for (s_key, axis), members in splits.items():
        base, k = split_view(s_key)
        s_shape = real_src[base] if k is None else view_shape(real_src[base], k)
        at = 0
        for _, move, i, move_axis in sorted(members, key=lambda m: m[0]):
            width = move.made[move_axis]
            name, tr, _, _ = move.sources[i]
            move.sources[i] = (name, tr, at, at + width)
            at += width
        if at != s_shape[axis]:
            problems.append(f"source tensor {s_key!r} {real_src[base]} splits into destination tensors "
                            f"{[m.target for _, m, _, _ in members]} of {at} along axis {axis}, not {s_shape[axis]}")
    for s_key, rows in covered.items():
        base, k = split_view(s_key)
        total = view_shape(real_src[base], k)[0]
        if rows != total:
            problems.append(f"source tensor {s_key!r} {real_src[base]}: its entries' runs take {rows} of its {total} rows")
    unused = sorted(k for k in set(real_src) - used if template(k)[0] not in dropped)
    if unused:
        problems.append(f"source tensors no destination tensor uses: {unused[:8]}"
                        f"{' and %d more' % (len(unused) - 8) if len(unused) > 8 else ''}")
    if problems:
        raise ConversionError("the twins' rules do not fit the real checkpoint (nothing was written):\n  - "
                              + "\n  - ".join(problems[:20]))
    return moves


def _strided_move(key: str, shape: tuple[int, ...], idx: tuple[int, ...], recipe: Recipe,
                  real_src: dict[str, tuple[int, ...]], used: set[str], problems: list[str]) -> Move | None:
    """The move of an interleaving recipe (:attr:`Recipe.stride`) for the real destination tensor ``key``."""
    n, axis = recipe.stride, recipe.axis
    move = Move(key, shape, axis, stride=n)
    for p in recipe.pieces:
        s_key = fill(p.source, idx[:p.source.count("{}")])
        if s_key not in real_src:
            problems.append(f"destination tensor {key!r} needs source tensor {s_key!r}, which the source lacks")
            return None
        seen = list(_shape_of(real_src[s_key], p.transpose))
        if len(seen) <= axis:
            seen = [-1]
        elif len(recipe.pieces) == 1:  # a cut: every n-th entry
            seen[axis] = seen[axis] // n if seen[axis] % n == 0 else -1
        else:  # a join: n pieces of one width
            seen[axis] *= n
        if tuple(seen) != tuple(shape):
            problems.append(f"destination tensor {key!r} {shape} interleaves {s_key!r} {real_src[s_key]} "
                            f"{'transposed ' if p.transpose else ''}with stride {n} along axis {axis}: shapes disagree")
            return None
        used.add(s_key)
        move.sources.append((s_key, p.transpose, p.start if len(recipe.pieces) == 1 else 0, None))
    return move


def _saved_only(recipe: Recipe, real_src: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The real destination tensors of a recipe whose target the destination model does not hold
    as a parameter (its saver writes them under other names: per-expert matrices from a fused
    stack, a router under its checkpoint name), named and shaped from the real sources."""
    p = recipe.pieces[0]
    out = {}
    for key, shape in real_src.items():
        st, s_idx = template(key)
        if st != (split_view(p.source)[0] if recipe.group else p.source):
            continue
        if recipe.group:  # entries' runs of a source seen through a view: their widths scaled from the twin
            out.update(_group_pick_saved(recipe, key, shape, s_idx))
            continue
        if not (recipe.pick or recipe.stack):  # whole sources, maybe transposed, saved under their own name
            if recipe.target.count("{}") != len(s_idx):
                continue
            shapes = [_shape_of(real_src.get(fill(q.source, s_idx), ()), q.transpose) for q in recipe.pieces]
            if recipe.axis is None or len(shapes) == 1:
                out[fill(recipe.target, s_idx)] = shapes[0]
            elif all(len(x) > recipe.axis for x in shapes):
                out[fill(recipe.target, s_idx)] = shapes[0][:recipe.axis] + (sum(x[recipe.axis] for x in shapes),) \
                    + shapes[0][recipe.axis + 1:]
            continue
        if recipe.pick:
            inner = tuple(x for k, x in enumerate(shape) if k != recipe.axis)
            inner = inner[::-1] if p.transpose else inner
            for e in range(shape[recipe.axis]):
                idx = s_idx[:recipe.vary] + (e,) + s_idx[recipe.vary:]
                out[fill(recipe.target, idx)] = inner
        else:
            idx = tuple(i for k, i in enumerate(s_idx) if k != recipe.vary)
            count = sum(1 for k2 in real_src if template(k2)[0] == st and
                        tuple(i for k, i in enumerate(template(k2)[1]) if k != recipe.vary) == idx)
            inner = tuple(shape[::-1]) if p.transpose else tuple(shape)
            out[fill(recipe.target, idx)] = inner[:recipe.axis] + (count,) + inner[recipe.axis:]
    return out


def _new_axis_move(key: str, shape: tuple[int, ...], idx: tuple[int, ...], recipe: Recipe,
                   real_src: dict[str, tuple[int, ...]], used: set[str], problems: list[str]) -> Move | None:
    """The move of a stack or pick recipe for the real destination tensor ``key``."""
    p = recipe.pieces[0]
    if recipe.stack:
        view = recipe.view
        if view == HEADS:  # stacked, then flattened: as many as the real sources hold
            view = f"{HEADS}{_count(p.source, idx, recipe.vary, real_src)}"
        made = shape if view is None else view_shape(shape, view)
        count = made[recipe.axis] if recipe.axis < len(made) else 0
        inner = made[:recipe.axis] + made[recipe.axis + 1:]
        move = Move(key, shape, recipe.axis, stack=True, view=view)
        for e in range(count):
            s_key = fill(p.source, idx[:recipe.vary] + (e,) + idx[recipe.vary:])
            if s_key not in real_src:
                problems.append(f"destination tensor {key!r} stacks {count} source tensors; the source lacks {s_key!r}")
                return None
            if _shape_of(real_src[s_key], p.transpose) != inner:
                problems.append(f"destination tensor {key!r} {shape} stacks {s_key!r} {real_src[s_key]}"
                                f"{' transposed' if p.transpose else ''}: shapes disagree")
                return None
            used.add(s_key)
            move.sources.append((s_key, p.transpose, 0, None))
        return move
    s_key = fill(p.source, tuple(i for k, i in enumerate(idx) if k != recipe.vary))
    entry = idx[recipe.vary]
    s_key, k = split_view(s_key)
    if s_key not in real_src:
        problems.append(f"destination tensor {key!r} needs source tensor {s_key!r}, which the source lacks")
        return None
    s_shape = real_src[s_key]
    if k == HEADS:  # one entry of a flattened stack: as many entries as the real tensor's rows hold
        rows = _shape_of(shape, p.transpose)[0] if shape else 0
        if not rows or s_shape[0] % rows:
            problems.append(f"destination tensor {key!r} {shape} as one entry of {s_key!r} {s_shape}: its rows "
                            f"do not divide the source's")
            return None
        used.add(s_key)
        k = f"{HEADS}{s_shape[0] // rows}"
        s_shape = view_shape(s_shape, k)
        s_key = f"{s_key}{VIEW}{k}"
    else:
        used.add(s_key)
    inner = tuple(x for k, x in enumerate(s_shape) if k != recipe.axis)
    if entry >= s_shape[recipe.axis] or _shape_of(inner, p.transpose) != shape:
        problems.append(f"destination tensor {key!r} {shape} as entry {entry} of {s_key!r} {s_shape} along axis "
                        f"{recipe.axis}: shapes disagree")
        return None
    return Move(key, shape, recipe.axis, [(s_key, p.transpose, entry, entry + 1)], pick=True)


def _count(source: str, idx: tuple[int, ...], vary: int, real_src: dict[str, tuple[int, ...]]) -> int:
    """How many real source tensors of template ``source`` there are for the destination's indices
    ``idx``, their index at position ``vary`` running 0, 1, ..."""
    n = 0
    while fill(source, idx[:vary] + (n,) + idx[vary:]) in real_src:
        n += 1
    return n


def _shared_indices(src, dst) -> int | None:
    """The number of leading indices every path of one rule has, where its paths differ in how many
    they have (None where they agree: every index generalises)."""
    srcs = [src] if isinstance(src, str) else list(src)
    to = dst.get("to") if isinstance(dst, dict) else dst[0] if isinstance(dst, tuple) else dst
    dsts = [to] if isinstance(to, str) else list(to)
    counts = {len(re.findall(r"(?<=\\\.)\d+(?=\\\.|$)", p)) for p in srcs} | \
        {len(re.findall(r"(?<=\.)\d+(?=\.|$)", p)) for p in dsts}
    # a side whose paths hold no dotted index at all (keras' "transformer_layer_0/...") numbers its
    # layers otherwise: nothing to keep
    return min(counts) if len(counts) > 1 and min(counts) > 0 else None


def generalise_layer_rules(rules: list) -> list:
    """``report.rules`` of the twins' transfer with every index generalised (``layers\\.0\\.`` ->
    ``layers\\.(\\d+)\\.`` and ``\\1`` in the target), duplicates dropped: rules for the full models."""
    out, seen = [], set()
    for src, dst in rules:
        # a move between a bank of experts and one stored parameter: the expert index (the
        # indices one side has more) stays as it is, the block's index generalises
        keep = _shared_indices(src, dst)

        def pat(p):
            n = [0]

            def sub(m):
                n[0] += 1
                return r"(\d+)" if keep is None or n[0] <= keep else m.group()
            return re.sub(r"(?<=\\\.)\d+(?=\\\.|$)", sub, p), n[0]

        def tgt(t):
            n = [0]

            def sub(m):
                n[0] += 1
                return f"\\{n[0]}" if keep is None or n[0] <= keep else m.group()
            return re.sub(r"(?<=\.)\d+(?=\.|$)", sub, t)

        if isinstance(src, (list, tuple)) and not isinstance(src, str):
            new_src = tuple(pat(s)[0] for s in src)
        else:
            new_src = pat(src)[0]
        if isinstance(dst, dict):  # {"to": ..., "heads"/"axis"/"swap": ...}
            to = dst["to"]
            new_dst = {**dst, "to": [tgt(d) for d in to] if isinstance(to, list) else tgt(to)}
        elif isinstance(dst, tuple):  # (parameter path, fn)
            new_dst = (tgt(dst[0]), dst[1])
        else:
            new_dst = [tgt(d) for d in dst] if isinstance(dst, list) else tgt(dst)
        key = repr((new_src, new_dst))
        if key not in seen:
            seen.add(key)
            out.append((new_src, new_dst))
    return out


# ----------------------------------------------------------------------------- flattened expert stacks
# One library may save every expert's matrix of one projection as ONE tensor (E * F, H) (expert
# 0's (F, H) rows, then expert 1's, ...) where the other saves one tensor per expert, (F, H) or its
# transpose. Matched by value, the per-expert tensor is a run of rows of the flattened one whose
# start moves with the expert index, which no recipe of fixed slices generalises; seen through the
# per-head view (HEADS: (E * F, H) as (E, F, H)) it is one entry along the new axis 0 (a pick), and
# the flattened tensor is the per-expert tensors stacked along a new axis 0, the view undone (a
# stack). The count E is left to the real checkpoint's tensors ("|h" without a number), so the
# twin's few experts give the recipe for any number of them.


def flat_stack_recipes(name: str, d, src: dict, axis: int | None, found: list) -> list | None:
    """The pick or stack recipes (several where the indices agree by chance: layer 0's expert 0)
    that make the destination twin's tensor ``name`` from the pieces ``found`` along ``axis``
    (:func:`_match`), when they show a flattened expert stack; None otherwise.

    Args:
        name: the destination file key; ``d``: its float32 array (2-D).
        src: the source twin's file key -> array.
        axis, found: what ``_match`` found: pieces ``(source, transpose, start, stop, whole)``
            concatenated along ``axis`` make ``d``.

    Returns:
        A list of :class:`Recipe` (``pick`` or ``stack`` with the view
        ``"h"``), or None.
    """
    if axis is None or getattr(d, "ndim", 0) != 2 or not found:
        return None
    t, idx = template(name)
    if len(found) == 1 and not found[0][4]:
        return _flat_pick(t, idx, d, src, axis, found[0])
    if len(found) >= 2 and all(f[4] for f in found) and axis == 0:
        return _flat_stack(t, idx, d, src, found)
    return None


def _flat_pick(t: str, idx: tuple, d, src: dict, axis: int, piece) -> list | None:
    """``d`` as entry e of a source (E * r, c) seen as (E, r, c), its two axes exchanged when the
    piece is transposed: the run [e * r, (e + 1) * r) of the source's rows."""
    s_name, transpose, start, stop, _ = piece
    s = src.get(s_name)  # a source seen through a view is no flattened stack (see grouped_pick_recipes)
    if s is None or s.ndim != 2:
        return None
    stored = (1 - axis) if transpose else axis
    length = stop - start
    if stored != 0 or length <= 0 or s.shape[0] % length or start % length or s.shape[0] // length < 2:
        return None
    entry = start // length
    st, s_idx = template(s_name)
    out = [Recipe(t, 0, (Piece(f"{st}{VIEW}{HEADS}", transpose, 0, 0, True),),
                         pick=True, vary=k)
           for k in range(len(idx)) if idx[k] == entry and idx[:k] + idx[k + 1:] == s_idx]
    return out or None


def _flat_stack(t: str, idx: tuple, d, src: dict, found: list) -> list | None:
    """``d`` (E * r, c) as E whole sources of one template, one per value 0 .. E-1 of one of its
    indices, each (r, c) (or (c, r) transposed), stacked along a new axis 0 and flattened."""
    names = [f[0] for f in found]
    transposes = {f[1] for f in found}
    templates = {template(n)[0] for n in names}
    if len(transposes) != 1 or len(templates) != 1 or d.shape[0] % len(found):
        return None
    shapes = {_shape_of(src[n].shape, found[0][1]) for n in names}
    if shapes != {(d.shape[0] // len(found), d.shape[1])}:
        return None
    indices = [template(n)[1] for n in names]
    varying = [k for k in range(len(indices[0])) if len({i[k] for i in indices}) > 1]
    if len(varying) != 1 or [i[varying[0]] for i in indices] != list(range(len(found))):
        return None
    vary = varying[0]
    if tuple(i for k, i in enumerate(indices[0]) if k != vary) != idx:
        return None
    st = templates.pop()
    return [Recipe(t, 0, (Piece(st, found[0][1], 0, 0, True),), view=HEADS, stack=True,
                         vary=vary)]



# ----------------------------------------------------------------------------- grouped expert stacks
# One library may keep every expert's projections of one block as ONE tensor stacked along a new
# axis, each entry the concatenation of several per-expert matrices, transposed ((E, H, 2F): expert
# e's gate and up (F, H) each, transposed and joined), where the other saves one tensor per expert
# and projection. Seen through a reshaped view ((E, H, 2F) as (E * 2F, H)) the destination is the
# concatenation of whole sources gate_0, up_0, gate_1, up_1, ...: a group of templates repeated
# once per value of one source index. The recipe keeps the group and that index's position; the
# count E is left to the real checkpoint's tensors, so the twin's few experts carry to any number.


def grouped_stack_recipes(name: str, view: str, src: dict, axis: int | None, found: list) -> list | None:
    """The group recipe (:attr:`Recipe.group`) that makes the destination twin's tensor ``name``
    seen through ``view`` from the whole pieces ``found`` concatenated along ``axis``, when they are
    one group of source templates repeated once per value 0 .. E-1 (E >= 2) of one source index
    (the others the destination's own indices); None otherwise.

    Args:
        name: the destination file key; ``view``: the view of it the pieces make (``"021-2"``).
        src: the source twin's file key -> array (unused but for symmetry with
            :func:`flat_stack_recipes`).
        axis, found: what ``_match`` found: pieces ``(source, transpose, start, stop, whole)``.

    Returns:
        ``[Recipe]`` with ``group=True``, or None.
    """
    del src
    if axis is None or _heads(view) is not None or len(found) < 2 or not all(f[4] for f in found):
        return None
    t, idx = template(name)
    for g in range(1, len(found) // 2 + 1):
        if len(found) % g:
            continue
        groups = [found[i:i + g] for i in range(0, len(found), g)]
        shape = [(template(f[0])[0], f[1]) for f in groups[0]]
        if any([(template(f[0])[0], f[1]) for f in grp] != shape for grp in groups):
            continue
        if len(set(shape)) != g:  # a template twice in one group: no one index tells its entries apart
            continue
        indices = [[template(f[0])[1] for f in grp] for grp in groups]
        n = len(indices[0][0])
        varying = [k for k in range(n) if len({i[0][k] for i in indices}) > 1]
        if len(varying) != 1:
            continue
        vary = varying[0]
        ok = all(len({i[vary] for i in grp}) == 1 and grp[0][vary] == e and
                 all(tuple(x for k, x in enumerate(i) if k != vary) == idx for i in grp)
                 for e, grp in enumerate(indices))
        if ok:
            pieces = tuple(Piece(st, tr, 0, 0, True) for st, tr in shape)
            return [Recipe(t, axis, pieces, view=view, vary=vary, group=True)]
    return None


def _group_move(key: str, shape: tuple[int, ...], idx: tuple[int, ...], recipe: Recipe,
                real_src: dict[str, tuple[int, ...]], used: set[str], problems: list[str]) -> Move | None:
    """The move of a group recipe for the real destination tensor ``key`` (``shape``): the group's
    sources for every entry the real source holds, whole, concatenated along the recipe's axis of
    the destination's view."""
    count = _count(recipe.pieces[0].source, idx, recipe.vary, real_src)
    if count == 0:
        problems.append(f"destination tensor {key!r} needs source tensor "
                        f"{fill(recipe.pieces[0].source, idx[:recipe.vary] + (0,) + idx[recipe.vary:])!r}, "
                        "which the source lacks")
        return None
    move = Move(key, shape, recipe.axis, view=recipe.view)
    made = move.made
    total = 0
    for e in range(count):
        for p in recipe.pieces:
            s_key = fill(p.source, idx[:recipe.vary] + (e,) + idx[recipe.vary:])
            if s_key not in real_src:
                problems.append(f"destination tensor {key!r} joins {count} entries; the source lacks {s_key!r}")
                return None
            s_shape = _shape_of(real_src[s_key], p.transpose)
            if len(s_shape) != len(made) or any(a != b for k, (a, b) in enumerate(zip(s_shape, made))
                                                 if k != recipe.axis):
                problems.append(f"destination tensor {key!r} {shape} seen as {made} joins {s_key!r} "
                                f"{real_src[s_key]}{' transposed' if p.transpose else ''}: shapes disagree")
                return None
            total += s_shape[recipe.axis]
            used.add(s_key)
            move.sources.append((s_key, p.transpose, 0, None))
    if total != made[recipe.axis]:
        problems.append(f"destination tensor {key!r} {shape} seen as {made}: its {count} entries join to {total} "
                        f"along axis {recipe.axis}")
        return None
    return move


def _view_entries(shape: tuple[int, ...], view: str) -> tuple[int, int] | None:
    """(entries E, entry width G) of a tensor of ``shape`` seen through the reshaped ``view``
    (``"021-2"``): E is the leading axis the view merges into its rows, G the rows each holds."""
    if _heads(view) is not None:
        return None
    perm, k = _parse_view(view)
    if k < 2 or len(shape) < 2:
        return None
    rows = view_shape(tuple(shape), view)[0]
    e = shape[perm[0]]
    return (e, rows // e) if e >= 2 and rows % e == 0 else None


def grouped_pick_recipes(name: str, d, src: dict, axis: int | None, found: list) -> list | None:
    """The reverse of :func:`grouped_stack_recipes`: the destination twin's tensor ``name`` (a
    matrix ``d``) as one run of an entry of a source seen through a reshaped view (``(E, H, 2F)``
    seen as ``(E * 2F, H)``: gate_e is rows [e * 2F, e * 2F + F)), the entry ``e`` one of the
    destination's indices. Several recipes where the indices agree by chance (layer 0's expert 0).

    Args:
        name, d: the destination file key and its float32 array.
        src: the source twin's file key -> array (without views).
        axis, found: what ``_match`` found among the viewed sources: one piece
            ``(source|view, transpose, start, stop, whole)`` along ``axis``.

    Returns:
        A list of :class:`Recipe` with ``group`` and ``pick``, or None.
    """
    if axis is None or getattr(d, "ndim", 0) != 2 or len(found) != 1 or found[0][4]:
        return None
    s_key, transpose, start, stop, _ = found[0]
    base, view = split_view(s_key)
    if view is None or base not in src or (((1 - axis) if transpose else axis) != 0):
        return None
    entries = _view_entries(tuple(np.shape(src[base])), view)
    if entries is None:
        return None
    _, width = entries
    e, off = divmod(start, width)
    if off + (stop - start) > width:
        return None
    t, idx = template(name)
    st, s_idx = template(base)
    out = [Recipe(t, axis, (Piece(f"{st}{VIEW}{view}", transpose, off, off + stop - start, False),),
                  vary=k, group=True, pick=True, width=width)
           for k in range(len(idx)) if idx[k] == e and idx[:k] + idx[k + 1:] == s_idx]
    return out or None


def _scaled(recipe: Recipe, real_width: int) -> tuple[int, int] | None:
    """The piece's run within an entry of ``real_width`` rows, scaled from the twin's entry (the
    runs of one entry keep their proportions: gate and up alike), or None where it does not divide."""
    p = recipe.pieces[0]
    lo, hi = p.start * real_width, p.stop * real_width
    if lo % recipe.width or hi % recipe.width:
        return None
    return lo // recipe.width, hi // recipe.width


def _group_pick_saved(recipe: Recipe, key: str, shape: tuple[int, ...], s_idx: tuple[int, ...]) -> dict:
    """The destination tensors a group pick recipe makes from the real source ``key`` (``shape``),
    where the destination model holds them under other names (its saver writes them per entry)."""
    _, view = split_view(recipe.pieces[0].source)
    entries = _view_entries(tuple(shape), view)
    run = _scaled(recipe, entries[1]) if entries else None
    if run is None:
        return {}
    cols = view_shape(tuple(shape), view)[1]
    inner = _shape_of((run[1] - run[0], cols), recipe.pieces[0].transpose)
    return {fill(recipe.target, s_idx[:recipe.vary] + (e,) + s_idx[recipe.vary:]): inner for e in range(entries[0])}


def _group_pick_move(key: str, shape: tuple[int, ...], idx: tuple[int, ...], recipe: Recipe,
                     real_src: dict[str, tuple[int, ...]], used: set[str], covered: dict[str, int],
                     problems: list[str]) -> Move | None:
    """The move of a group pick recipe for the real destination tensor ``key``: the run of entry
    ``idx[vary]`` of the real source seen through the recipe's view, its rows counted in
    ``covered`` (every row of the source taken once, checked by :func:`plan`)."""
    p = recipe.pieces[0]
    s_key = fill(p.source, tuple(i for k, i in enumerate(idx) if k != recipe.vary))
    base, view = split_view(s_key)
    if base not in real_src:
        problems.append(f"destination tensor {key!r} needs source tensor {base!r}, which the source lacks")
        return None
    entries = _view_entries(tuple(real_src[base]), view)
    run = _scaled(recipe, entries[1]) if entries else None
    e = idx[recipe.vary]
    seen = view_shape(tuple(real_src[base]), view)
    if run is None or e >= entries[0] or _shape_of((run[1] - run[0], seen[1]), p.transpose) != tuple(shape):
        problems.append(f"destination tensor {key!r} {shape} as entry {e} of {s_key!r} {real_src[base]} "
                        f"seen as {seen}: shapes disagree")
        return None
    used.add(base)
    covered[s_key] = covered.get(s_key, 0) + run[1] - run[0]
    start = e * entries[1] + run[0]
    return Move(key, shape, recipe.axis, [(s_key, p.transpose, start, start + run[1] - run[0])])
