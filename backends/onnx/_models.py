"""The ``walk`` verb: every linear layer (and every other node reading float initializers) in any graph.

Linear layers are found by pattern (``_graph.find_linear``). Their paths, best source first:

1. the torch module path the dynamo exporter records on each node
   (``metadata_props["pkg.torch.onnx.name_scopes"]``: the scopes from the root, the op last);
2. the kernel initializer's own name when the exporter kept the parameter's name
   (``"encoder.layer.0.output.dense.weight"`` -> ``"encoder.layer.0.output.dense"``; dense_bridge's
   ``"0.kernel"`` -> ``"0"``);
3. the legacy exporter's node name, which spells the module scope
   (``"/encoder/layer.0/attention/self/query/MatMul"`` -> ``"encoder.layer.0.attention.self.query"``);
4. else the kernel initializer's generated name (``"onnx::MatMul_12"``, ``"val_37"``): such a
   path says nothing, so pairing by order never reads a name into it.

Other nodes reading float initializers (norms, embedding tables) are kind "other", grouped by
the same path rules, their parameters named by the initializers' last name component. An output
head exported as a folded copy of a tied embedding table shares the table's identity, and
writing the table writes the copy (``_tied_heads``).
"""
from __future__ import annotations

import ast
import re

import numpy as np
import onnx

from dense_bridge.models._layouts import Entry

from ._arrays import FLOAT_TYPES
from ._graph import Index, OnnxLinear, ParamSlots, Slot, find_linear, is_generated

_PARAM_TAIL = re.compile(r"\.(weight|kernel|bias|mask)$")


