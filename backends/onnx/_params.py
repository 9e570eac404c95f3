"""The ``get_params``/``set_params`` verbs: initializers <-> canonical arrays.

| canonical | in the graph |
|---|---|
| Dense ``kernel`` (in, units) | MatMul's (in, units) initializer; Gemm ``transB=0`` the same; Gemm ``transB=1`` and MatMul on ``Transpose(W)``: W is (units, in) |
| ``bias`` (units,) | the Add's (or Gemm's C) (units,) initializer |
| ``mask`` (in, units) | the ``Mul(kernel, mask)`` initializer (dense_bridge's own graphs) |
| Bilinear ``kernel`` (units, in1, in2) | the Einsum's initializer, as is |

Writes replace initializers in place (name and position kept). An initializer other nodes also
read is not overwritten with a different value: the layer gets its own copy (``_graph.ParamSlots.write``).
"""
from __future__ import annotations

import numpy as np

from dense_bridge._errors import ConversionError

from ._graph import ParamSlots
from ._to_spec import chain_of


def _holders(native) -> list[tuple[str, ParamSlots]]:
    """(canonical key prefix, parameters) of each layer holding some: "0.", "2."... in a chain."""
    if isinstance(native, ParamSlots):
        return [("", native)]
    c = chain_of(native)
    return [(f"{i}." if c.seq else "", h) for i, h in enumerate(c.holders) if h is not None]


def get_params(native) -> dict[str, np.ndarray]:
    """Canonical params of a linear layer in a graph, or of a chain ``compile`` wrote (copies)."""
    out = {}
    for prefix, holder in _holders(native):
        for name in holder.slots:
            out[prefix + name] = holder.canonical(name)
    return out


def set_params(native, params: dict[str, np.ndarray]) -> None:
    """Write canonical params (already validated by the core) into the graph's initializers."""
    plan = []
    for prefix, holder in _holders(native):
        arrays = {k: np.asarray(params[prefix + k]) for k in holder.slots if prefix + k in params}
        if "mask" in holder.slots and "kernel" in arrays:
            mask = arrays.get("mask", holder.canonical("mask"))
            arrays["kernel"] = arrays["kernel"] * (mask != 0)  # masked weights are exactly 0 by contract
        if arrays:
            plan.append((holder, arrays))
    for holder, arrays in plan:
        for name, value in arrays.items():
            have = holder.canonical(name)
            if tuple(value.shape) != tuple(have.shape):
                raise ConversionError(f"{holder.path or 'layer'} {name}: expected shape {have.shape}, "
                                      f"received {value.shape}")
    for holder, arrays in plan:
        holder.write(arrays)
