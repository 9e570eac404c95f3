"""Linear layers inside any model: find them (:func:`linear_layers`), declare third-party
layouts (:func:`register_layout`) and move whole models' weights (:func:`transfer`).

Everything framework-specific is the adapters' ``walk`` verb: it lists every layer that holds
parameters of its own, with its path in the framework's naming, its kind ("linear",
"quantized", "other") and readers/writers for its own parameters. Paths:

- torch: module paths from ``named_modules`` ("encoder.layer.0.output.dense");
- Keras: ``layer.path`` without the root model's name ("transformer_layer_0/self_attention_layer/query");
  automatic names depend on process history ("dense_3"), so name the layers you map;
- MLX: dotted attribute paths ("model.layers.0.mlp.up_proj"), in ``tree_flatten`` order.
"""
from __future__ import annotations

from typing import Any

from ._errors import ConversionError, received
from ._layouts import Entry, Layout, register
from ._registry import adapter_for, backend_of

__all__ = ["linear_layers", "register_layout", "transfer", "walk"]


def walk(model: Any, argument: str = "model") -> list[Entry]:
    """Every layer of ``model`` holding parameters of its own, in definition order (adapter ``walk``)."""
    name = backend_of(model, argument)
    adapter = adapter_for(model, argument)
    verb = getattr(adapter, "walk", None)
    if verb is None:
        raise ConversionError(f"the {name!r} backend cannot look inside models (it has no walk verb). "
                              f"{received(argument, model)}")
    return verb(model)


def _refuse_quantized(entries: list[Entry], argument: str) -> None:
    bad = [e for e in entries if e.kind == "quantized"]
    if bad:
        listed = "; ".join(f"{e.where()}{': ' + e.note if e.note else ''}" for e in bad)
        raise ConversionError(
            f"{argument} holds quantized linear layers, which have no exact float kernel to read or write: "
            f"{listed}. Dequantize the model first (load it in float16/float32, or mlx_lm's dequantize), "
            f"then list or transfer its layers")


def linear_layers(model: Any) -> dict[str, Any]:
    """Every linear-family layer inside ``model``, keyed by its path, in definition order.

    Linear-family: torch ``nn.Linear``/``LazyLinear``/``nn.Bilinear``, Keras ``Dense`` and
    ``EinsumDense`` whose equation is a linear map, MLX ``nn.Linear``/``nn.Bilinear``, and classes
    declared with :func:`register_layout` (transformers' ``Conv1D`` built in). Each value is the
    native layer itself and works with ``to_spec``, ``get_params`` (canonical kernel
    (in_features, units)), ``set_params``, ``convert`` and ``testing.compare`` like a lone layer.
    Quantized linear layers raise ConversionError naming them (no exact float kernel exists).
    A model that is itself a linear layer comes back under the path "".
    """
    entries = walk(model)
    _refuse_quantized(entries, "model")
    return {e.path: e.layer for e in entries if e.kind == "linear"}


def register_layout(cls: Any, *, kernel: str, bias: str | None = None, layout: str) -> Layout:
    """Declare where a third-party linear class keeps its parameters, and in which layout.

    ``cls``: the class, or its dotted name ("transformers.pytorch_utils.Conv1D") so that the
    framework need not be imported to declare it. ``kernel``/``bias``: attribute names.
    ``layout``: ``"in_out"`` (kernel stored as (in_features, units), like Conv1D) or
    ``"out_in"`` (stored as (units, in_features), like ``nn.Linear``). The class must compute
    ``x @ kernel + bias`` over the last axis; only its exact class is matched (a subclass may
    change the forward). Declaring a class again replaces its declaration. Returns it.
    """
    return register(cls, kernel=kernel, bias=bias, layout=layout)


def transfer(src: Any, dst: Any, *, mapping: Any = None, strict: bool = True):  # filled in below
    raise NotImplementedError
