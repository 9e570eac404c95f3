"""The four dtype names dense_bridge speaks, their numpy types and machine epsilons.

bfloat16 exists in numpy only through ``ml_dtypes``; it is imported on first use so that
float32-only users need nothing but numpy.
"""
from __future__ import annotations

import numpy as np

from ._errors import BackendUnavailableError, SpecError
from ._errors import received, suggest

DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")

#: Unit roundoff used by the tolerance formula (docs/FACTS.md): the spacing of 1.0 in each dtype.
EPS = {
    "float32": float(np.finfo(np.float32).eps),
    "float64": float(np.finfo(np.float64).eps),
    "float16": float(np.finfo(np.float16).eps),
    "bfloat16": 2.0**-7,
}


def _ml_dtypes():
    try:
        import ml_dtypes
    except ImportError as exc:  # pragma: no cover - ml_dtypes ships with every framework extra
        raise BackendUnavailableError(
            "bfloat16 needs the ml_dtypes package: pip install ml_dtypes"
        ) from exc
    return ml_dtypes


def canonical_dtype(value: object, argument: str = "dtype") -> str:
    """Return the canonical dtype name for a name, numpy dtype or numpy type.

    Raises TypeError for a non-dtype and SpecError for an unsupported dtype, naming ``argument``.
    """
    if isinstance(value, str):
        name = value.lower()
        if name in ("bf16",):
            name = "bfloat16"
        if name not in DTYPE_NAMES:
            raise SpecError(
                f"{argument} must be one of {', '.join(DTYPE_NAMES)}."
                f"{suggest(value, DTYPE_NAMES)} {received(argument, value)}"
            )
        return name
    if value is None:  # np.dtype(None) is float64: never what "no dtype" meant
        raise TypeError(f"{argument} must be a dtype name such as 'float32', not None. {received(argument, value)}")
    try:
        dt = np.dtype(value)
    except TypeError:
        raise TypeError(
            f"{argument} must be a dtype name such as 'float32'. {received(argument, value)}"
        ) from None
    if dt.name in DTYPE_NAMES:
        return dt.name
    raise SpecError(f"{argument} must be one of {', '.join(DTYPE_NAMES)}. {received(argument, value)}")


def numpy_dtype(name: str) -> np.dtype:
    """Return the numpy dtype for a canonical dtype name (bfloat16 is ml_dtypes.bfloat16)."""
    if name == "bfloat16":
        return np.dtype(_ml_dtypes().bfloat16)
    return np.dtype(name)


def dtype_name(dtype: np.dtype) -> str:
    """Return the canonical name of a numpy dtype (``bfloat16`` included), or its numpy name."""
    return np.dtype(dtype).name


def compute_dtype(name: str) -> np.dtype:
    """The numpy dtype the reference computes in: float16/bfloat16 accumulate in float32,
    as every framework's CPU kernels do."""
    return np.dtype(np.float64) if name == "float64" else np.dtype(np.float32)
