"""compare_models on layers holding a low-rank adapter (LoRA, rsLoRA, DoRA): what the adapter's own path rounds.

A layer with an adapter (dense_bridge/lora) computes y = x @ W + b + s * ((x @ A) @ B), and for
DoRA that sum scaled per unit by m / ||W + s A B|| (the norm over in_features). Its own
contribution is judged against the effective kernel (``effective_kernel``: W + s A B, or DoRA's
scaled form), so a difference already in x passes through the adapter's update as it passes
through W. What each side's rounding may add on top of the base product's (docs/FACTS.md, the
same derivation as testing/_tolerance.py and _propagate.py, every term with its own C):

- h = x @ A, a sum over in_features: local(h, K = in_features) + C eps |x| @ |A|;
- p = h @ B, a sum over the rank r: local(p, K = r) + C eps |h| @ |B|, plus h's allowance
  carried through B in quadrature, sqrt(A(h)^2 @ B^2);
- u = s p: |s| A(p) + C eps |u| (the product's rounding);
- the add y = base + u rounds like any output: it is the first term of the formula applied to y;
- DoRA: the factor f = m / n multiplies the whole sum, so the allowance is |f| times the above,
  plus the norm's own rounding (a sum of in_features squares, then a square root: relative
  C (eps + eps_f32 sqrt(in_features))) times |y|, plus C eps |x @ W| (PEFT computes
  (f - 1) x @ W as a separate term).

The backward path (dL/dx = g @ W^T + s (g @ B^T) @ A^T) is the same derivation with A and B
transposed and their roles swapped: :func:`adapter_allowance` with ``transpose=True``.

Returns are elementwise float64 arrays of the layer output's (or dL/dx's) shape, added to the
base product's allowance by the caller.
"""
from __future__ import annotations

import math

import numpy as np

from .._dtypes import EPS
from ._tolerance import Tolerance, allowed_error

__all__ = ["adapter_of", "effective_kernel", "adapter_allowance"]


def adapter_of(params: dict) -> dict | None:
    """The adapter keys of a layer's canonical params (``lora_a``, ``lora_b``, ``lora_scale``,
    ``lora_magnitude``), or None when it holds no 2-D adapter."""
    from ..lora import split

    _, lora = split(params)
    if "lora_a" not in lora or "lora_b" not in lora or "lora_scale" not in lora:
        return None
    kernel = params.get("kernel")
    return lora if kernel is not None and np.ndim(kernel) == 2 else None


def effective_kernel(params: dict) -> np.ndarray:
    """The kernel the layer computes with, float64 (in_features, units): its own kernel, or with
    an adapter W + s A B (DoRA: scaled per unit)."""
    lora = adapter_of(params)
    if lora is None:
        return np.asarray(params["kernel"], dtype=np.float64)
    from ..lora import effective_kernel as with_adapter

    return with_adapter(params["kernel"], lora)


def adapter_allowance(x: np.ndarray, params: dict, dtype: str, tol: Tolerance, c: float, *,
                      transpose: bool = False) -> np.ndarray | float:
    """Allowed rounding of the adapter's own path for rows ``x`` (float64).

    Args:
        x: (rows, in_features) the layer multiplies (``transpose``: (rows, units), dL/dz).
        params: the layer's canonical params (kernel and adapter keys).
        dtype: the compared dtype (its eps rounds every stored intermediate).
        tol: the comparison's :class:`Tolerance` (its ``atol``).
        c: the formula's C (``tol.c_output`` forward, ``tol.c_gradient`` backward).
        transpose: the backward path, dL/dx = s (g @ B^T) @ A^T.

    Returns:
        (rows, units) (``transpose``: (rows, in_features)) elementwise allowance, or 0.0 when the
        layer holds no adapter.
    """
    from ..lora import plain_factors

    lora = adapter_of(params)
    if lora is None:
        return 0.0
    fa, fb = (np.asarray(f, dtype=np.float64) for f in plain_factors(lora))
    s = float(np.asarray(lora["lora_scale"]))
    eps, c_norm = EPS[dtype], c * (EPS[dtype] + EPS["float32"] * math.sqrt(fa.shape[0]))
    if "lora_magnitude" in lora:
        w = np.asarray(params["kernel"], dtype=np.float64)
        v = w + s * (fa @ fb)
        f = np.asarray(lora["lora_magnitude"], dtype=np.float64) / np.linalg.norm(v, axis=0)  # (units,)
        plain = {k: val for k, val in params.items() if k != "lora_magnitude"}
        if transpose:  # dL/dx = (g * f) @ V^T (the norm is not differentiated): the factor on g's units first
            g = x * f
            return c_norm * (np.abs(g) @ np.abs(v.T)) + adapter_allowance(g, plain, dtype, tol, c, transpose=True)
        base = x @ w
        y = f * (base + s * ((x @ fa) @ fb))
        return np.abs(f) * adapter_allowance(x, plain, dtype, tol, c) + c_norm * np.abs(y) + c * eps * np.abs(base)
    a, b = (fb.T, fa.T) if transpose else (fa, fb)
    h = x @ a
    a_h = allowed_error(h, dtype, a.shape[0], c, tol.atol) + c * eps * (np.abs(x) @ np.abs(a))
    p = h @ b
    a_p = (np.sqrt(np.square(a_h) @ np.square(b)) + allowed_error(p, dtype, b.shape[0], c, tol.atol)
           + c * eps * (np.abs(h) @ np.abs(b)))
    return abs(s) * a_p + c * eps * np.abs(s * p)
