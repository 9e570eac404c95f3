"""The PyTorch adapter: specs <-> ``torch.nn`` modules, canonical parameters, autograd traces.

Layouts (canonical is numpy's y = x @ kernel + bias):

- ``nn.Linear.weight`` is (out, in) = ``kernel.T``; ``bias`` (out,) = ``bias``. Every transpose
  lives here: out with a zero-copy ``weight.detach().numpy().T``; in, at compile, as fresh memory
  already transposed (``ParamSource.native_layer``: a cache-blocked copy, faster than torch's
  ``copy_(K.t())``) that torch adopts through ``torch.from_numpy``, and in ``set_params`` with
  ``weight.copy_(K.t())`` into the existing tensors.
- :class:`DenseLinear` (a Dense with an activation and/or a mask) keeps the mask as a persistent
  buffer ``"mask"`` in the weight's layout (out, in) = ``mask.T``; the forward multiplies
  ``weight * mask``, so the mask holds from the first call and never trains.
- ``nn.Bilinear.weight`` is (out, in1, in2) = ``kernel``: no transpose.
- bfloat16 crosses to numpy as ``ml_dtypes.bfloat16`` through an int16 view (numpy has no bf16).

Compile: Dense -> exactly ``nn.Linear`` when there is no activation and no mask, else
:class:`DenseLinear`; lazy Dense -> :class:`LazyDense` (an ``nn.LazyLinear`` that draws the seeded
parameters at its first call, then becomes ``nn.Linear``/``DenseLinear`` like torch's own lazy
modules); Bilinear -> ``nn.Bilinear``; Identity -> ``nn.Identity``; Activation -> the native
module with explicit parameters, or :class:`ExactActivation` where torch has no exact module;
Sequential -> ``nn.Sequential`` (keys by native position).

to_spec also reads what users write: ``nn.Sequential`` of those modules, and any ``nn.Module``
whose ``forward`` is a single chain input -> Linear/activation -> ... -> output (traced with
``torch.fx``; its parameter keys are the chain positions of the returned Sequential). Dropout
is read as Identity (its eval-mode function). A leading ``x.view(-1, in_features)`` (the MNIST
flattening in most tutorial MLPs) is accepted as input formatting: the spec takes (*, in_features).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError, SpecError, received
from dense_bridge._params import ParamSource
from dense_bridge._trace import LayerTrace, Trace
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Identity, Sequential, from_config

__all__ = ["DenseLinear", "LazyDense", "ExactActivation"]

_TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                 "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
# Spec fields a torch module cannot hold natively (initializers, names): kept on the compiled
# module as plain JSON-able data so that deepcopy/pickle of the module keep working.
_META = "_dense_bridge_meta"
_LAZY_INIT = "_dense_bridge_init"


# ------------------------------------------------------------------ numpy <-> torch
def _dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ConversionError(f"{what} has dtype {dtype}; dense_bridge supports float32, float64, float16 "
                              f"and bfloat16")
    return _DTYPE_NAMES[dtype]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor (a copy for other devices); bf16 as ml_dtypes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    else:
        arr = t.numpy()
    arr.flags.writeable = False  # torch's memory: callers copy before mutating
    return arr


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    """A tensor viewing ``arr`` (no copy) for torch to read from; bf16 through an int16 view."""
    arr = np.asarray(arr)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    bf16 = arr.dtype == numpy_dtype("bfloat16")
    if bf16:
        arr = arr.view(np.int16)
    if any(s < 0 for s in arr.strides):  # torch.from_numpy rejects negative strides
        arr = np.ascontiguousarray(arr)
    with warnings.catch_warnings():
        # torch warns that a read-only array could be written through the tensor; we only read
        # it (it is the source of a copy_), so viewing it saves a full copy.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if bf16 else t


def _copy_in(target: torch.Tensor, value: np.ndarray, transpose: bool = False) -> None:
    """Copy canonical ``value`` into ``target`` (transposed for torch's (out, in) layout)."""
    src = _from_numpy(value)
    with torch.no_grad():
        target.copy_(src.t() if transpose else src)


# ------------------------------------------------------------------ activations
class ExactActivation(nn.Module):
    """An activation torch has no exact module for: softplus without threshold, exponential,
    linear, and selu with non-default constants. Holds the :class:`Activation` spec."""

    def __init__(self, spec: Activation) -> None:
        super().__init__()
        spec = spec if isinstance(spec, Activation) else Activation(spec)
        if spec.name not in ("softplus", "exponential", "linear", "selu"):
            raise SpecError(f"ExactActivation covers softplus, exponential, linear and selu; use the torch "
                            f"module for {spec.name!r}. {received('spec', spec)}")
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = self.spec.name
        if name == "softplus":
            # log(1 + e^x) exactly: torch's softplus returns x above threshold=20 (2e-9 off in
            # float64) and overflows to inf without one; logaddexp does neither.
            return torch.logaddexp(x, x.new_zeros(()))
        if name == "exponential":
            return torch.exp(x)
        if name == "selu":
            p = self.spec.params
            return p["scale"] * F.elu(x, alpha=p["alpha"])
        return x

    def extra_repr(self) -> str:
        return ", ".join([repr(self.spec.name)] + [f"{k}={v!r}" for k, v in self.spec.params.items()])


_DEFAULT_SELU = Activation("selu")


def _activation_module(act: Activation) -> nn.Module:
    """The torch module computing ``act`` exactly, every parameter passed explicitly."""
    n, p = act.name, act.params
    simple = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "sigmoid": nn.Sigmoid,
              "hard_sigmoid": nn.Hardsigmoid, "hard_silu": nn.Hardswish, "tanh": nn.Tanh,
              "softsign": nn.Softsign, "mish": nn.Mish}
    if n in simple:
        return simple[n]()
    if n == "leaky_relu":
        return nn.LeakyReLU(negative_slope=p["negative_slope"])
    if n == "elu":
        return nn.ELU(alpha=p["alpha"])
    if n == "selu" and act == _DEFAULT_SELU:
        return nn.SELU()  # torch's constants are the exact ones (ATen SELU_ALPHA/SELU_SCALE)
    if n == "gelu":
        return nn.GELU(approximate="none")
    if n == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if n == "softmax":
        return nn.Softmax(dim=p["axis"])
    if n == "log_softmax":
        return nn.LogSoftmax(dim=p["axis"])
    return ExactActivation(act)


