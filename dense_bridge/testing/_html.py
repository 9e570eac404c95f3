"""The HTML page of a report: verdict and first divergence at the top, structure, the per-layer
chart beside per-layer error histograms, then every layer as a collapsible section.

Self-contained (inline CSS and SVG, no script), so a CI run can attach it as is. Built to read
well for a model of dozens of layers: the layer where the models first part is shown open at
the top, failing layers are open, passing ones folded; the chart scrolls sideways.
Histograms count elements per tolerance-unit bin (``_elements.HISTOGRAM_EDGES``): green bins
pass, red ones fail; bar heights are log-scaled so a handful of bad elements among thousands
still shows.
"""
from __future__ import annotations

import html
import math

from ._elements import HISTOGRAM_EDGES
from ._format import detail_notes, fmt_err, fmt_units, result_word, ulp_cells

__all__ = ["render_html", "svg_chart"]

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222;max-width:1400px}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.4em}table{border-collapse:collapse;font-family:monospace;
font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#f3f3f3}
td.l{text-align:left}tr.fail td{background:#fde8e8}.pass{color:#17803d}.fail{color:#b91c1c}
.verdict{font-size:1.1em;font-weight:bold;margin:0.8em 0}ul{font-family:monospace;font-size:12px}
.first{border:2px solid #b91c1c;border-radius:6px;padding:0.5em 1em;background:#fff8f8}
.row{display:flex;gap:1.2em;align-items:flex-start}.chart{flex:0 1 auto;max-width:60%;overflow-x:auto}
.hists{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:6px;flex:1 1 40%;
max-height:360px;overflow-y:auto;align-content:start}
.hist{border:1px solid #eee;border-radius:4px;padding:2px 4px;font-family:monospace;font-size:10px}
.hist.bad{border:2px solid #e03131}
details{border:1px solid #ddd;border-radius:4px;margin:3px 0;padding:2px 8px}
summary{cursor:pointer;font-family:monospace;font-size:13px}summary .tag{font-weight:bold}
.meta{font-size:13px}.bit{color:#1864ab;font-weight:bold}"""

_BIN_LABELS = ["<1e-3"] + [f"<1e{int(e)}" for e in HISTOGRAM_EDGES[1:]] + [f">=1e{int(HISTOGRAM_EDGES[-1])}"]
_PASS_BINS = sum(1 for e in HISTOGRAM_EDGES if e <= 0)  # bins below 1 unit
_SHORT = {"output": "out", "dL/dx": "dx", "dL/dx1": "dx1", "dL/dx2": "dx2", "dL/dkernel": "dW",
          "dL/dbias": "db", "input": "in", "dL/dy": "dy", "model output": "out"}


def svg_chart(report) -> str:
    """Bars of log10(tolerance units) per layer and quantity (over 60 quantities: one bar per layer,
    its worst quantity); a dashed line at 1 unit."""
    rows = report.rows
    if not rows:
        return '<svg xmlns="http://www.w3.org/2000/svg" width="300" height="40"><text x="4" y="24">' \
               'nothing was compared</text></svg>'
    finite = [math.log10(q.units) for q in rows if math.isfinite(q.units) and q.units > 0]
    lo = min([-4.0] + [math.floor(v) for v in finite])
    hi = max([2.0] + [math.ceil(v) for v in finite])
    top_cap = hi + 0.5  # where an infinite error is drawn
    left, right, top, bottom, height = 56, 16, 24, 64, 260
    # a model of dozens of layers gets one bar per layer, its worst quantity, rather than a page-wide chart
    compact = len(rows) > 60
    bar, gap, group_gap = (max(4, min(14, 700 // len(report.layers))), 1, 3) if compact else (16, 3, 18)
    shown = [[max(layer.quantities, key=lambda q: q.units)] if compact and layer.quantities else
             list(layer.quantities) for layer in report.layers]
    widths = [len(qs) * (bar + gap) - gap for qs in shown]
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
    for layer, w, qs in zip(report.layers, widths, shown):
        for i, q in enumerate(qs):
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
            if not compact:
                label = html.escape(_SHORT.get(q.quantity, q.quantity))
                parts.append(f'<text x="{bx + bar / 2}" y="{top + height + 14}" text-anchor="middle" '
                             f'font-size="9">{label}</text>')
        name = "all" if layer.index is None else (str(layer.index) if compact else f"layer {layer.index}")
        fits = max(3, int((w + group_gap) / 5.6))  # monospace 9px: about 5.4px a character
        kind = layer.layer_type if len(layer.layer_type) <= fits else layer.layer_type[:fits - 1] + "\u2026"
        color = "" if layer.passed else ' fill="#b91c1c" font-weight="bold"'
        if not compact or not layer.passed or layer.index is None or layer.index % 10 == 0:
            parts.append(f'<text x="{x + w / 2}" y="{top + height + (16 if compact else 30)}" '
                         f'text-anchor="middle"{color}>{html.escape(name)}</text>')
        if not compact:
            parts.append(f'<text x="{x + w / 2}" y="{top + height + 44}" text-anchor="middle" font-size="9">'
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


def _hist_svg(counts: list[int], width: int = 140, height: int = 44) -> str:
    """Bars of log(1 + count) per tolerance-unit bin, green below 1 unit, red from 1 unit up."""
    n = len(counts)
    if not n or not any(counts):
        return '<svg xmlns="http://www.w3.org/2000/svg" width="140" height="14"><text x="2" y="11" ' \
               'font-size="10">no elements</text></svg>'
    top = math.log1p(max(counts))
    bar = width / n
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 12}" font-size="8">']
    for i, c in enumerate(counts):
        h = 0 if not c else max(1.5, (height - 2) * math.log1p(c) / top)
        color = "#2f9e44" if i < _PASS_BINS else "#e03131"
        parts.append(f'<rect x="{i * bar + 1:.1f}" y="{height - h:.1f}" width="{bar - 2:.1f}" height="{h:.1f}" '
                     f'fill="{color}"><title>{html.escape(_BIN_LABELS[i])} units: {c} element(s)</title></rect>')
    x1 = _PASS_BINS * bar
    parts.append(f'<line x1="{x1:.1f}" x2="{x1:.1f}" y1="0" y2="{height}" stroke="#b91c1c" stroke-dasharray="3 2"/>')
    parts.append(f'<text x="0" y="{height + 10}">1e-3</text><text x="{x1 - 4:.0f}" y="{height + 10}">1</text>'
                 f'<text x="{width - 22}" y="{height + 10}">1e3+</text></svg>')
    return "".join(parts)


def _layer_hist(quantities) -> list[int]:
    total = [0] * (len(HISTOGRAM_EDGES) + 1)
    for q in quantities:
        if q.stats is not None and q.stats.histogram:
            total = [t + c for t, c in zip(total, q.stats.histogram)]
    return total


def _name(index) -> str:
    return "model" if index is None else f"layer {index}"


def _quantity_table(quantities, e) -> str:
    out = ['<table><tr><th>quantity</th><th>max abs err</th><th>tol units</th><th>K</th><th>ULP max/med</th>'
           '<th>out of tolerance</th><th>result</th><th>worst element, NaN/Inf, note</th><th>histogram</th></tr>']
    for q in quantities:
        ulp, frac = ulp_cells(q)
        cls = "" if q.passed else ' class="fail"'
        word = result_word(q)
        word_cls = "bit" if q.bit_identical else ("pass" if q.passed else "fail")
        hist = _hist_svg(list(q.stats.histogram)) if q.stats is not None and q.stats.histogram else ""
        out.append(f'<tr{cls}><td class="l">{e(q.quantity)}</td><td>{fmt_err(q.max_abs_error)}</td>'
                   f"<td>{fmt_units(q.units)}</td><td>{q.fan_in}</td><td>{e(ulp)}</td><td>{e(frac)}</td>"
                   f'<td class="{word_cls}">{e(word)}</td><td class="l">{e("; ".join(detail_notes(q)))}</td>'
                   f"<td>{hist}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _summary(layer) -> str:
    worst = max(layer.quantities, key=lambda q: q.units) if layer.quantities else None
    bits = layer.quantities and all(q.bit_identical for q in layer.quantities)
    tag = "bit-identical" if bits else ("PASS" if layer.passed else "FAIL")
    cls = "bit" if bits else ("pass" if layer.passed else "fail")
    extra = "" if worst is None else f" &middot; worst {fmt_units(worst.units)} units ({html.escape(worst.quantity)})"
    return (f'<summary><span class="tag {cls}">{tag}</span> {html.escape(_name(layer.index))} &middot; '
            f"{html.escape(layer.layer_type)}{extra}</summary>")


def render_html(report) -> str:
    """The page (see the module docstring)."""
    e = html.escape
    status = "pass" if report.passed else "fail"
    t = report.tolerance
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>dense_bridge equivalence: {e(str(report.a))} vs {e(str(report.b))}</title>",
           f"<style>{_CSS}</style></head><body>",
           "<h1>dense_bridge equivalence report</h1>",
           f'<p class="meta">a: {e(str(report.a))}<br>b: {e(str(report.b))} (reference)<br>tolerance: dtype '
           f"{e(report.dtype)}, C output {t.c_output:g}, C gradient {t.c_gradient:g}"
           + (f", atol {t.atol:g}" if t.atol else "")
           + f"<br>inputs: {e(', '.join(str(s) for s in report.input_shapes) or '-')} "
           + ("given" if report.inputs_given else f"from seed {report.seed}")
           + ("; strict (spec differences in function or precision fail)" if report.strict else "")
           + "<br>mode: " + ("isolated (teacher forcing: each layer of b ran on what a's received)"
                            if report.isolated else "cascaded (each model on its own values)") + "</p>",
           f'<p class="verdict {status}">{e(report.verdict())}</p>']
    f = report.first_failure
    if f is not None:
        first = next((layer for layer in report.layers if f in layer.quantities), None)
        if first is not None:
            out.append(f'<div class="first"><h2>First divergence: {e(_name(first.index))} &middot; '
                       f"{e(first.layer_type)} ({e(f.quantity)})</h2>{_quantity_table(first.quantities, e)}</div>")
    if report.structure is not None:
        out.append("<h2>Structure (before running)</h2><ul>" + "".join(
            f"<li>{e(line.strip())}</li>" for line in report.structure.lines()) + "</ul>")
    if report.spec_differences:
        out.append("<h2>Spec differences (a vs b)</h2><ul>" + "".join(f"<li>{e(d)}</li>"
                                                                      for d in report.spec_differences) + "</ul>")
    if report.notes:
        out.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in report.notes) + "</ul>")
    out.append('<h2>Error per layer: tolerance units per quantity, and each layer\'s elements per tolerance '
               'bin</h2><div class="row"><div class="chart">' + svg_chart(report) + "</div>")
    out.append('<div class="hists">')
    # failing layers first (in execution order), so the divergence is in view without scrolling
    for layer in sorted(report.layers, key=lambda layer: layer.passed):
        cls = "pass" if layer.passed else "fail"
        out.append(f'<div class="hist{"" if layer.passed else " bad"}"><span class="{cls}">{e(_name(layer.index))}</span> '
                   f'<span title="{e(layer.layer_type)}">{e(layer.layer_type[-22:])}</span><br>'
                   f"{_hist_svg(_layer_hist(layer.quantities))}</div>")
    out.append("</div></div>")
    out.append(f"<h2>Layers ({len(report.layers)}; failing ones open)</h2>")
    for layer in report.layers:
        is_open = "" if layer.passed else " open"
        out.append(f"<details{is_open}>{_summary(layer)}{_quantity_table(layer.quantities, e)}</details>")
    out.append("</body></html>")
    return "\n".join(out)

