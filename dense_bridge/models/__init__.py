"""Linear layers inside any model: find them (:func:`linear_layers`), declare third-party
layouts (:func:`register_layout`) and move whole models' weights (:func:`transfer`).

Everything framework-specific is the adapters' ``walk`` verb: it lists every layer that holds
parameters of its own, with its path in the framework's naming, its kind ("linear",
"quantized", "other") and readers/writers for its own parameters. Paths:

- torch: module paths from ``named_modules`` ("encoder.layer.0.output.dense");
- Keras: ``layer.path`` without the root model's name ("transformer_layer_0/self_attention_layer/query");
  automatic names depend on process history ("dense_3"), so name the layers you map;
- MLX: dotted attribute paths ("model.layers.0.mlp.up_proj"), in ``tree_flatten`` order.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _plan as _mapping
from .._errors import ConversionError, SpecError, check_flag, received
from ._layouts import Entry, Layout, register
from ..registry._backends import adapter_for, backend_of

__all__ = ["linear_layers", "register_layout", "transfer", "match_layers", "match_moves", "walk", "TransferReport",
           "NAME_TABLE", "sides"]


def walk(model: Any, argument: str = "model") -> list[Entry]:
    """Every layer of ``model`` holding parameters of its own, in definition order (adapter ``walk``)."""
    name = backend_of(model, argument)
    adapter = adapter_for(model, argument)
    verb = getattr(adapter, "walk", None)
    if verb is None:
        raise ConversionError(f"the {name!r} backend cannot look inside models (it has no walk verb). "
                              f"{received(argument, model)}")
    return verb(model)


#: Entry kinds that are linear layers: "quantized" ones read and write through dense_bridge/quant.py.
LINEAR_KINDS = ("linear", "quantized")


def _refuse_quantized(entries: list[Entry], argument: str) -> None:
    from ..quant import unreadable

    bad = unreadable(entries)
    if bad:
        listed = "; ".join(f"{e.where()}{': ' + e.note if e.note else ''}" for e in bad)
        raise ConversionError(
            f"{argument} holds quantized linear layers dense_bridge cannot read: "
            f"{listed}. Dequantize the model first (load it in float16/float32, or mlx_lm's dequantize), "
            f"then list or transfer its layers")


def linear_layers(model: Any) -> dict[str, Any]:
    """Every linear-family layer inside ``model``, keyed by its path, in definition order.

    Linear-family: torch ``nn.Linear``/``LazyLinear``/``nn.Bilinear``, Keras ``Dense`` and
    ``EinsumDense`` whose equation is a linear map, MLX ``nn.Linear``/``nn.Bilinear``, Flax
    ``nnx.Linear``, Equinox ``nn.Linear``, the linear nodes of an ONNX graph (backends/onnx/_graph.py),
    and classes declared with :func:`register_layout` (transformers' ``Conv1D`` built in). Each value is the
    native layer itself and works with ``to_spec``, ``get_params`` (canonical kernel
    (in_features, units)), ``set_params``, ``convert`` and ``testing.compare`` like a lone layer.
    Quantized linear layers (MLX ``QuantizedLinear``, Keras int8/int4, torchao weight-only) are
    listed too (``get_params`` gives the float kernel they stand for, ``get_params(layer,
    quantized=True)`` their codes: dense_bridge/quant.py); quantized layers of other kinds raise
    ConversionError naming them. A model that is itself a linear layer comes back under the path "".
    """
    entries = walk(model)
    _refuse_quantized(entries, "model")
    return {e.path: e.layer for e in entries if e.kind in LINEAR_KINDS}


def register_layout(cls: Any, *, kernel: str, bias: str | None = None, layout: str) -> Layout:
    """Declare where a third-party linear class keeps its parameters, and in which layout.

    ``cls``: the class, or its dotted name ("transformers.pytorch_utils.Conv1D") so that the
    framework need not be imported to declare it. ``kernel``/``bias``: attribute names.
    ``layout``: ``"in_out"`` (kernel stored as (in_features, units), like Conv1D) or
    ``"out_in"`` (stored as (units, in_features), like ``nn.Linear``). The class must compute
    ``x @ kernel + bias`` over the last axis; only its exact class is matched (a subclass may
    change the forward). Declaring a class again replaces its declaration. Returns it.
    Declarations are read by the torch, MLX and Keras adapters (a Keras layer's kernel and bias
    attributes must be its variables, e.g. from ``add_weight``, and it must be built).
    """
    return register(cls, kernel=kernel, bias=bias, layout=layout)



# ----------------------------------------------------------------------------- mapping
#: Parameter names that mean the same thing across frameworks, for layers that are not linear.
#: A mapped pair of such layers moves each parameter to the one of the same name, else to the one
#: name of its group the other layer has (norm scale/offset, embedding table, batch-norm stats).
NAME_TABLE: tuple[tuple[str, ...], ...] = (
    ("weight", "gamma", "scale"),
    ("bias", "beta", "offset"),
    ("weight", "embeddings", "embedding"),  # Flax nnx.Embed's table is "embedding"
    ("running_mean", "moving_mean"),
    ("running_var", "moving_variance"),
)


def sides(src: Any, dst: Any, arguments: tuple[str, str] = ("src", "dst")) -> tuple[Any, Any]:
    """Both models' walks indexed by layer and parameter path, ties resolved (what a mapping is
    resolved against; ``_auto_mapping`` pairs their layers); ``arguments``: the names errors give them."""
    return _Side(src, arguments[0]), _Side(dst, arguments[1])


class _Side:
    """One model's walk, indexed by layer path and parameter path, with ties resolved."""

    def __init__(self, model: Any, argument: str) -> None:
        self.model, self.argument = model, argument
        self.backend = backend_of(model, argument)
        self.entries = walk(model, argument)
        _refuse_quantized(self.entries, argument)
        self.layers = {e.path: e for e in self.entries}
        self.params: dict[str, tuple[Entry, str]] = {}
        self.tied_to: dict[str, str] = {}  # param path -> the first path of the same storage
        # Keras: paths with automatic names renumbered per model (the walk's "stable_path"), both ways
        self.stable: dict[str, str] = {}
        self.alias: dict[str, str] = {}
        first: dict[Any, str] = {}
        for e in self.entries:
            stable = e.extra.get("stable_path")
            if stable is not None and stable != e.path:
                self._alias(e.path, stable)
            for n in e.names:
                p = e.param_path(n)
                if stable is not None and stable != e.path and p.startswith(e.path):
                    self._alias(p, stable + p[len(e.path):])
                self.params[p] = (e, n)
                key = e.ident[n]
                if key in first:
                    self.tied_to[p] = first[key]
                else:
                    first[key] = p

    def _alias(self, path: str, stable: str) -> None:
        self.stable[path] = stable
        self.alias.setdefault(stable, path)

    def layer(self, path: str) -> Entry | None:
        """The layer at ``path``, or at the path its stable form (Keras' renumbered names) stands for."""
        e = self.layers.get(path)
        return e if e is not None else self.layers.get(self.alias.get(path, ""))

    def param(self, path: str) -> str | None:
        """The parameter path ``path`` names (itself, or what its stable form stands for)."""
        if path in self.params:
            return path
        actual = self.alias.get(path)
        return actual if actual in self.params else None

    def linear(self) -> list[Entry]:
        return [e for e in self.entries if e.kind in LINEAR_KINDS]

    def fully_tied(self, e: Entry) -> bool:
        """A layer all of whose parameters are another layer's (GPT-2's lm_head is wte's weight)."""
        return bool(e.names) and all(e.param_path(n) in self.tied_to for n in e.names)

    def unknown(self, path: str, what: str) -> str:
        known = list(self.layers) + list(self.params)
        return f"{path!r} is not a {what} of {self.argument}.{suggest(path, known)}"


