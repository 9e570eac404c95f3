"""A streaming GGUF writer: the header (metadata and every tensor's info) first, then each
tensor's bytes as it comes, so no more than one tensor (a chunk of rows, when it is quantized
here) is in memory.

The layout is gguf-py's ``GGUFWriter``'s (version 3, little-endian): magic, version, counts,
metadata, tensor infos (dimensions innermost first, offsets relative to the data section, each
a multiple of the alignment), zero padding to the alignment, then the tensors in plan order,
each padded to the alignment. gguf-py's writer is not used because it takes the tensors'
shapes, dtypes and metadata types in its own forms and checks nothing a hostile or mistaken
caller could get wrong; the bytes are the same (the tests read both with ``gguf.GGUFReader``).

Metadata types: llama.cpp reads each key as one type (counts and ids UINT32, hyperparameters
FLOAT32, ``tokenizer.ggml.token_type`` an INT32 array, ``split.count`` UINT16): a Python value's
type is inferred (bool -> BOOL, str -> STRING, int -> UINT32, or INT32 when negative, 64-bit
beyond; float -> FLOAT32; a list -> an ARRAY of its elements' type, ints as INT32), and
``types`` names it where that is not what the reader expects (``GGUFFile.metadata_types``
passes a read file's types through unchanged).
"""
from __future__ import annotations

import os
import struct

import numpy as np

from dense_bridge._errors import CheckpointError, SpecError, received

from ._codes import CHUNK, ggml_type_of, quantize

__all__ = ["GGUFOutput", "encode_metadata", "MAX_NAME_BYTES"]

#: llama.cpp's GGML_MAX_NAME (64, the terminating zero included): longer tensor names are refused by it.
MAX_NAME_BYTES = 63
_VERSION = 3
_DEFAULT_ALIGNMENT = 32

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_RANGES = {0: (0, 2**8), 1: (-2**7, 2**7), 2: (0, 2**16), 3: (-2**15, 2**15), 4: (0, 2**32), 5: (-2**31, 2**31),
           10: (0, 2**64), 11: (-2**63, 2**63)}
_STRING, _ARRAY, _BOOL = 8, 9, 7


def _vt():
    import gguf

    return gguf.GGUFValueType


def _int_type(values) -> int:
    lo, hi = min(values), max(values)
    for t in (4, 5, 10, 11) if lo >= 0 else (5, 11):
        a, b = _RANGES[t]
        if a <= lo and hi < b:
            return t
    raise SpecError(f"integers from {lo} to {hi} do not fit a GGUF integer type")


def _infer(value, key: str):
    """(value type, element type or None) of a Python/numpy value."""
    if isinstance(value, (bool, np.bool_)):
        return (_BOOL, None)
    if isinstance(value, str):
        return (_STRING, None)
    if isinstance(value, (int, np.integer)):
        return (_int_type([int(value)]), None) if not isinstance(value, np.integer) else (_numpy_type(value.dtype, key), None)
    if isinstance(value, (float, np.floating)):
        return (6, None) if not isinstance(value, np.floating) or value.dtype.itemsize <= 4 else (12, None)
    if isinstance(value, np.ndarray):
        return (_ARRAY, _numpy_type(value.dtype, key))
    if isinstance(value, (list, tuple)):
        if not value:
            raise SpecError(f"metadata {key!r} is an empty list: its element type cannot be inferred; name it in "
                            f"types= (e.g. types={{{key!r}: gguf.GGUFValueType.INT32}})")
        if all(isinstance(v, (bool, np.bool_)) for v in value):
            return (_ARRAY, _BOOL)
        if all(isinstance(v, str) for v in value):
            return (_ARRAY, _STRING)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in value):
            t = _int_type([int(v) for v in value])
            return (_ARRAY, 5 if t == 4 and max(int(v) for v in value) < 2**31 else t)
        if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
               for v in value):
            return (_ARRAY, 6)
        if all(isinstance(v, (list, tuple, np.ndarray)) for v in value):
            return (_ARRAY, _ARRAY)
        raise SpecError(f"metadata {key!r} mixes element types ({sorted({type(v).__name__ for v in value})}): "
                        f"a GGUF array holds one type")
    raise SpecError(f"metadata {key!r} has a value GGUF cannot hold: {received(key, value)} "
                    "(str, int, float, bool, or a list of them)")


