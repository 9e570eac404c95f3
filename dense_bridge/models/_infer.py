"""``mapping="auto"``: a mapping inferred by watching two models run, checked before it is kept.

Each model runs forward ONCE on the given inputs (the adapters' ``capture`` verb, forward only)
while every layer holding parameters of its own records its calls: linear layers, norms,
embedding tables (Keras' ReversibleEmbedding records its lookups under the table's path and its
``reverse=True`` calls under its head's). From the calls:

- each layer's **kind**: ``linear`` (the walk says so), ``embedding`` (one 2-D table; called on
  floating-point activations it is a matrix applied as a linear map, a router, and pairs with
  linear layers), ``norm`` (1-D parameters only), ``stack`` (expert stacks: 3-D parameters leading
  with one expert count, paired parameter by parameter along an axis: split, joined, or with
  their last two axes exchanged, written as ``{"to", "axis", "swap"}`` rules), ``raw`` (anything
  else: a convolution, ``A_log``, ``D``; its parameters pair by name and shape);
- its **place**: the position of its first call in execution order (definition order does not
  count: mlx-lm's Llama MLP defines gate, down, up and calls gate, up, down);
- its **data flow**: a fingerprint of its input's exact values, so that calls that read the same
  tensor (q, k and v of one attention; gate and up of one MLP) form one *run*.

Pairing is per kind, never across kinds (transformers' Qwen3 interleaves q_norm between q_proj
and k_proj, mlx-lm calls the norms after v_proj: the linear and the norm sequences each agree):

- linear runs in order: two runs with the same widths pair member by member (equal widths by
  last path name when both runs use the same names, else by order); a run of ONE fused call
  whose units are the sum of the other run's pairs as a split/concatenation (GPT-2 ``c_attn``
  against keras-hub ``query``/``key``/``value``);
- a single linear call one side makes where the other makes none (the calls after it pair) is
  looked for among the other side's stacks of its block: a matrix (heads * (a + b), r) that side
  keeps per head, in parts (heads, a, r) or (heads, r, a), pairs as one move per head;
- embeddings and norms by their parameter shapes, several of one shape by execution order
  (BERT looks its three tables up in different orders on the two sides: their shapes differ);
- a head tied to its embedding follows its tie; a tied source head is paired with an untied
  destination head left over at the end.

Wrapped layers are the layers they wrap: a LoRA-wrapped linear layer and a quantized one (MLX
``QuantizedLinear``, a torchao weight-only weight) are one linear layer each, as they are to
``linear_layers``; what moves with them is decided by the transfer (``lora=``: an adapter is
kept, merged or refused by name; a quantized side moves codes where the destination's
arithmetic holds them, else its exact dequantization, or is refused by layer). An adapter's
factors that the forward never calls as layers (LoRA on raw parameters) are no layers to pair.
A backbone against a model with a head (outputs of different widths, one side's head mapping
the other's width to its own) is named as such (:func:`_head_hint`).

The result is a :class:`~dense_bridge.models._plan.Plan` (``LayerMove``s), so the transfer and
its ``report.rules`` are the explicit mapping's. Equal-width layers read from one input (q and k)
cannot be told apart by running the untrained pair: a wrong guess reproduces its partner layer
by layer, which is why ``db.transfer`` (``dense_bridge/_transfer.py``) verifies the whole run (every matched layer's input
and output, and the model output) before it keeps anything.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _offset_tables, _one_sided, _pair_banks, _pair_raw_linear, _stack_ranks, _structure
from . import _plan as _mapping
from .._errors import ConversionError, received
from ..registry._captures import HEAD_CALL
from ._inputs import model_inputs

__all__ = ["Auto", "auto", "is_auto", "infer", "split_inputs", "Inferred", "NEEDS_INPUTS"]

NEEDS_INPUTS = ("mapping='auto' infers the mapping by running both models: pass inputs= (a list, a dict, or a pair "
                "(src inputs, dst inputs)). Received: inputs=None")


@dataclass(frozen=True)
class Auto:
    """``db.auto(rules)``: explicit entries (any ``mapping=`` form) that take precedence; every
    layer they leave is inferred as ``mapping="auto"`` infers it."""

    explicit: Any = None


def auto(rules: Any = None) -> Auto:
    """A mapping that takes ``rules`` (a dict, a rule list or a callable, as ``mapping=`` takes
    them) for the layers they name and infers the rest from execution (needs ``inputs=``)."""
    _mapping.parse(rules)  # bad rules are refused here, by name, before any model runs
    return Auto(rules)


def is_auto(mapping: Any) -> bool:
    return isinstance(mapping, Auto) or (isinstance(mapping, str) and mapping == "auto")


# ----------------------------------------------------------------------------- recording
@dataclass
class _Layer:
    """One parameterised layer as its model ran it: kind, first call's place, shapes, data flow."""

    entry: Any
    kind: str  # "linear", "embedding", "norm"
    order: int  # position of its first call among all recorded calls
    signature: tuple  # linear: (in_features, units); others: the parameter shapes
    source: str  # fingerprint of its first call's input (calls reading one tensor share it)
    #: a norm's first call as (input, output), for :func:`_scale_offset`; None for other kinds
    call: Any = field(default=None, repr=False, compare=False)

    @property
    def path(self) -> str:
        return self.entry.path

    @property
    def units(self) -> int:
        return self.signature[1]


def _fingerprint(x: np.ndarray) -> str:
    """The input's values, whatever its shape (a router reads the hidden states flattened to
    (tokens, hidden), the experts beside it read them as (batch, positions, hidden))."""
    arr = np.ascontiguousarray(np.asarray(x))
    return f"{arr.dtype}:{arr.size}:{hashlib.blake2b(arr.tobytes(), digest_size=12).hexdigest()}"


def _applied(shape: tuple, call) -> bool:
    """The call maps its input's last axis (in_features, ``shape[1]``) to ``shape[0]`` units: a
    matrix applied as a linear layer (a router), not a table sliced by position."""
    try:
        x, y = np.shape(call.inputs[0]), np.shape(call.output)
    except Exception:  # noqa: BLE001 - an output numpy cannot read is no linear map to judge
        return False
    return len(shape) == 2 and shape[0] != shape[1] and bool(x) and bool(y) and x[-1] == shape[1] \
        and y[-1] == shape[0]


def _floating(x) -> bool:
    try:
        return np.asarray(x).dtype.kind == "f" or "float" in str(np.asarray(x).dtype)
    except Exception:  # noqa: BLE001 - an input numpy cannot read is no activation to judge
        return False


