"""``array_namespace`` of both JAX adapters (Flax NNX, Equinox): the judge's array math
(``dense_bridge/testing/_namespace``) in ``jax.numpy``, float64 on the model's own device.

Float64 needs JAX's 64-bit mode (``jax.config.update("jax_enable_x64", True)`` or
``JAX_ENABLE_X64=1``): without it JAX makes float32 of every float64, so :func:`array_namespace`
answers None and ``compare_models`` judges JAX captures on the host, in numpy, as before.
Ops run eagerly, each on the arrays' device; only :meth:`JaxNamespace.scalars` crosses to the
host (one concatenated transfer). Semantics follow numpy's where the verdict depends on them:
``max_median`` averages the two middle values, ``argmax`` returns the first maximum, ``bins``
counts like ``searchsorted(side="right")`` + ``bincount``.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

_INTS = {"float16": (jnp.int16, 15), "bfloat16": (jnp.int16, 15), "float32": (jnp.int32, 31),
         "float64": (jnp.int64, 63)}


def x64() -> bool:
    """Is JAX's 64-bit mode on (float64 arrays are float64)?"""
    return bool(jax.config.read("jax_enable_x64"))


class JaxNamespace:
    """float64 JAX arrays on ``device`` (a ``jax.Device``): the interface of
    ``dense_bridge.testing._namespace.ArrayNamespace``."""

    name = "jax"

    def __init__(self, device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"JaxNamespace({self.device})"

    def _put(self, x):
        return jax.device_put(x, self.device)

    # ------------------------------------------------------------------ arrays in
    def asarray(self, x):
        """``x`` as float64 on this device: a JAX array moved/cast once (a device copy at most), a
        DLPack array of another framework viewed where JAX can, numpy copied in once."""
        if isinstance(x, jax.Array):
            if x.dtype == jnp.float64 and x.devices() == {self.device}:
                return x
            return self._put(x).astype(jnp.float64)
        if not isinstance(x, (np.ndarray, np.generic, float, int)) and hasattr(x, "__dlpack__"):
            try:
                return self._put(jax.dlpack.from_dlpack(x)).astype(jnp.float64)
            except Exception:  # noqa: BLE001 - a device JAX cannot view: via the host
                pass
        return self._put(np.asarray(x).astype(np.float64))

    @staticmethod
    def dtype_name(x) -> str:
        return np.dtype(x.dtype).name if hasattr(x, "dtype") else np.asarray(x).dtype.name

    # ------------------------------------------------------------------ elementwise
    abs, sqrt, square, isnan, isinf, isfinite, log10 = (staticmethod(f) for f in (
        jnp.abs, jnp.sqrt, jnp.square, jnp.isnan, jnp.isinf, jnp.isfinite, jnp.log10))
    where = staticmethod(jnp.where)

    def broadcast_to(self, x, shape):
        return jnp.broadcast_to(x if isinstance(x, jax.Array) else self._put(np.float64(x)), tuple(shape))

    def zeros(self, shape):
        return self._put(np.zeros(tuple(int(d) for d in shape)))

    zeros_like = staticmethod(jnp.zeros_like)

    @staticmethod
    def sum(x, axis=None):
        return jnp.sum(x, axis=axis)

    mean = staticmethod(jnp.mean)

    # ------------------------------------------------------------------ ULPs, order statistics
    @staticmethod
    def ordinal(x, dtype: str):
        int_type, sign_bit = _INTS[dtype]
        target = jnp.bfloat16 if dtype == "bfloat16" else jnp.dtype(dtype)
        bits = jax.lax.bitcast_convert_type(x.astype(target), int_type).astype(jnp.int64)
        magnitude = bits & ((1 << sign_bit) - 1)
        return jnp.where(bits < 0, -magnitude, magnitude)

    @staticmethod
    def as_float64(i):
        return i.astype(jnp.float64)

    @staticmethod
    def max_median(x) -> tuple:
        """(max, median) of the non-NaN values of ``x`` (inf, inf when there are none), 0-d: NaN
        sorts last, so the k non-NaN values come first and the middle ones are taken by index."""
        s = jnp.sort(x.reshape(-1))
        k = jnp.sum(~jnp.isnan(s))
        lo, hi = jnp.maximum(k - 1, 0) // 2, jnp.minimum(k // 2, max(s.size - 1, 0))
        median = (s[lo] + s[hi]) / 2
        none = k == 0
        return jnp.where(none, jnp.inf, s[jnp.maximum(k - 1, 0)]), jnp.where(none, jnp.inf, median)

    @staticmethod
    def bins(x, edges):
        idx = jnp.searchsorted(jnp.asarray(edges, dtype=jnp.float64), x.reshape(-1), side="right")
        return jnp.bincount(idx, length=len(edges) + 1)

    @staticmethod
    def argmax(x):
        return jnp.argmax(x.reshape(-1))

    @staticmethod
    def take(x, i):
        return x.reshape(-1)[i]

    # ------------------------------------------------------------------ to the host
    @staticmethod
    def scalars(*values) -> list[float]:
        """Python floats of arrays (every element, flattened in order) and numbers: one transfer."""
        arrays = [v for v in values if isinstance(v, jax.Array)]
        if not arrays:
            return [float(x) for v in values for x in np.ravel(v)]
        host = iter(np.asarray(jnp.concatenate([jnp.ravel(a).astype(jnp.float64) for a in arrays])).tolist())
        return [x for v in values
                for x in ([next(host) for _ in range(v.size)] if isinstance(v, jax.Array) else [float(v)])]

    @staticmethod
    def errstate():
        return contextlib.nullcontext()

    @staticmethod
    def scope():
        return contextlib.nullcontext()

    @staticmethod
    def to_host(x) -> np.ndarray:
        return np.asarray(x).astype(np.float64)

    @staticmethod
    def size(x) -> int:
        return int(np.size(x)) if not isinstance(x, jax.Array) else int(x.size)


def namespace_for(arrays) -> JaxNamespace | None:
    """The namespace of a model whose JAX arrays are ``arrays`` (leaves of its state): float64 on
    the device of the first one; None without 64-bit mode, without arrays, or when that array is
    spread over several devices (sharded: judged on the host)."""
    if not x64():
        return None
    first = next((a for a in arrays if isinstance(a, jax.Array)), None)
    if first is None or len(first.devices()) != 1:
        return None
    return JaxNamespace(next(iter(first.devices())))
