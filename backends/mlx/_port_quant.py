"""Quantized mlx-lm directories in ``db.port``: read as the float model they stand for, and written
by mlx-lm's own quantizer (``quantize=``).

Reading (a quantized SOURCE). ``mlx_lm.convert(quantize=True)`` stores each quantized layer ``p``
as ``p.weight`` (units, in * bits / 32) uint32 packed codes, ``p.scales`` (units, in / group) and,
for ``mode="affine"``, ``p.biases``; config.json's ``"quantization"`` holds the defaults and, by
layer path, the per-layer settings (``mixed_3_6``: other bits; ``group_size`` None: the mode's
default). A port's twins are float, so the port reads such a directory as its float model:
:class:`QuantizedWeights` shows ``p.weight`` with the float shape and dtype and hides ``p.scales``
/ ``p.biases``; reading ``p.weight`` gives ``mx.dequantize`` of the layer's codes with the call
``mlx_lm.utils.dequantize_model`` makes (bit for bit its result: affine in the scales' dtype, the
microscaling modes in MLX's default bfloat16). Each layer's scheme is what mlx-lm's loader infers
(``infer_quant_config``: the float in_features of the layer, from the model mlx-lm builds for the
config, against the packing), checked against the config's per-layer entry.
:meth:`QuantizedWeights.codes_of` gives the codes themselves (keep_codes).

Writing with the source's codes (``keep_codes=True``, :func:`port_keep_codes`): codes another
library's file holds, given in MLX's layout by its adapter, become mlx-lm's quantized layers where
``mx.dequantize`` equals the source's dequantization (a GGUF file's blocks: affine group 32, float32
scales and biases; MXFP4: mxfp4).

Writing (``quantize=``): the float mlx-lm directory the port wrote is loaded by mlx-lm's loader
and quantized by ``mlx_lm.utils.quantize_model`` (the function ``mlx_lm.convert -q`` calls, so the
codes, the layers left float and the per-layer entries in config["quantization"] are mlx-lm's),
after the dtype cast ``convert`` makes from the source config's ``torch_dtype``; then saved by
``save_model``/``save_config``.
"""
from __future__ import annotations

import glob
import json
import os
import re
import tempfile
from typing import Any

import numpy as np

from dense_bridge.adapter_kit import CheckpointError, ConversionError, SafetensorsFile, received
from dense_bridge.checkpoints._safetensors import read_json_file

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
#: Tensors of a quantized layer besides its packed ``weight``.
CODE_LEAVES = ("scales", "biases")
#: ``quantize=`` modes besides "affine:BITS:GROUP" (mlx_lm.utils.quantize_model's table: bits, group).
MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
from ._quant_files import AFFINE_BITS, AFFINE_GROUPS  # noqa: E402  what mx.quantize offers (measured)


class _Info:
    __slots__ = ("shape", "numpy_dtype")

    def __init__(self, shape, numpy_dtype) -> None:
        self.shape, self.numpy_dtype = tuple(int(s) for s in shape), np.dtype(numpy_dtype)


def is_quantized(config: dict) -> bool:
    return bool(config.get("quantization"))


def _weight_map(path: str) -> dict[str, str]:
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        wm = read_json_file(index, "safetensors index").get("weight_map")
        if isinstance(wm, dict):
            return dict(wm)
    out = {}
    for full in sorted(glob.glob(os.path.join(path, "model*.safetensors"))):
        with SafetensorsFile(full) as f:
            out.update({k: os.path.basename(full) for k in f.keys()})
    return out


def _float_shapes(config: dict, shapes_of) -> dict[str, tuple[int, ...]]:
    """Every parameter of the float model mlx-lm builds for ``config`` (``shapes_of``: the port's
    ``port_shapes``, lazily: nothing computed)."""
    return dict(shapes_of({k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}))


def _mx_dtype_of(np_dtype) -> Any:
    import mlx.core as mx

    return {"uint8": mx.uint8, "float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(
        np.dtype(np_dtype).name, mx.float32)


def _default_float_dtype():
    """The dtype ``mx.dequantize`` gives the microscaling modes when none is asked (as dequantize_model calls it)."""
    import mlx.core as mx

    from ._arrays import to_numpy

    w, s = mx.quantize(mx.zeros((1, 32)), 32, 4, mode="mxfp4")[:2]
    return to_numpy(mx.dequantize(w, s, None, 32, 4, "mxfp4")[:0]).dtype


