"""transformers model directories (``save_pretrained``: ``config.json`` and ``model*.safetensors``,
with or without an index, or the ``pytorch_model*.bin`` pickles transformers wrote before
safetensors, with or without ``pytorch_model.bin.index.json``), the model-directory verbs of ``db.port`` (see dense_bridge/ports/_dirs.py).

Everything about transformers directories lives here: which files make one, their names, how a
config is read and written, and how the tiny twin is made. The config given to and returned by
these verbs is transformers' own ``config.json`` dictionary, which is also the interchange form
the port passes between libraries (transformers 5 keeps rope settings under ``rope_parameters``).
"""
from __future__ import annotations

import contextlib
import glob
import os
import re

import numpy as np

from dense_bridge.adapter_kit import BackendUnavailableError, CheckpointError, ConversionError, Match, SafetensorsFile, \
    received
from dense_bridge.checkpoints._safetensors import read_json_file

FORMAT = "transformers"
CONFIG = "config.json"
#: The weight index transformers writes beside sharded safetensors files.
INDEX = "model.safetensors.index.json"
#: The weight index transformers wrote beside sharded ``pytorch_model*.bin`` pickles.
PICKLE_INDEX = "pytorch_model.bin.index.json"
#: Files besides the weights that transformers' loaders read (tokenizers, generation settings).
EXTRAS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
          "generation_config.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
          "added_tokens.json")
#: Sub-configs of a multimodal checkpoint's other towers: only its text part would be written.
MULTIMODAL_KEYS = ("vision_config", "audio_config", "speech_config", "image_config")
#: The setting of a tied output head, which a multimodal composite keeps at its top level.
TIE = "tie_word_embeddings"
#: Keys of config.json that ask for code stored outside the installed library.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
#: The twin's sizes: per-head width, vocabulary, layers (at least; a per-layer pattern keeps one period).
TWIN_HEAD_DIM, TWIN_VOCAB, TWIN_LAYERS, TWIN_POSITIONS, TWIN_WINDOW = 8, 64, 2, 512, 48


def _transformers():
    try:
        import transformers
    except ImportError:
        raise BackendUnavailableError("transformers model directories need the transformers package: "
                                      "pip install 'dense-bridge[port]'") from None
    return transformers


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars off and the log records of what it imports on first use (torchao's
    missing CUDA kernels, torch's pytree notices) held back: a port reports in its own words."""
    import logging

    from transformers.utils import logging as tlog

    bars = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
        if bars:
            tlog.enable_progress_bar()


def _weight_files(path: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "model*.safetensors")))


def _pickle_files(path: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "pytorch_model*.bin")))


class _TensorInfo:
    __slots__ = ("shape", "numpy_dtype")

    def __init__(self, shape: tuple[int, ...], numpy_dtype: np.dtype) -> None:
        self.shape, self.numpy_dtype = shape, numpy_dtype


