"""MLX's quantized safetensors (what ``mlx_lm.convert(quantize=True)`` and ``model.save_weights``
write for ``nn.QuantizedLinear``): the layer's ``weight`` (units, in * bits / 32) uint32 packed
codes, ``scales`` (units, in / group_size), and for ``mode="affine"`` ``biases`` of the scales'
shape and dtype; the microscaling modes keep uint8 scales and no ``biases``.

The scheme is not written in the file (mlx-lm keeps it in config.json): it follows from the
shapes, given the float layer the spec describes (bits = 32 * words / in_features, group_size =
in_features / scale columns, "affine" where ``biases`` is present, else the microscaling mode
of those bits and groups). Every way those shapes can disagree is a CheckpointError naming the
tensor and what it holds, before MLX sees the arrays.

mlx-lm's quantized model directories (``config.json`` with "quantization" beside
``model.safetensors`` or its index, declared in ``_manifest.py``): :func:`model_dir_layers`
checks each quantized layer against the config and reads its widths from the packing.
"""
from __future__ import annotations

import os
from typing import Any

import mlx.nn as nn

from dense_bridge._errors import CheckpointError, ConversionError, SpecError, received
from dense_bridge.quant import MICROSCALING, Quant

from ._params import positions
from ._params import quant_position_build

#: Bit widths and group sizes ``mx.quantize`` offers in affine mode (measured, MLX 0.32).
AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


def scheme_of(path: str, where: str, entries: dict, in_features: int, units: int) -> Quant:
    """The :class:`Quant` of the quantized layer stored under ``where`` ("layers.0." or "") in a
    file whose tensors are ``entries`` (name -> (shape, dtype name)), for a float layer of
    (in_features, units); a CheckpointError naming the tensor where the shapes disagree."""
    w_name, s_name, b_name = where + "weight", where + "scales", where + "biases"

    def bad(name: str, why: str) -> CheckpointError:
        shape, dtype = entries[name]
        return CheckpointError(f"{path}: tensor {name!r} (shape {tuple(shape)}, {dtype}) {why}")

    if w_name not in entries:
        raise CheckpointError(f"{path}: tensor {s_name!r} holds quantization scales but the file has no {w_name!r}")
    (w_shape, w_dtype), (s_shape, s_dtype) = entries[w_name], entries[s_name]
    if w_dtype != "uint32":
        raise bad(w_name, "holds MLX packed codes and must be uint32")
    if len(w_shape) != 2 or w_shape[0] != units:
        raise bad(w_name, f"must be (units, packed words) = ({units}, ...) for the spec's layer")
    words = int(w_shape[1])
    if words < 1 or (words * 32) % in_features:
        raise bad(w_name, f"does not pack {in_features} in_features: {words} words x 32 bits / {in_features} is "
                          f"not a whole number of bits per code")
    bits = words * 32 // in_features
    if len(s_shape) != 2 or s_shape[0] != units or s_shape[1] < 1 or in_features % s_shape[1]:
        raise bad(s_name, f"must be (units, groups) = ({units}, G) with G dividing in_features {in_features}")
    group = in_features // int(s_shape[1])
    if b_name in entries:
        if tuple(entries[b_name][0]) != tuple(s_shape) or entries[b_name][1] != s_dtype:
            raise bad(b_name, f"must have the scales' shape {tuple(s_shape)} and dtype {s_dtype}")
        if bits not in AFFINE_BITS or group not in AFFINE_GROUPS:
            raise bad(w_name, f"reads as {bits}-bit codes in groups of {group}; MLX's affine quantization has "
                              f"bits {list(AFFINE_BITS)} and groups {list(AFFINE_GROUPS)}")
        scheme = "affine"
    else:
        if s_dtype != "uint8":
            raise bad(s_name, "has no biases beside it (a microscaling mode), so it must hold uint8 scales")
        modes = [m for m, shape in MICROSCALING.items() if shape == (bits, group)]
        if not modes:
            raise bad(w_name, f"reads as {bits}-bit codes in groups of {group} without biases, which is none of "
                              f"MLX's microscaling modes {dict(MICROSCALING)}")
        scheme = modes[0]
    try:
        return Quant(bits, group, scheme)
    except SpecError as exc:
        raise bad(w_name, str(exc)) from None


