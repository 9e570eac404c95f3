"""The ``capture`` verb on Keras: per-call inputs, outputs and gradients of linear layers inside a model.

Each captured layer's ``call`` is wrapped through an instance attribute (``Layer.__call__`` looks
``self.call`` up at every call, so nested, subclassed and functional models all go through it)
and ALWAYS restored afterwards, also on error. The wrapper records what the layer's own ``call``
received (after Keras' autocast to the compute dtype) and returned. Every Keras engine alike
(TensorFlow, JAX, torch: the engine's own autograd through ``_engine.vjp``):

1. a plain forward pass in inference mode (``training=False``: dropout is the identity) records
   each call's inputs and output, and the selected model output;
2. one vjp of the model, under ``keras.StatelessScope`` mapping the captured layers' trainable
   variables to the differentiated values, with a zero "probe" added to each call's output by the
   wrapper: the gradient of a probe is dL/d(that call's output) (JAX has no gradient with respect
   to an intermediate value; the probe gives one on every engine).
See ``dense_bridge.registry._captures``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import keras
import numpy as np

from dense_bridge._errors import ConversionError
from dense_bridge.registry._captures import HEAD_CALL, Call, Capture, select_output

from . import _engine
from ._models import is_reversible, untied_reversible


def _np(x) -> np.ndarray:
    """A numpy copy of an engine tensor (bfloat16 as ml_dtypes)."""
    return np.array(_engine.to_numpy(x), copy=True)


def _is_float(x) -> bool:
    return keras.ops.is_tensor(x) and "float" in str(keras.backend.standardize_dtype(x.dtype))


def _tensor(value: np.ndarray, dtype: str):
    arr = np.asarray(value)
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        return keras.ops.convert_to_tensor(arr.astype(np.float32) if arr.dtype == np.float64 else arr, dtype=dtype)
    return keras.ops.convert_to_tensor(arr)  # token ids stay integers, masks keep their type


def _takes_keywords(model, keys) -> bool:
    """A functional model's ``call(inputs)`` takes a dict positionally (keras-hub's BertBackbone);
    a subclassed model whose ``call`` names the keys takes them as keywords."""
    try:
        params = inspect.signature(model.call).parameters
    except (TypeError, ValueError):
        return False
    return all(k in params for k in keys)


class _Wrapped:
    """Records calls of one layer (plain pass) or adds a probe to its output (gradient pass).

    A layer with an activation inside (``Dense(activation=...)``, keras-hub's FFN) runs its
    linear map alone (its ``activation`` set to linear for the capture) and the wrapper applies
    the activation after recording: the recorded output is the linear map's, like torch's
    ``nn.Linear`` followed by its activation module.
    """

    def __init__(self, path: str, layer, log: list, state: dict):
        self.path, self.layer, self.log, self.state = path, layer, log, state
        # a quantized layer's __call__ runs quantized_call, not call (Keras 3 Layer.__call__)
        self.method = "quantized_call" if getattr(layer, "quantization_mode", None) else "call"
        self.original = getattr(layer, self.method)
        self.counts: dict[str, int] = {}
        act = getattr(layer, "activation", None)
        self.activation = act if act is not None and act is not keras.activations.linear else None
        if self.activation is not None:
            layer.activation = keras.activations.linear

    def __call__(self, *args, **kwargs):
        y = self.original(*args, **kwargs)
        path = self.recorded_as(kwargs)
        if path is None:
            return y
        probes = self.state.get("probes")
        if probes is not None:  # the gradient pass: y + 0, whose gradient is dL/dy
            k = self.state["k"]
            self.state["k"] = k + 1
            if k < len(probes):
                y = y + probes[k]
        else:
            xs = tuple(a for a in args if keras.ops.is_tensor(a) or hasattr(a, "shape"))
            n = self.counts.get(path, 0)
            self.counts[path] = n + 1
            self.log.append((path, n, xs, y))
        return y if self.activation is None else self.activation(y)

    def recorded_as(self, kwargs) -> str | None:
        """The path this call is recorded under, None when it is not one of the captured layer's.
        A ReversibleEmbedding is two layers: captured under its head's path (``.../reverse_embeddings``)
        it records its ``reverse=True`` calls only, under the table's path its lookups, and a tied
        one's ``reverse=True`` calls as the table called as the head (``<table path>#head``)."""
        if not is_reversible(self.layer):
            return self.path
        reverse = bool(kwargs.get("reverse", False))
        if self.path.rsplit("/", 1)[-1] == "reverse_embeddings":
            return self.path if reverse else None
        if not reverse:
            return self.path
        return None if untied_reversible(self.layer) else self.path + HEAD_CALL


def _canonical_grads(layer, grads: list[tuple[Any, Any]]) -> dict[str, np.ndarray]:
    """Native variable gradients -> canonical names and layout, read by ``get_params`` itself: each
    gradient is assigned into its variable for one ``get_params`` call and the value assigned back,
    so the layer's layout declaration (Dense, EinsumDense reshapes, ...) applies to it exactly."""
    from dense_bridge._api import get_params

    saved = []
    try:
        for var, g in grads:
            saved.append((var, keras.ops.convert_to_tensor(keras.ops.copy(var.value))))
            var.assign(keras.ops.cast(g, var.dtype))
        # the mask and a LoRA scale are not trained: no gradient to compare
        return {k: v for k, v in get_params(layer).items() if k not in ("mask", "lora_scale")}
    finally:
        for var, value in saved:
            var.assign(value)


def _grad_variables(layer) -> list:
    """The variables whose gradients are compared: the trainable ones, and the base kernel that
    ``enable_lora`` froze (the other frameworks' captures differentiate a frozen base too)."""
    out = list(layer.trainable_variables)
    kernel = getattr(layer, "_kernel", None) if getattr(layer, "lora_enabled", False) else None
    if kernel is not None and all(v is not kernel for v in out):
        out.append(kernel)
    return out


def capture(model, inputs, layers: dict[str, Any], *, cotangent: Callable[[tuple], np.ndarray],
            select=None, grads: bool = True) -> Capture:
    """One forward (and backward) of ``model`` recording every call of ``layers`` (path -> layer).

    ``inputs``: a list of numpy arrays (positional) or a dict (keyword; a functional model gets
    the dict as its one input); floating arrays are cast to the model's compute dtype.
    """
    dtype = getattr(model, "compute_dtype", None) or "float32"
    if isinstance(inputs, dict):
        tensors = {k: _tensor(v, dtype) for k, v in inputs.items()}
        args, kwargs = ([], tensors) if _takes_keywords(model, tensors) else ([tensors], {})
    else:
        args, kwargs = [_tensor(v, dtype) for v in inputs], {}
    log: list = []
    state: dict = {}
    wrappers = []
    try:
        for path, layer in layers.items():
            w = _Wrapped(path, layer, log, state)
            setattr(layer, w.method, w)
            wrappers.append(w)

        def forward():
            return select_output(model(*args, training=False, **kwargs), select, _is_float)

        pre = {w.path for w in wrappers if w.activation is not None}
        if not grads:
            out = forward()
            return Capture([Call(p, n, tuple(_np(x) for x in xs), _np(y)) for p, n, xs, y in log], {}, _np(out),
                           pre_activation=pre)
        trainables = {path: _grad_variables(layer) for path, layer in layers.items()}
        variables = [v for vs in trainables.values() for v in vs]
        out = forward()
        n = len(log)
        cot = _engine.to_tensor(cotangent(tuple(out.shape)), keras.backend.standardize_dtype(out.dtype))
        probes = [keras.ops.zeros_like(y) for _, _, _, y in log]

        def fn(*primals):
            values, state["probes"], state["k"] = primals[:len(variables)], primals[len(variables):], 0
            try:
                with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                    return select_output(model(*args, training=False, **kwargs), select, _is_float)
            finally:
                state["probes"] = None

        _, got = _engine.vjp(fn, [v.value for v in variables] + probes, cot)
        if state["k"] != n:
            raise ConversionError(f"the model made {state['k']} captured calls in the gradient pass but {n} in "
                                  f"the forward pass: its forward is not deterministic")
        g_vars, g_out = got[:len(variables)], got[len(variables):]
        _unwrap(wrappers)  # get_params must see the layers as they are
        calls = [Call(p, n, tuple(_np(x) for x in xs), _np(y), None if g is None else _np(g))
                 for (p, n, xs, y), g in zip(log, g_out)]
        result = Capture(calls, {}, _np(out), pre_activation=pre)
        by_var = {id(v): g for v, g in zip(variables, g_vars)}
        for path, vs in trainables.items():
            pairs = [(v, by_var.get(id(v))) for v in vs]
            if vs and all(g is not None for _, g in pairs):
                try:
                    result.param_grads[path] = _canonical_grads(layers[path], pairs)
                except ConversionError as exc:  # a layer get_params cannot read: say so, compare the rest
                    result.notes.append(f"{path}: parameter gradients not compared ({exc})")
        return result
    finally:
        _unwrap(wrappers)


def _unwrap(wrappers: list) -> None:
    while wrappers:
        w = wrappers.pop()
        if w.activation is not None:
            w.layer.activation = w.activation
        if isinstance(w.original, _Wrapped):  # one layer captured under two paths (a table and its head)
            w.layer.call = w.original
            continue
        try:
            delattr(w.layer, w.method)  # the class's own method shows again
        except AttributeError:
            setattr(w.layer, w.method, w.original)


def load_model(path: str, *, trust_pickle: bool = False):
    """A whole Keras model from a ``.keras`` file (for ``dense-bridge check --mapping``); keras-hub's
    classes are registered first when keras-hub is installed. ``trust_pickle`` is not needed here."""
    import importlib.util

    from dense_bridge._errors import CheckpointError

    if importlib.util.find_spec("keras_hub") is not None:
        import keras_hub  # noqa: F401 - registers its layers and models for deserialization
    try:
        return keras.saving.load_model(path, compile=False)
    except Exception as exc:  # noqa: BLE001 - any deserialization failure is a bad file
        raise CheckpointError(f"{path}: cannot load a Keras model ({type(exc).__name__}: {exc})") from None


#: for ``run_layer`` (``_trace.py``): the same canonical reading of one layer's gradients
canonical_grads = _canonical_grads
