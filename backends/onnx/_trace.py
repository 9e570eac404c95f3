"""The ``trace`` verb: the forward pass through onnxruntime, every layer's output recorded.

onnxruntime runs inference only: the manifest declares no ``gradients`` capability, the trace
holds outputs and no gradients, and comparisons run with ``grads=False`` and say so. Intermediate tensors are read by
running a copy of the model with them added as graph outputs; a linear layer inside a bigger
graph runs as a graph of its own nodes and initializers.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from dense_bridge._errors import ConversionError
from dense_bridge.registry._trace import LayerTrace, Trace

from ._arrays import to_numpy_dtype
from ._files import all_tensors
from ._graph import Index, OnnxLinear
from ._to_spec import chain_of


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    """An onnxruntime CPU session for ``model`` (serialized: the caller's model is never changed)."""
    for t, what in all_tensors(model):  # onnxruntime would read it relative to the current directory
        if t.data_location == onnx.TensorProto.EXTERNAL:
            raise ConversionError(f"{what} keeps its data in an external file that was not loaded: dense_bridge "
                                  f"does not let onnxruntime read it from the current directory; load the model "
                                  f"with db.load(path), which checks and reads its external data")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # run the graph as written
    try:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own exception types
        raise ConversionError(f"onnxruntime cannot run this model: {str(exc).strip().splitlines()[0]}") from None


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph also outputs the tensors ``names`` (types left to onnxruntime)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    have = {o.name for o in copy.graph.output}
    for name in names:
        if name not in have:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
            have.add(name)
    return copy


def run(model: onnx.ModelProto, feeds: dict, extra: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """Every graph output of ``model`` and the tensors ``extra``, by name, from one forward pass."""
    m = with_outputs(model, extra) if extra else model
    sess = session(m)
    names = [o.name for o in sess.get_outputs()]
    try:
        values = sess.run(names, feeds)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"onnxruntime failed to run the model: {str(exc).strip().splitlines()[0]}") from None
    return dict(zip(names, values))


def layer_graph(layer: OnnxLinear) -> onnx.ModelProto:
    """A model of just ``layer``'s nodes and initializers: one input and one output in the kernel's dtype."""
    index = Index(layer.model)
    kernel = layer.initializer("kernel")
    nodes = [onnx.NodeProto() for _ in layer.nodes]
    for new, old in zip(nodes, layer.nodes):
        new.CopyFrom(old)
    used = {n for node in nodes for n in node.input}
    inits = []
    for n in sorted(used):
        if n in index.inits:  # an initializer, or the tensor of a Constant node, as an initializer of its name
            t = onnx.TensorProto()
            t.CopyFrom(index.inits[n])
            t.name = n
            inits.append(t)
    kslot = layer.slots["kernel"]
    compute = kernel.data_type
    if kslot.node.op_type == "Cast":
        compute = helper.get_attribute_value(kslot.node.attribute[0])
    x, y = layer.input, layer.output
    if compute != kernel.data_type:  # dense_bridge's float16 layers take float16 and compute in float32
        x, y = f"{layer.input}.in", f"{layer.output}.out"
        nodes = [helper.make_node("Cast", [x], [layer.input], to=compute)] + nodes \
            + [helper.make_node("Cast", [layer.output], [y], to=kernel.data_type)]
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info(x, kernel.data_type, None)],
                              [helper.make_tensor_value_info(y, kernel.data_type, None)], inits)
    m = helper.make_model(graph, opset_imports=list(layer.model.opset_import))
    m.ir_version = layer.model.ir_version
    return m


def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray | None = None) -> Trace:
    """Forward only: each layer's output through onnxruntime; no gradients (``gradients=False``)."""
    if isinstance(native, OnnxLinear):
        model = layer_graph(native)
        dtype = to_numpy_dtype(native.initializer("kernel").data_type)
        x = np.asarray(inputs[0]).astype(dtype, copy=False)
        lead = x.shape[:-1]
        if native.matmul.op_type == "Gemm":  # Gemm is rank-2 only: leading axes flattened, then restored
            x = x.reshape(-1, x.shape[-1])
        out = run(model, {model.graph.input[0].name: x})[model.graph.output[0].name]
        out = out.reshape(lead + out.shape[-1:])
        return Trace([LayerTrace(out, ())])
    ends = chain_of(native).ends
    g = native.graph
    feeds = {}
    inits = {t.name for t in g.initializer}
    for spec_in, x in zip([i for i in g.input if i.name not in inits], inputs):
        dtype = to_numpy_dtype(spec_in.type.tensor_type.elem_type)
        feeds[spec_in.name] = np.asarray(x).astype(dtype, copy=False)
    values = run(native, feeds, [e for e in ends if e not in feeds])
    return Trace([LayerTrace(values[e] if e not in feeds else feeds[e], ()) for e in ends])


def run_layer(layer: OnnxLinear, x: np.ndarray, grad_out: np.ndarray | None = None):
    """One linear layer of a graph alone on ``x`` (teacher forcing): ``(output, None, {})``, the
    output as ``capture`` records it (x @ kernel + bias). Forward only: onnxruntime has no autograd,
    so ``grad_out`` is refused rather than ignored."""
    if grad_out is not None:
        raise ConversionError("onnxruntime runs forward only: run_layer takes no grad_out (compare with grads=False)")
    return trace(layer, [x]).layers[0].output, None, {}
