"""The numpy reference backend: forward and hand-derived backward for every layer spec.

Layout is the canonical one (y = x @ W + b): ``kernel`` (in_features, units). float32 and
float64 compute in their own precision; float16 and bfloat16 compute in float32 and round
each result to the layer dtype, as the frameworks' CPU kernels do.

Backward (seed 004), for z = x @ (W * M) + b, y = f(z), upstream g = dL/dy:
    dz = f'(z)^T g           (the activation's vector-Jacobian product)
    dL/dx = dz @ (W * M)^T,  dL/dW = (x^T dz) * M,  dL/db = sum over batch of dz
The mask multiplies the gradient so a masked weight never moves under plain SGD.

The package, one job a module (the same files as every adapter): ``_arrays`` (the
``to_numpy``/``from_numpy`` verbs, input checks), ``_activations`` (the common layer surface,
:class:`ActivationLayer`), ``_layers`` (Dense, Bilinear, Identity, Sequential reference layers,
``compile``, ``owns``), ``_params`` (get/set params), ``_to_spec``, ``_trace``.
"""
from __future__ import annotations

from ._activations import ActivationLayer
from ._arrays import from_numpy, to_numpy
from ._layers import BilinearLayer, DenseLayer, IdentityLayer, SequentialModel, compile, owns
from ._params import get_params, set_params
from ._to_spec import to_spec
from ._trace import run_layer, trace, train_sgd
from ._capture import capture
from ._models import walk
from ._files import file_info, read_file, write_file  # native checkpoint files

__all__ = ["DenseLayer", "BilinearLayer", "IdentityLayer", "ActivationLayer", "SequentialModel",
           "owns", "compile", "get_params", "set_params", "to_spec", "trace", "capture", "walk", "to_numpy", "from_numpy",
           "file_info", "read_file", "write_file",
           "train_sgd", "run_layer"]

# Pickles of reference layers name their classes by module path: keep the path they had as the
# single module ``backends/numpy.py``.
for _cls in (ActivationLayer, BilinearLayer, DenseLayer, IdentityLayer, SequentialModel):
    _cls.__module__ = __name__
del _cls
