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
  formula's rounding (K = in_features) plus G = 32 times the largest relative difference
  (elementwise |a - b| / (|b| + rms b)) of anything computed before it in execution order, or
  of the dtype's roundoff where that is more: the code in between may amplify what it is given
  and its own rounding, but creates no differences of its own. An activation swapped between two linear layers (gelu exact vs tanh) is
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

from .._dtypes import EPS
from .._errors import ConversionError, SpecError, check_flag, received
from ..params._source import array_to_numpy as _to_numpy
from ..registry._backends import adapter_for, backend_of
from ._gradients import effective_grads
from . import _split_groups
from ..registry._captures import Call, Capture, LeafOutput
from ._degenerate import refuse_nonfinite_inputs, refuse_nonfinite_outputs
from ._elements import element_stats, elementwise_units
from ._structure import model_structure
from ._report import LayerResult, ModelInfo, QuantityResult, Report, first_failure, fmt_err, fmt_units
from ._rounding import coarsest, round_common
from ._tolerance import Tolerance, allowed_error, rms

__all__ = ["compare_models", "ModelReport", "GROWTH", "JUDGES"]

#: How compare_models judges each layer: its own contribution, or as a value carried from its input.
JUDGES = ("layers", "carried")

#: How much the code between two linear layers (attention, norms, activations) may amplify the
#: relative difference it is given before a layer's input counts as diverged (see the module doc).
GROWTH = 32.0


@dataclass
class ModelReport(Report):
    """The :class:`Report` of :func:`compare_models`: one :class:`LayerResult` per call of a
    matched layer in execution order (``layer_type`` is its path, with ``[call n]`` from the
    second call on), then the model output (index None). ``first_divergence`` is the PATH of the
    layer where the models first part; ``pairs`` the matched (path in a, path in b)."""

    pairs: list[tuple[str, str]] = field(default_factory=list)
    #: per row of ``layers`` (by index): (path in a, path in b, call number)
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def first_divergence(self) -> str | None:  # type: ignore[override]
        """The path in b of the layer where the models first part ("model output" for the end
        of the model; None when they agree)."""
        f = self.first_failure
        if f is None:
            return None
        if f.layer is None:
            return f.layer_type if f.quantity == "calls" else "model output"
        return self.calls[f.layer][1]

    @property
    def first_divergence_a(self) -> str | None:
        """The same layer's path in a."""
        f = self.first_failure
        if f is None:
            return None
        if f.layer is None:
            return {pb: pa for pa, pb in self.pairs}.get(f.layer_type, "model output")
        return self.calls[f.layer][0]

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
        return (f"FAIL: first divergence at {where} ({f.quantity}): {fmt_units(f.units)} tolerance units "
                f"(max abs err {fmt_err(f.max_abs_error)}): {why}" + (f"; {f.note}" if f.note else ""))

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["first_divergence"] = self.first_divergence
        d["first_divergence_a"] = self.first_divergence_a
        d["calls"] = [{"a": pa, "b": pb, "call": n} for pa, pb, n in self.calls]
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


def _round_inputs(inputs, dtypes):
    if isinstance(inputs, dict):
        return {k: round_common(v, dtypes) if _is_float_dtype(v.dtype) else v for k, v in inputs.items()}
    return [round_common(v, dtypes) if _is_float_dtype(v.dtype) else v for v in inputs]


def _dtype_name(arr: np.ndarray) -> str:
    name = np.dtype(arr.dtype).name
    return name if name in EPS else "float32"


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
    """The typical relative size of a difference, rms(a - b) / rms(b) (0 when b is all 0)."""
    if a.shape != b.shape or not a.size:
        return 0.0 if a.shape == b.shape else math.inf
    scale = rms(b)
    d = rms(np.where(np.isfinite(a - b), a - b, 0.0))
    return d / scale if scale > 0 else 0.0


