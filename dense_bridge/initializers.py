"""Initializers: named, parameterised distributions sampled in numpy from one seeded generator.

Every backend receives parameters drawn here, so the same seed gives bit-identical
initial parameters on every backend. Samples are drawn in float64 and
rounded once to the layer's dtype (round-to-nearest-even, as every framework casts).

Fan-in / fan-out follow the canonical kernel layout (in_features, units):
fan_in = in_features, fan_out = units.
"""
from __future__ import annotations

import math
import numbers
from types import MappingProxyType

import numpy as np

from ._errors import SpecError, received, suggest

# name -> default parameters. Variance-scaling initializers follow Keras' definitions
# (their names are Keras' names): *_normal is a normal truncated at 2 std, rescaled so the
# std is exact; *_uniform is U(±sqrt(3 * scale / fan)).
_DEFAULTS: dict[str, dict[str, float]] = {
    "glorot_uniform": {},
    "glorot_normal": {},
    "he_uniform": {},
    "he_normal": {},
    "lecun_uniform": {},
    "lecun_normal": {},
    "orthogonal": {"gain": 1.0},
    "zeros": {},
    "ones": {},
    "constant": {"value": 0.0},
    "normal": {"mean": 0.0, "stddev": 0.05},
    "uniform": {"minval": -0.05, "maxval": 0.05},
    "truncated_normal": {"mean": 0.0, "stddev": 0.05},
    # torch nn.Linear: kaiming_uniform(a=sqrt(5)) == U(±1/sqrt(fan_in)), bias the same bound.
    "torch_default": {},
    # mlx nn.Linear: U(±sqrt(1/fan_in)) for weight and bias.
    "mlx_default": {},
}
_ALIASES = {"xavier_uniform": "glorot_uniform", "xavier_normal": "glorot_normal",
            "kaiming_uniform": "he_uniform", "kaiming_normal": "he_normal"}

NAMES = tuple(_DEFAULTS)

# std of a standard normal truncated to [-2, 2]; dividing by it makes the truncated std exact.
_TRUNC_STD = 0.87962566103423978


