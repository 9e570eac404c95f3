"""``.onnx`` files: read and write whole models, external data included, hostile files refused.

Reading never follows the file anywhere it should not go: the protobuf is parsed without its
external data, every external reference is checked (a relative path that stays inside the
model's directory, no ``..``, no absolute path, no symlink leaving the directory, a regular
file, an offset and length inside it, a size the machine's memory can hold) and only then read.
Writing goes through a temporary the core renames; tensors from ``external_threshold`` bytes go
to ``<name>.data`` next to the model (as torch's dynamo exporter writes them).
"""
from __future__ import annotations

import os
import stat
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import TensorProto
from onnx.external_data_helper import uses_external_data

from dense_bridge._errors import CheckpointError

from ._arrays import to_numpy_dtype

#: protobuf's own limit: larger models must keep tensors in external data
_PROTO_LIMIT = 2 ** 31 - 1


def _available_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _tensor_bytes(t: TensorProto, path: str) -> int:
    try:
        item = np.dtype(to_numpy_dtype(t.data_type)).itemsize
    except Exception:  # noqa: BLE001 - an unknown element type
        item = 8
    n = 1
    for d in t.dims:
        if d < 0:
            raise CheckpointError(f"{path}: tensor {t.name!r} has a negative dimension {d}: corrupted")
        n *= int(d)
    return n * item


def _external_tensors(model: onnx.ModelProto) -> list[TensorProto]:
    out = [t for t in model.graph.initializer if uses_external_data(t)]
    for node in model.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR and uses_external_data(a.t):
                out.append(a.t)
    return out


def _read_external(path: str, model: onnx.ModelProto) -> None:
    """Load every external tensor of ``model`` (parsed from ``path``) after checking where it points."""
    base = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    budget = _available_memory()
    total = 0
    for t in _external_tensors(model):
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if not loc or os.path.isabs(loc) or loc.startswith(("/", "\\")) or ".." in loc.replace("\\", "/").split("/"):
            raise CheckpointError(f"{path}: tensor {t.name!r} points at external data {loc!r} outside the model's "
                                  f"directory: refused (only relative paths inside {base} are read)")
        full = os.path.join(base, loc)
        real = os.path.realpath(full)
        if os.path.commonpath([real, base]) != base:
            raise CheckpointError(f"{path}: tensor {t.name!r}'s external data {loc!r} is a link leading outside "
                                  f"the model's directory ({real}): refused")
        try:
            st = os.stat(real)
        except OSError as exc:
            raise CheckpointError(f"{path}: tensor {t.name!r}'s external data {loc!r} cannot be opened "
                                  f"({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: tensor {t.name!r}'s external data {loc!r} is not a regular file "
                                  f"(a FIFO, device or directory): refused")
        try:
            offset, need = int(info.get("offset", 0)), _tensor_bytes(t, path)
            length = int(info.get("length", need))
        except ValueError as exc:
            raise CheckpointError(f"{path}: tensor {t.name!r} has a malformed external-data entry ({exc})") from None
        total += need
        if need > budget or total > budget:
            raise CheckpointError(f"{path}: tensor {t.name!r} claims {need} bytes ({total} in all), more memory than "
                                  f"this machine has ({budget}): refused")
        if offset < 0 or length != need or offset + length > st.st_size:
            raise CheckpointError(f"{path}: tensor {t.name!r} wants bytes {offset}..{offset + length} of {loc!r} "
                                  f"({st.st_size} bytes) for a tensor of {need} bytes: truncated or corrupted")
        with open(real, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise CheckpointError(f"{path}: {loc!r} ended early reading tensor {t.name!r}")
        t.raw_data = data
        del t.external_data[:]
        t.data_location = TensorProto.DEFAULT


def read_model(path: str) -> onnx.ModelProto:
    """An ``.onnx`` file as a ``ModelProto`` with every tensor in memory (CheckpointError on a bad file)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"cannot open {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device or directory): refused")
    with open(path, "rb") as f:
        data = f.read(st.st_size + 1)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise CheckpointError(f"{path} is not a readable ONNX model (truncated or corrupted protobuf: "
                              f"{type(exc).__name__})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.initializer):
        raise CheckpointError(f"{path} holds no ONNX graph (an empty or foreign protobuf)")
    for t in model.graph.initializer:
        if not uses_external_data(t):
            need = _tensor_bytes(t, path)
            if t.raw_data and len(t.raw_data) != need:
                raise CheckpointError(f"{path}: initializer {t.name!r} holds {len(t.raw_data)} bytes for a tensor of "
                                      f"{need}: corrupted")
    _read_external(path, model)
    return model


def write_model(model: onnx.ModelProto, path: str, *, external: bool | None = None,
                external_threshold: int = 1024) -> list[str]:
    """Write ``model`` to ``path`` (tensors of ``external_threshold`` bytes and more in ``<name>.data``
    when ``external``, by default when the model would pass protobuf's 2 GiB limit). Returns the files."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if external is None:
        external = copy.ByteSize() > _PROTO_LIMIT
    files = [path]
    if external:
        data_name = os.path.basename(path) + ".data"
        onnx.external_data_helper.convert_model_to_external_data(
            copy, all_tensors_to_one_file=True, location=data_name, size_threshold=external_threshold,
            convert_attribute=False)
        onnx.external_data_helper.write_external_data_tensors(copy, os.path.dirname(os.path.abspath(path)))
        files.append(os.path.join(os.path.dirname(path), data_name))
    with open(path, "wb") as f:
        f.write(copy.SerializeToString())
    return files


# ------------------------------------------------------------------ the adapter's file verbs
def file_info(path: str, container: str, *, files: Any = None) -> tuple[dict, dict]:
    """``{initializer name: (shape, dtype name)}`` of an ``.onnx`` file, and its metadata."""
    model = read_model(path)
    from ._arrays import dtype_name_of

    entries = {t.name: (tuple(int(d) for d in t.dims), dtype_name_of(t.data_type) or to_numpy_dtype(t.data_type).name)
               for t in model.graph.initializer}
    return entries, {p.key: p.value for p in model.metadata_props}


def read_file(path: str, container: str, template: Any = None, *, files: Any = None, check: Any = None,
              borrow: bool = False) -> onnx.ModelProto:
    """The model in an ``.onnx`` file (it carries its own graph: ``template`` is not needed)."""
    return read_model(path)


def write_file(model: Any, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    """Write an ONNX model into ``temp`` (renamed to ``path`` by the core), ``metadata`` in its props."""
    if not isinstance(model, onnx.ModelProto):
        raise CheckpointError(f"cannot write {path} as ONNX: expected an onnx.ModelProto, got {type(model).__name__}")
    if metadata:
        model = _with_props(model, metadata)
    write_model(model, temp)


def _with_props(model: onnx.ModelProto, metadata: Mapping[str, str]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    props = {p.key: p.value for p in copy.metadata_props}
    props.update({k: v for k, v in metadata.items() if k not in props})
    onnx.helper.set_model_props(copy, props)
    return copy


def load_model(path: str, *, trust_pickle: bool = False) -> onnx.ModelProto:
    """A whole ONNX model from ``path`` (``dense-bridge check A B --mapping``); nothing in it runs
    code, so ``trust_pickle`` is not needed."""
    return read_model(path)
