"""Allowed error of every traced quantity of a model: local rounding plus propagated allowance.

A quantity deep in a model differs between two correct implementations for two reasons: its
own rounding (the docs/FACTS.md formula with the fan-in K of the reduction that produced it), and
the differences already present in what it was computed from. The first is
``allowed_error(v, dtype, K, C)``; the second is the allowance of the inputs pushed through the
layer's first-order sensitivity. Independent errors add in quadrature, so

    A(v) = sqrt(local(v)^2 + sum over inputs u of (dv/du * A(u))^2)

evaluated elementwise on the reference model b, in float64. Per layer (rows of x; Wm = kernel*mask):

forward    z = x Wm + b           A(z)  = sqrt(local(z, in_features)^2 + A(x)^2 @ Wm^2)
           y = f(z)               A(y)  = sqrt(local(y, k_f)^2 + sec_f(z, A(z))^2)
backward   dz = f'(z) g           A(dz) = sqrt(local(dz, k_f)^2 + (f'(z) A(g))^2 + (C_out g sec_f'(z, A(z)))^2)
           dL/dx = dz Wm^T        A     = sqrt(local(dL/dx, units)^2 + A(dz)^2 @ Wm^T^2)
           dL/dW = x^T dz         A     = sqrt(local(dL/dW, N)^2 + A(x)^2^T @ dz^2 + x^2^T @ A(dz)^2)
           dL/db = sum_rows dz    A     = sqrt(local(dL/db, N)^2 + sum_rows A(dz)^2)

sec_f(z, A) = max(|f(z + A) - f(z)|, |f(z - A) - f(z)|) is the secant form of |f'(z)| A: it
also covers a kink within reach (relu' is 0 or 1 depending on which side of 0 a rounded z falls,
a real and common difference in float16/bfloat16), and the magnification in the tails of gelu,
silu or exp where a small relative error in z is a large relative error in y. softmax and
log_softmax use their Jacobians row by row. k_f is 1 for elementwise activations and the
axis length for softmax/log_softmax; N is the number of rows. C is 4 for forward quantities and
10 for gradients, and every allowance carries its own C; the kink term, a bound of one
element rather than a typical size, is scaled by C_out = 4 because the sums downstream add it
coherently (quadrature alone fell 2.4x short on float16 relu chains).

Frameworks evaluate some activations through intermediates larger than the result, and the
local terms carry that (see _EVAL_SIZE and _SMOOTH): gelu/gelu_tanh/mish/hard_silu outputs
eps * |z| (1 + erf cancels in the negative tail), elu/selu eps * alpha * scale (exp(z) - 1),
softplus eps; the derivatives of smooth activations eps * (1 + |z|) * |g| (taken from
intermediates such as y + scale*alpha or 1 - y^2).

For one lone Dense (exact inputs and upstream gradient) without those activations this is
exactly the docs/FACTS.md formula with K = in_features (output), units (dL/dx) and N (dL/dkernel,
dL/dbias).
"""
from __future__ import annotations

import numpy as np

from .._dtypes import EPS
from ..activations import Activation
from ..specs import Bilinear, Dense
from ._tolerance import Tolerance, allowed_error

__all__ = ["allowances", "activation_output_allowance", "activation_vjp"]

_REDUCING = ("softmax", "log_softmax")
# Activations that frameworks evaluate through intermediates larger than the result, so that
# their absolute error is about eps times that intermediate rather than eps * |y|:
# gelu/gelu_tanh as 0.5 z (1 + erf(z / sqrt 2)) (1 + erf cancels in the negative tail; measured:
# torch float32 gelu(-2.64) is 4.5e-7 off, 17 eps of the layer's rms), mish and hard_silu as z
# times a factor computed from 1 + exp(z) or z + 3; elu/selu as alpha * (exp(z) - 1) (MLX: in
# bfloat16 exp(z) rounds to 1 +- 2^-8 near 0, so elu(0.001) is 0.0 or 0.004), softplus as
# log(1 + exp(z)).
_EVAL_SIZE = {
    "gelu": lambda z, p: np.abs(z), "gelu_tanh": lambda z, p: np.abs(z), "mish": lambda z, p: np.abs(z),
    "hard_silu": lambda z, p: np.abs(z), "elu": lambda z, p: p["alpha"],
    "selu": lambda z, p: p["alpha"] * p["scale"], "softplus": lambda z, p: 1.0,
}
# Derivatives that frameworks evaluate from intermediates of size ~1 + |z| (Keras and MLX take
# elu'/selu' as y + scale*alpha, tanh' as 1 - y^2, sigmoid' as y(1 - y), gelu' with 1 + erf):
# their absolute error is about eps * (1 + |z|) * |g|, not eps * |f'(z) g| (measured: Keras and
# MLX float32 selu'(-12) g is 2e-7 off where the value is 1e-5). Piecewise-linear ones are exact.
_SMOOTH = ("elu", "selu", "gelu", "gelu_tanh", "silu", "sigmoid", "hard_silu", "tanh", "softplus", "softsign",
           "mish", "exponential")


