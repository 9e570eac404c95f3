"""Canonical parameters: initial values from a seed, and validation of user-given ones.

Canonical layout (numpy is the hub): Dense ``kernel`` (in_features, units), ``bias`` (units,),
``mask`` (in_features, units); Bilinear ``kernel`` (units, in1, in2), ``bias`` (units,).
In a Sequential every key is prefixed with the layer's position: "0.kernel", "2.bias".
Arrays carry the layer's dtype; bfloat16 is ``ml_dtypes.bfloat16``.
"""
from __future__ import annotations

import numbers
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

from .._dtypes import dtype_name, numpy_dtype
from .._errors import ConversionError, SpecError, check_type, received
from ..registry._backends import array_adapter
from ._memory_budget import check_fits_in_memory
from ._copy import core_to_spare, count_nonfinite, native_copy
from ..activations import Activation
from ..specs import Bilinear, Dense, Sequential, layer_param_shapes

__all__ = ["ParamSource", "initial_layer_params", "validate_params", "layer_dtype", "array_to_numpy",
           "fill_lazy_from_params", "expected_params", "check_seed"]


#: Arrays from this size are scanned for NaN/Inf on a background thread by ParamSource.for_layer
#: (below it the hand-over, two thread wake-ups, is a visible share of the scan).
_SCAN_AHEAD_BYTES = 4 << 20
#: Longest wait, in seconds, for the scan thread to start before the framework's copy goes ahead.
_HANDOVER_WAIT_S = 0.0002


def layer_dtype(layer) -> str:
    """The dtype name of a layer spec (float32 for layers without parameters)."""
    return getattr(layer, "dtype", "float32")


def _layer_rng(seed: int, index: int, part: int) -> np.random.Generator:
    # One independent stream per (layer position, parameter): a lazy layer can draw its
    # parameters late, and a Dense alone draws what it would draw at position 0 of a Sequential.
    return np.random.default_rng([seed, index, part])


def initial_layer_params(layer, seed: int, index: int = 0) -> dict[str, np.ndarray]:
    """Initial canonical parameters of one layer spec (in_features known), in its dtype.

    Drawn in float64 and rounded once to the dtype, so every backend gets the same bits.
    Masked kernel entries are exactly 0.
    """
    check_fits_in_memory(layer, "layer")  # lazy layers learn their size only here
    if isinstance(layer, Dense):
        shapes = layer.param_shapes()
        dt = numpy_dtype(layer.dtype)
        fan_in, fan_out = layer.in_features, layer.units
        kernel = layer.kernel_init.sample(shapes["kernel"], fan_in, fan_out, _layer_rng(seed, index, 0))
        out = {}
        if layer.mask is not None:
            kernel = kernel * layer.mask.adjacency
        out["kernel"] = kernel.astype(dt)
        if layer.use_bias:
            out["bias"] = layer.bias_init.sample((layer.units,), fan_in, fan_out,
                                                 _layer_rng(seed, index, 1)).astype(dt)
        if layer.mask is not None:
            out["mask"] = layer.mask.as_array(dt)
        return out
    if isinstance(layer, Bilinear):
        dt = numpy_dtype(layer.dtype)
        shapes = layer.param_shapes()
        fan_in, fan_out = layer.in1_features, layer.units
        out = {"kernel": layer.init.sample(shapes["kernel"], fan_in, fan_out,
                                           _layer_rng(seed, index, 0)).astype(dt)}
        if layer.use_bias:
            if layer.init.name in ("torch_default", "mlx_default"):
                bias = layer.init.sample((layer.units,), fan_in, fan_out, _layer_rng(seed, index, 1))
            else:
                bias = np.zeros(layer.units)
            out["bias"] = bias.astype(dt)
        return out
    return {}


def check_seed(seed: object) -> int:
    """A non-negative int seed, or a fresh random one for None."""
    if seed is None:
        return int(np.random.SeedSequence().entropy % (2**63))
    check_type("seed", seed, numbers.Integral, "a non-negative integer or None")
    if seed < 0:
        raise SpecError(f"seed must be a non-negative integer or None. {received('seed', seed)}")
    return int(seed)


