"""LoRA adapter files: PEFT and mlx-lm directories read into canonical adapters and written back.

Files are read as JSON and safetensors only, through ``_safetensors`` (the one reader and
writer: a malformed file is a CheckpointError naming it), and written atomically
(``_io.AtomicFiles``): nothing in them runs. In memory an adapter set is
``{layer path: {"lora_a" (in, r), "lora_b" (r, units), "lora_scale" 0-d float64[, "lora_magnitude"]}}``
keyed by the model's layer paths (the torch module path of the base model for PEFT; MLX's dotted
attribute path for mlx-lm: the same strings for transformers/mlx-lm twins such as Llama and Qwen2).

Naming, as data:

- PEFT (``adapter_model.safetensors`` + ``adapter_config.json``): ``base_model.model.<path>.lora_A.weight``
  (r, in), ``.lora_B.weight`` (out, r), ``.lora_magnitude_vector`` (out,) with ``use_dora``; scale
  ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), per module through ``rank_pattern`` and
  ``alpha_pattern`` (PEFT matches a pattern against a module path as ``(.*\\.)?pattern$``).
- mlx-lm (``adapters.safetensors`` + ``adapter_config.json``): ``<path>.lora_a`` (in, r), ``.lora_b``
  (r, out), ``.m`` (out,) for DoRA; ``fine_tune_type`` ("lora"/"dora"), ``num_layers`` (adapters sit
  in the LAST ``num_layers`` blocks of ``model.layers``) and ``lora_parameters`` {``rank``, ``scale``
  (absolute, one for every module), ``dropout``, ``keys`` (module paths inside one block)}.
- keras-hub (``*.lora.h5``): layers by index, no alpha (scale 1); HDF5 is read and written by the
  Keras adapter (``backends/keras/_lora.py``), the core names no framework.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np

from .. import lora as _lora
from ..checkpoints._io import AtomicFiles
from ..checkpoints._safetensors import SafetensorsFile, pending, read_json_file, write_safetensors
from .._errors import CheckpointError, ConversionError, SpecError, received

__all__ = ["load_adapter", "save_adapter", "convert_adapter", "read_adapter_dir", "write_adapter_dir", "FORMATS",
           "DIRECTORY_FORMATS", "AdapterRefused"]

#: API.md's format names, the one place the core spells them (allowlisted in tests/architecture/test_architecture.py)
FORMATS = ("peft", "mlx-lm", "keras-hub")
PEFT, MLX_LM, KERAS_HUB = FORMATS
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
MLX_FILES = ("adapters.safetensors", "adapter_config.json")
#: what ``convert_adapter`` reads and writes: directory format -> the files such a directory holds
DIRECTORY_FORMATS = {PEFT: PEFT_FILES, MLX_LM: MLX_FILES}
PEFT_PREFIX = "base_model.model."
_BLOCK = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<inner>.+)$")


class AdapterRefused(ConversionError):
    """The target format cannot hold this adapter exactly (the CLI exits 2 with its message)."""


# ----------------------------------------------------------------------------- reading
def _read_json(path: str) -> dict:
    return read_json_file(path, "adapter config")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file ``path``, as in-memory copies (the file is closed after)."""
    with SafetensorsFile(path) as f:
        return {name: np.array(f.get(name)) for name in f.tensors}


def detect(path: str) -> str:
    """"peft", "mlx-lm" or "keras-hub" for an adapter directory or file."""
    p = os.fspath(path)
    if os.path.isfile(p):
        return KERAS_HUB  # the one single-file format (a .lora.h5 file, read by the model's adapter)
    if os.path.isdir(p):
        names = set(os.listdir(p))
        if PEFT_FILES[0] in names:
            return PEFT
        if MLX_FILES[0] in names:
            return MLX_LM
        pickled = sorted(n for n in names if n.startswith("adapter_model.") and n != PEFT_FILES[0])
        if pickled:
            raise CheckpointError(f"{p} holds {pickled}, a pickled adapter, which dense_bridge does not unpickle: "
                                  f"save it as safetensors (safe_serialization=True)")
    raise CheckpointError(f"{p} is not an adapter directory ({PEFT}: {list(PEFT_FILES)}; {MLX_LM}: {list(MLX_FILES)}) "
                          f"nor a {KERAS_HUB} adapter file")


