"""``db.merge_lora``: every adapter of a model merged into its kernel, in place (see ``dense_bridge.lora``).

Into a float kernel: ``lora.merged_kernel`` (float64, one rounding). Into a quantized kernel
(MLX ``QuantizedLinear`` under an mlx-lm adapter, a Keras int8/int4 layer under ``enable_lora``): the framework's own dequantization, the float64
update, one rounding to the dequantized dtype, then the framework's quantizer in the same format.
Requantizing can erase a small update: the report gives per layer the fraction that survived,
``max(0, 1 - ||change - update|| / ||update||)`` with ``change = deq(q(W + update)) - deq(q(W))``,
measured against the base requantized alone (MLX requantization is not idempotent, so deq(W)
itself is the wrong reference), and a warning names the layers under one half. The plain norm
ratio ``||change|| / ||update||`` counts requantization noise as survival: it exceeds 1 for
updates far below one quantization step (codes that flip are not the update). The adapter verbs used for it are ``lora_quantized``,
``lora_dequantize``, ``lora_requantize`` and ``replace_lora`` (``backends/<fw>/_lora.py``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import ConversionError
from . import effective_kernel, has_lora_verbs, lora_of, merged_kernel, rank_of

__all__ = ["merge_lora", "MergeReport", "SURVIVAL_WARNING"]

#: merge_lora warns when less than this fraction of an update survives requantization
SURVIVAL_WARNING = 0.5


@dataclass
class MergeReport:
    """What :func:`merge_lora` merged: per layer path, rank, scale and the largest change of the kernel;
    ``survival``: per quantized layer, the fraction of the update its requantized kernel kept;
    ``change_ratio``: ||deq(q(W + update)) - deq(q(W))|| / ||update|| (requantization noise included)."""

    merged: list[tuple[str, int, float, float]] = field(default_factory=list)  # path, rank, scale, max |delta|
    survival: dict[str, float] = field(default_factory=dict)
    change_ratio: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.merged:
            return "merge_lora: no adapters found"
        lines = [f"merge_lora: {len(self.merged)} adapter(s) merged (float64 update, one rounding to the kernel dtype)"]
        for p, r, s, d in self.merged:
            kept = f"; {self.survival[p]:.1%} of the update survived requantization" if p in self.survival else ""
            lines.append(f"  {p}: rank {r}, scale {s:g}, largest kernel change {d:.3g}{kept}")
        return "\n".join(lines)


def _refuse_nonfinite(merged: np.ndarray, where: str) -> None:
    """A merged kernel holding NaN/Inf (from the factors, or finite factors whose update overflows the
    kernel's dtype) is never written: ConversionError naming the layer (nothing was merged yet)."""
    with np.errstate(invalid="ignore", over="ignore"):
        bad = int(merged.size - np.count_nonzero(np.isfinite(merged.astype(np.float64))))
    if bad:
        raise ConversionError(f"merge_lora: layer {where!r}: the merged kernel would hold {bad} NaN/Inf value(s) "
                              f"(NaN/Inf factors, or an update beyond the kernel's dtype {merged.dtype}); nothing "
                              f"was merged")


def _quantized_plan(adapter: Any, base: Any, lora: dict, where: str) -> tuple[Any, tuple[float, float], float]:
    """(the requantized merged layer, (the surviving fraction of the update, the change ratio), the
    largest kernel change)."""
    w = adapter.lora_dequantize(base)
    with np.errstate(invalid="ignore", over="ignore"):  # refused just below, naming the layer
        exact = effective_kernel(w, lora)
        merged = exact.astype(w.dtype)
    _refuse_nonfinite(merged, where)
    layer, deq_new = adapter.lora_requantize(base, merged)
    _, deq_base = adapter.lora_requantize(base, w)
    update = exact - w.astype(np.float64)
    change = deq_new.astype(np.float64) - deq_base.astype(np.float64)
    size = float(np.linalg.norm(update))
    # 1 - the relative error of the update the requantized kernel realises, floored at 0:
    # ||change|| / ||update|| alone reads requantization noise as survival (a 1e-4 update on 4-bit
    # MLX weights measured 11.96), and so does the projection of change on the update
    survived = max(0.0, 1.0 - float(np.linalg.norm(change - update)) / size) if size else 1.0
    ratio = float(np.linalg.norm(change)) / size if size else 1.0
    return layer, (survived, ratio), float(np.max(np.abs(deq_new.astype(np.float64) - w))) if w.size else 0.0


def merge_lora(model: Any) -> MergeReport:
    """Merge every adapter of ``model`` into its kernel, in place, and remove the adapter.

    The merged kernel is ``kernel + lora_scale * lora_a @ lora_b`` computed in float64 from the
    factors and rounded once to the kernel's dtype (DoRA: ``lora_magnitude * (kernel + update) /
    norm``, likewise). A quantized kernel is dequantized, merged and requantized in its own format,
    and the report says how much of each update survived (a warning under one half). Returns a
    :class:`MergeReport`. All merged kernels are computed before the first one is written: one that
    would hold NaN/Inf (NaN/Inf factors, or an update overflowing the kernel's dtype) is a
    ConversionError naming the layer, and the model is left unchanged.
    """
    from ..registry._backends import adapter_for
    from ..models import walk

    entries = walk(model)
    adapter = adapter_for(model, "model")
    if not has_lora_verbs(adapter):
        return MergeReport()
    plans = []
    for e in entries:
        if e.kind not in ("linear", "quantized"):
            continue
        lora = lora_of(e.layer)
        if lora is None:
            continue
        scale = float(np.asarray(lora["lora_scale"]))
        with adapter.lora_base(e.layer) as base:
            if getattr(adapter, "lora_quantized", None) is not None and adapter.lora_quantized(base):
                layer, survived, delta = _quantized_plan(adapter, base, lora, e.path)
                plans.append((e, "quantized", layer, rank_of(lora), scale, delta, survived))
                continue
            kernel = np.array(adapter.get_params(base)["kernel"], copy=True)
        with np.errstate(invalid="ignore", over="ignore"):  # refused just below, naming the layer
            merged = merged_kernel(kernel, lora)
        _refuse_nonfinite(merged, e.path)
        delta = float(np.max(np.abs(merged.astype(np.float64) - kernel.astype(np.float64)))) if kernel.size else 0.0
        plans.append((e, "float", merged, rank_of(lora), scale, delta, None))
    report = MergeReport()
    for e, how, value, rank, scale, delta, survived in plans:
        if how == "quantized":
            adapter.replace_lora(model, e.path, e.layer, value)
            report.survival[e.path], report.change_ratio[e.path] = survived
        else:
            base = adapter.detach_lora(model, e.path, e.layer)
            adapter.set_params(base, {"kernel": value})
        report.merged.append((e.path, rank, scale, delta))
    low = {p: s for p, s in report.survival.items() if s < SURVIVAL_WARNING}
    if low:
        warnings.warn(f"merge_lora: requantizing erased most of these adapters' updates (fraction that survived): "
                      + ", ".join(f"{p}: {s:.1%}" for p, s in low.items())
                      + "; the merged model computes nearly the base model's function there. Keep the adapter "
                        "unmerged, or merge into a float copy of the base", UserWarning, stacklevel=2)
    return report
