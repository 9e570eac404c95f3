"""torch's own checkpoint files: state dicts in ``.pt``/``.pth``/``.bin`` (zip or legacy pickle) and
torch-layout ``.safetensors``; the ``file_info``/``read_file``/``write_file`` verbs.

The core sniffs the container and opens safetensors files itself (``dense_bridge.checkpoints._safetensors``,
framework-free); this module serves what it reads as canonical views named by the rules of the
model :func:`compile` builds (``file_views``: the core builds the model from them), or loads it
into a given model (``read_file``), so the native layout (``weight`` (out, in), the mask buffer
stored like the weight) is torch's own, never guessed from a shape. Pickled files are read with
``torch.load(weights_only=True)`` only: no arbitrary Python objects.
"""
from __future__ import annotations

import os
import struct
import warnings
import zipfile
from collections import OrderedDict
from typing import Callable, Mapping

import numpy as np
import torch

from dense_bridge.checkpoints._native import FileViews, layer_file_plan, planned_file_tensors
from dense_bridge._dtypes import dtype_name as canonical_dtype_name
from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import CheckpointError, DenseBridgeError, first_line
from dense_bridge.checkpoints._guard import input_path
from dense_bridge.checkpoints._safetensors import PendingTensor, SafetensorsFile, write_safetensors
from dense_bridge.activations import Activation
from dense_bridge.specs import Dense, Sequential

from ._arrays import from_numpy, to_numpy

Entries = dict  # name -> (native shape, dtype name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def read_state(path: str, container: str, files: list[SafetensorsFile] | None) -> dict[str, torch.Tensor]:
    """The file's tensors by their torch names; zip files are mapped (``mmap``), not read."""
    if files:
        # views of the mapped (copy-on-write) safetensors pages; load_state_dict copies them in
        return {n: from_numpy(f.get(n)) for f in files for n in f.tensors}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own notes about the legacy format
            with input_path(path, what="torch checkpoint", whole=container != "torch-zip") as checked:
                state = torch.load(checked, map_location="cpu", weights_only=True, mmap=container == "torch-zip")
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many types for bad files
        text = first_line(exc)
        if "Weights only load failed" in str(exc):
            text = ("it holds pickled Python objects besides tensors, which torch.load(weights_only=True) "
                    "refuses (save model.state_dict() instead of the model)")
        raise CheckpointError(f"cannot read {path} as a torch checkpoint: {text}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"cannot read {path}: it holds a {type(state).__name__}, not a state dict "
                              "(save model.state_dict())")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"cannot read {path}: not a plain state dict; entries {bad[:6]} are not named "
                              "tensors (a training checkpoint? save checkpoint['model'] or the model's "
                              "state_dict() on its own)")
    return state


def file_info(path: str, container: str, *, files: list[SafetensorsFile] | None = None
              ) -> tuple[Entries, dict[str, str]]:
    """(name -> (native shape, dtype name), string metadata) of a torch file, without a spec."""
    if files:
        from dense_bridge._dtypes import dtype_name

        return ({n: (i.shape, dtype_name(i.numpy_dtype)) for f in files for n, i in f.tensors.items()},
                dict(files[0].metadata))
    state = read_state(path, container, None)
    return {k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in state.items()}, {}


def read_file(path: str, container: str, template, *, files: list[SafetensorsFile] | None = None,
              check: Callable[[Entries, Entries], None], borrow: bool = False):
    """``template`` (a torch model built for the file's spec) holding the file's tensors.

    ``check(got, expected)`` compares the file's names/shapes/dtypes with the template's and
    raises a CheckpointError listing every difference before anything is loaded. ``borrow``:
    the caller only reads the parameters out and drops the model, so a zip file's tensors are
    assigned as they are (``assign=True``: they stay in the file's private mapping, no copy), and
    the caller may release those pages layer by layer after reading them.
    """
    if template is None:
        raise CheckpointError(f"{path}: a torch state dict needs the model's structure (spec= or like=)")
    state = read_state(path, container, files)
    expected = {k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in template.state_dict().items()}
    check({k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in state.items()}, expected)
    try:
        template.load_state_dict(state, strict=True, assign=borrow and container == "torch-zip")
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot load {path} into the torch model: {first_line(exc)}") from None
    return template


