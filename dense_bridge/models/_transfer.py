"""``db.transfer``: one pipeline for every form of ``mapping=``.

    arguments checked -> each model walked once (``_walk.Side``: backend resolved, adapter kept,
    parameters read once) -> a plan (``plan_for``: by order, explicit rules, or inferred from one
    forward pass of each model) -> ``_execute.execute`` (every move checked, then all written, or
    nothing) -> with ``mapping="auto"`` and ``verify=True``, ``testing.compare_models(...,
    judge="carried")`` on the same inputs.

An inferred mapping is checked along the whole run (every matched linear layer's input and
output, and the model output): a layer-by-layer check alone cannot see q and k of equal width
swapped. When the check fails, or anything fails after a model ran, dst is put back from a
snapshot of all of its parameters taken before anything ran (a model may change itself in its
own forward) and a ConversionError names the first disagreeing pair and every parameterised
layer left unpaired.
"""
from __future__ import annotations

from typing import Any

from . import _infer, _plan as _mapping
from .._errors import ConversionError, check_flag, received
from ..testing.compare_models import compare_models
from ._by_order import by_order
from ._execute import execute
from ._report import TransferReport
from ._walk import Side, sides

__all__ = ["transfer", "plan_for", "match_moves", "match_layers"]


def transfer(src: Any, dst: Any, *, mapping: Any = None, strict: bool = True, allow_narrowing: bool = False,
             lora: str | None = None, allow_rounding: bool = False, requantize: bool = False,
             inputs: Any = None, verify: bool = True) -> TransferReport:
    """Move the parameters of model ``src`` into the existing model ``dst`` (any two frameworks).

    Linear layers (see ``linear_layers``) move in the canonical layout, each side transposed and
    reshaped by its declaration; other layers (norms, embeddings) move when mapped, parameter by
    parameter through ``_execute.NAME_TABLE`` (``weight``/``bias`` <-> ``gamma``/``beta``,
    ``weight`` <-> ``embeddings``), in the frameworks' shared layout. A parameter path mapped
    directly moves as it is stored (shapes must agree).

    Args:
        src: the model to read (a torch ``nn.Module``, a Keras model or layer, an MLX, Flax NNX or
            Equinox module, an ONNX graph, a numpy reference model).
        dst: the existing model to write.
        mapping: which layers and parameters go where. Keys and values are paths (torch "a.b",
            Keras "a/b" without the root model's name, MLX "a.b"):

            - ``None``: linear layers paired by order (two layers of equal shape whose last path
              components say another pairing are an error naming them), and every other
              parameter (norms, embeddings, running statistics, raw parameters) into the one of
              the same path and shape, so two models of one architecture move completely;
            - a dict ``{src path: dst path}``; a value that is a list of dst layer paths splits the
              src linear layer along units into them, in order, each taking as many units as it
              has; a key that is a tuple of src layer paths concatenates them along units into the
              one dst layer; a value ``(dst_parameter_path, fn)`` on a parameter path moves
              ``fn(array)``; ``{"to": paths, "heads": n}`` declares a fused side whose units
              interleave per head (GPT-NeoX ``query_key_value``);
            - a list of ``(regex, replacement)`` rules: each src layer path (then each parameter
              path of layers no rule took) goes through the first rule that ``re.fullmatch``-es
              it (``dense_bridge.models._plan``);
            - a callable ``src path -> dst path, list of paths, or None``;
            - ``"auto"`` (needs ``inputs``): each model runs forward once on ``inputs`` and the
              calls of their parameterised layers (linear, norm, embedding) are paired by kind,
              execution order, shape and data flow (``_infer``); ``db.auto(rules)``: the explicit
              entries first, the rest inferred.
        strict: ``True``: the transfer is complete: every linear layer of both models matched,
            every rule used, and every parameter of ``dst`` written, except parameters tied to one
            that is written and computed buffers (rotary frequencies, masks: a walk does not list
            them); running statistics (BatchNorm's) are parameters here. Otherwise a
            ConversionError names every parameter left unwritten and nothing is written.
            ``False``: what is matched is written and the rest listed in the report.
        allow_narrowing: round values into a narrower dst dtype (float32 into bfloat16) instead of
            refusing; the report's ``narrowed`` lists them. Widening is always exact.
        lora: how linear layers holding LoRA adapters move (``dense_bridge.lora._moves``): ``None``
            (a src adapter is an error naming it), ``"keep"`` (attached on dst with its
            framework's adapter class) or ``"merge"`` (into dst's kernels).
        allow_rounding: accept a scale dst folds into ``lora_b`` inexactly (Flax).
        requantize: a quantized dst whose arithmetic cannot hold src's codes bit for bit gets
            codes from its own quantizer (``report.quant_errors``) instead of an error.
        inputs: for ``mapping="auto"``: a list of arrays (positional), a dict (keyword), a list
            holding one dict, or a pair (src inputs, dst inputs); token ids stay integers.
        verify: ``mapping="auto"``: check the inferred transfer on ``inputs`` before keeping it;
            on failure dst is unchanged and a ConversionError names the first disagreeing pair.

    Returns:
        A :class:`TransferReport`: what moved, every parameter of either model that did not, the
        ties followed, and in ``rules`` the complete mapping used (reusable as ``mapping=``).

    Raises:
        TypeError: a bad argument (named, with the value received).
        ConversionError: every problem found, before anything is written (``dst`` unchanged).

    Ties: an output head whose parameters are its embedding's follows the embedding in every form:
    it moves once, with it, and needs no counterpart in ``dst``. Quantized linear layers: a
    quantized src into a float dst moves its exact dequantization; into a quantized dst its codes
    move when dst's arithmetic dequantizes them to the same floats bit for bit, else an error
    unless ``requantize=True``.
    """
    adapters = check_arguments(src, dst, strict=strict, allow_narrowing=allow_narrowing, lora=lora,
                               allow_rounding=allow_rounding, requantize=requantize)
    auto = _infer.is_auto(mapping)
    rules = None
    if auto:
        check_flag("verify", verify)
        inputs = _infer.one_dict(inputs)
        if inputs is None:
            raise TypeError(_infer.NEEDS_INPUTS)
    else:
        rules = _mapping.parse(mapping)
    a, b = sides(src, dst)
    saved = b.snapshot() if auto else None  # before either model runs: dst may change itself in its forward
    try:
        plan, found = plan_for(a, b, mapping, rules, inputs, strict)
        report = execute(a, b, plan, adapters, strict=strict, allow_narrowing=allow_narrowing, requantize=requantize)
        if auto:
            _verify(src, dst, inputs, report, found, verify)
    except BaseException:
        if saved is not None:
            Side.restore(saved)
        raise
    return report