def suggest(path: str, known: list[str]) -> str:
    """" Did you mean 'x'?" for the closest known path (case kept, unlike _errors.suggest)."""
    import difflib

    close = difflib.get_close_matches(path, known, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _name_pairs(s: Entry, d: Entry) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(src name, dst name) pairs of two mapped non-linear layers, and the names left on each side."""
    pairs, used = [], set()
    for n in s.names:
        if n in d.names and n not in used:
            pairs.append((n, n))
            used.add(n)
            continue
        cands = {c for group in NAME_TABLE if n in group for c in group if c in d.names and c not in used}
        if len(cands) == 1:
            c = cands.pop()
            pairs.append((n, c))
            used.add(c)
    moved_src = {a for a, _ in pairs}
    return pairs, [n for n in s.names if n not in moved_src], [n for n in d.names if n not in used]


def _by_order(src: _Side, dst: _Side, plan: _mapping.Plan) -> None:
    """Linear layers paired by order; an error where equal shapes and names say otherwise."""
    a = [e for e in src.linear() if not src.fully_tied(e)]
    b = [e for e in dst.linear() if not dst.fully_tied(e)]
    if len(a) != len(b):
        plan.problems.append(
            f"mapping=None pairs linear layers by order, but src has {len(a)} and dst has {len(b)} "
            f"(src: {[e.path for e in a]}; dst: {[e.path for e in b]}): give a mapping")
        return
    shapes_a = [_shape(e) for e in a]
    shapes_b = [_shape(e) for e in b]
    for i, (s, d) in enumerate(zip(a, b)):
        if shapes_a[i] != shapes_b[i]:
            plan.problems.append(f"mapping=None pairs src {s.where()} with dst {d.where()} by order, but their "
                                 f"(in_features, units) differ: {shapes_a[i]} vs {shapes_b[i]}: give a mapping")
            continue
        ns, nd = _last(s.path), _last(d.path)
        if ns == nd:
            plan.layers.append(_mapping.LayerMove((s,), (d,), rule="by order"))
            continue
        # names disagree: an error when another layer of the same shape carries the other's name
        # (mlx-lm's Llama MLP defines gate, down, up; transformers' gate, up, down: by order with
        # square shapes, up and down would swap silently)
        same = [j for j in range(len(a)) if shapes_a[j] == shapes_a[i]]
        names_a = {_last(a[j].path) for j in same}
        names_b = {_last(b[j].path) for j in same}
        if ns in names_b or nd in names_a:
            twin = next((b[j].path for j in same if _last(b[j].path) == ns), None)
            plan.problems.append(
                f"mapping=None would pair src {s.path!r} with dst {d.path!r} (both {shapes_a[i]}), but their names "
                f"differ and dst has a layer named like src's{f' ({twin!r})' if twin else ''}: layers of equal shape "
                f"defined in another order would swap silently. Give a mapping (e.g. "
                f"[(r'(.*)', r'\\1')] when the paths agree)")
            continue
        plan.layers.append(_mapping.LayerMove((s,), (d,), rule="by order"))


def _last(path: str) -> str:
    return re.split(r"[./]", path)[-1] if path else ""


def _linear_params(layer: Any) -> dict[str, np.ndarray]:
    """Canonical params of a linear layer (zero-copy views where the adapter gives them)."""
    from ..lora import read_params

    try:
        adapter = adapter_for(layer)
        with_adapter = read_params(adapter, layer)  # a LoRA-wrapped layer: its own + lora_* keys
        return adapter.get_params(layer) if with_adapter is None else with_adapter
    except SpecError as exc:  # an unbuilt lazy layer
        raise ConversionError(str(exc)) from None


def _shape(e: Entry) -> tuple:
    """The canonical kernel shape: (in_features, units), or (units, in1, in2) for a Bilinear."""
    if e.kind == "quantized":  # from the codes' shape: dequantizing only to count would cost a pass
        from ..quant import handle_of

        h = handle_of(e.layer)
        return (h.in_features, h.units)
    return tuple(_linear_params(e.layer)["kernel"].shape)


def _plan(src: _Side, dst: _Side, rules: list[_mapping.Rule] | None) -> _mapping.Plan:
    """The one place a mapping becomes a :class:`~dense_bridge.models._plan.Plan`: ``rules`` as
    ``_mapping.parse`` gives them (every explicit form), or None (linear layers by order). An
    inferred mapping (``_auto_mapping``) is a Plan already and goes straight to :func:`execute`."""
    if rules is None:
        plan = _mapping.Plan()
        _by_order(src, dst, plan)
        _mapping.record_ties(src, plan)
        return plan
    return _mapping.build_plan(src, dst, rules)


def match_layers(a: Any, b: Any, mapping: Any = None) -> dict[str, str]:
    """Linear layer paths of ``a`` -> linear layer paths of ``b``, as :func:`transfer` pairs them.

    ``mapping`` as in :func:`transfer` (None: by order, refusing ambiguous equal-shape pairs).
    Pairs of non-linear layers are left out. ConversionError lists every problem found.
    """
    return {m.src[0].path: m.dst[0].path for m in match_moves(a, b, mapping)
            if len(m.src) == len(m.dst) == 1}


def match_moves(a: Any, b: Any, mapping: Any = None, *, walked: tuple[Any, Any] | None = None
                ) -> list[_mapping.LayerMove]:
    """The linear layer moves of ``a`` into ``b`` as :func:`transfer` plans them (splits and
    concatenations included); ConversionError lists every problem found, and a mapping that
    pairs no linear layer at all is an error naming the rules that matched nothing.
    ``walked``: ``sides(a, b, ("a", "b"))`` when the caller holds them, so neither model is walked again."""
    rules = _mapping.parse(mapping)
    src, dst = walked if walked is not None else sides(a, b, ("a", "b"))
    plan = _plan(src, dst, rules)
    if plan.problems:
        raise ConversionError("cannot match the layers of a and b:\n  - " + "\n  - ".join(plan.problems))
    moves = [m for m in plan.layers if m.linear]
    if not moves:
        idle = f" Rules that matched nothing: {plan.idle}." if plan.idle else ""
        raise ConversionError(f"the mapping pairs no linear layer of a with one of b.{idle} a's linear layers: "
                              f"{[e.path for e in src.linear()][:8]}; b's: {[e.path for e in dst.linear()][:8]}. "
                              f"{received('mapping', mapping)}")
    return moves


# ----------------------------------------------------------------------------- transfer
@dataclass
class TransferReport:
    """What :func:`transfer` moved, and every parameter of either model it did not.

    ``moved``: (src path, dst path, what) per move: a linear layer's canonical kernel/bias, or one
    parameter. ``not_moved_src``/``not_moved_dst``: parameter paths left alone (native names).
    ``tied``: parameter path -> the path it shares storage with (moved once, with it).
    """

    src_backend: str
    dst_backend: str
    moved: list[tuple[str, str, str]] = field(default_factory=list)
    not_moved_src: list[str] = field(default_factory=list)
    not_moved_dst: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    #: dst layer path -> the largest |dequantized - source kernel| where the destination's
    #: quantizer made the codes (exact code moves are not listed)
    quant_errors: dict[str, float] = field(default_factory=dict)
    #: the complete mapping used, as rules ``mapping=`` takes again (JSON-able without functions)
    rules: list = field(default_factory=list)
    #: parameter paths (dst) whose values were rounded into a narrower dtype (allow_narrowing=True)
    narrowed: list[str] = field(default_factory=list)
    lora: dict = field(default_factory=dict)  # LoRA adapters: mode, kept, merged, rounding (path -> largest error)
    #: mapping="auto": whether the inferred mapping was verified on the inputs, and what was checked
    verification: str = ""

    @property
    def num_moved(self) -> int:
        return len(self.moved)

    def to_dict(self) -> dict:
        return {"src_backend": self.src_backend, "dst_backend": self.dst_backend,
                "moved": [list(m) for m in self.moved], "not_moved_src": list(self.not_moved_src),
                "not_moved_dst": list(self.not_moved_dst), "tied": dict(self.tied),
                "rules": [[r[0], r[1] if not isinstance(r[1], tuple) else [r[1][0], repr(r[1][1])]]
                          for r in self.rules], "narrowed": list(self.narrowed),
                "quant_errors": dict(self.quant_errors), "verification": self.verification}

    def __str__(self) -> str:
        lines = [f"transfer {self.src_backend} -> {self.dst_backend}: {len(self.moved)} moved, "
                 f"{len(self.not_moved_src)} src and {len(self.not_moved_dst)} dst parameters not moved"]
        width = max([len(s) for s, _, _ in self.moved] + [3])
        lines += [f"  {s:<{width}}  ->  {d}  [{what}]" for s, d, what in self.moved]
        for title, items in (("not moved (src)", self.not_moved_src), ("not moved (dst)", self.not_moved_dst)):
            if items:
                lines.append(f"{title}: " + ", ".join(items))
        if self.tied:
            lines.append("tied (moved once): " + ", ".join(f"{k} = {v}" for k, v in self.tied.items()))
        if self.narrowed:
            lines.append("rounded into a narrower dtype (allow_narrowing=True): " + ", ".join(self.narrowed))
        if self.verification:
            lines.append(self.verification)
        return "\n".join(lines)


def transfer(src: Any, dst: Any, *, mapping: Any = None, strict: bool = True,
             allow_narrowing: bool = False, lora: str | None = None,
             allow_rounding: bool = False, requantize: bool = False) -> TransferReport:
    """Move the parameters of model ``src`` into the existing model ``dst`` (any two frameworks).

    Linear layers (see :func:`linear_layers`) move in the canonical layout, each side
    transposed and reshaped by its declaration; other layers (norms, embeddings) move when
    mapped, parameter by parameter through :data:`NAME_TABLE` (``weight``/``bias`` <->
    ``gamma``/``beta``, ``weight`` <-> ``embeddings``), in the frameworks' shared layout. A
    parameter path mapped directly moves as it is stored (shapes must agree).

    ``mapping``: keys and values are paths (layer or parameter paths; torch "a.b", Keras "a/b"
    without the root model's name, MLX "a.b"):

    - a dict ``{src path: dst path}``; a value that is a list of dst layer paths splits the src
      linear layer along units into them, in order, each taking as many units as it has (the
      bias splits with it); a key that is a tuple of src layer paths concatenates them along
      units into the one dst layer; a value ``(dst_parameter_path, fn)`` on a parameter path
      moves ``fn(array)`` (the array in the frameworks' shared layout, e.g. a position table
      (rows, features)); ``{"to": paths, "heads": n}`` declares a fused side whose units
      interleave per head (GPT-NeoX ``query_key_value``), which a plain split refuses;
    - a list of ``(regex, replacement)`` rules: each src layer path (then each parameter path of
      layers no rule took) goes through the first rule that ``re.fullmatch``-es it, to
      ``match.expand(replacement)``; a replacement takes the forms of a dict value (a list: a
      split per match), a tuple of patterns concatenates (see ``dense_bridge.models._plan``);
    - a callable ``src path -> dst path, list of paths, or None``;
    - ``None``: linear layers paired by order; two layers of equal shape whose last path
      components say another pairing (a layer of the same name sits elsewhere) is an error
      naming them.
    ``db.transfer`` also takes ``mapping="auto"`` and ``db.auto(rules)`` with ``inputs=`` and
    ``verify=`` (``dense_bridge.models._transfer``), which infer the mapping and come here with it.

    Ties: an output head whose parameters are its embedding's follows the embedding in every
    form (an identity rule included): it moves once, with it, and needs no counterpart in
    ``dst`` (mlx-lm and keras-hub call the embedding as the head); into an untied dst head it is
    written as the embedding's values. Dtypes: widening (bfloat16 into float32) is exact; a
    narrowing cast (float32 into bfloat16) is an error naming the parameters unless
    ``allow_narrowing=True`` (the report's ``narrowed`` lists them).

    ``strict=True``: every linear layer of both models must be matched (a layer whose
    parameters are all tied to another's, like GPT-2's ``lm_head``, moves with it) and every
    rule must match something. All-or-nothing: names, shapes and values are checked before
    anything is written, and ``dst`` is restored if a write fails. Tied parameters move once.
    Quantized linear layers (dense_bridge/quant.py): a quantized src into a float dst moves its
    exact dequantization; into a quantized dst its codes move when dst's arithmetic dequantizes
    them to the same floats bit for bit (decided per layer), else a ConversionError names the
    layer and why, unless ``requantize=True``: dst's own quantizer then quantizes src's floats,
    as it always does for a float src, and ``report.quant_errors`` gives the largest error per layer.
    Returns a :class:`TransferReport` listing what moved and every parameter that did not, and
    in ``rules`` the complete mapping used (reusable as ``mapping=``).

    ``lora``: how linear layers holding LoRA adapters move (``dense_bridge.lora._moves``):
    ``None`` (an adapter in src is an error naming it), ``"keep"`` (attached on dst with its
    framework's adapter class) or ``"merge"`` (into dst's kernels). ``allow_rounding``: accept a
    scale dst folds into ``lora_b`` inexactly (Flax); ``report.lora["rounding"]`` says how much.
    """
    adapters = check_transfer(src, dst, strict=strict, allow_narrowing=allow_narrowing, lora=lora,
                              allow_rounding=allow_rounding, requantize=requantize)
    rules = _mapping.parse(mapping)
    a, b = _Side(src, "src"), _Side(dst, "dst")
    return execute(a, b, _plan(a, b, rules), adapters, strict=strict, allow_narrowing=allow_narrowing,
                   requantize=requantize)


def check_transfer(src: Any, dst: Any, *, strict: Any, allow_narrowing: Any, lora: Any, allow_rounding: Any,
                   requantize: Any) -> Any:
    """Check :func:`transfer`'s arguments other than the mapping (TypeError/ConversionError naming
    the first bad one); return the transfer's ``LoraMoves`` (``lora``/``allow_rounding`` checked)."""
    from ..lora._moves import LoraMoves

    adapters = LoraMoves(lora, allow_rounding, dst)
    for flag, value in (("strict", strict), ("allow_narrowing", allow_narrowing), ("requantize", requantize)):
        check_flag(flag, value)
    if src is dst:
        raise ConversionError(f"src and dst are the same object; transfer moves weights between two models. "
                              f"{received('dst', dst)}")
    return adapters


def execute(a: _Side, b: _Side, plan: _mapping.Plan, adapters: Any, *, strict: bool, allow_narrowing: bool,
            requantize: bool) -> TransferReport:
    """Carry out ``plan`` (every mapping form comes here as one Plan: by order, explicit rules, or
    inferred by ``_auto_mapping``) from side ``a`` into side ``b``: every move checked and queued,
    then, only when no problem was found, all written (put back if a write fails)."""
    problems = list(plan.problems)
    writes: list[tuple[Entry, str, dict]] = []  # (dst entry, "linear"/"native", arrays)
    report = TransferReport(a.backend, b.backend)
    moved_src: set[str] = set()
    moved_dst: dict[Any, str] = {}  # dst storage identity -> the src path written into it
    casts: list[tuple[str, Any, Any]] = []  # (dst parameter path, src dtype, dst dtype) of narrowing casts

    def claim(d: Entry, name: str, source: str) -> bool:
        key = d.ident[name]
        if key in moved_dst:
            if moved_dst[key] != source:
                tie = b.tied_to.get(d.param_path(name)) or next(
                    (p for p, f in b.tied_to.items() if f == d.param_path(name)), None)
                why = f" (it is tied to {tie!r}: one array, which cannot hold both)" if tie else ""
                problems.append(f"dst parameter {d.param_path(name)!r} gets both {moved_dst[key]!r} and "
                                f"{source!r}{why}")
            return False
        moved_dst[key] = source
        return True

    for m in plan.layers:
        if not m.linear and len(m.src) + len(m.dst) > 2:
            problems.append(f"mapping rule {m.rule!r}: splits and concatenations join linear layers; "
                            f"{[e.where() for e in m.src + m.dst if e.kind not in LINEAR_KINDS]} are not")
            continue
        s, d = m.src[0], m.dst[0]
        if (s.kind in LINEAR_KINDS) != (d.kind in LINEAR_KINDS):
            lin, other = (s, d) if s.kind in LINEAR_KINDS else (d, s)
            problems.append(f"{lin.where()} is a linear layer but {other.where()} is not: map its parameters by "
                            f"parameter path instead")
            continue
        if any(e.kind == "quantized" for e in m.src + m.dst):  # codes or dequantized floats: dense_bridge/quant.py
            from ..quant._moves import quantized_move

            problem, moved = quantized_move(m, writes, report, requantize, casts, _linear_move)
            if problem:
                problems.append(problem)
                continue
            for dd in m.dst:
                for n in dd.names:
                    claim(dd, n, "+".join(e.path for e in m.src))
            for ss in m.src:
                moved_src.update(ss.param_path(n) for n in ss.names)
            report.moved.extend(moved)
            continue
        if s.kind == "linear":
            if len(m.src) == len(m.dst) == 1:
                problem = adapters.move(s, d, writes) if adapters.takes(s, d) else _linear_move(s, d, writes, casts)
            else:
                problem = _fused_move(m, writes, casts, adapters)
            if problem:
                problems.append(problem)
                continue
            label = "+".join(e.path for e in m.src)
            for dd in m.dst:
                for n in dd.names:
                    claim(dd, n, label)
            for ss in m.src:
                moved_src.update(ss.param_path(n) for n in ss.names)
            how = "split" if len(m.dst) > 1 else "concatenated" if len(m.src) > 1 else ""
            heads = f", {m.heads} heads interleaved" if m.heads is not None else ""
            for ww in writes[-len(m.dst):]:
                what = ", ".join(sorted(ww[2])) + " (canonical" + (f", {how}{heads}" if how else "") + ")"
                report.moved.append((label, ww[0].path, what))
            continue
        from ..quant import same_quantized_tables

        codes = same_quantized_tables(s, d)  # two quantized tables of one format: their codes, exactly
        if codes is not None:
            writes.append((d, "quantized", codes))
            for n in d.names:
                claim(d, n, s.param_path(n))
            moved_src.update(s.param_path(n) for n in s.names)
            report.moved.append((s.path, d.path, "codes moved exactly (quantized table)"))
            continue
        pairs, left_s, left_d = _name_pairs(s, d)
        if left_s and strict:
            problems.append(f"src {s.where()} has parameters {left_s} with no counterpart in dst {d.where()} "
                            f"(which has {list(d.names)}): map them by parameter path")
        arrays = {}
        values = s.read()
        for ns, nd in pairs:
            if s.param_path(ns) in plan.ties:
                continue
            problem = _check_native(s.param_path(ns), values[ns], d, nd, casts)
            if problem:
                problems.append(problem)
                continue
            if claim(d, nd, s.param_path(ns)):
                arrays[nd] = values[ns]
            moved_src.add(s.param_path(ns))
            report.moved.append((s.param_path(ns), d.param_path(nd), "parameter"))
        if arrays:
            writes.append((d, "native", arrays))
    for pm in plan.params:
        s, ns = a.params[pm.src]
        d, nd = b.params[pm.dst]
        value = s.read()[ns]
        what = "parameter"
        if pm.fn is not None:
            if s.kind != "other":
                problems.append(f"mapping[{pm.src!r}]: a transform takes a parameter of a layer dense_bridge does "
                                f"not read as linear (a table, a norm); {s.where()} is a linear layer: map the layer")
                continue
            value, problem = _transformed(pm, value)
            if problem:
                problems.append(problem)
                continue
            what = f"parameter, transformed by {getattr(pm.fn, '__name__', 'fn')}"
        problem = _check_native(pm.src, value, d, nd, casts)
        if problem:
            problems.append(problem)
            continue
        if claim(d, nd, pm.src):
            writes.append((d, "native", {nd: value}))
        moved_src.add(pm.src)
        report.moved.append((pm.src, pm.dst, what))

    # ties: a src parameter tied to a moved one has moved; a dst one tied to a written one is written
    for p, first in a.tied_to.items():
        if first in moved_src:
            moved_src.add(p)
            report.tied[p] = first
    written_dst = set(moved_dst)
    dst_done = {p for p, (e, n) in b.params.items() if e.ident[n] in written_dst}
    for p, first in b.tied_to.items():
        if p in dst_done:
            report.tied[p] = first

    if strict:
        mapped_s = {e.path for m in plan.layers for e in m.src}
        mapped_d = {e.path for m in plan.layers for e in m.dst}
        for side, mapped, done in ((a, mapped_s, moved_src), (b, mapped_d, dst_done)):
            missing = [e.path for e in side.linear() if e.path not in mapped
                       and not (e.names and all(e.param_path(n) in done for n in e.names))]
            if missing:
                problems.append(f"strict: linear layers of {side.argument} not matched: {missing}")
        if plan.idle:
            problems.append(f"strict: mapping rules that matched nothing: {plan.idle}")
    if casts and not allow_narrowing:
        listed = ", ".join(f"{p} ({np.dtype(f).name} -> {np.dtype(t).name})" for p, f, t in casts[:8])
        more = f" and {len(casts) - 8} more" if len(casts) > 8 else ""
        problems.append(f"narrowing casts round values: {listed}{more}. Pass allow_narrowing=True to round them "
                        f"into dst's dtypes")
    problems += adapters.leftovers(a.model, moved_src)  # PEFT embedding adapters, modules_to_save: named
    if problems:
        raise ConversionError(f"cannot transfer {a.backend} -> {b.backend} (nothing was written):\n  - "
                              + "\n  - ".join(problems))
    _write_all(writes, adapters)
    report.rules = plan.rules({**a.stable, **b.stable})
    report.narrowed = [p for p, _, _ in casts]
    report.lora = adapters.summary()
    report.not_moved_src = [p for p in a.params if p not in moved_src]
    report.not_moved_dst = [p for p in b.params if p not in dst_done]
    return report


def _transformed(pm: _mapping.ParamMove, value: np.ndarray) -> tuple[Any, str | None]:
    """``pm.fn`` applied to a private copy of the source array; a problem sentence if it fails."""
    try:
        out = pm.fn(np.array(value, copy=True))
    except Exception as exc:  # noqa: BLE001 - the user's function: its failure is reported, nothing written
        return None, f"mapping[{pm.src!r}]: the transform raised {type(exc).__name__}: {exc}"
    if not isinstance(out, np.ndarray):
        return None, (f"mapping[{pm.src!r}]: the transform must return a numpy array; it returned "
                      f"{type(out).__name__}")
    return out, None


def _linear_move(s: Entry, d: Entry, writes: list, casts: list | None = None,
                 params: dict | None = None) -> str | None:
    """Queue the canonical params of linear ``s`` for linear ``d``; a problem sentence if they do not fit.

    Only the parameters are compared (names, shapes; values cast to dst's dtype and checked for
    NaN/Inf): a layer's fused activation need not be readable for its weights to move.
    ``params``: what to move instead of ``s``'s own (one piece of a split); ``casts`` collects
    the narrowing casts (dst path, src dtype, dst dtype).
    """
    try:
        params = _linear_params(s.layer) if params is None else params
        have = _linear_params(d.layer)
    except (ConversionError, SpecError) as exc:
        return f"{s.path!r} -> {d.path!r}: {exc}"
    if sorted(params) != sorted(have):
        return (f"src {s.where()} has parameters {sorted(params)} but dst {d.where()} has {sorted(have)} "
                f"(a bias or mask on one side only)")
    out = {}
    for k in params:
        if params[k].shape != have[k].shape:
            return (f"src {s.where()} {k} {params[k].shape} does not fit dst {d.where()} {k} {have[k].shape} "
                    f"(canonical layout: kernel (in_features, units))")
        if casts is not None and _mapping.narrowing(np.asarray(params[k]).dtype, have[k].dtype):
            casts.append((f"{d.path} ({k})", np.asarray(params[k]).dtype, have[k].dtype))
        with np.errstate(over="ignore", invalid="ignore"):
            value = np.asarray(params[k]).astype(have[k].dtype, copy=False)
        if not np.isfinite(np.asarray(value, dtype=np.float32)).all():
            return f"src {s.where()} {k} holds NaN or Inf (in dst's dtype {have[k].dtype})"
        out[k] = value
    writes.append((d, "linear", out))
    return None


def _fused_move(m: _mapping.LayerMove, writes: list, casts: list, adapters: Any) -> str | None:
    """Queue a split or a concatenation: the src layers' canonical params joined along units, then
    split along units into the dst layers, each taking as many units as it has (``m.heads``:
    per-head interleaving on the fused side); each piece then moves as :func:`_linear_move` moves one.

    LoRA adapters (``adapters``: the transfer's ``LoraMoves``) split and join with their layers: a
    split copies ``lora_a`` and slices ``lora_b`` (``lora.split_units``), a concatenation stacks the
    ranks with a block-diagonal ``lora_b`` (``lora.join_units``); with ``lora="merge"`` joined members
    are merged one by one in float64 first, so the destination kernel is rounded once."""
    from .. import lora as _lora

    names = f"{'+'.join(e.path for e in m.src)!r} -> {'+'.join(e.path for e in m.dst)!r}"
    fused = m.src[0] if len(m.src) == 1 else m.dst[0]
    if m.heads is None and _mapping.interleaved(fused.path):
        return (f"{names}: {fused.path!r} is a fused projection whose units interleave per head (q, k, v of each "
                f"head in turn); a plain split would scramble the heads. Declare it: "
                f"{{'to': [...], 'heads': n}} (heads=1 when it is q|k|v in blocks)")
    try:
        given = [_linear_params(e.layer) for e in m.src]
        haves = [_linear_params(e.layer) for e in m.dst]
    except (ConversionError, SpecError) as exc:
        return f"{names}: {exc}"
    loras = [_lora.split(p)[1] for p in given]
    with_lora = any(loras) or any(_lora.split(p)[1] for p in haves)
    given, haves = [_lora.split(p)[0] for p in given], [_lora.split(p)[0] for p in haves]
    if any(loras) and adapters.mode is None:
        return (f"{names}: src {[e.where() for e, x in zip(m.src, loras) if x]} hold LoRA adapters: pass "
                f"lora='keep' or lora='merge'")
    for side, params in (("src", given), ("dst", haves)):
        ins = sorted({int(np.shape(p["kernel"])[0]) for p in params if "kernel" in p})
        if len(ins) > 1:
            return f"{names}: the {side} layers have in_features {ins}; layers joined along units share their input"
        keys = [sorted(p) for p in params]
        if any(k != keys[0] for k in keys):
            return f"{names}: the {side} layers differ in parameters {keys} (a bias on some only)"
        if any(p["kernel"].ndim != 2 for p in params):
            return f"{names}: only 2-D kernels split or join (a Bilinear does not)"
    units = [p["kernel"].shape[-1] for p in (given if len(m.src) > 1 else haves)]
    problem = _mapping.check_widths(units, m.heads, names)
    if problem:
        return problem
    lora = loras[0]
    if len(m.src) > 1 and any(loras):
        if adapters.mode == "merge":  # each member's effective kernel in float64: rounded once, on the write
            given = [{**p, "kernel": _lora.effective_kernel(p["kernel"], x)} if x else p for p, x in zip(given, loras)]
            lora = {}
        else:
            lora, problem = _lora.join_units(loras, units, m.heads)
            if problem:
                return f"{names}: {problem}"
    params, problem = _mapping.join_arrays(given, m.heads) if len(m.src) > 1 else (given[0], None)
    if problem:
        return f"{names}: {problem}"
    pieces = [params]
    lora_pieces = [lora]
    if len(m.dst) > 1:
        total = params["kernel"].shape[-1]
        if total != sum(units):
            return (f"{names}: src has {total} units but the dst layers {[e.path for e in m.dst]} have {units} "
                    f"= {sum(units)} (a split gives each as many units as it has)")
        pieces = _mapping.split_arrays(params, units, m.heads)
        lora_pieces = _lora.split_units(lora, units, m.heads) if lora else [{} for _ in units]
    for d, piece, lora_piece in zip(m.dst, pieces, lora_pieces):
        if with_lora:
            problem = adapters.move(m.src[0], d, writes, given={**piece, **lora_piece})
        else:
            problem = _linear_move(m.src[0], d, writes, casts, params=piece)
        if problem:
            return f"{names}: {problem}"
    return None


def _check_native(src_path: str, value: np.ndarray, d: Entry, name: str, casts: list | None = None) -> str | None:
    shape = tuple(value.shape)
    if shape != d.shapes[name]:
        return (f"src parameter {src_path!r} {shape} does not fit dst parameter {d.param_path(name)!r} "
                f"{d.shapes[name]}")
    if (value.dtype.kind == "f" or str(value.dtype) == "bfloat16") and \
            not np.isfinite(np.asarray(value, dtype=np.float32)).all():
        return f"src parameter {src_path!r} holds NaN or Inf"
    if casts is not None:
        dst_dtype = np.asarray(d.read()[name]).dtype
        if _mapping.narrowing(value.dtype, dst_dtype):
            casts.append((d.param_path(name), value.dtype, dst_dtype))
    return None


def _write_all(writes: list[tuple[Entry, str, dict]], adapters: Any = None) -> None:
    """Write everything; on a failure, put back what was written (all-or-nothing)."""
    done: list[tuple[Entry, dict]] = []
    try:
        for d, how, arrays in writes:
            if how == "quantized":  # a dense_bridge.quant.Candidate: writing returns its own undo
                done.append((d, arrays.write()))
                continue
            before = {k: np.array(v, copy=True) for k, v in d.read().items()}
            done.append((d, before))
            if how == "lora":  # a LoRA layer: attached where dst has no adapter yet, then written
                adapters.write(d, arrays)
            elif how == "linear":
                adapter_for(d.layer).set_params(d.layer, arrays)
            else:
                d.write(arrays)
    except BaseException:
        if adapters is not None:
            adapters.undo()
        for d, before in reversed(done):
            try:
                before() if callable(before) else d.write(before)
            except Exception:  # noqa: BLE001 - restoring as much as possible; the first error is raised
                pass
        raise


def empty_params_error(adapter: Any, native: Any) -> ConversionError | None:
    """The error for ``get_params`` finding no linear parameters in ``native`` (None: {} is right).

    {} is the right answer only for a chain whose layers have no parameters (a Sequential of
    activations). A lone activation, a norm, a convolution or a custom model whose linear layers
    dense_bridge cannot see as a chain gets an error naming its class and what to use instead.
    """
    from ..specs import Sequential

    t = type(native)
    what = f"{t.__module__}.{t.__qualname__}"
    try:
        spec = adapter.to_spec(native)
    except (ConversionError, SpecError, TypeError) as exc:
        spec, why = None, str(exc)
    else:
        why = ""
    if isinstance(spec, Sequential):
        return None
    if spec is not None:
        return ConversionError(f"get_params: {what} has no linear parameters (it reads as {type(spec).__name__}, "
                               f"a layer without weights). Received: native={native!r}"[:600])
    inside = ""
    try:
        found = [e.path for e in walk(native, "native") if e.kind == "linear"]
    except (ConversionError, TypeError):
        found = []
    if found:
        inside = f" It holds linear layers at {found[:6]}{' ...' if len(found) > 6 else ''}."
    return ConversionError(
        f"get_params: {what} holds no linear parameters dense_bridge can read as a layer or a chain "
        f"({why or 'not a Linear/Dense layer'}).{inside} For the linear layers inside any model use "
        f"db.linear_layers(model); to move a whole model's weights use db.transfer(src, dst, mapping=...)")


# ----------------------------------------------------------------------------- weights files
def _file_names(framework: str | None):
    """How ``framework``'s plain weights files name a linear kernel (its manifest's ``file_names``:
    what ``inspect`` assumes when a file carries no spec; the file cannot say, GPT-2's Conv1D stores
    its "weight" as (in, out) in a torch file, for one), else the common (out, in) "weight"."""
    from ..registry._manifest import FileNames
    from ..registry._backends import backends

    info = backends().get(framework) if framework else None
    names = info.manifest.file_names if info is not None else None
    return names if names is not None else FileNames()


_EMBEDDING_HINTS = ("embed", "wte", "wpe", "token_type", "position_embeddings", "shared")


def file_linear_layers(entries: list[tuple[str, tuple, str]], framework: str | None) -> list[dict]:
    """Linear layers recognised by name in a plain weights file: ``<layer><sep><kernel>`` as the
    framework's manifest declares (``FileNames``: ``<layer>.weight`` by default) of rank 2, with a
    rank-1 bias beside it or not.

    ``entries``: (tensor name, shape, dtype) as a checkpoint lists them. Each row has the layer
    path, in_features, units, bias (bool), dtype, ``layout`` and ``layout_source``: a file stores
    no layout, so the orientation is decided by evidence where the file holds some (a bias's
    length names the output axis: GPT-2's Conv1D weight (in, out) with its (out,) bias reads
    ``in_out`` in a torch file), else assumed from the framework's convention for a non-square
    kernel, and ``"unknown"`` for a square kernel without a bias (in_features and units are then
    equal and only the orientation is unknown; a bias cannot orient a square kernel either). 2-D
    tensors of embedding-like names are left out.
    ``tensors``: the names of the tensors the row reads (kernel, and bias when present).
    """
    convention = _file_names(framework)
    name, layout, why = convention.kernel, convention.layout, convention.why
    shapes = {n: (tuple(s), d) for n, s, d in entries}
    rows = []
    sep, bias_name = convention.sep, convention.bias
    for tensor, (shape, dtype) in shapes.items():
        if not tensor.endswith(sep + name) and tensor != name or len(shape) != 2:
            continue
        path = tensor[: -len(name) - 1] if tensor != name else ""
        if any(h in path.lower() for h in _EMBEDDING_HINTS):
            continue
        bias_tensor = (path + sep if path else "") + bias_name
        bias = shapes.get(bias_tensor)
        length = bias[0][0] if bias is not None and len(bias[0]) == 1 else None
        this, source = layout, f"assumed from the file format ({why})"
        if length is not None and shape[0] != shape[1] and length in shape:
            this = "out_in" if length == shape[0] else "in_out"
            source = f"from its bias's length ({length}: the output axis)"
        elif shape[0] == shape[1]:
            this, source = "unknown", ("unknown: a square kernel" + (" without a bias" if length is None else
                                       ", which a bias cannot orient") + " (nothing in the file decides)")
        units, in_features = (shape[0], shape[1]) if this == "out_in" else (shape[1], shape[0])
        has_bias = length is not None and length == units
        rows.append({"layer": path, "in_features": int(in_features), "units": int(units), "bias": has_bias,
                     "dtype": dtype, "layout": this, "layout_source": source,
                     "tensors": [tensor] + ([bias_tensor] if has_bias else [])})
    return rows


def format_file_linear_layers(rows: list[dict]) -> str:
    """The `dense-bridge inspect` section for :func:`file_linear_layers` rows (plain text)."""
    if not rows:
        return "linear layers: none recognised by name"
    width = max(len(r["layer"]) for r in rows)
    sources = sorted({r["layout_source"] for r in rows if r["layout_source"].startswith("assumed")})
    lines = [f"linear layers recognised by name ({len(rows)}; layout from a bias's length where one decides"
             + (f", else {sources[0]}" if sources else "") + "):"]
    for r in rows:
        source = r["layout_source"]
        note = "(assumed)" if source.startswith("assumed") else "(from its bias)" if source.startswith("from") \
            else "(square, no bias)" if "without" in source else "(square)"
        lines.append(f"  {r['layer']:<{width}}  in={r['in_features']:<6} units={r['units']:<6} "
                     f"bias={'yes' if r['bias'] else 'no ':<3}  {r['dtype']}  layout {r['layout']} {note}")
    return "\n".join(lines)


#: Attribute under which ``to_spec(model, example=x)`` leaves the example input on the model.
EXAMPLE_ATTR = "_dense_bridge_example"


def remember_example(native: Any, example: Any) -> None:
    """Keep ``example`` (as numpy) on ``native`` for adapters that read a forward on an example
    input (torch.export): every later read of the model then takes the same branch."""
    array = np.asarray(example)
    if array.ndim == 0 or not (np.issubdtype(array.dtype, np.number) or str(array.dtype) == "bfloat16"):
        raise TypeError(f"example must be a numeric array with at least one axis. {received('example', example)}")
    try:
        object.__setattr__(native, EXAMPLE_ATTR, array)
    except (AttributeError, TypeError):  # objects with __slots__: nothing to remember it on
        pass
