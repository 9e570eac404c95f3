"""Where ``compare_models`` does its array math: the captures' own framework and device, or the host.

The judge (``_judge``, ``_elements``, ``_tolerance``) computes float64 elementwise allowances,
units, ULP distances and histograms over whole captured activations and gradients. Copying
every one of them to host numpy first costs more than running both models (a CUDA Llama pair:
27 s of judging against 27 ms of passes). So the judge is written against an
:class:`ArrayNamespace`: a handful of numpy-named operations on arrays of ONE framework on ONE
device. Only scalars and small summaries (max error, max units, counts, histogram bins, the
worst element's index and values) come to the host, through :meth:`ArrayNamespace.scalars`.

:data:`NUMPY` is the reference namespace (host numpy, what every backend's captures can be read
as). A backend offers its own through the optional adapter verb ``array_namespace(model) ->
namespace | None`` (``running`` capability's extra, ``registry/_contract``): torch's runs float64
on the model's device. :func:`choose` picks the namespace of one comparison: the reference
model's (b) where its adapter offers one, else a's, else :data:`NUMPY`. Captures of the side
whose namespace it is stay native (``capture(..., native=True)``); the other side's arrays are
brought to that one place once per compared quantity (:meth:`ArrayNamespace.asarray`: a device
copy, DLPack, or one host-to-device copy), never element by element.

The namespace interface (``xp`` below; ``A`` an array of the namespace, shapes kept):

- ``name`` (str); ``asarray(x) -> A`` float64 of any array (numpy, the framework's own on any
  device, another framework's); ``dtype_name(x) -> str`` the numpy name of ``x``'s dtype;
- elementwise, numpy semantics: ``abs sqrt square isnan isinf isfinite log10``,
  ``where(cond, x, y)`` (x, y arrays or Python floats), ``broadcast_to(x, shape)``;
- ``zeros(shape)``, ``zeros_like(x)`` float64; ``sum(x, axis=None)``, ``mean(x)`` (0-d A);
- ``ordinal(x, dtype) -> A`` int64: ``x`` rounded to ``dtype`` ("float16", "bfloat16",
  "float32", "float64"), its bits read as an integer, sign-magnitude folded (+0 and -0 both 0);
- ``as_float64(i) -> A`` of an integer array; ``max_median(x) -> (A, A)`` 0-d: the max and
  the median (numpy's: the mean of the two middle values for an even count) of the values of
  ``x`` that are not NaN, both inf when every one is; ``bins(x, edges) -> A`` counts per bin of ``x``
  against sorted ``edges`` (``searchsorted(..., side="right")`` then ``bincount``, length
  len(edges) + 1); ``argmax(x) -> A`` flat index of the first maximum, 0-d int;
  ``take(x, i) -> A`` the element at flat index ``i`` (a 0-d A), 0-d;
- ``scalars(*values) -> list[float]``: arrays (every element, flattened in order: 0-d ones and
  short vectors) and Python numbers to Python floats, with one host synchronisation for all;
- ``errstate()``: a context in which invalid operations are silent (numpy warns);
- ``scope()``: the context a whole judgement runs in (the framework's own settings for many
  small ops; nothing for numpy);
- ``to_host(x) -> np.ndarray`` float64 (the few paths computed by numpy code: activations
  inside a layer, adapters' own rounding; one copy of that quantity).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import numpy as np

from .._dtypes import numpy_dtype

__all__ = ["ArrayNamespace", "NumpyNamespace", "NUMPY", "choose", "host_only", "offered"]

_BITS = {"float16": (np.int16, 15), "bfloat16": (np.int16, 15), "float32": (np.int32, 31), "float64": (np.int64, 63)}


class ArrayNamespace:
    """The interface the judge computes through (see the module docstring); :class:`NumpyNamespace`
    is the reference implementation."""

    name = "abstract"


class NumpyNamespace(ArrayNamespace):
    """Host numpy, float64: the reference every other namespace must agree with."""

    name = "numpy"
    abs, sqrt, square, isnan, isinf, isfinite, log10 = (staticmethod(f) for f in (
        np.abs, np.sqrt, np.square, np.isnan, np.isinf, np.isfinite, np.log10))
    where, broadcast_to, zeros, zeros_like = (staticmethod(f) for f in (np.where, np.broadcast_to, np.zeros,
                                                                         np.zeros_like))

    @staticmethod
    def asarray(x) -> np.ndarray:
        return np.asarray(x).astype(np.float64)

    @staticmethod
    def dtype_name(x) -> str:
        return np.asarray(x).dtype.name

    @staticmethod
    def sum(x, axis=None):
        return np.sum(x, axis=axis)

    @staticmethod
    def mean(x):
        return np.mean(x)

    @staticmethod
    def ordinal(x: np.ndarray, dtype: str) -> np.ndarray:
        int_type, sign_bit = _BITS[dtype]
        bits = x.astype(numpy_dtype(dtype)).view(int_type).astype(np.int64)
        magnitude = bits & ((1 << sign_bit) - 1)
        return np.where(bits < 0, -magnitude, magnitude)

    @staticmethod
    def as_float64(i) -> np.ndarray:
        return np.asarray(i).astype(np.float64)

    @staticmethod
    def max_median(x) -> tuple:
        comparable = x[~np.isnan(x)]
        if not comparable.size:
            return math.inf, math.inf
        return comparable.max(), np.median(comparable)

    @staticmethod
    def bins(x, edges) -> np.ndarray:
        idx = np.searchsorted(np.asarray(edges), x, side="right")
        return np.bincount(idx, minlength=len(edges) + 1)

    @staticmethod
    def argmax(x):
        return np.argmax(x)

    @staticmethod
    def take(x, i):
        return x.reshape(-1)[int(i)]

    @staticmethod
    def scalars(*values) -> list[float]:
        return [float(x) for v in values for x in np.ravel(v)]

    @staticmethod
    def errstate():
        return np.errstate(all="ignore")

    @staticmethod
    def scope():
        return contextlib.nullcontext()

    @staticmethod
    def to_host(x) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)

    @staticmethod
    def size(x) -> int:
        return int(np.size(x))


NUMPY = NumpyNamespace()

_forced: list[str] = []


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Judge every comparison made inside on the host with :data:`NUMPY` (captures as numpy):
    the reference path, for tests that hold a device namespace against it."""
    _forced.append("numpy")
    try:
        yield
    finally:
        _forced.pop()


def offered(adapter: Any, model: Any) -> ArrayNamespace | None:
    """The namespace ``adapter`` offers for ``model``'s arrays (its ``array_namespace`` verb), or None."""
    fn = getattr(adapter, "array_namespace", None)
    return fn(model) if callable(fn) else None


def choose(sides: tuple, *, host: bool = False) -> tuple[ArrayNamespace, tuple[bool, bool]]:
    """(the namespace a comparison judges in, whether each side captures natively).

    Args:
        sides: ((adapter_a, model_a), (adapter_b, model_b)).
        host: judge with :data:`NUMPY` (paths whose helpers are numpy code: teacher forcing,
            quantized pairs), as inside :func:`host_only`.

    Returns:
        b's namespace where its adapter offers one, else a's, else :data:`NUMPY`; a side
        captures natively exactly when its adapter offers a namespace of the chosen kind.
    """
    if host or _forced:
        return NUMPY, (False, False)
    offers = [offered(adapter, model) for adapter, model in sides]
    xp = offers[1] or offers[0]
    if xp is None:
        return NUMPY, (False, False)
    return xp, tuple(o is not None and o.name == xp.name for o in offers)  # type: ignore[return-value]
