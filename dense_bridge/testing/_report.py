"""The equivalence report: per-layer rows, a text table, a dict/JSON form and an HTML page.

Nothing here computes errors (see ``_compare``); it only holds and renders them. The HTML page
is self-contained (inline CSS and SVG, no script) so it can be attached to a CI run as is.
"""
from __future__ import annotations

import html
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ._tolerance import Tolerance

__all__ = ["QuantityResult", "LayerResult", "Report"]


@dataclass(frozen=True)
class QuantityResult:
    """One compared quantity of one layer (``quantity``: "output", "dL/dx", "dL/dkernel", ...).

    ``units`` is the max error in tolerance units (<= 1 passes; inf for a shape mismatch, a
    missing quantity or a NaN/Inf in only one of the two); ``fan_in`` is K, the length of the
    reduction that produced it (its allowance also carries what it inherits from its inputs).
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

    def to_dict(self) -> dict:
        return {"layer": self.layer, "layer_type": self.layer_type, "quantity": self.quantity,
                "max_abs_error": _json_float(self.max_abs_error), "units": _json_float(self.units),
                "passed": self.passed, "fan_in": self.fan_in,
                "shape": list(self.shape), "note": self.note}


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
        if self.spec_differences:
            lines.append("spec differences (a vs b):")
            lines += [f"  {d}" for d in self.spec_differences]
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.layers:
            type_w = max([10] + [len(l.layer_type) for l in self.layers])
            q_w = max([10] + [len(q.quantity) for q in self.rows])
            header = (f"{'layer':>5}  {'type':<{type_w}}  {'quantity':<{q_w}}  {'max abs err':>11}  "
                      f"{'tol units':>9}  {'K':>6}  result")
            lines += [header, "-" * len(header)]
            for layer in self.layers:
                idx = "all" if layer.index is None else str(layer.index)
                for q in layer.quantities:
                    lines.append(f"{idx:>5}  {layer.layer_type:<{type_w}}  {q.quantity:<{q_w}}  "
                                 f"{fmt_err(q.max_abs_error):>11}  {fmt_units(q.units):>9}  {q.fan_in:>6}  "
                                 f"{'PASS' if q.passed else 'FAIL'}"
                                 + (f"  ({q.note})" if q.note else ""))
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
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def to_json(self, **kwargs) -> str:
        """``to_dict()`` as strict JSON (``json.dumps`` keyword arguments pass through)."""
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    # ------------------------------------------------------------------ html
    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained HTML page (table plus an SVG error chart); written atomically to ``path``."""
        page = _render_html(self)
        if path is not None:
            _write_atomic(Path(path), page)
        return page


