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
import re

import keras
import numpy as np

from dense_bridge._errors import CheckpointError, ConversionError, received

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
# The file comes from outside: before a value is read, every object is checked (no external links,
# soft links, external storage or virtual datasets: a file reads only its own bytes; no dataset
# declaring more bytes than the file holds), layer keys are canonical indices ("0", "12", never
# "-1" or "00"), and nothing is attached until every layer is validated.
_INDEX = re.compile(r"^(0|[1-9][0-9]{0,8})$")
_MAX_OBJECTS = 100_000  # objects visited in one file: keras-hub writes two per adapted layer


def _weighted_layers(model) -> list:
    # keras-hub names adapted layers by index in this list (Backbone.save_lora_weights)
    return [lyr for lyr in model._flatten_layers(include_self=False) if lyr.weights]


def _nonfinite(name: str, value: np.ndarray) -> str | None:
    bad = int(value.size - np.count_nonzero(np.isfinite(value.astype(np.float64))))
    return f"{name} holds {bad} NaN/Inf value(s) (allow_nonfinite=True accepts them)" if bad else None


def save_lora_h5(model, path: str, *, allow_nonfinite: bool = False) -> None:
    """keras-hub's ``.lora.h5`` (Keras' H5IOStore layout): ``lora/vars/rank`` and
    ``lora/<index>/vars/lora_kernel_a|b`` per adapted layer, ``<index>`` its place among the
    model's layers holding weights (keras-hub's ``Backbone.save_lora_weights``).

    The format stores one rank and no alpha (keras-hub loads with scale 1): adapters of another
    scale or of several ranks are refused, naming them, as are NaN/Inf factors unless
    ``allow_nonfinite``. Written to a temporary file renamed into place: ``path`` holds the old
    file or the whole new one."""
    if not str(path).endswith(".lora.h5"):
        raise ConversionError(f"a keras-hub adapter file name ends in .lora.h5. Received: path={path!r}")
    layers = _weighted_layers(model)
    found = [(i, lyr) for i, lyr in enumerate(layers) if is_lora(lyr)]
    if not found:
        raise ConversionError(f"{path}: model holds no Keras LoRA adapters to save")
    ranks = {int(lyr.lora_rank) for _, lyr in found}
    bad = [lyr.name for _, lyr in found if float(lyr.lora_alpha) != float(lyr.lora_rank)]
    if len(ranks) > 1 or bad:
        raise ConversionError(f"{path}: keras-hub's .lora.h5 holds one rank and no alpha (scale 1): ranks "
                              f"{sorted(ranks)}, layers with another scale: {bad}")
    data = {i: (read_array(lyr.lora_kernel_a), read_array(lyr.lora_kernel_b)) for i, lyr in found}
    if not allow_nonfinite:
        problems = [f"layer {i} ({layers[i].name}): {msg}" for i, (a, b) in data.items()
                    for msg in (_nonfinite("lora_kernel_a", a), _nonfinite("lora_kernel_b", b)) if msg]
        if problems:
            raise ConversionError(f"{path}: nothing written:\n  - " + "\n  - ".join(problems))
    write_lora_h5(path, ranks.pop(), data)


def write_lora_h5(path: str, rank: int, data: dict) -> None:
    """``{layer index: (lora_kernel_a, lora_kernel_b)}`` of one ``rank`` written as keras-hub's
    ``.lora.h5`` (the layout ``Backbone.load_lora_weights`` reads), atomically."""
    import h5py

    from dense_bridge.checkpoints._io import AtomicFiles, check_room

    # HDF5 crashes the process when the system refuses a write mid-file: ask for the room first
    check_room(path, sum(a.nbytes + b.nbytes for a, b in data.values()))
    with AtomicFiles(path) as tx:
        with h5py.File(tx.temp_for(path, ".lora.h5"), "w") as f:
            group = f.create_group("lora")
            group.create_group("vars")["rank"] = int(rank)
            for i, (a, b) in sorted(data.items()):
                inner = group.create_group(str(i)).create_group("vars")
                inner["lora_kernel_a"] = a
                inner["lora_kernel_b"] = b


