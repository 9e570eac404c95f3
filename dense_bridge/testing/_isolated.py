"""Teacher forcing (``isolated=True``): every linear layer of b run alone on what a's counterpart received.

In the default (cascaded) mode each model runs on its own values, and a layer's own error is
separated from what it inherits by a propagation heuristic (``compare_models``' G, ``compare``'s
first-order allowances). Teacher forcing removes the inheritance instead of estimating it, as
nobuco replays each converted node on the original node's inputs:

- forward: each call of a matched layer of b runs alone (the adapter's ``run_layer`` verb) on
  the exact input a's layer received in that call, reshaped to b's native input shape (a Keras
  ``EinsumDense`` takes (batch, seq, heads, head_dim) where torch's Linear takes (batch, seq,
  hidden)) and cast to the dtype b's layer received it in;
- backward: from the cotangent a's layer received (dL/d(its output)), reshaped and cast the
  same way, giving b's dL/dx and parameter gradients; a's own dL/dx comes from ``run_layer`` on
  a's layer with the same input and cotangent (captures do not record input gradients);
- a split/fused group (``_split_groups``) runs member by member on the common input, each with its
  slice of the cotangent along units; outputs and parameter gradients are joined as the merged
  capture joins them and the members' dL/dx summed.

The rows: ``output``, ``dL/dkernel``, ``dL/dbias`` are judged on these forced calls with the
same own-contribution allowances as the cascaded mode (what each side's rounding allows), and
``dL/dx`` (forced mode only) against both sides' rounding of dL/dz @ W^T. The code BETWEEN
linear layers (attention, norms, activations) is not something dense_bridge runs alone, so the
``input``, ``dL/dy`` and model-output rows stay those of the cascaded pass, and the report says
so. A layer that cannot be forced (an adapter without ``run_layer``, a layer called a different
number of times, an activation inside one side's layer only, a framework error) keeps its
cascaded rows and the report names it and why.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import EPS
from ..registry._captures import Call, Capture
from ._report import first_failure
from ._tolerance import Tolerance, allowed_error

__all__ = ["teacher_forced", "forced_capture", "merge_rows", "ISOLATED_NOTE", "dx_rows", "Forced",
           "forced_layer_traces", "Traced", "LAYER_NOTE"]

LAYER_NOTE = ("isolated: every layer of b (with the activations after it) ran alone, compiled from b's parameters "
              "on b's backend, on the input and output gradient its counterpart in a received (teacher forcing)")

ISOLATED_NOTE = ("isolated: every compared linear layer of b ran alone on the input and output gradient its "
                 "counterpart in a received (teacher forcing); output, dL/dx and parameter-gradient rows judge those "
                 "calls. The code between linear layers is not run alone: the input, dL/dy and model output rows "
                 "are the cascaded pass's")

#: rows taken from the forced judgement; every other row stays the cascaded one
FORCED_ROWS = ("output", "dL/dkernel", "dL/dbias")


class Forced:
    """What the forced calls gave: per row index of b's calls, (a's dL/dx, b's dL/dx, cotangent,
    b's input) in native shapes, for the ``dL/dx`` rows."""

    def __init__(self) -> None:
        self.dx: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.notes: list[str] = []
        self.forced_paths: set[str] = set()


def _name(adapter) -> str:
    return adapter.__name__.rsplit(".", 1)[-1]


def teacher_forced(report, cmp) -> None:
    """Judge b's layers run alone on a's recorded inputs and cotangents and put their output,
    dL/dx and parameter-gradient rows in place of ``report``'s cascaded ones (judged from
    ``cmp``, a captured :class:`~dense_bridge.testing._comparison.Comparison`); a split/fused
    group runs member by member."""
    from ._judge import judge

    report.isolated = True
    forced_cap, forced = forced_capture(cmp)
    twin = judge_copy(report)
    judge(twin, cmp, forced_cap)
    rows = {i for i, c in enumerate(cmp.cap_b.calls) if c.path in forced.forced_paths}
    dx = dx_rows(report, forced, cmp)
    report.layers = merge_rows(report.layers, twin.layers, dx, rows)
    report.notes += [ISOLATED_NOTE] + forced.notes
    report.first_failure = first_failure(report.layers)


