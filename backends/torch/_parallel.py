"""Tensor parallelism on torch's own machinery: ``DeviceMesh`` + ``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel`` (DTensor). No communication of dense_bridge's own: every
all-gather/reduce is DTensor's (``full_tensor``, ``redistribute``) or ``torch.distributed``'s.

Layouts: torch weight (out, in) = canonical kernel.T, so a column layer (canonical kernel split
along units, axis 1) is ``Shard(0)`` of the weight, a row layer (axis 0) ``Shard(1)``; the mask
buffer is a DTensor with the weight's placement (sharded with its kernel, never replicated, so
``weight * mask`` is a local product that holds through training); a row layer's bias is
``Replicate()``. The plan itself (which layer gathers, which input is sharded) is
``dense_bridge.parallel._plan.resolve_plan``.

Parameters are never materialised whole on a rank when they come from a file: each layer is
built on the meta device and its DTensor parameters are made with ``DTensor.from_local`` from
this rank's block (``block(position, name, index)``, canonical layout).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dense_bridge._errors import DenseBridgeError, SpecError, received
from dense_bridge.parallel._plan import Shard as ShardView
from dense_bridge.parallel._plan import elementwise, resolve_plan, shard_index, split_axis
from dense_bridge.registry._remembered_spec import remember_spec, remembered_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Flatten, Sequential

from ._activations import activation_module
from ._arrays import TORCH_DTYPES, from_numpy, to_numpy
from ._layers import DenseLinear

_STATE = "_dense_bridge_parallel"


def default_mesh() -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise DenseBridgeError("parallel= needs torch.distributed initialised on every rank "
                               "(torchrun, or dist.init_process_group(...) in each process) or a DeviceMesh as group=")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def _mesh(group: Any) -> DeviceMesh:
    if group is None:
        return default_mesh()
    if not isinstance(group, DeviceMesh) or group.ndim != 1:
        raise TypeError(f"group must be a 1-D torch DeviceMesh (or None for one over the world). {received('group', group)}")
    return group


class _Gathered(nn.Module):
    """A whole-feature-axis activation (softmax) fused into a column layer: gather, then apply."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x):
        if isinstance(x, DTensor):
            x = x.redistribute(x.device_mesh, [Replicate()])
        return self.act(x)


def _dtensor(block: np.ndarray, mesh: DeviceMesh, placement, full_shape, transpose: bool) -> torch.Tensor:
    t = from_numpy(block)
    # torch's own memory in the (out, in) layout: one copy (the transposing one, or a clone)
    t = t.t().contiguous() if transpose else t.clone()
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(t, mesh, [placement], run_check=False, shape=torch.Size(full_shape), stride=stride)


class _Style:
    """Mixin: partition a Linear from this rank's canonical blocks instead of a full tensor."""

    def __init__(self, spec: Dense, block: Callable, **kw) -> None:
        super().__init__(**kw)
        self.spec, self.block = spec, block

    def _partition_linear_fn(self, name, module, mesh):
        style = "column" if isinstance(self, ColwiseParallel) else "row"
        world, rank = mesh.size(), mesh.get_local_rank()
        units, fan_in = self.spec.units, self.spec.in_features
        for key in ("kernel", "bias", "mask"):
            tensor = getattr(module, "weight" if key == "kernel" else key, None)
            if tensor is None:
                continue
            canon = (fan_in, units) if key != "bias" else (units,)
            idx = shard_index(style, key, canon, rank, world)
            axis = split_axis(style, key)
            place = Replicate() if axis is None else Shard(axis if key == "bias" else 1 - axis)
            full = (units, fan_in) if key != "bias" else (units,)
            d = _dtensor(self.block(key, idx), mesh, place, full, transpose=key != "bias")
            if key == "mask":
                module.register_buffer("mask", d)
            else:
                module.register_parameter("weight" if key == "kernel" else "bias", nn.Parameter(d))


class _Column(_Style, ColwiseParallel):
    pass


class _Row(_Style, RowwiseParallel):
    pass


def _meta_dense(spec: Dense) -> nn.Module:
    dtype = TORCH_DTYPES[spec.dtype]
    act = None if spec.activation.name == "linear" else activation_module(spec.activation)
    if act is None and spec.mask is None:
        return nn.Linear(spec.in_features, spec.units, spec.use_bias, device="meta", dtype=dtype)
    mask = None if spec.mask is None else torch.empty((spec.units, spec.in_features), device="meta", dtype=dtype)
    return DenseLinear(spec.in_features, spec.units, spec.use_bias, activation=act, mask=mask, device="meta", dtype=dtype)


