"""compare_models(a, b, inputs): two whole models (any frameworks), judged linear layer by linear layer.

A ported transformer holds its linear layers among attention, norms and embeddings. Each model
runs ONE forward and ONE backward pass with its own framework's autograd (the adapters'
``capture`` verb), on the same inputs and the same random cotangent at the selected output, and
every matched linear layer's inputs, outputs, dL/d(output) and parameter gradients are recorded
call by call. Captures are reshaped to the canonical (rows, in_features) / (rows, units), so a
Keras ``EinsumDense`` output (batch, seq, heads, head_dim) meets torch's (batch, seq, hidden).

What is judged, per call of each matched layer (b is the reference; float64, in the captures'
own framework and device where the adapter offers an array namespace, else on the host:
``_namespace``; only scalars and small summaries reach the host):

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
  and its own rounding, but creates no differences of its own. Over T positions per example
  (the value's native (batch, *positions, features) shape) attention normalises over T positions
  and sums over T positions: K grows by 2 T and the carried part by sqrt(T) (``_judge``). An
  activation swapped between two linear layers (gelu exact vs tanh) is named at the input of the
  layer after it.
- with ``grads``: ``dL/dy`` (dL/d(output), judged like ``input`` but in backward order, against
  everything after it in the backward pass and the whole forward pass, C = 10), and per layer
  ``dL/dkernel`` / ``dL/dbias`` on their own contribution, like ``output``: autograd's
  gradient minus sum over calls of x^T dL/dy (resp. sum of dL/dy), each side, in quadrature.

A layer holding a low-rank adapter (LoRA, rsLoRA, DoRA) is judged through its effective kernel
(W + s A B, DoRA's scaled per unit), and each side's allowance adds the rounding of its own
adapter path (x @ A over in_features, then @ B over the rank, the scale and the add; DoRA's norm:
``_adapters``).

The state of one comparison (pairs, groups, parameters, captures, tolerance, flags) is one
``_comparison.Comparison``; ``_judge`` computes the rows from it and ``_isolated`` the teacher-forced
ones; ``_inputs`` reads the inputs in every form a user writes.

The first divergence is the first failing row in execution order (forward: each call's input,
then its output; then the model output; then the backward in reverse: dL/dy, then the layer's
parameter gradients) and is named by the layer's path. The tolerance dtype of a layer is the
coarser of the two layers' dtypes. The report is :class:`ModelReport` (a
:class:`~dense_bridge.testing.Report`: table, ``to_json``, ``to_html`` with the per-layer chart).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._errors import ConversionError, SpecError, check_flag, received
from ..registry._backends import backend_of, get_adapter
from ..registry._captures import LeafOutput
from ._degenerate import refuse_nonfinite_inputs, refuse_nonfinite_outputs
from ._gradients import effective_grads
from ._judge import GROWTH
from ._judge import judge as judge_rows
from ._report import ModelInfo, Report, fmt_err, fmt_units
from ._rounding import coarsest
from ._structure import model_structure
from ._tolerance import Tolerance

__all__ = ["compare_models", "ModelReport", "GROWTH", "JUDGES"]

#: How compare_models judges each layer: its own contribution, or as a value carried from its input.
JUDGES = ("layers", "carried")


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


def compare_models(a, b, inputs, *, mapping=None, grads: bool = True, outputs=None, seed: int = 0,
                   tolerance: Tolerance | None = None, isolated: bool = False,
                   judge: str = "layers") -> ModelReport:
    """Compare two whole models (any frameworks) linear layer by linear layer; ``b`` is the reference.

    ``inputs``: an array of any framework (numpy, torch on any device, jax, mx; token ids may be
    a nested Python list), a list of them (positional), a dict (keyword, as keras-hub's
    ``BertBackbone`` takes ``token_ids``/``segment_ids``/``padding_mask``), a list holding one
    dict, or a pair ``(inputs_a, inputs_b)`` when the models take different signatures
    (``_inputs``); any other form is a TypeError naming it, an input without rows a SpecError.
    Integer arrays (token ids) stay integers; floating ones are rounded once to values both
    models' dtypes hold.
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
    A layer one model calls once over all rows and the other N times over a share of them each
    (a scan written as a loop over positions) is compared as one call, the N calls joined along
    the rows; the calls of a layer whose counterpart is never called as a module (its weights read
    directly) are left out, noted, and judged where their values arrive (``_row_calls``).
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
    from ._comparison import Options, default_selects, prepare
    from ..models._inputs import model_inputs

    grads, isolated = check_flag("grads", grads), check_flag("isolated", isolated)
    if judge not in JUDGES:
        raise SpecError(received("judge", judge, f"one of {', '.join(repr(j) for j in JUDGES)}"))
    seed = check_count("seed", seed, 0)
    tol = check_tolerance(tolerance)
    select_a, select_b = default_selects(outputs)  # first floating outputs, re-paired by shape below if they differ
    backends = {"a": backend_of(a, "a"), "b": backend_of(b, "b")}  # once here, once by each model's walk
    adapter_a, adapter_b = get_adapter(backends["a"]), get_adapter(backends["b"])
    grads, grads_note = effective_grads(backends, grads)
    for name, adapter in (("a", adapter_a), ("b", adapter_b)):
        if not callable(getattr(adapter, "capture", None)):
            raise ConversionError(f"the {adapter.__name__.rsplit('.', 1)[-1]!r} backend cannot capture layers "
                                  f"inside a whole model yet (no capture verb); {name} cannot be compared")
    in_a, in_b = model_inputs(inputs)
    for side, given in (("inputs", in_a), ("inputs_b", in_b)):
        refuse_nonfinite_inputs(given.items() if isinstance(given, dict) else
                                ((f"{side}[{i}]", x) for i, x in enumerate(given)))
    cmp = prepare(a, b, mapping, (in_a, in_b), Options(grads, tol, seed, carried=judge == "carried",
                                                           isolated=isolated))
    cmp.capture(select_a, select_b)
    output_note = None
    if outputs is None and cmp.cap_a.output is not None and cmp.cap_b.output is not None \
            and cmp.cap_a.output.shape != cmp.cap_b.output.shape:
        paired = _pair_outputs_by_shape(select_a.shapes, select_b.shapes)
        if paired is not None:  # e.g. keras-hub's dict comes back in another order on the torch engine
            cmp.capture(LeafOutput(paired[0]), LeafOutput(paired[1]))
            output_note = (f"outputs: the models' first floating outputs differ in shape ({select_a.shapes[0]} vs "
                           f"{select_b.shapes[0]}); compared a's floating output #{paired[0]} with b's #{paired[1]}, "
                           f"both {select_a.shapes[paired[0]]} (the one same-shaped pair); pass outputs= to choose")
    refuse_nonfinite_outputs(cmp.cap_a.output, cmp.cap_b.output, cmp.xp)
    report = _new_report(cmp, [output_note] if output_note else [], [grads_note] if grads_note else [])
    judge_rows(report, cmp, carried_only=cmp.carried)
    if isolated:
        from ._isolated import teacher_forced

        teacher_forced(report, cmp)
    return report


