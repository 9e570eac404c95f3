"""The ``to_spec`` verb: a linear layer inside any graph, the chains ``compile`` writes, and chains
of linear layers and activations other tools export (``torch.onnx.export``, both exporters).

A chain ``compile`` wrote (its metadata says so) is read layer by layer (its nodes grouped by
their ``<position>/`` prefix): each layer's spec is read from its initializers (widths, bias,
mask, dtype) and operators (the activation, see ``_activations.candidates``), then written again
with those very parameters and compared node for node, inputs and constants included, with what
the graph holds. A graph that differs anywhere is not read as such a chain (ConversionError).

Any other graph is read as an exported chain (:func:`read_exported`): from its one input to its
one output, each linear layer (``_graph.find_linear``: Gemm with transB 0 or 1 and alpha = beta
= 1, MatMul + Add, weights behind Transpose/Identity/Cast or in Constant nodes) is a Dense, and
the nodes between two of them are read as an expression of the value entering them and scalar
constants, matched against the forms of the table's activations (``_activations.peel``) and
``Flatten``. A graph that branches, reads a second input, or computes anything else is refused
with a ConversionError naming the first node that is not part of such a chain: its linear layers
are still found by ``db.linear_layers``.
"""
from __future__ import annotations

import json

import numpy as np
import onnx

from dense_bridge._errors import ConversionError, SpecError
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Flatten, Identity, Sequential, from_config
from dense_bridge.wiring import Wiring

from . import _activations
from ._activations import Expr, NotAnActivation, const, fold
from ._arrays import FLOAT_TYPES, dtype_name_of, to_numpy
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


def _compiled_chain(model: onnx.ModelProto, kind: str) -> tuple[list, list, list]:
    """(specs, holders, output tensors) of a chain ``compile`` wrote; ConversionError otherwise."""
    seq = kind == "sequential"
    index = Index(model)
    g = model.graph
    x = [i.name for i in g.input]
    x_dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.input[0].type.tensor_type.elem_type))
    specs, holders, ends = [], [], []
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
        ends.append(x[0])  # compile names the last node's output "y", the graph's
    if not seq and len(specs) != 1:
        raise ConversionError("a lone dense_bridge layer graph holds more than one layer")
    return specs, holders, ends


class Chain:
    """A graph read as a chain: ``specs`` and ``holders`` (the parameters of each position, None
    for one without), ``ends`` (the tensor each position outputs), ``seq`` (a Sequential, else one
    lone layer: canonical keys without a position prefix)."""

    def __init__(self, specs: list, holders: list, ends: list, seq: bool) -> None:
        self.specs, self.holders, self.ends, self.seq = specs, holders, ends, seq


def chain_of(model: onnx.ModelProto) -> Chain:
    """The chain ``model`` computes (module docstring); ConversionError where it is none."""
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"expected an onnx.ModelProto, got {type(model).__name__}")
    kind = {p.key: p.value for p in model.metadata_props}.get(CHAIN_KEY)
    if kind in ("sequential", "layer"):
        specs, holders, ends = _compiled_chain(model, kind)
        return Chain(specs, holders, ends, kind == "sequential")
    specs, holders, ends = read_exported(model)
    seq = not (len(specs) == 1 and isinstance(specs[0], Dense))  # a lone linear layer, as torch's nn.Linear
    return Chain(specs, holders, ends, seq)


def read_chain(model: onnx.ModelProto) -> tuple[list, list]:
    """([layer spec], [ParamSlots or None]) of a chain (see :func:`chain_of`); ConversionError otherwise."""
    c = chain_of(model)
    return c.specs, c.holders


# ------------------------------------------------------------------ chains other tools exported
def _refuse(node, why: str) -> ConversionError:
    where = f"node {node.name!r} ({node.op_type})" if node is not None else "the graph"
    return ConversionError(f"this ONNX graph is not a chain of linear layers and activations: {where} {why}. "
                           f"Its linear layers are still found by db.linear_layers(model)")