def torch_scope(node: onnx.NodeProto) -> str | None:
    """The module path the dynamo exporter recorded on ``node`` (None when it recorded none)."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                return None
            if isinstance(scopes, list) and len(scopes) >= 2 and all(isinstance(s, str) for s in scopes):
                return scopes[-2]
    return None


def legacy_scope(node: onnx.NodeProto) -> str | None:
    """The module path in a legacy exporter node name ("/encoder/layer.0/query/MatMul")."""
    if not node.name.startswith("/"):
        return None
    parts = node.name[1:].split("/")
    return ".".join(parts[:-1])


def _kept(name: str) -> str | None:
    """The layer path in a parameter name the exporter kept ("a.b.weight" -> "a.b"), else None."""
    if is_generated(name):
        return None
    if name in ("kernel", "weight", "bias", "mask"):
        return ""
    m = _PARAM_TAIL.search(name)
    return name[:m.start()] if m else None


def _init_name(holder: ParamSlots, key: str) -> str:
    slot = holder.slots[key]
    return slot.node.input[slot.pos]


def linear_path(layer: OnnxLinear) -> tuple[str, bool]:
    """(path, generated) of a linear layer found in a graph (rules in the module docstring)."""
    scope = torch_scope(layer.matmul)
    if scope is not None:
        return scope, False
    kept = _kept(_init_name(layer, "kernel"))
    if kept is not None:
        return kept, False
    legacy = legacy_scope(layer.matmul)
    if legacy is not None:
        return legacy, False
    return _init_name(layer, "kernel"), True


def find_linears(model: onnx.ModelProto, index: Index | None = None) -> list[OnnxLinear]:
    """Every linear layer of ``model`` in graph order, each with its (unique) path."""
    index = index or Index(model)
    out, seen = [], set()
    for node in model.graph.node:
        if node.op_type not in ("Gemm", "MatMul"):
            continue
        layer, _ = find_linear(model, index, node)
        if layer is None:
            continue
        path, generated = linear_path(layer)
        base, n = path, 1
        while path in seen:  # a module called twice: one layer per call site
            n += 1
            path = f"{base}#{n}"
        seen.add(path)
        layer.path, layer.generated = path, generated
        out.append(layer)
    return out


def _others(model: onnx.ModelProto, index: Index, taken: set[int]) -> list[ParamSlots]:
    groups: dict[str, ParamSlots] = {}
    for node in model.graph.node:
        if id(node) in taken:
            continue
        for pos, name in enumerate(node.input):
            t = index.inits.get(name)
            if t is None or t.data_type not in FLOAT_TYPES or not t.dims:
                continue
            path = torch_scope(node) or _kept(name) or legacy_scope(node) or name
            tail = name.rsplit(".", 1)[-1] if not is_generated(name) and "." in name else f"input{pos}"
            holder = groups.setdefault(path, ParamSlots(model, path, {}))
            key, k = tail, 1
            while key in holder.slots:
                k += 1
                key = f"{tail}_{k}"
            holder.slots[key] = Slot(node, pos)
    return list(groups.values())


def _tied_heads(linears: list[OnnxLinear], others: list[ParamSlots]) -> dict[int, tuple[ParamSlots, str]]:
    """Output heads tied to an embedding table: id(head) -> (embedding holder, table name).

    Exporters write a tied head (``lm_head.weight = embed.weight``) as a MatMul on a folded copy
    of the table's transpose (``onnx::MatMul_12``, ``val_2``); a head with no bias or mask whose
    kernel equals a Gather table transposed (values with at least two distinct numbers) is read
    as tied to it, so a write of the table also writes the copy.
    """
    tables = []
    for h in others:
        for name, slot in h.slots.items():
            if slot.node.op_type == "Gather" and slot.pos == 0:
                table = h.native(name)
                if table.ndim == 2 and np.unique(table[: min(len(table), 64)]).size > 1:
                    tables.append((h, name, table))
    out = {}
    for layer in linears:
        if set(layer.slots) != {"kernel"} or not tables:
            continue
        kernel = layer.canonical("kernel")
        for h, name, table in tables:
            if kernel.shape == table.T.shape and kernel.dtype == table.dtype \
                    and np.ascontiguousarray(kernel.T).tobytes() == np.ascontiguousarray(table).tobytes():
                out[id(layer)] = (h, name)
                break
    return out


def _entry(holder: ParamSlots, kind: str, tied: dict | None = None, copies: list | None = None) -> Entry:
    """``tied``: name -> the identity of the parameter it is a copy of; ``copies``: tied heads whose
    kernel is this table transposed (written with it)."""
    def read() -> dict[str, np.ndarray]:
        return {n: holder.native(n) for n in holder.slots}

    def write(arrays: dict[str, np.ndarray]) -> None:
        holder.write(arrays, canonical=False)
        for head, name in copies or ():
            if name in arrays:
                head.write({"kernel": np.asarray(arrays[name]).T})

    names = tuple(holder.slots)
    shapes = {n: tuple(int(d) for d in holder.initializer(n).dims) for n in names}
    # identities per layer and name: an initializer several nodes share (an exporter merging equal
    # tensors) is no tie; a write that would change it for the others splits it instead
    ident = {n: (id(holder.model), holder.path, n) for n in names}
    ident.update(tied or {})
    return Entry(holder.path, holder, kind, names, ident, shapes, read, write)


def walk(model) -> list[Entry]:
    """Linear layers (kind "linear", values :class:`OnnxLinear`) and other parameter groups, in graph order."""
    if isinstance(model, OnnxLinear):
        return [_entry(model, "linear")]
    if isinstance(model, ParamSlots):
        return [_entry(model, "other")]
    index = Index(model)
    linears = find_linears(model, index)
    taken = {id(n) for layer in linears for n in layer.nodes}
    others = _others(model, index, taken)
    heads = _tied_heads(linears, others)
    copies: dict[int, list] = {}
    for layer in linears:
        if id(layer) in heads:
            h, name = heads[id(layer)]
            copies.setdefault(id(h), []).append((layer, name))
    out = []
    for layer in linears:
        tied = None
        if id(layer) in heads:
            h, name = heads[id(layer)]
            tied = {"kernel": (id(model), h.path, name)}
        out.append(_entry(layer, "linear", tied))
    out += [_entry(h, "other", copies=copies.get(id(h))) for h in others]
    order = {id(n): i for i, n in enumerate(model.graph.node)}

    def first(e: Entry) -> int:  # where the layer computes (the legacy exporter puts Identity nodes first)
        h = e.layer
        nodes = [h.matmul] if isinstance(h, OnnxLinear) else [s.node for s in h.slots.values()]
        return min(order.get(id(n), 0) for n in nodes)

    return sorted(out, key=first)


__all__ = ["walk", "find_linears", "linear_path", "torch_scope", "legacy_scope"]
