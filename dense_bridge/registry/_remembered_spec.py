"""The one way a spec is remembered on a native object: what the framework cannot hold.

A native layer cannot tell which initializer drew its first values, nor its spec name. Compile
leaves the spec on every object it makes (``dense_bridge._api.build`` on the object it returns,
each adapter on the layers inside a container), under one attribute; ``to_spec`` reads it back
and trusts it only where it agrees with what the object itself shows (the object may have been
changed since). Specs are immutable, picklable and deep-copyable, so the attribute travels with
``copy.deepcopy`` and ``torch.save`` of a whole module.
"""
from __future__ import annotations

from typing import Any

__all__ = ["SPEC_ATTR", "remember_spec", "remembered_spec"]

SPEC_ATTR = "_dense_bridge_spec"


def remember_spec(native: Any, spec: Any) -> None:
    """Keep ``spec`` on ``native`` (a no-op for objects that take no new attributes)."""
    try:
        # object.__setattr__: past frameworks' attribute tracking (torch/Keras/MLX modules would
        # otherwise inspect the value), and the same for every framework
        object.__setattr__(native, SPEC_ATTR, spec)
    except (AttributeError, TypeError):  # objects with __slots__: nothing to keep, nothing lost
        pass


def remembered_spec(native: Any, cls: type | tuple[type, ...] | None = None) -> Any:
    """The spec kept on ``native`` (of type ``cls`` when given), or None."""
    spec = getattr(native, SPEC_ATTR, None)
    if spec is None or (cls is not None and not isinstance(spec, cls)):
        return None
    return spec