def check_arguments(src: Any, dst: Any, *, strict: Any, allow_narrowing: Any, lora: Any, allow_rounding: Any,
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


def plan_for(a: Side, b: Side, mapping: Any, rules: list | None, inputs: Any = None, strict: bool = True
             ) -> tuple[_mapping.Plan, Any]:
    """The plan of ``mapping`` between sides ``a`` and ``b``, and for an inferred one the inference
    (``_infer.Inferred``, else None). ``rules``: ``_plan.parse(mapping)`` for the explicit forms.
    An inferred plan with problems (or, with ``strict``, layers left unpaired) is a ConversionError."""
    if not _infer.is_auto(mapping):
        return (by_order(a, b) if rules is None else _mapping.build_plan(a, b, rules)), None
    found = _infer.infer(a.model, b.model, a, b, inputs, mapping)
    problems = list(found.plan.problems)
    if strict and (found.unpaired_src or found.unpaired_dst):
        problems.append(found.unpaired_text() + " (never called on these inputs, or without a counterpart: pass "
                        "strict=False to leave them, or map them in db.auto({...}))")
    if problems:
        raise ConversionError(f"cannot transfer {a.backend} -> {b.backend} with mapping='auto' (nothing was "
                              f"written):\n  - " + "\n  - ".join(problems))
    plan = found.plan
    _mapping.in_source_order(a, plan)
    _mapping.finish(a, b, plan)
    return plan, found


def _verify(src: Any, dst: Any, inputs: Any, report: TransferReport, found: Any, verify: bool) -> None:
    """Check an inferred transfer just written on the inputs it was inferred from (the caller puts
    dst back when this raises)."""
    if not verify:
        report.verification = ("inferred mapping NOT verified (verify=False): check it with "
                               "db.testing.compare_models(src, dst, inputs, mapping=report.rules)")
        return
    compared = compare_models(src, dst, inputs, mapping=report.rules, grads=False, judge="carried")
    if not compared.passed:
        raise ConversionError(_verification_error(compared, found))
    report.verification = (f"inferred mapping verified on the inputs: {len(compared.calls)} calls of "
                           f"{len(compared.pairs)} matched linear layers and the model output agree")


def _verification_error(compared, found) -> str:
    f = compared.first_failure
    if f is not None and f.layer is None:
        where = "the model output"
        upstream = (" The matched layers all agree, so the cause lies after the last of them (an activation, "
                    "attention, the head) or in equal-width layers of one input paired the wrong way round "
                    "(q and k: each reproduces its partner)")
    else:
        where = f"src {compared.first_divergence_a!r} / dst {compared.first_divergence!r} ({f.quantity if f else '?'})"
        upstream = (" Its input already differs: the cause may lie upstream of it (in the code between it and the "
                    "matched layer before it, e.g. an activation or attention, or in equal-width layers of one "
                    "input paired the wrong way round)") if f is not None and f.quantity == "input" else ""
    unpaired = found.unpaired_text()
    return (f"mapping='auto': the inferred transfer does not reproduce src on the inputs (dst was left unchanged). "
            f"First disagreeing pair: {where}: {compared.verdict()}.{upstream}."
            + (f" Unpaired: {unpaired}." if unpaired else " No parameterised layer was left unpaired.")
            + " verify=False keeps the inferred mapping without this check")


# ----------------------------------------------------------------------------- the plan's linear moves
def match_moves(a: Any, b: Any, mapping: Any = None, *, walked: tuple[Side, Side] | None = None
                ) -> list[_mapping.LayerMove]:
    """The linear layer moves of ``a`` into ``b`` as :func:`transfer` plans them (splits and
    concatenations included); ConversionError lists every problem found, and a mapping that
    pairs no linear layer at all is an error naming the rules that matched nothing.
    ``walked``: ``sides(a, b, ("a", "b"))`` when the caller holds them, so neither model is walked again."""
    rules = _mapping.parse(mapping)
    src, dst = walked if walked is not None else sides(a, b, ("a", "b"))
    plan = by_order(src, dst) if rules is None else _mapping.build_plan(src, dst, rules)
    if plan.problems:
        raise ConversionError("cannot match the layers of a and b:\n  - " + "\n  - ".join(plan.problems))
    moves = [m for m in plan.layers if m.linear]
    if not moves:
        idle = f" Rules that matched nothing: {plan.idle}." if plan.idle else ""
        raise ConversionError(f"the mapping pairs no linear layer of a with one of b.{idle} a's linear layers: "
                              f"{[e.path for e in src.linear()][:8]}; b's: {[e.path for e in dst.linear()][:8]}. "
                              f"{received('mapping', mapping)}")
    return moves


def match_layers(a: Any, b: Any, mapping: Any = None) -> dict[str, str]:
    """Linear layer paths of ``a`` -> linear layer paths of ``b``, as :func:`transfer` pairs them.

    ``mapping`` as in :func:`transfer` (None: by order, refusing ambiguous equal-shape pairs).
    Pairs of non-linear layers are left out. ConversionError lists every problem found.
    """
    return {m.src[0].path: m.dst[0].path for m in match_moves(a, b, mapping)
            if len(m.src) == len(m.dst) == 1}