class PickleWeights:
    """The tensors of one ``pytorch_model*.bin`` as the port reads a safetensors file (``tensors``:
    name -> info with ``shape`` and ``numpy_dtype``; ``get(name)``: a read-only numpy view, bfloat16
    as ml_dtypes; ``keys``, ``metadata``, ``close``).

    Read only by ``torch.load(weights_only=True, mmap=True)`` (``_files.read_state``): no code from the
    file runs, and anything but named tensors is refused by name. The zip format is memory-mapped,
    so a tensor's bytes are read when it is made into a destination tensor, not before. A legacy
    (pre-zip) pickle cannot be mapped and is refused, naming the file and how to re-save it.
    Tensors that share one storage (a tied head that ``torch.save`` kept beside its embedding) are
    one tensor: the first name holds it, the others are listed in ``aliases`` (name -> kept name),
    as ``save_pretrained`` drops them from safetensors files.
    """

    def __init__(self, path: str) -> None:
        import zipfile

        from ._files import read_state

        self.path, self.metadata = path, {}
        from dense_bridge.checkpoints._guard import input_file

        with input_file(path, what="pytorch_model.bin file") as handle:
            zipped = zipfile.is_zipfile(handle)
        if not zipped:
            raise CheckpointError(f"{path} is a legacy (pre-zip) torch pickle, which cannot be memory-mapped, so the "
                                  "port would have to read it whole: refused (nothing was written). Re-save the model "
                                  "with transformers' save_pretrained(..., safe_serialization=True), or torch.save it "
                                  "again with a torch of 1.6 or later, then port that")
        self._state = read_state(path, "torch-zip", None)
        self.tensors: dict[str, _TensorInfo] = {}
        self.aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        import torch

        from ._arrays import to_numpy

        for name, t in self._state.items():
            sig = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if t.numel() and sig in seen:
                self.aliases[name] = seen[sig]
                continue
            seen[sig] = name
            self.tensors[name] = _TensorInfo(tuple(t.shape), to_numpy(torch.empty(0, dtype=t.dtype)).dtype)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only numpy view of the mapped file (a copy only for a
        non-contiguous tensor)."""
        from ._arrays import to_numpy

        t = self._state[name]
        return to_numpy(t if t.is_contiguous() else t.contiguous())

    def close(self) -> None:
        self._state, self.tensors = {}, {}

    def __enter__(self) -> "PickleWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def port_open(fmt: str, path: str):
    """The weight file ``path`` of a transformers directory opened for streaming: a
    :class:`SafetensorsFile` (headers checked), or :class:`PickleWeights` for a ``.bin`` pickle."""
    if path.endswith(".bin"):
        return PickleWeights(path)
    return SafetensorsFile(path)


def port_detect(fmt: str, path: str) -> int:
    """How sure it is that ``path`` is a transformers directory (``Match``): a config.json and
    safetensors weights not tagged by another library (DEFAULT), else NO."""
    if not os.path.isfile(os.path.join(path, CONFIG)):
        return Match.NO
    files = _weight_files(path)
    if not files:
        return Match.DEFAULT if _pickle_files(path) else Match.NO
    try:
        with SafetensorsFile(os.path.join(path, files[0])) as f:
            tag = (f.metadata or {}).get("format", "")
    except CheckpointError:
        return Match.FITS  # a damaged file: read as transformers' to say what is wrong with it
    return Match.LIKELY if tag == "pt" else Match.DEFAULT if tag in ("", "np", "pytorch") else Match.FITS


def port_contents(fmt: str, path: str, text_only: bool = False) -> dict:
    """``{"config": dict, "weights": {tensor name: file name relative to path}, "extras": [names],
    "aliases": {name: the name it shares its storage with}}``.

    The weight map comes from the index when there is one, else from every ``model*.safetensors``
    file's header; without safetensors, from ``pytorch_model.bin.index.json`` or every
    ``pytorch_model*.bin`` (read by :class:`PickleWeights`: ``weights_only``, memory-mapped). Names
    a pickle stores as another's storage (``aliases``) are left out of ``weights``.

    A multimodal checkpoint (a config naming another tower, :data:`MULTIMODAL_KEYS`) is refused
    unless ``text_only``; then the text model alone is described (:func:`_text_part`): ``config``
    is its text sub-config, ``weights`` are keyed by the names the text model's own saver writes,
    ``file_keys`` maps those names to the keys stored in the files, ``dropped`` lists the stored
    keys of the other towers, which are not ported, ``whole_config`` is the checkpoint's own config. CheckpointError for a directory without weights; ConversionError for a config
    asking for remote code (``auto_map``, ``trust_remote_code``), which is never run.
    """
    config = read_json_file(os.path.join(path, CONFIG), "transformers config")
    for key in REMOTE_CODE_KEYS:
        if config.get(key):
            raise ConversionError(f"{os.path.join(path, CONFIG)} asks for code from outside the installed libraries "
                                  f"({key}={config[key]!r}): refused, never run (port only models transformers "
                                  "implements itself)")
    towers = [k for k in MULTIMODAL_KEYS if config.get(k)]
    if towers and not text_only:
        raise ConversionError(f"{path} is a multimodal checkpoint ({', '.join(towers)} in its {CONFIG}): only its text "
                              "part would be written, so it is refused unless asked (pass text_only=True, or "
                              "--text-only, to port the text model alone; nothing was written)")
    weights: dict[str, str] = {}
    pickles = not _weight_files(path) and not os.path.isfile(os.path.join(path, INDEX)) and (
        bool(_pickle_files(path)) or os.path.isfile(os.path.join(path, PICKLE_INDEX)))
    index = os.path.join(path, PICKLE_INDEX if pickles else INDEX)
    if os.path.isfile(index):
        data = read_json_file(index, "pytorch_model.bin index" if pickles else "safetensors index")
        wm = data.get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{index}: 'weight_map' is not an object of tensor name -> file name. "
                                  f"{received('weight_map', wm)}")
        weights = dict(wm)
    else:
        files = _pickle_files(path) if pickles else _weight_files(path)
        if not files:
            raise CheckpointError(f"{path} holds no model*.safetensors (nor pytorch_model*.bin) weights beside its "
                                  f"{CONFIG}")
        for name in files:
            with port_open(fmt, os.path.join(path, name)) as f:
                for key in f.keys():
                    weights[key] = name
    aliases: dict[str, str] = {}
    if pickles:  # a tensor torch.save stored once under two names is one source tensor
        for name in sorted(set(weights.values())):
            full = os.path.join(path, name)
            if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/") or not os.path.isfile(full):
                continue  # the port refuses it, naming the entry
            with port_open(fmt, full) as f:
                aliases.update(f.aliases)
        weights = {k: v for k, v in weights.items() if k not in aliases}
    extras = [n for n in EXTRAS if os.path.isfile(os.path.join(path, n))]
    out = {"config": config, "weights": weights, "extras": extras, "aliases": aliases}
    if towers and text_only:
        text_config, file_keys, dropped = _text_part(path, config, weights)
        out.update(config=text_config, weights={k: weights[f] for k, f in file_keys.items()}, file_keys=file_keys,
                   dropped=dropped, whole_config=config)
    return out


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _index_template(key: str) -> tuple[str, tuple[str, ...]]:
    """``key`` with each dotted integer (a layer, expert or head index) replaced by ``{}``, and the integers."""
    return _INDEX.sub("{}", key), tuple(_INDEX.findall(key))


def _saved(model, tmp: str) -> dict[str, bytes]:
    """Every tensor ``save_pretrained`` writes for ``model``: file key -> (shape, bytes)."""
    model.save_pretrained(tmp)
    out = {}
    for name in sorted(os.listdir(tmp)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(tmp, name)) as f:
                for k in f.keys():
                    a = f.get(k)
                    out[k] = (tuple(a.shape), a.tobytes())
    return out


def _text_part(path: str, config: dict, weights: dict[str, str]) -> tuple[dict, dict[str, str], list[str]]:
    """The text model of the multimodal checkpoint ``path``: (its config, {text model file key: key
    stored in the checkpoint}, [stored keys not ported]).

    Which stored tensor is which text-model tensor is learnt on tiny twins, as the port learns
    everything else: the whole model built by transformers from the config with every sub-config
    shrunk, its random parameters saved by ``save_pretrained``; the text model built from the shrunk
    text sub-config, given the whole model's decoder (``get_decoder``) and output head, saved too;
    each tensor of the second found by its bytes in the first. The pairs are generalised over
    dotted indices (layers, experts) and applied to the checkpoint's stored keys.
    """
    import tempfile

    import torch

    transformers = _transformers()
    whole = _config(config)
    text = whole.get_text_config()
    if text is whole:
        raise ConversionError(f"{path}: text_only=True, but transformers finds no text sub-config in its {CONFIG} "
                              f"(keys {sorted(config)[:16]})")
    text_key = next((k for k in (getattr(whole, "sub_configs", None) or {}) if getattr(whole, k, None) is text),
                    "text_config")
    text_dict = {k: v for k, v in text.to_dict().items() if k != "transformers_version"}
    tie = getattr(whole, TIE, None)
    if TIE not in text_dict and isinstance(tie, bool):  # the composite's setting, which its text model computes with
        text_dict[TIE] = tie
    small = dict(config)
    small[text_key] = port_shrink(FORMAT, text_dict)
    for k in MULTIMODAL_KEYS:
        if isinstance(config.get(k), dict) and config[k].get("model_type") in transformers.CONFIG_MAPPING:
            try:
                small[k] = port_shrink(FORMAT, config[k])
            except ConversionError:
                small[k] = dict(config[k])  # kept as it is: a tower without heads to shrink by
            _to_text_width(config[k], small[k], text_dict.get("hidden_size"), small[text_key].get("hidden_size"))
    small.pop("quantization_config", None)
    try:
        with _quiet(), tempfile.TemporaryDirectory(prefix="dense-bridge-text-part-") as tmp:
            a = _auto(small).from_config(_config(small), dtype=torch.float32).eval()
            _randomize(a, seed=0)
            saved_a = _saved(a, os.path.join(tmp, "whole"))
            if _composite(small[text_key]) is not None:  # no text model of its own: the whole one's text part
                b = _text_view(a)
            else:
                b = transformers.AutoModelForCausalLM.from_config(_config(small[text_key]), dtype=torch.float32).eval()
                b.get_decoder().load_state_dict(a.get_decoder().state_dict())
                head_a, head_b = a.get_output_embeddings(), b.get_output_embeddings()
                if head_b is not None and head_a is not None and head_b.weight is not b.get_input_embeddings().weight:
                    with torch.no_grad():
                        head_b.weight.copy_(head_a.weight)
            saved_b = _saved(b, os.path.join(tmp, "text"))
    except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise ConversionError(f"{path}: transformers cannot build the text model of this {config.get('model_type')!r} "
                              f"checkpoint alone: {str(exc).splitlines()[0][:300]}") from None
    by_bytes: dict[tuple, list[str]] = {}
    for k, v in saved_a.items():
        by_bytes.setdefault(v, []).append(k)
    rules: dict[str, str] = {}  # stored template -> text model template
    for k, v in saved_b.items():
        found = by_bytes.get(v, [])
        if len(found) != 1:
            raise ConversionError(f"{path}: the text model's tensor {k!r} is {'not' if not found else 'ambiguously'} "
                                  f"found among the whole model's on the twins ({found[:4]}): text_only cannot port it")
        (t_text, i_text), (t_whole, i_whole) = _index_template(k), _index_template(found[0])
        if i_text != i_whole:
            raise ConversionError(f"{path}: the text model's {k!r} is stored as {found[0]!r}, with other indices: "
                                  "text_only cannot generalise it")
        rules[t_whole] = t_text
    file_keys: dict[str, str] = {}
    dropped: list[str] = []
    for key in weights:
        t, idx = _index_template(key)
        if t in rules:
            file_keys[rules[t].format(*idx)] = key
        else:
            dropped.append(key)
    return text_dict, file_keys, sorted(dropped)


def port_complete_config(fmt: str, config: dict, shapes: dict) -> dict:
    """``config`` as it is, where transformers can load a directory written for it; ConversionError
    for a text sub-config transformers builds only inside a multimodal composite (:func:`_composite`):
    its loader would want the composite's other towers (a vision encoder), which the source does not
    hold, and a directory without them is no model ``from_pretrained`` reads."""
    found = _composite(config)
    if found is None:
        return config
    whole_cls, key = found
    transformers = _transformers()
    towers = sorted(k for k in (getattr(whole_cls, "sub_configs", None) or {}) if k != key)
    model = transformers.AutoModelForImageTextToText._model_mapping[whole_cls].__name__
    raise ConversionError(f"transformers {transformers.__version__} builds the text model {config.get('model_type')!r} "
                          f"only inside {model} (model_type {whole_cls.model_type!r}), whose checkpoint also holds the "
                          f"other towers ({', '.join(towers)}), which this source does not have: what would be "
                          "written is no model transformers loads (nothing was written). Port the original "
                          "multimodal transformers checkpoint, or keep the text model in a library that builds it "
                          "alone")


def port_common_config(fmt: str, config: dict) -> dict:
    """transformers' config is the interchange form, with every value transformers computes with
    written out (``save_pretrained`` leaves out those equal to the class's defaults, which another
    library then lacks: mlx-lm requires ``head_dim``); as given where transformers cannot read it."""
    try:
        cfg = _config(config)
        full = cfg.to_dict()
    except Exception:  # noqa: BLE001 - refused later, by name, where it is built
        return dict(config)
    full = _plain_floats(full)
    full.pop("transformers_version", None)
    for alias, name in (getattr(type(cfg), "attribute_map", None) or {}).items():  # other libraries' names
        if alias not in full and name in full:
            full[alias] = full[name]
    heads, hidden = full.get("num_attention_heads"), full.get("hidden_size")
    if full.get("head_dim") is None and isinstance(heads, int) and isinstance(hidden, int) and heads:
        full["head_dim"] = hidden // heads  # what transformers' attention computes with when it is unset
    return _plain_floats({**full, **config})


def _plain_floats(obj):
    """``obj`` with transformers' JSON stand-ins for infinities and NaN (``{"__float__": "Infinity"}``,
    which its ``to_dict`` writes and its config classes do not read back) as the floats they stand for."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(obj["__float__"].lower().replace("infinity", "inf"))
        return {k: _plain_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_floats(v) for v in obj]
    return obj


