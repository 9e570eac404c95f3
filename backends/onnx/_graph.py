"""The graph index the ONNX modules share, and :class:`OnnxLinear`: one linear layer inside a graph.

An ONNX model is a graph, not a module tree: a linear layer is a pattern of nodes around a
weight initializer. The patterns exporters write for ``y = x @ kernel + bias``:

- ``Gemm(x, W, C)``: ``transB=1`` stores W as (units, in) ("out_in", torch's ``nn.Linear``
  exported at rank 2), ``transB=0`` as (in, units); only ``alpha = beta = 1`` and ``transA=0``
  are linear layers in the canonical sense (anything else is reported, not guessed);
- ``MatMul(x, W)`` on an (in, units) initializer (constant folding turned the weight's
  Transpose into a new initializer, often with a generated name such as ``onnx::MatMul_12``);
- ``MatMul(x, Transpose(W))`` on an (units, in) initializer (perm [1, 0]);
- ``MatMul(x, Mul(W, M))``: dense_bridge's own masked layers (M the 0/1 mask initializer);
- a bias as ``Add(y, b)`` or ``Add(b, y)`` with b a (units,) initializer, the MatMul's only consumer;
- a ``Cast`` (dense_bridge's float16 layers compute in float32) or an ``Identity`` (the legacy
  exporter's merged initializers) between an initializer and its use;
- a weight or bias held by a ``Constant`` node instead of an initializer (read and written in
  its ``value`` tensor, in place).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import NodeProto, TensorProto

from dense_bridge._errors import ConversionError

from ._arrays import FLOAT_TYPES, to_numpy, write_initializer

# Names exporters make up rather than take from the model: the legacy exporter's "onnx::MatMul_12"
# and "/encoder/Constant_3_output_0", dynamo's "val_37"/"_val_4", bare numbers, "Constant_4"
_GENERATED = re.compile(r"^(onnx::.*|_?val_\d+|\d+|.*Constant_\d+.*|.*_output_\d+|initializer(_\d+)?|arg\d+.*)$")


def is_generated(name: str) -> bool:
    """Does an initializer or node name come from the exporter rather than from the model?"""
    return not name or bool(_GENERATED.match(name))


class Index:
    """Lookups over one graph, built on demand (the graph may have changed since the last one).

    ``inits``: initializers by name, and the float tensors ``Constant`` nodes hold by their output's
    name (an exporter may write a weight as a Constant node). Two initializers (or an initializer
    and a node output) of one name are refused: onnxruntime would use one of them and dense_bridge
    could read or write the other.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.model = model
        self.inits: dict[str, TensorProto] = {}
        self.consts: dict[str, NodeProto] = {}  # a Constant node's output -> the node
        for t in g.initializer:
            if t.name in self.inits:
                raise ConversionError(f"the ONNX graph holds two initializers named {t.name!r}: onnxruntime would "
                                      f"use one of them and dense_bridge could read the other; refused")
            self.inits[t.name] = t
        self.producer: dict[str, NodeProto] = {}
        self.consumers: dict[str, list[tuple[NodeProto, int]]] = {}
        self.order: dict[int, int] = {}
        for i, node in enumerate(g.node):
            self.order[id(node)] = i
            for out in node.output:
                if out and out in self.inits:
                    raise ConversionError(f"node {node.name!r} ({node.op_type}) writes the tensor {out!r}, the name "
                                          f"of an initializer too: which one onnxruntime uses is not defined; refused")
                if out:
                    self.producer[out] = node
            for j, name in enumerate(node.input):
                if name:
                    self.consumers.setdefault(name, []).append((node, j))
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
                value = next((a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR),
                             None)
                if value is not None and value.data_type in FLOAT_TYPES:
                    self.consts[node.output[0]] = node
                    self.inits[node.output[0]] = value
        self.outputs = {o.name for o in g.output}

    def uses(self, name: str) -> int:
        """How many node inputs (and graph outputs) read the tensor ``name``."""
        return len(self.consumers.get(name, ())) + (name in self.outputs)

    def only_consumer(self, name: str) -> NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0][0] if len(users) == 1 and name not in self.outputs else None

    def float_init(self, name: str) -> TensorProto | None:
        t = self.inits.get(name)
        return t if t is not None and t.data_type in FLOAT_TYPES else None


