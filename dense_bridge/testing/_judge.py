"""Judging ``compare_models``' captures: one row per compared quantity, what each side's rounding allows.

The rows and their allowances are described in testing/compare_models.py's module docstring;
this module computes them from one :class:`~dense_bridge.testing._comparison.Comparison`.
Everything is float64 on the host; b is the reference.

Positions. A value computed by the code between linear layers (a layer's input, dL/d(output),
the model output) may come out of attention, which mixes the T positions of each example: a
softmax normalised by a sum over T positions, then a weighted sum over T positions. Both are
reductions of length T, so the formula's fan-in of such a value grows by 2 T; and each output
position sums T terms that each carry the relative differences before it, which add up like
the formula's accumulation term, sqrt(T) times one term's. T is read from the value's own
native shape, (batch, *positions, *features): 1 for a (batch, features) value, which nothing
mixes across rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import EPS
from .._errors import ConversionError
from ..registry._captures import Call, Capture
from ._adapters import adapter_allowance, effective_kernel
from ._comparison import Comparison, dtype_name
from ._elements import element_stats, elementwise_units
from ._report import LayerResult, QuantityResult, first_failure
from ._tolerance import Tolerance, allowed_error, rms

__all__ = ["judge", "rows_of", "row", "GROWTH"]

#: How much the code between two linear layers (attention, norms, activations) may amplify the
#: relative difference it is given before a layer's input counts as diverged (see compare_models).
GROWTH = 32.0


# ---------------------------------------------------------------------------- values
def rows_of(x: np.ndarray, width: int, what: str) -> np.ndarray:
    """A capture as canonical (rows, width) float64: the trailing axes whose sizes multiply to
    ``width`` are the features (an EinsumDense's (batch, seq, heads, head_dim) -> (batch*seq, hidden))."""
    x = np.asarray(x)
    size = 1
    for k in range(x.ndim - 1, -1, -1):
        size *= x.shape[k]
        if size == width:
            return x.astype(np.float64).reshape(-1, width)
        if size > width:
            break
    raise ConversionError(f"{what} of shape {x.shape} cannot be read as (..., {width}): no trailing axes "
                          f"hold {width} features")


def positions(shape: tuple, width: int) -> int:
    """T, the positions per example of a value of native ``shape`` (batch, *positions, *features)
    whose trailing axes hold ``width`` features; 1 when there is no axis between batch and features."""
    size, k = 1, len(shape)
    while k > 0 and size < width:
        k -= 1
        size *= shape[k]
    lead = shape[:k] if size == width else shape[:-1]
    return int(np.prod(lead[1:])) if len(lead) > 1 else 1


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """The typical relative size of a difference, rms(a - b) / rms(b) (0 when b is all 0)."""
    if a.shape != b.shape or not a.size:
        return 0.0 if a.shape == b.shape else math.inf
    scale = rms(b)
    d = rms(np.where(np.isfinite(a - b), a - b, 0.0))
    return d / scale if scale > 0 else 0.0


def row(i, label, name, a, b, allowed, k, note="", *, values=None, dtype: str = "float32",
        stats: bool = True) -> QuantityResult:
    """One judged row: ``a - b`` against ``allowed`` elementwise. ``values``: the two sides' values
    the element statistics (ULPs in ``dtype``, worst element) are read from when what is judged
    is not the values themselves (a layer's own contribution); default ``(a, b)``. ``stats=False``
    leaves those statistics out (a pass/fail verdict needs only the units)."""
    if a.shape != b.shape:
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, tuple(a.shape),
                              f"shape {a.shape} vs {b.shape}")
    if not a.size:
        return QuantityResult(i, label, name, 0.0, 0.0, True, k, tuple(a.shape), note)
    diff, units = elementwise_units(a, b, allowed)
    va, vb = (a, b) if values is None or np.shape(values[0]) != a.shape else values
    stats = element_stats(va, vb, units, dtype) if stats else None
    if not np.isfinite(diff).all():
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, tuple(a.shape),
                              note or "non-finite values in one model only", stats)
    err, u = float(diff.max()), float(units.max())
    return QuantityResult(i, label, name, err, u, u <= 1.0, k, tuple(a.shape), note, stats)


