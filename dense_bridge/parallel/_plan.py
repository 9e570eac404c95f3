"""Tensor parallelism, engine-neutral: which Dense layer is split how, and which block each rank holds.

The plan (``resolve_plan``) turns ``parallel=`` into one :class:`LayerPlan` per Dense position
of a spec: ``"column"`` splits the canonical kernel (in, units) along units (axis 1; bias and
mask with it), ``"row"`` splits it along in_features (axis 0; the mask with it, the bias
replicated, outputs summed). Whether a layer's input arrives sharded along features and whether
its output is gathered follow from its neighbours, so every engine wires the same thing:

- a column layer's output stays sharded only when the next layer is a row layer and everything
  between them (its own activation, Activation/Identity layers) acts element by element;
  otherwise (softmax/log_softmax, Flatten, a replicated or column layer next, the end of the
  model) it is gathered: the last layer's output is always replicated.
- a row layer takes a sharded input when the layer before it left its output sharded, else a
  replicated input which each rank slices locally (no communication).

Shards are equal: the split width must divide by the world size (else SpecError). Rank r holds
block r of the split axis (``shard_index``); in a checkpoint a replicated tensor is written by
rank 0 only (``owned_index``). The engines build their layers from this plan
(backends/<fw>/_parallel.py); the sharded directory stores it (``_sharded_dir``).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np

from .._errors import SpecError, received
from ..activations import Activation
from ..specs import Dense, Flatten, Identity, Sequential

STYLES = ("column", "row")
#: activations that need the whole feature axis: a column layer gathers before them
WHOLE_AXIS = ("softmax", "log_softmax")


class LayerPlan(NamedTuple):
    position: int          # position in the Sequential (0 for a lone Dense)
    style: str             # "column" or "row"
    input_sharded: bool    # row only: the input arrives split along features
    gather_output: bool    # column only: the output is gathered (replicated)


class Shard(NamedTuple):
    """``db.get_params(model, local=True)`` values: this rank's block and where it sits in the
    full canonical tensor (``full[index] == array``)."""
    array: np.ndarray
    index: tuple


def spec_layers(spec) -> tuple:
    """The layers of a Sequential spec, or a lone layer as a 1-tuple (its position is 0)."""
    return spec.layers if isinstance(spec, Sequential) else (spec,)


def elementwise(layer) -> bool:
    """Whether a parameterless layer acts on each feature alone, so a sharded activation may pass it."""
    if isinstance(layer, Flatten):
        return False
    if isinstance(layer, Identity):
        return True
    if isinstance(layer, Activation):
        return layer.name not in WHOLE_AXIS
    return False


def resolve_plan(spec, parallel: Any, world_size: int) -> dict[int, LayerPlan]:
    """``parallel`` ("auto", "column"/"row" for a lone Dense, or {position: style}) -> the plan.

    Raises SpecError for a style that is not column/row, a position that is not a Dense, a lazy
    layer, or a split width that does not divide by ``world_size``.
    """
    layers = spec_layers(spec)
    dense = [i for i, l in enumerate(layers) if isinstance(l, Dense)]
    if isinstance(parallel, str):
        if parallel == "auto":
            styles = {}
            prev_sharded = False
            for i in dense:  # alternate column/row, restarting with column after a gather
                styles[i] = "row" if prev_sharded else "column"
                prev_sharded = styles[i] == "column"
                if prev_sharded:
                    nxt = [j for j in dense if j > i]
                    between = layers[i + 1:nxt[0]] if nxt else None
                    own = layers[i].activation.name not in WHOLE_AXIS
                    prev_sharded = bool(nxt) and own and all(elementwise(l) for l in between)
        elif parallel in STYLES and not isinstance(spec, Sequential):
            styles = {0: parallel}
        else:
            raise SpecError(f'parallel must be "auto", {{position: "column" | "row"}}, or "column"/"row" for a lone '
                            f"Dense. {received('parallel', parallel)}")
    elif isinstance(parallel, Mapping):
        styles = {}
        for k, v in parallel.items():
            if isinstance(k, str) and k.lstrip("-").isdigit():
                k = int(k)
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(layers) or not isinstance(layers[k], Dense):
                raise SpecError(f"parallel keys must be positions of Dense layers (0..{len(layers) - 1}). "
                                f"{received('parallel', dict(parallel))}")
            if v not in STYLES:
                raise SpecError(f'parallel values must be "column" or "row". {received("parallel", dict(parallel))}')
            styles[k] = v
    else:
        raise TypeError(f'parallel must be "auto" or a dict {{position: "column" | "row"}}. {received("parallel", parallel)}')
    plan: dict[int, LayerPlan] = {}
    prev_sharded = False
    for i, layer in enumerate(layers):
        style = styles.get(i)
        if style is None:
            if isinstance(layer, Dense) or not elementwise(layer):
                prev_sharded = False
            continue
        if layer.lazy:
            raise SpecError(f"a parallel layer needs its in_features: layer {i} is lazy. Received: {layer!r}")
        width = layer.units if style == "column" else layer.in_features
        if width % world_size:
            what = "units" if style == "column" else "in_features"
            raise SpecError(f"layer {i} is {style}-parallel over {world_size} ranks, so its {what} must divide by "
                            f"{world_size}. Received: {what}={width}")
        if style == "row":
            plan[i] = LayerPlan(i, "row", prev_sharded, False)
            prev_sharded = False
            continue
        nxt = [j for j in range(i + 1, len(layers)) if isinstance(layers[j], Dense)]
        keep = (bool(nxt) and styles.get(nxt[0]) == "row" and layer.activation.name not in WHOLE_AXIS
                and all(elementwise(l) for l in layers[i + 1:nxt[0]]))
        plan[i] = LayerPlan(i, "column", False, not keep)
        prev_sharded = keep
    return plan


def split_axis(style: str, name: str) -> int | None:
    """The canonical axis ``name`` ("kernel", "bias", "mask") is split along, None if replicated."""
    if style == "column":
        return 1 if name in ("kernel", "mask") else 0
    return 0 if name in ("kernel", "mask") else None


def shard_index(style: str, name: str, shape: tuple, rank: int, world_size: int) -> tuple:
    """Rank ``rank``'s block of a canonical tensor of ``shape``: a tuple of slices."""
    axis = split_axis(style, name)
    index = [slice(0, n) for n in shape]
    if axis is not None:
        step = shape[axis] // world_size
        index[axis] = slice(rank * step, (rank + 1) * step)
    return tuple(index)


def params_plan(spec, plan: Mapping[int, LayerPlan]) -> dict[str, tuple[str | None, tuple]]:
    """Every canonical param key -> (style or None for a replicated layer, full shape)."""
    out = {}
    seq = isinstance(spec, Sequential)
    for i, layer in enumerate(spec_layers(spec)):
        if not hasattr(layer, "param_shapes"):
            continue
        p = plan.get(i)
        for name, shape in layer.param_shapes().items():
            out[(f"{i}." if seq else "") + name] = (p.style if p else None, tuple(shape))
    return out


def owned_index(style: str | None, key: str, shape: tuple, rank: int, world_size: int) -> tuple | None:
    """The block rank ``rank`` writes to a checkpoint: its shard, a replicated tensor only on rank 0."""
    name = key.rsplit(".", 1)[-1]
    if style is None or split_axis(style, name) is None:
        return tuple(slice(0, n) for n in shape) if rank == 0 else None
    return shard_index(style, name, shape, rank, world_size)
