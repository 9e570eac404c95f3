"""compare_models(a, b, inputs): two whole models (any frameworks), judged linear layer by linear layer.

A ported transformer holds its linear layers among attention, norms and embeddings. Each model
runs ONE forward and ONE backward pass with its own framework's autograd (the adapters'
``capture`` verb), on the same inputs and the same random cotangent at the selected output, and
every matched linear layer's inputs, outputs, dL/d(output) and parameter gradients are recorded
call by call. Captures are reshaped to the canonical (rows, in_features) / (rows, units), so a
Keras ``EinsumDense`` output (batch, seq, heads, head_dim) meets torch's (batch, seq, hidden).

What is judged, per call of each matched layer (b is the reference; float64 on the host):

- ``output``, the layer's OWN contribution: r = (y_a - y_b) - (x_a - x_b) @ W_b, the output
  difference beyond what the difference already in its input explains (for a correct pair r is
  each side's own rounding: x_a W_a - y_a and x_b W_b - y_b). Allowed: the docs/FACTS.md
  formula with K = in_features, C = 4, for each side, added in quadrature. A transposed kernel,
  a dropped bias, a kernel rounded to bfloat16 leave r at the size of x (W_a - W_b): hundreds of
  units; a correct layer after a broken one passes (its r stays rounding), so one bad layer is
  named once.
- ``input``: what reaches the layer from the code between linear layers (attention, norms,
  activations, embeddings, which dense_bridge does not describe). Its difference is allowed the
  formula's rounding (K = in_features) plus G = 16 times the largest relative difference
  (elementwise |a - b| / (|b| + rms b)) of anything computed before it in execution order:
  the code in between may amplify what it is given, but does not create differences of its
  own beyond rounding. An activation swapped between two linear layers (gelu exact vs tanh) is
  named at the input of the layer after it.
- with ``grads``: ``dL/dy`` (dL/d(output), judged like ``input`` but in backward order, against
  everything after it in the backward pass and the whole forward pass, C = 10), and per layer
  ``dL/dkernel`` / ``dL/dbias`` on their own contribution, like ``output``: autograd's
  gradient minus sum over calls of x^T dL/dy (resp. sum of dL/dy), each side, in quadrature.

The first divergence is the first failing row in execution order (forward: each call's input,
then its output; then the model output; then the backward in reverse: dL/dy, then the layer's
parameter gradients) and is named by the layer's path. The tolerance dtype of a layer is the
coarser of the two layers' dtypes. The report is :class:`ModelReport` (a
:class:`~dense_bridge.testing.Report`: table, ``to_json``, ``to_html`` with the per-layer chart).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._dtypes import EPS, numpy_dtype
from .._errors import ConversionError, SpecError, received
from .._params import _to_numpy
from .._registry import adapter_for, backend_of
from ._captures import Call, Capture
from ._report import LayerResult, ModelInfo, QuantityResult, Report, _fmt_err, _fmt_units
from ._tolerance import Tolerance, allowed_error, rms

__all__ = ["compare_models", "ModelReport", "GROWTH"]

#: How much the code between two linear layers (attention, norms, activations) may amplify the
#: relative difference it is given before a layer's input counts as diverged (see the module doc).
GROWTH = 16.0


@dataclass
class ModelReport(Report):
    """The :class:`Report` of :func:`compare_models`: one :class:`LayerResult` per call of a
    matched layer in execution order (``layer_type`` is its path, with ``[call n]`` from the
    second call on), then the model output (index None). ``first_divergence`` is the PATH of the
    layer where the models first part; ``pairs`` the matched (path in a, path in b)."""

    pairs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def first_divergence(self) -> str | None:  # type: ignore[override]
        f = self.first_failure
        return None if f is None else f.layer_type.split(" [call")[0]

    def verdict(self) -> str:
        if not self.compared or self.passed or self.first_failure is None:
            return super().verdict()
        f = self.first_failure
        what = {"input": "its input differs beyond what the layers before it explain (look at the code "
                         "between the previous linear layer and this one)",
                "output": "its own output differs (its parameters or its function differ)",
                "dL/dy": "the gradient reaching its output differs beyond what comes after it explains",
                "model output": "the model output differs beyond what the last linear layers explain"}
        why = what.get(f.quantity, f"its own {f.quantity} differs")
        where = "the model output" if f.layer is None else f.layer_type
        return (f"FAIL: first divergence at {where} ({f.quantity}): {_fmt_units(f.units)} tolerance units "
                f"(max abs err {_fmt_err(f.max_abs_error)}): {why}" + (f"; {f.note}" if f.note else ""))

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["first_divergence"] = self.first_divergence
        d["pairs"] = [list(p) for p in self.pairs]
        return d


# ---------------------------------------------------------------------------- arguments
def _as_numpy(value, argument: str) -> np.ndarray:
    arr = _to_numpy(value)
    if arr is None or arr.dtype == object:
        raise TypeError(f"{argument} must be a numeric array. {received(argument, value)}")
    return np.asarray(arr)


def _normalise_inputs(value, argument: str) -> list[np.ndarray] | dict[str, np.ndarray]:
    """A list (positional) or a dict (keyword) of numpy arrays; a lone array is one positional input."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{argument} keys must be argument names (str). {received(argument, value)}")
        return {k: _as_numpy(v, f"{argument}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_numpy(v, f"{argument}[{i}]") for i, v in enumerate(value)]
    return [_as_numpy(value, argument)]


def _split_inputs(inputs):
    """(inputs_a, inputs_b): a pair of lists/dicts is one per model, anything else feeds both."""
    if isinstance(inputs, tuple) and len(inputs) == 2 and all(isinstance(v, (list, tuple, dict)) for v in inputs):
        return _normalise_inputs(inputs[0], "inputs[0]"), _normalise_inputs(inputs[1], "inputs[1]")
    if inputs is None:
        raise TypeError("inputs must be given: a list (positional), a dict (keyword) or a pair "
                        "(inputs_a, inputs_b) of numpy arrays. Received: inputs=None")
    same = _normalise_inputs(inputs, "inputs")
    return same, same


def _is_float_dtype(dt) -> bool:
    return np.issubdtype(dt, np.floating) or np.dtype(dt).name == "bfloat16"


def _round_common(x: np.ndarray, dtypes) -> np.ndarray:
    """float64 values every dtype in ``dtypes`` holds exactly (rounded through each, to a fixpoint)."""
    x = np.asarray(x).astype(np.float64)
    for _ in range(3):
        y = x
        for d in dtypes:
            y = y.astype(numpy_dtype(d)).astype(np.float64)
        if np.array_equal(y, x, equal_nan=True):
            break
        x = y
    return x


def _round_inputs(inputs, dtypes):
    if isinstance(inputs, dict):
        return {k: _round_common(v, dtypes) if _is_float_dtype(v.dtype) else v for k, v in inputs.items()}
    return [_round_common(v, dtypes) if _is_float_dtype(v.dtype) else v for v in inputs]


def _dtype_name(arr: np.ndarray) -> str:
    name = np.dtype(arr.dtype).name
    return name if name in EPS else "float32"


def _coarsest(dtypes) -> str:
    return max(dtypes, key=lambda d: EPS[d])


# ---------------------------------------------------------------------------- pairing
def _linear_layers(model, argument: str) -> dict[str, Any]:
    from .. import models

    try:
        return models.linear_layers(model)
    except TypeError:
        raise
    except ConversionError as exc:
        raise ConversionError(f"{argument}: {exc}") from None


def _pairs(layers_a: dict, layers_b: dict, mapping) -> list[tuple[str, str]]:
    """Matched (path in a, path in b), through the mapping machinery of ``db.transfer``."""
    from .. import models

    match = getattr(models, "match_layers", None)
    if match is None:
        raise ConversionError("compare_models needs the layer mapping of db.transfer (issue 12), "
                              "not in this build")
    return match(layers_a, layers_b, mapping)


# ---------------------------------------------------------------------------- judging
def _rows(x: np.ndarray, width: int, what: str) -> np.ndarray:
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


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """Largest elementwise |a - b| / (|b| + rms(b)): the scale-free size of a difference."""
    if a.shape != b.shape or not a.size:
        return 0.0 if a.shape == b.shape else math.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.abs(a - b) / (np.abs(b) + rms(b))
    d = np.where(np.isnan(d), 0.0, d)
    return float(d.max())


def _row(i, label, name, a, b, allowed, k, note="") -> QuantityResult:
    if a.shape != b.shape:
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, tuple(a.shape),
                              f"shape {a.shape} vs {b.shape}")
    if not a.size:
        return QuantityResult(i, label, name, 0.0, 0.0, True, k, tuple(a.shape), note)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    if not np.isfinite(diff).all():
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(same, 0.0, diff)
    if not np.isfinite(diff).all():
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, tuple(a.shape),
                              note or "non-finite values in one model only")
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(diff == 0, 0.0, diff / np.broadcast_to(allowed, diff.shape))
    err, u = float(diff.max()), float(units.max())
    return QuantityResult(i, label, name, err, u, u <= 1.0, k, tuple(a.shape), note)


