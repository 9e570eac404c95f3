"""Element-level statistics of one compared quantity: ULPs, how many elements fail, the worst one.

A tolerance in units says how far the worst element is from passing; a reviewer settling an
argument also wants to know how many elements are off, where the worst one is and what both
sides hold there, how many units in the last place separate the two, and whether NaN and Inf
sit at the same positions. :func:`element_stats` computes all of it from

- ``values_a``/``values_b``: the two sides' values as compared (same shape, any float dtype);
- ``units``: the elementwise error in tolerance units (same shape; > 1 fails; inf where the
  non-finite values disagree), computed by the caller from whatever difference it judges
  (``compare_models`` judges a layer's own contribution, not the raw values);
- ``dtype``: the dtype the ULPs are counted in, the coarser of the two sides'.

ULP distance: both values rounded to ``dtype`` and mapped to integers ordered like the floats
(sign-magnitude bits folded so that +0 and -0 are both 0); the distance is the difference of
those integers, so 1.0 and the next float up are 1 apart and -tiny and +tiny are 2 apart.
NaN equals NaN only at the same position (0 ULP there); a NaN facing a number has no distance:
it counts as out of tolerance and makes the max ULP infinite. "bit-identical" means every pair of
values is equal (NaN with NaN), checked in float64 on the values themselves, not after rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._dtypes import EPS
from ._namespace import NUMPY, ArrayNamespace

__all__ = ["ElementStats", "element_stats", "elementwise_units", "ulp_distance", "HISTOGRAM_EDGES", "coarser_dtype",
           "format_fraction", "fmt_ulp"]

#: log10 edges of the tolerance-unit histogram: bin 0 holds exact matches and everything below
#: 1e-3 units, bin i (1..6) holds [1e(i-4), 1e(i-3)), the last bin everything from 1e3 units up
#: (infinite included). Bins 0..3 pass, 4.. fail.
HISTOGRAM_EDGES: tuple[float, ...] = (-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0)


@dataclass(frozen=True)
class ElementStats:
    """What each element of one compared quantity did.

    ``n_out`` of ``n_total`` elements are out of tolerance (a NaN/Inf mismatch counts);
    ``worst_index`` is the position (in the compared array's shape) of the element with the
    most tolerance units, ``worst_a``/``worst_b`` the two sides' values there (None when every
    element matches exactly); ``ulp_max``/``ulp_median`` the ULP distance in ``ulp_dtype``
    (``ulp_max`` inf when a NaN faces a number); ``nan_a``/``nan_b``/``inf_a``/``inf_b`` count
    the non-finite values of each side and ``nonfinite_mismatch`` the positions where they do
    not agree; ``histogram`` counts elements per tolerance-unit bin (:data:`HISTOGRAM_EDGES`).
    """

    n_total: int
    n_out: int
    ulp_dtype: str
    ulp_max: float
    ulp_median: float
    bit_identical: bool
    worst_index: tuple[int, ...] | None = None
    worst_a: float | None = None
    worst_b: float | None = None
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    nonfinite_mismatch: int = 0
    histogram: tuple[int, ...] = ()

    @property
    def fraction(self) -> str:
        """"12/4096 (0.3%)"."""
        return format_fraction(self.n_out, self.n_total)

    @property
    def nonfinite(self) -> str:
        """One phrase on NaN/Inf ("" when neither side has any)."""
        if not (self.nan_a or self.nan_b or self.inf_a or self.inf_b):
            return ""
        where = ("at the same positions" if not self.nonfinite_mismatch
                 else f"{self.nonfinite_mismatch} position(s) disagree")
        return f"NaN {self.nan_a}/{self.nan_b}, Inf {self.inf_a}/{self.inf_b} (a/b), {where}"

    def ulps(self) -> str:
        """"max 3 / median 0 ULP (float32)"."""
        return f"max {fmt_ulp(self.ulp_max)} / median {fmt_ulp(self.ulp_median)} ULP ({self.ulp_dtype})"

    def to_dict(self) -> dict:
        return {"n_total": self.n_total, "n_out_of_tolerance": self.n_out, "fraction_out_of_tolerance": self.fraction,
                "ulp_dtype": self.ulp_dtype, "ulp_max": _json(self.ulp_max), "ulp_median": _json(self.ulp_median),
                "bit_identical": self.bit_identical,
                "worst_index": None if self.worst_index is None else list(self.worst_index),
                "worst_a": None if self.worst_a is None else _json(self.worst_a),
                "worst_b": None if self.worst_b is None else _json(self.worst_b),
                "nan_a": self.nan_a, "nan_b": self.nan_b, "inf_a": self.inf_a, "inf_b": self.inf_b,
                "nonfinite_mismatch": self.nonfinite_mismatch, "histogram": list(self.histogram),
                "histogram_log10_edges": list(HISTOGRAM_EDGES)}


def coarser_dtype(*dtypes) -> str:
    """The coarsest of numpy dtypes (or names) as a dtype name; float32 for anything not a float
    dtype dense_bridge speaks (integer outputs are compared as they are)."""
    names = [np.dtype(d).name for d in dtypes]
    known = [n for n in names if n in EPS]
    return max(known, key=lambda n: EPS[n]) if known else "float32"


def format_fraction(n: int, total: int) -> str:
    pct = 100.0 * n / total if total else 0.0
    shown = f"{pct:.1f}" if pct >= 0.1 or n == 0 else f"{pct:.2g}"
    return f"{n}/{total} ({shown}%)"


def fmt_ulp(x: float) -> str:
    """A ULP count for a table: exact up to 99999, then two digits ("1.1e+09")."""
    if not math.isfinite(x):
        return "inf"
    if x >= 1e5:
        return f"{x:.2g}"
    return f"{x:.0f}" if x == int(x) else f"{x:.1f}"


def _json(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


_FMAX = float(np.finfo(np.float64).max)


def elementwise_units(diff_a, diff_b, allowed, xp: ArrayNamespace = NUMPY):
    """(|diff_a - diff_b|, that in tolerance units) elementwise, float64, in namespace ``xp``
    (``_namespace``; arrays of any shape, ``allowed`` broadcast to it).

    Equal non-finite values (NaN with NaN, Inf with the same Inf) differ by 0; any other
    non-finite difference is inf units. Where ``allowed`` is 0 any difference is inf units.
    """
    a, b = xp.asarray(diff_a), xp.asarray(diff_b)
    with xp.errstate():
        diff = xp.abs(a - b)
    same = (a == b) | (xp.isnan(a) & xp.isnan(b))
    diff = xp.where(same, 0.0, diff)
    diff = xp.where(xp.isnan(diff), math.inf, diff)
    with xp.errstate():
        units = xp.where(diff == 0, 0.0, diff / xp.broadcast_to(xp.asarray(allowed), diff.shape))
    return diff, xp.where(xp.isnan(units), math.inf, units)


def _ordinal(x: np.ndarray, dtype: str) -> np.ndarray:
    """Integers ordered like the floats of ``x`` rounded to ``dtype`` (+0 and -0 both 0), int64."""
    return NUMPY.ordinal(x, dtype)


def ulp_distance(a, b, dtype: str, xp: ArrayNamespace = NUMPY):
    """Elementwise ULP distance of ``a`` and ``b`` in ``dtype`` (float64 array of ``a``'s shape,
    in namespace ``xp``; NaN where exactly one side is NaN, 0 where both are)."""
    fa, fb = xp.asarray(a), xp.asarray(b)
    nan_a, nan_b = xp.isnan(fa), xp.isnan(fb)
    oa, ob = xp.ordinal(xp.where(nan_a, 0.0, fa), dtype), xp.ordinal(xp.where(nan_b, 0.0, fb), dtype)
    if dtype == "float64":  # int64 ordinals of opposite signs may overflow a subtraction
        same_sign = (oa >= 0) == (ob >= 0)
        exact = xp.as_float64(xp.abs(xp.where(same_sign, oa - xp.where(same_sign, ob, 0), 0)))
        far = xp.abs(xp.as_float64(oa)) + xp.abs(xp.as_float64(ob))
        dist = xp.where(same_sign, exact, far)
    else:
        dist = xp.as_float64(xp.abs(oa - ob))
    dist = xp.where(nan_a & nan_b, 0.0, dist)
    return xp.where(nan_a ^ nan_b, math.nan, dist)


def histogram(units, xp: ArrayNamespace = NUMPY) -> tuple[int, ...]:
    """Counts of elements per tolerance-unit bin (:data:`HISTOGRAM_EDGES`)."""
    return tuple(int(c) for c in xp.scalars(_bins(xp.asarray(units), xp)))


def _bins(u, xp: ArrayNamespace):
    """The histogram's counts, (len(HISTOGRAM_EDGES) + 1,) of ``xp`` (read with the other scalars at once)."""
    u = u.reshape(-1)
    with xp.errstate():
        logs = xp.where(u > 0, xp.log10(xp.where(u > 0, u, 1.0)), -math.inf)
    return xp.bins(logs, HISTOGRAM_EDGES)


