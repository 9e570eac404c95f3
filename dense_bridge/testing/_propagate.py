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

__all__ = ["allowances", "Propagation", "activation_output_allowance", "activation_vjp"]

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
               grad_out: np.ndarray, dtype: str, tol: Tolerance, grads: bool = True
               ) -> list[dict[str, tuple[np.ndarray, int]]]:
    """Per layer: quantity -> (elementwise allowed error, own reduction length K) for model b.

    ``layers``: b's layer specs; ``trace``: b's Trace; ``params``: b's canonical params;
    ``prefix_fmt``: "{}." for a Sequential ("" for a lone layer); ``inputs``/``grad_out``: what
    b was fed (float64); ``grads=False``: the forward allowances only (b may have been traced
    forward only). The whole model at once; :class:`Propagation` is the same computation
    one layer at a time (what a comparison of two checkpoints streams through).
    """
    def own(i: int) -> dict[str, np.ndarray]:
        pre = prefix_fmt.format(i)
        return {k: params[pre + k] for k in ("kernel", "bias", "mask") if pre + k in params}

    steps = Propagation(inputs, dtype, tol)
    out = [steps.forward(i, layer, own(i), trace.layers[i].output) for i, layer in enumerate(layers)]
    if not grads:
        return out
    steps.start_backward(grad_out)
    for i in range(len(layers) - 1, -1, -1):
        out[i].update(steps.backward(i, layers[i], own(i), trace.layers[i]))
    return out


class Propagation:
    """The allowances of model b's quantities, layer by layer: :meth:`forward` for layers 0..n-1
    in order (each call returns that layer's output allowance), then :meth:`start_backward` and
    :meth:`backward` for layers n-1..0 (each returns that layer's gradient allowances).

    ``params`` given to each step are the layer's own canonical parameters (kernel, bias, mask,
    unprefixed); they are not kept between the passes, so a caller can read each layer from a
    file twice instead of holding the model. What is kept per layer is batch-sized: its input,
    pre-activation and output with their allowances.
    """

    def __init__(self, inputs: list[np.ndarray], dtype: str, tol: Tolerance) -> None:
        self.dtype, self.tol = dtype, tol
        self._xs = [_f64(x) for x in inputs]
        self._ax = [np.zeros_like(x) for x in self._xs]
        self._fwd: dict[int, dict] = {}
        self._g = self._ag = None

    # -- the local rounding terms (docs/FACTS.md formula, plus the evaluation-size terms)
    def _local_out(self, v, k):
        return allowed_error(v, self.dtype, k, self.tol.c_output, self.tol.atol)

    def _local_grad(self, v, k):
        return allowed_error(v, self.dtype, k, self.tol.c_gradient, self.tol.atol)

    def _local_dz(self, act, z, g, dz):
        local = self._local_grad(dz, act.k(z))
        if act.act.name in _SMOOTH:
            local = local + self.tol.c_gradient * EPS[self.dtype] * np.abs(g) * (1.0 + np.abs(z))
        return local

    def _local_act(self, act, z, y):
        local = self._local_out(y, act.k(z))
        size = _EVAL_SIZE.get(act.act.name)
        if size is not None:
            local = local + self.tol.c_output * EPS[self.dtype] * size(z, act.act.params)
        return local

    @staticmethod
    def _masked_kernel(params: dict) -> np.ndarray:
        w = _f64(params["kernel"])
        return w * _f64(params["mask"]) if "mask" in params else w

    def forward(self, i: int, layer, params: dict, output) -> dict[str, tuple[np.ndarray, int]]:
        """Layer ``i``'s output allowance; ``output``: b's traced output of the layer."""
        xs, ax = self._xs, self._ax
        y = _f64(output)
        rec = {"x": xs, "ax": ax, "y": y}
        if isinstance(layer, Dense):
            w = self._masked_kernel(params)
            x = xs[0]
            z = x @ w + (_f64(params["bias"]) if "bias" in params else 0.0)
            az = _q(self._local_out(z, w.shape[0]), np.sqrt(np.square(ax[0]) @ np.square(w)))
            act = None if layer.activation.is_identity else _Act(layer.activation)
            ay = az if act is None else act.forward_allowance(z, az, y, self._local_act(act, z, y))
            rec.update(z=z, az=az, act=act, k=w.shape[0])
        elif isinstance(layer, Activation) and not layer.is_identity:
            act = _Act(layer)
            z, az = xs[0], ax[0]
            ay = act.forward_allowance(z, az, y, self._local_act(act, z, y))
            rec.update(z=z, az=az, act=act, k=act.k(z))
        elif isinstance(layer, Bilinear):
            k = layer.in1_features * layer.in2_features
            ay = self._local_out(y, k)  # a Bilinear stands alone: its inputs are exact
            rec.update(k=k)
        else:  # Identity, linear activation
            ay = ax[0]
            rec.update(k=0)
        rec["ay"] = ay
        self._fwd[i] = rec
        self._xs, self._ax = [y], [ay]
        return {"output": (ay, rec["k"])}

    def start_backward(self, grad_out) -> None:
        """The upstream gradient of the last layer (float64), exact: its allowance is 0."""
        self._g, self._ag = _f64(grad_out), np.zeros(np.shape(grad_out))

    def backward(self, i: int, layer, params: dict, traced) -> dict[str, tuple[np.ndarray, int]]:
        """Layer ``i``'s gradient allowances; ``traced``: b's LayerTrace of the layer."""
        rec, out = self._fwd.pop(i), {}
        g, ag = self._g, self._ag
        if isinstance(layer, Bilinear):  # stands alone: its inputs and upstream gradient are exact
            units, k1, k2 = layer.units, layer.in1_features, layer.in2_features
            rows = int(np.prod(rec["y"].shape[:-1]))
            out["dL/dx1"] = (self._local_grad(_f64(traced.input_grads[0]), units * k2), units * k2)
            out["dL/dx2"] = (self._local_grad(_f64(traced.input_grads[1]), units * k1), units * k1)
            for name, value in traced.param_grads.items():
                out[f"dL/d{name}"] = (self._local_grad(_f64(value), rows), rows)
            return out
        act = rec.get("act")
        dz, adz = (g, ag) if act is None else _backward(act, rec, g, ag, self._local_dz, self.tol.c_output)
        if isinstance(layer, Dense):
            w, x, axx = self._masked_kernel(params), rec["x"][0], rec["ax"][0]
            dx = dz @ w.T
            a_dx = _q(self._local_grad(dx, layer.units), np.sqrt(np.square(adz) @ np.square(w.T)))
            x2, dz2, ax2, adz2 = _rows(x), _rows(dz), _rows(axx), _rows(adz)
            rows = x2.shape[0]
            dw = x2.T @ dz2
            out["dL/dkernel"] = (_q(self._local_grad(dw, rows), np.sqrt(np.square(ax2).T @ np.square(dz2)
                                                                       + np.square(x2).T @ np.square(adz2))), rows)
            if "bias" in params:
                db = dz2.sum(axis=0)
                out["dL/dbias"] = (_q(self._local_grad(db, rows), np.sqrt(np.sum(np.square(adz2), axis=0))), rows)
            out["dL/dx"] = (a_dx, layer.units)
            self._g, self._ag = dx, a_dx
        else:  # Activation or Identity: dL/dx is dz itself
            out["dL/dx"] = (adz, act.k(rec["z"]) if act is not None else 0)
            self._g, self._ag = dz, adz
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
