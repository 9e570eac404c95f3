"""The PyTorch adapter: specs <-> ``torch.nn`` modules, canonical parameters, autograd traces.

Layouts (canonical is numpy's y = x @ kernel + bias):

- ``nn.Linear.weight`` is (out, in) = ``kernel.T``; ``bias`` (out,) = ``bias``. Every transpose
  lives here: out with a zero-copy ``weight.detach().numpy().T``; in, at compile, as fresh memory
  already transposed (``ParamSource.native_layer``: a cache-blocked copy, faster than torch's
  ``copy_(K.t())``) that torch adopts through ``torch.from_numpy``, and in ``set_params`` with
  ``weight.copy_(K.t())`` into the existing tensors.
- :class:`DenseLinear` (a Dense with an activation and/or a mask) keeps the mask as a persistent
  buffer ``"mask"`` in the weight's layout (out, in) = ``mask.T``; the forward multiplies
  ``weight * mask``, so the mask holds from the first call and never trains.
- ``nn.Bilinear.weight`` is (out, in1, in2) = ``kernel``: no transpose.
- bfloat16 crosses to numpy as ``ml_dtypes.bfloat16`` through an int16 view (numpy has no bf16).

Compile: Dense -> exactly ``nn.Linear`` when there is no activation and no mask, else
:class:`DenseLinear`; lazy Dense -> :class:`LazyDense` (an ``nn.LazyLinear`` that draws the seeded
parameters at its first call, then becomes ``nn.Linear``/``DenseLinear`` like torch's own lazy
modules); Bilinear -> ``nn.Bilinear``; Identity -> ``nn.Identity``; Activation -> the native
module with explicit parameters, or :class:`ExactActivation` where torch has no exact module;
Sequential -> ``nn.Sequential`` (keys by native position).

to_spec also reads what users write: ``nn.Sequential`` of those modules, and any ``nn.Module``
whose ``forward`` is a single chain input -> Linear/activation -> ... -> output (traced with
``torch.fx``; its parameter keys are the chain positions of the returned Sequential). Dropout
is read as Identity (its eval-mode function). A leading ``x.view(-1, in_features)`` (the MNIST
flattening in most tutorial MLPs) is accepted as input formatting: the spec takes (*, in_features).
Rejected with a ConversionError that says what to do (by to_spec, get_params and set_params
alike): a Linear whose weight torch recomputes at every forward (``prune``, ``parametrize``,
legacy ``weight_norm``: a write would be lost, a read goes stale), a parameter shared by two
chain positions (tied weights: set_params would keep the last write, convert would untie
them), and a chain mixing dtypes (a Sequential spec has one).

``owns`` leaves Keras layers to the keras adapter: under ``KERAS_BACKEND=torch`` they are
``nn.Module`` too.

The package, one job a module:

- ``_arrays``: the ``to_numpy``/``from_numpy`` verbs, dtype names, copies into tensors.
- ``_activations``: Activation <-> torch activation modules, functions and tensor methods.
- ``_layers``: :class:`DenseLinear` and :class:`LazyDense`, the modules dense_bridge adds, and
  the ``compile`` and ``owns`` verbs.
- ``_to_spec``: the ``to_spec`` verb: one module -> its layer spec; chains of nn.Sequential and
  torch.fx-traced modules.
- ``_params``: the ``get_params``/``set_params`` verbs and their layout transposes.
- ``_trace``: the ``trace`` verb (torch autograd).
- ``_models``: the ``walk`` verb (every parameterised layer inside any module tree, by path).
- ``_parallel``: the ``parallel_*`` verbs (DTensor ``ColwiseParallel``/``RowwiseParallel`` on a
  ``DeviceMesh``) and ``save_dcp``/``load_dcp`` (torch.distributed.checkpoint directories).
"""
from __future__ import annotations

from ._activations import ExactActivation
from ._arrays import device_of, from_numpy, nonfinite_flags, parse_device, place, to_numpy  # devices: placement, device moves
from ._layers import DenseLinear, LazyDense, _check_width, compile, owns
from ._params import device_params, get_params, in_place_copies, quant_position_build, quant_positions, set_params
from ._to_spec import to_spec
from ._trace import run_layer, trace, train_sgd
from ._capture import capture, load_model
from ._namespace import array_namespace  # compare_models judges captures on the model's device
from ._models import walk
from ._lora import (attach_lora, detach_lora, lora_base, lora_dora, lora_heads, lora_leftovers, lora_raw_updates, lora_root, read_lora, write_lora)
from ._quant import quant_build, quant_layer  # torchao weight-only layers: dense_bridge/quant.py
from ._files import file_info, file_layout, file_views, read_file, write_file  # native checkpoint files
from ._parallel import (load_dcp, parallel_agree_seed, parallel_barrier, parallel_compile, parallel_get_params, parallel_set_params, parallel_state, parallel_to_spec, parallel_trace, save_dcp)

from ._ports import (port_detect, port_contents, port_common_config, port_own_config, port_shrink, port_twin, port_save, port_shapes, port_layout, port_load, port_logits, port_example, port_describe, port_open, port_complete_config, port_inputs)  # noqa: E501  model directories (db.port)
__all__ = ["DenseLinear", "LazyDense", "ExactActivation",
           "array_namespace", "owns", "compile", "get_params", "set_params", "to_spec", "trace", "capture", "walk", "to_numpy", "from_numpy",
           "file_info", "file_layout", "file_views", "read_file", "write_file",
           "train_sgd", "run_layer", "lora_base", "lora_dora", "read_lora", "write_lora", "lora_heads", "attach_lora", "detach_lora",
           "lora_leftovers", "lora_raw_updates", "lora_root", "quant_layer", "quant_build", "quant_positions", "quant_position_build",
           "parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params", "parallel_to_spec",
           "parallel_trace", "parallel_barrier", "parallel_agree_seed", "save_dcp", "load_dcp"]
__all__ += ["port_detect", "port_contents", "port_common_config", "port_own_config", "port_shrink", "port_twin", "port_save", "port_shapes", "port_layout", "port_load", "port_logits", "port_example", "port_describe", "port_open", "port_complete_config", "port_inputs"]
from ._port_quant import port_keep_codes, port_recompute_codes  # noqa: E402  keep_codes=True: torchao codes (db.port)
__all__ += ["port_keep_codes", "port_recompute_codes"]

# Pickles of whole modules (torch.save) name these by module path, and error messages print
# it (``describe``): keep the path they had as the single module ``backends/torch.py``.
# ``_check_width`` is pickled as the forward pre-hook of a materialized LazyDense.
for _obj in (ExactActivation, DenseLinear, LazyDense, _check_width):
    _obj.__module__ = __name__
del _obj
