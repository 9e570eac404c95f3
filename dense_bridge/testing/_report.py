"""The equivalence report: per-layer rows, a text table, a dict/JSON form and an HTML page.

Nothing here computes errors (see ``_compare``); it only holds and renders them. The HTML page
is self-contained (inline CSS and SVG, no script) so it can be attached to a CI run as is.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..checkpoints._io import write_text
from ._elements import ElementStats
from ._format import detail_notes, fmt_err, fmt_units, result_word, ulp_cells
from ._tolerance import Tolerance

__all__ = ["QuantityResult", "LayerResult", "Report"]


@dataclass(frozen=True)
class QuantityResult:
    """One compared quantity of one layer (``quantity``: "output", "dL/dx", "dL/dkernel", ...).

    ``units`` is the max error in tolerance units (<= 1 passes; inf for a shape mismatch, a
    missing quantity or a NaN/Inf in only one of the two); ``fan_in`` is K, the length of the
    reduction that produced it (its allowance also carries what it inherits from its inputs).
    ``stats``: element by element (ULPs, the fraction out of tolerance, the worst element with
    both values, NaN/Inf positions; see ``_elements``), None where no values were compared.
    """

    layer: int | None
    layer_type: str
    quantity: str
    max_abs_error: float
    units: float
    passed: bool
    fan_in: int = 0
    shape: tuple[int, ...] = ()
    note: str = ""
    stats: ElementStats | None = None

    @property
    def bit_identical(self) -> bool:
        """True when every element of the two sides matches exactly (NaN with NaN)."""
        return self.stats is not None and self.stats.bit_identical

    def to_dict(self) -> dict:
        return {"layer": self.layer, "layer_type": self.layer_type, "quantity": self.quantity,
                "max_abs_error": _json_float(self.max_abs_error), "units": _json_float(self.units),
                "passed": self.passed, "fan_in": self.fan_in,
                "shape": list(self.shape), "note": self.note,
                "bit_identical": self.bit_identical,
                "elements": None if self.stats is None else self.stats.to_dict()}


@dataclass(frozen=True)
class LayerResult:
    """All compared quantities of one layer position (``index`` None: the model end to end)."""

    index: int | None
    layer_type: str
    quantities: tuple[QuantityResult, ...]

    @property
    def passed(self) -> bool:
        return all(q.passed for q in self.quantities)

    def __getitem__(self, quantity: str) -> QuantityResult:
        for q in self.quantities:
            if q.quantity == quantity:
                return q
        raise KeyError(f"layer {self.index} has no quantity {quantity!r}; it has "
                       f"{[q.quantity for q in self.quantities]}")

    def to_dict(self) -> dict:
        return {"index": self.index, "layer_type": self.layer_type, "passed": self.passed,
                "quantities": [q.to_dict() for q in self.quantities]}


#: rows judged on the way forward, in execution order: a layer's input, its quantization, its output
FORWARD_QUANTITIES = ("input", "quantization", "output")
#: rows about the whole run, between the forward and the backward pass (``compare_models``)
RUN_QUANTITIES = ("model output", "calls")


def first_failure(layers: list[LayerResult]) -> QuantityResult | None:
    """The first failing quantity in execution order: the forward rows layer by layer, then the
    rows about the whole run, then the backward rows (dL/dx, dL/dy, parameter gradients) from
    the last layer to the first. ``compare`` has only outputs and gradients; ``compare_models``
    adds inputs, quantization, the model output and call counts."""
    for layer in layers:
        for q in layer.quantities:
            if q.quantity in FORWARD_QUANTITIES and not q.passed:
                return q
    for layer in layers:
        for q in layer.quantities:
            if q.quantity in RUN_QUANTITIES and not q.passed:
                return q
    for layer in reversed(layers):
        for q in layer.quantities:
            if q.quantity not in FORWARD_QUANTITIES + RUN_QUANTITIES and not q.passed:
                return q
    return None


@dataclass(frozen=True)
class ModelInfo:
    """What one side of the comparison was: backend, model kind and dtype."""

    backend: str
    kind: str
    dtype: str

    def __str__(self) -> str:
        return f"{self.backend} {self.kind} ({self.dtype})"


@dataclass
class Report:
    """Result of :func:`~dense_bridge.testing.compare`.

    ``layers``: one :class:`LayerResult` per layer position, in forward order;
    ``first_divergence``: the index of the layer where the two models first part (see
    ``compare``), ``first_failure`` the failing quantity there; ``spec_differences``: readable
    field-by-field differences of the two specs; ``strict_differences``: those of them that
    change the function or its precision, which fail the report only when ``strict`` is True;
    ``notes``: what was adapted or not compared.
    """

    a: ModelInfo
    b: ModelInfo
    dtype: str
    tolerance: Tolerance
    input_shapes: list[tuple[int, ...]]
    seed: int
    inputs_given: bool
    layers: list[LayerResult] = field(default_factory=list)
    spec_differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: bool = True
    first_failure: QuantityResult | None = None
    strict: bool = False
    strict_differences: list[str] = field(default_factory=list)
    #: teacher forcing: every layer of b ran on the input and cotangent a's counterpart received
    isolated: bool = False
    #: parameters of either model left unmatched, tied or matched with another dtype, and both
    #: parameter counts (``_structure.Structure``), found before anything ran; None: not looked at
    structure: Any = None

    # ------------------------------------------------------------------ verdict
    @property
    def passed(self) -> bool:
        """True when the numeric comparison ran and every quantity is within tolerance (and, when
        ``strict``, the specs compute the same function at the same precision)."""
        return self.compared and all(layer.passed for layer in self.layers) and not self.strict_failed

    @property
    def strict_failed(self) -> bool:
        """True when strict mode is on and the specs differ in function or precision."""
        return self.strict and bool(self.strict_differences)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def first_divergence(self) -> int | None:
        """Index of the layer where the models first part, or None (also for end-to-end rows)."""
        return None if self.first_failure is None else self.first_failure.layer

    @property
    def rows(self) -> list[QuantityResult]:
        """Every compared quantity, layer by layer."""
        return [q for layer in self.layers for q in layer.quantities]

    @property
    def bit_identical(self) -> bool:
        """True when something was compared and every value of every quantity matches exactly."""
        rows = self.rows
        return self.compared and bool(rows) and all(q.bit_identical for q in rows)

    @property
    def worst(self) -> QuantityResult | None:
        """The quantity with the most tolerance units (None when nothing was compared)."""
        rows = self.rows
        return max(rows, key=lambda q: q.units) if rows else None

    # ------------------------------------------------------------------ text
    def verdict(self) -> str:
        """One line: PASS or FAIL and where."""
        if not self.compared:
            return "FAIL: the numeric comparison could not run (" + "; ".join(self.notes) + ")"
        strict = (f"strict: the specs differ in {len(self.strict_differences)} field(s) that change the "
                  f"function or its precision: " + "; ".join(self.strict_differences)) if self.strict_failed else ""
        worst = self.worst
        if self.passed and self.bit_identical:
            return f"PASS: bit-identical: every value of {len(self.rows)} quantities matches exactly (0 ULP)"
        if self.passed:
            extra = f" (specs differ in {len(self.spec_differences)} field(s))" if self.spec_differences else ""
            where = "" if worst is None else (f"; worst {fmt_units(worst.units)} tolerance units at "
                                              f"{_where(worst)} {worst.quantity}")
            return f"PASS: {len(self.rows)} quantities within tolerance{where}{extra}"
        f = self.first_failure
        if f is None:  # the numbers agree: only strict mode failed it
            return f"FAIL ({strict}); numerically {len(self.rows)} quantities within tolerance"
        return (f"FAIL: first divergence at {_where(f)} {f.quantity}: {fmt_units(f.units)} tolerance "
                f"units (max abs err {fmt_err(f.max_abs_error)})" + (f"; {f.note}" if f.note else "")
                + (f"; {strict}" if strict else ""))

    def __str__(self) -> str:
        t = self.tolerance
        lines = [
            "dense_bridge equivalence report",
            f"  a: {self.a}",
            f"  b: {self.b}",
            f"  tolerance: dtype {self.dtype}, C output {t.c_output:g}, C gradient {t.c_gradient:g}"
            + (f", atol {t.atol:g}" if t.atol else "")
            + f"; inputs {', '.join(str(s) for s in self.input_shapes) or '-'} "
            + ("given" if self.inputs_given else f"from seed {self.seed}")
            + ("; strict (spec differences in function or precision fail)" if self.strict else ""),
        ]
        if self.isolated:
            lines.append("  mode: isolated (each layer of b ran on the input and output gradient its counterpart "
                         "in a received)")
        if self.structure is not None:
            lines += self.structure.lines()
        if self.spec_differences:
            lines.append("spec differences (a vs b):")
            lines += [f"  {d}" for d in self.spec_differences]
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.layers:
            type_w = max([10] + [len(l.layer_type) for l in self.layers])
            q_w = max([10] + [len(q.quantity) for q in self.rows])
            header = (f"{'layer':>5}  {'type':<{type_w}}  {'quantity':<{q_w}}  {'max abs err':>11}  "
                      f"{'tol units':>9}  {'K':>6}  {'ULP max/med':>15}  {'out of tol':>18}  result")
            lines += [header, "-" * len(header)]
            for layer in self.layers:
                idx = "all" if layer.index is None else str(layer.index)
                for q in layer.quantities:
                    ulp, frac = ulp_cells(q)
                    lines.append(f"{idx:>5}  {layer.layer_type:<{type_w}}  {q.quantity:<{q_w}}  "
                                 f"{fmt_err(q.max_abs_error):>11}  {fmt_units(q.units):>9}  {q.fan_in:>6}  "
                                 f"{ulp:>15}  {frac:>18}  {result_word(q):<18}"
                                 + "".join(f"  ({x})" for x in detail_notes(q)))
        lines.append(self.verdict())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Report {'PASS' if self.passed else 'FAIL'}: {self.a} vs {self.b}>"

    # ------------------------------------------------------------------ data
    def to_dict(self) -> dict:
        """A JSON-able dict (non-finite numbers as the strings "inf"/"nan")."""
        f = self.first_failure
        return {
            "passed": self.passed,
            "verdict": self.verdict(),
            "first_divergence": self.first_divergence,
            "first_divergence_quantity": None if f is None else f.quantity,
            "a": vars(self.a).copy(), "b": vars(self.b).copy(),
            "dtype": self.dtype,
            "tolerance": {"c_output": self.tolerance.c_output, "c_gradient": self.tolerance.c_gradient,
                          "atol": self.tolerance.atol},
            "inputs": {"shapes": [list(s) for s in self.input_shapes], "seed": self.seed,
                       "given": self.inputs_given},
            "compared": self.compared,
            "strict": self.strict,
            "spec_differences": list(self.spec_differences),
            "strict_differences": list(self.strict_differences),
            "notes": list(self.notes),
            "isolated": self.isolated,
            "bit_identical": self.bit_identical,
            "structure": None if self.structure is None else self.structure.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def to_json(self, **kwargs) -> str:
        """``to_dict()`` as strict JSON (``json.dumps`` keyword arguments pass through)."""
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    # ------------------------------------------------------------------ html
    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained HTML page (table plus an SVG error chart); written atomically to ``path``."""
        from ._html import render_html

        page = render_html(self)
        if path is not None:
            write_text(os.fspath(path), page, make_parent=True)  # readers never see half a page
        return page


# ---------------------------------------------------------------------- helpers
def _json_float(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def _where(q: QuantityResult) -> str:
    return "the model output" if q.layer is None else f"layer {q.layer} ({q.layer_type})"
