"""Reading Keras objects back into specs: which layers are readable (:func:`layer_kind`) and their specs,
and walking models: the layer chain of a Sequential or functional model (positions in a chain are
the canonical parameter-key positions, "0.kernel"; InputLayers are not part of it; subclassed
models, shared layers and branching graphs are refused).

Reads keras.layers.Dense, DenseBridgeDense, Bilinear, Identity, Dropout (identity at
inference) and the activation layers, alone or in a Sequential or single-chain functional
model. A name Keras generated ("dense_3") is not carried into the spec.
"""
from __future__ import annotations

import math
import re

import keras

from dense_bridge._dtypes import DTYPE_NAMES
from dense_bridge._errors import ConversionError, SpecError
from dense_bridge.models._layouts import declared, warn_dropout
from dense_bridge.specs import Bilinear as BilinearSpec
from dense_bridge.specs import Dense, Flatten, Identity, Sequential

from ._quant import quant_layer
from ._activations import activation_of_function, activation_of_layer
from ._layers import AnyRankSequential, Bilinear, DenseBridgeDense, init_of
from ._models import plan_or_raise



# ------------------------------------------------------------------ walking models
def describe_layer(obj) -> str:
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
    if type(model) in (keras.Sequential, AnyRankSequential):
        layers = list(model.layers)
    elif _is_functional(model):
        layers = _functional_chain(model)
    else:
        raise ConversionError(
            f"{describe_layer(model)} is a subclassed keras.Model; dense_bridge reads keras.Sequential and "
            "functional models whose layers form one chain")
    seen: set[int] = set()
    for layer in layers:
        if id(layer) in seen:
            raise ConversionError(f"{describe_layer(layer)} is used twice in {describe_layer(model)}; shared layers "
                                  "cannot be expressed as a Sequential")
        seen.add(id(layer))
    return layers


def _functional_chain(model) -> list:
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ConversionError(f"{describe_layer(model)} has {len(model.inputs)} inputs and {len(model.outputs)} "
                              "outputs; dense_bridge reads single-input, single-output chains")
    layers, tensor = [], model.outputs[0]
    while True:
        op, node_index, _ = tensor._keras_history  # Keras' own record of the op that made it
        if isinstance(op, keras.layers.InputLayer):
            break
        node = op._inbound_nodes[node_index]
        if len(node.input_tensors) != 1:
            raise ConversionError(
                f"{describe_layer(op)} in {describe_layer(model)} takes {len(node.input_tensors)} tensors; dense_bridge "
                "reads models whose layers form one chain (no residual or merge connections)")
        layers.append(op)
        tensor = node.input_tensors[0]
    if tensor is not model.inputs[0]:  # pragma: no cover - Keras guarantees a connected graph
        raise ConversionError(f"{describe_layer(model)}: the output does not lead back to the input")
    return layers[::-1]


def layers_of(native) -> tuple[list, bool]:
    """(the layers, whether parameter keys carry their position): a model's chain, or one layer."""
    if isinstance(native, keras.Model):
        return _chain(native), True
    return [native], False


# ------------------------------------------------------------------ layers -> specs

def _snake(name: str) -> str:
    # keras.src.utils.naming.to_snake_case, which Keras uses for automatic layer names
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _spec_name(obj) -> str | None:
    """The layer's name, or None when Keras generated it ("dense_3", "sequential")."""
    name = getattr(obj, "name", None)
    if name is None or re.fullmatch(rf"{re.escape(_snake(type(obj).__name__))}(_\d+)?", name):
        return None
    return name