class ParamSource:
    """Where a compiled layer's first parameters come from: a seed, given canonical params, or
    a stream (``stream(index, layer_spec) -> canonical params``, called once per layer as the
    adapter builds it: a checkpoint reads each layer from its file then, so one layer's pages
    are released before the next is read).

    Adapters call :meth:`for_layer` (or :meth:`native_layer`) once the layer's input width is
    known (at build time for lazy layers), with the layer's position in its Sequential (0 for
    a lone layer).

    ``keep_device`` (adapters with ``COMPILES_FROM_DEVICE_ARRAYS``): given params that are another
    framework's device arrays stay where they are (:func:`validate_params`); :meth:`for_layer`
    hands them out as they are.

    With ``defer_finite_check`` the NaN/Inf scan of given params is not a separate pass over
    everything up front: :meth:`native_layer` scans inside its copy, :meth:`for_layer` scans
    what it hands out, and :meth:`finish` raises for those and scans whatever no adapter asked
    for. The error is the one :func:`validate_params` raises, listing every offender. Only for
    targets that are new objects (compile, convert): a half-built one is simply dropped.

    :meth:`for_layer`'s scans of arrays of :data:`_SCAN_AHEAD_BYTES` and more run on one
    background thread beside the copy the adapter makes next with its framework (``mx.array``,
    ``jnp.asarray``: single-threaded copies, which leave a core idle). ``mx.array`` holds the GIL
    for its whole copy while numpy releases it inside a reduction, so a scan queued ahead of time
    waits for the copies to end; :meth:`for_layer` therefore returns only once the scan of the
    layer's first big array is inside numpy, and the two read the same source side by side
    (see :meth:`_scan_beside`).
    """

    _unchecked: frozenset | set = frozenset()  # given keys not yet known to be free of NaN/Inf
    _pending: Mapping = MappingProxyType({})  # key -> its NaN/Inf count, or a Future of it (for_layer)
    _stream = None  # stream(index, layer_spec) -> canonical params, when a file supplies them
    _scanner = None  # the ThreadPoolExecutor of for_layer's background scans, made on first use
    _last_scan: Future | None = None  # the scan last queued on it
    _scan_here = False  # True once the scan thread was slow to start: later scans run inline

    def __init__(self, spec, seed: object = None, params: Mapping | None = None, *,
                 defer_finite_check: bool = False, allow_nonfinite: bool = False,
                 stream: Callable[[int, Any], dict[str, np.ndarray]] | None = None, keep_device: bool = False) -> None:
        self.spec = spec
        self.seed = check_seed(0 if stream is not None else seed)
        self.params = None
        self._stream = stream
        if stream is not None and params is not None:
            raise TypeError("pass params or stream to ParamSource, not both")
        if params is not None:
            if _is_lazy(spec):
                # given params fix the width: adapters then build eagerly with these exact shapes
                spec = fill_lazy_from_params(spec, params)
                self.spec = spec
            self.params, deferred = _validate(spec, params, strict=True, argument="params",
                                              check_finite=not defer_finite_check,
                                              allow_nonfinite=allow_nonfinite, keep_device=keep_device)
            check_masks_match(spec, self.params)
            self._unchecked = set(deferred)
            self._pending = {}

    @property
    def draws(self) -> bool:
        """True when the parameters are drawn from :attr:`seed` (neither given nor streamed)."""
        return self.params is None and self._stream is None

    def _prefix(self, index: int) -> str:
        return f"{index}." if isinstance(self.spec, Sequential) else ""

    def _given(self, index: int, layer) -> dict[str, np.ndarray]:
        prefix = self._prefix(index)
        out = {}
        for key in layer_param_shapes(layer):
            value = self.params.get(prefix + key)
            if value is None:
                raise ConversionError(f"params has no {prefix + key!r} for layer {index}")
            out[key] = value
        return out

    def for_layer(self, index: int, layer) -> dict[str, np.ndarray]:
        """Canonical params for the layer at ``index``: drawn fresh from the seed, or, with given
        params, the caller's own validated arrays (adapters copy before keeping them), or what
        the stream returns for it (read and validated by the stream's owner, e.g. a checkpoint)."""
        if self._stream is not None:
            return self._stream(index, layer)
        if self.params is None:
            return initial_layer_params(layer, self.seed, index)
        out = self._given(index, layer)
        prefix = self._prefix(index)
        big = []
        for key in out:
            if prefix + key in self._unchecked and prefix + key not in self._pending:
                # finish() gives the verdict, with every offender named at once
                if np.asarray(out[key]).nbytes >= _SCAN_AHEAD_BYTES:
                    big.append(prefix + key)
                else:
                    self._pending[prefix + key] = count_nonfinite(out[key])
        if big:
            self._scan_beside(big)
        return out

    def _scan_beside(self, keys: list[str]) -> None:
        """Start the NaN/Inf scans of ``keys`` on the background thread (their counts become
        Futures in ``_pending``) and return once the first one is running inside numpy.

        The caller's next step is its framework's copy of the same arrays, which holds the GIL
        throughout (``mx.array``): a scan that has not entered numpy's GIL-free loop by then
        waits for the copy to end. Returning only when the thread has signalled, right before
        the scan, means the waiting thread gets the GIL back when numpy releases it: the scan
        then reads the source on the other core while the copy reads it on this one.
        """
        if self._scanner is None and not self._scan_here and not core_to_spare():
            # measured at load 4-6 on 2 cores: scans beside the copies took 1.5x the time of inline ones
            self._scan_here = True
        if self._scanner is None and not self._scan_here:
            self._scanner = ThreadPoolExecutor(1, thread_name_prefix="dense_bridge-scan")
            # a compile that fails half-way never reaches finish(): the thread goes with the source
            weakref.finalize(self, self._scanner.shutdown, wait=False, cancel_futures=True)
        elif self._scan_here or not self._last_scan.done():
            # no core to spare (a busy machine), or scans slower than the copies: queued, this scan
            # would wait for the GIL through the copy and after it; here it costs one pass at most
            for key in keys:
                self._pending[key] = count_nonfinite(self.params[key])
            return
        started = threading.Event()

        def first(value: np.ndarray) -> int:
            started.set()
            return count_nonfinite(value)
        for n, key in enumerate(keys):
            self._pending[key] = self._last_scan = self._scanner.submit(count_nonfinite if n else first,
                                                                        self.params[key])
        # Where the other cores are busy the hand-over takes a time slice or more, the thread's
        # start or this thread's return to the GIL (0.75 ms median per layer, measured at load
        # 4-6 on 2 cores, against 41 us with a core idle): then the copy goes first, and this
        # source scans its next layers on the calling thread.
        start = time.perf_counter()
        started.wait(_HANDOVER_WAIT_S)
        self._scan_here = time.perf_counter() - start > _HANDOVER_WAIT_S

    def native_layer(self, index: int, layer, perms: Mapping[str, tuple[int, ...]] | None = None
                     ) -> dict[str, np.ndarray]:
        """The layer's params in a framework's layout, as fresh memory the adapter may give away.

        Each array is a new, 64-byte aligned, C-contiguous copy of ``value.transpose(perm)``
        (``perms[key]``; keys not listed keep the canonical layout), bit for bit, written in
        one fast pass that also scans given params for NaN/Inf (see the class docstring).
        Adapters hand these to their framework without another copy (``torch.from_numpy``,
        DLPack), so the framework owns memory nobody else references.
        """
        perms = perms or {}
        prefix = self._prefix(index)
        due = {k for k in layer_param_shapes(layer)
               if prefix + k in self._unchecked and prefix + k not in self._pending}
        values = self._given(index, layer) if due else self.for_layer(index, layer)
        out, bad = {}, False
        for key, value in values.items():
            out[key], count = native_copy(value, perms.get(key), check_finite=key in due)
            bad = bad or count > 0
        if bad:
            self._raise_nonfinite()
        if due:
            self._unchecked.difference_update(prefix + k for k in due)
        return out

    def finish(self) -> None:
        """Collect the scans under way and scan the given params no adapter asked for; raise
        if any holds NaN or Inf."""
        try:
            self._collect()
        finally:
            if self._scanner is not None:
                self._scanner.shutdown(wait=False, cancel_futures=True)

    def _collect(self) -> None:
        if not self._unchecked:
            return
        for key, count in self._pending.items():
            if isinstance(count, Future):
                count = count.result()
            if count == 0:
                self._unchecked.discard(key)
        self._pending = {}
        if any(count_nonfinite(self.params[k]) for k in self._unchecked):
            self._raise_nonfinite()
        self._unchecked = set()

    def _raise_nonfinite(self) -> None:
        # the same words, in the same key order, as validate_params' up-front scan
        problems = [f"{key}: {bad} NaN or Inf value(s)" for key in expected_params(self.spec)
                    if key in self._unchecked and (bad := count_nonfinite(self.params[key]))]
        raise ConversionError(f"params do not fit {_describe(self.spec)}: " + "; ".join(problems))


