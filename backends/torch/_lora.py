"""PEFT LoRA layers as one linear layer: the ``dense_bridge.lora`` verbs on torch.

PEFT's ``lora.Linear`` wraps ``base_layer`` (an ``nn.Linear``, or transformers' ``Conv1D`` with
``fan_in_fan_out``) and holds, per adapter name, ``lora_A[name]`` (an ``nn.Linear`` with weight
(r, in)), ``lora_B[name]`` (weight (out, r)), ``scaling[name]`` (lora_alpha / r, or / sqrt(r)
with rsLoRA) and for DoRA ``lora_magnitude_vector[name].weight`` (out,). ``fan_in_fan_out``
changes only the base weight's layout: lora_A and lora_B keep theirs. Canonical:
``lora_a = lora_A.weight.T`` (in, r), ``lora_b = lora_B.weight.T`` (r, out).

One adapter per layer is read: the active one. A layer holding several adapters is refused
with their names (a port that silently picks one is the bug this avoids), as is a merged or
disabled adapter (its weight no longer is the base) and ``lora_bias`` (an update outside the
canonical form).
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch
from torch import nn

from dense_bridge._errors import ConversionError

from ._arrays import copy_in, to_numpy


def is_lora(m) -> bool:
    """A PEFT LoRA linear wrapper (decided without importing peft: it is imported if one exists)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return layer is not None and type(m) is getattr(layer, "Linear", None)


def _active(m) -> str:
    names = list(m.lora_A.keys())
    where = f"{type(m).__module__}.{type(m).__qualname__}"
    if getattr(m, "merged_adapters", None):
        raise ConversionError(f"{where}: adapter(s) {m.merged_adapters} are merged into the base weight (PEFT merge()); "
                              f"call unmerge() first, or merge_and_unload() and move the plain model")
    if getattr(m, "disable_adapters", False):
        raise ConversionError(f"{where}: its adapters {names} are disabled; enable them or unload them first")
    active = [a for a in m.active_adapters if a in m.lora_A]
    if len(names) != 1 or len(active) != 1:
        raise ConversionError(f"{where} holds adapters {names} (active: {active}); dense_bridge reads exactly one "
                              f"adapter per layer: delete_adapter() the others (or add_weighted_adapter() to combine "
                              f"them) first")
    name = active[0]
    if m.lora_bias.get(name):
        raise ConversionError(f"{where}: adapter {name!r} has lora_bias=True (a bias update outside the "
                              f"low-rank form): merge it first")
    variant = getattr(m, "lora_variant", {}).get(name)
    if variant is not None and not m.use_dora.get(name):
        raise ConversionError(f"{where}: adapter {name!r} is a {type(variant).__name__} variant, not LoRA/DoRA")
    return name


@contextlib.contextmanager
def lora_base(m):
    yield m.base_layer if is_lora(m) else None


def read_lora(m) -> dict[str, np.ndarray]:
    name = _active(m)
    out = {"lora_a": to_numpy(m.lora_A[name].weight).T, "lora_b": to_numpy(m.lora_B[name].weight).T,
           "lora_scale": np.array(float(m.scaling[name]), dtype=np.float64)}
    if m.use_dora.get(name):
        out["lora_magnitude"] = to_numpy(m.lora_magnitude_vector[name].weight)
    return out


def write_lora(m, lora: dict) -> None:
    name = _active(m)
    if "lora_a" in lora:
        copy_in(m.lora_A[name].weight, lora["lora_a"], transpose=True)
    if "lora_b" in lora:
        copy_in(m.lora_B[name].weight, lora["lora_b"], transpose=True)
    if "lora_scale" in lora:
        m.scaling[name] = float(np.asarray(lora["lora_scale"]))
    if "lora_magnitude" in lora:
        copy_in(m.lora_magnitude_vector[name].weight, lora["lora_magnitude"])


def lora_dora() -> bool:
    """Does this framework have a DoRA adapter class (a magnitude vector)?"""
    return True


def lora_heads(m):
    return None


def _parent(model, path: str):
    if not path:
        raise ConversionError("the model itself is the linear layer: an adapter cannot be attached to or removed "
                              "from the root in place; wrap it in a module first")
    parent, _, name = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), name


