"""The state of one ``compare_models`` run: what is paired, captured and judged, built once and passed around.

:func:`prepare` walks both models once, pairs their linear layers (``db.transfer``'s moves, a
split or fused side as one group: ``_split_groups``), reads each pair's canonical parameters,
finds quantized pairs, and rounds the inputs to values both models hold; :meth:`Comparison.capture`
then runs each model once forward and backward with its framework's autograd. Judging
(``_judge``) and teacher forcing (``_isolated``) read everything from the one
:class:`Comparison`, computing in its array namespace ``xp`` (``_namespace``: chosen at capture,
where the captures of a side whose adapter offers it stay in its framework and on its device).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._dtypes import EPS
from ..registry._captures import Capture, LeafOutput
from ._namespace import NUMPY
from ._rounding import coarsest, round_common
from ._tolerance import Tolerance

__all__ = ["Comparison", "Options", "prepare", "dtype_name"]


def dtype_name(arr) -> str:
    """The tolerance dtype of an array: its own where the formula knows it, else float32."""
    name = np.asarray(arr).dtype.name
    return name if name in EPS else "float32"


def _is_float_dtype(dt) -> bool:
    return np.issubdtype(dt, np.floating) or np.dtype(dt).name == "bfloat16"


def _round_inputs(inputs, dtypes):
    if isinstance(inputs, dict):
        return {k: round_common(v, dtypes) if _is_float_dtype(v.dtype) else v for k, v in inputs.items()}
    return [round_common(v, dtypes) if _is_float_dtype(v.dtype) else v for v in inputs]


def _activation(layer):
    """The activation a linear layer applies inside itself (Keras ``Dense(activation=...)``), or None."""
    from .._api import to_spec
    from ..specs import Dense

    if layer is None:  # a split/fused group has no one native layer (no activation)
        return None
    try:
        spec = to_spec(layer)
    except Exception:  # noqa: BLE001 - a layer without a spec (EinsumDense, declared classes) is linear
        return None
    act = getattr(spec, "activation", None) if isinstance(spec, Dense) else None
    return None if act is None or act.is_identity else act


@dataclass(frozen=True)
class Options:
    """How a comparison runs and judges: ``grads`` (a backward pass too), ``tol`` (the formula's
    scales), ``seed`` (of the cotangent), ``carried`` (``judge="carried"``: values only where
    that suffices), ``isolated`` (teacher forcing follows: its helpers read the captures as numpy)."""

    grads: bool
    tol: Tolerance
    seed: int
    carried: bool = False
    isolated: bool = False


@dataclass
class Comparison:
    """Everything one comparison of models ``a`` and ``b`` (b the reference) pairs, reads and captures.

    Paths: a pair is (path in a, path in b); a split/fused side is a group label "p+q+..." (its
    members in ``groups``, their units in ``widths``). ``layers_*`` map path (and group label,
    to None) -> native layer; ``params_*`` pair path -> canonical params (a group's joined along
    units). ``inputs_*``: each model's inputs, floating ones rounded to values both dtypes hold.
    ``cap_*``: the captures (None until :meth:`capture`), groups merged into one call.
    """

    a: Any
    b: Any
    adapter_a: Any
    adapter_b: Any
    pairs: list[tuple[str, str]]
    groups: dict
    widths: dict[str, int]
    layers_a: dict
    layers_b: dict
    params_a: dict
    params_b: dict
    inputs_a: list | dict
    inputs_b: list | dict
    dtypes: list[str]
    options: Options
    walks: tuple | None = None  # each model's walk entries (quantized embeddings, structure)
    backends: tuple[str, str] = ("", "")  # each model's backend, resolved once by its walk
    read: Any = None  # a linear layer object -> its canonical params, read once through its model's adapter
    quant: dict = field(default_factory=dict)  # path in b -> _quantized.QuantPair
    cap_a: Capture | None = None
    cap_b: Capture | None = None
    xp: Any = NUMPY  # the array namespace the captures are judged in (set by capture)
    _acts: dict = field(default_factory=dict, repr=False)
    _cotangents: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ derived
    @property
    def grads(self) -> bool:
        return self.options.grads

    @property
    def tol(self) -> Tolerance:
        return self.options.tol

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def carried(self) -> bool:
        return self.options.carried

    @property
    def b_to_a(self) -> dict[str, str]:
        return {pb: pa for pa, pb in self.pairs}

    def members(self, side: str) -> list[str]:
        """The native layer paths of side "a" or "b" that the pairs name, groups expanded."""
        from ._split_groups import members

        return members([p[0 if side == "a" else 1] for p in self.pairs], self.groups)

    def acts(self, pa: str, pb: str) -> tuple:
        """(a's, b's) activation included in each side's recorded output (None: the linear map alone)."""
        key = (pa, pb)
        if key not in self._acts:
            fa = None if self.cap_a is not None and pa in self.cap_a.pre_activation else _activation(
                self.layers_a.get(pa))
            fb = None if self.cap_b is not None and pb in self.cap_b.pre_activation else _activation(
                self.layers_b.get(pb))
            self._acts[key] = (fa, fb)
        return self._acts[key]

    def same_activation(self, pa: str, pb: str) -> bool:
        fa, fb = self.acts(pa, pb)
        return (fa is None) == (fb is None) and (fa is None or fa == fb)

    @property
    def dtype_a(self) -> str:
        return coarsest([dtype_name(p["kernel"]) for p in self.params_a.values() if "kernel" in p] or ["float32"])

    @property
    def dtype_b(self) -> str:
        return coarsest([dtype_name(p["kernel"]) for p in self.params_b.values() if "kernel" in p] or ["float32"])

    # ------------------------------------------------------------------ running
    def cotangent(self, shape: tuple) -> np.ndarray:
        """The standard-normal cotangent of ``shape`` from ``seed``, the same for both models,
        rounded to values every compared dtype (and float16) holds."""
        size = int(np.prod(shape))
        if size not in self._cotangents:
            self._cotangents[size] = round_common(np.random.default_rng(self.seed).standard_normal(size),
                                                  self.dtypes + ["float16"])
        return self._cotangents[size].reshape(shape)

    def capture(self, select_a, select_b) -> None:
        """Run both models once (forward, and backward with ``grads``) and keep the captures,
        each group's member calls merged into one call, and one side's calls over shares of the
        rows joined where the other side makes one call over them all (``_row_calls``).

        The judging namespace is chosen here (``_namespace.choose``): a side whose adapter offers
        it captures natively (``capture(..., native=True)``: its framework's arrays where the model
        computed them); teacher forcing and quantized pairs, whose helpers are numpy code, judge on
        the host."""
        from ._namespace import choose
        from ._row_calls import join_row_calls
        from ._split_groups import merge

        self.xp, native = choose(((self.adapter_a, self.a), (self.adapter_b, self.b)),
                                 host=self.options.isolated or bool(self.quant))
        caps = []
        for adapter, model, inputs, side, select, own in ((self.adapter_a, self.a, self.inputs_a, "a", select_a,
                                                           native[0]),
                                                          (self.adapter_b, self.b, self.inputs_b, "b", select_b,
                                                           native[1])):
            layers = self.layers_a if side == "a" else self.layers_b
            extra = {"native": True} if own else {}
            cap = adapter.capture(model, inputs, {p: layers[p] for p in self.members(side)}, cotangent=self.cotangent,
                                  select=select, grads=self.grads, **extra)
            caps.append(merge(cap, self.groups, self.widths, adapter.to_numpy if own else None))
        self.cap_a, self.cap_b = join_row_calls(*caps, self.pairs, self.params_a, self.params_b, tuple(
            adapter.to_numpy if own else None for adapter, own in zip((self.adapter_a, self.adapter_b), native)))
        self._acts.clear()


