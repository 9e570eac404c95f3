"""Autograd traces on Equinox: per-layer outputs and gradients of L = sum(y * grad_out) via ``jax.vjp``.

Equinox layers take one sample: the leading axes of the inputs are flattened into one batch axis
and every layer runs under ``jax.vmap`` (the Equinox convention), then reshaped back. Each layer
is split with ``eqx.partition(layer, eqx.is_inexact_array)``: only floating arrays are
differentiated, so the bool mask never is. The whole chain's forward and backward run as one
``jax.jit`` computation (eager JAX compiles every primitive on its first shape). Gradients come
back in the canonical layout (weight.T for Dense).
"""
from __future__ import annotations

from typing import Sequence

import equinox as eqx
import jax
import numpy as np

from dense_bridge.registry._trace import LayerTrace, Trace
from dense_bridge.backends._jax.trace import float_name, trace_layers

from .._jax.arrays import full_precision
from .._jax.capture import first_array
from ._arrays import to_jax
from ._layers import Bilinear, is_dense
from ._params import positions


def _param_dtype(m):
    w = getattr(m, "weight", None) if isinstance(m, eqx.Module) else None
    return w.dtype if isinstance(w, jax.Array) and eqx.is_inexact_array(w) else None


def _apply(static, dynamic, xs):
    """One layer, vmapped over the batch axis; ``static`` a :class:`_Static` (a bare function when
    ``dynamic`` is None)."""
    layer = static.tree if dynamic is None else eqx.combine(dynamic, static.tree)
    return jax.vmap(lambda *a: layer(*a))(*xs)


def _canonical_grads(m, grads) -> dict[str, np.ndarray]:
    out = {}
    if (is_dense(m) or type(m) is Bilinear) and grads is not None:
        w = np.array(grads.weight)
        out["kernel"] = w if type(m) is Bilinear else w.T
        if m.bias is not None:
            out["bias"] = np.array(grads.bias)
    return out


@full_precision
def trace(native, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Per-layer outputs and gradients of L = sum(y * grad_out) with JAX's autograd, vmapped per sample."""
    layers = [m for _, m in positions(native)]
    inputs = [np.asarray(x) for x in inputs]
    lead = inputs[0].shape[:-1]
    n = int(np.prod(lead)) if lead else 1
    flat = [x.reshape((n,) + x.shape[-1:]) for x in inputs]
    first = next((d for d in map(_param_dtype, layers) if d is not None), None)
    name = float_name(first if first is not None else inputs[0].dtype)
    like = first_array(native)  # inputs and cotangent on the model's device
    xs = tuple(to_jax(x, name, like=like) for x in flat)
    # a layer that is a bare function (an MLP's activation) has nothing to partition
    split = [eqx.partition(m, eqx.is_inexact_array) if isinstance(m, eqx.Module) else (None, m) for m in layers]
    g = np.asarray(grad_out)
    g = to_jax(g.reshape((n,) + g.shape[len(lead):]), float_name(g.dtype), like=like)
    records = trace_layers(_apply, tuple(_Static(s) for _, s in split), tuple(map(_param_dtype, layers)),
                           tuple(d for d, _ in split), xs, g)
    out = []
    for m, (y, dxs, gparams) in zip(layers, records):
        shape = lambda a: np.array(a).reshape(lead + a.shape[1:])  # noqa: E731
        out.append(LayerTrace(shape(y), tuple(shape(d) for d in dxs), _canonical_grads(m, gparams)))
    return Trace(out)


class _Static:
    """A hashable wrapper of a partition's static half (jit keys static arguments by ``==``/hash)."""

    def __init__(self, tree) -> None:
        self.tree = tree
        self._leaves, self._def = jax.tree_util.tree_flatten(tree)

    def __hash__(self) -> int:
        return hash((self._def, tuple(map(id, self._leaves))))

    def __eq__(self, other) -> bool:
        return isinstance(other, _Static) and self._def == other._def and \
            len(self._leaves) == len(other._leaves) and all(a is b for a, b in zip(self._leaves, other._leaves))



@full_precision
def run_layer(layer, x: np.ndarray, grad_out: np.ndarray | None):
    """One call of ``layer`` alone on ``x`` (leading axes flattened and ``jax.vmap``-ed, the
    Equinox convention) and ``jax.vjp``'s backward from ``grad_out`` (dL/d(output)): ``(output,
    dL/dx, canonical parameter gradients)`` as numpy; ``grad_out`` None: forward only.

    The output is what ``capture`` records: a DenseLinear with an activation runs its linear map
    alone (``grad_out`` is then dL/d(linear map)).
    """
    from ._capture import canonical as _canonical
    from ._layers import DenseLinear

    arr = np.asarray(x)
    lead = arr.shape[:-1]
    n = int(np.prod(lead)) if lead else 1
    like = first_array(layer)  # on the layer's device
    xj = to_jax(arr.reshape((n,) + arr.shape[-1:]), float_name(arr.dtype), like=like)
    dynamic, static = eqx.partition(layer, eqx.is_inexact_array)
    linear_only = isinstance(layer, DenseLinear) and not layer.activation.is_identity

    def fn(dynamic, xj):
        m = eqx.combine(dynamic, static)
        return jax.vmap(m._linear if linear_only else m)(xj)

    def back(a):
        return np.array(a).reshape(lead + a.shape[1:])

    if grad_out is None:  # op by op like jax.vjp's primal below (a jit fuses differently: 1 ULP apart)
        return back(fn(dynamic, xj)), None, {}
    y, vjp = jax.vjp(fn, dynamic, xj)
    g = np.asarray(grad_out)
    gdyn, dx = vjp(to_jax(g.reshape((n,) + g.shape[len(lead):]), float_name(g.dtype), like=like).astype(y.dtype))
    return back(y), back(dx), _canonical(type(layer), gdyn)
