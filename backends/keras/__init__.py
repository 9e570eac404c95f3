"""Keras 3 adapter: dense_bridge specs <-> Keras layers and models, on any Keras engine.

Keras runs on the engine ``KERAS_BACKEND`` names (tensorflow, the default; jax; torch); this
adapter works on each with the same exactness. Engine-specific code lives in ``_engine``
(tensors, numpy, erfc, autograd); the rest is ``keras.ops`` and Keras layers.

Layouts (canonical == Keras for every parameter: this adapter never transposes):

==========  ============================  ===========================================
spec        Keras object                  weights (Keras name: shape)
==========  ============================  ===========================================
Dense       keras.layers.Dense            kernel: (in_features, units), bias: (units,)
 + act/mask DenseBridgeDense (subclass)   + mask: (in_features, units), non-trainable
Bilinear    Bilinear (registered layer)   kernel: (units, in1, in2), bias: (units,)
Identity    keras.layers.Identity         -
Activation  ReLU/LeakyReLU/ELU/Softmax/   -
            Activation(name or exact fn)
Sequential  keras.Sequential              keys "<position>.<name>" by position in .layers
==========  ============================  ===========================================

Keras quirks handled here (measured in docs/FACTS.md and below):

- Keras' activation defaults are not dense_bridge's (``leaky_relu`` 0.2, ``LeakyReLU()`` 0.3),
  ``tf.nn.leaky_relu`` stores its slope as a float32 attribute and ``tf.nn.gelu`` passes
  1/sqrt(2) through float32: both are ~1e-8 off in float64. Compiled layers therefore apply
  :class:`ExactActivation` (explicit parameters, constants made in the tensor's dtype); native
  Keras activation layers are used only where they compute the same function.
- ``kernel_constraint`` runs only after an optimizer step, so a mask is multiplied into the
  kernel in ``call``; its gradient is then zero on masked entries and the stored zeros stay
  zero under SGD (momentum, decoupled weight decay), Adam and custom GradientTape loops.
- Layers compute in their dtype policy's compute dtype and cast floating inputs to it, so
  activation and identity layers in a Sequential take the dtype of the Dense before them.
- Parameters are written straight into the variables at creation: the layer's initializers
  hand out the ParamSource's arrays once, then the lasting initializer (a native Keras one
  where it samples the same distribution, else :class:`DenseBridgeInitializer`) is put back.
  A lazy plain Dense stays exactly ``keras.layers.Dense`` this way. The arrays handed out are
  fresh 64-byte aligned buffers (``ParamSource.native_layer``) given to TF through DLPack, so
  each variable adopts its buffer: one copy in all, and no Keras random init to throw away.
- ``get_params`` arrays are zero-copy, read-only snapshots of the variables: TF copies a
  variable's buffer on write while another tensor still references it, so later training
  does not show in them (the first update after costs that one copy).

The package, one job a module (the same files as every adapter): ``_arrays`` (the
``to_numpy``/``from_numpy`` verbs; numpy <-> TF buffers: DLPack hand-over, zero-copy snapshots),
``_activations`` (exact activation functions, native activation layers, reading them back),
``_layers`` (DenseBridgeDense, Bilinear, Keras <-> dense_bridge initializers with the ParamSource
draw, and ``compile``), ``_to_spec`` (the layer chain of a Sequential/functional model, reading
layers and models back into specs), ``_params`` (get/set params), ``_trace``
(``tf.GradientTape`` traces), ``_models`` (``walk``: every layer with variables inside any model,
and EinsumDense read as the linear layer its equation makes it).
"""
from __future__ import annotations

import keras

from ._engine import ENGINE  # noqa: F401 - imports the engine Keras runs on (tensorflow, jax or torch)
from ._activations import ExactActivation  # noqa: E402 - after the backend check
from ._arrays import from_numpy, to_numpy  # noqa: E402
from ._layers import AnyRankSequential, Bilinear, DenseBridgeDense, DenseBridgeInitializer, compile, inference  # noqa: E402,E501
from ._params import get_params, quant_position_build, quant_positions, set_params  # noqa: E402
from ._to_spec import to_spec  # noqa: E402
from ._trace import run_layer, trace  # noqa: E402
from ._capture import capture, load_model
from ._models import walk  # noqa: E402
from ._lora import (attach_lora, detach_lora, load_lora_h5, lora_base, lora_dequantize, lora_dora, lora_heads, lora_quantized, lora_requantize, read_lora, replace_lora, save_lora_h5, write_lora, write_lora_file)  # enable_lora adapters and keras-hub .lora.h5 files
from ._quant import quant_build, quant_layer  # noqa: E402  quantized Dense/EinsumDense: dense_bridge/quant.py
from ._quant_files import quant_file_layers, quant_file_template  # noqa: E402  quantized .weights.h5: checkpoints/_quantized.py
from ._files import file_info, file_layout, file_views, read_file, write_file  # noqa: E402  # native checkpoint files
# tensor parallelism: ModelParallel + LayoutMap, Keras' JAX backend only
from ._parallel import (parallel_agree_seed, parallel_barrier, parallel_compile, parallel_get_params, parallel_set_params, parallel_state, parallel_to_spec, parallel_trace)

__all__ = ["write_lora_file", "lora_base", "lora_dora", "read_lora", "write_lora", "lora_heads", "attach_lora", "detach_lora", "save_lora_h5",
           "load_lora_h5", "lora_quantized", "lora_dequantize", "lora_requantize", "replace_lora",
           "DenseBridgeDense", "AnyRankSequential", "Bilinear", "ExactActivation", "DenseBridgeInitializer",
           "owns", "compile", "get_params", "set_params", "to_spec", "trace", "capture", "walk", "to_numpy", "from_numpy",
           "file_info", "file_layout", "file_views", "read_file", "write_file", "run_layer", "quant_layer", "quant_build",
           "quant_positions", "quant_position_build", "quant_file_layers", "quant_file_template",
           "parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params", "parallel_to_spec",
           "parallel_trace", "parallel_barrier", "parallel_agree_seed"]

# The registered classes keep the module they had as one file: saved .keras configs record
# it ("module") and error messages print it, so both stay as they were.
for _cls in (ExactActivation, DenseBridgeInitializer, DenseBridgeDense, Bilinear, AnyRankSequential):
    _cls.__module__ = __name__
del _cls


def owns(obj) -> bool:
    """Is ``obj`` a Keras layer (models included)."""
    return isinstance(obj, keras.layers.Layer)
from ._ports import (port_detect, port_contents, port_common_config, port_own_config, port_shrink, port_twin, port_save, port_shapes, port_layout, port_load, port_logits, port_example, port_describe, port_open, port_inputs, port_write_weights, port_write_config)  # noqa: E402,E501  keras-hub presets (db.port)
__all__ += ["port_detect", "port_contents", "port_common_config", "port_own_config", "port_shrink", "port_twin", "port_save", "port_shapes", "port_layout", "port_load", "port_logits", "port_example", "port_describe", "port_open", "port_inputs", "port_write_weights", "port_write_config"]
