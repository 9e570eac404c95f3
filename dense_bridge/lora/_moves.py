"""How :func:`dense_bridge.transfer` moves linear layers that hold LoRA adapters (``lora=``).

``transfer`` hands every pair of linear layers where either side holds an adapter to
:class:`LoraMoves`; everything else takes transfer's plain path. Modes:

- ``None``: a source adapter is a problem naming the layer (never dropped silently);
- ``"merge"``: the destination kernel gets the source's effective kernel (``lora.effective_kernel``,
  float64, one rounding to the destination dtype); a destination holding an adapter is refused;
- ``"keep"``: the adapter moves in the destination's form (plain, or Keras' per-head) and is
  attached with the destination framework's own adapter class where the layer has none.

Everything is checked while transfer plans (shapes, dtypes, NaN/Inf, a scale the destination must
fold into ``lora_b``); attaching and writing happen with transfer's other writes.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import lora as _lora
from .._errors import ConversionError, SpecError
from ..registry._backends import adapter_for


def _params(layer: Any) -> dict:
    try:
        return _lora.params_of(layer)
    except SpecError as exc:  # an unbuilt lazy layer
        raise ConversionError(str(exc)) from None


class LoraMoves:
    """The LoRA part of one transfer: per destination layer, what to attach and write."""

    def __init__(self, mode: str | None, allow_rounding: bool, dst_model: Any) -> None:
        _lora.check_mode(mode, allow_rounding)
        self.mode = mode
        self.allow_rounding = allow_rounding
        self.dst_model = dst_model
        self.attach: dict[int, tuple[int, bool]] = {}  # id(dst entry) -> (rank, dora)
        self.attached: list[tuple[Any, Any]] = []  # (adapter, dst entry) attached by this transfer
        self.rounding: dict[str, float] = {}  # dst path -> largest abs rounding of lora_b
        self.merged: list[str] = []
        self.kept: list[str] = []
        #: adapters on raw parameters merged as their parameters are read: factor path -> parameter path
        self.raw: dict[str, str] = {}
        self._raw_wrappers: dict[str, str] = {}  # wrapper path -> the parameter path it updates

    def prepare(self, src: Any) -> None:
        """Before planning: with ``lora="merge"``, the updates of ``src``'s adapters on raw parameters
        (an adapter's ``lora_raw_updates`` verb: PEFT's LoRA on a router weight or an expert stack)
        are added to those parameters as they are read (``Side.updates``), so the parameters move
        merged, one rounding, wherever the plan sends them. Other modes leave them to
        :meth:`leftovers`, which names them."""
        verb = getattr(src.adapter, "lora_raw_updates", None)
        if self.mode != "merge" or verb is None:
            return
        for wrapper, param, delta, factors in verb(src.model):
            if src.param(param) is None:
                raise ConversionError(f"src {wrapper!r}: the parameter {param!r} its adapter updates is not one "
                                      f"dense_bridge reads")
            path = src.param(param)
            entry = src.params[path][0]
            if entry.kind in ("linear", "quantized"):  # read in the canonical layout, where no update is added
                raise ConversionError(f"src {wrapper!r} holds an adapter on the parameter {param!r} of the linear layer "
                                      f"{entry.path!r} (LoRA on a raw parameter, not a LoRA linear layer); lora='merge' "
                                      f"merges such adapters into raw parameters only: merge_and_unload() first")
            src.updates[path] = src.updates.get(path, 0) + np.asarray(delta, np.float64)
            self.raw.update({f: path for f in factors})
            self._raw_wrappers[wrapper] = path

    def takes(self, s: Any, d: Any) -> bool:
        """Does this linear pair involve an adapter on either side?"""
        return _lora.lora_of(s.layer) is not None or _lora.lora_of(d.layer) is not None

    def move(self, s: Any, d: Any, writes: list, given: dict | None = None) -> str | None:
        """Queue the move of ``s`` into ``d``; a problem sentence when it cannot be done.

        ``given``: the canonical params (adapter keys included) to move instead of ``s``'s own: one
        piece of a split fused layer, or split layers joined (``lora.split_units`` / ``join_units``)."""
        try:
            src = _params(s.layer) if given is None else given
            dst = _params(d.layer)
        except ConversionError as exc:
            return f"{s.path!r} -> {d.path!r}: {exc}"
        own_s, lora_s = _lora.split(src)
        own_d, lora_d = _lora.split(dst)
        if lora_s and self.mode is None:
            return (f"src {s.where()} holds a LoRA adapter (rank {_lora.rank_of(lora_s)}): pass lora='keep' or "
                    f"lora='merge'")
        if lora_d and self.mode != "keep":
            return (f"dst {d.where()} holds a LoRA adapter{'' if lora_s else ' and src does not'}: "
                    f"db.merge_lora(dst) first, or lora='keep'")
        if not lora_s and lora_d:
            return f"dst {d.where()} holds a LoRA adapter and src {s.where()} has none"
        if self.mode == "merge" and lora_s:  # joined split layers arrive merged already (float64)
            own_s = {**own_s, "kernel": _lora.effective_kernel(own_s["kernel"], lora_s)}
            lora_s = {}
        out, problem = _cast_own(s, d, own_s, own_d)
        if problem:
            return problem
        if not lora_s:
            writes.append((d, "linear", out))
            self.merged.append(d.path)
            return None
        return self._keep(s, d, out, lora_s, lora_d, writes)

    def _keep(self, s, d, own: dict, lora_s: dict, lora_d: dict, writes: list) -> str | None:
        adapter = adapter_for(d.layer)
        if not _lora.has_lora_verbs(adapter) or not hasattr(adapter, "attach_lora"):
            return (f"dst {d.where()}: its framework has no adapter class dense_bridge can attach; use lora='merge'")
        if "lora_magnitude" in lora_s and not adapter.lora_dora():
            return f"dst {d.where()}: its framework has no DoRA adapter class; use lora='merge'"
        heads = adapter.lora_heads(d.layer)
        moved = _lora.to_form(lora_s, heads)
        problems = _lora.check(lora_s, tuple(np.shape(own["kernel"])), f"src {s.where()}")
        if problems:
            return "; ".join(problems)
        dtype = np.asarray(own["kernel"]).dtype
        if lora_d:
            for k in set(moved) | set(lora_d):
                if k not in lora_d or k not in moved:
                    return (f"src {s.where()} adapter has {sorted(moved)} but dst {d.where()} has {sorted(lora_d)} "
                            f"(DoRA on one side only)")
                if np.shape(moved[k]) != np.shape(lora_d[k]):
                    return (f"src {s.where()} {k} {np.shape(moved[k])} does not fit dst {d.where()} {k} "
                            f"{np.shape(lora_d[k])} (adapter ranks differ)")
            dtype = np.asarray(lora_d["lora_a"]).dtype
        else:
            self.attach[id(d)] = (int(np.shape(moved["lora_a"])[-1]), "lora_magnitude" in moved)
        arrays = {k: (np.asarray(v, dtype=np.float64) if k == "lora_scale" else np.asarray(v).astype(dtype))
                  for k, v in moved.items()}
        for k, v in arrays.items():
            if not np.isfinite(v.astype(np.float64)).all():
                return f"src {s.where()} {k} holds NaN or Inf (in dst's dtype {dtype})"
        scale = float(arrays["lora_scale"])
        folds = getattr(adapter, "lora_folds_scale", None)
        if folds is not None and folds() and scale != 1.0:
            exact = arrays["lora_b"].astype(np.float64) * scale
            err = float(np.max(np.abs(exact.astype(dtype).astype(np.float64) - exact))) if exact.size else 0.0
            if err and not self.allow_rounding:
                return (f"dst {d.where()} folds the adapter scale into lora_b: lora_scale={scale!r} rounds it "
                        f"(largest error {err:.3g}; exact only for powers of two): pass allow_rounding=True")
            if err:
                self.rounding[d.path] = err
        writes.append((d, "lora", {**own, **arrays}))
        self.kept.append(d.path)
        return None

    def write(self, d: Any, arrays: dict) -> None:
        """Attach (where needed) and write one queued layer."""
        adapter = adapter_for(d.layer)
        if id(d) in self.attach:
            rank, dora = self.attach.pop(id(d))
            d.layer = adapter.attach_lora(self.dst_model, d.path, d.layer, rank=rank, dora=dora)
            self.attached.append((adapter, d))
        own, lora = _lora.split(arrays)
        with _lora.rounding_allowed(self.allow_rounding):
            _lora.write_params(adapter, d.layer, own, lora)

    def undo(self) -> None:
        """Remove the adapters this transfer attached (a later write failed: all-or-nothing)."""
        while self.attached:
            adapter, d = self.attached.pop()
            try:
                d.layer = adapter.detach_lora(self.dst_model, d.path, d.layer)
            except Exception:  # noqa: BLE001 - restoring as much as possible; the first error is raised
                pass

    def leftovers(self, src_model: Any, moved_src: set) -> list[str]:
        """Problems for adapter parts of ``src_model`` that are not LoRA linear layers (PEFT embedding
        adapters, ``modules_to_save`` copies) whose trained parameters did not move."""
        verb = getattr(adapter_for(src_model, "src"), "lora_leftovers", None)
        problems = []
        raw = getattr(adapter_for(src_model, "src"), "lora_raw_updates", None) is not None
        for path, what, trained in (verb(src_model) if verb is not None else []):
            # an adapter merged into its raw parameter moved with that parameter
            left = [p for p in trained if p not in moved_src and self.raw.get(p) not in moved_src]
            if left:
                how = "pass lora='merge' to merge it into the parameters it updates, or merge_and_unload() first" \
                    if raw and "raw parameters" in what and self.mode != "merge" else \
                    "map them by parameter path, or merge_and_unload() first"
                problems.append(f"src {path!r} is {what}; its parameters {left[:4]}{' ...' if len(left) > 4 else ''} "
                                f"did not move: {how}")
        for wrapper, param in self._raw_wrappers.items():
            if param in moved_src and wrapper not in self.merged:
                self.merged.append(wrapper)
        return problems

    def summary(self) -> dict:
        return {"mode": self.mode, "kept": list(self.kept), "merged": list(self.merged),
                "rounding": dict(self.rounding)}


def _cast_own(s, d, own_s: dict, own_d: dict) -> tuple[dict, str | None]:
    """The layer's own params of ``s`` cast to ``d``'s dtypes, checked like transfer's plain path."""
    if sorted(own_s) != sorted(own_d):
        return {}, (f"src {s.where()} has parameters {sorted(own_s)} but dst {d.where()} has {sorted(own_d)} "
                    f"(a bias or mask on one side only)")
    out = {}
    for k, v in own_s.items():
        if np.shape(v) != np.shape(own_d[k]):
            return {}, (f"src {s.where()} {k} {np.shape(v)} does not fit dst {d.where()} {k} {np.shape(own_d[k])} "
                        f"(canonical layout: kernel (in_features, units))")
        with np.errstate(over="ignore", invalid="ignore"):
            value = np.asarray(v).astype(np.asarray(own_d[k]).dtype)
        if not np.isfinite(np.asarray(value, dtype=np.float32)).all():
            return {}, f"src {s.where()} {k} holds NaN or Inf (in dst's dtype {value.dtype})"
        out[k] = value
    return out, None
