"""Keras' quantized ``.weights.h5`` (``save_weights`` of a model whose Dense layers ran
``quantize("int8" | "int4")``): each quantized layer's group ``layers/<name>/vars/`` holds, in
Keras' own order (``save_own_variables``, measured with Keras 3.15),

- ``0``: the int8 codes: (in, units) for int8, (in, ceil(units / 2)) two int4 codes per byte;
- ``1``: the bias, where the layer has one; then
- the scale: (units,) per-channel (int8, int4 block -1), or (G, units) in groups, followed by
  the int8 zero points (G, units) and ``g_idx`` (in,) (int4 with a block size).

The mode is not written in the file: it follows from those shapes, given the float layer the
spec describes (a float Dense never stores an int8 kernel). An int4 layer with one output unit
packs to (in, 1), which reads as int8: Keras' int4 is only told apart from int8 when units > 1.
Every shape that fits neither mode is a CheckpointError naming the dataset and what it holds.
"""
from __future__ import annotations

from typing import Any

from dense_bridge._errors import CheckpointError, ConversionError, SpecError
from dense_bridge.quant import Quant

from ._files import layer_groups, saved_names
from ._params import quant_position_build
from ._to_spec import layers_of


def quant_file_layers(entries: dict, path: str, config: dict | None = None) -> dict[str, None]:
    """{layer group: None} of every quantized Dense in a ``.weights.h5``'s datasets ``entries``
    (an int8 kernel); their schemes need the spec's widths (:func:`quant_file_template`)."""
    return {group: None for group, v in layer_groups(entries).items() if 0 in v and v[0][1] == "int8"}


def scheme_of(path: str, group: str, variables: dict[int, tuple], in_features: int, units: int,
              has_bias: bool) -> Quant:
    """The Quant of the quantized Dense saved as ``group`` for a float Dense (in_features, units)."""
    where = f"layers/{group}/vars/"

    def bad(index: int, why: str) -> CheckpointError:
        shape, dtype = variables.get(index, ("missing", "-"))
        return CheckpointError(f"{path}: dataset {where}{index} ({shape}, {dtype}) {why}")

    first = 2 if has_bias else 1
    kernel = variables[0][0]
    if len(kernel) != 2 or kernel[0] != in_features or kernel[1] not in (units, (units + 1) // 2):
        raise bad(0, f"must hold int8 codes ({in_features}, {units}) or packed int4 codes "
                     f"({in_features}, {(units + 1) // 2}) for the spec's Dense")
    scale = variables.get(first)
    if scale is None or not scale[1].startswith(("float", "bfloat")):
        raise bad(first, "must be the layer's float scale")
    if kernel[1] == units:  # int8 (or int4 with one unit: the same shape, read as int8)
        if scale[0] != (units,) or len(variables) != first + 1:
            raise bad(first, f"must be the int8 scale ({units},), the layer's last variable")
        return Quant(8, None, "divide")
    if len(variables) == first + 1:
        if scale[0] != (units,):
            raise bad(first, f"must be the int4 per-channel scale ({units},)")
        return Quant(4, None, "divide")
    zero, g_idx = variables.get(first + 1), variables.get(first + 2)
    if len(scale[0]) != 2 or scale[0][1] != units or scale[0][0] < 1 or in_features % scale[0][0]:
        raise bad(first, f"must be the int4 group scale (G, {units}) with G dividing in_features {in_features}")
    if zero is None or zero[0] != scale[0] or zero[1] != "int8":
        raise bad(first + 1, f"must be the int4 zero points {scale[0]} int8")
    if g_idx is None or g_idx[0] != (in_features,) or len(variables) != first + 3:
        raise bad(first + 2, f"must be g_idx ({in_features},), the layer's last variable")
    groups = scale[0][0]
    try:
        return Quant(4, None if groups == 1 else in_features // groups, "zero_point")
    except SpecError as exc:
        raise bad(first, str(exc)) from None


def quant_file_template(template: Any, entries: dict, path: str) -> Any:
    """``template`` (the float Keras model the spec compiles to) with each Dense the file stores
    quantized quantized the same way by Keras itself, so that ``load_weights`` finds Keras' own
    structure; returns it."""
    groups = layer_groups(entries)
    layers, keyed = layers_of(template)
    prefix_of = {id(layer): (f"{i}." if keyed else "") for i, layer in enumerate(layers)}
    for layer, group in saved_names(template):
        variables = groups.get(group)
        if not variables or variables.get(0, (None, None))[1] != "int8":
            continue
        kernel = getattr(layer, "kernel", None)
        if kernel is None or len(kernel.shape) != 2 or id(layer) not in prefix_of:
            raise CheckpointError(f"{path}: dataset layers/{group}/vars/0 holds int8 codes for a layer the spec does "
                                  f"not describe as a Dense ({type(layer).__name__})")
        n, units = (int(s) for s in kernel.shape)
        quant = scheme_of(path, group, variables, n, units, layer.bias is not None)
        try:
            template = quant_position_build(template, prefix_of[id(layer)], quant)
        except ConversionError as exc:
            raise CheckpointError(f"{path}: the quantized layer {group!r} ({quant}) cannot be built in Keras: "
                                  f"{exc}") from None
    return template
