"""numpy <-> JAX arrays and dtype names for the JAX adapters: bit-exact, dtype always explicit.

Shared by the Flax and the Equinox adapter (each re-exports it from its own file of the same role).

JAX keeps float32 unless ``jax_enable_x64`` is on, even where a dtype says float64 (it warns and
makes float32): dense_bridge refuses float64 then with a SpecError rather than round silently.
bfloat16 is ``ml_dtypes.bfloat16`` on both sides (JAX's own bfloat16 is that type), so it crosses
bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError, SpecError

DTYPES = ("float32", "float64", "float16", "bfloat16")


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


def check_dtype(dtype: str, argument: str = "dtype") -> None:
    """SpecError for float64 while JAX runs in 32-bit mode (its default)."""
    if dtype == "float64" and not x64_enabled():
        raise SpecError(f"{argument}='float64' needs JAX's 64-bit mode (JAX makes float32 otherwise): call "
                        f"jax.config.update('jax_enable_x64', True) first. Received: {argument}={dtype!r}")


def to_jax(array, dtype: str) -> jax.Array:
    """A JAX array of ``array`` in ``dtype`` (a copy on the default device)."""
    check_dtype(dtype)
    a = np.asarray(array)
    if a.dtype != numpy_dtype(dtype):
        a = a.astype(numpy_dtype(dtype))
    return jnp.asarray(a, dtype=a.dtype)


def from_numpy(array) -> jax.Array:
    """The adapter verb: a JAX array of ``array`` in its own dtype (bfloat16 bit for bit).

    float64 needs ``jax_enable_x64`` (SpecError otherwise); integers and bools keep their type.
    """
    a = np.asarray(array)
    if a.dtype.name in DTYPES:
        return to_jax(a, a.dtype.name)
    return jnp.asarray(a)


def to_numpy(array) -> np.ndarray:
    """The adapter verb: a read-only numpy view (or copy) of a JAX array (or a Flax nnx.Variable)."""
    if hasattr(array, "get_value") and not isinstance(array, (jax.Array, np.ndarray)):
        array = array.get_value()  # a Flax nnx.Variable
    out = np.asarray(array)
    if out.flags.writeable and isinstance(array, jax.Array):
        out = out.view()
        out.flags.writeable = False  # JAX owns this memory (arrays are immutable)
    return out


def dtype_name(dtype, where: str) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ConversionError(f"{where} has dtype {name}; dense_bridge supports {', '.join(DTYPES)}")
    return name