def _pattern_value(patterns: dict, path: str, default: Any) -> Any:
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default


def _read_peft(path: str) -> tuple[dict, dict]:
    config = _read_json(os.path.join(path, "adapter_config.json"))
    tensors = _read_tensors(os.path.join(path, "adapter_model.safetensors"))
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("lora_bias"):
        raise CheckpointError(f"{path}: lora_bias=True (a bias update outside the low-rank form) is not supported")
    layers: dict[str, dict] = {}
    for key, value in tensors.items():
        m = re.match(r"^(?:base_model\.model\.)?(?P<path>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|"
                     r"lora_magnitude_vector)$", key)
        if m is None:
            raise CheckpointError(f"{path}: tensor {key!r} is not a LoRA factor (modules_to_save, embedding or "
                                  f"token adapters are not read)")
        part = {"lora_A.weight": "lora_a", "lora_B.weight": "lora_b", "lora_magnitude_vector": "lora_magnitude"}
        layers.setdefault(m["path"], {})[part[m["part"]]] = value
    out = {}
    for layer, parts in layers.items():
        if "lora_a" not in parts or "lora_b" not in parts:
            raise CheckpointError(f"{path}: layer {layer!r} lacks {'lora_A' if 'lora_a' not in parts else 'lora_B'}")
        r = _pattern_value(config.get("rank_pattern"), layer, config.get("r", 8))
        alpha = _pattern_value(config.get("alpha_pattern"), layer, config.get("lora_alpha", 8))
        if parts["lora_a"].shape[0] != r:
            raise CheckpointError(f"{path}: {layer} lora_A has rank {parts['lora_a'].shape[0]} but the config says r={r}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        entry = {"lora_a": np.ascontiguousarray(parts["lora_a"].T), "lora_b": np.ascontiguousarray(parts["lora_b"].T),
                 "lora_scale": np.array(scale, dtype=np.float64)}
        if "lora_magnitude" in parts:
            entry["lora_magnitude"] = parts["lora_magnitude"]
        out[layer] = entry
    return out, {"dropout": float(config.get("lora_dropout", 0.0) or 0.0)}


def _read_mlx(path: str) -> tuple[dict, dict]:
    config = _read_json(os.path.join(path, "adapter_config.json"))
    tensors = _read_tensors(os.path.join(path, "adapters.safetensors"))
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise CheckpointError(f"{path}: fine_tune_type {kind!r} is not an adapter (lora or dora)")
    params = config.get("lora_parameters") or {}
    if "scale" not in params:
        raise CheckpointError(f"{path}: lora_parameters has no 'scale' ({MLX_LM}'s LoRA needs it)")
    layers: dict[str, dict] = {}
    for key, value in tensors.items():
        m = re.match(r"^(?P<path>.+)\.(?P<part>lora_a|lora_b|m)$", key)
        if m is None:
            raise CheckpointError(f"{path}: tensor {key!r} is not a LoRA factor")
        part = {"lora_a": "lora_a", "lora_b": "lora_b", "m": "lora_magnitude"}[m["part"]]
        layers.setdefault(m["path"], {})[part] = value
    out = {}
    for layer, parts in layers.items():
        if "lora_a" not in parts or "lora_b" not in parts:
            raise CheckpointError(f"{path}: layer {layer!r} lacks {'lora_a' if 'lora_a' not in parts else 'lora_b'}")
        out[layer] = {**parts, "lora_scale": np.array(float(params["scale"]), dtype=np.float64)}
    return out, {"dropout": float(params.get("dropout", 0.0) or 0.0), "num_layers": config.get("num_layers")}


