"""The ``walk`` verb: every layer holding parameters inside any ``nn.Module`` tree, with its path.

Paths are torch's own module paths (``named_modules``: "encoder.layer.0.output.dense"), in
definition order; "" is the root itself. Linear-family layers (``nn.Linear`` and its lazy and
dense_bridge variants, ``nn.Bilinear``, classes declared with ``db.register_layout`` such as
transformers' ``Conv1D``) are kind "linear"; quantized linear classes are "quantized" (an
``nn.Linear`` holding a torchao weight-only tensor reads through ``_quant.py``; torch.ao and
bitsandbytes modules are refused by name); everything else with parameters
(norms, embeddings, attention's packed ``in_proj_weight``) is "other", its parameters read and
written in torch's own layout under their own names.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

from dense_bridge.models._layouts import Entry, Layout, declared

from ._arrays import copy_in, to_numpy
from ._lora import raw_adapter_wrappers, wrapper_params
from ._quant import is_quantized as is_torchao
from ._quant import quant_layer
from ._to_spec import LINEAR_TYPES as _LINEAR_TYPES



def linear_kind(m: nn.Module) -> str | None:
    """"linear", "bilinear", "declared" for the linear family, else None."""
    kind = type(m)
    if kind in _LINEAR_TYPES:
        return "linear"
    if kind is nn.Bilinear:
        return "bilinear"
    if declared(m) is not None:
        return "declared"
    return None


def declaration(m: nn.Module) -> Layout | None:
    """The layout declaration of a third-party linear module (None for torch's own)."""
    return declared(m)


def _quantized(m: nn.Module) -> bool:
    """torch.ao quantized Linear modules, bitsandbytes' Linear8bitLt/Linear4bit and the like."""
    mod, name = type(m).__module__, type(m).__name__
    if "Linear" not in name:
        return False
    return "quantized" in mod or any(tag in name for tag in ("4bit", "8bit", "Quant", "FP8", "Int8"))


def walk(model: nn.Module) -> list[Entry]:
    """Every module with parameters of its own (and every linear-family module), in definition order."""
    out = []
    inside: list[str] = []  # paths of LoRA wrappers: their parts are the wrapper's parameters
    raw = raw_adapter_wrappers(model)  # LoRA on raw parameters: its factor modules are no linear layers
    lora_cls = getattr(sys.modules.get("peft.tuners.lora.layer"), "Linear", None)  # what is_lora looks for
    kinds: dict[type, str | None] = {}  # class -> its kind by class alone (decided once per class in a walk)
    linears: dict[type, bool] = {}  # class -> a subclass of nn.Linear (which may hold a torchao weight)
    for path, m in model.named_modules():
        if inside and any(path.startswith(w + ".") for w in inside):
            continue
        if lora_cls is not None and type(m) is lora_cls:  # is_lora: one linear layer under the wrapped layer's path
            inside.append(path)
            out.append(_entry(path, m, "linear", wrapper_params(m), lora=True))
            continue
        cls = type(m)
        if cls not in kinds:
            kinds[cls] = "linear" if linear_kind(m) else "quantized" if _quantized(m) else None
            linears[cls] = issubclass(cls, nn.Linear)
        # an nn.Linear holding a torchao tensor is quantized (read through _quant.py)
        torchao = linears[cls] and type(m._parameters.get("weight")) is not nn.Parameter and is_torchao(m)
        kind = "quantized" if torchao else kinds[cls]
        if kind is not None and raw and any(path.startswith(w + ".") and not (path == b or path.startswith(b + "."))
                                            for w, b in raw.items()):
            kind = "other"  # an adapter's factor (lora_A/lora_B of PEFT's ParamWrapper), named as an adapter part
        params = {n: p for n, p in m._parameters.items() if p is not None}
        # persistent floating buffers are state a port carries too (BatchNorm's running stats);
        # non-persistent ones (causal masks, rotary inv_freq) are recomputed by the model
        if m._buffers:
            params.update({n: b for n, b in m._buffers.items() if b is not None and b.is_floating_point()
                           and n not in m._non_persistent_buffers_set and n != "mask"})
        if kind is None:
            if not params:
                continue
            kind = "other"
        out.append(_entry(path, m, kind, params, torchao))
    return out


def _shape(p) -> tuple[int, ...]:
    if isinstance(p, nn.parameter.UninitializedTensorMixin):
        return ()
    return tuple(p.shape)  # torch.Size: a tuple of ints already


def _entry(path: str, m: nn.Module, kind: str, params: dict, torchao: bool | None = None, lora: bool = False) -> Entry:
    torchao = is_torchao(m) if torchao is None else torchao

    def read() -> dict[str, np.ndarray]:
        if torchao:  # the weight torchao dequantizes to, in torch's (out, in) layout (_quant.py)
            floats = quant_layer(m).dequantized()
            return {"weight": floats["kernel"].T, **({"bias": floats["bias"]} if "bias" in floats else {})}
        return {n: to_numpy(p) for n, p in params.items()}

    def write(arrays: dict[str, np.ndarray]) -> None:
        if torchao:  # float values into the codes: torchao's own quantize_
            handle = quant_layer(m)
            floats = handle.dequantized()
            kernel = np.asarray(arrays["weight"]).T if "weight" in arrays else floats["kernel"]
            handle.quantize(kernel, arrays.get("bias", floats.get("bias"))).write()
            return
        for n, a in arrays.items():
            copy_in(params[n], a)

    note = "" if kind != "quantized" else "its weights are quantized (packed integers and scales)"
    # the tensors where they live, for moves that stay on the device (dense_bridge/models/_device.py)
    # "holds_lora": whether the layer wraps a LoRA adapter, known here (spares the core asking lora_base)
    extra = {"holds_lora": lora} if torchao else {
        "read_device": lambda: {n: p.detach() for n, p in params.items()},
        "snapshot_device": lambda: {n: p.detach().clone() for n, p in params.items()}, "holds_lora": lora}
    ident, shapes = {}, {}
    for n, p in params.items():
        ident[n] = id(p)
        shapes[n] = tuple(p.shape) if type(p) is nn.Parameter or type(p) is torch.Tensor else _shape(p)
    return Entry(path, m, kind, tuple(params), ident, shapes, read, write, note, extra=extra)
