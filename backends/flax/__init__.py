"""The Flax NNX adapter: specs to ``flax.nnx`` modules and back, canonical parameters, autograd traces.

Layouts (canonical <-> Flax): the same, nothing is transposed.

- Dense: ``nnx.Linear.kernel`` (in_features, units) = canonical ``kernel``; ``bias`` (units,);
  a mask is a :class:`Mask` variable (in_features, units), an ``nnx.Variable`` that is not an
  ``nnx.Param``.
- Bilinear: dense_bridge's :class:`Bilinear` (Flax has none), kernel (units, in1, in2) as canonical.
- Sequential: ``nnx.Sequential`` keeps its layers in ``.layers``; canonical keys are
  "<position>.<name>" ("0.kernel"), Flax's paths "layers.0.kernel".

What compile builds, lazy widths, masks under ``nnx.Optimizer``: see ``_layers``. jax.nn's
defaults (``gelu`` is the tanh approximation, ``leaky_relu`` slope 0.01) are pinned in
``_activations``. float64 needs ``jax_enable_x64`` (SpecError otherwise, ``_arrays``).

The package, one job a module (the same files as every adapter): ``_arrays``, ``_activations``,
``_layers``, ``_params``, ``_to_spec``, ``_trace`` (``jax.vjp``), ``_models`` (``walk``), ``_files`` (msgpack, Orbax),
``_capture`` (per-call records inside a whole model, ``compare_models``), ``_parallel`` (the
``parallel_*`` verbs: sharding annotations on a named mesh axis).
"""
from __future__ import annotations

from flax import nnx

from ._arrays import from_numpy, nonfinite_flags, parse_device, to_numpy  # devices: placement, device moves

COMPILES_FROM_DEVICE_ARRAYS = True  # compile copies another framework's device arrays on their device
from ._capture import capture
from ._namespace import array_namespace  # compare_models judges captures on the model's device (64-bit mode)
from ._files import file_info, file_views, read_file, write_file
from ._layers import Bilinear, DenseLinear, Flatten, Identity, LazyDenseLinear, Mask, compile
from ._models import walk
from ._lora import (attach_lora, detach_lora, lora_base, lora_dora, lora_folds_scale, lora_heads, read_lora, write_lora)  # nnx.LoRALinear adapters
from ._params import device_of, device_params, get_params, place, set_params
from ._parallel import (parallel_agree_seed, parallel_barrier, parallel_compile, parallel_get_params, parallel_set_params, parallel_state, parallel_to_spec, parallel_trace)
from ._to_spec import to_spec
from ._trace import run_layer, trace

__all__ = ["lora_base", "lora_dora", "read_lora", "write_lora", "lora_heads", "lora_folds_scale", "attach_lora", "detach_lora",
           "DenseLinear", "LazyDenseLinear", "Bilinear", "Identity", "Flatten", "Mask",
           "array_namespace", "owns", "compile", "get_params", "set_params", "to_spec", "trace", "capture", "walk", "file_info", "file_views", "read_file", "write_file", "to_numpy", "from_numpy", "run_layer",
           "parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params", "parallel_to_spec",
           "parallel_trace", "parallel_barrier", "parallel_agree_seed"]


def owns(obj) -> bool:
    """Is ``obj`` a Flax NNX module."""
    return isinstance(obj, nnx.Module)