def read_adapter_dir(path: str) -> tuple[str, dict, dict]:
    """(format, {layer path: canonical adapter}, extras such as dropout) of a PEFT or mlx-lm directory."""
    fmt = detect(path)
    if fmt == KERAS_HUB:
        raise CheckpointError(f"{path}: a {KERAS_HUB} file names layers by index; it is read into a model "
                              f"(db.load_adapter(path, model))")
    layers, extra = _read_peft(path) if fmt == PEFT else _read_mlx(path)
    return fmt, layers, extra


# ----------------------------------------------------------------------------- writing
def _write_files(path: str, weights: str, tensors: dict, config: dict, metadata: dict | None = None) -> None:
    """The adapter directory ``path``: ``weights`` (safetensors of ``tensors``, string ``metadata``)
    and ``adapter_config.json``, committed together (``AtomicFiles``): a reader sees the old pair
    or the new one."""
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, weights)
    with AtomicFiles(target) as tx:
        with open(tx.temp_for(target), "wb") as f:
            write_safetensors(f, {k: pending(np.ascontiguousarray(v)) for k, v in tensors.items()}, metadata)
        config_path = os.path.join(path, "adapter_config.json")
        with open(tx.temp_for(config_path), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def _pad_rank(entry: dict, rank: int) -> dict:
    """A rank-r adapter as rank ``rank`` >= r with zero columns/rows: the same update exactly."""
    a, b = _lora.plain_factors(entry)
    r = a.shape[1]
    if r == rank:
        return {**entry, "lora_a": a, "lora_b": b}
    pa = np.zeros((a.shape[0], rank), dtype=a.dtype)
    pa[:, :r] = a
    pb = np.zeros((rank, b.shape[1]), dtype=b.dtype)
    pb[:r] = b
    return {**entry, "lora_a": pa, "lora_b": pb}


def _write_peft(layers: dict, path: str, extra: dict) -> None:
    ranks = {p: int(_lora.plain_factors(e)[0].shape[1]) for p, e in layers.items()}
    dora = {("lora_magnitude" in e) for e in layers.values()}
    if len(dora) > 1:
        raise AdapterRefused("PEFT's use_dora is one flag for every module: DoRA on some layers only "
                             f"({sorted(p for p, e in layers.items() if 'lora_magnitude' in e)}) cannot be written")
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    rank_pattern, alpha_pattern, alphas = {}, {}, {}
    for p, e in layers.items():
        alpha = float(e["lora_scale"]) * ranks[p]
        if alpha / ranks[p] != float(e["lora_scale"]):
            raise AdapterRefused(f"{p}: lora_scale {float(e['lora_scale'])!r} is not exactly lora_alpha / r for any "
                                 f"lora_alpha at r={ranks[p]}: PEFT cannot hold it")
        alphas[p] = int(alpha) if alpha.is_integer() else alpha
        if ranks[p] != r:
            rank_pattern[re.escape(p)] = ranks[p]
    lora_alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    for p, a in alphas.items():
        if a != lora_alpha:
            alpha_pattern[re.escape(p)] = a
    tensors = {}
    for p, e in layers.items():
        a, b = _lora.plain_factors(e)
        tensors[f"{PEFT_PREFIX}{p}.lora_A.weight"] = a.T
        tensors[f"{PEFT_PREFIX}{p}.lora_B.weight"] = b.T
        if "lora_magnitude" in e:
            tensors[f"{PEFT_PREFIX}{p}.lora_magnitude_vector"] = np.asarray(e["lora_magnitude"])
    targets = sorted({p.rsplit(".", 1)[-1] for p in layers})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "use_rslora": False,
              "use_dora": bool(dora.pop()) if dora else False, "target_modules": targets,
              "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
              "lora_dropout": float(extra.get("dropout", 0.0)), "fan_in_fan_out": False, "bias": "none",
              "lora_bias": False, "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
              "init_lora_weights": True, "modules_to_save": None}
    _write_files(path, PEFT_FILES[0], tensors, config, {"format": "pt"})


