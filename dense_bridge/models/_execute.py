"""Carrying out a plan (``_plan.Plan``: by order, explicit rules or inferred, all alike) from one
model into another: every move checked and queued, then, only when no problem was found
anywhere, all written (put back if a write fails).

One method per kind of move (:class:`Execution`):

- ``linear``: one linear layer into one, in the canonical layout (LoRA adapters through
  ``lora._moves.LoraMoves``);
- ``fused``: a split or a concatenation along units (per head where declared);
- ``quantized``: a move with a quantized side (``quant._moves``);
- ``layer_params``: two non-linear layers (norms, embeddings), parameter by parameter through
  :data:`NAME_TABLE`;
- ``param``: one parameter path into another, through a transform when given.

Then ties are accounted for and, with ``strict``, completeness is checked: every linear layer of
both models matched, every rule used, every parameter of dst written (or tied to one that is).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _one_sided, _plan as _mapping, _stride
from .._errors import ConversionError, SpecError
from ._device import DeviceMoves, dtype_of, is_host, shape_of, snapshot
from ._layouts import Entry
from ._report import TransferReport
from ._walk import LINEAR_KINDS, Side

__all__ = ["execute", "NAME_TABLE"]

#: Parameter names that mean the same thing across frameworks, for layers that are not linear.
#: A mapped pair of such layers moves each parameter to the one of the same name, else to the one
#: name of its group the other layer has (norm scale/offset, embedding table, batch-norm stats).
NAME_TABLE: tuple[tuple[str, ...], ...] = (
    ("weight", "gamma", "scale"),
    ("bias", "beta", "offset"),
    ("weight", "embeddings", "embedding"),  # Flax nnx.Embed's table is "embedding"
    ("running_mean", "moving_mean"),
    ("running_var", "moving_variance"),
)


def execute(a: Side, b: Side, plan: _mapping.Plan, adapters: Any, *, strict: bool, allow_narrowing: bool,
            requantize: bool) -> TransferReport:
    """Carry out ``plan`` from side ``a`` into side ``b``; ConversionError listing every problem
    (nothing written), else the report. ``adapters``: the transfer's ``lora._moves.LoraMoves``."""
    run = Execution(a, b, plan, adapters, strict, requantize)
    for m in plan.layers:
        run.layer_move(m)
    for pm in plan.params:
        run.param(pm)
    for am in plan.axis_moves:
        run.axis_move(am)
    dst_done = run.ties()
    if strict:
        run.completeness(dst_done)
    if run.casts and not allow_narrowing:
        listed = ", ".join(f"{p} ({np.dtype(f).name} -> {np.dtype(t).name})" for p, f, t in run.casts[:8])
        more = f" and {len(run.casts) - 8} more" if len(run.casts) > 8 else ""
        run.problems.append(f"narrowing casts round values: {listed}{more}. Pass allow_narrowing=True to round "
                            f"them into dst's dtypes")
    if getattr(a.adapter, "lora_leftovers", None) is not None:  # PEFT embedding adapters, modules_to_save: named
        run.problems += adapters.leftovers(a.model, run.moved_src)
    run.problems += run.dev.verdict()  # the NaN/Inf tests of the device path: one host synchronisation
    if run.problems:
        raise ConversionError(f"cannot transfer {a.backend} -> {b.backend} (nothing was written):\n  - "
                              + "\n  - ".join(run.problems))
    run.write()
    report = run.report
    report.rules = plan.rules({**a.stable, **b.stable})
    report.narrowed = [p for p, _, _ in run.casts]
    report.lora = adapters.summary()
    report.not_moved_src = [p for p in a.params if p not in run.moved_src]
    report.not_moved_dst = [p for p in b.params if p not in dst_done]
    return report