def file_views(path: str, container: str, spec, *, files: list[SafetensorsFile] | None = None,
               check: Callable[[Entries, Entries], None]):
    """Canonical views of a torch file for ``spec``, with no torch model built: a zip checkpoint
    mapped by ``torch.load(mmap=True)``, a torch-layout safetensors file mapped by the core, or a
    legacy pickle (read whole by ``torch.load``; it cannot be mapped). A load onto torch builds
    its model from these, layer by layer, as from a canonical file; a conversion to another
    framework copies each layer once (see dense_bridge/registry/_contract.py).

    Names are those ``torch.nn`` gives the model :func:`compile` builds (:func:`_plan`);
    ``check(got, expected)`` compares the file's names, shapes and dtypes with them first. None
    for a spec holding a layer those rules do not describe.
    """
    plan = _plan(spec)
    expected = planned_file_tensors(plan, spec)
    if expected is None:
        return None
    if files:
        got = {n: (i.shape, canonical_dtype_name(i.numpy_dtype)) for f in files for n, i in f.tensors.items()}
        check(got, expected)
        where = {n: f for f in files for n in f.tensors}
        return FileViews(plan, lambda name: where[name].get(name))
    state = read_state(path, container, None)  # a zip file is mapped, not read
    check({k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in state.items()}, expected)
    return FileViews(plan, lambda name: to_numpy(state[name]))


def _plan(spec) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """canonical name -> (the state-dict name, axes: canonical = native.permute(axes)) of the torch
    model :func:`compile` builds for ``spec``; None for a layer these rules do not describe.

    A Sequential is an ``nn.Sequential``: position ``i``'s tensors are ``"<i>.weight"``,
    ``"<i>.bias"`` and the ``"<i>.mask"`` buffer (a lone layer: no prefix); activations, Identity
    and Flatten hold none. ``weight`` (out, in) and the mask stored like it are the canonical
    kernel and mask transposed; a Bilinear ``weight`` (units, in1, in2) is the kernel as it is.
    """
    return layer_file_plan(spec, container="", kernel="weight", dense_axes=(1, 0), bilinear_axes=(0, 1, 2))


def _pending(state: Mapping[str, torch.Tensor]) -> dict[str, PendingTensor]:
    """Each tensor turned into numpy only when written (a zero-copy view), one at a time."""
    out = {}
    for k, v in state.items():
        probe = to_numpy(v.reshape(-1)[:0])  # dtype only: bf16 as ml_dtypes.bfloat16
        out[k] = PendingTensor(probe.dtype, tuple(v.shape), (lambda t=v: to_numpy(t.contiguous())))
    return out


