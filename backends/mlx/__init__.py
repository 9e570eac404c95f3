"""The MLX adapter: specs to ``mlx.nn`` modules and back, canonical parameters, autograd traces.

Layouts (canonical <-> MLX), by declaration and never by shape:

- Dense: canonical ``kernel`` (in_features, units) <-> ``nn.Linear.weight`` (units, in_features),
  i.e. weight = kernel.T; ``bias`` (units,) is the same in both. A mask is stored like the
  weight, (units, in_features) = canonical mask.T, as the frozen parameter ``mask``.
- Bilinear: canonical ``kernel`` (units, in1, in2) <-> ``nn.Bilinear.weight`` (units, in2, in1):
  MLX computes y_i = x2^T W_i x1 + b_i (mlx/nn/layers/linear.py), so weight = kernel with axes
  1 and 2 swapped.
- Sequential: ``nn.Sequential`` keeps its modules in ``.layers``; canonical keys are
  "<position>.<name>" ("0.kernel", "2.bias"), MLX's native ones "layers.0.weight".

What compile builds:

- Dense with no activation and no mask -> exactly ``nn.Linear``; otherwise :class:`DenseLinear`
  (an ``nn.Linear`` subclass applying weight * mask and the activation in ``__call__``); a lazy
  spec (in_features=None) -> :class:`LazyDenseLinear`, which draws its parameters on its first
  input. Bilinear -> ``nn.Bilinear``; Identity -> ``nn.Identity``; Sequential -> ``nn.Sequential``.
- Activation -> the ``mlx.nn`` module where MLX computes exactly that function, gradients at
  kinks and in float16 included (``nn.ReLU``, ``nn.SiLU``, ``nn.Softmax()`` for axis -1, ...),
  else :class:`ExactActivation`: MLX's ``selu`` uses truncated constants (1.0507, 1.67326), MLX
  has no ``hard_sigmoid``/``exponential``, ``nn.Softmax`` has no axis, ``nn.LeakyReLU``'s
  ``maximum(s*x, x)`` has slope 1 at 0 (and is leaky_relu only for slopes <= 1), ``nn.ELU``'s
  gradient is NaN for large x, ``nn.GELU`` and ``nn.Hardswish`` overflow in float16, and
  ``nn.log_softmax`` segfaults over an axis of length 1 (MLX 0.32.4). ``to_spec`` still reads
  all of these native modules when users build them by hand.

Masks: MLX makes every public ``mx.array`` attribute a trainable parameter (docs/FACTS.md), so ``mask``
is frozen: ``save_weights``/``load_weights`` carry it, ``trainable_parameters``,
``nn.value_and_grad`` and the optimizers never see it, and ``unfreeze()`` cannot thaw it.

dtypes: float32, float16, bfloat16 and float64. float64 runs on the CPU only, and MLX computes
``exp``, ``sigmoid`` and ``erf`` there to float32 accuracy only (docs/FACTS.md): float64 activations
built on them are float32-accurate. ``mx.array`` of a float64 numpy array silently makes float32
unless told otherwise, so every conversion here passes its dtype. bfloat16 crosses to and from
numpy bit for bit through a uint16 view (ml_dtypes on the numpy side), never widened.

Compiling never draws from MLX's global random state: modules are created without running
``nn.Linear.__init__`` (whose uniform draws would be thrown away) and given the numpy params.

The package, one job a module (the same files as every adapter): ``_arrays`` (the
``to_numpy``/``from_numpy`` verbs, numpy <-> mx copies/views and dtype names),
``_activations`` (exact activation modules/functions and reading native ones, both directions),
``_layers`` (DenseLinear, LazyDenseLinear and ``compile``), ``_params`` (get/set params, layout
transposes), ``_to_spec`` (reading live modules back into specs), ``_trace`` (``mx.vjp`` traces),
``_models`` (``walk``: every module holding arrays inside any module tree, by dotted path),
``_parallel`` (the ``parallel_*`` verbs: tensor parallelism on ``mx.distributed``, column/row-sharded
Dense; the plain verbs above never see a sharded layer: dense_bridge/parallel/_dispatch.py routes
a parallel model to these).
"""
from __future__ import annotations

import mlx.nn as nn

from ._activations import ExactActivation
from ._arrays import from_numpy, to_numpy
from ._layers import DenseLinear, Flatten, LazyDenseLinear, compile
from ._params import get_params, quant_position_build, quant_positions, set_params
from ._to_spec import to_spec
from ._trace import run_layer, trace
from ._capture import capture
from ._models import walk
from ._lora import (attach_lora, detach_lora, lora_base, lora_dora, lora_dequantize, lora_heads, lora_quantized, lora_requantize, read_lora, replace_lora, write_lora)
from ._quant import quant_build, quant_layer  # quantized layers: dense_bridge/quant.py
from ._files import file_info, file_layout, file_views, read_file, write_file  # native checkpoint files
from ._quant_files import model_dir_layers, quant_file_layers, quant_file_template  # MLX quantized safetensors, mlx-lm directories

from ._parallel import (ColumnDense, RowDense, parallel_agree_seed, parallel_barrier, parallel_compile, parallel_get_params, parallel_set_params, parallel_state, parallel_to_spec, parallel_trace)

from ._ports import (port_detect, port_contents, port_common_config, port_own_config, port_shrink, port_twin, port_save, port_shapes, port_layout, port_load, port_logits, port_example, port_describe, port_open, port_quantize, port_parse_quantize, port_recompute_codes, port_complete_config, port_as_loaded, port_source_form)  # noqa: E501  model directories (db.port)
__all__ = ["lora_base", "lora_dora", "read_lora", "write_lora", "lora_heads", "attach_lora", "detach_lora", "lora_quantized",
           "lora_dequantize", "lora_requantize", "replace_lora",
           "DenseLinear", "LazyDenseLinear", "Flatten", "ExactActivation", "ColumnDense", "RowDense",
           "parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params", "parallel_to_spec",
           "parallel_trace", "parallel_barrier", "parallel_agree_seed",
           "owns", "compile", "get_params", "set_params", "to_spec", "trace", "capture", "walk", "to_numpy", "from_numpy",
           "file_info", "file_layout", "file_views", "read_file", "write_file", "run_layer", "quant_layer", "quant_build", "quant_positions", "quant_position_build",
           "quant_file_layers", "quant_file_template", "model_dir_layers"]
from ._port_quant import port_keep_codes  # noqa: E402  keep_codes=True: the source's codes in mlx-lm's layout
__all__ += ["port_keep_codes"]
__all__ += ["port_detect", "port_contents", "port_common_config", "port_own_config", "port_shrink", "port_twin", "port_save", "port_shapes", "port_layout", "port_load", "port_logits", "port_example", "port_describe", "port_open", "port_quantize", "port_parse_quantize", "port_recompute_codes", "port_complete_config", "port_as_loaded", "port_source_form"]


def owns(obj) -> bool:
    """Is ``obj`` an mlx.nn module."""
    return isinstance(obj, nn.Module)
