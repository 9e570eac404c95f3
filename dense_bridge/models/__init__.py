"""Linear layers inside any model: find them (:func:`linear_layers`), declare third-party
layouts (:func:`register_layout`), and plan and carry out the moves of whole models' weights.
``db.transfer`` itself, which also verifies an inferred mapping with ``dense_bridge.testing``,
is the front-door module ``dense_bridge/_transfer.py``: nothing in this package imports testing.

Paths are each framework's own naming:

- torch: module paths from ``named_modules`` ("encoder.layer.0.output.dense");
- Keras: ``layer.path`` without the root model's name ("transformer_layer_0/self_attention_layer/query");
  automatic names depend on process history ("dense_3"), so name the layers you map;
- MLX: dotted attribute paths ("model.layers.0.mlp.up_proj"), in ``tree_flatten`` order.

The package, one job a module:

- ``_walk``: a model's walk (the adapters' ``walk`` verb), its linear layers, and ``Side`` (one
  model's walk indexed by path, its backend resolved once, its parameters read once);
- ``_layouts``: layout declarations of third-party linear classes, and the walk's ``Entry``;
- ``_plan``: every explicit ``mapping=`` form parsed into a plan; ``_by_order``: the plan of
  ``mapping=None``; ``_infer``: the plan of ``mapping="auto"`` (one forward pass of each model);
- ``_execute``: a plan carried out, one function per kind of move, all-or-nothing;
- ``_resolve``: any mapping form resolved into a plan on two walked models (``plan_for``), the
  linear moves as a transfer plans them (``match_moves``), transfer's argument checks;
- ``_report``: ``TransferReport``;
- ``_hints``, ``_file_layers``: the errors that point lone-layer verbs at models, and the linear
  layers of a plain weights file (``dense-bridge inspect``).
"""
from __future__ import annotations

from typing import Any

# also read from here by the rest of the package: the CLI's file listing (it imports public modules
# only), _api's hints, testing's walk of both models (sides)
from ._file_layers import file_linear_layers, format_file_linear_layers
from ._hints import empty_params_error, remember_example
from ._layouts import Layout, register
from ._report import TransferReport
from ._walk import LINEAR_KINDS, linear_layers, sides, walk

__all__ = ["linear_layers", "register_layout", "transfer", "auto", "walk", "TransferReport"]

#: Names imported on first use (``transfer`` from the front door, which imports testing).
_LATER = {"transfer": "dense_bridge._transfer", "match_moves": "._resolve", "match_layers": "._resolve",
          "auto": "._infer", "NAME_TABLE": "._execute"}


def __getattr__(name: str) -> Any:
    if name in _LATER:
        import importlib

        return getattr(importlib.import_module(_LATER[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_layout(cls: Any, *, kernel: str, bias: str | None = None, layout: str) -> Layout:
    """Declare where a third-party linear class keeps its parameters, and in which layout.

    Args:
        cls: the class, or its dotted name ("transformers.pytorch_utils.Conv1D") so that the
            framework need not be imported to declare it.
        kernel: the attribute holding the kernel.
        bias: the attribute holding the bias (None: the class has none).
        layout: ``"in_out"`` (kernel stored as (in_features, units), like Conv1D) or ``"out_in"``
            (stored as (units, in_features), like ``nn.Linear``).

    Returns:
        The declaration (a ``Layout``). Declaring a class again replaces its declaration.

    The class must compute ``x @ kernel + bias`` over the last axis; only its exact class is
    matched (a subclass may change the forward). Declarations are read by the torch, MLX and Keras
    adapters (a Keras layer's kernel and bias attributes must be its variables, e.g. from
    ``add_weight``, and it must be built).
    """
    return register(cls, kernel=kernel, bias=bias, layout=layout)
