"""``dense-bridge check A B`` for two model directories (or one-file models): each loaded by its own library's loader,
run on the same generated tokens, compared layer by layer with the mapping inferred."""
from __future__ import annotations

import os

import numpy as np

from . import _dirs


def is_model_dir(path) -> bool:
    """Whether ``path`` is a directory some installed library's model-directory adapter reads, or a
    one-file model a port format claims (its ``port_detect`` takes files)."""
    try:
        return os.path.exists(path) and _dirs.detect(os.fspath(path)) is not None
    except Exception:  # noqa: BLE001 - any failure to recognise it means "not one"
        return False


def check_dirs(a, b, *, positions: int = 256, seed: int = 0, isolated: bool = False, device=None):
    """The ``compare_models`` report of the two model directories ``a`` and ``b`` (b the reference),
    on ``positions`` generated token positions, the mapping inferred (``mapping="auto"``).

    ``device``: where both models run ("cpu", "cuda", "cuda:N", "gpu", "gpu:N"; a library that
    places nothing runs its model where it puts it); None: each on its framework's GPU when it
    sees one, else the CPU (``registry._devices.place_for_run``). Each side's inputs are made on
    its own model's device.

    Returns:
        ``(report, {"a": format, "b": format, "positions": n, "devices": {"a": device, "b": device}})``
        (each device as its framework's adapter names it, None for a framework that places nothing).
    """
    from ..registry._devices import check_device_value, place_for_run, where
    from ..testing import compare_models
    from ._port import positions_for, token_ids, vocab_of

    check_device_value(device)  # a bad name is refused before any model is loaded
    fa, fb = _dirs.detect(os.fspath(a), "A"), _dirs.detect(os.fspath(b), "B")
    ca = fa.port_contents(os.fspath(a))["config"]
    ma = place_for_run(fa.port_load(os.fspath(a)), device)
    mb = place_for_run(fb.port_load(os.fspath(b)), device)
    vocab = vocab_of(fa, ca, {"": (32, 1)})
    n = positions_for(fa, ca, positions)
    ids = token_ids(vocab, n, seed)
    report = compare_models(ma, mb, [np.asarray(ids)], mapping="auto", grads=False, isolated=isolated)
    return report, {"a": fa.name, "b": fb.name, "positions": n, "devices": {"a": where(ma), "b": where(mb)}}
