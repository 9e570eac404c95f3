"""Twins whose weights pair but whose libraries compute different functions: measured, and named.

When the twins disagree, ``_port`` runs every linear layer of the destination twin alone on what
its counterpart in the source twin received (``compare_models(isolated=True)``, teacher forcing):

- a linear layer that disagrees run alone: the mapping (or a weight's layout) is wrong;
- every one agrees and the next-token distributions stay close (``_port._KL_LIMIT``, ``_TOP1_LIMIT``):
  a library difference small enough to port, named as a discrepancy;
- every one agrees and the distributions part: the weights pair (the mapping was found), but the
  twins compute different functions. That is refused (:func:`refusal`), naming where the values
  part (between which linear layers), the KL and top-1 agreement, and why, from the two configs'
  settings (:func:`compare_settings`: each side's ``port_describe`` ``fields``, the settings its
  library's config declares with the values it computes with):

  - a setting the destination takes with another value than the source's (a rope base lost in
    translation) that explains the difference: the source twin rebuilt with the destination's
    value (the same parameters: the same seed and shapes) computes what the destination twin
    computes. The port's translation is at fault, and the message says so;
  - else the destination library's code computes otherwise for this config: the settings of the
    source it has no field for are listed, and the one whose leaving out (removed, or a number
    set to 1 or 0) makes the rebuilt source twin compute what the destination computes is named
    as the cause; failing that, the destination's settings the source has no field for are
    probed the same way on the destination twin (rebuilt, the source twin's weights moved in by
    the twins' mapping: :func:`destination_builder`), naming a value the source's code assumes;
    the settings the destination adds, and those whose values differ, are listed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .._errors import DenseBridgeError

__all__ = ["Isolation", "isolate", "Settings", "compare_settings", "refusal"]

#: At most this many twins are rebuilt with one setting left out (``_probes``; a change of the weights'
#: shapes is not counted: no twin is built for it).
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


def _settings(values: dict) -> dict[str, Any]:
    """Each setting of ``values`` (name -> value) set to something; a dictionary's entries one by
    one, named ``"outer.inner"``."""
    out = {}
    for k in sorted(values):
        v = values[k]
        if isinstance(v, dict):
            out.update({f"{k}.{i}": x for i, x in v.items() if not _neutral(x) and not isinstance(x, dict)})
        elif not _neutral(v):
            out[k] = v
    return out


def _plain(v: Any) -> Any:
    """A value as JSON holds it (tuples as lists, integers as floats), to compare two configs' values."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return v


@dataclass
class Settings:
    """How the two twins' configs compare, setting by setting (values as each library computes with
    them): ``untaken`` (source settings the destination has no field for), ``lost`` (source settings
    the destination takes, holding another value: name -> (source value, destination value)),
    ``added`` (destination settings the source has no field for, at the destination's values)."""

    untaken: dict[str, Any]
    lost: dict[str, tuple[Any, Any]]
    added: dict[str, Any]


def compare_settings(src_fmt, dst_fmt, src_cfg: dict, dst_cfg: dict) -> Settings | None:
    """The :class:`Settings` of the twins' configs (each side's ``port_describe`` ``fields``: the
    settings its library's config declares for the model, with the values it computes with); a
    setting is the destination's when it has a field of its name, of a dictionary entry's inner
    name, or an entry of that name in a dictionary it takes (rope_parameters' rope_theta); None
    where a side cannot say."""
    src = (src_fmt.port_describe(src_cfg) or {}).get("fields")
    dst = (dst_fmt.port_describe(dst_cfg) or {}).get("fields")
    if not src or not dst:
        return None

    def finder(values: dict):
        flat = _settings(values)
        held = {i: x for v in values.values() if isinstance(v, dict) for i, x in v.items()}

        def find(name: str):
            leaf = name.partition(".")[2] or name
            for table in (flat, values, held):
                if name in table:
                    return True, table[name]
                if leaf in table:
                    return True, table[leaf]
            return False, None
        return flat, find

    src_flat, in_src = finder(src)
    dst_flat, in_dst = finder(dst)
    untaken, lost, added = {}, {}, {}
    for name, value in src_flat.items():
        taken, theirs = in_dst(name)
        if not taken:
            untaken[name] = value
        elif _plain(theirs) != _plain(value):
            lost[name] = (value, theirs)
    for name, value in dst_flat.items():
        if not in_src(name)[0]:
            added[name] = value
    return Settings(untaken, lost, added)