#: ONNX's attribute defaults (opset 13 on) for the operators an activation is read from
_DEFAULTS = {"Softmax": {"axis": -1}, "LogSoftmax": {"axis": -1}, "LeakyRelu": {"alpha": 0.01}, "Elu": {"alpha": 1.0},
             "HardSigmoid": {"alpha": 0.2, "beta": 0.5},
             "Selu": {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
             "Gelu": {"approximate": "none"}, "Flatten": {"axis": 1}, "Swish": {"alpha": 1.0}}
#: operators read as themselves inside an activation (their inputs read in turn)
_ELEMENTWISE = {"Relu", "Sigmoid", "Tanh", "Exp", "Erf", "Gelu", "Softplus", "Elu", "Selu", "LeakyRelu",
                "HardSigmoid", "HardSwish", "Mish", "Softsign", "Softmax", "LogSoftmax", "Abs", "Log", "Where",
                "Greater", "Min", "Max", "Swish", "Flatten", "Sqrt", "Clip", "Div"}
#: every operator read inside a run of activations (the others refuse the graph as a chain)
_READ = _ELEMENTWISE | {"Identity", "Dropout", "Cast", "CastLike", "Mul", "Add", "Sub", "Neg", "Pow", "Constant"}
#: the longest path of nodes read inside one run of activations (deeper is refused, not recursed)
_MAX_DEPTH = 100
#: element types a scalar constant is read from: floats, integers, bool
_NUMERIC = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 16})
#: relative rounding of a constant stored in each dtype (two ulps)
_TOL = {1: 2.0 ** -22, 10: 2.0 ** -9, 16: 2.0 ** -6, 11: 2.0 ** -51}


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _attr_value(a) -> object:
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, float):
        return float(v)
    if isinstance(v, int):
        return int(v)
    return repr(v)  # tensors, graphs, lists: no form reads them, so any such node is no match