# torch's softplus returns x above ``threshold``: off by log1p(exp(-threshold)) <= 2.1e-9 for
# threshold >= 20 (torch's default), below float32 resolution. Read as the exact softplus.
_SOFTPLUS_MIN_THRESHOLD = 20.0


def _softplus_spec(beta: Any, threshold: Any, where: str) -> Activation:
    if beta != 1:
        raise ConversionError(f"{where}: softplus with beta={beta!r} has no dense_bridge equivalent (only "
                              f"beta=1). {received('beta', beta)}")
    if not threshold >= _SOFTPLUS_MIN_THRESHOLD:
        raise ConversionError(f"{where}: softplus with threshold={threshold!r} differs from log(1 + e^x) by up "
                              f"to {math.log1p(math.exp(-threshold)):.2g}; only threshold >= 20 converts. "
                              f"{received('threshold', threshold)}")
    return Activation("softplus")


def _axis_spec(name: str, dim: Any, dtype: Any, where: str) -> Activation:
    if dim is None:
        raise ConversionError(f"{where}: {name} without dim uses torch's implicit dim (0 for 1-D and 3-D "
                              f"input, 1 otherwise); pass dim explicitly, e.g. dim=-1. {received('dim', dim)}")
    if dtype is not None:
        raise ConversionError(f"{where}: {name} with dtype={dtype} casts its output; not convertible. "
                              f"{received('dtype', dtype)}")
    return Activation(name, axis=int(dim))


def _hardtanh_spec(min_val: Any, max_val: Any, where: str) -> Activation:
    if (min_val, max_val) != (0.0, 6.0):
        raise ConversionError(f"{where}: Hardtanh({min_val}, {max_val}) is only convertible as relu6 "
                              f"(min_val=0, max_val=6). Received: min_val={min_val!r}, max_val={max_val!r}")
    return Activation("relu6")


def _celu_spec(alpha: Any, where: str) -> Activation:
    if alpha != 1.0:
        raise ConversionError(f"{where}: CELU(alpha={alpha}) equals elu only for alpha=1. "
                              f"{received('alpha', alpha)}")
    return Activation("elu", alpha=1.0)


