"""What a transfer did: :class:`TransferReport`."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TransferReport"]


@dataclass
class TransferReport:
    """What :func:`transfer` moved, and every parameter of either model it did not.

    ``moved``: (src path, dst path, what) per move: a linear layer's canonical kernel/bias, or one
    parameter. ``not_moved_src``/``not_moved_dst``: parameter paths left alone (native names).
    ``tied``: parameter path -> the path it shares storage with (moved once, with it).
    """

    src_backend: str
    dst_backend: str
    moved: list[tuple[str, str, str]] = field(default_factory=list)
    not_moved_src: list[str] = field(default_factory=list)
    not_moved_dst: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    #: dst layer path -> the largest |dequantized - source kernel| where the destination's
    #: quantizer made the codes (exact code moves are not listed)
    quant_errors: dict[str, float] = field(default_factory=dict)
    #: the complete mapping used, as rules ``mapping=`` takes again (JSON-able without functions)
    rules: list = field(default_factory=list)
    #: parameter paths (dst) whose values were rounded into a narrower dtype (allow_narrowing=True)
    narrowed: list[str] = field(default_factory=list)
    lora: dict = field(default_factory=dict)  # LoRA adapters: mode, kept, merged, rounding (path -> largest error)
    #: mapping="auto": whether the inferred mapping was verified on the inputs, and what was checked
    verification: str = ""

    @property
    def num_moved(self) -> int:
        return len(self.moved)

    def to_dict(self) -> dict:
        return {"src_backend": self.src_backend, "dst_backend": self.dst_backend,
                "moved": [list(m) for m in self.moved], "not_moved_src": list(self.not_moved_src),
                "not_moved_dst": list(self.not_moved_dst), "tied": dict(self.tied),
                "rules": [[r[0], r[1] if not isinstance(r[1], tuple) else [r[1][0], repr(r[1][1])]]
                          for r in self.rules], "narrowed": list(self.narrowed),
                "quant_errors": dict(self.quant_errors), "verification": self.verification}

    def __str__(self) -> str:
        lines = [f"transfer {self.src_backend} -> {self.dst_backend}: {len(self.moved)} moved, "
                 f"{len(self.not_moved_src)} src and {len(self.not_moved_dst)} dst parameters not moved"]
        width = max([len(s) for s, _, _ in self.moved] + [3])
        lines += [f"  {s:<{width}}  ->  {d}  [{what}]" for s, d, what in self.moved]
        for title, items in (("not moved (src)", self.not_moved_src), ("not moved (dst)", self.not_moved_dst)):
            if items:
                lines.append(f"{title}: " + ", ".join(items))
        if self.tied:
            lines.append("tied (moved once): " + ", ".join(f"{k} = {v}" for k, v in self.tied.items()))
        if self.narrowed:
            lines.append("rounded into a narrower dtype (allow_narrowing=True): " + ", ".join(self.narrowed))
        if self.verification:
            lines.append(self.verification)
        return "\n".join(lines)
