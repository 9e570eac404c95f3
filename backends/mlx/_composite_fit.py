"""A text model mlx-lm implements twice: on its own and inside its multimodal composite, which may differ.

mlx-lm may implement the text part of a multimodal family under its own ``model_type``
``"<name>_text"`` AND inside the composite ``"<name>"`` (the composite reading a text-only
checkpoint through its ``text_config``), and the two need not build the same model: the text-only
module may lack layers the composite has (a mixture-of-experts feed-forward where the text-only
module builds a dense one). The port then writes the form whose model holds the source's weights:
the one whose parameter count is the source's (tensor names differ between the two forms, their
sizes do not), the text-only form where both fit alike.
"""
from __future__ import annotations

import math
import re

__all__ = ["composite_if_it_fits_better", "as_composite"]


def _count(model) -> int | None:
    from mlx.utils import tree_flatten

    try:
        return sum(int(math.prod(v.shape)) for _, v in tree_flatten(model.parameters()))
    except Exception:  # noqa: BLE001 - a model whose parameters cannot be read has no count
        return None


_MISSING = re.compile(r"missing \d+ required positional arguments?: (.*)")


def _build_unset_as_none(composite: dict, build):
    """The composite built, the text settings its text part requires and the text-only model does not
    (a rope scaling: none where the config names none) set to None, as a config without them means."""
    try:
        return build(composite)
    except Exception as exc:  # noqa: BLE001 - read the names the composite's text part requires
        found = _MISSING.search(str(exc))
        if found is None:
            raise
        names = re.findall(r"'(\w+)'", found.group(1))
        if not names or any(n in composite["text_config"] for n in names):
            raise
        composite["text_config"].update({n: None for n in names})
        return build(composite)


def composite_if_it_fits_better(config: dict, shapes: dict[str, tuple[int, ...]], suffix: str, implements,
                                build) -> dict:
    """``config`` (a completed mlx-lm config of a ``"<name><suffix>"`` model), or the composite's
    ``{"model_type": "<name>", "text_config": config}`` where mlx-lm's composite holds as many
    weights as ``shapes`` (the source's tensors) and its text-only model does not.

    Args:
        config: mlx-lm's config for the text model (``model_type`` ending in ``suffix``).
        shapes: {tensor name: shape} of the source's weights.
        suffix: the text part's ``model_type`` suffix (``"_text"``).
        implements: ``model_type -> bool``, whether mlx-lm has a model for it.
        build: ``config -> model``, mlx-lm's model built lazily (raises where it cannot be built).

    Returns:
        The config to write (``config`` itself, unchanged, where the composite fits no better).
    """
    kind = config.get("model_type")
    if not shapes or not isinstance(kind, str) or not kind.endswith(suffix) or not implements(kind[:-len(suffix)]):
        return config
    want = sum(int(math.prod(s)) for s in shapes.values())
    composite = {"model_type": kind[:-len(suffix)], "text_config": dict(config)}
    try:
        own = _count(build(config))
    except Exception:  # noqa: BLE001 - a text model that cannot be built: the composite may be
        own = None
    try:
        other = _count(_build_unset_as_none(composite, build))
    except Exception:  # noqa: BLE001 - a composite that cannot be built from it is no choice
        return config
    if other is None or (own is not None and abs(own - want) <= abs(other - want)):
        return config
    return composite


def as_composite(config: dict, suffix: str) -> dict:
    """``config`` of a ``"<name><suffix>"`` text model as its composite's config (itself where it is
    no such text model)."""
    kind = config.get("model_type")
    if not isinstance(kind, str) or not kind.endswith(suffix):
        return config
    return {"model_type": kind[:-len(suffix)], "text_config": dict(config)}
