"""Recipes whose pieces interleave along an axis, learnt by value (``"stride"`` in the rules).

A destination twin's tensor that is every n-th entry of a source tensor along one axis,
starting at entry k (GPT-OSS's ``gate_up_proj`` seen from mlx-lm: the gate is ``[..., 0::2]``,
the up projection ``[..., 1::2]``), or n source tensors interleaved along one axis (the way
back). Found only where no plain rearrangement makes the tensor (``_rules._made`` first).
"""
from __future__ import annotations

import numpy as np

from ._placed import oriented as _oriented, placed

__all__ = ["find"]

#: how many interleaved pieces are looked for (a fused gate/up: 2; q, k, v: 3)
MOST = 4


def _cut(d: np.ndarray, src: dict[str, np.ndarray], where) -> tuple | None:
    """``d`` as entries k, k + n, ... along one axis of a source (maybe transposed):
    (axis, [(source, transpose, k)], n), or None."""
    if not d.size:
        return None
    for s_name, transpose, so, coord in placed(where, src, d.reshape(-1)[0], d.ndim):
        for axis in range(d.ndim):
            n, rem = divmod(so.shape[axis], d.shape[axis]) if d.shape[axis] else (0, 1)
            k = int(coord[axis])
            if rem or not 2 <= n <= MOST or k >= n:
                continue
            if any(coord[x] != 0 or so.shape[x] != d.shape[x] for x in range(d.ndim) if x != axis):
                continue
            if np.array_equal(np.take(so, np.arange(k, so.shape[axis], n), axis=axis), d):
                return axis, [(s_name, transpose, k)], n
    return None


def _whole(x: np.ndarray, src: dict[str, np.ndarray], where) -> tuple[str, bool] | None:
    """The source equal to ``x``, or to ``x`` with its last two axes exchanged: (name, transpose)."""
    if not x.size:
        return None
    for s_name, _ in where.find(x.reshape(-1)[0]):
        s = src[s_name]
        for transpose in ((False, True) if s.ndim >= 2 else (False,)):
            so = _oriented(s, transpose)
            if so.shape == x.shape and np.array_equal(so, x):
                return s_name, transpose
    return None


def _joined(d: np.ndarray, src: dict[str, np.ndarray], where) -> tuple | None:
    """``d`` as n whole sources (maybe transposed) interleaved along one axis:
    (axis, [(source, transpose, 0), ...], n), or None."""
    for axis in range(d.ndim):
        for n in range(2, MOST + 1):
            if d.shape[axis] % n or d.shape[axis] == n:
                continue
            found = []
            for k in range(n):
                hit = _whole(np.take(d, np.arange(k, d.shape[axis], n), axis=axis), src, where)
                if hit is None:
                    break
                found.append((hit[0], hit[1], 0))
            if len(found) == n:
                return axis, found, n
    return None


def find(d: np.ndarray, src: dict[str, np.ndarray], where) -> tuple | None:
    """How ``d`` is made by interleaving: (axis, pieces [(source, transpose, first entry)], stride)
    with one piece (a cut: every stride-th entry of the source from the first) or stride pieces
    (a join: whole sources interleaved), or None.

    Args:
        d: the destination twin's tensor (float32).
        src: the source twin's tensors.
        where: ``_rules._Index`` of ``src``.
    """
    return _cut(d, src, where) or _joined(d, src, where)
