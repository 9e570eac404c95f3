"""Refusing work that cannot fit: a spec's parameter bytes against the memory available.

``Dense(10**12)`` or a config read from a file could otherwise ask a framework for terabytes and
end in a ``MemoryError`` (or the OOM killer) deep inside it. Compiling checks first and raises a
``SpecError`` naming the bytes needed and the bytes available.

Available memory is Linux's ``MemAvailable`` (/proc/meminfo): what can be allocated without
swapping. Where it cannot be read the check is skipped (the framework's own error then stands).
"""
from __future__ import annotations

import math

from .._dtypes import numpy_dtype
from .._errors import CheckpointError, SpecError
from ..specs import Sequential, layer_param_shapes

__all__ = ["available_memory", "param_bytes", "check_fits_in_memory", "check_load_fits"]


def available_memory() -> int | None:
    """Bytes the system can allocate now (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def param_bytes(spec) -> int:
    """Bytes of every parameter (and mask) ``spec`` declares; lazy layers count what is known."""
    layers = spec.layers if isinstance(spec, Sequential) else [spec]
    total = 0
    for layer in layers:
        if getattr(layer, "lazy", False):
            continue
        dtype = getattr(layer, "dtype", None)
        itemsize = numpy_dtype(dtype).itemsize if dtype else 4
        for shape in layer_param_shapes(layer).values():
            total += math.prod(shape) * itemsize
    return total


def check_fits_in_memory(spec, what: str = "spec") -> None:
    """SpecError when ``spec``'s parameters need more bytes than the system has available."""
    available = available_memory()
    if available is None:
        return
    needed = param_bytes(spec)
    if needed > available:
        raise SpecError(f"{what} needs {needed:,} bytes for its parameters but only {available:,} bytes of memory "
                        f"are available (MemAvailable); use smaller layers or a machine with more memory. "
                        f"Received: {what}={_describe(spec)}")


def check_load_fits(spec, path: str) -> None:
    """:func:`check_fits_in_memory` for a spec read from the checkpoint ``path``, before a load
    allocates its parameters: a CheckpointError naming the file (the file is what is wrong)."""
    try:
        check_fits_in_memory(spec, "the checkpoint's spec")
    except SpecError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _describe(spec) -> str:
    text = repr(spec)
    return text if len(text) <= 200 else text[:200] + "..."


def return_freed_memory() -> None:
    """Give memory that was freed back to the operating system, between the steps of a job that
    streams (one layer pair at a time) through frameworks that allocate on many threads.

    Collects reference cycles first (a framework's model often sits in one until the collector
    runs), then on glibc calls ``malloc_trim(0)``: the frameworks' worker threads allocate from
    their own malloc arenas, which keep freed layers as cached free memory, so without this a
    stream's resident memory creeps up by about a layer per step (measured: a 16-layer
    ``dense-bridge check`` through Keras grew to 3.5x the file instead of one layer pair).
    """
    import ctypes
    import gc
    import sys

    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return
    trim(0)