def forced_capture(cmp) -> tuple[Capture, Forced]:
    """A Capture of b whose calls are b's layers run alone on a's recorded inputs and cotangents
    (a call that cannot be forced is b's own cascaded call), and what the forcing saw.

    ``cmp``: the captured comparison; its ``acts(pa, pb)`` gives the activation each side's
    recorded output includes (None: the linear map alone); its split/fused ``groups`` run member
    by member (``_run_unit``, member units in ``widths``).
    """
    adapter_a, adapter_b, cap_a, cap_b = cmp.adapter_a, cmp.adapter_b, cmp.cap_a, cmp.cap_b
    layers_a, layers_b, groups, widths, grads = cmp.layers_a, cmp.layers_b, cmp.groups, cmp.widths, cmp.grads
    forced = Forced()
    run_b, run_a = getattr(adapter_b, "run_layer", None), getattr(adapter_a, "run_layer", None)
    for adapter, run, side in ((adapter_b, run_b, "b"), (adapter_a, run_a, "a")):
        if run is None:
            forced.notes.append(f"isolated: the {_name(adapter)!r} backend cannot run one layer alone (no run_layer "
                                f"verb): {side}'s layers are judged as in cascaded mode")
    if run_b is None or (grads and run_a is None):
        return cap_b, forced
    by_a = cap_a.by_path()
    b_to_a = cmp.b_to_a
    counts_b = cap_b.call_counts()
    refused: dict[str, str] = {}
    for pa, pb in cmp.pairs:
        missing = [p for p in _members(pa, groups) if layers_a.get(p) is None] + \
            [p for p in _members(pb, groups) if layers_b.get(p) is None]
        if missing:
            refused[pb] = f"no native layer to run alone for {', '.join(missing)}"
        elif len(by_a.get(pa, [])) != counts_b.get(pb, 0):
            refused[pb] = f"called {counts_b.get(pb, 0)} time(s) in b but {len(by_a.get(pa, []))} in a"
        elif not cmp.same_activation(pa, pb):
            refused[pb] = "one side records its output before an activation applied inside the layer, the other after"
    calls: list[Call] = []
    sums: dict[str, dict[str, np.ndarray]] = {}
    for idx, cb in enumerate(cap_b.calls):
        pb = cb.path
        pa = b_to_a[pb]
        ca = by_a[pa][cb.call] if pb not in refused else None
        if ca is None or len(ca.inputs) != 1 or len(cb.inputs) != 1:
            if pb not in refused and ca is not None:
                refused[pb] = "not a one-input layer"
            calls.append(cb)
            continue
        x = np.asarray(ca.inputs[0])
        xb = x.reshape(np.shape(cb.inputs[0])).astype(np.asarray(cb.inputs[0]).dtype)
        g = gb = None
        if grads:
            # a call a's backward pass never reached had a cotangent of 0 (torch reports None)
            g = np.zeros(np.shape(ca.output)) if ca.output_grad is None else np.asarray(ca.output_grad)
            gb = g.reshape(np.shape(cb.output)).astype(np.asarray(cb.output).dtype)
        try:
            yb, dxb, pgb = _run_unit(run_b, layers_b, groups, widths, pb, xb, gb)
            dxa = None
            if gb is not None:
                _, dxa, _ = _run_unit(run_a, layers_a, groups, widths, pa, x, g.astype(np.asarray(ca.output).dtype))
        except Exception as exc:  # noqa: BLE001 - a framework that cannot run this layer alone: said, not fatal
            refused[pb] = f"cannot run alone ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            calls.append(cb)
            continue
        calls.append(Call(pb, cb.call, (xb,), yb, gb))
        forced.forced_paths.add(pb)
        if gb is not None:
            forced.dx[idx] = (dxa, dxb, g, x)
            for path, pg in pgb.items():
                total = sums.setdefault(path, {})
                for k, v in pg.items():
                    total[k] = total.get(k, 0.0) + np.asarray(v).astype(np.float64)
    for pb, why in refused.items():
        forced.notes.append(f"isolated: {pb} ({b_to_a[pb]} in a) judged as in cascaded mode: {why}")
    forced.forced_paths -= set(refused)
    param_grads = {}
    for pb, cascaded in cap_b.param_grads.items():
        # a tied or frozen parameter has no cascaded gradient: the forced one is not compared either
        forced_grads = _unit_grads(pb, groups, sums) if pb in forced.forced_paths else None
        param_grads[pb] = cascaded if forced_grads is None else forced_grads
    forced.dx = {i: v for i, v in forced.dx.items() if cap_b.calls[i].path in forced.forced_paths}
    result = Capture(calls, param_grads, cap_b.output, list(cap_b.notes), set(cap_b.pre_activation))
    return result, forced


