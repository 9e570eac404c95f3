"""Whole checkpoints, one ecosystem's model directory into another's (API.md, "Whole checkpoints"):
:func:`port` and :func:`verify_port`.

The flow is framework-neutral: every fact about a library's directories (file names, config keys,
how its twin is built and saved, its loader) comes from its adapter's model-directory verbs
(``_dirs``). ``_port`` holds the flow, ``_rules`` the recipes learnt from the twins,
``_certificate`` the streamed writing, the certificate and its check.
"""
from __future__ import annotations

from ._certificate import VerifyReport, verify_port
from ._check import check_dirs, is_model_dir
from ._demo import headline
from ._one_file import describe_file
from ._port import PortMismatch, PortReport, port


def formats() -> tuple[str, ...]:
    """Every model-directory format the registered adapters declare (``to=`` names)."""
    from ._dirs import formats as declared

    return tuple(declared())


__all__ = ["port", "verify_port", "PortReport", "VerifyReport", "PortMismatch", "formats", "check_dirs",
           "is_model_dir", "headline", "describe_file"]
