"""A GGUF file reader: memory-mapped, bounded, and safe on hostile input.

The format (llama.cpp's ``gguf.cpp``, gguf-py's ``GGUFReader``), little-endian:

- ``b"GGUF"``, uint32 version (2 or 3), uint64 tensor count, uint64 metadata count;
- metadata: per key a string (uint64 length + UTF-8 bytes), a uint32 value type
  (``gguf.GGUFValueType``) and the value; an ARRAY value is a uint32 element type, a uint64
  count and the elements (arrays may nest);
- tensor infos: per tensor its name (string), uint32 n_dims, n_dims uint64 dimensions ``ne``
  (innermost first: a torch ``(out, in)`` weight is stored ``ne = [in, out]``), uint32 ggml type,
  uint64 offset relative to the data section;
- the data section, starting at the end of the tensor infos padded to ``general.alignment``
  (uint32, a power of two, default 32); every tensor offset is a multiple of it.

Why our own parser, not gguf-py's ``GGUFReader``: that reader maps the file and builds numpy
views of whatever the header claims (an array of ``2**40`` elements, a string running past the
end: numpy errors or huge allocations, never an error naming the file and key). Here every
count and length is checked against the bytes present before anything is allocated, nesting is
bounded, and every problem is a ``CheckpointError`` naming the file and the key or tensor.

Reading is consistent against a concurrent atomic save: each part is opened once and the header
and every tensor are read from that descriptor. The header is read with ``pread`` as far as the
parse gets (no map: a file truncated meanwhile is an error, never a SIGBUS); each tensor gets
its own small private map (as ``SafetensorsFile`` does), so its pages are released with the array.

Shapes are given in NUMPY order (``ne`` reversed): ``TensorInfo.shape`` of a torch ``(out, in)``
weight is ``(out, in)``. Split models (``name-00001-of-00003.gguf``, ``split.*`` metadata, as
llama.cpp's ``gguf-split`` and gguf-py's ``GGUFWriter(split_max_*)`` write them) open as one
file whose tensors come from every part.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import struct
import weakref
from dataclasses import dataclass

import numpy as np

from dense_bridge._errors import CheckpointError, ConversionError
from dense_bridge.checkpoints._safetensors import open_readonly, read_at, shorten

__all__ = ["GGUF_MAGIC", "TensorInfo", "GGUFFile", "open_gguf", "is_gguf", "split_parts", "type_sizes",
           "numpy_dtype_of", "file_info", "describe", "MAX_DIMS"]

GGUF_MAGIC = b"GGUF"
#: The versions read: 2 and 3 (uint64 counts; version 1's uint32 counts are long obsolete).
VERSIONS = (2, 3)
#: ggml's GGML_MAX_DIMS.
MAX_DIMS = 4
#: Limits on what a header may make us build (real models stay far below them: a 256k-token
#: vocabulary with scores, types and merges is about a million array elements).
MAX_TENSORS = 1 << 20
MAX_METADATA = 1 << 16
MAX_ARRAY_ITEMS = 1 << 23      # every metadata array's elements together
MAX_ARRAY_DEPTH = 4            # arrays of arrays of ...
MAX_STRING = 1 << 26           # one metadata string (a chat template is a few kB)
MAX_NAME = 1 << 12             # a key or tensor name (llama.cpp: tensor names < 64 bytes)
MAX_HEADER = 1 << 30           # metadata and tensor infos together
#: The largest tensor accepted (2**62 bytes): the product of hostile dimensions is refused
#: long before it could matter, and every size below it is compared to the file, never allocated.
MAX_TENSOR_BYTES = 1 << 62

_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def _gguf():
    import gguf

    return gguf


# value type number -> (struct code, size) of the scalar types
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
                  11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
# the fewest bytes one element of an array of each type takes (a string: its length; an array: type + count)
_MIN_ITEM = {**{k: v[1] for k, v in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}


def type_sizes(ggml_type) -> tuple[int, int]:
    """(block size in values, bytes per block) of a ggml type (``gguf.GGML_QUANT_SIZES``)."""
    return _gguf().GGML_QUANT_SIZES[ggml_type]


def numpy_dtype_of(ggml_type) -> np.dtype:
    """The dtype :meth:`GGUFFile.get` returns for a tensor of ``ggml_type``: float32 for F32 and every
    quantized type (dequantized), float16 for F16, ``ml_dtypes.bfloat16`` for BF16, float64 for F64,
    int8..int64 for I8..I64."""
    T = _gguf().GGMLQuantizationType
    stored = {T.F32: "float32", T.F16: "float16", T.F64: "float64", T.I8: "int8", T.I16: "int16",
              T.I32: "int32", T.I64: "int64"}
    if ggml_type == T.BF16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(stored.get(ggml_type, "float32"))


def _stored_dtype(ggml_type) -> np.dtype | None:
    """The dtype the bytes of a float or integer tensor are stored as; None for block-quantized types."""
    T = _gguf().GGMLQuantizationType
    if ggml_type in (T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64):
        return numpy_dtype_of(ggml_type).newbyteorder("<")
    return None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    - ``name``; ``shape``: NUMPY order (the file's ``ne`` reversed: a torch ``(out, in)`` weight
      reads ``(out, in)``); ``ggml_type``: a ``gguf.GGMLQuantizationType``;
    - ``offset``: absolute byte offset in its file (``path``, the part of a split model holding it);
      ``nbytes``: its size in the file (whole blocks).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: object
    offset: int
    nbytes: int
    path: str

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype :meth:`GGUFFile.get` returns (float32 for quantized types: dequantized)."""
        return numpy_dtype_of(self.ggml_type)

    @property
    def type_name(self) -> str:
        """The ggml type's name ("Q4_K", "F16")."""
        return self.ggml_type.name

    @property
    def quantized(self) -> bool:
        """Whether the tensor is stored in blocks of codes (any type but the float and integer ones)."""
        return _stored_dtype(self.ggml_type) is None

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape of :meth:`GGUFFile.raw`'s bytes: the leading axes, then the bytes of one row."""
        block, size = type_sizes(self.ggml_type)
        return (*self.shape[:-1], self.shape[-1] // block * size)


class _Reader:
    """A bounds-checked cursor over a header's bytes, read from the descriptor with ``pread`` as far
    as the parse has come (never mapped: a file truncated meanwhile is an error, not a SIGBUS);
    every error names the file and what was read. ``size``: the file's size, the bound of every
    length and count; ``buf``: the bytes read so far, from byte 0."""

    def __init__(self, fd: int, size: int, path: str) -> None:
        self.fd, self.path, self.pos, self.size = fd, path, 0, size
        self.buf = b""
        self.items = 0  # metadata array elements read so far (MAX_ARRAY_ITEMS)

    def error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a readable GGUF file: {what}")

    def fill(self, end: int) -> None:
        """``buf`` holds the file's bytes up to ``end`` at least (``end`` within the file): read doubling."""
        if end <= len(self.buf):
            return
        want = min(self.size, max(end, 2 * len(self.buf), 1 << 16))
        if want > MAX_HEADER:
            raise self.error(f"the header runs past {MAX_HEADER} bytes (refused: no model's header is that large)")
        try:
            more = read_at(self.fd, want - len(self.buf), len(self.buf))
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        self.buf += more
        if len(self.buf) < end:
            raise self.error(f"truncated while being read: it ends at byte {len(self.buf)}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.error(f"truncated: {what} needs {n} bytes at byte {self.pos} but the file has "
                             f"{max(self.size - self.pos, 0)} left")
        self.fill(self.pos + n)

    def scalar(self, code: str, n: int, what: str):
        self.need(n, what)
        (value,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def raw_string(self, what: str, limit: int) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise self.error(f"{what} claims {n} bytes (at most {limit} allowed)")
        self.need(n, what)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def name(self, what: str) -> str:
        raw = self.raw_string(what, MAX_NAME)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} {shorten(raw)} is not UTF-8") from None

    def string(self, what: str) -> str:
        # values keep any bytes (a vocabulary may hold byte pieces that are no UTF-8): undecodable
        # bytes become surrogates, written back byte for byte by the writer
        return self.raw_string(what, MAX_STRING).decode("utf-8", "surrogateescape")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            code, n = _SCALARS[vtype]
            v = self.scalar(code, n, what)
            if vtype == _BOOL:
                if v > 1:
                    raise self.error(f"{what} is a BOOL holding {v} (only 0 or 1)")
                return bool(v)
            return v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.error(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
            etype = self.u32(f"the element type of {what}")
            if etype not in _MIN_ITEM:
                raise self.error(f"{what} is an array of unknown value type {etype} "
                                 f"(known: {sorted(_TYPE_NAMES)})")
            count = self.u64(f"the length of {what}")
            # checked against the bytes present before anything is built
            if count * _MIN_ITEM[etype] > self.size - self.pos:
                raise self.error(f"truncated: {what} claims {count} elements of {_TYPE_NAMES[etype]}, needing at "
                                 f"least {count * _MIN_ITEM[etype]} bytes, but the file has {self.size - self.pos} left")
            self.items += count
            if self.items > MAX_ARRAY_ITEMS:
                raise self.error(f"{what}: the metadata arrays hold more than {MAX_ARRAY_ITEMS} elements together "
                                 "(refused: no model's metadata is that large)")
            if etype in _NUMPY_SCALARS:
                n = count * _SCALARS[etype][1]
                self.need(n, what)
                arr = np.frombuffer(self.buf, dtype=_NUMPY_SCALARS[etype], count=count, offset=self.pos)
                self.pos += n
                if etype == _BOOL:
                    if count and int(arr.max()) > 1:
                        raise self.error(f"{what} is a BOOL array holding {int(arr.max())} (only 0 or 1)")
                    return [bool(x) for x in arr]
                return arr.tolist()
            if etype == _STRING:
                return self._strings(count, what)
            return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]
        raise self.error(f"{what} has unknown value type {vtype} (known: {sorted(_TYPE_NAMES)})")

    def _strings(self, count: int, what: str) -> list[str]:
        """A string array's ``count`` elements (a vocabulary: hundreds of thousands), in one tight loop."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.error(f"truncated: {what}[{i}] needs 8 bytes at byte {pos} but the file has {size - pos} left")
            if pos + 8 > len(buf):
                self.fill(pos + 8)
                buf = self.buf
            (n,) = unpack(buf, pos)
            pos += 8
            if n > MAX_STRING or pos + n > size:
                raise self.error(f"truncated: {what}[{i}] claims {n} bytes at byte {pos} but the file has "
                                 f"{size - pos} left")
            if pos + n > len(buf):
                self.fill(pos + n)
                buf = self.buf
            out.append(str(buf[pos:pos + n], "utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value_type(self, vtype: int) -> tuple:
        """(value type, element type or None) of the value about to be read (peeks an array's element type)."""
        if vtype == _ARRAY and self.pos + 4 <= self.size:
            self.fill(self.pos + 4)
            return (vtype, struct.unpack_from("<I", self.buf, self.pos)[0])
        return (vtype, None)


class _Part:
    """One opened GGUF file: its descriptor, metadata, value types and tensor infos."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = open_readonly(path)
        except FileNotFoundError:
            raise CheckpointError(f"cannot read {path}: no such file") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        self._closer = weakref.finalize(self, os.close, self.fd)
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._closer()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def _parse(self) -> None:
        path = self.path
        try:
            self.size = size = os.fstat(self.fd).st_size
            head = read_at(self.fd, 24, 0)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        if head[:4] != GGUF_MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file: it starts with {head[:4]!r}, not {GGUF_MAGIC!r}")
        if len(head) < 24:
            raise CheckpointError(f"{path} is not a readable GGUF file: truncated: {size} bytes, "
                                  "shorter than the 24-byte header")
        (version,) = struct.unpack_from("<I", head, 4)
        if version not in VERSIONS:
            swapped = struct.unpack_from(">I", head, 4)[0]
            note = " (a big-endian GGUF file: only little-endian files are read)" if swapped in VERSIONS else ""
            raise CheckpointError(f"{path} is GGUF version {version}, which is not read (versions read: "
                                  f"{', '.join(map(str, VERSIONS))}){note}")
        self.version = version
        self._parse_header(_Reader(self.fd, size, path))

    def _parse_header(self, r: _Reader) -> None:
        r.pos = 8
        n_tensors = r.u64("the tensor count")
        n_kv = r.u64("the metadata count")
        if n_tensors > MAX_TENSORS or n_tensors * 24 > r.size - r.pos:
            raise r.error(f"the header claims {n_tensors} tensors, more than the file's {r.size} bytes can hold "
                          f"(or than the {MAX_TENSORS} read)")
        if n_kv > MAX_METADATA or n_kv * 13 > r.size - r.pos:
            raise r.error(f"the header claims {n_kv} metadata entries, more than the file's {r.size} bytes can hold "
                          f"(or than the {MAX_METADATA} read)")
        self.metadata: dict[str, object] = {}
        self.types: dict[str, tuple] = {}
        for i in range(n_kv):
            key = r.name(f"metadata key #{i}")
            if key in self.metadata:
                raise r.error(f"metadata key {shorten(key)} appears twice")
            vtype = r.u32(f"the value type of metadata key {shorten(key)}")
            if vtype not in _TYPE_NAMES:
                raise r.error(f"metadata key {shorten(key)} has unknown value type {vtype} (known: {sorted(_TYPE_NAMES)})")
            self.types[key] = r.value_type(vtype)
            self.metadata[key] = r.value(vtype, f"metadata key {shorten(key)}")
        alignment = self.metadata.get("general.alignment", 32)
        if "general.alignment" in self.metadata and self.types["general.alignment"][0] != 4:
            raise r.error(f"general.alignment must be a UINT32, not {_TYPE_NAMES[self.types['general.alignment'][0]]}")
        if not (isinstance(alignment, int) and alignment > 0 and alignment & (alignment - 1) == 0):
            raise r.error(f"general.alignment must be a power of two. Received: {alignment!r}")
        self.alignment = alignment
        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = r.name(f"the name of tensor #{i}")
            if name in names:
                raise r.error(f"tensor {shorten(name)} appears twice")
            names.add(name)
            infos.append((name, *self._tensor_info(r, name)))
        data_start = -(-r.pos // alignment) * alignment
        self.data_start = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, gtype, rel, nbytes in infos:
            if rel % alignment:
                raise r.error(f"tensor {shorten(name)} has offset {rel}, not a multiple of the alignment {alignment}")
            start = data_start + rel
            if start + nbytes > self.size:
                raise r.error(f"truncated: tensor {shorten(name)} ({gtype.name}, shape {shape}, {nbytes} bytes) ends at "
                              f"byte {start + nbytes} but the file has {self.size}")
            self.tensors[name] = TensorInfo(name, shape, gtype, start, nbytes, self.path)
        end = data_start
        for info in sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes)):
            if info.offset < end:
                raise r.error(f"tensor {shorten(info.name)} starts at byte {info.offset}, inside the bytes of another "
                              f"tensor (which end at byte {end}): tensors may not overlap")
            end = info.offset + info.nbytes

    def _tensor_info(self, r: _Reader, name: str):
        gguf = _gguf()
        what = f"tensor {shorten(name)}"
        n_dims = r.u32(f"the dimension count of {what}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.error(f"{what} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        r.need(8 * n_dims, f"the dimensions of {what}")
        ne = struct.unpack_from(f"<{n_dims}q", r.buf, r.pos)
        r.pos += 8 * n_dims
        if any(d < 0 for d in ne):
            raise r.error(f"{what} has a negative dimension: ne={list(ne)}")
        code = r.u32(f"the type of {what}")
        try:
            gtype = gguf.GGMLQuantizationType(code)
            block, size = gguf.GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise r.error(f"{what} has unknown ggml type {code} (gguf {_gguf_version()} knows "
                          f"{', '.join(f'{t.name}={t.value}' for t in gguf.GGMLQuantizationType)})") from None
        rel = r.u64(f"the offset of {what}")
        if ne[0] % block:
            raise r.error(f"{what} has {ne[0]} values per row, not a multiple of the {gtype.name} block size {block}")
        nbytes = math.prod(ne[1:]) * (ne[0] // block) * size
        if nbytes > MAX_TENSOR_BYTES or nbytes > self.size:
            raise r.error(f"{what} of shape ne={list(ne)} in {gtype.name} needs {nbytes} bytes, more than the "
                          f"file's {self.size}")
        return tuple(reversed(ne)), gtype, rel, nbytes


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001 - only for a message
        return "(version unknown)"


def split_parts(path: str) -> list[str] | None:
    """The paths of every part of a split model when ``path`` is named like one
    (``name-00002-of-00003.gguf``), in order; None for a single file."""
    m = _SPLIT_NAME.match(os.path.basename(path))
    if m is None:
        return None
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise CheckpointError(f"{path} is named as part {int(m['no'])} of {count} of a split GGUF model, which cannot be")
    folder = os.path.dirname(path)
    digits_no, digits_count = m.span("no"), m.span("count")
    base = os.path.basename(path)
    return [os.path.join(folder, base[:digits_no[0]] + f"{i:05d}" + base[digits_no[1]:digits_count[0]]
                         + m["count"] + base[digits_count[1]:]) for i in range(1, count + 1)]


class GGUFFile:
    """A GGUF file (or every part of a split model) opened for reading.

    Attributes:
        path: the path opened (the first part of a split model).
        paths: every part's path, in order.
        metadata: key -> value (str, int, float, bool, or a list of them; nested arrays as lists);
            a split model's metadata is its first part's (less nothing: ``split.*`` included).
        metadata_types: key -> (``gguf.GGUFValueType``, element type or None): how each value is
            stored, for writing it back the same way.
        tensors: name -> :class:`TensorInfo`, from every part.
        version, alignment: of the (first) file.

    ``get(name)`` -> the tensor as numpy (float and integer types mapped as stored, copy-on-write;
    quantized types dequantized by ``gguf.quants.dequantize`` to float32), ``raw(name)`` -> its
    block bytes (uint8, shape ``TensorInfo.byte_shape``, mapped). ``close()`` closes the
    descriptors; arrays already returned stay valid. A context manager.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file path (str or os.PathLike). Received: path={path!r}"[:300])
        self.path = os.fspath(path)
        parts = split_parts(self.path)
        self._parts: list[_Part] = []
        try:
            if parts is not None and len(parts) == 1:  # "-00001-of-00001": split metadata or none
                self._parts.append(_Part(parts[0]))
                if "split.no" in self._parts[0].metadata:
                    self._parts.pop().close()
                else:
                    parts = None
            if parts is None:
                if not self._parts:
                    self._parts.append(_Part(self.path))
                self._check_not_split(self._parts[0])
            else:
                self.path = parts[0]
                self._open_split(parts)
        except BaseException:
            self.close()
            raise
        first = self._parts[0]
        self.paths = [p.path for p in self._parts]
        self.version, self.alignment = first.version, first.alignment
        self.metadata = first.metadata
        gguf = _gguf()
        self.metadata_types = {k: (gguf.GGUFValueType(t), None if e is None else gguf.GGUFValueType(e))
                               for k, (t, e) in first.types.items()}
        self.tensors: dict[str, TensorInfo] = {}
        for part in self._parts:
            for name, info in part.tensors.items():
                if name in self.tensors:
                    self.close()
                    raise CheckpointError(f"{part.path} is not a readable GGUF file: tensor {shorten(name)} is also in "
                                          f"{self.tensors[name].path} (a split model's parts must hold different tensors)")
                self.tensors[name] = info
        self._by_path = {p.path: p for p in self._parts}

    def _check_not_split(self, part: _Part) -> None:
        count = part.metadata.get("split.count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 1:
            raise CheckpointError(f"{part.path} is part {part.metadata.get('split.no', 0)} (counted from 0) of a GGUF "
                                  f"model split into {count} files, but its name does not say which "
                                  "(name-00001-of-0000N.gguf): open the parts by their names")

    def _open_split(self, parts: list[str]) -> None:
        total = None
        for i, p in enumerate(parts):
            part = _Part(p)
            self._parts.append(part)
            meta = part.metadata

            def field(key, p=p):
                v = meta.get(key)
                if not isinstance(v, int) or isinstance(v, bool):
                    raise CheckpointError(f"{p} is not a readable part of a split GGUF model: its metadata lacks the "
                                          f"integer {key!r} (received: {shorten(v)})")
                return v

            no, count = field("split.no"), field("split.count")
            if no != i or count != len(parts):
                raise CheckpointError(f"{p} is not part {i + 1} of {len(parts)} as its name says: its metadata says "
                                      f"split.no={no} (counted from 0), split.count={count}")
            if i == 0:
                total = field("split.tensors.count")
        held = sum(len(p.tensors) for p in self._parts)
        if held != total:
            raise CheckpointError(f"{parts[0]}: the split model's parts hold {held} tensors but split.tensors.count "
                                  f"says {total} (a part is missing or truncated)")

    # -- the SafetensorsFile-like surface the port reads weights through
    def keys(self) -> list[str]:
        """Every tensor's name, in file order (parts in order)."""
        return list(self.tensors)

    @property
    def closed(self) -> bool:
        return all(p.closed for p in self._parts)

    def close(self) -> None:
        """Close every part's descriptor (idempotent); arrays already returned keep their own maps."""
        for p in self._parts:
            p.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except (KeyError, TypeError):
            raise CheckpointError(f"{self.path} holds no tensor {shorten(name)}") from None

    def _map(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a uint8 array on a private copy-on-write map of just those bytes."""
        part = self._by_path[info.path]
        if part.closed:
            raise CheckpointError(f"cannot read tensor {info.name!r} from {info.path}: the file was closed")
        if info.nbytes == 0:
            return np.zeros(0, np.uint8)
        skip = info.offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(part.fd, skip + info.nbytes, access=mmap.ACCESS_COPY, offset=info.offset - skip)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read tensor {info.name!r} from {info.path}: {exc} (truncated while open?)") from None
        return np.frombuffer(mapped, dtype=np.uint8, count=info.nbytes, offset=skip)

    def raw(self, name: str) -> np.ndarray:
        """The block bytes of tensor ``name``: uint8 of shape ``TensorInfo.byte_shape`` (leading axes,
        then one row's bytes), mapped from the file (copy-on-write), as ``gguf.quants.dequantize`` takes them."""
        info = self._info(name)
        return self._map(info).reshape(info.byte_shape)

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` in numpy order: float and integer types as stored (mapped, no copy),
        quantized types dequantized to float32 with ``gguf.quants.dequantize`` (ConversionError
        naming the type where gguf cannot dequantize it)."""
        info = self._info(name)
        stored = _stored_dtype(info.ggml_type)
        if stored is not None:
            return self._map(info).view(stored).view(info.numpy_dtype).reshape(info.shape)
        from ._codes import dequantize

        try:
            return dequantize(self.raw(name), info.ggml_type, info.shape)
        except ConversionError as exc:
            raise ConversionError(f"{info.path}: tensor {name!r}: {exc}") from None


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The GGUF file ``path`` opened for reading (a part of a split model, named
    ``name-0000K-of-0000N.gguf``, opens every part); CheckpointError naming the file otherwise."""
    return GGUFFile(path)


def is_gguf(head: bytes) -> bool:
    """Whether a file's first bytes are a GGUF file's (its magic)."""
    return head[:4] == GGUF_MAGIC


def file_info(path: str, container: str | None = None, *, files=None) -> tuple[dict, dict]:
    """The ``file_info`` file verb for a GGUF file (what ``dense-bridge inspect`` lists):
    (name -> (numpy shape, ggml type name in lower case: "q4_k", "f16"), metadata)."""
    with open_gguf(path) as f:
        return ({n: (t.shape, t.type_name.lower()) for n, t in f.tensors.items()}, dict(f.metadata))


_BLOCK = re.compile(r"^blk\.\d+\.")


def _embedding_names() -> frozenset[str]:
    """gguf-py's names of embedding tables ("token_embd", "position_embd", ...): rank-2 weights that
    are looked up, not multiplied, so no linear layer."""
    gguf = _gguf()
    return frozenset(gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSOR if t in gguf.TENSOR_NAMES
                     and ("EMBD" in t.name and "UNEMBD" not in t.name or t.name == "TOKEN_TYPES"))


def describe(path: str | os.PathLike) -> dict:
    """What ``dense-bridge inspect`` shows of a GGUF file (or split model), read from its header only.

    Returns:
        ``{"path", "kind", "files", "bytes", "architecture", "metadata_count",
        "tensors": [{"name", "shape", "dtype"}], "linear_layers": [...]}``: ``dtype`` is the ggml
        type's name ("Q4_K", "F16"); ``linear_layers`` rows as the core's ``file_linear_layers``
        gives them (``layer``, ``in_features``, ``units``, ``bias``, ``dtype``, ``layout``,
        ``layout_source``, ``tensors``): every rank-2 ``<layer>.weight`` but the embedding tables
        gguf-py names, its layout known (ggml stores a matrix as ``ne = [in, out]``: numpy ``(out, in)``).
    """
    with open_gguf(path) as f:
        embeddings = _embedding_names()
        tensors = [{"name": n, "shape": list(t.shape), "dtype": t.type_name} for n, t in f.tensors.items()]
        layers = []
        for n, t in f.tensors.items():
            if not n.endswith(".weight") or len(t.shape) != 2:
                continue
            layer = n[: -len(".weight")]
            if _BLOCK.sub("blk.{bid}.", layer) in embeddings:
                continue
            bias = f.tensors.get(layer + ".bias")
            has_bias = bias is not None and bias.shape == (t.shape[0],)
            layers.append({"layer": layer, "in_features": int(t.shape[1]), "units": int(t.shape[0]), "bias": has_bias,
                           "dtype": t.type_name, "layout": "out_in",
                           "layout_source": "GGUF stores every matrix as ne = [in, out] (ggml's convention)",
                           "tensors": [n] + ([layer + ".bias"] if has_bias else [])})
        sizes = [os.path.getsize(p) for p in f.paths]
        version = f.version
        return {"path": os.fspath(path), "kind": f"GGUF file (version {version}"
                + (f", split into {len(f.paths)} files)" if len(f.paths) > 1 else ")"),
                "files": list(f.paths), "bytes": sum(sizes), "architecture": f.metadata.get("general.architecture"),
                "metadata_count": len(f.metadata), "tensors": tensors, "linear_layers": layers}
