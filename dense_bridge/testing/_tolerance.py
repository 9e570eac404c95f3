"""Tolerances derived from dtype and fan-in (docs/FACTS.md), not one fixed number.

    |a - b| <= C * (eps_dtype * (|b| + rms(b)) + eps_f32 * sqrt(K) * rms(b))

b is the reference, K the fan-in of the reduction that produced the values, eps_dtype the
unit roundoff of the compared dtype, eps_f32 the float32 one (frameworks accumulate float16 and
bfloat16 in float32). The first term is rounding of each value in its dtype (the rms part keeps
values near 0 from demanding exactness: a relative error alone is useless there); the second is
accumulation error that grows like sqrt(K). C = 4 for outputs, 10 for gradients: on 416 fresh
comparisons the worst needs were 1.8 and 4.2, and a single weight scaled by 1.001 still fails.
All arithmetic is float64, on the host or in the captures' own namespace (``_namespace``).

This is the allowance for one layer fed exact inputs. Inside a model, ``compare`` adds the
differences a layer inherits from its inputs (see ``_propagate``) and passes the result to
:func:`error_units` as ``allowed``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._dtypes import EPS
from .._errors import SpecError
from ._namespace import NUMPY, ArrayNamespace

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
                raise SpecError(f"Tolerance.{name} must be {what}. Received: {name}={value!r}")


def as_float64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def rms(b, xp: ArrayNamespace = NUMPY):
    """sqrt(mean(b^2)), 0 for an empty ``b``: a float on the host namespace, a 0-d array of ``xp``
    otherwise (no host synchronisation)."""
    if xp is NUMPY:
        b = as_float64(b)
        return float(np.sqrt(np.mean(np.square(b)))) if b.size else 0.0
    b = xp.asarray(b)
    return xp.sqrt(xp.mean(xp.square(b))) if xp.size(b) else 0.0


def allowed_error(reference, dtype: str, fan_in: int, c: float, atol: float = 0.0, xp: ArrayNamespace = NUMPY):
    """Elementwise allowed |a - b| for reference ``b`` in ``dtype`` with reduction length ``fan_in``
    (float64, ``b``'s shape, in namespace ``xp``)."""
    b = xp.asarray(reference)
    r = rms(b, xp)
    eps = EPS[dtype]
    return c * (eps * (xp.abs(b) + r) + EPS["float32"] * math.sqrt(max(1, fan_in)) * r) + atol


def error_units(actual, reference, dtype: str, fan_in: int, c: float, atol: float = 0.0, *,
                allowed=None) -> tuple[float, float]:
    """(max abs error, max error in tolerance units); units <= 1 passes. NaN mismatch is inf.

    ``allowed``: an elementwise allowance (shape of ``reference``) used instead of the formula.
    """
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
    if allowed is None:
        allowed = allowed_error(np.where(np.isfinite(b), b, 0.0), dtype, fan_in, c, atol)
    # where nothing is allowed (an all-zero reference), any difference is infinitely many units
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(diff == 0, 0.0, diff / np.asarray(allowed, dtype=np.float64))
    return float(diff.max()), float(units.max())