class _Segment:
    """Reads the nodes between two positions of a chain as an :class:`Expr` of the value ``start``."""

    def __init__(self, model: onnx.ModelProto, index: Index, start: str, linear_nodes: set[int],
                 rank: int | None) -> None:
        self.model, self.index, self.start, self.linear_nodes = model, index, start, linear_nodes
        self.rank = rank  # of the value entering the segment, where the graph tells it
        self.opset = _opset(model)
        self.memo: dict[str, Expr] = {}
        self.used: set[int] = set()
        self.open: list[str] = []  # tensors being read (a cycle, or a path past _MAX_DEPTH, is refused)

    def constant(self, name: str, reader) -> Expr | None:
        """A scalar constant (initializer or Constant node), or None where ``name`` is computed."""
        index = self.index
        node = index.producer.get(name)
        if name in index.inits:
            t = index.inits[name]
            if node is not None:
                self.used.add(id(node))
        elif node is not None and node.op_type == "Constant" and len(node.attribute) == 1:
            self.used.add(id(node))
            a = node.attribute[0]
            if a.name in ("value_float", "value_int"):
                return const(float(onnx.helper.get_attribute_value(a)), _TOL[1] if a.name == "value_float" else 0.0)
            if a.name != "value" or a.type != onnx.AttributeProto.TENSOR:
                raise _refuse(node, f"holds a {a.name} constant where an activation reads a scalar")
            t = a.t
        else:
            return None
        if t.data_type not in _NUMERIC:
            raise _refuse(reader, f"reads {name!r}, a constant of element type "
                                  f"{onnx.TensorProto.DataType.Name(t.data_type)}, where an activation reads a number")
        if int(np.prod(t.dims)) != 1 or len(t.dims) > 1:
            raise _refuse(reader, f"reads {name!r}, a constant of shape {tuple(t.dims)}: inside a chain only "
                                  f"scalar constants (activation parameters) are read, so this is no activation")
        value = to_numpy(t).reshape(()).astype(np.float64)
        return const(float(value), _TOL.get(t.data_type, 0.0))

    def expr(self, name: str, reader) -> Expr:
        if name == self.start:
            return Expr("x", tensor=name)
        if not name:
            return Expr("none")
        if name in self.memo:
            return self.memo[name]
        c = self.constant(name, reader)
        if c is not None:
            return c
        node = self.index.producer.get(name)
        if node is None or id(node) in self.linear_nodes:
            what = "an input of the graph" if node is None else f"the output of the linear layer at {node.name!r}"
            raise _refuse(reader, f"reads {name!r} ({what}) besides the chain's value {self.start!r}: a branch, "
                                  f"residual connection or second input")
        if name in self.open or len(self.open) >= _MAX_DEPTH:
            raise _refuse(node, "is part of a cycle or of a path too long to be activations")
        self.used.add(id(node))
        self.open.append(name)
        e = self.node_expr(node, name)
        self.open.pop()
        self.memo[name] = e
        return e

    def node_expr(self, node, name: str) -> Expr:
        kind = node.op_type
        if node.domain not in ("", "ai.onnx"):
            raise _refuse(node, f"is an operator of the domain {node.domain!r}, not an activation")
        if name != node.output[0]:
            raise _refuse(node, f"is read through its output {name!r}, which no activation uses")
        a = {**_DEFAULTS.get(kind, {}), **{x.name: _attr_value(x) for x in node.attribute}}
        if kind in ("Softmax", "LogSoftmax") and self.opset < 13:  # before 13: over the axes from axis on
            rank = 2 if _has(self.expr(node.input[0], node), "Flatten") else self.rank
            axis = next((x.i for x in node.attribute if x.name == "axis"), 1)
            if axis != -1 and (rank is None or axis != rank - 1):
                raise _refuse(node, f"normalizes over the axes from {axis} on (opset {self.opset}), of a value of "
                                    f"rank {rank}: not one axis")
            a["axis"] = -1

        def arg(i: int) -> Expr:
            return self.expr(node.input[i], node) if i < len(node.input) else Expr("none")

        if kind == "Identity":
            return arg(0).at(name)
        if kind == "Dropout":  # inference: the identity unless training_mode is given and not a constant false
            if len(node.input) > 2 and node.input[2]:
                mode = self.constant(node.input[2], node)
                if mode is None or mode.value != 0:
                    raise _refuse(node, "runs in training mode (training_mode is not a constant false)")
            return arg(0).at(name)
        if kind in ("Cast", "CastLike"):
            to = a.get("to") if kind == "Cast" else (self.index.inits.get(node.input[1]).data_type
                                                   if node.input[1] in self.index.inits else None)
            if to not in FLOAT_TYPES:
                raise _refuse(node, "casts to a type other than a floating one")
            inner = arg(0)
            return const(inner.value, max(inner.tol, _TOL.get(to, 0.0))) if inner.op == "c" else inner.at(name)
        if kind in ("Mul", "Add"):
            return fold(kind, [arg(0), arg(1)], name)
        if kind == "Sub":
            return fold("Add", [arg(0), fold("Mul", [const(-1.0), arg(1)])], name)
        if kind == "Neg":
            return fold("Mul", [const(-1.0), arg(0)], name)
        if kind == "Div":
            den = arg(1)
            if den.op == "c" and den.value != 0:
                return fold("Mul", [arg(0), const(1.0 / den.value, den.tol + 2.0 ** -52)], name)
            return Expr("Div", [arg(0), den], tensor=name)
        if kind == "Pow":
            base, exp = arg(0), arg(1)
            if exp.op == "c" and exp.value in (1.0, 2.0, 3.0):
                return fold("Mul", [base] * int(exp.value), name)
            return Expr("Pow", [base, exp], tensor=name)
        if kind == "Clip" and self.opset < 11:  # min and max were attributes
            lo, hi = a.pop("min", -3.4028234663852886e38), a.pop("max", 3.4028234663852886e38)
            return Expr("Clip", [arg(0), const(lo, _TOL[1]), const(hi, _TOL[1])], tuple(sorted(a.items())), tensor=name)
        if kind not in _ELEMENTWISE:  # (reached from elsewhere than the chain's value: _segment names these first)
            raise _refuse(node, "is no operator of an activation")
        return Expr(kind, [arg(i) for i in range(len(node.input))], tuple(sorted(a.items())), tensor=name)


def _has(e: Expr, op_type: str) -> bool:
    return e.op == op_type or any(_has(a, op_type) for a in e.args)


def _rank(info: onnx.ValueInfoProto) -> int | None:
    t = info.type.tensor_type
    return len(t.shape.dim) if t.HasField("shape") else None


