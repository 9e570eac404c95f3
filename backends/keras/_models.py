"""The ``walk`` verb for Keras, and ``EinsumDense`` read as the linear layer it often is.

Paths are ``layer.path`` without the root model's name ("transformer_layer_0/self_attention_layer/query"),
in Keras' own tracking order (definition order); a layer without a path gets its parent's path
plus its name. Kinds: ``Dense``, dense_bridge's layers and ``EinsumDense`` whose equation is a
linear map are "linear"; quantized ``Dense``/``EinsumDense`` (``quantization_mode`` set) are
"quantized" (read through ``_quant.py``); any other layer with variables of its own (norms, embeddings) is "other", its
variables read and written under their Keras names (``gamma``, ``beta``, ``embeddings``).

An ``EinsumDense`` is a linear map when its equation reads ``<batch><in>,<kernel>-><batch><out>``:
the input's leading axes pass through to the output unchanged, every kernel axis is either
contracted with the input's trailing axes (``in``) or becomes one of the output's trailing axes
(``out``), and nothing else. Then, with in_features = prod(in axes) and units = prod(out axes),
the canonical kernel is the Keras kernel with its axes put in (in..., out...) order and reshaped
to (in_features, units) (MultiHeadAttention's query "abc,cde->abde": kernel (hidden, heads,
head_dim) -> (hidden, heads*head_dim); its output "abcd,cde->abe": (heads, head_dim, hidden) ->
(heads*head_dim, hidden)). The bias spans some trailing output axes (``bias_axes``); read, it is
broadcast to (units,); written, a bias over only some output axes ("partial ``bias_axes``")
accepts only canonical biases constant along the other axes, and refuses others naming them.
As a lone layer (``compare``) it takes (*, in_features) inputs, reshaped to its in axes.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError
from dense_bridge.models._layouts import Entry, declared, register

from ._arrays import assign_array, read_array


@dataclass(frozen=True)
class EinsumPlan:
    """How one EinsumDense maps onto a canonical Dense (see module doc)."""

    perm: tuple[int, ...]  # kernel axes in (in..., out...) order
    in_shape: tuple[int, ...]  # sizes of the contracted input axes, in input order
    out_shape: tuple[int, ...]  # sizes of the output's trailing axes, in output order
    bias_axes: tuple[bool, ...] | None  # per out axis: does the bias span it (None: no bias)
    n_batch: int  # leading axes the equation names ("ab" in "abc,cd->abd"); 1 with an ellipsis

    @property
    def in_features(self) -> int:
        return math.prod(self.in_shape)

    @property
    def units(self) -> int:
        return math.prod(self.out_shape)


def _describe(layer) -> str:
    t = type(layer)
    return f"layer {getattr(layer, 'name', '?')!r} ({t.__module__}.{t.__qualname__})"


def einsum_plan(layer) -> EinsumPlan | str:
    """The plan of a built EinsumDense, or a sentence saying why its equation is not a linear map."""
    if not layer.built:
        return "it is not built yet (no kernel)"
    eq = layer.equation.replace(" ", "")
    m = re.fullmatch(r"(\.\.\.)?([a-zA-Z]+),([a-zA-Z]+)->(\.\.\.)?([a-zA-Z]+)", eq)
    if m is None or bool(m.group(1)) != bool(m.group(4)):
        return f"its equation {layer.equation!r} is not of the form <batch><in>,<kernel>-><batch><out>"
    inp, ker, out = m.group(2), m.group(3), m.group(5)
    if len(set(inp)) < len(inp) or len(set(ker)) < len(ker) or len(set(out)) < len(out):
        return f"its equation {layer.equation!r} repeats an axis (a trace or diagonal)"
    batch = [c for c in inp if c not in ker]
    contracted = [c for c in inp if c in ker]
    free = [c for c in ker if c not in inp]
    if any(c in out for c in contracted) or any(c in inp and c in ker for c in out):
        return f"its equation {layer.equation!r} keeps a kernel axis on both input and output (not a matmul)"
    if inp[:len(batch)] != "".join(batch) or out[:len(batch)] != "".join(batch):
        return (f"its equation {layer.equation!r} does not keep the input's leading axes as the output's "
                f"leading axes, features last")
    if sorted(out[len(batch):]) != sorted(free) or set(ker) != set(contracted) | set(free):
        return f"its equation {layer.equation!r} is not a linear map of the input's trailing axes"
    out_letters = out[len(batch):]
    kshape = tuple(int(s) for s in layer.kernel.shape)
    perm = tuple(ker.index(c) for c in contracted) + tuple(ker.index(c) for c in out_letters)
    bias_axes = None
    if getattr(layer, "bias", None) is not None:
        axes = layer.bias_axes or ""
        if any(c not in out_letters for c in axes):
            return (f"its bias_axes {layer.bias_axes!r} include an axis the input passes through (not a "
                    f"bias of a linear map)")
        bias_axes = tuple(c in axes for c in out_letters)
    return EinsumPlan(perm, tuple(kshape[ker.index(c)] for c in contracted),
                      tuple(kshape[ker.index(c)] for c in out_letters), bias_axes,
                      1 if m.group(1) else len(batch))


def plan_or_raise(layer) -> EinsumPlan:
    plan = einsum_plan(layer)
    if isinstance(plan, str):
        raise ConversionError(f"cannot read {_describe(layer)} as a linear layer: {plan}")
    return plan


def einsum_params(layer) -> dict[str, np.ndarray]:
    """Canonical kernel (in_features, units) and bias (units,) of a linear-map EinsumDense."""
    plan = plan_or_raise(layer)
    kernel = read_array(layer.kernel).transpose(plan.perm).reshape(plan.in_features, plan.units)
    out = {"kernel": kernel}
    if plan.bias_axes is not None:
        out["bias"] = np.broadcast_to(_bias_view(layer, plan), plan.out_shape).reshape(plan.units)
    return out


def _bias_view(layer, plan: EinsumPlan) -> np.ndarray:
    """The Keras bias as an array broadcastable to out_shape (its shape has trailing 1s already)."""
    b = read_array(layer.bias)
    return b.reshape((1,) * (len(plan.out_shape) - b.ndim) + b.shape)


def set_einsum_params(layer, params: dict[str, np.ndarray]) -> None:
    """Write canonical params (checked shapes) into the Keras kernel/bias layout."""
    plan = plan_or_raise(layer)
    bias = None
    if "bias" in params:
        full = np.asarray(params["bias"]).reshape(plan.out_shape)
        keep = tuple(slice(None) if spans else slice(0, 1) for spans in plan.bias_axes)
        bias = full[keep]
        if not np.array_equal(np.broadcast_to(bias, full.shape), full, equal_nan=True):
            lost = [i for i, spans in enumerate(plan.bias_axes) if not spans]
            raise ConversionError(
                f"cannot write the bias of {_describe(layer)}: its bias_axes {layer.bias_axes!r} span only some "
                f"output axes (its bias is shared along output axes {lost} of shape {plan.out_shape}), but the "
                f"given bias (units={plan.units},) differs along them. Build the layer with bias_axes covering every "
                f"output axis to hold this bias")
        bias = bias.reshape(tuple(int(s) for s in layer.bias.shape))
    if "kernel" in params:
        inverse = tuple(np.argsort(plan.perm))
        native = np.asarray(params["kernel"]).reshape(plan.in_shape + plan.out_shape).transpose(inverse)
        assign_array(layer.kernel, np.ascontiguousarray(native))
    if bias is not None:
        assign_array(layer.bias, np.ascontiguousarray(bias))


def einsum_call(layer, x):
    """Run the layer on (*, in_features) input: reshaped to its in axes, output flattened to units."""
    plan = plan_or_raise(layer)
    lead = tuple(x.shape[:-1])
    # the layer's input_spec fixes its rank: leading axes become (rows, 1, ...) for its batch axes
    rows = (math.prod(lead),) + (1,) * max(plan.n_batch - 1, 0)
    y = layer(keras.ops.reshape(x, rows + plan.in_shape), training=False)
    return keras.ops.reshape(y, lead + (plan.units,))


def einsum_canonical_grads(layer, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Native kernel/bias gradients -> canonical layout (bias summed over shared axes is its own grad)."""
    plan = plan_or_raise(layer)
    out = {}
    if "kernel" in grads:
        out["kernel"] = np.asarray(grads["kernel"]).transpose(plan.perm).reshape(plan.in_features, plan.units)
    if "bias" in grads:
        g = np.asarray(grads["bias"])
        g = g.reshape((1,) * (len(plan.out_shape) - g.ndim) + g.shape)
        out["bias"] = np.broadcast_to(g, plan.out_shape).reshape(plan.units)
    return out


