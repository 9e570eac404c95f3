"""The few array functions the adapter computes with, exact in every dtype on every Keras backend.

``keras.ops`` wherever it is exact. It is not for float64 on JAX and torch: Keras' type promotion
(``keras.src.backend.common.dtypes._lattice_result_type``) maps float64 to float32 on every backend
but TensorFlow, so for float64 tensors (measured with keras 3.15, ``jax_enable_x64`` on)
``keras.ops.tanh`` and ``logaddexp`` return float32 on JAX, and ``matmul``, ``minimum`` and
``logaddexp`` compute in float32 on torch (a float64 ``keras.layers.Dense`` on torch is 2.9e-8 off
a float64 matmul). There the backend's own function is used: ``jax.numpy``/``jax.nn``, ``torch``.
"""
from __future__ import annotations

from keras import ops

from ._arrays import BACKEND

relu, relu6, where, expm1, erfc, sigmoid, softsign, exp = (
    ops.relu, ops.relu6, ops.where, ops.expm1, ops.erfc, ops.sigmoid, ops.softsign, ops.exp)
softmax, log_softmax, einsum = ops.softmax, ops.log_softmax, ops.einsum
tanh, logaddexp, minimum, matmul = ops.tanh, ops.logaddexp, ops.minimum, ops.matmul

if BACKEND == "jax":
    import jax.numpy as jnp

    tanh, logaddexp, minimum, matmul, einsum = jnp.tanh, jnp.logaddexp, jnp.minimum, jnp.matmul, jnp.einsum
elif BACKEND == "torch":
    import torch

    def _t(x):
        return x.value if hasattr(x, "value") and not isinstance(x, torch.Tensor) else x  # a Keras Variable

    def matmul(a, b):
        return torch.matmul(_t(a), _t(b))

    def einsum(eq, *xs):
        return torch.einsum(eq, *[_t(x) for x in xs])

    tanh, logaddexp, minimum = torch.tanh, torch.logaddexp, torch.minimum
