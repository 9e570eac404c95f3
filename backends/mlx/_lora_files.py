"""mlx-lm's LoRA adapter directories (``mlx_lm.lora`` training, ``mlx_lm.tuner.utils.load_adapters``)
as canonical adapters, and back.

Framework-free on purpose (numpy and json-shaped dicts only; no mlx, no mlx-lm): the core loads
this module without the MLX adapter's ``__init__`` (``AdapterFormat(module="_lora_files")`` in
``_manifest.py``), so an mlx-lm directory is read, checked and converted on a machine without MLX.
The core reads the files (``adapters.safetensors`` and ``adapter_config.json``) and hands their
contents to :func:`lora_from_files`; it writes what :func:`lora_to_files` returns.

mlx-lm's grammar:

- ``<path>.lora_a`` (in, r) and ``.lora_b`` (r, out), already the canonical layout, ``.m`` (out,)
  for DoRA; ``<path>`` is the module path in the mlx-lm model (``model.layers.3.self_attn.q_proj``,
  the same string as the transformers twin's).
- ``fine_tune_type`` ("lora" / "dora"; "full" is no adapter), ``num_layers`` (adapters sit in the
  LAST ``num_layers`` blocks of ``model.layers``; -1: all) and ``lora_parameters`` {``rank`` (one
  for every module), ``scale`` (absolute, one for every module, not alpha / r), ``dropout``,
  ``keys`` (module paths inside one block; absent: every linear layer)}.
"""
from __future__ import annotations

import itertools
import re

import numpy as np

from dense_bridge.adapter_kit import CheckpointError, ConversionError, file_number

_KEY = re.compile(r"^(?P<path>.+)\.(?P<part>lora_a|lora_b|m)$")
_PARTS = {"lora_a": "lora_a", "lora_b": "lora_b", "m": "lora_magnitude"}
#: a module inside block ``index`` of a model's ``layers`` stack
BLOCK = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<inner>.+)$")


