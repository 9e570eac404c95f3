"""numpy <-> numpy: the ``to_numpy``/``from_numpy`` verbs of the reference, and input checks."""
from __future__ import annotations

import numpy as np


def as_input(x, argument: str = "x") -> np.ndarray:
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"
            or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{argument} must be a numeric array. Received: {argument} of dtype {arr.dtype}")
    return arr


def to_numpy(array) -> np.ndarray:
    """The adapter verb: the reference's arrays are numpy already (no copy)."""
    return np.asarray(array)


def from_numpy(array) -> np.ndarray:
    """The adapter verb: the reference's arrays are numpy already (no copy)."""
    return np.asarray(array)