def check_masks_match(spec, params: Mapping[str, np.ndarray], prefix: str | None = None) -> None:
    """A mask given in params must be the spec's own wiring: the spec is what to_spec, save and
    compare report, so a different mask would make the object lie about what it computes.

    ``spec`` may be one layer of a Sequential, with ``prefix`` its key prefix ("2."): then
    ``params`` are that layer's own (unprefixed) keys. ConversionError naming each layer and how
    many entries differ.
    """
    if prefix is not None:
        layers, names = [spec], [prefix.rstrip(".") or "0"]
        key_of = (lambda i: "mask")
    else:
        layers = list(spec.layers) if isinstance(spec, Sequential) else [spec]
        names = [str(i) for i in range(len(layers))]
        key_of = (lambda i: f"{i}.mask") if isinstance(spec, Sequential) else (lambda i: "mask")
    wrong = []
    for i, layer in enumerate(layers):
        key = key_of(i)
        if isinstance(layer, Dense) and layer.mask is not None and key in params:
            differing = int(np.count_nonzero((np.asarray(params[key]) != 0) != layer.mask.adjacency))
            if differing:
                label = f"layer {names[i]}" + (f" ({layer.name!r})" if layer.name else "")
                wrong.append(f"{label}: {differing} of {layer.mask.adjacency.size} mask entries differ")
    if wrong:
        raise ConversionError("the mask in params differs from the spec's mask (" + "; ".join(wrong) + "): pass a "
                              "spec with that wiring (db.Dense(mask=...)) or leave the mask out of params")


