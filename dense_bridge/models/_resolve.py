"""A mapping of any form resolved into a plan on two walked models, and the checks of transfer's
arguments: what ``db.transfer`` (``dense_bridge/_transfer.py``) and the comparisons share.

- :func:`plan_for`: by order (``mapping=None``), explicit rules, or inferred from one forward pass
  of each model (``mapping="auto"``, ``db.auto(rules)``);
- :func:`match_moves` / :func:`match_layers`: the linear layer moves as a transfer plans them,
  for ``testing.compare_models`` and ``linear_layers`` users;
- :func:`check_arguments`: transfer's flags, and its ``LoraMoves``.
"""
from __future__ import annotations

from typing import Any

from . import _infer, _plan as _mapping
from .._errors import ConversionError, check_flag, received
from ._by_order import by_order
from ._walk import Side, sides

__all__ = ["check_arguments", "plan_for", "match_moves", "match_layers"]


def check_arguments(src: Any, dst: Any, *, strict: Any, allow_narrowing: Any, lora: Any, allow_rounding: Any,
                    requantize: Any) -> Any:
    """Check :func:`transfer`'s arguments other than the mapping (TypeError/ConversionError naming
    the first bad one); return the transfer's ``LoraMoves`` (``lora``/``allow_rounding`` checked)."""
    from ..lora._moves import LoraMoves

    adapters = LoraMoves(lora, allow_rounding, dst)
    for flag, value in (("strict", strict), ("allow_narrowing", allow_narrowing), ("requantize", requantize)):
        check_flag(flag, value)
    if src is dst:
        raise ConversionError(f"src and dst are the same object; transfer moves weights between two models. "
                              f"{received('dst', dst)}")
    return adapters


def plan_for(a: Side, b: Side, mapping: Any, rules: list | None, inputs: Any = None, strict: bool = True
             ) -> tuple[_mapping.Plan, Any]:
    """The plan of ``mapping`` between sides ``a`` and ``b``, and for an inferred one the inference
    (``_infer.Inferred``, else None). ``rules``: ``_plan.parse(mapping)`` for the explicit forms.
    An inferred plan with problems (or, with ``strict``, layers left unpaired) is a ConversionError."""
    if not _infer.is_auto(mapping):
        return (by_order(a, b) if rules is None else _mapping.build_plan(a, b, rules)), None
    found = _infer.infer(a.model, b.model, a, b, inputs, mapping)
    problems = list(found.plan.problems)
    if strict and (found.unpaired_src or found.unpaired_dst):
        problems.append(found.unpaired_text() + " (never called on these inputs, or without a counterpart: pass "
                        "strict=False to leave them, or map them in db.auto({...}))")
    if problems:
        raise ConversionError(f"cannot transfer {a.backend} -> {b.backend} with mapping='auto' (nothing was "
                              f"written):\n  - " + "\n  - ".join(problems))
    plan = found.plan
    _mapping.in_source_order(a, plan)
    _mapping.finish(a, b, plan)
    return plan, found


# ----------------------------------------------------------------------------- the plan's linear moves
def match_moves(a: Any, b: Any, mapping: Any = None, *, walked: tuple[Side, Side] | None = None
                ) -> list[_mapping.LayerMove]:
    """The linear layer moves of ``a`` into ``b`` as :func:`transfer` plans them (splits and
    concatenations included); ConversionError lists every problem found, and a mapping that
    pairs no linear layer at all is an error naming the rules that matched nothing.
    ``walked``: ``sides(a, b, ("a", "b"))`` when the caller holds them, so neither model is walked again."""
    rules = _mapping.parse(mapping)
    src, dst = walked if walked is not None else sides(a, b, ("a", "b"))
    plan = by_order(src, dst) if rules is None else _mapping.build_plan(src, dst, rules)
    if plan.problems:
        raise ConversionError("cannot match the layers of a and b:\n  - " + "\n  - ".join(plan.problems))
    moves = [m for m in plan.layers if m.linear]
    if not moves:
        idle = f" Rules that matched nothing: {plan.idle}." if plan.idle else ""
        raise ConversionError(f"the mapping pairs no linear layer of a with one of b.{idle} a's linear layers: "
                              f"{[e.path for e in src.linear()][:8]}; b's: {[e.path for e in dst.linear()][:8]}. "
                              f"{received('mapping', mapping)}")
    return moves


def match_layers(a: Any, b: Any, mapping: Any = None) -> dict[str, str]:
    """Linear layer paths of ``a`` -> linear layer paths of ``b``, as :func:`transfer` pairs them.

    ``mapping`` as in :func:`transfer` (None: by order, refusing ambiguous equal-shape pairs).
    Pairs of non-linear layers are left out. ConversionError lists every problem found.
    """
    return {m.src[0].path: m.dst[0].path for m in match_moves(a, b, mapping)
            if len(m.src) == len(m.dst) == 1}