def attrs(node: NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@dataclass
class Slot:
    """Where one canonical parameter lives: ``node.input[pos]`` names its initializer; ``transposed``:
    stored as the canonical array's transpose ((units, in) for a kernel)."""

    node: NodeProto
    pos: int
    transposed: bool = False


@dataclass(eq=False)
class ParamSlots:
    """Parameters of one part of a graph, each read by one node input (:class:`Slot`); writes go
    to the initializers of ``model`` in place. ``path``: the part's path in the model."""

    model: onnx.ModelProto
    path: str
    slots: dict[str, Slot]

    def initializer(self, name: str) -> TensorProto:
        slot = self.slots[name]
        wanted = slot.node.input[slot.pos]
        tensor = next((t for t in self.model.graph.initializer if t.name == wanted), None)
        if tensor is None:  # a weight an exporter wrote as a Constant node: its value attribute, in place
            tensor = next((a.t for n in self.model.graph.node if n.op_type == "Constant" and list(n.output) == [wanted]
                           for a in n.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
        if tensor is None:
            raise ConversionError(f"{self.path or 'the layer'}: its {name} initializer "
                                  f"{slot.node.input[slot.pos]!r} is no longer in the graph")
        return tensor

    def native(self, name: str) -> np.ndarray:
        """One parameter as stored (the graph's own layout)."""
        return to_numpy(self.initializer(name))

    def canonical(self, name: str) -> np.ndarray:
        a = self.native(name)
        return a.T if self.slots[name].transposed else a

    def write(self, arrays: dict[str, np.ndarray], *, canonical: bool = True) -> None:
        """Write parameters into the graph. An initializer other nodes read too is left to them
        when the value changes: this layer gets its own copy (a split), never a write for all."""
        index = Index(self.model)
        planned = []
        for name, value in arrays.items():
            slot = self.slots[name]
            read = slot.node.input[slot.pos]
            old = index.inits[read]
            value = np.asarray(value)
            stored = value.T if canonical and slot.transposed else value
            stored = np.ascontiguousarray(stored).astype(to_numpy(old).dtype, copy=False)
            planned.append((slot, read, old, stored))
        for slot, read, old, stored in planned:
            if index.uses(read) > 1:
                current = to_numpy(old)
                if current.shape == stored.shape and current.tobytes() == stored.tobytes():
                    continue
                copy = self.model.graph.initializer.add()
                copy.CopyFrom(old)
                copy.name = _unique(index, f"{read}.{self.path or slot.node.name or 'split'}")
                index.inits[copy.name] = copy
                slot.node.input[slot.pos] = copy.name
                write_initializer(copy, stored)
            else:
                write_initializer(old, stored)



@dataclass(eq=False)
class OnnxLinear(ParamSlots):
    """One linear layer inside an ONNX graph: y = x @ kernel (* mask) + bias over the last axis.

    Works with ``get_params``/``set_params``/``to_spec``/``trace`` as a lone layer. ``matmul``:
    the Gemm/MatMul node (its first input is x); ``output``: the tensor holding
    x @ kernel + bias; ``nodes``: every node of the pattern, in graph order; ``slots``: "kernel",
    "bias", "mask" -> :class:`Slot` ("kernel" transposed when stored (units, in)).
    """

    matmul: NodeProto = None  # type: ignore[assignment]
    output: str = ""
    nodes: list[NodeProto] = field(default_factory=list)
    generated: bool = False  # the path is a made-up name (pairing by order ignores it)

    @property
    def input(self) -> str:
        return self.matmul.input[0]

    def __repr__(self) -> str:
        return f"<OnnxLinear {self.path!r} {self.matmul.op_type} {sorted(self.slots)}>"


def _unique(index: Index, name: str) -> str:
    out, n = name, 1
    while out in index.inits or out in index.producer:
        n += 1
        out = f"{name}.{n}"
    return out


#: nodes between an initializer and its use that keep its values: dense_bridge's float16 layers
#: cast to float32; the legacy exporter reads an initializer it merged with an equal one through
#: an Identity
_PASS_THROUGH = ("Cast", "Identity")


def _through_cast(index: Index, name: str, nodes: list) -> tuple[str, NodeProto | None, int]:
    """(the tensor before an optional Cast of an initializer, the node reading it, the input pos)."""
    node = index.producer.get(name)
    if node is not None and node.op_type in _PASS_THROUGH and node.input[0] in index.inits:
        nodes.append(node)
        return node.input[0], node, 0
    return name, None, -1


def _weight(index: Index, name: str, reader: NodeProto, pos: int, nodes: list) -> tuple[dict, str] | None:
    """Slots of a MatMul's weight operand ``name`` (read by ``reader`` at ``pos``), or None."""
    if index.float_init(name) is not None:
        return {"kernel": Slot(reader, pos)}, ""
    node = index.producer.get(name)
    if node is None:
        return None
    if node.op_type in _PASS_THROUGH and index.float_init(node.input[0]) is not None:
        nodes.append(node)
        return {"kernel": Slot(node, 0)}, ""
    if node.op_type == "Transpose" and list(attrs(node).get("perm", [1, 0])) == [1, 0] \
            and index.float_init(node.input[0]) is not None:
        nodes.append(node)
        return {"kernel": Slot(node, 0, transposed=True)}, ""
    if node.op_type == "Mul" and len(node.input) == 2:
        found = []
        for j in (0, 1):
            src, cast, cpos = _through_cast(index, node.input[j], nodes)
            if index.float_init(src) is None:
                return None
            found.append(Slot(cast, cpos) if cast is not None else Slot(node, j))
        nodes.append(node)
        return {"kernel": found[0], "mask": found[1]}, ""
    return None


def find_linear(model: onnx.ModelProto, index: Index, node: NodeProto) -> tuple[OnnxLinear | None, str]:
    """The linear layer whose Gemm/MatMul is ``node``; (None, why) where it is not one."""
    nodes: list[NodeProto] = []
    if node.op_type == "Gemm":
        a = attrs(node)
        weight = node.input[1] if len(node.input) > 1 else ""
        init = index.float_init(weight)
        if init is None or len(init.dims) != 2 or node.input[0] in index.inits:
            return None, ""
        odd = {k: a.get(k, d) for k, d in (("alpha", 1.0), ("beta", 1.0), ("transA", 0)) if a.get(k, d) != d}
        if odd:
            return None, (f"Gemm {node.name!r} with {', '.join(f'{k}={v}' for k, v in odd.items())} is not "
                          f"x @ kernel + bias: not read as a linear layer")
        slots = {"kernel": Slot(node, 1, transposed=bool(a.get("transB", 0)))}
        units = init.dims[0] if a.get("transB", 0) else init.dims[1]
        if len(node.input) > 2 and node.input[2]:
            bias = index.float_init(node.input[2])
            if bias is None or tuple(bias.dims) != (units,):
                return None, f"Gemm {node.name!r}: its C input is not a ({units},) bias initializer"
            slots["bias"] = Slot(node, 2)
        return OnnxLinear(model, "", slots, node, node.output[0], [node]), ""
    if node.op_type != "MatMul" or len(node.input) != 2 or node.input[0] in index.inits:
        return None, ""
    found = _weight(index, node.input[1], node, 1, nodes)
    if found is None:
        return None, ""
    slots, _ = found
    kernel = index.inits[slots["kernel"].node.input[slots["kernel"].pos]]
    if len(kernel.dims) != 2:
        return None, ""
    if "mask" in slots:
        mask = index.inits[slots["mask"].node.input[slots["mask"].pos]]
        if tuple(mask.dims) != tuple(kernel.dims):
            return None, ""
    units = kernel.dims[0] if slots["kernel"].transposed else kernel.dims[1]
    nodes.append(node)
    out = node.output[0]
    add = index.only_consumer(out)
    if add is not None and add.op_type == "Add":
        other = add.input[1] if add.input[0] == out else add.input[0]
        pos = 1 if add.input[0] == out else 0
        src, cast, cpos = _through_cast(index, other, [])
        bias = index.float_init(src)
        if bias is not None and tuple(bias.dims) == (units,):
            if cast is not None:
                nodes.append(cast)
            slots["bias"] = Slot(cast, cpos) if cast is not None else Slot(add, pos)
            nodes.append(add)
            out = add.output[0]
    nodes.sort(key=lambda n: index.order.get(id(n), 0))
    return OnnxLinear(model, "", slots, node, out, nodes), ""


class Builder:
    """Nodes and initializers of one layer, named ``<prefix><Op>_<n>`` (tensors ``<prefix><op>_<n>``).

    ``compute``: the numpy dtype the layer computes in (float32 or float64). Constants are float64
    scalar initializers, cast to ``compute`` by a Cast node where it is float32, so the graph keeps
    every activation parameter exactly as the spec gave it (ONNX float attributes are float32).
    """

    def __init__(self, prefix: str, compute: np.dtype) -> None:
        self.prefix, self.compute = prefix, np.dtype(compute)
        self.nodes: list[NodeProto] = []
        self.inits: list[TensorProto] = []
        self._n = 0

    def op(self, op_type: str, inputs: list[str], **attributes) -> str:
        self._n += 1
        out = f"{self.prefix}{op_type.lower()}_{self._n}"
        self.nodes.append(onnx.helper.make_node(op_type, inputs, [out], name=f"{self.prefix}{op_type}_{self._n}",
                                                **attributes))
        return out

    def init(self, array: np.ndarray, name: str) -> str:
        from ._arrays import from_numpy

        self.inits.append(from_numpy(array, name))
        return name

    def const(self, value: float) -> str:
        self._n += 1
        name = self.init(np.array(value, dtype=np.float64), f"{self.prefix}const_{self._n}")
        if self.compute == np.float64:
            return name
        return self.op("Cast", [name], to=onnx.helper.np_dtype_to_tensor_dtype(self.compute))


def const_values(index: Index, nodes: list[NodeProto], inside: set[str]) -> list[float]:
    """The scalar constants ``nodes`` read (through a Cast), in node and input order."""
    out = []
    for node in nodes:
        for name in node.input:
            if name in inside:
                continue
            src = index.producer.get(name)
            if src is not None and src.op_type == "Cast" and src.input[0] in index.inits:
                name = src.input[0]
            t = index.inits.get(name)
            if t is not None and not t.dims:
                out.append(float(to_numpy(t)))
    return out


def shape_of(nodes: list[NodeProto], inits: dict[str, TensorProto], start: list[str]) -> list:
    """The structure of ``nodes`` with tensor names replaced by what they are: ("in", k) for the
    k-th of ``start``, ("node", i, j) for output j of the i-th node, ("init", dtype, dims, value
    of a scalar) for an initializer. Two layers compute the same function when these agree."""
    where = {name: ("in", k) for k, name in enumerate(start)}
    out = []
    for i, node in enumerate(nodes):
        ins = []
        for name in node.input:
            if name in where:
                ins.append(where[name])
            elif name in inits:
                t = inits[name]
                small = to_numpy(t).tobytes() if int(np.prod(t.dims)) <= 16 else None  # constants by value
                ins.append(("init", t.data_type, tuple(t.dims), small))
            else:
                ins.append(("?", name))
        out.append((node.op_type, node.domain, tuple(sorted((k, repr(v)) for k, v in attrs(node).items())),
                    tuple(ins)))
        for j, name in enumerate(node.output):
            where[name] = ("node", i, j)
    return out