def _config_class(config: dict):
    transformers = _transformers()
    model_type = config.get("model_type")
    try:
        return transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ConversionError(f"transformers {transformers.__version__} does not implement model_type {model_type!r} "
                              f"(it offers {len(transformers.CONFIG_MAPPING)} model types, e.g. "
                              f"{sorted(transformers.CONFIG_MAPPING)[:12]})") from None


def _config(config: dict):
    cls = _config_class(config)
    rest = {k: v for k, v in _plain_floats(config).items() if k not in ("model_type", "transformers_version")}
    return cls(**rest)


def port_own_config(fmt: str, common: dict) -> dict:
    """The config.json transformers writes for ``common`` (its own standardisation: rope settings
    under ``rope_parameters``), the dictionary ``save_pretrained`` would write."""
    cfg = _config(common)
    out = _plain_floats(cfg.to_diff_dict())
    out.pop("transformers_version", None)
    return out


def _period(values: list) -> int:
    for p in range(1, len(values) + 1):
        if all(values[i] == values[i % p] for i in range(len(values))):
            return p
    return len(values)


def _keep_each(values: list, n: int) -> list:
    """The first ``n`` of a per-layer list, the last ones replaced by the kinds they would leave out
    (a list of dense layers then sparse ones keeps one of each)."""
    out = list(values[:n])
    missing = [v for v in dict.fromkeys(map(repr, values)) if v not in map(repr, out)]
    by_repr = {repr(v): v for v in values}
    for i, r in enumerate(missing[:n]):
        out[n - len(missing[:n]) + i] = by_repr[r]
    return out


