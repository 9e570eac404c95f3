"""The ``walk`` verb for Equinox: every module holding floating arrays of its own inside any module tree.

Paths are dotted attribute paths ("encoder.layers.0.attention.query_proj"; "" is the root), in
definition order (dataclass field order, tuple/list items by index; Equinox layers have no
names of their own: docs/FACTS.md). Kinds: ``eqx.nn.Linear`` and dense_bridge's DenseLinear and
Bilinear are "linear"; any other module with floating arrays of its own (``eqx.nn.LayerNorm``,
``eqx.nn.Embedding``) is "other", read and written under its own field names in its own layout.
Only ``eqx.is_inexact_array`` leaves count: what Equinox trains (the bool masks are not).
Equinox modules are immutable; ``write`` rebinds the fields in place (see ``_params``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import equinox as eqx
import numpy as np

from dense_bridge.models._layouts import Entry

from ._arrays import dtype_name, to_jax, to_numpy
from ._layers import Bilinear, is_dense


def _kind(m) -> str:
    return "linear" if is_dense(m) or type(m) is Bilinear else "other"


def _children(node) -> Iterator[tuple[str, Any]]:
    if isinstance(node, (list, tuple)):
        yield from ((str(i), v) for i, v in enumerate(node))
    elif isinstance(node, dict):
        yield from ((str(k), v) for k, v in node.items())
    elif isinstance(node, eqx.Module):
        for f in dataclasses.fields(node):
            if hasattr(node, f.name):
                yield f.name, getattr(node, f.name)


def _own_arrays(m) -> dict[str, Any]:
    return {k: v for k, v in _children(m) if eqx.is_inexact_array(v)}


def walk(model) -> list[Entry]:
    """Every module with floating arrays of its own (and every linear one), in definition order."""
    out, seen = [], set()

    def visit(node, path: str) -> None:
        if isinstance(node, eqx.Module):
            if id(node) in seen:  # a module reachable under two paths is reported once
                return
            seen.add(id(node))
            own = _own_arrays(node)
            if own or _kind(node) == "linear":
                out.append(_entry(path, node, _kind(node), own))
        for name, child in _children(node):
            if isinstance(child, (eqx.Module, list, tuple, dict)):
                visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return out


def _entry(path: str, m, kind: str, own: dict[str, Any]) -> Entry:
    def read() -> dict[str, np.ndarray]:
        return {n: to_numpy(a) for n, a in _own_arrays(m).items()}

    def write(arrays: dict[str, Any]) -> None:
        current = _own_arrays(m)
        for n, a in arrays.items():
            object.__setattr__(m, n, to_jax(a, dtype_name(current[n].dtype, n), like=current[n]))

    return Entry(path, m, kind, tuple(own), {n: id(a) for n, a in own.items()},
                 {n: tuple(int(s) for s in a.shape) for n, a in own.items()}, read, write,
                 extra={"read_device": lambda: dict(_own_arrays(m)),  # where they live (models/_device.py)
                        "snapshot_device": lambda: dict(_own_arrays(m))})  # immutable arrays: kept, not copied
