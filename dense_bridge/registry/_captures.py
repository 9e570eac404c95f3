"""What an adapter's ``capture`` verb returns: per-call inputs, outputs and gradients of linear layers.

``capture(model, inputs, layers, *, cotangent, select=None, grads=True)`` runs ONE forward and
(with ``grads``) one backward pass of a whole native model with its framework's own autograd, for
the loss L = sum(out * cotangent(out.shape)) where ``out`` is the selected model output, and
records every call of every layer in ``layers`` (a dict path -> native layer, from
``linear_layers``) in execution order. Arrays are numpy in the framework's own dtype (bfloat16 as
``ml_dtypes.bfloat16``) and in the layer's NATIVE shapes: a Keras ``EinsumDense`` output stays
(batch, seq, heads, head_dim); the core reshapes to the canonical (..., in_features) / (..., units).
Parameter gradients are canonical (the layout ``get_params`` gives: "kernel" (in, units), "bias").
An adapter offering ``array_namespace`` also takes ``native=True``: the same arrays as the
framework's own, where the model computed them (``dense_bridge/testing/_namespace``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Call", "Capture", "HEAD_CALL"]

#: Suffix of a recorded call's path for an embedding table called as the output head without a
#: module call of its own (mlx-lm's ``embed_tokens.as_linear(h)``): ``"<table path>#head"``,
#: input (..., dim), output (..., vocab), i.e. x @ table.T.
HEAD_CALL = "#head"


@dataclass
class Call:
    """One call of one captured layer.

    ``inputs``: the layer's positional array arguments as the layer received them (two for a
    Bilinear); ``output``: what it returned; ``output_grad``: dL/d(output) from the framework's
    autograd, None when ``grads`` is off or the backward pass did not reach this call.
    """

    path: str
    call: int  # 0 for the first call of this layer, 1 for the second, ...
    inputs: tuple[np.ndarray, ...]
    output: np.ndarray
    output_grad: np.ndarray | None = None


@dataclass
class Capture:
    """``calls`` in execution order; ``param_grads``: path -> canonical name -> dL/dparam summed
    over the layer's calls (absent for a layer the backward pass did not reach); ``output``: the
    selected model output the cotangent was applied to; ``notes``: what was not captured and why
    (a parameter shared with another part of the model has a gradient from every use)."""

    calls: list[Call]
    param_grads: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    output: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    #: paths whose recorded outputs (and dL/d(output)) are taken BEFORE the activation the layer
    #: applies inside itself (Keras ``Dense(activation=...)``): the linear map alone
    pre_activation: set[str] = field(default_factory=set)

    def by_path(self) -> dict[str, list[Call]]:
        """Each layer's calls, in execution order, by path."""
        out: dict[str, list[Call]] = {}
        for c in self.calls:
            out.setdefault(c.path, []).append(c)
        return out

    def call_counts(self) -> dict[str, int]:
        """How many times each path was called."""
        return {p: len(cs) for p, cs in self.by_path().items()}


def select_output(out, select, is_float):
    """The model output the backward pass starts from, in the framework's own type.

    ``select`` None: the first floating tensor of ``out`` (itself; a dict's or a transformers
    ``ModelOutput``'s values in order; a tuple's or list's items), searched depth first.
    A callable: ``select(out)``. A str: ``out[select]`` for a mapping, else ``getattr(out, select)``.
    An int: ``out[select]``. ``is_float(x)``: is x a floating tensor of the framework.
    """
    if callable(select):
        return select(out)
    if isinstance(select, str):
        return out[select] if hasattr(out, "keys") else getattr(out, select)
    if isinstance(select, int) and not isinstance(select, bool):
        return out[select]
    found = _first_floating(out, is_float)
    if found is None:
        raise TypeError(f"the model returned no floating tensor to start the backward pass from "
                        f"(got {type(out).__name__}); pass outputs=(select_a, select_b)")
    return found


def _first_floating(out, is_float):
    leaves = floating_leaves(out, is_float, first_only=True)
    return leaves[0] if leaves else None


def floating_leaves(out, is_float, *, first_only: bool = False, depth: int = 0) -> list:
    """The floating tensors of ``out`` depth first, in the order :func:`select_output` searches
    them (a dict's values in order, a tuple's items; nesting up to 8 deep)."""
    if is_float(out):
        return [out]
    if depth > 8:
        return []
    if hasattr(out, "keys") and hasattr(out, "values"):
        items = list(out.values())
    elif isinstance(out, (tuple, list)):
        items = list(out)
    else:
        return []
    found = []
    for item in items:
        found += floating_leaves(item, is_float, first_only=first_only, depth=depth + 1)
        if found and first_only:
            break
    return found


def looks_float(x) -> bool:
    """Is ``x`` a floating tensor of any framework (a shape, and a dtype whose name says float)?
    For selectors that run inside every adapter's capture (torch ``torch.float32``, TF/JAX
    ``float32``, MLX ``mlx.core.bfloat16``)."""
    return hasattr(x, "shape") and "float" in str(getattr(x, "dtype", ""))


class LeafOutput:
    """An output selector (``select`` callable): the ``index``-th floating tensor of the model's
    output in :func:`floating_leaves` order, remembering every floating tensor's shape it saw."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, out):
        leaves = floating_leaves(out, looks_float)
        self.shapes = [tuple(int(d) for d in x.shape) for x in leaves]
        if self.index >= len(leaves):
            raise TypeError(f"the model returned {len(leaves)} floating tensors, not {self.index + 1}; pass "
                            f"outputs=(select_a, select_b)")
        return leaves[self.index]