def quantized_layers(path: str, config: dict | None, shapes_of) -> dict[str, dict]:
    """{layer path: {"bits", "group_size", "mode", "shape" (float), "dtype" (numpy, of the
    dequantization), "files": {leaf: file}}} of every quantized layer of the mlx-lm directory
    ``path``, each scheme as mlx-lm's loader infers it; CheckpointError naming the tensor or the
    setting that disagrees."""
    import mlx.core as mx
    from mlx_lm.utils import infer_quant_config

    if config is None:
        config = read_json_file(os.path.join(path, CONFIG), "mlx-lm config")
    settings = config.get("quantization")
    if not isinstance(settings, dict):
        raise CheckpointError(f"{os.path.join(path, CONFIG)}: \"quantization\" must be an object. "
                              f"{received('quantization', settings)}")
    weights = _weight_map(path)
    shapes = _float_shapes(config, shapes_of)
    opened: dict[str, SafetensorsFile] = {}
    out: dict[str, dict] = {}
    mx_default = None
    try:
        def info(name):
            rel = weights[name]
            if rel not in opened:
                opened[rel] = SafetensorsFile(os.path.join(path, rel))
            return opened[rel].tensors[name]

        for name in sorted(weights):
            if not name.endswith(".scales"):
                continue
            layer = name[: -len(".scales")]
            if layer + ".weight" not in weights:
                raise CheckpointError(f"{path}: tensor {name!r} holds quantization scales but the directory has no "
                                      f"{layer + '.weight'!r}")
            if layer + ".global_scale" in weights:
                raise ConversionError(f"{path}: layer {layer!r} keeps a global_scale (nvfp4 with a tensor scale): "
                                      "ports of such layers are not implemented (nothing was written)")
            if layer + ".weight" not in shapes:
                raise CheckpointError(f"{path}: tensor {name!r} quantizes {layer!r}, which mlx-lm's model for this "
                                      "config does not have")
            float_shape = shapes[layer + ".weight"]
            w, s = info(layer + ".weight"), info(name)
            if str(w.numpy_dtype) != "uint32":
                raise CheckpointError(f"{path}: tensor {layer + '.weight'!r} ({w.numpy_dtype}) beside {name!r} must hold "
                                      "uint32 packed codes")
            # mlx-lm's own inference reads only the shapes and the scales' dtype
            shims = {layer + ".scales": _Shape(s.shape, _mx_dtype_of(s.numpy_dtype)),
                     layer + ".weight": _Shape(w.shape, mx.uint32)}
            try:
                got = infer_quant_config(layer, _Module(float_shape), shims)
            except (ValueError, ZeroDivisionError) as exc:
                raise CheckpointError(f"{path}: tensor {layer + '.weight'!r} {tuple(w.shape)} with scales "
                                      f"{tuple(s.shape)} ({s.numpy_dtype}) is no quantization mlx-lm reads for a "
                                      f"{float_shape} weight: {exc}") from None
            own = settings.get(layer)
            if isinstance(own, dict):
                for key in ("bits", "group_size", "mode"):
                    if own.get(key) is not None and own[key] != got[key]:
                        raise CheckpointError(f"{path}: config.json's quantization[{layer!r}] says {key}={own[key]!r}, "
                                              f"but the tensors of {layer!r} hold {key}={got[key]!r}")
            has_biases = layer + ".biases" in weights
            if has_biases != (got["mode"] == "affine"):
                raise CheckpointError(f"{path}: layer {layer!r} is {got['mode']} but "
                                      f"{'has' if has_biases else 'lacks'} a {layer + '.biases'!r} tensor")
            if got["bits"] * float_shape[-1] != 32 * w.shape[-1] or float_shape[:-1] != tuple(w.shape[:-1]):
                raise CheckpointError(f"{path}: tensor {layer + '.weight'!r} {tuple(w.shape)} does not pack a "
                                      f"{float_shape} weight in {got['bits']}-bit codes")
            if got["mode"] == "affine":
                dtype = s.numpy_dtype
            else:
                if mx_default is None:
                    mx_default = _default_float_dtype()
                dtype = mx_default
            out[layer] = {"bits": int(got["bits"]), "group_size": int(got["group_size"]), "mode": got["mode"],
                          "shape": tuple(float_shape), "dtype": np.dtype(dtype),
                          "files": {leaf: weights[f"{layer}.{leaf}"] for leaf in ("weight",) + CODE_LEAVES
                                    if f"{layer}.{leaf}" in weights}}
    finally:
        for f in opened.values():
            f.close()
    return out


