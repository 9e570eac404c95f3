"""Activations both ways: :class:`Activation` -> ONNX operators, and those operators -> :class:`Activation`.

Each activation is written with operators onnxruntime's CPU provider runs in float32 AND float64
(its float64 kernels lack Erf, Elu, Softplus, Softsign, Mish and PRelu), the way the float64
reference in ``dense_bridge.activations`` writes them; parameters are float64 constants (see
``_graph.Builder``). Exact gelu needs Erf: in float64 it is refused. Reading back is by pattern:
the operators of a layer's activation name the candidate, its constants give the parameters,
and the candidate is written again and compared node for node with what the graph holds.

Graphs other tools exported write activations their own way (an operator, or decomposed into
arithmetic): those are read by :func:`peel`, which matches a normalized expression of the
operators against :data:`FORMS`, the forms each activation of the table is exported in.
"""
from __future__ import annotations

import itertools

import numpy as np

from dense_bridge._errors import SpecError
from dense_bridge.activations import NAMES, Activation
from dense_bridge.specs import Flatten

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



# ------------------------------------------------------------------ activations exporters write
# torch's exporters (and others) write an activation as an ONNX operator (Relu, Elu, Gelu at opset
# 20...) or decomposed into arithmetic (gelu as 0.5 x (1 + erf(x / sqrt 2)), silu as x * sigmoid(x)),
# each exporter in its own order. A segment of a graph is read as an expression over its input and
# scalar constants (``_to_spec``), normalized as :func:`fold` says, then matched against the forms
# of every activation in :data:`FORMS`. A constant matches when it equals the form's value up to
# the rounding of the constant's own dtype; a float attribute, up to float32's.

#: the largest expression read as activations (a graph built to blow up when unfolded is refused)
MAX_EXPR = 512
#: two float32 ulps: attributes are float32, and exporters fold constants in float32
_F32 = 2.0 ** -22


