"""Canonical parameters: get_params / set_params on Keras variables (the mask included).

Canonical == Keras for every parameter: nothing is transposed. ``get_params`` arrays are
zero-copy, read-only snapshots of the variables: TF copies a variable's buffer on write while
another tensor still references it, so later training does not show in them (the first update
after costs that one copy). Stored masked weights are always exactly 0.
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np

from dense_bridge._errors import SpecError
from dense_bridge.quant import Quant

from ._arrays import assign_array, read_array, to_tensor
from ._models import einsum_params, set_einsum_params
from ._quant import KerasQuantLayer, quant_build, quant_layer
from ._to_spec import declared_variables, describe_layer, layer_kind, layers_of


def layer_variables(layer) -> dict[str, Any]:
    """Canonical name -> Keras variable of one layer (the mask included)."""
    kind = layer_kind(layer)
    if kind == "free":
        return {}
    if kind == "declared":  # as declared: get/set_params transpose when stored_transposed
        kernel, bias, _ = declared_variables(layer)
        return {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
    if not layer.built:
        raise SpecError(f"{describe_layer(layer)} has in_features=None (lazy) and no parameters yet: run one "
                        "input through it (or build it) first")
    out = {"kernel": layer.kernel}
    if layer.bias is not None:
        out["bias"] = layer.bias
    if getattr(layer, "mask", None) is not None and kind == "dense":
        out["mask"] = layer.mask
    return out


def stored_transposed(layer) -> bool:
    """Is this layer's kernel variable the canonical kernel transposed, (units, in_features)? Only a
    layer declared with db.register_layout(..., layout="out_in") stores it so."""
    return layer_kind(layer) == "declared" and declared_variables(layer)[2]


def get_params(native) -> dict[str, np.ndarray]:
    """Canonical params as zero-copy read-only snapshots of the variables (see module doc)."""
    quantized = quant_layer(native)
    if quantized is not None:  # Keras' own dequantization arithmetic (_quant.py)
        return quantized.dequantized()
    layers, keyed = layers_of(native)
    out = {}
    for i, layer in enumerate(layers):
        quantized = quant_layer(layer)
        # an EinsumDense kernel is reshaped (a copy) to the canonical (in_features, units)
        read = quantized.dequantized() if quantized is not None else einsum_params(layer) \
            if layer_kind(layer) == "einsum" else {k: read_array(v) for k, v in layer_variables(layer).items()}
        if "kernel" in read and stored_transposed(layer):
            read["kernel"] = read["kernel"].T  # a zero-copy view in the canonical (in_features, units)
        out.update({(f"{i}." if keyed else "") + k: v for k, v in read.items()})
    return out


def set_params(native, params: dict[str, np.ndarray]) -> None:
    """Write validated canonical params (possibly a subset) into the variables."""
    quantized = quant_layer(native)
    if quantized is not None:  # float weights into codes: Keras' own quantize (_quant.py)
        full = {**quantized.dequantized(), **params}
        quantized.quantize(full["kernel"], full.get("bias")).write()
        return
    layers, keyed = layers_of(native)
    for i, layer in enumerate(layers):
        prefix = f"{i}." if keyed else ""
        mine = {k: params[prefix + k] for k in ("kernel", "bias", "mask") if prefix + k in params}
        if mine and layer_kind(layer) == "einsum" and quant_layer(layer) is None:
            set_einsum_params(layer, mine)
        elif mine:
            _set_layer(layer, mine)


def _set_layer(layer, params: dict[str, np.ndarray]) -> None:
    quantized = quant_layer(layer)
    if quantized is not None:  # a quantized layer in a chain: Keras' own quantizer (_quant.py)
        full = {**quantized.dequantized(), **params}
        quantized.quantize(full["kernel"], full.get("bias")).write()
        return
    variables = layer_variables(layer)
    if hasattr(layer, "clear_masked_cache"):
        layer.clear_masked_cache()  # also inside db.inference, where the cache is otherwise trusted
    if "mask" in params:
        assign_array(variables["mask"], params["mask"])
    if "kernel" in params or "mask" in params:
        given = params.get("kernel")
        if given is not None and stored_transposed(layer):
            given = np.ascontiguousarray(np.asarray(given).T)
        kernel = to_tensor(given) if given is not None else variables["kernel"].value
        if "mask" in variables:  # stored masked weights are exactly 0, whatever was given
            kernel = keras.ops.multiply(kernel, variables["mask"].value)
        variables["kernel"].assign(kernel)
    if "bias" in params:
        assign_array(variables["bias"], params["bias"])


def quant_positions(native: Any) -> dict[str, KerasQuantLayer]:
    """Key prefix ("" for a lone layer, "0.", ... by position in a model's chain) -> the handle of
    each quantized Dense/EinsumDense (what a checkpoint of the chain stores as codes)."""
    layers, keyed = layers_of(native)
    return {(f"{i}." if keyed else ""): h for i, layer in enumerate(layers) if (h := quant_layer(layer)) is not None}


def quant_position_build(native: Any, prefix: str, quant: Quant) -> Any:
    """``native`` with the float Dense at ``prefix`` quantized in place (:func:`quant_build`)."""
    layers, keyed = layers_of(native)
    by_prefix = {(f"{i}." if keyed else ""): layer for i, layer in enumerate(layers)}
    quant_build(by_prefix[prefix], quant)
    return native