def _members(path: str, groups: dict) -> list[str]:
    return list(groups[path].paths) if path in groups else [path]


def _run_unit(run, layers: dict, groups: dict, widths: dict[str, int], path: str, x: np.ndarray,
              g: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, dict[str, dict]]:
    """``run`` (an adapter's run_layer) on one compared side: (output, dL/dx, {layer path: its
    parameter gradients}).

    A plain layer runs as it is. A split/fused group runs as the one virtual layer ``_split_groups.merge``
    makes of its members: each member runs on ``x`` (their common input, the first member's native
    shape) with its slice of ``g`` along units (per head when the group declares heads), the outputs
    come back joined along units as (rows, units) like the merged capture's, and dL/dx is the sum of
    the members' (the input fans out to all of them). ``g``: (rows, units) of the whole group or any
    shape holding them; None runs forward only."""
    if path not in groups:
        y, dx, pg = run(layers[path], x, g)
        return y, dx, {path: pg}
    from ..models._plan import split_arrays
    from ._split_groups import as_units, join_units

    grp = groups[path]
    units = [widths[p] for p in grp.paths]
    slices: list = [None] * len(units)
    if g is not None:
        # a member's native output shape (a keras-hub EinsumDense's (batch, seq, heads, head_dim))
        # is only known by running it: its slice of the cotangent must come in that shape
        shapes = [np.asarray(run(layers[p], x, None)[0]) for p in grp.paths]
        pieces = split_arrays({"kernel": np.asarray(g).reshape(-1, sum(units))}, units, grp.heads)
        slices = [pc["kernel"].reshape(y.shape).astype(y.dtype) for pc, y in zip(pieces, shapes)]
    ys, dxs, grads = [], [], {}
    for p, gp in zip(grp.paths, slices):
        y, dx, pg = run(layers[p], x, gp)
        ys.append(as_units(y, widths[p]))
        dxs.append(dx)
        grads[p] = pg
    dx = None
    if g is not None:
        dx = sum(np.asarray(d, np.float64) for d in dxs).astype(np.asarray(dxs[0]).dtype)
    return join_units(ys, grp.heads), dx, grads


def _unit_grads(path: str, groups: dict, sums: dict[str, dict]) -> dict | None:
    """The forced parameter gradients of a plain layer, or of a group joined like ``_split_groups.merge``
    joins the cascaded ones; None when some member has none."""
    if path not in groups:
        return sums.get(path)
    from ..models._plan import join_arrays

    pieces = [sums.get(p) for p in groups[path].paths]
    if any(pc is None for pc in pieces):
        return None
    joined, problem = join_arrays(pieces, groups[path].heads)
    return None if problem else joined