def _carried(b: np.ndarray, dtype: str, k: int, c: float, tol: Tolerance, prev: float) -> np.ndarray:
    """Allowance of a value computed by undescribed code: its rounding plus GROWTH x what it was given."""
    return allowed_error(b, dtype, k, c, tol.atol) + GROWTH * prev * (np.abs(b) + rms(b))


def _own(a: np.ndarray, b: np.ndarray, dtype: str, k: int, c: float, tol: Tolerance) -> np.ndarray:
    """Allowance of a difference of two own-rounding errors (each side's formula, in quadrature)."""
    return np.sqrt(np.square(allowed_error(a, dtype, k, c, tol.atol)) + np.square(allowed_error(b, dtype, k, c, tol.atol)))


def _cast_term(x: np.ndarray, w: np.ndarray, x_dtype: str, w_dtype: str, c: float) -> np.ndarray | float:
    """A layer whose input arrives wider than its kernel rounds it first: eps * |x| @ |W| more."""
    if EPS[x_dtype] >= EPS[w_dtype]:
        return 0.0
    return c * EPS[w_dtype] * np.sqrt(np.square(x) @ np.square(w))


def compare_models(a, b, inputs, *, mapping=None, grads: bool = True, outputs=None, seed: int = 0,
                   tolerance: Tolerance | None = None) -> ModelReport:
    """Compare two whole models (any frameworks) linear layer by linear layer; ``b`` is the reference.

    ``inputs``: a list of numpy arrays (positional), a dict (keyword, as keras-hub's
    ``BertBackbone`` takes ``token_ids``/``segment_ids``/``padding_mask``), or a pair
    ``(inputs_a, inputs_b)`` when the models take different signatures. Integer arrays (token
    ids) stay integers; floating ones are rounded once to values both models' dtypes hold.
    ``mapping``: pairs a's linear layers with b's, as ``db.transfer`` takes it (a dict of paths,
    ``(regex, replacement)`` rules, a callable, or None for by-order matching).
    ``outputs``: ``(select_a, select_b)``, each a callable on the model's output, a key or an
    index; default: each model's first floating output (a ``ModelOutput``'s first field, a dict's
    first value). The backward pass starts there with the same standard-normal cotangent (from
    ``seed``) on both sides. ``grads=False``: forward only. ``tolerance``: a :class:`Tolerance`.

    Returns a :class:`ModelReport`; ``report.first_divergence`` is the path (in b) of the first
    layer where the models part. See the module docstring for what each row measures.
    """
    from ._compare import _check_count, _check_flag, _check_tolerance

    grads = _check_flag("grads", grads)
    seed = _check_count("seed", seed, 0)
    tol = _check_tolerance(tolerance)
    if outputs is None:
        select_a = select_b = None
    elif isinstance(outputs, (tuple, list)) and len(outputs) == 2:
        select_a, select_b = outputs
    else:
        raise TypeError(f"outputs must be None or a pair (select_a, select_b). {received('outputs', outputs)}")
    adapter_a, adapter_b = adapter_for(a, "a"), adapter_for(b, "b")
    for name, adapter in (("a", adapter_a), ("b", adapter_b)):
        if not callable(getattr(adapter, "capture", None)):
            raise ConversionError(f"the {adapter.__name__.rsplit('.', 1)[-1]!r} backend cannot capture layers "
                                  f"inside a whole model yet (no capture verb); {name} cannot be compared")
    in_a, in_b = _split_inputs(inputs)
    layers_a, layers_b = _linear_layers(a, "a"), _linear_layers(b, "b")
    pairs = _pairs(layers_a, layers_b, mapping)
    from .._api import get_params

    params_a = {pa: get_params(layers_a[pa], copy=False) for pa, _ in pairs}
    params_b = {pb: get_params(layers_b[pb], copy=False) for _, pb in pairs}
    dtypes = sorted({_dtype_name(p["kernel"]) for p in list(params_a.values()) + list(params_b.values())
                     if "kernel" in p} or {"float32"})
    in_a, in_b = _round_inputs(in_a, dtypes), _round_inputs(in_b, dtypes)

    cache: dict[int, np.ndarray] = {}

    def cotangent(shape: tuple) -> np.ndarray:
        size = int(np.prod(shape))
        if size not in cache:
            cache[size] = _round_common(np.random.default_rng(seed).standard_normal(size), dtypes + ["float16"])
        return cache[size].reshape(shape)

    cap_a = adapter_a.capture(a, in_a, {pa: layers_a[pa] for pa, _ in pairs}, cotangent=cotangent,
                              select=select_a, grads=grads)
    cap_b = adapter_b.capture(b, in_b, {pb: layers_b[pb] for _, pb in pairs}, cotangent=cotangent,
                              select=select_b, grads=grads)
    dt_a = _coarsest([_dtype_name(p["kernel"]) for p in params_a.values() if "kernel" in p] or ["float32"])
    dt_b = _coarsest([_dtype_name(p["kernel"]) for p in params_b.values() if "kernel" in p] or ["float32"])
    report = ModelReport(ModelInfo(backend_of(a, "a"), type(a).__name__, dt_a),
                         ModelInfo(backend_of(b, "b"), type(b).__name__, dt_b), _coarsest([dt_a, dt_b]), tol,
                         _input_shapes(in_b), seed, True)
    report.pairs = pairs
    report.notes += [f"a: {n}" for n in cap_a.notes] + [f"b: {n}" for n in cap_b.notes]
    _judge(report, pairs, cap_a, cap_b, params_b, grads, tol)
    return report


