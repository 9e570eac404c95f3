"""Every form of ``mapping=`` parsed into one plan: which layers and parameters of a source model
go where in a destination model.

The forms (``db.transfer`` and ``db.testing.compare_models`` take all of them):

- a dict ``{src: dst}`` of layer or parameter paths, where
  - a value that is a list of destination paths **splits** the source linear layer along its
    output axis (units) into those layers, in order, each taking as many units as it has;
  - a key that is a tuple of source paths **concatenates** those linear layers along units
    into the one destination layer;
  - a value ``(destination_parameter_path, fn)`` on a parameter path **transforms** the source's
    array: ``fn`` takes the canonical numpy array and returns the destination's;
  - a value ``{"to": <path or list of paths>, "axis": k or None, "swap": bool, "offset": c}`` on
    parameter paths moves stored arrays as they are stored: joined and split along ``axis``
    (expert stacks; with ``"stack": True`` stacked or unstacked along a NEW axis ``axis``: one
    matrix per expert against one (experts, ...) array), their last two axes exchanged first when ``swap``, ``c`` added to every
    value after (a norm scale stored as ``w`` on one side and ``1 + w`` on the other: ``offset``
    1.0 or -1.0; the sum rounds in the destination's dtype, which the report states); with
    ``"stride": n`` the n pieces interleave along ``axis`` instead of lying one after another:
    piece k holds entries k, k + n, k + 2n, ... of the joined array (GPT-OSS keeps its experts'
    gate and up projections interleaved in one ``gate_up_proj``), so every piece has the same width;
  - a value ``{"to": <path or list of paths>, "heads": n}`` declares a fused layer whose units
    interleave per head (GPT-NeoX ``query_key_value``: q, k, v for head 0, then head 1, ...):
    the fused units are n blocks, each holding 1/n of every piece, in order;
- a list of ``(regex, replacement)`` rules: each source layer path (then each parameter path of
  layers no rule took) goes through the first rule that ``re.fullmatch``-es it; the replacement
  takes the same forms as a dict value (a string, a list: a split per match, ``(str, fn)``, a
  heads dict), and a pattern that is a tuple of regexes concatenates: every pattern matches its
  own source paths, and those that expand to the same destination are concatenated in the
  patterns' order;
- a callable ``src path -> dst path, list of paths, or None``;
- ``None``: linear layers paired by order (``models.py``).

The plan (:class:`Plan`) is what any of these, or an inferred mapping, comes down to: layer
moves (:class:`LayerMove`: one or more source layers into one or more destination layers, with
an optional head count), parameter moves (:class:`ParamMove`, with an optional ``fn``), the
ties that a source head follows (it moves with its embedding), the problems found, and the
rules that matched nothing. :meth:`Plan.rules` writes the complete mapping back as rules that
``mapping=`` takes again (JSON-able when it holds no functions).

Splitting and joining arrays along units (:func:`split_arrays`, :func:`join_arrays`) works on
canonical parameters: kernel (in_features, units), bias (units,), mask (in_features, units),
and adapter factors (``lora_b`` (rank, units) along units, ``lora_a`` (in_features, rank)
shared by every piece).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ._patterns import bounded_pattern
from .._errors import SpecError, received

__all__ = ["Target", "Rule", "LayerMove", "ParamMove", "AxisMove", "Plan", "parse", "build_plan", "finish", "in_source_order",
           "record_ties", "split_arrays",
           "join_arrays", "check_widths", "interleaved", "narrowing", "UNIT_AXIS", "INTERLEAVED_NAMES"]

#: Canonical parameter name -> its axis along units (None: shared by every piece of a split).
UNIT_AXIS: dict[str, int | None] = {"kernel": -1, "bias": -1, "mask": -1, "lora_b": -1, "lora_magnitude": -1,
                                     "lora_a": None, "lora_scale": None}

#: Last path components of fused projections whose units interleave per head (GPT-NeoX, Bloom and
#: Falcon call theirs ``query_key_value``: q, k, v of head 0, then of head 1, ...). A plain split
#: or concatenation of such a layer would scramble the heads; it must be declared with ``heads``.
INTERLEAVED_NAMES = ("query_key_value",)


@dataclass(frozen=True)
class Target:
    """Where one source path goes: one path (``split`` False), or several (a split, in order);
    ``fn`` transforms a parameter's array; ``heads``: the per-head interleaving of the fused side."""

    paths: tuple[str, ...]
    split: bool = False
    fn: Callable | None = None
    heads: int | None = None
    #: a parameter-level move along an axis of the stored arrays (expert stacks): the axis the
    #: pieces split or join along, and ``swap`` (the last two axes exchanged first)
    axis: int | None = None
    swap: bool | tuple[bool, ...] = False  # a tuple: one per part of a move per head
    offset: float = 0.0  # added to every value moved along an axis, after the move
    #: the pieces stack along a NEW axis ``axis`` (one per expert), or one array unstacks along it
    stack: bool = False
    #: the pieces interleave along ``axis`` (piece k: entries k, k + n, ...), n = the number of pieces
    stride: int | None = None

    @property
    def along_axis(self) -> bool:
        return self.axis is not None or bool(self.swap) or bool(self.offset) or self.stack


