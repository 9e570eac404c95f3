"""Activations on JAX, both directions: canonical Activation <-> ``jax.nn`` callables.

Shared by the Flax and the Equinox adapter (each re-exports it from its own file of the same role).

jax.nn's defaults differ from the canonical table and are pinned here, both ways:
``jax.nn.gelu`` is the tanh approximation unless ``approximate=False``; ``jax.nn.leaky_relu``'s
slope is 0.01; ``jax.nn.softmax``/``log_softmax`` act on the last axis. Reading a bare
``jax.nn.gelu`` therefore gives ``gelu_tanh``; compiling writes every parameter explicitly
(``functools.partial(jax.nn.gelu, approximate=False)``).

Compile uses the ``jax.nn`` function where it computes exactly the canonical function, kinks
included (relu'(0) = 0, relu6'(6) = 0, hard_sigmoid'(+-3) = 0, elu'(0) = alpha, exact selu
constants), and a function of its own only for leaky_relu: ``jax.nn.leaky_relu`` is
``where(x >= 0, x, s*x)``, slope 1 at 0 where the reference (torch) has s.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from dense_bridge._errors import ConversionError, SpecError, received
from dense_bridge.activations import Activation

_SELU = Activation("selu").params  # the exact constants, as jax.nn.selu has them


def leaky_relu(x, negative_slope: float = 0.01):
    """x if x > 0 else negative_slope * x: the slope at 0 is ``negative_slope`` (torch's kink)."""
    return jnp.where(x > 0, x, negative_slope * x)


def selu(x, alpha: float, scale: float):
    """scale * elu(x, alpha) for non-default constants (jax.nn.selu has the exact defaults only)."""
    return scale * jax.nn.elu(x, alpha)


def identity(x):
    return x


@functools.lru_cache(maxsize=None)
def activation_fn(act: Activation) -> Callable | None:
    """The JAX callable computing ``act`` exactly, parameters explicit; None for linear."""
    n, p = act.name, act.params
    if n == "linear":
        return None
    if n == "gelu":
        return functools.partial(jax.nn.gelu, approximate=False)
    if n == "gelu_tanh":
        return functools.partial(jax.nn.gelu, approximate=True)
    if n == "leaky_relu":
        return functools.partial(leaky_relu, negative_slope=p["negative_slope"])
    if n == "elu":
        return functools.partial(jax.nn.elu, alpha=p["alpha"])
    if n == "selu":
        if dict(p) == dict(_SELU):
            return jax.nn.selu
        return functools.partial(selu, alpha=p["alpha"], scale=p["scale"])
    if n == "softmax":
        return functools.partial(jax.nn.softmax, axis=p["axis"])
    if n == "log_softmax":
        return functools.partial(jax.nn.log_softmax, axis=p["axis"])
    try:
        return _PLAIN[n]
    except KeyError:  # pragma: no cover - the table covers every canonical name
        raise SpecError(f"no JAX function for {act!r}") from None


_PLAIN: dict[str, Callable] = {
    "relu": jax.nn.relu, "relu6": jax.nn.relu6, "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh, "softplus": jax.nn.softplus, "softsign": jax.nn.soft_sign, "mish": jax.nn.mish,
    "hard_sigmoid": jax.nn.hard_sigmoid, "hard_silu": jax.nn.hard_silu, "exponential": jnp.exp,
}


# ------------------------------------------------------------------ JAX -> canonical
def conversion_error(where: str, m, why: str) -> ConversionError:
    return ConversionError(f"{where} ({type(m).__module__}.{type(m).__qualname__}) {why}. "
                           f"{received(where, m)}")


def _readers() -> list[tuple[Callable, Callable[[dict], Activation]]]:
    """Known callables with how their keyword arguments (and jax.nn's defaults) read."""
    table = [(fn, (lambda name: lambda kw: Activation(name))(name)) for name, fn in _PLAIN.items()]
    table += [
        (jax.nn.tanh, lambda kw: Activation("tanh")),
        (identity, lambda kw: Activation("linear")),
        # jax.nn.gelu's default is the tanh approximation
        (jax.nn.gelu, lambda kw: Activation("gelu_tanh" if kw.get("approximate", True) else "gelu")),
        (jax.nn.leaky_relu, lambda kw: Activation("leaky_relu", negative_slope=kw.get("negative_slope", 0.01))),
        (leaky_relu, lambda kw: Activation("leaky_relu", negative_slope=kw.get("negative_slope", 0.01))),
        (jax.nn.elu, lambda kw: Activation("elu", alpha=kw.get("alpha", 1.0))),
        (jax.nn.selu, lambda kw: Activation("selu")),
        (selu, lambda kw: Activation("selu", alpha=kw["alpha"], scale=kw["scale"])),
        (jax.nn.softmax, lambda kw: Activation("softmax", axis=kw.get("axis", -1))),
        (jax.nn.log_softmax, lambda kw: Activation("log_softmax", axis=kw.get("axis", -1))),
    ]
    return table


_KNOWN_ARGS = {"gelu": {"approximate"}, "gelu_tanh": {"approximate"}, "leaky_relu": {"negative_slope"},
               "elu": {"alpha"}, "selu": {"alpha", "scale"}, "softmax": {"axis"}, "log_softmax": {"axis"}}


def activation_of_function(fn, where: str) -> Activation:
    """The canonical Activation of a JAX callable (optionally a functools.partial by keyword)."""
    base, kwargs = fn, {}
    if isinstance(fn, functools.partial):
        if fn.args:
            raise conversion_error(where, fn, "binds positional arguments; bind parameters by keyword")
        base, kwargs = fn.func, dict(fn.keywords)
    for known, make in _readers():
        if base is known:
            if isinstance(kwargs.get("axis"), (tuple, list)) or kwargs.get("where") is not None:
                raise conversion_error(where, fn, "normalises over several axes or a subset; the canonical "
                                       "softmax takes one axis")
            try:
                act = make(kwargs)
                extra = set(kwargs) - _KNOWN_ARGS.get(act.name, set())
                if extra:
                    raise SpecError(f"unknown keyword(s) {sorted(extra)}")
            except (SpecError, TypeError, KeyError) as exc:
                raise conversion_error(where, fn, f"has arguments no canonical activation takes ({exc})") from None
            return act
    raise conversion_error(where, fn, "is a callable dense_bridge cannot read; use a jax.nn function such "
                           "as jax.nn.relu (optionally a functools.partial with keyword parameters)")