def split_inputs(inputs) -> tuple[Any, Any]:
    """(src inputs, dst inputs) as numpy lists/dicts, read as ``compare_models`` reads them
    (``_inputs.model_inputs``: a pair of lists/dicts is one per model, anything else feeds both)."""
    if inputs is None:
        raise TypeError(NEEDS_INPUTS)
    return model_inputs(inputs)


def _kind(side, e) -> str | None:
    """linear / embedding / norm / stack, or None for a layer auto cannot pair (named in the refusal).

    ``raw``: any other layer with parameters (a convolution, a state-space mixer's ``A_log``/``D``):
    its parameters pair one by one by name and shape (:func:`_pair_raw`).
    ``stack``: a layer whose parameters hold an expert axis (every 3-D parameter leads with the
    same count: mixture-of-experts stacks, fused or not), paired parameter by parameter
    (:func:`_pair_stacks`). An ``embedding`` called on floating-point activations is a matrix
    applied as a linear map (a router): it is re-kinded ``linear`` when its call is recorded.
    A quantized linear layer (MLX ``QuantizedLinear``, a torchao weight-only weight) is ``linear``:
    its stored codes, scales and offsets are one linear map whose canonical kernel the walk reads,
    never parameters to pair one by one."""
    if e.kind in ("linear", "quantized"):
        return "linear"
    shapes = [e.shapes[n] for n in e.names]
    if len(shapes) == 1 and len(shapes[0]) == 2:
        return "embedding"
    if shapes and all(len(s) == 1 for s in shapes):
        return "norm"
    big = [s for s in shapes if len(s) == 3]
    # an axis of length one is a depthwise convolution's (channels, 1, width) or (channels, width,
    # 1), never an expert bank's matrix: such a layer pairs by name and shape, as raw
    if big and len({s[0] for s in big}) == 1 and not any(1 in s for s in big) \
            and all(len(s) == 3 or (len(s) == 2 and s[0] == big[0][0]) for s in shapes):
        return "stack"
    return "raw" if shapes else None


@dataclass
class _Run:
    """One model's recorded layers, by kind, in execution order; and the layers never called."""

    layers: dict[str, list[_Layer]] = field(default_factory=dict)
    uncalled: list[str] = field(default_factory=list)
    tied_heads: list[_Layer] = field(default_factory=list)  # fully tied linear heads that were called
    #: embedding tables called as the output head without a module of their own (HEAD_CALL)
    table_heads: list[_Layer] = field(default_factory=list)
    #: linear and raw layers never called as modules (a forward that reads their weights directly)
    unseen: list[_Layer] = field(default_factory=list)
    #: the shape of the model output the capture selected (its first floating output), () if none
    output: tuple = ()


def _record(model, side, inputs, skip: set[str]) -> _Run:
    """One forward pass of ``model`` recording every call of its parameterised layers."""
    verb = getattr(side.adapter, "capture", None)
    if not callable(verb):
        raise ConversionError(f"mapping='auto': the {side.backend!r} backend cannot record the calls of layers inside "
                              f"a model (no capture verb). {received(side.argument, model)}")
    unsupported = [e for e in side.entries if e.path not in skip and _kind(side, e) is None]
    if unsupported:
        listed = "; ".join(f"{e.path!r} ({type(e.layer).__name__}, parameters "
                           f"{ {n: e.shapes[n] for n in e.names} })" for e in unsupported[:6])
        raise ConversionError(
            f"mapping='auto' pairs linear layers, norms and embedding tables; {side.argument} holds layers it cannot "
            f"pair: {listed} (neither linear layers, norms, embedding tables nor expert stacks (every 3-D "
            f"parameter leading with one expert count)): map them by parameter path")
    wanted = {e.path: e for e in side.entries if e.path not in skip}
    try:
        captured = verb(model, inputs, {p: e.layer for p, e in wanted.items()},
                        cotangent=lambda shape: np.zeros(shape), grads=False)
    except (ConversionError, TypeError):
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own forward failed on the inputs given
        raise ConversionError(f"mapping='auto': {side.argument} failed to run on the inputs given "
                              f"({type(exc).__name__}: {exc}); pass inputs={side.argument} takes "
                              f"(a pair (src inputs, dst inputs) when they differ)") from None
    run = _Run()
    try:
        run.output = tuple(int(n) for n in np.shape(captured.output)) if captured.output is not None else ()
    except Exception:  # noqa: BLE001 - an output numpy cannot read has no shape to compare
        run.output = ()
    seen: set[str] = set()
    for i, call in enumerate(captured.calls):
        table = call.path[:-len(HEAD_CALL)] if call.path.endswith(HEAD_CALL) else None
        if table in wanted and call.path not in seen:
            seen.add(call.path)
            e = wanted[table]
            rows, dim = e.shapes[e.names[0]]
            run.table_heads.append(_Layer(e, "linear", i, (dim, rows), _fingerprint(call.inputs[0])))
            continue
        if call.path in seen or call.path not in wanted:
            continue
        seen.add(call.path)
        e = wanted[call.path]
        kind = _kind(side, e)
        if kind == "embedding" and call.inputs and _floating(call.inputs[0]) and _applied(e.shapes[e.names[0]], call):
            kind = "matrix"  # a 2-D weight applied to activations (a router), stored (units, in_features)
        applied = _pair_raw_linear.matrix_signature(e, call) if kind == "raw" else None
        if applied is not None:  # a bare weight (and bias) its module's code applies as a linear layer
            kind, sig = "linear", applied
        elif kind == "linear":
            sig = side.kernel_shape(e)
        elif kind == "matrix":
            kind, sig = "linear", tuple(e.shapes[e.names[0]][::-1])
        else:
            sig = tuple(e.shapes[n] for n in e.names)
        source = _fingerprint(call.inputs[0]) if call.inputs else f"none:{i}"
        layer = _Layer(e, kind, i, tuple(sig), source,
                       (call.inputs[0], call.output) if kind == "norm" and len(call.inputs) == 1 else None)
        if kind == "linear" and side.fully_tied(e):
            run.tied_heads.append(layer)  # moves with its embedding
            continue
        run.layers.setdefault(kind, []).append(layer)
    run.uncalled = [p for p, e in wanted.items() if p not in seen and not side.fully_tied(e)]
    for p in run.uncalled:  # never called as a module (its weights used directly): paired by name below
        e = wanted[p]
        kind = _kind(side, e)
        if kind == "linear":
            run.unseen.append(_Layer(e, kind, len(captured.calls), tuple(side.linear_params(e)["kernel"].shape),
                                     f"unseen:{p}"))
        elif kind in ("raw", "stack"):
            run.unseen.append(_Layer(e, kind, len(captured.calls), tuple(e.shapes[n] for n in e.names), f"unseen:{p}"))
    return run


