"""Timing helpers shared by the benchmarks: medians over repeated, interleaved runs."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def calibrate(fn: Callable[[], object], target_s: float = 0.02) -> int:
    """How many calls of ``fn`` make one sample of about ``target_s`` seconds (at least 1)."""
    fn()
    start = time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-7)
    return max(1, int(target_s / one))


def sample(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call, averaged over ``inner`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def compare_medians(fns: dict[str, Callable[[], object]], repeats: int = 15,
                    target_s: float = 0.02) -> dict[str, float]:
    """Median seconds per call for each function, sampled round-robin so drift hits all alike."""
    inner = {k: calibrate(f, target_s) for k, f in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            samples[k].append(sample(f, inner[k]))
    return {k: statistics.median(v) for k, v in samples.items()}


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def table(rows: list[list[str]], header: list[str]) -> str:
    """A GitHub-flavoured markdown table."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])