def _module_activation(m: nn.Module, where: str) -> Activation | None:
    """The Activation a torch activation module computes (params read exactly), or None."""
    kind = type(m)
    if kind is ExactActivation:
        return m.spec
    plain = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.SiLU: "silu", nn.Sigmoid: "sigmoid",
             nn.Hardsigmoid: "hard_sigmoid", nn.Hardswish: "hard_silu", nn.Tanh: "tanh",
             nn.Softsign: "softsign", nn.Mish: "mish", nn.SELU: "selu"}
    if kind in plain:
        return Activation(plain[kind])
    if kind is nn.LeakyReLU:
        return Activation("leaky_relu", negative_slope=m.negative_slope)
    if kind is nn.ELU:
        return Activation("elu", alpha=m.alpha)
    if kind is nn.CELU:
        return _celu_spec(m.alpha, where)
    if kind is nn.Hardtanh:
        return _hardtanh_spec(m.min_val, m.max_val, where)
    if kind is nn.GELU:
        if m.approximate not in ("none", "tanh"):
            raise ConversionError(f"{where}: GELU(approximate={m.approximate!r}) is unknown")
        return Activation("gelu" if m.approximate == "none" else "gelu_tanh")
    if kind is nn.Softplus:
        return _softplus_spec(m.beta, m.threshold, where)
    if kind is nn.Softmax:
        return _axis_spec("softmax", m.dim, None, where)
    if kind is nn.LogSoftmax:
        return _axis_spec("log_softmax", m.dim, None, where)
    return None


# ------------------------------------------------------------------ modules
class DenseLinear(nn.Linear):
    """``nn.Linear`` with a fused activation and/or a fixed 0/1 connectivity mask.

    y = activation(x @ (weight * mask).T + bias). ``weight`` (out, in) and ``bias`` (out,) are the
    usual parameters; ``mask`` (out, in), in the weight's layout, is a persistent buffer: saved in
    the state dict, never a parameter, so no optimizer touches it. Multiplying in the forward
    (rather than torch's ``prune``, which renames the weight and is stale after ``opt.step()``)
    gives masked weights a zero gradient, so they stay exactly 0 under SGD with momentum and
    weight decay, Adam and AdamW when they start at 0; ``load_state_dict`` re-zeroes them.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 activation: nn.Module | None = None, mask: Any = None, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = activation
        if mask is None:
            self.register_buffer("mask", None)
            return
        mask = torch.as_tensor(mask, dtype=self.weight.dtype, device=self.weight.device)
        if tuple(mask.shape) != (out_features, in_features):
            raise SpecError(f"mask must have the weight's shape (out_features, in_features) = "
                            f"({out_features}, {in_features}). Received: mask of shape {tuple(mask.shape)}")
        self.register_buffer("mask", mask.clone())
        with torch.no_grad():
            self.weight.mul_(self.mask)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # one read each: nn.Module.__getattr__ is a slow path (~0.3 us a read) that showed at
        # 16->16, batch 1 in benchmarks/bench_layers.py
        mask, activation = self.mask, self.activation
        weight = self.weight if mask is None else self.weight * mask
        out = F.linear(input, weight, self.bias)
        return out if activation is None else activation(out)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # A state dict may carry nonzero masked weights (saved from an unmasked model): zero
        # them so the stored weight matches what the layer computes. Only in place when needed,
        # since with assign=True the weight is the caller's tensor.
        if self.mask is not None and self.weight.device.type != "meta":
            with torch.no_grad():
                if bool(((self.weight != 0) & (self.mask == 0)).any()):
                    self.weight.mul_(self.mask)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.mask is not None:
            text += f", mask=({self.out_features}, {self.in_features}) density={float(self.mask.float().mean()):.3f}"
        return text


def _check_width(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a materialized lazy layer: a clear error for another input width."""
    width = args[0].shape[-1] if args and args[0].dim() > 0 else None
    if width != module.in_features:
        raise SpecError(f"{type(module).__name__} was built for in_features={module.in_features} by its first "
                        f"input. Received: input of shape {tuple(args[0].shape)} (last dimension {width})")


class LazyDense(nn.LazyLinear):
    """A lazy Dense: ``nn.LazyLinear`` whose first input fixes ``in_features`` and draws the
    parameters from dense_bridge's seed (the same bits as the eager spec).

    Once materialized it becomes ``nn.Linear`` (or :class:`DenseLinear` with an activation),
    as torch's own lazy modules do, with a pre-hook that rejects inputs of another width.
    """

    def __init__(self, out_features: int, bias: bool = True, *, activation: nn.Module | None = None,
                 init: dict | None = None, device=None, dtype=None) -> None:
        super().__init__(out_features, bias, device=device, dtype=dtype)
        if activation is not None:
            self.activation = activation
            self.register_buffer("mask", None)
            self.cls_to_become = DenseLinear  # instance attribute: LazyModuleMixin reads it
        # {"spec": Dense config, "seed": int, "index": position in the Sequential}: plain data, so
        # the module deep-copies and pickles
        setattr(self, _LAZY_INIT, init)

    def initialize_parameters(self, input: torch.Tensor) -> None:  # type: ignore[override]
        if input.dim() == 0:
            raise SpecError(f"input must have at least 1 dimension (*, in_features). "
                            f"Received: input of shape {tuple(input.shape)}")
        width = int(input.shape[-1])
        if self.has_uninitialized_params():
            params = self._draw(width)
            with torch.no_grad():
                self.in_features = width
                self.weight.materialize((self.out_features, width))
                if self.bias is not None:
                    self.bias.materialize((self.out_features,))
            if params is None:
                self.reset_parameters()
            else:
                _copy_in(self.weight, params["kernel"], transpose=True)
                if self.bias is not None:
                    _copy_in(self.bias, params["bias"])
        elif self.in_features == 0:  # materialized by load_state_dict before the first call
            self.in_features = int(self.weight.shape[-1])
        if hasattr(self, _LAZY_INIT):
            delattr(self, _LAZY_INIT)  # drop the seed/params: they are in the weights now
        self.register_forward_pre_hook(_check_width)
        _check_width(self, (input,))

    def _draw(self, width: int) -> dict | None:
        info = getattr(self, _LAZY_INIT, None)
        if info is None:
            return None  # built by hand: torch's own init
        spec = from_config(info["spec"]).with_in_features(width)
        return ParamSource(spec, seed=info["seed"]).for_layer(info["index"], spec)