@dataclass
class Rule:
    """One entry of the mapping as given: exact source paths (dict), regexes (rules) or a callable."""

    kind: str  # "exact", "regex", "callable"
    src: tuple[Any, ...]  # paths (exact) or compiled patterns (regex); () for a callable
    target: Target | None  # None for a callable (asked per path)
    text: str  # how the rule reads in messages
    fn: Callable | None = None  # the callable itself
    hits: int = 0

    @property
    def concat(self) -> bool:
        return len(self.src) > 1


def _target(value: Any, where: str, mapping: Any) -> Target:
    """A dict value / rule replacement / callable result -> Target (TypeError naming it)."""
    if isinstance(value, str):
        return Target((value,))
    if isinstance(value, dict) and "heads" in value and "axis" in value:
        return _per_head_target(value, where, mapping)
    if isinstance(value, dict) and "heads" not in value and ("axis" in value or "swap" in value or "offset" in value):
        if set(value) - {"to", "axis", "swap", "offset", "stack", "stride"}:
            raise TypeError(f"{where}: a parameter move along an axis is {{'to': path or [paths], 'axis': k, "
                            f"'swap': bool, 'offset': number, 'stack': bool, 'stride': n}}; got {value!r}. "
                            f"{received('mapping', mapping)}")
        stride = value.get("stride")
        if stride is not None and (not isinstance(stride, int) or isinstance(stride, bool) or stride < 2
                                   or value.get("axis") is None):
            raise TypeError(f"{where}: 'stride' must be an integer of at least 2 (the number of interleaved pieces) "
                            f"with an 'axis' to interleave along; got stride={stride!r}, axis={value.get('axis')!r}. "
                            f"{received('mapping', mapping)}")
        axis, swap, offset = value.get("axis"), value.get("swap", False), value.get("offset", 0.0)
        stack = value.get("stack", False)
        if not isinstance(stack, bool) or (stack and axis is None):
            raise TypeError(f"{where}: 'stack' must be a bool, and a stack needs the new axis 'axis'; got "
                            f"stack={stack!r}, axis={axis!r}. {received('mapping', mapping)}")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
            raise TypeError(f"{where}: 'offset' must be a finite number; got {offset!r}. "
                            f"{received('mapping', mapping)}")
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool) or axis < 0):
            raise TypeError(f"{where}: 'axis' must be a non-negative integer or None; got {axis!r}. "
                            f"{received('mapping', mapping)}")
        if not isinstance(swap, bool):
            raise TypeError(f"{where}: 'swap' must be a bool; got {swap!r}. {received('mapping', mapping)}")
        inner = _target(value.get("to"), where, mapping)
        if inner.fn is not None:
            raise TypeError(f"{where}: 'to' must be a path or a list of paths. {received('mapping', mapping)}")
        return Target(inner.paths, inner.split, None, None, axis, swap, float(offset), stack, stride)
    if isinstance(value, dict):
        if set(value) - {"to", "heads"} or "to" not in value:
            raise TypeError(f"{where}: a dict value must be {{'to': path or [paths], 'heads': n}}; got {value!r}. "
                            f"{received('mapping', mapping)}")
        heads = value.get("heads")
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise TypeError(f"{where}: 'heads' must be a positive integer; got {heads!r}. "
                            f"{received('mapping', mapping)}")
        inner = _target(value["to"], where, mapping)
        if inner.fn is not None:
            raise TypeError(f"{where}: 'to' must be a path or a list of paths. {received('mapping', mapping)}")
        return Target(inner.paths, inner.split, None, heads)
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str) and callable(value[1]):
        return Target((value[0],), False, value[1])
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
        if isinstance(value, tuple) and len(value) == 1:
            return Target((value[0],))
        return Target(tuple(value), True)
    raise TypeError(f"{where}: a destination must be a path, a list of paths (a split), "
                    f"(parameter_path, fn) (a transform) or {{'to': ..., 'heads': n}}; got {value!r}. "
                    f"{received('mapping', mapping)}")


