"""The twins' second try where a cut could be interleaved (``models._stride``).

Shapes do not tell a fused parameter whose pieces lie one after another from one whose pieces
interleave (GPT-OSS's ``gate_up_proj``: gate, up, gate, up, ... along its output axis). The
inferred mapping cuts plainly; where the twins then disagree and the mapping holds cuts or joins
into pieces of one width, the same mapping with those interleaved (``"stride"``) is transferred
and compared in turn, and kept only where the twins then agree.
"""
from __future__ import annotations

from typing import Any

from .._errors import DenseBridgeError

__all__ = ["retry"]


def retry(a: Any, b: Any, rules: list, inputs: Any, transfer, compare_models, distance=None) -> tuple[Any, Any] | None:
    """The twins transferred again with ``rules``' equal cuts interleaved, where that makes them agree.

    Args:
        a: the source twin.
        b: the destination twin (written again; put back as ``rules`` make it when this fails).
        rules: the inferred mapping (``report.rules``).
        inputs: the twins' inputs, as ``transfer``/``compare_models`` take them.
        transfer: ``db.transfer``.
        compare_models: ``db.testing.compare_models``.
        distance: ``() -> float``, how far the twins' outputs lie apart as ``b`` now holds them (the
            next-token KL): where neither mapping makes them agree (the libraries also differ
            elsewhere, which the caller judges next), the one whose outputs lie closer is kept.
    Returns:
        (the transfer report, its comparison) when the interleaved mapping makes the twins agree or
        (with ``distance``) brings them closer, else None (``b`` then holds what ``rules`` write).
    """
    from ..models import _stride
    from ..models._walk import sides

    sa, sb = sides(a, b)

    def shapes(side):
        return {p: tuple(e.shapes[n]) for p, (e, n) in side.params.items()}
    alt = _stride.strided_rules(rules, shapes(sa), shapes(sb))
    if alt is None:
        return None
    before = distance() if distance is not None else None
    try:
        report = transfer(a, b, mapping=alt, inputs=inputs, verify=False)
    except DenseBridgeError:  # the interleaved mapping does not apply (a failed transfer changes nothing)
        return None
    compared = compare_models(a, b, inputs, mapping=report.rules, grads=False, judge="carried")
    if compared.passed or (before is not None and distance() < before):
        return report, compared
    transfer(a, b, mapping=rules, inputs=inputs, verify=False)  # b as the first mapping wrote it
    return None
