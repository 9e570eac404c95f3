"""What JAX tensor parallelism needs across processes, shared by the Keras-on-JAX and Flax
adapters' ``_parallel.py``. JAX is single-controller: one process drives every device, so with
one process both verbs are no-ops; with several (``jax.distributed.initialize``) they use JAX's
own ``multihost_utils``.
"""
from __future__ import annotations

import jax
import numpy as np

__all__ = ["agree_seed", "barrier"]


def agree_seed(seed: int) -> int:
    """Process 0's ``seed`` in every JAX process (``compile(seed=None, parallel=...)``).

    Sent as two uint32 halves: JAX without 64-bit mode would truncate an int64.
    """
    if jax.process_count() == 1:
        return int(seed)
    from jax.experimental import multihost_utils

    halves = np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)
    hi, lo = (int(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(halves)))
    return hi << 32 | lo


def barrier() -> None:
    """Every JAX process reaches this point (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("dense_bridge")
