"""Help for the verbs on lone layers when they are given whole models: the error ``get_params``
gives a model it cannot read as a layer or a chain (pointing at ``linear_layers`` and
``transfer``), and the example input ``to_spec(model, example=x)`` leaves on a model."""
from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ConversionError, SpecError, received
from ._walk import walk

__all__ = ["empty_params_error", "remember_example", "EXAMPLE_ATTR"]


def empty_params_error(adapter: Any, native: Any) -> ConversionError | None:
    """The error for ``get_params`` finding no linear parameters in ``native`` (None: {} is right).

    {} is the right answer only for a chain whose layers have no parameters (a Sequential of
    activations). A lone activation, a norm, a convolution or a custom model whose linear layers
    dense_bridge cannot see as a chain gets an error naming its class and what to use instead.
    """
    from ..specs import Sequential

    t = type(native)
    what = f"{t.__module__}.{t.__qualname__}"
    try:
        spec = adapter.to_spec(native)
    except (ConversionError, SpecError, TypeError) as exc:
        spec, why = None, str(exc)
    else:
        why = ""
    if isinstance(spec, Sequential):
        return None
    if spec is not None:
        return ConversionError(f"get_params: {what} has no linear parameters (it reads as {type(spec).__name__}, "
                               f"a layer without weights). Received: native={native!r}"[:600])
    inside = ""
    try:
        found = [e.path for e in walk(native, "native") if e.kind == "linear"]
    except (ConversionError, TypeError):
        found = []
    if found:
        inside = f" It holds linear layers at {found[:6]}{' ...' if len(found) > 6 else ''}."
    return ConversionError(
        f"get_params: {what} holds no linear parameters dense_bridge can read as a layer or a chain "
        f"({why or 'not a Linear/Dense layer'}).{inside} For the linear layers inside any model use "
        f"db.linear_layers(model); to move a whole model's weights use db.transfer(src, dst, mapping=...)")


#: Attribute under which ``to_spec(model, example=x)`` leaves the example input on the model.
EXAMPLE_ATTR = "_dense_bridge_example"


def remember_example(native: Any, example: Any) -> None:
    """Keep ``example`` (as numpy) on ``native`` for adapters that read a forward on an example
    input (torch.export): every later read of the model then takes the same branch."""
    array = np.asarray(example)
    if array.ndim == 0 or not (np.issubdtype(array.dtype, np.number) or str(array.dtype) == "bfloat16"):
        raise TypeError(f"example must be a numeric array with at least one axis. {received('example', example)}")
    try:
        object.__setattr__(native, EXAMPLE_ATTR, array)
    except (AttributeError, TypeError):  # objects with __slots__: nothing to remember it on
        pass
