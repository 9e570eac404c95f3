"""mlx-lm model directories (``config.json``, ``model*.safetensors`` tagged ``format: mlx`` and
``model.safetensors.index.json``, as ``mlx_lm.utils.save_model`` writes them), the model-directory
verbs of ``db.port`` (see dense_bridge/ports/_dirs.py).

mlx-lm reads a Hugging Face style ``config.json`` but under the names its ``ModelArgs`` declare:
transformers 5 keeps rope settings under ``rope_parameters``, which mlx-lm 0.32's Llama reads as
``rope_theta`` (silently 10000 when absent). :data:`READS_AS` is that one table, for the library,
not per architecture; the port builds its destination twin from the config as written, so a setting
lost here fails the twins' verification.
"""
from __future__ import annotations

import glob
import math
import os
import re

import numpy as np

from dense_bridge.adapter_kit import BackendUnavailableError, CheckpointError, ConversionError, Match, SafetensorsFile, \
    received
from dense_bridge.checkpoints._safetensors import read_json_file

from ._port_quant import QuantizedWeights, code_names, is_quantized, port_parse_quantize, port_quantize, port_recompute_codes  # noqa: F401  quantized directories

FORMAT = "mlx-lm"
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
#: Files besides the weights mlx-lm's ``load`` reads (its tokenizer is transformers').
EXTRAS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
          "generation_config.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
          "added_tokens.json")
#: Sub-configs of a multimodal checkpoint's other towers: only its text part would be written.
MULTIMODAL_KEYS = ("vision_config", "audio_config", "speech_config", "image_config")
#: Keys of config.json that make mlx-lm import code stored in the directory.
REMOTE_CODE_KEYS = ("model_file", "auto_map", "trust_remote_code")
#: Interchange keys inside ``rope_parameters`` that mlx-lm reads at the top level, under these names;
#: what is left of a non-default ``rope_parameters`` is read as ``rope_scaling``.
READS_AS = {"rope_theta": "rope_theta", "partial_rotary_factor": "partial_rotary_factor"}
#: The rotary base of each layer type, where ``rope_parameters`` holds one setting per layer type, under
#: the top-level names transformers' configs still accept for it (and mlx-lm reads).
READS_AS_PER_TYPE = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
#: Top-level interchange keys mlx-lm reads under another name: {name mlx-lm reads: interchange name}.
ALIASES = {"n_ctx": "n_positions"}
#: Names a required ``ModelArgs`` field may have in the interchange config when the config lacks the
#: field's own name: the older Hugging Face names of the same setting (the rotary base and fraction,
#: the spellings of a norm's epsilon), read only to fill a field the config does not set.
SYNONYMS = {"rotary_emb_base": ("rope_theta",), "rotary_pct": ("partial_rotary_factor",),
            "rope_theta": ("rotary_emb_base", "rope_base"), "partial_rotary_factor": ("rotary_pct",),
            "layer_norm_epsilon": ("layer_norm_eps", "rms_norm_eps", "norm_eps", "norm_epsilon"),
            "layer_norm_eps": ("layer_norm_epsilon", "rms_norm_eps", "norm_eps"),
            "rms_norm_eps": ("norm_eps", "layer_norm_eps", "layer_norm_epsilon", "layernorm_epsilon"),
            "norm_eps": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"),
            "layernorm_epsilon": ("rms_norm_eps", "layer_norm_eps", "norm_eps"),
            "num_layers": ("num_hidden_layers",), "num_hidden_layers": ("num_layers", "n_layer"),
            "num_experts": ("num_local_experts", "n_routed_experts"),
            "num_local_experts": ("num_experts", "n_routed_experts"),
            "n_routed_experts": ("num_experts", "num_local_experts"),
            "shared_intermediate_size": ("shared_expert_intermediate_size",)}
#: The suffix of the text sub-config's model type of a multimodal model (transformers' convention).
TEXT_SUFFIX = "_text"
#: How many value combinations :func:`port_complete_config` tries at most (each builds mlx-lm's
#: model lazily: no weights are computed).
MAX_TRIES = 256


def _mlx_lm():
    try:
        import mlx_lm.utils
    except ImportError:
        raise BackendUnavailableError("mlx-lm model directories need the mlx-lm package: "
                                      "pip install 'dense-bridge[port]'") from None
    return mlx_lm.utils


def _weight_files(path: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "model*.safetensors")))


def port_detect(fmt: str, path: str) -> int:
    """CERTAIN for a config.json beside safetensors tagged ``format: mlx`` (mlx-lm's ``save_model``),
    FITS for any config.json beside ``model*.safetensors`` (what mlx-lm's loader globs), else NO."""
    if not os.path.isfile(os.path.join(path, CONFIG)):
        return Match.NO
    files = _weight_files(path)
    if not files:
        return Match.NO
    try:
        with SafetensorsFile(os.path.join(path, files[0])) as f:
            tag = (f.metadata or {}).get("format", "")
    except CheckpointError:
        return Match.NO
    return Match.CERTAIN if tag == "mlx" else Match.FITS


