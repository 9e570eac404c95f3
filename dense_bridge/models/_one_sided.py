"""A linear layer's bias held on one side only, moved where that is exact.

A linear layer without a bias computes ``x @ W``, which is ``x @ W + 0``: a destination layer
holding a bias its source lacks takes exact zeros there (one library builds every attention
projection with a bias, another only when its config asks). The other way, a source bias is
dropped into a destination layer without one only when every value of it is exactly zero;
otherwise the layers compute different functions and the move is refused, naming the layer
and the largest value it would lose.
"""
from __future__ import annotations

import numpy as np

__all__ = ["reconcile", "ZEROS_NOTE"]

#: how the report words a bias written as zeros
ZEROS_NOTE = "bias written as exact zeros (src has none)"


def reconcile(params: dict, have: dict, src_where: str, dst_where: str) -> tuple[dict, str | None, str | None]:
    """``params`` (canonical source params of a linear layer) made to hold the parameters the
    destination layer holds (``have``), where only a bias differs.

    Args:
        params: canonical source params ({"kernel": (in, units), "bias": (units,), ...}).
        have: canonical destination params, the same layout.
        src_where: the source layer, as messages name it.
        dst_where: the destination layer, as messages name it.
    Returns:
        (params to move, a note for the report or None, a problem sentence or None). Where the
        two differ in more than a bias, ``params`` comes back unchanged and no note nor problem
        (the caller's own check words the difference).
    """
    if "kernel" not in params or "kernel" not in have:
        return params, None, None
    extra = set(params) - set(have)
    missing = set(have) - set(params)
    if not extra and missing == {"bias"}:
        bias = have["bias"]
        units = np.shape(params["kernel"])[-1]
        if tuple(np.shape(bias)) != (units,):
            return params, None, None  # the shape check words it
        return {**params, "bias": np.zeros((units,), dtype=np.asarray(params["kernel"]).dtype)}, ZEROS_NOTE, None
    if not missing and extra == {"bias"}:
        bias = np.asarray(params["bias"])
        if not np.any(bias):  # -0.0 counts as zero: x @ W + (-0.0) is x @ W
            return {k: v for k, v in params.items() if k != "bias"}, "bias of exact zeros dropped (dst has none)", None
        wide = np.abs(np.asarray(bias, np.float64))
        at = int(np.nanargmax(wide)) if np.isfinite(wide).any() else 0
        return params, None, (f"src {src_where} has a bias where dst {dst_where} has none: a bias moves into a layer "
                              f"without one only when every value is exactly zero, and this one holds "
                              f"{float(bias.reshape(-1)[at])!r} at unit {at} (the largest of "
                              f"{int(np.count_nonzero(bias))} non-zero values): give a dst whose layer has a bias "
                              f"(its config's bias setting)")
    return params, None, None


def zero_leftovers(left: list[str], side) -> tuple[list[str], list[str]]:
    """Source parameters the pairing left over, split into those still unpaired and the vectors of
    exact zeros among them (a bias or a router's score correction the destination's model has no
    place for): an added zero changes nothing, so they need no counterpart. The transfer's
    verification still judges the whole model without them (a zero that multiplies is caught there).

    Args:
        left: parameter or layer paths of ``side`` left unpaired.
        side: ``_walk.Side`` of the source.
    Returns:
        (still unpaired, dropped as exact zeros).
    """
    kept, zeros = [], []
    for path in left:
        found = side.params.get(path) if isinstance(path, str) else None
        if found is None:
            kept.append(path)
            continue
        e, name = found
        try:
            value = np.asarray(side.native(e)[name])
        except Exception:  # noqa: BLE001 - a parameter the walk cannot read stays unpaired, named
            kept.append(path)
            continue
        vector = 1 <= value.ndim <= 2 and sum(1 for n in value.shape if n > 1) <= 1
        if vector and value.size and not np.any(value):
            zeros.append(path)
        else:
            kept.append(path)
    return kept, zeros
