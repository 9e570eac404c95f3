"""Low-rank adapters (LoRA, rsLoRA, DoRA) as canonical parameters: the maths, neutral of frameworks.

A linear layer wrapped with an adapter is ONE linear layer. Its canonical parameters are the
layer's own (``kernel`` (in_features, units), ``bias`` (units,)) plus:

- ``lora_a`` (in_features, rank) and ``lora_b`` (rank, units);
- ``lora_scale``: a 0-d float64 array, the factor the framework multiplies the update by
  (PEFT ``lora_alpha / r`` or ``lora_alpha / sqrt(r)`` with rsLoRA, mlx-lm's absolute ``scale``,
  Keras ``lora_alpha / rank``, 1 for Flax, which folds any scale into ``lora_b``);
- ``lora_magnitude`` (units,) for DoRA.

The update is ``lora_scale * lora_a @ lora_b``; the effective kernel ``kernel + update``, and for
DoRA ``lora_magnitude * (kernel + update) / norm`` with ``norm`` the 2-norm of each unit's column
over in_features (the bias stays outside).

Per-head form: a Keras ``EinsumDense`` whose kernel is (in_features, heads, head_dim) (keras-hub's
``query``/``value``) factorises as ``lora_a`` (in_features, heads, R) and ``lora_b`` (R, head_dim),
one ``lora_b`` shared by the heads: head h's update is ``A[:, h, :] @ B``. That is exactly the
plain adapter of rank R * heads with ``lora_a = [A_0 | ... | A_{H-1}]`` and ``lora_b`` block-diagonal
with B on each block (:func:`per_head_to_plain`); a plain rank-r adapter is exactly a per-head one
of rank r * heads (:func:`plain_to_per_head`), and the round trip gives back the rank-r factors
bit for bit. ``get_params`` reports the form a layer holds: ``lora_a`` with 3 axes is per-head.

Adapters reach the frameworks through each adapter package's ``_lora.py`` verbs:

- ``lora_base(layer)``: a context manager yielding the object on which the plain
  ``get_params``/``set_params``/``to_spec`` read and write the wrapped layer's own parameters,
  or None when ``layer`` holds no adapter;
- ``read_lora(layer)`` / ``write_lora(layer, lora)``: the adapter keys above, canonical;
- ``lora_heads(layer)``: heads of a per-head factorisation (None: plain);
- ``attach_lora(model, path, layer, *, rank, dora)`` -> the layer, holding the framework's own
  adapter class (zero update) in ``model``; ``detach_lora(model, path, layer)`` -> the wrapped
  layer, the adapter removed from ``model``.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import numpy as np

from .._errors import ConversionError, check_flag, received

__all__ = ["LORA_KEYS", "split", "update", "effective_kernel", "merged_kernel", "per_head_to_plain",
           "plain_to_per_head", "to_form", "check", "fold_scale", "rounding_allowed", "lora_of", "params_of",
           "has_lora_verbs"]

LORA_KEYS = ("lora_a", "lora_b", "lora_scale", "lora_magnitude")


def split(params: dict) -> tuple[dict, dict]:
    """(the layer's own params, its adapter params) of a canonical dict."""
    base = {k: v for k, v in params.items() if k not in LORA_KEYS}
    return base, {k: v for k, v in params.items() if k in LORA_KEYS}


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def plain_factors(lora: dict) -> tuple[np.ndarray, np.ndarray]:
    """(lora_a (in, rank), lora_b (rank, units)) in the plain form, whatever form ``lora`` holds."""
    a, b = np.asarray(lora["lora_a"]), np.asarray(lora["lora_b"])
    if a.ndim == 3:
        return per_head_to_plain(a, b)
    return a, b


def update(lora: dict) -> np.ndarray:
    """``lora_scale * lora_a @ lora_b`` in float64, (in_features, units)."""
    a, b = plain_factors(lora)
    return float(np.asarray(lora["lora_scale"])) * (_f64(a) @ _f64(b))


def effective_kernel(kernel: np.ndarray, lora: dict) -> np.ndarray:
    """The kernel the layer computes with, in float64: W + update, or DoRA's m * (W + update) / norm."""
    v = _f64(kernel) + update(lora)
    if "lora_magnitude" in lora:
        norm = np.linalg.norm(v, axis=0)  # per unit, over in_features
        v = v * (_f64(lora["lora_magnitude"]) / norm)[None, :]
    return v


def merged_kernel(kernel: np.ndarray, lora: dict) -> np.ndarray:
    """:func:`effective_kernel` rounded once to ``kernel``'s dtype."""
    dtype = np.asarray(kernel).dtype
    return effective_kernel(kernel, lora).astype(dtype)


# ----------------------------------------------------------------------------- per-head form
def per_head_to_plain(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-head factors (in, heads, R), (R, head_dim) -> plain (in, rank), (rank, heads*head_dim).

    Rank R * heads with a block-diagonal ``lora_b`` in general. Where the per-head factors are
    :func:`plain_to_per_head`'s (head h uses only its own R/heads columns of A, the same ones for
    every head), the plain rank-R/heads factors come back exactly instead.
    """
    a, b = np.asarray(a), np.asarray(b)
    n_in, heads, big_r = a.shape
    hd = b.shape[1]
    r = big_r // heads if big_r % heads == 0 else 0
    if r:
        blocks = [a[:, h, h * r:(h + 1) * r] for h in range(heads)]
        off = np.ones(a.shape, dtype=bool)
        for h in range(heads):
            off[:, h, h * r:(h + 1) * r] = False
        if not np.any(a[off]) and all(np.array_equal(blocks[0], x) for x in blocks[1:]):
            plain_b = np.concatenate([b[h * r:(h + 1) * r, :] for h in range(heads)], axis=1)
            return np.ascontiguousarray(blocks[0]), plain_b
    plain_a = np.ascontiguousarray(a.reshape(n_in, heads * big_r))
    plain_b = np.zeros((heads * big_r, heads * hd), dtype=b.dtype)
    for h in range(heads):
        plain_b[h * big_r:(h + 1) * big_r, h * hd:(h + 1) * hd] = b
    return plain_a, plain_b


def plain_to_per_head(a: np.ndarray, b: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain factors (in, r), (r, heads*head_dim) -> per-head (in, heads, r*heads), (r*heads, head_dim).

    Head h's A has the plain A in its own block of r columns and zeros elsewhere; the shared B
    stacks each head's slice of the plain B. The factors are the plain ones' values (exact) and
    each head's update is the same sum of products as the plain one's.
    """
    a, b = np.asarray(a), np.asarray(b)
    n_in, r = a.shape
    hd = b.shape[1] // heads
    per_a = np.zeros((n_in, heads, r * heads), dtype=a.dtype)
    for h in range(heads):
        per_a[:, h, h * r:(h + 1) * r] = a
    per_b = np.concatenate([b[:, h * hd:(h + 1) * hd] for h in range(heads)], axis=0)
    return per_a, per_b


def to_form(lora: dict, heads: int | None) -> dict:
    """``lora`` in the plain form (heads None) or the per-head form of ``heads`` heads."""
    a = np.asarray(lora["lora_a"])
    if heads is None and a.ndim == 3:
        pa, pb = per_head_to_plain(a, lora["lora_b"])
        return {**lora, "lora_a": pa, "lora_b": pb}
    if heads is not None and a.ndim == 2:
        pa, pb = plain_to_per_head(a, lora["lora_b"], heads)
        return {**lora, "lora_a": pa, "lora_b": pb}
    return dict(lora)


def rank_of(lora: dict) -> int:
    return int(np.asarray(lora["lora_a"]).shape[-1])


def check(lora: dict, kernel_shape: tuple, where: str) -> list[str]:
    """Problems with an adapter for a layer of canonical kernel (in_features, units)."""
    problems = []
    missing = [k for k in ("lora_a", "lora_b", "lora_scale") if k not in lora]
    if missing:
        return [f"{where}: adapter keys missing: {missing}"]
    n_in, units = kernel_shape
    a, b = plain_factors(lora)
    if a.shape[0] != n_in or b.shape[1] != units or a.shape[1] != b.shape[0]:
        problems.append(f"{where}: lora_a {np.shape(lora['lora_a'])} and lora_b {np.shape(lora['lora_b'])} do not "
                        f"factor a ({n_in}, {units}) kernel update")
    if np.shape(lora["lora_scale"]) != ():
        problems.append(f"{where}: lora_scale must be a 0-d array, received shape {np.shape(lora['lora_scale'])}")
    if "lora_magnitude" in lora and np.shape(lora["lora_magnitude"]) != (units,):
        problems.append(f"{where}: lora_magnitude must be ({units},), received {np.shape(lora['lora_magnitude'])}")
    for k, v in lora.items():
        if not np.isfinite(np.asarray(v, dtype=np.float64)).all():
            problems.append(f"{where}: {k} holds NaN or Inf")
    return problems


# ----------------------------------------------------------------------------- scale folding
_ROUNDING: contextvars.ContextVar = contextvars.ContextVar("dense_bridge_lora_rounding", default=None)


@contextlib.contextmanager
def rounding_allowed(allowed: bool):
    """Within this scope a framework that folds the scale into ``lora_b`` (Flax) may round it when
    ``allowed``; every rounding is recorded in the yielded dict (layer id -> largest abs error)."""
    record: dict = {"allowed": allowed, "max_abs": {}}
    token = _ROUNDING.set(record)
    try:
        yield record
    finally:
        _ROUNDING.reset(token)


def fold_scale(lora_b: np.ndarray, scale: float, where: str, dtype: Any) -> np.ndarray:
    """``scale * lora_b`` rounded to ``dtype`` for a framework without a scale of its own.

    Exact when the scale is a power of two (and nothing under- or overflows); otherwise a
    ConversionError unless inside ``rounding_allowed(True)``, which records the rounding.
    """
    exact = _f64(lora_b) * float(scale)
    folded = exact.astype(dtype)
    err = float(np.max(np.abs(folded.astype(np.float64) - exact))) if exact.size else 0.0
    if err:
        record = _ROUNDING.get()
        if record is None or not record["allowed"]:
            raise ConversionError(
                f"{where}: this framework has no adapter scale of its own; folding lora_scale={float(scale)!r} into "
                f"lora_b rounds it (largest error {err:.3g}; exact only for powers of two). Pass "
                f"allow_rounding=True to accept that")
        record["max_abs"][where] = max(err, record["max_abs"].get(where, 0.0))
    return folded


# ----------------------------------------------------------------------------- adapter dispatch
def has_lora_verbs(adapter: Any) -> bool:
    return hasattr(adapter, "lora_base")


def params_of(layer: Any) -> dict:
    """Canonical params of one native linear layer, adapter keys included where it holds one."""
    from ..registry._backends import adapter_for

    adapter = adapter_for(layer)
    found = read_params(adapter, layer)
    return adapter.get_params(layer) if found is None else found


def lora_of(layer: Any) -> dict | None:
    """The canonical adapter params of one native layer (None: it holds no adapter)."""
    from ..registry._backends import adapter_for

    adapter = adapter_for(layer)
    if not has_lora_verbs(adapter):
        return None
    with adapter.lora_base(layer) as base:
        if base is None:
            return None
    return adapter.read_lora(layer)


def check_mode(lora: Any, allow_rounding: Any) -> None:
    if lora not in (None, "keep", "merge"):
        raise TypeError(f"lora must be None, 'keep' or 'merge'. {received('lora', lora)}")
    check_flag("allow_rounding", allow_rounding)


# ----------------------------------------------------------------------------- get/set_params hooks
@contextlib.contextmanager
def base_of(adapter: Any, native: Any):
    """The object holding ``native``'s own parameters when it wraps an adapter, else None."""
    if not has_lora_verbs(adapter):
        yield None
        return
    with adapter.lora_base(native) as base:
        yield base


def read_params(adapter: Any, native: Any) -> dict | None:
    """Canonical params of an adapter-wrapped layer, adapter keys included (None: no adapter)."""
    with base_of(adapter, native) as base:
        if base is None:
            return None
        own = adapter.get_params(base)
    return {**own, **adapter.read_lora(native)}


def spec_of(adapter: Any, native: Any) -> Any:
    """The spec of the wrapped layer of an adapter-wrapped ``native`` (None: no adapter)."""
    with base_of(adapter, native) as base:
        return None if base is None else adapter.to_spec(base)


def check_for_set(adapter: Any, native: Any, lora: dict, kernel_shape: tuple, *, strict: bool = True) -> dict:
    """Adapter keys given to set_params, checked against the adapter ``native`` holds (shapes and
    form must match: set_params never attaches or resizes one; ``strict``: all of its keys are
    given); returns them as float arrays."""
    have = None
    with base_of(adapter, native) as base:
        if base is not None:
            have = adapter.read_lora(native)
    if have is None and not lora:
        return {}
    if have is None:
        raise ConversionError(f"params hold adapter keys {sorted(lora)} but the layer has no adapter: attach one "
                              f"with the framework's adapter class, or use db.transfer(..., lora='keep'). "
                              f"Received: native={type(native).__name__}")
    problems = [f"unexpected adapter key {k!r} (the layer's adapter has {sorted(have)})" for k in lora if k not in have]
    if strict and any(k not in lora for k in have):
        problems.append(f"missing keys: {[k for k in have if k not in lora]} (the layer holds a LoRA adapter)")
    out = {}
    for k, v in lora.items():
        if k not in have:
            continue
        v = np.asarray(v)
        if v.shape != np.shape(have[k]):
            problems.append(f"expected shape {np.shape(have[k])} for parameter {k}, received {v.shape}")
            continue
        if not np.isfinite(v.astype(np.float64)).all():
            problems.append(f"{k} holds NaN or Inf")
            continue
        out[k] = v.astype(np.float64) if k == "lora_scale" else v.astype(np.asarray(have[k]).dtype)
    if problems:
        raise ConversionError("cannot load parameters:\n  - " + "\n  - ".join(problems))
    return out


def write_params(adapter: Any, native: Any, own: dict, lora: dict) -> None:
    with base_of(adapter, native) as base:
        if own:
            adapter.set_params(base, own)
    if lora:
        adapter.write_lora(native, lora)


def refuse_convert(adapter: Any, native: Any) -> None:
    """convert builds a plain layer: an adapter would be lost, so say what to do instead."""
    with base_of(adapter, native) as base:
        if base is not None:
            raise ConversionError(f"convert builds a plain layer and {type(native).__name__} holds a LoRA adapter: "
                                  f"db.merge_lora(model) first, or db.transfer(src, dst, lora='keep'). "
                                  f"Received: native={type(native).__name__}")


# ----------------------------------------------------------------------------- fused layers
def split_units(lora: dict, units: list[int], heads: int | None = None) -> list[dict]:
    """One fused layer's adapter -> the adapters of its pieces of ``units[i]`` units, in order.

    Every piece keeps the same ``lora_a`` (in_features, rank) and ``lora_scale``, and takes its slice
    of ``lora_b`` (rank, units_i) (and of DoRA's ``lora_magnitude``): each piece's update is exactly
    its columns of the fused update. ``heads``: the fused units interleave per head."""
    from ..models._plan import split_arrays

    a, b = plain_factors(lora)
    return split_arrays({**lora, "lora_a": a, "lora_b": b}, units, heads)


def join_units(loras: list[dict | None], units: list[int], heads: int | None = None) -> tuple[dict, str | None]:
    """The adapters of layers joined along units -> the fused layer's adapter (or a problem sentence).

    ``loras[i]`` is member i's adapter (None: it has none and contributes rank 0); ``units[i]`` its
    width. The joined rank is the sum of the ranks, ``lora_a`` the members' ``lora_a`` side by side
    (in_features, sum r_i), ``lora_b`` block-diagonal (sum r_i, sum units_i): member i's rows hold its
    ``lora_b`` over its units, zeros elsewhere, so the fused update is exactly the members' updates side
    by side. Equal scales stay the joined scale (exact); different ones are folded into their
    ``lora_b`` blocks (one rounding to ``lora_b``'s dtype) under a joined scale of 1."""
    from ..models._plan import join_arrays

    present = [x for x in loras if x]
    doras = {"lora_magnitude" in x for x in present}
    if len(doras) > 1 or (doras == {True} and len(present) != len(loras)):
        return {}, "DoRA on some of the joined layers only: their magnitudes cannot join"
    factors = [plain_factors(x) if x else None for x in loras]
    ins = {f[0].shape[0] for f in factors if f is not None}
    if len(ins) > 1:
        return {}, f"their adapters' lora_a have in_features {sorted(ins)}, and the joined layer has one"
    scales = [float(np.asarray(x["lora_scale"])) for x in present]
    common = scales[0] if all(s == scales[0] for s in scales) else None
    rank = sum(f[1].shape[0] for f in factors if f is not None)
    n_in = ins.pop()
    dtype = np.result_type(*[f[1].dtype for f in factors if f is not None])
    a_parts, b_parts, row = [], [], 0
    for x, f, width in zip(loras, factors, units):
        b = np.zeros((rank, width), dtype)
        if f is not None:
            a_i, b_i = f
            r = b_i.shape[0]
            a_parts.append(np.asarray(a_i).astype(dtype, copy=False))
            scale = 1.0 if common is not None else float(np.asarray(x["lora_scale"]))
            b[row:row + r] = (_f64(b_i) * scale).astype(dtype) if scale != 1.0 else b_i
            row += r
        b_parts.append({"lora_b": b})
    joined, problem = join_arrays(b_parts, heads)
    if problem:
        return {}, problem
    out = {"lora_a": np.concatenate(a_parts, axis=-1) if a_parts else np.zeros((n_in, 0), dtype),
           "lora_b": joined["lora_b"], "lora_scale": np.asarray(1.0 if common is None else common, np.float64)}
    if doras == {True}:
        out["lora_magnitude"] = join_arrays([{"lora_magnitude": x["lora_magnitude"]} for x in loras], heads)[0][
            "lora_magnitude"]
    return out, None