def parallel_compile(spec, block: Callable, parallel: Any, group: Any) -> nn.Module:
    """The parallelised torch module for ``spec``; ``block(position, name, index)`` gives this
    rank's canonical block of each parameter (index: a tuple of slices)."""
    mesh = _mesh(group)
    layers = spec.layers if isinstance(spec, Sequential) else (spec,)
    if any(isinstance(l, Bilinear) for l in layers):
        raise SpecError(f"parallel= shards Dense layers; Bilinear is not supported. Received: {spec!r}")
    plan = resolve_plan(spec, parallel, mesh.size())
    modules, styles = [], {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, Dense):
            # parameterless: Identity/Flatten/Activation, as the plain compile makes them
            m = activation_module(layer) if isinstance(layer, Activation) else \
                nn.Flatten() if isinstance(layer, Flatten) else nn.Identity()
            remember_spec(m, layer)
            modules.append(m)
            continue
        if layer.lazy:
            raise SpecError(f"a parallel model needs every in_features: layer {i} is lazy. Received: {layer!r}")
        m = _meta_dense(layer)
        p = plan.get(i)
        get = (lambda key, idx, i=i: block(i, key, idx))
        if p is None:  # replicated: plain tensors
            shapes = layer.param_shapes()
            full = {k: get(k, tuple(slice(0, n) for n in s)) for k, s in shapes.items()}
            m.weight = nn.Parameter(from_numpy(np.ascontiguousarray(full["kernel"].T)).clone())
            if "bias" in full:
                m.bias = nn.Parameter(from_numpy(full["bias"]).clone())
            if "mask" in full:
                m.mask = from_numpy(np.ascontiguousarray(full["mask"].T)).clone()
        elif p.style == "column":
            if p.gather_output and getattr(m, "activation", None) is not None and layer.activation.name in ("softmax", "log_softmax"):
                m.activation = _Gathered(m.activation)
            styles[str(i)] = _Column(layer, get, output_layouts=Replicate() if p.gather_output else Shard(-1))
        else:
            styles[str(i)] = _Row(layer, get, input_layouts=Shard(-1) if p.input_sharded else Replicate())
        remember_spec(m, layer)
        modules.append(m)
    model = nn.Sequential(*modules) if isinstance(spec, Sequential) else modules[0]
    if isinstance(spec, Sequential):
        parallelize_module(model, mesh, styles)
    elif styles:
        parallelize_module(model, mesh, styles["0"])
    model.__dict__[_STATE] = {"plan": plan, "mesh": mesh}
    remember_spec(model, spec)
    return model


# ------------------------------------------------------------------ verbs on a parallel model
def parallel_state(native: Any) -> dict | None:
    """{"plan", "mesh", "rank", "world_size"} of a parallel model, None for any other object."""
    state = getattr(native, "__dict__", {}).get(_STATE)
    if state is None:
        return None
    mesh = state["mesh"]
    return {**state, "rank": mesh.get_local_rank(), "world_size": mesh.size()}


def _tensors(native: nn.Module):
    """(canonical key, tensor, transposed?) of every parameter and mask."""
    spec = remembered_spec(native)
    seq = isinstance(spec, Sequential)
    modules = list(native) if seq else [native]
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Linear):
            continue
        prefix = f"{i}." if seq else ""
        yield prefix + "kernel", m.weight, True
        if m.bias is not None:
            yield prefix + "bias", m.bias, False
        if getattr(m, "mask", None) is not None:
            yield prefix + "mask", m.mask, True


def _np(t: torch.Tensor, transposed: bool) -> np.ndarray:
    a = to_numpy(t)
    return a.T if transposed else a


def parallel_get_params(native: nn.Module, local: bool = False) -> dict:
    """Full canonical params on every rank (DTensor all-gathers: collective), or with ``local``
    this rank's blocks as :class:`dense_bridge.parallel._plan.Shard` (array, index into the full)."""
    out = {}
    for key, t, tr in _tensors(native):
        if not isinstance(t, DTensor):
            a = _np(t, tr)
            out[key] = ShardView(a, tuple(slice(0, n) for n in a.shape)) if local else a
            continue
        if not local:
            out[key] = _np(t.full_tensor(), tr)
            continue
        a = _np(t.to_local(), tr)
        out[key] = ShardView(a, _local_index(t, tr))
    return out


