"""What differs between Keras' own backends (TensorFlow, JAX, torch): tensors, numpy, autograd.

Keras 3 runs on whichever engine ``KERAS_BACKEND`` names; everything else in this adapter is
written in ``keras.ops`` and Keras layers. Only these few things need the engine itself:

- ``to_tensor`` / ``to_numpy``: numpy <-> the engine's tensors, bfloat16 included (torch has no
  numpy bfloat16, so the bits cross as int16 and are relabelled; JAX and TF take ml_dtypes);
- ``erfc``: not in ``keras.ops``, and exact gelu needs it (``1 + erf(x)`` cancels in the
  negative tail, so the erf form is ~1e-8 off in float64);
- ``vjp``: forward and backward of one call with the engine's own autograd (``tf.GradientTape``,
  ``jax.vjp`` over ``stateless_call``, ``torch.autograd.grad``);
- ``check_dtype``: JAX silently keeps float32 where float64 is asked unless ``jax_enable_x64``.
- ``tanh``, ``logaddexp``, ``minimum``, ``matmul``, ``einsum``: ``keras.ops`` wherever exact, but
  Keras' type promotion (``keras.src.backend.common.dtypes._lattice_result_type``) maps float64 to
  float32 on every engine but TensorFlow, so for float64 tensors (measured, Keras 3.15,
  ``jax_enable_x64`` on) ``keras.ops.tanh`` and ``logaddexp`` return float32 on JAX and
  ``matmul``, ``minimum`` and ``logaddexp`` compute in float32 on torch (a float64
  ``keras.layers.Dense`` on torch is 2.9e-8 off a float64 matmul). There the engine's own is used.

Measured here (Keras 3.15): Dense, rank-3 input, ``fit`` and bfloat16 work on all three engines.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import numpy as np

from dense_bridge import SpecError
from dense_bridge._dtypes import numpy_dtype

ENGINE = keras.backend.backend()
_BF16 = np.dtype(numpy_dtype("bfloat16"))

if ENGINE == "tensorflow":
    import tensorflow as tf

    def to_tensor(array: Any, dtype: str | None = None):
        t = tf.convert_to_tensor(np.asarray(array))
        return t if dtype is None else tf.cast(t, dtype)

    def to_numpy(tensor: Any) -> np.ndarray:
        return np.asarray(tf.convert_to_tensor(tensor))

    def erfc(x):
        return tf.math.erfc(x)

    def vjp(fn: Callable, primals: Sequence, cotangent) -> tuple[Any, list]:
        primals = [tf.convert_to_tensor(p) for p in primals]
        with tf.GradientTape() as tape:
            for p in primals:
                tape.watch(p)
            out = fn(*primals)
        grads = tape.gradient(out, primals, output_gradients=cotangent)
        return out, [tf.zeros_like(p) if g is None else g for p, g in zip(primals, grads)]

elif ENGINE == "jax":
    import jax
    import jax.numpy as jnp

    def to_tensor(array: Any, dtype: str | None = None):
        a = np.asarray(array)
        return jnp.asarray(a, dtype=dtype or a.dtype)

    def to_numpy(tensor: Any) -> np.ndarray:
        return np.asarray(tensor)

    def erfc(x):
        return jax.lax.erfc(x)

    def vjp(fn: Callable, primals: Sequence, cotangent) -> tuple[Any, list]:
        out, pull = jax.vjp(fn, *primals)
        return out, list(pull(cotangent))

elif ENGINE == "torch":
    import torch

    def to_tensor(array: Any, dtype: str | None = None):
        a = np.asarray(array)
        if a.dtype == _BF16:  # numpy has no bfloat16 torch understands: move the bits
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.tensor(a)
        t = keras.ops.convert_to_tensor(t)  # onto the device Keras computes on
        return t if dtype is None else keras.ops.cast(t, dtype)

    def to_numpy(tensor: Any) -> np.ndarray:
        t = keras.ops.convert_to_tensor(tensor).detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(_BF16)
        return t.numpy()

    def erfc(x):
        return torch.special.erfc(x)

    def vjp(fn: Callable, primals: Sequence, cotangent) -> tuple[Any, list]:
        leaves = [p.detach().requires_grad_(True) for p in primals]
        with torch.enable_grad():
            out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad_outputs=cotangent, allow_unused=True)
        return out, [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]

else:  # pragma: no cover - Keras' other engines (openvino) have no autograd
    raise ImportError(f"dense_bridge's keras backend supports Keras on tensorflow, jax and torch, not {ENGINE!r}")


# What tells a variable's value changed, for the masked-kernel cache (_layers.DenseBridgeDense):
# JAX arrays are immutable, so every assign makes a new array (identity); torch tensors count
# their in-place writes (version counter) and may be swapped (identity, data pointer); a
# TensorFlow variable changes in place with no counter at all (None: no cache outside
# ``db.inference``). ``recording(x)``: the product must be computed afresh because the call is
# traced (tf.function / jax.jit / jax.grad / torch.compile would bake a cached tensor into the
# graph) or, on torch, autograd is recording (a cached product would share one graph between
# two backward passes and hide the kernel from the gradient).
if ENGINE == "jax":
    def change_key(variable):
        return (variable.value,)

    def recording(x) -> bool:
        return isinstance(x, jax.core.Tracer)
elif ENGINE == "torch":
    def change_key(variable):
        t = variable.value
        return (t, t._version, t.data_ptr())

    def recording(x) -> bool:
        return torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling()
else:
    def change_key(variable):
        return None

    def recording(x) -> bool:
        return not tf.executing_eagerly()


def same_key(a, b) -> bool:
    """Equal change keys: the held objects identical (``is``), counters and pointers equal."""
    return a is not None and b is not None and len(a) == len(b) and \
        all(x is y if i == 0 else x == y for i, (x, y) in enumerate(zip(a, b)))


tanh, logaddexp, minimum = keras.ops.tanh, keras.ops.logaddexp, keras.ops.minimum
matmul, einsum = keras.ops.matmul, keras.ops.einsum
if ENGINE == "jax":
    tanh, logaddexp, minimum, matmul, einsum = jnp.tanh, jnp.logaddexp, jnp.minimum, jnp.matmul, jnp.einsum
elif ENGINE == "torch":
    def _value(x):
        return x.value if isinstance(x, keras.Variable) else x

    def matmul(a, b):  # noqa: F811 - the engine's own, exact in float64
        return torch.matmul(_value(a), _value(b))

    def einsum(equation, *operands):  # noqa: F811
        return torch.einsum(equation, *[_value(x) for x in operands])

    tanh, logaddexp, minimum = torch.tanh, torch.logaddexp, torch.minimum


def inexact_float64_dense(dtype: str) -> bool:
    """keras.layers.Dense computes float64 in float32 on torch (keras.ops.matmul, see above)."""
    return dtype == "float64" and ENGINE == "torch"


def check_dtype(dtype: str, where: str = "spec") -> None:
    """SpecError for float64 on JAX without x64: JAX would silently compute in float32."""
    if ENGINE == "jax" and dtype == "float64":
        import jax

        if not jax.config.jax_enable_x64:
            raise SpecError(f"{where} asks for float64, but Keras runs on JAX without x64, which keeps float32 "
                            "silently; enable it first (jax.config.update('jax_enable_x64', True) or "
                            "JAX_ENABLE_X64=1). Received: dtype='float64'")


def layer_vjp(layer, xs: Sequence, cotangent, call: Callable | None = None) -> tuple[Any, list, dict]:
    """(y, dL/dxs, {variable path: dL/dvariable}) of one layer call, L = sum(y * cotangent).

    ``call(layer, *xs)`` defaults to ``layer(*xs, training=False)``. Trainable variables only.
    """
    call = call or (lambda lyr, *a: lyr(*a, training=False))
    trainable = list(layer.trainable_variables)
    if ENGINE == "jax":
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def fn(*args):
            values, inputs = args[:len(trainable)], args[len(trainable):]
            with keras.StatelessScope(state_mapping=list(zip(trainable, values))
                                      + list(zip(layer.non_trainable_variables, non_trainable))):
                return call(layer, *inputs)

        out, grads = vjp(fn, [v.value for v in trainable] + list(xs), cotangent)
        return out, grads[len(trainable):], {v.path: g for v, g in zip(trainable, grads[:len(trainable)])}
    if ENGINE == "torch":
        import torch

        leaves = [x.detach().requires_grad_(True) for x in xs]
        params = [v.value for v in trainable]
        with torch.enable_grad():
            out = call(layer, *leaves)
        got = torch.autograd.grad(out, leaves + params, grad_outputs=cotangent, allow_unused=True)
        got = [torch.zeros_like(s) if g is None else g for s, g in zip(leaves + params, got)]
        return out, got[:len(leaves)], {v.path: g for v, g in zip(trainable, got[len(leaves):])}
    import tensorflow as tf

    xs = [tf.convert_to_tensor(x) for x in xs]
    with tf.GradientTape() as tape:
        for x in xs:
            tape.watch(x)
        out = call(layer, *xs)
    sources = list(xs) + [v.value for v in trainable]
    got = tape.gradient(out, sources, output_gradients=cotangent)
    got = [tf.zeros_like(s) if g is None else g for s, g in zip(sources, got)]
    return out, got[:len(xs)], {v.path: g for v, g in zip(trainable, got[len(xs):])}
