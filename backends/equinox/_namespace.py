"""``array_namespace``: ``compare_models`` judges this adapter's captures in ``jax.numpy``, float64 on
the model's device, when JAX's 64-bit mode is on (``backends/_jax/namespace.py``; without it: None,
and the captures are judged on the host).
"""
from __future__ import annotations

import jax

from .._jax.namespace import JaxNamespace, namespace_for


def array_namespace(model) -> JaxNamespace | None:
    """The namespace of ``model``'s captures: float64 on the device of its first array, or None
    (no 64-bit mode, no array, a sharded array)."""
    return namespace_for(jax.tree_util.tree_leaves(model))