def _local_index(t: DTensor, transposed: bool) -> tuple:
    """Where this rank's local block sits in the full canonical tensor."""
    shape = list(t.shape)
    index = [slice(0, n) for n in shape]
    for p in t.placements:
        if isinstance(p, Shard):
            step = shape[p.dim] // t.device_mesh.size()
            r = t.device_mesh.get_local_rank()
            index[p.dim] = slice(r * step, (r + 1) * step)
    return tuple(reversed(index)) if transposed else tuple(index)


def parallel_set_params(native: nn.Module, params: dict) -> None:
    """Scatter full canonical params by declaration: each rank copies its own block (no comm);
    masked weights are multiplied by their mask again (they are exactly 0 by contract)."""
    touched = set()
    with torch.no_grad():
        for key, t, tr in _tensors(native):
            if key not in params:
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            idx = _local_index(t, tr) if isinstance(t, DTensor) else tuple(slice(None) for _ in t.shape)
            src = from_numpy(np.asarray(params[key])[idx])
            local.copy_(src.t() if tr else src)
            touched.add(key.rsplit(".", 1)[0] if "." in key else "")
        spec = remembered_spec(native)
        modules = list(native) if isinstance(spec, Sequential) else [native]
        for i, m in enumerate(modules):
            mask = getattr(m, "mask", None)
            if mask is not None:
                w = m.weight.to_local() if isinstance(m.weight, DTensor) else m.weight
                w.mul_(mask.to_local() if isinstance(mask, DTensor) else mask)


def parallel_to_spec(native: nn.Module):
    """The full spec ``parallel_compile`` built the model from (DTensor modules hold no other)."""
    return remembered_spec(native)


def parallel_agree_seed(group: Any, seed: int) -> int:
    """``compile(seed=None, parallel=...)``: the seed of the mesh's rank 0 on every rank of it
    (``torch.distributed.broadcast``), so every rank keeps its block of one random model."""
    mesh = _mesh(group)
    pg = mesh.get_group()
    t = torch.tensor([seed], dtype=torch.int64, device=mesh.device_type)
    dist.broadcast(t, src=dist.get_global_rank(pg, 0), group=pg)
    return int(t.item())


def parallel_barrier(native: nn.Module) -> None:
    """Every rank of the model's mesh reaches this point (``torch.distributed.barrier``)."""
    state = native.__dict__[_STATE]
    dist.barrier(group=state["mesh"].get_group())


# ------------------------------------------------------------------ DCP (a native format)
def save_dcp(native: nn.Module, path: str) -> None:
    """``torch.distributed.checkpoint.save`` of the state dict into the directory ``path``
    (collective on a parallel model: each rank writes its own DTensor shards, over the model's
    own mesh, so a mesh over some of the world's ranks saves without the others)."""
    import torch.distributed.checkpoint as dcp

    state = parallel_state(native)
    dcp.save(native.state_dict(), checkpoint_id=path, process_group=None if state is None else state["mesh"].get_group())


#: What a DCP ``.metadata`` pickle may name: DCP's own metadata dataclasses and storage info,
#: ``torch.Size``, the layout/memory-format decoders DCP pickles, paths, plain containers. Any
#: other global (``os.system``, ``builtins.eval``, a class with a hostile ``__reduce__``) is
#: refused before it is looked up, so unpickling a downloaded directory runs none of its code.
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice", "int", "float", "str", "bytes", "bool"},
    "collections": {"OrderedDict"},
}
#: The biggest ``.metadata`` read (a real one is a few hundred bytes per tensor shard).
_DCP_METADATA_MAX = 1 << 28


def _dcp_unpickler(stream, where: str):
    import pickle

    from dense_bridge._errors import CheckpointError

    class AllowListUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if name in _DCP_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)  # the dtype globals (torch.float32, torch.bfloat16, ...)
            raise CheckpointError(f"{where} names {module}.{name}, which a DCP .metadata never holds: refused "
                                  "unread (unpickling it could run code from the file)")

        def persistent_load(self, pid):
            raise CheckpointError(f"{where} holds a persistent id, which a DCP .metadata never holds: refused unread")

    return AllowListUnpickler(stream)