def _per_head_target(value: dict, where: str, mapping: Any) -> Target:
    """``{"to", "heads": h, "axis": k, "swap": [bool per part]}``: a parameter move per head (see
    :class:`AxisMove`)."""
    shape_of_rule = ("{'to': path or [paths], 'heads': n, 'axis': k, 'swap': [bool per part]}")
    if set(value) - {"to", "axis", "swap", "heads"}:
        raise TypeError(f"{where}: a parameter move per head is {shape_of_rule}; got {value!r}. "
                        f"{received('mapping', mapping)}")
    heads, axis, swap = value.get("heads"), value.get("axis"), value.get("swap", False)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise TypeError(f"{where}: 'heads' must be a positive integer; got {heads!r}. {received('mapping', mapping)}")
    if not isinstance(axis, int) or isinstance(axis, bool) or axis < 1:
        raise TypeError(f"{where}: 'axis' of a move per head must be a positive integer; got {axis!r}. "
                        f"{received('mapping', mapping)}")
    if isinstance(swap, list):
        swap = tuple(swap)
    if not (isinstance(swap, bool) or (isinstance(swap, tuple) and all(isinstance(x, bool) for x in swap))):
        raise TypeError(f"{where}: 'swap' must be a bool or a list of bools; got {swap!r}. "
                        f"{received('mapping', mapping)}")
    inner = _target(value.get("to"), where, mapping)
    if inner.fn is not None:
        raise TypeError(f"{where}: 'to' must be a path or a list of paths. {received('mapping', mapping)}")
    return Target(inner.paths, inner.split, None, heads, axis, swap)


def _compile(pattern: str, mapping: Any):
    def refuse(message: str) -> SpecError:
        return SpecError(f"{message}. {received('mapping', mapping)}"[:1200])

    return bounded_pattern(pattern, f"mapping rule {pattern!r}", refuse)


def _check_replacement(rx: re.Pattern, replacement: str, mapping: Any) -> None:
    """SpecError before any work when ``replacement`` cannot expand a match of ``rx`` (a group
    it does not have: ``\\9``, ``\\g<name>``; a bad escape). Checked on a pattern with the same
    groups that matches the empty string (``rx|``)."""
    try:
        probe = re.compile(f"(?:{rx.pattern})|", rx.flags & ~re.UNICODE).match("")
    except re.error:  # inline flags that must lead the pattern: left to the expansion itself
        return
    try:
        probe.expand(replacement)
    except (re.error, IndexError) as exc:
        raise SpecError(f"mapping replacement {replacement!r} does not fit the rule {rx.pattern!r} ({exc}). "
                        f"{received('mapping', mapping)}") from None


def parse(mapping: Any) -> list[Rule] | None:
    """Check ``mapping`` and turn every form into rules; None stays None (pairing by order)."""
    if mapping is None:
        return None
    if callable(mapping) and not isinstance(mapping, (dict, list, tuple)):
        return [Rule("callable", (), None, getattr(mapping, "__name__", "mapping"), mapping)]
    if isinstance(mapping, dict):
        rules = []
        for key, value in mapping.items():
            keys = (key,) if isinstance(key, str) else tuple(key) if isinstance(key, tuple) else None
            if not keys or not all(isinstance(k, str) for k in keys):
                raise TypeError(f"mapping keys must be paths (str) or tuples of paths (a concatenation); got "
                                f"{key!r}. {received('mapping', mapping)}")
            target = _target(value, f"mapping[{key!r}]", mapping)
            if len(keys) > 1 and (target.split or target.fn is not None):
                raise TypeError(f"mapping[{key!r}]: a concatenation goes into one destination layer; got {value!r}. "
                                f"{received('mapping', mapping)}")
            rules.append(Rule("exact", keys, target, repr(key)))
        return rules
    if isinstance(mapping, (list, tuple)):
        rules = []
        for rule in mapping:
            if not (isinstance(rule, (list, tuple)) and len(rule) == 2):
                raise TypeError(f"mapping rules must be (regex, replacement) pairs; got {rule!r}. "
                                f"{received('mapping', mapping)}")
            pattern, repl = rule
            patterns = (pattern,) if isinstance(pattern, str) else tuple(pattern) \
                if isinstance(pattern, (list, tuple)) else ()
            if not patterns or not all(isinstance(p, str) for p in patterns):
                raise TypeError(f"a mapping rule's pattern must be a regex (str) or a tuple of regexes (a "
                                f"concatenation); got {pattern!r}. {received('mapping', mapping)}")
            target = _target(repl, f"mapping rule {pattern!r}", mapping)
            if len(patterns) > 1 and (target.split or target.fn is not None):
                raise TypeError(f"mapping rule {pattern!r}: a concatenation goes into one destination layer; got "
                                f"{repl!r}. {received('mapping', mapping)}")
            text = pattern if isinstance(pattern, str) else repr(tuple(pattern))
            compiled = tuple(_compile(p, mapping) for p in patterns)
            for rx in compiled:
                for path in target.paths:
                    _check_replacement(rx, path, mapping)
            rules.append(Rule("regex", compiled, target, text))
        return rules
    raise TypeError("mapping must be None, a dict of paths, a list of (regex, replacement) rules or a callable. "
                    f"{received('mapping', mapping)}")


