"""Expert banks: one linear layer per expert on one side, one stored parameter holding them all on the other.

A mixture-of-experts block may keep its experts as a *bank*: a list of modules numbered
``0 .. E-1`` under one path, each holding the same linear layers (mlx-lm's DBRX:
``ffn.experts.<e>.w1``/``v1``/``w2``), called only for the tokens routed to them, so that one
forward pass calls some of them and never others. The other library may keep every expert's
matrix of one projection in ONE stored parameter of the same block:

- flattened along its first axis, ``(E * rows, cols)`` (transformers' DBRX ``experts.mlp.w1``),
  the experts' matrices one after another, each as the bank stores it or with its two axes
  exchanged (``w2``: ``(E * F, H)`` against per-expert ``(H, F)``);
- stacked along a new first axis, ``(E, rows, cols)`` or ``(E, cols, rows)`` (mlx-lm's
  ``SwitchLinear``): the move stacks/unstacks along that new axis
  (:class:`~dense_bridge.models._plan.AxisMove` ``stack``).

Execution order cannot pair those (the bank's calls follow the routing, the stored parameter is
no layer of its own), so the bank is taken out of the linear layers before they pair and paired
here by shape within its block; several projections of one shape (``w1`` and ``v1``) by their
names, else in the order they run. The moves are :class:`~dense_bridge.models._plan.AxisMove`\\ s,
verified by the transfer like every inferred pair.
"""
from __future__ import annotations

import dataclasses
import re

from . import _plan as _mapping

__all__ = ["pair_banks"]

_NUMBER = re.compile(r"(?:^|(?<=[./]))(\d+)(?=[./]|$)")
_BLOCK = re.compile(r"^(.*(?:[./]|_)\d+)[./]")


def _bank_key(path: str) -> tuple[str, int, str] | None:
    """(prefix, expert index, rest) around the path's last numbered component, when the prefix is
    itself inside a numbered block (``transformer.blocks.0.ffn.experts`` + ``3`` + ``.w1``): the
    layers of one model's blocks (``model.layers.<i>.q_proj``) are no bank."""
    found = list(_NUMBER.finditer(path))
    if len(found) < 2:
        return None
    last = found[-1]
    return path[:last.start()], int(last.group(1)), path[last.end():]


def _block(prefix: str) -> str:
    m = _BLOCK.match(prefix)
    return m.group(1) if m else ""


def _words(path: str) -> set[str]:
    return {w for part in re.split(r"[./]", path)[-2:] for w in part.lower().split("_") if w}


@dataclasses.dataclass
class _Bank:
    prefix: str
    rest: str
    members: list  # _Layer, by expert index
    name: str  # the one parameter name each member holds

    @property
    def shape(self) -> tuple[int, ...]:
        e = self.members[0].entry
        return tuple(e.shapes[self.name])

    def params(self) -> tuple[str, ...]:
        return tuple(x.entry.param_path(self.name) for x in self.members)


def _banks(layers: list) -> list[_Bank]:
    """The banks among ``layers`` (linear layers, called or not): every index 0 .. E-1 (E >= 2)
    present under one prefix and rest, each member with one 2-D parameter of one name and shape."""
    groups: dict[tuple[str, str], dict[int, object]] = {}
    for x in layers:
        key = _bank_key(x.path)
        if key is not None:
            groups.setdefault((key[0], key[2]), {})[key[1]] = x
    out = []
    for (prefix, rest), members in groups.items():
        n = len(members)
        if n < 2 or sorted(members) != list(range(n)):
            continue
        ordered = [members[i] for i in range(n)]
        names = {x.entry.names for x in ordered}
        if len(names) != 1 or len(next(iter(names))) != 1:
            continue
        name = ordered[0].entry.names[0]
        shapes = {tuple(x.entry.shapes[name]) for x in ordered}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            continue
        out.append(_Bank(prefix, rest, ordered, name))
    out.sort(key=lambda bank: min(x.order for x in bank.members))
    return out


def _fit(bank: _Bank, shape: tuple[int, ...]) -> tuple[bool, bool] | None:
    """(stacked along a new axis, swap) when a parameter of ``shape`` holds the bank's E matrices
    (r, c): flattened (E * r, c) or (E * c, r), or stacked (E, r, c) or (E, c, r); else None."""
    e, (r, c) = len(bank.members), bank.shape
    for swap, (rows, cols) in ((False, (r, c)), (True, (c, r))):
        if r == c and swap:
            break
        if tuple(shape) == (e * rows, cols):
            return False, swap
        if tuple(shape) == (e, rows, cols):
            return True, swap
    return None


