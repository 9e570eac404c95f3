"""Settings mlx-lm reads in another form than the interchange config writes them, found by value
and verified on mlx-lm's own model (used by :func:`._ports.port_complete_config`):

- a settings mapping left None that mlx-lm's model reads with ``.get`` (a rope scaling it always
  applies): ``{}``, no entry, which is what a config without the setting means
  (:func:`empty_settings`);
- a per-layer list of layer kinds whose names mlx-lm's module does not know (transformers 5 calls
  a state-space layer ``"linear_attention"`` and an attention layer ``"full_attention"``; a model
  may compare them with older names): each distinct kind renamed, one for one, to one of the names
  the module compares layer kinds with, the renaming under which mlx-lm's model holds the source's
  weights (:func:`renamed_kinds`);
- a string of per-layer letters (a period of layer kinds, one letter each) where the interchange
  config lists each layer's kind (``layer_types``): the shortest string over the letters the
  module names under which every layer of mlx-lm's model keeps the cache of the kind the config
  lists for it, a sliding window keeping a rotating cache (:func:`letter_pattern`).

Each value so found is then judged by the port's twins like any other setting. Nothing here names
a model: the names and letters come from mlx-lm's own module, the choice from the weights or from
the kinds of cache mlx-lm's model keeps per layer.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
import sys

#: The interchange (transformers 5) layer kinds and the class of cache mlx-lm keeps for a layer of
#: that kind (``make_cache``): a library-level correspondence, the same for every model.
KIND_CACHE = {"full_attention": "KVCache", "sliding_attention": "RotatingKVCache",
              "chunked_attention": "ChunkedKVCache", "linear_attention": "ArraysCache"}
#: The interchange config's per-layer list of layer kinds.
LAYER_KINDS = "layer_types"
#: How many candidate values are built at most per field (MLX builds lazily: nothing is computed).
MAX_TRIES = 256


def _annotation(f) -> str:
    t = f.type if isinstance(f.type, str) else str(f.type)
    return t.replace("typing.", "").replace(" ", "")


def _source(args_class) -> str:
    try:
        return inspect.getsource(sys.modules[args_class.__module__])
    except (KeyError, OSError, TypeError):
        return ""


def empty_settings(config: dict, args_class, build) -> dict:
    """``config`` with each settings mapping (a field typed as a dict) that is None set to ``{}``
    where mlx-lm's model cannot be built with None (it reads the mapping with ``.get``) and can with
    ``{}``; ``config`` itself otherwise.

    Args:
        config: mlx-lm's config for the model.
        args_class: its ``ModelArgs``.
        build: ``config -> model`` (raises where mlx-lm cannot build it).
    Returns:
        The config (a new dictionary where a field was set).
    """
    try:
        build(config)
        return config
    except Exception as exc:  # noqa: BLE001 - only a None read as a mapping is answered here
        if "'NoneType' object has no attribute" not in str(exc):
            return config
    names = [f.name for f in dataclasses.fields(args_class)
             if config.get(f.name) is None and re.search(r"\b[Dd]ict\b", _annotation(f))]
    for name in names:
        trial = {**config, name: {}}
        try:
            build(trial)
        except Exception:  # noqa: BLE001 - not this field
            continue
        return trial
    return config


def _compared_words(source: str) -> list[str]:
    """The words a module compares values with (``== "word"``, ``!= "word"``), in order of appearance."""
    return list(dict.fromkeys(re.findall(r"[!=]=\s*[\"'](\w+)[\"']", source)))


def renamed_kinds(config: dict, args_class, build, fit) -> dict:
    """``config`` with its per-layer lists of layer kinds (fields typed as a list of strings) that
    mlx-lm cannot build with renamed, each distinct kind to one of the words mlx-lm's module
    compares kinds with, one for one: the renaming under which mlx-lm's model holds the source's
    weights with strictly the fewest disagreeing (``fit``), where exactly one renaming does so;
    ``config`` itself otherwise (then building refuses, naming the kind).

    Args:
        config: mlx-lm's config for the model.
        args_class: its ``ModelArgs``.
        build: ``config -> model`` (raises where mlx-lm cannot build it).
        fit: ``config -> int | None``, how many of the source's tensors disagree with mlx-lm's
            model for the config (None where it is not built).
    Returns:
        The config (a new dictionary where a list was renamed).
    """
    try:
        build(config)
        return config
    except Exception:  # noqa: BLE001 - a kind the module does not know, among other causes
        pass
    words = _compared_words(_source(args_class))
    out = dict(config)
    for f in dataclasses.fields(args_class):
        value = out.get(f.name)
        if _annotation(f) not in ("List[str]", "list[str]") or not isinstance(value, list) or not value \
                or not all(isinstance(v, str) for v in value):
            continue
        kinds = list(dict.fromkeys(value))
        if all(k in words for k in kinds) or len(words) < len(kinds):
            continue
        scores = {}
        for names in itertools.islice(itertools.permutations(words, len(kinds)), MAX_TRIES):
            rename = dict(zip(kinds, names))
            score = fit({**out, f.name: [rename[v] for v in value]})
            if score is not None:
                scores[names] = score
        if not scores:
            continue
        best = min(scores.values())
        chosen = [names for names, score in scores.items() if score == best]
        if len(chosen) == 1:
            rename = dict(zip(kinds, chosen[0]))
            out[f.name] = [rename[v] for v in value]
    return out


def _cache_kinds(model) -> list[str] | None:
    try:
        return [type(c).__name__ for c in model.make_cache()]
    except Exception:  # noqa: BLE001 - a model without per-layer caches says nothing here
        return None


def letter_pattern(config: dict, args_class, build, mistyped) -> dict:
    """``config`` with each string field mlx-lm reads as per-layer letters, that the config leaves
    in another type (``mistyped(field, value)``: transformers' integer period), set from the
    config's list of layer kinds (:data:`LAYER_KINDS`): the shortest string over the one-letter
    strings mlx-lm's module names under which mlx-lm's model keeps, for every layer, the cache of
    that layer's kind (:data:`KIND_CACHE`), where exactly one string of that length does; a string
    longer than the model's layers is not tried. ``config`` itself otherwise (refused later, naming
    the field).

    Args:
        config: mlx-lm's config for the model.
        args_class: its ``ModelArgs``.
        build: ``config -> model`` (raises where mlx-lm cannot build it).
        mistyped: ``(field, value) -> bool``, whether the value is not of the field's declared type.
    Returns:
        The config (a new dictionary where a field was set).
    """
    kinds = config.get(LAYER_KINDS)
    if not isinstance(kinds, list) or not kinds or not all(k in KIND_CACHE for k in kinds):
        return config
    want = [KIND_CACHE[k] for k in kinds]
    fields = [f for f in dataclasses.fields(args_class)
              if "str" in _annotation(f) and config.get(f.name) is not None and mistyped(f, config[f.name])]
    if not fields:
        return config
    letters = sorted(set(re.findall(r"[\"']([A-Z])[\"']", _source(args_class))))
    out = dict(config)
    for f in fields:
        tries, found = 0, None
        for length in range(1, len(kinds) + 1):
            fits = []
            for chars in itertools.product(letters, repeat=length):
                tries += 1
                if tries > MAX_TRIES:
                    break
                trial = {**out, f.name: "".join(chars)}
                try:
                    model = build(trial)
                except Exception:  # noqa: BLE001 - a string the model cannot be built with
                    continue
                if _cache_kinds(model) == want:
                    fits.append(trial[f.name])
            if fits or tries > MAX_TRIES:
                found = fits[0] if len(fits) == 1 else None
                break
        if found is not None:
            out[f.name] = found
    return out
