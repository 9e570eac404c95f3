"""The demo's headline step: a tiny random model saved by the first library that offers one,
ported to every other installed model-directory format and back, each directory loaded by its own
library's loader, logits compared, the round trip checked bit for bit, the certificates summarised."""
from __future__ import annotations

import os
import time

import numpy as np

from .._errors import BackendUnavailableError, DenseBridgeError
from ..checkpoints._safetensors import SafetensorsFile
from ..registry._backends import available_backends
from . import _dirs
from ._port import port, token_ids


def _tensors_bytes(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(path, name)) as f:
                for key in f.keys():
                    out[key] = f.get(key).tobytes()
    return out


def headline(workdir: str, seed: int = 0) -> list[dict]:
    """Rows ``{"step", "backends", "passed", "seconds", "detail", "max_abs_error"}``; empty when fewer
    than two model-directory formats are installed."""
    installed = set(available_backends())
    names = [f for f, b in _dirs.formats().items() if b in installed]
    rows: list[dict] = []
    if len(names) < 2:
        return rows
    first, src = None, None
    for name in names:
        path = os.path.join(workdir, f"model-{name}")
        try:
            _dirs.Format(name).port_example(path, seed)
        except (DenseBridgeError, ImportError):
            continue
        first, src = _dirs.Format(name), path
        break
    if first is None:
        return rows
    ids = token_ids(128, 256, seed)
    ref_logits = first.port_logits(first.port_load(src), ids)
    for name in names:
        if name == first.name:
            continue
        other = _dirs.Format(name)
        if other.offers("port_write"):  # one-file formats carry a tokenizer, which the example has not
            continue
        there, back = os.path.join(workdir, f"ported-{name}"), os.path.join(workdir, f"back-{first.name}-from-{name}")
        t = time.perf_counter()
        try:
            report = port(src, there, to=name, progress=False)
        except BackendUnavailableError:  # the framework is installed, the library on top of it is not
            continue
        logits = other.port_logits(other.port_load(there), ids)
        err = float(np.max(np.abs(logits.astype(np.float64) - ref_logits)))
        v = report.verification
        rows.append({"step": "port a model directory (db.port)", "backends": f"{first.name} -> {name}",
                     "passed": bool(v["passed"]), "seconds": time.perf_counter() - t, "max_abs_error": err,
                     "detail": f"{report.tensors} tensors, verified {v['mode']} on {v['positions']} positions, "
                               f"KL {v['kl_divergence']:.1e}, top-1 {v['top1_agreement']:.0%}; logits of "
                               f"{name}'s own loader vs {first.name}'s"})
        t = time.perf_counter()
        back_report = port(there, back, to=first.name, progress=False)
        same = _tensors_bytes(src) == _tensors_bytes(back)
        logits = first.port_logits(first.port_load(back), ids)
        err = float(np.max(np.abs(logits.astype(np.float64) - ref_logits)))
        exact = sum(t["exact"] for t in back_report.certificate["tensors"].values())
        rows.append({"step": "port it back, round trip", "backends": f"{name} -> {first.name}",
                     "passed": same and bool(back_report.verification["passed"]),
                     "seconds": time.perf_counter() - t, "max_abs_error": err,
                     "detail": ("every tensor bit-identical to the original" if same else "tensors differ") +
                               f"; certificate: {exact}/{back_report.tensors} tensors exact"})
    return rows
