"""PEFT's LoRA adapter directories (``PeftModel.save_pretrained``) as canonical adapters, and back.

Framework-free on purpose (numpy, json-shaped dicts and ``re`` only; no torch, no peft): the core
loads this module without the torch adapter's ``__init__`` (``AdapterFormat(module="_lora_files")``
in ``_manifest.py``), so a PEFT directory is read, checked and converted where torch is absent.
The core reads the files (``adapter_model.safetensors`` and ``adapter_config.json``) and hands
their contents to :func:`lora_from_files`; it writes what :func:`lora_to_files` returns.

PEFT's grammar, as this module reads and writes it:

- ``base_model.model.<path>.lora_A.weight`` (r, in), ``.lora_B.weight`` (out, r) (torch's
  (out, in) layout: canonical ``lora_a`` is ``lora_A.weight.T`` (in, r), ``lora_b`` is
  ``lora_B.weight.T`` (r, out)), ``.lora_magnitude_vector`` (out,) with ``use_dora``; ``<path>`` is
  the module path inside the base (transformers) model.
- scale ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), per module through ``rank_pattern``
  and ``alpha_pattern``: PEFT takes the FIRST pattern with ``re.match(rf"(.*\\.)?({pattern})$", path)``.
- ``target_modules``: a regex fully matching a module path, or names a path equals or ends with
  (``.name``); ``exclude_modules`` likewise; ``layers_to_transform``: block indices.

Patterns come from a file: each is at most :data:`PATTERN_LIMIT` characters, holds no nested
quantifier (``(a+)+``: backtracking exponential in the input) and is matched against paths of at
most :data:`PATH_LIMIT` characters, so no file makes a match run long.
"""
from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

from dense_bridge.adapter_kit import PATH_LIMIT, CheckpointError, ConversionError, bounded_pattern, file_number

#: PEFT's prefix of every key: PeftModel.base_model (LoraModel).model (the base model)
PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|"
                  r"lora_magnitude_vector)$")
_PARTS = {"lora_A.weight": "lora_a", "lora_B.weight": "lora_b", "lora_magnitude_vector": "lora_magnitude"}


# ----------------------------------------------------------------------------- bounded patterns
def checked_pattern(pattern, where: str, key: str) -> re.Pattern:
    """``pattern`` from the file ``where`` (its config key ``key``) compiled, or a CheckpointError:
    not a string, too long, not a regex, or with nested quantifiers (``bounded_pattern``)."""
    return bounded_pattern(pattern, f"{where}: {key}", CheckpointError)


def _bounded(path: str, where: str) -> str:
    if len(path) > PATH_LIMIT:
        raise CheckpointError(f"{where}: layer path of {len(path)} characters (at most {PATH_LIMIT} are matched "
                              f"against the config's patterns). Received: {path[:80]!r}...")
    return path


def _patterns(config: dict, key: str, where: str, *, integer: bool) -> dict:
    """The config's ``key`` ({pattern: value}) with every pattern bounded and every value checked,
    each pattern compiled as PEFT matches it: ``(.*\\.)?(pattern)$``."""
    found = config.get(key) or {}
    if not isinstance(found, dict):
        raise CheckpointError(f"{where}: {key} must be an object {{pattern: value}}. Received: {found!r}"[:400])
    out = {}
    for pattern, value in found.items():
        checked_pattern(pattern, where, f"{key}[{pattern[:40]!r}]")
        value = file_number(value, where, f"{key}[{pattern[:40]!r}]", integer=integer)
        out[pattern] = (re.compile(rf"(.*\.)?({pattern})$"), value)
    return out


def _pattern_value(patterns: dict, path: str, default, where: str):
    """PEFT's ``get_pattern_key``: (the value of the first pattern matching ``path``, that pattern),
    else (``default``, None)."""
    for pattern, (compiled, value) in patterns.items():
        if compiled.match(_bounded(path, where)):
            return value, pattern
    return default, None