def read_exported(model: onnx.ModelProto) -> tuple[list, list, list]:
    """(specs, holders, output tensors) of an exported chain of linear layers and activations."""
    g = model.graph
    index = Index(model)
    inputs = [i.name for i in g.input if i.name not in index.inits]
    if len(inputs) != 1 or len(g.output) != 1:
        raise _refuse(None, f"takes {len(inputs)} inputs and gives {len(g.output)} outputs (a chain: one each)")
    out = g.output[0].name
    linears, why = {}, {}
    for node in g.node:
        if node.op_type in ("Gemm", "MatMul"):
            lin, reason = find_linear(model, index, node)
            if lin is not None:
                linears[id(node)] = lin
            elif reason:
                why[id(node)] = reason
    linear_nodes = {id(n) for lin in linears.values() for n in lin.nodes}
    specs, holders, ends = [], [], []
    claimed: set[int] = set()
    cur = inputs[0]
    rank = next((_rank(i) for i in g.input if i.name == cur), None)
    while cur != out:
        users = index.consumers.get(cur, [])
        lin = linears.get(id(users[0][0])) if len(users) == 1 and users[0][1] == 0 else None
        if lin is not None and lin.input == cur and id(users[0][0]) not in claimed:
            inside = {o for n in lin.nodes for o in n.output if o != lin.output}
            for t in inside:  # a tensor of the layer read from outside it is a branch
                for reader, _ in index.consumers.get(t, []):
                    if all(reader is not n for n in lin.nodes):
                        raise _refuse(reader, f"reads {t!r}, a value inside the linear layer at {lin.matmul.name!r}")
                if t in index.outputs:
                    raise _refuse(lin.matmul, f"has its inner value {t!r} as a graph output")
            claimed |= {id(n) for n in lin.nodes}
            if "mask" in lin.slots:  # dense_bridge's own masks are read with their chain; a product is no Dense
                raise _refuse(lin.matmul, "multiplies its weight by another tensor (Mul(W, M)) before the MatMul")
            specs.append(linear_spec(lin))
            holders.append(lin)
            ends.append(lin.output)
            cur = lin.output
            rank = 2 if lin.matmul.op_type == "Gemm" else rank  # Gemm is rank 2; MatMul keeps the leading axes
            continue
        cur, rank = _segment(model, index, cur, out, linears, linear_nodes, why, claimed, specs, holders, ends, rank)
    left = [n for n in g.node if id(n) not in claimed and n.op_type != "Constant"]
    if left:
        raise _refuse(left[0], "computes nothing the chain's output depends on (a second branch or a dead end)")
    dtypes = {s.dtype for s in specs if isinstance(s, Dense)}
    if len(dtypes) > 1:
        raise ConversionError(f"this ONNX graph's linear layers mix dtypes {sorted(dtypes)}; a chain has one dtype")
    if not specs:
        raise _refuse(None, "computes nothing from its input (no node between its input and its output)")
    from ._models import linear_path  # the layer paths the graph records, for messages and split names

    for h in holders:
        if isinstance(h, OnnxLinear):
            h.path, h.generated = linear_path(h)
    return _positions(index, inputs[0], specs, holders, ends)


def _positions(index: Index, x: str, specs: list, holders: list, ends: list) -> tuple[list, list, list]:
    """The chain with ``Identity()`` where the exported ``nn.Sequential`` had a position the graph
    lost (an ``nn.Dropout``, an ``nn.Identity``), so that parameter keys ("3.kernel") are torch's.

    Each position's nodes record the module they came from (the dynamo exporter's name scopes, the
    legacy exporter's node names "/3/Gemm"); only where every position names a distinct top-level
    index, increasing along the chain, are the gaps filled. A trailing lost position leaves no trace.
    """
    from ._models import legacy_scope, torch_scope

    found = []
    for spec, holder, end in zip(specs, holders, ends):
        node = holder.matmul if isinstance(holder, OnnxLinear) else index.producer.get(end)
        scope = None if node is None else torch_scope(node) or legacy_scope(node)
        if scope is None or not scope.isdigit():
            return specs, holders, ends
        found.append(int(scope))
    if any(b <= a for a, b in zip(found, found[1:])) or found == list(range(len(found))):
        return specs, holders, ends
    out_specs, out_holders, out_ends, last = [], [], [], x
    for position, spec, holder, end in zip(found, specs, holders, ends):
        while len(out_specs) < position:
            out_specs.append(Identity())
            out_holders.append(None)
            out_ends.append(last)
        out_specs.append(spec)
        out_holders.append(holder)
        out_ends.append(end)
        last = end
    return out_specs, out_holders, out_ends


