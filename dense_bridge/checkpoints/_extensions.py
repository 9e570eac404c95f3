"""Where the checkpoint flows (``_flows``, ``_native``) find the features that extend them from
modules of their own, without importing those modules: each feature imports the flows (to
subclass a checkpoint, to write a file) and registers itself here when the package is imported
(``checkpoints/__init__``), so the import graph has no circle.

- ``quantized``: checkpoints keeping quantized layers' codes (``_quantized``): save, the
  canonical checkpoint with codes, native files holding codes, model directories.
"""
from __future__ import annotations

from typing import Any

#: A hook's answer "not mine: carry on as before".
PASS = object()

#: The ``checkpoints._quantized`` module, registered by the package ``__init__``.
quantized: Any = None
