"""A raw 2-D weight (with its bias) that a module's own code applies as a linear layer.

transformers' GPT-OSS router keeps ``weight`` (experts, hidden) and ``bias`` (experts,) as bare
parameters and calls ``F.linear`` on them, returning a tuple (logits, scores, indices); mlx-lm's
router is an ``nn.Linear``. Seen by its call, such a module is a linear layer: it maps its input's
last axis (in_features, the weight's second axis) to the weight's first (units), the first
floating output of a tuple holding the result. It then takes its place in the linear sequence and
pairs with the other side's linear layer (its matrix into the kernel, the bias into the bias,
``_infer._matrix_moves``); the transfer's verification judges the pair like every other.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["matrix_signature"]


def _first_output(output: Any) -> Any:
    """The call's output, or the first element of a tuple or list output (a router's logits)."""
    if isinstance(output, (tuple, list)):
        return output[0] if output else None
    return output


def matrix_signature(e: Any, call: Any) -> tuple[int, int] | None:
    """(in_features, units) where the layer ``e`` holds one 2-D parameter (units, in_features)
    and at most its bias (a vector of ``units`` named ``bias``) beside it, and its recorded ``call`` read floating-point
    activations whose last axis is ``in_features`` and returned (first, in a tuple) values whose
    last axis is ``units``; None otherwise (a table looked up by index, a convolution, anything
    else).

    Args:
        e: the walk's entry (``names``, ``shapes``).
        call: its first recorded call (``inputs``, ``output``).
    Returns:
        The linear widths, or None.
    """
    mats = [n for n in e.names if len(e.shapes[n]) == 2]
    if len(mats) != 1:
        return None
    units, n_in = (int(x) for x in e.shapes[mats[0]])
    vecs = [n for n in e.names if n not in mats]
    # the vector beside it must be the map's bias: a router's score correction (e_score_correction_bias)
    # is added to the scores after the map, no bias of it
    if len(vecs) > 1 or any(tuple(e.shapes[n]) != (units,) or n.rsplit(".", 1)[-1] != "bias" for n in vecs) \
            or units == n_in:
        return None
    if not call.inputs:
        return None
    try:
        x = np.asarray(call.inputs[0])
        y = _first_output(call.output)
        y_shape = np.shape(y)
    except Exception:  # noqa: BLE001 - an input or output numpy cannot read is no linear map to judge
        return None
    if not (x.dtype.kind == "f" or "float" in str(x.dtype)) or not x.shape or not y_shape:
        return None
    return (n_in, units) if x.shape[-1] == n_in and y_shape[-1] == units else None
