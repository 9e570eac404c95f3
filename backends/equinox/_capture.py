"""The ``capture`` verb on Equinox: per-call inputs, outputs and gradients of linear layers inside a model.

Equinox models take one sample: the model runs under ``jax.vmap`` over the leading (batch) axis
of every input, the Equinox convention. Each captured layer gets, for the capture only, a one-off
subclass of its own class whose ``__call__`` records the call (``isinstance`` holds; the original
class is ALWAYS put back, also on error). The per-sample function returns the model output AND
every recorded call's inputs and output, so ``vmap`` batches the records too; ``jax.eval_shape``
of it gives the calls and shapes, then ONE jitted ``jax.value_and_grad`` of L = sum(out *
cotangent) with respect to the model's inexact arrays (``eqx.partition(model,
eqx.is_inexact_array)``: the bool masks are not differentiated) and one zero "probe" per call,
added to the call's output, gives every value and gradient (dL/d(probe) = dL/d(output)).

A layer called inside the model's own ``jax.vmap`` (over a sequence, say) cannot hand its
records out of that transform: a ConversionError says so; call it on the whole sequence or vmap
outside. JAX differentiates to zeros what the loss does not depend on: a layer whose every call
gets an all-zero dL/d(output) is reported as not reached, as torch reports it. A DenseLinear with
an activation records its output before the activation (``Capture.pre_activation``).
"""
from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from dense_bridge._errors import ConversionError
from dense_bridge.testing._captures import Call, Capture, select_output

from ._arrays import to_jax
from ._layers import Bilinear, DenseLinear

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _is_float(x) -> bool:
    return isinstance(x, jax.Array) and np.dtype(x.dtype).name in _FLOATS


def _np(x) -> np.ndarray:
    return np.array(np.asarray(x), copy=True)


def _float_dtype(model) -> str:
    for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array)):
        return np.dtype(leaf.dtype).name
    return "float32"


def _array(value, dtype: str):
    arr = np.asarray(value)
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        return to_jax(arr, dtype)
    return jnp.asarray(arr)


def _recording_class(cls, path: str, state: dict):
    pre_activation = issubclass(cls, DenseLinear)  # record the linear map alone, as on Flax and Keras

    def __call__(self, *args, **kwargs):
        y = DenseLinear._linear(self, *args) if pre_activation else cls.__call__(self, *args, **kwargs)
        log, probes = state["log"], state.get("probes")
        if probes is not None:
            y = y + probes[len(log)]
        n = state["counts"].get(path, 0)
        state["counts"][path] = n + 1
        log.append((path, n, tuple(a for a in args if isinstance(a, (jax.Array, np.ndarray))), y))
        return DenseLinear._activate(self, y) if pre_activation else y

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__})


def _canonical(cls, g) -> dict[str, np.ndarray]:
    """Native gradients of a layer of (original) class ``cls`` in the canonical layout."""
    dense = cls is eqx.nn.Linear or issubclass(cls, DenseLinear)
    if not (dense or cls is Bilinear) or g is None or getattr(g, "weight", None) is None:
        return {}
    w = _np(g.weight)
    out = {"kernel": w if cls is Bilinear else w.T}
    if getattr(g, "bias", None) is not None:
        out["bias"] = _np(g.bias)
    return out


def _at(tree, keypath):
    """The subtree of ``tree`` at ``keypath`` (jax.tree_util keys), or None where it is absent."""
    for key in keypath:
        if tree is None:
            return None
        if isinstance(key, jax.tree_util.GetAttrKey):
            tree = getattr(tree, key.name, None)
        elif isinstance(key, jax.tree_util.SequenceKey):
            tree = tree[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            tree = tree.get(key.key)
        else:
            return None
    return tree


def capture(model, inputs, layers: dict[str, Any], *, cotangent: Callable[[tuple], np.ndarray],
            select=None, grads: bool = True) -> Capture:
    """One vmapped forward (and backward) of ``model`` recording every call of ``layers`` (path -> module)."""
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
            object.__setattr__(layer, "__class__", _recording_class(cls, path, state))
            swapped.append((layer, cls))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        paths = list(layers)

        def one(params, probes, args, kwargs):
            state.update(log=[], counts={}, probes=probes)
            out = select_output(eqx.combine(params, static)(*args, **kwargs), select, _is_float)
            return out, [(xs, y) for _, _, xs, y in state["log"]]

        def run(params, probes):
            return jax.vmap(one, in_axes=(None, 0 if probes is not None else None, 0, 0))(params, probes, args, kwargs)

        try:
            out_shape, log_shapes = jax.eval_shape(run, params, None)
        except jax.errors.UnexpectedTracerError as exc:
            raise ConversionError("a captured Equinox layer is called inside the model's own jax.vmap (or another "
                                  "transform), whose values cannot leave it; capture needs the layer called "
                                  f"directly in the per-sample forward ({str(exc).splitlines()[0]})") from None
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
        (_, (out, logs)), (g_params, g_probes) = jax.jit(
            jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, probes0)
        calls = [Call(p, n, tuple(_np(x) for x in xs), _np(y)) for (p, n), (xs, y) in zip(order, logs)]
        result = Capture(calls, {}, _np(out), pre_activation=pre)
        reached = set()
        for call, g in zip(calls, g_probes):
            call.output_grad = _np(g)
            if np.any(call.output_grad != 0):
                reached.add(call.path)
        for call in calls:
            if call.path not in reached:
                call.output_grad = None
        # the gradient tree has the model's structure: each layer's gradients sit at its key path
        targets = {id(l): p for p, l in layers.items()}
        originals = {id(layer): cls for layer, cls in swapped}
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: id(x) in targets)[0]:
            p = targets.get(id(leaf))
            if p is not None and p in reached and p not in result.param_grads:
                result.param_grads[p] = _canonical(originals[id(leaf)], _at(g_params, keypath))
        return result
    finally:
        while swapped:
            layer, cls = swapped.pop()
            object.__setattr__(layer, "__class__", cls)