class _Shape:
    def __init__(self, shape, dtype) -> None:
        self.shape, self.dtype = tuple(shape), dtype


class _Module:
    def __init__(self, shape) -> None:
        self.weight = _Shape(shape, None)


def code_names(path: str, config: dict, weights: dict[str, str], shapes_of) -> set[str]:
    """The tensors of ``weights`` a float reading hides (each quantized layer's scales and biases)."""
    if not is_quantized(config):
        return set()
    layers = quantized_layers(path, config, shapes_of)
    return {f"{layer}.{leaf}" for layer in layers for leaf in CODE_LEAVES if f"{layer}.{leaf}" in weights}


_CACHE: dict[tuple, dict] = {}


def _layers_cached(directory: str, shapes_of) -> dict[str, dict]:
    config_path = os.path.join(directory, CONFIG)
    st = os.stat(config_path)
    key = (os.path.realpath(directory), st.st_mtime_ns, st.st_size)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = quantized_layers(directory, None, shapes_of)
    return _CACHE[key]


class QuantizedWeights:
    """One weight file of a quantized mlx-lm directory read as the float model it stands for (see
    the module docstring): ``tensors`` (name -> shape, numpy_dtype), ``get``, ``keys``, ``close``,
    like :class:`~dense_bridge.checkpoints._safetensors.SafetensorsFile`; ``codes_of(name)``."""

    def __init__(self, path: str, shapes_of) -> None:
        """``shapes_of(config)``: every parameter's shape in mlx-lm's float model for a config."""
        self.path = path
        self.directory = os.path.dirname(os.path.abspath(path))
        self.file = SafetensorsFile(path)
        self.metadata = self.file.metadata
        self._siblings: dict[str, SafetensorsFile] = {}
        try:
            self.layers = _layers_cached(self.directory, shapes_of)
        except BaseException:
            self.file.close()
            raise
        rel = os.path.basename(path)
        self.tensors: dict[str, Any] = {}
        self.quantized: dict[str, str] = {}  # float weight name -> its layer
        for name, info in self.file.tensors.items():
            layer, _, leaf = name.rpartition(".")
            q = self.layers.get(layer)
            if q is not None and leaf in CODE_LEAVES:
                continue
            if q is not None and leaf == "weight" and q["files"].get("weight") == rel:
                self.tensors[name] = _Info(q["shape"], q["dtype"])
                self.quantized[name] = layer
            else:
                self.tensors[name] = info

    def keys(self) -> list[str]:
        return list(self.tensors)

    def _raw(self, layer: str, leaf: str) -> np.ndarray:
        rel = self.layers[layer]["files"][leaf]
        if rel == os.path.basename(self.path):
            return self.file.get(f"{layer}.{leaf}")
        if rel not in self._siblings:
            self._siblings[rel] = SafetensorsFile(os.path.join(self.directory, rel))
        return self._siblings[rel].get(f"{layer}.{leaf}")

    def code_info(self, name: str) -> dict | None:
        """What stands behind the float tensor ``name`` without reading it: {"bits", "group_size",
        "mode", "tensors": {leaf: stored name}, "files": {leaf: file}, "dequantize": words}; None
        for a float tensor."""
        layer = self.quantized.get(name)
        if layer is None:
            return None
        q = self.layers[layer]
        return {"bits": q["bits"], "group_size": q["group_size"], "mode": q["mode"],
                "tensors": {leaf: f"{layer}.{leaf}" for leaf in q["files"]}, "files": dict(q["files"]),
                "dequantize": f"mlx.core.dequantize ({q['mode']}, {q['bits']}-bit, group {q['group_size']}), as "
                              f"mlx_lm.utils.dequantize_model"}

    def codes_of(self, name: str) -> dict | None:
        """The stored codes behind the float tensor ``name`` (None for a float tensor): {"weight"
        (units, words) uint32, "scales", "biases" (affine), "bits", "group_size", "mode",
        "tensors": {leaf: stored name}, "files": {leaf: file}}."""
        layer = self.quantized.get(name)
        if layer is None:
            return None
        q = self.layers[layer]
        out = {k: q[k] for k in ("bits", "group_size", "mode")}
        for leaf in q["files"]:
            out[leaf] = self._raw(layer, leaf)
        out.update(_canonical(out))
        out["tensors"] = {leaf: f"{layer}.{leaf}" for leaf in q["files"]}
        out["files"] = dict(q["files"])
        out["dtype"] = q["dtype"]
        return out

    def get(self, name: str) -> np.ndarray:
        layer = self.quantized.get(name)
        if layer is None:
            return self.file.get(name)
        c = self.codes_of(name)
        return dequantize(c)

    def close(self) -> None:
        self.file.close()
        for f in self._siblings.values():
            f.close()
        self._siblings = {}

    def __enter__(self) -> "QuantizedWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _canonical(codes: dict) -> dict:
    """The codes unpacked: ``qcodes`` (units, in) unsigned, one per weight; ``scale`` (units, G)
    (a microscaling mode's decoded to float32) and, affine, ``offset`` (units, G): the layer
    dequantizes as f(f(scale * q) + offset) (affine)."""
    from ._quant import unpack

    words = np.asarray(codes["weight"])
    lead, n = words.shape[:-1], words.shape[-1] * 32 // codes["bits"]
    q = unpack(words.reshape(-1, words.shape[-1]), codes["bits"], n).reshape(*lead, n)
    out = {"qcodes": q}
    if codes["mode"] == "affine":
        out["scale"], out["offset"] = np.asarray(codes["scales"]), np.asarray(codes["biases"])
    else:
        s = np.asarray(codes["scales"])
        if codes["mode"] == "nvfp4":  # float8 e4m3 scales
            import ml_dtypes

            out["scale"] = s.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        else:  # mxfp: an exponent, 2**(e - 127)
            out["scale"] = np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32)
    return out