def _is_lazy(spec) -> bool:
    return getattr(spec, "lazy", False)


def fill_lazy_from_params(spec, params: Mapping):
    """A lazy spec with in_features taken from the given kernel (params fix the width)."""
    key = "kernel"
    if isinstance(spec, Sequential):
        first = next((i for i, l in enumerate(spec.layers) if isinstance(l, Dense)), None)
        key = f"{first}.kernel"
    kernel = params.get(key) if isinstance(params, Mapping) else None
    if kernel is None or np.ndim(kernel) != 2:
        return spec
    return spec.with_in_features(int(np.shape(kernel)[0]))


def expected_params(spec) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) of every canonical parameter of ``spec``."""
    if isinstance(spec, Sequential):
        out = {}
        for i, layer in enumerate(spec.layers):
            for key, shape in layer_param_shapes(layer).items():
                out[f"{i}.{key}"] = (shape, layer_dtype(layer))
        return out
    if isinstance(spec, Activation):
        return {}
    return {k: (s, spec.dtype) for k, s in spec.param_shapes().items()}


def validate_params(spec, params: object, *, strict: bool = True, argument: str = "params",
                    allow_nonfinite: bool = False, keep_device: bool = False) -> dict[str, np.ndarray]:
    """Check ``params`` against ``spec``; return them as numpy arrays in the spec's dtypes.

    ``keep_device=True`` (the destination takes arrays of any framework speaking DLPack: the
    ``devices`` capability): a framework's array that can be checked where it lives (its adapter's
    ``nonfinite_flags``), of the spec's dtype or one that widens into it exactly (float16 or
    bfloat16 into float32), is returned as it is, its NaN/Inf check one reduction on its device
    and one host synchronisation per device; nothing of it is copied to the host unless it holds
    NaN/Inf (then to count them for the error).

    Every offender is collected first: missing keys (strict only), unexpected keys (strict only),
    wrong shapes, non-numeric values, NaN/Inf, masks that are not 0/1. One ConversionError then
    lists them all, so the caller can reject the whole load before touching anything.
    ``allow_nonfinite=True`` lets NaN/Inf through (the one rule of load, set_params, compile and
    convert). Integer arrays are accepted for float parameters only where every value is exact
    in the target dtype.
    """
    return _validate(spec, params, strict=strict, argument=argument, check_finite=True,
                     allow_nonfinite=allow_nonfinite, keep_device=keep_device)[0]


def validate_params_scan_later(spec, params: object, *, argument: str = "params") -> dict[str, np.ndarray]:
    """:func:`validate_params` leaving the NaN/Inf scan of values kept as they are (no cast) to a
    caller that scans them anyway while copying them (``_file_fill.fill(check_finite=True)``),
    so each byte is read once. Casts and masks are still checked here; an error still names
    every offender, NaN/Inf included."""
    return _validate(spec, params, strict=True, argument=argument, check_finite=False)[0]


def _deferrable(key: str, value: np.ndarray, target: np.dtype) -> bool:
    """May this value's NaN/Inf scan wait for the copy? Not for masks (a NaN must read as NaN,
    not as "not 0/1") nor for values cast to the spec's dtype (the cast may overflow to Inf)."""
    return not key.endswith("mask") and value.dtype == target


