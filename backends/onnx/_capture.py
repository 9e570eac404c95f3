"""The ``capture`` verb on ONNX: per-call inputs and outputs of linear layers, forward only.

One onnxruntime run of a copy of the model whose graph also outputs every captured layer's input
and output tensor. onnxruntime has no autograd (its manifest declares no ``gradients`` capability): no dL/d(output), no parameter
gradients; comparisons run with ``grads=False`` and say gradients were not compared.
Inputs: a list (the graph inputs in order) or a dict (by graph input name); floating arrays are
cast to each graph input's element type, integer ones to its integer type.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dense_bridge._errors import SpecError, received
from dense_bridge.registry._captures import Call, Capture, select_output

from ._arrays import to_numpy_dtype
from ._graph import OnnxLinear
from ._trace import run


def _feeds(model, inputs) -> dict[str, np.ndarray]:
    graph_inputs = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    names = [i.name for i in graph_inputs]
    if isinstance(inputs, dict):
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise SpecError(f"inputs has keys the ONNX graph does not take: {unknown} (its inputs: {names}). "
                            f"{received('inputs', sorted(inputs))}")
        pairs = [(i, inputs[i.name]) for i in graph_inputs if i.name in inputs]
    else:
        if len(inputs) > len(graph_inputs):
            raise SpecError(f"inputs has {len(inputs)} arrays but the ONNX graph takes {len(names)}: {names}")
        pairs = list(zip(graph_inputs, inputs))
    feeds = {}
    for info, value in pairs:
        elem = info.type.tensor_type.elem_type
        arr = np.asarray(value)
        feeds[info.name] = arr.astype(to_numpy_dtype(elem), copy=False) if elem else arr
    return feeds


def _is_float(x) -> bool:
    return isinstance(x, np.ndarray) and (np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16")


def capture(model, inputs, layers: dict[str, Any], *, cotangent: Callable[[tuple], np.ndarray] | None = None,
            select=None, grads: bool = True) -> Capture:
    """One forward pass of ``model`` recording each captured layer's input and output (no gradients)."""
    feeds = _feeds(model, inputs)
    wanted = []
    for path, layer in layers.items():
        if not isinstance(layer, OnnxLinear):
            raise SpecError(f"layers[{path!r}] is not a linear layer of this ONNX graph. {received('layer', layer)}")
        wanted += [layer.input, layer.output]
    values = run(model, feeds, [w for w in wanted if w not in feeds])
    values.update(feeds)
    outs = {o.name: values[o.name] for o in model.graph.output}
    out = select_output(outs, select, _is_float)
    calls = [Call(path, 0, (np.array(values[layer.input]),), np.array(values[layer.output]))
             for path, layer in layers.items()]
    order = {id(n): i for i, n in enumerate(model.graph.node)}
    calls.sort(key=lambda c: order.get(id(layers[c.path].matmul), 0))
    return Capture(calls, {}, np.array(out))
