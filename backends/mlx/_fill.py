"""MLX arrays whose memory dense_bridge fills itself: MLX allocates, dense_bridge copies and checks.

``mx.array(numpy_array)`` makes MLX's own copy, and a NaN/Inf check beside it has to read the
source a second time (a pass as long as the copy where memory bandwidth is the limit). MLX also
reads arrays from a Python stream: ``mx.load(stream, format="safetensors")`` allocates each array
(uninitialised) and hands its memory to the stream's ``readinto``. :func:`filled_arrays` gives it
a stream whose header lists the arrays, and the caller writes each array's memory with
``fill(index, out)``: ``dense_bridge._transfer.copy_into``, which tests every word for NaN/Inf in
the copy's own pass.

MLX reads one array at a time, each through two thread hand-overs (its stream thread, its reader
thread): about 100 us an array on a 2-core VM, a tenth of a 16 MiB copy. So ``readinto`` only
passes the memory on, MLX goes on to allocate the next array, and the calling thread copies into
the memory received meanwhile. Nothing reads the arrays before :func:`filled_arrays` returns
them: the load runs on MLX's CPU stream, whose reader writes the memory the array keeps (a GPU
stream's reader could copy it elsewhere once ``readinto`` returns), and every copy has ended by
then. Measured: ``benchmarks/bench_scan_limits.py``.
"""
from __future__ import annotations

import io
import queue
import threading
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError
from dense_bridge.checkpoints._safetensors import PendingTensor, header_bytes

#: dtypes filled this way (MLX's safetensors reader has no F64: float64 keeps mx.array)
_FILLED_DTYPES = ("float32", "float16", "bfloat16")


def can_fill(dtype: str) -> bool:
    return dtype in _FILLED_DTYPES


class _HandOverStream(io.RawIOBase):
    """A read-only safetensors stream of the arrays ``(shape, dtype)``: the header is read from
    here; each array's memory, when MLX asks for its bytes, is put on ``handed`` as
    ``(index, out)`` (``out`` a writable numpy view of it) for the caller to fill."""

    def __init__(self, arrays: Sequence[tuple[tuple[int, ...], str]], handed: queue.SimpleQueue):
        super().__init__()
        # the header comes from the one safetensors writer; the data is never produced here
        tensors = {str(i): PendingTensor(numpy_dtype(dtype), tuple(shape), produce=None)
                   for i, (shape, dtype) in enumerate(arrays)}
        self._head, order = header_bytes(tensors, None)
        self._by_start, start = {}, len(self._head)
        for name in order:
            self._by_start[start] = int(name)
            start += tensors[name].nbytes
        self._size = start
        self._arrays, self._handed, self._pos = list(arrays), handed, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        # runs on MLX's reader thread, where an exception would not travel back: nothing here raises
        view = memoryview(buffer).cast("B")
        n = view.nbytes
        if self._pos < len(self._head):
            chunk = self._head[self._pos:self._pos + n]
            view[:len(chunk)] = chunk
            n = len(chunk)
        else:
            i = self._by_start[self._pos]
            shape, dtype = self._arrays[i]
            self._handed.put((i, np.frombuffer(view, numpy_dtype(dtype)).reshape(shape)))
        self._pos += n
        return n


def filled_arrays(arrays: Sequence[tuple[tuple[int, ...], str]], fill: Callable[[int, np.ndarray], None]
                  ) -> list[mx.array]:
    """New, evaluated MLX arrays of the given ``(shape, dtype name)`` (no empty ones), each one's
    memory written by ``fill(index, out)`` on the calling thread: ``out`` is a writable
    C-contiguous numpy array (bfloat16 as ml_dtypes) that ``fill`` must write completely.
    Whatever ``fill`` raises is raised here, once MLX has finished (the arrays are dropped)."""
    if any(int(np.prod(shape)) == 0 for shape, _ in arrays):
        raise ConversionError("filled_arrays makes no empty arrays (they would share a stream offset). "
                              f"Received: shapes {[tuple(shape) for shape, _ in arrays]}")
    handed: queue.SimpleQueue = queue.SimpleQueue()
    loaded: dict = {}
    done = object()

    def load() -> None:
        try:
            loaded.update(mx.load(_HandOverStream(arrays, handed), format="safetensors", stream=mx.cpu))
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread
            loaded["error"] = exc
        finally:
            handed.put(done)
    loader = threading.Thread(target=load, name="dense_bridge-mlx-load", daemon=True)
    loader.start()
    error: BaseException | None = None
    while (item := handed.get()) is not done:
        if error is None:
            try:
                fill(*item)
            except BaseException as exc:  # noqa: BLE001 - MLX's load is let finish first
                error = exc
    loader.join()
    if error is None:
        error = loaded.get("error")
    if error is not None:
        raise error
    return [loaded[str(i)] for i in range(len(arrays))]
