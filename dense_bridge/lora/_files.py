"""LoRA adapter files, the neutral flow: ``db.load_adapter``, ``db.save_adapter``, ``db.convert_adapter``.

In memory an adapter set is ``{layer path: {"lora_a" (in, r), "lora_b" (r, units), "lora_scale" 0-d
float64[, "lora_magnitude" (units,)]}}`` keyed by the layer paths of the BASE model (a model a
framework's adapter wrapper holds is reached through the adapter's ``lora_root`` verb: its path
prefix is taken off on saving and put back on loading, so a wrapped model and its base save the
same files).

Every file format belongs to the backend of the framework whose ecosystem writes it and is
declared in that backend's manifest (``registry._manifest.AdapterFormat``): its name, its files,
and either a framework-free module converting a directory's contents (one safetensors weights
file and one JSON config, read and written here: nothing in them runs) to and from canonical
adapters, or, for a file naming layers of one model, the adapter's own load/save verbs. Here are
only the flow, the checks every format shares (factor shapes, finite values) and the atomic
writes (``_io.AtomicFiles``; a converted directory is built aside and renamed into place).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

from .. import lora as _lora
from ..checkpoints._io import AtomicFiles
from ..checkpoints._safetensors import SafetensorsFile, pending, read_json_file, write_safetensors
from .._errors import CheckpointError, ConversionError, SpecError, check_flag, received
from ..registry._manifest import LORA_FILE_VERBS, AdapterFormat

__all__ = ["load_adapter", "save_adapter", "convert_adapter", "read_adapter_dir", "write_adapter_dir",
           "adapter_formats", "AdapterRefused"]


class AdapterRefused(ConversionError):
    """The target format cannot hold this adapter exactly (the CLI exits 2 with its message)."""


# ----------------------------------------------------------------------------- the declared formats
def adapter_formats() -> dict[str, tuple[str, AdapterFormat]]:
    """{format name: (backend name, its declaration)} over every registered backend's manifest."""
    from ..registry._backends import backends

    out: dict[str, tuple[str, AdapterFormat]] = {}
    for name, info in backends().items():
        for fmt in info.manifest.adapter_formats:
            out.setdefault(fmt.name, (name, fmt))
    return out


def __getattr__(name: str):
    if name == "DIRECTORY_FORMATS":  # db.ADAPTER_DIRECTORY_FORMATS: format name -> the files its directory holds
        return {n: f.files for n, (_, f) in adapter_formats().items() if f.files}
    if name == "FORMATS":
        return tuple(adapter_formats())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MODULES: dict[tuple[str, str], Any] = {}


