"""Wiring masks: which input feeds which output of a Dense layer.

A wiring is stored as its explicit adjacency matrix of shape (in_features, units), in the
canonical kernel layout: ``adjacency[i, j] == 1`` means input i feeds output j. It is never
stored as a seed (a seed does not reproduce a wiring across library versions).

Constructors: :func:`dense`, :func:`random`, :func:`banded`, :func:`block_diagonal`,
:func:`from_adjacency`; each returns a :class:`Wiring` usable as ``Dense(mask=...)``.
"""
from __future__ import annotations

import base64
import numbers

import numpy as np

from ._errors import SpecError, check_positive_int, check_type, received

__all__ = ["Wiring", "dense", "random", "banded", "block_diagonal", "from_adjacency"]


class Wiring:
    """An immutable 0/1 connectivity matrix of shape (in_features, units).

    ``adjacency`` is a read-only bool array; ``as_array(dtype)`` gives 0/1 in any dtype.
    """

    __slots__ = ("_adjacency", "_kind")

    def __init__(self, adjacency: np.ndarray, *, kind: str = "custom", allow_empty_outputs: bool = False):
        arr = _as_01(adjacency, "mask")
        if not allow_empty_outputs:
            empty = np.flatnonzero(~arr.any(axis=0))
            if empty.size:
                raise SpecError(
                    f"mask leaves outputs {empty[:10].tolist()}{'...' if empty.size > 10 else ''} with no "
                    f"input (an all-zero column); pass allow_empty_outputs=True if that is intended. "
                    f"Received: mask of shape {arr.shape} with {int(arr.sum())} connections"
                )
        arr.flags.writeable = False
        object.__setattr__(self, "_adjacency", arr)
        object.__setattr__(self, "_kind", kind)

    def __setattr__(self, name, value):
        raise AttributeError("Wiring is immutable")

    def __reduce__(self):
        return (Wiring.from_config, (self.to_config(),))

    @property
    def adjacency(self) -> np.ndarray:
        """Read-only bool array (in_features, units)."""
        return self._adjacency

    @property
    def shape(self) -> tuple[int, int]:
        return self._adjacency.shape

    @property
    def kind(self) -> str:
        """How it was made ("random", "banded", ...): informative only, the adjacency is the truth."""
        return self._kind

    @property
    def density(self) -> float:
        return float(self._adjacency.mean())

    @property
    def num_connections(self) -> int:
        return int(self._adjacency.sum())

    def as_array(self, dtype="float32") -> np.ndarray:
        """The mask as a fresh 0/1 array of ``dtype`` (numpy dtype or canonical name)."""
        from ._dtypes import numpy_dtype

        dt = numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        return self._adjacency.astype(dt)

    def to_config(self) -> dict:
        """JSON-able: shape plus the bit-packed adjacency in base64 (row-major, numpy packbits)."""
        packed = np.packbits(self._adjacency, axis=None)
        return {
            "kind": self._kind,
            "shape": list(self._adjacency.shape),
            "packbits_base64": base64.b64encode(packed.tobytes()).decode("ascii"),
        }

    @classmethod
    def from_config(cls, config: dict) -> "Wiring":
        """Rebuild from ``to_config()``. The claimed shape is checked against the packed bytes
        actually present before anything is allocated: a config is often read from a file, and
        a few bytes must not be able to ask for gigabytes (``np.unpackbits`` pads with zeros)."""
        if not isinstance(config, dict):
            raise TypeError(f"a mask config must be a dict. {received('config', config)}")
        shape, packed = config.get("shape"), config.get("packbits_base64")
        if not (isinstance(shape, (list, tuple)) and len(shape) == 2
                and all(type(s) is int and s >= 0 for s in shape)):
            raise SpecError(f"a mask config needs shape = [in_features, units] (two non-negative integers). "
                            f"{received('shape', shape)}")
        if not isinstance(packed, str):
            raise SpecError(f"a mask config needs packbits_base64, a base64 string. "
                            f"{received('packbits_base64', packed)}")
        count = shape[0] * shape[1]
        needed = -(-count // 8)
        # base64 holds 3 bytes per 4 characters: refuse a mismatch before decoding anything
        if len(packed) != 4 * -(-needed // 3):
            raise SpecError(f"a mask config of shape {tuple(shape)} needs {needed} packed bytes "
                            f"({4 * -(-needed // 3)} base64 characters); received {len(packed)} characters")
        try:
            raw = np.frombuffer(base64.b64decode(packed, validate=True), dtype=np.uint8)
        except ValueError as exc:
            raise SpecError(f"a mask config's packbits_base64 is not valid base64: {exc}") from None
        if raw.size != needed:
            raise SpecError(f"a mask config of shape {tuple(shape)} needs {needed} packed bytes; "
                            f"received {raw.size}")
        bits = np.unpackbits(raw, count=count).reshape(shape).astype(bool)
        kind = config.get("kind", "custom")
        if not isinstance(kind, str):
            raise SpecError(f"a mask config's kind must be a string. {received('kind', kind)}")
        return cls(bits, kind=kind, allow_empty_outputs=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Wiring) and self.shape == other.shape and bool(
            np.array_equal(self._adjacency, other._adjacency))

    def __hash__(self) -> int:
        return hash((self.shape, np.packbits(self._adjacency).tobytes()))

    def __repr__(self) -> str:
        return f"Wiring({self._kind}, shape={self.shape}, density={self.density:.3f})"


def _as_01(value: object, argument: str) -> np.ndarray:
    """Validate a 2-D array of 0/1 (or bool) values; return a fresh bool copy."""
    if isinstance(value, Wiring):
        return value.adjacency.copy()
    if isinstance(value, (str, bytes, numbers.Number)) or value is None:
        raise TypeError(f"{argument} must be a 2-D 0/1 array of shape (in_features, units). "
                        f"{received(argument, value)}")
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is a type error for the user
        raise TypeError(f"{argument} must be array-like. {received(argument, value)}") from None
    if arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 is not a numpy "number" subtype
        arr = arr.astype(np.float32)
    if arr.dtype == object or not (arr.dtype == bool or np.issubdtype(arr.dtype, np.number)):
        raise TypeError(f"{argument} must hold numbers or bools, got dtype {arr.dtype}. {received(argument, value)}")
    if arr.ndim != 2 or 0 in arr.shape:
        raise SpecError(f"{argument} must be a non-empty 2-D array (in_features, units). "
                        f"Received: {argument} of shape {arr.shape}")
    if arr.dtype != bool:
        bad = ~((arr == 0) | (arr == 1))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise SpecError(f"{argument} must hold only 0 and 1; found {arr[where]!r} at index {where}. "
                            f"Received: {argument} of shape {arr.shape}")
    return arr.astype(bool)


def from_adjacency(array, *, allow_empty_outputs: bool = False) -> Wiring:
    """A wiring from an explicit (in_features, units) 0/1 array."""
    return Wiring(array, kind="custom", allow_empty_outputs=allow_empty_outputs)


def dense(in_features: int, units: int) -> Wiring:
    """Every input feeds every output (equivalent to no mask)."""
    i, u = check_positive_int("in_features", in_features), check_positive_int("units", units)
    return Wiring(np.ones((i, u), dtype=bool), kind="dense")


def random(in_features: int, units: int, density: float, seed: int) -> Wiring:
    """Each output gets exactly max(1, round(density * in_features)) inputs, chosen uniformly.

    Fixing the count per output (rather than flipping a coin per weight) keeps every output
    connected and the density exact. ``seed`` picks the pattern; the pattern, not the seed,
    is what is stored.
    """
    i, u = check_positive_int("in_features", in_features), check_positive_int("units", units)
    check_type("density", density, numbers.Real, "a number in (0, 1]")
    if not 0.0 < density <= 1.0:
        raise SpecError(f"density must be in (0, 1]. {received('density', density)}")
    check_type("seed", seed, numbers.Integral, "a non-negative integer")
    if seed < 0:
        raise SpecError(f"seed must be a non-negative integer. {received('seed', seed)}")
    rng = np.random.default_rng(int(seed))
    k = max(1, int(round(density * i)))
    adjacency = np.zeros((i, u), dtype=bool)
    order = np.argsort(rng.random((i, u)), axis=0)[:k]  # k distinct random rows per column
    adjacency[order, np.arange(u)] = True
    return Wiring(adjacency, kind="random")


def banded(in_features: int, units: int, bandwidth: int) -> Wiring:
    """Input i feeds output j when |i - c_j| <= bandwidth, c_j = j's position scaled onto the inputs.

    For a square layer this is the usual band |i - j| <= bandwidth.
    """
    i, u = check_positive_int("in_features", in_features), check_positive_int("units", units)
    check_type("bandwidth", bandwidth, numbers.Integral, "a non-negative integer")
    if bandwidth < 0:
        raise SpecError(f"bandwidth must be a non-negative integer. {received('bandwidth', bandwidth)}")
    centers = np.arange(u) * ((i - 1) / (u - 1)) if u > 1 else np.zeros(1)
    dist = np.abs(np.arange(i)[:, None] - centers[None, :])
    # every output keeps at least its nearest input, so bandwidth 0 on a non-square layer still wires
    adjacency = (dist <= bandwidth + 1e-9) | (dist == dist.min(axis=0, keepdims=True))
    return Wiring(adjacency, kind="banded")


def block_diagonal(in_features: int, units: int, blocks: int) -> Wiring:
    """Inputs and outputs split into ``blocks`` contiguous groups (sizes differ by at most 1);
    group b of the inputs feeds only group b of the outputs."""
    i, u = check_positive_int("in_features", in_features), check_positive_int("units", units)
    b = check_positive_int("blocks", blocks)
    if b > min(i, u):
        raise SpecError(f"blocks must be at most min(in_features, units) = {min(i, u)}. {received('blocks', blocks)}")
    adjacency = np.zeros((i, u), dtype=bool)
    for rows, cols in zip(np.array_split(np.arange(i), b), np.array_split(np.arange(u), b)):
        adjacency[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1] = True
    return Wiring(adjacency, kind="block_diagonal")