# ----------------------------------------------------------------------------- reversible embeddings
#: Keras' (and keras-hub's) ``ReversibleEmbedding``: an embedding table whose ``call(x, reverse=True)``
#: is the output head, ``x @ reverse_embeddings`` (hidden, vocab) when untied: an (in, out) linear
#: map declared like any third-party linear class; tied (``tie_weights=True``), the head is the
#: table transposed and has no parameters of its own (a tie, not a layer).
REVERSIBLE = getattr(keras.layers, "ReversibleEmbedding", None)
if REVERSIBLE is not None:
    register(REVERSIBLE, kernel="reverse_embeddings", layout="in_out")


def untied_reversible(layer) -> bool:
    """Is ``layer`` a ReversibleEmbedding with a float head of its own (``reverse_embeddings``)?"""
    return REVERSIBLE is not None and isinstance(layer, REVERSIBLE) and not layer.tie_weights \
        and layer.quantization_mode is None and isinstance(getattr(layer, "reverse_embeddings", None), keras.Variable)


def is_reversible(layer) -> bool:
    return REVERSIBLE is not None and isinstance(layer, REVERSIBLE)


# ----------------------------------------------------------------------------- walk
def _quantized(layer) -> bool:
    return getattr(layer, "quantization_mode", None) is not None