# ----------------------------------------------------------------------------- the plan
@dataclass
class LayerMove:
    """Source layers (entries, several: concatenated along units) into destination layers
    (several: split along units, in order); ``heads``: the fused side interleaves per head."""

    src: tuple[Any, ...]
    dst: tuple[Any, ...]
    heads: int | None = None
    rule: str = ""

    @property
    def linear(self) -> bool:
        return all(e.kind in ("linear", "quantized") for e in self.src + self.dst)  # quantized: quant.py


@dataclass
class ParamMove:
    """One parameter path into another, through ``fn`` when given (canonical numpy in and out)."""

    src: str
    dst: str
    fn: Callable | None = None
    rule: str = ""


@dataclass
class AxisMove:
    """Stored parameters moved along an axis (expert stacks: one 3-D tensor holding every
    expert's matrix, fused or not): each source array (its last two axes exchanged first when
    ``swap``) joined along ``axis`` in order, then split along ``axis`` into the destination
    parameters, each taking as many as it holds. ``axis`` None: one source into one destination."""

    src: tuple[str, ...]
    dst: tuple[str, ...]
    axis: int | None = None
    #: a bool for every part alike, or (``heads``) one bool per part of the side with several
    swap: bool | tuple[bool, ...] = False
    rule: str = ""
    #: per head: the side with ONE parameter (a matrix (heads * (a + b + ...), r)) is seen as
    #: (heads, a + b + ..., r) and cut along ``axis`` (1) into the other side's parts, each (heads,
    #: a, r) or, where its ``swap`` says so, (heads, r, a); or those parts joined into it
    heads: int | None = None
    #: added to every value after the move (a norm's scale stored as ``w`` on one side and as
    #: ``1 + w`` on the other), the sum rounded in the destination's dtype
    offset: float = 0.0
    #: along a NEW axis ``axis``: the source arrays stacked into the one destination (a bank of
    #: per-expert matrices into an (experts, rows, cols) stack), or the one source unstacked into
    #: the destinations, one entry each
    stack: bool = False
    #: the pieces interleave along ``axis``: piece k holds entries k, k + n, ... (n = ``stride``,
    #: the number of pieces); None: they lie one after another
    stride: int | None = None

    def replacement(self, st: Callable[[str], str] = lambda p: p) -> dict:
        to: Any = [st(d) for d in self.dst] if len(self.dst) > 1 else st(self.dst[0])
        out: dict = {"to": to, "axis": self.axis}
        if self.heads is not None:
            out["heads"] = self.heads
            out["swap"] = list(self.swap) if isinstance(self.swap, tuple) else self.swap
        elif self.swap:
            out["swap"] = True
        if self.offset:
            out["offset"] = self.offset
        if self.stack:
            out["stack"] = True
        if self.stride:
            out["stride"] = self.stride
        return out