class Init:
    """An initializer spec: a canonical name plus its explicit parameters. Immutable."""

    __slots__ = ("_name", "_params")

    def __init__(self, name: str, **params: float) -> None:
        key = _lookup(name, "name")
        full = dict(_DEFAULTS[key])
        for pname, value in params.items():
            if pname not in full:
                raise SpecError(
                    f"Initializer {key!r} has no parameter {pname!r}."
                    f"{suggest(pname, full)} Parameters: {sorted(full) or 'none'}. {received(pname, value)}"
                )
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{key} parameter {pname} must be a number. {received(pname, value)}")
            if not math.isfinite(value):
                raise SpecError(f"{key} parameter {pname} must be finite. {received(pname, value)}")
            full[pname] = float(value)
        if key in ("normal", "truncated_normal") and full["stddev"] <= 0:
            raise SpecError(f"{key} stddev must be positive. {received('stddev', full['stddev'])}")
        if key == "uniform" and not full["minval"] < full["maxval"]:
            raise SpecError(
                f"uniform needs minval < maxval. Received: minval={full['minval']}, maxval={full['maxval']}"
            )
        if key == "orthogonal" and full["gain"] <= 0:
            raise SpecError(f"orthogonal gain must be positive. {received('gain', full['gain'])}")
        object.__setattr__(self, "_name", key)
        object.__setattr__(self, "_params", MappingProxyType(full))

    def __setattr__(self, name, value):
        raise AttributeError("Init is immutable")

    def __reduce__(self):
        return (Init.from_config, (self.to_config(),))

    @property
    def name(self) -> str:
        return self._name

    @property
    def params(self):
        return self._params

    def to_config(self) -> dict:
        return {"name": self._name, "params": dict(self._params)}

    @classmethod
    def from_config(cls, config: dict) -> "Init":
        return cls(config["name"], **config.get("params", {}))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Init) and (self._name, dict(self._params)) == (other._name, dict(other._params))

    def __hash__(self) -> int:
        return hash((self._name, tuple(sorted(self._params.items()))))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self._params.items())
        return f"Init({self._name!r}{extra})"

    # ----------------------------------------------------------------- sampling
    def sample(self, shape: tuple[int, ...], fan_in: int, fan_out: int,
               rng: np.random.Generator) -> np.ndarray:
        """Draw a float64 array of ``shape`` from this distribution.

        ``fan_in``/``fan_out`` are those of the layer (in_features, units), also for its bias.
        """
        p, n = self._params, self._name
        if n == "zeros":
            return np.zeros(shape)
        if n == "ones":
            return np.ones(shape)
        if n == "constant":
            return np.full(shape, p["value"])
        if n == "normal":
            return rng.normal(p["mean"], p["stddev"], shape)
        if n == "uniform":
            return rng.uniform(p["minval"], p["maxval"], shape)
        if n == "truncated_normal":
            return p["mean"] + p["stddev"] * _truncated_standard_normal(rng, shape)
        if n in ("torch_default", "mlx_default"):
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            return rng.uniform(-bound, bound, shape)
        if n == "orthogonal":
            return p["gain"] * _orthogonal(rng, shape)
        family, dist = n.split("_")
        fan = {"glorot": (fan_in + fan_out) / 2.0, "he": fan_in / 2.0, "lecun": float(fan_in)}[family]
        scale = 1.0 / max(1.0, fan)
        if dist == "uniform":
            limit = math.sqrt(3.0 * scale)
            return rng.uniform(-limit, limit, shape)
        return math.sqrt(scale) / _TRUNC_STD * _truncated_standard_normal(rng, shape)

    def moments(self, fan_in: int, fan_out: int) -> tuple[float, float]:
        """(mean, std) of the distribution, for statistical tests; orthogonal gives gain/sqrt(fan)."""
        p, n = self._params, self._name
        if n == "zeros":
            return 0.0, 0.0
        if n == "ones":
            return 1.0, 0.0
        if n == "constant":
            return p["value"], 0.0
        if n in ("normal", "truncated_normal"):
            return p["mean"], p["stddev"] * (_TRUNC_STD if n == "truncated_normal" else 1.0)
        if n == "uniform":
            return (p["minval"] + p["maxval"]) / 2, (p["maxval"] - p["minval"]) / math.sqrt(12)
        if n in ("torch_default", "mlx_default"):
            return 0.0, (1.0 / math.sqrt(fan_in)) / math.sqrt(3)
        if n == "orthogonal":
            return 0.0, p["gain"] / math.sqrt(max(fan_in, fan_out))
        family, _ = n.split("_")
        fan = {"glorot": (fan_in + fan_out) / 2.0, "he": fan_in / 2.0, "lecun": float(fan_in)}[family]
        return 0.0, math.sqrt(1.0 / max(1.0, fan))


def _lookup(name: object, argument: str) -> str:
    """Canonical initializer name for ``name``; errors name ``argument`` and suggest a close match."""
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be an initializer name or db.Init. {received(argument, name)}")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _DEFAULTS:
        raise SpecError(
            f"Unknown initializer {name!r}.{suggest(name, NAMES)} Known: {', '.join(NAMES)}. "
            f"{received(argument, name)}"
        )
    return key


def _truncated_standard_normal(rng: np.random.Generator, shape) -> np.ndarray:
    """Standard normal samples redrawn until inside [-2, 2] (Keras/TF truncated_normal)."""
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2.0
    return out


def _orthogonal(rng: np.random.Generator, shape) -> np.ndarray:
    """A matrix with orthonormal rows or columns (whichever are fewer), from QR of a normal matrix."""
    if len(shape) < 2:
        raise SpecError(f"orthogonal needs at least a 2-D shape. {received('shape', shape)}")
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))  # makes the decomposition unique, hence the distribution uniform
    if rows < cols:
        q = q.T
    return q.reshape(shape)


def get(value: object, argument: str = "kernel_init") -> Init:
    """Return an Init for a name, an Init, or a config dict; TypeError naming ``argument`` otherwise."""
    if isinstance(value, Init):
        return value
    if isinstance(value, str):
        return Init(_lookup(value, argument))
    if isinstance(value, dict) and "name" in value:
        return Init.from_config(value)
    raise TypeError(f"{argument} must be an initializer name or db.Init. {received(argument, value)}")
