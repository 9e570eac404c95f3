"""GGUF files (llama.cpp's format), the port verbs of ``db.port`` (see dense_bridge/ports/_dirs.py).

No framework runs GGUF here, so its twin is the model transformers' own GGUF loader makes of a file:
the "config" these verbs take and give is the file's hyperparameter metadata (``{"metadata":
{key: value}, "tied": bool}``), read into transformers' config by its GGUF loader (``_config``);
the twin is transformers' causal LM for that config; ``port_save`` writes it as a GGUF file with
llama.cpp's tensor names (gguf-py's name map) and llama.cpp's encoding of each tensor.

The tensors the port core sees are logical: numpy order (GGUF's dimensions reversed, so a weight
matrix is (out, in) as transformers holds it) and transformers' row order. What llama.cpp's file
does to them (the q/k row permutation of llama-family models, the reversed dimensions, the
quantization) is applied in this adapter's writer (``port_write``) and undone in its reader
(``port_open``), so the port's recipes, learnt by value between the twins' saved files, are copies.

The core writes a file format that writes its own files through the optional ``port_write`` verb.
"""
from __future__ import annotations

import os

import numpy as np

from dense_bridge.adapter_kit import BackendUnavailableError, CheckpointError, ConversionError, Match, received

from . import _config

FORMAT = "gguf"
SUFFIX = ".gguf"
MAGIC = b"GGUF"
#: outtype -> the GGUF tensor type of the matrices (norms, biases and other 1-D tensors stay F32, as
#: llama.cpp's converter and reader expect).
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "keep")
#: outtypes quantized by llama.cpp's own quantizer (llama-cpp-python): ``_llama_cpp.OUTTYPES``
LLAMA_CPP_OUTTYPES = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "q5_0",
                      "q5_1")


def _need():
    try:
        import gguf  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(f"GGUF files need the gguf and transformers packages ({exc.name} is missing): "
                                      "pip install 'dense-bridge[port]'") from None


def _open(path: str):
    from ._file import open_gguf

    return open_gguf(path)


def _output():
    from ._writer import GGUFOutput

    return GGUFOutput


def port_inspect(fmt: str, path: str) -> dict:
    """What ``dense-bridge inspect`` shows of the GGUF file ``path`` (``_file.describe``): its
    tensors and linear layers with their stored types."""
    from ._file import describe

    return describe(path)


def _tp():
    import dense_bridge.backends.torch._ports as tp

    return tp