# ------------------------------------------------------------------ compile
def _adopt(module: nn.Module, arrays: dict[str, np.ndarray], parameters: dict[str, str],
           buffers: dict[str, str]) -> None:
    """Give a meta-device module real tensors made from fresh arrays (no copy).

    The arrays come from ``ParamSource.native_layer``: new memory in torch's layout that no
    one else references, so torch owning it through ``torch.from_numpy`` is safe. It is also
    the fast path: huge pages and a 64-byte start, which torch.empty (4 KiB pages) lacks.
    """
    for key, name in parameters.items():
        if key in arrays:
            setattr(module, name, nn.Parameter(_from_numpy(arrays[key])))
    for key, name in buffers.items():
        if key in arrays:
            setattr(module, name, _from_numpy(arrays[key]))


def _compile_dense(spec: Dense, source: ParamSource, index: int) -> nn.Module:
    dtype = _TORCH_DTYPES[spec.dtype]
    act = None if spec.activation.name == "linear" else _activation_module(spec.activation)
    if spec.lazy:
        # given params fix the width (ParamSource fills it), so a lazy layer always draws from the seed
        init = {"spec": spec.to_config(), "seed": source.seed, "index": index}
        module = LazyDense(spec.units, spec.use_bias, activation=act, init=init, dtype=dtype)
    else:
        # fresh memory already in torch's layout: weight (out, in) = kernel.T, mask like the weight
        params = source.native_layer(index, spec, {"kernel": (1, 0), "mask": (1, 0)})
        shape = (spec.units, spec.in_features)
        # Built on the meta device: torch's own init would be overwritten at once (skip_init).
        if act is None and spec.mask is None:
            module = nn.Linear(spec.in_features, spec.units, spec.use_bias, device="meta", dtype=dtype)
        else:
            mask = None if spec.mask is None else torch.empty(shape, device="meta", dtype=dtype)
            module = DenseLinear(spec.in_features, spec.units, spec.use_bias, activation=act, mask=mask,
                                 device="meta", dtype=dtype)
        _adopt(module, params, {"kernel": "weight", "bias": "bias"}, {"mask": "mask"})
    setattr(module, _META, {"kernel_init": spec.kernel_init.to_config(),
                            "bias_init": spec.bias_init.to_config(), "name": spec.name})
    return module


def _compile_bilinear(spec: Bilinear, source: ParamSource, index: int) -> nn.Bilinear:
    params = source.native_layer(index, spec)  # (out, in1, in2) is the canonical layout
    module = nn.Bilinear(spec.in1_features, spec.in2_features, spec.units, spec.use_bias, device="meta",
                         dtype=_TORCH_DTYPES[spec.dtype])
    _adopt(module, params, {"kernel": "weight", "bias": "bias"}, {})
    setattr(module, _META, {"init": spec.init.to_config(), "name": spec.name})
    return module


def _compile_layer(spec, source: ParamSource, index: int) -> nn.Module:
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, Bilinear):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, Identity):
        module = nn.Identity()
        setattr(module, _META, {"name": spec.name})
        return module
    if isinstance(spec, Activation):
        return _activation_module(spec)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def owns(obj) -> bool:
    return isinstance(obj, nn.Module)


def compile(spec, source: ParamSource) -> nn.Module:
    """The torch module for ``spec``, with parameters from ``source`` copied into torch memory."""
    if isinstance(spec, Sequential):
        module = nn.Sequential(*[_compile_layer(l, source, i) for i, l in enumerate(spec.layers)])
        setattr(module, _META, {"name": spec.name, "in_features": spec.in_features})
        return module
    return _compile_layer(spec, source, 0)


