"""The ``get_params``/``set_params`` verbs: canonical parameters by chain position, with the
layout transposes (``nn.Linear.weight`` and the mask are (out, in) = ``kernel.T``; Bilinear's
weight is canonical as is).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from dense_bridge._errors import SpecError
from dense_bridge.quant import Quant

from ._arrays import copy_in, to_numpy
from ._quant import TorchaoQuantLayer, quant_build, quant_layer
from ._to_spec import (LINEAR_TYPES, chain, check_plain_params, declared_tensors, describe, has_params, is_container)


def layer_modules(native: nn.Module) -> list[tuple[str, nn.Module]]:
    """(key prefix, module) for every parameterised layer, by chain position."""
    if not is_container(native):
        # a chain checks each position in _leaf_spec; a lone pruned/parametrized Linear must fail
        # here too, not read a stale weight (or nothing: a parametrized Linear changes class)
        check_plain_params(native, describe(native))
        return [("", native)]
    return [(f"{i}.", s.module) for i, s in enumerate(chain(native)) if has_params(s.module)]


def _module_params(m: nn.Module, to_numpy=to_numpy) -> dict[str, np.ndarray]:
    """Canonical params of one layer, each read by ``to_numpy`` (the numpy view; detached tensors
    for :func:`device_params`)."""
    quantized = quant_layer(m)
    if quantized is not None:  # a torchao Linear in a chain: torchao's own dequantize() (_quant.py)
        return quantized.dequantized()
    if type(m) is nn.Bilinear:
        out = {"kernel": to_numpy(m.weight)}
    elif type(m) not in LINEAR_TYPES and has_params(m):  # declared with db.register_layout
        kernel, bias, transposed = declared_tensors(m)
        out = {"kernel": to_numpy(kernel.t()) if transposed else to_numpy(kernel)}
        return out if bias is None else {**out, "bias": to_numpy(bias)}
    elif type(m) in LINEAR_TYPES:
        if isinstance(m, nn.LazyLinear) and m.has_uninitialized_params():
            raise SpecError(f"this lazy {type(m).__name__} has no parameters yet: run one input through it first "
                            f"(its in_features is fixed by the first input)")
        # .t() before the reading: on a device the transpose happens there, then one copy to the host
        out = {"kernel": to_numpy(m.weight.t())}
        if getattr(m, "mask", None) is not None:
            out["mask"] = to_numpy(m.mask.t())
    else:
        return {}
    if m.bias is not None:
        out["bias"] = to_numpy(m.bias)
    return out


def _plain_linear(m) -> bool:
    """Is ``m`` exactly an ``nn.Linear`` holding its weight and bias as plain Parameters (not
    parametrized, pruned, hooked, lazy or quantized: what ``layer_modules`` checks), so its
    canonical params are ``weight.t()`` and ``bias`` with nothing else to look at: the fast path
    of the per-layer verbs, whose checks cost more than the read for a small layer."""
    if type(m) is not nn.Linear:
        return False
    params = m._parameters
    w, b = params.get("weight", False), params.get("bias", False)
    return type(w) is nn.Parameter and (b is None or type(b) is nn.Parameter) and "mask" not in m._buffers


def get_params(native: nn.Module) -> dict[str, np.ndarray]:
    """Canonical params as read-only zero-copy views of torch's memory (kernel = weight.T)."""
    quantized = quant_layer(native)
    if quantized is not None:  # torchao's own dequantize() (_quant.py)
        return quantized.dequantized()
    return {prefix + k: v for prefix, m in layer_modules(native) for k, v in _module_params(m).items()}


def set_params(native: nn.Module, params: dict[str, np.ndarray]) -> None:
    """Copy validated canonical params in (transposing copies into the existing tensors)."""
    if _plain_linear(native) and params.keys() <= {"kernel", "bias"}:
        if "kernel" in params:
            copy_in(native.weight, params["kernel"], transpose=True)
        if "bias" in params:
            copy_in(native.bias, params["bias"])
        return
    quantized = quant_layer(native)
    if quantized is not None:  # float weights into codes: torchao's own quantize_ (_quant.py)
        full = {**quantized.dequantized(), **params}
        quantized.quantize(full["kernel"], full.get("bias")).write()
        return
    for prefix, m in layer_modules(native):
        quantized = quant_layer(m)
        if quantized is not None:  # a torchao Linear in a chain: torchao's quantize_ (_quant.py)
            mine = {k: params[prefix + k] for k in ("kernel", "bias") if prefix + k in params}
            if mine:
                full = {**quantized.dequantized(), **mine}
                quantized.quantize(full["kernel"], full.get("bias")).write()
            continue
        if type(m) not in LINEAR_TYPES and type(m) is not nn.Bilinear:  # declared with db.register_layout
            kernel, bias, transposed = declared_tensors(m)
            if prefix + "kernel" in params:
                copy_in(kernel, params[prefix + "kernel"], transpose=transposed)
            if prefix + "bias" in params:
                copy_in(bias, params[prefix + "bias"])
            continue
        transpose = type(m) is not nn.Bilinear
        if prefix + "mask" in params:
            copy_in(m.mask, params[prefix + "mask"], transpose=True)
        if prefix + "kernel" in params:
            copy_in(m.weight, params[prefix + "kernel"], transpose=transpose)
        if prefix + "bias" in params:
            copy_in(m.bias, params[prefix + "bias"])
        if getattr(m, "mask", None) is not None and (prefix + "kernel" in params or prefix + "mask" in params):
            with torch.no_grad():
                m.weight.mul_(m.mask)  # masked weights are exactly 0 by contract