def _targeted(config: dict, path: str, where: str) -> str | None:
    """Why PEFT, building the model from ``config``, would put no adapter on ``path`` (None: it would)."""
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str):
        if checked_pattern(excluded, where, "exclude_modules").fullmatch(_bounded(path, where)):
            return f"exclude_modules {excluded!r} excludes it"
    elif excluded:
        if path in excluded or any(path.endswith(f".{t}") for t in excluded):
            return f"exclude_modules {excluded!r} excludes it"
    targets = config.get("target_modules")
    if targets is None:
        return None  # PEFT's default targets for the model type: not decidable without the model
    if isinstance(targets, str):
        if targets == "all-linear":
            return None
        if not checked_pattern(targets, where, "target_modules").fullmatch(_bounded(path, where)):
            return f"target_modules {targets!r} does not match it"
        return None
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(f"{where}: target_modules must be a string or a list of strings. Received: {targets!r}"
                              [:400])
    if not (path in targets or any(path.endswith(f".{t}") for t in targets)):
        return f"target_modules {sorted(targets)[:8]} names no module it ends with"
    indices = config.get("layers_to_transform")
    if indices is not None:
        indices = [indices] if isinstance(indices, int) else indices
        pattern = config.get("layers_pattern")
        names = [pattern] if isinstance(pattern, str) else (pattern or [])
        found = None
        for name in names or [None]:
            inner = r"[^.]*" if name is None else re.escape(name)
            m = re.match(rf".*\.{inner}\.(\d+)\.", _bounded(path, where))
            if m:
                found = int(m[1])
                break
        if found is None or found not in indices:
            return f"layers_to_transform {indices} does not hold its block ({found})"
    return None


