"""GGUF metadata <-> transformers config, tensor names and the q/k row permutation, all from the
libraries' own knowledge: transformers' GGUF loader (``GGUF_CONFIG_MAPPING``, ``load_gguf_checkpoint``,
``TENSOR_PROCESSORS``, ``get_gguf_hf_weights_map``) and gguf-py's architecture names.

- Reading: a file's config is what ``load_gguf_checkpoint`` makes of its metadata.
- Writing: the metadata is transformers' key table for the model type, inverted; the result is
  read back by ``load_gguf_checkpoint`` (from a metadata-only file) and every mapped value must
  come back equal, else the architecture is refused naming what would be lost.
- The architecture name written: the model type itself where gguf-py names it, else the
  architecture whose file transformers' loader reads back as that model type (a model type
  llama.cpp writes under another architecture: that one, with general.name saying the model type), found by asking that loader, not a table of ours.
- The permutation: transformers' tensor processor for the file's architecture undoes what
  llama.cpp's converter did (``process``); the writer applies its inverse, found by running the
  processor on row indices, so it applies exactly where the reader undoes it.
"""
from __future__ import annotations

import functools
import os
import tempfile

import numpy as np

from dense_bridge.adapter_kit import ConversionError, received

#: transformers config keys that are no computation setting (names, dtype, loading options).
IGNORED = ("architectures", "transformers_version", "dtype", "torch_dtype", "name_or_path", "model_type",
           "output_attentions", "output_hidden_states", "return_dict", "use_cache", "tokenizer_class")
#: Metadata keys that are not hyperparameters (written from the tokenizer files, or by the writer).
NOT_CONFIG = ("tokenizer.", "general.file_type", "general.quantization_version", "split.")


def _ggml():
    from transformers.integrations import ggml
    from transformers import modeling_gguf_pytorch_utils as utils

    return ggml, utils


def gguf_type_of(value):
    """The GGUF value type (and array sub type) a metadata value is written with."""
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, bool):
        return T.BOOL, None
    if isinstance(value, int):
        return (T.UINT32 if 0 <= value < 2 ** 32 else T.INT64), None
    if isinstance(value, float):
        return T.FLOAT32, None
    if isinstance(value, str):
        return T.STRING, None
    if isinstance(value, (list, tuple)):
        sub = gguf_type_of(value[0])[0] if value else T.INT32
        if sub == T.UINT32:
            sub = T.INT32 if all(v < 2 ** 31 for v in value) else sub
        return T.ARRAY, sub
    raise ConversionError(f"a GGUF metadata value of type {type(value).__name__} cannot be written: {value!r}")


def _float_keys() -> tuple[str, ...]:
    """The suffixes of the hyperparameter keys llama.cpp reads as float32 (gguf-py's key names): a
    config that spells such a value as an integer (``"rope_theta": 10000`` in a JSON file) is
    written as a float, which llama.cpp requires."""
    import gguf

    K = gguf.Keys
    names = [(K.Rope, "FREQ_BASE"), (K.Rope, "FREQ_BASE_SWA"), (K.Rope, "SCALING_FACTOR"),
             (K.Rope, "SCALING_ATTN_FACTOR"), (K.Rope, "SCALING_YARN_LOG_MUL"), (K.Attention, "LAYERNORM_EPS"),
             (K.Attention, "LAYERNORM_RMS_EPS"), (K.Attention, "SCALE"), (K.Attention, "CLAMP_KQV"),
             (K.Attention, "MAX_ALIBI_BIAS"), (K.LLM, "LOGIT_SCALE"), (K.LLM, "EMBEDDING_SCALE"),
             (K.LLM, "RESIDUAL_SCALE"), (K.LLM, "ATTN_LOGIT_SOFTCAPPING"), (K.LLM, "FINAL_LOGIT_SOFTCAPPING")]
    return tuple(getattr(c, n).split("{arch}.", 1)[-1] for c, n in names if hasattr(c, n))


def typed(metadata: dict) -> dict:
    """{key: (value, type, sub type)} for the writer (an integer under a float key as a float)."""
    out = {}
    floats = _float_keys()
    for k, v in metadata.items():
        if isinstance(v, int) and not isinstance(v, bool) and "." in k and k.split(".", 1)[1] in floats:
            v = float(v)
        vtype, sub = gguf_type_of(v)
        out[k] = (list(v) if isinstance(v, tuple) else v, vtype, sub)
    return out