def _kind(layer) -> str:
    from ._layers import Bilinear, DenseBridgeDense

    if _quantized(layer) and isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return "quantized"
    t = type(layer)
    if t in (keras.layers.Dense, DenseBridgeDense, Bilinear):
        return "linear"
    if t is keras.layers.EinsumDense and not isinstance(einsum_plan(layer), str):
        return "linear"
    if is_reversible(layer):  # the table is "other"; an untied head is reported apart (see walk)
        return "other"
    if declared(layer) is not None:  # db.register_layout: read through _to_spec.declared_variables
        return "linear"
    return "other"


def _own_variables(layer) -> list:
    # the layer's own variables only: its sublayers' are reported under their own paths
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def computed_state(layer) -> bool:
    """Whether ``layer``'s variables are state it computes from its own configuration (a rotary
    embedding's ``inv_freq``): every one was created non-trainable (``add_weight(trainable=False)``;
    freezing a layer later does not move its variables out of ``_trainable_variables``) and the layer
    is not a normalization whose running statistics are learnt from data."""
    import keras

    if layer._trainable_variables or not layer._non_trainable_variables:
        return False
    stats = (keras.layers.BatchNormalization,)
    return not isinstance(layer, stats)


def _children(layer) -> list:
    return [l for l in layer._flatten_layers(include_self=False, recursive=False)]


def auto_name_base(layer) -> str | None:
    """The base of Keras' automatic name for ``layer``'s class ("dense" for "dense_7") when its name
    is one (Keras numbers them process-wide: keras.src.utils.naming), else None."""
    name = getattr(layer, "name", None)
    cls = re.sub(r"\W+", "", type(layer).__name__)
    cls = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", cls)
    base = re.sub("([a-z])([A-Z])", r"\1_\2", cls).lower()
    return base if isinstance(name, str) and re.fullmatch(rf"{re.escape(base)}(_\d+)?", name) else None


def _stable_names(children: list) -> list[str]:
    """Each child's name with Keras' process-wide automatic numbering replaced by its ordinal among
    its auto-named siblings of the same class ("dense_7", "dense_8" -> "dense", "dense_1"): the
    same in every instance of a model, however many layers the process built before it."""
    counts: dict[str, int] = {}
    out = []
    for child in children:
        name = getattr(child, "name", "")
        base = auto_name_base(child)
        if base is not None:
            k = counts.get(base, 0)
            counts[base] = k + 1
            name = base if k == 0 else f"{base}_{k}"
        out.append(name)
    return out


def walk(model) -> list[Entry]:
    """Every layer with variables of its own (and every linear-family layer) under ``model``.

    Each entry's ``extra["stable_path"]`` is its path with automatic names renumbered per model
    (:func:`_stable_names`), so that mapping rules written for one instance carry to another."""
    root = getattr(model, "path", None) or model.name
    out: list[Entry] = []
    seen: set[int] = set()

    def visit(layer, parent: str | None, stable: str) -> None:
        if id(layer) in seen:  # a shared layer is reported once, at its first path
            return
        seen.add(id(layer))
        if parent is None:
            path = ""
        else:
            own = getattr(layer, "path", None)
            if own and own.startswith(root + "/"):
                path = own[len(root) + 1:]
            else:
                path = f"{parent}/{layer.name}" if parent else layer.name
        variables = _own_variables(layer)
        kind = _kind(layer)
        first = len(out)
        if kind == "other" and computed_state(layer):
            variables = []  # set by the layer from its configuration: nothing to carry
        if untied_reversible(layer):
            # two entries: the table (an embedding) and the untied head (a linear map, in, out)
            head = layer.reverse_embeddings
            out.append(_entry(path, layer, kind, [v for v in variables if v is not head]))
            where = f"{path}/reverse_embeddings" if path else "reverse_embeddings"
            linear = _entry(where, layer, "linear", [head])
            linear.extra["param_paths"] = {"reverse_embeddings": where}
            out.append(linear)
        elif variables or kind != "other":
            out.append(_entry(path, layer, kind, variables))
        for e in out[first:]:
            e.extra["stable_path"] = stable + e.path[len(path):]
        children = _children(layer)
        for child, name in zip(children, _stable_names(children)):
            visit(child, path, f"{stable}/{name}" if stable else name)

    visit(model, None, "")
    return out


def _local_name(v) -> str:
    return v.path.rsplit("/", 1)[-1] if getattr(v, "path", None) else v.name


def _entry(path: str, layer, kind: str, variables: list) -> Entry:
    named = {_local_name(v): v for v in variables}

    def read() -> dict[str, np.ndarray]:
        return {n: read_array(v) for n, v in named.items()}

    def write(arrays: dict[str, Any]) -> None:
        for n, a in arrays.items():
            target = numpy_dtype(keras.backend.standardize_dtype(named[n].dtype))
            assign_array(named[n], np.ascontiguousarray(np.asarray(a).astype(target, copy=False)))

    note = "" if kind != "quantized" else f"quantization_mode={layer.quantization_mode!r}"
    return Entry(path, layer, kind, tuple(named), {n: id(v) for n, v in named.items()},
                 {n: tuple(int(s) for s in v.shape) for n, v in named.items()}, read, write, note, sep="/")
