"""``mapping=None``: the plan two models get without a mapping.

- Linear layers pair by definition order, when both models have as many (heads tied to their
  embedding left out: they follow it) and each pair has one canonical shape. Two layers of equal
  shape whose last path components say another pairing (the other model has a layer of that name
  among those of this shape) are an error naming them: mlx-lm's Llama MLP defines gate, down, up,
  transformers' gate, up, down, and by order up and down would swap silently.
- Every other parameter (norm scales and offsets, embedding tables, running statistics, raw
  parameters) moves to the parameter of the same path in the other model when its shape agrees,
  so two models of one architecture move completely.
"""
from __future__ import annotations

from . import _plan as _mapping
from ._layouts import Entry
from ._walk import LINEAR_KINDS, Side

__all__ = ["by_order", "kernel_shape"]


def by_order(src: Side, dst: Side) -> _mapping.Plan:
    """The plan for ``mapping=None``: problems collected in ``plan.problems``, nothing raised."""
    plan = _mapping.Plan()
    _linear_by_order(src, dst, plan)
    _others_by_path(src, dst, plan)
    _mapping.record_ties(src, plan)
    return plan


def kernel_shape(side: Side, e: Entry) -> tuple:
    """The canonical kernel shape: (in_features, units), or (units, in1, in2) for a Bilinear."""
    if e.kind == "quantized":  # from the codes' shape: dequantizing only to count would cost a pass
        from ..quant import quant_layer

        h = quant_layer(side.adapter, e.layer)
        return (h.in_features, h.units)
    return side.kernel_shape(e)


def _last(path: str) -> str:
    """The last component of a path ("a.b/c" -> "c"): what follows its last "." or "/"."""
    return path[max(path.rfind("."), path.rfind("/")) + 1:]


def _linear_by_order(src: Side, dst: Side, plan: _mapping.Plan) -> None:
    a = [e for e in src.linear() if not src.fully_tied(e)]
    b = [e for e in dst.linear() if not dst.fully_tied(e)]
    if len(a) != len(b):
        plan.problems.append(
            f"mapping=None pairs linear layers by order, but src has {len(a)} and dst has {len(b)} "
            f"(src: {[e.path for e in a]}; dst: {[e.path for e in b]}): give a mapping")
        return
    shapes_a = [kernel_shape(src, e) for e in a]
    shapes_b = [kernel_shape(dst, e) for e in b]
    for i, (s, d) in enumerate(zip(a, b)):
        if shapes_a[i] != shapes_b[i]:
            plan.problems.append(f"mapping=None pairs src {s.where()} with dst {d.where()} by order, but their "
                                 f"(in_features, units) differ: {shapes_a[i]} vs {shapes_b[i]}: give a mapping")
            continue
        ns, nd = _last(s.path), _last(d.path)
        if ns != nd:
            same = [j for j in range(len(a)) if shapes_a[j] == shapes_a[i]]
            names_a = {_last(a[j].path) for j in same}
            names_b = {_last(b[j].path) for j in same}
            if ns in names_b or nd in names_a:
                twin = next((b[j].path for j in same if _last(b[j].path) == ns), None)
                plan.problems.append(
                    f"mapping=None would pair src {s.path!r} with dst {d.path!r} (both {shapes_a[i]}), but their "
                    f"names differ and dst has a layer named like src's{f' ({twin!r})' if twin else ''}: layers of "
                    f"equal shape defined in another order would swap silently. Give a mapping (e.g. "
                    f"[(r'(.*)', r'\\1')] when the paths agree)")
                continue
        plan.layers.append(_mapping.LayerMove((s,), (d,), rule="by order"))


def _others_by_path(src: Side, dst: Side, plan: _mapping.Plan) -> None:
    """Each parameter of a non-linear layer into dst's parameter of the same path (or stable path,
    Keras' renumbered names) and shape; tied parameters follow their tie."""
    for p, (e, n) in src.params.items():
        if e.kind in LINEAR_KINDS or p in src.tied_to:
            continue
        q = dst.param(p) or dst.param(src.stable.get(p, p))
        if q is None or q in dst.tied_to:
            continue
        d, nd = dst.params[q]
        if d.kind in LINEAR_KINDS or d.shapes[nd] != e.shapes[n]:
            continue
        plan.params.append(_mapping.ParamMove(p, q, None, "by path"))
