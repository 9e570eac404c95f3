"""The ``capture`` verb on MLX: per-call inputs, outputs and gradients of linear layers inside a model.

Python looks ``layer(x)`` up on the layer's class, so each captured layer is given, for the
duration of the capture, a one-off subclass of its own class whose ``__call__`` records the call
(``isinstance`` still holds); the original class is ALWAYS put back, also on error.

MLX differentiates functions of arrays, not intermediate values, so the capture runs the model
twice, both in eval mode with training flags restored afterwards:
1. a plain forward pass records each call's inputs and output, and the selected model output;
2. ``mx.grad`` of L = sum(out * cotangent) with respect to the captured layers' parameters
   (swapped in with ``Module.update`` and swapped back) and one zero "probe" per call that the
   wrapper adds to the call's output: the gradient of a probe is dL/d(that call's output).
See ``dense_bridge.registry._captures``.
"""
from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dense_bridge._errors import ConversionError
from dense_bridge.registry._captures import HEAD_CALL, Call, Capture, select_output

from ._arrays import dtype_name, to_mx as _to_mx, to_numpy as _to_numpy

_FLOATS = (mx.float16, mx.bfloat16, mx.float32, mx.float64)


def _np(x: mx.array) -> np.ndarray:
    mx.eval(x)
    return np.array(_to_numpy(x), copy=True)


def _is_float(x) -> bool:
    return isinstance(x, mx.array) and x.dtype in _FLOATS


def _float_dtype(model) -> str:
    """Floating inputs are cast to the dtype of the model's first floating parameter."""
    for _, v in tree_flatten(model.parameters()):
        if v.dtype in _FLOATS:
            return dtype_name(v.dtype, "parameter")
    return "float32"


def _array(value: np.ndarray, dtype: str) -> mx.array:
    arr = np.asarray(value)
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        return _to_mx(arr, dtype)
    return mx.array(arr)  # token ids stay integers, masks keep their type


def _recording_class(cls, path: str, state: dict):
    """A subclass of ``cls`` whose calls are recorded into ``state`` (and probed in the grad pass)."""
    def __call__(self, *args, **kwargs):
        y = cls.__call__(self, *args, **kwargs)
        log, probes = state["log"], state.get("probes")
        if probes is not None and isinstance(y, mx.array):  # the grad pass: y + 0, whose gradient is dL/dy
            y = y + probes[len(log)]
        counts = state["counts"]
        n = counts.get(path, 0)
        counts[path] = n + 1
        # a layer returning several arrays (a router: the experts it picked and their scores) is
        # recorded by its first floating-point one
        main = y if isinstance(y, mx.array) else next(
            (o for o in y if _is_float(o)), None) if isinstance(y, (tuple, list)) else None
        log.append((path, n, tuple(a for a in args if isinstance(a, mx.array)), main))
        return y

    methods = {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if callable(getattr(cls, "as_linear", None)):  # nn.Embedding called as the tied output head
        def as_linear(self, x):
            y = cls.as_linear(self, x)
            if state.get("probes") is not None:  # the grad pass, as for __call__
                y = y + state["probes"][len(state["log"])]
            counts = state["counts"]
            head = path + HEAD_CALL
            n = counts.get(head, 0)
            counts[head] = n + 1
            state["log"].append((head, n, (x,), y))
            return y
        methods["as_linear"] = as_linear
    return type(cls.__name__, (cls,), methods)


def _canonical_grads(layer, grads: dict) -> dict[str, np.ndarray]:
    """Native parameter gradients -> canonical names and layout, read by ``get_params`` itself: the
    gradients are swapped in with ``update`` for one ``get_params`` call and the values swapped back."""
    from dense_bridge._api import get_params

    saved = layer.trainable_parameters()
    try:
        layer.update(grads)
        # the mask and a LoRA scale are not trained: no gradient to compare
        return {k: v for k, v in get_params(layer).items() if k not in ("mask", "lora_scale")}
    finally:
        layer.update(saved)


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
    state: dict = {"log": [], "counts": {}}
    modes = [(m, m.training) for _, m in model.named_modules()]
    swapped = []
    try:
        model.eval()
        for path, layer in layers.items():
            cls = type(layer)
            layer.__class__ = _recording_class(cls, path, state)
            swapped.append((layer, cls))
        out = select_output(model(*args, **kwargs), select, _is_float)
        log = state["log"]
        calls = [Call(p, n, tuple(_np(x) for x in xs), _np(y) if y is not None else np.zeros((0,), np.float32))
                 for p, n, xs, y in log]
        result = Capture(calls, {}, _np(out))
        if not grads:
            return result
        cot = _to_mx(cotangent(tuple(out.shape)), dtype_name(out.dtype, "the model output"))
        paths = list(layers)
        originals = [layers[p].trainable_parameters() for p in paths]
        probes0 = [mx.zeros_like(y) if y is not None else mx.zeros((0,)) for _, _, _, y in log]

        def loss(params, probes):
            for p, value in zip(paths, params):
                layers[p].update(value)
            state.update(log=[], counts={}, probes=probes)
            y = select_output(model(*args, **kwargs), select, _is_float)
            return mx.sum(y.astype(mx.float32) * cot.astype(mx.float32))

        try:
            g_params, g_probes = mx.grad(loss, argnums=(0, 1))(originals, probes0)
        finally:
            state["probes"] = None
            for p, value in zip(paths, originals):
                layers[p].update(value)
        if len(state["log"]) != len(calls):
            raise ConversionError(f"the model made {len(state['log'])} captured calls in the gradient pass but "
                                  f"{len(calls)} in the forward pass: its forward is not deterministic")
        for call, g in zip(calls, g_probes):
            call.output_grad = _np(g)
        _restore(swapped, modes)  # get_params must see the layers' own classes
        for p, g in zip(paths, g_params):
            if tree_flatten(g):
                try:
                    result.param_grads[p] = _canonical_grads(layers[p], g)
                except ConversionError as exc:  # a layer get_params cannot read: say so, compare the rest
                    result.notes.append(f"{p}: parameter gradients not compared ({exc})")
        return result
    finally:
        _restore(swapped, modes)


def _restore(swapped: list, modes: list) -> None:
    while swapped:
        layer, cls = swapped.pop()
        layer.__class__ = cls
    for m, training in modes:
        m._training = training


#: for ``run_layer`` (``_trace.py``): the same canonical reading of one layer's gradients
canonical_grads = _canonical_grads