def _special(fmt, cfg: dict) -> dict[str, Any]:
    """The settings of ``cfg`` (``fmt``'s config; its ``port_describe`` ``fields``) whose values differ
    from those ``fmt``'s library gives a config naming only its kind (the defaults), each set to
    something; {} where ``fmt`` cannot say."""
    try:
        described = fmt.port_describe(cfg) or {}
        own, kind = described.get("fields"), described.get("kind_only")
        default = (fmt.port_describe(kind) or {}).get("fields") if kind else None
    except DenseBridgeError:
        return {}
    if not own or not default:
        return {}
    flat, base = _settings(own), _settings(default)
    return {k: v for k, v in flat.items() if k in base or "." not in k
            if _plain(base.get(k)) != _plain(v)}


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


def _cause(probes, fmt, cfg: dict, rebuild: Callable, reference: np.ndarray, ids, kl_top1, kl_limit: float,
           top1_limit: float, source: bool = True) -> tuple[str, str, float, float] | None:
    """(name, how it was changed, KL, top-1) of the first of ``probes`` ((name, words, change) per
    change of one setting of ``cfg``, ``fmt``'s config) that makes the twin rebuilt by
    ``rebuild(config)`` (the same parameter shapes, hence values) compute what the other twin
    computes (its logits ``reference``; ``source``: the rebuilt twin is the source, whose
    distribution the KL is taken from); None when none does."""
    shapes = fmt.port_shapes(cfg)
    tried = 0
    for name, how, change in probes:
        if tried >= _TRIED:
            break
        changed = _with(cfg, name, **change)
        try:
            if fmt.port_shapes(changed) != shapes:
                continue  # another model (a width put back): not run, not counted
            tried += 1
            got = fmt.port_logits(rebuild(changed), ids)
            kl, top1 = kl_top1(got, reference) if source else kl_top1(reference, got)
        except Exception:  # noqa: BLE001 - a config its library cannot build so
            continue
        if np.isfinite(kl) and kl <= kl_limit and top1 >= top1_limit:
            return name, how, kl, top1
    return None


def destination_builder(a, dst_fmt, transfer, rules, device=None) -> Callable:
    """``rebuild(config) -> destination twin``: the destination's model for ``config`` with ``a``'s
    weights moved in by ``rules`` (the twins' mapping), for probing a setting on that side."""
    from ..registry._devices import place_for_run

    def rebuild(cfg: dict):
        twin = place_for_run(dst_fmt.port_twin(cfg, seed=1), device)
        transfer(a, twin, mapping=rules, verify=False)
        return twin
    return rebuild


def _listed(values: dict, pairs: bool = False) -> str:
    items = list(values.items())
    words = [f"{n}={v[0]!r} (there {v[1]!r})" if pairs else f"{n}={v!r}" for n, v in items[:10]]
    return ", ".join(words) + (" ..." if len(items) > 10 else "")


