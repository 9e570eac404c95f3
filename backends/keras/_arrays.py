"""numpy <-> the Keras engine's memory: fresh tensors it alone owns, snapshots, variable writes.

On TensorFlow (below) large arrays take the DLPack hand-over; on JAX and torch the engine's own
conversion (``_engine.to_tensor``) copies once, and snapshots are host copies.

Large arrays cross into TF with one copy: dense_bridge copies them into a fresh 64-byte
aligned buffer that TF adopts through DLPack (:func:`give_array`). ``read_array`` gives zero-copy,
read-only snapshots of variables (TF copies a variable's buffer on write while another
tensor still references it, so later training does not show in them).
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge.params._copy import native_copy

from . import _engine
from ._engine import ENGINE

if ENGINE == "tensorflow":
    import tensorflow as tf

_GIVE_MIN_BYTES = 1 << 20  # below this TF's own copy of a numpy array costs next to nothing
_GIVEABLE = {np.dtype(t) for t in (np.float16, np.float32, np.float64)} | {np.dtype(numpy_dtype("bfloat16"))}


def to_tensor(array: Any):
    """A fresh TF tensor holding a copy of ``array``, in memory TF alone owns.

    Large arrays are copied by dense_bridge (a cache-blocked transpose for views such as
    torch's weight.T: 2-3x tf.transpose here) into a new buffer that TF then adopts (:func:`give_array`).
    """
    a = np.asarray(array)
    if ENGINE != "tensorflow":
        return _engine.to_tensor(a)
    if a.nbytes < _GIVE_MIN_BYTES or a.dtype not in _GIVEABLE or not tf.executing_eagerly():
        return tf.convert_to_tensor(a)  # TF copies (numpy memory is not 64-byte aligned)
    fresh, _ = native_copy(a)
    return give_array(fresh)


def give_array(fresh: np.ndarray):
    """TF's tensor over ``fresh``, a new 64-byte aligned array that no one else references.

    DLPack hands the buffer to TF without a copy (``tf.convert_to_tensor`` would copy it
    again), and a variable created from or assigned the tensor takes the buffer over: its
    only owner from then on. TF aborts on DLPack memory not aligned to 64 bytes (docs/FACTS.md);
    ``ParamSource.native_layer`` and ``native_copy`` buffers are.
    """
    if ENGINE != "tensorflow":
        return _engine.to_tensor(fresh)
    if fresh.dtype not in _GIVEABLE or not tf.executing_eagerly() or fresh.ndim == 0:
        return tf.convert_to_tensor(fresh)
    if fresh.dtype == numpy_dtype("bfloat16"):
        # numpy exports no ml_dtypes bfloat16 over DLPack: move the bits as uint16, relabel in TF
        # (tf.bitcast shares the buffer)
        return tf.bitcast(tf.experimental.dlpack.from_dlpack(fresh.view(np.uint16).__dlpack__()), tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(fresh.__dlpack__())


def read_array(variable) -> np.ndarray:
    """A zero-copy, read-only numpy snapshot of a Keras variable (bfloat16 as ml_dtypes)."""
    if ENGINE != "tensorflow":
        out = np.array(_engine.to_numpy(variable.value))  # a copy: the engine may update in place
        out.flags.writeable = False
        return out
    out = np.asarray(tf.convert_to_tensor(variable.value))
    out.flags.writeable = False  # it is TF's buffer: never written through numpy
    return out


def assign_array(variable, array: Any) -> None:
    """Copy a canonical array into a variable (the variable takes over the fresh buffer)."""
    variable.assign(to_tensor(array))


def to_numpy(array: Any) -> np.ndarray:
    """The adapter verb: a numpy array of a TF tensor or Keras variable (bfloat16 as ml_dtypes).

    A zero-copy view where TF allows one, read-only either way (TF owns the memory).
    """
    if isinstance(array, keras.Variable):
        return read_array(array)
    out = _engine.to_numpy(array)
    out.flags.writeable = False
    return out


def from_numpy(array: Any):
    """The adapter verb: a TF tensor holding ``array``'s values in its dtype (bfloat16 included)."""
    return to_tensor(array)
