"""Peak-memory helpers shared by the benchmarks (Linux /proc; ru_maxrss elsewhere)."""
from __future__ import annotations

import resource
import sys


def maxrss_bytes() -> int:
    """This process's lifetime peak RSS in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def status_bytes(field: str) -> int | None:
    """A /proc/self/status memory field (VmRSS, VmHWM, ...) in bytes, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0: clear_refs "5").

    False where not allowed; the caller then falls back to the lifetime peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
