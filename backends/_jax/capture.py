"""The probed forward and backward pass both JAX adapters' ``capture`` verbs run (Flax NNX, Equinox).

An adapter swaps each captured layer's class for :func:`recording_class` (a one-off subclass
whose ``__call__`` logs the call into a shared ``state`` dict), and hands :func:`probed_capture`
a pure ``run(params, probes) -> (selected output, [(inputs, output) per logged call])`` built from
its own split/merge (``nnx.split``/``nnx.merge``, ``eqx.partition``/``eqx.combine`` under vmap).
:func:`probed_capture` then

1. traces ``run`` once with ``jax.eval_shape``: which calls happen, in what order, their shapes;
2. runs ONE jitted ``jax.value_and_grad`` of L = sum(out * cotangent) with respect to the params
   and one zero "probe" per call, which the recording ``__call__`` adds to the call's output, so
   the gradient of a probe is dL/d(that call's output) (eager JAX would compile each primitive on
   its own: seconds for a small transformer).

JAX differentiates to zeros what the loss does not depend on: a layer whose every call got an
all-zero dL/d(output) is reported as not reached (no ``output_grad``), as torch's autograd
reports a layer its backward pass never reaches. The adapter maps the parameter gradient tree
to canonical names for the reached layers itself (its layouts and trees differ).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dense_bridge._errors import ConversionError
from dense_bridge.registry._captures import Call, Capture

from .arrays import full_precision, to_jax

FLOATS = ("float16", "bfloat16", "float32", "float64")


def is_float(x) -> bool:
    """Is ``x`` a floating JAX array (an output a cotangent can be given to)?"""
    return isinstance(x, jax.Array) and np.dtype(x.dtype).name in FLOATS


def to_numpy_copy(x) -> np.ndarray:
    """A numpy copy owning its memory (bfloat16 as ml_dtypes)."""
    return np.array(np.asarray(x), copy=True)


def input_array(value, dtype: str, like=None):
    """A model input: floating arrays cast to ``dtype`` (the model's parameter dtype); token ids
    and masks keep their integer or bool type; on the device of ``like`` (one of the model's
    arrays) when given."""
    arr = np.asarray(value)
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        return to_jax(arr, dtype, like=like)
    devices = like.devices() if isinstance(like, jax.Array) else ()
    return jax.device_put(arr, next(iter(devices))) if len(devices) == 1 else jnp.asarray(arr)


def first_array(model):
    """The model's first JAX array (where its inputs go), else None."""
    return next((leaf for leaf in jax.tree_util.tree_leaves(model) if isinstance(leaf, jax.Array)), None)


def inputs_of(inputs, dtype: str, like=None) -> tuple[list, dict]:
    """(args, kwargs) for the model from capture's ``inputs``: a list (positional) or a dict
    (keyword), placed on the device of ``like`` (one of the model's arrays) when given."""
    if isinstance(inputs, dict):
        return [], {k: input_array(v, dtype, like) for k, v in inputs.items()}
    return [input_array(v, dtype, like) for v in inputs], {}


def new_state() -> dict:
    """The log the recording classes write: calls in order, calls per path, this pass's probes."""
    return {"log": [], "counts": {}, "probes": None}


def recording_class(cls, path: str, state: dict, dense_cls):
    """A subclass of ``cls`` (same name, so ``isinstance`` and messages hold) whose ``__call__``
    logs ``(path, n-th call, array inputs, output)`` into ``state["log"]`` and, in the gradient
    pass, adds this call's probe to the output. A ``dense_cls`` (dense_bridge's DenseLinear of the
    adapter) records its linear map alone and applies its activation after the probe, as Keras'
    ``Dense(activation=...)`` is recorded (``Capture.pre_activation``)."""
    pre_activation = issubclass(cls, dense_cls)

    def __call__(self, *args, **kwargs):
        y = dense_cls._linear(self, *args) if pre_activation else cls.__call__(self, *args, **kwargs)
        log, probes = state["log"], state.get("probes")
        if probes is not None:  # the gradient pass: y + 0, whose gradient is dL/dy
            y = y + probes[len(log)]
        n = state["counts"].get(path, 0)
        state["counts"][path] = n + 1
        log.append((path, n, tuple(a for a in args if isinstance(a, (jax.Array, np.ndarray))), y))
        return dense_cls._activate(self, y) if pre_activation else y

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__})


@full_precision
def probed_capture(run: Callable, params: Any, state: dict, pre_activation: set[str], *,
                   cotangent: Callable[[tuple], np.ndarray], grads: bool, native: bool = False) -> tuple[Capture, Any]:
    """The Capture of ``run`` (see module doc) and the gradient tree of ``params`` (None without
    ``grads``). ``run(params, probes)`` must reset ``state`` (:func:`new_state`'s keys) and set
    its probes before calling the model. ``native``: the recorded arrays stay JAX arrays on the
    model's device (immutable: nothing copied); else numpy copies."""
    keep = (lambda x: x) if native else to_numpy_copy
    try:
        out_shape, log_shapes = jax.eval_shape(run, params, None)  # traces once: the calls and their shapes
    except jax.errors.UnexpectedTracerError as exc:
        raise ConversionError("a captured layer is called inside the model's own jax.vmap, scan or other "
                              "transform, whose values cannot leave it; capture needs the layer called "
                              f"directly in the model's forward ({str(exc).splitlines()[0]})") from None
    order = [(p, n) for p, n, _, _ in state["log"]]

    def calls_of(logs) -> list[Call]:
        return [Call(p, n, tuple(keep(x) for x in xs), keep(y)) for (p, n), (xs, y) in zip(order, logs)]

    if not grads:
        out, logs = jax.jit(run)(params, None)
        return Capture(calls_of(logs), {}, keep(out), pre_activation=pre_activation), None
    like = first_array(params)  # the cotangent and the probes on the model's device
    cot = to_jax(np.asarray(cotangent(tuple(out_shape.shape))), np.dtype(out_shape.dtype).name, like=like)

    def loss(params, probes):
        out, logs = run(params, probes)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), (out, logs)

    # zeros computed where ``like`` lives: nothing crosses between devices
    shapes = [(y.shape, y.dtype) for _, y in log_shapes]
    devices = like.devices() if like is not None else ()
    where = {"out_shardings": jax.sharding.SingleDeviceSharding(next(iter(devices)))} if len(devices) == 1 else {}
    probes0 = jax.jit(lambda: [jnp.zeros(s, d) for s, d in shapes], **where)()
    # one XLA computation for the forward pass and the backward pass
    (_, (out, logs)), (g_params, g_probes) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, probes0)
    if [(p, n) for p, n, _, _ in state["log"]] != order:
        raise ConversionError("the model made different captured calls when traced twice: its forward is "
                              "not deterministic")
    calls = calls_of(logs)
    reached = set()
    # which probes got a nonzero gradient: one reduction each on the device, one transfer for all
    nonzero = np.asarray(jnp.stack([jnp.any(g != 0) for g in g_probes])) if native and g_probes else ()
    for i, (call, g) in enumerate(zip(calls, g_probes)):
        call.output_grad = keep(g)
        if nonzero[i] if native else np.any(call.output_grad != 0):
            reached.add(call.path)
    for call in calls:
        if call.path not in reached:
            call.output_grad = None
    return Capture(calls, {}, keep(out), pre_activation=pre_activation), g_params


def reached_paths(capture: Capture) -> set[str]:
    """Paths of the captured layers the backward pass reached (some call has an output gradient)."""
    return {c.path for c in capture.calls if c.output_grad is not None}