def _new_report(cmp, before: list[str], after: list[str]) -> ModelReport:
    """The empty report of a captured comparison: the models, dtypes, pairs and the notes (layers
    left unpaired, ``before``, what the captures say, ``after``), with the parameter structure
    unless ``judge="carried"``."""
    a, b = cmp.a, cmp.b
    report = ModelReport(ModelInfo(cmp.backends[0], type(a).__name__, cmp.dtype_a),
                         ModelInfo(cmp.backends[1], type(b).__name__, cmp.dtype_b),
                         coarsest([cmp.dtype_a, cmp.dtype_b]), cmp.tol, _input_shapes(cmp.inputs_b), cmp.seed, True)
    report.pairs = cmp.pairs
    for side, layers in (("a", cmp.layers_a), ("b", cmp.layers_b)):
        matched = set(cmp.members(side))
        left = [p for p in layers if p not in matched]
        if left:
            report.notes.append(f"{side}'s linear layers the mapping does not pair (not compared): {', '.join(left)}")
    report.notes += before
    report.notes += [f"a: {n}" for n in cmp.cap_a.notes] + [f"b: {n}" for n in cmp.cap_b.notes]
    if not cmp.carried:
        report.structure = model_structure(a, b, cmp.pairs, cmp.groups, entries=cmp.walks, read=cmp.read)
    report.notes += after
    return report


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
