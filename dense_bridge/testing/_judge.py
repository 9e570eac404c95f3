"""Judging ``compare_models``' captures: one row per compared quantity, what each side's rounding allows.

The rows and their allowances are described in testing/compare_models.py's module docstring;
this module computes them from one :class:`~dense_bridge.testing._comparison.Comparison`.
Everything is float64, computed in the comparison's array namespace (``cmp.xp``, ``_namespace``:
the captures' own framework and device, or host numpy); only scalars come to the host. b is the
reference. Arrays below are of that namespace unless named numpy.

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
from ._adapters import adapter_allowance, adapter_of, effective_kernel
from ._comparison import Comparison, dtype_name
from ._elements import element_stats, elementwise_units
from ._namespace import NUMPY, ArrayNamespace
from ._report import LayerResult, QuantityResult, first_failure
from ._tolerance import Tolerance, allowed_error, rms

__all__ = ["judge", "rows_of", "row", "GROWTH"]

#: How much the code between two linear layers (attention, norms, activations) may amplify the
#: relative difference it is given before a layer's input counts as diverged (see compare_models).
GROWTH = 32.0


# ---------------------------------------------------------------------------- values
def rows_of(x, width: int, what: str, xp: ArrayNamespace = NUMPY):
    """A capture (any array ``xp`` reads) as canonical (rows, width) float64 of ``xp``: the trailing
    axes whose sizes multiply to ``width`` are the features (an EinsumDense's (batch, seq, heads,
    head_dim) -> (batch*seq, hidden))."""
    shape = tuple(int(d) for d in np.shape(x))
    size = 1
    for k in range(len(shape) - 1, -1, -1):
        size *= shape[k]
        if size == width:
            return xp.asarray(x).reshape(-1, width)
        if size > width:
            break
    raise ConversionError(f"{what} of shape {shape} cannot be read as (..., {width}): no trailing axes "
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


def rel(a, b, xp: ArrayNamespace = NUMPY) -> float:
    """The typical relative size of a difference, rms(a - b) / rms(b) (0 when b is all 0); one
    host synchronisation."""
    if a.shape != b.shape or not xp.size(a):
        return 0.0 if a.shape == b.shape else math.inf
    scale, d = xp.scalars(rms(b, xp), rms(xp.where(xp.isfinite(a - b), a - b, 0.0), xp))
    return d / scale if scale > 0 else 0.0


def row(at: tuple, name: str, a, b, allowed, k: int, note: str = "", *, values=None,
        dtype: str = "float32", stats: bool = True, xp: ArrayNamespace = NUMPY) -> QuantityResult:
    """One judged row: ``a - b`` against ``allowed`` elementwise (arrays of ``xp``, any one shape;
    ``allowed`` broadcast to it).

    Args:
        at: (row index or None for the model, label).
        name: the quantity ("input", "output", "dL/dy", ...); ``k``: its fan-in, for the report.
        values: the two sides' values the element statistics (ULPs in ``dtype``, worst element)
            are read from when what is judged is not the values themselves (a layer's own
            contribution); default ``(a, b)``.
        stats: False leaves those statistics out (a pass/fail verdict needs only the units).
    """
    i, label = at
    shape = tuple(int(d) for d in a.shape)
    if a.shape != b.shape:
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, shape,
                              f"shape {shape} vs {tuple(int(d) for d in b.shape)}")
    if not xp.size(a):
        return QuantityResult(i, label, name, 0.0, 0.0, True, k, shape, note)
    diff, units = elementwise_units(a, b, allowed, xp)
    va, vb = (a, b) if values is None or tuple(np.shape(values[0])) != shape else values
    stats = element_stats(va, vb, units, dtype, xp) if stats else None
    err, u = xp.scalars(diff.max(), units.max())  # diff is inf where it is not finite
    if not math.isfinite(err):
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, shape,
                              note or "non-finite values in one model only", stats)
    return QuantityResult(i, label, name, err, u, u <= 1.0, k, shape, note, stats)


# ---------------------------------------------------------------------------- allowances
def carried(b, dtype: str, k: int, c: float, tol: Tolerance, prev: float, t: int = 1, xp: ArrayNamespace = NUMPY):
    """Allowance of a value computed by undescribed code: its rounding (fan-in ``k`` + 2 ``t``)
    plus GROWTH x sqrt(``t``) x what it was given, or x its own dtype's roundoff where that is
    more (attention's softmax amplifies the rounding of its logits, ~eps x |logit|, in bfloat16 a
    few eps of its output on its own). ``t``: positions per example (the module docstring).
    ``b``: an array of ``xp``; returns its shape."""
    return (allowed_error(b, dtype, k + 2 * (t - 1), c, tol.atol, xp)
            + GROWTH * math.sqrt(t) * max(prev, EPS[dtype]) * (xp.abs(b) + rms(b, xp)))


def rounding(v, terms, dtype: str, k: int, c: float, tol: Tolerance, xp: ArrayNamespace = NUMPY):
    """Allowed rounding of a sum v of k products whose absolute values sum to ``terms``: the
    docs/FACTS.md formula plus eps * terms, which also covers a sum that cancels to about 0
    (the gradient of a key projection's bias is 0 in exact arithmetic: its rounding is not).
    eps is the compared dtype's: XLA (Keras on JAX) sums bfloat16 gradients in bfloat16."""
    return allowed_error(v, dtype, k, c, tol.atol, xp) + c * EPS[dtype] * terms


def _cast_term(x, w, x_dtype: str, w_dtype: str, c: float, xp: ArrayNamespace = NUMPY):
    """A layer whose input arrives wider than its kernel rounds it first: eps * |x| @ |W| more
    (x (rows, in), w (in, units) -> (rows, units), or 0.0)."""
    if EPS[x_dtype] >= EPS[w_dtype]:
        return 0.0
    return c * EPS[w_dtype] * (xp.abs(x) @ xp.abs(w))


@dataclass
class _Side:
    """One model's call of a layer, canonical and float64 (arrays of the judge's namespace), with
    what its own rounding allows."""

    x: Any  # (rows, in)
    y: Any  # (rows, units), what the layer returned (after its activation, if any)
    z: Any  # x @ W_b + b_b: the pre-activation with the reference's parameters
    pred: Any  # f(z): what the layer returns if its parameters are b's
    allowed: Any  # rounding allowed in y - pred
    act: Any
    x_dtype: str


@dataclass
class _Pair:
    """A compared pair of layers: b's effective kernel and bias (float64, in the judge's namespace:
    one copy there per pair), sizes, dtype, and the activation each side's recorded output includes."""

    pa: str
    pb: str
    w: Any  # (in, units): b's kernel, with its adapter's update where it holds one
    bias: Any  # (units,) or None
    w_dtype: str
    acts: tuple  # (a's, b's)

    @property
    def n_in(self) -> int:
        return self.w.shape[0]

    @property
    def n_out(self) -> int:
        return self.w.shape[1]


@dataclass
class _Judged:
    """One call judged forward, with what its backward rows need."""

    at: tuple  # (row index, label)
    layer: _Pair
    ca: Call
    cb: Call
    sa: _Side
    sb: _Side


def judge(report, cmp: Comparison, cap_b: Capture | None = None, *, carried_only: bool = False) -> None:
    """Fill ``report.layers`` (and ``calls``, notes, ``first_failure``) from ``cmp``'s captures.

    Args:
        report: the :class:`~dense_bridge.testing.compare_models.ModelReport` to fill.
        cmp: the comparison, captured.
        cap_b: b's capture to judge instead of ``cmp.cap_b`` (teacher forcing's forced calls).
        carried_only: ``judge="carried"``: a call whose two sides apply the same map gets the
            value rows of :meth:`_Judge.carried_rows` instead of its own contribution.
    """
    with getattr(cmp, "xp", NUMPY).scope():
        _Judge(report, cmp, cap_b or cmp.cap_b, carried_only).run()


class _Judge:
    """One judgement of ``cmp``'s captures into ``report``: the forward rows in execution order
    (carrying the largest relative difference so far, ``prev``), the model output, then the
    backward rows in reverse."""

    def __init__(self, report, cmp: Comparison, cap_b: Capture, carried_only: bool) -> None:
        self.report, self.cmp, self.cap_a, self.cap_b = report, cmp, cmp.cap_a, cap_b
        self.dtype, self.tol, self.carried_only = report.dtype, cmp.tol, carried_only
        self.xp: ArrayNamespace = getattr(cmp, "xp", NUMPY)
        self.results: list[LayerResult] = []
        self.judged: list[_Judged | None] = []  # per row: what the backward pass needs, or None
        self.dzs: dict[int, tuple] = {}  # per row: (dL/dz a, dL/dz b, their allowances)
        self.pairs: dict[str, _Pair] = {}
        self.prev = 0.0  # largest relative difference of anything computed so far

    def row(self, at, name, a, b, allowed, k, note="", *, values=None, stats=True) -> QuantityResult:
        return row(at, name, a, b, allowed, k, note, values=values, dtype=self.dtype, stats=stats, xp=self.xp)

    def carried(self, b, k: int, c: float, shape: tuple, width: int):
        """:func:`carried` for a value of native ``shape`` whose trailing axes hold ``width``."""
        return carried(b, self.dtype, k, c, self.tol, self.prev, positions(tuple(shape), width), self.xp)

    def rows(self, x, width: int, what: str):
        """:func:`rows_of` in this judge's namespace."""
        return rows_of(x, width, what, self.xp)

    def rel(self, a, b) -> float:
        return rel(a, b, self.xp)

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        from ._quantized import table_spread

        extra_calls = self.notes()
        if self.cmp.walks is not None:  # quantized embeddings differ before any linear layer (_quantized)
            self.prev, table_notes = table_spread(*self.cmp.walks)
            self.report.notes += table_notes
        by_a, counts_b, b_to_a = self.cap_a.by_path(), self.cap_b.call_counts(), self.cmp.b_to_a
        for idx, cb in enumerate(self.cap_b.calls):
            pb = cb.path
            pa = b_to_a[pb]
            self.report.calls.append((pa, pb, cb.call))
            label = pb if counts_b[pb] == 1 else f"{pb} [call {cb.call}]"
            if pa != pb:
                label += f" <- {pa}"
            calls_a = by_a.get(pa, [])
            self.forward((idx, label), calls_a[cb.call] if cb.call < len(calls_a) else None, cb, pa)
        final = self.model_output()
        if self.cmp.grads:
            self.backward()
        model_rows = ([final] if final is not None else []) + extra_calls
        self.report.layers = self.results + ([LayerResult(None, "model", tuple(model_rows))] if model_rows else [])
        self.report.first_failure = first_failure(self.report.layers)

    def notes(self) -> list[QuantityResult]:
        """The report's notes on quantized pairs, call counts and activations; the failed rows of
        calls a made and b did not."""
        report, cmp = self.report, self.cmp
        for pb, q in cmp.quant.items():
            report.notes.append(f"{pb}: quantized ({q.what}): each side's output judged against its own "
                                f"kernel, the kernels against one quantization step (row 'quantization'); a "
                                f"quantized kernel has no parameter gradient, so those rows are left out")
        by_a, counts_b = self.cap_a.by_path(), self.cap_b.call_counts()
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
                report.notes.append(f"{what(fb, pb, self.cap_b)}, {what(fa, pa, self.cap_a)} (a): each output is "
                                    f"judged through its own activation, dL/dy before the activation")
        return extra_calls

    def pair(self, pa: str, pb: str) -> _Pair | None:
        """The compared pair behind b's path ``pb``, or None when it is not a 2-D kernel."""
        if pb not in self.pairs:
            params = self.cmp.params_b[pb]
            kb, bias = params.get("kernel"), params.get("bias")
            self.pairs[pb] = None if kb is None or kb.ndim != 2 else _Pair(
                pa, pb, self.xp.asarray(effective_kernel(params)), None if bias is None else self.xp.asarray(bias),
                dtype_name(kb), self.cmp.acts(pa, pb))
        return self.pairs[pb]

    # ------------------------------------------------------------------ forward
    def forward(self, at: tuple, ca: Call | None, cb: Call, pa: str) -> None:
        """The rows of one call of b's layer (``ca``: a's call of the same number, or None)."""
        from ._quantized import quantization_row

        idx, pb, tol = at[0], cb.path, self.tol
        layer = self.pair(pa, pb)
        if ca is None:
            self.results.append(LayerResult(idx, at[1], (QuantityResult(
                idx, at[1], "output", math.inf, math.inf, False, 0, tuple(cb.output.shape),
                f"no call {cb.call} of {pa} in a"),)))
            self.judged.append(None)
            return
        if layer is None or len(cb.inputs) != 1 or len(ca.inputs) != 1:
            ya, yb = self.xp.asarray(ca.output), self.xp.asarray(cb.output)
            self.results.append(LayerResult(idx, at[1], (self.row(at, "output", ya, yb, allowed_error(
                yb, self.dtype, 1, tol.c_output, tol.atol, self.xp), 0, "not a one-input linear map: compared as values"),)))
            self.judged.append(None)
            return
        q = self.cmp.quant.get(pb)
        if self.carried_only and q is None and not self.cmp.grads and layer.acts[0] == layer.acts[1]:
            self.results.append(LayerResult(idx, at[1], self.carried_rows(at, ca, cb, layer)))
            self.judged.append(None)  # same map on both sides: values comparable
            return
        sa, sb = self.side(ca, layer, "a"), self.side(cb, layer, "b")
        n_in = layer.n_in
        same_x = sa.x.shape == sb.x.shape
        rows = [self.row(at, "input", sa.x, sb.x, self.carried(sb.x, n_in, tol.c_output, np.shape(cb.inputs[0]),
                                                                  n_in) if same_x else 0.0, n_in)]
        if same_x and sa.y.shape == sb.y.shape:
            # the layer's own contribution: each side's output minus what b's parameters make of its input
            xp = self.xp
            rows.append(self.row(at, "output", sa.y - sa.pred, sb.y - sb.pred,
                                 xp.sqrt(xp.square(sa.allowed) + xp.square(sb.allowed)), n_in, values=(sa.y, sb.y)))
            self.prev = max(self.prev, self.rel(sa.x, sb.x))
            if self.cmp.same_activation(pa, pb):
                self.prev = max(self.prev, self.rel(sa.y, sb.y))
        else:
            rows.append(self.row(at, "output", sa.y, sb.y, 0.0, n_in))
        if q is not None and same_x:
            rows.append(quantization_row(idx, at[1], q, self.cmp.params_b[pb]["kernel"], sb.x))
        self.results.append(LayerResult(idx, at[1], tuple(rows)))
        self.judged.append(_Judged(at, layer, ca, cb, sa, sb))

    def side(self, call: Call, layer: _Pair, which: str) -> _Side:
        """One side's call judged against b's kernel (the side's own for a quantized pair); the
        side's own adapter (if any) rounds on its path."""
        from ._propagate import activation_output_allowance

        tol, dtype, q, xp = self.tol, self.dtype, self.cmp.quant.get(layer.pb), self.xp
        if which == "a":
            w, bias = (layer.w, layer.bias) if q is None else (q.kernel_a, q.bias_a)
            params, act, x_fn, what = self.cmp.params_a[layer.pa], layer.acts[0], q and q.input_a, layer.pa
        else:
            w, bias = layer.w, layer.bias
            params, act, x_fn, what = self.cmp.params_b[layer.pb], layer.acts[1], q and q.input_b, layer.pb
        x = self.rows(call.inputs[0], layer.n_in, f"{what} input")
        y = self.rows(call.output, layer.n_out, f"{what} output")
        xm = x if x_fn is None else x_fn(x)  # what the layer multiplies (Keras int8 quantizes its input)
        z = xm @ w + (0.0 if bias is None else bias)
        terms = xp.abs(xm) @ xp.abs(w) + (0.0 if bias is None else xp.abs(bias))
        name = xp.dtype_name(call.inputs[0])
        x_dtype = name if name in EPS else "float32"
        az = (rounding(z, terms, dtype, layer.n_in, tol.c_output, tol, xp)
              + _cast_term(x, w, x_dtype, layer.w_dtype, tol.c_output, xp)
              + (0.0 if adapter_of(params) is None else _on_host(xp, adapter_allowance, xm, params, dtype, tol,
                                                                   tol.c_output)))
        if act is None:
            return _Side(x, y, z, z, az, None, x_dtype)
        with np.errstate(all="ignore"):
            pred = xp.asarray(np.asarray(act.forward(xp.to_host(z)), dtype=np.float64))
        return _Side(x, y, z, pred, _on_host(xp, activation_output_allowance, act, z, az, y, dtype, tol), act,
                     x_dtype)

    def carried_rows(self, at: tuple, ca: Call, cb: Call, layer: _Pair) -> tuple:
        """``judge="carried"``'s rows of one call, (input row, output row). Each is judged as a
        value the code before it computed (:func:`carried`: the formula's rounding, K =
        in_features, plus GROWTH x ``prev``, which the output's row takes after adding its
        input's)."""
        n_in, n_out, c = layer.n_in, layer.n_out, self.tol.c_output
        xa, xb = self.rows(ca.inputs[0], n_in, f"{layer.pa} input"), self.rows(cb.inputs[0], n_in, f"{layer.pb} input")
        ya, yb = self.rows(ca.output, n_out, f"{layer.pa} output"), self.rows(cb.output, n_out, f"{layer.pb} output")
        shape = tuple(np.shape(cb.inputs[0]))
        same_x = xa.shape == xb.shape
        x_row = self.row(at, "input", xa, xb, self.carried(xb, n_in, c, shape, n_in) if same_x else 0.0, n_in,
                         stats=False)
        self.prev = max(self.prev, self.rel(xa, xb)) if same_x else self.prev
        same_y = ya.shape == yb.shape
        y_row = self.row(at, "output", ya, yb, self.carried(yb, n_in, c, shape, n_in) if same_y else 0.0, n_in,
                         stats=False)
        self.prev = max(self.prev, self.rel(ya, yb)) if same_y else self.prev
        return x_row, y_row

    def model_output(self) -> QuantityResult | None:
        if self.cap_a.output is None or self.cap_b.output is None:
            return None
        xp = self.xp
        oa, ob = xp.asarray(self.cap_a.output), xp.asarray(self.cap_b.output)
        if xp.size(oa) == xp.size(ob) and oa.shape != ob.shape:
            oa = oa.reshape(ob.shape)
        width = int(ob.shape[-1]) if ob.ndim else 1
        final = self.row((None, "model"), "model output", oa, ob,
                         self.carried(ob, width, self.tol.c_output, ob.shape, width) if oa.shape == ob.shape else 0.0,
                         width, stats=not self.carried_only)
        self.prev = max(self.prev, self.rel(oa, ob))
        return final

    # ------------------------------------------------------------------ backward
    def backward(self) -> None:
        """The backward rows, in reverse execution order: each call's dL/dy (carried; the backward
        through undescribed code also uses the forward values, so ``prev`` goes on), and at each
        layer's first call its parameter gradients (own contribution)."""
        from ._quantized import backward_spread

        first_call: dict[str, int] = {}
        for i, j in enumerate(self.judged):
            if j is not None and j.layer.pb not in first_call:
                first_call[j.layer.pb] = i
        for i in range(len(self.judged) - 1, -1, -1):
            j = self.judged[i]
            if j is None:
                continue
            pb, extra = j.layer.pb, []
            if j.ca.output_grad is not None or j.cb.output_grad is not None:
                extra.append(self.dy_row(i, j))
                if pb in self.cmp.quant:  # dL/dx leaves through two different kernels: the quantization's share
                    self.prev = max(self.prev, backward_spread(self.cmp.quant[pb], self.dzs[i][1],
                                                               self.cmp.params_b[pb]["kernel"]))
            if first_call.get(pb) == i and pb not in self.cmp.quant:
                extra += self.param_rows(j)
            if extra:
                self.results[i] = LayerResult(i, self.results[i].layer_type, self.results[i].quantities + tuple(extra))

    def dy_row(self, i: int, j: _Judged) -> QuantityResult:
        """The dL/dy row of call ``i`` (before the activation, dL/dz, where only one side's layer
        applies it); keeps each side's dL/dz for the parameter-gradient rows."""
        n_out, (pa, pb) = j.layer.n_out, (j.layer.pa, j.layer.pb)
        xp = self.xp
        ga, aga = _dz(j.sa, j.ca.output_grad, n_out, self.dtype, pa, xp)
        gb, agb = _dz(j.sb, j.cb.output_grad, n_out, self.dtype, pb, xp)
        self.dzs[i] = (ga, gb, aga, agb)
        if j.sa.act is None and j.sb.act is None:  # no activation: dL/dz is dL/dy, read once
            qa, qb, note, extra_allowed = ga, gb, "", 0.0
        elif (j.sa.act is None) == (j.sb.act is None) and j.sa.act == j.sb.act:
            qa = xp.zeros_like(j.sa.y) if j.ca.output_grad is None else self.rows(j.ca.output_grad, n_out, pa)
            qb = xp.zeros_like(j.sb.y) if j.cb.output_grad is None else self.rows(j.cb.output_grad, n_out, pb)
            note, extra_allowed = "", 0.0  # compare what each framework gave: dL/dy
        else:  # the activation sits inside one layer only: compare before it, dL/dz
            qa, qb, note, extra_allowed = ga, gb, "before the activation (dL/dz)", xp.sqrt(aga ** 2 + agb ** 2)
        allowed = self.carried(qb, n_out, self.tol.c_gradient, tuple(np.shape(j.cb.output)), n_out) + extra_allowed
        self.prev = max(self.prev, self.rel(qa, qb))
        return self.row((i, self.results[i].layer_type), "dL/dy", qa, qb, allowed, n_out, note)

    def param_rows(self, first: _Judged) -> list:
        """dL/dkernel, dL/dbias of ``first``'s layer on their own contribution: each side's
        autograd gradient minus the sum over the layer's calls of x^T dL/dz (resp. of dL/dz),
        computed in float64 from its captures (in the judge's namespace)."""
        xp = self.xp
        pa, pb = first.layer.pa, first.layer.pb
        at = (first.at[0], self.results[first.at[0]].layer_type)
        pg_a, pg_b = self.cap_a.param_grads.get(pa), self.cap_b.param_grads.get(pb)
        if pg_a is None and pg_b is None:
            return []
        want: dict[str, list] = {"kernel": [0.0] * 6, "bias": [0.0] * 6}
        n_rows = 0
        for i, j in enumerate(self.judged):
            if j is None or j.layer.pb != pb or i not in self.dzs:
                continue
            ga, gb, aga, agb = self.dzs[i]
            for side, (x, g, ag) in enumerate(((j.sa.x, ga, aga), (j.sb.x, gb, agb))):
                k, bb = want["kernel"], want["bias"]
                k[side] = k[side] + x.T @ g
                k[2 + side] = k[2 + side] + xp.abs(x).T @ xp.abs(g)  # the size of the terms summed
                k[4 + side] = k[4 + side] + xp.abs(x).T @ ag  # what dL/dz's own evaluation adds
                bb[side] = bb[side] + g.sum(0)
                bb[2 + side] = bb[2 + side] + xp.abs(g).sum(0)
                bb[4 + side] = bb[4 + side] + ag.sum(0)
            n_rows += j.sb.x.shape[0]
        out = []
        for name in ("kernel", "bias"):
            va = None if pg_a is None else pg_a.get(name)
            vb = None if pg_b is None else pg_b.get(name)
            if va is None and vb is None:
                continue
            q = f"dL/d{name}"
            # a layer the backward pass does not reach: torch reports no gradient, Keras and MLX zeros
            if va is None and not _any(xp, vb):
                va = xp.zeros(np.shape(vb))
            if vb is None and not _any(xp, va):
                vb = xp.zeros(np.shape(va))
            if va is None or vb is None:
                side = "a" if va is None else "b"
                shape = tuple(np.shape(vb if va is None else va))
                out.append(QuantityResult(at[0], at[1], q, math.inf, math.inf, False, n_rows, shape,
                                          f"absent in {side}"))
                continue
            ea, eb, ta, tb, xa, xb = want[name]
            va, vb = xp.asarray(va), xp.asarray(vb)
            sa, sb, se = (tuple(int(d) for d in np.shape(v)) for v in (va, vb, eb))
            if sa != tuple(np.shape(ea)) or sb != se:
                out.append(QuantityResult(at[0], at[1], q, math.inf, math.inf, False, n_rows, sa,
                                          f"shape {sa} vs {sb}, expected {se}"))
                continue
            c = self.tol.c_gradient
            allowed = xp.sqrt(xp.square(rounding(va, ta, self.dtype, n_rows, c, self.tol, xp) + xa)
                              + xp.square(rounding(vb, tb, self.dtype, n_rows, c, self.tol, xp) + xb))
            out.append(self.row(at, q, va - ea, vb - eb, allowed, n_rows, values=(va, vb)))
        return out


def _dz(side: _Side, g, n_out: int, dtype: str, what: str, xp: ArrayNamespace = NUMPY) -> tuple:
    """dL/dz (rows, units) of one side's call (dL/dy through its own activation) and the
    allowance that adds, both arrays of ``xp``."""
    from ._propagate import activation_vjp

    g = xp.zeros_like(side.y) if g is None else rows_of(g, n_out, f"{what} dL/dy", xp)
    if side.act is None:
        return g, xp.zeros_like(g)
    if xp is NUMPY:
        return activation_vjp(side.act, side.z, g, dtype)
    dz, allowed = activation_vjp(side.act, xp.to_host(side.z), xp.to_host(g), dtype)
    return xp.asarray(dz), xp.asarray(allowed)


def _any(xp: ArrayNamespace, v) -> bool:
    """Does ``v`` (any array ``xp`` reads) hold a nonzero value? One scalar to the host."""
    v = xp.asarray(v)
    return bool(xp.scalars(xp.sum(v != 0))[0]) if xp.size(v) else False


def _on_host(xp: ArrayNamespace, fn, *args):
    """``fn(*args)``, numpy code (an activation's or an adapter's own rounding), run on the host:
    ``xp``'s arrays among ``args`` copied there once, an array result copied back (a float kept)."""
    if xp is NUMPY:
        return fn(*args)
    got = fn(*(xp.to_host(a) if _is_array(a) else a for a in args))
    return got if isinstance(got, float) else xp.asarray(got)


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, np.ndarray)