def element_stats(values_a, values_b, units, dtype: str, xp: ArrayNamespace = NUMPY) -> ElementStats:
    """The :class:`ElementStats` of one quantity (see the module docstring for the arguments),
    computed in namespace ``xp``; what reaches the host is one batch of scalars (counts, maxima,
    the median, the histogram, the worst element's index and values)."""
    dtype = dtype if dtype in EPS else "float32"
    fa, fb = xp.asarray(values_a), xp.asarray(values_b)
    u = xp.asarray(units)
    shape = tuple(int(d) for d in u.shape)
    n = xp.size(u)
    nan_a, nan_b = xp.isnan(fa), xp.isnan(fb)
    inf_a, inf_b = xp.isinf(fa), xp.isinf(fb)
    mismatch = (nan_a ^ nan_b) | ((inf_a | inf_b) & ~(nan_a | nan_b) & (fa != fb))
    out = (u > 1.0) | mismatch
    same = (fa == fb) | (nan_a & nan_b)
    counts = [xp.sum(same), xp.sum(out), xp.sum(nan_a), xp.sum(nan_b), xp.sum(inf_a), xp.sum(inf_b),
              xp.sum(mismatch)]
    summary: list = []
    if n:
        dist = ulp_distance(fa, fb, dtype, xp)
        undefined = xp.isnan(dist)
        summary = [xp.sum(undefined), *xp.max_median(dist)]
        score = xp.where(mismatch, math.inf, u)
        with xp.errstate():
            d = xp.abs(fa - fb)  # as numpy's nan_to_num(nan=inf): NaN -> inf, inf -> the largest float
            raw = xp.where(same, 0.0, xp.where(xp.isnan(d), math.inf, xp.where(xp.isinf(d), _FMAX, d)))
        # units 0 everywhere (nothing allowed nowhere): the worst is the largest raw difference
        score = xp.where(xp.sum(score > 0) > 0, score, raw)
        flat = xp.argmax(xp.where(xp.isnan(score), math.inf, score))
        summary += [flat, xp.take(fa, flat), xp.take(fb, flat)]
    got = xp.scalars(*counts, *summary, _bins(xp.where(mismatch, math.inf, u), xp))
    n_same, n_out, na, nb, ia, ib, n_mis = (int(v) for v in got[:7])
    hist = tuple(int(c) for c in got[7 + len(summary):])
    bit_identical = n_same == n
    if n:
        n_undefined, ulp_max, ulp_median, flat_i, worst_a, worst_b = got[7:13]
        ulp_max = math.inf if n_undefined else ulp_max
    else:
        ulp_max = ulp_median = 0.0
    worst = None
    if n and not bit_identical:
        worst = tuple(int(i) for i in np.unravel_index(int(flat_i), shape))
    else:
        worst_a = worst_b = None
    return ElementStats(n, n_out, dtype, ulp_max, ulp_median, bit_identical, worst, worst_a, worst_b,
                        na, nb, ia, ib, n_mis, hist)