# ----------------------------------------------------------------------------- reading
def lora_from_files(tensors: dict, config: dict, where: str) -> tuple[dict, dict]:
    """A PEFT directory's tensors and config as canonical adapters (see ``registry._manifest.LORA_FILE_VERBS``).

    Args:
        tensors: ``adapter_model.safetensors``'s tensors {key: array}.
        config: ``adapter_config.json``.
        where: the directory, for errors.

    Returns:
        ``({layer path: {"lora_a" (in, r), "lora_b" (r, out), "lora_scale" 0-d float64[, "lora_magnitude"
        (out,)]}}, {"dropout": float})``. Every disagreement between the config and the tensors PEFT would
        trip over (ranks, DoRA without magnitudes, modules the config would not adapt) is a CheckpointError
        naming the key.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: adapter_config.json holds {type(config).__name__}, not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("lora_bias"):
        raise CheckpointError(f"{where}: lora_bias=True (a bias update outside the low-rank form) is not supported")
    rank_pattern = _patterns(config, "rank_pattern", where, integer=True)
    alpha_pattern = _patterns(config, "alpha_pattern", where, integer=False)
    layers: dict[str, dict] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise CheckpointError(f"{where}: tensor {key!r} is not a LoRA factor (modules_to_save, embedding or "
                                  f"token adapters are not read)")
        layers.setdefault(m["path"], {})[_PARTS[m["part"]]] = value
    dora = config.get("use_dora", False)
    rslora = config.get("use_rslora", False)
    r_default = config.get("r", 8)
    alpha_default = config.get("lora_alpha", 8)
    out = {}
    for layer, parts in layers.items():
        for part, name in (("lora_a", "lora_A.weight"), ("lora_b", "lora_B.weight")):
            if part not in parts:
                raise CheckpointError(f"{where}: layer {layer!r} lacks {PREFIX}{layer}.{name}")
            if np.ndim(parts[part]) != 2:
                raise CheckpointError(f"{where}: {PREFIX}{layer}.{name} has shape {np.shape(parts[part])}, not 2-D")
        if bool(dora) != ("lora_magnitude" in parts):
            raise CheckpointError(
                f"{where}: use_dora={dora!r} but layer {layer!r} "
                + ("has no lora_magnitude_vector (PEFT would start DoRA from the base weights' norms)" if dora
                   else "holds a lora_magnitude_vector (a DoRA adapter; PEFT would drop it)"))
        problem = _targeted(config, layer, where)
        if problem:
            raise CheckpointError(f"{where}: layer {layer!r} has factors but {problem}: PEFT would not adapt it "
                                  f"(its factors would be dropped)")
        r, r_key = _pattern_value(rank_pattern, layer, r_default, where)
        r = file_number(r, where, f"rank_pattern[{r_key!r}]" if r_key else "r", integer=True)
        alpha, a_key = _pattern_value(alpha_pattern, layer, alpha_default, where)
        alpha = file_number(alpha, where, f"alpha_pattern[{a_key!r}]" if a_key else "lora_alpha", integer=False)
        rank_a, rank_b = np.shape(parts["lora_a"])[0], np.shape(parts["lora_b"])[1]
        if rank_a != r or rank_b != r:
            raise CheckpointError(f"{where}: {PREFIX}{layer}.lora_A.weight {np.shape(parts['lora_a'])} and "
                                  f"lora_B.weight "
                                  f"{np.shape(parts['lora_b'])} have rank {rank_a}/{rank_b} but the config says "
                                  f"{'rank_pattern[' + repr(r_key) + ']' if r_key else 'r'}={r}")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        entry = {"lora_a": np.ascontiguousarray(np.asarray(parts["lora_a"]).T),
                 "lora_b": np.ascontiguousarray(np.asarray(parts["lora_b"]).T),
                 "lora_scale": np.array(scale, dtype=np.float64)}
        if "lora_magnitude" in parts:
            entry["lora_magnitude"] = np.asarray(parts["lora_magnitude"])
        out[layer] = entry
    dropout = config.get("lora_dropout", 0.0) or 0.0
    return out, {"dropout": float(file_number(dropout, where, "lora_dropout", integer=False))}


# ----------------------------------------------------------------------------- writing
def _alpha_for(scale: float, rank: int) -> float | None:
    """A lora_alpha with ``lora_alpha / rank == scale`` exactly in Python floats (PEFT's division), or None."""
    alpha = scale * rank
    for candidate in (alpha, float(np.nextafter(alpha, np.inf)), float(np.nextafter(alpha, -np.inf))):
        if candidate / rank == scale:
            return int(candidate) if float(candidate).is_integer() else float(candidate)
    return None


def lora_to_files(layers: dict, extra: dict, *, num_layers: int | None = None,
                  model_paths: list | None = None) -> tuple[dict, dict, dict]:
    """Canonical adapters (plain form, keyed by the base model's layer paths) as PEFT's files.

    Args:
        layers: {layer path: {"lora_a" (in, r), "lora_b" (r, out), "lora_scale"[, "lora_magnitude"]}}.
        extra: {"dropout": float}.
        num_layers, model_paths: unused (PEFT names every module by its full path).

    Returns:
        (``adapter_model.safetensors``'s tensors in torch's layout, ``adapter_config.json``, the
        safetensors metadata). ``target_modules`` lists the adapted paths exactly, so PEFT adapts
        those and no other module of the model. ConversionError: DoRA on some layers only, a scale
        no ``lora_alpha / r`` gives exactly.
    """
    ranks = {p: int(np.shape(e["lora_a"])[1]) for p, e in layers.items()}
    dora = {("lora_magnitude" in e) for e in layers.values()}
    if len(dora) > 1:
        raise ConversionError("PEFT's use_dora is one flag for every module: DoRA on some layers only "
                              f"({sorted(p for p, e in layers.items() if 'lora_magnitude' in e)}) cannot be written")
    r = Counter(ranks.values()).most_common(1)[0][0] if ranks else 8
    alphas = {}
    for p, e in layers.items():
        alpha = _alpha_for(float(e["lora_scale"]), ranks[p])
        if alpha is None:
            raise ConversionError(f"{p}: lora_scale {float(e['lora_scale'])!r} is not exactly lora_alpha / r for any "
                                  f"lora_alpha at r={ranks[p]}: PEFT cannot hold it")
        alphas[p] = alpha
    lora_alpha = Counter(alphas.values()).most_common(1)[0][0] if alphas else 8
    # PEFT takes the first pattern matching a path: an escaped full path matches that path only
    rank_pattern = {re.escape(p): ranks[p] for p in layers if ranks[p] != r}
    alpha_pattern = {re.escape(p): a for p, a in alphas.items() if a != lora_alpha}
    tensors = {}
    for p, e in layers.items():
        tensors[f"{PREFIX}{p}.lora_A.weight"] = np.asarray(e["lora_a"]).T
        tensors[f"{PREFIX}{p}.lora_B.weight"] = np.asarray(e["lora_b"]).T
        if "lora_magnitude" in e:
            tensors[f"{PREFIX}{p}.lora_magnitude_vector"] = np.asarray(e["lora_magnitude"])
    config = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "use_rslora": False,
              "use_dora": bool(dora.pop()) if dora else False, "target_modules": sorted(layers),
              "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
              "lora_dropout": float(extra.get("dropout", 0.0)), "fan_in_fan_out": False, "bias": "none",
              "lora_bias": False, "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
              "init_lora_weights": True, "modules_to_save": None}
    return tensors, config, {"format": "pt"}