def _checked_objects(f, path: str, size: int) -> list[str]:
    """Problems with the objects of the open HDF5 file ``f`` (of ``size`` bytes): links that leave
    the file or alias another object, external storage, virtual datasets, datasets declaring more
    bytes than the file has."""
    import h5py

    problems, seen = [], 0
    stack = [("", f)]
    while stack:
        prefix, group = stack.pop()
        for key in group.keys():
            seen += 1
            if seen > _MAX_OBJECTS:
                return problems + [f"more than {_MAX_OBJECTS} objects"]
            name = f"{prefix}/{key}" if prefix else key
            link = group.get(key, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                problems.append(f"{name!r} is an external link to {link.filename!r}:{link.path!r} (a file reads only "
                                f"its own bytes)")
                continue
            if isinstance(link, h5py.SoftLink):
                problems.append(f"{name!r} is a soft link to {link.path!r} (one object under two names)")
                continue
            obj = group.get(key)
            if isinstance(obj, h5py.Group):
                if len(name.split("/")) > 8:
                    problems.append(f"{name!r}: groups nested deeper than keras-hub writes")
                    continue
                stack.append((name, obj))
            elif isinstance(obj, h5py.Dataset):
                if obj.is_virtual:
                    problems.append(f"{name!r} is a virtual dataset (its values live in other files)")
                elif obj.external:
                    problems.append(f"{name!r} keeps its values in external files {[e[0] for e in obj.external]}")
                elif obj.dtype.kind not in "biuf":
                    problems.append(f"{name!r} holds {obj.dtype}, not numbers")
                else:
                    declared = int(np.prod(obj.shape, dtype=np.float64)) * obj.dtype.itemsize if obj.shape else 8
                    if declared > size:
                        problems.append(f"{name!r} declares shape {obj.shape} ({declared} bytes) but the file has "
                                        f"{size} bytes")
            else:
                problems.append(f"{name!r} is a {type(obj).__name__}, not a group or dataset")
    return problems


def load_lora_h5(model, path: str, *, allow_nonfinite: bool = False) -> dict:
    """Read a keras-hub ``.lora.h5`` into ``model`` (layers by index; scale 1), enabling LoRA where needed.

    Every object of the file and every layer is checked before a value is attached (see above);
    NaN/Inf factors are refused unless ``allow_nonfinite``. Returns {layer path: rank}."""
    import os

    import h5py

    from dense_bridge.checkpoints._guard import input_path

    layers = _weighted_layers(model)
    where = f"keras-hub adapter file {path}"
    try:
        with input_path(path, what="keras-hub adapter file") as checked, h5py.File(checked, "r") as f:
            size = os.path.getsize(checked)
            problems = _checked_objects(f, path, size)
            if problems:
                raise CheckpointError(f"cannot read {where}:\n  - " + "\n  - ".join(problems))
            if "lora" not in f or not isinstance(f["lora"], h5py.Group) or "lora/vars/rank" not in f:
                raise CheckpointError(f"cannot read {where}: no lora/vars/rank (keras-hub's layout)")
            rank_set = f["lora/vars/rank"]
            if rank_set.shape != () or rank_set.dtype.kind not in "iu":
                raise CheckpointError(f"{where}: lora/vars/rank must be one integer. Received: {rank_set.dtype} "
                                      f"{rank_set.shape}")
            rank = int(rank_set[()])
            keys = [k for k in f["lora"].keys() if k != "vars"]
            bad = [k for k in keys if not _INDEX.match(k)]
            if bad:
                raise CheckpointError(f"{where}: lora/{bad[0]!r} is not a layer index (0, 1, 2, ...: no sign, no "
                                      f"leading zero). Received keys: {sorted(bad)[:8]}")
            data = {}
            for k in keys:
                names = [f"lora/{k}/vars/lora_kernel_a", f"lora/{k}/vars/lora_kernel_b"]
                absent = [n for n in names if n not in f or not isinstance(f[n], h5py.Dataset)]
                if absent:
                    raise CheckpointError(f"{where}: {absent[0]} is missing")
                data[int(k)] = tuple(np.asarray(f[n][()]) for n in names)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"cannot read {where}: {exc}") from None
    if len(data) != len(keys):
        raise CheckpointError(f"{where}: two file layers name one model layer: {sorted(keys)}")
    problems = []
    if rank < 1:
        problems.append(f"lora/vars/rank: {rank} (a rank is at least 1)")
    plan = []
    for i, (a, b) in sorted(data.items()):
        key = f"lora/{i}"
        if i >= len(layers) or not _lora_capable(layers[i]):
            problems.append(f"{key}: layer index {i} is not a Dense/EinsumDense layer of the model "
                            f"({len(layers)} layers hold weights)")
            continue
        lyr = layers[i]
        want_a = tuple(lyr._kernel.shape[:-1]) + (rank,)
        want_b = (rank, lyr._kernel.shape[-1])
        if a.shape != want_a or b.shape != want_b:
            problems.append(f"{key} ({lyr.name}): factors {a.shape}, {b.shape} do not fit {want_a}, {want_b}")
            continue
        if is_lora(lyr) and int(lyr.lora_rank) != rank:
            problems.append(f"{key} ({lyr.name}): the layer holds an adapter of rank {lyr.lora_rank}, the file {rank}")
            continue
        if not allow_nonfinite:
            problems += [f"{key}/vars/{msg}" for msg in (_nonfinite("lora_kernel_a", a), _nonfinite("lora_kernel_b", b))
                         if msg]
        # the dtype enable_lora gives the factors: the layer's variable dtype
        dtype = read_array(lyr.lora_kernel_a).dtype if is_lora(lyr) else np.dtype(lyr.variable_dtype)
        plan.append((lyr, np.ascontiguousarray(a.astype(dtype)), np.ascontiguousarray(b.astype(dtype))))
    if problems:
        raise ConversionError(f"cannot load adapter {path} (nothing was attached):\n  - " + "\n  - ".join(problems))
    out = {}
    for lyr, a, b in plan:
        if not is_lora(lyr):
            lyr.enable_lora(rank)
        assign_array(lyr.lora_kernel_a, a)
        assign_array(lyr.lora_kernel_b, b)
        lyr.lora_alpha = float(rank)
        out[lyr.path] = rank
    return out