def _files(path: str) -> list[str]:
    """The GGUF file ``path`` (or the one in the directory ``path``) and its split siblings, first first."""
    if os.path.isdir(path):
        found = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX))
        if not found:
            raise CheckpointError(f"{path} holds no {SUFFIX} file")
        path = os.path.join(path, found[0])
    base = os.path.basename(path)
    import re

    m = re.match(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", base)
    if not m:
        return [path]
    count = int(m.group(3))
    names = [f"{m.group(1)}-{i + 1:05d}-of-{count:05d}{SUFFIX}" for i in range(count)]
    missing = [n for n in names if not os.path.isfile(os.path.join(os.path.dirname(path), n))]
    if missing:
        raise CheckpointError(f"{path} is one of {count} split GGUF files, but {missing} are missing")
    return [os.path.join(os.path.dirname(path), n) for n in names]


def port_detect(fmt: str, path: str) -> int:
    """CERTAIN for a file beginning with GGUF's magic, else NO (directories are other formats')."""
    if not os.path.isfile(path):
        return Match.NO
    from dense_bridge.checkpoints._guard import input_file

    try:
        with input_file(path, what="GGUF file") as f:
            return Match.CERTAIN if f.read(4) == MAGIC else Match.NO
    except (OSError, CheckpointError):
        return Match.NO


def _own_config(meta: dict, tensor_names) -> dict:
    keep = {k: v for k, v in meta.items() if not k.startswith(_config.NOT_CONFIG)}
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" not in keep and isinstance(tokens, list):
        keep[f"{arch}.vocab_size"] = len(tokens)  # where transformers' loader takes it when the key is absent
    return {"metadata": keep, "tied": "output.weight" not in set(tensor_names)}


def port_contents(fmt: str, path: str, text_only: bool = False) -> dict:
    """``{"config", "weights": {GGUF tensor name: file name}, "extras": []}`` of the GGUF file
    ``path`` (or of the one in the directory ``path``), split files included."""
    _need()
    if text_only:
        raise ConversionError(f"{path}: text_only is not implemented for GGUF sources (nothing was written)")
    with _open(_files(path)[0]) as f:  # every part of a split model, checked by the file layer
        meta = dict(f.metadata)
        weights = {name: os.path.basename(f.tensors[name].path) for name in f.keys()}
    return {"config": _own_config(meta, weights), "weights": weights, "extras": [], "gguf_metadata_keys": len(meta)}


def port_common_config(fmt: str, config: dict) -> dict:
    """transformers' config of a file holding this metadata, as its GGUF loader reads it."""
    _need()
    common = _config.config_of_metadata(config["metadata"], config["tied"])
    # transformers' GGUF loader computes in float32 (every GGUF type dequantizes exactly into it);
    # a directory holding F16 matrices beside F32 norms is read so too, not as its first tensor's dtype
    common.setdefault("dtype", "float32")
    return common


def port_own_config(fmt: str, common: dict) -> dict:
    """The GGUF metadata of the transformers config ``common`` (ConversionError for an architecture
    transformers' GGUF loader does not map, or a setting it would not read back)."""
    _need()
    meta, tied = _config.metadata_of_config(common)
    return {"metadata": meta, "tied": tied}


def port_shrink(fmt: str, common: dict) -> dict:
    raise ConversionError("GGUF does not shrink interchange configs: transformers does")


def port_twin(fmt: str, config: dict, seed: int = 0):
    """transformers' causal LM for the file's config, float32, every parameter random."""
    return _tp().port_twin("transformers", port_common_config(fmt, config), seed)


def _arch(config: dict) -> str:
    return config["metadata"]["general.architecture"]


def _processor(config: dict):
    return _config.processor_for(_arch(config), port_common_config(FORMAT, config))


def _model_names(model, config: dict) -> dict[str, str]:
    """{transformers key: GGUF name} for every parameter of ``model``; ConversionError naming one
    gguf-py's map does not name."""
    names = _config.names_of(model, _arch(config), model.config.to_dict())
    inverse = {hf: g for g, hf in names.items()}
    state = model.state_dict()
    missing = [k for k in state if k not in inverse]
    if missing:
        raise ConversionError(f"gguf-py's tensor names for architecture {_arch(config)!r} do not name the "
                              f"transformers parameters {missing[:6]}: such a model cannot be written as GGUF")
    return inverse


def _stored(model) -> list[str]:
    """The state-dict keys ``save_pretrained`` would write: a parameter tied to an earlier one is not."""
    seen, out = set(), []
    for k, v in model.state_dict().items():
        ptr = (v.data_ptr(), tuple(v.shape))
        if ptr in seen:
            continue
        seen.add(ptr)
        out.append(k)
    return out


def port_save(fmt: str, model, path: str) -> None:
    """``model`` written into the directory ``path`` as ``model.gguf``: llama.cpp's names, F32,
    the permutation applied where transformers' reader undoes it, a tied head not written."""
    import torch

    config = port_own_config(fmt, _tp().port_own_config("transformers", model.config.to_dict()))
    names = _model_names(model, config)
    state = model.state_dict()
    tensors = {}
    for k in _stored(model):
        with torch.no_grad():
            tensors[names[k]] = state[k].detach().float().numpy()
    os.makedirs(path, exist_ok=True)
    _write(os.path.join(path, "model" + SUFFIX), config, tensors, "f32", extras=None)


def port_shapes(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the GGUF file for ``config`` (a tied head included, though not stored) with
    its logical shape, from transformers' model built on the meta device."""
    import torch

    tp = _tp()
    common = port_common_config(fmt, config)
    with torch.device("meta"), tp._quiet():
        model = tp._transformers().AutoModelForCausalLM.from_config(tp._config(common))
    names = _model_names(model, config)
    return {names[k]: tuple(v.shape) for k, v in model.state_dict().items()}


def port_layout(fmt: str, count: int) -> dict:
    """One file: the destination is the file itself (``port_write``)."""
    return {"shards": ["model" + SUFFIX], "index": None, "metadata": None, "config": None, "extras": ()}


def port_load(fmt: str, path: str):
    """The model transformers' own GGUF loader makes of the file (``from_pretrained(gguf_file=)``)."""
    tp = _tp()
    first = _files(path)[0]
    try:
        with tp._quiet():
            return tp._transformers().AutoModelForCausalLM.from_pretrained(
                os.path.dirname(os.path.abspath(first)), gguf_file=os.path.basename(first)).eval()
    except (NotImplementedError, RuntimeError):
        # transformers 5 maps a file whose general.name is a model type other than its architecture to
        # that model type's config, then asks gguf-py for an architecture of that name to name the
        # tensors, which gguf-py may lack; for some model types it reads no head_dim (the class
        # default, mismatching the tensors): the same steps, with the file's own architecture and
        # key_length
        return _load_by_parts(first)


def _load_by_parts(path: str):
    """transformers' model of the GGUF file ``path`` built as its GGUF loader builds it (its config,
    its tensor processor, gguf-py's names for the file's architecture), float32."""
    import torch

    tp = _tp()
    with _open(path) as f:
        config = _config.with_head_dim(_config.config_of_file(path), f.metadata)
    with tp._quiet():
        model = tp._transformers().AutoModelForCausalLM.from_config(tp._config(config), dtype=torch.float32).eval()
    reader = _Logical(path)
    try:
        arch = reader.file.metadata.get("general.architecture")
        names = _config.names_of(model, arch, config)
        state = {names[n]: torch.from_numpy(np.array(reader.get(n), np.float32)) for n in reader.keys() if n in names}
    finally:
        reader.close()
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    left = [k for k in missing if k not in state and not any(k in t for t in _tied_keys(model))]
    if left or unexpected:
        raise CheckpointError(f"{path}: the GGUF file lacks {left[:6]} or holds {list(unexpected)[:6]}")
    return model


def _tied_keys(model) -> list[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return list(keys) if not isinstance(keys, str) else [keys]


def port_logits(fmt: str, model, ids: np.ndarray) -> np.ndarray:
    return _tp().port_logits("transformers", model, ids)


def port_describe(fmt: str, config: dict) -> dict:
    """``{"architecture", "kind", "vocab_size", "max_positions"}`` of the file's config (the GGUF
    architecture name), or of an interchange config (the port's full verification passes that)."""
    if "metadata" not in config:
        return _tp().port_describe("transformers", config)
    out = _tp().port_describe("transformers", port_common_config(fmt, config))
    out["architecture"] = [_arch(config)]
    return out


def port_example(fmt: str, path: str, seed: int = 0) -> None:
    raise ConversionError("GGUF offers no example model of its own")


# ------------------------------------------------------------------ reading
class _Logical:
    """A GGUF file read as the port core reads weight files (``tensors``: name -> info with the
    logical ``shape`` and ``numpy_dtype``; ``get``; ``keys``; ``close``): dequantized by gguf, the
    permutation undone by transformers' tensor processor for the file's architecture."""

    def __init__(self, path: str) -> None:
        self.file = _open(path)  # a part of a split model opens every part
        meta = self.file.metadata
        arch = meta.get("general.architecture")
        config = _config.with_head_dim(_config.config_of_file(self.file.path), meta)
        self.processor = _config.processor_for(arch, config)
        self.tensors = self.file.tensors
        #: quantized tensors (read as their exact dequantization) -> their GGUF type's name
        self.quantized = {n: i.type_name for n, i in self.tensors.items() if i.quantized}

    def keys(self):
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        return _config.unpermute(self.processor, name, self.file.get(name))

    def stored(self, name: str) -> np.ndarray:
        """The bytes tensor ``name`` is stored as (uint8, flat: the file's own encoding, rows in
        llama.cpp's order), what ``port_recompute_codes`` recomputes."""
        return self.file.raw(name).reshape(-1)

    def code_info(self, name: str) -> dict | None:
        """What stands behind the float tensor ``name`` (None for a float one): {"ggml_type",
        "tensors": {"blocks": name}, "files": {"blocks": file}, "dequantize": words}."""
        kind = self.quantized.get(name)
        if kind is None:
            return None
        rel = os.path.basename(self.tensors[name].path)
        return {"ggml_type": kind, "tensors": {"blocks": name}, "files": {"blocks": rel},
                "dequantize": f"gguf.quants.dequantize ({kind} blocks)"}

    def codes_of(self, name: str) -> dict | None:
        """The codes of the quantized tensor ``name`` in MLX's layout, moved, not requantized
        (``_codes.to_mlx_affine``: Q4_0/Q4_1/Q8_0/Q4_K -> affine group 32, float32 scales and biases;
        ``to_mlx_mxfp4``: MXFP4 -> mxfp4), rows in logical order (the permutation undone on each of
        ``weight``/``scales``/``biases``): {"weight", "scales", "biases" (affine), "bits",
        "group_size", "mode", "ggml_type", "qcodes", "scale", "offset"? (canonical), "note"}.
        None for a float tensor; ConversionError naming the tensor and its type for any other
        quantized type (keep_codes cannot move its codes)."""
        from . import _codes

        kind = self.quantized.get(name)
        if kind is None:
            return None
        info = self.tensors[name]
        if kind in _codes.MLX_AFFINE_BITS:
            w, scales, biases = _codes.to_mlx_affine(self.file.raw(name), info.ggml_type, info.shape)
            out = {"weight": w, "scales": scales, "biases": biases, "bits": _codes.MLX_AFFINE_BITS[kind],
                   "group_size": 32, "mode": "affine"}
            out["note"] = ("bit for bit" if kind in ("Q4_1", "Q4_K") else
                           "equal in value; bit for bit but the sign of zero (gguf's d * 0 is -0.0 for a negative d, "
                           "MLX's scale * q + bias is +0.0)")
        elif kind == "MXFP4":
            w, scales = _codes.to_mlx_mxfp4(self.file.raw(name), info.shape)
            out = {"weight": w, "scales": scales, "bits": 4, "group_size": 32, "mode": "mxfp4",
                   "note": "equal in value; bit for bit but the sign of zero (FP4 code 8 is -0.0 to MLX, +0.0 to gguf)"}
        else:
            raise ConversionError(f"{info.path}: tensor {name!r} is {kind}, whose codes have no exact MLX layout "
                                  f"(keep_codes moves {', '.join(_codes.MLX_AFFINE_BITS)} and MXFP4): port without "
                                  f"keep_codes to dequantize it exactly (nothing was written)")
        # canonical codes (ports/_codes.py): (units, in) unsigned codes, per-group scale and offset
        words = np.ascontiguousarray(out["weight"]).astype("<u4", copy=False).view(np.uint8)
        if out["bits"] == 4:
            q = np.empty(words.shape[:-1] + (words.shape[-1] * 2,), np.uint8)
            q[..., 0::2], q[..., 1::2] = words & np.uint8(0x0F), words >> np.uint8(4)
        else:
            q = words
        out["qcodes"] = q
        if out["mode"] == "affine":
            out["scale"], out["offset"] = out["scales"], out["biases"]
        order = _config.row_order(self.processor, name, tuple(info.shape))
        if order is not None:
            for leaf in ("weight", "scales", "biases"):
                if leaf in out:
                    out[leaf] = np.ascontiguousarray(out[leaf][order])
            for leaf in ("qcodes", "scale", "offset"):
                if leaf in out:
                    out[leaf] = np.ascontiguousarray(out[leaf][order])
        out["ggml_type"] = kind
        out["tensors"], out["files"] = {"blocks": name}, {"blocks": os.path.basename(info.path)}
        return out

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def port_open(fmt: str, path: str):
    """The GGUF file ``path`` opened for streaming, in logical order (see :class:`_Logical`)."""
    _need()
    return _Logical(path)


# ------------------------------------------------------------------ writing
def tensor_type(name: str, shape: tuple[int, ...], outtype: str):
    """The GGUF type llama.cpp's converter gives the tensor ``name``: F32 for 1-D tensors, norms and
    anything but a ``.weight``; else ``outtype``, falling back to F16 where a row does not fill
    quantization blocks (as the converter does)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return T.F32
    kind = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}[outtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if shape[-1] % block:
        return T.F16
    return kind


def encode(data: np.ndarray, kind) -> np.ndarray:
    """``data`` (float) in the GGUF type ``kind``, by gguf's own quantizers."""
    import gguf

    arr = np.asarray(data)
    if arr.dtype != np.float32 and arr.dtype != np.float16:
        arr = arr.astype(np.float32)
    if kind == gguf.GGMLQuantizationType.F16 and arr.dtype == np.float16:
        return np.ascontiguousarray(arr)
    if kind == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(arr, np.float32)
    return gguf.quants.quantize(arr, kind)


def _exactness(logical: np.ndarray, stored: np.ndarray, kind) -> dict:
    """``exact`` (the file's values equal the logical tensor's) and ``max_ulp`` (of a float type;
    None for quantized blocks, whose error is not a rounding of each value)."""
    import gguf

    back = gguf.quants.dequantize(stored, kind).reshape(logical.shape)
    exact = bool(np.array_equal(back, np.asarray(logical, np.float32)))
    if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
        err = float(np.max(np.abs(back.astype(np.float64) - np.asarray(logical, np.float64)))) if back.size else 0.0
        return {"exact": exact, "max_ulp": None, "max_abs_error": err}
    if exact:
        return {"exact": True, "max_ulp": 0}
    wide = np.asarray(logical, np.float64)
    spacing = np.abs(np.spacing(np.asarray(back, np.float32)).astype(np.float64))
    scale = {gguf.GGMLQuantizationType.F16: 2.0 ** 13, gguf.GGMLQuantizationType.BF16: 2.0 ** 16}.get(kind, 1.0)
    ulp = np.abs(wide - back) / np.maximum(spacing * scale, np.finfo(np.float64).tiny)
    return {"exact": False, "max_ulp": int(np.ceil(ulp.max()))}


def _keep_type(name: str, shape: tuple[int, ...], codes: dict):
    """``outtype="keep"``: Q4_1 for a matrix whose source holds MLX affine 4-bit codes (moved by
    :func:`_moved`), F32 for every other tensor; ConversionError naming a matrix whose codes are
    not affine 4-bit in groups of a multiple of 32 (nothing is requantized)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if name not in codes or len(shape) != 2 or not name.endswith(".weight") or name.endswith("_norm.weight"):
        return T.F32
    f, stored = codes[name]
    info = f.code_info(stored) or {}
    bits, group, mode = info.get("bits"), info.get("group_size"), info.get("mode")
    if mode != "affine" or bits != 4 or not isinstance(group, int) or group % 32 or len(shape) != 2:
        held = f"{info['ggml_type']} blocks" if info.get("ggml_type") else \
            f"{mode} {bits}-bit codes in groups of {group}"
        raise ConversionError(f"outtype='keep': tensor {name!r} (source {stored!r}) holds {held}; only MLX affine "
                              "4-bit codes in groups of a multiple of 32 move into Q4_1 blocks without requantizing: "
                              "choose another outtype (nothing was written)")
    return T.Q4_1


def _moved(name: str, codes: dict, processor, logical: np.ndarray) -> tuple[np.ndarray, dict]:
    """The Q4_1 bytes of the matrix ``name`` with its source's MLX codes moved in
    (``_codes.from_mlx_affine_q4``; rows in llama.cpp's order) and its certificate note: the
    move's report and the largest difference between gguf's dequantization of the blocks and the
    source's own (``logical``, MLX's ``mx.dequantize``, computed in its scales' dtype)."""
    import gguf

    from ._codes import from_mlx_affine_q4

    f, stored = codes[name]
    c = f.codes_of(stored)
    raw, report = from_mlx_affine_q4(np.asarray(c["weight"]), np.asarray(c["scales"]), np.asarray(c["biases"]),
                                     int(c["group_size"]))
    if not report["exact"]:
        raise ConversionError(f"outtype='keep': tensor {name!r} (source {stored!r}): {report['inexact_scales']} "
                              f"scales and {report['inexact_biases']} biases are not float16 values, so Q4_1's "
                              f"float16 d and m cannot hold them exactly (largest difference "
                              f"{report['max_abs_error']:.3g}): choose another outtype (nothing was written)")
    order = _config.row_order(processor, name, tuple(logical.shape))
    if order is not None:
        arranged = np.empty_like(raw)
        arranged[order] = raw
        raw = arranged
    back = _config.unpermute(processor, name, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
    ref = np.asarray(logical, np.float32)
    err = float(np.max(np.abs(back.astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
    groups = int(c["group_size"]) // 32
    note = {"codes": "moved", "exact": bool(np.array_equal(back, ref)), "max_ulp": None, "max_abs_error": err,
            "codes_move": {k: report[k] for k in ("exact", "inexact_scales", "inexact_biases")},
            "ops": [f"move MLX affine 4-bit codes, group {c['group_size']}, into Q4_1 blocks "
                    f"({'each group two' if groups == 2 else f'each group {groups}'} block{'s' if groups > 1 else ''}"
                    f" sharing its scale and bias as float16 d and m, exactly): codes and scales identical; gguf's "
                    f"d * q + m (float32) differs from MLX's dequantization (in {np.asarray(c['scales']).dtype}) by "
                    f"at most {err:.3g}"]}
    return raw, note


def _recipe(name: str, kind, by: str, processor, arch: str) -> dict:
    """How the stored bytes of tensor ``name`` are recomputed from its logical value
    (``port_recompute_codes``): ``by`` "gguf" (gguf-py's quantizers, or the float type itself),
    "llama.cpp" (ggml's ``ggml_quantize_chunk``) or "move" (an MLX affine 4-bit source's codes moved
    into Q4_1 blocks); ``permute`` (None where rows stay in place): the architecture, tensor name
    and integer hyperparameters transformers' tensor processor reorders its rows by."""
    permute = None
    if processor is not None:
        permute = {"architecture": arch, "tensor": name,
                   "config": {k: v for k, v in dict(processor.config).items()
                              if isinstance(v, int) and not isinstance(v, bool)}}
    return {"by": by, "ggml_type": kind.name, "float_dtype": "float32", "permute": permute}


def _encoding_ops(recipe: dict) -> list[str]:
    """The certificate's words for what the writer did to a tensor after the port's moves."""
    ops = []
    if recipe["permute"] is not None:
        ops.append("permute rows as llama.cpp stores q/k (the inverse of transformers' GGUF tensor processor for "
                   f"{recipe['permute']['architecture']!r})")
    kind = recipe["ggml_type"]
    ops.append({"move": "MLX affine 4-bit codes moved into Q4_1 blocks",
                "llama.cpp": f"quantize {kind} by llama.cpp (llama_model_quantize; ggml_quantize_chunk per tensor)",
                }.get(recipe["by"], "stored as F32" if kind == "F32" else
                      f"encode {kind} by gguf.quants.quantize" if kind not in ("F16", "BF16") else
                      f"round to {kind} by gguf.quants.quantize"))
    return ops


def _write(path: str, config: dict, tensors: dict, outtype: str, extras: dict, on_tensor=None,
           codes: dict | None = None) -> dict:
    """Write the GGUF file ``path``: ``tensors`` {GGUF name: logical array, or a callable giving it}
    in order (``codes``, for ``outtype="keep"``: {name: (opened source file, stored key)} of the
    tensors copied whole from quantized sources); returns {name: {"ggml_type", "permuted", "codes"}}."""
    from . import _tokenizer

    processor = _processor(config)
    import gguf

    codes = dict(codes or {})
    plan, notes = [], {}
    for name, t in tensors.items():
        shape = tuple(t.shape)
        kind = _keep_type(name, shape, codes) if outtype == "keep" else tensor_type(name, shape, outtype)
        plan.append((name, shape, kind))
        permuted = _config.row_order(processor, name, shape) is not None
        moved = outtype == "keep" and kind == gguf.GGMLQuantizationType.Q4_1
        notes[name] = {"ggml_type": kind.name, "permuted": permuted,
                       "codes": None if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                                 gguf.GGMLQuantizationType.BF16) else "quantized",
                       "recompute": _recipe(name, kind, "move" if moved else "gguf", processor if permuted else None,
                                            _arch(config))}
        notes[name]["encoding"] = _encoding_ops(notes[name]["recompute"])
    typed = _config.typed(config["metadata"])  # after the plan: a tensor refused is named first
    typed.update(_tokenizer.metadata(extras, config))

    typed["general.file_type"] = (int({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                                       "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                                       "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                                       "keep": gguf.LlamaFileType.MOSTLY_Q4_1}
                                      [outtype]), gguf.GGUFValueType.UINT32, None)
    typed["general.quantization_version"] = (gguf.GGML_QUANT_VERSION, gguf.GGUFValueType.UINT32, None)
    out = _output()(path, typed, plan)
    try:
        for name, shape, kind in plan:
            t = tensors[name]
            value = t.produce() if hasattr(t, "produce") else t
            if outtype == "keep" and kind == gguf.GGMLQuantizationType.Q4_1:
                stored, note = _moved(name, codes, processor, np.asarray(value))
                out.write(name, np.ascontiguousarray(stored).reshape(-1).view(np.uint8))
                notes[name].update(note)
            else:
                arranged = _config.permute(processor, name, np.asarray(value))
                stored = encode(arranged, kind)
                out.write(name, np.ascontiguousarray(stored).reshape(-1).view(np.uint8))  # the stored bytes
                notes[name].update(_exactness(arranged, stored, kind))
            if on_tensor is not None:
                on_tensor(name, stored.nbytes)
    except BaseException:
        out.abort()  # the partial file removed; the refusal itself is what the caller sees
        raise
    out.close()
    return notes


def port_write(fmt: str, path: str, config: dict, tensors: dict, *, outtype=None, extras=None, on_tensor=None,
               codes=None):
    """The destination file ``path`` written from ``tensors`` {GGUF name: PendingTensor (logical)}:
    llama.cpp's encoding of each (permutation, ``outtype``: f32 (default), f16, bf16, q8_0, q4_0,
    q4_1; ``keep``: Q4_1 blocks holding a quantized source's MLX affine 4-bit codes, moved, every other
    tensor F32), the hyperparameters of ``config`` and the tokenizer metadata made from ``extras`` {file
    name: path} (the source's tokenizer files); ``codes`` {name: (opened source file, stored key)} of
    the tensors copied whole from quantized sources (``ports._codes.sources_of``). Returns {name:
    {"ggml_type", "permuted", "codes"}}."""
    outtype = "f32" if outtype is None else outtype
    if outtype not in OUTTYPES + LLAMA_CPP_OUTTYPES:
        raise ConversionError(f"outtype must be one of {OUTTYPES} or, quantized by llama.cpp (llama-cpp-python), "
                              f"{LLAMA_CPP_OUTTYPES}. {received('outtype', outtype)}")
    if outtype in LLAMA_CPP_OUTTYPES:
        return _write_by_llama_cpp(path, config, tensors, outtype, dict(extras or {}), on_tensor, codes)
    if outtype == "keep" and not codes:
        raise ConversionError("outtype='keep' moves a quantized source's MLX affine 4-bit codes into Q4_1 blocks, "
                              "and this source holds no quantized tensors: choose f32, f16, bf16, q8_0, q4_0 or q4_1 "
                              f"(nothing was written). {received('outtype', outtype)}")
    return _write(path, config, tensors, outtype, dict(extras or {}), on_tensor, codes=codes)


def _write_by_llama_cpp(path: str, config: dict, tensors: dict, outtype: str, extras: dict, on_tensor, codes) -> dict:
    """``outtype`` one of ``LLAMA_CPP_OUTTYPES``: the tensors written as an F32 GGUF file beside
    ``path`` (the port's temporary directory), quantized into ``path`` by llama.cpp's own quantizer
    (``_llama_cpp.quantize_file``), the F32 file removed; each tensor's note says the type llama.cpp
    chose, the recipe ``port_recompute_codes`` reproduces its bytes by, and ``max_abs_error``: the
    largest difference between llama.cpp's blocks, dequantized by gguf, and the F32 values."""
    import gguf

    from . import _llama_cpp

    _llama_cpp._module()  # refused naming llama-cpp-python before anything is written
    floats = path + ".f32.tmp"
    try:
        notes = _write(floats, config, tensors, "f32", extras, on_tensor, codes=codes)
        _llama_cpp.quantize_file(floats, path, outtype)
        by = f"llama.cpp {_llama_cpp.version()} (llama_model_quantize, file type {_llama_cpp.OUTTYPES[outtype]})"
        with _open(floats) as a, _open(path) as b:
            if sorted(b.keys()) != sorted(notes):
                raise ConversionError(f"llama.cpp's quantizer wrote the tensors {sorted(set(b.keys()) ^ set(notes))[:6]} "
                                      "that the F32 file does not hold, or left them out (nothing was written)")
            for name, note in notes.items():
                kind = gguf.GGMLQuantizationType(int(b.tensors[name].ggml_type))
                recipe = dict(note["recompute"], by="llama.cpp" if kind != gguf.GGMLQuantizationType.F32 else "gguf",
                              ggml_type=kind.name)
                note.update({"ggml_type": kind.name, "recompute": recipe, "encoding": _encoding_ops(recipe),
                             "quantized_by": by})
                if kind == gguf.GGMLQuantizationType.F32:
                    if b.raw(name).tobytes() != a.raw(name).tobytes():
                        raise ConversionError(f"llama.cpp's quantizer changed the F32 tensor {name!r} (nothing was written)")
                    continue
                ref = np.asarray(a.get(name), np.float32)
                back = np.asarray(b.get(name), np.float32)
                err = float(np.max(np.abs(back.astype(np.float64) - ref))) if ref.size else 0.0
                float_kind = kind in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
                note.update({"codes": None if float_kind else "quantized", "exact": bool(err == 0.0),
                             "max_abs_error": err})
                note.update(_exactness(ref, b.raw(name), kind) if float_kind else {"max_ulp": None})
    finally:
        try:
            os.remove(floats)
        except OSError:
            pass
    return notes


def port_recompute_codes(fmt: str, recipe: dict, value: np.ndarray, codes: dict | None) -> np.ndarray:
    """The bytes a GGUF tensor is stored as (uint8, flat), recomputed from its logical float
    ``value`` (numpy order, transformers' rows) by the certificate's ``recipe`` (see :func:`_recipe`):
    the rows permuted as llama.cpp stores them, then encoded by gguf-py, by llama.cpp's own
    quantizer, or (``"move"``) the source's MLX codes ``codes`` moved into Q4_1 blocks."""
    import gguf

    kind = gguf.GGMLQuantizationType[recipe["ggml_type"]]
    perm = recipe.get("permute")
    processor = name = None
    if perm is not None:
        processor, name = _config.processor_for(perm["architecture"], dict(perm["config"])), perm["tensor"]
    if recipe["by"] == "move":
        from ._codes import from_mlx_affine_q4

        if codes is None:
            raise ConversionError("the source holds no codes to move")
        raw, _ = from_mlx_affine_q4(np.asarray(codes["weight"]), np.asarray(codes["scales"]),
                                    np.asarray(codes["biases"]), int(codes["group_size"]))
        order = None if processor is None else _config.row_order(processor, name, tuple(value.shape))
        if order is not None:
            arranged = np.empty_like(raw)
            arranged[order] = raw
            raw = arranged
        return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    value = np.asarray(value)
    if processor is not None:
        if _config.row_order(processor, name, tuple(value.shape)) is None:
            raise ConversionError(f"the recipe permutes {name!r}, which transformers' tensor processor leaves in place")
        value = _config.permute(processor, name, value)
    if recipe["by"] == "llama.cpp":
        from ._llama_cpp import quantize_rows

        return quantize_rows(value, kind).reshape(-1)
    return np.ascontiguousarray(encode(value, kind)).reshape(-1).view(np.uint8)


def port_write_extras(fmt: str, src: str, directory: str, names) -> list[str]:
    """The GGUF file ``src``'s tokenizer written into the destination ``directory`` as the files of
    ``names`` (the destination layout's tokenizer files) that transformers' own GGUF tokenizer
    converters (``transformers.integrations.ggml``, through ``AutoTokenizer.from_pretrained(...,
    gguf_file=)``) and ``save_pretrained`` make; nothing for a file that holds no tokenizer
    (``tokenizer.ggml.model`` absent). ConversionError naming the file and transformers' reason
    where its converters cannot read the tokenizer. Returns the names written."""
    import shutil
    import tempfile

    first = _files(src)[0]
    with _open(first) as f:
        kind = f.metadata.get("tokenizer.ggml.model")
    if kind is None:
        return []
    tp = _tp()
    staging = tempfile.mkdtemp(prefix=".tokenizer-", dir=directory)
    try:
        try:
            with tp._quiet():
                tok = tp._transformers().AutoTokenizer.from_pretrained(
                    os.path.dirname(os.path.abspath(first)), gguf_file=os.path.basename(first))
                tok.save_pretrained(staging)
        except (ValueError, KeyError, NotImplementedError, OSError, TypeError, RuntimeError) as exc:
            raise ConversionError(f"{first}: transformers' GGUF tokenizer converter cannot read its {kind!r} tokenizer "
                                  f"({type(exc).__name__}: {str(exc)[:200]}); nothing was written") from None
        written = []
        for name in sorted(os.listdir(staging)):
            if name in names and not os.path.exists(os.path.join(directory, name)):
                shutil.move(os.path.join(staging, name), os.path.join(directory, name))
                written.append(name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