def dx_rows(report, forced: Forced, cmp) -> dict[int, Any]:
    """The ``dL/dx`` row of every forced call with a cotangent: a's and b's dL/dx on the same
    input and cotangent, each allowed its rounding of dL/dz @ W^T (K = units), in quadrature.
    A layer with an adapter sends dL/dz through its update too (W is the effective kernel) and
    each side's adapter path adds its rounding (``_adapters``, transposed). A pair with a
    quantized side (``cmp.quant``, testing/_quantized.py) multiplies two kernels: a's dL/dx is
    judged with that difference, dL/dz @ (Wa - Wb)^T, taken out."""
    from ._adapters import adapter_allowance, effective_kernel
    from ._judge import row, rows_of
    from ._propagate import activation_vjp

    out = {}
    dtype, tol = report.dtype, cmp.tol
    for idx, (dxa, dxb, g, x) in forced.dx.items():
        pa, pb, _ = report.calls[idx]
        params_b = cmp.params_b[pb]
        w = effective_kernel(params_b)
        n_in, n_out = w.shape
        a_rows, b_rows = rows_of(dxa, n_in, f"{pa} dL/dx"), rows_of(dxb, n_in, f"{pb} dL/dx")
        dz = rows_of(g, n_out, f"{pa} dL/dy")
        act = cmp.acts(pa, pb)[1]
        if act is not None:  # the recorded output is after the activation: dL/dz = f'(z) dL/dy
            z = rows_of(x, n_in, f"{pa} input") @ w
            if "bias" in params_b:
                z = z + np.asarray(params_b["bias"], dtype=np.float64)
            dz = activation_vjp(act, z, dz, dtype)[0]
        if pb in cmp.quant:
            from ._quantized import without_kernel_difference
            a_rows = without_kernel_difference(cmp.quant[pb], a_rows, dz, w)
        terms = np.abs(dz) @ np.abs(w.T)
        each = [allowed_error(v, dtype, n_out, tol.c_gradient, tol.atol) + tol.c_gradient * EPS[dtype] * terms
                + adapter_allowance(dz, params, dtype, tol, tol.c_gradient, transpose=True)
                for v, params in ((a_rows, cmp.params_a[pa]), (b_rows, params_b))]
        label = report.layers[idx].layer_type
        out[idx] = row((idx, label), "dL/dx", a_rows, b_rows, np.sqrt(each[0] ** 2 + each[1] ** 2), n_out,
                       dtype=dtype)
    return out


def merge_rows(cascaded: list, forced_layers: list, dx: dict, forced_paths_rows: set[int]):
    """The report's layers: per call row, the cascaded ``input``/``dL/dy`` rows and the forced
    ``output``, ``dL/dx`` and parameter-gradient rows (a call that was not forced keeps every
    cascaded row); the model rows are the cascaded ones."""
    from ._report import LayerResult

    merged = []
    for layer in cascaded:
        i = layer.index
        if i is None or i not in forced_paths_rows:
            merged.append(layer)
            continue
        forced = {q.quantity: q for q in forced_layers[i].quantities}
        rows = []
        for q in layer.quantities:
            if q.quantity in FORCED_ROWS:
                rows.append(forced.pop(q.quantity, q))  # a row the forced calls lack stays cascaded
                continue
            rows.append(q)
            if q.quantity == "dL/dy" and i in dx:
                rows.append(dx[i])
        if i in dx and not any(q.quantity == "dL/dx" for q in rows):
            rows.append(dx[i])
        rows += [q for name, q in forced.items() if name in FORCED_ROWS]
        merged.append(LayerResult(i, layer.layer_type, tuple(rows)))
    return merged


def judge_copy(report):
    """An empty copy of ``report`` to judge the forced calls into (rows and notes its own)."""
    twin = copy.copy(report)
    twin.layers, twin.notes, twin.calls = [], [], []
    return twin


