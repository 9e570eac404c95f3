"""dense_bridge's own torch modules and the ``compile``/``owns`` verbs.

:class:`DenseLinear` (activation and/or mask fused into ``nn.Linear``) and :class:`LazyDense` (a
seeded ``nn.LazyLinear``), the attribute names under which compiled modules carry spec data torch
cannot hold, and ``compile``: a spec -> the torch module, parameters adopted from ``ParamSource``
without another copy.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dense_bridge._errors import SpecError, received
from dense_bridge.params._source import ParamSource
from dense_bridge.registry._remembered_spec import remember_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Flatten, Identity, Sequential, from_config

from ._activations import activation_module
from ._arrays import TORCH_DTYPES, copy_in, from_numpy

# Spec fields a torch module cannot hold natively (initializers, names) are kept with the
# core's remember_spec (the spec itself: picklable and deep-copyable).
_LAZY_INIT = "_dense_bridge_init"


_grad_enabled = torch.is_grad_enabled  # a module global: one dict lookup per call


class DenseLinear(nn.Linear):
    """``nn.Linear`` with a fused activation and/or a fixed 0/1 connectivity mask.

    y = activation(x @ (weight * mask).T + bias). ``weight`` (out, in) and ``bias`` (out,) are the
    usual parameters; ``mask`` (out, in), in the weight's layout, is a persistent buffer: saved in
    the state dict, never a parameter, so no optimizer touches it. Multiplying in the forward
    (rather than torch's ``prune``, which renames the weight and is stale after ``opt.step()``)
    gives masked weights a zero gradient, so they stay exactly 0 under SGD with momentum and
    weight decay, Adam and AdamW when they start at 0; ``load_state_dict`` re-zeroes them.

    Inference (autograd off: ``torch.no_grad()``/``torch.inference_mode()``) reuses the masked
    weight from the last call while neither the weight nor the mask has changed, so a masked
    forward costs what an unmasked one does; it holds one extra weight-sized tensor. A change is
    seen through the tensors' version counters (every in-place write: optimizers,
    ``load_state_dict``, ``db.set_params``, ``copy_`` under ``no_grad``), their data pointers
    (``weight.data = t``) and identities (``layer.weight = nn.Parameter(t)``, ``.to()``). Writes
    through ``weight.data`` in place (``layer.weight.data.mul_(2)``) bypass torch's version
    counter: call :meth:`clear_masked_cache` after them. With autograd on, the product is
    computed at every call (it is part of the graph).
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
        # straight from the module's own dicts: nn.Module.__getattr__ is a slow path (~0.6 us a
        # read, more than the whole masked-weight check) that showed at 16->16, batch 1 in
        # benchmarks/bench_layers.py --masked. A parametrized weight (torch.nn.utils.parametrize)
        # is a property, not in _parameters: read it the usual way then.
        params, buffers = self._parameters, self._buffers
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        mask = buffers["mask"] if "mask" in buffers else self.mask
        activation = self.activation
        if mask is not None:
            if _grad_enabled():
                weight = weight * mask  # part of the graph: computed at every call
            else:
                # inlined, comparisons in order and short-circuited (no key tuple built): the
                # check is the whole cost of a cached masked forward, ~0.3 us
                cache = self.__dict__.get("_masked_cache")
                if cache is not None and cache[0] is weight and cache[1] is mask \
                        and cache[2] == weight._version and cache[3] == mask._version \
                        and cache[4] == weight.data_ptr() and cache[5] == mask.data_ptr():
                    weight = cache[6]
                else:
                    weight = self._masked_weight(weight, mask)
        out = F.linear(input, weight, bias)
        return out if activation is None else activation(out)

    def _masked_weight(self, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """weight * mask, remembered with what identifies both tensors' contents (autograd off only):
        identity (held, so an id is never reused), version counter, data pointer."""
        masked = weight * mask
        self.__dict__["_masked_cache"] = (weight, mask, weight._version, mask._version, weight.data_ptr(),
                                          mask.data_ptr(), masked)
        return masked

    def clear_masked_cache(self) -> None:
        """Forget the cached masked weight (needed only after in-place writes through ``.data``)."""
        self.__dict__.pop("_masked_cache", None)

    def __getstate__(self):
        # pickles and deep copies carry the parameters, not a cache derived from them
        state = dict(super().__getstate__())
        state.pop("_masked_cache", None)
        return state

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
                copy_in(self.weight, params["kernel"], transpose=True)
                if self.bias is not None:
                    copy_in(self.bias, params["bias"])
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
            setattr(module, name, nn.Parameter(from_numpy(arrays[key])))
    for key, name in buffers.items():
        if key in arrays:
            setattr(module, name, from_numpy(arrays[key]))


def linear_to_fill(cls: type, in_features: int, out_features: int, use_bias: bool, *,
                   activation: nn.Module | None = None) -> nn.Linear:
    """An ``nn.Linear`` (or :class:`DenseLinear`) with every attribute its ``__init__`` sets and no
    tensors yet: ``weight`` (and ``bias``, ``mask``) are then given by :func:`_adopt`.

    ``nn.Linear.__init__`` draws initial weights even on the meta device, through Python
    decompositions of ``kaiming_uniform_``: about 65 us a layer, replaced at once. Built this
    way the module is the same class with the same ``__dict__`` keys, parameter and buffer
    names as one built by ``cls(...)`` (tests/test_torch_construction.py compares them on the
    installed torch), so a torch release that adds an attribute shows there.
    """
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.in_features, module.out_features = in_features, out_features
    module.register_parameter("weight", None)  # the order torch registers them in
    module.register_parameter("bias", None)
    if cls is not nn.Linear:
        module.activation = activation
        # registered now, so that assigning the mask tensor later makes it a buffer
        module.register_buffer("mask", None)
    return module


def _compile_dense(spec: Dense, source: ParamSource, index: int) -> nn.Module:
    dtype = TORCH_DTYPES[spec.dtype]
    act = None if spec.activation.name == "linear" else activation_module(spec.activation)
    if spec.lazy:
        # given params fix the width (ParamSource fills it), so a lazy layer always draws from the seed
        init = {"spec": spec.to_config(), "seed": source.seed, "index": index}
        module = LazyDense(spec.units, spec.use_bias, activation=act, init=init, dtype=dtype)
    else:
        # fresh memory already in torch's layout: weight (out, in) = kernel.T, mask like the weight
        params = source.native_layer(index, spec, {"kernel": (1, 0), "mask": (1, 0)})
        cls = nn.Linear if act is None and spec.mask is None else DenseLinear
        module = linear_to_fill(cls, spec.in_features, spec.units, spec.use_bias, activation=act)
        _adopt(module, params, {"kernel": "weight", "bias": "bias"}, {"mask": "mask"})
    remember_spec(module, spec)
    return module


def _compile_bilinear(spec: Bilinear, source: ParamSource, index: int) -> nn.Bilinear:
    params = source.native_layer(index, spec)  # (out, in1, in2) is the canonical layout
    module = nn.Bilinear(spec.in1_features, spec.in2_features, spec.units, spec.use_bias, device="meta",
                         dtype=TORCH_DTYPES[spec.dtype])
    _adopt(module, params, {"kernel": "weight", "bias": "bias"}, {})
    remember_spec(module, spec)
    return module


def _compile_layer(spec, source: ParamSource, index: int) -> nn.Module:
    if isinstance(spec, Dense):
        return _compile_dense(spec, source, index)
    if isinstance(spec, Bilinear):
        return _compile_bilinear(spec, source, index)
    if isinstance(spec, Identity):
        # Flatten: start_dim=1, end_dim=-1, every axis after the first
        module = nn.Flatten() if isinstance(spec, Flatten) else nn.Identity()
        remember_spec(module, spec)
        return module
    if isinstance(spec, Activation):
        return activation_module(spec)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def _is_keras(obj) -> bool:
    """Is ``obj`` a Keras object? Without importing keras: one that exists has been imported."""
    if (getattr(type(obj), "__module__", None) or "").split(".")[0] == "keras":
        return True
    keras = sys.modules.get("keras")
    layer = getattr(getattr(keras, "layers", None), "Layer", None)
    return isinstance(layer, type) and isinstance(obj, layer)


def owns(obj) -> bool:
    """Is ``obj`` a torch module (not a Keras layer, which is one under KERAS_BACKEND=torch)."""
    return isinstance(obj, nn.Module) and not _is_keras(obj)


def compile(spec, source: ParamSource) -> nn.Module:
    """The torch module for ``spec``, with parameters from ``source`` copied into torch memory."""
    if isinstance(spec, Sequential):
        module = nn.Sequential(*[_compile_layer(l, source, i) for i, l in enumerate(spec.layers)])
        remember_spec(module, spec)
        return module
    return _compile_layer(spec, source, 0)