class NotAnActivation(Exception):
    """A segment that is not built of activations of the table (``why`` says what it computes)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Expr:
    """One value of a segment.

    ``op``: "x" (the segment's input), "c" (a scalar constant ``value``, exact to a relative
    ``tol``), "none" (an absent optional input), an ONNX operator type with ``attrs`` (sorted
    (name, value) pairs) and ``args``; in the forms also "X" (the input of the outermost
    activation, any expression) and "P" (a parameter, named by its one attribute). ``tensor``: the
    graph tensor holding the value (each layer's output), not part of equality.
    """

    __slots__ = ("op", "attrs", "args", "value", "tol", "tensor", "size", "key")

    def __init__(self, op: str, args=(), attrs=(), value: float = 0.0, tol: float = 0.0, tensor: str = "") -> None:
        self.op, self.args, self.attrs = op, tuple(args), tuple(attrs)
        self.value, self.tol, self.tensor = float(value), float(tol), tensor
        self.size = 1 + sum(a.size for a in self.args)
        if self.size > MAX_EXPR:
            raise NotAnActivation(f"its expression unfolds to more than {MAX_EXPR} terms")
        self.key = (op, self.attrs, self.value if op == "c" else None, tuple(a.key for a in self.args))

    def __eq__(self, other) -> bool:
        return isinstance(other, Expr) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def at(self, tensor: str) -> "Expr":
        """The same value, held by ``tensor``."""
        return Expr(self.op, self.args, self.attrs, self.value, self.tol, tensor)

    def __repr__(self) -> str:
        if self.op == "c":
            return f"{self.value:.9g}"
        if self.op in ("x", "X", "none"):
            return self.op
        if self.op == "P":
            return f"P({self.attrs[0][1]})"
        inner = ", ".join([repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.attrs])
        return f"{self.op}({inner})"


def const(value: float, tol: float = 0.0) -> Expr:
    return Expr("c", value=value, tol=tol)


def fold(op_type: str, args, tensor: str = "") -> Expr:
    """``Mul``/``Add`` of ``args`` normalized: nested ones flattened, the constants folded into one
    (first, dropped when it is exactly the unit), a lone operand returned as itself."""
    unit = 1.0 if op_type == "Mul" else 0.0
    value, tol, rest = unit, 0.0, []
    for a in args:
        for b in (a.args if a.op == op_type else (a,)):
            if b.op == "c":
                value = value * b.value if op_type == "Mul" else value + b.value
                tol += b.tol + 2.0 ** -52
            else:
                rest.append(b)
    if not rest:
        return Expr("c", value=value, tol=tol, tensor=tensor)
    if value == unit:
        return rest[0].at(tensor or rest[0].tensor) if len(rest) == 1 else Expr(op_type, rest, tensor=tensor)
    return Expr(op_type, [const(value, tol)] + rest, tensor=tensor)


def _leaf(a) -> Expr:
    return a if isinstance(a, Expr) else const(a)


def mul(*args) -> Expr:
    return fold("Mul", [_leaf(a) for a in args])


def add(*args) -> Expr:
    return fold("Add", [_leaf(a) for a in args])


def P(name: str) -> Expr:
    """A form's parameter: the constant or float attribute that is the activation's parameter ``name``."""
    return Expr("P", attrs=(("name", name),))


def op(op_type: str, *args, **attributes) -> Expr:
    """A form's operator; an attribute value is a number (float32 rounding allowed), a string or a ``P``."""
    return Expr(op_type, [_leaf(a) for a in args], tuple(sorted(attributes.items())))


X = Expr("X")


def _forms() -> dict[str, list[Expr]]:
    inv_sqrt2, sqrt_2_over_pi = 1.0 / np.sqrt(2.0), np.sqrt(2.0 / np.pi)
    hard_sigmoid = mul(1.0 / 6.0, op("Clip", add(X, 3.0), 0.0, 6.0))
    softplus_stable = add(op("Relu", X), op("Log", add(1.0, op("Exp", mul(-1.0, op("Abs", X))))))
    return {
        "relu": [op("Relu", X)],
        "sigmoid": [op("Sigmoid", X)],
        "tanh": [op("Tanh", X)],
        "exponential": [op("Exp", X)],
        "relu6": [op("Clip", X, 0.0, 6.0)],
        "leaky_relu": [op("LeakyRelu", X, alpha=P("negative_slope")),
                       op("Where", op("Greater", X, 0.0), X, mul(P("negative_slope"), X))],
        "elu": [op("Elu", X, alpha=P("alpha"))],
        "selu": [op("Selu", X, alpha=P("alpha"), gamma=P("scale"))],
        "gelu": [op("Gelu", X, approximate="none"), mul(0.5, X, add(1.0, op("Erf", mul(inv_sqrt2, X))))],
        "gelu_tanh": [op("Gelu", X, approximate="tanh"),
                      mul(0.5, X, add(1.0, op("Tanh", mul(sqrt_2_over_pi, add(X, mul(0.044715, X, X, X)))))),
                      mul(0.5, X, add(1.0, op("Tanh", add(mul(sqrt_2_over_pi, X),
                                                           mul(sqrt_2_over_pi * 0.044715, X, X, X)))))],
        "silu": [mul(X, op("Sigmoid", X)), op("Swish", X, alpha=1.0)],
        "hard_sigmoid": [op("HardSigmoid", X, alpha=1.0 / 6.0, beta=0.5), hard_sigmoid],
        "hard_silu": [op("HardSwish", X), mul(X, op("HardSigmoid", X, alpha=1.0 / 6.0, beta=0.5)),
                      mul(X, hard_sigmoid)],
        # torch's softplus returns x above its threshold 20, where log(1 + e^-x) is below float32's resolution
        "softplus": [op("Softplus", X), op("Where", op("Greater", X, 20.0), X, op("Softplus", X)), softplus_stable],
        "softsign": [op("Softsign", X), op("Div", X, add(1.0, op("Abs", X)))],
        "mish": [op("Mish", X), mul(X, op("Tanh", op("Softplus", X))), mul(X, op("Tanh", softplus_stable))],
        "softmax": [op("Softmax", X, axis=P("axis"))],
        "log_softmax": [op("LogSoftmax", X, axis=P("axis"))],
    }


#: activation name -> the forms exporters write it in (operators, or arithmetic normalized by ``fold``)
FORMS: dict[str, list[Expr]] = {n: f for n, f in _forms().items() if n in NAMES}


def _close(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol * max(abs(want), abs(got))


def _bind(name: str, value: float, tol: float, binds: dict) -> dict | None:
    if name in binds:
        return binds if _close(value, binds[name], max(tol, _F32)) else None
    return {**binds, name: value}


def _match(t: Expr, e: Expr, binds: dict) -> dict | None:
    """``binds`` extended so that the form ``t`` is ``e`` ("X" -> an Expr, parameters -> floats), or None."""
    if t.op == "X":
        if "X" in binds:
            return binds if binds["X"] == e else None
        return {**binds, "X": e}
    if t.op == "P":
        return _bind(t.attrs[0][1], e.value, e.tol, binds) if e.op == "c" else None
    if t.op == "c":
        return binds if e.op == "c" and _close(e.value, t.value, max(e.tol, 2.0 ** -50)) else None
    if e.op != t.op or len(e.args) != len(t.args) or [k for k, _ in e.attrs] != [k for k, _ in t.attrs]:
        return None
    for (_, tv), (_, ev) in zip(t.attrs, e.attrs):
        if isinstance(tv, Expr):  # a parameter
            binds = _bind(tv.attrs[0][1], ev, _F32, binds) if isinstance(ev, (int, float)) else None
        elif isinstance(tv, str) or isinstance(ev, str) or isinstance(tv, int) and isinstance(ev, int):
            binds = binds if tv == ev else None
        elif not isinstance(ev, (int, float)) or not _close(float(ev), float(tv), _F32):
            binds = None
        if binds is None:
            return None
    orders = itertools.permutations(e.args) if t.op in ("Mul", "Add") else (e.args,)  # Mul, Add commute
    for args in orders:
        out = binds
        for ta, ea in zip(t.args, args):
            out = _match(ta, ea, out)
            if out is None:
                break
        if out is not None:
            return out
    return None


def _clean(value: float, default: float | None) -> float:
    """A parameter read from the graph (float32 or coarser): the table's default where it rounds to
    the same float32, else the shortest decimal that is the same float32 (0.7, not 0.699999988).
    An integer (an axis) is itself."""
    if isinstance(value, int):
        return value
    if default is not None and np.float32(default) == np.float32(value):
        return float(default)
    if float(np.float32(value)) == value:
        return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
    return float(value)


def peel(e: Expr) -> list[tuple[Activation | Flatten, str]]:
    """The activations ``e`` applies to the segment input ("x"), innermost first, each with the
    tensor holding its output; NotAnActivation where ``e`` is not such a composition."""
    if e.op == "x":
        return []
    if e.op == "Flatten" and e.attrs == (("axis", 1),):  # torch's nn.Flatten(), exported by the legacy exporter
        return peel(e.args[0]) + [(Flatten(), e.tensor)]
    for name, forms in FORMS.items():
        for form in forms:
            binds = _match(form, e, {})
            if binds is None or "X" not in binds:
                continue
            try:
                inner = peel(binds["X"])
            except NotAnActivation:
                continue
            defaults = Activation(name).params
            try:
                act = Activation(name, **{k: _clean(v, defaults.get(k)) for k, v in binds.items() if k != "X"})
            except (SpecError, TypeError):
                continue
            return inner + [(act, e.tensor)]
    raise NotAnActivation(f"it computes {e!r}, which is no activation of dense_bridge's table (nor a chain of them)")
