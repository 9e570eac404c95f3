"""A small safetensors reader and streaming writer on numpy, bfloat16 included.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N, then N
bytes of UTF-8 JSON ``{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` (padded with spaces to a multiple of 8), then the raw
little-endian, C-order tensor bytes; offsets are relative to the end of the header.
``__metadata__`` is reserved: no tensor may have that name (the writer refuses it).

Why our own, not the ``safetensors`` package (measured with safetensors 0.8, 128 MiB of
float32, 2-core machine under load 6): its numpy flavour does round-trip bfloat16, but
- it reads by copying: ``safe_open(framework="np").get_tensor`` 0.65 GB/s against 5.1 GB/s for
  a private map of each tensor here (read + sum), and a copy doubles a load's peak memory;
- its writer takes a dict of materialized arrays (``save_file``): a save or conversion would
  hold the whole checkpoint in numpy at once, where this writer pulls one tensor at a time;
- its numpy writer stores an F-contiguous array's bytes as if C-ordered (saving ``a.T`` reloads
  a different matrix; huggingface/safetensors#825);
- it opens by path, so a concurrent save's rename can pair an old index with new files; here
  a file is opened once and everything is read from that descriptor;
- every malformed file has to be a CheckpointError naming the file, with the bounds checks
  below, before anything is allocated.
So the package is no runtime dependency; the tests use it as the reference implementation that
our files must load in. bfloat16 is ``ml_dtypes.bfloat16``. Errors are ``CheckpointError``
naming the file.

Reading is consistent against a concurrent atomic save (``os.replace``) of the same path: a
``SafetensorsFile`` opens the file ONCE, reads the header from that descriptor and maps every
tensor from it, so a rename that lands in between cannot pair the old header with the new
file's bytes (the replaced inode lives on while the descriptor or a map holds it). Each
tensor gets its own small private map of that descriptor (not one map of the whole file), so
its pages are released as soon as the array is dropped and a streamed conversion's resident
memory stays at about one tensor.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
import struct
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from .._errors import CheckpointError, SpecError
from ._guard import file_kind as _file_kind, open_input, open_readonly

__all__ = ["TensorInfo", "SafetensorsFile", "write_safetensors", "is_safetensors", "st_dtype",
           "open_readonly", "read_at", "read_json_file", "RESERVED", "MAX_HEADER", "MAX_JSON_FILE", "parse_json", "parse_json_object",
           "shorten"]

#: The header may not be larger than this (the reference implementation's limit).
MAX_HEADER = 100_000_000
#: The header key the format keeps for string metadata: a tensor of this name cannot be stored.
RESERVED = "__metadata__"

_NUMPY_CODES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool",
}
_ML_CODES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


#: Deepest rank a stored tensor may have (numpy's own limit is 64).
MAX_RANK = 32
#: JSON nesting deeper than this is refused before parsing (Python's parser would recurse).
MAX_JSON_DEPTH = 64


def shorten(value: object, limit: int = 80) -> str:
    """repr of a value from a file, cut to ``limit`` characters (files can hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_json_object(raw: bytes, error: Callable[[str], Exception], what: str) -> dict:
    """A JSON object from ``raw`` bytes of a file; ``error(reason)`` is raised for anything else.

    Refused: everything :func:`parse_json` refuses, and non-objects.
    """
    value = parse_json(raw, error, what)
    if not isinstance(value, dict):
        raise error(f"corrupted {what} (not a JSON object)")
    return value


def parse_json(raw: bytes, error: Callable[[str], Exception], what: str):
    """A JSON value from ``raw`` bytes of a file; ``error(reason)`` is raised for anything else.

    Refused: invalid UTF-8 or JSON, nesting deeper than MAX_JSON_DEPTH (checked by a scan
    before parsing, so no RecursionError), integers too long for Python to convert, duplicate
    keys (two entries for one tensor: which one would be read is undefined).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"corrupted {what} (not UTF-8: {exc})") from None
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(f"corrupted {what} (JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} allowed)")

    def no_duplicates(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen[key] = value
        return seen

    try:
        value = json.loads(text, object_pairs_hook=no_duplicates)
    except _DuplicateKey as exc:
        raise error(f"corrupted {what} (key {shorten(exc.args[0])} appears twice)") from None
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        # ValueError: an integer literal longer than Python's int conversion limit
        raise error(f"corrupted {what} (not valid JSON: {shorten(str(exc), 200)})") from None
    return value


class _DuplicateKey(Exception):
    pass


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _json_depth(text: str) -> int:
    """Deepest bracket nesting of JSON ``text`` (brackets inside strings do not count).

    Strings are removed with one regex pass and the brackets counted with numpy, so a header of
    many megabytes is scanned in C, not character by character in Python.
    """
    skeleton = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "replace"), dtype=np.uint8)
    steps = (np.isin(skeleton, (ord("["), ord("{"))).astype(np.int64)
             - np.isin(skeleton, (ord("]"), ord("}"))).astype(np.int64))
    return int(np.cumsum(steps).max(initial=0))


def numpy_dtype_of(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code (BF16 -> ml_dtypes.bfloat16)."""
    if code in _NUMPY_CODES:
        return np.dtype(_NUMPY_CODES[code])
    import ml_dtypes  # only needed for bfloat16 / float8 files

    return np.dtype(getattr(ml_dtypes, _ML_CODES[code]))


def st_dtype(dtype: np.dtype) -> str:
    """The safetensors dtype code of a numpy dtype; ValueError when it has none."""
    name = np.dtype(dtype).name
    for table in (_NUMPY_CODES, _ML_CODES):
        for code, n in table.items():
            if n == name:
                return code
    raise SpecError(f"dtype {name} cannot be stored in safetensors")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: dtype code, shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return numpy_dtype_of(self.dtype)


def is_safetensors(head: bytes, size: int) -> bool:
    """Whether the first bytes of a file of ``size`` bytes look like safetensors."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    # a header length that overruns the file still means safetensors (a truncated one): the
    # reader then says so precisely
    return 0 < n <= MAX_HEADER and head[8:9] == b"{"


#: The largest JSON file (an index, a spec file) read whole.
MAX_JSON_FILE = 1 << 26


def read_json_file(path: str, what: str, limit: int = MAX_JSON_FILE, top_level: type | None = dict, *,
                   inside: str | None = None):
    """The JSON object in the small file ``path`` (an index, a spec file), opened the safe way
    (``_guard.open_input``: a FIFO or device refused, never waited on) and parsed by
    ``parse_json`` (deep nesting, duplicate keys refused); ``top_level=None`` takes any JSON
    value, not only an object; ``inside``: a folder the file must lie in, symlinks resolved
    (``_guard.open_input``). CheckpointError naming it."""
    fd = open_input(path, what=what, limit=limit, inside=inside)
    try:  # no more than the file holds: pread allocates the size asked for before it reads
        raw = read_at(fd, min(limit, os.fstat(fd).st_size) + 1, 0)
    except OSError as exc:
        raise CheckpointError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > limit:  # grew since the check
        raise CheckpointError(f"the {what} {path} is larger than {limit} bytes: refused")
    error = (lambda reason: CheckpointError(f"{path} is not a readable {what}: {reason}"))
    return parse_json(raw, error, what) if top_level is None else parse_json_object(raw, error, what)


def read_at(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes of ``fd`` from ``offset`` (fewer only at the end of the file)."""
    chunks, got = [], 0
    while got < n:
        if hasattr(os, "pread"):
            chunk = os.pread(fd, n - got, offset + got)
        else:  # pragma: no cover - Windows has no pread; one reader per descriptor there
            os.lseek(fd, offset + got, os.SEEK_SET)
            chunk = os.read(fd, n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class SafetensorsFile:
    """A safetensors file opened once: header read and checked; tensors mapped on demand.

    ``get(name)`` returns a numpy array backed by a private copy-on-write map of just that
    tensor's bytes, taken from the descriptor opened here (writable without touching the
    file; the pages are freed with the array). ``fd`` hands over a descriptor of ``path``
    already open (this object then owns it). ``close()`` (or garbage collection) closes the
    descriptor; arrays already returned stay valid.
    """

    def __init__(self, path: str | os.PathLike, *, fd: int | None = None) -> None:
        self.path = os.fspath(path)
        if fd is None:
            fd = open_input(self.path, what="safetensors file")
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> None:
        try:
            size = os.fstat(self._fd).st_size
            prefix = read_at(self._fd, 8, 0)
            if len(prefix) < 8:
                raise self._error(f"file is {size} bytes, too short for a safetensors header (empty or truncated)")
            (n,) = struct.unpack("<Q", prefix)
            if n == 0 or n > MAX_HEADER or n > size - 8:
                raise self._error(f"header length field says {n} bytes but the file has {size - 8} "
                                  "after it (truncated, or not a safetensors file)")
            raw = read_at(self._fd, n, 8)
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        header = parse_json_object(raw, self._error, "header")
        meta = header.pop(RESERVED, None)
        if meta is None:  # absent, or null as MLX writes it
            meta = {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in meta.items()):
            raise self._error("corrupted header (__metadata__ must map strings to strings)")
        self.metadata: dict[str, str] = meta
        self.size = size
        data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._parse_entry(name, entry, data_start, size - data_start)
        self._check_layout(size - data_start)

    def _check_layout(self, data_size: int) -> None:
        """The tensors tile the data section exactly, as the format's reference requires: sorted
        by offset each begins where the one before ends, and the last ends at the end of the
        file. Overlapping tensors (two names reading the same bytes) and a header length that is
        off (which shifts every tensor) are caught here; empty tensors take no bytes."""
        pos = 0
        for info in sorted(self.tensors.values(), key=lambda t: (t.start, t.nbytes)):
            begin = info.start - (self.size - data_size)
            if begin != pos:
                what = "overlaps the tensor before it" if begin < pos else f"leaves bytes {pos}..{begin} unused"
                raise self._error(f"tensor {info.name!r} starts at data byte {begin} and {what} "
                                  "(the tensors must cover the data section exactly)")
            pos += info.nbytes
        if pos != data_size:
            raise self._error(f"the tensors cover {pos} data bytes but the file holds {data_size} after the "
                              "header (wrong header length, or trailing bytes)")

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def close(self) -> None:
        """Close the descriptor (idempotent); arrays already mapped keep their own maps."""
        self._closer()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a readable safetensors file: {what}")

    def _parse_entry(self, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise self._error(f"corrupted header (entry {name!r} needs dtype, shape and data_offsets)")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or (code not in _NUMPY_CODES and code not in _ML_CODES):
            raise self._error(f"tensor {name!r} has unsupported dtype {shorten(code)}")
        # JSON true/false are Python bools, and bool is an int subclass: exact type checks
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK
                and all(type(s) is int and s >= 0 for s in shape)):
            raise self._error(f"corrupted header (tensor {name!r} has shape {shorten(shape)})")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise self._error(f"corrupted header (tensor {name!r} has data_offsets {shorten(offsets)})")
        begin, end = offsets
        if end > data_size:
            raise self._error(f"truncated: tensor {name!r} ends at data byte {end} but the file "
                              f"holds only {data_size} data bytes")
        itemsize = numpy_dtype_of(code).itemsize
        # the product of the claimed shape is only compared, never allocated
        if end - begin != itemsize * math.prod(shape):
            raise self._error(f"tensor {name!r}: shape {tuple(shape)} of {code} needs "
                              f"{itemsize * math.prod(shape)} bytes but its offsets span {end - begin}")
        return TensorInfo(name, code, tuple(shape), data_start + begin, end - begin)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a numpy array mapped from the opened file (copy-on-write)."""
        info = self.tensors[name]
        dtype = info.numpy_dtype
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype)
        if self.closed:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.path}: the file was closed")
        # mmap offsets must be multiples of the allocation granularity: map from the page before
        skip = info.start % mmap.ALLOCATIONGRANULARITY
        try:
            # mmap duplicates the descriptor: the map (and the array on it) outlives close()
            mapped = mmap.mmap(self._fd, skip + info.nbytes, access=mmap.ACCESS_COPY, offset=info.start - skip)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.path}: {exc}") from None
        return np.frombuffer(mapped, dtype=dtype, count=math.prod(info.shape), offset=skip).reshape(info.shape)

    def read_block(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` (one ``slice(start, stop)`` per axis) of tensor ``name``, read
        with ``pread`` of its bytes only: the block is a run of contiguous bytes per index of
        its leading axes (one run when it spans whole rows), so a rank of a tensor-parallel
        load reads its columns of a kernel row by row, never the whole tensor."""
        info = self.tensors[name]
        dtype, shape = info.numpy_dtype, info.shape
        if len(index) != len(shape) or any(not 0 <= s.start <= s.stop <= n for s, n in zip(index, shape)):
            raise CheckpointError(f"{self.path}: block {index} lies outside tensor {name!r} of shape {shape}")
        out = np.empty([s.stop - s.start for s in index], dtype)
        if out.size == 0:
            return out
        if self.closed:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.path}: the file was closed")
        # axes from k on form one contiguous run: every axis after k is whole
        k = len(shape) - 1 if shape else 0
        while k > 0 and index[k].start == 0 and index[k].stop == shape[k]:
            k -= 1
        run = math.prod(out.shape[k:]) * dtype.itemsize
        flat = out.reshape(math.prod(out.shape[:k]) if k else 1, -1)
        for n, lead in enumerate(np.ndindex(*out.shape[:k])):
            first = [i + s.start for i, s in zip(lead, index)] + [s.start for s in index[k:]]
            offset = info.start + int(np.ravel_multi_index(first, shape)) * dtype.itemsize if shape else info.start
            raw = read_at(self._fd, run, offset)
            if len(raw) != run:
                raise CheckpointError(f"cannot read tensor {name!r} from {self.path}: the file ends early "
                                      "(truncated while open)")
            flat[n] = np.frombuffer(raw, dtype=dtype)
        return out


# ------------------------------------------------------------------------------ writing
#: A tensor to write: its numpy array, or (dtype, shape, producer) to fetch it when its turn comes.
Producer = Callable[[], np.ndarray]


@dataclass(frozen=True)
class PendingTensor:
    """A tensor known by dtype and shape now, its data fetched only when it is written."""

    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Producer

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def pending(value) -> PendingTensor:
    """A PendingTensor for an array (or one already pending)."""
    if isinstance(value, PendingTensor):
        return value
    arr = value
    return PendingTensor(arr.dtype, tuple(arr.shape), lambda: arr)


def header_bytes(tensors: Mapping[str, PendingTensor], metadata: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    """The length-prefixed, space-padded header and the order the tensors' bytes follow in.

    Larger dtypes come first (stable otherwise), so every tensor starts aligned to its itemsize.
    """
    if RESERVED in tensors:
        raise CheckpointError(f"a tensor cannot be named {RESERVED!r}: safetensors reserves that header key "
                              "for metadata (rename the parameter)")
    order = sorted(tensors, key=lambda k: -tensors[k].dtype.itemsize)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": st_dtype(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def write_header(path: str, tensors: Mapping[str, PendingTensor], metadata: Mapping[str, str] | None) -> dict[str, int]:
    """Write only the header of a safetensors file for ``tensors`` (dtype and shape used, data
    not) at ``path``; return each tensor's byte offset in the file, for the bytes to be filled
    in later (``_native_stream``: a framework's file written with no model built)."""
    head, order = header_bytes(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
    offsets, at = {}, len(head)
    for name in order:
        offsets[name] = at
        at += tensors[name].nbytes
    return offsets


def write_safetensors(f, tensors: Mapping[str, PendingTensor], metadata: Mapping[str, str] | None = None,
                      on_tensor: Callable[[str, int], None] | None = None, check_finite: bool = False) -> int:
    """Write ``tensors`` to ``f`` (a binary file opened for writing, at its start); return the bytes written.

    The header goes first; each tensor's bytes follow at their offsets through
    :func:`dense_bridge.checkpoints._file_fill.fill`: each producer is called when its tensor's turn comes,
    transposed views are rearranged piece by piece while the previous piece is written, so
    memory holds a few pieces, never a tensor. ``on_tensor(name, nbytes)`` reports progress.
    ``check_finite``: a tensor holding NaN/Inf is a CheckpointError (scanned while it is copied).
    """
    from ._file_fill import Slot, fill

    head, order = header_bytes(tensors, metadata)
    f.write(head)
    f.flush()
    offset = len(head)
    slots = []
    for name in order:
        t = tensors[name]
        slots.append(Slot(name, offset, np.dtype(t.dtype), tuple(t.shape), t.produce))
        offset += t.nbytes
    fill(f.fileno(), slots, on_tensor=on_tensor, check_finite=check_finite)
    f.seek(offset)
    return offset