class Execution:
    """One plan being checked and queued: the writes, the problems, what moved."""

    def __init__(self, a: Side, b: Side, plan: _mapping.Plan, adapters: Any, strict: bool, requantize: bool):
        self.a, self.b, self.plan, self.adapters = a, b, plan, adapters
        self.strict, self.requantize = strict, requantize
        self.problems: list[str] = list(plan.problems)
        self.writes: list[tuple[Entry, str, Any]] = []  # (dst entry, "linear"/"native"/"lora"/"quantized", arrays)
        self.report = TransferReport(a.backend, b.backend)
        self.moved_src: set[str] = set()
        self.moved_dst: dict[Any, str] = {}  # dst storage identity -> the src path written into it
        self.casts: list[tuple[str, Any, Any]] = []  # (dst parameter path, src dtype, dst dtype), narrowing
        self.dev = DeviceMoves(a, b)  # moves that stay on the device, where both adapters offer them
        self.bias_notes: dict[str, str] = {}  # dst layer path -> how a bias on one side only moved

    # ------------------------------------------------------------------------- bookkeeping
    def claim(self, d: Entry, name: str, source: str) -> bool:
        """Record that ``source`` writes ``d``'s parameter ``name``; False (and a problem when
        another source got there first) when it is written already."""
        key = d.ident[name]
        if key in self.moved_dst:
            if self.moved_dst[key] != source:
                b = self.b
                tie = b.tied_to.get(d.param_path(name)) or next(
                    (p for p, f in b.tied_to.items() if f == d.param_path(name)), None)
                why = f" (it is tied to {tie!r}: one array, which cannot hold both)" if tie else ""
                self.problems.append(f"dst parameter {d.param_path(name)!r} gets both {self.moved_dst[key]!r} and "
                                     f"{source!r}{why}")
            return False
        self.moved_dst[key] = source
        return True

    def _moved_layers(self, m: _mapping.LayerMove) -> str:
        label = m.src[0].path if len(m.src) == 1 else "+".join(e.path for e in m.src)
        for dd in m.dst:
            for n in dd.names:
                self.claim(dd, n, label)
        for ss in m.src:
            self.moved_src.update(self.a.param_paths(ss))
        return label

    # ------------------------------------------------------------------------- layer moves
    def layer_move(self, m: _mapping.LayerMove) -> None:
        """Dispatch one layer move to its kind; a problem of a move an explicit rule made names the rule."""
        first = len(self.problems)
        self._layer_move(m)
        if m.rule and m.rule not in ("auto", "by order"):
            self.problems[first:] = [p if "mapping rule" in p else f"{p} (mapping rule {_mapping.rule_label(m.rule)})"
                                     for p in self.problems[first:]]

    def _layer_move(self, m: _mapping.LayerMove) -> None:
        if not m.linear and len(m.src) + len(m.dst) > 2:
            self.problems.append(f"mapping rule {m.rule!r}: splits and concatenations join linear layers; "
                                 f"{[e.where() for e in m.src + m.dst if e.kind not in LINEAR_KINDS]} are not")
            return
        s, d = m.src[0], m.dst[0]
        if (s.kind in LINEAR_KINDS) != (d.kind in LINEAR_KINDS):
            lin, other = (s, d) if s.kind in LINEAR_KINDS else (d, s)
            self.problems.append(f"{lin.where()} is a linear layer but {other.where()} is not: map its parameters "
                                 f"by parameter path instead")
        elif any(e.kind == "quantized" for e in m.src + m.dst):
            self.quantized(m)
        elif s.kind == "linear":
            self.linear(m) if len(m.src) == len(m.dst) == 1 else self.fused(m)
        else:
            self.layer_params(m)

    def linear(self, m: _mapping.LayerMove) -> None:
        """One linear layer into one (with its LoRA adapter, by ``lora=``)."""
        s, d = m.src[0], m.dst[0]
        try:  # the device path reads no LoRA-wrapped layer: both read there means neither holds one
            with_lora = not (self.dev.linear(self.a, s) is not None and self.dev.linear(self.b, d) is not None) and (
                _has_lora(self.a.linear_params(s)) or _has_lora(self.b.linear_params(d)))
        except ConversionError as exc:
            self.problems.append(f"{s.path!r} -> {d.path!r}: {exc}")
            return
        problem = self.adapters.move(s, d, self.writes) if with_lora else self.canonical(s, d)
        if problem:
            self.problems.append(problem)
            return
        self._record_linear(m)

    def _record_linear(self, m: _mapping.LayerMove) -> None:
        label = self._moved_layers(m)
        how = "split" if len(m.dst) > 1 else "concatenated" if len(m.src) > 1 else ""
        heads = f", {m.heads} heads interleaved" if m.heads is not None else ""
        for ww in self.writes[-len(m.dst):]:
            what = ", ".join(sorted(ww[2])) + " (canonical" + (f", {how}{heads}" if how else "") + ")"
            if ww[0].path in self.bias_notes:
                what += f"; {self.bias_notes[ww[0].path]}"
            self.report.moved.append((label, ww[0].path, what))

    def canonical(self, s: Entry, d: Entry, writes: list | None = None, casts: list | None = None,
                  params: dict | None = None) -> str | None:
        """Queue the canonical params of linear ``s`` (or ``params``: one piece of a split) for linear
        ``d``; a problem sentence if they do not fit. Only the parameters are compared (names,
        shapes; values cast to dst's dtype and checked for NaN/Inf): a layer's fused activation
        need not be readable for its weights to move. (``writes``/``casts``: the signature
        ``quant._moves`` calls it with; they are this execution's.)"""
        if params is None and self.dev.on:
            problem = self._canonical_on_device(s, d)
            if problem is not False:
                return problem
        try:
            params = self.a.linear_params(s) if params is None else params
            have = self.b.linear_params(d)
        except (ConversionError, SpecError) as exc:
            return f"{s.path!r} -> {d.path!r}: {exc}"
        params, note, problem = _one_sided.reconcile(params, have, s.where(), d.where())
        if problem:
            return problem
        if note:
            self.bias_notes[d.path] = note
        if sorted(params) != sorted(have):
            return (f"src {s.where()} has parameters {sorted(params)} but dst {d.where()} has {sorted(have)} "
                    f"(a bias or mask on one side only)")
        out = {}
        for k in params:
            if params[k].shape != have[k].shape:
                return (f"src {s.where()} {k} {params[k].shape} does not fit dst {d.where()} {k} {have[k].shape} "
                        f"(canonical layout: kernel (in_features, units))")
            if _mapping.narrowing(np.asarray(params[k]).dtype, have[k].dtype):
                self.casts.append((f"{d.path} ({k})", np.asarray(params[k]).dtype, have[k].dtype))
            with np.errstate(over="ignore", invalid="ignore"):
                value = np.asarray(params[k]).astype(have[k].dtype, copy=False)
            if not np.isfinite(np.asarray(value, dtype=np.float32)).all():
                return f"src {s.where()} {k} holds NaN or Inf (in dst's dtype {have[k].dtype})"
            out[k] = value
        self.writes.append((d, "linear", out))
        return None

    def _canonical_on_device(self, s: Entry, d: Entry) -> str | None | bool:
        """:meth:`canonical` on the device path: shapes and dtypes compared (metadata), the
        NaN/Inf test queued (:meth:`DeviceMoves.verdict`), src's device arrays queued for dst's
        adapter to copy device to device. False: this pair takes the host path (a LoRA adapter,
        a quantized or lazy layer, a narrowing cast whose overflow is judged in dst's dtype)."""
        params, have = self.dev.linear(self.a, s), self.dev.linear(self.b, d)
        if params is None or have is None or params.keys() != have.keys():
            return False
        for k in params:
            src, dst = params[k], have[k]
            if src.shape != dst.shape and shape_of(src) != shape_of(dst):  # shapes are tuples (or tuple-like)
                return False  # the host path words the problem
            if src.dtype is not dst.dtype and _mapping.narrowing(dtype_of(src), dtype_of(dst)):  # one dtype: no cast
                return False
        for k in params:
            self.dev.check(params[k], lambda k=k: f"src {s.where()} {k} holds NaN or Inf (in dst's dtype "
                                                  f"{dtype_of(have[k])})")
        self.writes.append((d, "linear", dict(params)))
        return None

    def fused(self, m: _mapping.LayerMove) -> None:
        """A split or a concatenation: the src layers' canonical params joined along units, then
        split along units into the dst layers, each taking as many units as it has (``m.heads``:
        per-head interleaving on the fused side); each piece then moves as :meth:`canonical` moves
        one. LoRA adapters split and join with their layers: a split copies ``lora_a`` and slices
        ``lora_b`` (``lora.split_units``), a concatenation stacks the ranks with a block-diagonal
        ``lora_b`` (``lora.join_units``); with ``lora="merge"`` joined members are merged one by one
        in float64 first, so the destination kernel is rounded once."""
        problem = self._fused(m)
        if problem:
            self.problems.append(problem)
            return
        self._record_linear(m)

    def _fused(self, m: _mapping.LayerMove) -> str | None:
        from .. import lora as _lora

        names = f"{'+'.join(e.path for e in m.src)!r} -> {'+'.join(e.path for e in m.dst)!r}"
        fused = m.src[0] if len(m.src) == 1 else m.dst[0]
        if m.heads is None and _mapping.interleaved(fused.path):
            return (f"{names}: {fused.path!r} is a fused projection whose units interleave per head (q, k, v of each "
                    f"head in turn); a plain split would scramble the heads. Declare it: "
                    f"{{'to': [...], 'heads': n}} (heads=1 when it is q|k|v in blocks)")
        try:
            given = [self.a.linear_params(e) for e in m.src]
            haves = [self.b.linear_params(e) for e in m.dst]
        except (ConversionError, SpecError) as exc:
            return f"{names}: {exc}"
        loras = [_lora.split(p)[1] for p in given]
        with_lora = any(loras) or any(_lora.split(p)[1] for p in haves)
        given, haves = [_lora.split(p)[0] for p in given], [_lora.split(p)[0] for p in haves]
        if any(loras) and self.adapters.mode is None:
            return (f"{names}: src {[e.where() for e, x in zip(m.src, loras) if x]} hold LoRA adapters: pass "
                    f"lora='keep' or lora='merge'")
        for side, params in (("src", given), ("dst", haves)):
            ins = sorted({int(np.shape(p["kernel"])[0]) for p in params if "kernel" in p})
            if len(ins) > 1:
                return f"{names}: the {side} layers have in_features {ins}; layers joined along units share their input"
            keys = [sorted(p) for p in params]
            if any(k != keys[0] for k in keys):
                return f"{names}: the {side} layers differ in parameters {keys} (a bias on some only)"
            if any(p["kernel"].ndim != 2 for p in params):
                return f"{names}: only 2-D kernels split or join (a Bilinear does not)"
        units = [p["kernel"].shape[-1] for p in (given if len(m.src) > 1 else haves)]
        problem = _mapping.check_widths(units, m.heads, names)
        if problem:
            return problem
        lora = loras[0]
        if len(m.src) > 1 and any(loras):
            if self.adapters.mode == "merge":  # each member's effective kernel in float64: rounded once
                given = [{**p, "kernel": _lora.effective_kernel(p["kernel"], x)} if x else p
                         for p, x in zip(given, loras)]
                lora = {}
            else:
                lora, problem = _lora.join_units(loras, units, m.heads)
                if problem:
                    return f"{names}: {problem}"
        params, problem = _mapping.join_arrays(given, m.heads) if len(m.src) > 1 else (given[0], None)
        if problem:
            return f"{names}: {problem}"
        pieces, lora_pieces = [params], [lora]
        if len(m.dst) > 1:
            total = params["kernel"].shape[-1]
            if total != sum(units):
                return (f"{names}: src has {total} units but the dst layers {[e.path for e in m.dst]} have {units} "
                        f"= {sum(units)} (a split gives each as many units as it has)")
            pieces = _mapping.split_arrays(params, units, m.heads)
            lora_pieces = _lora.split_units(lora, units, m.heads) if lora else [{} for _ in units]
        for d, piece, lora_piece in zip(m.dst, pieces, lora_pieces):
            if with_lora:
                problem = self.adapters.move(m.src[0], d, self.writes, given={**piece, **lora_piece})
            else:
                problem = self.canonical(m.src[0], d, params=piece)
            if problem:
                return f"{names}: {problem}"
        return None

    def quantized(self, m: _mapping.LayerMove) -> None:
        """A move with a quantized side: codes or dequantized floats (``quant._moves``)."""
        from ..quant._moves import quantized_move

        problem, moved = quantized_move(m, self.writes, self.report, self.requantize, self.casts, self.canonical)
        if problem:
            self.problems.append(problem)
            return
        self._moved_layers(m)
        self.report.moved.extend(moved)

    def layer_params(self, m: _mapping.LayerMove) -> None:
        """Two mapped non-linear layers: each parameter into the one of the same name, else the one
        of its :data:`NAME_TABLE` group the other layer has; two quantized tables of one format
        move their codes exactly."""
        from ..quant import same_quantized_tables

        s, d = m.src[0], m.dst[0]
        codes = same_quantized_tables(s, d)
        if codes is not None:
            self.writes.append((d, "quantized", codes))
            for n in d.names:
                self.claim(d, n, s.param_path(n))
            self.moved_src.update(s.param_path(n) for n in s.names)
            self.report.moved.append((s.path, d.path, "codes moved exactly (quantized table)"))
            return
        pairs, left_s, _ = _name_pairs(s, d)
        if left_s and self.strict:
            self.problems.append(f"src {s.where()} has parameters {left_s} with no counterpart in dst {d.where()} "
                                 f"(which has {list(d.names)}): map them by parameter path")
        arrays = {}
        values = self.dev.native(self.a, s) or self.a.native(s)
        for ns, nd in pairs:
            if s.param_path(ns) in self.plan.ties:
                continue
            problem = self._check_native(s.param_path(ns), values[ns], d, nd)
            if problem:
                self.problems.append(problem)
                continue
            if self.claim(d, nd, s.param_path(ns)):
                arrays[nd] = values[ns]
            self.moved_src.add(s.param_path(ns))
            self.report.moved.append((s.param_path(ns), d.param_path(nd), "parameter"))
        if arrays:
            self.writes.append((d, "native", arrays))

    def param(self, pm: _mapping.ParamMove) -> None:
        """One parameter path into another, as stored (shapes must agree), through ``pm.fn`` when given."""
        s, ns = self.a.params[pm.src]
        d, nd = self.b.params[pm.dst]
        on_device = None if pm.fn is not None else self.dev.native(self.a, s)  # a transform takes numpy
        value = on_device[ns] if on_device is not None else self.a.native(s)[ns]
        what = "parameter"
        if pm.fn is not None:
            if s.kind != "other":
                self.problems.append(f"mapping[{pm.src!r}]: a transform takes a parameter of a layer dense_bridge "
                                     f"does not read as linear (a table, a norm); {s.where()} is a linear layer: "
                                     f"map the layer")
                return
            value, problem = _transformed(pm, value)
            if problem:
                self.problems.append(problem)
                return
            what = f"parameter, transformed by {getattr(pm.fn, '__name__', 'fn')}"
        problem = self._check_native(pm.src, value, d, nd)
        if problem:
            self.problems.append(problem)
            return
        if self.claim(d, nd, pm.src):
            self.writes.append((d, "native", {nd: value}))
        self.moved_src.add(pm.src)
        self.report.moved.append((pm.src, pm.dst, what))

    def axis_move(self, am: _mapping.AxisMove) -> None:
        """Stored parameters joined and split along an axis (expert stacks), as stored: each source
        (last two axes exchanged when ``am.swap``) concatenated along ``am.axis``, then cut into the
        destination parameters, each as wide as it is along that axis."""
        names = f"{'+'.join(am.src)!r} -> {'+'.join(am.dst)!r}"
        if am.heads is not None:
            self._per_head_move(am, names)
            return
        values = []
        for p in am.src:
            s, ns = self.a.params[p]
            v = np.asarray(self.a.native(s)[ns])
            values.append(np.swapaxes(v, -1, -2) if am.swap and v.ndim >= 2 else v)
        dsts = [self.b.params[p] for p in am.dst]
        if am.stack:  # along a new axis: several stacked into one, or one unstacked into several
            pieces = self._stacked(am, values, dsts, names)
            if pieces is None:
                return
        elif am.axis is None:
            if len(values) != 1 or len(dsts) != 1:
                self.problems.append(f"{names}: several parameters on one side need an axis to join or split along")
                return
            pieces = values
        else:
            if any(v.ndim <= am.axis for v in values):
                self.problems.append(f"{names}: axis {am.axis} is beyond the parameters' {[v.ndim for v in values]} axes")
                return
            stride = getattr(am, "stride", None)
            if stride is not None and stride != max(len(values), len(dsts)):
                self.problems.append(f"{names}: 'stride' {stride} interleaves {stride} pieces; the move has "
                                     f"{max(len(values), len(dsts))}")
                return
            try:
                whole = values[0] if len(values) == 1 else _stride.interleave(values, am.axis) if stride \
                    else np.concatenate(values, axis=am.axis)
            except ValueError as exc:
                whole = f"({exc})"
            if isinstance(whole, str):
                self.problems.append(f"{names}: the src parameters do not join along axis {am.axis} {whole}")
                return
            widths = [d.shapes[n][am.axis] if len(d.shapes[n]) > am.axis else -1 for d, n in dsts]
            if sum(widths) != whole.shape[am.axis] or (stride and len(dsts) > 1 and len(set(widths)) != 1):
                self.problems.append(f"{names}: src holds {whole.shape[am.axis]} along axis {am.axis}, the dst "
                                     f"parameters {widths} = {sum(widths)}"
                                     + (" (interleaved pieces share one width)" if stride else ""))
                return
            pieces = _stride.cut(whole, len(dsts), am.axis) if stride and len(dsts) > 1 \
                else np.split(whole, np.cumsum(widths)[:-1], axis=am.axis)
        fitted = []
        for (d, nd), piece in zip(dsts, pieces):
            piece, want = np.ascontiguousarray(piece), d.shapes[nd]
            if am.axis is None and piece.shape != want and piece.size == int(np.prod(want)) \
                    and tuple(x for x in piece.shape if x != 1) == tuple(x for x in want if x != 1):
                piece = piece.reshape(want)  # axes of length one only: a scalar stored (1,) on one side, () on the other
            if am.offset:  # summed exactly (float64 holds any float32 + 1), rounded once, in dst's dtype
                dst_dtype = np.asarray(self.b.native(d)[nd]).dtype
                piece = (np.asarray(piece, np.float64) + am.offset).astype(dst_dtype)
            fitted.append(piece)
        self._write_pieces(am, dsts, fitted, names, f"parameter along {'new ' if am.stack else ''}axis {am.axis}"
                           + (" (last two axes swapped)" if am.swap else "")
                           + (f" (interleaved, stride {am.stride})" if getattr(am, "stride", None) else "")
                           + (f" plus {am.offset:g}, rounded to the destination's dtype" if am.offset else ""))

    def _stacked(self, am: _mapping.AxisMove, values: list, dsts: list, names: str) -> list | None:
        """``am.stack``: the source arrays (several) stacked along the new axis ``am.axis`` into the
        one destination, or the one source's entries along ``am.axis`` (that axis dropped) into the
        destinations, one each; None (the problem recorded) where the counts or axes do not agree."""
        if len(values) > 1 and len(dsts) == 1:
            if am.axis > values[0].ndim or any(v.shape != values[0].shape for v in values):
                self.problems.append(f"{names}: the src parameters {[tuple(v.shape) for v in values]} do not stack "
                                     f"along a new axis {am.axis}")
                return None
            return [np.stack(values, axis=am.axis)]
        if len(values) == 1 and len(dsts) > 1 and am.axis < values[0].ndim \
                and values[0].shape[am.axis] == len(dsts):
            return [np.take(values[0], i, axis=am.axis) for i in range(len(dsts))]
        self.problems.append(f"{names}: a stack joins several parameters into one along a new axis or cuts one "
                             f"into as many as its axis {am.axis} holds ({len(values)} src, {len(dsts)} dst)")
        return None

    def _write_pieces(self, am: _mapping.AxisMove, dsts: list, pieces: list, names: str, how: str) -> None:
        """Check each piece against its dst parameter and queue the writes; nothing is queued for a
        piece after the first that does not fit (the problem is recorded)."""
        for (d, nd), piece, path in zip(dsts, pieces, am.dst):
            piece = np.require(piece, requirements="C")  # contiguous; a 0-d value stays 0-d
            problem = self._check_native(am.src[0], piece, d, nd)
            if problem:
                self.problems.append(f"{names}: {problem}")
                return
            if self.claim(d, nd, am.src[0]):
                self.writes.append((d, "native", {nd: piece}))
            self.report.moved.append(("+".join(am.src), path, how))
        self.moved_src.update(am.src)

    def _per_head_move(self, am: _mapping.AxisMove, names: str) -> None:
        """``am.heads``: the side with one matrix (heads * (a + b + ...), r) seen as (heads, a + b
        + ..., r), cut along ``am.axis`` into the other side's parts or joined from them, each part
        with its last two axes exchanged where its ``swap`` says so."""
        src = [np.asarray(self.a.native(self.a.params[p][0])[self.a.params[p][1]]) for p in am.src]
        dsts = [self.b.params[p] for p in am.dst]
        parts = len(am.dst) if len(am.src) == 1 else len(am.src)
        swaps = am.swap if isinstance(am.swap, tuple) else (am.swap,) * parts
        if len(swaps) != parts or (len(am.src) == 1) == (len(am.dst) == 1) or am.axis is None:
            self.problems.append(f"{names}: a move per head joins several parameters into one or cuts one into "
                                 f"several, one swap per part ({len(swaps)} given for {parts} parts)")
            return
        h = am.heads
        if len(am.src) == 1:  # cut
            whole = src[0]
            if whole.ndim < 2 or whole.shape[0] % h:
                self.problems.append(f"{names}: {tuple(whole.shape)} has no leading axis of {h} heads")
                return
            whole = whole.reshape((h, whole.shape[0] // h) + whole.shape[1:])
            shapes = [tuple(d.shapes[n]) for d, n in dsts]
            widths = [(s[:-2] + (s[-1], s[-2]) if sw else s)[am.axis] for s, sw in zip(shapes, swaps)]
            if am.axis >= whole.ndim or sum(widths) != whole.shape[am.axis]:
                self.problems.append(f"{names}: src holds {whole.shape} per head ({h} heads), the dst parameters "
                                     f"{widths} = {sum(widths)} along axis {am.axis}")
                return
            pieces = [np.swapaxes(x, -1, -2) if sw else x
                      for x, sw in zip(np.split(whole, np.cumsum(widths)[:-1], axis=am.axis), swaps)]
        else:  # join
            parts = [np.swapaxes(v, -1, -2) if sw else v for v, sw in zip(src, swaps)]
            if any(v.ndim != 3 or v.shape[0] != h or v.shape[2] != parts[0].shape[2] for v in parts) or am.axis != 1:
                self.problems.append(f"{names}: the src parameters {[tuple(v.shape) for v in src]} do not join "
                                     f"per head ({h} heads) along axis {am.axis}")
                return
            joined = np.concatenate(parts, axis=1)
            pieces = [joined.reshape((-1,) + joined.shape[2:])]
        self._write_pieces(am, dsts, pieces, names, f"parameter per head ({h} heads) along axis {am.axis}")

    def _check_native(self, src_path: str, value: Any, d: Entry, name: str) -> str | None:
        """Does ``value`` (host numpy, or a device array on the device path) fit dst's ``name``."""
        shape = shape_of(value)
        if shape != d.shapes[name]:
            return (f"src parameter {src_path!r} {shape} does not fit dst parameter {d.param_path(name)!r} "
                    f"{d.shapes[name]}")
        if not is_host(value):  # the device path: the test queued for one synchronisation
            self.dev.check(value, lambda: f"src parameter {src_path!r} holds NaN or Inf")
            dst_native = self.dev.native(self.b, d)
            dst_dtype = dtype_of((dst_native or self.b.native(d))[name])
            if _mapping.narrowing(dtype_of(value), dst_dtype):
                self.casts.append((d.param_path(name), dtype_of(value), dst_dtype))
            return None
        if (value.dtype.kind == "f" or str(value.dtype) == "bfloat16") and \
                not np.isfinite(np.asarray(value, dtype=np.float32)).all():
            return f"src parameter {src_path!r} holds NaN or Inf"
        dst_dtype = np.asarray(self.b.native(d)[name]).dtype
        if _mapping.narrowing(value.dtype, dst_dtype):
            self.casts.append((d.param_path(name), value.dtype, dst_dtype))
        return None

    # ------------------------------------------------------------------------- after the moves
    def ties(self) -> set[str]:
        """Account for ties (a src parameter tied to a moved one has moved; a dst one tied to a
        written one is written); returns every dst parameter path written."""
        a, b = self.a, self.b
        for p, first in a.tied_to.items():
            if first in self.moved_src:
                self.moved_src.add(p)
                self.report.tied[p] = first
        written = set(self.moved_dst)
        dst_done = {p for p, (e, n) in b.params.items() if e.ident[n] in written}
        for p, first in b.tied_to.items():
            if p in dst_done:
                self.report.tied[p] = first
        return dst_done

    def completeness(self, dst_done: set[str]) -> None:
        """``strict``: every linear layer of both models matched, every rule used, and every
        parameter of dst written (computed buffers are not in a walk: nothing asks for them)."""
        plan, a, b = self.plan, self.a, self.b
        mapped_s = {e.path for m in plan.layers for e in m.src}
        mapped_d = {e.path for m in plan.layers for e in m.dst}
        for side, mapped, done in ((a, mapped_s, self.moved_src), (b, mapped_d, dst_done)):
            missing = [e.path for e in side.linear() if e.path not in mapped
                       and not (e.names and all(e.param_path(n) in done for n in e.names))]
            if missing:
                self.problems.append(f"strict: linear layers of {side.argument} not matched: {missing}")
        if plan.idle:
            self.problems.append(f"strict: mapping rules that matched nothing: {plan.idle}")
        unwritten = [p for p in b.params if p not in dst_done]
        if unwritten:
            self.problems.append(f"strict: parameters of dst left unwritten: {unwritten} (strict=True writes every "
                                 f"parameter of dst: map them, or pass strict=False to leave them as they are)")

    def write(self) -> None:
        """Write everything queued; on a failure, put back what was written (all-or-nothing).

        Every check (shapes, dtypes, NaN/Inf, completeness) has passed before this runs. What can
        still fail is a write itself: each is written with an undo (a copy of what it overwrites)
        except those dst's adapter takes as plain in-place copies (:meth:`_in_place`), which can
        neither fail nor allocate and are done last, all in one call, so that a failure of any
        other write leaves them unwritten and the undo of the others restores dst whole."""
        taken, commit = self._in_place()
        done: list[tuple[Entry, Any]] = []
        try:
            for i, (d, how, arrays) in enumerate(self.writes):
                if i in taken:
                    continue
                if how == "quantized":  # a dense_bridge.quant.Candidate: writing returns its own undo
                    done.append((d, arrays.write()))
                    continue
                before = snapshot(d) if self.dev.on else {k: np.array(v, copy=True) for k, v in d.read().items()}
                done.append((d, before))
                if how == "lora":  # a LoRA layer: attached where dst has no adapter yet, then written
                    self.adapters.write(d, arrays)
                elif how == "linear":
                    self.b.set_linear(d, arrays)
                else:
                    d.write(arrays)
            if commit is not None:
                commit()
        except BaseException:
            self.adapters.undo()
            for d, before in reversed(done):
                try:
                    before() if callable(before) else d.write(before)
                except Exception:  # noqa: BLE001 - restoring as much as possible; the first error is raised
                    pass
            raise

    def _in_place(self) -> tuple[set[int], Any]:
        """The queued writes dst's adapter does as plain in-place copies (``in_place_copies``, an
        extra of the ``devices`` capability: same shape, same device, nothing allocated, nothing
        that can raise) and the call doing them; ``(set(), None)`` off the device path, or when
        the two models share a parameter (a write could change what another reads)."""
        verb = getattr(self.b.adapter, "in_place_copies", None) if self.dev.on else None
        if verb is None:
            return set(), None
        forms = {"linear": "canonical", "native": "native"}
        index = [i for i, (_, how, _) in enumerate(self.writes) if how in forms]
        if not index:
            return set(), None
        shared = {k for e, _ in self.a.params.values() for k in e.ident.values()}
        if any(e.ident[n] in shared for e, n in self.b.params.values()):
            return set(), None
        taken, commit = verb([(self.writes[i][0].layer, forms[self.writes[i][1]], self.writes[i][2]) for i in index])
        return {index[j] for j in taken}, commit


def _has_lora(params: dict) -> bool:
    return any(k.startswith("lora_") for k in params)


def _name_pairs(s: Entry, d: Entry) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(src name, dst name) pairs of two mapped non-linear layers, and the names left on each side."""
    pairs, used = [], set()
    for n in s.names:
        if n in d.names and n not in used:
            pairs.append((n, n))
            used.add(n)
            continue
        cands = {c for group in NAME_TABLE if n in group for c in group if c in d.names and c not in used}
        if len(cands) == 1:
            c = cands.pop()
            pairs.append((n, c))
            used.add(c)
    moved_src = {a for a, _ in pairs}
    return pairs, [n for n in s.names if n not in moved_src], [n for n in d.names if n not in used]


def _transformed(pm: _mapping.ParamMove, value: np.ndarray) -> tuple[Any, str | None]:
    """``pm.fn`` applied to a private copy of the source array; a problem sentence if it fails."""
    try:
        out = pm.fn(np.array(value, copy=True))
    except Exception as exc:  # noqa: BLE001 - the user's function: its failure is reported, nothing written
        return None, f"mapping[{pm.src!r}]: the transform raised {type(exc).__name__}: {exc}"
    if not isinstance(out, np.ndarray):
        return None, (f"mapping[{pm.src!r}]: the transform must return a numpy array; it returned "
                      f"{type(out).__name__}")
    if out.dtype.kind not in "fiub":  # complex (its imaginary part would be dropped), objects, strings
        return None, (f"mapping[{pm.src!r}]: the transform must return real numbers; it returned an array of "
                      f"dtype {out.dtype} (a parameter holds real values: nothing would keep the rest)")
    return out, None