# ----------------------------------------------------------------------------- pairing
_BLOCK = re.compile(r"^(.*(?:[./]|_)\d+)[./]")


def _block(path: str) -> str:
    """The path up to its last numbered component (``model.layers.0``; Keras numbers a name's end:
    ``transformer_layer_0/sparse_moe_block_2``): the block a layer sits in."""
    m = _BLOCK.match(path)
    return m.group(1) if m else ""


def _runs(layers: list[_Layer]) -> list[list[_Layer]]:
    """Linear calls reading the same input with the same in_features: one run each, consecutive
    calls, and later calls of the same block reading that input again (a mixture-of-experts block
    calls its shared expert and its router on one input, in an order each library picks)."""
    out: list[list[_Layer]] = []
    for layer in layers:
        if out and out[-1][-1].source == layer.source and out[-1][-1].signature[0] == layer.signature[0]:
            out[-1].append(layer)
            continue
        block = _block(layer.path)
        earlier = next((r for r in out if block and r[0].source == layer.source and _block(r[0].path) == block
                        and r[0].signature[0] == layer.signature[0]), None)
        if earlier is not None:
            earlier.append(layer)
        else:
            out.append([layer])
    return out


def _last(path: str) -> str:
    return re.split(r"[./]", path)[-1]


def _one_to_one(s, d, plan: _mapping.Plan, widths: tuple | None = None) -> None:
    """One layer into one; a linear layer and a matrix applied as one (a router) move parameter by
    parameter, by name, as each stores them (both (units, in_features) where they agree in shape),
    or, named apart, as :func:`_matrix_moves` pairs them (``widths``: the pair's (in_features,
    units), read off the calls)."""
    linear = ("linear", "quantized")
    if (s.kind in linear) != (d.kind in linear):
        if sorted(s.names) == sorted(d.names) and all(tuple(s.shapes[n]) == tuple(d.shapes[n]) for n in s.names):
            for n in s.names:
                plan.params.append(_mapping.ParamMove(s.param_path(n), d.param_path(n), None, rule="auto"))
            return
        moves = _matrix_moves(s, d, widths)
        if moves is not None:
            plan.axis_moves.extend(moves)
            return
    plan.layers.append(_mapping.LayerMove((s,), (d,), rule="auto"))


def _matrix_moves(s, d, widths: tuple | None) -> list | None:
    """A plain linear layer and a matrix applied as one (a router) that name their parameters
    apart (Keras' ``Dense`` keeps ``kernel`` (in_features, units), transformers' MoE router
    ``weight`` (units, in_features)): the matrix into the matrix, its two axes exchanged where the
    two store it differently, the bias into the bias. Each side's orientation is read from the
    widths (in_features, units) that the calls showed, so a square matrix (both widths equal) is
    not decidable: None then, as for anything else (a quantized layer, more parameters), and the
    pair is refused by name. The transfer's verification judges the result like every pair."""
    if widths is None or len(widths) != 2 or widths[0] == widths[1] or "quantized" in (s.kind, d.kind):
        return None
    n_in, units = widths

    def parts(e):
        mats = [n for n in e.names if len(e.shapes[n]) == 2]
        vecs = [n for n in e.names if tuple(e.shapes[n]) == (units,)]
        return (mats[0], vecs) if len(mats) == 1 and len(vecs) <= 1 and len(e.names) == 1 + len(vecs) else None

    def stored_out_first(e, n) -> bool | None:
        shape = tuple(e.shapes[n])
        return True if shape == (units, n_in) else False if shape == (n_in, units) else None

    ps, pd = parts(s), parts(d)
    if ps is None or pd is None or len(ps[1]) != len(pd[1]):
        return None
    os_, od = stored_out_first(s, ps[0]), stored_out_first(d, pd[0])
    if os_ is None or od is None:
        return None
    moves = [_mapping.AxisMove((s.param_path(ps[0]),), (d.param_path(pd[0]),), None, os_ != od, rule="auto")]
    if ps[1]:
        moves.append(_mapping.AxisMove((s.param_path(ps[1][0]),), (d.param_path(pd[1][0]),), None, False, rule="auto"))
    return moves


def _pair_run(a: list[_Layer], b: list[_Layer], plan: _mapping.Plan) -> bool:
    """Pair two runs read from one input each; False when their widths say they do not correspond."""
    if sorted(x.signature for x in a) == sorted(x.signature for x in b):
        for sig in dict.fromkeys(x.signature for x in a):
            xs = [x for x in a if x.signature == sig]
            ys = [y for y in b if y.signature == sig]
            names_x, names_y = [_last(x.path) for x in xs], [_last(y.path) for y in ys]
            if len(xs) > 1 and sorted(names_x) == sorted(names_y) and len(set(names_x)) == len(names_x):
                ys = [ys[names_y.index(n)] for n in names_x]  # equal widths: the names agree, trust them
            for x, y in zip(xs, ys):
                _one_to_one(x.entry, y.entry, plan, x.signature)
        return True
    in_a, in_b = a[0].signature[0], b[0].signature[0]
    if in_a != in_b:
        return False
    if len(a) == 1 and len(b) > 1 and a[0].units == sum(y.units for y in b):
        plan.layers.append(_mapping.LayerMove((a[0].entry,), tuple(y.entry for y in b), rule="auto"))
        return True
    if len(b) == 1 and len(a) > 1 and b[0].units == sum(x.units for x in a):
        plan.layers.append(_mapping.LayerMove(tuple(x.entry for x in a), (b[0].entry,), rule="auto"))
        return True
    return False


def _pair_within(a: list[_Layer], b: list[_Layer], plan: _mapping.Plan, extras: list) -> bool:
    """Two runs from one input each where one holds one layer more than :func:`_pair_run` can pair
    with the other (the rest pair one to one, or as a fused layer against its parts): the rest
    pair, the one more is appended to ``extras`` as ``(side, layer)``. False (nothing recorded)
    when no layer, or more than one, is the one more, or it is alike in widths to the other run's."""
    for big, small, side in ((a, b, "src"), (b, a, "dst")):
        if len(big) < 2 or not small:
            continue
        fits = []
        for k, extra in enumerate(big):
            rest = big[:k] + big[k + 1:]
            trial = _mapping.Plan()
            if _pair_run(rest, small, trial) if side == "src" else _pair_run(small, rest, trial):
                fits.append((extra, trial))
        if len(fits) != 1 or fits[0][0].signature in [y.signature for y in small]:
            continue  # none, or which of the alike layers is the extra one is not decidable
        extra, trial = fits[0]
        plan.layers += trial.layers
        plan.params += trial.params
        plan.axis_moves += trial.axis_moves
        extras.append((side, extra))
        return True
    return False