def port_contents(fmt: str, path: str, text_only: bool = False) -> dict:
    """``{"config", "weights": {tensor name: file relative to path}, "extras"}``; ConversionError
    for a config that asks for code in the directory (``model_file``) or a multimodal one; a
    quantized directory lists its float model's tensors (its scales and biases read through
    :func:`port_open`) (``text_only`` is not implemented for mlx-lm directories: refused, saying so)."""
    config = read_json_file(os.path.join(path, CONFIG), "mlx-lm config")
    for key in REMOTE_CODE_KEYS:
        if config.get(key):
            raise ConversionError(f"{os.path.join(path, CONFIG)} asks for code from outside the installed libraries "
                                  f"({key}={config[key]!r}): refused, never run")
    towers = [k for k in MULTIMODAL_KEYS if config.get(k)]
    if towers and not _text_alone(path, config):
        raise ConversionError(f"{path} is a multimodal checkpoint ({', '.join(towers)} in its {CONFIG}): only its text "
                              "part would be written, so it is refused "
                              + ("(text_only=True is implemented for transformers sources only, not yet for mlx-lm "
                                 "directories; nothing was written)" if text_only else
                                 "unless asked (text_only=True, or --text-only, ports the text model alone where the "
                                 "source's library separates it; nothing was written)"))
    weights: dict[str, str] = {}
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        wm = read_json_file(index, "safetensors index").get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{index}: 'weight_map' is not an object of tensor name -> file name. "
                                  f"{received('weight_map', wm)}")
        weights = dict(wm)
    else:
        for name in _weight_files(path):
            with SafetensorsFile(os.path.join(path, name)) as f:
                for key in f.keys():
                    weights[key] = name
    if not weights:
        raise CheckpointError(f"{path} holds no model*.safetensors weights beside its {CONFIG}")
    extras = [n for n in EXTRAS if os.path.isfile(os.path.join(path, n))]
    hidden = code_names(path, config, weights, lambda c: port_shapes(fmt, c))  # a quantized directory reads as its float model (_port_quant)
    weights = {k: v for k, v in weights.items() if k not in hidden}
    return {"config": config, "weights": weights, "extras": extras}


def _text_alone(path: str, config: dict) -> bool:
    """Whether the directory ``path``, whose config names other towers (a vision encoder's
    settings, kept by mlx-lm's own converter), holds only tensors of the text model mlx-lm builds
    for that config (its composite drops the towers when it loads a multimodal checkpoint): then
    the towers are settings without weights, and nothing would be left behind by a port."""
    try:
        own = set(port_shapes(FORMAT, config))
    except Exception:  # noqa: BLE001 - a model mlx-lm cannot build: refused as multimodal, by name
        return False
    stored: set[str] = set()
    for name in _weight_files(path):
        with SafetensorsFile(os.path.join(path, name)) as f:
            stored.update(f.keys())
    suffixes = (".scales", ".biases")  # a quantized layer's codes beside its weight
    return bool(stored) and all(k in own or (k.endswith(suffixes) and k.rsplit(".", 1)[0] + ".weight" in own)
                                for k in stored)


def port_open(fmt: str, path: str):
    """A weight file of an mlx-lm directory opened for streaming: as it is stored, or, in a quantized
    directory, as the float model it stands for (:class:`~._port_quant.QuantizedWeights`)."""
    directory = os.path.dirname(os.path.abspath(path))
    config_path = os.path.join(directory, CONFIG)
    if os.path.isfile(config_path) and is_quantized(read_json_file(config_path, "mlx-lm config")):
        return QuantizedWeights(path, lambda c: port_shapes(fmt, c))
    return SafetensorsFile(path)