# ---------------------------------------------------------------------- helpers
def _json_float(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def fmt_err(x: float) -> str:
    return "inf" if math.isinf(x) else ("nan" if math.isnan(x) else f"{x:.3e}")


def fmt_units(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x:.3g}" if x < 1e4 else f"{x:.2e}"


def _where(q: QuantityResult) -> str:
    return "the model output" if q.layer is None else f"layer {q.layer} ({q.layer_type})"


def _write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside ``path``, then rename: readers never see half a page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


_SHORT = {"output": "out", "dL/dx": "dx", "dL/dx1": "dx1", "dL/dx2": "dx2", "dL/dkernel": "dW",
          "dL/dbias": "db", "input": "in", "dL/dy": "dy", "model output": "out"}
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.3em}table{border-collapse:collapse;font-family:monospace;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#f3f3f3}
td.l{text-align:left}tr.fail td{background:#fde8e8}.pass{color:#17803d}.fail{color:#b91c1c}
.verdict{font-size:1.1em;font-weight:bold;margin:1em 0}ul{font-family:monospace}"""


def _svg_chart(report: Report) -> str:
    """Bars of log10(tolerance units) per layer and quantity; a dashed line at 1 unit."""
    rows = report.rows
    if not rows:
        return '<svg xmlns="http://www.w3.org/2000/svg" width="300" height="40"><text x="4" y="24">' \
               'nothing was compared</text></svg>'
    finite = [math.log10(q.units) for q in rows if math.isfinite(q.units) and q.units > 0]
    lo = min([-4.0] + [math.floor(v) for v in finite])
    hi = max([2.0] + [math.ceil(v) for v in finite])
    top_cap = hi + 0.5  # where an infinite error is drawn
    left, right, top, bottom, height = 56, 16, 24, 64, 260
    bar, gap, group_gap = 16, 3, 18
    widths = [len(layer.quantities) * (bar + gap) - gap for layer in report.layers]
    width = max(left + 200, left + right + sum(widths) + group_gap * (len(widths) + 1))  # room for the legend

    def y(v: float) -> float:
        return top + (top_cap - v) / (top_cap - lo) * height

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + bottom}" '
             f'font-family="monospace" font-size="11">']
    for tick in range(int(lo), int(hi) + 1):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
                     f'stroke="#eee"/><text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">1e{tick}</text>')
    parts.append(f'<text x="12" y="{top + height / 2:.0f}" transform="rotate(-90 12 {top + height / 2:.0f})" '
                 f'text-anchor="middle">error / tolerance (log)</text>')
    x = left + group_gap
    for layer, w in zip(report.layers, widths):
        for i, q in enumerate(layer.quantities):
            bx = x + i * (bar + gap)
            if math.isfinite(q.units):
                v = math.log10(q.units) if q.units > 0 else lo
            else:
                v = top_cap
            color = "#2f9e44" if q.passed else "#e03131"
            tip = html.escape(f"layer {layer.index if layer.index is not None else 'all'} {q.quantity}: "
                              f"{fmt_units(q.units)} units, max abs err {fmt_err(q.max_abs_error)}")
            parts.append(f'<rect x="{bx}" y="{y(v):.1f}" width="{bar}" height="{max(1.0, y(lo) - y(v)):.1f}" '
                         f'fill="{color}"><title>{tip}</title></rect>')
            label = html.escape(_SHORT.get(q.quantity, q.quantity))
            parts.append(f'<text x="{bx + bar / 2}" y="{top + height + 14}" text-anchor="middle" '
                         f'font-size="9">{label}</text>')
        name = "all" if layer.index is None else f"layer {layer.index}"
        fits = max(3, int((w + group_gap) / 5.6))  # monospace 9px: about 5.4px a character
        kind = layer.layer_type if len(layer.layer_type) <= fits else layer.layer_type[:fits - 1] + "\u2026"
        parts.append(f'<text x="{x + w / 2}" y="{top + height + 30}" text-anchor="middle">{html.escape(name)}</text>'
                     f'<text x="{x + w / 2}" y="{top + height + 44}" text-anchor="middle" font-size="9">'
                     f'<title>{html.escape(layer.layer_type)}</title>{html.escape(kind)}</text>')
        x += w + group_gap
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#b91c1c" '
                 f'stroke-dasharray="6 3" stroke-width="1.5"/><text x="{width - right}" y="{y(0) - 4:.1f}" '
                 f'text-anchor="end" fill="#b91c1c">tolerance (1 unit)</text>')
    parts.append(f'<rect x="{left}" y="6" width="10" height="10" fill="#2f9e44"/><text x="{left + 14}" y="15">'
                 f'within tolerance</text><rect x="{left + 130}" y="6" width="10" height="10" fill="#e03131"/>'
                 f'<text x="{left + 144}" y="15">over</text>')
    parts.append("</svg>")
    return "".join(parts)


def _render_html(report: Report) -> str:
    e = html.escape
    status = "pass" if report.passed else "fail"
    t = report.tolerance
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>dense_bridge equivalence: {e(str(report.a))} vs {e(str(report.b))}</title>",
           f"<style>{_CSS}</style></head><body>",
           "<h1>dense_bridge equivalence report</h1>",
           f"<p>a: {e(str(report.a))}<br>b: {e(str(report.b))}<br>tolerance: dtype {e(report.dtype)}, "
           f"C output {t.c_output:g}, C gradient {t.c_gradient:g}" + (f", atol {t.atol:g}" if t.atol else "")
           + f"<br>inputs: {e(', '.join(str(s) for s in report.input_shapes) or '-')} "
           + ("given" if report.inputs_given else f"from seed {report.seed}")
           + ("; strict (spec differences in function or precision fail)" if report.strict else "") + "</p>",
           f'<p class="verdict {status}">{e(report.verdict())}</p>']
    if report.spec_differences:
        out.append("<h2>Spec differences (a vs b)</h2><ul>")
        out += [f"<li>{e(d)}</li>" for d in report.spec_differences]
        out.append("</ul>")
    if report.notes:
        out.append("<ul>" + "".join(f"<li>note: {e(n)}</li>" for n in report.notes) + "</ul>")
    out.append("<h2>Error per layer</h2>")
    out.append(_svg_chart(report))
    out.append("<h2>Table</h2><table><tr><th>layer</th><th>type</th><th>quantity</th><th>max abs err</th>"
               "<th>tol units</th><th>K</th><th>result</th><th>note</th></tr>")
    for layer in report.layers:
        for q in layer.quantities:
            cls = "" if q.passed else ' class="fail"'
            out.append(f"<tr{cls}><td>{'all' if layer.index is None else layer.index}</td>"
                       f'<td class="l">{e(layer.layer_type)}</td><td class="l">{e(q.quantity)}</td>'
                       f"<td>{fmt_err(q.max_abs_error)}</td><td>{fmt_units(q.units)}</td><td>{q.fan_in}</td>"
                       f"<td class=\"{'pass' if q.passed else 'fail'}\">"
                       f"{'PASS' if q.passed else 'FAIL'}</td><td class=\"l\">{e(q.note)}</td></tr>")
    out.append("</table></body></html>")
    return "\n".join(out)