def _row(i, label, name, a, b, allowed, k, note="", *, values=None, dtype: str = "float32",
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


def _carried(b: np.ndarray, dtype: str, k: int, c: float, tol: Tolerance, prev: float) -> np.ndarray:
    """Allowance of a value computed by undescribed code: its rounding plus GROWTH x what it was
    given, or x its own dtype's roundoff where that is more (attention's softmax amplifies the
    rounding of its logits, ~eps x |logit|, in bfloat16 a few eps of its output on its own)."""
    return allowed_error(b, dtype, k, c, tol.atol) + GROWTH * max(prev, EPS[dtype]) * (np.abs(b) + rms(b))


def _rounding(v: np.ndarray, terms: np.ndarray, dtype: str, k: int, c: float, tol: Tolerance) -> np.ndarray:
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


def _activation(layer):
    """The activation a linear layer applies inside itself (Keras ``Dense(activation=...)``), or None."""
    from .._api import to_spec
    from ..specs import Dense

    try:
        spec = to_spec(layer)
    except Exception:  # noqa: BLE001 - a layer without a spec (EinsumDense, declared classes) is linear
        return None
    act = getattr(spec, "activation", None) if isinstance(spec, Dense) else None
    return None if act is None or act.is_identity else act


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


def _side(call: Call, w: np.ndarray, bias, act, n_in: int, n_out: int, dtype: str, w_dtype: str,
          tol: Tolerance, what: str, x_fn=None) -> _Side:
    from ._propagate import activation_output_allowance

    x = _rows(call.inputs[0], n_in, f"{what} input")
    y = _rows(call.output, n_out, f"{what} output")
    xm = x if x_fn is None else x_fn(x)  # what the layer multiplies (Keras int8 quantizes its input)
    z = xm @ w + (0.0 if bias is None else bias)
    terms = np.abs(xm) @ np.abs(w) + (0.0 if bias is None else np.abs(bias))
    x_dtype = _dtype_name(call.inputs[0])
    az = _rounding(z, terms, dtype, n_in, tol.c_output, tol) + _cast_term(x, w, x_dtype, w_dtype, tol.c_output)
    if act is None:
        return _Side(x, y, z, z, az, None, x_dtype)
    with np.errstate(all="ignore"):
        pred = np.asarray(act.forward(z), dtype=np.float64)
    return _Side(x, y, z, pred, activation_output_allowance(act, z, az, y, dtype, tol), act, x_dtype)


def _dz(side: _Side, g, n_out: int, dtype: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """dL/dz of one side's call (dL/dy through its own activation) and the allowance that adds."""
    from ._propagate import activation_vjp

    g = np.zeros_like(side.y) if g is None else _rows(g, n_out, f"{what} dL/dy")
    if side.act is None:
        return g, np.zeros_like(g)
    return activation_vjp(side.act, side.z, g, dtype)


def compare_models(a, b, inputs, *, mapping=None, grads: bool = True, outputs=None, seed: int = 0,
                   tolerance: Tolerance | None = None, isolated: bool = False,
                   judge: str = "layers") -> ModelReport:
    """Compare two whole models (any frameworks) linear layer by linear layer; ``b`` is the reference.

    ``inputs``: a list of numpy arrays (positional), a dict (keyword, as keras-hub's
    ``BertBackbone`` takes ``token_ids``/``segment_ids``/``padding_mask``), or a pair
    ``(inputs_a, inputs_b)`` when the models take different signatures. Integer arrays (token
    ids) stay integers; floating ones are rounded once to values both models' dtypes hold.
    ``mapping``: pairs a's linear layers with b's, as ``db.transfer`` takes it (a dict of paths,
    ``(regex, replacement)`` rules, a callable, or None for by-order matching); a split or a
    concatenation compares the fused layer with its counterparts joined along units (per head
    when declared), labelled "path+path+..."; a mapping that pairs no linear layer is a
    ConversionError naming the rules that matched nothing; ``"auto"`` or ``db.auto(rules)``
    infers it as ``db.transfer`` does.
    ``outputs``: ``(select_a, select_b)``, each a callable on the model's output, a key or an
    index; default: each model's first floating output (a ``ModelOutput``'s first field, a dict's
    first value). The backward pass starts there with the same standard-normal cotangent (from
    ``seed``) on both sides. ``grads=False``: forward only. ``tolerance``: a :class:`Tolerance`.
    ``isolated=True``: every matched layer of b also runs alone on the input and output gradient
    its counterpart in a received (teacher forcing, ``_isolated``), so its output and gradient
    rows hold its own error with nothing carried from before it.
    Before anything runs, ``report.structure`` lists the parameters of either model left
    unmatched, tied or matched with another dtype, and both parameter counts.

    ``judge``: ``"layers"`` (default) judges every layer's own contribution as described above.
    ``"carried"`` (what ``db.transfer(mapping="auto")`` uses to check a transfer it just made) gives
    a verdict at the cost of little more than the two forwards. Every call's input and
    the model output are judged as above; each call's output is judged as a value computed from
    its input, like ``input`` (its difference allowed the formula's rounding plus GROWTH times what
    came before it), instead of as its own contribution, which needs x @ W in float64 per side.
    A wrongly paired layer fails at its output (its values differ at O(1)); a layer's own small
    error (a kernel rounded to bfloat16) meets a looser allowance than its own contribution's,
    GROWTH x the differences before it. No element statistics, no ``report.structure``; with
    ``grads``, a quantized pair or an activation inside one layer only, the full judging runs.

    Returns a :class:`ModelReport`; ``report.first_divergence`` is the path (in b) of the first
    layer where the models part. See the module docstring for what each row measures.
    """
    from ._compare import check_count, check_tolerance

    grads, isolated = check_flag("grads", grads), check_flag("isolated", isolated)
    if judge not in JUDGES:
        raise SpecError(received("judge", judge, f"one of {', '.join(repr(j) for j in JUDGES)}"))
    carried = judge == "carried"
    seed = check_count("seed", seed, 0)
    tol = check_tolerance(tolerance)
    if outputs is None:  # each side's first floating output, re-paired by shape below if they differ
        select_a, select_b = LeafOutput(0), LeafOutput(0)
    elif isinstance(outputs, (tuple, list)) and len(outputs) == 2:
        select_a, select_b = outputs
    else:
        raise TypeError(f"outputs must be None or a pair (select_a, select_b). {received('outputs', outputs)}")
    adapter_a, adapter_b = adapter_for(a, "a"), adapter_for(b, "b")
    grads, grads_note = effective_grads({"a": backend_of(a, "a"), "b": backend_of(b, "b")}, grads)
    for name, adapter in (("a", adapter_a), ("b", adapter_b)):
        if not callable(getattr(adapter, "capture", None)):
            raise ConversionError(f"the {adapter.__name__.rsplit('.', 1)[-1]!r} backend cannot capture layers "
                                  f"inside a whole model yet (no capture verb); {name} cannot be compared")
    in_a, in_b = _split_inputs(inputs)
    for side, given in (("inputs", in_a), ("inputs_b", in_b)):
        refuse_nonfinite_inputs(given.items() if isinstance(given, dict) else
                                ((f"{side}[{i}]", x) for i, x in enumerate(given)))
    from ..models import _infer as _auto_mapping
    from .. import models

    walked = models.sides(a, b, ("a", "b"))  # each model walked once: pairing, inference, judging, structure
    walks = (walked[0].entries, walked[1].entries)
    if _auto_mapping.is_auto(mapping):  # inferred from one forward pass of each model, compared as rules
        mapping = _auto_mapping.inferred_rules(a, b, inputs, mapping, lambda *_: walked)
    layers_a, layers_b = ({e.path: e.layer for e in side.linear()} for side in walked)
    # matched (path in a, path in b): the linear layers db.transfer would pair with mapping, a split or
    # concatenated side as one group labelled "path+path+..." (_split_groups), and the groups
    pairs, groups = _split_groups.pairs_of(models.match_moves(a, b, mapping, walked=walked))
    from .._api import get_params

    params_a = {pa: _split_groups.group_params(pa, groups, layers_a, get_params) for pa, _ in pairs}
    params_b = {pb: _split_groups.group_params(pb, groups, layers_b, get_params) for _, pb in pairs}
    widths = {p: get_params(layers[p], copy=False)["kernel"].shape[-1] for layers in (layers_a, layers_b)
              for p in _split_groups.members(groups, groups) if p in layers}
    dtypes = sorted({_dtype_name(p["kernel"]) for p in list(params_a.values()) + list(params_b.values())
                     if "kernel" in p} or {"float32"})
    in_a, in_b = _round_inputs(in_a, dtypes), _round_inputs(in_b, dtypes)

    cache: dict[int, np.ndarray] = {}

    def cotangent(shape: tuple) -> np.ndarray:
        size = int(np.prod(shape))
        if size not in cache:
            cache[size] = round_common(np.random.default_rng(seed).standard_normal(size), dtypes + ["float16"])
        return cache[size].reshape(shape)

    def run(select_a, select_b) -> tuple[Capture, Capture]:
        cap_a = adapter_a.capture(a, in_a, {p: layers_a[p] for p in _split_groups.members([pa for pa, _ in pairs], groups)},
                                  cotangent=cotangent, select=select_a, grads=grads)
        cap_b = adapter_b.capture(b, in_b, {p: layers_b[p] for p in _split_groups.members([pb for _, pb in pairs], groups)},
                                  cotangent=cotangent, select=select_b, grads=grads)
        return _split_groups.merge(cap_a, groups, widths), _split_groups.merge(cap_b, groups, widths)

    cap_a, cap_b = run(select_a, select_b)
    output_note = None
    if outputs is None and cap_a.output is not None and cap_b.output is not None \
            and cap_a.output.shape != cap_b.output.shape:
        paired = _pair_outputs_by_shape(select_a.shapes, select_b.shapes)
        if paired is not None:  # e.g. keras-hub's dict comes back in another order on the torch engine
            cap_a, cap_b = run(LeafOutput(paired[0]), LeafOutput(paired[1]))
            output_note = (f"outputs: the models' first floating outputs differ in shape ({select_a.shapes[0]} vs "
                           f"{select_b.shapes[0]}); compared a's floating output #{paired[0]} with b's #{paired[1]}, "
                           f"both {select_a.shapes[paired[0]]} (the one same-shaped pair); pass outputs= to choose")
    refuse_nonfinite_outputs(cap_a.output, cap_b.output)
    dt_a = coarsest([_dtype_name(p["kernel"]) for p in params_a.values() if "kernel" in p] or ["float32"])
    dt_b = coarsest([_dtype_name(p["kernel"]) for p in params_b.values() if "kernel" in p] or ["float32"])
    report = ModelReport(ModelInfo(backend_of(a, "a"), type(a).__name__, dt_a),
                         ModelInfo(backend_of(b, "b"), type(b).__name__, dt_b), coarsest([dt_a, dt_b]), tol,
                         _input_shapes(in_b), seed, True)
    report.pairs = pairs
    for side, layers, matched in (("a", layers_a, set(_split_groups.members([pa for pa, _ in pairs], groups))),
                                  ("b", layers_b, set(_split_groups.members([pb for _, pb in pairs], groups)))):
        left = [p for p in layers if p not in matched]
        if left:
            report.notes.append(f"{side}'s linear layers the mapping does not pair (not compared): {', '.join(left)}")
    if output_note:
        report.notes.append(output_note)
    layers_a = {**layers_a, **{g: None for g in groups}}  # a group has no one native layer (no activation)
    layers_b = {**layers_b, **{g: None for g in groups}}
    report.notes += [f"a: {n}" for n in cap_a.notes] + [f"b: {n}" for n in cap_b.notes]
    if not carried:
        report.structure = model_structure(a, b, pairs, groups, entries=walks)
    if grads_note:
        report.notes.append(grads_note)
    from ._quantized import quantized_pairs  # pairs with a quantized side: testing/_quantized.py

    quant = quantized_pairs(pairs, layers_a, layers_b, params_a)
    _judge(report, pairs, cap_a, cap_b, layers_a, layers_b, params_b, grads, tol, quant=quant, walks=walks,
           verify_only=carried)
    if isolated:
        _teacher_forced(report, adapter_a, adapter_b, pairs, layers_a, layers_b, cap_a, cap_b, params_b, grads, tol,
                        quant=quant, walks=walks, groups=groups, widths=widths)
    return report


def _teacher_forced(report: ModelReport, adapter_a, adapter_b, pairs, layers_a, layers_b, cap_a: Capture,
                    cap_b: Capture, params_b: dict, grads: bool, tol: Tolerance, quant: dict | None = None,
                    walks=None, groups: dict | None = None, widths: dict | None = None) -> None:
    """Judge b's layers run alone on a's recorded inputs and cotangents (``_isolated``) and put
    their output, dL/dx and parameter-gradient rows in place of the cascaded ones; a split/fused
    group (``groups``, member units in ``widths``) runs member by member."""
    from ._isolated import ISOLATED_NOTE, dx_rows, forced_capture, judge_copy, merge_rows

    def acts(pa: str, pb: str):
        return (None if pa in cap_a.pre_activation else _activation(layers_a[pa]),
                None if pb in cap_b.pre_activation else _activation(layers_b[pb]))

    report.isolated = True
    forced_cap, forced = forced_capture(adapter_a, adapter_b, pairs, layers_a, layers_b, cap_a, cap_b, grads, acts,
                                        groups=groups, widths=widths)
    twin = judge_copy(report)
    _judge(twin, pairs, cap_a, forced_cap, layers_a, layers_b, params_b, grads, tol, quant=quant, walks=walks)
    rows = {i for i, c in enumerate(cap_b.calls) if c.path in forced.forced_paths}
    dx = dx_rows(report, forced, params_b, acts, report.calls, tol, _row, _rows, quant=quant)
    report.layers = merge_rows(report.layers, twin.layers, dx, rows)
    report.notes += [ISOLATED_NOTE] + forced.notes
    report.first_failure = first_failure(report.layers)


def _pair_outputs_by_shape(shapes_a: list, shapes_b: list) -> tuple[int, int] | None:
    """(index in a, index in b) of the floating outputs to compare when the first ones differ in
    shape: a's first output with b's one output of its shape, else b's first with a's one output
    of its shape; None when neither is unambiguous (then the mismatch is reported as it is)."""
    if shapes_a and shapes_b:
        in_b = [j for j, s in enumerate(shapes_b) if s == shapes_a[0]]
        if len(in_b) == 1:
            return 0, in_b[0]
        in_a = [i for i, s in enumerate(shapes_a) if s == shapes_b[0]]
        if len(in_a) == 1:
            return in_a[0], 0
    return None


def _input_shapes(inputs) -> list[tuple[int, ...]]:
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return [tuple(np.shape(v)) for v in values]


def _judge(report: ModelReport, pairs, cap_a: Capture, cap_b: Capture, layers_a: dict, layers_b: dict,
           params_b: dict, grads: bool, tol: Tolerance, quant: dict | None = None, walks=None,
           verify_only: bool = False) -> None:
    from ._quantized import backward_spread, quantization_row, table_spread

    quant = quant or {}
    for pb in quant:
        report.notes.append(f"{pb}: quantized ({quant[pb].what}): each side's output judged against its own "
                            f"kernel, the kernels against one quantization step (row 'quantization'); a "
                            f"quantized kernel has no parameter gradient, so those rows are left out")
    by_a = cap_a.by_path()
    b_to_a = {pb: pa for pa, pb in pairs}
    counts_b = cap_b.call_counts()
    extra_calls = []
    for pa, pb in pairs:
        na, nb = len(by_a.get(pa, [])), counts_b.get(pb, 0)
        if na != nb:
            report.notes.append(f"{pb}: called {nb} time(s) in b but {pa} {na} time(s) in a")
            if na > nb:  # calls b never made fail the report (fewer are failed rows below)
                extra_calls.append(QuantityResult(None, pb, "calls", math.inf, math.inf, False, 0, (na,),
                                                  f"{pa} called {na} time(s) in a, {pb} {nb} in b"))
        elif na == 0:
            report.notes.append(f"{pb} ({pa} in a): not called in the forward pass, nothing to compare")
    acts = {}
    for pa, pb in pairs:
        # a capture taken before the layer's own activation sees the linear map alone
        acts[pb] = (None if pa in cap_a.pre_activation else _activation(layers_a[pa]),
                    None if pb in cap_b.pre_activation else _activation(layers_b[pb]))
        fa, fb = acts[pb]
        if (fa is None) != (fb is None) or (fa is not None and fa != fb):
            def what(act, path, cap):
                if path in cap.pre_activation:
                    return f"{path} is captured before its own activation"
                return f"{path} applies {act.name} inside itself" if act else f"{path} applies no activation"
            report.notes.append(f"{what(fb, pb, cap_b)}, {what(fa, pa, cap_a)} (a): each output is judged "
                                f"through its own activation, dL/dy before the activation")

    fwd_prev = 0.0  # largest relative difference of anything computed so far (forward)
    if walks is not None:  # quantized embeddings differ before any linear layer (testing/_quantized.py)
        fwd_prev, table_notes = table_spread(*walks)
        report.notes += table_notes
    results: list[LayerResult] = []
    rec: list = []  # per row: what the backward pass needs, or None
    for idx, cb in enumerate(cap_b.calls):
        pb = cb.path
        pa = b_to_a[pb]
        report.calls.append((pa, pb, cb.call))
        label = pb if counts_b[pb] == 1 else f"{pb} [call {cb.call}]"
        if pa != pb:
            label += f" <- {pa}"
        calls_a = by_a.get(pa, [])
        ca = calls_a[cb.call] if cb.call < len(calls_a) else None
        kb = params_b[pb].get("kernel")
        if ca is None:
            results.append(LayerResult(idx, label, (QuantityResult(
                idx, label, "output", math.inf, math.inf, False, 0, tuple(cb.output.shape),
                f"no call {cb.call} of {pa} in a"),)))
            rec.append(None)
            continue
        if kb is None or kb.ndim != 2 or len(cb.inputs) != 1 or len(ca.inputs) != 1:
            ya, yb = np.asarray(ca.output, np.float64), np.asarray(cb.output, np.float64)
            results.append(LayerResult(idx, label, (_row(idx, label, "output", ya, yb, allowed_error(
                yb, report.dtype, 1, tol.c_output, tol.atol), 0, "not a one-input linear map: compared as values",
                dtype=report.dtype),)))
            rec.append(None)
            continue
        n_in, n_out = kb.shape
        w = kb.astype(np.float64)
        bias = params_b[pb]["bias"].astype(np.float64) if "bias" in params_b[pb] else None
        dtype = report.dtype
        w_dtype = _dtype_name(kb)
        fa, fb = acts[pb]
        q = quant.get(pb)
        if verify_only and q is None and not grads and fa == fb:  # same map on both sides: values comparable
            rows, fwd_prev = _verdict_rows(idx, label, ca, cb, pa, pb, n_in, n_out, dtype, tol, fwd_prev)
            results.append(LayerResult(idx, label, rows))
            rec.append(None)
            continue
        sa = _side(ca, w if q is None else q.kernel_a, bias if q is None else q.bias_a, fa, n_in, n_out, dtype,
                   w_dtype, tol, pa, None if q is None else q.input_a)
        sb = _side(cb, w, bias, fb, n_in, n_out, dtype, w_dtype, tol, pb, None if q is None else q.input_b)
        rows = [_row(idx, label, "input", sa.x, sb.x, _carried(sb.x, dtype, n_in, tol.c_output, tol, fwd_prev)
                     if sa.x.shape == sb.x.shape else 0.0, n_in, dtype=dtype)]
        if sa.x.shape == sb.x.shape and sa.y.shape == sb.y.shape:
            # the layer's own contribution: each side's output minus what b's parameters make of its input
            rows.append(_row(idx, label, "output", sa.y - sa.pred, sb.y - sb.pred,
                             np.sqrt(np.square(sa.allowed) + np.square(sb.allowed)), n_in,
                             values=(sa.y, sb.y), dtype=dtype))
            fwd_prev = max(fwd_prev, _rel(sa.x, sb.x))
            if (fa is None) == (fb is None) and (fa is None or fa == fb):
                fwd_prev = max(fwd_prev, _rel(sa.y, sb.y))
        else:
            rows.append(_row(idx, label, "output", sa.y, sb.y, 0.0, n_in, dtype=dtype))
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
        final = _row(None, "model", "model output", oa, ob,
                     _carried(ob, report.dtype, width, tol.c_output, tol, fwd_prev) if oa.shape == ob.shape else 0.0,
                     width, dtype=report.dtype, stats=not verify_only)
        fwd_prev = max(fwd_prev, _rel(oa, ob))

    if grads:
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
                ga, aga = _dz(sa, ca.output_grad, n_out, report.dtype, pa)
                gb, agb = _dz(sb, cb.output_grad, n_out, report.dtype, pb)
                dzs[i] = (ga, gb, aga, agb)
                same = (sa.act is None) == (sb.act is None) and (sa.act is None or sa.act == sb.act)
                if same:  # compare what each framework gave: dL/dy
                    qa = np.zeros_like(sa.y) if ca.output_grad is None else _rows(ca.output_grad, n_out, pa)
                    qb = np.zeros_like(sb.y) if cb.output_grad is None else _rows(cb.output_grad, n_out, pb)
                    note, extra_allowed = "", 0.0
                else:  # the activation sits inside one layer only: compare before it, dL/dz
                    qa, qb, note, extra_allowed = ga, gb, "before the activation (dL/dz)", np.sqrt(aga ** 2 + agb ** 2)
                extra.append(_row(i, results[i].layer_type, "dL/dy", qa, qb,
                                  _carried(qb, report.dtype, n_out, tol.c_gradient, tol, bwd_prev) + extra_allowed,
                                  n_out, note, dtype=report.dtype))
                bwd_prev = max(bwd_prev, _rel(qa, qb))
                if pb in quant:  # dL/dx leaves through two different kernels: the quantization's own share
                    bwd_prev = max(bwd_prev, backward_spread(quant[pb], gb, params_b[pb]["kernel"]))
            if first_call.get(pb) == i and pb not in quant:
                extra += _param_rows(i, results[i].layer_type, pa, pb, cap_a, cap_b, rec, dzs, report.dtype, tol)
            if extra:
                results[i] = LayerResult(i, results[i].layer_type, results[i].quantities + tuple(extra))
    model_rows = ([final] if final is not None else []) + extra_calls
    report.layers = results + ([LayerResult(None, "model", tuple(model_rows))] if model_rows else [])
    report.first_failure = first_failure(report.layers)


def _verdict_rows(idx, label, ca: Call, cb: Call, pa, pb, n_in, n_out, dtype, tol: Tolerance,
                  prev: float) -> tuple[tuple, float]:
    """``judge="carried"``'s rows of one call, (input row, output row), and the largest relative
    difference so far. Each is judged as a value the code before it computed (``_carried``: the
    formula's rounding, K = in_features, plus GROWTH x ``prev``, the largest relative difference
    so far, which the output's row takes after adding its input's)."""
    xa, xb = _rows(ca.inputs[0], n_in, f"{pa} input"), _rows(cb.inputs[0], n_in, f"{pb} input")
    ya, yb = _rows(ca.output, n_out, f"{pa} output"), _rows(cb.output, n_out, f"{pb} output")
    same_x = xa.shape == xb.shape
    x_row = _row(idx, label, "input", xa, xb, _carried(xb, dtype, n_in, tol.c_output, tol, prev) if same_x else 0.0,
                 n_in, dtype=dtype, stats=False)
    prev = max(prev, _rel(xa, xb)) if same_x else prev
    same_y = ya.shape == yb.shape
    y_row = _row(idx, label, "output", ya, yb, _carried(yb, dtype, n_in, tol.c_output, tol, prev) if same_y else 0.0,
                 n_in, dtype=dtype, stats=False)
    return (x_row, y_row), max(prev, _rel(ya, yb)) if same_y else prev


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
        allowed = np.sqrt(np.square(_rounding(va, ta, dtype, n_rows, tol.c_gradient, tol) + xa)
                          + np.square(_rounding(vb, tb, dtype, n_rows, tol.c_gradient, tol) + xb))
        out.append(_row(i, label, q, va - ea, vb - eb, allowed, n_rows, values=(va, vb), dtype=dtype))
    return out