# ----------------------------------------------------------------------------- reading
def lora_from_files(tensors: dict, config: dict, where: str) -> tuple[dict, dict]:
    """An mlx-lm directory's tensors and config as canonical adapters (``registry._manifest.LORA_FILE_VERBS``).

    Args:
        tensors: ``adapters.safetensors``'s tensors {key: array}.
        config: ``adapter_config.json``.
        where: the directory, for errors.

    Returns:
        ``({layer path: {"lora_a" (in, r), "lora_b" (r, out), "lora_scale" 0-d float64[, "lora_magnitude"
        (out,)]}}, {"dropout": float, "num_layers": int | None})``. What mlx-lm's ``load_adapters`` would
        refuse or silently skip (a rank other than ``lora_parameters.rank``, DoRA without ``m``, a module
        outside ``keys``) is a CheckpointError naming the key.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: adapter_config.json holds {type(config).__name__}, not an object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise CheckpointError(f"{where}: fine_tune_type {kind!r} is not an adapter (lora or dora)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: lora_parameters must be an object. Received: {params!r}"[:400])
    if "scale" not in params:
        raise CheckpointError(f"{where}: lora_parameters has no 'scale' (mlx-lm's LoRA needs it)")
    scale = file_number(params["scale"], where, "lora_parameters.scale", integer=False)
    rank = params.get("rank")
    if rank is not None:
        rank = file_number(rank, where, "lora_parameters.rank", integer=True)
    keys = params.get("keys")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise CheckpointError(f"{where}: lora_parameters.keys must be a list of module paths. Received: {keys!r}"[:400])
    num_layers = config.get("num_layers")
    if num_layers is not None:
        num_layers = file_number(num_layers, where, "num_layers", integer=True)
    layers: dict[str, dict] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise CheckpointError(f"{where}: tensor {key!r} is not a LoRA factor (lora_a, lora_b or m)")
        layers.setdefault(m["path"], {})[_PARTS[m["part"]]] = value
    out = {}
    for layer, parts in layers.items():
        for part in ("lora_a", "lora_b"):
            if part not in parts:
                raise CheckpointError(f"{where}: layer {layer!r} lacks {layer}.{part}")
            if np.ndim(parts[part]) != 2:
                raise CheckpointError(f"{where}: {layer}.{part} has shape {np.shape(parts[part])}, not 2-D")
        if (kind == "dora") != ("lora_magnitude" in parts):
            raise CheckpointError(f"{where}: fine_tune_type {kind!r} but layer {layer!r} "
                                  + ("has no m (DoRA's magnitude)" if kind == "dora" else
                                     "holds m (a DoRA magnitude mlx-lm's LoRALinear has no place for)"))
        got = (np.shape(parts["lora_a"])[1], np.shape(parts["lora_b"])[0])
        if rank is not None and got != (rank, rank):
            raise CheckpointError(f"{where}: {layer}.lora_a {np.shape(parts['lora_a'])} and .lora_b "
                                  f"{np.shape(parts['lora_b'])} have rank {got[0]}/{got[1]} but lora_parameters.rank "
                                  f"is {rank}")
        if keys is not None:
            block = BLOCK.match(layer)
            if layer not in keys and (block is None or block["inner"] not in keys):
                raise CheckpointError(f"{where}: layer {layer!r} has factors but lora_parameters.keys {keys[:8]} "
                                      f"names no module it is: mlx-lm would not adapt it")
        out[layer] = {**parts, "lora_scale": np.array(float(scale), dtype=np.float64)}
    blocks = {int(m["index"]) for p in out if (m := BLOCK.match(p))}
    if num_layers is not None and num_layers >= 0 and blocks and max(blocks) - min(blocks) + 1 > num_layers:
        raise CheckpointError(f"{where}: num_layers {num_layers} (mlx-lm adapts the last {num_layers} blocks) but the "
                              f"tensors adapt blocks {min(blocks)} to {max(blocks)}: mlx-lm would not adapt some "
                              f"of them")
    dropout = params.get("dropout", 0.0) or 0.0
    return out, {"dropout": float(file_number(dropout, where, "lora_parameters.dropout", integer=False)),
                 "num_layers": num_layers}


# ----------------------------------------------------------------------------- writing
def _pad_rank(entry: dict, rank: int) -> dict:
    """A rank-r adapter as rank ``rank`` >= r with zero columns/rows: the same update exactly."""
    a, b = np.asarray(entry["lora_a"]), np.asarray(entry["lora_b"])
    r = a.shape[1]
    if r == rank:
        return entry
    pa = np.zeros((a.shape[0], rank), dtype=a.dtype)
    pa[:, :r] = a
    pb = np.zeros((rank, b.shape[1]), dtype=b.dtype)
    pb[:r] = b
    return {**entry, "lora_a": pa, "lora_b": pb}


def block_count(paths) -> int | None:
    """The number of blocks of the ``layers`` stack the layer ``paths`` sit in (None: no stack)."""
    indices = {int(m["index"]) for p in paths if (m := BLOCK.match(p + ".x"))}
    return max(indices) + 1 if indices else None


def lora_to_files(layers: dict, extra: dict, *, num_layers: int | None = None,
                  model_paths: list | None = None) -> tuple[dict, dict, None]:
    """Canonical adapters (plain form, keyed by the model's layer paths) as mlx-lm's files.

    Args:
        layers: {layer path: {"lora_a" (in, r), "lora_b" (r, out), "lora_scale"[, "lora_magnitude"]}}.
        extra: {"dropout": float}.
        num_layers: the base model's block count; else counted from ``model_paths`` (every linear
            layer path of the model the adapters sit on).

    Returns:
        (``adapters.safetensors``'s tensors, ``adapter_config.json``, None). Ranks that differ are
        zero-padded to the largest (the same update exactly). ConversionError for what mlx-lm cannot
        hold: scales that differ, DoRA on some layers only, adapters outside the last blocks of the
        stack or not on every listed key of each of them.
    """
    if not layers:
        raise ConversionError("no adapters to write")
    scales = {float(e["lora_scale"]) for e in layers.values()}
    if len(scales) > 1:
        by = {p: float(e["lora_scale"]) for p, e in layers.items()}
        raise ConversionError(f"mlx-lm's adapter_config holds one scale for every module; these layers differ: {by}")
    dora = {("lora_magnitude" in e) for e in layers.values()}
    if len(dora) > 1:
        raise ConversionError("mlx-lm's fine_tune_type is lora or dora for every module: DoRA on some layers "
                              "only cannot be written")
    blocks, keys, stacks = set(), set(), set()
    for p in layers:
        m = BLOCK.match(p)
        if m is None:
            raise ConversionError(f"{p}: mlx-lm places adapters only inside the blocks of model.layers; this layer "
                                  f"is outside them")
        blocks.add(int(m["index"]))
        keys.add(m["inner"])
        stacks.add(m["stack"])
    if num_layers is None and model_paths is not None:
        num_layers = block_count(model_paths)
    if num_layers is None:
        raise ConversionError("mlx-lm's num_layers counts blocks from the END of the stack: give the base model's "
                              "layer count (--base-config config.json or --num-layers)")
    if max(blocks) >= num_layers:
        raise ConversionError(f"adapters on block {max(blocks)} but the base model has {num_layers} blocks")
    first = min(blocks)
    # the keys mlx-lm expects, walked lazily (a layer count from a flag or a file may be huge): the
    # first ones missing are named, and nothing of the size of the count is ever built
    expected = (f"{stack}.{i}.{k}" for i in range(first, num_layers) for k in sorted(keys) for stack in sorted(stacks))
    absent = list(itertools.islice((name for name in expected if name not in layers), 9))
    if absent:
        raise ConversionError(f"mlx-lm puts an adapter on every key {sorted(keys)} of each of the last "
                              f"{num_layers - first} blocks; these have none: {absent[:8]}"
                              f"{' ...' if len(absent) > 8 else ''}")
    rank = max(int(np.shape(e["lora_a"])[1]) for e in layers.values())
    tensors = {}
    for p, e in layers.items():
        padded = _pad_rank(e, rank)
        tensors[f"{p}.lora_a"] = padded["lora_a"]
        tensors[f"{p}.lora_b"] = padded["lora_b"]
        if "lora_magnitude" in e:
            tensors[f"{p}.m"] = np.asarray(e["lora_magnitude"])
    config = {"fine_tune_type": "dora" if dora.pop() else "lora", "num_layers": num_layers - first,
              "lora_parameters": {"rank": rank, "scale": scales.pop(), "dropout": float(extra.get("dropout", 0.0)),
                                  "keys": sorted(keys)}}
    return tensors, config, None