def _param_shape(side, path: str) -> tuple[int, ...]:
    """The stored shape of ``side``'s parameter ``path``."""
    owner, name = side.params[path]
    return tuple(owner.shapes[name])


def _pair_matrices(extras: list, left_a: list[str], left_b: list[str], a, b,
                   plan: _mapping.Plan) -> tuple[list, list, list[str], list[str]]:
    """Each linear layer :func:`_pair_within` set aside, paired with the other side's raw matrix
    left unpaired in the same block whose stored shape is the layer's kernel as stored, or its
    transpose (a router kept as a bare (experts, hidden) weight that the block's own code
    multiplies by). The move is the matrix, transposed where the two store it apart; a square
    matrix (either orientation fits) stays unpaired. Returns (src layers still unpaired, dst layers
    still unpaired, src raw parameters left, dst raw parameters left)."""
    left_a, left_b, still = list(left_a), list(left_b), {"src": [], "dst": []}
    for side, layer in extras:
        e = layer.entry
        mats = [n for n in e.names if len(e.shapes[n]) == 2]
        other_left, other = (left_b, b) if side == "src" else (left_a, a)
        hit = None
        if len(mats) == 1 and len(e.names) == 1:
            stored = tuple(e.shapes[mats[0]])
            for q in other_left:
                qs = _param_shape(other, q)
                if _block(q) != _block(e.path) or len(qs) != 2 or qs[0] == qs[1]:
                    continue
                if qs == stored or qs == stored[::-1]:
                    hit = (q, qs != stored)
                    break
        if hit is None:
            still[side].append(layer)
            continue
        other_left.remove(hit[0])
        mine = e.param_path(mats[0])
        src, dst = (mine, hit[0]) if side == "src" else (hit[0], mine)
        plan.axis_moves.append(_mapping.AxisMove((src,), (dst,), None, hit[1], rule="auto"))
    return still["src"], still["dst"], left_a, left_b


def _as_params(left: list, raw: list[str]) -> tuple[list, list[str]]:
    """Tables and norms left unpaired, seen as the raw parameters they hold (a router's bare
    matrix is one 2-D parameter, as a table is; a gate's score bias one 1-D parameter, as a
    norm's is): (the other layers left, ``raw`` with their parameters added)."""
    keep, params = [], list(raw)
    for x in left:
        if isinstance(x, _Layer) and x.kind in ("embedding", "norm"):
            params += [x.entry.param_path(n) for n in x.entry.names]
        else:
            keep.append(x)
    return keep, params


def _pair_leftover_params(left_a: list[str], left_b: list[str], a, b,
                          plan: _mapping.Plan) -> tuple[list[str], list[str]]:
    """Parameters still unpaired on both sides after every kind has paired its own: one into the
    one of the same name, shape and block on the other side, when exactly one fits (a router's
    score bias held by the router on one side, by a module of its own on the other)."""
    left_b = list(left_b)
    rest_a = []
    for p in left_a:
        fits = [q for q in left_b if _last(q) == _last(p) and _block(q) == _block(p)
                and _param_shape(b, q) == _param_shape(a, p)]
        if len(fits) != 1:
            rest_a.append(p)
            continue
        left_b.remove(fits[0])
        plan.axis_moves.append(_mapping.AxisMove((p,), (fits[0],), None, False, rule="auto"))
    return rest_a, left_b


def _describe(run: list[_Layer]) -> str:
    return "[" + ", ".join(f"{x.path} {x.signature}" for x in run) + "]"


def _pair_linear(a: list[_Layer], b: list[_Layer], plan: _mapping.Plan,
                 lone: list | None = None, extras: list | None = None) -> tuple[list[_Layer], list[_Layer]]:
    """Runs in execution order; returns the layers left unpaired on each side. ``lone``: where one
    side runs a single linear layer that the other side has no linear layer for (the runs after
    it pair), that layer is set aside here as ``(side, layer, problem)`` for :func:`_pair_per_head`
    (the other side may hold it per head, as expert-like stacks), the problem raised if it stays.
    ``extras``: where one run holds the other's layers and one more (a router one library runs
    as a linear layer beside the shared expert, the other as a matrix its own code applies),
    the rest pair and that layer is set aside as ``(side, layer)`` for :func:`_pair_matrices`."""
    ra, rb = _runs(a), _runs(b)
    i = j = 0
    while i < len(ra) and j < len(rb):
        if _pair_run(ra[i], rb[j], plan):
            i, j = i + 1, j + 1
            continue
        problem = (f"the models differ in structure at their linear call #{sum(len(r) for r in ra[:i]) + 1}: src "
                   f"runs {_describe(ra[i])} where dst runs {_describe(rb[j])} (widths (in_features, units) that "
                   f"neither pair one to one nor split/concatenate)")
        if extras is not None and _pair_within(ra[i], rb[j], plan, extras):
            i, j = i + 1, j + 1
            continue
        if lone is not None and len(ra[i]) == 1 and i + 1 < len(ra) and _pair_run(ra[i + 1], rb[j], _mapping.Plan()):
            lone.append(("src", ra[i][0], problem))
            i += 1
            continue
        if lone is not None and len(rb[j]) == 1 and j + 1 < len(rb) and _pair_run(ra[i], rb[j + 1], _mapping.Plan()):
            lone.append(("dst", rb[j][0], problem))
            j += 1
            continue
        plan.problems.append(problem)
        break
    return [x for r in ra[i:] for x in r], [y for r in rb[j:] for y in r]


def _per_head_parts(layer: _Layer, stacks: list[_Layer]) -> tuple[list[_Layer], tuple[bool, ...], int] | None:
    """The stack layers of ``layer``'s block that hold its one matrix (units, r) per head: the
    first few, in execution order, each with one parameter (heads, a, r) or (heads, r, a) (swap)
    whose widths times heads sum to units. (parts, swaps, heads) or None."""
    e = layer.entry
    if len(e.names) != 1 or len(e.shapes[e.names[0]]) != 2 or tuple(e.shapes[e.names[0]]) != \
            (layer.units, layer.signature[0]):
        return None
    units, r = layer.units, layer.signature[0]
    mine = [x for x in stacks if _block(x.path) == _block(layer.path) and len(x.entry.names) == 1
            and len(x.entry.shapes[x.entry.names[0]]) == 3]
    for k in range(2, len(mine) + 1):
        group = mine[:k]
        shapes = [tuple(x.entry.shapes[x.entry.names[0]]) for x in group]
        heads = shapes[0][0]
        if any(s[0] != heads for s in shapes):
            return None
        swaps = []
        for s in shapes:
            if s[2] == r:
                swaps.append(False)
            elif s[1] == r:
                swaps.append(True)
            else:
                return None
        if heads * sum(s[1] if not sw else s[2] for s, sw in zip(shapes, swaps)) == units:
            return group, tuple(swaps), heads
    return None


