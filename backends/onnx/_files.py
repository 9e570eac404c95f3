"""``.onnx`` files: read and write whole models, external data included, hostile files refused.

Reading never follows the file anywhere it should not go: the file's size is checked against the
memory available before it is read, the protobuf is parsed without its external data, and every
tensor anywhere in it (initializers, sparse initializers, Constant and other tensor attributes,
in the main graph, in every nested graph of If/Loop/Scan nodes and in model functions) is
checked: two initializers of one name in a graph are refused (onnxruntime would use one of them),
and every external reference must be a relative path that stays inside the model's directory
(no ``..``, no absolute path, no symlink leaving the directory), a regular file, with an offset
and length inside it and a size the machine's memory can hold; only then is it read into the
tensor, so nothing is left for onnxruntime to resolve against the current directory.
Writing goes through a temporary the core renames; tensors from ``external_threshold`` bytes go
to ``<name>.data`` next to the model (as torch's dynamo exporter writes them).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import TensorProto
from onnx.external_data_helper import uses_external_data

from dense_bridge._errors import CheckpointError
from dense_bridge.checkpoints._guard import input_file, open_input
from dense_bridge.checkpoints._safetensors import read_at
from dense_bridge.params._memory_budget import available_memory

from ._arrays import to_numpy_dtype

#: element types stored one whole number of bytes per value (sub-byte and string types are packed otherwise)
_WHOLE_BYTES = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20})
#: protobuf's own limit: larger models must keep tensors in external data
_PROTO_LIMIT = 2 ** 31 - 1


def _available_memory() -> int:
    """Bytes a read may take: ``MemAvailable`` (the memory budget's reading), else physical memory."""
    available = available_memory()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _tensor_bytes(t: TensorProto, path: str, what: str = "") -> int:
    try:
        item = np.dtype(to_numpy_dtype(t.data_type)).itemsize
    except Exception:  # noqa: BLE001 - an unknown element type
        item = 8
    n = 1
    for d in t.dims:
        if d < 0:
            raise CheckpointError(f"{path}: {what or repr(t.name)} has a negative dimension {d}: corrupted")
        n *= int(d)
    return n * item


def _graph_tensors(graph: onnx.GraphProto, where: str):
    """(tensor, what it is) for every tensor of ``graph`` and of the graphs nested in its nodes."""
    inside = f" of {where}" if where else ""
    for t in graph.initializer:
        yield t, f"initializer {t.name!r}{inside}"
    for sp in graph.sparse_initializer:
        yield sp.values, f"sparse initializer {sp.values.name!r}{inside}"
        yield sp.indices, f"the indices of sparse initializer {sp.values.name!r}{inside}"
    yield from _node_tensors(graph.node, where)


def _node_tensors(nodes, where: str):
    inside = f" of {where}" if where else ""
    for node in nodes:
        for a in node.attribute:
            what = f"attribute {a.name!r} of node {node.name!r} ({node.op_type}){inside}"
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t, f"the tensor in {what}"
            elif a.type == onnx.AttributeProto.TENSORS:
                yield from ((t, f"a tensor in {what}") for t in a.tensors)
            elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                yield a.sparse_tensor.values, f"the sparse tensor in {what}"
                yield a.sparse_tensor.indices, f"the sparse tensor's indices in {what}"
            elif a.type == onnx.AttributeProto.GRAPH:
                yield from _graph_tensors(a.g, f"the graph in {what}")
            elif a.type == onnx.AttributeProto.GRAPHS:
                for k, g in enumerate(a.graphs):
                    yield from _graph_tensors(g, f"graph {k} in {what}")


def all_tensors(model: onnx.ModelProto):
    """(tensor, what it is) for every tensor ``model`` holds: main graph, nested graphs, functions."""
    yield from _graph_tensors(model.graph, "")
    for f in model.functions:
        yield from _node_tensors(f.node, f"function {f.name!r}")


def _graphs(graph: onnx.GraphProto, where: str):
    """(graph, what it is) for ``graph`` and every graph nested in its nodes."""
    yield graph, where or "the main graph"
    for node in graph.node:
        for a in node.attribute:
            what = f"the graph in attribute {a.name!r} of node {node.name!r} ({node.op_type})"
            for k, g in enumerate([a.g] if a.type == onnx.AttributeProto.GRAPH else
                                  a.graphs if a.type == onnx.AttributeProto.GRAPHS else []):
                yield from _graphs(g, what if a.type == onnx.AttributeProto.GRAPH else f"{what} (graph {k})")


def _check_names(path: str, model: onnx.ModelProto) -> None:
    """CheckpointError for two initializers of one name in a graph (onnxruntime uses one of them)."""
    for graph, where in _graphs(model.graph, ""):
        seen: set[str] = set()
        for name in [t.name for t in graph.initializer] + [sp.values.name for sp in graph.sparse_initializer]:
            if name in seen:
                raise CheckpointError(f"{path}: {where} holds two initializers named {name!r}: onnxruntime would "
                                      f"use one of them and dense_bridge could read the other; refused")
            seen.add(name)


def _read_external(path: str, model: onnx.ModelProto) -> None:
    """Load every external tensor of ``model`` (parsed from ``path``) after checking where it points."""
    base = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    budget = _available_memory()
    total = 0
    for t, what in list(all_tensors(model)):
        if not uses_external_data(t):
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if not loc or os.path.isabs(loc) or loc.startswith(("/", "\\")) or ".." in loc.replace("\\", "/").split("/"):
            raise CheckpointError(f"{path}: {what} points at external data {loc!r} outside the model's "
                                  f"directory: refused (only relative paths inside {base} are read)")
        full = os.path.join(base, loc)
        real = os.path.realpath(full)
        if os.path.commonpath([real, base]) != base:
            raise CheckpointError(f"{path}: {what}'s external data {loc!r} is a link leading outside "
                                  f"the model's directory ({real}): refused")
        try:
            offset, need = int(info.get("offset", 0)), _tensor_bytes(t, path, what)
            length = int(info.get("length", need))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {what} has a malformed external-data entry ({exc})") from None
        total += need
        if need > budget or total > budget:
            raise CheckpointError(f"{path}: {what} claims {need} bytes ({total} in all), more memory than "
                                  f"this machine has ({budget}): refused")
        try:
            f = input_file(full, what=f"external data {loc!r} of {what} of the ONNX model {path}", inside=base)
            with f as handle:
                size = os.fstat(handle.fileno()).st_size
                if offset < 0 or length != need or offset + length > size:
                    raise CheckpointError(f"{path}: {what} wants bytes {offset}..{offset + length} of {loc!r} "
                                          f"({size} bytes) for a tensor of {need} bytes: truncated or corrupted")
                handle.seek(offset)
                data = handle.read(length)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read {what}'s external data {loc!r} ({exc.strerror or exc})") \
                from None
        if len(data) != length:
            raise CheckpointError(f"{path}: {loc!r} ended early reading {what}")
        t.raw_data = data
        del t.external_data[:]
        t.data_location = TensorProto.DEFAULT


def read_model(path: str) -> onnx.ModelProto:
    """An ``.onnx`` file as a ``ModelProto`` with every tensor in memory (CheckpointError on a bad file)."""
    fd = open_input(path, what="ONNX model")
    try:
        st = os.fstat(fd)
        data = _read_checked(path, fd, st)
    finally:
        os.close(fd)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise CheckpointError(f"{path} is not a readable ONNX model (truncated or corrupted protobuf: "
                              f"{type(exc).__name__})") from None
    return _checked_model(path, model)


def _read_checked(path: str, fd: int, st: os.stat_result) -> bytes:
    """The bytes of the open ONNX file, refused before reading when they cannot fit."""
    available = _available_memory()
    if 2 * st.st_size > available:  # the file's bytes and the parsed model hold it twice
        raise CheckpointError(f"{path} is {st.st_size:,} bytes; reading it takes about {2 * st.st_size:,} bytes, more "
                              f"than the {available:,} bytes of memory available: refused before reading")
    if st.st_size > _PROTO_LIMIT:
        raise CheckpointError(f"{path} is {st.st_size:,} bytes, past protobuf's 2 GiB limit ({_PROTO_LIMIT:,}): not "
                              f"a readable ONNX model (a model this large keeps its tensors in external data)")
    try:
        return read_at(fd, st.st_size + 1, 0)
    except OSError as exc:
        raise CheckpointError(f"cannot read the ONNX model {path}: {exc.strerror or exc}") from None


def _checked_model(path: str, model: onnx.ModelProto) -> onnx.ModelProto:
    if not model.HasField("graph") or (not model.graph.node and not model.graph.initializer):
        raise CheckpointError(f"{path} holds no ONNX graph (an empty or foreign protobuf)")
    _check_names(path, model)
    for t, what in all_tensors(model):
        if not uses_external_data(t) and t.data_type in _WHOLE_BYTES:
            need = _tensor_bytes(t, path, what)
            if t.raw_data and len(t.raw_data) != need:
                raise CheckpointError(f"{path}: {what} holds {len(t.raw_data)} bytes for a tensor of {need}: "
                                      f"corrupted")
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
