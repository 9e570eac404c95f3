"""Refusing comparisons that cannot tell two models apart: all-NaN/Inf inputs or outputs.

Two models fed inputs that are all NaN or Inf produce NaN/Inf everywhere, whatever their
weights, and two outputs that are all NaN/Inf on both sides agree for any pair of models: a
verdict of "equivalent" would mean nothing. ``compare`` and ``compare_models`` raise a
SpecError saying so instead (``dense-bridge check``: exit 2 with one line).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .._errors import SpecError

__all__ = ["refuse_nonfinite_inputs", "refuse_nonfinite_outputs"]


def _floating(x) -> np.ndarray | None:
    a = np.asarray(x)
    return a if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else None


def _all_nonfinite(a: np.ndarray) -> bool:
    return a.size > 0 and not np.isfinite(a.astype(np.float64, copy=False)).any()


def refuse_nonfinite_inputs(named: Iterable[tuple[str, object]]) -> None:
    """SpecError when the floating inputs given are all NaN/Inf (each one of them, every value)."""
    floating = [(name, a) for name, x in named if (a := _floating(x)) is not None and a.size]
    if floating and all(_all_nonfinite(a) for _, a in floating):
        names = ", ".join(name for name, _ in floating)
        raise SpecError(f"{names}: every value is NaN or Inf, so both models can only output NaN/Inf and no "
                        "comparison can tell them apart; pass finite inputs. "
                        f"Received: {names} of shape(s) {', '.join(str(a.shape) for _, a in floating)}")


def refuse_nonfinite_outputs(out_a, out_b, xp=None) -> None:
    """SpecError when both models' outputs are all NaN/Inf: they would agree whatever the models.

    ``xp``: the comparison's array namespace (``_namespace``); outputs of a device framework are
    tested where they are (one reduction, one scalar to the host)."""
    if xp is not None and xp.name != "numpy":
        found = [o for o in (out_a, out_b) if o is not None and "float" in xp.dtype_name(o)]
        if len(found) == 2 and all(xp.size(o) and not xp.scalars(xp.sum(xp.isfinite(xp.asarray(o))))[0]
                                   for o in found):
            raise SpecError(f"both models' outputs are all NaN or Inf (a {tuple(np.shape(out_a))}, b "
                            f"{tuple(np.shape(out_b))}): they agree whatever the models compute, so equivalence "
                            "cannot be judged (NaN/Inf parameters, or inputs that overflow them?)")
        return
    a, b = (None if o is None else _floating(o) for o in (out_a, out_b))
    if a is not None and b is not None and _all_nonfinite(a) and _all_nonfinite(b):
        raise SpecError(f"both models' outputs are all NaN or Inf (a {a.shape}, b {b.shape}): they agree whatever "
                        "the models compute, so equivalence cannot be judged (NaN/Inf parameters, or inputs that "
                        "overflow them?)")