def _segment(model, index: Index, cur: str, out: str, linears: dict, linear_nodes: set, why: dict,
             claimed: set, specs: list, holders: list, ends: list, rank: int | None) -> tuple[str, int | None]:
    """Read the activations from ``cur`` to the next linear layer or the output, appending them to
    ``specs``/``holders``/``ends``; returns where they end and the rank there (Flatten: 2)."""
    # the tensors where this segment can end: the graph output and the inputs of linear layers
    stops = {out} | {lin.input for lin in linears.values() if id(lin.matmul) not in claimed}
    seen, frontier, reached = set(), [cur], []
    while frontier:  # every node the chain's value flows into before a linear layer
        t = frontier.pop()
        for node, pos in index.consumers.get(t, []):
            if id(node) in seen or (id(node) in linears and pos == 0 and linears[id(node)].input == t):
                continue
            if id(node) in claimed or id(node) in linear_nodes:
                raise _refuse(node, f"reads {t!r}, a value of the chain that an earlier layer already consumed "
                                    f"(a branch or residual connection)")
            seen.add(id(node))
            reached.append(node)
            frontier += [o for o in node.output if o]
    reached.sort(key=lambda n: index.order[id(n)])
    odd = next((n for n in reached if id(n) in why), None)  # a Gemm/MatMul that is no linear layer: say why
    if odd is not None:
        raise _refuse(odd, why[id(odd)])
    foreign = next((n for n in reached if n.domain not in ("", "ai.onnx") or n.op_type not in _READ), None)
    if foreign is not None:  # the first node no activation is made of (an embedding's Gather, a Conv...)
        if foreign.op_type in ("MatMul", "Gemm"):
            weight = foreign.input[1] if len(foreign.input) > 1 else ""
            raise _refuse(foreign, f"multiplies by {weight!r}, which is no weight (a float initializer or Constant, "
                                   f"possibly behind Transpose/Identity/Cast)")
        raise _refuse(foreign, "is no operator of an activation")
    found = {t for t in [cur] + [o for n in reached for o in n.output] if t in stops}
    candidates = sorted(found, key=lambda t: -1 if t == cur else index.order[id(index.producer[t])])
    if not candidates:
        late = index.producer.get(out)
        if late is not None and all(late is not n for n in reached):
            raise _refuse(late, f"computes the graph's output {out!r} from something other than the chain's value "
                                f"{cur!r}")
        raise _refuse(reached[0] if reached else None, f"is where the chain's value {cur!r} goes, but it never "
                                                       f"reaches the graph's output {out!r} or a linear layer")
    if len(candidates) > 1:
        raise _refuse(index.producer[candidates[1]], f"computes {candidates[1]!r}, a second value leaving the "
                                                     f"activations after {cur!r} (a branch)")
    end = candidates[0]
    seg = _Segment(model, index, cur, linear_nodes, rank)
    try:
        e = seg.expr(end, index.producer.get(end))
        layers = _activations.peel(e)
    except NotAnActivation as exc:
        nodes = [n for n in reached if id(n) in seg.used]
        raise _refuse(nodes[0] if nodes else None, f"begins activations that are not of dense_bridge's table: "
                                                   f"{exc.why}") from None
    unused = [n for n in reached if id(n) not in seg.used]
    if unused:
        raise _refuse(unused[0], f"reads the chain's value but nothing after it reaches {end!r} (a branch)")
    if end == cur and not reached:
        users = index.consumers.get(cur, [])
        raise _refuse(users[1][0] if len(users) > 1 else None, f"reads {cur!r} as another layer does (a branch)")
    claimed |= seg.used
    for spec, tensor in layers:
        specs.append(spec)
        holders.append(None)
        ends.append(tensor or end)
    return end, 2 if any(isinstance(spec, Flatten) for spec, _ in layers) else rank


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
    c = chain_of(native)
    props = {p.key: p.value for p in native.metadata_props}
    if CHAIN_KEY not in props:  # an exported chain
        try:
            return Sequential(c.specs) if c.seq else c.specs[0]
        except SpecError as exc:
            raise ConversionError(f"this ONNX graph's layers do not form a valid Sequential: {exc}") from None
    read = Sequential(c.specs) if c.seq else c.specs[0]
    try:
        kept = from_config(json.loads(props.get(SPEC_KEY, "null")))
    except Exception:  # noqa: BLE001 - metadata is a hint; the graph is what counts
        kept = None
    if kept is not None and _strip(kept) == _strip(read):
        return kept
    return read