def _write_mlx(layers: dict, path: str, extra: dict, num_layers_total: int | None) -> None:
    if not layers:
        raise AdapterRefused("no adapters to write")
    scales = {float(e["lora_scale"]) for e in layers.values()}
    if len(scales) > 1:
        by = {p: float(e["lora_scale"]) for p, e in layers.items()}
        raise AdapterRefused(f"{MLX_LM}'s adapter_config holds one scale for every module; these layers differ: {by}")
    dora = {("lora_magnitude" in e) for e in layers.values()}
    if len(dora) > 1:
        raise AdapterRefused(f"{MLX_LM}'s fine_tune_type is lora or dora for every module: DoRA on some layers "
                             f"only cannot be written")
    blocks, keys = set(), set()
    for p in layers:
        m = _BLOCK.match(p)
        if m is None:
            raise AdapterRefused(f"{p}: {MLX_LM} places adapters only inside the blocks of model.layers; this layer "
                                 f"is outside them")
        blocks.add(int(m["index"]))
        keys.add(m["inner"])
    if num_layers_total is None:
        raise AdapterRefused(f"{MLX_LM}'s num_layers counts blocks from the END of the stack: give the base model's "
                             f"layer count (--base-config config.json or --num-layers)")
    first = min(blocks)
    num_layers = num_layers_total - first
    expected = {f"{stack}.{i}.{k}" for i in range(first, num_layers_total) for k in keys
                for stack in {_BLOCK.match(p)["stack"] for p in layers}}
    absent = sorted(expected - set(layers))
    if max(blocks) >= num_layers_total:
        raise AdapterRefused(f"adapters on block {max(blocks)} but the base model has {num_layers_total} blocks")
    if absent:
        raise AdapterRefused(f"{MLX_LM} puts an adapter on every key {sorted(keys)} of each of the last {num_layers} "
                             f"blocks; these have none: {absent[:8]}{' ...' if len(absent) > 8 else ''}")
    rank = max(int(_lora.plain_factors(e)[0].shape[1]) for e in layers.values())
    tensors = {}
    for p, e in layers.items():
        padded = _pad_rank(e, rank)  # per-module ranks fit by zero-padding: the same update exactly
        tensors[f"{p}.lora_a"] = padded["lora_a"]
        tensors[f"{p}.lora_b"] = padded["lora_b"]
        if "lora_magnitude" in e:
            tensors[f"{p}.m"] = np.asarray(e["lora_magnitude"])
    config = {"fine_tune_type": "dora" if dora.pop() else "lora", "num_layers": num_layers,
              "lora_parameters": {"rank": rank, "scale": scales.pop(), "dropout": float(extra.get("dropout", 0.0)),
                                  "keys": sorted(keys)}}
    _write_files(path, MLX_FILES[0], tensors, config)


def write_adapter_dir(layers: dict, path: str, fmt: str, *, extra: dict | None = None,
                      num_layers: int | None = None) -> None:
    """Write canonical adapters ``{layer path: adapter}`` as a ``fmt`` ("peft"/"mlx-lm") directory."""
    extra = extra or {}
    if fmt == PEFT:
        _write_peft(layers, os.fspath(path), extra)
    elif fmt == MLX_LM:
        _write_mlx(layers, os.fspath(path), extra, num_layers)
    else:
        raise AdapterRefused(f"format {fmt!r}: a directory conversion writes {PEFT!r} or {MLX_LM!r} ({KERAS_HUB} "
                             f"files name layers by their index in a model: db.save_adapter(model, ...))")


def convert_adapter(src: str, output: str, *, to: str, num_layers: int | None = None) -> dict:
    """Convert the adapter directory ``src`` (PEFT or mlx-lm) to format ``to`` in ``output``, with
    no model loaded: read whole, written into a temporary sibling directory, then renamed, so
    a refusal (``AdapterRefused``) or a failure leaves no partial ``output``.

    ``output`` must not exist or be an empty directory. ``num_layers``: the base model's block
    count (mlx-lm counts adapted blocks from the end of the stack). Returns a summary
    ``{"src", "from", "to", "output", "layers"}``.
    """
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise CheckpointError(f"-o {output} exists and is not an empty directory")
    fmt, layers, extra = read_adapter_dir(src)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    temp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        write_adapter_dir(layers, temp, to, extra=extra, num_layers=num_layers)
        if os.path.isdir(output):
            os.rmdir(output)
        os.replace(temp, output)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return {"src": src, "from": fmt, "to": to, "output": output, "layers": len(layers)}