def write_file(model, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``model``'s state dict into ``temp``, the temporary the core renames to ``path``.

    ``kind``: "torch-pickle" (``torch.save``, what ``.pt``/``.pth``/``.bin`` hold) or
    "safetensors" (torch names and layout; ``metadata`` rides along, "format" = "pt").
    """
    if kind == "torch-pickle":
        torch.save(model.state_dict(), temp)
    elif kind == "safetensors":
        meta = {"format": "pt", **(metadata or {})}
        with open(temp, "wb") as f:
            write_safetensors(f, _pending(model.state_dict()), meta)
    else:
        raise CheckpointError(f"cannot write {path}: torch writes .pt/.pth/.bin or .safetensors, not {kind!r}")


def file_layout(spec, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None):
    """The skeleton of a ``.pt`` file for ``spec`` written into ``temp`` by ``torch.save`` itself,
    every storage's bytes left to fill (``torch.serialization.skip_data`` over ``torch.empty``
    tensors, never touched: a sparse file, no resident memory), and where each canonical tensor
    goes (``_native_stream.FileLayout``).

    The state dict holds the names :func:`_plan` gives (``nn.Module.state_dict``'s own for the
    model :func:`compile` builds), each a fake tensor of the full size, so the file is what
    ``torch.save(model.state_dict())`` writes for the real model once filled. Storage records are
    ``data/0``, ``data/1``... in the state dict's order (torch's pickler numbers storages as it
    meets them); their offsets come from torch's own archive reader, their sizes are checked.
    ``finish`` writes each record's CRC-32 into the zip's two headers. For a torch-layout
    ``.safetensors`` ("format" = "pt", as :func:`write_file`), the header. None for layers the
    :func:`_plan` rules do not cover.
    """
    from dense_bridge.checkpoints._native_stream import FileLayout
    from dense_bridge.checkpoints._safetensors import write_header

    plan = _plan(spec)
    tensors = planned_file_tensors(plan, spec)
    if kind not in ("torch-pickle", "safetensors") or tensors is None:
        return None
    if kind == "safetensors":
        native = {name: PendingTensor(np.dtype(numpy_dtype(dtype)), shape, None) for name, (shape, dtype) in tensors.items()}
        offsets = write_header(temp, native, {"format": "pt", **(metadata or {})})
        return FileLayout({c: (offsets[name], axes) for c, (name, axes) in plan.items()})
    canonical_of = {name: c for c, (name, _) in plan.items()}
    # in the model's own order (position, then weight, bias, mask): torch numbers storages so
    state = OrderedDict()
    state._metadata = _module_versions(spec)  # type: ignore[attr-defined]
    for name in _state_order(tensors):
        shape, dtype = tensors[name]
        # never written nor read (skip_data), so never touched: address space, not resident memory
        state[name] = torch.empty(shape, dtype=from_numpy(np.zeros(0, numpy_dtype(dtype))).dtype)
    with torch.serialization.skip_data():
        torch.save(state, temp)
    reader = torch._C.PyTorchFileReader(temp)
    records = {}
    with zipfile.ZipFile(temp) as archive:
        sizes = {i.filename.split("/", 1)[1]: i for i in archive.infolist()}
    for key, name in enumerate(state):
        record = f"data/{key}"
        if record not in sizes or sizes[record].file_size != state[name].nbytes:
            return None  # not the archive this reading of torch's format expects: torch.save decides
        records[canonical_of[name]] = record
    places = {c: (reader.get_record_offset(r), plan[c][1]) for c, r in records.items()}
    del reader
    return FileLayout(places, finish=lambda crcs: _write_crcs(temp, {records[c]: v for c, v in crcs.items()}))


def _module_versions(spec) -> OrderedDict:
    """The ``_metadata`` ``state_dict`` attaches to the model :func:`compile` builds: {module path:
    {"version": its ``_version``}} for the root, each position of a Sequential and each
    activation module (a Dense's ``activation`` submodule, or a position of its own), in
    ``named_modules`` order. The Linear, Bilinear, Identity and Flatten modules keep
    ``nn.Module._version``; activation modules are built (no parameters) and asked."""
    from ._activations import activation_module

    sequential = isinstance(spec, Sequential)
    versions = OrderedDict([("", {"version": torch.nn.Module._version})])
    for i, layer in enumerate(spec.layers if sequential else [spec]):
        prefix = str(i) if sequential else ""
        if sequential:
            versions[prefix] = {"version": torch.nn.Module._version}
        if isinstance(layer, Dense) and layer.activation.name != "linear":
            at, act = (prefix + "." if prefix else "") + "activation", activation_module(layer.activation)
        elif isinstance(layer, Activation):
            at, act = prefix, activation_module(layer)
        else:
            continue
        for name, module in act.named_modules():
            path = ".".join(p for p in (at, name) if p)
            versions[path] = {"version": module._version}
    return versions


def _state_order(tensors: Mapping[str, object]) -> list[str]:
    """The state-dict names in the order ``nn.Module.state_dict`` lists them: by position, then
    parameters (weight, bias) before buffers (mask)."""
    rank = {"weight": 0, "bias": 1, "mask": 2}

    def key(name: str):
        head, _, last = name.rpartition(".")
        return (int(head) if head else 0, rank[last])

    return sorted(tensors, key=key)


def _write_crcs(path: str, crcs: Mapping[str, int]) -> None:
    """Put each record's CRC-32 into its local header and its central-directory entry (the
    fields ``skip_data`` leaves 0), so zip tools verify the filled file as torch.save's own."""
    with zipfile.ZipFile(path) as archive:
        entries = {i.filename.split("/", 1)[1]: i for i in archive.infolist()}
        start_dir = archive.start_dir
    with open(path, "r+b") as f:
        for record, crc in crcs.items():
            f.seek(entries[record].header_offset + 14)  # local file header: CRC-32 at byte 14
            f.write(struct.pack("<I", crc))
        position = start_dir
        while True:  # central directory entries: CRC-32 at byte 16; name, extra, comment lengths at 28
            f.seek(position)
            head = f.read(46)
            if len(head) < 46 or head[:4] != b"PK\x01\x02":
                break
            n_name, n_extra, n_comment = struct.unpack("<HHH", head[28:34])
            name = f.read(n_name).decode("utf-8").split("/", 1)[1]
            if name in crcs:
                f.seek(position + 16)
                f.write(struct.pack("<I", crcs[name]))
            position += 46 + n_name + n_extra + n_comment