def _index_lists(common: dict, out: dict, total) -> dict[str, list[int]]:
    """Lists of layer indices in ``common`` (increasing integers below the layer count ``total``: the
    full-attention layers), for the shrunk config ``out``: the indices of the same layer types in its
    ``layer_types`` where the list names exactly the layers of some types, else those still in range."""
    if not isinstance(total, int):
        return {}
    types, small_types = common.get("layer_types"), out.get("layer_types")
    n = next((v for k, v in out.items() if k in ("num_hidden_layers", "n_layer", "num_layers") and isinstance(v, int)),
             total)
    found = {}
    for k, v in common.items():
        if not (isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
                and v == sorted(set(v)) and v[-1] < total):
            continue
        if isinstance(types, list) and len(types) == total and isinstance(small_types, list):
            kinds = {repr(types[i]) for i in v}
            if v == [i for i, t in enumerate(types) if repr(t) in kinds]:
                found[k] = [i for i, t in enumerate(small_types) if repr(t) in kinds]
                continue
        found[k] = [i for i in v if i < n]
    return found


def _per_head_widths(config: dict, per_head: int, exact: str | None = None) -> None:
    """The per-head widths of ``config`` (``*_head_dim``, ``*_d_head``, ``rotary_dim``, and ``exact``)
    scaled in place as the head width ``per_head`` is to the twin's: latent attention's parts, the
    rotated part, a state-space layer's head width; in proportion, so sums stay sums."""
    for k, v in list(config.items()):
        if (k.endswith("_head_dim") or k.endswith("_d_head") or k in ("rotary_dim", exact)) and isinstance(v, int) \
                and not isinstance(v, bool) and v > 0:
            config[k] = max(2, 2 * round(v * TWIN_HEAD_DIM / per_head / 2))
            _keep_products(config, k, v, config[k])


def _rope_sections(config: dict, per_head: int) -> None:
    """Lists of positive ints inside the rope settings (``rope_*`` dicts) that split the rotary
    frequencies of a head (summing to half the head width ``per_head``, or to all of it: the
    sections of a multimodal rope) split the twin's head the same way, in proportion (largest
    remainders), in place."""
    for k, v in list(config.items()):
        if not (k.startswith("rope") and isinstance(v, dict)):
            continue
        new = dict(v)
        for name, parts in v.items():
            if not (isinstance(parts, list) and parts and all(isinstance(i, int) and not isinstance(i, bool) and i > 0
                                                                for i in parts)):
                continue
            if sum(parts) not in (per_head // 2, per_head):
                continue
            total = TWIN_HEAD_DIM * sum(parts) // per_head
            exact = [p * total / sum(parts) for p in parts]
            got = [int(x) for x in exact]
            for i in sorted(range(len(parts)), key=lambda i: -(exact[i] - got[i]))[:total - sum(got)]:
                got[i] += 1
            new[name] = got
        config[k] = new


def _keep_products(config: dict, key: str, before: int, after: int) -> None:
    """A width of ``key``'s family (``mamba_d_ssm`` beside ``mamba_d_head``) that was the head
    width ``before`` times the family's head count (``mamba_n_heads``) becomes ``after`` times it:
    a library that checks the product (transformers' Falcon-H1) still finds it."""
    prefix = key.rsplit("_", 2)[0] + "_" if key.count("_") >= 2 else None
    if prefix is None:
        return
    heads = [v for k, v in config.items() if k.startswith(prefix) and k.endswith("_heads") and isinstance(v, int)
             and not isinstance(v, bool) and v > 0]
    if len(heads) != 1:
        return
    for k, v in list(config.items()):
        if k != key and k.startswith(prefix) and isinstance(v, int) and not isinstance(v, bool) \
                and v == before * heads[0] and not k.endswith("_heads"):
            config[k] = after * heads[0]


def _layer_keys(value, total) -> dict[int, object] | None:
    """{layer index: key} when ``value`` is a dict of settings (dicts) keyed by layer indices (ints, or
    strings of digits such as ``"05"``) below ``total``, else None (a label map is no such dict)."""
    if not isinstance(value, dict) or not value or not isinstance(total, int) \
            or not all(isinstance(v, dict) for v in value.values()):
        return None
    out = {}
    for key in value:
        if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())):
            return None
        if int(key) >= total:
            return None
        out[int(key)] = key
    return out


