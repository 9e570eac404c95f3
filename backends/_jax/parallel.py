"""What JAX tensor parallelism needs whatever the module library, shared by the Keras-on-JAX and
Flax adapters' ``_parallel.py``: agreeing on a seed and a barrier across JAX processes, this
process's block of a sharded array, and the check of every variable's live sharding against the
plan. JAX is single-controller: one process drives every device, so with one process the
seed and barrier are no-ops; with several (``jax.distributed.initialize``) they use JAX's own
``multihost_utils``.
"""
from __future__ import annotations

import jax
import numpy as np

from dense_bridge._errors import SpecError
from dense_bridge.parallel._plan import Shard, split_axis
from dense_bridge.specs import Dense

__all__ = ["agree_seed", "barrier", "addressable_block", "layout_problems"]


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


def addressable_block(array) -> Shard:
    """The bounding block of the shards of ``array`` this process addresses, as a read-only
    canonical :class:`Shard`, checked to be tiled by them exactly (replicas counted once; in one
    process: the whole tensor)."""
    shape = tuple(int(d) for d in array.shape)
    blocks = {}
    for s in array.addressable_shards:
        blocks[tuple(sl.indices(d)[:2] for sl, d in zip(s.index, shape))] = s
    lo = [min(b[a][0] for b in blocks) for a in range(len(shape))]
    hi = [max(b[a][1] for b in blocks) for a in range(len(shape))]
    first = np.asarray(next(iter(blocks.values())).data)
    out = np.empty([h - l for l, h in zip(lo, hi)], dtype=first.dtype)
    covered = 0
    for b, s in blocks.items():
        out[tuple(slice(x - l, y - l) for (x, y), l in zip(b, lo))] = np.asarray(s.data)
        covered += int(np.prod([y - x for x, y in b]))
    if covered != out.size:
        raise SpecError(f"this process's shards of a tensor of shape {shape} do not form one block")
    out.flags.writeable = False
    return Shard(out, tuple(slice(l, h) for l, h in zip(lo, hi)))


def layout_problems(shapes: dict[str, list[tuple[int, ...]]], layers, plan: dict, n: int, keyed: bool) -> list[str]:
    """Every Dense variable whose live device shards (``shapes``: canonical key -> each device's
    shard shape) differ from the plan: a planned kernel/bias/mask split ``n`` ways along its
    planned axis, every other one whole on every device. ``keyed``: keys carry positions ("0.kernel")."""
    wrong = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, Dense):
            continue
        style = plan[i].style if i in plan else None
        for key, full in layer.param_shapes().items():
            name = (f"{i}." if keyed else "") + key
            axis = None if style is None else split_axis(style, key)
            want = tuple(d // n if a == axis else d for a, d in enumerate(full))
            got = set(shapes.get(name, []))
            if got != {want}:
                wrong.append(f"{name} ({style or 'replicated'}): device shards {sorted(got)}, expected {want}")
    return wrong