def quant_file_template(template: Any, entries: dict, path: str) -> Any:
    """``template`` (the float MLX model the spec compiles to) with each ``nn.Linear`` whose name
    in the file carries ``scales`` replaced by the ``nn.QuantizedLinear`` of the scheme the
    file's shapes give (:func:`scheme_of`), ready for ``load_weights``; returns the root."""
    for prefix, m in list(positions(template)):
        where = f"layers.{prefix}" if prefix else ""
        if where + "scales" not in entries:
            continue
        if not isinstance(m, nn.Linear):
            raise CheckpointError(f"{path}: tensor {where + 'scales'!r} quantizes position {prefix or '<root>'!r}, "
                                  f"which the spec describes as {type(m).__name__}, not a linear layer")
        units, n = (int(s) for s in m.weight.shape)
        quant = scheme_of(path, where, entries, n, units)
        try:
            template = quant_position_build(template, prefix, quant)
        except ConversionError as exc:
            raise CheckpointError(f"{path}: the quantized layer at {where or '<root>'!r} ({quant}) cannot be built "
                                  f"in MLX: {exc}") from None
    return template


def quant_file_layers(entries: dict, path: str) -> dict[str, None]:
    """{layer name ("layers.0", "" for a lone layer): None} of every quantized layer in an MLX
    file's tensors ``entries`` (a ``scales`` tensor beside a ``weight``): the scheme needs the
    spec's in_features (:func:`quant_file_template`)."""
    return {layer: None for layer in _quantized_layers(entries, path)}


def model_dir_layers(entries: dict, path: str, settings: object) -> dict[str, tuple[Quant, int, int]]:
    """{layer name ("model.layers.0.self_attn.q_proj"): (Quant, in_features, units)} of every
    quantized layer of the mlx-lm model directory ``path``, whose weight files hold ``entries``
    (name -> (shape, dtype name)) and whose config.json says ``settings`` (its "quantization":
    {"bits", "group_size", "mode"?, per-layer overrides by name}; the manifest's ``ModelDir``).
    in_features is read from the packing: ``weight`` is (units, in_features * bits / 32) uint32
    words. Each layer's shapes are checked against the config: a CheckpointError naming the
    tensor or the setting."""
    if not isinstance(settings, dict):
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: \"quantization\" must be an object with bits "
                              f"and group_size. {received('quantization', settings)}")
    out = {}
    for layer, where in _quantized_layers(entries, path).items():
        quant = _configured(path, where, entries, settings, layer)
        units, words = entries[where + "weight"][0]
        out[layer] = (quant, int(words) * 32 // quant.bits, int(units))
    return out


def _quantized_layers(entries: dict, path: str) -> dict[str, str]:
    """{layer name: its tensors' prefix ("layers.0." or "")} of every ``scales`` tensor in
    ``entries``; a CheckpointError where the ``weight`` beside it is missing."""
    out = {}
    for name in entries:
        if not (name == "scales" or name.endswith(".scales")):
            continue
        layer = name[: -len(".scales")] if name != "scales" else ""
        where = layer + "." if layer else ""
        if where + "weight" not in entries:
            raise CheckpointError(f"{path}: tensor {name!r} holds quantization scales but the file has no "
                                  f"{where + 'weight'!r}")
        out[layer] = where
    return out


def _configured(path: str, where: str, entries: dict, config: dict, layer: str) -> Quant:
    """The Quant mlx-lm's config gives ``layer``, checked against the file's shapes."""
    own = config.get(layer)
    settings = own if isinstance(own, dict) else config
    bits, group, mode = settings.get("bits"), settings.get("group_size"), settings.get("mode", "affine")
    try:
        want = Quant(bits, group, mode)
    except (SpecError, TypeError) as exc:
        raise CheckpointError(f"{path}: quantization of {layer or '<root>'!r} (bits={bits!r}, group_size={group!r}, "
                              f"mode={mode!r}) is not a scheme MLX has: {exc}") from None
    w_shape = tuple(entries[where + "weight"][0])
    if len(w_shape) != 2 or w_shape[1] < 1 or (int(w_shape[1]) * 32) % bits:
        raise CheckpointError(f"{path}: tensor {where + 'weight'!r} (shape {w_shape}) does not hold "
                              f"{bits}-bit codes packed in uint32 words")
    got = scheme_of(path, where, entries, int(w_shape[1]) * 32 // bits, int(w_shape[0]))
    if got != want:
        raise CheckpointError(f"{path}: tensors under {where or '<root>'!r} hold {got}, but the quantization "
                              f"config says {want}")
    return want
