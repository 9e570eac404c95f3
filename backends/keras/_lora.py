"""Keras ``Dense``/``EinsumDense`` after ``enable_lora``: the ``dense_bridge.lora`` verbs on Keras, and
keras-hub's ``.lora.h5`` adapter files.

``enable_lora(rank, lora_alpha=rank)`` adds ``lora_kernel_a`` (kernel.shape[:-1] + (rank,)) and
``lora_kernel_b`` (rank, kernel.shape[-1]); the ``kernel`` property then returns
``_kernel + (lora_alpha / lora_rank) * lora_kernel_a @ lora_kernel_b`` (the base ``_kernel`` stays).
Only the LAST kernel axis is factorised, so:

- ``Dense`` (in, units) and an EinsumDense whose kernel has one output axis (keras-hub's
  ``attention_output``, (heads, head_dim, hidden)) are plain adapters: ``lora_a`` is
  ``lora_kernel_a`` reshaped to (in_features, rank);
- an EinsumDense whose kernel has several output axes (keras-hub's ``query``/``value``,
  (hidden, heads, head_dim)) is per-head: ``lora_a`` (in_features, heads, rank) and ``lora_b``
  (rank, head_dim) shared by the heads (``dense_bridge.lora``'s per-head form).

Keras has no DoRA and no way to remove an adapter: ``detach_lora`` turns it off and untracks
its variables, the layer staying the same object.
"""
from __future__ import annotations

import contextlib
import math

import keras
import numpy as np

from dense_bridge._errors import CheckpointError, ConversionError

from ._arrays import assign_array, read_array
from ._models import einsum_plan
from ._quant import KerasQuantLayer, is_quantized


def _lora_capable(layer) -> bool:
    return isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))


def is_lora(layer) -> bool:
    return bool(getattr(layer, "lora_enabled", False)) and _lora_capable(layer)


@contextlib.contextmanager
def lora_base(layer):
    """The layer with its adapter switched off for the duration: ``kernel`` is then ``_kernel``."""
    if not is_lora(layer):
        yield None
        return
    layer.lora_enabled = False
    try:
        yield layer
    finally:
        layer.lora_enabled = True


def _axes(layer) -> tuple[int, int | None]:
    """(in_features, heads) of a lora-capable layer; heads None for a plain factorisation."""
    if type(layer).__name__ != "EinsumDense":
        return int(layer._kernel.shape[0]), None
    plan = einsum_plan(layer)
    if isinstance(plan, str):
        raise ConversionError(f"EinsumDense {layer.name!r}: {plan}")
    if tuple(plan.perm) != tuple(range(len(plan.perm))):
        raise ConversionError(f"EinsumDense {layer.name!r}: equation {layer.equation!r} orders its kernel axes other "
                              f"than (in..., out...); its LoRA factors have no canonical form here")
    heads = math.prod(plan.out_shape[:-1]) if len(plan.out_shape) > 1 else None
    return plan.in_features, heads


def lora_dora() -> bool:
    """Does this framework have a DoRA adapter class (a magnitude vector)?"""
    return False


def lora_heads(layer):
    return _axes(layer)[1]


def read_lora(layer) -> dict[str, np.ndarray]:
    n_in, heads = _axes(layer)
    a, b = read_array(layer.lora_kernel_a), read_array(layer.lora_kernel_b)
    rank = int(layer.lora_rank)
    a = a.reshape(n_in, heads, rank) if heads else a.reshape(n_in, rank)
    return {"lora_a": a, "lora_b": b,
            "lora_scale": np.array(float(layer.lora_alpha) / rank, dtype=np.float64)}


def alpha_for(scale: float, rank: int) -> float:
    """A ``lora_alpha`` with ``lora_alpha / rank == scale`` exactly (Keras divides in Python floats)."""
    alpha = scale * rank
    for candidate in (alpha, np.nextafter(alpha, np.inf), np.nextafter(alpha, -np.inf)):
        if float(candidate) / rank == scale:
            return float(candidate)
    raise ConversionError(f"no lora_alpha gives lora_alpha / {rank} == {scale!r} exactly in Keras")


def write_lora(layer, lora: dict) -> None:
    if "lora_magnitude" in lora:
        raise ConversionError(f"Keras layer {layer.name!r}: Keras has no DoRA adapter (no magnitude): use lora='merge'")
    if "lora_a" in lora:
        assign_array(layer.lora_kernel_a, np.ascontiguousarray(np.asarray(lora["lora_a"]).reshape(
            tuple(layer.lora_kernel_a.shape))))
    if "lora_b" in lora:
        assign_array(layer.lora_kernel_b, np.ascontiguousarray(lora["lora_b"]))
    if "lora_scale" in lora:
        layer.lora_alpha = alpha_for(float(np.asarray(lora["lora_scale"])), int(layer.lora_rank))


def attach_lora(model, path: str, layer, *, rank: int, dora: bool):
    """Keras' own ``enable_lora(rank)`` on ``layer`` (its factor b starts at zero)."""
    if dora:
        raise ConversionError(f"{path}: Keras has no DoRA adapter class (no magnitude): use lora='merge'")
    layer.enable_lora(rank)
    return layer