def quant_positions(native: nn.Module) -> dict[str, TorchaoQuantLayer]:
    """Key prefix ("" for a lone layer, "0.", ... by chain position) -> the handle of each torchao
    Linear (what a checkpoint of the chain stores as codes)."""
    if (h := quant_layer(native)) is not None:
        return {"": h}
    return {prefix: h for prefix, m in layer_modules(native) if (h := quant_layer(m)) is not None}


def quant_position_build(native: nn.Module, prefix: str, quant: Quant) -> nn.Module:
    """``native`` with the float nn.Linear at ``prefix`` quantized in place (:func:`quant_build`)."""
    modules = dict(layer_modules(native))
    quant_build(modules[prefix], quant)
    return native


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def device_params(native: nn.Module) -> dict[str, torch.Tensor] | None:
    """Canonical params as detached tensors where the model keeps them (kernel = ``weight.t()``, a
    view: nothing is copied, no device is left); None for a quantized layer (its dequantized
    floats are computed on the host)."""
    if _plain_linear(native):  # read from _parameters: the checks of Module.__getattr__ cost more than the views
        params = native._parameters
        w, b = params["weight"].detach(), params.get("bias")
        return {"kernel": w.t()} if b is None else {"kernel": w.t(), "bias": b.detach()}
    if quant_layer(native) is not None:
        return None
    modules = layer_modules(native)  # once: it checks every layer for computed weights
    if any(quant_layer(m) is not None for _, m in modules):
        return None
    return {prefix + k: v for prefix, m in modules for k, v in _module_params(m, _detached).items()}


_PLAIN_TYPES = frozenset((torch.Tensor, nn.Parameter))


def _writable(dst, src) -> bool:
    """Can ``dst.copy_(src)`` neither fail nor allocate: both dense tensors of torch's own (no
    subclass: no torchao, DTensor or fake tensor, whose ``copy_`` is someone else's code),
    floating, with data (not meta), of one shape on one device; dst no inference tensor (torch
    refuses an in-place update of one outside inference mode) and no element of dst sharing
    memory with another (an expanded tensor: torch refuses to write it)."""
    if type(dst) not in _PLAIN_TYPES or type(src) not in _PLAIN_TYPES or dst.layout is not torch.strided \
            or src.layout is not torch.strided or dst.shape != src.shape or not dst.is_floating_point() \
            or not src.is_floating_point() or dst.is_meta or src.is_meta or dst.is_inference() \
            or dst.device != src.device:
        return False
    try:
        return dst.is_contiguous() or torch._debug_has_internal_overlap(dst) == 0  # MemOverlap::No
    except (AttributeError, RuntimeError):
        return False


def in_place_copies(writes: list) -> tuple[list[int], Any]:
    """The writes of a transfer that are plain in-place copies, done together (``devices`` extra).

    Args:
        writes: ``(layer, form, arrays)`` per write: ``form`` "canonical" (a linear layer's
            ``kernel`` (in_features, units) and ``bias``, as :func:`device_params` gives them) or
            "native" (the layer's own parameters and floating buffers by name, torch's layout);
            ``arrays``: src's tensors, checked already (shapes, dtypes, NaN/Inf).

    Returns:
        ``(taken, commit)``: the indices of the writes that are copies of plain tensors into
        plain tensors of the same shape on the same device (:func:`_writable`), none of them
        reading memory another writes; ``commit()`` copies all of them in one
        ``torch._foreach_copy_`` (one call: nothing is left half-done between two of them, not
        even by a KeyboardInterrupt, and nothing is allocated). None when nothing is taken. The
        rest is the caller's (written one by one, each with its undo).
    """
    copy_all = getattr(torch, "_foreach_copy_", None)
    if copy_all is None:
        return [], None
    taken, dsts, srcs = [], [], []
    for i, (layer, form, arrays) in enumerate(writes):
        pairs = _targets(layer, form, arrays)
        if pairs is None:
            continue
        for d, s in pairs:
            if not _writable(d, s):
                break
        else:
            taken.append(i)
            for d, s in pairs:
                dsts.append(d)
                srcs.append(s)
    if not taken:
        return [], None
    read = {s.untyped_storage().data_ptr() for s in srcs}
    if any(d.untyped_storage().data_ptr() in read for d in dsts):  # a model writing into itself: one by one
        return [], None

    def commit() -> None:
        with torch.no_grad():
            copy_all(dsts, srcs)
    return taken, commit


def _targets(layer, form: str, arrays: dict) -> list | None:
    """(dst tensor, src tensor in dst's layout) for each array of one write; None where the write
    is not a plain copy (a layer read through a declaration, a mask, a quantized weight)."""
    if form == "canonical":
        if not _plain_linear(layer):
            return None
        params = layer._parameters  # what _plain_linear checked: a plain weight, a plain bias or None
        out = []
        for k, v in arrays.items():
            if not isinstance(v, torch.Tensor):
                return None
            if k == "kernel":
                out.append((params["weight"], v.t()))
            elif k == "bias" and params.get("bias") is not None:
                out.append((params["bias"], v))
            else:
                return None
        return out
    if form == "native":
        out = []
        for n, v in arrays.items():
            t = layer._parameters.get(n)
            if t is None:
                t = layer._buffers.get(n)
            if t is None or not isinstance(v, torch.Tensor):
                return None
            out.append((t, v))
        return out
    return None
