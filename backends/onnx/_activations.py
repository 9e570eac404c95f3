"""Activations both ways: :class:`Activation` -> ONNX operators, and those operators -> :class:`Activation`.

Each activation is written with operators onnxruntime's CPU provider runs in float32 AND float64
(its float64 kernels lack Erf, Elu, Softplus, Softsign, Mish and PRelu), the way the float64
reference in ``dense_bridge.activations`` writes them; parameters are float64 constants (see
``_graph.Builder``). Exact gelu needs Erf: in float64 it is refused. Reading back is by pattern:
the operators of a layer's activation name the candidate, its constants give the parameters,
and the candidate is written again and compared node for node with what the graph holds.
"""
from __future__ import annotations

import numpy as np

from dense_bridge._errors import SpecError
from dense_bridge.activations import NAMES, Activation

from ._graph import Builder


def _elu(b: Builder, x: str, alpha: float) -> str:
    # alpha * (exp(min(x, 0)) - 1) below 0, x above: exp of min(x, 0) keeps the unused branch finite
    neg = b.op("Sub", [b.op("Exp", [b.op("Min", [x, b.const(0.0)])]), b.const(1.0)])
    return b.op("Where", [b.op("Greater", [x, b.const(0.0)]), x, b.op("Mul", [neg, b.const(alpha)])])


def _softplus(b: Builder, x: str) -> str:
    # log(1 + e^x) = relu(x) + log(1 + e^-|x|): exp never overflows
    tail = b.op("Log", [b.op("Add", [b.const(1.0), b.op("Exp", [b.op("Neg", [b.op("Abs", [x])])])])])
    return b.op("Add", [b.op("Relu", [x]), tail])


def _hard_sigmoid(b: Builder, x: str) -> str:
    # relu6(x + 3) / 6, the torch and Keras 3 definition
    return b.op("Div", [b.op("Clip", [b.op("Add", [x, b.const(3.0)]), b.const(0.0), b.const(6.0)]), b.const(6.0)])


def emit(b: Builder, act: Activation, x: str) -> str:
    """Append the operators computing ``act`` on tensor ``x`` (in ``b.compute``); returns y's name."""
    n, p = act.name, act.params
    if n == "linear":
        return x
    if n == "gelu" and b.compute == np.float64:
        raise SpecError("exact gelu needs Erf, which onnxruntime's CPU provider has no float64 kernel for: "
                        "dtype float64 with activation 'gelu' cannot run; use float32 or 'gelu_tanh'. "
                        "Received: dtype='float64', activation='gelu'")
    simple = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exponential": "Exp"}
    if n in simple:
        return b.op(simple[n], [x])
    if n == "relu6":
        return b.op("Clip", [x, b.const(0.0), b.const(6.0)])
    if n == "leaky_relu":
        return b.op("Where", [b.op("Greater", [x, b.const(0.0)]), x, b.op("Mul", [x, b.const(p["negative_slope"])])])
    if n == "elu":
        return _elu(b, x, p["alpha"])
    if n == "selu":
        return b.op("Mul", [_elu(b, x, p["alpha"]), b.const(p["scale"])])
    if n == "gelu":
        return b.op("Gelu", [x], approximate="none")
    if n == "gelu_tanh":
        return b.op("Gelu", [x], approximate="tanh")
    if n == "silu":
        return b.op("Mul", [x, b.op("Sigmoid", [x])])
    if n == "hard_sigmoid":
        return _hard_sigmoid(b, x)
    if n == "hard_silu":
        return b.op("Mul", [x, _hard_sigmoid(b, x)])
    if n == "softplus":
        return _softplus(b, x)
    if n == "softsign":
        return b.op("Div", [x, b.op("Add", [b.const(1.0), b.op("Abs", [x])])])
    if n == "mish":
        return b.op("Mul", [x, b.op("Tanh", [_softplus(b, x)])])
    if n == "softmax":
        return b.op("Softmax", [x], axis=int(p["axis"]))
    if n == "log_softmax":
        return b.op("LogSoftmax", [x], axis=int(p["axis"]))
    raise SpecError(f"no ONNX form for activation {n!r}. Received: activation={act!r}")


def _signature(act: Activation) -> tuple[str, ...]:
    b = Builder("", np.float32)
    emit(b, act, "x")
    return tuple(n.op_type for n in b.nodes if n.op_type != "Cast")


#: op types (Casts of constants left out) -> activation names written with them
_BY_OPS: dict[tuple[str, ...], list[str]] = {}
for _name in NAMES:
    _BY_OPS.setdefault(_signature(Activation(_name)), []).append(_name)
del _name

#: the constants each parameterised activation reads, in the order ``emit`` writes them
_PARAM_CONSTS = {"leaky_relu": {"negative_slope": 1}, "elu": {"alpha": 3}, "selu": {"alpha": 3, "scale": 4}}


def candidates(ops: tuple[str, ...], node_attrs: list[dict], consts: list[float]) -> list[Activation]:
    """The activations whose operators are ``ops`` (Casts left out), parameters from the graph's
    constants and attributes; the caller writes each again and keeps the one that matches."""
    out = []
    for name in _BY_OPS.get(ops, []):
        params = {}
        for pname, k in _PARAM_CONSTS.get(name, {}).items():
            if k < len(consts):
                params[pname] = consts[k]
        if name in ("softmax", "log_softmax"):
            params["axis"] = int(node_attrs[0].get("axis", -1))
        try:
            out.append(Activation(name, **params))
        except (SpecError, TypeError):
            continue
    return out
