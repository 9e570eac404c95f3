"""Walking Keras models: the layer chain of a Sequential or functional model, and naming layers in errors.

Positions in a chain are the canonical parameter-key positions ("0.kernel"); InputLayers are
not part of it. Subclassed models, shared layers and branching graphs are refused.
"""
from __future__ import annotations

import keras

from dense_bridge._errors import ConversionError


def _describe(obj) -> str:
    t = type(obj)
    return f"layer {getattr(obj, 'name', '?')!r} ({t.__module__}.{t.__qualname__})"


def _is_functional(model) -> bool:
    try:
        from keras.src.models.functional import Functional  # Keras exports no public name for it
    except ImportError:  # pragma: no cover - a future Keras layout
        return type(model).__name__ == "Functional"
    return type(model) is Functional


def _chain(model) -> list:
    """The layers of a Sequential or of a single-path functional model, input to output.

    Positions in this list are the parameter-key positions ("0.kernel"); InputLayers excluded.
    """
    if type(model) is keras.Sequential:
        layers = list(model.layers)
    elif _is_functional(model):
        layers = _functional_chain(model)
    else:
        raise ConversionError(
            f"{_describe(model)} is a subclassed keras.Model; dense_bridge reads keras.Sequential and "
            "functional models whose layers form one chain")
    seen: set[int] = set()
    for layer in layers:
        if id(layer) in seen:
            raise ConversionError(f"{_describe(layer)} is used twice in {_describe(model)}; shared layers "
                                  "cannot be expressed as a Sequential")
        seen.add(id(layer))
    return layers


def _functional_chain(model) -> list:
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ConversionError(f"{_describe(model)} has {len(model.inputs)} inputs and {len(model.outputs)} "
                              "outputs; dense_bridge reads single-input, single-output chains")
    layers, tensor = [], model.outputs[0]
    while True:
        op, node_index, _ = tensor._keras_history  # Keras' own record of the op that made it
        if isinstance(op, keras.layers.InputLayer):
            break
        node = op._inbound_nodes[node_index]
        if len(node.input_tensors) != 1:
            raise ConversionError(
                f"{_describe(op)} in {_describe(model)} takes {len(node.input_tensors)} tensors; dense_bridge "
                "reads models whose layers form one chain (no residual or merge connections)")
        layers.append(op)
        tensor = node.input_tensors[0]
    if tensor is not model.inputs[0]:  # pragma: no cover - Keras guarantees a connected graph
        raise ConversionError(f"{_describe(model)}: the output does not lead back to the input")
    return layers[::-1]


def _layers_of(native) -> tuple[list, bool]:
    """(the layers, whether parameter keys carry their position): a model's chain, or one layer."""
    if isinstance(native, keras.Model):
        return _chain(native), True
    return [native], False