def layer_kind(layer) -> str:
    """"dense", "einsum", "declared" (db.register_layout), "bilinear" or "free" (no parameters);
    ConversionError for anything else."""
    t = type(layer)
    if t in (keras.layers.Dense, DenseBridgeDense):
        return "dense"
    if t is Bilinear:
        return "bilinear"
    if t is keras.layers.EinsumDense:  # a linear map by its equation, or refused saying why
        plan_or_raise(layer)
        return "einsum"
    if declared(layer) is not None:  # a custom layer declared with db.register_layout
        declared_variables(layer)  # refused here, saying why, when the declaration does not fit
        return "declared"
    if t is keras.layers.Flatten and layer.data_format == "channels_first":
        raise ConversionError(f"cannot convert {describe_layer(layer)}: Flatten(data_format='channels_first') moves the "
                              f"channels last before flattening; db.Flatten() flattens the axes in their order")
    if t in (keras.layers.Identity, keras.layers.Dropout, keras.layers.Flatten) or \
            activation_of_layer(layer) is not None:
        return "free"
    raise ConversionError(
        f"cannot convert {describe_layer(layer)}: dense_bridge reads Dense, EinsumDense (a linear map), Bilinear, "
        "Identity, Dropout, Flatten, Activation, ReLU, LeakyReLU, ELU and Softmax layers")


def declared_variables(layer) -> tuple[object, object | None, bool]:
    """(kernel variable, bias variable or None, stored transposed?) of a custom Keras layer declared
    with db.register_layout; ConversionError when it is not built or the names do not fit."""
    decl = declared(layer)
    if getattr(layer, "tie_weights", False) and decl.kernel == "reverse_embeddings":
        raise ConversionError(f"{describe_layer(layer)} ties its output head to its embeddings (tie_weights=True): "
                              f"the head is the table transposed and has no linear parameters of its own; move the "
                              f"table (its 'embeddings') and the head follows")
    if not getattr(layer, "built", False):
        raise SpecError(f"{describe_layer(layer)} is not built yet and has no parameters: run one input through it "
                        f"(or build it) first")
    kernel = getattr(layer, decl.kernel, None)
    if not isinstance(kernel, keras.Variable) or len(kernel.shape) != 2:
        raise ConversionError(f"cannot read {describe_layer(layer)}: its layout declaration names the kernel "
                              f"attribute {decl.kernel!r}, which is {type(kernel).__name__}, not a 2-D Keras variable")
    bias = getattr(layer, decl.bias, None) if decl.bias else None
    if bias is not None and (not isinstance(bias, keras.Variable) or len(bias.shape) != 1):
        raise ConversionError(f"cannot read {describe_layer(layer)}: its layout declaration names the bias "
                              f"attribute {decl.bias!r}, which is {type(bias).__name__}, not a 1-D Keras variable")
    units = kernel.shape[0] if decl.transposed else kernel.shape[1]
    if bias is not None and bias.shape[0] != units:
        raise ConversionError(f"cannot read {describe_layer(layer)}: its bias {decl.bias!r} has {bias.shape[0]} entries "
                              f"but its kernel {decl.kernel!r} {tuple(kernel.shape)} stored {decl.layout!r} has "
                              f"{units} units")
    return kernel, bias, decl.transposed


def to_spec(native):
    """The dense_bridge spec of a Keras layer, Sequential or single-chain functional model."""
    quantized = quant_layer(native)
    if quantized is not None:  # the float Dense a quantized Dense/EinsumDense stands for
        return quantized.spec()
    if isinstance(native, keras.Model):
        return _model_spec(native)
    return _layer_spec(native)


def _model_spec(model) -> Sequential:
    chain = _chain(model)
    specs = []
    for layer in chain:
        if layer_kind(layer) == "bilinear":
            raise ConversionError(f"{describe_layer(layer)} takes two inputs and cannot sit in a Sequential chain")
        specs.append(_layer_spec(layer))
    try:
        return Sequential(specs, in_features=_input_width(model), name=_spec_name(model))
    except SpecError as exc:
        raise ConversionError(f"{describe_layer(model)}: {exc}") from None


def _input_width(model) -> int | None:
    try:
        inputs = model.inputs  # a Sequential without an Input has none yet (lazy)
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    shape = inputs[0].shape
    if type(model.layers[0]).__name__ == "Flatten" and len(shape) > 2:  # the width after flattening
        return None if any(s is None for s in shape[1:]) else int(math.prod(shape[1:]))
    width = shape[-1]
    return None if width is None else int(width)