def dequantize(codes: dict) -> np.ndarray:
    """``mx.dequantize`` of one layer's stored codes, the call ``mlx_lm.utils.dequantize_model`` makes."""
    import mlx.core as mx

    from ._arrays import from_numpy, to_numpy

    biases = codes.get("biases")
    w = mx.dequantize(from_numpy(codes["weight"]), from_numpy(codes["scales"]),
                      None if biases is None else from_numpy(biases), codes["group_size"], codes["bits"],
                      codes["mode"])
    mx.eval(w)
    return np.ascontiguousarray(to_numpy(w))


def describe(codes: dict) -> str:
    return f"{codes['mode']} {codes['bits']}-bit, group {codes['group_size']}"


# ------------------------------------------------------------------------------ quantize=
def parse_quantize(value: Any) -> dict:
    """``"affine:BITS:GROUP"``, a microscaling mode name (``"mxfp4"``, ``"nvfp4"``, ``"mxfp8"``) or one of
    mlx-lm's mixed recipes (``"mixed_3_6"``: per-layer bits, written as per-layer entries of
    config["quantization"]) -> {"mode", "bits", "group_size", "recipe"?}; ConversionError naming
    ``quantize`` and echoing the value."""
    if not isinstance(value, str):
        raise TypeError(f"quantize must be a string such as 'affine:4:64' or 'mxfp4'. {received('quantize', value)}")
    if value in MODES:
        bits, group = MODES[value]
        return {"mode": value, "bits": bits, "group_size": group}
    recipes = _recipes()
    if value in recipes:  # mlx_lm.convert --quant-predicate: per-layer bits, group and bits by default
        return {"mode": "affine", "bits": None, "group_size": None, "recipe": value}
    m = re.fullmatch(r"affine:(\d+):(\d+)", value)
    if not m:
        raise ConversionError(f"quantize must be 'affine:BITS:GROUP' (bits {list(AFFINE_BITS)}, groups "
                              f"{list(AFFINE_GROUPS)}), one of MLX's modes {sorted(MODES)} or one of mlx-lm's mixed "
                              f"recipes {list(recipes)}. {received('quantize', value)}")
    bits, group = int(m.group(1)), int(m.group(2))
    if bits not in AFFINE_BITS or group not in AFFINE_GROUPS:
        raise ConversionError(f"quantize={value!r}: MLX's affine quantization has bits {list(AFFINE_BITS)} and groups "
                              f"{list(AFFINE_GROUPS)}. {received('quantize', value)}")
    return {"mode": "affine", "bits": bits, "group_size": group}


