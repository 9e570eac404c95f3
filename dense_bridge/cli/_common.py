"""What every command shares: exit codes, one-line errors, sizes in words, the progress bar,
JSON output, and the ``--spec`` reader (a spec JSON file, a checkpoint's spec, or inline JSON)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import dense_bridge as db
from .. import checkpoints

EXIT_OK, EXIT_NOT_EQUIVALENT, EXIT_BAD_INPUT = 0, 1, 2

#: elements per step of a scan over one tensor: float64 temporaries of 2 MB, whatever its size
SCAN_BLOCK = 1 << 18


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


class ProgressBar:
    """``[#####-----]  42%  12.0/28.4 MB  85.3 MB/s`` on stderr, redrawn at most 10 times a second."""

    def __init__(self, label: str, enabled: bool, stream=None) -> None:
        self.label, self.enabled = label, enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        frac = 1.0 if total <= 0 else min(1.0, done / total)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = done / max(now - self.start, 1e-9)
        self.stream.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}%  {human_bytes(done)}/{human_bytes(total)}  "
                          f"{human_bytes(rate)}/s")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=_json_default))


def _json_default(value: Any):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def read_spec(text: str | None):
    """A spec from --spec: a JSON file of spec.to_config(), a dense_bridge checkpoint, or inline JSON."""
    if text is None:
        return None
    if text.lstrip().startswith("{"):
        return db.from_config(text)
    if not os.path.exists(text):
        raise db.CheckpointError(f"--spec {text}: no such file (give a spec JSON file, a dense_bridge checkpoint "
                                 "or inline JSON)")
    if os.path.isdir(text):
        raise db.CheckpointError(f"--spec {text}: it is a directory, not a spec JSON file")
    head, size = checkpoints.read_head(text, 1)  # a FIFO or device is refused, never waited on
    if head == b"{":
        if size > checkpoints.MAX_JSON_FILE:
            raise db.SpecError(f"--spec {text}: {size:,} bytes is too large for a spec JSON file "
                               f"(at most {checkpoints.MAX_JSON_FILE:,})")
        raw, _ = checkpoints.read_head(text, size)
        config = checkpoints.parse_json(raw, lambda reason: db.SpecError(f"--spec {text}: not a spec JSON file ({reason})"),
                            "JSON")
        if isinstance(config, dict) and "weight_map" in config:  # an index: take the checkpoint's spec
            return _spec_of_checkpoint(text)
        if isinstance(config, dict) and "spec" in config and "class_name" not in config:
            config = config["spec"]  # the output of `inspect --json`
        return db.from_config(config)
    return _spec_of_checkpoint(text)


def _spec_of_checkpoint(path: str):
    with checkpoints.open_checkpoint(path) as ckpt:
        if ckpt.spec is None:
            raise db.CheckpointError(f"--spec {path}: this checkpoint carries no spec to take")
        return ckpt.spec


def show_progress(args) -> bool:
    if getattr(args, "progress", None) is not None:
        return bool(args.progress)
    return sys.stderr.isatty()
