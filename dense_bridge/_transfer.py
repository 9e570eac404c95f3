"""``db.transfer``, a front-door verb: one pipeline for every form of ``mapping=``.

It lives at the root because it composes two packages that know nothing of each other: ``models``
(walks, plans, moves) and ``testing`` (the comparison that verifies an inferred mapping).

    arguments checked -> each model walked once (``models._walk.Side``: backend resolved, adapter kept,
    parameters read once) -> a plan (``plan_for``: by order, explicit rules, or inferred from one
    forward pass of each model) -> ``models._execute.execute`` (every move checked, then all written, or
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

import contextlib
import gc
from typing import Any

from ._errors import ConversionError, check_flag
from .models import _infer, _plan as _mapping
from .models._execute import execute
from .models._report import TransferReport
from .models._resolve import check_arguments, plan_for
from .models._walk import Side, sides
from .testing.compare_models import compare_models

__all__ = ["transfer"]


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
            framework's adapter class) or ``"merge"`` (into dst's kernels; an adapter on a raw
            parameter, PEFT's LoRA on a router weight or an expert stack, is merged into that
            parameter as it is read, float64 and one rounding, and named as unmovable otherwise).
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
        if inputs is None:
            raise TypeError(_infer.NEEDS_INPUTS)
        _infer.split_inputs(inputs)  # every form compare_models takes, or one error naming it, before any run
    else:
        rules = _mapping.parse(mapping)
    with _collector_paused() if not auto else contextlib.nullcontext():
        return _transfer(src, dst, mapping, rules, auto, inputs, strict, allow_narrowing, requantize, verify, adapters)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector held off while a transfer walks and plans (it allocates
    many small objects and no reference cycles worth collecting): a full collection triggered
    there scans the whole heap of the user's process (torch, transformers: hundreds of
    thousands of objects), tens of milliseconds that cost more than the planning of a small
    model. Restored as it was afterwards; what the transfer left behind is collected later."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _transfer(src, dst, mapping, rules, auto, inputs, strict, allow_narrowing, requantize, verify, adapters):
    a, b = sides(src, dst)
    adapters.prepare(a)  # lora="merge": adapters on raw parameters merge as those are read
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
    unpaired = found.unpaired_text(hint=False)
    hint = f" {found.hint[:1].upper()}{found.hint[1:]}." if found.hint else ""  # what the difference means
    return (f"mapping='auto': the inferred transfer does not reproduce src on the inputs (dst was left unchanged).{hint} "
            f"First disagreeing pair: {where}: {compared.verdict()}.{upstream}."
            + (f" Unpaired: {unpaired}." if unpaired else " No parameterised layer was left unpaired.")
            + " verify=False keeps the inferred mapping without this check")
