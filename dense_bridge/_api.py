"""The public verbs: compile, get_params, set_params, to_spec, convert; and ``build``, the one
compile path they and checkpoint loading share.

Each one resolves its native object once into a handle (``dense_bridge._handles``: plain,
parallel, LoRA-wrapped, or quantized codes) and calls it; framework work is the adapter's.
The checks that must hold for every backend (names, shapes, dtypes, all-or-nothing loading)
live here and in the handles, once.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ._errors import SpecError, check_flag, received
from ._handles import resolve
from .params._memory_budget import check_fits_in_memory
from .params._source import ParamSource
from .registry._backends import adapter_for, backend_of, check_backend_name, get_adapter
from .registry._backends import available_backends as installed_backends
from .registry._remembered_spec import remember_spec
from .activations import Activation
from .specs import Dense, Spec


def _check_spec(spec: object) -> None:
    if not isinstance(spec, (Spec, Activation)):
        raise TypeError(f"spec must be a dense_bridge spec (Dense, Bilinear, Identity, Sequential). "
                        f"{received('spec', spec)}")


def compile(spec: Any, backend: str, *, seed: int | None = None, params: Mapping | None = None,
            allow_nonfinite: bool = False, parallel: Any = None, group: Any = None, device: Any = None):
    """The framework's own layer or model for ``spec``.

    Dense -> torch.nn.Linear / keras.layers.Dense / mlx.nn.Linear (a thin subclass only when
    an activation or mask needs one); Sequential -> that framework's Sequential; "numpy" -> the
    reference layer. Initial parameters are drawn in numpy from ``seed`` (bit-identical on every
    backend), or loaded from canonical ``params`` (NaN/Inf in them raise a ConversionError
    unless ``allow_nonfinite=True``). ``parallel`` ("auto", or {position: "column" | "row"})
    with ``group`` (the framework's mesh/group) compiles onto the framework's own tensor-parallel
    machinery: dense_bridge/parallel/ (plan, dispatch), backends/<fw>/_parallel.py. There every rank
    must build the same model: with ``seed=None`` rank 0 draws the seed and the group's other
    ranks take it (one broadcast), so the shards are those of one random model.

    ``device``: where the model's arrays live: the framework's own device object or "cpu",
    "cuda", "cuda:N", "gpu", "gpu:N" (backends with the ``devices`` capability: torch, Flax,
    Equinox); checked before anything is built (a SpecError naming the value). None: the
    framework's default device.
    """
    _check_spec(spec)
    check_flag("allow_nonfinite", allow_nonfinite)
    backend = check_backend_name(backend)
    if device is not None:
        from .registry import _devices

        if parallel is not None or group is not None:
            raise SpecError(f"device= and parallel= do not go together: a parallel model's ranks each hold their "
                            f"own device (the group says which). {received('device', device)}")
        target = _devices.device_for(backend, device)
        return _devices.place(compile(spec, backend, seed=seed, params=params, allow_nonfinite=allow_nonfinite),
                              backend, target)
    # The target is a new object, so the NaN/Inf scan of given params can ride along with the
    # copies into it instead of costing a pass of its own (the same error, before returning).
    source = ParamSource(spec, seed=seed, params=params, defer_finite_check=True, allow_nonfinite=allow_nonfinite)
    if parallel is not None or group is not None:  # tensor parallelism: dense_bridge/parallel/
        from .parallel._dispatch import compile_source
        return compile_source(backend, source, parallel, group, agree_seed=seed is None)
    return build(backend, source)


def build(backend: str, source: ParamSource):
    """The one compile path: the native object for ``source.spec`` on ``backend``.

    ``compile``, ``convert`` and checkpoint loading all come here. ``source`` says where the
    parameters come from (a seed, given canonical params, or a stream reading each layer from a
    file: ``ParamSource(spec, stream=...)``); the adapter asks it layer by layer. Afterwards the
    deferred NaN/Inf checks are collected (``source.finish()``) and the spec is remembered on
    the object (``dense_bridge.registry._remembered_spec``).
    """
    adapter = get_adapter(backend)
    check_fits_in_memory(source.spec)  # a SpecError now, not a MemoryError inside the framework
    native = adapter.compile(source.spec, source)
    source.finish()
    remember_spec(native, source.spec)
    return native


def get_params(native: Any, *, copy: bool = True, local: bool = False,
               quantized: bool = False) -> dict[str, np.ndarray]:
    """Canonical parameters of a native layer or model: kernel (in, units), bias (units,), mask.

    Sequential keys are prefixed with the layer position ("0.kernel"). bfloat16 stays bfloat16.
    With ``copy=True`` (the default) the arrays are snapshots the caller owns: training the
    model afterwards does not change them. ``copy=False`` returns the adapters' zero-copy,
    read-only views where the framework allows (torch, MLX): fast, but a torch view follows
    the weights through ``opt.step()``. On a parallel model (compiled with ``parallel=``) the
    call is collective and returns the full arrays on every rank; ``local=True`` returns this
    rank's blocks as ``Shard(array, index)`` with ``full[index] == array``.
    A quantized linear layer gives the float kernel its framework dequantizes to; with
    ``quantized=True`` its codes instead: "qkernel" (in, units), per-group "scale" and
    "zero"/"offset", "bias", and "quant" (a ``db.Quant``) (dense_bridge/quant.py).
    """
    check_flag("copy", copy)
    check_flag("quantized", quantized)
    check_flag("local", local)
    return resolve(native, codes=quantized).get(copy=copy, local=local)


def set_params(native: Any, params: Mapping, *, strict: bool = True, allow_nonfinite: bool = False) -> None:
    """Load canonical ``params`` into ``native``.

    All keys, shapes and values are checked before anything is written: on any offender one
    ConversionError lists them all and ``native`` is unchanged. ``strict=False`` allows a
    subset of the keys (unexpected ones still raise). NaN/Inf raise unless
    ``allow_nonfinite=True``; a mask that differs from the model's raises. Into a quantized
    layer, float params are quantized by its framework's quantizer; codes (params with a
    "quant" key, as ``get_params(quantized=True)`` gives them) move only where the layer
    dequantizes them to the same floats bit for bit, else ConversionError (dense_bridge/quant.py).
    """
    check_flag("strict", strict)
    check_flag("allow_nonfinite", allow_nonfinite)
    codes = isinstance(params, Mapping) and "quant" in params
    resolve(native, codes=codes).set(params, strict=strict, allow_nonfinite=allow_nonfinite)


def to_spec(native: Any, *, example: Any = None):
    """The backend-neutral spec of a native layer or model (activation parameters read exactly).

    ``example``: an input (numpy array) for torch models whose forward branches on static
    properties (``x.ndim``, shapes): torch.export specialises the branch this input takes (by
    default a (2, in_features) input from the first Linear). It is remembered on the model, so
    later get_params/set_params/convert read the same branch.
    """
    if isinstance(native, (Spec, Activation)):
        return native
    handle = resolve(native)  # a parallel model's: the full spec
    if example is not None:
        from .models import remember_example

        remember_example(native, example)
    return handle.spec()


def convert(native: Any, to: str, *, allow_nonfinite: bool = False, example: Any = None, quant: Any = None,
            requantize: bool = False, device: Any = None):
    """A new native object on backend ``to`` with ``native``'s spec and parameters.

    float32 parameters arrive bit-identical; layouts are transposed by declaration, never by
    shape, so square layers convert correctly and A -> B -> A gives back A's values. NaN/Inf
    parameters raise a ConversionError unless ``allow_nonfinite=True``. A quantized layer
    converts to the float layer it stands for (its exact dequantization); with ``quant`` (a
    ``db.Quant`` the target offers) to the target's quantized layer, its codes moved exactly
    or a ConversionError, unless ``requantize=True`` (dense_bridge/quant.py).

    ``device``: where the new model's arrays live (the framework's device object, or "cpu", "cuda",
    "cuda:N", "gpu", "gpu:N"). Default: ``native``'s own device when the target framework can
    hold arrays there (a CUDA torch model converts to a Flax model on the same GPU; a second JAX
    host device's model to a CPU torch model), else the target framework's default device.
    """
    from .registry import _devices

    target = check_backend_name(to, "to")
    place_on = _devices.device_for(target, device) if device is not None else _devices.source_device(native, target)
    if example is not None:  # see to_spec; what is not a model is refused by its reading first
        from .models import remember_example

        resolve(native)
        remember_example(native, example)
    if quant is None and place_on is not None:
        out = _convert_on_device(native, target, place_on, allow_nonfinite=allow_nonfinite)
        if out is not None:
            return out
    out = _convert(native, target, allow_nonfinite=allow_nonfinite, quant=quant, requantize=requantize)
    return out if place_on is None else _devices.place(out, target, place_on)


def _convert_on_device(native: Any, target: str, place_on: Any, *, allow_nonfinite: bool):
    """:func:`convert` without a host round trip, for a source whose arrays are on an accelerator
    (or a second host device) and whose framework hands them out as its own arrays
    (``device_params``), into a framework that builds from such arrays
    (``COMPILES_FROM_DEVICE_ARRAYS``): each array is copied on its device (DLPack; the layout
    transpose, any cast and the NaN/Inf check done there), then placed on ``place_on`` (nothing
    moves when it is there already). None where this does not apply (host memory, a layer read
    on the host, a LoRA wrapper, a target that builds from host buffers): the host path converts
    those, reading each array once."""
    from .registry import _devices

    where = _devices.where(native)
    if where is None or where in ("cpu", "cpu:0") or not getattr(get_adapter(target), "COMPILES_FROM_DEVICE_ARRAYS", False):
        return None
    handle = resolve(native)
    read_device = getattr(handle.verbs, "device_params", None) if handle.kind == "plain" else None
    if not callable(read_device):
        return None
    arrays = read_device(native)
    if arrays is None:
        return None
    source = ParamSource(handle.spec(), params=arrays, allow_nonfinite=allow_nonfinite, keep_device=True)
    return _devices.place(build(target, source), target, place_on)


def _convert(native: Any, target: str, *, allow_nonfinite: bool, quant: Any, requantize: bool):
    """:func:`convert` on the target framework's default device."""
    if quant is not None:  # the float conversion, then the target framework's quantized layer
        from .quant import check_quant, quantize_converted

        check_flag("requantize", requantize)
        check_quant(quant)
        return quantize_converted(native, _convert(native, target, allow_nonfinite=allow_nonfinite,
                                                   quant=None, requantize=False), quant, requantize)
    handle = resolve(native)  # a parallel model's: full params gathered on every rank
    spec, params = handle.source()  # a LoRA-wrapped layer: a ConversionError (the adapter would be lost)
    return compile(spec, target, params=params, allow_nonfinite=allow_nonfinite)


def inference(native: Any):
    """A context manager for inference with ``native``: masked layers reuse kernel * mask while
    the weights do not change. torch and MLX layers do this on their own (they see
    changes: version counters, immutable arrays); Keras needs this scope on TensorFlow, whose
    variables change in place with no counter (on JAX and torch engines it caches outside it
    too). Inside, change weights only through dense_bridge (``set_params``, ``db.load``) or
    Keras' ``load_weights``. Other backends: a no-op scope. ``with db.inference(model): ...``
    """
    import contextlib

    verb = getattr(adapter_for(native, "native"), "inference", None)
    return contextlib.nullcontext(native) if verb is None else verb(native)


def available_backends(check: bool = False) -> list[str]:
    """Names of the usable backends, in canonical order.

    ``check=False``: those whose framework packages are installed, decided by package lookup
    without importing a framework not yet imported (for keras, Keras plus the package its
    ``KERAS_BACKEND`` names). ``check=True``: of those, the ones whose adapter imports and
    compiles a 1x1 Dense (a framework installed but broken here is left out).
    """
    check_flag("check", check)
    names = installed_backends()
    if not check:
        return names
    working = []
    for name in names:
        try:
            compile(Dense(1, in_features=1), name, seed=0)
        except Exception:  # noqa: BLE001 - any failure (import, build) means "not usable here"
            continue
        working.append(name)
    return working


def backend(native: Any) -> str:
    """The backend name of a native object ("torch", "keras", "mlx", "flax", "equinox", "onnx", "numpy",
    or a registered one)."""
    return backend_of(native)
