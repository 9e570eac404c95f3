"""Twins whose weights pair but whose libraries compute different functions: measured, and named.

When the twins disagree, ``_port`` runs every linear layer of the destination twin alone on what
its counterpart in the source twin received (``compare_models(isolated=True)``, teacher forcing):

- a linear layer that disagrees run alone: the mapping (or a weight's layout) is wrong;
- every one agrees and the next-token distributions stay close (``_port._KL_LIMIT``, ``_TOP1_LIMIT``):
  a library difference small enough to port, named as a discrepancy;
- every one agrees and the distributions part: the weights pair (the mapping was found), but the
  destination library's code computes another function than the source's for this config. That
  is refused (:func:`refusal`), naming where the values part (between which linear layers), the
  KL and top-1 agreement, the settings of the source's config that the destination's config
  does not take (the ``fields`` of each side's ``port_describe``: the source's declared settings,
  set to something, that the destination has no field for), and, where one is found, the setting
  whose removal from the source's config makes the source library compute what the destination
  computes: the source twin is rebuilt with it left out (removed, or a number set to 1 or 0: the
  same parameters, by the same seed and shapes) and its logits compared with the destination twin's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .._errors import DenseBridgeError

__all__ = ["Isolation", "isolate", "untaken", "refusal"]

#: At most this many source twins are rebuilt with one setting left out (``_probes``).
_TRIED = 16


@dataclass
class Isolation:
    """What the isolated comparison of two twins found: ``agree`` (every linear layer of b run
    alone agrees with its counterpart), ``kl`` and ``top1`` (next-token KL divergence and top-1
    agreement of the two models' logits), ``place`` (words for where their values first part)."""

    agree: bool
    kl: float
    top1: float
    place: str

    def discrepancy(self, src: str, dst: str, kl_limit: float, top1_limit: float) -> str | None:
        """Words for a difference small enough to port (every layer agrees alone, the distributions
        within the limits), or None."""
        if not self.agree or self.kl > kl_limit or self.top1 < top1_limit:
            return None
        return (f"every linear layer agrees run alone, but the {src} and {dst} models compute different "
                f"functions {self.place}: next-token KL {self.kl:.3g}, top-1 agreement {self.top1:.4f}")


def isolate(a, b, ids, rules, src_fmt, dst_fmt, compare_models, kl_top1: Callable, inputs) -> Isolation:
    """Every linear layer of ``b`` run alone on what its counterpart in ``a`` received, and the two
    models' next-token distributions on ``ids`` (``kl_top1(logits_a, logits_b)``); ``inputs``: the
    models' inputs as ``compare_models`` takes them."""
    iso = compare_models(a, b, inputs, mapping=rules, grads=False, isolated=True)
    rows = [q for layer in iso.layers for q in layer.quantities]
    own = [q for q in rows if q.quantity != "input" and q.layer is not None]
    agree = bool(own) and all(q.passed for q in own)
    kl, top1 = kl_top1(src_fmt.port_logits(a, ids), dst_fmt.port_logits(b, ids))
    at = next((i for i, q in enumerate(rows) if q.quantity == "input" and not q.passed), None)
    enters = None if at is None else rows[at]
    if enters is None:
        place = "after the last linear layer"
    else:
        before = next((q.layer_type for q in reversed(rows[:at])
                       if q.layer is not None and q.layer_type != enters.layer_type), None)
        place = (f"between the linear layer before {enters.layer_type!r} and it ({enters.units:.3g} tolerance units)"
                 if before is None else f"between {before!r} and {enters.layer_type!r} ({enters.units:.3g} tolerance "
                                        f"units at the input of the latter)")
    return Isolation(agree, kl, top1, place)


def _neutral(value: Any) -> bool:
    """A setting that asks for nothing (absent, off, zero, empty)."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, (str, list, tuple, dict)) and not value


def _settings(config: dict, declared: frozenset[str]) -> list[tuple[str, Any]]:
    """(name, value) of each declared setting of ``config`` set to something; a dictionary's
    entries one by one, named ``"outer.inner"``."""
    out = []
    for k in sorted(declared):
        v = config.get(k)
        if isinstance(v, dict):
            out += [(f"{k}.{i}", x) for i, x in v.items() if not _neutral(x) and not isinstance(x, dict)]
        elif not _neutral(v):
            out.append((k, v))
    return out


def untaken(src_fmt, dst_fmt, src_cfg: dict, dst_cfg: dict) -> list[tuple[str, Any]] | None:
    """The settings of the source's config (those its library declares, set to something) that the
    destination's config for the same model does not take (no field of that name, nor, for a
    dictionary's entry, of its inner name, nor an entry of that name in a dictionary it takes);
    None where a side cannot say."""
    src = (src_fmt.port_describe(src_cfg) or {}).get("fields")
    dst = (dst_fmt.port_describe(dst_cfg) or {}).get("fields")
    if not src or not dst:
        return None
    # a dictionary the destination takes holds settings under their own names (rope_parameters' rope_theta)
    held = {k for f in dst if isinstance(dst_cfg.get(f), dict) for k in dst_cfg[f]}
    out = []
    for name, value in _settings(src_cfg, frozenset(src) - {"model_type"}):  # the key that selects the model
        leaf = name.partition(".")[2] or name
        if name in dst or leaf in dst or leaf in held:
            continue
        out.append((name, value))
    return out


def _with(config: dict, name: str, value: Any = None, drop: bool = False) -> dict:
    """``config`` with the setting ``name`` (``"outer.inner"``: a dictionary's entry) set to
    ``value``, or removed with ``drop``."""
    outer, _, inner = name.partition(".")
    out = dict(config)
    if inner:
        entry = {k: v for k, v in out[outer].items() if k != inner}
        if not drop:
            entry[inner] = value
        out[outer] = entry
    elif drop:
        out.pop(outer, None)
    else:
        out[outer] = value
    return out


def _probes(candidates: list[tuple[str, Any]]) -> list[tuple[str, str, dict]]:
    """(name, words, change) per way of leaving a setting out: removed (its library's default, which
    may be the same value), and for a number the values that ask for nothing (1, a factor; 0, an
    amount), for a flag the other one. Numbers first: a factor a library ignores is the usual case."""
    def order(c):
        v = c[1]
        return (0 if isinstance(v, (int, float)) and not isinstance(v, bool) else 1 if isinstance(v, bool) else 2, c[0])

    out = []
    for name, value in sorted(candidates, key=order):
        out.append((name, "removed", {"drop": True}))
        if isinstance(value, bool):
            out.append((name, f"set to {not value!r}", {"value": not value}))
        elif isinstance(value, (int, float)):
            for v in (1, 0):
                if value != v:
                    out.append((name, f"set to {type(value)(v)!r}", {"value": type(value)(v)}))
    return out


def _cause(candidates, src_fmt, dst_fmt, src_cfg: dict, b, ids, rebuild: Callable, shapes: dict, kl_top1,
           kl_limit: float, top1_limit: float) -> tuple[str, str, float, float] | None:
    """(name, how it was left out, KL, top-1) of the first setting among ``candidates`` whose
    leaving out (:func:`_probes`) makes the source twin (rebuilt by ``rebuild(config)`` with the same
    parameter shapes, hence values) compute what ``b`` computes; None when none does."""
    reference = dst_fmt.port_logits(b, ids)
    for name, how, change in _probes(candidates)[:_TRIED]:
        cfg = _with(src_cfg, name, **change)
        try:
            if src_fmt.port_shapes(cfg) != shapes:
                continue
            kl, top1 = kl_top1(src_fmt.port_logits(rebuild(cfg), ids), reference)
        except Exception:  # noqa: BLE001 - a config its library cannot build so
            continue
        if np.isfinite(kl) and kl <= kl_limit and top1 >= top1_limit:
            return name, how, kl, top1
    return None


def refusal(iso: Isolation, src_fmt, dst_fmt, src_cfg: dict, dst_cfg: dict, b, ids, rebuild: Callable, kl_top1,
            kl_limit: float, top1_limit: float) -> str:
    """The PortMismatch message for twins whose weights pair but whose libraries compute different
    functions (module docstring).

    Args:
        iso: the isolated comparison's findings (``agree`` True).
        src_cfg, dst_cfg: the twins' own configs; ``b``: the destination twin; ``ids``: its token ids.
        rebuild: ``rebuild(config) -> source twin`` for a source config (the same seed).
        kl_top1: ``(logits_a, logits_b) -> (KL, top-1)``; ``kl_limit``, ``top1_limit``: what agrees.
    """
    src, dst = src_fmt.name, dst_fmt.name
    words = (f"the {src} and {dst} libraries' models compute different functions for this config (nothing was "
             f"written): every linear layer agrees run alone on what its counterpart received, so the weights pair "
             f"(the mapping was found), but the values part {iso.place}, and the next-token distributions differ "
             f"(KL {iso.kl:.3g}, top-1 agreement {iso.top1:.4f}; a port needs KL <= {kl_limit:g} and top-1 >= "
             f"{top1_limit:g}): {dst}'s code for this model computes otherwise than {src}'s")
    try:
        dropped = untaken(src_fmt, dst_fmt, src_cfg, dst_cfg)
    except DenseBridgeError:
        dropped = None
    if dropped:
        try:
            found = _cause(dropped, src_fmt, dst_fmt, src_cfg, b, ids, rebuild, src_fmt.port_shapes(src_cfg),
                           kl_top1, kl_limit, top1_limit)
        except DenseBridgeError:
            found = None
        if found is not None:
            name, how, kl, top1 = found
            value = dict(dropped)[name]
            words += (f". The cause: {dst}'s config for this model has no setting for {name}={value!r}; with it "
                      f"{how}, {src} computes what {dst} computes (KL {kl:.3g}, top-1 agreement {top1:.4f}), so "
                      f"{dst} cannot run this model as {src} does")
        listed = ", ".join(f"{n}={v!r}" for n, v in dropped[:10]) + (" ..." if len(dropped) > 10 else "")
        words += f". Settings of the {src} config that {dst}'s config for this model does not take: {listed}"
    elif dropped is not None:
        words += f"; {dst}'s config takes every setting the {src} config declares, so the difference lies in its code"
    return words + (". Port to a library that implements this configuration, or ask the destination library's "
                    "maintainers; nothing here can make the two compute the same function")
