"""Adapters of any ranks and scales (a PEFT or mlx-lm adapter moved onto a keras-hub model) written
as keras-hub's ``.lora.h5``, the file ``Backbone.load_lora_weights`` reads.

keras-hub holds ONE rank and ONE scale for every layer: ``Backbone.enable_lora(rank)`` calls each
target layer's ``enable_lora(rank)``, whose ``lora_alpha`` defaults to ``rank`` (scale 1), and the
file stores the rank and the factors only. So each adapter is first put in its layer's own form
(``EinsumDense`` query/value: per-head factors, rank r * heads; ``Dense`` and
``attention_output``: plain), then made one rank and scale 1 exactly by
``dense_bridge.ports._adapters.single_rank_scale``: factors zero-padded to the common (largest)
rank, each layer's scale folded into ``lora_b`` where it is a power of two (exact in floating
point), refused naming the layer where it is not.

keras-hub enables LoRA on every layer whose name it is given (``target_layer_names``; by default
``query``/``value`` and ``query_dense``/``value_dense``), in every block, and reads a factor pair for
each: a layer of those names the adapter does not cover gets zero factors (no update, exactly).
"""
from __future__ import annotations

import numpy as np

from dense_bridge._errors import ConversionError, received

from ._lora import _lora_capable, _weighted_layers, lora_heads, write_lora_h5

#: ``Backbone.default_lora_layer_names()`` of keras-hub 0.32: what ``load_lora_weights`` enables by itself
DEFAULT_NAMES = ("query_dense", "value_dense", "query", "value")


def write_hub_lora(model, path: str, layers: dict, *, allow_nonfinite: bool = False) -> dict:
    """Write canonical adapters of ``model``'s layers as keras-hub's ``.lora.h5``.

    Args:
        model: a keras-hub task model (its ``backbone`` is what ``load_lora_weights`` loads into) or
            backbone, built (its layers hold weights).
        path: the file to write, ending in ``.lora.h5``.
        layers: ``{layer path in model (dense_bridge's walk path): {"lora_a" (in_features, r),
            "lora_b" (r, units), "lora_scale" 0-d}}``, ranks and scales per layer.
        allow_nonfinite: accept NaN/Inf factors.

    Returns:
        ``{"rank": R, "scale": 1.0, "target_layer_names": [...], "default_names": bool, "layers":
        {path: index}, "zero_filled": [index, ...]}``: load it with
        ``backbone.enable_lora(R, target_layer_names=...)`` then ``backbone.load_lora_weights(path)``
        (``default_names``: ``load_lora_weights`` alone enables exactly these layers).
        ConversionError naming the layer: not a Dense/EinsumDense of ``model``, a DoRA adapter, a
        scale whose ratio to 1 is not a power of two; nothing is written then.
    """
    from dense_bridge import lora as _lora
    from dense_bridge.models import walk
    from dense_bridge.ports._adapters import single_rank_scale

    if not str(path).endswith(".lora.h5"):
        raise ConversionError(f"a keras-hub adapter file name ends in .lora.h5. {received('path', path)}")
    backbone = getattr(model, "backbone", model)
    entries = {e.path: e.layer for e in walk(model) if e.kind == "linear"}
    problems, per = [], {}
    for p, entry in layers.items():
        lyr = entries.get(p)
        if lyr is None or not _lora_capable(lyr):
            problems.append(f"layer {p!r}: no Dense/EinsumDense of the keras-hub model has this path")
            continue
        n_in = int(np.prod(lyr._kernel.shape[:-1])) if lora_heads(lyr) is None else int(lyr._kernel.shape[0])
        problems += _lora.check(entry, (n_in, _units(lyr)), repr(p))
        per[p] = _lora.to_form(entry, lora_heads(lyr))
    if problems:
        raise ConversionError(f"{path}: the adapter does not fit the keras-hub model (nothing written):\n  - "
                              + "\n  - ".join(problems[:20]))
    folded, rank, scale = single_rank_scale(per, scale=1.0, where=f"keras-hub adapter {path}")
    weighted = _weighted_layers(backbone)
    index = {id(lyr): i for i, lyr in enumerate(weighted)}
    data, placed = {}, {}
    for p, e in folded.items():
        lyr = entries[p]
        i = index.get(id(lyr))
        if i is None:
            raise ConversionError(f"{path}: layer {p!r} is not inside the backbone keras-hub loads adapters into")
        dtype = np.dtype(lyr.variable_dtype)
        a = np.asarray(e["lora_a"]).reshape(tuple(lyr._kernel.shape[:-1]) + (rank,))
        data[i] = (np.ascontiguousarray(a.astype(dtype)), np.ascontiguousarray(np.asarray(e["lora_b"]).astype(dtype)))
        placed[p] = i
    names = sorted({entries[p].name for p in folded})
    zero = []
    for i, lyr in enumerate(weighted):  # keras-hub enables every layer of these names and reads each one's factors
        if lyr.name in names and i not in data and _lora_capable(lyr):
            dtype = np.dtype(lyr.variable_dtype)
            data[i] = (np.zeros(tuple(lyr._kernel.shape[:-1]) + (rank,), dtype),
                       np.zeros((rank, lyr._kernel.shape[-1]), dtype))
            zero.append(i)
    if not allow_nonfinite:
        bad = [i for i, (a, b) in data.items() if not (np.isfinite(a).all() and np.isfinite(b).all())]
        if bad:
            raise ConversionError(f"{path}: factors of layer indices {bad[:8]} hold NaN/Inf (nothing written)")
    write_lora_h5(path, rank, data)
    default = set(names) <= set(DEFAULT_NAMES) and all(
        (lyr.name not in DEFAULT_NAMES or not _lora_capable(lyr)) or i in data for i, lyr in enumerate(weighted))
    return {"rank": rank, "scale": scale, "target_layer_names": names, "default_names": default,
            "layers": placed, "zero_filled": zero}


def _units(lyr) -> int:
    return int(np.prod(lyr._kernel.shape[1:])) if lora_heads(lyr) is not None else int(lyr._kernel.shape[-1])
