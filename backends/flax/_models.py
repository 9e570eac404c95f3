"""The ``walk`` verb for Flax NNX: every module holding variables of its own inside any module tree.

Paths are dotted attribute paths ("encoder.layers.0.attn.query"; "" is the root), in definition
order: attributes in the order they were set (``vars``), list items by index. NNX's own graph
traversal sorts attribute names, which would reorder layers, so the walk is done here. Kinds:
``nnx.Linear`` (and dense_bridge's DenseLinear) and dense_bridge's Bilinear are "linear"; any
other module with variables of its own (``nnx.LayerNorm``, ``nnx.Embed``, ``nnx.LinearGeneral``)
is "other", read and written under its own names in its own layout. Every ``nnx.Variable`` counts
(Params and batch statistics: a port carries them) except dense_bridge's Mask (part of the
spec, not a parameter to move) and RNG state.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from flax import nnx

from dense_bridge.models._layouts import Entry

from ._arrays import dtype_name, to_jax, to_numpy
from ._layers import Bilinear, Mask, is_dense
from ._lora import is_lora


def _kind(m) -> str:
    return "linear" if is_dense(m) or type(m) is Bilinear or is_lora(m) else "other"


def _children(node) -> Iterator[tuple[str, Any]]:
    """(name, value) of a graph node's attributes or items, in definition order."""
    if isinstance(node, nnx.List) or isinstance(node, (list, tuple)):
        yield from ((str(i), v) for i, v in enumerate(node))
    elif isinstance(node, dict):
        yield from ((str(k), v) for k, v in node.items())
    elif isinstance(node, nnx.Module):
        yield from ((k, v) for k, v in vars(node).items() if not (isinstance(k, str) and k.startswith("_")))


def _own_variables(m) -> dict[str, nnx.Variable]:
    own = {k: v for k, v in _children(m) if isinstance(v, nnx.Variable) and not isinstance(v, Mask)
           and not isinstance(v, nnx.RngState)}
    if is_lora(m):  # nnx.LoRALinear is one linear layer: its adapter's factors are its own
        own.update({f"lora.{k}": v for k, v in _children(m.lora) if isinstance(v, nnx.Variable)})
    return own


def walk(model) -> list[Entry]:
    """Every module with variables of its own (and every linear one), in definition order."""
    out, seen = [], set()

    def visit(node, path: str) -> None:
        if isinstance(node, nnx.Module) and not isinstance(node, nnx.List):
            if id(node) in seen:  # a module reachable under two paths is reported once
                return
            seen.add(id(node))
            own = _own_variables(node)
            if own or _kind(node) == "linear":
                out.append(_entry(path, node, _kind(node), own))
        for name, child in _children(node):
            if is_lora(node) and name == "lora":
                continue
            if isinstance(child, (nnx.Module, list, tuple, dict)):
                visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return out


def _entry(path: str, m, kind: str, own: dict[str, nnx.Variable]) -> Entry:
    def read() -> dict[str, np.ndarray]:
        return {n: to_numpy(v) for n, v in _own_variables(m).items()}

    def write(arrays: dict[str, Any]) -> None:
        current = _own_variables(m)
        for n, a in arrays.items():
            value = current[n].get_value()
            current[n].set_value(to_jax(a, dtype_name(value.dtype, n), like=value))

    values = {n: v.get_value() for n, v in own.items()}
    return Entry(path, m, kind, tuple(own), {n: id(v) for n, v in own.items()},
                 {n: tuple(int(s) for s in np.shape(a)) for n, a in values.items()}, read, write,
                 extra={"read_device": lambda: {n: v.get_value() for n, v in _own_variables(m).items()},
                        # JAX arrays are immutable: the snapshot keeps them, copies nothing
                        "snapshot_device": lambda: {n: v.get_value() for n, v in _own_variables(m).items()}})