def _input_shapes(inputs) -> list[tuple[int, ...]]:
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return [tuple(np.shape(v)) for v in values]


def _judge(report: ModelReport, pairs, cap_a: Capture, cap_b: Capture, params_b: dict, grads: bool,
           tol: Tolerance) -> None:
    by_a: dict[str, list[Call]] = {}
    for c in cap_a.calls:
        by_a.setdefault(c.path, []).append(c)
    to_b = {pa: pb for pa, pb in pairs}
    b_to_a = {pb: pa for pa, pb in pairs}
    # b's execution order is the order of the report; a's calls are matched call by call
    order: list[tuple[Call, Call | None]] = []
    seen: dict[str, int] = {}
    for cb in cap_b.calls:
        pa = b_to_a[cb.path]
        n = seen.get(cb.path, 0)
        seen[cb.path] = n + 1
        calls_a = by_a.get(pa, [])
        order.append((cb, calls_a[n] if n < len(calls_a) else None))
    counts_b = {pb: seen.get(pb, 0) for _, pb in pairs}
    for pa, pb in pairs:
        na, nb = len(by_a.get(pa, [])), counts_b[pb]
        if na != nb:
            report.notes.append(f"{pb}: called {nb} time(s) in b but {pa} {na} time(s) in a")
        if na == nb == 0:
            report.notes.append(f"{pb} ({pa} in a): not called in the forward pass, nothing to compare")

    fwd_prev = 0.0  # largest relative difference of anything computed so far (forward)
    results: list[LayerResult] = []
    rec = []  # per row: what the backward pass needs
    for idx, (cb, ca) in enumerate(order):
        pb = cb.path
        label = pb if cb.call == 0 and counts_b[pb] == 1 else f"{pb} [call {cb.call}]"
        if to_b[b_to_a[pb]] != pb:  # pragma: no cover - pairs are one to one
            raise ConversionError(f"layer {pb} is matched twice")
        pa = b_to_a[pb]
        if pa != pb:
            label += f" <- {pa}"
        kb = params_b[pb].get("kernel")
        if ca is None:
            q = QuantityResult(idx, label, "output", math.inf, math.inf, False, 0, tuple(cb.output.shape),
                               f"no call {cb.call} of {pa} in a")
            results.append(LayerResult(idx, label, (q,)))
            rec.append(None)
            continue
        if kb is None or kb.ndim != 2 or len(cb.inputs) != 1 or len(ca.inputs) != 1:
            q = _row(idx, label, "output", ca.output.astype(np.float64), cb.output.astype(np.float64),
                     allowed_error(cb.output, report.dtype, 1, tol.c_output, tol.atol), 0,
                     "not a one-input linear map: compared as values")
            results.append(LayerResult(idx, label, (q,)))
            rec.append(None)
            continue
        n_in, n_out = kb.shape
        w = kb.astype(np.float64)
        dtype = _coarsest([report.dtype])
        xa, xb = _rows(ca.inputs[0], n_in, f"{pa} input"), _rows(cb.inputs[0], n_in, f"{pb} input")
        ya, yb = _rows(ca.output, n_out, f"{pa} output"), _rows(cb.output, n_out, f"{pb} output")
        rows = []
        if xa.shape == xb.shape:
            rows.append(_row(idx, label, "input", xa, xb, _carried(xb, dtype, n_in, tol.c_output, tol, fwd_prev), n_in))
        else:
            rows.append(_row(idx, label, "input", xa, xb, 0.0, n_in))
        if xa.shape == xb.shape and ya.shape == yb.shape:
            r_a = ya - xa @ w
            r_b = yb - xb @ w
            allowed = _own(ya, yb, dtype, n_in, tol.c_output, tol)
            allowed = allowed + _cast_term(xa, w, _dtype_name(ca.inputs[0]), _dtype_name(params_b[pb]["kernel"]),
                                           tol.c_output) + _cast_term(xb, w, _dtype_name(cb.inputs[0]),
                                                                       _dtype_name(params_b[pb]["kernel"]), tol.c_output)
            rows.append(_row(idx, label, "output", r_a, r_b, allowed, n_in))
        else:
            rows.append(_row(idx, label, "output", ya, yb, 0.0, n_in))
        if xa.shape == xb.shape:
            fwd_prev = max(fwd_prev, _rel(xa, xb))
        if ya.shape == yb.shape:
            fwd_prev = max(fwd_prev, _rel(ya, yb))
        results.append(LayerResult(idx, label, tuple(rows)))
        rec.append((pa, pb, ca, cb, xa, xb, n_in, n_out, dtype))

    final = None
    if cap_a.output is not None and cap_b.output is not None:
        oa, ob = np.asarray(cap_a.output).astype(np.float64), np.asarray(cap_b.output).astype(np.float64)
        if oa.size == ob.size and oa.shape != ob.shape:
            oa = oa.reshape(ob.shape)
        width = ob.shape[-1] if ob.ndim else 1
        final = _row(None, "model", "model output", oa, ob,
                     _carried(ob, report.dtype, width, tol.c_output, tol, fwd_prev) if oa.shape == ob.shape else 0.0,
                     width)
        fwd_prev = max(fwd_prev, _rel(oa, ob))

    if grads:
        bwd_prev = fwd_prev  # the backward through undescribed code also uses the forward values
        first_call = {}
        for i, r in enumerate(rec):
            if r is not None and r[1] not in first_call:
                first_call[r[1]] = i
        for i in range(len(rec) - 1, -1, -1):
            r = rec[i]
            if r is None:
                continue
            pa, pb, ca, cb, xa, xb, n_in, n_out, dtype = r
            extra = []
            ga, gb = ca.output_grad, cb.output_grad
            if ga is None and gb is None:
                pass
            else:
                ga = np.zeros(ca.output.shape) if ga is None else ga
                gb = np.zeros(cb.output.shape) if gb is None else gb
                ga, gb = _rows(ga, n_out, f"{pa} dL/dy"), _rows(gb, n_out, f"{pb} dL/dy")
                if ga.shape == gb.shape:
                    extra.append(_row(i, results[i].layer_type, "dL/dy", ga, gb,
                                      _carried(gb, dtype, n_out, tol.c_gradient, tol, bwd_prev), n_out))
                    bwd_prev = max(bwd_prev, _rel(ga, gb))
                else:
                    extra.append(_row(i, results[i].layer_type, "dL/dy", ga, gb, 0.0, n_out))
            if first_call.get(pb) == i:
                extra += _param_rows(i, results[i].layer_type, pa, pb, cap_a, cap_b, rec, dtype, tol)
            if extra:
                results[i] = LayerResult(i, results[i].layer_type, results[i].quantities + tuple(extra))
    report.layers = results + ([LayerResult(None, "model", (final,))] if final is not None else [])
    report.first_failure = _first_failure(report.layers)