def _recipes() -> tuple[str, ...]:
    """mlx-lm's mixed quantization recipes (``mlx_lm.convert --quant-predicate``)."""
    try:
        from mlx_lm.convert import QUANT_RECIPES
    except ImportError:
        return ()
    return tuple(QUANT_RECIPES)


def port_quantize(fmt: str, path: str, quantize: str, source_config: dict, dtype: str | None) -> dict:
    """Quantize the float mlx-lm directory ``path`` in place as ``mlx_lm.convert(quantize=True)`` does:
    the dtype cast convert makes (to the source config's ``torch_dtype`` when ``dtype`` was not
    asked), ``mlx_lm.utils.quantize_model`` with ``quantize``'s mode, bits and group, then
    ``save_model`` and ``save_config``. The files of ``path`` are replaced.

    Returns:
        {"settings": {"mode", "bits", "group_size"}, "tensors": {float weight name: {"codes":
        "quantized", "stored": {stored tensor: dtype name}, "ops", "max_abs_error" (the largest
        |dequantized - float| of the weight)}}, "files": {stored tensor: file}}.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.convert import MODEL_CONVERSION_DTYPES
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    from pathlib import Path

    settings = parse_quantize(quantize)
    model, config = load_model(Path(path), lazy=True)
    cast = None if dtype is not None else source_config.get("torch_dtype")
    if cast in MODEL_CONVERSION_DTYPES:
        target = getattr(mx, cast)
        keep = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(target) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    before = {k: v for k, v in tree_flatten(model.parameters())}
    predicate = None
    if settings.get("recipe"):
        from mlx_lm.convert import mixed_quant_predicate_builder

        try:
            predicate = mixed_quant_predicate_builder(settings["recipe"], model, None)
        except ValueError as exc:
            raise ConversionError(f"quantize={quantize!r}: mlx-lm's recipe does not fit this model: {exc}") from None
    model, config = quantize_model(model, config, settings["group_size"], settings["bits"], mode=settings["mode"],
                                   quant_predicate=predicate)
    tensors: dict[str, dict] = {}
    for name, module in model.named_modules():
        if not hasattr(module, "scales") or not hasattr(module, "bits") or not isinstance(
                getattr(module, "weight", None), mx.array):
            continue
        w = mx.dequantize(module.weight, module.scales, getattr(module, "biases", None), module.group_size,
                          module.bits, module.mode)
        ref = before[f"{name}.weight"]
        err = float(mx.max(mx.abs(w.astype(mx.float32) - ref.astype(mx.float32))).item())
        stored = {f"{name}.{leaf}": _dtype(getattr(module, leaf)) for leaf in ("weight", "scales", "biases")
                  if isinstance(getattr(module, leaf, None), mx.array)}
        recipe = {"mode": module.mode, "bits": int(module.bits), "group_size": int(module.group_size),
                  "float_dtype": _dtype(ref)}
        tensors[f"{name}.weight"] = {
            "codes": "quantized", "stored": stored, "max_abs_error": err,
            "recompute": {k: {**recipe, "part": k.rsplit(".", 1)[1]} for k in stored},
            "ops": [f"quantize {module.mode} {module.bits}-bit, group {module.group_size} "
                    f"(mlx_lm.utils.quantize_model, as mlx_lm.convert -q)"]}
    for old in glob.glob(os.path.join(path, "model*.safetensors")) + [os.path.join(path, INDEX)]:
        if os.path.exists(old):
            os.remove(old)
    save_model(path, model, donate_model=True)
    save_config(config, config_path=os.path.join(path, CONFIG))
    return {"settings": settings, "tensors": tensors, "files": _weight_map(path)}


def _dtype(a) -> str:
    return str(a.dtype).replace("mlx.core.", "")


def port_parse_quantize(fmt: str, value) -> dict:
    """``quantize=`` checked before anything is written (:func:`parse_quantize`)."""
    return parse_quantize(value)


def port_recompute_codes(fmt: str, recipe: dict, value: np.ndarray, codes: dict | None) -> np.ndarray:
    """The stored tensor ``recipe["part"]`` ("weight", "scales", "biases") of ``value`` (the float
    weight, already in ``recipe["float_dtype"]``) quantized again by ``mx.quantize`` with the
    recipe's mode, bits and group, as quantize_model did (``db.verify_port``)."""
    import mlx.core as mx

    from ._arrays import from_numpy, to_numpy

    if recipe.get("kind") == "moved":  # codes moved from the source (keep_codes): its codes, as they are
        return np.ascontiguousarray(codes[recipe["part"]])
    parts = mx.quantize(from_numpy(np.ascontiguousarray(value)), recipe["group_size"], recipe["bits"],
                        mode=recipe["mode"])
    index = {"weight": 0, "scales": 1, "biases": 2}[recipe["part"]]
    mx.eval(parts[index])
    return np.ascontiguousarray(to_numpy(parts[index]))