def _validate(spec, params: object, *, strict: bool, argument: str, check_finite: bool,
              allow_nonfinite: bool = False, keep_device: bool = False) -> tuple[dict[str, np.ndarray], list[str]]:
    """validate_params, plus the keys whose NaN/Inf scan was left for later (only when
    ``check_finite`` is False and nothing else is wrong: an error lists every offender)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{argument} must be a dict of name -> array. {received(argument, params)}")
    try:
        expected = expected_params(spec)
    except SpecError as exc:
        raise ConversionError(f"cannot load parameters: {exc}") from None
    problems: list[str] = []
    missing = [k for k in expected if k not in params]
    unexpected = [k for k in params if k not in expected]
    if strict and missing:
        problems.append(f"missing keys: {missing}")
    if unexpected:  # never silently ignored, strict or not
        problems.append(f"unexpected keys: {unexpected}")
    out: dict[str, np.ndarray] = {}
    deferred: list[str] = []
    on_device: dict = {}  # adapter -> keys of the arrays kept where they live
    for key, (shape, dtype) in expected.items():
        if key not in params:
            continue
        adapter = _device_array(params[key], dtype) if keep_device and not key.endswith("mask") else None
        if adapter is not None:
            if tuple(params[key].shape) != tuple(shape):
                problems.append(f"expected shape {tuple(shape)} for parameter {key}, received {tuple(params[key].shape)}")
                continue
            out[key] = params[key]
            if not allow_nonfinite:  # one reduction on its device: never left for a later copy to scan
                on_device.setdefault(adapter, []).append(key)
            continue
        value = array_to_numpy(params[key])
        if value is None or not (np.issubdtype(value.dtype, np.number) or value.dtype == bool
                                 or dtype_name(value.dtype) == "bfloat16") \
                or np.issubdtype(value.dtype, np.complexfloating):
            what = f"dtype {value.dtype}" if value is not None else type(params[key]).__name__
            problems.append(f"{key}: expected a real numeric array, received {what}")
            continue
        if tuple(value.shape) != tuple(shape):
            problems.append(f"expected shape {tuple(shape)} for parameter {key}, received {tuple(value.shape)}")
            continue
        if any(stride < 0 for stride in value.strides):
            # reversed views (x[::-1]) are legal numpy but DLPack importers (MLX) refuse them
            value = np.ascontiguousarray(value)
        target = numpy_dtype(dtype)
        if (allow_nonfinite or not check_finite) and _deferrable(key, value, target):
            if allow_nonfinite:
                out[key] = value
                continue
            deferred.append(key)
            out[key] = value
            continue
        # cast first: a finite float64 such as 1e6 becomes Inf in float16, and that is the
        # value the layer would hold
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, by key
            cast = value if value.dtype == target else value.astype(target)
        if (np.issubdtype(value.dtype, np.integer) or value.dtype == bool) and value.dtype != target \
                and not key.endswith("mask"):
            with np.errstate(over="ignore", invalid="ignore"):  # an Inf round trip is inexact too
                inexact = int(np.count_nonzero(cast.astype(value.dtype) != value))
            if inexact:
                problems.append(f"{key}: {inexact} integer value(s) of dtype {value.dtype} are not exact in {dtype}")
                continue
        bad = 0 if allow_nonfinite and not key.endswith("mask") else count_nonfinite(cast)
        if bad:
            overflow = "" if value.dtype == target or count_nonfinite(value) else \
                f" after casting to {dtype} (values outside its range)"
            problems.append(f"{key}: {bad} NaN or Inf value(s){overflow}")
            continue
        if key.endswith("mask") and not ((cast == 0) | (cast == 1)).all():
            problems.append(f"{key}: a mask must hold only 0 and 1")
            continue
        out[key] = cast
    for adapter, keys in on_device.items():
        try:
            flags = adapter.nonfinite_flags([params[k] for k in keys])
        except Exception:  # noqa: BLE001 - an array its own framework cannot reduce (no data: meta): which one
            flags = [_nonfinite_alone(adapter, key, params[key], problems) for key in keys]
        for key, bad in zip(keys, flags):
            if bad:  # counted on the host: an error's detail, never the common path
                problems.append(f"{key}: {count_nonfinite(array_to_numpy(params[key]))} NaN or Inf value(s)")
    if problems and deferred:  # the one error must name every offender: scan now after all
        return _validate(spec, params, strict=strict, argument=argument, check_finite=True,
                         allow_nonfinite=allow_nonfinite)
    if problems:
        raise ConversionError(f"{argument} do not fit {_describe(spec)}: " + "; ".join(problems))
    return out, deferred


def _nonfinite_alone(adapter, key: str, value, problems: list[str]) -> bool:
    """``value``'s NaN/Inf flag by itself; a problem naming ``key`` where its framework cannot
    reduce it (then False: the problem already refuses the load)."""
    try:
        return bool(adapter.nonfinite_flags([value])[0])
    except Exception as exc:  # noqa: BLE001 - reported by key, with the framework's reason
        problems.append(f"{key}: cannot be read where it lives ({type(exc).__name__}: {exc})")
        return False


_WIDENS_EXACTLY = {"float32": ("float16", "bfloat16"), "float64": ("float16", "bfloat16", "float32")}


def _device_array(value, dtype: str):
    """The adapter of ``value``'s framework when ``value`` is an array it keeps on its device and
    can check for NaN/Inf there, of dtype ``dtype`` or one that widens into it exactly; else None
    (the value is then read on the host)."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
        return None
    adapter = array_adapter(value)
    if adapter is None or not callable(getattr(adapter, "nonfinite_flags", None)):
        return None
    name = str(getattr(value, "dtype", "")).rsplit(".", 1)[-1]
    return adapter if name == dtype or name in _WIDENS_EXACTLY.get(dtype, ()) else None


def array_to_numpy(value) -> np.ndarray | None:
    """A numpy array (a view where possible) of an array-like from any framework, or None.

    A torch tensor, an mx.array, a TF tensor or Keras variable goes through its adapter's
    ``to_numpy`` verb (bfloat16 as ``ml_dtypes.bfloat16``, device memory copied to the host);
    anything else through ``np.asarray``. None for what is not numeric (object arrays, errors).
    """
    if isinstance(value, np.ndarray):
        return value
    adapter = array_adapter(value)
    try:
        arr = adapter.to_numpy(value) if adapter is not None else np.asarray(value)
    except Exception:  # noqa: BLE001 - reported as a non-numeric value by the caller
        return None
    return arr if arr.dtype != object else None


def _describe(spec) -> str:
    return f"{type(spec).__name__}" + (f" {spec.name!r}" if getattr(spec, "name", None) else "")


def nonfinite_counts(params: Mapping) -> dict[str, int]:
    """name -> number of NaN/Inf values, for every parameter that holds any."""
    counts = {}
    for key, value in params.items():
        arr = array_to_numpy(value)
        if arr is not None and (n := count_nonfinite(arr)):
            counts[key] = n
    return counts
