"""numpy <-> the Keras backend's memory (TensorFlow, JAX or torch): fresh tensors, snapshots, writes.

Which backend is decided once, when Keras is imported (``KERAS_BACKEND``); :data:`BACKEND` names it.

- TensorFlow: large arrays cross with one copy: dense_bridge copies them into a fresh 64-byte
  aligned buffer that TF adopts through DLPack (:func:`_give`). ``_read`` gives zero-copy,
  read-only snapshots of variables (TF copies a variable's buffer on write while another
  tensor still references it, so later training does not show in them).
- JAX: arrays are immutable and a variable's assign replaces its array, so ``_read`` is a
  zero-copy snapshot too; ``_give`` lets ``jnp.asarray`` take the fresh buffer (JAX's CPU
  client may alias aligned host memory, which is safe for a buffer nobody else holds).
  float64 exists only with ``jax_enable_x64`` (JAX silently makes float32 otherwise):
  :func:`check_dtype` refuses it.
- torch: a Keras variable is a ``torch.nn.Parameter`` that optimizers and ``assign`` update in
  place, so ``_read`` is a read-only view of live memory (``db.get_params`` copies by default).
  ``torch.from_numpy`` adopts fresh buffers; bfloat16 crosses as its 16 bits (numpy has no
  bfloat16 of its own, torch none in ``from_numpy``).
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import SpecError
from dense_bridge._transfer import native_copy

BACKEND: str = keras.backend.backend()

_BF16 = np.dtype(numpy_dtype("bfloat16"))
_GIVE_MIN_BYTES = 1 << 20  # below this the framework's own copy of a numpy array costs next to nothing
_GIVEABLE = {np.dtype(t) for t in (np.float16, np.float32, np.float64)} | {_BF16}

if BACKEND == "tensorflow":
    import tensorflow as tf

    def _give(fresh: np.ndarray):
        """TF's tensor over ``fresh``, a new 64-byte aligned array that no one else references.

        DLPack hands the buffer to TF without a copy (``tf.convert_to_tensor`` would copy it
        again), and a variable created from or assigned the tensor takes the buffer over: its
        only owner from then on. TF aborts on DLPack memory not aligned to 64 bytes (docs/FACTS.md);
        ``ParamSource.native_layer`` and ``native_copy`` buffers are.
        """
        if fresh.dtype not in _GIVEABLE or not tf.executing_eagerly() or fresh.ndim == 0:
            return tf.convert_to_tensor(fresh)
        if fresh.dtype == _BF16:
            # numpy exports no ml_dtypes bfloat16 over DLPack: move the bits as uint16, relabel in TF
            # (tf.bitcast shares the buffer)
            return tf.bitcast(tf.experimental.dlpack.from_dlpack(fresh.view(np.uint16).__dlpack__()), tf.bfloat16)
        return tf.experimental.dlpack.from_dlpack(fresh.__dlpack__())

    def _copy(a: np.ndarray):
        if a.nbytes < _GIVE_MIN_BYTES or a.dtype not in _GIVEABLE or not tf.executing_eagerly():
            return tf.convert_to_tensor(a)  # TF copies (numpy memory is not 64-byte aligned)
        return _give(native_copy(a)[0])

    def _numpy(t) -> np.ndarray:
        return np.asarray(tf.convert_to_tensor(t))

elif BACKEND == "jax":
    import jax
    import jax.numpy as jnp

    def _give(fresh: np.ndarray):
        """A JAX array of ``fresh`` (a buffer nobody else holds: JAX may keep it as its own)."""
        return jnp.asarray(fresh)

    def _copy(a: np.ndarray):
        return jnp.array(a, copy=True)

    def _numpy(t) -> np.ndarray:
        return np.asarray(t)  # zero-copy on CPU; bfloat16 arrives as ml_dtypes.bfloat16

elif BACKEND == "torch":
    import torch
    from keras.src.backend.torch.core import get_device

    def _give(fresh: np.ndarray):
        """A torch tensor over ``fresh`` (adopted, no copy, on CPU), on Keras' device."""
        if fresh.dtype == _BF16:
            t = torch.from_numpy(fresh.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(fresh)
        return t.to(get_device())

    def _copy(a: np.ndarray):
        if a.nbytes >= _GIVE_MIN_BYTES and a.dtype in _GIVEABLE:
            return _give(native_copy(a)[0])  # transposing views are copied cache-blocked
        return _give(np.array(a, copy=True, order="C"))

    def _numpy(t) -> np.ndarray:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_BF16)
        return t.numpy()

else:  # pragma: no cover - guarded in __init__
    raise ImportError(f"Keras backend {BACKEND!r} is not supported by dense_bridge")


def x64_enabled() -> bool:
    """Can this Keras backend hold float64 (JAX: only with ``jax_enable_x64``)."""
    return BACKEND != "jax" or bool(jax.config.jax_enable_x64)


def check_dtype(dtype: str, where: str) -> None:
    """SpecError for float64 on JAX without ``jax_enable_x64`` (JAX would silently keep float32)."""
    if dtype == "float64" and not x64_enabled():
        raise SpecError(
            f"{where} has dtype float64, but Keras runs on JAX and jax_enable_x64 is off, so JAX would "
            f"silently make it float32. Enable it first (JAX_ENABLE_X64=1, or "
            f"jax.config.update('jax_enable_x64', True)) or use float32. Received: dtype={dtype!r}")


def _to_tensor(array: Any):
    """A fresh backend tensor holding a copy of ``array`` (its dtype kept, bfloat16 included).

    Large arrays are copied by dense_bridge (a cache-blocked transpose for views such as
    torch's weight.T: 2-3x tf.transpose here) into a new buffer the framework then adopts.
    """
    a = np.asarray(array)
    if a.dtype == np.float64:
        check_dtype("float64", "the array")
    return _copy(a)


def _read(variable) -> np.ndarray:
    """A zero-copy, read-only numpy view of a Keras variable's value (bfloat16 as ml_dtypes)."""
    out = _numpy(variable.value)
    if out.flags.writeable:
        out = out.view()
        out.flags.writeable = False  # the framework's buffer: never written through numpy
    return out


def _assign(variable, array: Any) -> None:
    """Copy a canonical array into a variable (TF/JAX: the variable takes over the fresh buffer)."""
    variable.assign(_to_tensor(array))


def to_numpy(array: Any) -> np.ndarray:
    """The adapter verb: a numpy array of a backend tensor or Keras variable (bfloat16 as ml_dtypes).

    A zero-copy view where the framework allows one, read-only either way (it owns the memory).
    """
    if isinstance(array, keras.Variable):
        return _read(array)
    out = _numpy(keras.ops.convert_to_tensor(array))
    if out.flags.writeable:
        out = out.view()
        out.flags.writeable = False
    return out


def from_numpy(array: Any):
    """The adapter verb: a backend tensor holding ``array``'s values in its dtype (bfloat16 included)."""
    return _to_tensor(array)