def port_shrink(fmt: str, common: dict) -> dict:
    """``common`` (the interchange config) with widths, layer count and vocabulary shrunk and the
    structure kept: head counts and grouping, tying, biases, activation, norms, rope settings, one
    period of a per-layer pattern, a sliding window the inputs reach, special-token ids inside the
    shrunk vocabulary. Names go through the config class's ``attribute_map`` (GPT-2's ``n_embd``).

    Where transformers' config class rejects the shrunk config and it holds a count of a part of the
    layers (``num_*_layers`` below the layer count: the trailing layers that reuse earlier layers'
    key/value caches), that count shrinks with the layers, in proportion, at least one and leaving at
    least one layer outside it; where the class still rejects it (its constructor or one of its
    computed properties raises: no producer of some layer kind is left before the sharing layers),
    the twin grows by whole periods of the layer pattern until it accepts it (at most four more periods; past them the last config is returned and
    transformers names the problem when the twin is built).

    Args:
        fmt: the format name (unused: transformers' config classes judge every format's config).
        common: the interchange config (a transformers config dict, ``model_type`` set).

    Returns:
        The shrunk config dict (a new dict; ``common`` is unchanged).
    """
    out = _shrink(common)
    if not _part_counts(common) or _rejection(out) is None:  # a count its class does not couple stays as it is
        return out
    n_key = dict(getattr(_config_class(common), "attribute_map", {}) or {}).get("num_hidden_layers",
                                                                               "num_hidden_layers")
    types = common.get("layer_types")
    step = _period(types) if isinstance(types, list) and types else 1
    out = _shrink(common, parts=True)
    for _ in range(4):
        if _rejection(out) is None or not isinstance(out.get(n_key), int) \
                or out[n_key] >= common.get(n_key, 0):
            return out
        out = _shrink(common, at_least=out[n_key] + step, parts=True)
    return out


def _part_counts(common: dict) -> dict[str, int]:
    """{key: value} of ``common``'s counts of a part of the layers: ``num_*_layers`` integers (other than
    the layer count itself) above zero and below the layer count (the trailing layers that share
    earlier layers' caches); a count of separate layers (an encoder's, equal to or above it) is none."""
    amap = dict(getattr(_config_class(common), "attribute_map", {}) or {})
    n_key = amap.get("num_hidden_layers", "num_hidden_layers")
    total = common.get(n_key)
    if not isinstance(total, int) or isinstance(total, bool):
        return {}
    return {k: v for k, v in common.items() if k.startswith("num_") and k.endswith("_layers") and k != n_key
            and k not in amap and isinstance(v, int) and not isinstance(v, bool) and 0 < v < total}


def _rejection(config: dict) -> str | None:
    """Why transformers' config class rejects ``config`` (its constructor, or a computed property of
    the class such as the per-layer cache-sharing modes, raises ValueError), or None when it accepts it."""
    try:
        cfg = _config(config)
        base = _transformers().PreTrainedConfig
        names = [name for klass in type(cfg).__mro__ if issubclass(klass, base) and klass is not base
                 for name, attr in vars(klass).items() if isinstance(attr, property) and not name.startswith("_")]
        for name in names:  # the model's own properties (the base class's are generic, some only warn)
            try:
                getattr(cfg, name)
            except ValueError:
                raise
            except Exception:  # noqa: BLE001  a property that needs more than the config (a device, a tokenizer)
                continue
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001  anything else: not this shrink's to judge (the twin's build names it)
        return None
    return None


