"""Regular expressions from users and files, bounded: no pattern that can run for ages.

Mapping rules (``db.transfer``'s ``(pattern, replacement)`` rules, ``dense-bridge check
--mapping``) and adapter configs (PEFT's ``rank_pattern``, ``target_modules``) hold patterns that
are matched against layer paths. Python's ``re`` backtracks: a quantifier nested inside another
(``(a+)+``, ``(\\w+\\.)*x``) takes time exponential in the path's length on a path that almost
matches. A pattern is therefore refused when it nests a repeat inside a repeat, or is longer than
:data:`PATTERN_LIMIT`; the paths matched are at most :data:`PATH_LIMIT` characters. The check
reads the tree Python's own regex parser builds, the one ``re.compile`` uses.
"""
from __future__ import annotations

import re
from typing import Callable

try:  # the stdlib's own regex parser
    import re._constants as _sre
    import re._parser as _sre_parse
except ImportError:  # Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parse

__all__ = ["PATTERN_LIMIT", "PATH_LIMIT", "bounded_pattern", "nested_repeat"]

#: the longest pattern accepted
PATTERN_LIMIT = 512
#: the longest layer path a pattern from a file is matched against
PATH_LIMIT = 1024


def nested_repeat(items, inside: bool = False) -> bool:
    """Whether a parsed regex (``sre_parse.parse``'s tree) holds a repeat of more than one inside
    another one: the shape whose backtracking is exponential."""
    c = _sre
    repeats = {c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)}
    groups = {c.ASSERT, c.ASSERT_NOT, getattr(c, "ATOMIC_GROUP", c.ASSERT)}  # av: (direction, sub) or sub
    for op, av in items:
        if op in repeats:
            _, hi, sub = av
            many = hi == c.MAXREPEAT or hi > 1
            if (many and inside) or nested_repeat(sub, inside or many):
                return True
        elif op == c.SUBPATTERN and nested_repeat(av[-1], inside):
            return True
        elif op == c.BRANCH and any(nested_repeat(b, inside) for b in av[1]):
            return True
        elif op in groups and nested_repeat(av[1] if isinstance(av, tuple) else av, inside):
            return True
    return False


def bounded_pattern(pattern: object, what: str, error: Callable[[str], Exception]) -> re.Pattern:
    """``pattern`` compiled, or ``error(message)`` naming ``what`` (the rule, or the file and key).

    Args:
        pattern: the regular expression (anything else is refused).
        what: where it comes from, for the message ("mapping rule", "adapter_config.json: rank_pattern").
        error: the exception class to raise (SpecError for a user's argument, CheckpointError for a file).

    Returns:
        The compiled pattern.
    """
    if not isinstance(pattern, str):
        raise error(f"{what}: a pattern must be a string. Received: {pattern!r}"[:400])
    if len(pattern) > PATTERN_LIMIT:
        raise error(f"{what}: pattern of {len(pattern)} characters (at most {PATTERN_LIMIT}). "
                    f"Received: {pattern[:80]!r}...")
    try:
        tree = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise error(f"{what}: {pattern!r} is not a regular expression ({exc})"[:600]) from None
    if nested_repeat(tree):
        raise error(f"{what}: {pattern!r} nests one quantifier inside another (its matching time grows "
                    f"exponentially with the path's length); write it without, e.g. '(.*)\\.q_proj' for "
                    f"'((\\w+)\\.)+q_proj'")
    return re.compile(pattern)