def _numpy_type(dtype: np.dtype, key: str) -> int:
    for t, code in _NUMPY.items():
        if t != _BOOL and np.dtype(code) == np.dtype(dtype).newbyteorder("<"):
            return t
    if np.dtype(dtype) == np.bool_:
        return _BOOL
    raise SpecError(f"metadata {key!r} has numpy dtype {np.dtype(dtype)}, which GGUF cannot hold")


def _type_arg(spec, key: str):
    """types[key] as (value type, element type or None): a GGUFValueType (a list's element type for a list
    value) or a (type, element type) pair (``GGUFFile.metadata_types``)."""
    VT = _vt()
    try:
        if isinstance(spec, tuple):
            t, e = spec
            return (int(VT(t)), None if e is None else int(VT(e)))
        return (int(VT(spec)), None)
    except (ValueError, TypeError):
        raise SpecError(f"types[{key!r}] must be a gguf.GGUFValueType or a (type, element type) pair. "
                        f"{received(f'types[{key!r}]', spec)}") from None


def _pack(value, vtype: int, etype, key: str, out: list) -> None:
    """Append the bytes of ``value`` stored as ``vtype`` (arrays of ``etype``) to ``out``."""
    if vtype == _ARRAY:
        if etype is None:
            etype = _infer(value, key)[1]
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
            raise SpecError(f"metadata {key!r} is declared an ARRAY but is no list. {received(key, value)}")
        out.append(struct.pack("<IQ", etype, len(value)))
        if etype in _NUMPY:
            out.append(_numeric(np.asarray(value), etype, key).tobytes())
        elif etype == _STRING:
            for v in value:
                _pack(v, _STRING, None, key, out)
        elif etype == _ARRAY:
            for v in value:
                _pack(v, _ARRAY, None, key, out)
        else:
            raise SpecError(f"metadata {key!r}: unknown element type {etype}")
        return
    if vtype == _STRING:
        if not isinstance(value, str):
            raise SpecError(f"metadata {key!r} is declared a STRING. {received(key, value)}")
        raw = value.encode("utf-8", "surrogateescape")  # bytes read as surrogates go back as they were
        out.append(struct.pack("<Q", len(raw)) + raw)
        return
    if vtype in _NUMPY:
        out.append(_numeric(np.asarray(value).reshape(()), vtype, key).tobytes())
        return
    raise SpecError(f"metadata {key!r}: unknown value type {vtype}")


def _numeric(arr: np.ndarray, vtype: int, key: str) -> np.ndarray:
    """``arr`` as the little-endian numpy type of ``vtype``, refusing values that would change."""
    if vtype == _BOOL:
        if arr.size and not np.isin(arr, (0, 1, True, False)).all():
            raise SpecError(f"metadata {key!r} is declared BOOL but holds other values")
        return arr.astype(np.uint8)
    if arr.dtype.kind not in "biuf" or arr.dtype == np.bool_ and vtype != _BOOL:
        raise SpecError(f"metadata {key!r} must be numbers for type {_vt()(vtype).name}. {received(key, arr)}")
    if vtype in _RANGES:
        if arr.dtype.kind == "f" and arr.size and not np.array_equal(arr, np.trunc(arr)):
            raise SpecError(f"metadata {key!r} is declared {_vt()(vtype).name} but holds fractions. {received(key, arr)}")
        lo, hi = _RANGES[vtype]
        if arr.size and (int(arr.min()) < lo or int(arr.max()) >= hi):
            raise SpecError(f"metadata {key!r} does not fit {_vt()(vtype).name}. {received(key, arr)}")
    return arr.astype(_NUMPY[vtype])


def _typed(value) -> bool:
    """Whether a metadata value is given with its type: ``(value, GGUFValueType)`` or
    ``(value, GGUFValueType, element type or None)`` (gguf-py's own ``GGUFValue`` triple)."""
    VT = _vt()
    return (isinstance(value, tuple) and len(value) in (2, 3) and type(value[1]) is VT
            and (len(value) == 2 or value[2] is None or type(value[2]) is VT))


