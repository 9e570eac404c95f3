"""The ``compile``/``owns`` verbs: a spec as an ``onnx.ModelProto`` onnxruntime runs.

Layout of a compiled model (what ``to_spec`` and ``get_params`` read back):

- graph input ``x`` (``x1``, ``x2`` for a Bilinear first), output ``y``, element type the first
  layer's dtype, shape left open: any number of leading axes, features last;
- Dense at position i of a Sequential: nodes named ``i/<Op>_<n>``, initializers ``i.kernel``
  (in_features, units), ``i.bias`` (units,), ``i.mask`` (in_features, units); a lone layer has no
  prefix (``kernel``...). ``MatMul(x, kernel)`` (``MatMul(x, Mul(kernel, mask))`` when masked),
  ``Add`` of the bias, then the activation's operators (``_activations``);
- Bilinear: ``Einsum("...i,kij,...j->...k", x1, kernel, x2)`` (+ ``Add``); Identity: ``Identity``;
  Flatten: ``Flatten(axis=1)``; an Activation layer: its operators;
- float16 layers compute as the other frameworks' CPU kernels do: inputs and parameters cast to
  float32, the pre-activation rounded to float16, the activation in float32, the output float16.
  bfloat16 is refused: onnxruntime's CPU provider has no bfloat16 MatMul or Gemm;
- ``metadata_props``: ``dense_bridge_spec`` (the spec as JSON: initializer names and the spec's
  name, trusted only where the graph agrees) and ``dense_bridge_chain`` ("sequential"/"layer").

The default opset is :data:`OPSET` (20, for ``Gelu``), IR version :data:`IR_VERSION`, both run by
onnxruntime 1.17 and later.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import onnx
from onnx import helper

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import SpecError, received
from dense_bridge.params._source import ParamSource
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Flatten, Identity, Sequential

from . import _activations
from ._arrays import ELEM_TYPES
from ._graph import Builder, OnnxLinear

OPSET = 20
IR_VERSION = 10
SPEC_KEY, CHAIN_KEY = "dense_bridge_spec", "dense_bridge_chain"


def owns(obj) -> bool:
    """An ``onnx.ModelProto`` or a linear layer inside one (decided without importing onnx)."""
    mod = sys.modules.get("onnx")
    return mod is not None and isinstance(obj, (mod.ModelProto, OnnxLinear))


def _compute(dtype: str) -> np.dtype:
    """What a layer of ``dtype`` computes in: float16 in float32, the others in themselves."""
    if dtype == "bfloat16":
        raise SpecError("onnxruntime's CPU provider has no bfloat16 MatMul or Gemm: a bfloat16 layer cannot run "
                        "as ONNX; use float32 or float16. Received: dtype='bfloat16'")
    return np.dtype(np.float32) if dtype == "float16" else numpy_dtype(dtype)


def _cast(b: Builder, x: str, to: np.dtype) -> str:
    return b.op("Cast", [x], to=helper.np_dtype_to_tensor_dtype(np.dtype(to)))


class Emitter:
    """Writes the layers of a spec one after the other, tracking the running tensor's dtype."""

    def __init__(self, source: ParamSource, seq: bool) -> None:
        self.source, self.seq = source, seq
        self.nodes: list = []
        self.inits: list = []

    def builder(self, i: int, compute: np.dtype) -> Builder:
        return Builder(f"{i}/" if self.seq else "", compute)

    def names(self, i: int, key: str) -> str:
        return f"{i}.{key}" if self.seq else key

    def keep(self, b: Builder) -> None:
        self.nodes += b.nodes
        self.inits += b.inits

    def dense(self, i: int, spec: Dense, x: str, x_dtype: np.dtype) -> tuple[str, np.dtype]:
        dt, cdt = numpy_dtype(spec.dtype), _compute(spec.dtype)
        b = self.builder(i, cdt)
        params = self.source.for_layer(i, spec)
        kernel = b.init(np.asarray(params["kernel"], dt), self.names(i, "kernel"))
        if x_dtype != cdt:
            x = _cast(b, x, cdt)
        if dt != cdt:
            kernel = _cast(b, kernel, cdt)
        if "mask" in params:
            mask = b.init(np.asarray(params["mask"], dt), self.names(i, "mask"))
            kernel = b.op("Mul", [kernel, mask if dt == cdt else _cast(b, mask, cdt)])
        z = b.op("MatMul", [x, kernel])
        if "bias" in params:
            bias = b.init(np.asarray(params["bias"], dt), self.names(i, "bias"))
            z = b.op("Add", [z, bias if dt == cdt else _cast(b, bias, cdt)])
        if dt != cdt:  # the pre-activation is rounded to the layer dtype, as the frameworks' kernels do
            z = _cast(b, z, dt)
            if spec.activation.is_identity:
                self.keep(b)
                return z, dt
            z = _cast(b, z, cdt)
        y = _activations.emit(b, spec.activation, z)
        if dt != cdt:
            y = _cast(b, y, dt)
        self.keep(b)
        return y, dt

    def bilinear(self, i: int, spec: Bilinear, xs: list[str], x_dtype: np.dtype) -> tuple[str, np.dtype]:
        dt, cdt = numpy_dtype(spec.dtype), _compute(spec.dtype)
        b = self.builder(i, cdt)
        params = self.source.for_layer(i, spec)
        kernel = b.init(np.asarray(params["kernel"], dt), self.names(i, "kernel"))
        if x_dtype != cdt:
            xs = [_cast(b, x, cdt) for x in xs]
        if dt != cdt:
            kernel = _cast(b, kernel, cdt)
        y = b.op("Einsum", [xs[0], kernel, xs[1]], equation="...i,kij,...j->...k")
        if "bias" in params:
            bias = b.init(np.asarray(params["bias"], dt), self.names(i, "bias"))
            y = b.op("Add", [y, bias if dt == cdt else _cast(b, bias, cdt)])
        if dt != cdt:
            y = _cast(b, y, dt)
        self.keep(b)
        return y, dt

    def other(self, i: int, spec, x: str, x_dtype: np.dtype) -> tuple[str, np.dtype]:
        if isinstance(spec, Flatten):
            b = self.builder(i, x_dtype)
            y = b.op("Flatten", [x], axis=1)
        elif isinstance(spec, Identity):
            b = self.builder(i, x_dtype)
            y = b.op("Identity", [x])
        else:  # an Activation layer computes in its input's dtype (float16 through float32)
            cdt = np.dtype(np.float32) if x_dtype == np.float16 else x_dtype
            b = self.builder(i, cdt)
            y = _activations.emit(b, spec, x if cdt == x_dtype else _cast(b, x, cdt))
            if spec.is_identity:
                y = b.op("Identity", [y])
            elif cdt != x_dtype:
                y = _cast(b, y, x_dtype)
        self.keep(b)
        return y, x_dtype


