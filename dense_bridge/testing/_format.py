"""Cell texts of a report row, shared by the table (``_report``) and the HTML page (``_html``)."""
from __future__ import annotations

import math
from typing import Any

from ._elements import fmt_ulp

__all__ = ["fmt_err", "fmt_units", "ulp_cells", "result_word", "worst_text", "detail_notes"]


def fmt_err(x: float) -> str:
    return "inf" if math.isinf(x) else ("nan" if math.isnan(x) else f"{x:.3e}")


def fmt_units(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x:.3g}" if x < 1e4 else f"{x:.2e}"


def ulp_cells(q: Any) -> tuple[str, str]:
    """("max/median" ULPs, "n/N (x%)" out of tolerance) of a row, "-" where no values were compared."""
    if q.stats is None:
        return "-", "-"
    s = q.stats
    return f"{fmt_ulp(s.ulp_max)}/{fmt_ulp(s.ulp_median)}", s.fraction


def result_word(q: Any) -> str:
    """PASS, FAIL, or "PASS bit-identical" when every element matches exactly."""
    return ("PASS bit-identical" if q.bit_identical else "PASS") if q.passed else "FAIL"


def worst_text(q: Any) -> str:
    """"worst [3, 17]: a 0.1234 | b 0.1301" ("" when every element matches)."""
    s = q.stats
    if s is None or s.worst_index is None:
        return ""
    return f"worst {list(s.worst_index)}: a {s.worst_a:.7g} | b {s.worst_b:.7g}"


def detail_notes(q: Any) -> list[str]:
    """The worst element, NaN/Inf positions and the row's note, as far as there is any."""
    s = q.stats
    out = [] if s is None else [x for x in (worst_text(q), s.nonfinite) if x]
    return out + ([q.note] if q.note else [])
