"""Tolerances derived from dtype and fan-in (FACTS.md), not one fixed number.

For one reduction (FACTS.md, measured on every framework pair):

    |a - b| <= C * (eps_dtype * (|b| + rms(b)) + eps_f32 * sqrt(K) * rms(b))

b is the reference, K the fan-in of the reduction that produced the values, eps_dtype the
unit roundoff of the compared dtype, eps_f32 the float32 one (frameworks accumulate float16 and
bfloat16 in float32). The first term is rounding of each value in its dtype (the rms part keeps
values near 0 from demanding exactness: a relative error alone is useless there); the second is
accumulation error that grows like sqrt(K). C = 4 for outputs, 10 for gradients: on 416 fresh
comparisons the worst needs were 1.8 and 4.2, and a single weight scaled by 1.001 still fails.
All arithmetic is float64 on the host.

Chains (``stages``). In a model the value at layer i carries the rounding of every step before
it. Rounding errors of independent steps are independent, and a well-conditioned layer carries
an input error of size e * rms(x) to an output error of about e * rms(y), so errors add in
quadrature relative to the rms of the values: S rounding steps in the dtype contribute
eps_dtype * sqrt(S) * rms(b), and reductions of total length K (summed over the path)
contribute eps_f32 * sqrt(K) * rms(b). The general form is therefore

    |a - b| <= C * (eps_dtype * (|b| + sqrt(S) * rms(b)) + eps_f32 * sqrt(K) * rms(b)) + atol

which is exactly the one-reduction formula when S = 1 and K is one fan-in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._dtypes import EPS

C_OUTPUT = 4.0
C_GRADIENT = 10.0


@dataclass(frozen=True)
class Tolerance:
    """Scales of the formula; override ``c_output``/``c_gradient`` or add an ``atol`` floor."""

    c_output: float = C_OUTPUT
    c_gradient: float = C_GRADIENT
    atol: float = 0.0

    def __post_init__(self) -> None:
        for name in ("c_output", "c_gradient", "atol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Tolerance.{name} must be a number. Received: {name}={value!r}")
            if not math.isfinite(value) or value < 0 or (name != "atol" and value == 0):
                what = "a finite number >= 0" if name == "atol" else "a finite number > 0"
                raise ValueError(f"Tolerance.{name} must be {what}. Received: {name}={value!r}")


def as_float64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def rms(b: np.ndarray) -> float:
    b = as_float64(b)
    return float(np.sqrt(np.mean(np.square(b)))) if b.size else 0.0


def allowed_error(reference, dtype: str, fan_in: int, c: float, atol: float = 0.0,
                  stages: int = 1) -> np.ndarray:
    """Elementwise allowed |a - b| for reference ``b`` in ``dtype``.

    ``fan_in``: total reduction length K on the path that produced the values; ``stages``: the
    number S of roundings to ``dtype`` on that path (1 for a single layer).
    """
    b = as_float64(reference)
    r = rms(b)
    eps = EPS[dtype]
    return c * (eps * (np.abs(b) + math.sqrt(max(1, stages)) * r)
                + EPS["float32"] * math.sqrt(max(1, fan_in)) * r) + atol


def error_units(actual, reference, dtype: str, fan_in: int, c: float, atol: float = 0.0,
                stages: int = 1) -> tuple[float, float]:
    """(max abs error, max error in tolerance units); units <= 1 passes. NaN mismatch is inf."""
    a, b = as_float64(actual), as_float64(reference)
    if a.shape != b.shape:
        return math.inf, math.inf
    if a.size == 0:
        return 0.0, 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    same_nonfinite = (~np.isfinite(a) | ~np.isfinite(b)) & ((a == b) | (np.isnan(a) & np.isnan(b)))
    diff = np.where(same_nonfinite, 0.0, diff)
    if not np.isfinite(diff).all():
        return math.inf, math.inf
    allowed = allowed_error(np.where(np.isfinite(b), b, 0.0), dtype, fan_in, c, atol, stages)
    # where nothing is allowed (an all-zero reference), any difference is infinitely many units
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(diff == 0, 0.0, diff / allowed)
    return float(diff.max()), float(units.max())