def _layer_spec(layer):
    quantized = quant_layer(layer)
    if quantized is not None:  # a quantized Dense/EinsumDense in a chain: the float Dense it stands for
        return quantized.spec()
    kind = layer_kind(layer)
    if kind == "dense":
        return _dense_spec(layer)
    if kind == "einsum":
        return _einsum_spec(layer)
    if kind == "declared":  # the declaration says: x @ kernel + bias, no activation
        kernel, bias, transposed = declared_variables(layer)
        units, in_features = kernel.shape if transposed else kernel.shape[::-1]
        return Dense(int(units), in_features=int(in_features), use_bias=bias is not None,
                     dtype=_dtype_of(layer), name=_spec_name(layer))
    if kind == "bilinear":
        return BilinearSpec(layer.in1_features, layer.in2_features, layer.units, use_bias=layer.use_bias,
                            init=init_of(layer.kernel_initializer, "torch_default"),
                            dtype=_dtype_of(layer), name=_spec_name(layer))
    if type(layer) is keras.layers.Flatten:
        return Flatten(name=_spec_name(layer))
    if type(layer) is keras.layers.Dropout:
        warn_dropout(describe_layer(layer), layer.rate)
    if type(layer) in (keras.layers.Identity, keras.layers.Dropout):  # Dropout: identity at inference
        return Identity(name=_spec_name(layer))
    return activation_of_layer(layer)


def _dtype_of(layer) -> str:
    # the variables' dtype: a mixed policy ("mixed_float16") reads as its float32 parameters
    dtype = keras.backend.standardize_dtype(layer.dtype_policy.variable_dtype)
    if dtype not in DTYPE_NAMES:
        raise ConversionError(f"{describe_layer(layer)} has dtype {dtype}; dense_bridge supports "
                              f"{', '.join(DTYPE_NAMES)}")
    return dtype


_DROPPED = ("kernel_regularizer", "bias_regularizer", "activity_regularizer", "kernel_constraint", "bias_constraint")


def _warn_dropped(layer) -> None:
    """Name the regularizers and constraints a spec cannot carry: a port (convert, save) drops them."""
    import warnings

    found = {a: getattr(layer, a, None) for a in _DROPPED}
    found = {a: v for a, v in found.items() if v is not None}
    if found:
        listed = ", ".join(f"{a}={type(v).__name__}" for a, v in found.items())
        warnings.warn(f"{describe_layer(layer)}: {listed} dropped: a dense_bridge spec carries no regularizers or "
                      f"constraints, so a converted or saved model trains without them", UserWarning, stacklevel=4)


def _einsum_spec(layer) -> Dense:
    """An EinsumDense whose equation is a linear map, as the Dense it computes (backends/keras/_models.py)."""
    where = describe_layer(layer)
    if getattr(layer, "quantization_mode", None) is not None or getattr(layer, "lora_enabled", False):
        raise ConversionError(f"{where} is quantized or has LoRA enabled; dense_bridge reads plain kernels")
    plan = plan_or_raise(layer)
    _warn_dropped(layer)
    return Dense(plan.units, in_features=plan.in_features, use_bias=plan.bias_axes is not None,
                 activation=activation_of_function(layer.activation, where),
                 kernel_init=init_of(layer.kernel_initializer, "glorot_uniform"),
                 bias_init=init_of(layer.bias_initializer, "zeros"), dtype=_dtype_of(layer), name=_spec_name(layer))


def _dense_spec(layer) -> Dense:
    where = describe_layer(layer)
    if getattr(layer, "quantization_mode", None) is not None or getattr(layer, "lora_enabled", False):
        raise ConversionError(f"{where} is quantized or has LoRA enabled; dense_bridge reads plain kernels")
    wiring = layer.wiring() if isinstance(layer, DenseBridgeDense) else None
    _warn_dropped(layer)
    in_features = int(layer.kernel.shape[0]) if layer.built else None
    return Dense(layer.units, in_features=in_features, use_bias=layer.use_bias,
                 activation=activation_of_function(layer.activation, where),
                 kernel_init=init_of(layer.kernel_initializer, "glorot_uniform"),
                 bias_init=init_of(layer.bias_initializer, "zeros"),
                 mask=wiring, dtype=_dtype_of(layer), name=_spec_name(layer))
