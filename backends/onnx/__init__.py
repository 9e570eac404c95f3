"""The ONNX backend: ``onnx.ModelProto`` graphs run by onnxruntime (forward only).

| canonical | ONNX |
|---|---|
| Dense ``kernel`` (in_features, units) | MatMul on an (in, units) initializer; Gemm ``transB=1`` / MatMul on ``Transpose(W)``: W (units, in) |
| ``bias`` (units,) | an ``Add`` (or Gemm's C) of a (units,) initializer |
| ``mask`` (in_features, units) | ``Mul(kernel, mask)`` before the MatMul |
| Bilinear ``kernel`` (units, in1, in2) | ``Einsum("...i,kij,...j->...k")`` on it |

``compile`` writes a spec as such a graph (``_layers``, opset :data:`OPSET`); ``to_spec`` reads it
back, and reads any graph that is a chain of linear layers and activations (an MLP exported by
``torch.onnx.export``, either exporter) as a spec too (``_to_spec``); ``db.linear_layers``
finds linear layers in any graph, exported ones included (``_models``), each an
:class:`OnnxLinear` that works as a lone layer; writes go to initializers in place (``_graph``).
onnxruntime has no autograd: the manifest (``_manifest.py``) declares no ``gradients`` capability,
``trace``/``capture`` return outputs only, and comparisons run with ``grads=False`` and say so. ``.onnx`` files: ``_files``.
"""
from __future__ import annotations

from ._arrays import from_numpy, to_numpy
from ._capture import capture
from ._files import file_info, load_model, read_file, read_model, write_file, write_model
from ._graph import OnnxLinear
from ._layers import OPSET, compile, owns
from ._models import walk
from ._params import get_params, set_params
from ._to_spec import to_spec
from ._trace import run_layer, trace

__all__ = ["OnnxLinear", "OPSET", "owns", "compile", "get_params", "set_params", "to_spec", "trace", "capture",
           "walk", "to_numpy", "from_numpy", "file_info", "read_file", "write_file", "read_model", "write_model",
           "load_model", "run_layer"]
