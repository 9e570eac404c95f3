"""Where a destination twin's value lies in the source twin's tensors, as stored or transposed:
the search the recipe learners (``_rules``, ``_strided``) start every match from."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["oriented", "placed"]


def oriented(a: np.ndarray, transpose: bool) -> np.ndarray:
    """``a``, or ``a`` transposed: its last two axes exchanged (a matrix's transpose; a convolution's
    (channels, 1, width) <-> (channels, width, 1))."""
    return np.swapaxes(a, -1, -2) if transpose else a


def placed(where, src: dict[str, np.ndarray], value, ndim: int) -> Iterator[tuple[str, bool, np.ndarray, list[int]]]:
    """Each place ``value`` occurs in a source tensor of ``ndim`` axes, as stored or transposed.

    Args:
        where: the sources' value index (``_rules._Index``: ``find(value)`` -> (name, flat index)).
        src: source name -> array.
        value: one scalar value.
        ndim: the number of axes the tensor being matched has.

    Yields:
        (source name, transposed, the source as oriented, the value's coordinate in that orientation).
    """
    for name, flat in where.find(value):
        s = src[name]
        for transpose in ((False, True) if s.ndim >= 2 else (False,)):
            so = oriented(s, transpose)
            if so.ndim != ndim:
                continue
            coord = [int(c) for c in np.unravel_index(flat, s.shape)]
            if transpose:
                coord[-2], coord[-1] = coord[-1], coord[-2]
            yield name, transpose, so, coord
