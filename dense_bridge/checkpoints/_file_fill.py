"""Filling a file's tensor slots from arrays (usually views of another, memory-mapped file).

Every checkpoint writer ends the same way: a file whose structure is written (a safetensors
header, a torch zip's records, an HDF5 file's datasets) and whose tensors' bytes go at known
offsets. :func:`fill` writes those bytes, each slot in C order, from an array in the output's
layout: any view, a transposed view of a mapped source included.

Why a pipeline: a conversion reads (page faults on the source mapping), rearranges (a
transposing copy when the layouts differ) and writes. Done one after the other these add up;
here worker threads (one per core, at most :data:`_MAX_WORKERS`) read and rearrange the next
pieces (numpy's copies and the page faults release the GIL) while the calling thread writes
the pieces in file order with ``os.pwrite`` (which releases it too), and the kernel is asked to
start reading each tensor's pages one tensor ahead (:func:`dense_bridge.checkpoints._pages.prefetch`). Pieces are at most :data:`PIECE` bytes, so the extra
memory is a few pieces, never a tensor; the pages of each source tensor are given back once it
is written (:func:`dense_bridge.checkpoints._pages.release_file_pages`).
"""
from __future__ import annotations

import math
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .._errors import CheckpointError
from ._pages import FileMappings, prefetch, release_file_pages
from ..params._copy import blocked_transpose, count_nonfinite

#: Bytes per piece written: large enough that the per-piece Python work is noise, small enough
#: that the buffers (one per piece in flight) stay a rounding error next to a checkpoint.
PIECE = 32 << 20
#: Pieces prepared ahead of the one being written, at most (each may hold a buffer).
_AHEAD = 4
_MAX_WORKERS = 4
#: Tensors smaller than this are prepared by the writing thread itself: handing a piece to a
#: worker and back costs ~50 us, more than copying it (a model of thousands of biases).
_INLINE = 256 << 10
#: Smaller sources are not worth a look at /proc/self/maps to give their pages back.
_RELEASE_FROM = 4 << 20


@dataclass(frozen=True)
class Slot:
    """One tensor's place in the output: ``nbytes`` C-order bytes at ``offset``.

    ``produce()`` returns the tensor in the output's layout (dtype ``dtype``, shape ``shape``):
    any strides, called once, when the tensor's turn comes (a mapping may be opened then).
    """

    name: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Piece:
    """Piece ``seq`` (file order): ``array[index]`` of slot ``slot`` goes at ``offset``."""

    seq: int
    slot: int
    offset: int
    index: tuple
    last: bool  # the slot's last piece
    inline: bool = False  # small: prepared by the writer itself, a hand-over would cost more


