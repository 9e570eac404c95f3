"""The Equinox adapter: specs to ``equinox.nn`` modules and back, canonical parameters, autograd traces.

Layouts (canonical <-> Equinox), by declaration and never by shape:

- Dense: canonical ``kernel`` (in_features, units) <-> ``eqx.nn.Linear.weight`` (units, in_features),
  weight = kernel.T; ``bias`` (units,) the same. A mask is a bool array (units, in_features).
- Bilinear: dense_bridge's :class:`Bilinear` (Equinox has none), weight (units, in1, in2) = kernel.
- Sequential: ``eqx.nn.Sequential`` keeps its layers in ``.layers`` ("0.kernel"); an ``eqx.nn.MLP``
  reads as Linear, activation, Linear, ... ("0.kernel", "2.kernel").

Equinox layers take one sample and batch through ``jax.vmap`` (the one exception to "any
leading axes"); lazy widths raise a SpecError (immutable modules); masks are bool arrays, which
``eqx.is_inexact_array`` filtering leaves out of training (see ``_layers``). jax.nn's defaults are
pinned in ``_activations``. float64 needs ``jax_enable_x64`` (SpecError otherwise, ``_arrays``).

The package, one job a module (the same files as every adapter): ``_arrays``, ``_activations``,
``_layers``, ``_params``, ``_to_spec``, ``_trace`` (``jax.vjp`` under ``jax.vmap``), ``_models``, ``_files``
(``eqx.tree_serialise_leaves``), ``_capture`` (per-call records inside a model, vmapped).
"""
from __future__ import annotations

import equinox as eqx

from ._arrays import from_numpy, nonfinite_flags, parse_device, to_numpy  # devices: placement, device moves

COMPILES_FROM_DEVICE_ARRAYS = True  # compile copies another framework's device arrays on their device
from ._capture import capture
from ._namespace import array_namespace  # compare_models judges captures on the model's device (64-bit mode)
from ._files import file_info, file_views, read_file, write_file
from ._layers import Bilinear, DenseLinear, Flatten, compile
from ._models import walk
from ._params import device_of, device_params, get_params, place, set_params
from ._to_spec import to_spec
from ._trace import run_layer, trace

__all__ = ["DenseLinear", "Bilinear", "Flatten",
           "array_namespace", "owns", "compile", "get_params", "set_params", "to_spec", "trace", "capture", "walk", "file_info", "file_views", "read_file", "write_file", "to_numpy", "from_numpy", "run_layer"]


def owns(obj) -> bool:
    """Is ``obj`` an Equinox module."""
    return isinstance(obj, eqx.Module)
