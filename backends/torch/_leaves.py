"""Reading one torch module as a layer spec: the Linear family, Bilinear, Identity, Dropout and
activation modules (what a chain position can hold).
"""
from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize, prune

from dense_bridge._errors import ConversionError
from dense_bridge._layouts import declared
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Identity

from ._activations import _module_activation
from ._layers import _META, DenseLinear, LazyDense
from ._tensors import _dtype_name


def _describe(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


# NonDynamicallyQuantizableLinear: nn.MultiheadAttention's out_proj, an nn.Linear in all but name
_LINEAR_TYPES = (nn.Linear, DenseLinear, nn.LazyLinear, LazyDense, nn.modules.linear.NonDynamicallyQuantizableLinear)


def _has_params(m: nn.Module | None) -> bool:
    """Is ``m`` a layer whose parameters dense_bridge reads (Linear family or Bilinear)?"""
    return m is not None and (type(m) in _LINEAR_TYPES + (nn.Bilinear,) or declared(m) is not None)


def _declared_tensors(m: nn.Module) -> tuple[object, object | None, bool]:
    """(kernel tensor, bias tensor or None, stored transposed?) of a class declared with
    db.register_layout (transformers' Conv1D: weight (in, out), not transposed)."""
    decl = declared(m)
    kernel = getattr(m, decl.kernel, None)
    if kernel is None or getattr(kernel, "ndim", 0) != 2:
        raise ConversionError(f"cannot read {_describe(m)}: its layout declaration names the kernel "
                              f"attribute {decl.kernel!r}, which is {type(kernel).__name__}, not a 2-D tensor")
    bias = getattr(m, decl.bias, None) if decl.bias else None
    return kernel, bias, decl.transposed


def _hook_fix(m: nn.Module) -> str:
    """Why a module's weight/bias is not a Parameter (a forward pre-hook computes it), and the fix."""
    hooks = list(m._forward_pre_hooks.values())
    pruned = [h._tensor_name for h in hooks if isinstance(h, prune.BasePruningMethod)]
    if pruned:
        removes = "; ".join(f"torch.nn.utils.prune.remove(module, {n!r})" for n in pruned)
        return (f"{' and '.join(pruned)} pruned with torch.nn.utils.prune (<name> = <name>_orig * <name>_mask, "
                f"recomputed at every forward). Make the pruning permanent first: {removes}; for a mask that "
                f"stays enforced, use db.Dense(..., mask=...)")
    kinds = {type(h).__name__ for h in hooks}
    if "WeightNorm" in kinds:
        return ("weight computed by the legacy torch.nn.utils.weight_norm hook (from weight_g, weight_v). Bake it in "
                "first: torch.nn.utils.remove_weight_norm(module)")
    if "SpectralNorm" in kinds:
        return ("weight computed by the legacy torch.nn.utils.spectral_norm hook (from weight_orig). Bake it in "
                "first: torch.nn.utils.remove_spectral_norm(module)")
    return "weight or bias computed rather than registered as a Parameter; make it a plain nn.Parameter first"


def _check_plain_params(m: nn.Module, where: str) -> None:
    """ConversionError for a Linear/Bilinear whose weight or bias is computed, not stored.

    torch's prune, parametrize (weight_norm, spectral_norm, orthogonal, ...) and the legacy
    weight_norm/spectral_norm hooks replace the ``weight`` Parameter by a tensor recomputed from other ones at
    every forward: a value written into it is lost at the next call, and one read from it goes
    stale after ``opt.step()``. Only the user can choose how to bake it in.
    """
    if not isinstance(m, (nn.Linear, nn.Bilinear)):
        return
    if parametrize.is_parametrized(m):
        names = list(m.parametrizations.keys())
        removes = "; ".join(f"torch.nn.utils.parametrize.remove_parametrizations(module, {n!r})" for n in names)
        raise ConversionError(
            f"cannot convert {where}: {type(m).__name__} has its {' and '.join(names)} parametrized with "
            f"torch.nn.utils.parametrize (weight_norm, spectral_norm, ...: recomputed from "
            f"parametrizations.<name>.original at every access), so dense_bridge cannot read or write it "
            f"exactly. Bake it in first: {removes}")
    # a reparametrized tensor is deleted from _parameters (a bias=False layer keeps "bias": None)
    if "weight" not in m._parameters or "bias" not in m._parameters:
        raise ConversionError(f"cannot convert {where}: {type(m).__name__} has its {_hook_fix(m)}")


def _dense_spec(m: nn.Module, where: str) -> Dense:
    lazy = isinstance(m, nn.LazyLinear) and m.has_uninitialized_params()
    act = getattr(m, "activation", None)
    activation = Activation("linear") if act is None or type(act) is nn.Identity else \
        _module_activation(act, f"{where}.activation")
    if activation is None:
        raise ConversionError(f"{where}.activation is {_describe(act)}, not a known activation module")
    mask = getattr(m, "mask", None)
    meta = getattr(m, _META, None) or {}
    return Dense(
        m.out_features, in_features=None if lazy else m.in_features, use_bias=m.bias is not None,
        # read as bool: the mask is 0/1 in the layer dtype, and Wiring takes no bfloat16
        activation=activation, mask=None if mask is None else (mask.detach().cpu() != 0).numpy().T,
        # a hand-built nn.Linear was initialised with torch's U(+-1/sqrt(in)) for both
        kernel_init=meta.get("kernel_init", "torch_default"), bias_init=meta.get("bias_init", "torch_default"),
        dtype=_dtype_name(m.weight.dtype, where), name=meta.get("name"))


def _leaf_spec(m: nn.Module, where: str):
    """The spec of a single module, or None when ``m`` is not one dense_bridge knows as a layer."""
    _check_plain_params(m, where)
    kind = type(m)
    if kind in _LINEAR_TYPES:
        return _dense_spec(m, where)
    if kind is nn.Bilinear:
        meta = getattr(m, _META, None) or {}
        return Bilinear(m.in1_features, m.in2_features, m.out_features, use_bias=m.bias is not None,
                        init=meta.get("init", "torch_default"), dtype=_dtype_name(m.weight.dtype, where),
                        name=meta.get("name"))
    if declared(m) is not None:
        kernel, bias, transposed = _declared_tensors(m)
        units, in_features = kernel.shape if transposed else kernel.shape[::-1]
        return Dense(int(units), in_features=int(in_features), use_bias=bias is not None,
                     kernel_init="torch_default", bias_init="zeros", dtype=_dtype_name(kernel.dtype, where))
    if kind is nn.Identity:
        return Identity(name=(getattr(m, _META, None) or {}).get("name"))
    if kind in (nn.Dropout, nn.AlphaDropout):
        return Identity()  # dropout's eval-mode function; training-time dropout is not carried over
    return _module_activation(m, where)