def _pair_per_head(lone: list, run_a: _Run, run_b: _Run, plan: _mapping.Plan) -> list:
    """Each linear layer set aside by :func:`_pair_linear` with the stack layers of the other side
    that hold its matrix per head (mlx-lm's latent attention keeps ``kv_b_proj`` as ``embed_q``
    and ``unembed_out``, one (heads, ., .) array each): a move per head
    (:class:`~dense_bridge.models._plan.AxisMove` ``heads``), verified as every pair is. Returns
    the layers left on each side (src, dst), their problems recorded."""
    left: dict[str, list] = {"src": [], "dst": []}
    for side, layer, problem in lone:
        other = run_b if side == "src" else run_a
        stacks = other.layers.get("stack", [])
        found = _per_head_parts(layer, stacks)
        if found is None:
            plan.problems.append(problem)
            left[side].append(layer)
            continue
        group, swaps, heads = found
        for x in group:
            stacks.remove(x)
        whole = (layer.entry.param_path(layer.entry.names[0]),)
        parts = tuple(x.entry.param_path(x.entry.names[0]) for x in group)
        src, dst = (whole, parts) if side == "src" else (parts, whole)
        plan.axis_moves.append(_mapping.AxisMove(src, dst, 1, swaps, rule="auto", heads=heads))
    return left["src"], left["dst"]


def _pair_by_shape(a: list[_Layer], b: list[_Layer], plan: _mapping.Plan) -> tuple[list[_Layer], list[_Layer]]:
    """Embeddings and norms: by parameter shapes, several of one shape in execution order."""
    left_a, left_b = [], []
    for sig in dict.fromkeys([x.signature for x in a] + [y.signature for y in b]):
        xs = [x for x in a if x.signature == sig]
        ys = [y for y in b if y.signature == sig]
        for x, y in zip(xs, ys):
            plan.layers.append(_mapping.LayerMove((x.entry,), (y.entry,), rule="auto"))
        left_a += xs[len(ys):]
        left_b += ys[len(xs):]
    return left_a, left_b


def _pair_norms(a: list[_Layer], b: list[_Layer], side_a, side_b,
                plan: _mapping.Plan) -> tuple[list[_Layer], list[_Layer]]:
    """Norms as :func:`_pair_by_shape` pairs them, each pair of one scale each moved with the
    offset :func:`_scale_offset` finds between the two conventions (a move of the scale plus that
    offset), else as a layer."""
    found = _mapping.Plan()
    left_a, left_b = _pair_by_shape(a, b, found)
    by_entry = {id(x.entry): x for x in a + b}
    for move in found.layers:
        x, y = by_entry[id(move.src[0])], by_entry[id(move.dst[0])]
        offset = _scale_offset(x, y, side_a, side_b)
        if not offset:
            plan.layers.append(move)
            continue
        plan.axis_moves.append(_mapping.AxisMove((x.entry.param_path(x.entry.names[0]),),
                                                 (y.entry.param_path(y.entry.names[0]),), None, False,
                                                 rule="auto", offset=offset))
    return left_a, left_b


#: (c_src, c_dst): the scale each side's norm multiplies by is its stored weight plus c
_CONVENTIONS = ((0.0, 0.0), (1.0, 1.0), (1.0, 0.0), (0.0, 1.0))


def _scale_offset(x: _Layer, y: _Layer, side_a, side_b) -> float:
    """What to add to ``x``'s stored scale to make ``y``'s: 0.0 when both store the scale their
    norm multiplies by (or both ``1 + w``), 1.0 when ``x``'s norm multiplies by ``1 + w`` and
    ``y``'s by ``w`` (transformers' zero-centred RMSNorm against mlx-lm's plain one), -1.0 the
    other way. Found by running ``y`` alone (the adapter's ``run_layer``) on the input ``x`` was
    recorded with: per feature, output_x / output_y = (w_x + c_x) / (w_y + c_y), the two
    normalisations being the same function of one input; the conventions that fit best, by far,
    decide. 0.0 when anything is unknown (one scale of equal shape each, a layer that runs alone
    on one input) or no convention fits: the transfer's verification judges the pair."""
    run = getattr(side_b.adapter, "run_layer", None)
    if x.call is None or not callable(run) or len(x.entry.names) != 1 or len(y.entry.names) != 1:
        return 0.0
    try:
        w_x = np.asarray(side_a.native(x.entry)[x.entry.names[0]], np.float64).reshape(-1)
        w_y = np.asarray(side_b.native(y.entry)[y.entry.names[0]], np.float64).reshape(-1)
        out_x = np.asarray(x.call[1], np.float64)
        out_y = np.asarray(run(y.entry.layer, np.asarray(x.call[0]), None)[0], np.float64)
    except Exception:  # noqa: BLE001 - a layer that does not run alone on one input: no evidence
        return 0.0
    n = w_x.size
    if w_y.size != n or out_x.shape != out_y.shape or not out_x.size or out_x.shape[-1] != n:
        return 0.0
    ox, oy = out_x.reshape(-1, n), out_y.reshape(-1, n)
    den = (oy * oy).sum(axis=0)
    ok = den > 0
    if not ok.any():
        return 0.0
    ratio = (ox * oy).sum(axis=0)[ok] / den[ok]
    errors = []
    for c_x, c_y in _CONVENTIONS:
        scale_y = w_y[ok] + c_y
        with np.errstate(divide="ignore", invalid="ignore"):
            want = (w_x[ok] + c_x) / scale_y
            err = np.abs(ratio - want) / np.maximum(np.abs(want), 1e-6)
        errors.append(float(np.nanmax(err)) if np.isfinite(err).any() else np.inf)
    best = int(np.argmin(errors))
    if best < 2 or errors[best] > 1e-3 or min(errors[:2]) < 100 * errors[best]:
        return 0.0
    c_x, c_y = _CONVENTIONS[best]
    return c_x - c_y


