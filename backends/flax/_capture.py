"""The ``capture`` verb on Flax NNX: per-call inputs, outputs and gradients of linear layers inside a model.

Each captured layer is given, for the capture only, a one-off subclass of its own class whose
``__call__`` records the call (``isinstance`` still holds); the original class is ALWAYS put
back, also on error. The model is split with ``nnx.split(model, nnx.Param, ...)`` and merged
inside a pure function (the graph keeps the recording classes) that returns the selected output
and every recorded call's inputs and output. ``jax.eval_shape`` of it gives the calls and their
shapes; then ONE jitted ``jax.value_and_grad`` of L = sum(out * cotangent) with respect to the
Params and one zero "probe" per call, which the wrapper adds to the call's output (the gradient
of a probe is dL/d(that call's output)), gives the values and every gradient (eager JAX would
compile each primitive separately: seconds for a small transformer).

JAX differentiates to zeros what the loss does not depend on: a layer whose every call gets an
all-zero dL/d(output) is reported as not reached (no ``output_grad``, no parameter gradients),
as torch reports a layer its backward pass never reaches.

A DenseLinear with an activation records its output BEFORE the activation (its linear map alone,
``Capture.pre_activation``), as Keras ``Dense(activation=...)`` does. Parameter gradients are
canonical already (Flax's layouts are). Modules that draw randomness (``nnx.Dropout``) should be
put in eval mode by the caller first: capture runs the model as it is.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dense_bridge._errors import ConversionError
from dense_bridge.testing._captures import Call, Capture, select_output

from ._arrays import to_jax
from ._layers import DenseLinear

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _is_float(x) -> bool:
    return isinstance(x, jax.Array) and np.dtype(x.dtype).name in _FLOATS


def _np(x) -> np.ndarray:
    return np.array(np.asarray(x), copy=True)


def _float_dtype(model) -> str:
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = np.dtype(v.get_value().dtype).name
        if name in _FLOATS:
            return name
    return "float32"


def _array(value, dtype: str):
    arr = np.asarray(value)
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        return to_jax(arr, dtype)
    return jnp.asarray(arr)  # token ids stay integers, masks keep their type


def _recording_class(cls, path: str, state: dict):
    pre_activation = issubclass(cls, DenseLinear)

    def __call__(self, *args, **kwargs):
        if pre_activation:  # the linear map alone; the activation after the probe
            y = DenseLinear._linear(self, *args)
        else:
            y = cls.__call__(self, *args, **kwargs)
        log, probes = state["log"], state.get("probes")
        if probes is not None:  # the grad pass: y + 0, whose gradient is dL/dy
            y = y + probes[len(log)]
        counts = state["counts"]
        n = counts.get(path, 0)
        counts[path] = n + 1
        log.append((path, n, tuple(a for a in args if isinstance(a, (jax.Array, np.ndarray))), y))
        if pre_activation:
            return DenseLinear._activate(self, y)
        return y

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__})


def _grads_by_path(grads) -> dict[str, Any]:
    return {".".join(str(k) for k in path): v.get_value() if hasattr(v, "get_value") else v
            for path, v in nnx.to_flat_state(grads)}


def capture(model, inputs, layers: dict[str, Any], *, cotangent: Callable[[tuple], np.ndarray],
            select=None, grads: bool = True) -> Capture:
    """One forward (and backward) of ``model`` recording every call of ``layers`` (path -> module).

    ``inputs``: a list of numpy arrays (positional) or a dict (keyword); floating arrays are cast
    to the model's parameter dtype, integer and bool arrays keep their type.
    """
    dtype = _float_dtype(model)
    if isinstance(inputs, dict):
        args, kwargs = [], {k: _array(v, dtype) for k, v in inputs.items()}
    else:
        args, kwargs = [_array(v, dtype) for v in inputs], {}
    state: dict = {"log": [], "counts": {}, "probes": None}
    swapped = []
    try:
        for path, layer in layers.items():
            cls = type(layer)
            layer.__class__ = _recording_class(cls, path, state)
            swapped.append((layer, cls))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def run(params, probes):
            state.update(log=[], counts={}, probes=probes)
            out = select_output(nnx.merge(graphdef, params, rest)(*args, **kwargs), select, _is_float)
            return out, [(xs, y) for _, _, xs, y in state["log"]]

        out_shape, log_shapes = jax.eval_shape(run, params, None)  # traces once: the calls and their shapes
        order = [(p, n) for p, n, _, _ in state["log"]]
        pre = {p for p, layer in layers.items()
               if isinstance(layer, DenseLinear) and not layer.activation.is_identity}
        if not grads:
            out, logs = jax.jit(run)(params, None)
            calls = [Call(p, n, tuple(_np(x) for x in xs), _np(y)) for (p, n), (xs, y) in zip(order, logs)]
            return Capture(calls, {}, _np(out), pre_activation=pre)
        cot = to_jax(np.asarray(cotangent(tuple(out_shape.shape))), np.dtype(out_shape.dtype).name)

        def loss(params, probes):
            out, logs = run(params, probes)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), (out, logs)

        probes0 = [jnp.zeros(y.shape, y.dtype) for _, y in log_shapes]
        # one XLA computation for the forward pass and the backward pass (eager JAX compiles per op)
        (_, (out, logs)), (g_params, g_probes) = jax.jit(
            jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, probes0)
        if [(p, n) for p, n, _, _ in state["log"]] != order:
            raise ConversionError("the model made different captured calls when traced twice: its forward is "
                                  "not deterministic")
        calls = [Call(p, n, tuple(_np(x) for x in xs), _np(y)) for (p, n), (xs, y) in zip(order, logs)]
        result = Capture(calls, {}, _np(out), pre_activation=pre)
        # JAX gives zeros, not "no gradient", to what the loss does not depend on; a layer whose every
        # call got an all-zero dL/dy is reported as not reached, as torch's autograd reports it
        reached = set()
        for call, g in zip(calls, g_probes):
            call.output_grad = _np(g)
            if np.any(call.output_grad != 0):
                reached.add(call.path)
        for call in calls:
            if call.path not in reached:
                call.output_grad = None
        flat = _grads_by_path(g_params)
        for p in layers:
            if p not in reached:
                continue
            prefix = f"{p}." if p else ""
            found = {name: _np(flat[prefix + name]) for name in ("kernel", "bias") if prefix + name in flat}
            if found:
                result.param_grads[p] = found
        return result
    finally:
        while swapped:
            layer, cls = swapped.pop()
            layer.__class__ = cls
