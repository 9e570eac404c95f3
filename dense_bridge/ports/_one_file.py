"""A one-file model (a file some port format reads, that no checkpoint reader knows) described by
the adapter of the format that claims it: what ``dense-bridge inspect`` shows of it."""
from __future__ import annotations

import os

from .._errors import DenseBridgeError
from ..registry._backends import file_format_backends
from ._dirs import Format, formats

__all__ = ["describe_file"]


def describe_file(path: str) -> dict | None:
    """What a port format's adapter says of the one-file model ``path`` (its optional
    ``port_inspect(fmt, path)`` verb): ``{"kind", "files", "bytes", "tensors": [{"name", "shape",
    "dtype"}], "linear_layers": [{"layer", "in_features", "units", "bias", "dtype", "layout", ...}]}``
    with the types as stored; None when no format claims the file. A format that claims it and
    finds it damaged raises its CheckpointError naming the file."""
    if not os.path.isfile(path):
        return None
    one_file = set(file_format_backends())
    for fmt, backend in formats().items():
        # only the file-format backends (no framework behind them) are asked: a framework's adapter
        # would import the whole framework to say no
        if backend not in one_file:
            continue
        try:
            side = Format(fmt)
            if not side.offers("port_inspect") or int(side.port_detect(path)) <= 0:
                continue
        except (DenseBridgeError, OSError):
            continue
        return side.port_inspect(path)
    return None