def _stack_params(layers: list[_Layer]) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of the stack layers, in execution order (definition order within a layer)."""
    return [(x.entry.param_path(n), tuple(x.entry.shapes[n])) for x in layers for n in x.entry.names]


def _order_by_name(fused: str, pieces: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """Pieces of a fused parameter in the order the fused name lists their names (``gate_up_proj``:
    gate, then up); where it names only some (``expert_feedforward_gate_dense`` holding gate and
    up), those first, the others after them in execution order; execution order where it names none."""
    name = _last(fused)

    def at(piece):
        word = _last(piece[0])
        if word in ("weight", "kernel", "bias"):
            word = _last(piece[0].rsplit(".", 1)[0])
        head = word.split("_")[0]
        pos = name.find(head) if head else -1
        return pos if pos >= 0 else len(name)
    positions = [at(p) for p in pieces]
    named = [x for x in positions if x < len(name)]
    if named and len(set(named)) == len(named):  # the unnamed keep their order (sorted is stable)
        return [p for _, p in sorted(zip(positions, pieces), key=lambda q: q[0])]
    return pieces


def _swapped(shape: tuple, swap: bool) -> tuple:
    return tuple(shape[:-2]) + (shape[-1], shape[-2]) if swap and len(shape) >= 2 else tuple(shape)


def _joins(whole: tuple, parts: list[tuple], first: int = 1) -> tuple[int | None, bool] | None:
    """(axis, swap) such that ``parts`` (each with its last two axes exchanged when swap) joined
    along axis make ``whole`` (axis None: one part, equal to it); None when no axis does. Axes from
    ``first`` on: 1 for expert stacks (axis 0 counts experts), 0 for channels."""
    for swap in (False, True):
        ps = [_swapped(p, swap) for p in parts]
        if len(ps) == 1 and ps[0] == tuple(whole):
            return None, swap
        for axis in range(first, len(whole)):
            if len(ps) > 1 and all(len(p) == len(whole) and p[:axis] + p[axis + 1:] == whole[:axis] + whole[axis + 1:]
                                   for p in ps) and sum(p[axis] for p in ps) == whole[axis]:
                return axis, swap
    return None


def _splits(whole: tuple, parts: list[tuple], first: int = 1) -> tuple[int, bool] | None:
    """(axis, swap) such that ``whole`` (its last two axes exchanged when swap) cut along axis
    makes ``parts``; None when no axis does. Axes from ``first`` on, as for :func:`_joins`."""
    for swap in (False, True):
        w = _swapped(whole, swap)
        for axis in range(first, len(w)):
            if all(len(p) == len(w) and p[:axis] + p[axis + 1:] == w[:axis] + w[axis + 1:] for p in parts) \
                    and sum(p[axis] for p in parts) == w[axis]:
                return axis, swap
    return None


def _pair_stacks(a: list[_Layer], b: list[_Layer], plan: _mapping.Plan) -> tuple[list[str], list[str]]:
    """Expert stacks, parameter by parameter in execution order: one into one (its last two axes
    exchanged where the layouts differ), a fused one cut along an axis into the next few of the
    other side (``gate_up_proj`` into ``gate_proj`` and ``up_proj``, in the order the fused name
    lists them), or the next few joined into one; what that leaves on both sides pairs again rank
    by rank (``_stack_ranks``: matrices, then biases). Returns the parameters left unpaired."""
    left_a, left_b = _pair_stack_params(_stack_params(a), _stack_params(b), plan)
    return _stack_ranks.pair_by_rank(left_a, left_b, lambda p: _shape_in(a, p), lambda q: _shape_in(b, q),
                                     lambda pa, pb: _pair_stack_params(pa, pb, plan))


def _shape_in(layers: list[_Layer], path: str) -> tuple[int, ...]:
    """The stored shape of the parameter ``path`` of one of ``layers``."""
    for x in layers:
        for n in x.entry.names:
            if x.entry.param_path(n) == path:
                return tuple(x.entry.shapes[n])
    return ()


def _pair_stack_params(pa: list, pb: list, plan: _mapping.Plan) -> tuple[list[str], list[str]]:
    """The pairing of :func:`_pair_stacks` on two lists of ``(path, shape)`` in execution order."""
    i = j = 0
    while i < len(pa) and j < len(pb):
        move = None
        one = _joins(pb[j][1], [pa[i][1]])
        run = _equal_run(pa, pb, i, j) if one is not None else 1
        if run > 1:  # several alike in shape on both sides: their names say which goes where
            for x, y in _by_names(pa[i:i + run], pb[j:j + run]):
                plan.axis_moves.append(_mapping.AxisMove((x,), (y,), one[0], one[1], rule="auto"))
            i, j = i + run, j + run
            continue
        if one is not None:
            move = ((pa[i][0],), (pb[j][0],), one[0], one[1], 1, 1)
        for k in range(2, 5):
            if move is not None:
                break
            if j + k <= len(pb):
                group = _order_by_name(pa[i][0], pb[j:j + k])
                cut = _splits(pa[i][1], [q[1] for q in group])
                if cut is not None:
                    move = ((pa[i][0],), tuple(q[0] for q in group), cut[0], cut[1], 1, k)
                    break
            if i + k <= len(pa):
                group = _order_by_name(pb[j][0], pa[i:i + k])
                join = _joins(pb[j][1], [q[1] for q in group])
                if join is not None:
                    move = (tuple(q[0] for q in group), (pb[j][0],), join[0], join[1], k, 1)
        if move is None:
            break
        src, dst, axis, swap, di, dj = move
        plan.axis_moves.append(_mapping.AxisMove(src, dst, axis, swap, rule="auto"))
        i, j = i + di, j + dj
    return [p for p, _ in pa[i:]], [q for q, _ in pb[j:]]


def _equal_run(pa: list, pb: list, i: int, j: int) -> int:
    """How many parameters from ``pa[i]`` and ``pb[j]`` on have, on both sides, the shapes of those
    two (at most 4): stacks a library stores alike (an expert bank's gate and up projections)."""
    n = 1
    while n < 4 and i + n < len(pa) and j + n < len(pb) and pa[i + n][1] == pa[i][1] and pb[j + n][1] == pb[j][1]:
        n += 1
    return n


def _words(path: str) -> set[str]:
    """The words of a parameter's own name and of its layer's ("switch_mlp.gate_proj.weight":
    gate, proj, weight; "experts/expert_feedforward_gate_dense": expert, feedforward, gate, dense)."""
    parts = re.split(r"[./]", path)[-2:]
    return {w for part in parts for w in part.lower().split("_") if w}


def _by_names(xs: list, ys: list) -> list[tuple[str, str]]:
    """Parameters alike in shape paired so that the words their paths share are the most; in
    execution order where no pairing shares more (the transfer's verification judges either)."""
    import itertools

    def telling(words: list[set[str]]) -> list[set[str]]:  # the words all of one side share say nothing
        common = set.intersection(*words)
        return [w - common for w in words]
    words_x, words_y = telling([_words(x) for x, _ in xs]), telling([_words(y) for y, _ in ys])
    best, best_score = list(range(len(ys))), -1
    for order in itertools.permutations(range(len(ys))):
        score = sum(len(words_x[k] & words_y[o]) for k, o in enumerate(order))
        if score > best_score:
            best, best_score = list(order), score
    return [(xs[k][0], ys[o][0]) for k, o in enumerate(best)]


def _pair_unseen(run_a: _Run, run_b: _Run, plan: _mapping.Plan) -> None:
    """Layers one side never calls as modules (its forward reads their weights directly, as
    transformers' reference Mamba path does with ``dt_proj`` and ``conv1d``): a linear one pairs
    with the other side's layer of the same path and widths, taken out of the call order it would
    otherwise shift; raw ones join the raw layers, which pair by name."""
    for mine, theirs in ((run_a, run_b), (run_b, run_a)):
        for x in list(mine.unseen):
            if x.kind != "linear":
                mine.layers.setdefault(x.kind, []).append(x)
                continue
            others = theirs.layers.get("linear", [])
            hit = next((y for y in others if y.entry.path == x.entry.path and y.signature == x.signature), None)
            if hit is None:
                continue
            others.remove(hit)
            src, dst = (x, hit) if mine is run_a else (hit, x)
            _one_to_one(src.entry, dst.entry, plan, src.signature)
            for run, layer in ((run_a, src), (run_b, dst)):
                if layer.entry.path in run.uncalled:
                    run.uncalled.remove(layer.entry.path)
        for x in mine.unseen:
            if x.kind != "linear" and x.entry.path in mine.uncalled:
                mine.uncalled.remove(x.entry.path)
        mine.unseen = []


def _squeezed(shape) -> tuple:
    """``shape`` without its axes of length one: a scalar stored as (1,) by one library and () by another."""
    return tuple(d for d in shape if d != 1)


def _pair_raw(a: list[_Layer], b: list[_Layer], plan: _mapping.Plan) -> tuple[list[str], list[str]]:
    """Parameters of layers that are neither linear, norm, table nor expert stack (a depthwise
    convolution, ``A_log``, ``D``, ``dt_bias``), in execution order: each into the first one left
    on the other side with the same name and shape (up to axes of length one: a learned scalar
    stored (1,) on one side, () on the other), or the same name and its last two axes
    exchanged (a convolution stored (channels, 1, width) on one side, (channels, width, 1) on the
    other). The transfer's verification judges the result like every other pair."""
    pa, pb = _stack_params(a), _stack_params(b)
    taken: set[int] = set()
    left_a = []
    for path, shape in pa:
        name = _last(path)
        hit = None
        for j, (q, qs) in enumerate(pb):
            if j in taken or _last(q) != name:
                continue
            if tuple(qs) == tuple(shape) or _squeezed(qs) == _squeezed(shape):  # (1,) on one side, () on the other
                hit = (j, False)
                break
            if len(qs) >= 2 and _swapped(shape, True) == tuple(qs):
                hit = (j, True)
                break
        if hit is None:
            left_a.append(path)
            continue
        taken.add(hit[0])
        plan.axis_moves.append(_mapping.AxisMove((path,), (pb[hit[0]][0],), None, hit[1], rule="auto"))
    unpaired = set(left_a)
    return _pair_raw_channels([(p, s) for p, s in pa if p in unpaired],
                              [(q, qs) for j, (q, qs) in enumerate(pb) if j not in taken], plan)


def _pair_raw_channels(pa: list, pb: list, plan: _mapping.Plan) -> tuple[list[str], list[str]]:
    """Raw parameters left by :func:`_pair_raw`: one side's parameter that is the next few of the
    other side's in its block (same name, in execution order) joined along their first axis, their
    last two axes exchanged where the layouts differ (one depthwise convolution over the
    concatenated query, key and value channels against one convolution each)."""
    pa, pb = list(pa), list(pb)
    for one, many, forward in ((pa, pb, True), (pb, pa, False)):
        for path, shape in list(one):
            group = [(q, qs) for q, qs in many if _last(q) == _last(path) and _block(q) == _block(path)]
            for k in range(2, min(4, len(group)) + 1):
                parts = group[:k]
                shapes = [qs for _, qs in parts]  # the exchange applies to the source side (AxisMove)
                found = _splits(shape, shapes, first=0) if forward else _joins(shape, shapes, first=0)
                if found is None or found[0] != 0:
                    continue
                names = tuple(q for q, _ in parts)
                src, dst = ((path,), names) if forward else (names, (path,))
                plan.axis_moves.append(_mapping.AxisMove(src, dst, 0, found[1], rule="auto"))
                one.remove((path, shape))
                for x in parts:
                    many.remove(x)
                break
    return [p for p, _ in pa], [q for q, _ in pb]


def _drop_adapter_parts(run: _Run, side) -> None:
    """Parts of an adapter that the forward never calls as layers (PEFT's LoRA on raw parameters:
    its ``lora_A``/``lora_B`` hold factors that the wrapper folds into the wrapped parameter) are
    no layers to pair: they leave the uncalled lists, and the transfer names them as adapters
    (the adapter's ``lora_leftovers`` verb, ``lora._moves.LoraMoves.leftovers``). Trained copies
    that the forward does call (PEFT's ``modules_to_save``) stay and pair like any layer."""
    verb = getattr(side.adapter, "lora_leftovers", None)
    if verb is None or not (run.uncalled or run.unseen):
        return
    trained = {p for _, _, paths in verb(side.model) for p in paths}
    if not trained:
        return
    parts = {e.path for e in side.entries if e.names and all(e.param_path(n) in trained for n in e.names)}
    run.uncalled = [p for p in run.uncalled if p not in parts]
    run.unseen = [x for x in run.unseen if x.path not in parts]


def _head_hint(run_a: _Run, run_b: _Run, left_a: list, left_b: list) -> str:
    """The sentence for a backbone against a model with a head: the model outputs end in different
    widths, and the side whose output is wider holds a linear layer (left unpaired, or a head
    tied to its table) mapping the other side's output width to its own. "" otherwise."""
    out_a, out_b = run_a.output, run_b.output
    if not out_a or not out_b or out_a[-1] == out_b[-1]:
        return ""
    for mine, left, out, other, name, other_name in ((run_a, left_a, out_a, out_b, "src", "dst"),
                                                      (run_b, left_b, out_b, out_a, "dst", "src")):
        heads = [x for x in list(left) + mine.tied_heads + mine.table_heads
                 if isinstance(x, _Layer) and x.kind == "linear" and x.signature == (other[-1], out[-1])]
        if heads:
            head = heads[-1]
            return (f"the outputs are hidden states on one side and logits on the other: {other_name} returns "
                    f"{other} (hidden states of width {other[-1]}) where {name} returns {out} through its head "
                    f"{head.path!r} ({other[-1]} -> {out[-1]}), which {other_name} lacks: give the task model "
                    f"(the one with the output head) on both sides (strict=False with verify=False moves the rest, "
                    f"unchecked)")
    return ""


@dataclass
class Inferred:
    """The inferred plan (explicit entries first), and every parameterised layer left unpaired."""

    plan: _mapping.Plan
    unpaired_src: list[str]
    unpaired_dst: list[str]
    #: what the leftovers say about the models as a whole (:func:`_head_hint`), "" when nothing
    hint: str = ""
    #: src vectors of exact zeros with no counterpart, left behind (``_one_sided.zero_leftovers``)
    zeros_left: list = field(default_factory=list)

    def unpaired_text(self, hint: bool = True) -> str:
        """The hint (``hint=True``) and the layers left unpaired on each side, as one sentence."""
        parts = [self.hint] if self.hint and hint else []
        if self.unpaired_src:
            parts.append(f"src layers left unpaired: {self.unpaired_src}")
        if self.unpaired_dst:
            parts.append(f"dst layers left unpaired: {self.unpaired_dst}")
        return "; ".join(parts)


def infer(src_model, dst_model, a, b, inputs, mapping) -> Inferred:
    """Record both models on ``inputs`` and pair their layers (``a``/``b``: ``_walk.sides``)."""
    explicit = mapping.explicit if isinstance(mapping, Auto) else None
    plan = _mapping.Plan()
    if explicit is not None:
        plan = _mapping.build_plan(a, b, _mapping.parse(explicit))
    taken_a = {e.path for m in plan.layers for e in m.src} | {a.params[p.src][0].path for p in plan.params}
    taken_b = {e.path for m in plan.layers for e in m.dst} | {b.params[p.dst][0].path for p in plan.params}
    in_a, in_b = split_inputs(inputs)
    run_a = _record(src_model, a, in_a, taken_a)
    run_b = _record(dst_model, b, in_b, taken_b)
    for run, side in ((run_a, a), (run_b, b)):
        _drop_adapter_parts(run, side)
    _pair_banks.pair_banks(run_a, run_b, a, b, plan)  # per-expert linear layers against one stored parameter
    _pair_unseen(run_a, run_b, plan)
    lone: list = []
    extras: list = []
    left_a, left_b = _pair_linear(run_a.layers.get("linear", []), run_b.layers.get("linear", []), plan, lone,
                                  extras)
    la, lb = _pair_per_head(lone, run_a, run_b, plan)
    left_a, left_b = la + left_a, lb + left_b
    # a tied source head (GPT-2's lm_head is wte) fills an untied destination head left at the end
    if len(left_b) == 1 and not left_a and run_a.tied_heads \
            and run_a.tied_heads[-1].signature == left_b[0].signature:
        plan.layers.append(_mapping.LayerMove((run_a.tied_heads[-1].entry,), (left_b[0].entry,), rule="auto"))
        left_b = []
    # a table called as the head (x @ table.T) fills an untied destination head: its kernel is the
    # table, transposed where the destination stores (in, out)
    if len(left_b) == 1 and not left_a and run_a.table_heads \
            and run_a.table_heads[-1].signature == left_b[0].signature and len(left_b[0].entry.names) == 1:
        t, d = run_a.table_heads[-1].entry, left_b[0].entry
        src_param, dst_param = t.param_path(t.names[0]), d.param_path(d.names[0])
        same = t.shapes[t.names[0]] == d.shapes[d.names[0]]
        plan.params.append(_mapping.ParamMove(src_param, b.param(dst_param), None if same else np.transpose,
                                              rule="auto"))
        left_b = []
    la, lb = _pair_by_shape(run_a.layers.get("embedding", []), run_b.layers.get("embedding", []), plan)
    la, lb = _offset_tables.pair_offset_tables(la, lb, b, plan)  # a position table with reserved leading rows
    left_a += la
    left_b += lb
    la, lb = _pair_norms(run_a.layers.get("norm", []), run_b.layers.get("norm", []), a, b, plan)
    left_a += la
    left_b += lb
    sa, sb = _pair_stacks(run_a.layers.get("stack", []), run_b.layers.get("stack", []), plan)
    left_a += sa
    left_b += sb
    ra, rb = _pair_raw(run_a.layers.get("raw", []), run_b.layers.get("raw", []), plan)
    left_a, ra = _as_params(left_a, ra)
    left_b, rb = _as_params(left_b, rb)
    still_a, still_b, ra, rb = _pair_matrices(extras, ra, rb, a, b, plan)
    ra, rb = _pair_leftover_params(ra, rb, a, b, plan)
    left_a += ra + still_a
    left_b += rb + still_b
    _mapping.record_ties(a, plan)
    def names(left):  # layers, and the parameters of stacks and raw layers left unpaired
        return [x if isinstance(x, str) else x.path for x in left]
    hint = _head_hint(run_a, run_b, left_a, left_b)
    unpaired_a = _offset_tables.drop_tied_copies(names(left_a) + run_a.uncalled, a, plan)  # one table, several names
    unpaired_a, zeros = _one_sided.zero_leftovers(unpaired_a, a)
    unpaired_b = names(left_b) + run_b.uncalled
    different = "" if hint else _structure.different_blocks(a, b, unpaired_a, unpaired_b)
    if different and plan.problems:  # layers no mapping makes alike: the cause, before what it shows up as
        plan.problems.insert(0, different)
    elif different:  # only layers left unpaired (strict=False may leave them): said beside them
        hint = different
    lost = _offset_tables.lacking_tables([n for n in unpaired_a if n not in run_a.uncalled],
                                         unpaired_b, a, b)  # tables looked up, not buffers
    hint = "; ".join(h for h in (hint, lost) if h)
    return Inferred(plan, unpaired_a, unpaired_b, hint, zeros)


def inferred_rules(src_model, dst_model, inputs, mapping, sides) -> list:
    """The inferred mapping as explicit rules (``compare_models(..., mapping="auto")``); ``sides``:
    ``_walk.sides``. ConversionError when the models cannot be paired."""
    if inputs is None:
        raise TypeError(NEEDS_INPUTS)
    a, b = sides(src_model, dst_model)
    found = infer(src_model, dst_model, a, b, inputs, mapping)
    if found.plan.problems:
        raise ConversionError("mapping='auto' cannot pair the models:\n  - " + "\n  - ".join(
            found.plan.problems + ([found.unpaired_text()] if found.unpaired_text() else [])))
    return found.plan.rules({**a.stable, **b.stable})