@dataclass
class Plan:
    """What a mapping comes down to: layer moves, parameter moves, the ties source heads follow,
    every problem found (collected, not raised) and the rules that matched nothing."""

    layers: list[LayerMove] = field(default_factory=list)
    params: list[ParamMove] = field(default_factory=list)
    #: parameter moves along an axis (expert stacks split, joined or transposed)
    axis_moves: list[AxisMove] = field(default_factory=list)
    #: source parameter path -> the parameter it is tied to (a head that moves with its embedding)
    ties: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    idle: list[str] = field(default_factory=list)  # rules that matched nothing

    def rules(self, stable: dict[str, str] | None = None) -> list:
        """The complete mapping as ``(regex, replacement)`` rules of exact (escaped) paths, in the
        forms :func:`parse` reads back; JSON-able when no transform holds a function. ``stable``:
        path -> the form that carries across instances (Keras' automatic names renumbered)."""
        stable = stable or {}

        def st(path: str) -> str:
            return stable.get(path, path)

        out: list = []
        for m in self.layers:
            dst = [st(d.path) for d in m.dst]
            repl: Any = dst if len(dst) > 1 else dst[0]
            if m.heads is not None:
                repl = {"to": repl, "heads": m.heads}
            src = [_escape(st(s.path)) for s in m.src]
            out.append((src if len(src) > 1 else src[0], repl))
        for p in self.params:
            out.append((_escape(st(p.src)), st(p.dst) if p.fn is None else (st(p.dst), p.fn)))
        for am in self.axis_moves:
            src = [_escape(st(x)) for x in am.src]
            out.append((src if len(src) > 1 else src[0], am.replacement(st)))
        return out


#: ``re.escape`` of a path, remembered: a report's rules escape every moved path, the same paths
#: at every transfer of one model (bounded: paths of a few models)
_escape = functools.lru_cache(maxsize=1 << 14)(re.escape)


def _expand(target: Target, match: re.Match | None) -> Target:
    if match is None:
        return target
    try:
        paths = tuple(match.expand(p) for p in target.paths)
    except (re.error, IndexError) as exc:
        raise SpecError(f"mapping replacement {target.paths!r} does not fit the rule {match.re.pattern!r} "
                        f"({exc})") from None
    return Target(paths, target.split, target.fn, target.heads, target.axis, target.swap, target.offset, target.stack, target.stride)


def _ask(rule: Rule, path: str) -> Target | None:
    out = rule.fn(path)
    if out is None:
        return None
    return _target(out, f"mapping (a callable) returned {out!r} for {path!r}", rule.fn)


def build_plan(src, dst, rules: list[Rule]) -> Plan:
    """Resolve ``rules`` against two models' walks (``models._Side``: ``layer(path)``,
    ``param(path)``, ``entries``, ``params``, ``tied_to``, ``stable``, ``unknown``); every problem
    is collected, nothing raised."""
    plan = Plan()
    if rules and rules[0].kind == "exact":
        _exact(src, dst, rules, plan)
    else:
        _by_rules(src, dst, rules, plan)
    finish(src, dst, plan)
    plan.idle = [r.text for r in rules if r.kind != "callable" and not r.hits]
    return plan


def finish(src, dst, plan: Plan) -> None:
    """What every resolved plan goes through, however its moves were found (rules, inference):
    head pairs a kept tie makes redundant dropped, the ties source heads follow recorded, and a
    destination layer written by two moves made a problem."""
    _ties(src, dst, plan)
    _one_source_each(plan)


def in_source_order(src, plan: Plan) -> None:
    """Order ``plan``'s moves as regex rules resolve them, so an inferred plan reports and writes
    like its rules: layer moves by their first source layer's position in ``src``'s walk
    (concatenations after the others), parameter moves by source parameter position."""
    layer_at = {e.path: i for i, e in enumerate(src.entries)}
    param_at = {p: i for i, p in enumerate(src.params)}
    plan.layers.sort(key=lambda m: (len(m.src) > 1, min(layer_at[e.path] for e in m.src)))
    plan.params.sort(key=lambda p: param_at[p.src])


def rule_label(text: str) -> str:
    """A rule's text as an error quotes it: a dict key's text is its repr already, a pattern is quoted."""
    return text if text[:1] in ("'", '"') else repr(text)


def _one_source_each(plan: Plan) -> None:
    """A destination layer that several moves write is a problem (a concatenation is one move)."""
    seen: dict[str, str] = {}
    rules: dict[str, str] = {}
    for m in plan.layers:
        label = "+".join(e.path for e in m.src)
        for d in m.dst:
            if d.path in seen and seen[d.path] != label:
                by = sorted({r for r in (rules[d.path], m.rule) if r and r not in ("auto", "by order")})
                plan.problems.append(
                    f"dst layer {d.path!r} gets both {seen[d.path]!r} and {label!r}"
                    + (f" (mapping rules {', '.join(rule_label(r) for r in by)})" if by else "") + ": to concatenate src layers into "
                    f"it, give their paths as one tuple key (dict) or a tuple of patterns (rules)")
            seen.setdefault(d.path, label)
            rules.setdefault(d.path, m.rule)