def port_common_config(fmt: str, config: dict) -> dict:
    """What mlx-lm reads in its config.json, in the interchange form: the keys of :data:`READS_AS` as
    its ``ModelArgs`` take them (a rope base it does not find is its default, which is what it
    computes with) written back under ``rope_parameters``, minus what only mlx-lm keeps (its own
    quantization entry)."""
    out = dict(config)
    if out.pop("quantization", None) is not None:
        out.pop("quantization_config", None)  # mlx-lm's copy of it, for the Hugging Face hub
    text = out.get("text_config")
    if isinstance(text, dict) and text.get("model_type") == f"{out.get('model_type')}{TEXT_SUFFIX}":
        return port_common_config(fmt, text)  # a text model mlx-lm reads through its composite (port_own_config)
    try:
        _, args_class = _classes(out)
        args = args_class.from_dict(out)
    except (ConversionError, TypeError, KeyError, ValueError, AttributeError):
        return out  # refused later, by name, when its model is built
    rope = out.get("rope_parameters")
    if rope is not None and (not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values())):
        return out  # per-layer-type rope settings: read by the models that declare them, as they are
    rope = dict(rope or {})
    for inner, outer in READS_AS.items():
        value = getattr(args, outer, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (inner in rope or outer in out
                                                                                or inner == "rope_theta"):
            rope[inner] = value
            out[outer] = value
    if rope:
        rope.setdefault("rope_type", "default")
        out["rope_parameters"] = rope
    return out


def _implements(model_type: str) -> bool:
    """Whether mlx-lm has a model for ``model_type`` (directly or through its remapping)."""
    try:
        _mlx_lm()._get_classes({"model_type": model_type})
    except (ValueError, ImportError, SystemExit):  # a module that exits when imported: not offered here
        return False
    return True


def port_own_config(fmt: str, common: dict) -> dict:
    """``common`` with every key mlx-lm reads under another name carried under that name
    (:data:`READS_AS`): ``rope_parameters`` flattened to ``rope_theta`` (and ``rope_scaling`` when
    its type is not the default), the original kept for the models that read it. The text part of
    a multimodal model (``model_type`` ``"<name>_text"``) that mlx-lm implements only inside its
    composite ``"<name>"`` is written as that composite's config, the text config under
    ``text_config`` (which is how mlx-lm's composites read a text-only checkpoint)."""
    out = dict(common)
    kind = out.get("model_type")
    if isinstance(kind, str) and kind.endswith(TEXT_SUFFIX) and not _implements(kind) \
            and _implements(kind[:-len(TEXT_SUFFIX)]):
        return {"model_type": kind[:-len(TEXT_SUFFIX)], "text_config": _flat_own_config(out)}
    return _flat_own_config(out)


def _flat_own_config(common: dict) -> dict:
    out = dict(common)
    for theirs, ours in ALIASES.items():
        if ours in out and theirs not in out:
            out[theirs] = out[ours]
    _optional_fields(out)
    rope = _one_rope(out.get("rope_parameters"))
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        for layer_type, outer in READS_AS_PER_TYPE.items():  # a base per layer type, read at the top level
            if isinstance(rope.get(layer_type, {}).get("rope_theta"), (int, float)) and outer not in out:
                out[outer] = rope[layer_type]["rope_theta"]
    if isinstance(rope, dict) and not any(isinstance(v, dict) for v in rope.values()):
        for inner, outer in READS_AS.items():
            if inner in rope and outer not in out:
                out[outer] = rope[inner]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default") and out.get("rope_scaling") is None:
            rest = {k: v for k, v in rope.items() if k not in READS_AS}
            out["rope_scaling"] = {**rest, "type": kind, "rope_type": kind}
    return out


def _one_rope(rope):
    """``rope`` (``rope_parameters``), or, where it holds one setting per layer type and every layer
    type has the same one, that setting: what a library with one rope for every layer reads."""
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        first = next(iter(rope.values()))
        if all(v == first for v in rope.values()) and not any(isinstance(x, dict) for x in first.values()):
            return dict(first)
    return rope


def _optional_fields(config: dict) -> None:
    """Fields mlx-lm's ``ModelArgs`` requires but types as optional, and ``rope_scaling`` (an absent
    one is the default rope), absent from ``config``: set to None, which is what an absent setting
    means to the library that wrote it."""
    import dataclasses

    try:
        _, args_class = _classes(config)
        fields = dataclasses.fields(args_class)
    except (ConversionError, TypeError):
        return
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        optional = "Optional" in str(f.type) or "None" in str(f.type) or f.name == "rope_scaling"
        if required and f.name not in config and optional:
            config[f.name] = None


def _required(f) -> bool:
    import dataclasses

    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _kind(f) -> str | None:
    """'bool', 'int' or 'float' for a field typed as one (its annotation as a string or a type)."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t if t in ("bool", "int", "float") else None


def _scalar_type(f) -> str | None:
    """'bool', 'int', 'float' or 'str' for a field typed as one, or as one or None; else None."""
    import re

    t = f.type if isinstance(f.type, str) else f.type.__name__ if isinstance(f.type, type) else str(f.type)
    t = t.replace("typing.", "").replace(" ", "")
    m = re.fullmatch(r"Optional\[(\w+)\]|(\w+)\|None|None\|(\w+)|(\w+)|<class'(\w+)'>", t)
    name = next((g for g in m.groups() if g), None) if m else None
    return name if name in ("bool", "int", "float", "str") else None


def _mistyped(f, value) -> bool:
    """Whether ``value`` (set, not None) is not of the scalar type the field ``f`` declares (an int
    where mlx-lm reads a string of per-layer letters, say): mlx-lm would misread it."""
    kind = _scalar_type(f)
    if value is None or kind is None:
        return False
    if kind == "str":
        return not isinstance(value, str)
    if kind == "bool":
        return not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, bool) or not isinstance(value, int)
    return isinstance(value, bool) or not isinstance(value, (int, float))


def _mistyped_fields(config: dict, args_class) -> list[str]:
    """``"name=value: mlx-lm's ModelArgs reads a <type>"`` for each field of ``args_class`` whose value
    in ``config`` is of another type than the one it declares."""
    import dataclasses

    try:
        fields = dataclasses.fields(args_class)
    except TypeError:
        return []
    return [f"{f.name}={config[f.name]!r} ({type(config[f.name]).__name__}): mlx-lm's ModelArgs reads a "
            f"{_scalar_type(f)}" for f in fields if _mistyped(f, config.get(f.name))]


def _fit(config: dict, shapes: dict[str, tuple[int, ...]], widths_only: bool = False) -> int | None:
    """How many tensors disagree between mlx-lm's model for ``config`` and the weights ``shapes``
    (names and shapes as the source stores them) once mlx-lm's own ``sanitize`` has read them, as its
    loader does (parameters missing or of another shape, weights left over); None where the model
    is not built (``widths_only``: only tensors both hold, of another shape). Lazy arrays: nothing is
    computed, whatever the sizes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    try:
        model = _build(config)
        weights = {k: mx.zeros(tuple(v), dtype=mx.float32) for k, v in shapes.items()}
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        params = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    except Exception:  # noqa: BLE001 - a value the library cannot build with does not fit
        return None
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if widths_only:  # only tensors both hold, of another shape
        return sum(1 for k, s in params.items() if k in got and got[k] != s)
    return sum(1 for k, s in params.items() if got.get(k) != s) + sum(1 for k in got if k not in params)


def port_complete_config(fmt: str, config: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """``config`` (as :func:`port_own_config` wrote it) with the fields mlx-lm's ``ModelArgs``
    require and the config leaves unset (absent, or None where the field is not optional) filled,
    in this order:

    1. from another name of the same setting (:data:`SYNONYMS`), or computed from the settings it
       is made of (:data:`DERIVED`: the rotated width of a head);
    2. a field no weight can decide (a string: a routing method, a scoring function) takes the value
       mlx-lm's own models give that field by default where most of them agree (:func:`_library_default`);
    3. booleans and integers, by the weights: the one value under which mlx-lm's own model holds the
       tensors ``shapes`` (the fewest disagreeing; the source's names and shapes, read through
       mlx-lm's ``sanitize`` as its loader reads them): a bias or a norm present or not, a width,
       0 (none) included; a per-layer list of switches (which layers hold experts), layer by layer;
    4. what the weights leave open: a switch is off, as a config that does not name it means; an
       integer no weight depends on at all takes mlx-lm's usual default for it, else, for a
       feed-forward width (:data:`NONE_WIDTHS`), 0 (none); any other stays unset.

    Before and after these, settings mlx-lm reads in another form are put in that form, found by
    value (:mod:`._port_kinds`): a settings mapping left None that mlx-lm reads as a mapping, a
    per-layer list of layer kinds under the names mlx-lm's module uses, a string of per-layer
    letters for the config's list of layer kinds.

    The twins' verification judges every value so filled. A field none of this fills is left unset,
    and building the model refuses naming it.

    Args:
        config: mlx-lm's config for the model.
        shapes: {tensor name: shape} of the source's weights (the checkpoint, or the source twin).
    Returns:
        The config, completed (a new dictionary; ``config`` is not changed).
    """
    out = _in_mlx_forms(dict(config), shapes)
    return _in_mlx_forms(_complete(out, shapes), shapes)


def _in_mlx_forms(config: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """``config`` with the settings mlx-lm reads in another form put in that form (:mod:`._port_kinds`)."""
    from . import _port_kinds

    try:
        _, args_class = _classes(config)
    except ConversionError:
        return config
    config = _port_kinds.letter_pattern(config, args_class, _build, _mistyped)
    config = _port_kinds.empty_settings(config, args_class, _build)
    if shapes:
        config = _port_kinds.renamed_kinds(config, args_class, _build, lambda c: _fit(c, shapes))
    return config


def _complete(config: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Steps 1-4 of :func:`port_complete_config`."""
    import dataclasses
    import itertools

    out = dict(config)
    try:
        _, args_class = _classes(out)
        fields = [f for f in dataclasses.fields(args_class) if _required(f)]
    except (ConversionError, TypeError):
        return out
    names = set(_unset(out, args_class))
    unset = [f for f in fields if f.name in names]
    guess, switches = [], []
    for f in unset:
        other = next((k for k in SYNONYMS.get(f.name, ()) if out.get(k) is not None), None)
        derived = DERIVED[f.name](out) if f.name in DERIVED else None
        if other is not None:
            out[f.name] = out[other]
        elif derived is not None:
            out[f.name] = derived
        elif _kind(f) in ("bool", "int"):
            guess.append(f)
        elif _bool_list(f):
            switches.append(f)
        else:
            default = _library_default(f.name)
            if default is not None:
                out[f.name] = default
    if not shapes:
        return out
    if not (guess or switches):
        return _composite_if_it_fits_better(_refine_defaults(out, args_class, shapes), shapes)
    layers = _layer_count(out)
    if switches and layers:
        out.update({f.name: [False] * layers for f in switches})  # every switch off, then turned on layer by layer below
    if guess:
        dims = sorted({d for s in shapes.values() for d in s} | {0, 1})
        options = [[False, True] if _kind(f) == "bool" else dims for f in guess]
        tries = list(itertools.islice(itertools.product(*options), MAX_TRIES + 1))
        if len(tries) > MAX_TRIES:
            return out
        scores = {}
        for values in tries:
            score = _fit({**out, **{f.name: v for f, v in zip(guess, values)}}, shapes)
            if score is not None:
                scores[values] = score
        if not scores:
            return out
        best = min(scores.values())  # a tied head one side lists and the other does not: not zero, still the fewest
        scored = [values for values, score in scores.items() if score == best]
        if len(scored) > 1:  # the weights leave some fields open: switches off, integers nothing depends on
            open_ = {i for i in range(len(guess)) if len({values[i] for values in scored}) > 1}
            for i in sorted(open_):
                if _kind(guess[i]) == "bool":
                    keep = False
                elif {values[i] for values in scored} >= {v for values in scores for v in values[i:i + 1]}:
                    default = _library_default(guess[i].name)
                    if isinstance(default, int) and not isinstance(default, bool):
                        keep = default
                    elif guess[i].name.endswith(NONE_WIDTHS):
                        keep = 0  # a feed-forward width no tensor has: no such part
                    else:
                        continue  # a count nothing decides (0 may divide by it): left to the refusal
                else:
                    continue  # the weights allow a few values, not every one: left to the refusal
                scored = [values for values in scored if values[i] == keep]
        if len(scored) == 1:
            out.update({f.name: v for f, v in zip(guess, scored[0])})
    for f in switches:  # layer by layer: a switch on where the weights fit better with it
        if not layers:
            break
        score = _fit(out, shapes)
        for i in range(layers):
            if score is None:
                break
            trial = list(out[f.name])
            trial[i] = True
            s = _fit({**out, f.name: trial}, shapes)
            if s is not None and s < score:
                out[f.name], score = trial, s
    return _composite_if_it_fits_better(_refine_defaults(out, args_class, shapes), shapes)


def port_source_form(fmt: str, config: dict, real: dict, stored: dict[str, tuple[int, ...]]) -> dict:
    """The twin's ``config`` (as :func:`port_own_config` wrote it) in the form the source directory's
    own config takes: a text model whose real config ``real`` mlx-lm's composite holds the weights
    ``stored`` of (and its text-only model does not) is built as that composite (see "composite or text-only" below)."""
    chosen = _composite_if_it_fits_better(real, stored)
    return config if chosen is real else as_composite(config, TEXT_SUFFIX)


def _composite_if_it_fits_better(config: dict, shapes: dict) -> dict:
    """``config``, or its composite form where mlx-lm's composite holds the weights and its text-only
    model does not (see "composite or text-only" below)."""
    return composite_if_it_fits_better(config, shapes, TEXT_SUFFIX, _implements, _build)


def _refine_defaults(config: dict, args_class, shapes: dict) -> dict:
    """``config`` with integer fields it leaves to mlx-lm's defaults set by the weights where the
    default does not hold them: when some tensor of ``shapes`` has another shape in mlx-lm's model,
    each such field, one at a time, takes the width under which that model holds strictly fewer of
    the tensors disagreeing (a width the source's config says in another form, as a per-layer
    setting); a config whose tensors all have their shapes is unchanged.
    At most :data:`MAX_TRIES` models are built (lazily)."""
    import dataclasses

    if not _fit(config, shapes, widths_only=True):  # names left over are no width: nothing a default explains
        return config
    score = _fit(config, shapes)
    try:
        fields = [f for f in dataclasses.fields(args_class) if not _required(f) and _kind(f) == "int"
                  and f.name not in config]
    except TypeError:
        return config
    dims = sorted({d for s in shapes.values() for d in s})
    out, tries = dict(config), 0
    for f in fields:
        best = None
        for v in dims:
            if tries >= MAX_TRIES or not score:
                return out
            tries += 1
            s = _fit({**out, f.name: v}, shapes)
            if s is not None and s < score and (best is None or s < best[1]):
                best = (v, s)
        if best is not None:
            out[f.name], score = best
    return out


def _bool_list(f) -> bool:
    """Whether the field ``f`` is typed as a list of booleans (one switch per layer)."""
    t = f.type if isinstance(f.type, str) else str(f.type)
    return t.replace("typing.", "").replace(" ", "") in ("List[bool]", "list[bool]")


def _layer_count(config: dict) -> int | None:
    for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if isinstance(config.get(k), int) and not isinstance(config.get(k), bool) and config[k] > 0:
            return config[k]
    return None


def _rotary_dim(config: dict) -> int | None:
    """The rotated width of each head: ``head_dim`` x the partial rotary factor (1 where unset)."""
    head = config.get("head_dim")
    if not isinstance(head, int) or isinstance(head, bool):
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        head = hidden // heads if isinstance(heads, int) and isinstance(hidden, int) and heads else None
    if head is None:
        return None
    rope = _one_rope(config.get("rope_parameters"))
    factor = config.get("partial_rotary_factor")
    if factor is None and isinstance(rope, dict):
        factor = rope.get("partial_rotary_factor")
    return int(head * (1.0 if factor is None else float(factor)))


#: Integer fields that are the width of a feed-forward part: one no tensor of the source has, that
#: no weight decides, is 0 (the part is absent). Other integers nothing decides stay unset (refused).
NONE_WIDTHS = ("intermediate_size",)
#: Fields computed from the settings they are made of, where the config sets the parts but not the
#: field: {field: function of the config -> value or None}.
DERIVED = {"rotary_dim": _rotary_dim}


def _library_default(name: str):
    """The default most of mlx-lm's ``ModelArgs`` give a field called ``name`` (more than half of
    those that default it, and at least two), or None: what mlx-lm assumes for the setting where a
    config leaves it out."""
    import collections

    counts = collections.Counter(repr(v) for v in _library_defaults().get(name, ()))
    if not counts:
        return None
    value, n = counts.most_common(1)[0]
    if n < 2 or 2 * n <= sum(counts.values()):
        return None
    return next(v for v in _library_defaults()[name] if repr(v) == value)


_DEFAULTS: dict | None = None


def _library_defaults() -> dict:
    """{field name: [the default of every mlx-lm ``ModelArgs`` that defaults it]} (scalars only),
    read once from every model module mlx-lm offers."""
    global _DEFAULTS
    if _DEFAULTS is None:
        import contextlib
        import dataclasses
        import importlib
        import io
        import pkgutil

        import mlx_lm.models

        found: dict[str, list] = {}
        for m in pkgutil.iter_modules(mlx_lm.models.__path__):
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # modules that print what they lack
                    module = importlib.import_module(f"mlx_lm.models.{m.name}")
            except BaseException:  # noqa: BLE001 - a module that cannot be imported here (it may exit)
                continue
            args = getattr(module, "ModelArgs", None)
            if not (isinstance(args, type) and dataclasses.is_dataclass(args)):
                continue
            for f in dataclasses.fields(args):
                if f.default is not dataclasses.MISSING and isinstance(f.default, (bool, int, float, str)):
                    found.setdefault(f.name, []).append(f.default)
        _DEFAULTS = found
    return _DEFAULTS


def port_shrink(fmt: str, common: dict) -> dict:
    """Not offered here: the interchange config's sizes are shrunk by transformers' own config classes."""
    raise ConversionError("mlx-lm does not shrink interchange configs: install transformers (pip install "
                          "'dense-bridge[port]')")


def _classes(config: dict):
    utils = _mlx_lm()
    try:
        return utils._get_classes(config)
    except (SystemExit, ImportError) as exc:  # a module that ends the process when a package it needs is missing
        raise ConversionError(f"mlx-lm's model for model_type {config.get('model_type')!r} cannot be loaded here: its "
                              f"module needs what this machine lacks ({type(exc).__name__}: {exc}; mlx-lm prints "
                              "what to install); nothing was written") from None
    except ValueError:
        import pkgutil

        import mlx_lm.models

        offered = sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if not m.name.startswith("_"))
        raise ConversionError(f"mlx-lm does not implement model_type {config.get('model_type')!r} (it offers "
                              f"{len(offered)} model types: {', '.join(offered)})") from None


def _build(config: dict):
    model_class, args_class = _classes(config)
    try:
        return model_class(args_class.from_dict(config))
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        mistyped = _mistyped_fields(config, args_class)
        if mistyped:  # named before anything unset: the value is there, in a type mlx-lm does not read
            raise ConversionError(f"mlx-lm cannot build model_type {config.get('model_type')!r} from this config: "
                                  + "; ".join(mistyped) + " (the setting has no translation into what mlx-lm reads: "
                                  "refused, nothing was written; where the source's library also reads that type, "
                                  "write the setting so in the source's config.json and port again): "
                                  f"{type(exc).__name__}: {str(exc)[:200]}") from None
        unset = _unset(config, args_class)
        why = (f" ({', '.join(unset)}: required by its ModelArgs, set neither by the source's config nor, under "
               "another name, by its weights; nothing was written: add "
               + ("it" if len(unset) == 1 else "them") + " to the source's config.json under "
               + ("that name" if len(unset) == 1 else "those names") + ", with the values the model was made "
               "with, and port again)") if unset else ""
        raise ConversionError(f"mlx-lm cannot build model_type {config.get('model_type')!r} from this config{why}: "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from None


def _unset(config: dict, args_class) -> list[str]:
    """The fields ``args_class`` requires that ``config`` leaves unset (absent, or None where not optional)."""
    import dataclasses

    try:
        fields = dataclasses.fields(args_class)
    except TypeError:
        return []
    return [f.name for f in fields if _required(f) and config.get(f.name) is None
            and not (f.name in config and ("Optional" in str(f.type) or "None" in str(f.type)))]


def port_twin(fmt: str, config: dict, seed: int = 0):
    """mlx-lm's own model for ``config`` (its ``_get_classes``, as ``load_model`` does), float32,
    every parameter random (seeded)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    model = _build(config)
    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if len(shape) <= 1:  # vectors and scalars (a learned activation's)
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / shape[-1] ** 0.5
        new.append((name, mx.array(value.astype(np.float32))))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    _runs_here(model, config)
    return model


def _runs_here(model, config: dict) -> None:
    """ConversionError naming the layers when ``model`` runs a kernel this machine's MLX has no
    back-end for (``mx.fast.metal_kernel`` without Metal): the twins could never be compared here.
    Any other failure is left to the comparison, which reports it with its inputs."""
    import inspect
    import sys

    import mlx.core as mx

    try:
        mx.eval(model(mx.array(np.zeros((1, 2), np.int32))))
    except RuntimeError as exc:
        if "metal" not in str(exc).lower():
            return
        layers = []
        for path, m in model.named_modules():
            try:
                source = inspect.getsource(sys.modules[type(m).__module__])
            except (KeyError, OSError, TypeError):
                continue
            if "metal_kernel" in source and not list(m.children()):
                layers.append(f"{path} ({type(m).__name__})")
        raise ConversionError(f"mlx-lm's {config.get('model_type')!r} model runs a kernel written for Metal only, "
                              f"which this machine's MLX cannot run ({str(exc).strip()[:120]}), in "
                              f"{', '.join(layers[:3]) or 'its layers'}{' and more' if len(layers) > 3 else ''}: the "
                              "port's twins cannot be run here; port on a machine whose MLX has Metal (Apple silicon)"
                              ) from None
    except Exception:  # noqa: BLE001 - judged where the twins are compared
        return


def port_as_loaded(fmt: str, model, names) -> set[str]:
    """``model`` (a twin) made what mlx-lm's loader makes of it when its files hold only the tensors
    ``names``: the model's ``sanitize`` run on them, as ``load_model`` runs it, for what it does to
    the model itself (a head it drops, to compute with the embedding's transpose, when the files
    hold none); the values it returns are not loaded (the twin keeps its own).

    Args:
        model: mlx-lm's model, changed in place.
        names: the parameter names (as the model names them) the files would hold.
    Returns:
        The names of the parameters ``model`` then holds.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    names = set(names)
    if hasattr(model, "sanitize") and not set(params) <= names:  # only a file set lacking some parameter
        try:
            model.sanitize({k: mx.zeros(v.shape, dtype=v.dtype) for k, v in params.items() if k in names})
        except Exception:  # noqa: BLE001 - a sanitize that needs the checkpoint's own names: the model as built
            pass
    return {k for k, _ in tree_flatten(model.parameters())}


def port_save(fmt: str, model, path: str) -> None:
    """``model``'s weights written into ``path`` by mlx-lm's own ``save_model``."""
    _mlx_lm().save_model(path, model)


def port_shapes(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of mlx-lm's model for ``config`` with its shape (MLX builds lazily: the
    initial values are never computed)."""
    from mlx.utils import tree_flatten

    model = _build(config)
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def port_layout(fmt: str, count: int) -> dict:
    """File names as ``mlx_lm.utils.save_model`` writes them (an index always)."""
    shards = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                         for i in range(count)]
    return {"shards": shards, "index": INDEX, "metadata": {"format": "mlx"}, "config": CONFIG, "extras": EXTRAS}


def port_example(fmt: str, path: str, seed: int = 0) -> None:
    """Not offered: the demo's example model comes from a library that writes the interchange config."""
    raise ConversionError("mlx-lm directories offer no example model of their own")


def port_load(fmt: str, path: str):
    """The model as mlx-lm's own loader reads the directory (``mlx_lm.utils.load_model``)."""
    from pathlib import Path

    model, _ = _mlx_lm().load_model(Path(path))
    return model


def port_logits(fmt: str, model, ids: np.ndarray) -> np.ndarray:
    """Float32 logits (batch, positions, vocab) for the token ids ``ids`` (batch, positions)."""
    import mlx.core as mx

    out = model(mx.array(np.asarray(ids, np.int32)))
    return np.asarray(out.astype(mx.float32))


def _window(config: dict) -> int | None:
    """The sliding-window length of attention the config sets (the shortest, where several), or None."""
    found = [v for k, v in config.items() if k == "sliding_window" or k.endswith("_sliding_window")]
    found = [v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(found) if found else None


def port_describe(fmt: str, config: dict) -> dict:
    """``{"architecture", "vocab_size", "max_positions", "window", "fields", "kind_only"}`` of an mlx-lm config (Hugging
    Face names); None where it does not say (``fields``: the settings its model takes, :func:`_fields`;
    ``kind_only``: a config naming only the model's kind, whose ``fields`` are mlx-lm's defaults)."""
    text = config.get("text_config")
    if isinstance(text, dict) and not isinstance(config.get("vocab_size"), int):
        return {**port_describe(fmt, text), "architecture": config.get("architectures") or [config.get("model_type")]}
    vocab = config.get("vocab_size")
    limits = [config[k] for k in ("max_position_embeddings", "n_positions", "n_ctx") if isinstance(config.get(k), int)]
    arch = config.get("architectures") or [config.get("model_type")]
    return {"architecture": arch, "kind": config.get("model_type"),
            "vocab_size": vocab if isinstance(vocab, int) else None, "max_positions": min(limits) if limits else None,
            "window": _window(config), "fields": _fields(config),
            "kind_only": {k: config[k] for k in ("model_type", "architectures") if k in config}}


def _fields(config: dict) -> dict | None:
    """The settings mlx-lm's model for ``config`` takes, with the values it computes with: its
    ``ModelArgs`` fields but ``model_type`` (``from_dict`` drops every other key; defaults
    filled); None where the model is not found."""
    import dataclasses

    try:
        _, args_class = _classes(config)
        fields = dataclasses.fields(args_class)
    except (ConversionError, TypeError):
        return None
    fields = [f for f in fields if f.name != "model_type"]  # the key that selects the model, not a setting of it
    try:
        args = args_class.from_dict(config)
        return {f.name: getattr(args, f.name, None) for f in fields}
    except Exception:  # noqa: BLE001 - a config its ModelArgs cannot take: the values as written
        return {f.name: config.get(f.name, None if _required(f) or f.default is dataclasses.MISSING else f.default)
                for f in fields}


# ----------------------------------------------------------------------------- composite or text-only
# A text model mlx-lm implements twice: on its own and inside its multimodal composite, which may differ.
#
# mlx-lm may implement the text part of a multimodal family under its own ``model_type``
# ``"<name>_text"`` AND inside the composite ``"<name>"`` (the composite reading a text-only
# checkpoint through its ``text_config``), and the two need not build the same model: the text-only
# module may lack layers the composite has (a mixture-of-experts feed-forward where the text-only
# module builds a dense one). The port then writes the form whose model holds the source's weights:
# the one whose parameter count is the source's (tensor names differ between the two forms, their
# sizes do not), the text-only form where both fit alike.


def _count(model) -> int | None:
    from mlx.utils import tree_flatten

    try:
        return sum(int(math.prod(v.shape)) for _, v in tree_flatten(model.parameters()))
    except Exception:  # noqa: BLE001 - a model whose parameters cannot be read has no count
        return None


_MISSING = re.compile(r"missing \d+ required positional arguments?: (.*)")


def _build_unset_as_none(composite: dict, build):
    """The composite built, the text settings its text part requires and the text-only model does not
    (a rope scaling: none where the config names none) set to None, as a config without them means."""
    try:
        return build(composite)
    except Exception as exc:  # noqa: BLE001 - read the names the composite's text part requires
        found = _MISSING.search(str(exc))
        if found is None:
            raise
        names = re.findall(r"'(\w+)'", found.group(1))
        if not names or any(n in composite["text_config"] for n in names):
            raise
        composite["text_config"].update({n: None for n in names})
        return build(composite)


def composite_if_it_fits_better(config: dict, shapes: dict[str, tuple[int, ...]], suffix: str, implements,
                                build) -> dict:
    """``config`` (a completed mlx-lm config of a ``"<name><suffix>"`` model), or the composite's
    ``{"model_type": "<name>", "text_config": config}`` where mlx-lm's composite holds as many
    weights as ``shapes`` (the source's tensors) and its text-only model does not.

    Args:
        config: mlx-lm's config for the text model (``model_type`` ending in ``suffix``).
        shapes: {tensor name: shape} of the source's weights.
        suffix: the text part's ``model_type`` suffix (``"_text"``).
        implements: ``model_type -> bool``, whether mlx-lm has a model for it.
        build: ``config -> model``, mlx-lm's model built lazily (raises where it cannot be built).

    Returns:
        The config to write (``config`` itself, unchanged, where the composite fits no better).
    """
    kind = config.get("model_type")
    if not shapes or not isinstance(kind, str) or not kind.endswith(suffix) or not implements(kind[:-len(suffix)]):
        return config
    want = sum(int(math.prod(s)) for s in shapes.values())
    composite = {"model_type": kind[:-len(suffix)], "text_config": dict(config)}
    try:
        own = _count(build(config))
    except Exception:  # noqa: BLE001 - a text model that cannot be built: the composite may be
        own = None
    try:
        other = _count(_build_unset_as_none(composite, build))
    except Exception:  # noqa: BLE001 - a composite that cannot be built from it is no choice
        return config
    if other is None or (own is not None and abs(own - want) <= abs(other - want)):
        return config
    return composite


def as_composite(config: dict, suffix: str) -> dict:
    """``config`` of a ``"<name><suffix>"`` text model as its composite's config (itself where it is
    no such text model)."""
    kind = config.get("model_type")
    if not isinstance(kind, str) or not kind.endswith(suffix):
        return config
    return {"model_type": kind[:-len(suffix)], "text_config": dict(config)}