def encode_metadata(metadata: dict, types: dict | None = None) -> tuple[bytes, int]:
    """(the metadata section's bytes, its entry count) for ``metadata`` (see the module docstring)."""
    out: list[bytes] = []
    types = types or {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not key:
            raise SpecError(f"metadata keys must be non-empty strings. {received('key', key)}")
        explicit = types.get(key)
        if _typed(value):  # (value, GGUFValueType[, element type]): typed in place
            value, explicit = value[0], (value[1], value[2] if len(value) == 3 else None)
            if explicit[0] != _ARRAY and explicit[1] is not None:
                explicit = explicit[0]
        if explicit is not None:
            vtype, etype = _type_arg(explicit, key)
            if vtype != _ARRAY and isinstance(value, (list, tuple, np.ndarray)) and np.ndim(value) > 0:
                vtype, etype = _ARRAY, vtype  # a list declared by its element type
        else:
            vtype, etype = _infer(value, key)
        raw = key.encode("utf-8")
        out.append(struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype))
        _pack(value, vtype, etype, key, out)
    return b"".join(out), len(metadata)


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class GGUFOutput:
    """A GGUF file written as a stream: header now, tensors one by one in ``plan`` order.

    Args:
        path: the file to write (created or truncated; the caller makes it atomic).
        metadata: key -> value (str, int, float, bool, lists of them, numpy arrays); ``general.alignment``
            (a power of two) sets the alignment, else 32.
        plan: ``[(name, numpy_shape, ggml_type), ...]``: every tensor, in the order written; the
            shape in numpy order (a torch ``(out, in)`` weight as ``(out, in)``; stored reversed).
        types: key -> ``gguf.GGUFValueType`` (a list's element type) or (type, element type), for
            keys whose inferred type is not what llama.cpp reads. A metadata value may also carry
            its type itself: ``(value, GGUFValueType[, element type or None])``.

    ``write(name, data)``: ``data`` is the tensor's stored bytes (bytes or a uint8 array of
    exactly its size: codes moved as they are) or an array of its shape (floats: converted to
    the type with gguf's own quantizers, a chunk of rows at a time; integers for I8..I64).
    ``close()`` finishes the file (CheckpointError naming what was never written, the partial
    file removed); ``abort()`` removes it. A context manager: an exception aborts.
    """

    def __init__(self, path: str | os.PathLike, metadata: dict, plan: list, *, types: dict | None = None) -> None:
        import gguf

        self.path = os.fspath(path)
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict. {received('metadata', metadata)}")
        metadata = dict(metadata)
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, (int, np.integer)) or alignment <= 0 \
                or alignment & (alignment - 1) or alignment >= 2**32:
            raise SpecError(f"general.alignment must be a power of two. {received('general.alignment', alignment)}")
        self.alignment = int(alignment)
        types = dict(types or {})
        if "general.alignment" in metadata:
            types["general.alignment"] = gguf.GGUFValueType.UINT32
        self.plan = self._check_plan(plan)
        kv, n_kv = encode_metadata(metadata, types)
        infos = []
        offset = 0
        self._offsets = {}
        for name, shape, gtype, nbytes in self.plan:
            raw = name.encode("utf-8")
            infos.append(struct.pack("<Q", len(raw)) + raw + struct.pack("<I", len(shape))
                         + struct.pack(f"<{len(shape)}Q", *reversed(shape)) + struct.pack("<IQ", int(gtype), offset))
            self._offsets[name] = offset
            offset += _pad(nbytes, self.alignment)
        head = struct.pack("<4sIQQ", b"GGUF", _VERSION, len(self.plan), n_kv) + kv + b"".join(infos)
        head += b"\0" * (_pad(len(head), self.alignment) - len(head))
        self.data_start = len(head)
        self.size = len(head) + offset
        self._next = 0
        try:
            self._f = open(self.path, "wb")
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        try:
            self._f.write(head)
        except OSError as exc:
            self.abort()
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def _check_plan(self, plan) -> list:
        import gguf

        if not isinstance(plan, (list, tuple)):
            raise TypeError(f"plan must be a list of (name, shape, ggml_type). {received('plan', plan)}")
        out, seen = [], set()
        for i, entry in enumerate(plan):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
                raise SpecError(f"plan[{i}] must be (name, numpy_shape, ggml_type). {received(f'plan[{i}]', entry)}")
            name, shape, gtype = entry
            if not isinstance(name, str) or not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
                raise SpecError(f"plan[{i}]: a tensor name must be a string of 1 to {MAX_NAME_BYTES} UTF-8 bytes "
                                f"(llama.cpp's limit). {received('name', name)}")
            if name in seen:
                raise SpecError(f"plan: tensor {name!r} appears twice")
            seen.add(name)
            gtype = ggml_type_of(gtype, f"plan[{i}] type")
            if not (isinstance(shape, (list, tuple)) and 1 <= len(shape) <= 4
                    and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in shape)):
                raise SpecError(f"plan: tensor {name!r} needs a shape of 1 to 4 positive dimensions. "
                                f"{received('shape', shape)}")
            shape = tuple(int(d) for d in shape)
            block, size = gguf.GGML_QUANT_SIZES[gtype]
            if shape[-1] % block:
                raise SpecError(f"plan: tensor {name!r} of shape {shape} cannot be {gtype.name}: its rows of "
                                f"{shape[-1]} values are no multiple of the block size {block}")
            nbytes = int(np.prod(shape[:-1], dtype=object)) * (shape[-1] // block) * size
            out.append((name, shape, gtype, nbytes))
        return out

    def __enter__(self) -> "GGUFOutput":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def write(self, name: str, data) -> None:
        """Write tensor ``name`` (the next in the plan): its bytes, or an array of its shape (see the class)."""
        if self._f.closed:
            raise CheckpointError(f"cannot write tensor {name!r} to {self.path}: the file is closed")
        if self._next >= len(self.plan):
            raise SpecError(f"{self.path}: every tensor of the plan is written already; {received('name', name)}")
        want, shape, gtype, nbytes = self.plan[self._next]
        if name != want:
            raise SpecError(f"{self.path}: tensors are written in plan order: expected {want!r} next. "
                            f"{received('name', name)}")
        try:
            self._write(name, data, shape, gtype, nbytes)
        except OSError as exc:
            self.abort()
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        self._next += 1

    def _write(self, name, data, shape, gtype, nbytes) -> None:
        f = self._f
        f.seek(self.data_start + self._offsets[name])
        if isinstance(data, (bytes, bytearray, memoryview)) or (isinstance(data, np.ndarray) and data.dtype == np.uint8):
            buf = memoryview(np.ascontiguousarray(np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray)
                                                  else data).reshape(-1))
            if buf.nbytes != nbytes:
                raise SpecError(f"tensor {name!r} ({gtype.name}, shape {shape}) takes {nbytes} bytes; got {buf.nbytes}")
            f.write(buf)
        else:
            arr = np.asarray(data)
            if tuple(arr.shape) != shape:
                raise SpecError(f"tensor {name!r} has shape {shape} in the plan; {received('data.shape', arr.shape)}")
            ints = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}
            if gtype.name in ints:
                if arr.dtype.kind not in "iu":
                    raise SpecError(f"tensor {name!r} is {gtype.name}: it needs integers. {received('data.dtype', arr.dtype)}")
                out = arr.astype(np.dtype(ints[gtype.name]).newbyteorder("<"))
                if not np.array_equal(out, arr):
                    raise SpecError(f"tensor {name!r}: values do not fit {gtype.name}")
                f.write(memoryview(np.ascontiguousarray(out)).cast("B"))
            else:
                rows = arr.reshape(-1, shape[-1])
                step = max(1, CHUNK // shape[-1])
                for start in range(0, rows.shape[0], step):
                    f.write(memoryview(quantize(rows[start:start + step], gtype)).cast("B"))
        end = f.tell()
        f.write(b"\0" * (_pad(end - self.data_start, self.alignment) - (end - self.data_start)))

    def close(self) -> None:
        """Finish the file; CheckpointError (the partial file removed) when tensors of the plan were never written."""
        if self._f.closed:
            return
        if self._next < len(self.plan):
            missing = [p[0] for p in self.plan[self._next:]]
            self.abort()
            raise CheckpointError(f"{self.path} was closed before {len(missing)} tensor(s) of its plan were written "
                                  f"(first: {missing[0]!r}); the partial file was removed")
        try:
            self._f.truncate(self.size)
            self._f.close()
        except OSError as exc:
            self.abort()
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def abort(self) -> None:
        """Close and remove the partial file."""
        try:
            self._f.close()
        except (OSError, AttributeError):
            pass
        try:
            os.remove(self.path)
        except OSError:
            pass
