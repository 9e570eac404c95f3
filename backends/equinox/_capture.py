"""The ``capture`` verb on Equinox: per-call inputs, outputs and gradients of linear layers inside a model.

Equinox models take one sample: the model runs under ``jax.vmap`` over the leading (batch) axis
of every input, the Equinox convention. Each captured layer gets, for the capture only, a one-off
subclass of its own class whose ``__call__`` records the call (``isinstance`` holds; the original
class is ALWAYS put back, also on error). The per-sample function returns the model output AND
every recorded call's inputs and output, so ``vmap`` batches the records too. The probed forward
and backward pass (``backends/_jax/capture.py``, shared with Flax) differentiates the model's
inexact arrays (``eqx.partition(model, eqx.is_inexact_array)``: the bool masks are not
differentiated).

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
import numpy as np

from dense_bridge.registry._captures import Capture, select_output

from .._jax.capture import (first_array, inputs_of, is_float, new_state, probed_capture, reached_paths, recording_class, to_numpy_copy)
from ._layers import Bilinear, DenseLinear


def _float_dtype(model) -> str:
    for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array)):
        return np.dtype(leaf.dtype).name
    return "float32"


def _canonical(cls, g) -> dict[str, np.ndarray]:
    """Native gradients of a layer of (original) class ``cls`` in the canonical layout."""
    dense = cls is eqx.nn.Linear or issubclass(cls, DenseLinear)
    if not (dense or cls is Bilinear) or g is None or getattr(g, "weight", None) is None:
        return {}
    w = to_numpy_copy(g.weight)
    out = {"kernel": w if cls is Bilinear else w.T}
    if getattr(g, "bias", None) is not None:
        out["bias"] = to_numpy_copy(g.bias)
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
            select=None, grads: bool = True, native: bool = False) -> Capture:
    """One vmapped forward (and backward) of ``model`` recording every call of ``layers`` (path -> module).

    ``native``: the per-call records stay JAX arrays on the model's device (``array_namespace``;
    parameter gradients are canonical numpy either way); else numpy copies."""
    args, kwargs = inputs_of(inputs, _float_dtype(model), first_array(model))  # on the model's device
    state = new_state()
    swapped = []
    try:
        for path, layer in layers.items():
            cls = type(layer)
            object.__setattr__(layer, "__class__", recording_class(cls, path, state, DenseLinear))
            swapped.append((layer, cls))
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def one(params, probes, args, kwargs):
            state.update(new_state(), probes=probes)
            out = select_output(eqx.combine(params, static)(*args, **kwargs), select, is_float)
            return out, [(xs, y) for _, _, xs, y in state["log"]]

        def run(params, probes):
            return jax.vmap(one, in_axes=(None, 0 if probes is not None else None, 0, 0))(params, probes, args, kwargs)

        pre = {p for p, layer in layers.items()
               if isinstance(layer, DenseLinear) and not layer.activation.is_identity}
        result, g_params = probed_capture(run, params, state, pre, cotangent=cotangent, grads=grads, native=native)
        if g_params is None:
            return result
        # the gradient tree has the model's structure: each layer's gradients sit at its key path
        reached = reached_paths(result)
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


#: for ``run_layer`` (``_trace.py``): the same canonical reading of one layer's gradients
canonical = _canonical