def _exact(src, dst, rules: list[Rule], plan: Plan) -> None:
    for rule in rules:
        keys, target = rule.src, rule.target
        rule.hits = 1
        where = f"mapping[{keys[0] if len(keys) == 1 else keys!r}]"
        if len(keys) == 1 and src.param(keys[0]) is not None and src.layer(keys[0]) is None:
            _param(src, dst, src.param(keys[0]), target, where, plan, rule.text)
            continue
        if len(keys) > 1 and target.along_axis and all(src.param(k) is not None and src.layer(k) is None for k in keys):
            _axis_move(src, dst, tuple(src.param(k) for k in keys), target, where, plan, rule.text)
            continue
        missing = [k for k in keys if src.layer(k) is None]
        if missing:
            plan.problems.append(f"mapping key {src.unknown(missing[0], 'layer or parameter')}")
            continue
        _layers(src, dst, tuple(src.layer(k) for k in keys), target, where, plan, rule.text)


def _axis_move(src, dst, paths: tuple[str, ...], target: Target, where: str, plan: Plan, text: str) -> None:
    unknown = [p for p in target.paths if dst.param(p) is None]
    if unknown:
        plan.problems.append(f"{where}: {dst.unknown(unknown[0], 'parameter')}")
        return
    plan.axis_moves.append(AxisMove(tuple(paths), tuple(dst.param(p) for p in target.paths), target.axis,
                                    target.swap, text, target.heads, target.offset, target.stack, target.stride))


def _param(src, dst, path: str, target: Target, where: str, plan: Plan, text: str) -> None:
    if target.along_axis:
        _axis_move(src, dst, (path,), target, where, plan, text)
    elif target.split or target.heads is not None:
        plan.problems.append(f"{where}: {path!r} is a parameter; splits and heads apply to linear layers")
    elif dst.param(target.paths[0]) is not None:
        plan.params.append(ParamMove(path, dst.param(target.paths[0]), target.fn, text))
    else:
        plan.problems.append(f"{where}: {dst.unknown(target.paths[0], 'parameter')}")


def _layers(src, dst, entries: tuple, target: Target, where: str, plan: Plan, text: str) -> None:
    if target.fn is not None:
        e = entries[0]
        example = f" (map its parameter, e.g. {e.param_path(e.names[0])!r})" if e.names else ""
        plan.problems.append(f"{where}: a transform (path, fn) applies to a parameter path, and {e.path!r} is a "
                             f"layer{example}")
        return
    unknown = [p for p in target.paths if dst.layer(p) is None]
    if unknown:
        if len(entries) == 1 and not target.split and _follows_tie(src, entries[0]):
            return  # a tied head whose counterpart is no module of dst (mlx-lm's as_linear): a tie
        if len(entries) == 1 and not target.split and len(entries[0].names) == 1 and \
                dst.param(target.paths[0]) is not None:
            e = entries[0]  # a one-parameter layer into a parameter
            plan.params.append(ParamMove(e.param_path(e.names[0]), dst.param(target.paths[0]), None, text))
            return
        plan.problems.append(f"{where}: {dst.unknown(unknown[0], 'layer')}")
        return
    plan.layers.append(LayerMove(entries, tuple(dst.layer(p) for p in target.paths), target.heads, text))


def _follows_tie(side, entry) -> bool:
    """A layer all of whose parameters are another's (GPT-2/Qwen2 ``lm_head`` is the embedding)."""
    return bool(entry.names) and all(entry.param_path(n) in side.tied_to for n in entry.names)


