"""The ``walk`` verb for MLX: every module holding arrays of its own inside any module tree.

Paths are MLX's dotted attribute paths ("model.layers.0.mlp.up_proj"; "" is the root), ordered
by ``tree_flatten(module.parameters())``, which is definition order (``named_modules()`` is in
reverse definition order: docs/FACTS.md). Kinds: ``nn.Linear`` and dense_bridge's Dense modules
and ``nn.Bilinear`` are "linear"; ``QuantizedLinear`` is "quantized" (codes, read and written
through ``_quant.py``); a ``QuantizedEmbedding`` is "other", its table read as MLX dequantizes
it and written through ``mx.quantize`` (mlx-lm quantizes embeddings too); anything else
with arrays of its own (norms, embeddings) is "other", read and written under MLX's names.
Frozen arrays count too: ``parameters()`` lists them, and a port must carry them.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dense_bridge.models._layouts import Entry

from ._arrays import MX_DTYPES, to_mx, to_numpy
from ._layers import declared_arrays
from ._quant import embedding_table, set_embedding_table
from ._layers import is_dense as _is_dense
from ._lora import is_lora


def _kind(m) -> str:
    if isinstance(m, nn.QuantizedEmbedding):  # a table, moved as MLX dequantizes it (_quant.py)
        return "other"
    if type(m).__name__.startswith("Quantized"):
        return "quantized"
    if _is_dense(m) or type(m) is nn.Bilinear or declared_arrays(m) is not None:
        return "linear"
    return "other"


def _own_arrays(m) -> dict[str, mx.array]:
    if is_lora(m):  # a LoRA wrapper's arrays are the wrapped layer's and its adapter's
        return dict(tree_flatten(m.parameters()))
    return {k: v for k, v in m.items() if isinstance(v, mx.array) and not k.startswith("_")}


def walk(model) -> list[Entry]:
    """Every module with arrays of its own (and every linear one), in ``tree_flatten`` order."""
    modules = dict(model.named_modules())
    wrappers = [p for p, m in modules.items() if is_lora(m)]  # mlx-lm LoRA: one linear layer each
    order: list[str] = []
    seen: set[str] = set()
    for key, _ in tree_flatten(model.parameters()):
        path = key.rsplit(".", 1)[0] if "." in key else ""
        path = next((w for w in wrappers if key.startswith(w + ".") or not w), path)
        if path not in seen and path in modules:
            seen.add(path)
            order.append(path)
    # linear modules without arrays yet (a lazy Dense before its first call) still belong to the list
    for path, m in reversed(list(modules.items())):
        if any(path.startswith(w + ".") for w in wrappers if w) or (wrappers == [""] and path):
            continue
        if path not in seen and _kind(m) != "other":
            seen.add(path)
            order.append(path)
    out, done = [], set()
    for path in order:
        m = modules[path]
        if id(m) in done:  # a module reachable under two paths is reported once
            continue
        done.add(id(m))
        kind = (_kind(m.linear) if _kind(m.linear) == "quantized" else "linear") if is_lora(m) else _kind(m)
        out.append(_entry(path, m, kind))
    return out


def _quantized_table(path: str, m) -> Entry:
    """A QuantizedEmbedding as the float (vocab, dims) ``weight`` table it stands for: read as
    mx.dequantize computes it, written through mx.quantize with the layer's own bits and groups."""
    shape = (int(m["weight"].shape[0]), int(m.dims))
    arrays = ("weight", "scales", "biases")

    def native() -> dict:
        return {k: m[k] for k in arrays if k in m and m[k] is not None}

    # another table of the same format takes the codes themselves: requantizing a dequantized
    # table is not idempotent in MLX (docs/FACTS.md), so through floats it would change values
    codes = {"format": ("mlx", m.mode, int(m.bits), int(m.group_size), shape, str(m["scales"].dtype)),
             "read": native, "write": m.update}
    return Entry(path, m, "other", ("weight",), {"weight": id(m["weight"])}, {"weight": shape},
                 lambda: {"weight": embedding_table(m)}, lambda arrays: set_embedding_table(m, arrays["weight"]),
                 f"a QuantizedEmbedding ({m.bits}-bit {m.mode}, group {m.group_size}): its table moves dequantized",
                 extra={"quantized_table": codes})


def _entry(path: str, m, kind: str) -> Entry:
    if isinstance(m, nn.QuantizedEmbedding):
        return _quantized_table(path, m)
    names = tuple(_own_arrays(m))

    def read() -> dict[str, np.ndarray]:
        arrays = _own_arrays(m)
        mx.eval(list(arrays.values()))
        return {n: to_numpy(a) for n, a in arrays.items()}

    def write(arrays: dict[str, Any]) -> None:
        current = _own_arrays(m)
        new = {}
        for n, a in arrays.items():
            dtype = next((k for k, v in MX_DTYPES.items() if v == current[n].dtype), None)
            new[n] = to_mx(a, dtype) if dtype is not None else mx.array(np.asarray(a), dtype=current[n].dtype)
        m.update(tree_unflatten(list(new.items())) if is_lora(m) else new)

    arrays = _own_arrays(m)
    note = "" if kind != "quantized" else "its weights are packed integers with scales (mlx.nn.quantize)"
    return Entry(path, m, kind, names, {n: id(a) for n, a in arrays.items()},
                 {n: tuple(int(s) for s in a.shape) for n, a in arrays.items()}, read, write, note)