def _name(path: str) -> str:
    """A parameter's own name, or its layer's where the parameter is the layer's matrix
    (``experts.gate_proj.weight``: ``gate_proj``)."""
    parts = re.split(r"[./]", path)
    return parts[-2] if len(parts) > 1 and parts[-1] in ("weight", "kernel") else parts[-1]


def _choose(bank: _Bank, fits: list[tuple[str, tuple[bool, bool]]]) -> tuple[str, tuple[bool, bool]] | None:
    """The parameter that holds the bank among those whose shapes fit: the one named as the
    bank's projection (``w1`` for ``experts.<e>.w1``), else the one sharing the most words with
    it, else the first in execution order."""
    if not fits:
        return None
    own = re.split(r"[./]", bank.rest.strip("./"))[-1] if bank.rest.strip("./") else ""
    named = [f for f in fits if own and _name(f[0]) == own]
    if len(named) == 1:
        return named[0]
    words = _words(bank.prefix + bank.rest)
    scored = sorted(fits, key=lambda f: -len(words & _words(f[0])))
    return scored[0]


def pair_banks(run_a, run_b, a, b, plan: _mapping.Plan) -> None:
    """Pair every expert bank of one run with the stored parameter of the other that holds it.

    Args:
        run_a, run_b: the two models' recorded runs (``_infer._Run``): linear layers called
            (``layers["linear"]``) or never called (``unseen``); the other side's raw and stack
            layers, called or not, hold the candidate parameters.
        a, b: the two sides (``_walk.Side``), unused but for symmetry with the other pairings.
        plan: the plan the moves go into (:class:`~dense_bridge.models._plan.AxisMove`, joined or
            split along axis 0 or 1 of the flattened parameter, or stacked along a new axis 0).

    Returns:
        None. The paired bank members leave their run's linear, unseen and uncalled lists; the
        parameters they pair with leave the other run's layers (a layer whose other parameters
        stay keeps only those).
    """
    del a, b
    for mine, theirs in ((run_a, run_b), (run_b, run_a)):
        linear = list(mine.layers.get("linear", [])) + [x for x in mine.unseen if x.kind == "linear"]
        banks = _banks(linear)
        if not banks:
            continue
        holders = [(kind, x) for kind in ("raw", "stack") for x in theirs.layers.get(kind, [])] + \
            [(x.kind, x) for x in theirs.unseen if x.kind in ("raw", "stack")]
        taken: dict[int, set[str]] = {}
        for bank in banks:
            block = _block(bank.prefix)
            fits = []
            for _, holder in holders:
                for n in holder.entry.names:
                    p = holder.entry.param_path(n)
                    if p in taken.get(id(holder), ()) or _block(holder.path + ".") != block:
                        continue
                    fit = _fit(bank, tuple(holder.entry.shapes[n]))
                    if fit is not None:
                        fits.append((p, fit, holder))
            chosen = _choose(bank, [(p, fit) for p, fit, _ in fits])
            if chosen is None:
                continue
            p, (stacked, swap) = chosen
            holder = next(h for q, _, h in fits if q == p)
            taken.setdefault(id(holder), set()).add(p)
            members = bank.params()
            if mine is run_a:  # the bank's matrices joined into the one parameter
                move = _mapping.AxisMove(members, (p,), 0, swap, rule="auto", stack=stacked)
            else:  # the one parameter cut into the bank's matrices (exchanged first when swap)
                axis = 0 if stacked or not swap else 1
                move = _mapping.AxisMove((p,), members, axis, swap, rule="auto", stack=stacked)
            plan.axis_moves.append(move)
            _remove(mine, bank.members)
        _drop_taken(theirs, taken)


def _remove(run, members: list) -> None:
    gone = {id(x) for x in members}
    paths = {x.path for x in members}
    run.layers["linear"] = [x for x in run.layers.get("linear", []) if id(x) not in gone]
    run.unseen = [x for x in run.unseen if id(x) not in gone]
    run.uncalled = [p for p in run.uncalled if p not in paths]


def _drop_taken(run, taken: dict[int, set[str]]) -> None:
    """The holders' paired parameters out of the run: a holder left with none leaves it, one left
    with some keeps only those (a copy of its entry naming them)."""
    if not taken:
        return

    def keep(x):
        used = taken.get(id(x))
        if not used:
            return x
        names = tuple(n for n in x.entry.names if x.entry.param_path(n) not in used)
        if not names:
            return None
        return dataclasses.replace(x, entry=dataclasses.replace(x.entry, names=names))

    for kind in ("raw", "stack"):
        if kind in run.layers:
            run.layers[kind] = [y for y in (keep(x) for x in run.layers[kind]) if y is not None]
    dropped = {x.path for x in run.unseen if id(x) in taken and keep(x) is None}
    run.unseen = [y for y in (keep(x) for x in run.unseen) if y is not None]
    run.uncalled = [p for p in run.uncalled if p not in dropped]
