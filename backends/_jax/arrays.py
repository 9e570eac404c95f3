"""numpy <-> JAX arrays and dtype names for the JAX adapters: bit-exact, dtype always explicit.

Shared by the Flax and the Equinox adapter (each re-exports it from its own file of the same role).

JAX keeps float32 unless ``jax_enable_x64`` is on, even where a dtype says float64 (it warns and
makes float32): dense_bridge refuses float64 then with a SpecError rather than round silently.
bfloat16 is ``ml_dtypes.bfloat16`` on both sides (JAX's own bfloat16 is that type), so it crosses
bit for bit.
"""
from __future__ import annotations

import functools

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


def to_jax(array, dtype: str, like=None) -> jax.Array:
    """A JAX array of ``array`` in ``dtype``, a copy JAX owns.

    ``array``: numpy (one host-to-device copy), a JAX array, or an array of another framework
    speaking DLPack (a torch tensor: imported without a host round trip, then copied once on its
    device, where the cast and any transpose of a strided view happen). ``like``: the array being
    replaced; the result goes to its device (one transfer when it is elsewhere), else numpy
    lands on JAX's default device.
    """
    check_dtype(dtype)
    target = _device_of_array(like)
    if isinstance(array, jax.Array) or (hasattr(array, "__dlpack__") and not isinstance(array, np.ndarray)):
        if isinstance(array, jax.Array):  # immutable: shared as it is, or cast on its device
            a = array if array.dtype == numpy_dtype(dtype) else array.astype(numpy_dtype(dtype))
        else:  # a fresh array JAX owns: a DLPack import shares the other framework's (mutable) memory
            a = _import(array)
            a = a.astype(numpy_dtype(dtype)) if a.dtype != numpy_dtype(dtype) else jnp.array(a, copy=True)
        return a if target is None or a.devices() == {target} else jax.device_put(a, target)
    a = np.asarray(array)
    if a.dtype != numpy_dtype(dtype):
        a = a.astype(numpy_dtype(dtype))
    if target is not None:
        return jax.device_put(a, target)
    return jnp.asarray(a, dtype=a.dtype)


def _import(array) -> jax.Array:
    """A DLPack array of another framework as a JAX array sharing its memory. A transposed view
    (the canonical kernel of a torch ``nn.Linear``: ``weight.t()``) that a JAX build refuses to
    import with its strides is imported untransposed (``.T``: the contiguous original) and
    transposed back by JAX, on the device."""
    try:
        return jax.dlpack.from_dlpack(array)
    except Exception:  # noqa: BLE001 - strides this JAX build does not import; anything else re-raises below
        if getattr(array, "ndim", 0) != 2:
            raise
        return jax.dlpack.from_dlpack(array.T).T


def _device_of_array(value):
    """The one device ``value`` (a JAX array, a Flax variable) lives on, else None."""
    if value is None:
        return None
    if hasattr(value, "get_value") and not isinstance(value, jax.Array):
        value = value.get_value()
    devices = value.devices() if isinstance(value, jax.Array) else ()
    return next(iter(devices)) if len(devices) == 1 else None


def from_numpy(array, device=None) -> jax.Array:
    """The adapter verb: a JAX array of ``array`` in its own dtype (bfloat16 bit for bit), on
    ``device`` (a ``jax.Device`` or a name :func:`parse_device` reads) when given, else on JAX's
    default device.

    float64 needs ``jax_enable_x64`` (SpecError otherwise); integers and bools keep their type.
    """
    a = np.asarray(array)
    target = None if device is None else parse_device(device)
    if a.dtype.name in DTYPES:
        check_dtype(a.dtype.name)
    return jnp.asarray(a) if target is None else jax.device_put(a, target)


def device_name(device) -> str:
    """A JAX device as dense_bridge names it: "cpu:N" or, for a GPU, "cuda:N" (its local index)."""
    kind = "cuda" if device.platform in ("gpu", "cuda") else device.platform
    return f"{kind}:{device.id}"


def device_of_leaves(leaves) -> str | None:
    """The device of the first JAX array among ``leaves`` (a model's arrays), else None."""
    for leaf in leaves:
        device = _device_of_array(leaf)
        if device is not None:
            return device_name(device)
    return None


def parse_device(value, argument: str = "device"):
    """A user's ``device=`` as a ``jax.Device``: a ``jax.Device`` or one of "cpu", "cpu:N",
    "cuda", "cuda:N", "gpu", "gpu:N" (N: the index among JAX's devices of that platform).
    TypeError for another type, SpecError (naming ``argument``, echoing the value) otherwise."""
    from dense_bridge._errors import received

    if isinstance(value, jax.Device):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a device name (str) or a jax.Device. {received(argument, value)}")
    kind, _, index = value.strip().lower().partition(":")
    platform = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu"}.get(kind)
    if platform is None or (index and not index.isdigit()):
        raise SpecError(f"{argument} must be 'cpu', 'cuda', 'cuda:N', 'gpu', 'gpu:N' or a jax.Device. "
                        f"{received(argument, value)}")
    devices = _platform_devices(platform)
    if int(index or 0) >= len(devices):
        raise SpecError(f"{argument} names a {platform.upper()} device JAX does not have here ({len(devices)} "
                        f"{platform} device(s)). {received(argument, value)}")
    return devices[int(index or 0)]


def _platform_devices(platform: str) -> list:
    """JAX's devices of ``platform`` ("cpu" or "gpu"). A CUDA plugin registers its backend as
    "cuda", and JAX builds differ in whether they answer to "gpu" as well: each name is asked."""
    names = ("gpu", "cuda", "rocm") if platform == "gpu" else (platform,)
    for name in names:
        try:
            return list(jax.devices(name))
        except RuntimeError:
            continue
    return [d for d in jax.devices() if d.platform in names]


def full_precision(fn):
    """``fn`` run with JAX's float32 matrix products at full float32 precision. On a GPU, JAX's
    default computes them in TF32 (a 10-bit mantissa) where torch, NumPy and JAX on a CPU compute
    float32: a comparison of a JAX model against any of those would report that rounding as a
    divergence of the model. The comparison verbs (traces, captures) run under this."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)
    return wrapped


def nonfinite_flags(arrays) -> list[bool]:
    """Which of ``arrays`` (JAX arrays, or DLPack arrays of another framework) hold NaN or Inf:
    one reduction per array on its device, the flags of each device stacked, one host
    synchronisation for the verdict."""
    flags = [False] * len(arrays)
    by_device: dict = {}
    for i, a in enumerate(arrays):
        x = a if isinstance(a, jax.Array) else _import(a)
        if jnp.issubdtype(x.dtype, jnp.floating) and x.size:
            by_device.setdefault(_device_of_array(x), []).append((i, jnp.isfinite(x).all()))
    for pairs in by_device.values():
        finite = jnp.stack([f for _, f in pairs])
        if bool(finite.all()):  # the one host synchronisation
            continue
        for (i, _), ok in zip(pairs, np.asarray(finite).tolist()):
            flags[i] = not ok
    return flags


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