def _by_rules(src, dst, rules: list[Rule], plan: Plan) -> None:
    taken: set[str] = set()
    concat: dict[tuple[int, str], dict[int, Any]] = {}  # (rule, dst path) -> pattern index -> entry
    for e in src.entries:
        for r, rule in enumerate(rules):
            if rule.kind == "callable":
                target = _ask(rule, e.path)
                if target is None:
                    continue
                rule.hits += 1
                _layers(src, dst, (e,), target, f"mapping sends src layer {e.path!r} to {target.paths}, and",
                        plan, rule.text)
                taken.add(e.path)
                break
            found = None
            for i, rx in enumerate(rule.src):
                m = rx.fullmatch(e.path) or (rx.fullmatch(src.stable[e.path]) if e.path in src.stable else None)
                if m is not None:
                    found = (i, m)
                    break
            if found is None:
                continue
            rule.hits += 1
            taken.add(e.path)
            i, m = found
            target = _expand(rule.target, m)
            if rule.concat:
                group = concat.setdefault((r, target.paths[0]), {})
                if i in group:
                    plan.problems.append(f"mapping rule {rule.text}: pattern {rule.src[i].pattern!r} matches both "
                                         f"{group[i].path!r} and {e.path!r} for {target.paths[0]!r}")
                group[i] = e
            else:
                _layers(src, dst, (e,), target, f"mapping rule {rule.text!r} sends src layer {e.path!r} to "
                        f"{list(target.paths) if target.split else target.paths[0]!r}, and", plan, rule.text)
            break
    for (r, path), group in concat.items():
        rule = rules[r]
        if len(group) != len(rule.src):
            lost = [rule.src[i].pattern for i in range(len(rule.src)) if i not in group]
            plan.problems.append(f"mapping rule {rule.text}: for {path!r}, patterns {lost} match no src layer "
                                 f"(found {[g.path for g in group.values()]})")
            continue
        _layers(src, dst, tuple(group[i] for i in range(len(rule.src))), Target((path,), heads=rule.target.heads),
                f"mapping rule {rule.text} concatenates into {path!r}, and", plan, rule.text)
    param_concat: dict[tuple[int, str], dict[int, str]] = {}  # (rule, dst path) -> pattern index -> param
    for p, (e, _) in src.params.items():
        for r, rule in enumerate(rules):
            if rule.concat and rule.target is not None and rule.target.along_axis:
                found = next(((i, m) for i, m in ((i, rx.fullmatch(p)) for i, rx in enumerate(rule.src)) if m), None)
                if found is not None:
                    rule.hits += 1
                    target = _expand(rule.target, found[1])
                    param_concat.setdefault((r, target.paths[0]), {})[found[0]] = p
                    break
                continue
            if e.path in taken and (p == e.path or not (rule.kind == "regex" and not rule.concat and rule.src[0].pattern
                                                        in (re.escape(p), re.escape(src.stable.get(p, p))))):
                continue  # a mapped layer's parameter also goes where a rule naming it exactly says
            if rule.kind == "callable":
                target = _ask(rule, p)
            elif rule.concat:
                continue
            else:
                m = rule.src[0].fullmatch(p) or (rule.src[0].fullmatch(src.stable[p]) if p in src.stable else None)
                target = None if m is None else _expand(rule.target, m)
            if target is None:
                continue
            rule.hits += 1
            if p in src.tied_to and dst.param(target.paths[0]) is None:
                break  # a tied parameter follows its tie
            _param(src, dst, p, target, f"mapping sends src parameter {p!r} to {target.paths[0]!r}, and", plan,
                   rule.text)
            break
    for (r, path), group in param_concat.items():
        rule = rules[r]
        if len(group) != len(rule.src):
            plan.problems.append(f"mapping rule {rule.text}: for {path!r}, only {sorted(group.values())} of its "
                                 f"{len(rule.src)} patterns match a src parameter")
            continue
        joined = Target((path,), heads=rule.target.heads, axis=rule.target.axis, swap=rule.target.swap,
                        offset=rule.target.offset, stack=rule.target.stack, stride=rule.target.stride)
        _axis_move(src, dst, tuple(group[i] for i in range(len(rule.src))), joined, f"mapping rule {rule.text} joins into {path!r}, and", plan, rule.text)


def _ties(src, dst, plan: Plan) -> None:
    """Drop head pairs that a kept tie makes redundant, and record the ties a source head follows.

    A source head tied to its embedding (every parameter shared) paired with a destination head
    tied to the embedding the source embedding goes to is the same tie on both sides: it moves
    once, with the embedding. A tied source head paired with an untied destination head fills it
    (the pair stays). A source head with no destination counterpart follows its embedding."""
    goes: dict[str, set[str]] = {}  # src parameter path -> dst parameter paths it may land on
    for m in plan.layers:
        if len(m.src) == len(m.dst) == 1:
            for n in m.src[0].names:
                goes[m.src[0].param_path(n)] = {m.dst[0].param_path(x) for x in m.dst[0].names}
    for p in plan.params:
        goes[p.src] = {p.dst}
    for am in plan.axis_moves:
        for x in am.src:
            goes[x] = set(am.dst)
    keep = []
    for m in plan.layers:
        s, d = m.src[0], m.dst[0]
        if len(m.src) == len(m.dst) == 1 and _follows_tie(src, s) and _follows_tie(dst, d) \
                and len(s.names) == len(d.names) \
                and all(dst.tied_to[d.param_path(nd)] in goes.get(src.tied_to[s.param_path(n)], ())
                        for n, nd in zip(s.names, d.names)):
            for n in s.names:
                plan.ties[s.param_path(n)] = src.tied_to[s.param_path(n)]
            continue
        keep.append(m)
    plan.layers = keep
    record_ties(src, plan)