def attach_lora(model, path: str, layer, *, rank: int, dora: bool):
    """Wrap ``layer`` (at ``path`` in ``model``) in PEFT's own ``lora.Linear`` (adapter "default")."""
    try:
        from peft import LoraConfig
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError as exc:
        raise ConversionError(f"attaching a LoRA adapter on torch needs peft (pip install peft): {exc}") from None
    conv1d = type(layer).__name__ == "Conv1D"
    if not (isinstance(layer, nn.Linear) or conv1d):
        raise ConversionError(f"{path}: PEFT attaches LoRA to nn.Linear and Conv1D, not {type(layer).__name__}")
    config = LoraConfig(r=rank, lora_alpha=rank, use_dora=dora, fan_in_fan_out=conv1d, lora_dropout=0.0)
    parent, name = _parent(model, path)
    wrapped = LoraLinear(layer, "default", config=config, r=rank, lora_alpha=rank, is_target_conv_1d_layer=conv1d)
    wrapped.to(layer.weight.device)
    for p in wrapped.parameters():  # the adapter in the base's dtype, as PEFT's autocast_adapter_dtype=False
        if p.dtype != layer.weight.dtype:
            p.data = p.data.to(layer.weight.dtype)
    setattr(parent, name, wrapped)
    return wrapped


def detach_lora(model, path: str, m):
    """Put ``m.base_layer`` back in ``m``'s place; return it."""
    parent, name = _parent(model, path)
    setattr(parent, name, m.base_layer)
    return m.base_layer


def lora_root(model) -> str:
    """The path prefix under which a PEFT wrapper holds the base model: ``"base_model.model."`` for a
    ``PeftModel`` (its ``base_model``, a ``LoraModel``, holds it as ``model``), ``"model."`` for a
    ``LoraModel`` alone, "" for any other model. Adapter files name layers by their path in the base
    model (PEFT writes ``base_model.model.<base path>`` itself), so this prefix is not part of it."""
    peft_model = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    tuner = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTuner", None)
    prefix = ""
    while True:
        if peft_model is not None and isinstance(model, peft_model):
            prefix, model = prefix + "base_model.", model.base_model
        elif tuner is not None and isinstance(model, tuner):
            prefix, model = prefix + "model.", model.model
        else:
            return prefix


def wrapper_params(m) -> dict[str, torch.Tensor]:
    """Every parameter of a wrapper under its path inside it ("base_layer.weight", "lora_A.default.weight")."""
    return dict(m.named_parameters())


