"""Blocks that hold different amounts of weights: a structural difference no mapping bridges, said as such.

Every mapping the rule language writes (moves, splits, concatenations, stacks, transposes, per-head
cuts) rearranges weights and never adds or drops one, so two blocks of the same number (``layers.1``
on both sides) that hold different numbers of weights cannot be made from one another: the two
libraries build different layers there for the config given (one library's module for a
``model_type`` implements another variant of the family: linear attention where the other has
full attention, a dense feed-forward where the other has experts). When the inferred pairing
leaves layers unpaired, this is the sentence that says so, instead of leaving the user to look for
a mapping that does not exist.
"""
from __future__ import annotations

import math
import re

__all__ = ["different_blocks"]

_NUMBER = re.compile(r"(?:^|(?<=[./_]))(\d+)(?=[./]|$)")


def _first_number(path: str) -> int | None:
    m = _NUMBER.search(path)
    return int(m.group(1)) if m else None


def _within(path: str) -> str:
    """``path`` after its first number (``model.layers.6.self_attn.k_proj`` -> ``self_attn.k_proj``):
    the layer's place inside its block, the same on both sides where the libraries name alike."""
    m = _NUMBER.search(path)
    return path[m.end():].lstrip("./") if m else path


def _weights(side, number: int) -> tuple[int, list[str]] | None:
    """(how many weights ``side``'s layers numbered ``number`` hold, their paths); None where one of
    them is quantized (its stored codes are not its weights)."""
    total, paths = 0, []
    for e in side.entries:
        if _first_number(e.path) != number or not e.names:
            continue
        if e.kind == "quantized":
            return None
        total += sum(int(math.prod(e.shapes[n])) for n in e.names)
        paths.append(e.path)
    return total, paths


def different_blocks(a, b, left_a: list[str], left_b: list[str]) -> str:
    """The sentence for the first block (by its number, in the order the unpaired layers name them)
    whose layers hold a different number of weights on the two sides; "" when there is none.

    Args:
        a, b: the two sides (``_walk.Side``: ``entries`` with ``path``, ``kind``, ``names``, ``shapes``).
        left_a, left_b: the paths of the layers and parameters left unpaired on each side.

    Returns:
        The sentence, or "".
    """
    seen: set[int] = set()
    for path in list(left_a) + list(left_b):
        n = _first_number(path)
        if n is None or n in seen:
            continue
        seen.add(n)
        if len(seen) > 4:
            break
        wa, wb = _weights(a, n), _weights(b, n)
        if wa is None or wb is None or not wa[1] or not wb[1] or wa[0] == wb[0]:
            continue
        only_a = [p for p in left_a if _first_number(p) == n][:4]
        only_b = [p for p in left_b if _first_number(p) == n][:4]
        kinds_a, kinds_b = {_within(p) for p in wa[1]}, {_within(p) for p in wb[1]}
        lacks = [f"{side}'s have {sorted(mine - theirs)[:6]}, which {other}'s have not"
                 for side, other, mine, theirs in (("dst", "src", kinds_b, kinds_a), ("src", "dst", kinds_a, kinds_b))
                 if mine - theirs]
        return (f"the two libraries build different layers numbered {n} for this config ({wa[0]} weights in src, "
                f"{wb[0]} in dst; no mapping adds or drops a weight"
                + (f"; of the layers inside it, {' and '.join(lacks)}" if lacks else "")
                + f"): the destination library's model implements another variant of the architecture, which this "
                  f"model cannot be carried into (src's {only_a} against dst's {only_b})")
    return ""