def detach_lora(model, path: str, layer):
    """Switch the adapter off and untrack its variables (Keras offers no disable_lora)."""
    layer.lora_enabled = False
    for name in ("lora_kernel_a", "lora_kernel_b"):
        if hasattr(layer, name):
            delattr(layer, name)
    layer.lora_rank = None
    return layer


# ----------------------------------------------------------------------------- quantized bases
# Keras lets ``enable_lora`` wrap an int8/int4 layer (QLoRA: the float factors sit beside the codes).
# Merging dequantizes with Keras' own arithmetic and requantizes with Keras' own quantizer
# (``_quant.KerasQuantLayer``); the layer stays the same object, its codes rewritten in place.
def lora_quantized(base) -> bool:
    """Is the layer under the adapter quantized (Keras ``quantize("int8" | "int4")``)?"""
    return is_quantized(base)


def lora_dequantize(base) -> np.ndarray:
    """The float kernel (in_features, units) Keras computes from the layer's codes."""
    return KerasQuantLayer(base).dequantized()["kernel"]


def lora_requantize(base, kernel: np.ndarray):
    """(codes for ``base`` holding ``kernel`` (in_features, units) quantized by Keras in the layer's own
    mode and block size, not written yet (a ``quant.Candidate``), the float kernel (in_features, units)
    they dequantize to)."""
    handle = KerasQuantLayer(base)
    bias = handle.codes().get("bias")
    candidate = handle.quantize(kernel, bias)
    return candidate, candidate.kernel


def replace_lora(model, path: str, m, layer):
    """Write the requantized codes ``layer`` into ``m`` and remove its adapter."""
    layer.write()
    return detach_lora(model, path, m)


# ----------------------------------------------------------------------------- keras-hub .lora.h5
def _weighted_layers(model) -> list:
    # keras-hub names adapted layers by index in this list (Backbone.save_lora_weights)
    return [lyr for lyr in model._flatten_layers(include_self=False) if lyr.weights]


def save_lora_h5(model, path: str) -> None:
    """keras-hub's ``.lora.h5`` (Keras' H5IOStore layout): ``lora/vars/rank`` and
    ``lora/<index>/vars/lora_kernel_a|b`` per adapted layer.

    The format stores one rank and no alpha (keras-hub loads with scale 1): adapters of another
    scale or of several ranks are refused, naming them."""
    import h5py

    if not str(path).endswith(".lora.h5"):
        raise ConversionError(f"a keras-hub adapter file name ends in .lora.h5. Received: path={path!r}")
    layers = _weighted_layers(model)
    found = [(i, lyr) for i, lyr in enumerate(layers) if is_lora(lyr)]
    if not found:
        raise ConversionError("model holds no Keras LoRA adapters to save")
    ranks = {int(lyr.lora_rank) for _, lyr in found}
    bad = [lyr.name for _, lyr in found if float(lyr.lora_alpha) != float(lyr.lora_rank)]
    if len(ranks) > 1 or bad:
        raise ConversionError(f"keras-hub's .lora.h5 holds one rank and no alpha (scale 1): ranks {sorted(ranks)}, "
                              f"layers with another scale: {bad}")
    with h5py.File(path, "w") as f:
        group = f.create_group("lora")
        group.create_group("vars")["rank"] = ranks.pop()
        for i, lyr in found:
            inner = group.create_group(str(i)).create_group("vars")
            inner["lora_kernel_a"] = read_array(lyr.lora_kernel_a)
            inner["lora_kernel_b"] = read_array(lyr.lora_kernel_b)


def load_lora_h5(model, path: str) -> dict:
    """Read a keras-hub ``.lora.h5`` into ``model`` (layers by index; scale 1), enabling LoRA where needed."""
    import h5py

    layers = _weighted_layers(model)
    try:
        with h5py.File(path, "r") as f:
            rank = int(f["lora/vars/rank"][()])
            data = {int(k): (np.asarray(f[f"lora/{k}/vars/lora_kernel_a"]), np.asarray(f[f"lora/{k}/vars/lora_kernel_b"]))
                    for k in f["lora"].keys() if k != "vars"}
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"cannot read keras-hub adapter file {path}: {exc}") from None
    problems = []
    for i, (a, b) in data.items():
        if i >= len(layers) or not _lora_capable(layers[i]):
            problems.append(f"layer index {i} is not a linear layer of the model")
            continue
        lyr = layers[i]
        want_a = tuple(lyr._kernel.shape[:-1]) + (rank,)
        if a.shape != want_a or b.shape != (rank, lyr._kernel.shape[-1]):
            problems.append(f"layer {i} ({lyr.name}): factors {a.shape}, {b.shape} do not fit {want_a}")
    if problems:
        raise ConversionError(f"cannot load adapter {path} (nothing was attached):\n  - " + "\n  - ".join(problems))
    out = {}
    for i, (a, b) in data.items():
        lyr = layers[i]
        if not is_lora(lyr):
            lyr.enable_lora(rank)
        assign_array(lyr.lora_kernel_a, np.ascontiguousarray(a.astype(read_array(lyr.lora_kernel_a).dtype)))
        assign_array(lyr.lora_kernel_b, np.ascontiguousarray(b.astype(read_array(lyr.lora_kernel_b).dtype)))
        lyr.lora_alpha = float(rank)
        out[lyr.path] = rank
    return out