def read_dcp_metadata(path: str):
    """The ``.metadata`` of the DCP directory ``path``, unpickled through the allow-list above and
    checked: every tensor it describes is stored in a regular file directly inside ``path``
    (no ``..``, no separator) at a non-negative offset. CheckpointError naming the file otherwise."""
    import io
    import os
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    from dense_bridge._errors import CheckpointError
    from dense_bridge.checkpoints._safetensors import open_readonly, read_at

    where = os.path.join(path, ".metadata")
    try:
        fd = open_readonly(where)
    except OSError as exc:
        raise CheckpointError(f"cannot read {where}: {exc.strerror or exc}") from None
    try:
        raw = read_at(fd, min(_DCP_METADATA_MAX, os.fstat(fd).st_size) + 1, 0)  # pread allocates what it is asked
    finally:
        os.close(fd)
    if len(raw) > _DCP_METADATA_MAX:
        raise CheckpointError(f"{where} is larger than {_DCP_METADATA_MAX} bytes: not a DCP .metadata")
    try:
        meta = _dcp_unpickler(io.BytesIO(raw), where).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RecursionError, MemoryError, ImportError) as exc:
        raise CheckpointError(f"{where} is not a readable DCP .metadata ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict) \
            or not isinstance(meta.storage_data, dict):
        raise CheckpointError(f"{where} is not a DCP .metadata (it holds a {type(meta).__name__})")
    for fqn, md in meta.state_dict_metadata.items():
        if not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{where}: entry {str(fqn)[:80]!r} is a {type(md).__name__}, not DCP storage metadata")
    for info in meta.storage_data.values():
        name = getattr(info, "relative_path", None)
        # DCP's storage record (filesystem._StorageInfo), the one class the unpickler admits for it
        if type(info).__name__ != "_StorageInfo" or not isinstance(name, str) or os.path.basename(name) != name \
                or name in ("", ".", "..") or "\\" in name:
            raise CheckpointError(f"{where} points at a data file outside its directory: {str(name)[:200]!r}")
        if any(type(v) is not int or v < 0 for v in (info.offset, info.length)):
            raise CheckpointError(f"{where}: data file {name!r} has a bad byte range "
                                  f"(offset {info.offset!r}, length {info.length!r})")
        if info.transform_descriptors:
            raise CheckpointError(f"{where}: data file {name!r} is stored through transforms "
                                  f"{list(info.transform_descriptors)[:4]!r}; only plain DCP data is read")
    for name in {info.relative_path for info in meta.storage_data.values()}:
        try:
            os.close(open_readonly(os.path.join(path, name)))  # a FIFO or device is refused, never opened blocking
        except OSError as exc:
            raise CheckpointError(f"cannot read {os.path.join(path, name)}: {exc.strerror or exc}") from None
    return meta


def _dcp_reader(path: str, checked):
    """DCP's own filesystem reader, handing DCP the ``.metadata`` read (and checked) first by
    :func:`read_dcp_metadata`, so a hostile one fails before DCP starts (DCP would log each
    rank's traceback)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class AllowListReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            meta = checked
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return AllowListReader(path)


def _tensor_only_planner():
    """DCP's default load planner, refusing non-tensor entries: DCP reads those with
    ``torch.load(weights_only=False)``, which would run code stored in the data file."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from dense_bridge._errors import CheckpointError

    class TensorOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise CheckpointError(f"the DCP checkpoint stores {read_item.dest_index.fqn!r} as pickled bytes, not a "
                                  "tensor: refused unread (unpickling it could run code from the file)")

    return TensorOnlyPlanner()


def load_dcp(native: nn.Module, path: str) -> None:
    """Fill ``native`` (parallel or not) from a DCP directory saved at any world size: DCP reads
    each rank's slices itself. Its ``.metadata`` goes through an allow-list unpickler and its
    non-tensor entries are refused (see ``read_dcp_metadata``): no code from the directory runs."""
    import torch.distributed.checkpoint as dcp

    from dense_bridge._errors import CheckpointError

    state = native.state_dict()
    par = parallel_state(native)
    meta = read_dcp_metadata(path)
    _check_dcp_dtypes(path, meta, state)
    reader = _dcp_reader(path, meta)
    try:
        dcp.load(state, storage_reader=reader, planner=_tensor_only_planner(),
                 process_group=None if par is None else par["mesh"].get_group())
    except CheckpointError:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException, wrapping each rank's error
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        inner = _dcp_cause(exc)
        if isinstance(inner, CheckpointError):
            raise inner from None
        text = " ".join(str(inner).split())[:500]
        raise CheckpointError(f"{path}: the DCP checkpoint does not fit this model or cannot be read "
                              f"({type(inner).__name__}: {text})") from None
    if par is None:  # DCP filled a plain model's state-dict copies; a parallel model's DTensors in place
        native.load_state_dict(state)


def _check_dcp_dtypes(path: str, meta, state: dict) -> None:
    """Each stored tensor's dtype is the model's: DCP itself would cast silently (``copy_``)."""
    from dense_bridge._errors import CheckpointError

    problems = []
    for fqn, target in state.items():
        stored = getattr(getattr(meta.state_dict_metadata.get(fqn), "properties", None), "dtype", None)
        if stored is not None and stored != target.dtype:
            problems.append(f"{fqn}: {str(stored).replace('torch.', '')} stored, "
                            f"{str(target.dtype).replace('torch.', '')} expected")
    if problems:
        raise CheckpointError(f"{path}: the DCP checkpoint's dtypes differ from the spec's ({'; '.join(problems[:8])})")


def _dcp_cause(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's ``CheckpointException`` (``failures``: rank ->
    (exception, traceback)), else ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, BaseException):
                return inner
    return exc