# ------------------------------------------------------------------ to_spec: single modules
def _describe(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


_LINEAR_TYPES = (nn.Linear, DenseLinear, nn.LazyLinear, LazyDense)


def _has_params(m: nn.Module | None) -> bool:
    """Is ``m`` a layer whose parameters dense_bridge reads (Linear family or Bilinear)?"""
    return m is not None and type(m) in _LINEAR_TYPES + (nn.Bilinear,)


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
    kind = type(m)
    if kind in _LINEAR_TYPES:
        return _dense_spec(m, where)
    if kind is nn.Bilinear:
        meta = getattr(m, _META, None) or {}
        return Bilinear(m.in1_features, m.in2_features, m.out_features, use_bias=m.bias is not None,
                        init=meta.get("init", "torch_default"), dtype=_dtype_name(m.weight.dtype, where),
                        name=meta.get("name"))
    if kind is nn.Identity:
        return Identity(name=(getattr(m, _META, None) or {}).get("name"))
    if kind in (nn.Dropout, nn.AlphaDropout):
        return Identity()  # dropout's eval-mode function; training-time dropout is not carried over
    return _module_activation(m, where)


# ------------------------------------------------------------------ to_spec: chains
class _Step:
    """One position of a chain: its spec, the module holding its parameters, how to run it."""

    __slots__ = ("spec", "module", "run")

    def __init__(self, spec, module: nn.Module | None, run: Callable) -> None:
        self.spec, self.module, self.run = spec, module, run


_OWN_LEAVES = (DenseLinear, LazyDense, ExactActivation)


def _is_container(m: nn.Module) -> bool:
    """Modules whose forward calls other modules: traced into rather than read as a layer."""
    if isinstance(m, nn.Sequential):
        return True
    return type(m) not in _OWN_LEAVES and not type(m).__module__.startswith("torch.nn")


class _Tracer(torch.fx.Tracer):
    """fx tracer that keeps dense_bridge's own modules as leaves (torch.nn ones already are)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m) in _OWN_LEAVES or super().is_leaf_module(m, qualname)


def _fn_spec(name: str, b: dict, where: str):
    """The spec of a traced function call, from its bound arguments (torch's defaults filled in)."""
    if name == "dropout":
        return Identity()
    if name == "hardtanh":
        return _hardtanh_spec(b.get("min_val", -1.0), b.get("max_val", 1.0), where)
    if name == "celu":
        return _celu_spec(b.get("alpha", 1.0), where)
    if name == "leaky_relu":
        return Activation("leaky_relu", negative_slope=b.get("negative_slope", 0.01))
    if name == "elu":
        return Activation("elu", alpha=b.get("alpha", 1.0))
    if name == "gelu":
        approx = b.get("approximate", "none")
        if approx not in ("none", "tanh"):
            raise ConversionError(f"{where}: gelu(approximate={approx!r}) is unknown")
        return Activation("gelu" if approx == "none" else "gelu_tanh")
    if name == "softplus":
        return _softplus_spec(b.get("beta", 1.0), b.get("threshold", 20.0), where)
    if name in ("softmax", "log_softmax"):
        return _axis_spec(name, b.get("dim"), b.get("dtype"), where)
    return Activation(name)


# Functions and tensor methods a chain may call: target -> (dense_bridge name, argument names).
_I, _IP = ("input",), ("input", "inplace")
_FUNCTIONS: dict[Any, tuple[str, tuple[str, ...]]] = {
    F.relu: ("relu", _IP), torch.relu: ("relu", _I), torch.relu_: ("relu", _I), F.relu_: ("relu", _I),
    F.relu6: ("relu6", _IP), F.hardtanh: ("hardtanh", ("input", "min_val", "max_val", "inplace")),
    F.leaky_relu: ("leaky_relu", ("input", "negative_slope", "inplace")),
    F.elu: ("elu", ("input", "alpha", "inplace")), F.celu: ("celu", ("input", "alpha", "inplace")),
    F.selu: ("selu", _IP), torch.selu: ("selu", _I),
    F.gelu: ("gelu", ("input", "approximate")), F.silu: ("silu", _IP),
    torch.sigmoid: ("sigmoid", _I), F.hardsigmoid: ("hard_sigmoid", _IP), F.hardswish: ("hard_silu", _IP),
    torch.tanh: ("tanh", _I), F.softplus: ("softplus", ("input", "beta", "threshold")),
    F.softsign: ("softsign", _I), F.mish: ("mish", _IP),
    F.softmax: ("softmax", ("input", "dim", "_stacklevel", "dtype")),
    torch.softmax: ("softmax", ("input", "dim", "dtype")),
    F.log_softmax: ("log_softmax", ("input", "dim", "_stacklevel", "dtype")),
    torch.log_softmax: ("log_softmax", ("input", "dim", "dtype")),
    torch.exp: ("exponential", _I), F.dropout: ("dropout", ("input", "p", "training", "inplace")),
}
_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "relu": ("relu", _I), "relu_": ("relu", _I), "sigmoid": ("sigmoid", _I), "tanh": ("tanh", _I),
    "exp": ("exponential", _I), "softmax": ("softmax", ("input", "dim", "dtype")),
    "log_softmax": ("log_softmax", ("input", "dim", "dtype")),
}
_RESHAPES = {"view", "reshape"}


def _node_name(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
    return f"node {node.name!r} ({node.op} {target})"


def _bind(node: torch.fx.Node, names: tuple[str, ...], where: str) -> dict:
    if len(node.args) > len(names):
        raise ConversionError(f"{where} has {len(node.args)} positional arguments; expected at most {len(names)}")
    bound = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key not in names or key in bound:
            raise ConversionError(f"{where} has an unexpected argument {key}={value!r}")
        bound[key] = value
    return bound


def _is_flatten(node: torch.fx.Node) -> int | None:
    """N for ``x.view(-1, N)`` / ``x.reshape(-1, N)`` (also with a tuple), else None."""
    if node.op != "call_method" or node.target not in _RESHAPES or node.kwargs:
        return None
    shape = node.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if len(shape) == 2 and shape[0] == -1 and isinstance(shape[1], int) and shape[1] > 0:
        return shape[1]
    return None


def _replay(node: torch.fx.Node) -> Callable:
    """Run a traced function/method node on a new chain input (its other arguments as traced)."""
    args, kwargs = list(node.args[1:]), dict(node.kwargs)
    if node.op == "call_method":
        return lambda x: getattr(x, node.target)(*args, **kwargs)
    if "input" in kwargs:  # F.relu(input=x)
        return lambda x: node.target(*node.args, **{**kwargs, "input": x})
    return lambda x: node.target(x, *args, **kwargs)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _traced_chain(root: nn.Module, what: str) -> list[_Step]:
    """The chain of a module's forward, read with torch.fx; ConversionError naming any offender."""
    try:
        graph = _Tracer().trace(root)
    except Exception as exc:  # noqa: BLE001 - any trace failure means "not a plain chain"
        raise ConversionError(f"cannot convert {what}: torch.fx could not trace its forward "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Only a "
                              f"chain of Linear layers and activations without Python control flow converts")
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ConversionError(f"cannot convert {what}: its forward takes {len(inputs)} inputs "
                              f"({', '.join(n.name for n in inputs)}); only single-input chains convert")
    steps: list[_Step] = []
    flatten: tuple[torch.fx.Node, int] | None = None
    cur = inputs[0]
    for node in nodes:
        if node.op == "placeholder":
            continue
        where = f"{what}, {_node_name(node)}"
        if node.op == "output":
            if node.args[0] is not cur:
                raise ConversionError(f"cannot convert {what}: it returns {node.args[0]!r}, not the last value "
                                      f"of a single chain")
            break
        used = node.all_input_nodes
        if used != [cur]:
            raise ConversionError(f"cannot convert {where}: it uses {[n.name for n in used]} where a chain "
                                  f"uses only the previous step's output {cur.name!r} (branches, residual "
                                  f"connections, parameters used directly and second inputs do not convert)")
        if len(cur.users) != 1:
            raise ConversionError(f"cannot convert {what}: the value {cur.name!r} feeds "
                                  f"{[u.name for u in cur.users]} (a branch or residual connection), at {where}")
        if _is_flatten(node) is not None:
            if steps:
                raise ConversionError(f"cannot convert {where}: a reshape inside the chain (only a leading "
                                      f"x.view(-1, in_features) converts, as input formatting)")
            flatten = (node, _is_flatten(node))
        else:
            steps.append(_node_step(root, node, cur, where))
        cur = node
    first = next((s.spec for s in steps if isinstance(s.spec, Dense)), None)
    if flatten is not None and first is not None and first.in_features not in (None, flatten[1]):
        raise ConversionError(f"cannot convert {what}, {_node_name(flatten[0])}: it flattens the input to "
                              f"{flatten[1]} features but the first Linear takes in_features={first.in_features}")
    return steps


def _node_step(root: nn.Module, node: torch.fx.Node, cur, where: str) -> _Step:
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        spec = _leaf_spec(module, where)
        if spec is None or isinstance(spec, Bilinear):
            raise ConversionError(f"cannot convert {where}: {_describe(module)} is not a Linear layer, "
                                  f"Identity, Dropout or activation module")
        if node.args[0] is not cur or len(node.args) != 1 or node.kwargs:
            raise ConversionError(f"cannot convert {where}: called with extra arguments")
        return _Step(spec, module, module)
    table = _FUNCTIONS if node.op == "call_function" else _METHODS if node.op == "call_method" else {}
    key = node.target
    try:
        entry = table.get(key)
    except TypeError:  # unhashable target
        entry = None
    if entry is None:
        raise ConversionError(f"cannot convert {where}: not a Linear layer or a known activation")
    name, names = entry
    bound = _bind(node, names, where)
    if bound.get("input") is not cur:
        raise ConversionError(f"cannot convert {where}: the chain value is not its input")
    spec = _fn_spec(name, bound, where)
    # dropout runs as what the spec says it is (identity), even if traced in training mode
    return _Step(spec, None, _identity if isinstance(spec, Identity) else _replay(node))


def _chain(native: nn.Module) -> list[_Step]:
    """Positions of a container (nn.Sequential or a traced nn.Module) as steps."""
    steps = _chain_steps(native)
    seen: dict[int, int] = {}
    for i, step in enumerate(steps):
        if _has_params(step.module):
            if id(step.module) in seen:
                raise ConversionError(f"cannot convert {_describe(native)}: the same {type(step.module).__name__} "
                                      f"is used at chain positions {seen[id(step.module)]} and {i} (shared "
                                      f"weights); dense_bridge layers own their parameters")
            seen[id(step.module)] = i
        if isinstance(step.spec, Identity) and step.module is not None and type(step.module) is not nn.Identity:
            step.run = _identity  # Dropout: its eval-mode function, whatever the module's mode
    return steps


def _chain_steps(native: nn.Module) -> list[_Step]:
    what = _describe(native)
    if type(native) is nn.Sequential:
        children = list(native)
        if not any(_is_container(c) for c in children):
            steps = []
            for i, child in enumerate(children):
                where = f"{what} position {i}"
                spec = _leaf_spec(child, where)
                if spec is None or isinstance(spec, Bilinear):
                    raise ConversionError(f"cannot convert {where}: {_describe(child)} is not a Linear layer, "
                                          f"Identity, Dropout or activation module")
                steps.append(_Step(spec, child, child))
            return steps
    return _traced_chain(native, what)


def to_spec(native: nn.Module):
    """The spec of a torch module: a layer, an nn.Sequential, or an nn.Module chain (see module doc)."""
    what = _describe(native)
    if not _is_container(native):
        spec = _leaf_spec(native, what)
        if spec is None:
            raise ConversionError(f"cannot convert {what}: not a Linear, Bilinear, Identity, Dropout, activation "
                                  f"or container module. {received('native', native)}")
        return spec
    steps = _chain(native)
    meta = getattr(native, _META, None) or {}
    layers = [s.spec for s in steps]
    try:
        try:
            return Sequential(layers, in_features=meta.get("in_features"), name=meta.get("name"))
        except SpecError:
            if not meta:
                raise
            return Sequential(layers)  # the module changed since compile: read it as it is now
    except (SpecError, TypeError) as exc:
        raise ConversionError(f"cannot convert {what}: its layers do not form a valid Sequential: {exc}") from None


# ------------------------------------------------------------------ parameters
def _layer_modules(native: nn.Module) -> list[tuple[str, nn.Module]]:
    """(key prefix, module) for every parameterised layer, by chain position."""
    if not _is_container(native):
        return [("", native)]
    return [(f"{i}.", s.module) for i, s in enumerate(_chain(native)) if _has_params(s.module)]


def _module_params(m: nn.Module) -> dict[str, np.ndarray]:
    if type(m) is nn.Bilinear:
        out = {"kernel": _to_numpy(m.weight)}
    elif type(m) in _LINEAR_TYPES:
        if isinstance(m, nn.LazyLinear) and m.has_uninitialized_params():
            raise SpecError(f"this lazy {type(m).__name__} has no parameters yet: run one input through it first "
                            f"(its in_features is fixed by the first input)")
        out = {"kernel": _to_numpy(m.weight).T}
        if getattr(m, "mask", None) is not None:
            out["mask"] = _to_numpy(m.mask).T
    else:
        return {}
    if m.bias is not None:
        out["bias"] = _to_numpy(m.bias)
    return out


def get_params(native: nn.Module) -> dict[str, np.ndarray]:
    """Canonical params as read-only zero-copy views of torch's memory (kernel = weight.T)."""
    return {prefix + k: v for prefix, m in _layer_modules(native) for k, v in _module_params(m).items()}


def set_params(native: nn.Module, params: dict[str, np.ndarray]) -> None:
    """Copy validated canonical params in (transposing copies into the existing tensors)."""
    for prefix, m in _layer_modules(native):
        transpose = type(m) is not nn.Bilinear
        if prefix + "mask" in params:
            _copy_in(m.mask, params[prefix + "mask"], transpose=True)
        if prefix + "kernel" in params:
            _copy_in(m.weight, params[prefix + "kernel"], transpose=transpose)
        if prefix + "bias" in params:
            _copy_in(m.bias, params[prefix + "bias"])
        if getattr(m, "mask", None) is not None and (prefix + "kernel" in params or prefix + "mask" in params):
            with torch.no_grad():
                m.weight.mul_(m.mask)  # masked weights are exactly 0 by contract


# ------------------------------------------------------------------ trace
def _steps(native: nn.Module) -> list[_Step]:
    if not _is_container(native):
        spec = to_spec(native)
        return [_Step(spec, native, _identity if isinstance(spec, Identity) else native)]
    return _chain(native)


def _input_dtype(steps: list[_Step], x: np.ndarray) -> torch.dtype:
    """The first parameterised layer's dtype (torch's Linear rejects any other input dtype)."""
    for s in steps:
        if _has_params(s.module):
            return s.module.weight.dtype
    # parameterless: the input's own float dtype; numpy's rule for integer input is float64
    return _TORCH_DTYPES.get(np.asarray(x).dtype.name, torch.float64)


def _param_tensors(m: nn.Module | None) -> list[tuple[str, torch.Tensor, bool]]:
    """(canonical name, tensor, transposed?) of a step's parameters."""
    if not _has_params(m):
        return []
    out = [("kernel", m.weight, type(m) is not nn.Bilinear)]
    if m.bias is not None:
        out.append(("bias", m.bias, False))
    return out


def _forward_steps(steps: list[_Step], xs: list[torch.Tensor]):
    """Run the steps keeping every layer's inputs and output (the graph retains them)."""
    layer_inputs, outputs, cur = [], [], xs
    for step in steps:
        if _has_params(step.module):
            y = step.run(*cur)
        else:  # run on a copy: an in-place activation (inplace=True) must not overwrite the record
            y = step.run(*[c.clone() for c in cur])
        layer_inputs.append(cur)
        outputs.append(y)
        cur = [y]
    return layer_inputs, outputs


def trace(native: nn.Module, inputs: Sequence[np.ndarray], grad_out: np.ndarray) -> Trace:
    """Forward and torch autograd backward of L = sum(y * grad_out), every layer recorded.

    Uses torch.autograd.grad, so the module's own ``.grad`` fields are left untouched.
    """
    steps = _steps(native)
    dtype = _input_dtype(steps, inputs[0])
    xs = [_from_numpy(np.asarray(x)).to(dtype).clone().requires_grad_(True) for x in inputs]
    params = [_param_tensors(s.module) for s in steps]
    frozen = [t for group in params for _, t, _ in group if not t.requires_grad]
    for t in frozen:  # gradients are reported for every parameter, frozen or not
        t.requires_grad_(True)
    try:
        with torch.enable_grad():
            layer_inputs, outputs = _forward_steps(steps, xs)
            y = outputs[-1]
            g = _from_numpy(np.asarray(grad_out)).to(y.dtype)
            if tuple(g.shape) != tuple(y.shape):
                raise SpecError(f"grad_out must have the output's shape {tuple(y.shape)}. "
                                f"Received: grad_out of shape {tuple(g.shape)}")
            wrt = [t for group in layer_inputs for t in group] + [t for group in params for _, t, _ in group]
            grads = iter(torch.autograd.grad(y, wrt, grad_outputs=g, allow_unused=True))
    finally:
        for t in frozen:
            t.requires_grad_(False)

    def _grad(value, like):  # allow_unused gives None for an unused input: its gradient is 0
        return _to_numpy(torch.zeros_like(like) if value is None else value)

    dxs = [tuple(_grad(next(grads), x) for x in group) for group in layer_inputs]
    records = []
    for i, group in enumerate(params):
        pg = {}
        for name, t, transposed in group:
            gt = next(grads)
            gt = torch.zeros_like(t) if gt is None else gt
            pg[name] = _to_numpy(gt.t() if transposed else gt)
        records.append(LayerTrace(_to_numpy(outputs[i]), dxs[i], pg))
    return Trace(records)