# ------------------------------------------------------------------------------ keep_codes=True
KEEP_LAYOUT = "mlx-lm quantized layers (weight/scales/biases, config.json \"quantization\"), as mlx_lm.convert -q writes"


def _keep_difference(name: str, got: np.ndarray, want: np.ndarray) -> str:
    a, b = got.astype(np.float32), want.astype(np.float32)
    differ = np.flatnonzero(((a != b) & ~(np.isnan(a) & np.isnan(b))).reshape(-1))
    index = tuple(int(k) for k in np.unravel_index(int(differ[0]), a.shape))
    return (f"tensor {name!r} at index {index}: mx.dequantize of the moved codes gives {float(a[index])!r}, the "
            f"source's exact dequantization {float(b[index])!r} ({differ.size} of {a.size} values differ)")


def port_keep_codes(fmt: str, path: str, layers: dict, requantize: bool) -> dict:
    """``keep_codes=True`` into mlx-lm directories: a quantized source's codes written as mlx-lm writes
    quantized models, moved, never requantized.

    The source's adapter gives each layer's codes already in MLX's layout (``codes_of``: ``weight``
    uint32 packed along the input axis, ``scales`` and, affine, ``biases`` (units, in / group),
    ``bits``, ``group_size``, ``mode``; a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K blocks become affine
    group-32 layers with float32 scales and biases, MXFP4 blocks mxfp4). A layer is written quantized
    only where mlx-lm's model quantizes that module (``to_quantized``: linear layers and embeddings;
    norms stay float) and ``mx.dequantize`` of the codes equals the source's exact dequantization in
    value (a zero's sign aside: -0.0 == +0.0); else the first differing value is named
    (``requantize=True``: ``mx.quantize`` of the float weight, group 32, the source's bits).

    The files are mlx-lm's own (``save_model``/``save_config``, as ``mlx_lm.convert -q`` saves):
    ``<layer>.weight``/``.scales``/``.biases``, config.json's ``"quantization"`` (and ``"quantization_config"``) holding the
    most common setting and, by layer path, each layer whose bits or mode differ, which
    ``mlx_lm.utils.load_model`` reads.

    Args:
        path: the float mlx-lm directory the port wrote (rewritten in place).
        layers: {float weight name: codes in MLX's layout (``weight``, ``scales``, ``biases``?,
            ``bits``, ``group_size``, ``mode``) with ``"reference"``, the exact dequantization written}.
        requantize: quantize with ``mx.quantize`` where the codes cannot move, instead of refusing.

    Returns:
        {"tensors": {float weight name: {"codes": "moved" | "quantized", "stored": {stored tensor:
        dtype name}, "ops", "max_abs_error", "recompute"}}, "files": {stored tensor: file},
        "layout"}. ConversionError naming the first differing value where codes cannot move and
        ``requantize`` is False (the directory is then left as it was).
    """
    from collections import Counter
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import load_model, save_config, save_model

    from ._arrays import from_numpy, to_numpy

    model, config = load_model(Path(path), lazy=True)
    modules = {name: m for name, m in model.named_modules() if hasattr(m, "to_quantized")}
    plan: dict[str, dict] = {}
    for target, codes in layers.items():
        layer = target[: -len(".weight")] if target.endswith(".weight") else None
        module = modules.get(layer)
        ref = np.asarray(codes["reference"])
        if module is None or tuple(module.weight.shape) != tuple(ref.shape):
            continue  # mlx-lm does not quantize it: the exact dequantization stays (certificate: dequantized)
        bits, group, mode = int(codes["bits"]), int(codes["group_size"]), codes["mode"]
        parts = {"weight": codes["weight"], "scales": codes["scales"]}
        if codes.get("biases") is not None:
            parts["biases"] = codes["biases"]
        got = to_numpy(mx.dequantize(from_numpy(np.ascontiguousarray(parts["weight"])),
                                     from_numpy(np.ascontiguousarray(parts["scales"])),
                                     from_numpy(np.ascontiguousarray(parts["biases"])) if "biases" in parts else None,
                                     group, bits, mode, dtype=mx.float32))
        want = ref.astype(np.float32)
        if np.array_equal(got, want):  # in value: -0.0 == +0.0
            kind, err = "moved", 0.0
            op = (f"move {mode} {bits}-bit codes, group {group}, into MLX's layout ({codes.get('ggml_type', mode)}): "
                  "mx.dequantize equals the source's dequantization "
                  + ("bit for bit" if got.tobytes() == want.tobytes() else
                     "in value; bit for bit but the sign of zero (-0.0 in the source, +0.0 in MLX)"))
        elif not requantize:
            raise ConversionError("keep_codes=True: the source's codes do not dequantize the same in MLX: "
                                  + _keep_difference(target, got, want)
                                  + "; pass requantize=True for MLX's own codes (nothing was written)")
        else:
            mode, group = "affine", 32
            q = mx.quantize(from_numpy(np.ascontiguousarray(want)), group, bits, mode=mode)
            parts = {"weight": to_numpy(q[0]), "scales": to_numpy(q[1]), "biases": to_numpy(q[2])}
            back = to_numpy(mx.dequantize(q[0], q[1], q[2], group, bits, mode))
            kind, err = "quantized", float(np.max(np.abs(back.astype(np.float64) - ref)))
            op = f"quantize affine {bits}-bit, group {group} (mx.quantize)"
        quantized = module.to_quantized(group_size=group, bits=bits, mode=mode)  # mlx-lm's own layer class
        for leaf, a in parts.items():
            setattr(quantized, leaf, from_numpy(np.ascontiguousarray(a)))
        plan[target] = {"layer": layer, "module": quantized, "parts": parts, "kind": kind, "err": err, "op": op,
                        "setting": {"group_size": group, "bits": bits, "mode": mode}}
    if not plan:
        return {"tensors": {}, "files": _weight_map(path), "layout": KEEP_LAYOUT}
    model.update_modules(tree_unflatten([(p["layer"], p["module"]) for p in plan.values()]))
    common = Counter(tuple(sorted(p["setting"].items())) for p in plan.values()).most_common(1)[0][0]
    quantization: dict = dict(common)
    for p in plan.values():  # per-layer entries where the bits or mode differ, as mlx-lm's mixed recipes write
        if tuple(sorted(p["setting"].items())) != common:
            quantization[p["layer"]] = dict(p["setting"])
    config["quantization"] = quantization
    config["quantization_config"] = quantization
    mx.eval(model.parameters())  # read from the float files before they are replaced
    for old in glob.glob(os.path.join(path, "model*.safetensors")) + [os.path.join(path, INDEX)]:
        if os.path.exists(old):
            os.remove(old)
    save_model(path, model, donate_model=True)
    save_config(config, config_path=os.path.join(path, CONFIG))
    done = {}
    for target, p in plan.items():
        stored = {f"{p['layer']}.{leaf}": str(np.asarray(a).dtype) for leaf, a in p["parts"].items()}
        done[target] = {"codes": p["kind"], "max_abs_error": p["err"], "ops": [p["op"]], "stored": stored,
                        "recompute": {k: {"kind": p["kind"], **p["setting"], "float_dtype": "float32",
                                          "part": k.rsplit(".", 1)[1]} for k in stored}}
    return {"tensors": done, "files": _weight_map(path), "layout": KEEP_LAYOUT}
