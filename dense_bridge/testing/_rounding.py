"""Dtype helpers that ``compare`` and ``compare_models`` share: which of two precisions is the
coarser, and inputs every side holds exactly."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .._dtypes import EPS, numpy_dtype

__all__ = ["coarsest", "round_common"]


def coarsest(dtypes: Sequence[str]) -> str:
    """The dtype name with the largest machine epsilon (``"bfloat16"`` over ``"float16"``)."""
    return max(dtypes, key=lambda d: EPS[d])


def round_common(x: np.ndarray, dtypes: Sequence[str]) -> np.ndarray:
    """float64 values that every dtype in ``dtypes`` represents exactly (rounded through each):
    both models then start from the same numbers, whatever precision each runs in."""
    x = np.asarray(x).astype(np.float64)
    for _ in range(3):  # float16 <-> bfloat16 settles in one or two rounds
        y = x
        for d in dtypes:
            y = y.astype(numpy_dtype(d)).astype(np.float64)
        if np.array_equal(y, x, equal_nan=True):
            break
        x = y
    return x