def _f64(x) -> np.ndarray:
    return np.nan_to_num(np.asarray(x).astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def _q(*terms) -> np.ndarray:
    """Quadrature sum of allowances (arrays broadcast)."""
    total = 0.0
    for t in terms:
        total = total + np.square(t)
    return np.sqrt(total)


class _Act:
    """An activation's value, derivative and their secant spreads over +-A, all float64."""

    def __init__(self, act: Activation):
        self.act = act

    @property
    def reduces(self) -> bool:
        return self.act.name in _REDUCING

    def k(self, z: np.ndarray) -> int:
        return z.shape[self.act.params["axis"]] if self.reduces else 1

    def f(self, z):
        return _f64(self.act.forward(z))

    def df(self, z):
        return _f64(self.act.vjp(z, None, np.ones_like(z)))

    def spread(self, fn, z: np.ndarray, a: np.ndarray) -> np.ndarray:
        at = fn(z)
        return np.maximum(np.abs(fn(z + a) - at), np.abs(fn(z - a) - at))

    def forward_allowance(self, z, az, y, local_y):
        if self.act.name == "softmax":
            # dy_i = y_i (dz_i - sum_j y_j dz_j)
            mixed = np.sqrt(np.sum(np.square(y * az), axis=self.act.params["axis"], keepdims=True))
            return _q(local_y, y * az, y * mixed)
        if self.act.name == "log_softmax":
            # dy_i = dz_i - sum_j p_j dz_j
            p = np.exp(y)
            mixed = np.sqrt(np.sum(np.square(p * az), axis=self.act.params["axis"], keepdims=True))
            return _q(local_y, az, mixed)
        return _q(local_y, self.spread(self.f, z, az))


def allowances(layers: list, trace, params: dict, prefix_fmt: str, inputs: list[np.ndarray],
               grad_out: np.ndarray, dtype: str, tol: Tolerance) -> list[dict[str, tuple[np.ndarray, int]]]:
    """Per layer: quantity -> (elementwise allowed error, own reduction length K) for model b.

    ``layers``: b's layer specs; ``trace``: b's Trace; ``params``: b's canonical params;
    ``prefix_fmt``: "{}." for a Sequential ("" for a lone layer); ``inputs``/``grad_out``: what
    b was fed (float64).
    """
    def local_out(v, k):
        return allowed_error(v, dtype, k, tol.c_output, tol.atol)

    def local_grad(v, k):
        return allowed_error(v, dtype, k, tol.c_gradient, tol.atol)

    def local_dz(act, z, g, dz):
        local = local_grad(dz, act.k(z))
        if act.act.name in _SMOOTH:
            local = local + tol.c_gradient * EPS[dtype] * np.abs(g) * (1.0 + np.abs(z))
        return local

    def local_act(act, z, y):
        local = local_out(y, act.k(z))
        size = _EVAL_SIZE.get(act.act.name)
        if size is not None:
            local = local + tol.c_output * EPS[dtype] * size(z, act.act.params)
        return local

    n = len(layers)
    xs = [_f64(x) for x in inputs]
    ax = [np.zeros_like(x) for x in xs]
    fwd = []  # per layer: dict of what the backward pass needs
    out: list[dict[str, tuple[np.ndarray, int]]] = [dict() for _ in range(n)]
    for i, layer in enumerate(layers):
        pre = prefix_fmt.format(i)
        y = _f64(trace.layers[i].output)
        rec = {"x": xs, "ax": ax, "y": y}
        if isinstance(layer, Dense):
            w = _f64(params[pre + "kernel"])
            if pre + "mask" in params:
                w = w * _f64(params[pre + "mask"])
            x = xs[0]
            z = x @ w + (_f64(params[pre + "bias"]) if pre + "bias" in params else 0.0)
            az = _q(local_out(z, w.shape[0]), np.sqrt(np.square(ax[0]) @ np.square(w)))
            act = None if layer.activation.is_identity else _Act(layer.activation)
            ay = az if act is None else act.forward_allowance(z, az, y, local_act(act, z, y))
            rec.update(w=w, z=z, az=az, act=act, k=w.shape[0])
        elif isinstance(layer, Activation) and not layer.is_identity:
            act = _Act(layer)
            z, az = xs[0], ax[0]
            ay = act.forward_allowance(z, az, y, local_act(act, z, y))
            rec.update(z=z, az=az, act=act, k=act.k(z))
        elif isinstance(layer, Bilinear):
            k = layer.in1_features * layer.in2_features
            ay = local_out(y, k)  # a Bilinear stands alone: its inputs are exact
            rec.update(k=k)
        else:  # Identity, linear activation
            ay = ax[0]
            rec.update(k=0)
        rec["ay"] = ay
        out[i]["output"] = (ay, rec["k"])
        fwd.append(rec)
        xs, ax = [y], [ay]

    g, ag = _f64(grad_out), np.zeros(np.shape(grad_out))
    for i in range(n - 1, -1, -1):
        layer, rec = layers[i], fwd[i]
        if isinstance(layer, Bilinear):  # stands alone: its inputs and upstream gradient are exact
            t = trace.layers[i]
            units, k1, k2 = layer.units, layer.in1_features, layer.in2_features
            rows = int(np.prod(rec["y"].shape[:-1]))
            out[i]["dL/dx1"] = (local_grad(_f64(t.input_grads[0]), units * k2), units * k2)
            out[i]["dL/dx2"] = (local_grad(_f64(t.input_grads[1]), units * k1), units * k1)
            for name, value in t.param_grads.items():
                out[i][f"dL/d{name}"] = (local_grad(_f64(value), rows), rows)
            continue
        act = rec.get("act")
        dz, adz = (g, ag) if act is None else _backward(act, rec, g, ag, local_dz, tol.c_output)
        if isinstance(layer, Dense):
            w, x, axx = rec["w"], rec["x"][0], rec["ax"][0]
            dx = dz @ w.T
            a_dx = _q(local_grad(dx, layer.units), np.sqrt(np.square(adz) @ np.square(w.T)))
            x2, dz2, ax2, adz2 = _rows(x), _rows(dz), _rows(axx), _rows(adz)
            rows = x2.shape[0]
            dw = x2.T @ dz2
            out[i]["dL/dkernel"] = (_q(local_grad(dw, rows), np.sqrt(np.square(ax2).T @ np.square(dz2)
                                                                    + np.square(x2).T @ np.square(adz2))), rows)
            if prefix_fmt.format(i) + "bias" in params:
                db = dz2.sum(axis=0)
                out[i]["dL/dbias"] = (_q(local_grad(db, rows), np.sqrt(np.sum(np.square(adz2), axis=0))), rows)
            out[i]["dL/dx"] = (a_dx, layer.units)
            g, ag = dx, a_dx
        else:  # Activation or Identity: dL/dx is dz itself
            out[i]["dL/dx"] = (adz, act.k(rec["z"]) if act is not None else 0)
            g, ag = dz, adz
    return out


def _backward(act: _Act, rec: dict, g, ag, local_fn, jump_scale: float):
    """dz and its allowance through the activation of a layer (Dense+act or Activation layer).

    ``local_fn(act, z, g, dz)``: the rounding allowance of dz itself.
    """
    z, y = rec["z"], rec["y"]
    axis = act.act.params.get("axis", -1)
    with np.errstate(all="ignore"):
        dz = _f64(act.act.vjp(z, None, g))
        if act.act.name == "softmax":
            ay = rec["ay"]
            s = np.sum(y * g, axis=axis, keepdims=True)
            a_s = np.sqrt(np.sum(np.square(ay * g) + np.square(y * ag), axis=axis, keepdims=True))
            prop = _q(ay * (g - s), y * ag, y * a_s)
        elif act.act.name == "log_softmax":
            ay = rec["ay"]
            p = np.exp(y)
            total = np.sum(g, axis=axis, keepdims=True)
            a_total = np.sqrt(np.sum(np.square(ag), axis=axis, keepdims=True))
            prop = _q(ag, p * ay * total, p * a_total)
        else:
            # The spread of f' is a bound of one element's difference (a whole jump at a kink), not
            # a typical size like the C-scaled terms; the sums downstream add it coherently, which
            # the quadrature underestimates by up to ~3x over a batch: scale it like an output (C=4).
            prop = _q(np.abs(act.df(z)) * ag, jump_scale * np.abs(g) * act.spread(act.df, z, rec["az"]))
    return dz, _q(local_fn(act, z, g, dz), _f64(prop))


# ---------------------------------------------------------------------------- for compare_models
def activation_output_allowance(act: Activation, z: np.ndarray, az: np.ndarray, y: np.ndarray, dtype: str,
                                tol: Tolerance) -> np.ndarray:
    """Allowed error of y = f(z) (float64, elementwise) when z is allowed ``az``: y's own rounding
    (with the intermediates frameworks evaluate it through) plus the secant spread of f over +-az."""
    a = _Act(act)
    local = allowed_error(y, dtype, a.k(z), tol.c_output, tol.atol)
    size = _EVAL_SIZE.get(act.name)
    if size is not None:
        local = local + tol.c_output * EPS[dtype] * size(z, act.params)
    return a.forward_allowance(_f64(z), az, _f64(y), local)


def activation_vjp(act: Activation, z: np.ndarray, g: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(dL/dz = f'(z) g, its allowance from z's rounding in ``dtype``) in float64: the allowance is
    |g| times the spread of f' over z +- 4 eps (|z| + rms z) (scaled by 4, as ``allowances`` scales
    kink jumps), so a rounded z landing on the other side of a kink is allowed."""
    a = _Act(act)
    z, g = _f64(z), _f64(g)
    with np.errstate(all="ignore"):
        dz = _f64(act.vjp(z, None, g))
    if a.reduces:
        return dz, np.zeros_like(dz)
    r = float(np.sqrt(np.mean(np.square(z)))) if z.size else 0.0
    az = 4.0 * EPS[dtype] * (np.abs(z) + r)
    return dz, 4.0 * np.abs(g) * a.spread(a.df, z, az)
