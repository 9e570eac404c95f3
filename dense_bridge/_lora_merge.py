"""``db.merge_lora``: every adapter of a model merged into its kernel, in place (see ``dense_bridge.lora``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .lora import has_lora_verbs, lora_of, merged_kernel, rank_of

__all__ = ["merge_lora", "MergeReport"]


@dataclass
class MergeReport:
    """What :func:`merge_lora` merged: per layer path, rank, scale, and the largest change of the kernel."""

    merged: list[tuple[str, int, float, float]] = field(default_factory=list)  # path, rank, scale, max |delta|

    def __str__(self) -> str:
        if not self.merged:
            return "merge_lora: no adapters found"
        lines = [f"merge_lora: {len(self.merged)} adapter(s) merged (float64 update, one rounding to the kernel dtype)"]
        lines += [f"  {p}: rank {r}, scale {s:g}, largest kernel change {d:.3g}" for p, r, s, d in self.merged]
        return "\n".join(lines)


def merge_lora(model: Any) -> MergeReport:
    """Merge every adapter of ``model`` into its kernel, in place, and remove the adapter.

    The merged kernel is ``kernel + lora_scale * lora_a @ lora_b`` computed in float64 from the
    factors and rounded once to the kernel's dtype (DoRA: ``lora_magnitude * (kernel + update) /
    norm``, likewise). Returns a :class:`MergeReport`. All adapters are read and their merged
    kernels computed before the first one is written.
    """
    from ._registry import adapter_for
    from .models import walk

    entries = walk(model)
    adapter = adapter_for(model, "model")
    if not has_lora_verbs(adapter):
        return MergeReport()
    plans = []
    for e in entries:
        if e.kind != "linear":
            continue
        lora = lora_of(e.layer)
        if lora is None:
            continue
        with adapter.lora_base(e.layer) as base:
            kernel = np.array(adapter.get_params(base)["kernel"], copy=True)
        merged = merged_kernel(kernel, lora)
        delta = float(np.max(np.abs(merged.astype(np.float64) - kernel.astype(np.float64)))) if kernel.size else 0.0
        plans.append((e, merged, rank_of(lora), float(np.asarray(lora["lora_scale"])), delta))
    report = MergeReport()
    for e, merged, rank, scale, delta in plans:
        base = adapter.detach_lora(model, e.path, e.layer)
        adapter.set_params(base, {"kernel": merged})
        report.merged.append((e.path, rank, scale, delta))
    return report