def _param_rows(i, label, pa, pb, cap_a: Capture, cap_b: Capture, rec, dtype, tol: Tolerance) -> list:
    """dL/dkernel, dL/dbias on their own contribution: autograd's minus sum over calls of x^T dL/dy."""
    pg_a, pg_b = cap_a.param_grads.get(pa), cap_b.param_grads.get(pb)
    if pg_a is None and pg_b is None:
        return []
    calls = [r for r in rec if r is not None and r[1] == pb]
    expect_a, expect_b, n_rows = {}, {}, 0
    for _, _, ca, cb, xa, xb, n_in, n_out, _ in calls:
        ga = np.zeros((xa.shape[0], n_out)) if ca.output_grad is None else _rows(ca.output_grad, n_out, "dL/dy")
        gb = np.zeros((xb.shape[0], n_out)) if cb.output_grad is None else _rows(cb.output_grad, n_out, "dL/dy")
        expect_a["kernel"] = expect_a.get("kernel", 0.0) + xa.T @ ga
        expect_b["kernel"] = expect_b.get("kernel", 0.0) + xb.T @ gb
        expect_a["bias"] = expect_a.get("bias", 0.0) + ga.sum(0)
        expect_b["bias"] = expect_b.get("bias", 0.0) + gb.sum(0)
        n_rows += xb.shape[0]
    out = []
    for name in ("kernel", "bias"):
        va = None if pg_a is None else pg_a.get(name)
        vb = None if pg_b is None else pg_b.get(name)
        if va is None and vb is None:
            continue
        q = f"dL/d{name}"
        if va is None or vb is None:
            side = "a" if va is None else "b"
            shape = tuple(np.shape(vb if va is None else va))
            out.append(QuantityResult(i, label, q, math.inf, math.inf, False, n_rows, shape, f"absent in {side}"))
            continue
        va, vb = np.asarray(va).astype(np.float64), np.asarray(vb).astype(np.float64)
        ea, eb = np.asarray(expect_a[name]), np.asarray(expect_b[name])
        if va.shape != ea.shape or vb.shape != eb.shape:
            out.append(QuantityResult(i, label, q, math.inf, math.inf, False, n_rows, va.shape,
                                      f"shape {va.shape} vs {vb.shape}"))
            continue
        out.append(_row(i, label, q, va - ea, vb - eb, _own(va, vb, dtype, n_rows, tol.c_gradient, tol), n_rows))
    return out


def _first_failure(layers: list[LayerResult]) -> QuantityResult | None:
    """Execution order: forward rows call by call (input, output), the model output, then the
    backward from the last call to the first (dL/dy, then the layer's parameter gradients)."""
    forward = ("input", "output")
    for layer in layers:
        for q in layer.quantities:
            if q.quantity in forward and not q.passed:
                return q
    for layer in layers:
        for q in layer.quantities:
            if q.quantity == "model output" and not q.passed:
                return q
    for layer in reversed(layers):
        for q in layer.quantities:
            if q.quantity not in forward and q.quantity != "model output" and not q.passed:
                return q
    return None
