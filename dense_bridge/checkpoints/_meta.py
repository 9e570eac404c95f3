"""What canonical and native checkpoint readers share: the spec as JSON in a file's metadata,
comparing a file's tensors with what a spec expects, and the NaN/Inf rule for loaded params.

Kept apart from ``_flows`` so that ``_native`` (native files through adapter verbs) and
``_flows`` (canonical files, save/load/convert) both depend on it and not on each other: no
import circle.
"""
from __future__ import annotations

import json
from typing import Mapping

from .._errors import CheckpointError
from ..params._source import nonfinite_counts
from ._safetensors import parse_json_object, shorten
from ..specs import from_config, layer_config

__all__ = ["spec_json", "spec_from_json", "mismatches", "check_finite_params"]


def spec_json(spec) -> str:
    """The spec's config as compact JSON, as stored in a file's metadata."""
    return json.dumps(layer_config(spec), separators=(",", ":"))


def spec_from_json(text: str, where: str):
    """The spec stored in a file's metadata (None for "" or "null"); every way it can be
    malformed is a CheckpointError naming ``where``."""
    if text in ("", "null"):
        return None

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"{where} has a spec in its metadata that cannot be read: {reason}")

    config = parse_json_object(text.encode("utf-8", "surrogatepass"), bad, "spec JSON")
    try:
        return from_config(config)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a hostile config triggers is the file's fault
        raise bad(f"{type(exc).__name__}: {shorten(str(exc), 300)}") from None


def mismatches(got: Mapping[str, tuple], expected: Mapping[str, tuple], note: str = "") -> list[str]:
    """Every difference between stored and expected (name -> (shape, dtype)), in words."""
    problems = []
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for k in expected:
        if k in got:
            (gs, gd), (es, ed) = got[k], expected[k]
            if tuple(gs) != tuple(es):
                problems.append(f"{k}: file has shape {tuple(gs)}, the spec expects {tuple(es)}{note}")
            elif gd != ed:
                problems.append(f"{k}: file has dtype {gd}, the spec expects {ed}")
    return problems


def check_finite_params(params: Mapping, path: str) -> None:
    """CheckpointError naming ``path`` and each parameter that holds NaN or Inf."""
    bad = nonfinite_counts(params)
    if bad:
        raise CheckpointError(f"{path} holds NaN or Inf parameters ("
                              + "; ".join(f"{k}: {n} value(s)" for k, n in bad.items())
                              + "); pass allow_nonfinite=True to load them anyway")