def fill(fd: int, slots: list[Slot], *, check_finite: bool = False, checksums: bool = False,
         on_tensor: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Write every slot's bytes into the open file ``fd`` at its offset (``os.pwrite``).

    ``check_finite``: refuse NaN/Inf (CheckpointError naming the tensor; what was written stays
    in the caller's temporary, which the caller removes). ``checksums``: return each slot's
    CRC-32 (zlib's, as zip files keep) by name, else {}. ``on_tensor(name, nbytes)`` is called
    after each slot is written, in order.
    """
    sizes = [slot.nbytes for slot in slots]
    pieces = [p for i, slot in enumerate(slots) for p in _pieces(i, slot, sizes[i])]
    for seq, p in enumerate(pieces):  # numbered in file order
        pieces[seq] = _Piece(seq, p.slot, p.offset, p.index, p.last, p.inline)
    run = _Run(slots, pieces, check_finite)
    workers = [threading.Thread(target=run.work, name=f"dense_bridge-fill-{k}", daemon=True)
               for k in range(min(_MAX_WORKERS, os.cpu_count() or 1, sum(not p.inline for p in pieces)))]
    for w in workers:
        w.start()
    crcs = {slot.name: 0 for slot in slots}
    try:
        for piece in pieces:
            data = run.prepare_here(piece) if piece.inline else run.take(piece.seq)
            _pwrite_all(fd, data, piece.offset)
            name = slots[piece.slot].name
            if checksums:
                crcs[name] = zlib.crc32(data, crcs[name])
            del data
            run.written(piece)
            if piece.last and on_tensor is not None:
                on_tensor(name, sizes[piece.slot])
        for i, slot in enumerate(slots):  # empty tensors have no pieces
            if sizes[i] == 0 and on_tensor is not None:
                on_tensor(slot.name, 0)
    except BaseException:
        run.stop()
        raise
    finally:
        for w in workers:
            w.join()
    return crcs if checksums else {}


class _Run:
    """What the workers and the writer share: the next piece to prepare, the prepared pieces by
    number, the free buffers and each slot's source array (produced once, one slot ahead)."""

    def __init__(self, slots: list[Slot], pieces: list[_Piece], check_finite: bool) -> None:
        self.slots, self.pieces, self.check_finite = slots, pieces, check_finite
        self.cond = threading.Condition()
        self.next = 0  # the next piece a worker takes
        self.done: dict[int, object] = {}  # seq -> bytes to write, or the exception preparing it raised
        self.writing = 0  # the piece the writer waits for
        self.stopped = False
        self.size = min(PIECE, max((s.nbytes for s in slots), default=0))  # no piece is larger
        self.buffers: list[np.ndarray] = []
        self.lent: dict[int, np.ndarray] = {}  # seq -> the buffer its bytes are in
        self.arrays: dict[int, np.ndarray] = {}
        self.mappings = FileMappings()

    # -- the workers' side
    def work(self) -> None:
        while True:
            with self.cond:
                while True:
                    while self.next < len(self.pieces) and self.pieces[self.next].inline:
                        self.next += 1  # the writer prepares those itself
                    if self.stopped or self.next >= len(self.pieces) or self.next < self.writing + _AHEAD:
                        break
                    self.cond.wait()
                if self.stopped or self.next >= len(self.pieces):
                    return
                piece = self.pieces[self.next]
                self.next += 1
                try:
                    array = self._array(piece.slot)
                except BaseException as exc:  # noqa: BLE001 - handed to the writer, which raises it
                    self.done[piece.seq] = exc
                    self.cond.notify_all()
                    return
            try:
                result: object = self._prepare(piece, array[piece.index])
            except BaseException as exc:  # noqa: BLE001 - handed to the writer, which raises it
                result = exc
            with self.cond:
                self.done[piece.seq] = result
                self.cond.notify_all()

    def _array(self, i: int) -> np.ndarray:
        """Slot ``i``'s source (called with the lock held); producing it asks the kernel for the
        next slot's pages too, so they are read while this one is copied."""
        if i not in self.arrays:
            self.arrays[i] = _checked(self.slots[i])
        if i + 1 < len(self.slots) and i + 1 not in self.arrays and self.slots[i + 1].nbytes >= _INLINE:
            self.arrays[i + 1] = _checked(self.slots[i + 1])
            prefetch(self.arrays[i + 1])
        return self.arrays[i]

    def _prepare(self, piece: _Piece, part: np.ndarray) -> memoryview:
        """The bytes to write: the piece itself where it is contiguous little-endian memory, else
        a copy into a buffer (a blocked transpose for the common transposed view)."""
        slot = self.slots[piece.slot]
        little = part.dtype.byteorder != ">"
        if part.flags.c_contiguous and little:
            if self.check_finite:
                _refuse_nonfinite(slot, count_nonfinite(part))
            return memoryview(part.reshape(-1).view(np.uint8))
        with self.cond:
            buffer = self.buffers.pop() if self.buffers else np.empty(self.size, np.uint8)
            self.lent[piece.seq] = buffer
        out = buffer[:part.nbytes].view(part.dtype.newbyteorder("<")).reshape(part.shape)
        if little and part.ndim >= 2 and part.strides[-2] == part.itemsize:  # a transposed view
            bad = blocked_transpose(out, part.swapaxes(-1, -2), self.check_finite)
        else:
            np.copyto(out, part, casting="equiv")
            bad = count_nonfinite(out) if self.check_finite else 0
        _refuse_nonfinite(slot, bad)
        return memoryview(buffer[:part.nbytes])

    # -- the writer's side
    def prepare_here(self, piece: _Piece) -> memoryview:
        """A small piece, prepared on the writing thread (no hand-over)."""
        with self.cond:
            array = self._array(piece.slot)
        return self._prepare(piece, array[piece.index])

    def take(self, seq: int) -> memoryview:
        with self.cond:
            while seq not in self.done:
                self.cond.wait()
            result = self.done.pop(seq)
        if isinstance(result, BaseException):
            raise result
        return result

    def written(self, piece: _Piece) -> None:
        with self.cond:
            buffer = self.lent.pop(piece.seq, None)
            if buffer is not None:
                self.buffers.append(buffer)
            self.writing = piece.seq + 1
            array = self.arrays.pop(piece.slot, None) if piece.last else None
            self.cond.notify_all()
        if array is not None and array.nbytes >= _RELEASE_FROM:
            release_file_pages([array], self.mappings)  # written: its source pages can go

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = data
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n


def _checked(slot: Slot) -> np.ndarray:
    array = np.asarray(slot.produce())
    if array.dtype.newbyteorder("=") != slot.dtype.newbyteorder("=") or tuple(array.shape) != tuple(slot.shape):
        raise CheckpointError(f"tensor {slot.name!r} changed while being written: expected {slot.dtype} "
                              f"{tuple(slot.shape)}, got {array.dtype} {tuple(array.shape)}")
    return array.reshape(1) if array.ndim == 0 else array


def _pieces(i: int, slot: Slot, nbytes: int) -> Iterator[_Piece]:
    """Slot ``i``'s pieces of at most :data:`PIECE` bytes, in file order (``seq`` numbered later)."""
    found = list(_split(slot.shape if slot.shape else (1,), slot.dtype.itemsize, slot.offset, ()))
    inline = nbytes < _INLINE
    for k, (offset, index) in enumerate(found):
        yield _Piece(-1, i, offset, index, k == len(found) - 1, inline)


def _split(shape: tuple[int, ...], itemsize: int, offset: int, prefix: tuple) -> Iterator[tuple[int, tuple]]:
    """(offset, index) of C-order pieces of an array of ``shape`` at ``offset``, each at most
    :data:`PIECE` bytes: runs of whole rows, or, for a row larger than that, pieces of each row."""
    if 0 in shape:
        return
    row = math.prod(shape[1:]) * itemsize
    if len(shape) > 1 and row > PIECE:
        for i in range(shape[0]):
            yield from _split(shape[1:], itemsize, offset + i * row, prefix + (i,))
        return
    rows = max(1, PIECE // row)
    for i in range(0, shape[0], rows):
        yield offset + i * row, prefix + (slice(i, i + rows),)


def _refuse_nonfinite(slot: Slot, bad: int) -> None:
    if bad:
        raise CheckpointError(f"tensor {slot.name!r} holds {bad}+ NaN/Inf values; refusing to write it "
                              "(pass allow_nonfinite=True where NaN/Inf are intended)")
