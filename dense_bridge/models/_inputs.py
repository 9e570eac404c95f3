"""The inputs a user hands ``compare``, ``compare_models`` and ``dense-bridge check``, in every form, as numpy.

One reading for every entry point, so a form that works in one works in all:

- an array of any framework (numpy, torch tensors on any device, jax arrays, mx arrays, TF
  tensors; bfloat16 as ``ml_dtypes.bfloat16``), or a nested Python list of numbers (token ids
  written as ``[[1, 2, 3]]``): ONE positional input;
- a list or tuple of such inputs: positional inputs in order. A list is read as several inputs
  when it holds arrays, or nested lists that are each at least 2-D (``[[[1, 2, 3]]]`` is one
  input of shape (1, 3)); a list of plain numbers or of 1-D lists is one array (``[[1, 2, 3]]``
  is one input of shape (1, 3));
- a dict name -> input: keyword inputs (keras-hub's ``token_ids``/``padding_mask``);
- a list or tuple holding exactly one dict: that dict.

Each array must be numeric and hold at least one element: an input of shape (0, ...) makes
every compared quantity empty, so two different models would compare "equivalent"; it is a
SpecError. Anything else is a TypeError naming the form received.
"""
from __future__ import annotations

import numbers

import numpy as np

from .._errors import SpecError, received
from ..params._source import array_to_numpy

__all__ = ["normalise", "model_inputs", "layer_inputs", "FORMS"]

#: what the messages say a user may pass
FORMS = ("an array (of any installed backend, on any device; token ids may be a nested Python list), a list "
         "of them (positional), a dict name -> array (keyword) or a list holding one such dict")


def _depth(value) -> int | None:
    """The nesting depth of a nested list of plain numbers (0 for a number), None when ``value``
    holds anything else (an array, a dict, a string)."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (numbers.Number, np.number)):
        return 0
    if isinstance(value, (list, tuple)) and value:
        depths = {_depth(v) for v in value}
        if None in depths or len(depths) != 1:
            return None
        return depths.pop() + 1
    return None


def _is_array(value) -> bool:
    return not isinstance(value, (list, tuple, dict, str, bytes)) and value is not None


def _array(value, argument: str, whole: tuple[str, object] | None = None) -> np.ndarray:
    """``value`` as a numeric numpy array with at least one element. ``whole``: (name, value) of
    the list or dict ``value`` came from, echoed in the message too."""
    plain_number = isinstance(value, numbers.Number) and not isinstance(value, np.generic)
    if isinstance(value, (str, bytes, dict, set)) or plain_number or value is None:
        kind = "a plain number" if plain_number else type(value).__name__
        raise TypeError(f"{argument} must be a numeric array, not {kind}. {received(argument, value)}"
                        + ("" if whole is None else f" (in {received(*whole)})"))
    arr = array_to_numpy(value)
    if arr is None or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
                           or np.issubdtype(arr.dtype, np.bool_)
                           or arr.dtype.name == "bfloat16"):
        kind = "" if arr is None else f" (got dtype {arr.dtype})"
        raise TypeError(f"{argument} must be a numeric array{kind}. {received(argument, value)}")
    arr = np.asarray(arr)
    if arr.size == 0:
        raise SpecError(f"{argument} must hold at least one row and one element: an empty input compares "
                        f"nothing, so any two models would pass. Received: {argument} of shape {arr.shape}")
    return arr


def _is_positional_list(value) -> bool:
    """Is the list or tuple ``value`` several inputs (True) or one array written as a list (False)?"""
    d = _depth(value)
    if d is None:  # holds arrays (or something that is not a plain number): a list of inputs
        return True
    return d >= 3  # a list of 2-D (or deeper) nested lists: each one input


def normalise(value, argument: str = "inputs") -> list[np.ndarray] | dict[str, np.ndarray]:
    """A user's inputs as a list (positional) or a dict (keyword) of numpy arrays.

    Args:
        value: any form the module docstring lists.
        argument: the name the messages give it.

    Returns:
        list of arrays (positional) or dict name -> array (keyword), each as the framework held
        it (dtype kept; integer token ids stay integers).

    Raises:
        TypeError: a form that is none of those (naming it); SpecError: an empty array.
    """
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], dict):
        return normalise(value[0], f"{argument}[0]")
    if isinstance(value, dict):
        if not value:
            raise SpecError(f"{argument} must name at least one input. {received(argument, value)}")
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{argument} keys must be argument names (str). {received(argument, value)}")
        return {k: _array(v, f"{argument}[{k!r}]", (argument, value)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if not value:
            raise SpecError(f"{argument} must hold at least one input. {received(argument, value)}")
        if not _is_positional_list(value):
            return [_array(value, argument)]
        if any(isinstance(v, dict) for v in value):
            raise TypeError(f"{argument} must be {FORMS}; a dict inside a list of several inputs has no position. "
                            f"{received(argument, value)}")
        return [_array(v, f"{argument}[{i}]", (argument, value)) for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bytes, set)):
        raise TypeError(f"{argument} must be {FORMS}; got {type(value).__name__}. {received(argument, value)}")
    return [_array(value, argument)]


def model_inputs(inputs) -> tuple[list | dict, list | dict]:
    """(inputs_a, inputs_b) of ``compare_models``: a tuple of two positional lists or dicts
    (``(inputs_a, inputs_b)``) is one per model; any other form feeds both models."""
    if inputs is None:
        raise TypeError(f"inputs must be given: {FORMS}, or a pair (inputs_a, inputs_b). Received: inputs=None")
    if isinstance(inputs, tuple) and len(inputs) == 2 and all(
            isinstance(v, dict) or (isinstance(v, (list, tuple)) and _is_positional_list(v)) for v in inputs):
        return normalise(inputs[0], "inputs[0]"), normalise(inputs[1], "inputs[1]")
    same = normalise(inputs, "inputs")
    return same, same


def layer_inputs(inputs, n_inputs: int) -> list:
    """The arrays of ``compare`` (a layer or Sequential taking ``n_inputs`` arrays): any form
    above holding exactly ``n_inputs`` of them (a keyword dict in its order), each as given."""
    given = normalise(inputs, "inputs")
    arrays = list(given.values()) if isinstance(given, dict) else given
    if len(arrays) != n_inputs:
        want = "one array (*, in_features)" if n_inputs == 1 else "a pair (x1, x2) for a Bilinear layer"
        raise SpecError(f"inputs must be {want}; received {len(arrays)} input(s) "
                        f"({', '.join(str(np.shape(a)) for a in arrays)})")
    return arrays
