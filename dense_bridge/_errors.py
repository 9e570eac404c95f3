"""Error types of dense_bridge and the helpers that phrase their messages.

Every message names the argument and echoes the value received, in the style
"expected a positive integer. Received: units=0".
"""
from __future__ import annotations

import difflib
from typing import Iterable


class DenseBridgeError(Exception):
    """Base class of every error dense_bridge raises on purpose."""


class SpecError(DenseBridgeError, ValueError):
    """A spec (Dense, Activation, Init, wiring, ...) got an invalid value."""


class ConversionError(DenseBridgeError):
    """Parameters or a native object could not be converted or loaded."""


class CheckpointError(DenseBridgeError):
    """A checkpoint could not be read or written."""


class StateError(DenseBridgeError, RuntimeError):
    """A call made in the wrong order (a reference layer's backward before its forward)."""


class BackendUnavailableError(DenseBridgeError, ImportError):
    """The framework behind a backend is not installed; the message names the pip extra."""


def received(name: str, value: object) -> str:
    """Return ``"Received: name=value"`` with the value's repr (shortened when huge)."""
    text = repr(value)
    if len(text) > 200:
        text = text[:200] + "...>"
    return f"Received: {name}={text}"


def suggest(value: object, choices: Iterable[str]) -> str:
    """Return " Did you mean 'x'?" for the closest choice, or "" when nothing is close."""
    if not isinstance(value, str):
        return ""
    match = difflib.get_close_matches(value.lower(), list(choices), n=1, cutoff=0.6)
    return f" Did you mean {match[0]!r}?" if match else ""


def check_type(name: str, value: object, types, what: str) -> None:
    """Raise TypeError naming ``name`` unless ``value`` is an instance of ``types``.

    ``bool`` never passes for an integer argument: ``units=True`` is a bug, not 1.
    """
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise TypeError(f"{name} must be {what}, not a bool. {received(name, value)}")
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}. {received(name, value)}")


def file_number(value: object, where: str, key: str, *, integer: bool) -> int | float:
    """``value``, read from a file's config under ``key``, when it is a number (an integer with
    ``integer``; never a bool: ``"r": true`` is not a rank of 1); else CheckpointError naming
    the file (``where``) and the key.

    Returns:
        ``value`` unchanged.
    """
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float))) and not isinstance(value, bool)
    if not ok:
        raise CheckpointError(f"{where}: {key} must be {'an integer' if integer else 'a number'}. "
                              f"Received: {value!r}"[:400])
    return value


def check_flag(name: str, value: object) -> bool:
    """Return ``value`` as a bool when it is True or False (numpy's bools too); else TypeError
    naming ``name``: a truthy stand-in such as ``strict="no"`` is a bug, not True."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")
    if not isinstance(value, bool) and not numpy_bool:
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}. {received(name, value)}")
    return bool(value)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name when the message is empty):
    a library's multi-line error quoted inside one of ours."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` as int when it is a positive integer; else TypeError/SpecError naming it."""
    import numbers

    check_type(name, value, numbers.Integral, "a positive integer")
    if value <= 0:
        raise SpecError(f"{name} must be a positive integer. {received(name, value)}")
    return int(value)