# ---------------------------------------------------------------------------- allowances
def carried(b: np.ndarray, dtype: str, k: int, c: float, tol: Tolerance, prev: float, t: int = 1) -> np.ndarray:
    """Allowance of a value computed by undescribed code: its rounding (fan-in ``k`` + 2 ``t``)
    plus GROWTH x sqrt(``t``) x what it was given, or x its own dtype's roundoff where that is
    more (attention's softmax amplifies the rounding of its logits, ~eps x |logit|, in bfloat16 a
    few eps of its output on its own). ``t``: positions per example (the module docstring)."""
    return (allowed_error(b, dtype, k + 2 * (t - 1), c, tol.atol)
            + GROWTH * math.sqrt(t) * max(prev, EPS[dtype]) * (np.abs(b) + rms(b)))


def rounding(v: np.ndarray, terms: np.ndarray, dtype: str, k: int, c: float, tol: Tolerance) -> np.ndarray:
    """Allowed rounding of a sum v of k products whose absolute values sum to ``terms``: the
    docs/FACTS.md formula plus eps * terms, which also covers a sum that cancels to about 0
    (the gradient of a key projection's bias is 0 in exact arithmetic: its rounding is not).
    eps is the compared dtype's: XLA (Keras on JAX) sums bfloat16 gradients in bfloat16."""
    return allowed_error(v, dtype, k, c, tol.atol) + c * EPS[dtype] * terms


def _cast_term(x: np.ndarray, w: np.ndarray, x_dtype: str, w_dtype: str, c: float) -> np.ndarray | float:
    """A layer whose input arrives wider than its kernel rounds it first: eps * |x| @ |W| more."""
    if EPS[x_dtype] >= EPS[w_dtype]:
        return 0.0
    return c * EPS[w_dtype] * (np.abs(x) @ np.abs(w))


@dataclass
class _Side:
    """One model's call of a layer, canonical and float64, with what its own rounding allows."""

    x: np.ndarray  # (rows, in)
    y: np.ndarray  # (rows, units), what the layer returned (after its activation, if any)
    z: np.ndarray  # x @ W_b + b_b: the pre-activation with the reference's parameters
    pred: np.ndarray  # f(z): what the layer returns if its parameters are b's
    allowed: np.ndarray  # rounding allowed in y - pred
    act: Any
    x_dtype: str


@dataclass
class _Pair:
    """One compared call's layer: b's effective kernel and bias (float64), sizes and dtypes."""

    w: np.ndarray  # (in, units): b's kernel, with its adapter's update where it holds one
    bias: np.ndarray | None
    n_in: int
    n_out: int
    w_dtype: str


def _side(call: Call, w: np.ndarray, bias, own_params: dict, act, layer: _Pair, dtype: str, tol: Tolerance,
          what: str, x_fn=None) -> _Side:
    """One side's call judged against kernel ``w`` (b's, or the side's own for a quantized pair);
    ``own_params``: the side's own canonical params, whose adapter (if any) rounds on its path."""
    from ._propagate import activation_output_allowance

    x = rows_of(call.inputs[0], layer.n_in, f"{what} input")
    y = rows_of(call.output, layer.n_out, f"{what} output")
    xm = x if x_fn is None else x_fn(x)  # what the layer multiplies (Keras int8 quantizes its input)
    z = xm @ w + (0.0 if bias is None else bias)
    terms = np.abs(xm) @ np.abs(w) + (0.0 if bias is None else np.abs(bias))
    x_dtype = dtype_name(call.inputs[0])
    az = (rounding(z, terms, dtype, layer.n_in, tol.c_output, tol)
          + _cast_term(x, w, x_dtype, layer.w_dtype, tol.c_output)
          + adapter_allowance(xm, own_params, dtype, tol, tol.c_output))
    if act is None:
        return _Side(x, y, z, z, az, None, x_dtype)
    with np.errstate(all="ignore"):
        pred = np.asarray(act.forward(z), dtype=np.float64)
    return _Side(x, y, z, pred, activation_output_allowance(act, z, az, y, dtype, tol), act, x_dtype)