def _layers(spec) -> list:
    return list(spec.layers) if isinstance(spec, Sequential) else [spec]


def compile(spec, source: ParamSource) -> onnx.ModelProto:
    """An ``onnx.ModelProto`` computing ``spec`` with parameters from ``source`` (see module doc)."""
    layers = _layers(spec)
    for layer in layers:
        if getattr(layer, "lazy", False) or (isinstance(layer, Dense) and layer.in_features is None):
            raise SpecError(f"an ONNX graph has fixed weights: every Dense needs in_features when compiled to "
                            f"'onnx' (give in_features, or compile with params). {received('spec', spec)}")
        if isinstance(layer, (Dense, Bilinear)):
            _compute(layer.dtype)
    first = next((l for l in layers if isinstance(l, (Dense, Bilinear))), None)
    in_dtype = numpy_dtype(first.dtype) if first is not None else np.dtype(np.float32)
    em = Emitter(source, isinstance(spec, Sequential))
    bilinear_first = bool(layers) and isinstance(layers[0], Bilinear)
    inputs = ["x1", "x2"] if bilinear_first else ["x"]
    x, dt = inputs[0], in_dtype
    for i, layer in enumerate(layers):
        if isinstance(layer, Dense):
            x, dt = em.dense(i, layer, x, dt)
        elif isinstance(layer, Bilinear):
            if i != 0:
                raise SpecError(f"a Bilinear takes two inputs: only the first layer of a Sequential can be one. "
                                f"{received('spec', spec)}")
            x, dt = em.bilinear(i, layer, inputs, dt)
        elif isinstance(layer, (Identity, Activation)):
            x, dt = em.other(i, layer, x, dt)
        else:
            raise TypeError(f"spec must be a dense_bridge spec. {received('spec', layer)}")
    if x in inputs:  # an empty Sequential: y = x
        b = Builder("", dt)
        x = b.op("Identity", [x])
        em.keep(b)
    elem = ELEM_TYPES[np.dtype(in_dtype).name]
    graph = helper.make_graph(
        em.nodes, getattr(spec, "name", None) or "dense_bridge",
        [helper.make_tensor_value_info(n, elem, None) for n in inputs],
        [helper.make_tensor_value_info("y", ELEM_TYPES[np.dtype(dt).name], None)], em.inits)
    # the last node writes "y"
    graph.node[-1].output[0] = "y"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dense_bridge")
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {SPEC_KEY: json.dumps(spec.to_config(), sort_keys=True),
                                   CHAIN_KEY: "sequential" if isinstance(spec, Sequential) else "layer"})
    return model


__all__ = ["owns", "compile", "Emitter", "OnnxLinear", "OPSET", "IR_VERSION", "SPEC_KEY", "CHAIN_KEY"]