def write_metadata_only(path: str, metadata: dict, tensor_names=()) -> None:
    """A GGUF file holding ``metadata`` and, for each name, a one-element float32 tensor (the
    loader reads a tied head from the absence of ``output.weight``)."""
    import gguf

    w = gguf.GGUFWriter(path, metadata["general.architecture"])
    for k, (v, t, s) in typed(metadata).items():
        if k != "general.architecture":
            w.add_key_value(k, v, t, sub_type=s)
    for n in tensor_names:
        w.add_tensor(n, np.zeros(1, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def config_of_file(path: str) -> dict:
    """transformers' config for the GGUF file ``path`` as its GGUF loader reads it."""
    _, utils = _ggml()
    try:
        parsed = utils.load_gguf_checkpoint(path, return_tensors=False)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ConversionError(f"transformers' GGUF loader cannot read {path}: {str(exc).splitlines()[0][:300]} "
                              f"(it maps {sorted(utils.GGUF_SUPPORTED_ARCHITECTURES)})") from None
    return dict(parsed["config"])


def config_of_metadata(metadata: dict, tied: bool) -> dict:
    """transformers' config for a file holding ``metadata`` (an ``output.weight`` unless ``tied``)."""
    with tempfile.TemporaryDirectory(prefix="dense-bridge-gguf-") as tmp:
        path = os.path.join(tmp, "probe.gguf")
        write_metadata_only(path, metadata, () if tied else ("output.weight",))
        config = with_head_dim(config_of_file(path), metadata)
    return inside_vocabulary(config)


def inside_vocabulary(config: dict) -> dict:
    """``config`` with every special-token id the file's vocabulary does not hold unset: the loader
    leaves the config class's defaults (Phi-3's pad id 32000), which refer to another vocabulary."""
    import dense_bridge.backends.torch._ports as tp

    vocab = config.get("vocab_size")
    if not isinstance(vocab, int):
        return config
    cls = tp._config_class(config)
    defaults = cls().to_dict()
    out = dict(config)
    for key, value in defaults.items():
        if key.endswith("_token_id") and key not in out and isinstance(value, int) and value >= vocab:
            out[key] = None
    for key, value in list(out.items()):
        if key.endswith("_token_id") and isinstance(value, int) and value >= vocab:
            out[key] = None
    return out


def _key_length(arch: str) -> str:
    import gguf

    return gguf.Keys.Attention.KEY_LENGTH.format(arch=arch)


def with_head_dim(config: dict, metadata: dict) -> dict:
    """``config`` with ``head_dim`` from llama.cpp's ``attention.key_length`` (gguf-py's key) where
    transformers' key table for the model type does not read it (for some model types its loader would take the
    class default)."""
    ggml, _ = _ggml()
    arch = metadata.get("general.architecture")
    value = metadata.get(_key_length(arch)) if arch else None
    table = ggml.GGUF_CONFIG_MAPPING.get(config.get("model_type"), {})
    if isinstance(value, int) and "head_dim" not in table.values():
        config = dict(config, head_dim=value)
    return config


@functools.lru_cache(maxsize=None)
def architecture_for(model_type: str) -> tuple[str, str]:
    """(general.architecture, general.name) that transformers' GGUF loader reads back as
    ``model_type``; ConversionError naming the architectures it maps otherwise."""
    import gguf

    ggml, utils = _ggml()
    mapped = ggml.GGUF_CONFIG_MAPPING
    names = set(gguf.MODEL_ARCH_NAMES.values())
    if model_type not in mapped or model_type in ("general", "tokenizer"):
        raise ConversionError(f"transformers' GGUF loader maps no model type {model_type!r}: GGUF files are written "
                              f"for the architectures it maps ({sorted(k for k in mapped if k not in ('general', 'tokenizer'))})")
    candidates = [model_type] if model_type in names else []
    candidates += sorted(a for a in mapped if a in names and a != model_type and mapped[a] == mapped[model_type])
    for arch in candidates:
        for name in (model_type, arch):
            got = config_of_metadata({"general.architecture": arch, "general.name": name}, tied=True)
            if got.get("model_type") == model_type:
                return arch, name
    raise ConversionError(f"no GGUF architecture known to gguf-py is read back by transformers as {model_type!r} "
                          f"(tried {candidates})")


def _states_head_dim(cfg, head_dim: int) -> bool:
    """Whether the config's own saver writes ``head_dim`` (its class takes it), or it differs from the
    width per head: llama.cpp's converter writes the key length exactly when config.json holds it."""
    import inspect

    if "head_dim" in inspect.signature(type(cfg).__init__).parameters:
        return True
    heads, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    return not (isinstance(heads, int) and isinstance(hidden, int) and heads and head_dim == hidden // heads)


def _value_in(cfg, key: str):
    value = getattr(cfg, key, None)
    if value is None:
        rope = getattr(cfg, "rope_parameters", None) or {}
        if isinstance(rope, dict):
            value = rope.get(key)
    return value


def metadata_of_config(common: dict) -> tuple[dict, bool]:
    """(GGUF metadata, tied head) for the transformers config ``common``: transformers' own key table
    for its model type, inverted. ConversionError naming a setting the loader would not read back."""
    import dense_bridge.backends.torch._ports as tp

    ggml, _ = _ggml()
    model_type = common.get("model_type")
    arch, name = architecture_for(model_type)
    cfg = tp._config(common)
    meta = {"general.architecture": arch, "general.name": name}
    table = ggml.GGUF_CONFIG_MAPPING[model_type]
    for gguf_key, hf_key in table.items():
        if not hf_key or hf_key == -1:
            continue
        value = _value_in(cfg, hf_key)
        if isinstance(value, (bool, int, float, str)) or (isinstance(value, list) and value):
            meta[f"{arch}.{gguf_key}"] = value
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    head_dim = getattr(cfg, "head_dim", None)
    if isinstance(head_dim, int) and "head_dim" not in table.values() and _states_head_dim(cfg, head_dim):
        import gguf

        meta[_key_length(arch)] = head_dim
        meta[gguf.Keys.Attention.VALUE_LENGTH.format(arch=arch)] = head_dim
    back = config_of_metadata(meta, tied)
    back_cfg = tp._config(back)
    lost = []
    for key in sorted(set(cfg.to_dict()) | set(back_cfg.to_dict())):
        if key.startswith("_") or key in IGNORED or key.endswith("_token_id"):  # ids: the tokenizer's metadata
            continue
        a, b = _value_in(cfg, key), _value_in(back_cfg, key)
        if a is None:  # unset in the source (no window, no scaling): the loader's default is its own reading
            continue
        if key == "head_dim" and isinstance(a, int) and not _states_head_dim(cfg, a):
            continue  # the width per head, which the model computes from the widths read back
        if a != b and not (isinstance(a, float) and isinstance(b, float) and np.float32(a) == np.float32(b)):
            lost.append(f"{key}={a!r} (read back as {b!r})")
    if lost:
        raise ConversionError(f"a GGUF file of architecture {arch!r} cannot carry this {model_type!r} config: "
                              f"transformers' GGUF loader would read {', '.join(lost[:8])}")
    return meta, tied


# ------------------------------------------------------------------ names and the permutation
def processor_for(arch: str, config: dict):
    """transformers' tensor processor for the GGUF architecture ``arch`` (its default where it has none)."""
    _, utils = _ggml()
    return utils.TENSOR_PROCESSORS.get(arch, utils.TensorProcessor)(config=config)


def names_of(model, arch: str, config: dict) -> dict[str, str]:
    """{GGUF tensor name: transformers state-dict key} for ``model`` (gguf-py's name map through
    transformers' ``get_gguf_hf_weights_map``)."""
    _, utils = _ggml()
    try:
        return dict(utils.get_gguf_hf_weights_map(model, processor_for(arch, config), model_type=arch))
    except NotImplementedError as exc:
        raise ConversionError(f"gguf-py names no tensors for this model: {str(exc).splitlines()[0][:200]}") from None


def row_order(processor, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The rows of the tensor ``name`` as transformers' processor reorders them when reading
    (``read = stored[order]``), None where it leaves them in place."""
    rows = np.arange(shape[0], dtype=np.float64).reshape((shape[0],) + (1,) * (len(shape) - 1))
    probe = np.broadcast_to(rows, (shape[0],) + tuple(1 for _ in shape[1:])).copy()
    out = processor.process(weights=probe, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}).weights
    order = np.asarray(out).reshape(shape[0], -1)[:, 0].astype(np.int64)
    if np.array_equal(order, np.arange(shape[0])):
        return None
    return order


def unpermute(processor, name: str, data: np.ndarray) -> np.ndarray:
    order = row_order(processor, name, data.shape)
    return data if order is None else data[order]


def permute(processor, name: str, data: np.ndarray) -> np.ndarray:
    """The inverse of :func:`unpermute`: what llama.cpp stores for the logical tensor ``data``."""
    order = row_order(processor, name, data.shape)
    if order is None:
        return data
    out = np.empty_like(data)
    out[order] = data
    return out
