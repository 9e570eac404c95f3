"""Activations both ways: :class:`Activation` -> the exact torch module, and torch activation
modules, functional calls and tensor methods -> :class:`Activation` (parameters read exactly).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dense_bridge._errors import ConversionError, SpecError, received
from dense_bridge.models._layouts import warn_dropout
from dense_bridge.activations import Activation
from dense_bridge.specs import Flatten, Identity


# ------------------------------------------------------------------ modules
class ExactActivation(nn.Module):
    """An activation torch has no exact module for: softplus without threshold, exponential,
    linear, and selu with non-default constants. Holds the :class:`Activation` spec."""

    def __init__(self, spec: Activation) -> None:
        super().__init__()
        spec = spec if isinstance(spec, Activation) else Activation(spec)
        if spec.name not in ("softplus", "exponential", "linear", "selu"):
            raise SpecError(f"ExactActivation covers softplus, exponential, linear and selu; use the torch "
                            f"module for {spec.name!r}. {received('spec', spec)}")
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = self.spec.name
        if name == "softplus":
            # log(1 + e^x) exactly: torch's softplus returns x above threshold=20 (2e-9 off in
            # float64) and overflows to inf without one; logaddexp does neither.
            return torch.logaddexp(x, x.new_zeros(()))
        if name == "exponential":
            return torch.exp(x)
        if name == "selu":
            p = self.spec.params
            return p["scale"] * F.elu(x, alpha=p["alpha"])
        return x

    def extra_repr(self) -> str:
        return ", ".join([repr(self.spec.name)] + [f"{k}={v!r}" for k, v in self.spec.params.items()])


_DEFAULT_SELU = Activation("selu")


def activation_module(act: Activation) -> nn.Module:
    """The torch module computing ``act`` exactly, every parameter passed explicitly."""
    n, p = act.name, act.params
    simple = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "sigmoid": nn.Sigmoid,
              "hard_sigmoid": nn.Hardsigmoid, "hard_silu": nn.Hardswish, "tanh": nn.Tanh,
              "softsign": nn.Softsign, "mish": nn.Mish}
    if n in simple:
        return simple[n]()
    if n == "leaky_relu":
        return nn.LeakyReLU(negative_slope=p["negative_slope"])
    if n == "elu":
        return nn.ELU(alpha=p["alpha"])
    if n == "selu" and act == _DEFAULT_SELU:
        return nn.SELU()  # torch's constants are the exact ones (ATen SELU_ALPHA/SELU_SCALE)
    if n == "gelu":
        return nn.GELU(approximate="none")
    if n == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if n == "softmax":
        return nn.Softmax(dim=p["axis"])
    if n == "log_softmax":
        return nn.LogSoftmax(dim=p["axis"])
    return ExactActivation(act)


# torch's softplus returns x above ``threshold``: off by log1p(exp(-threshold)) <= 2.1e-9 for
# threshold >= 20 (torch's default), below float32 resolution. Read as the exact softplus.
_SOFTPLUS_MIN_THRESHOLD = 20.0


def _softplus_spec(beta: Any, threshold: Any, where: str) -> Activation:
    if beta != 1:
        raise ConversionError(f"{where}: softplus with beta={beta!r} has no dense_bridge equivalent (only "
                              f"beta=1). {received('beta', beta)}")
    if not threshold >= _SOFTPLUS_MIN_THRESHOLD:
        raise ConversionError(f"{where}: softplus with threshold={threshold!r} differs from log(1 + e^x) by up "
                              f"to {math.log1p(math.exp(-threshold)):.2g}; only threshold >= 20 converts. "
                              f"{received('threshold', threshold)}")
    return Activation("softplus")


def _axis_spec(name: str, dim: Any, dtype: Any, where: str) -> Activation:
    if dim is None:
        raise ConversionError(f"{where}: {name} without dim uses torch's implicit dim (0 for 1-D and 3-D "
                              f"input, 1 otherwise); pass dim explicitly, e.g. dim=-1. {received('dim', dim)}")
    if dtype is not None:
        raise ConversionError(f"{where}: {name} with dtype={dtype} casts its output; not convertible. "
                              f"{received('dtype', dtype)}")
    return Activation(name, axis=int(dim))


def _hardtanh_spec(min_val: Any, max_val: Any, where: str) -> Activation:
    if (min_val, max_val) != (0.0, 6.0):
        raise ConversionError(f"{where}: Hardtanh({min_val}, {max_val}) is only convertible as relu6 "
                              f"(min_val=0, max_val=6). Received: min_val={min_val!r}, max_val={max_val!r}")
    return Activation("relu6")


def _celu_spec(alpha: Any, where: str) -> Activation:
    if alpha != 1.0:
        raise ConversionError(f"{where}: CELU(alpha={alpha}) equals elu only for alpha=1. "
                              f"{received('alpha', alpha)}")
    return Activation("elu", alpha=1.0)


def module_activation(m: nn.Module, where: str) -> Activation | None:
    """The Activation a torch activation module computes (params read exactly), or None."""
    kind = type(m)
    if kind is ExactActivation:
        return m.spec
    plain = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.SiLU: "silu", nn.Sigmoid: "sigmoid",
             nn.Hardsigmoid: "hard_sigmoid", nn.Hardswish: "hard_silu", nn.Tanh: "tanh",
             nn.Softsign: "softsign", nn.Mish: "mish", nn.SELU: "selu"}
    if kind in plain:
        return Activation(plain[kind])
    if kind is nn.LeakyReLU:
        return Activation("leaky_relu", negative_slope=m.negative_slope)
    if kind is nn.ELU:
        return Activation("elu", alpha=m.alpha)
    if kind is nn.CELU:
        return _celu_spec(m.alpha, where)
    if kind is nn.Hardtanh:
        return _hardtanh_spec(m.min_val, m.max_val, where)
    if kind is nn.GELU:
        if m.approximate not in ("none", "tanh"):
            raise ConversionError(f"{where}: GELU(approximate={m.approximate!r}) is unknown")
        return Activation("gelu" if m.approximate == "none" else "gelu_tanh")
    if kind is nn.Softplus:
        return _softplus_spec(m.beta, m.threshold, where)
    if kind is nn.Softmax:
        return _axis_spec("softmax", m.dim, None, where)
    if kind is nn.LogSoftmax:
        return _axis_spec("log_softmax", m.dim, None, where)
    return None


# ------------------------------------------------------------------ functions and tensor methods
def fn_spec(name: str, b: dict, where: str):
    """The spec of a traced function call, from its bound arguments (torch's defaults filled in)."""
    if name == "flatten":  # torch.flatten(x, 1) / x.flatten(1): db.Flatten; other axes are not a layer spec
        if b.get("start_dim", 0) == 1 and b.get("end_dim", -1) == -1:
            return Flatten()
        raise ConversionError(f"{where}: flatten(start_dim={b.get('start_dim', 0)}, end_dim={b.get('end_dim', -1)}) "
                              f"is not db.Flatten() (start_dim=1, end_dim=-1: every axis after the first)")
    if name == "dropout":
        warn_dropout(where, b.get("p", 0.5))
        return Identity()
    if name == "hardtanh":
        return _hardtanh_spec(b.get("min_val", -1.0), b.get("max_val", 1.0), where)
    if name == "celu":
        return _celu_spec(b.get("alpha", 1.0), where)
    if name == "leaky_relu":
        return Activation("leaky_relu", negative_slope=b.get("negative_slope", 0.01))
    if name == "elu":
        return Activation("elu", alpha=b.get("alpha", 1.0))
    if name == "gelu":
        approx = b.get("approximate", "none")
        if approx not in ("none", "tanh"):
            raise ConversionError(f"{where}: gelu(approximate={approx!r}) is unknown")
        return Activation("gelu" if approx == "none" else "gelu_tanh")
    if name == "softplus":
        return _softplus_spec(b.get("beta", 1.0), b.get("threshold", 20.0), where)
    if name in ("softmax", "log_softmax"):
        return _axis_spec(name, b.get("dim"), b.get("dtype"), where)
    return Activation(name)


# Functions and tensor methods a chain may call: target -> (dense_bridge name, argument names).
_I, _IP = ("input",), ("input", "inplace")
FUNCTIONS: dict[Any, tuple[str, tuple[str, ...]]] = {
    F.relu: ("relu", _IP), torch.relu: ("relu", _I), torch.relu_: ("relu", _I), F.relu_: ("relu", _I),
    F.relu6: ("relu6", _IP), F.hardtanh: ("hardtanh", ("input", "min_val", "max_val", "inplace")),
    F.leaky_relu: ("leaky_relu", ("input", "negative_slope", "inplace")),
    F.elu: ("elu", ("input", "alpha", "inplace")), F.celu: ("celu", ("input", "alpha", "inplace")),
    F.selu: ("selu", _IP), torch.selu: ("selu", _I),
    F.gelu: ("gelu", ("input", "approximate")), F.silu: ("silu", _IP),
    torch.sigmoid: ("sigmoid", _I), F.hardsigmoid: ("hard_sigmoid", _IP), F.hardswish: ("hard_silu", _IP),
    torch.tanh: ("tanh", _I), F.softplus: ("softplus", ("input", "beta", "threshold")),
    F.softsign: ("softsign", _I), F.mish: ("mish", _IP),
    F.softmax: ("softmax", ("input", "dim", "_stacklevel", "dtype")),
    torch.softmax: ("softmax", ("input", "dim", "dtype")),
    F.log_softmax: ("log_softmax", ("input", "dim", "_stacklevel", "dtype")),
    torch.log_softmax: ("log_softmax", ("input", "dim", "dtype")),
    torch.exp: ("exponential", _I), F.dropout: ("dropout", ("input", "p", "training", "inplace")),
    torch.flatten: ("flatten", ("input", "start_dim", "end_dim")),
}
METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "relu": ("relu", _I), "relu_": ("relu", _I), "sigmoid": ("sigmoid", _I), "tanh": ("tanh", _I),
    "exp": ("exponential", _I), "softmax": ("softmax", ("input", "dim", "dtype")),
    "log_softmax": ("log_softmax", ("input", "dim", "dtype")),
    "flatten": ("flatten", ("input", "start_dim", "end_dim")),
}