def _dz(side: _Side, g, n_out: int, dtype: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """dL/dz of one side's call (dL/dy through its own activation) and the allowance that adds."""
    from ._propagate import activation_vjp

    g = np.zeros_like(side.y) if g is None else rows_of(g, n_out, f"{what} dL/dy")
    if side.act is None:
        return g, np.zeros_like(g)
    return activation_vjp(side.act, side.z, g, dtype)


# ---------------------------------------------------------------------------- the judgement
def _notes(report, cmp: Comparison, cap_a: Capture, cap_b: Capture) -> list[QuantityResult]:
    """The report's notes on quantized pairs, call counts and activations; the failed rows of
    calls a made and b did not."""
    for pb, q in cmp.quant.items():
        report.notes.append(f"{pb}: quantized ({q.what}): each side's output judged against its own "
                            f"kernel, the kernels against one quantization step (row 'quantization'); a "
                            f"quantized kernel has no parameter gradient, so those rows are left out")
    by_a, counts_b = cap_a.by_path(), cap_b.call_counts()
    extra_calls = []
    for pa, pb in cmp.pairs:
        na, nb = len(by_a.get(pa, [])), counts_b.get(pb, 0)
        if na != nb:
            report.notes.append(f"{pb}: called {nb} time(s) in b but {pa} {na} time(s) in a")
            if na > nb:  # calls b never made fail the report (fewer are failed rows below)
                extra_calls.append(QuantityResult(None, pb, "calls", math.inf, math.inf, False, 0, (na,),
                                                  f"{pa} called {na} time(s) in a, {pb} {nb} in b"))
        elif na == 0:
            report.notes.append(f"{pb} ({pa} in a): not called in the forward pass, nothing to compare")
    for pa, pb in cmp.pairs:
        if not cmp.same_activation(pa, pb):
            fa, fb = cmp.acts(pa, pb)

            def what(act, path, cap):
                if path in cap.pre_activation:
                    return f"{path} is captured before its own activation"
                return f"{path} applies {act.name} inside itself" if act else f"{path} applies no activation"
            report.notes.append(f"{what(fb, pb, cap_b)}, {what(fa, pa, cap_a)} (a): each output is judged "
                                f"through its own activation, dL/dy before the activation")
    return extra_calls


def judge(report, cmp: Comparison, cap_b: Capture | None = None, *, carried_only: bool = False) -> None:
    """Fill ``report.layers`` (and ``calls``, notes, ``first_failure``) from ``cmp``'s captures.

    Args:
        report: the :class:`~dense_bridge.testing.compare_models.ModelReport` to fill.
        cmp: the comparison, captured.
        cap_b: b's capture to judge instead of ``cmp.cap_b`` (teacher forcing's forced calls).
        carried_only: ``judge="carried"``: a call whose two sides apply the same map gets the
            value rows of :func:`_carried_rows` instead of its own contribution.
    """
    from ._quantized import quantization_row, table_spread

    cap_a, cap_b = cmp.cap_a, cap_b if cap_b is not None else cmp.cap_b
    tol, dtype, quant = cmp.tol, report.dtype, cmp.quant
    extra_calls = _notes(report, cmp, cap_a, cap_b)
    by_a, counts_b, b_to_a = cap_a.by_path(), cap_b.call_counts(), cmp.b_to_a

    fwd_prev = 0.0  # largest relative difference of anything computed so far (forward)
    if cmp.walks is not None:  # quantized embeddings differ before any linear layer (testing/_quantized.py)
        fwd_prev, table_notes = table_spread(*cmp.walks)
        report.notes += table_notes
    results: list[LayerResult] = []
    rec: list = []  # per row: what the backward pass needs, or None
    layers: dict[str, _Pair] = {}
    for idx, cb in enumerate(cap_b.calls):
        pb = cb.path
        pa = b_to_a[pb]
        report.calls.append((pa, pb, cb.call))
        label = pb if counts_b[pb] == 1 else f"{pb} [call {cb.call}]"
        if pa != pb:
            label += f" <- {pa}"
        calls_a = by_a.get(pa, [])
        ca = calls_a[cb.call] if cb.call < len(calls_a) else None
        kb = cmp.params_b[pb].get("kernel")
        if ca is None:
            results.append(LayerResult(idx, label, (QuantityResult(
                idx, label, "output", math.inf, math.inf, False, 0, tuple(cb.output.shape),
                f"no call {cb.call} of {pa} in a"),)))
            rec.append(None)
            continue
        if kb is None or kb.ndim != 2 or len(cb.inputs) != 1 or len(ca.inputs) != 1:
            ya, yb = np.asarray(ca.output, np.float64), np.asarray(cb.output, np.float64)
            results.append(LayerResult(idx, label, (row(idx, label, "output", ya, yb, allowed_error(
                yb, dtype, 1, tol.c_output, tol.atol), 0, "not a one-input linear map: compared as values",
                dtype=dtype),)))
            rec.append(None)
            continue
        if pb not in layers:
            bias = cmp.params_b[pb].get("bias")
            layers[pb] = _Pair(effective_kernel(cmp.params_b[pb]), None if bias is None else bias.astype(np.float64),
                               kb.shape[0], kb.shape[1], dtype_name(kb))
        layer = layers[pb]
        n_in, n_out = layer.n_in, layer.n_out
        fa, fb = cmp.acts(pa, pb)
        q = quant.get(pb)
        if carried_only and q is None and not cmp.grads and fa == fb:  # same map on both sides: values comparable
            rows, fwd_prev = _carried_rows(idx, label, ca, cb, pa, pb, layer, dtype, tol, fwd_prev)
            results.append(LayerResult(idx, label, rows))
            rec.append(None)
            continue
        sa = _side(ca, layer.w if q is None else q.kernel_a, layer.bias if q is None else q.bias_a,
                   cmp.params_a[pa], fa, layer, dtype, tol, pa, None if q is None else q.input_a)
        sb = _side(cb, layer.w, layer.bias, cmp.params_b[pb], fb, layer, dtype, tol, pb,
                   None if q is None else q.input_b)
        t = positions(np.shape(cb.inputs[0]), n_in)
        rows = [row(idx, label, "input", sa.x, sb.x, carried(sb.x, dtype, n_in, tol.c_output, tol, fwd_prev, t)
                    if sa.x.shape == sb.x.shape else 0.0, n_in, dtype=dtype)]
        if sa.x.shape == sb.x.shape and sa.y.shape == sb.y.shape:
            # the layer's own contribution: each side's output minus what b's parameters make of its input
            rows.append(row(idx, label, "output", sa.y - sa.pred, sb.y - sb.pred,
                            np.sqrt(np.square(sa.allowed) + np.square(sb.allowed)), n_in,
                            values=(sa.y, sb.y), dtype=dtype))
            fwd_prev = max(fwd_prev, rel(sa.x, sb.x))
            if cmp.same_activation(pa, pb):
                fwd_prev = max(fwd_prev, rel(sa.y, sb.y))
        else:
            rows.append(row(idx, label, "output", sa.y, sb.y, 0.0, n_in, dtype=dtype))
        if q is not None and sa.x.shape == sb.x.shape:
            rows.append(quantization_row(idx, label, q, kb, sb.x))
        results.append(LayerResult(idx, label, tuple(rows)))
        rec.append((pa, pb, ca, cb, sa, sb, n_in, n_out))

    final = None
    if cap_a.output is not None and cap_b.output is not None:
        oa, ob = np.asarray(cap_a.output).astype(np.float64), np.asarray(cap_b.output).astype(np.float64)
        if oa.size == ob.size and oa.shape != ob.shape:
            oa = oa.reshape(ob.shape)
        width = ob.shape[-1] if ob.ndim else 1
        t = positions(ob.shape, width) if ob.ndim else 1
        final = row(None, "model", "model output", oa, ob,
                    carried(ob, dtype, width, tol.c_output, tol, fwd_prev, t) if oa.shape == ob.shape else 0.0,
                    width, dtype=dtype, stats=not carried_only)
        fwd_prev = max(fwd_prev, rel(oa, ob))

    if cmp.grads:
        _backward(report, cmp, cap_a, cap_b, results, rec, fwd_prev)
    model_rows = ([final] if final is not None else []) + extra_calls
    report.layers = results + ([LayerResult(None, "model", tuple(model_rows))] if model_rows else [])
    report.first_failure = first_failure(report.layers)


def _backward(report, cmp: Comparison, cap_a: Capture, cap_b: Capture, results: list, rec: list,
              fwd_prev: float) -> None:
    """The backward rows, in reverse execution order: each call's dL/dy (carried), and at each
    layer's first call its parameter gradients (own contribution); ``results`` updated in place."""
    from ._quantized import backward_spread

    dtype, tol, quant = report.dtype, cmp.tol, cmp.quant
    bwd_prev = fwd_prev  # the backward through undescribed code also uses the forward values
    first_call: dict[str, int] = {}
    for i, r in enumerate(rec):
        if r is not None and r[1] not in first_call:
            first_call[r[1]] = i
    dzs: dict[int, tuple] = {}
    for i in range(len(rec) - 1, -1, -1):
        r = rec[i]
        if r is None:
            continue
        pa, pb, ca, cb, sa, sb, n_in, n_out = r
        extra = []
        if ca.output_grad is not None or cb.output_grad is not None:
            ga, aga = _dz(sa, ca.output_grad, n_out, dtype, pa)
            gb, agb = _dz(sb, cb.output_grad, n_out, dtype, pb)
            dzs[i] = (ga, gb, aga, agb)
            same = (sa.act is None) == (sb.act is None) and (sa.act is None or sa.act == sb.act)
            if same:  # compare what each framework gave: dL/dy
                qa = np.zeros_like(sa.y) if ca.output_grad is None else rows_of(ca.output_grad, n_out, pa)
                qb = np.zeros_like(sb.y) if cb.output_grad is None else rows_of(cb.output_grad, n_out, pb)
                note, extra_allowed = "", 0.0
            else:  # the activation sits inside one layer only: compare before it, dL/dz
                qa, qb, note, extra_allowed = ga, gb, "before the activation (dL/dz)", np.sqrt(aga ** 2 + agb ** 2)
            t = positions(np.shape(cb.output), n_out)
            extra.append(row(i, results[i].layer_type, "dL/dy", qa, qb,
                             carried(qb, dtype, n_out, tol.c_gradient, tol, bwd_prev, t) + extra_allowed,
                             n_out, note, dtype=dtype))
            bwd_prev = max(bwd_prev, rel(qa, qb))
            if pb in quant:  # dL/dx leaves through two different kernels: the quantization's own share
                bwd_prev = max(bwd_prev, backward_spread(quant[pb], gb, cmp.params_b[pb]["kernel"]))
        if first_call.get(pb) == i and pb not in quant:
            extra += _param_rows(i, results[i].layer_type, pa, pb, cap_a, cap_b, rec, dzs, dtype, tol)
        if extra:
            results[i] = LayerResult(i, results[i].layer_type, results[i].quantities + tuple(extra))


def _carried_rows(idx, label, ca: Call, cb: Call, pa, pb, layer: _Pair, dtype, tol: Tolerance,
                  prev: float) -> tuple[tuple, float]:
    """``judge="carried"``'s rows of one call, (input row, output row), and the largest relative
    difference so far. Each is judged as a value the code before it computed (:func:`carried`:
    the formula's rounding, K = in_features, plus GROWTH x ``prev``, the largest relative
    difference so far, which the output's row takes after adding its input's)."""
    n_in, n_out = layer.n_in, layer.n_out
    xa, xb = rows_of(ca.inputs[0], n_in, f"{pa} input"), rows_of(cb.inputs[0], n_in, f"{pb} input")
    ya, yb = rows_of(ca.output, n_out, f"{pa} output"), rows_of(cb.output, n_out, f"{pb} output")
    t = positions(np.shape(cb.inputs[0]), n_in)
    same_x = xa.shape == xb.shape
    x_row = row(idx, label, "input", xa, xb, carried(xb, dtype, n_in, tol.c_output, tol, prev, t) if same_x else 0.0,
                n_in, dtype=dtype, stats=False)
    prev = max(prev, rel(xa, xb)) if same_x else prev
    same_y = ya.shape == yb.shape
    y_row = row(idx, label, "output", ya, yb, carried(yb, dtype, n_in, tol.c_output, tol, prev, t) if same_y else 0.0,
                n_in, dtype=dtype, stats=False)
    return (x_row, y_row), max(prev, rel(ya, yb)) if same_y else prev


def _param_rows(i, label, pa, pb, cap_a: Capture, cap_b: Capture, rec, dzs, dtype, tol: Tolerance) -> list:
    """dL/dkernel, dL/dbias on their own contribution: each side's autograd gradient minus the sum
    over the layer's calls of x^T dL/dz (resp. of dL/dz), computed in float64 from its captures."""
    pg_a, pg_b = cap_a.param_grads.get(pa), cap_b.param_grads.get(pb)
    if pg_a is None and pg_b is None:
        return []
    want: dict[str, list] = {"kernel": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], "bias": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]}
    n_rows = 0
    for j, r in enumerate(rec):
        if r is None or r[1] != pb or j not in dzs:
            continue
        sa, sb = r[4], r[5]
        ga, gb, aga, agb = dzs[j]
        for side, (x, g, ag) in enumerate(((sa.x, ga, aga), (sb.x, gb, agb))):
            k, bb = want["kernel"], want["bias"]
            k[side] = k[side] + x.T @ g
            k[2 + side] = k[2 + side] + np.abs(x).T @ np.abs(g)  # the size of the terms summed
            k[4 + side] = k[4 + side] + np.abs(x).T @ ag  # what dL/dz's own evaluation adds
            bb[side] = bb[side] + g.sum(0)
            bb[2 + side] = bb[2 + side] + np.abs(g).sum(0)
            bb[4 + side] = bb[4 + side] + ag.sum(0)
        n_rows += sb.x.shape[0]
    out = []
    for name in ("kernel", "bias"):
        va = None if pg_a is None else pg_a.get(name)
        vb = None if pg_b is None else pg_b.get(name)
        if va is None and vb is None:
            continue
        q = f"dL/d{name}"
        # a layer the backward pass does not reach: torch reports no gradient, Keras and MLX zeros
        if va is None and not np.any(np.asarray(vb, dtype=np.float64)):
            va = np.zeros(np.shape(vb))
        if vb is None and not np.any(np.asarray(va, dtype=np.float64)):
            vb = np.zeros(np.shape(va))
        if va is None or vb is None:
            side = "a" if va is None else "b"
            shape = tuple(np.shape(vb if va is None else va))
            out.append(QuantityResult(i, label, q, math.inf, math.inf, False, n_rows, shape, f"absent in {side}"))
            continue
        ea, eb, ta, tb, xa, xb = want[name]
        va, vb = np.asarray(va).astype(np.float64), np.asarray(vb).astype(np.float64)
        if va.shape != np.shape(ea) or vb.shape != np.shape(eb):
            out.append(QuantityResult(i, label, q, math.inf, math.inf, False, n_rows, va.shape,
                                      f"shape {va.shape} vs {vb.shape}, expected {np.shape(eb)}"))
            continue
        allowed = np.sqrt(np.square(rounding(va, ta, dtype, n_rows, tol.c_gradient, tol) + xa)
                          + np.square(rounding(vb, tb, dtype, n_rows, tol.c_gradient, tol) + xb))
        out.append(row(i, label, q, va - ea, vb - eb, allowed, n_rows, values=(va, vb), dtype=dtype))
    return out