def raw_adapter_wrappers(model) -> dict[str, str]:
    """PEFT adapter wrappers that are not a LoRA linear layer (LoRA on raw parameters, PEFT's
    ``ParamWrapper``, nested one per wrapped parameter): outermost wrapper path -> the path of the
    layer it wraps (the innermost ``base_layer``). Their ``lora_A``/``lora_B`` are ``nn.Linear``
    modules holding factors, never called as layers: the walk lists them as adapter parts."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    base_tuner = getattr(tuners, "BaseTunerLayer", None)
    if base_tuner is None:
        return {}
    out: dict[str, str] = {}
    for path, m in model.named_modules():
        if not isinstance(m, base_tuner) or is_lora(m) or any(path.startswith(w + ".") for w in out):
            continue
        base, at = getattr(m, "base_layer", None), f"{path}.base_layer" if path else "base_layer"
        while isinstance(base, base_tuner) and getattr(base, "base_layer", None) is not None:
            base, at = base.base_layer, at + ".base_layer"
        if isinstance(base, nn.Module):
            out[path] = at
    return out


def lora_raw_updates(model) -> list[tuple[str, str, np.ndarray, list[str]]]:
    """The updates of PEFT's LoRA on raw parameters (``ParamWrapper``), for ``lora="merge"``:
    (wrapper path, the wrapped parameter's path, its update in float64 in the parameter's own
    shape and layout, the wrapper's own factor parameter paths), one per wrapper, nested ones
    included. The update is PEFT's ``get_delta_weight`` computed in float64: ``scale * B @ A``
    (transposed with ``fan_in_fan_out``) for one matrix; for an expert stack of E experts, A
    (E * r, in) and B (out, r * E) read per expert, ``delta[e] = scale * (B_e @ A_e)`` laid out
    (E, in, out), or (E, out, in) where PEFT swapped them for the stack's layout.
    ConversionError names a wrapper holding several, merged or disabled adapters, or an update
    whose shape is not its parameter's."""
    out = []
    for path, base_path in raw_adapter_wrappers(model).items():
        m, at = model.get_submodule(path) if path else model, path
        while m is not None and hasattr(m, "lora_A") and hasattr(m, "parameter_name"):
            name = _active(m)
            base = model.get_submodule(base_path) if base_path else model
            param = getattr(base, m.parameter_name)
            a = m.lora_A[name].weight.detach().to(torch.float64)
            b = m.lora_B[name].weight.detach().to(torch.float64)
            scale = float(m.scaling[name])
            experts = int(getattr(m, "num_experts", 1) or 1)
            if experts == 1:
                delta = (b @ a) * scale
                if getattr(m, "fan_in_fan_out", False):
                    delta = delta.T
            else:
                a = a.reshape(experts, -1, a.shape[-1])
                b = b.reshape(b.shape[0], -1, experts)
                pattern = "o r e, e r i -> e o i" if getattr(m, "_did_swap_in_out_features", False) else \
                    "o r e, e r i -> e i o"
                delta = torch.einsum(pattern, b, a) * scale
            where = f"{at}: PEFT {type(m).__name__} on {base_path}.{m.parameter_name}"
            if tuple(delta.shape) != tuple(param.shape):
                raise ConversionError(f"{where}: its update has shape {tuple(delta.shape)} but the parameter "
                                      f"{tuple(param.shape)}; merge_and_unload() first")
            own = [f"{at}.{n}" if at else n for n, _ in m.named_parameters()
                   if n.startswith(("lora_A.", "lora_B."))]
            out.append((at, f"{base_path}.{m.parameter_name}", delta.numpy(), own))
            m, at = getattr(m, "base_layer", None), f"{at}.base_layer" if at else "base_layer"
    return out


def lora_leftovers(model) -> list[tuple[str, str, list[str]]]:
    """PEFT parts that are not a LoRA linear layer: (wrapper path, what it is, the parameter paths
    holding its trained values). A transfer that leaves those parameters behind names them."""
    if "peft" not in sys.modules:  # every such part is a PEFT class: none exists before peft is imported
        return []
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    base_tuner = getattr(tuners, "BaseTunerLayer", None)
    out = []
    for path, m in model.named_modules():
        prefix = f"{path}." if path else ""
        name = type(m).__name__
        if name in ("ModulesToSaveWrapper", "TrainableTokensWrapper") or "AuxiliaryTraining" in name:
            trained = [prefix + n for n, _ in m.named_parameters() if not n.startswith("original_module.")]
            out.append((path, f"a PEFT {name} (its trained copy)", trained))
        elif base_tuner is not None and isinstance(m, base_tuner) and not is_lora(m) \
                and not any(path.startswith(p + ".") for p, _, _ in out):
            # wrappers nest (PEFT's ParamWrapper: one per wrapped parameter); the base is the innermost
            base, wrapped = getattr(m, "base_layer", None), [getattr(m, "parameter_name", None)]
            while isinstance(base, base_tuner) and getattr(base, "base_layer", None) is not None:
                wrapped.append(getattr(base, "parameter_name", None))
                base = base.base_layer
            own = {id(p) for p in base.parameters()} if isinstance(base, nn.Module) else set()
            trained = [prefix + n for n, p in m.named_parameters() if id(p) not in own]
            wrapped = [w for w in wrapped if w]
            what = (f"a PEFT {type(m).__module__}.{name} adapter on the parameters {wrapped[::-1]} of "
                    f"{type(base).__name__} (LoRA on raw parameters, not a LoRA linear layer)") if wrapped else \
                f"a PEFT {type(m).__module__}.{name} adapter (not a LoRA linear layer)"
            out.append((path, what, trained))
    return out