def _format_module(backend: str, fmt: AdapterFormat):
    """The module ``fmt.module`` of backend ``backend``'s package, loaded from its file without running
    the package's ``__init__`` (which imports the framework) unless the package is imported already."""
    from ..registry._backends import backends

    key = (backend, fmt.module)
    if key in _MODULES:
        return _MODULES[key]
    package = backends()[backend].module_name
    full = f"{package}.{fmt.module}"
    mod = sys.modules.get(full)
    if mod is None:
        spec = importlib.util.find_spec(package)  # imports the parent packages only
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((p for p in (os.path.join(loc, f"{fmt.module}.py") for loc in locations) if os.path.isfile(p)),
                    None)
        if path is None:
            raise ConversionError(f"the {backend!r} backend declares the adapter format {fmt.name!r} in module "
                                  f"{fmt.module!r}, which {package} does not have")
        spec = importlib.util.spec_from_file_location(full, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # kept out of sys.modules, as the manifests are
    missing = [v for v in LORA_FILE_VERBS if not callable(getattr(mod, v, None))]
    if missing:
        raise ConversionError(f"{full} (adapter format {fmt.name!r}) lacks {missing}")
    _MODULES[key] = mod
    return mod


def _format(name: Any) -> tuple[str, AdapterFormat]:
    found = adapter_formats()
    if not isinstance(name, str) or name not in found:
        raise SpecError(f"format must be one of {list(found)}. {received('format', name)}")
    return found[name]


def detect(path: str) -> tuple[str, str, AdapterFormat]:
    """(format name, backend, declaration) of an adapter directory or single adapter file."""
    p = os.fspath(path)
    found = adapter_formats()
    if os.path.isfile(p):
        for name, (backend, fmt) in found.items():
            if fmt.suffix and p.lower().endswith(fmt.suffix):
                return name, backend, fmt
    elif os.path.isdir(p):
        names = frozenset(os.listdir(p))
        hits = [(n, b, f) for n, (b, f) in found.items() if f.files and f.files[0] in names]
        if len(hits) > 1:
            raise CheckpointError(f"{p} holds the files of several adapter formats: "
                                  f"{ {n: f.files[0] for n, _, f in hits} }; keep one per directory")
        if hits:
            return hits[0]
        for n, (_, f) in found.items():
            why = f.refuse(names) if f.refuse is not None else None
            if why:
                raise CheckpointError(f"{p}: {why}")
    dirs = "; ".join(f"{n}: {list(f.files)}" for n, (_, f) in found.items() if f.files)
    files = ", ".join(f"{n}: *{f.suffix}" for n, (_, f) in found.items() if f.suffix)
    raise CheckpointError(f"{p} is not an adapter directory ({dirs}) nor an adapter file ({files})")


# ----------------------------------------------------------------------------- shared checks
def check_layers(layers: dict, where: str, *, allow_nonfinite: bool = False, error: type = CheckpointError) -> None:
    """Every adapter of ``layers`` (plain or per-head form) has 2-D factors of one rank (>= 1) that
    agree, a 0-d scale, a magnitude of ``units`` values where it has one, and (unless
    ``allow_nonfinite``) finite factors, scale and magnitude; else ``error`` naming ``where``, the
    layer and the key."""
    problems = []
    for layer, entry in layers.items():
        missing = [k for k in ("lora_a", "lora_b", "lora_scale") if k not in entry]
        if missing:
            problems.append(f"layer {layer!r}: adapter keys missing: {missing}")
            continue
        a, b = _lora.plain_factors(entry)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or a.shape[1] < 1:
            problems.append(f"layer {layer!r}: lora_a {np.shape(entry['lora_a'])} and lora_b "
                            f"{np.shape(entry['lora_b'])} are not factors of one rank (in, r) @ (r, units)")
            continue
        if np.shape(entry["lora_scale"]) != ():
            problems.append(f"layer {layer!r}: lora_scale must be 0-d, received shape {np.shape(entry['lora_scale'])}")
        if "lora_magnitude" in entry and np.shape(entry["lora_magnitude"]) != (b.shape[1],):
            problems.append(f"layer {layer!r}: lora_magnitude {np.shape(entry['lora_magnitude'])} does not fit "
                            f"{b.shape[1]} units")
        if not allow_nonfinite:
            for key, value in entry.items():
                v = np.asarray(value)
                if v.dtype.kind in "fc" or v.dtype.kind == "V" or v.dtype.name == "bfloat16":
                    bad = int(np.size(v) - np.count_nonzero(np.isfinite(v.astype(np.float64))))
                    if bad:
                        problems.append(f"layer {layer!r}: {key} holds {bad} NaN/Inf value(s)"
                                        + (f" ({float(v)!r})" if v.ndim == 0 else ""))
    if problems:
        raise error(f"{where}: " + ("\n  - ".join([""] + problems) if len(problems) > 1 else problems[0])
                    + ("\n(allow_nonfinite=True accepts NaN/Inf values)" if any("NaN" in p for p in problems) else ""))


# ----------------------------------------------------------------------------- directories
def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file ``path``, as in-memory copies (the file is closed after)."""
    with SafetensorsFile(path) as f:
        return {name: np.array(f.get(name)) for name in f.tensors}


def read_adapter_dir(path: str, *, allow_nonfinite: bool = False) -> tuple[str, dict, dict]:
    """(format name, {layer path: canonical adapter}, extras such as dropout) of an adapter directory.

    The directory's weights and config are read here (safetensors and JSON only) and turned into
    canonical adapters by the format's module (``lora_from_files``), which checks the config against
    the tensors; then every adapter is checked (:func:`check_layers`)."""
    p = os.fspath(path)
    name, backend, fmt = detect(p)
    if not fmt.files:
        raise CheckpointError(f"{p}: a {name} file names layers of one model: it is read into a model "
                              f"(db.load_adapter(path, model))")
    module = _format_module(backend, fmt)
    config = read_json_file(os.path.join(p, fmt.files[1]), "adapter config")
    tensors = _read_tensors(os.path.join(p, fmt.files[0]))
    layers, extra = module.lora_from_files(tensors, config, p)
    check_layers(layers, p, allow_nonfinite=allow_nonfinite)
    return name, layers, extra


def _refuse_foreign(path: str, name: str, fmt: AdapterFormat) -> None:
    """Writing ``fmt``'s files into ``path`` must not overwrite another adapter's (two formats share
    a config file name): a directory holding one of ``fmt``'s files but not its weights file is
    someone else's."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file: a {name} adapter is a directory ({' + '.join(fmt.files)})")
    if not os.path.isdir(path):
        return
    names = set(os.listdir(path))
    clash = sorted(f for f in fmt.files if f in names)
    if clash and fmt.files[0] not in names:
        raise CheckpointError(f"{path} already holds {clash} of another adapter (no {fmt.files[0]}): writing a {name} "
                              f"adapter would overwrite {os.path.join(path, clash[0])}; choose another directory")


def _write_files(path: str, files: tuple[str, ...], tensors: dict, config: dict, metadata: dict | None) -> None:
    """The adapter directory ``path``: ``files[0]`` (safetensors of ``tensors``, string ``metadata``)
    and ``files[1]`` (``config`` as JSON), committed together (``AtomicFiles``): a reader sees the
    old pair or the new one."""
    import json

    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, files[0])
    with AtomicFiles(target) as tx:
        with open(tx.temp_for(target), "wb") as f:
            write_safetensors(f, {k: pending(np.ascontiguousarray(v)) for k, v in tensors.items()}, metadata)
        config_path = os.path.join(path, files[1])
        with open(tx.temp_for(config_path), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def write_adapter_dir(layers: dict, path: str, fmt: str, *, extra: dict | None = None, num_layers: int | None = None,
                      model_paths: list | None = None, allow_nonfinite: bool = False) -> None:
    """Write canonical adapters ``{base layer path: adapter}`` as a ``fmt`` directory.

    ``num_layers``: the base model's block count where the format needs it; ``model_paths``: every
    linear layer path of the base model, when there is one. AdapterRefused names what the format
    cannot hold; nothing is written then."""
    p = os.fspath(path)
    found = adapter_formats()
    entry = found.get(fmt) if isinstance(fmt, str) else None
    if entry is None or not entry[1].files:
        dirs = [n for n, (_, f) in found.items() if f.files]
        raise AdapterRefused(f"format {fmt!r}: a directory is written as one of {dirs} (a single-file format names "
                             f"layers by their place in a model: db.save_adapter(model, ...))")
    backend, declared = entry
    check_layers(layers, p, allow_nonfinite=allow_nonfinite, error=ConversionError)
    plain = {}
    for layer, e in layers.items():
        a, b = _lora.plain_factors(e)
        plain[layer] = {**e, "lora_a": a, "lora_b": b}
    try:
        tensors, config, metadata = _format_module(backend, declared).lora_to_files(
            plain, extra or {}, num_layers=num_layers, model_paths=model_paths)
    except AdapterRefused:
        raise
    except ConversionError as exc:
        raise AdapterRefused(str(exc)) from None
    _refuse_foreign(p, fmt, declared)
    _write_files(p, declared.files, tensors, config, metadata)


def convert_adapter(src: str, output: str, *, to: str, num_layers: int | None = None,
                    allow_nonfinite: bool = False) -> dict:
    """Convert the adapter directory ``src`` to the directory format ``to`` in ``output``, with no
    model loaded: read whole, written into a temporary sibling directory, then renamed, so a
    refusal (``AdapterRefused``) or a failure leaves no partial ``output``.

    Args:
        src: an adapter directory (``db.ADAPTER_DIRECTORY_FORMATS`` names the formats and their files).
        output: must not exist or be an empty directory.
        to: the target format's name.
        num_layers: the base model's block count (a format counting adapted blocks from the end needs it).
        allow_nonfinite: accept NaN/Inf factors, scales and magnitudes.

    Returns:
        ``{"src", "from", "to", "output", "layers"}``.
    """
    check_flag("allow_nonfinite", allow_nonfinite)
    _format(to)
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise CheckpointError(f"-o {output} exists and is not an empty directory")
    fmt, layers, extra = read_adapter_dir(src, allow_nonfinite=allow_nonfinite)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    temp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        write_adapter_dir(layers, temp, to, extra=extra, num_layers=num_layers, allow_nonfinite=allow_nonfinite)
        if os.path.isdir(output):
            os.rmdir(output)
        os.replace(temp, output)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return {"src": src, "from": fmt, "to": to, "output": output, "layers": len(layers)}


# ----------------------------------------------------------------------------- models
def _root(adapter: Any, model: Any) -> str:
    """The path prefix under which ``model`` (a framework's adapter wrapper) holds its base model."""
    verb = getattr(adapter, "lora_root", None)
    return verb(model) if verb is not None else ""


def _base_entries(model: Any, adapter: Any) -> tuple[str, dict]:
    """(the wrapper's path prefix, {base model path: walk entry} of every linear layer of ``model``)."""
    from ..models import walk

    root = _root(adapter, model)
    return root, {e.path[len(root):]: e for e in walk(model) if e.kind == "linear" and e.path.startswith(root)}


def model_adapters(model: Any) -> dict[str, dict]:
    """{base model path: canonical adapter} of every adapter-wrapped linear layer of ``model``."""
    from ..registry._backends import adapter_for

    _, entries = _base_entries(model, adapter_for(model, "model"))
    out = {}
    for path, e in entries.items():
        found = _lora.lora_of(e.layer)
        if found is not None:
            out[path] = {k: np.array(v, copy=True) for k, v in found.items()}
    return out


def _check_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path. {received('path', path)}")
    return os.fspath(path)


def save_adapter(model: Any, path: Any, *, format: str, allow_nonfinite: bool = False) -> str:
    """Write every adapter of ``model`` as adapter files of ``format`` (``db.ADAPTER_DIRECTORY_FORMATS``
    for directories; a single-file format is written by the model's framework adapter).

    Layer paths are the base model's (a wrapper's prefix, ``lora_root``, is taken off). Raises
    ConversionError naming what the format cannot hold, and for NaN/Inf values unless
    ``allow_nonfinite``. Returns ``path``.
    """
    from ..registry._backends import adapter_for

    name, (backend, fmt) = format, _format(format)
    p = _check_path(path)
    check_flag("allow_nonfinite", allow_nonfinite)
    adapter = adapter_for(model, "model")
    if not fmt.files:
        verb = getattr(adapter, fmt.save_verb or "", None)
        if verb is None:
            raise ConversionError(f"format {name!r} is written by the adapter of the framework that reads it "
                                  f"({backend}); {type(model).__name__}'s has no {fmt.save_verb} verb")
        verb(model, p, allow_nonfinite=allow_nonfinite)
        return p
    layers = model_adapters(model)
    if not layers:
        raise ConversionError(f"model holds no LoRA adapters to save. {received('model', model)}"[:400])
    _, entries = _base_entries(model, adapter)
    write_adapter_dir(layers, p, name, model_paths=list(entries), allow_nonfinite=allow_nonfinite)
    return p


def _map(mapping: Any, path: str) -> str | None:
    if mapping is None:
        return path
    if isinstance(mapping, dict):
        return mapping.get(path)
    if callable(mapping):
        return mapping(path)
    for pattern, repl in mapping:
        m = re.fullmatch(pattern, path)
        if m is not None:
            return m.expand(repl)
    return None


def load_adapter(path: Any, model: Any, *, mapping: Any = None, allow_rounding: bool = False,
                 allow_nonfinite: bool = False) -> dict:
    """Attach and load the adapters of an adapter directory (or single adapter file) into ``model``.

    Each file layer path goes through ``mapping`` (None: the same path; a dict, a list of
    ``(regex, replacement)`` rules or a callable, as in ``transfer``) to a linear layer of the base
    model (a wrapper's prefix, ``lora_root``, is put back); a layer without an adapter gets the
    framework's own adapter class. Everything is checked before anything is attached; NaN/Inf
    values are refused unless ``allow_nonfinite``. Returns ``{model layer path: rank}``.
    """
    from ..registry._backends import adapter_for

    p = _check_path(path)
    check_flag("allow_nonfinite", allow_nonfinite)
    name, backend, fmt = detect(p)
    adapter = adapter_for(model, "model")
    if not fmt.files:
        verb = getattr(adapter, fmt.load_verb or "", None)
        if verb is None:
            raise ConversionError(f"{p}: a {name} file loads through the adapter of the framework that reads it "
                                  f"({backend}); {type(model).__name__}'s has no {fmt.load_verb} verb")
        return verb(model, p, allow_nonfinite=allow_nonfinite)
    _, layers, _ = read_adapter_dir(p, allow_nonfinite=allow_nonfinite)
    _, entries = _base_entries(model, adapter)
    problems, plan, targets = [], [], {}
    for file_path, entry in layers.items():
        target = _map(mapping, file_path)
        if target is None or target not in entries:
            problems.append(f"{file_path!r} -> {target!r}: no such linear layer in model")
            continue
        if target in targets:
            problems.append(f"{file_path!r} and {targets[target]!r} both map onto {target!r}")
            continue
        targets[target] = file_path
        e = entries[target]
        own, have = _lora.split(_lora.params_of(e.layer))
        heads = adapter.lora_heads(e.layer) if _lora.has_lora_verbs(adapter) else None
        found = _lora.check(entry, tuple(np.shape(own["kernel"])), f"{file_path!r}")
        problems += [x for x in found if not (allow_nonfinite and x.endswith("holds NaN or Inf"))]
        if "lora_magnitude" in entry and _lora.has_lora_verbs(adapter) and not adapter.lora_dora():
            problems.append(f"{file_path!r}: a DoRA adapter, and the model's framework has no DoRA adapter class")
        moved = _lora.to_form(entry, heads)
        if have and any(np.shape(have.get(k)) != np.shape(v) for k, v in moved.items()):
            problems.append(f"{target!r}: the model's adapter {({k: np.shape(v) for k, v in have.items()})} does not "
                            f"fit the file's {({k: np.shape(v) for k, v in moved.items()})}")
        dtype = np.asarray(own["kernel"]).dtype
        plan.append((e, {k: (np.asarray(v, np.float64) if k == "lora_scale" else np.asarray(v).astype(dtype))
                         for k, v in moved.items()}, bool(have)))
    if not _lora.has_lora_verbs(adapter):
        problems.append(f"the {type(model).__name__} model's framework has no adapter class: merge the adapter instead")
    if problems:
        raise ConversionError(f"cannot load adapter {p} (nothing was attached):\n  - " + "\n  - ".join(problems))
    out = {}
    with _lora.rounding_allowed(allow_rounding):
        for e, moved, has in plan:
            layer = e.layer
            if not has:
                layer = adapter.attach_lora(model, e.path, layer, rank=int(np.shape(moved["lora_a"])[-1]),
                                            dora="lora_magnitude" in moved)
            _lora.write_params(adapter, layer, {}, moved)
            out[e.path] = int(np.shape(moved["lora_a"])[-1])
    return out