# ---------------------------------------------------------------------------- compare (spec models)
def _segments(layers: list) -> list[tuple[int, int]] | None:
    """[start, end) ranges each holding one layer with parameters and the parameter-free layers
    after it (those before the first join it); None when no layer has parameters."""
    from ..specs import layer_param_shapes

    starts = [i for i, layer in enumerate(layers) if layer_param_shapes(layer)]
    if not starts:
        return None
    bounds = [0] + starts[1:] + [len(layers)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class Traced:
    """What ``compare`` traced of two spec models, for teacher forcing b's layers.

    ``layers_b``/``params_b``: b's layer specs and canonical params ("0.kernel", ...);
    ``trace_a``/``trace_b``: the cascaded traces (a's values are fed; b's give the dtype each of
    its layers received); ``xs``/``g``: the model's input and upstream gradient (float64);
    ``in_dtype_b``: the dtype b takes its input in; ``dtype``: the compared dtype.
    """

    backend_b: str
    layers_b: list
    params_b: dict
    trace_a: Any
    trace_b: Any
    xs: list
    g: np.ndarray | None
    in_dtype_b: str
    dtype: str
    tol: Tolerance
    grads: bool


def forced_layer_traces(run: Traced) -> tuple[list, list] | str:
    """b's layers traced one segment at a time (a layer with parameters and the activations after
    it, compiled alone on b's backend from b's parameters) on the input a's segment received and
    backward from the gradient a's segment received: (b's LayerTrace per layer, the allowances per
    layer for exact inputs), or why b's layers cannot be forced.
    """
    backend_b, layers_b, params_b = run.backend_b, run.layers_b, run.params_b
    trace_a, trace_b, xs, g, in_dtype_b = run.trace_a, run.trace_b, run.xs, run.g, run.in_dtype_b
    dtype, tol, grads = run.dtype, run.tol, run.grads
    from .._api import build
    from .._dtypes import numpy_dtype
    from ..params._source import ParamSource
    from ..registry._backends import get_adapter
    from ..specs import Sequential
    from ._gradients import computes_gradients
    from ._propagate import allowances

    able_b = computes_gradients({"b": backend_b}, False)["b"]
    parts = _segments(layers_b)
    if parts is None or len(parts) < 2:
        return "fewer than two layers with parameters: each already runs on exactly what the other's received"
    traces: list = [None] * len(layers_b)
    allowed: list = [None] * len(layers_b)
    n = len(layers_b)
    for start, end in parts:
        x = [np.asarray(v) for v in xs] if start == 0 else [np.asarray(trace_a.layers[start - 1].output)]
        x_dtype = np.asarray(trace_b.layers[start - 1].output).dtype if start else numpy_dtype(in_dtype_b)
        up_dtype = np.asarray(trace_b.layers[end - 1].output).dtype
        if grads:
            up = np.asarray(g if end == n else trace_a.layers[end].input_grads[0]).astype(up_dtype)
        else:  # forward only: zeros where b's backend differentiates, None where it cannot (no gradients)
            up = np.zeros(np.shape(trace_b.layers[end - 1].output), up_dtype) if able_b else None
        part = Sequential(list(layers_b[start:end]))
        own = {f"{j - start}.{k.split('.', 1)[1]}": v for j in range(start, end) for k, v in params_b.items()
               if k.split(".", 1)[0] == str(j)}
        try:
            model = build(backend_b, ParamSource(part, params=own, allow_nonfinite=True))
            seg = get_adapter(backend_b).trace(model, [v.astype(x_dtype) for v in x], up)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this part alone: said, not fatal
            return f"layers {start}..{end - 1} cannot run alone on {backend_b} ({type(exc).__name__}: {exc})"
        seg_allowed = allowances(list(part.layers), seg, own, "{}.", [np.asarray(v, np.float64) for v in x],
                                 None if up is None else np.asarray(up, np.float64), dtype, tol, grads=grads)
        for j in range(start, end):
            traces[j], allowed[j] = seg.layers[j - start], seg_allowed[j - start]
    return traces, allowed