def _shrink(common: dict, at_least: int = 0, parts: bool = False) -> dict:
    """The body of :func:`port_shrink`: ``common`` shrunk to at least ``at_least`` layers (within the
    model's own count); with ``parts``, its counts of a part of the layers in proportion."""
    cls = _config_class(common)
    amap = dict(getattr(cls, "attribute_map", {}) or {})
    out = dict(common)

    def key(name):
        return amap.get(name, name)

    def get(name, default=None):
        return out.get(key(name), default)

    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    if not isinstance(hidden, int) or (not isinstance(heads, int) and "expand" not in out):
        raise ConversionError(f"cannot shrink the {common.get('model_type')!r} config into a twin: it has no integer "
                              f"num_attention_heads/hidden_size ({received('num_attention_heads', heads)})")
    head_dim = out.get("head_dim")
    if not isinstance(heads, int):  # no attention (a state-space model): widths that expand computes from
        heads, head_dim = 8, None
        if isinstance(out.get("time_step_rank"), int):
            out["time_step_rank"] = TWIN_HEAD_DIM
    small_hidden = heads * TWIN_HEAD_DIM
    if isinstance(head_dim, int):
        out["head_dim"] = TWIN_HEAD_DIM
        if head_dim * heads != hidden:  # widths that differ stay different (still a multiple of the heads)
            small_hidden = 2 * heads * TWIN_HEAD_DIM
    elif not isinstance(get("num_attention_heads"), int) and isinstance(out.get("num_heads"), int) \
            and isinstance(out.get("head_dim"), int) and isinstance(out.get("expand"), (int, float)) \
            and out["num_heads"] * out["head_dim"] == int(out["expand"] * hidden):
        # state-space heads that tile the expanded width (heads x head width = expand x hidden): they still do
        out["head_dim"] = TWIN_HEAD_DIM
        out["num_heads"] = max(1, int(out["expand"] * small_hidden) // TWIN_HEAD_DIM)
    per_head = head_dim if isinstance(head_dim, int) else hidden // heads if heads and hidden % heads == 0 else None
    if per_head:
        _per_head_widths(out, per_head)
        _rope_sections(out, per_head)
    for k, v in list(out.items()):  # low-rank latent widths
        if k.endswith("_lora_rank") and isinstance(v, int) and not isinstance(v, bool) and v > 4 * TWIN_HEAD_DIM:
            out[k] = 4 * TWIN_HEAD_DIM
    out[key("hidden_size")] = small_hidden
    if isinstance(out.get("expand"), (int, float)) and not isinstance(get("num_attention_heads"), int):
        out["intermediate_size"] = int(out["expand"] * small_hidden)  # the inner width expand gives
    def inner(width):  # an exact multiple of the width stays one (a library may compute it as such), else apart
        return width // hidden * small_hidden if width % hidden == 0 and width > hidden else 2 * small_hidden + 16

    if isinstance(get("intermediate_size"), int) and not isinstance(out.get("expand"), (int, float)):
        out[key("intermediate_size")] = inner(get("intermediate_size"))
    elif isinstance(get("intermediate_size"), list) and get("intermediate_size") \
            and all(isinstance(w, int) and not isinstance(w, bool) for w in get("intermediate_size")):
        out[key("intermediate_size")] = [inner(w) for w in get("intermediate_size")]  # one width per layer
    if isinstance(out.get("n_inner"), int):
        out["n_inner"] = inner(out["n_inner"])
    if isinstance(out.get("moe_intermediate_size"), int):
        out["moe_intermediate_size"] = small_hidden + 16
    layers = max(TWIN_LAYERS, at_least)
    types = out.get("layer_types")
    if isinstance(types, list) and types:
        layers = max(layers, _period(types))
        out["layer_types"] = [types[i % len(types)] for i in range(layers)]
    for pattern_key in ("sliding_window_pattern", "sliding_window_layers"):
        if isinstance(out.get(pattern_key), int):
            layers = max(layers, out[pattern_key])
    total = get("num_hidden_layers", layers)
    for k, v in out.items():  # a pattern of block kinds the layers cycle through (block_types): one whole cycle,
        # so every kind of block is in the twin (cut short, a kind the model needs is missing)
        if k != "layer_types" and k.endswith("_types") and isinstance(v, list) and isinstance(total, int) \
                and 1 < len(v) < total and all(isinstance(x, str) for x in v) and len(set(v)) > 1:
            layers = max(layers, len(v))
    out[key("num_hidden_layers")] = min(layers, total)
    for k, v in list(out.items()):  # another stack of as many layers (an encoder-decoder's decoder_layers): shrunk
        # alike, as the library sizes one per-layer cache for both from num_hidden_layers
        if k.endswith("_layers") and k != key("num_hidden_layers") and type(v) is int and v == total and v > 1:
            out[k] = out[key("num_hidden_layers")]
    small_n = out[key("num_hidden_layers")]
    if parts and isinstance(total, int) and isinstance(small_n, int) and small_n < total:
        for k, v in _part_counts(common).items():  # a part of the layers (the trailing cache-sharing ones) in
            # proportion: at least one layer in it and one outside it, so every role is in the twin
            out[k] = max(1, min(small_n - 1, round(v * small_n / total)))
    indices = _index_lists(common, out, total)
    for k, v in list(out.items()):  # settings per layer keyed by layer index (per_layer_config): the same layers kept
        keys = _layer_keys(v, total)
        if keys is not None:
            kept = _index_lists({**common, k: sorted(keys)}, out, total).get(k, [])
            width = max(len(str(x)) for x in v) if all(isinstance(x, str) for x in v) else 0
            types, small_types = common.get("layer_types"), out.get("layer_types")
            left, shrunk = sorted(keys), {}
            for new_i in kept[:len(left)]:  # each kept layer takes its setting from the first of its kind not yet used
                same = [i for i in left if not (isinstance(types, list) and isinstance(small_types, list))
                        or repr(types[i]) == repr(small_types[new_i])] or left
                old_i = same[0]
                left.remove(old_i)
                entry = dict(v[keys[old_i]]) if isinstance(v[keys[old_i]], dict) else v[keys[old_i]]
                if isinstance(entry, dict) and per_head:
                    _per_head_widths(entry, per_head, exact="head_dim")
                shrunk[str(new_i).zfill(width) if width else new_i] = entry
            out[k] = shrunk
    for k, v in list(out.items()):  # other per-layer lists (mlp_layer_types): each kind kept, one layer each
        if k in indices:
            out[k] = indices[k]
        elif k != "layer_types" and isinstance(v, list) and isinstance(total, int) and len(v) == total > layers:
            out[k] = _keep_each(v, out[key("num_hidden_layers")])
    if isinstance(out.get("sliding_window"), int):
        out["sliding_window"] = min(out["sliding_window"], TWIN_WINDOW)
    for k, v in list(out.items()):  # a count of positions selected (sparse attention's top-k): one the inputs exceed,
        # so both libraries run the selection (a top-k as large as the sequence is skipped by some)
        if k.endswith("topk") and isinstance(v, int) and not isinstance(v, bool) and v >= TWIN_POSITIONS:
            out[k] = TWIN_WINDOW // 2
    vocab = get("vocab_size")
    if isinstance(vocab, int) and vocab > TWIN_VOCAB:
        out[key("vocab_size")] = TWIN_VOCAB
        for k, v in list(out.items()):  # other tables of the same vocabulary (a per-layer input embedding)
            if k.startswith("vocab_size") and isinstance(v, int) and not isinstance(v, bool) and v > TWIN_VOCAB:
                out[k] = TWIN_VOCAB
        ids = sorted({v for k, v in out.items() if k.endswith("_token_id") and isinstance(v, int)}
                     | {i for k, v in out.items() if k.endswith("_token_id") and isinstance(v, list) for i in v})
        remap = {old: TWIN_VOCAB - 1 - n for n, old in enumerate(ids)}
        for k, v in list(out.items()):
            if k.endswith("_token_id") and isinstance(v, int):
                out[k] = remap[v]
            elif k.endswith("_token_id") and isinstance(v, list):
                out[k] = [remap[i] for i in v]
    if isinstance(get("max_position_embeddings"), int):
        out[key("max_position_embeddings")] = max(TWIN_POSITIONS, get("max_position_embeddings"))
    if isinstance(out.get("n_ctx"), int):
        out["n_ctx"] = max(TWIN_POSITIONS, out["n_ctx"])
    for alias, name in amap.items():  # names carried for other libraries follow the values shrunk
        if alias in out and name in out:
            out[alias] = out[name]
    out["dtype"] = "float32"
    out.pop("torch_dtype", None)
    for drop in ("quantization_config", "quantization"):
        out.pop(drop, None)
    return out


def _randomize(model, seed: int) -> None:
    """Every parameter drawn at random (seeded): a library's ones and zeros would make the twins'
    tensors indistinguishable (a swapped norm or a dropped bias would go unseen)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim <= 1:  # vectors and scalars (a learned activation's)
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _auto(config: dict):
    """transformers' auto class for ``config``: a sequence classifier or a sequence-to-sequence
    model where its ``architectures`` names one (transformers' own mappings say which), a causal language model where transformers
    maps the config class to one, else its image-text-to-text model where it maps it there (a
    multimodal checkpoint's whole model, or a text model transformers files only there)."""
    transformers = _transformers()
    from transformers.models.auto import modeling_auto

    arch = (config.get("architectures") or [None])[0]
    if arch in set(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values()):
        return transformers.AutoModelForSequenceClassification
    if arch in set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values()):
        return transformers.AutoModelForSeq2SeqLM  # the whole encoder-decoder, not its decoder alone
    try:
        cls = _config_class(config)
    except ConversionError:
        return transformers.AutoModelForCausalLM  # refused by name where it is built
    if cls not in transformers.AutoModelForCausalLM._model_mapping \
            and cls in transformers.AutoModelForImageTextToText._model_mapping:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def _composite(config: dict):
    """For a text sub-config that transformers builds no model of its own for (no causal language
    model, no image-text-to-text model maps its class): (the composite config class of the same
    model family that holds it as a sub-config and has an image-text-to-text model, the sub-config's
    key), else None."""
    transformers = _transformers()
    try:
        cls = _config_class(config)
    except ConversionError:
        return None
    mapped = (transformers.AutoModelForCausalLM._model_mapping, transformers.AutoModelForImageTextToText._model_mapping)
    if any(cls in m for m in mapped):
        return None
    family = cls.__module__.rsplit(".", 1)[0]
    for whole in dict.fromkeys(transformers.CONFIG_MAPPING.values()):
        if whole.__module__.rsplit(".", 1)[0] != family or whole not in mapped[1]:
            continue
        for key, sub in (getattr(whole, "sub_configs", None) or {}).items():
            if sub is cls:
                return whole, key
    return None


def _towers_shrunk(whole_cls, text_key: str, text: dict) -> dict:
    """The composite ``whole_cls``'s config dict with ``text`` as its text sub-config and every other
    sub-config its class default shrunk (kept as it is where it has no heads to shrink by)."""
    out = {text_key: text}
    if isinstance(text.get(TIE), bool):  # the composite ties its text model's head by its own setting
        out[TIE] = text[TIE]
    default = whole_cls()
    width = getattr(getattr(default, text_key, None), "hidden_size", None)
    for key in getattr(whole_cls, "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if key == text_key or sub is None or not hasattr(sub, "to_dict"):
            continue
        d = _plain_floats(sub.to_dict())
        d.pop("transformers_version", None)
        try:
            out[key] = port_shrink(FORMAT, d)
        except ConversionError:
            out[key] = dict(d)
        _to_text_width(d, out[key], width, text.get("hidden_size"))
    return out


def _to_text_width(tower: dict, small: dict, before, after) -> None:
    """A tower's width that is the text model's (``before``: its output projected onto the text
    embeddings) and that the tower's own shrink left as it was, set to the shrunk text width
    ``after`` in ``small`` (in place): a composite may require the two to match."""
    if not isinstance(before, int) or not isinstance(after, int):
        return
    for k, v in tower.items():
        if isinstance(v, int) and not isinstance(v, bool) and v == before and small.get(k) == v:
            small[k] = after


def _text_view(model):
    """``model`` (a multimodal model, built or loaded whole) with every submodule that holds none of
    its text model's parameters (those of ``get_decoder()`` and the output head) replaced by an empty
    module: the text model transformers builds only inside its composite, its state keyed as the
    composite stores it. A forward on token ids never reaches the modules emptied (the other
    towers run on the other modalities' inputs). Returns ``model``, changed in place."""
    import torch

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    keep = {id(p) for p in decoder.parameters()} | ({id(p) for p in head.parameters()} if head is not None else set())

    def strip(module):
        for name, child in list(module.named_children()):
            params = list(child.parameters())
            if params and not any(id(p) in keep for p in params):
                setattr(module, name, torch.nn.Module())
            elif params:
                strip(child)
    strip(model)
    return model


def _build(config: dict, dtype=None):
    """transformers' model for ``config`` built from the config (``from_config``): its auto class's
    (:func:`_auto`), or for a text sub-config transformers builds only inside a composite
    (:func:`_composite`), that composite with the other towers tiny, seen as its text model
    (:func:`_text_view`). ValueError where transformers has neither."""
    transformers = _transformers()
    kw = {} if dtype is None else {"dtype": dtype}
    found = _composite(config)
    if found is None:
        return _auto(config).from_config(_config(config), **kw)
    whole_cls, key = found
    text = {k: v for k, v in _plain_floats(config).items() if k != "transformers_version"}
    whole = whole_cls(**_towers_shrunk(whole_cls, key, text))
    return _text_view(transformers.AutoModelForImageTextToText.from_config(whole, **kw))


def port_twin(fmt: str, config: dict, seed: int = 0):
    """transformers' own causal LM for ``config`` (``AutoModelForCausalLM.from_config``), float32,
    eval mode, every parameter random."""
    transformers = _transformers()
    import torch

    try:
        with _quiet():
            model = _build(config, dtype=torch.float32)
    except ValueError as exc:
        raise ConversionError(f"transformers {transformers.__version__} has no causal language model for "
                              f"model_type {config.get('model_type')!r}: {str(exc).splitlines()[0][:300]}") from None
    model.eval()
    _randomize(model, seed)
    return model


def port_save(fmt: str, model, path: str) -> None:
    """``model`` written into the directory ``path`` by transformers' own ``save_pretrained``."""
    _transformers()
    with _quiet():
        model.save_pretrained(path)


def port_shapes(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter (state-dict key) of transformers' model for ``config`` with its shape, from a
    model built on the meta device (no memory)."""
    transformers = _transformers()
    import torch

    with torch.device("meta"), _quiet():
        model = _build(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def port_layout(fmt: str, count: int) -> dict:
    """File names for ``count`` weight files: ``{"shards", "index" (None for one file),
    "metadata" (the safetensors header metadata transformers writes), "config", "index_metadata"}``."""
    shards = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                         for i in range(count)]
    return {"shards": shards, "index": None if count == 1 else INDEX, "metadata": {"format": "pt"},
            "config": CONFIG, "extras": EXTRAS}


def port_example(fmt: str, path: str, seed: int = 0) -> None:
    """A tiny random transformers Llama (grouped-query attention, rope base 500000 as Llama 3 has it)
    saved into ``path`` by ``save_pretrained``: the demo's source."""
    transformers = _transformers()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=500000.0, tie_word_embeddings=False)
    with _quiet():
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        _randomize(model, seed)
        model.save_pretrained(path)


def port_load(fmt: str, path: str, text_only: bool = False):
    """The model as transformers' own loader reads the directory (``from_pretrained``), eval mode.
    ``text_only``: the text model of a multimodal checkpoint, built from its text sub-config and
    given the loaded model's decoder (``get_decoder``) and output head."""
    transformers = _transformers()
    with _quiet():
        whole = _auto(read_json_file(os.path.join(path, CONFIG), "transformers config")).from_pretrained(path).eval()
        if not text_only:
            return whole
        if _composite(whole.config.get_text_config().to_dict()) is not None:  # no text model of its own
            return _text_view(whole)
        text = transformers.AutoModelForCausalLM.from_config(whole.config.get_text_config(), dtype=whole.dtype)
    text.get_decoder().load_state_dict(whole.get_decoder().state_dict())
    head_w, head_t = whole.get_output_embeddings(), text.get_output_embeddings()
    if head_t is not None and head_w is not None and head_t.weight is not text.get_input_embeddings().weight:
        import torch

        with torch.no_grad():
            head_t.weight.copy_(head_w.weight)
    return text.eval()


def port_logits(fmt: str, model, ids: np.ndarray) -> np.ndarray:
    """Float32 logits (batch, positions, vocab) of ``model`` for the token ids ``ids`` (batch, positions)."""
    import torch

    device = next((p.device for p in model.parameters()), None)  # the ids go where the model is
    given = port_inputs(fmt, ids, model)
    with torch.no_grad():
        if isinstance(given, dict):
            out = model(**{k: torch.as_tensor(v, device=device) for k, v in given.items()}).logits
        else:
            out = model(torch.as_tensor(np.asarray(ids, np.int64), device=device)).logits
    return out.float().cpu().numpy()  # one copy to the host


def port_inputs(fmt: str, ids: np.ndarray, model=None):
    """``model``'s inputs for the token ids ``ids`` (batch, positions): ``[ids]``; for an
    encoder-decoder model the ids on both sides (``input_ids`` and ``decoder_input_ids``), since the
    decoder ids transformers makes by itself (the ids shifted right after a start id its config
    holds) are no input another library's model derives alike."""
    ids = np.asarray(ids)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return {"input_ids": ids.astype(np.int64), "decoder_input_ids": ids.astype(np.int64)}
    return [ids]


def _window(config: dict) -> int | None:
    """The sliding-window length of attention the config sets (the shortest, where several), or None."""
    found = [v for k, v in config.items() if k == "sliding_window" or k.endswith("_sliding_window")]
    found = [v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(found) if found else None


def port_describe(fmt: str, config: dict) -> dict:
    """``{"architecture", "vocab_size", "max_positions", "window", "fields", "kind_only"}`` of a transformers config (names
    through the config class's ``attribute_map``: GPT-2's ``n_positions``); None where it does not say
    (``fields``: the settings its config class declares, :func:`_fields`; ``kind_only``: a config naming
    only the model's kind, whose ``fields`` are the library's defaults)."""
    amap = dict(getattr(_config_class(config), "attribute_map", {}) or {})
    vocab = config.get(amap.get("vocab_size", "vocab_size"))
    limits = [config[k] for k in (amap.get("max_position_embeddings", "max_position_embeddings"), "n_ctx")
              if isinstance(config.get(k), int)]
    arch = config.get("architectures") or [config.get("model_type")]
    return {"architecture": arch, "kind": config.get("model_type"),
            "vocab_size": vocab if isinstance(vocab, int) else None, "max_positions": min(limits) if limits else None,
            "window": _window(config), "fields": _fields(config),
            "kind_only": {k: config[k] for k in ("model_type", "architectures") if k in config}}


def _fields(config: dict) -> dict | None:
    """The settings transformers' config class for ``config`` declares for its architecture (the
    annotated fields of the class and of its bases up to the generic config class, and the names
    of its ``attribute_map``), with the values its config object holds (defaults filled); None
    where the class is not found."""
    try:
        cls = _config_class(config)
    except ConversionError:
        return None
    base = _transformers().PreTrainedConfig
    names = set()
    for k in cls.__mro__:
        if k is base or not (isinstance(k, type) and issubclass(k, base)):
            continue
        names.update(getattr(k, "__annotations__", {}))
    amap = dict(getattr(cls, "attribute_map", {}) or {})
    names = (names | set(amap) | set(amap.values())) - {"model_type"}  # the key that selects the model
    try:
        with _quiet():
            obj = _config(config)
    except Exception:  # noqa: BLE001 - a config its class refuses: the values as written
        return {n: config.get(n) for n in names}
    return {n: getattr(obj, n, config.get(n)) for n in names}
