"""``db.transfer``: :func:`dense_bridge.models.transfer` plus ``mapping="auto"`` / ``db.auto(rules)``.

An inferred mapping (``_auto_mapping``) is a plan of the same type an explicit mapping resolves
to: it is carried out by the same ``models.execute``, on the walks the inference used, and with ``verify=True`` it is then checked by ``compare_models`` on the same
inputs (every matched linear layer's input and output along the whole run, and the model
output: a layer-by-layer check alone cannot see q and k of equal width swapped). When the check
fails, dst is put back from a snapshot taken before the write and a ConversionError names the
first disagreeing pair and every parameterised layer left unpaired. It lives apart from
``models.py`` because it needs ``testing.compare_models``, which itself builds on ``models``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _infer as _auto_mapping, _plan as _mapping
from .. import models
from .._errors import ConversionError, check_flag
from ..testing.compare_models import compare_models

__all__ = ["transfer"]


def transfer(src: Any, dst: Any, *, mapping: Any = None, strict: bool = True, allow_narrowing: bool = False,
             lora: str | None = None, allow_rounding: bool = False, requantize: bool = False,
             inputs: Any = None, verify: bool = True) -> models.TransferReport:
    """Move the parameters of ``src`` into ``dst``: :func:`dense_bridge.models.transfer` (every
    explicit ``mapping`` form, ties, dtypes, adapters (``lora``), quantized layers
    (``requantize``), all-or-nothing; its keywords mean the same here), and also

    - ``mapping="auto"`` (needs ``inputs``, in the forms ``compare_models`` takes; a pair is
      (src inputs, dst inputs)): each model runs forward once on ``inputs`` and the calls of
      their parameterised layers (linear, norm, embedding) are paired by kind, execution order,
      shape and data flow, a fused projection against the split ones that read its input
      (``dense_bridge.models._infer``); a layer that is never called, or has no counterpart, is
      an error naming it (``strict=False`` leaves it);
    - ``mapping=db.auto(rules)``: the explicit entries first, the rest inferred.

    ``verify=True``: the inferred transfer is checked on the same inputs before it is kept; on
    failure dst is unchanged and a ConversionError names the first disagreeing pair.
    ``verify=False`` keeps the inferred mapping unchecked; ``report.verification`` says which.
    ``report.rules`` is the inferred mapping in explicit form, reusable without ``inputs``.
    """
    kwargs = dict(strict=strict, allow_narrowing=allow_narrowing, lora=lora, allow_rounding=allow_rounding,
                  requantize=requantize)
    if not _auto_mapping.is_auto(mapping):
        return models.transfer(src, dst, mapping=mapping, **kwargs)
    check_flag("verify", verify)
    adapters = models.check_transfer(src, dst, **kwargs)
    if inputs is None:
        raise TypeError(_auto_mapping.NEEDS_INPUTS)
    a, b = models.sides(src, dst)
    found = _auto_mapping.infer(src, dst, a, b, inputs, mapping)
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
    saved = [(e, {k: np.array(v, copy=True) for k, v in e.read().items()}) for e in b.entries if e.names]
    report = models.execute(a, b, plan, adapters, strict=strict, allow_narrowing=allow_narrowing,
                            requantize=requantize)
    rules = report.rules
    if not verify:
        report.verification = ("inferred mapping NOT verified (verify=False): check it with "
                               "db.testing.compare_models(src, dst, inputs, mapping=report.rules)")
        return report
    try:
        compared = compare_models(src, dst, inputs, mapping=rules, grads=False, judge="carried")
    except BaseException:
        _restore(saved)
        raise
    if not compared.passed:
        _restore(saved)
        raise ConversionError(_verification_error(compared, found))
    report.verification = (f"inferred mapping verified on the inputs: {len(compared.calls)} calls of "
                           f"{len(compared.pairs)} matched linear layers and the model output agree")
    return report


def _restore(saved: list) -> None:
    for e, arrays in saved:
        e.write(arrays)


def _verification_error(compared, found) -> str:
    f = compared.first_failure
    if f is not None and f.layer is None:
        where = "the model output"
        upstream = (" The matched layers all agree, so the cause lies after the last of them (an activation, "
                    "attention, the head) or in equal-width layers of one input paired the wrong way round "
                    "(q and k: each reproduces its partner)")
    else:
        where = f"src {compared.first_divergence_a!r} / dst {compared.first_divergence!r} ({f.quantity if f else '?'})"
        upstream = (" Its input already differs: the cause may lie upstream of it (in the code between it and the "
                    "matched layer before it, e.g. an activation or attention, or in equal-width layers of one "
                    "input paired the wrong way round)") if f is not None and f.quantity == "input" else ""
    unpaired = found.unpaired_text()
    return (f"mapping='auto': the inferred transfer does not reproduce src on the inputs (dst was left unchanged). "
            f"First disagreeing pair: {where}: {compared.verdict()}.{upstream}."
            + (f" Unpaired: {unpaired}." if unpaired else " No parameterised layer was left unpaired.")
            + " verify=False keeps the inferred mapping without this check")