# ----------------------------------------------------------------------------- adapters of any ranks and scales
# keras-hub holds ONE rank and ONE scale for every layer: ``Backbone.enable_lora(rank)`` calls each
# target layer's ``enable_lora(rank)``, whose ``lora_alpha`` defaults to ``rank`` (scale 1), and the
# file stores the rank and the factors only. An adapter moved onto a keras-hub model (PEFT, mlx-lm) is
# first put in its layer's own form (EinsumDense query/value: per-head, rank r * heads; Dense and
# attention_output: plain), then made one rank and scale 1 exactly by
# ``dense_bridge.ports._adapters.single_rank_scale`` (factors zero-padded to the largest rank, each
# scale folded into lora_b where it is a power of two, refused naming the layer where not).
# keras-hub enables LoRA on every layer of the names it is given, in every block, and reads a factor
# pair for each: a layer of those names the adapter does not cover gets zero factors (no update).

#: ``Backbone.default_lora_layer_names()`` of keras-hub 0.32: what ``load_lora_weights`` enables by itself
HUB_DEFAULT_NAMES = ("query_dense", "value_dense", "query", "value")


def write_lora_file(model, path: str, layers: dict, *, allow_nonfinite: bool = False) -> dict:
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
    # Keras numbers a model's name when the process built another of the same name ("<name>_1"):
    # a path whose first component differs is found by the rest of it, where that is unique
    below: dict[str, list] = {}
    for known in entries:
        below.setdefault(known.split("/", 1)[-1], []).append(known)
    problems, per = [], {}
    for p, entry in list(layers.items()):
        if p not in entries and len(below.get(p.split("/", 1)[-1], [])) == 1:
            layers = {**layers, below[p.split("/", 1)[-1]][0]: entry}
            del layers[p]
            p = below[p.split("/", 1)[-1]][0]
        lyr = entries.get(p)
        if lyr is None or not _lora_capable(lyr):
            problems.append(f"layer {p!r}: no Dense/EinsumDense of the keras-hub model has this path")
            continue
        n_in = int(np.prod(lyr._kernel.shape[:-1])) if lora_heads(lyr) is None else int(lyr._kernel.shape[0])
        problems += _lora.check(entry, (n_in, _hub_units(lyr)), repr(p))
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
    default = set(names) <= set(HUB_DEFAULT_NAMES) and all(
        (lyr.name not in HUB_DEFAULT_NAMES or not _lora_capable(lyr)) or i in data for i, lyr in enumerate(weighted))
    return {"rank": rank, "scale": scale, "target_layer_names": names, "default_names": default,
            "layers": placed, "zero_filled": zero}


def _hub_units(lyr) -> int:
    return int(np.prod(lyr._kernel.shape[1:])) if lora_heads(lyr) is not None else int(lyr._kernel.shape[-1])
