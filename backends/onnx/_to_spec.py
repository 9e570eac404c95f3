"""The ``to_spec`` verb: a linear layer inside any graph, and the chains ``compile`` writes.

A chain is read layer by layer (its nodes grouped by their ``<position>/`` prefix): each layer's
spec is read from its initializers (widths, bias, mask, dtype) and operators (the activation, see
``_activations.candidates``), then written again with those very parameters and compared node for
node, inputs and constants included, with what the graph holds. A graph that differs anywhere is
not read as a chain (ConversionError): its linear layers are still found by ``db.linear_layers``.
"""
from __future__ import annotations

import json

import numpy as np
import onnx

from dense_bridge._errors import ConversionError
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Flatten, Identity, Sequential, from_config
from dense_bridge.wiring import Wiring

from . import _activations
from ._arrays import dtype_name_of, to_numpy
from ._graph import Index, OnnxLinear, ParamSlots, Slot, attrs, const_values, find_linear, shape_of
from ._layers import CHAIN_KEY, SPEC_KEY, Emitter


def linear_spec(layer: OnnxLinear) -> Dense:
    """The Dense a linear layer inside a graph computes (no activation: the layer is the linear map)."""
    kernel = layer.initializer("kernel")
    dims = tuple(kernel.dims)
    in_f, units = (dims[1], dims[0]) if layer.slots["kernel"].transposed else dims
    mask = None
    if "mask" in layer.slots:
        mask = Wiring(layer.canonical("mask") != 0, allow_empty_outputs=True)
    return Dense(int(units), in_features=int(in_f), use_bias="bias" in layer.slots, mask=mask,
                 dtype=dtype_name_of(kernel.data_type) or "float32", kernel_init="zeros")


class _Given:
    """A ParamSource stand-in for writing a layer again with the parameters the graph holds."""

    def __init__(self, params: dict) -> None:
        self.params = params

    def for_layer(self, index, layer) -> dict:
        return self.params


def _groups(model: onnx.ModelProto, seq: bool) -> list[list]:
    if not seq:
        return [list(model.graph.node)]
    groups: dict[int, list] = {}
    for node in model.graph.node:
        head, sep, _ = node.name.partition("/")
        if not sep or not head.isdigit():
            raise ConversionError(f"node {node.name!r} belongs to no layer of a dense_bridge chain")
        groups.setdefault(int(head), []).append(node)
    if sorted(groups) != list(range(len(groups))):
        raise ConversionError(f"the chain's layer positions are not 0..n-1: {sorted(groups)}")
    return [groups[i] for i in range(len(groups))]


def _written(i: int, spec, params: dict, seq: bool, x: list[str], x_dtype: np.dtype):
    em = Emitter(_Given(params), seq)
    if isinstance(spec, Dense):
        y, dt = em.dense(i, spec, x[0], x_dtype)
    elif isinstance(spec, Bilinear):
        y, dt = em.bilinear(i, spec, x, x_dtype)
    else:
        y, dt = em.other(i, spec, x[0], x_dtype)
    return em.nodes, {t.name: t for t in em.inits}, dt


def _activation_candidates(index: Index, tail: list) -> list[Activation]:
    ops = tuple(n.op_type for n in tail if n.op_type != "Cast")
    if not ops:
        return [Activation("linear")]
    body = [n for n in tail if n.op_type != "Cast"]
    inside = {o for n in body for o in n.output}
    return _activations.candidates(ops, [attrs(n) for n in body], const_values(index, body, inside))