def refusal(iso: Isolation, src_fmt, dst_fmt, src_cfg: dict, dst_cfg: dict, a, b, ids, rebuild: Callable, kl_top1,
            kl_limit: float, top1_limit: float, rebuild_dst: Callable | None = None) -> str:
    """The PortMismatch message for twins whose weights pair but that compute different functions
    (module docstring): a setting lost in translating the config, where rebuilding the source twin
    with the destination's value explains the difference; else the two libraries' code, with the
    setting that explains it where one does.

    Args:
        iso: the isolated comparison's findings (``agree`` True).
        src_cfg, dst_cfg: the twins' own configs; ``a``, ``b``: the twins; ``ids``: their token ids.
        rebuild: ``rebuild(config) -> source twin`` for a source config (the same seed).
        rebuild_dst: ``rebuild_dst(config) -> destination twin`` holding ``a``'s weights
            (:func:`destination_builder`), or None: the destination's own settings are not probed.
        kl_top1: ``(logits_a, logits_b) -> (KL, top-1)``; ``kl_limit``, ``top1_limit``: what agrees.
    """
    src, dst = src_fmt.name, dst_fmt.name
    measured = (f"every linear layer agrees run alone on what its counterpart received, so the weights pair (the "
                f"mapping was found); the values part {iso.place}; next-token KL {iso.kl:.3g}, top-1 agreement "
                f"{iso.top1:.4f} (a port needs KL <= {kl_limit:g} and top-1 >= {top1_limit:g})")
    try:
        settings = compare_settings(src_fmt, dst_fmt, src_cfg, dst_cfg)
        src_logits, dst_logits = src_fmt.port_logits(a, ids), dst_fmt.port_logits(b, ids)
    except DenseBridgeError:
        settings = None
    limits = (kl_top1, kl_limit, top1_limit)
    if settings is not None and settings.lost:
        probes = [(n, f"set to {v[1]!r}", {"value": v[1]}) for n, v in settings.lost.items()]
        found = _cause(probes, src_fmt, src_cfg, rebuild, dst_logits, ids, *limits)
        if found is not None:
            name, _, kl, top1 = found
            value, theirs = settings.lost[name]
            return (f"the twins disagree because a setting was lost in translating the config (nothing was written): "
                    f"{name}={value!r} in the {src} config is {theirs!r} in the {dst} config the port wrote; with "
                    f"{theirs!r} the {src} model computes what the {dst} model computes (KL {kl:.3g}, top-1 agreement "
                    f"{top1:.4f}). The port's translation is at fault: report it, with the source's config. "
                    f"{measured[0].upper()}{measured[1:]}")
    head = f"the {src} and {dst} libraries compute different functions for this config (nothing was written): "
    found = added = None
    if settings is not None and settings.untaken:
        found = _cause(_probes(list(settings.untaken.items())), src_fmt, src_cfg, rebuild, dst_logits, ids, *limits)
    special = None
    if found is None and settings is None:  # the destination cannot say which settings it takes: the source's
        # settings away from its library's default, each put back to the default, may still name the cause
        special = _special(src_fmt, src_cfg)
        if special:
            found = _cause([p for p in _probes(list(special.items())) if p[1] == "removed"], src_fmt, src_cfg,
                           rebuild, dst_logits, ids, *limits)
    if found is None and settings is not None and settings.added and rebuild_dst is not None:
        added = _cause(_probes(list(settings.added.items())), dst_fmt, dst_cfg, rebuild_dst, src_logits, ids, *limits,
                       source=False)
    if found is not None and special is not None:
        name, how, kl, top1 = found
        words = (head + f"{name}={special[name]!r} in the {src} config is not its library's default; with it {how} "
                 f"(the default), {src} computes what {dst} computes (KL {kl:.3g}, top-1 agreement {top1:.4f}), so "
                 f"{dst}'s model for this config does not do what {name} asks ({dst}'s config has no such setting, or "
                 f"the translation into it leaves it out) and cannot run this model as {src} does. "
                 f"{measured[0].upper()}{measured[1:]}")
    elif found is not None:
        name, how, kl, top1 = found
        words = (head + f"{dst}'s config for this model has no setting for {name}={settings.untaken[name]!r}; with "
                 f"it {how}, {src} computes what {dst} computes (KL {kl:.3g}, top-1 agreement {top1:.4f}), so {dst} "
                 f"cannot run this model as {src} does. {measured[0].upper()}{measured[1:]}")
    elif added is not None:
        name, how, kl, top1 = added
        words = (head + f"{dst}'s config for this model sets {name}={settings.added[name]!r}, which {src}'s config "
                 f"has no setting for; with it {how}, {dst} computes what {src} computes (KL {kl:.3g}, top-1 "
                 f"agreement {top1:.4f}): {src}'s code for this model assumes another value, and the port does not "
                 f"write settings the source does not hold. {measured[0].upper()}{measured[1:]}")
    else:
        where = iso.place.split(" (")[0]
        words = (head + f"{dst}'s code for this model computes otherwise than {src}'s, in what runs {where}, and no "
                 f"setting the port could change in the source's config explains it. "
                 f"{measured[0].upper()}{measured[1:]}")
    if settings is not None:
        if settings.untaken:
            words += f". Settings of the {src} config that {dst}'s config does not take: {_listed(settings.untaken)}"
        if settings.added:
            words += (f". Settings of the {dst} config (at its values) that {src}'s config has no field for: "
                      f"{_listed(settings.added)}")
        if settings.lost:
            words += f". Settings whose values differ between the two configs: {_listed(settings.lost, pairs=True)}"
    if added is not None:
        return words
    return words + (". Port to a library that implements this configuration, or ask the destination library's "
                    "maintainers; nothing here can make the two compute the same function")
