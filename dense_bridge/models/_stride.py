"""Pieces that interleave along an axis (the rule language's ``"stride": n``).

GPT-OSS keeps each expert's gate and up projections in one ``gate_up_proj`` whose output axis
alternates gate, up, gate, up, ... (``[..., ::2]`` is the gate); mlx-lm keeps ``gate_proj`` and
``up_proj`` apart. An axis move with ``stride`` n cuts the joined array into its n interleaved
pieces (piece k: entries k, k + n, k + 2n, ...) or interleaves n pieces into one.

Shapes cannot tell pieces that lie one after another from interleaved ones. The inference
proposes the plain cut; where the models then disagree, :func:`strided_rules` gives the same
mapping with every cut or join into pieces of equal width interleaved instead, which the caller
verifies like the first (the twins of a port: ``ports._port._twins``).
"""
from __future__ import annotations

import numpy as np

__all__ = ["cut", "interleave", "strided_rules"]


def cut(whole: np.ndarray, n: int, axis: int) -> list[np.ndarray] | str:
    """``whole`` cut into its ``n`` interleaved pieces along ``axis`` (piece k: entries k, k + n, ...).

    Args:
        whole: the joined array.
        n: the number of pieces (the stride).
        axis: the axis they interleave along.
    Returns:
        The pieces, or a sentence saying why they cannot be cut (the axis does not divide by n).
    """
    if whole.ndim <= axis or whole.shape[axis] % n:
        return f"{tuple(whole.shape)} has no axis {axis} that {n} interleaved pieces of one width divide"
    return [np.ascontiguousarray(np.take(whole, np.arange(k, whole.shape[axis], n), axis=axis)) for k in range(n)]


def interleave(pieces: list[np.ndarray], axis: int) -> np.ndarray | str:
    """The ``pieces`` interleaved along ``axis``: entry i of piece k at position i * n + k.

    Args:
        pieces: arrays of one shape.
        axis: the axis they interleave along.
    Returns:
        The joined array, or a sentence saying why they cannot be joined (shapes differ).
    """
    shapes = {tuple(p.shape) for p in pieces}
    if len(shapes) != 1 or pieces[0].ndim <= axis:
        return f"interleaved pieces share one shape with an axis {axis}; got {[tuple(p.shape) for p in pieces]}"
    stacked = np.stack(pieces, axis=axis + 1)
    shape = list(pieces[0].shape)
    shape[axis] *= len(pieces)
    return np.ascontiguousarray(stacked.reshape(shape))


def strided_rules(rules: list, shapes_src, shapes_dst) -> list | None:
    """``rules`` (a report's, as :meth:`Plan.rules` writes them) with every parameter cut into, or
    joined from, several pieces of equal width along an axis made an interleaving (``"stride"``:
    the number of pieces); None when there is no such move.

    Args:
        rules: ``(source, replacement)`` pairs; replacements along an axis are dicts.
        shapes_src: ``path -> shape`` of the source's parameters (unescaped paths).
        shapes_dst: ``path -> shape`` of the destination's parameters.
    Returns:
        The rules with those moves interleaved, or None.
    """
    import re

    def unescape(p: str) -> str:
        return re.sub(r"\\(.)", r"\1", p)

    out, changed = [], False
    for src, repl in rules:
        if isinstance(repl, dict) and repl.get("axis") is not None and "heads" not in repl and not repl.get("stride"):
            srcs = [src] if isinstance(src, str) else list(src)
            dsts = [repl["to"]] if isinstance(repl["to"], str) else list(repl["to"])
            axis = repl["axis"]
            many, one = (dsts, shapes_dst) if len(srcs) == 1 else (srcs, shapes_src) if len(dsts) == 1 else (None, None)
            if many is not None and len(many) > 1:
                widths = {(tuple(one.get(unescape(p), ()))[axis:axis + 1]) for p in many}
                if len(widths) == 1 and next(iter(widths)):
                    repl = {**repl, "stride": len(many)}
                    changed = True
        out.append((src, repl))
    return out if changed else None
