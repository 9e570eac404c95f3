"""The ``capture`` verb on Flax NNX: per-call inputs, outputs and gradients of linear layers inside a model.

Each captured layer is given, for the capture only, a one-off subclass of its own class whose
``__call__`` records the call (``isinstance`` still holds); the original class is ALWAYS put
back, also on error. The model is split with ``nnx.split(model, nnx.Param, ...)`` and merged
inside a pure function (the graph keeps the recording classes) that returns the selected output
and every recorded call's inputs and output; the probed forward and backward pass over the
Params is the one both JAX adapters share (``backends/_jax/capture.py``).

A DenseLinear with an activation records its output BEFORE the activation (its linear map alone,
``Capture.pre_activation``), as Keras ``Dense(activation=...)`` does. Parameter gradients are
canonical already (Flax's layouts are). Modules that draw randomness (``nnx.Dropout``) should be
put in eval mode by the caller first: capture runs the model as it is.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from flax import nnx

from dense_bridge.registry._captures import Capture, select_output

from .._jax.capture import (FLOATS, first_array, inputs_of, is_float, new_state, probed_capture, reached_paths, recording_class, to_numpy_copy)
from ._layers import DenseLinear


def _float_dtype(model) -> str:
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = np.dtype(v.get_value().dtype).name
        if name in FLOATS:
            return name
    return "float32"


def _grads_by_path(grads) -> dict[str, Any]:
    return {".".join(str(k) for k in path): v.get_value() if hasattr(v, "get_value") else v
            for path, v in nnx.to_flat_state(grads)}


def capture(model, inputs, layers: dict[str, Any], *, cotangent: Callable[[tuple], np.ndarray],
            select=None, grads: bool = True, native: bool = False) -> Capture:
    """One forward (and backward) of ``model`` recording every call of ``layers`` (path -> module).

    ``inputs``: a list of numpy arrays (positional) or a dict (keyword); floating arrays are cast
    to the model's parameter dtype, integer and bool arrays keep their type. ``native``: the
    records (parameter gradients included) stay JAX arrays on the model's device
    (``array_namespace``); else numpy copies.
    """
    args, kwargs = inputs_of(inputs, _float_dtype(model), first_array(nnx.state(model)))  # on the model's device
    state = new_state()
    swapped = []
    try:
        for path, layer in layers.items():
            cls = type(layer)
            layer.__class__ = recording_class(cls, path, state, DenseLinear)
            swapped.append((layer, cls))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def run(params, probes):
            state.update(new_state(), probes=probes)
            out = select_output(nnx.merge(graphdef, params, rest)(*args, **kwargs), select, is_float)
            return out, [(xs, y) for _, _, xs, y in state["log"]]

        pre = {p for p, layer in layers.items()
               if isinstance(layer, DenseLinear) and not layer.activation.is_identity}
        result, g_params = probed_capture(run, params, state, pre, cotangent=cotangent, grads=grads, native=native)
        if g_params is None:
            return result
        flat = _grads_by_path(g_params)  # Flax's layouts are canonical: kernel (in, out)
        for p in reached_paths(result):
            prefix = f"{p}." if p else ""
            found = {name: flat[prefix + name] if native else to_numpy_copy(flat[prefix + name])
                     for name in ("kernel", "bias") if prefix + name in flat}
            if found:
                result.param_grads[p] = found
        return result
    finally:
        while swapped:
            layer, cls = swapped.pop()
            layer.__class__ = cls