def record_ties(src, plan: Plan) -> None:
    """Every source head that no layer move takes and whose parameters are all tied follows its tie."""
    mapped = {e.path for m in plan.layers for e in m.src}
    for e in src.entries:
        if e.path not in mapped and _follows_tie(src, e):
            for n in e.names:
                plan.ties.setdefault(e.param_path(n), src.tied_to[e.param_path(n)])


# ----------------------------------------------------------------------------- arrays
def _widths(units: list[int], heads: int | None, what: str) -> str | None:
    if heads is not None and any(u % heads for u in units):
        return f"{what}: widths {units} are not all divisible by heads={heads}"
    return None


def split_arrays(params: dict[str, np.ndarray], units: list[int], heads: int | None = None) -> list[dict]:
    """One fused layer's canonical params -> one dict per piece of ``units[i]`` units, in order.

    With ``heads``: the fused units are ``heads`` blocks, each holding units[i] // heads of every
    piece in order (per-head interleaving). Shared keys (``lora_a``, ``lora_scale``) are copied."""
    out: list[dict] = [{} for _ in units]
    for k, v in params.items():
        axis = UNIT_AXIS.get(k, -1)
        if axis is None:
            for o in out:
                o[k] = v
            continue
        v = np.asarray(v)
        if heads is None:
            edges = np.cumsum([0] + list(units))
            pieces = [v[..., edges[i]:edges[i + 1]] for i in range(len(units))]
        else:
            per = [u // heads for u in units]
            blocks = v.reshape(v.shape[:-1] + (heads, sum(per)))
            edges = np.cumsum([0] + per)
            pieces = [blocks[..., edges[i]:edges[i + 1]].reshape(v.shape[:-1] + (units[i],))
                      for i in range(len(units))]
        for o, p in zip(out, pieces):
            o[k] = np.ascontiguousarray(p)
    return out


def join_arrays(pieces: list[dict], heads: int | None = None) -> tuple[dict, str | None]:
    """The inverse of :func:`split_arrays`: pieces' canonical params joined along units; a shared
    key must be equal in every piece (else the sentence saying so comes back)."""
    out: dict = {}
    for k in pieces[0]:
        vals = [np.asarray(p[k]) for p in pieces]
        if UNIT_AXIS.get(k, -1) is None:
            if not all(np.array_equal(vals[0], v) for v in vals[1:]):
                return {}, f"their {k} differ, and the joined layer holds one"
            out[k] = vals[0]
            continue
        if heads is None:
            out[k] = np.concatenate(vals, axis=-1)
        else:
            blocks = [v.reshape(v.shape[:-1] + (heads, v.shape[-1] // heads)) for v in vals]
            joined = np.concatenate(blocks, axis=-1)
            out[k] = joined.reshape(joined.shape[:-2] + (-1,))
    return out, None


def check_widths(units: list[int], heads: int | None, what: str) -> str | None:
    """A problem sentence when the pieces cannot split per head; None when they can."""
    return _widths(units, heads, what)


def interleaved(path: str) -> bool:
    """Does this layer's name say its fused units interleave per head (see INTERLEAVED_NAMES)?"""
    return re.split(r"[./]", path)[-1] in INTERLEAVED_NAMES


#: (mantissa bits, exponent bits) of the floating dtypes parameters come in
_FLOAT_BITS = {"float16": (10, 5), "bfloat16": (7, 8), "float32": (23, 8), "float64": (52, 11)}


@functools.lru_cache(maxsize=256)  # a few dtype pairs, asked once per tensor moved
def narrowing(src_dtype: Any, dst_dtype: Any) -> bool:
    """Does casting ``src_dtype`` values into ``dst_dtype`` lose precision or range (float32 into
    bfloat16, bfloat16 into float16)? Widening (bfloat16 into float32) is exact."""
    key = (src_dtype, dst_dtype)
    try:
        return _NARROWING[key]
    except (KeyError, TypeError):  # not asked yet, or a dtype object that is no dict key
        pass
    a, b = _FLOAT_BITS.get(np.dtype(src_dtype).name), _FLOAT_BITS.get(np.dtype(dst_dtype).name)
    found = a is not None and b is not None and (b[0] < a[0] or b[1] < a[1])
    try:
        _NARROWING[key] = found
    except TypeError:
        pass
    return found


#: (src dtype, dst dtype) -> :func:`narrowing`'s answer: a handful of pairs, asked once per tensor
_NARROWING: dict[tuple, bool] = {}