# ----------------------------------------------------------------------------- models
def _check_format(fmt: Any) -> str:
    if fmt not in FORMATS:
        raise SpecError(f"format must be one of {list(FORMATS)}. {received('format', fmt)}")
    return fmt


def model_adapters(model: Any) -> dict[str, dict]:
    """{layer path: canonical adapter} of every adapter-wrapped linear layer of ``model``."""
    from ..models import walk

    out = {}
    for e in walk(model):
        if e.kind == "linear":
            found = _lora.lora_of(e.layer)
            if found is not None:
                out[e.path] = {k: np.array(v, copy=True) for k, v in found.items()}
    return out


def _block_count(model: Any) -> int | None:
    from ..models import walk

    indices = {int(m["index"]) for e in walk(model) if (m := _BLOCK.match(e.path + ".x"))}
    return max(indices) + 1 if indices else None


def save_adapter(model: Any, path: Any, *, format: str) -> str:
    """Write every adapter of ``model`` as a PEFT or mlx-lm directory, or a keras-hub ``.lora.h5`` file.

    Layer paths are the model's own (torch module paths, MLX attribute paths). Raises
    ConversionError naming what the format cannot hold (per-module scales in mlx-lm, DoRA on some
    layers only, layers outside the last blocks of the stack for mlx-lm). Returns ``path``.
    """
    fmt = _check_format(format)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path. {received('path', path)}")
    if fmt == KERAS_HUB:
        from ..registry._backends import adapter_for

        verb = getattr(adapter_for(model, "model"), "save_lora_h5", None)
        if verb is None:
            raise ConversionError(f"format {KERAS_HUB!r} is written by the adapter of the framework that reads it; "
                                  f"{type(model).__name__}'s has no save_lora_h5 verb")
        verb(model, os.fspath(path))
        return os.fspath(path)
    layers = model_adapters(model)
    if not layers:
        raise ConversionError(f"model holds no LoRA adapters to save. {received('model', model)}"[:400])
    write_adapter_dir(layers, path, fmt, num_layers=_block_count(model))
    return os.fspath(path)


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


def load_adapter(path: Any, model: Any, *, mapping: Any = None, allow_rounding: bool = False) -> dict:
    """Attach and load the adapters of a PEFT or mlx-lm directory (or keras-hub ``.lora.h5``) into ``model``.

    Each file layer path goes through ``mapping`` (None: the same path; a dict, a list of
    ``(regex, replacement)`` rules or a callable, as in ``transfer``) to a linear layer of
    ``model``; a layer without an adapter gets the framework's own adapter class. Everything is
    checked before anything is attached. Returns ``{model layer path: rank}``.
    """
    from ..registry._backends import adapter_for
    from ..models import walk

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path. {received('path', path)}")
    p = os.fspath(path)
    fmt = detect(p)
    adapter = adapter_for(model, "model")
    if fmt == KERAS_HUB:
        verb = getattr(adapter, "load_lora_h5", None)
        if verb is None:
            raise ConversionError(f"{p}: a {KERAS_HUB} file loads through the adapter of the framework that reads it; "
                                  f"{type(model).__name__}'s has no load_lora_h5 verb")
        return verb(model, p)
    _, layers, _ = read_adapter_dir(p)
    entries = {e.path: e for e in walk(model) if e.kind == "linear"}
    problems, plan = [], []
    for file_path, entry in layers.items():
        target = _map(mapping, file_path)
        if target is None or target not in entries:
            problems.append(f"{file_path!r} -> {target!r}: no such linear layer in model")
            continue
        e = entries[target]
        own, have = _lora.split(_lora.params_of(e.layer))
        heads = adapter.lora_heads(e.layer) if _lora.has_lora_verbs(adapter) else None
        problems += _lora.check(entry, tuple(np.shape(own["kernel"])), f"{file_path!r}")
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