def _layer_candidates(index: Index, model, group: list) -> list[tuple]:
    """(spec, params, slots) guesses for one group of nodes."""
    ops = [n.op_type for n in group]
    if "MatMul" in ops:
        matmul = group[ops.index("MatMul")]
        lin, _ = find_linear(model, index, matmul)
        if lin is None:
            return []
        base = linear_spec(lin)
        params = {k: lin.canonical(k) for k in lin.slots}
        last = max(group.index(n) for n in lin.nodes)
        return [(base.replace(activation=a), params, lin) for a in _activation_candidates(index, group[last + 1:])]
    if "Einsum" in ops:
        ein = group[ops.index("Einsum")]
        kernel = index.float_init(ein.input[1])
        if kernel is None or len(kernel.dims) != 3:
            return []
        slots = {"kernel": Slot(ein, 1)}
        add = index.only_consumer(ein.output[0])
        if add is not None and add.op_type == "Add" and add in group:
            src = add.input[1]
            cast = index.producer.get(src)
            slots["bias"] = Slot(cast, 0) if cast is not None and cast.op_type == "Cast" else Slot(add, 1)
        holder = ParamSlots(model, "", slots)
        units, in1, in2 = (int(d) for d in kernel.dims)
        spec = Bilinear(in1, in2, units, use_bias="bias" in slots, dtype=dtype_name_of(kernel.data_type) or "float32")
        return [(spec, {k: to_numpy(holder.initializer(k)) for k in slots}, holder)]
    if ops == ["Flatten"]:
        return [(Flatten(), {}, None)]
    if ops == ["Identity"]:
        return [(Identity(), {}, None)] + [(a, {}, None) for a in [Activation("linear")]]
    return [(a, {}, None) for a in _activation_candidates(index, group) if not a.is_identity]


def read_chain(model: onnx.ModelProto) -> tuple[list, list]:
    """([layer spec], [ParamSlots or None]) of a chain ``compile`` wrote; ConversionError otherwise."""
    kind = {p.key: p.value for p in model.metadata_props}.get(CHAIN_KEY)
    if kind not in ("sequential", "layer"):
        raise ConversionError("this ONNX graph is not a chain dense_bridge compiled, so it has no spec of its own: "
                              "read its linear layers with db.linear_layers(model)")
    seq = kind == "sequential"
    index = Index(model)
    g = model.graph
    x = [i.name for i in g.input]
    x_dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.input[0].type.tensor_type.elem_type))
    specs, holders = [], []
    for i, group in enumerate(_groups(model, seq)):
        for spec, params, holder in _layer_candidates(index, model, group):
            try:
                nodes, inits, dt = _written(i, spec, params, seq, x, x_dtype)
            except Exception:  # noqa: BLE001 - a guess that cannot even be written is no match
                continue
            if shape_of(nodes, inits, x) == shape_of(group, index.inits, x):
                break
        else:
            raise ConversionError(f"layer {i} of this ONNX graph ({[n.op_type for n in group]}) is not a layer "
                                  f"dense_bridge writes: read its linear layers with db.linear_layers(model)")
        specs.append(spec)
        holders.append(holder)
        x, x_dtype = [group[-1].output[0]], dt
    if not seq and len(specs) != 1:
        raise ConversionError("a lone dense_bridge layer graph holds more than one layer")
    return specs, holders


def _strip(spec):
    if isinstance(spec, Sequential):
        return Sequential([_strip(l) for l in spec.layers], in_features=spec.in_features)
    if isinstance(spec, Dense):
        return spec.replace(kernel_init="zeros", bias_init="zeros", name=None)
    if isinstance(spec, Bilinear):
        return spec.replace(init="zeros", name=None)
    return spec


def to_spec(native):
    """The spec of a linear layer in a graph (no activation), or of a chain ``compile`` wrote
    (initializer names and the spec's name kept from its metadata where the graph agrees)."""
    if isinstance(native, OnnxLinear):
        return linear_spec(native)
    specs, _ = read_chain(native)
    props = {p.key: p.value for p in native.metadata_props}
    seq = props.get(CHAIN_KEY) == "sequential"
    read = Sequential(specs) if seq else specs[0]
    try:
        kept = from_config(json.loads(props.get(SPEC_KEY, "null")))
    except Exception:  # noqa: BLE001 - metadata is a hint; the graph is what counts
        kept = None
    if kept is not None and _strip(kept) == _strip(read):
        return kept
    return read
