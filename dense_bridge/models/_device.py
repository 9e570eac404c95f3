"""Moves between two models that stay on the device(s) where the models live.

When both sides' adapters offer the ``devices`` capability (``registry._contract.DEVICES``), a
transfer reads each side's parameters as the framework's own arrays where they live
(``device_params``, a walk's ``Entry.extra["read_device"]``) instead of host numpy: the checks
need only shapes and dtypes (metadata, no data moved), the NaN/Inf test is one reduction per
array on its device with one host synchronisation for the whole transfer (``nonfinite_flags``),
and the writes hand the arrays to dst's adapter, which copies them device to device (DLPack
between frameworks; the transpose and the cast done there; one transfer per array when the
devices differ). Moves that compute on the host (LoRA adapters, splits and concatenations,
quantized layers, user transforms, narrowing casts) keep the host path: their arrays are read
through ``get_params``, one device-to-host copy each.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import numpy_dtype
from ._layouts import Entry

__all__ = ["DeviceMoves", "is_host", "dtype_of"]


def is_host(value: Any) -> bool:
    """Is ``value`` a host numpy array (the host path), not a framework's device array."""
    return isinstance(value, np.ndarray)


#: framework dtype object -> numpy dtype (a handful of entries: read once per dtype, not per array)
_DTYPES: dict[Any, np.dtype] = {}


def dtype_of(value: Any) -> np.dtype:
    """The numpy dtype of an array of any framework, read from its dtype's name ("float32",
    "bfloat16"; a framework prefix such as "<fw>.float32" dropped): metadata only."""
    if isinstance(value, np.ndarray):
        return value.dtype
    dtype = getattr(value, "dtype", "")
    found = _DTYPES.get(dtype)
    if found is None:
        name = str(dtype).rsplit(".", 1)[-1]
        try:
            found = numpy_dtype(name)
        except Exception:  # noqa: BLE001 - not a dense_bridge float dtype name: numpy's own reading
            found = np.dtype(name)
        _DTYPES[dtype] = found
    return found


def shape_of(value: Any) -> tuple[int, ...]:
    """``value``'s shape as a tuple (metadata; the frameworks' shapes hold Python ints)."""
    return tuple(value.shape)


class DeviceMoves:
    """The device path of one transfer (``on``: both adapters offer it), with the NaN/Inf tests
    it defers to one synchronisation (:meth:`verdict`)."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b
        self.on = False
        if all(callable(getattr(s.adapter, "device_params", None)) for s in (a, b)):
            where = [s.adapter.device_of(s.model) for s in (a, b)]
            # one kind of memory on both sides (host memory, or GPUs both frameworks address):
            # a framework reads the other's arrays there; between kinds, the host path copies once
            self.on = None not in where and len({w.partition(":")[0] for w in where}) == 1
        self._native: dict[int, dict | None] = {}
        self._checks: list[tuple[Any, str]] = []  # (src device array, the problem if it holds NaN/Inf)

    def linear(self, side: Any, e: Entry) -> dict | None:
        """Canonical params of linear ``e`` as device arrays (``Side.device_params``, read once);
        None: the host path."""
        return side.device_params(e) if self.on else None

    def native(self, side: Any, e: Entry) -> dict | None:
        """``e``'s parameters in the framework's layout as device arrays, read once; None: host path."""
        if not self.on or side.merges(e):  # an update to add as it is read: the host path adds it
            return None
        key = id(e)
        if key not in self._native:
            reader = e.extra.get("read_device")
            self._native[key] = None if reader is None else reader()
        return self._native[key]

    def check(self, value: Any, problem: Any) -> None:
        """Queue the NaN/Inf test of ``value`` (a device array of src): :meth:`verdict` runs them all.
        ``problem``: its sentence, or a function making it (worded only for a value that fails)."""
        dtype = dtype_of(value)
        if dtype.kind == "f" or dtype.name == "bfloat16":
            self._checks.append((value, problem))

    def verdict(self) -> list[str]:
        """Every queued NaN/Inf test at once (one reduction per array, one host synchronisation):
        the problems of those that failed."""
        if not self._checks:
            return []
        flags = self.a.adapter.nonfinite_flags([v for v, _ in self._checks])
        problems = [p() if callable(p) else p for (_, p), bad in zip(self._checks, flags) if bad]
        self._checks = []
        return problems


def snapshot(e: Entry) -> dict:
    """A copy of ``e``'s parameters to put back after a failed write: on the device where the walk
    offers it (``Entry.extra["snapshot_device"]``), else host numpy."""
    taker = e.extra.get("snapshot_device")
    if taker is not None:
        return taker()
    return {k: np.array(v, copy=True) for k, v in e.read().items()}