# ------------------------------------------------------------------ trace (db.testing.compare)
def parallel_trace(native: nn.Module, inputs, grad_out):
    """The ``trace`` verb on a parallel model (collective): every layer's output, input gradient
    and canonical parameter gradients, gathered whole (DTensor all-gathers) on every rank, so
    ``db.testing.compare`` can hold a parallel model against a single-process one."""
    from dense_bridge.registry._trace import LayerTrace, Trace

    state = native.__dict__[_STATE]
    plan, mesh = state["plan"], state["mesh"]
    spec = remembered_spec(native)
    seq = isinstance(spec, Sequential)
    layers = spec.layers if seq else (spec,)
    modules = list(native) if seq else [native]
    first = next(l for l in layers if isinstance(l, Dense))
    dtype = TORCH_DTYPES[first.dtype]
    x = from_numpy(np.asarray(inputs[0])).to(dtype).clone().requires_grad_(True)

    def whole(t, sharded):
        t = t.detach()
        if isinstance(t, DTensor):
            return t.full_tensor()
        return DTensor.from_local(t, mesh, [Shard(t.dim() - 1)], run_check=False).full_tensor() if sharded else t

    record, cur, sharded = [], x, False
    with torch.enable_grad():
        for i, (layer, m) in enumerate(zip(layers, modules)):
            p = plan.get(i)
            y = m(cur) if isinstance(m, nn.Linear) else m(cur.clone())
            in_sharded = sharded
            if p is not None and p.style == "column":
                sharded = not p.gather_output
            elif isinstance(layer, Dense) or not elementwise(layer):
                sharded = False
            params = []
            if isinstance(m, nn.Linear):
                params = [("kernel", m.weight, True)] + ([("bias", m.bias, False)] if m.bias is not None else [])
            record.append((cur, in_sharded, y, sharded, params))
            cur = y
        g = from_numpy(np.asarray(grad_out)).to(cur.dtype)
        if tuple(g.shape) != tuple(cur.shape):
            raise SpecError(f"grad_out must have the output's shape {tuple(cur.shape)}. "
                            f"Received: grad_out of shape {tuple(g.shape)}")
        wrt = [r[0] for r in record] + [t for r in record for _, t, _ in r[4]]
        grads = list(torch.autograd.grad(cur, wrt, grad_outputs=g, allow_unused=True))
    dxs, pgs = grads[:len(record)], iter(grads[len(record):])
    out = []
    for (xin, in_sh, y, y_sh, params), dx in zip(record, dxs):
        dx = torch.zeros_like(xin) if dx is None else dx
        pg = {}
        for name, t, tr in params:
            gt = next(pgs)
            gt = whole(torch.zeros_like(t) if gt is None else gt, False)
            pg[name] = to_numpy(gt.t() if tr else gt)
        out.append(LayerTrace(to_numpy(whole(y, y_sh)), (to_numpy(whole(dx, in_sh)),), pg))
    return Trace(out)