def prepare(a, b, mapping, inputs: tuple, options: Options) -> Comparison:
    """The :class:`Comparison` of ``a`` and ``b`` before anything runs: both models walked once,
    their linear layers paired by ``mapping`` (``"auto"`` inferred from one forward pass of
    each), the pairs' parameters read, the quantized pairs found and the inputs rounded.

    Args:
        inputs: (inputs_a, inputs_b), each model's inputs as numpy (``_inputs.model_inputs``);
            ``mapping="auto"`` infers from them.
        options: how it runs and judges.
    """
    from .. import models
    from ..models import _infer
    from . import _split_groups
    from ._quantized import quantized_pairs

    inputs_a, inputs_b = inputs
    walked = models.sides(a, b, ("a", "b"))  # each model walked once: pairing, inference, judging, structure
    get_params = reader(walked)
    walks = (walked[0].entries, walked[1].entries)
    if _infer.is_auto(mapping):  # inferred from one forward pass of each model, compared as rules
        # the inputs as read here (every form alike), one per model
        mapping = _infer.inferred_rules(a, b, (inputs_a, inputs_b), mapping, lambda *_: walked)
    layers_a, layers_b = ({e.path: e.layer for e in side.linear()} for side in walked)
    pairs, groups = _split_groups.pairs_of(models.match_moves(a, b, mapping, walked=walked))
    params_a = {pa: _split_groups.group_params(pa, groups, layers_a, get_params) for pa, _ in pairs}
    params_b = {pb: _split_groups.group_params(pb, groups, layers_b, get_params) for _, pb in pairs}
    widths = {p: get_params(layers[p], copy=False)["kernel"].shape[-1] for layers in (layers_a, layers_b)
              for p in _split_groups.members(groups, groups) if p in layers}
    dtypes = sorted({dtype_name(p["kernel"]) for p in list(params_a.values()) + list(params_b.values())
                     if "kernel" in p} or {"float32"})
    quant = quantized_pairs(pairs, layers_a, layers_b, params_a, adapters=(walked[0].adapter, walked[1].adapter))
    return Comparison(a, b, walked[0].adapter, walked[1].adapter, pairs, groups, widths, layers_a, layers_b,
                      params_a, params_b, _round_inputs(inputs_a, dtypes), _round_inputs(inputs_b, dtypes), dtypes,
                      options, walks, (walked[0].backend, walked[1].backend), get_params, quant)


def reader(walked: tuple) -> Any:
    """``get_params(layer, copy=False)`` for the linear layers of two walked models: each read once,
    through the adapter its model's walk resolved (a LoRA-wrapped layer with its ``lora_*`` keys,
    as ``db.get_params`` gives it); any other object through ``db.get_params``."""
    from .._api import get_params

    owners = {id(e.layer): (side, e) for side in walked for e in side.linear()}

    def read(layer: Any, copy: bool = False) -> dict:
        found = owners.get(id(layer))
        if found is None:
            return get_params(layer, copy=copy)
        side, e = found
        params = side.linear_params(e)
        return {k: np.array(v, copy=True) for k, v in params.items()} if copy else params

    return read


def default_selects(outputs) -> tuple:
    """(select_a, select_b) of ``outputs``: each model's first floating output by default."""
    from .._errors import received

    if outputs is None:
        return LeafOutput(0), LeafOutput(0)
    if isinstance(outputs, (tuple, list)) and len(outputs) == 2:
        return outputs[0], outputs[1]
    raise TypeError(f"outputs must be None or a pair (select_a, select_b). {received('outputs', outputs)}")
