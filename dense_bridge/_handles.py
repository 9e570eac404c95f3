"""A native object resolved once into what it is, for the public verbs to call on.

``get_params``, ``set_params``, ``to_spec`` and ``convert`` each begin with :func:`resolve`: one
lookup of the owning backend and its adapter, one parallel probe (only on a backend whose
manifest declares ``parallel``), one LoRA probe (only on an adapter with the ``lora``
capability), and a handle of one of four kinds, each with ``get``/``set``/``spec`` and
``source`` (what ``convert`` copies):

- :class:`Plain`: the adapter's own verbs;
- :class:`Parallel`: a model compiled with ``parallel=``: the collective ``parallel_*`` verbs
  through ``dense_bridge.parallel._dispatch.ParallelModelVerbs`` (full arrays on every rank, or
  ``local`` blocks);
- :class:`LoRA`: a layer wrapping a LoRA adapter: the wrapped layer's params and spec plus the
  canonical ``lora_*`` keys (``dense_bridge.lora``); ``convert`` refuses it (the adapter would be lost);
- :class:`Quantized`: a quantized linear layer asked for its codes (``get_params(quantized=True)``,
  ``set_params`` with a "quant" key): ``dense_bridge.quant``. Asked for floats, a quantized layer
  is :class:`Plain` (its adapter reads the kernel its framework dequantizes to).

The kinds are the features layered on the verbs: the verbs in ``_api`` hold no feature branch.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import lora
from ._errors import ConversionError, SpecError
from .params._source import check_masks_match, validate_params
from .parallel._dispatch import ParallelModelVerbs, parallel_verbs
from .registry._backends import backend_of, get_adapter
from .registry._remembered_spec import remembered_spec
from .specs import Bilinear, Dense, Sequential

__all__ = ["Plain", "Parallel", "LoRA", "Quantized", "resolve", "WHOLE_MODEL_HINT"]

#: Appended to every "cannot read this model" error: the verbs that work on any model.
WHOLE_MODEL_HINT = ("dense_bridge reads chains of linear layers and activations as specs; for the linear layers "
                    "inside any model use db.linear_layers(model), and db.transfer(src, dst, mapping=...) moves a "
                    "whole model's weights")


def resolve(native: Any, argument: str = "native", *, codes: bool = False):
    """The handle for ``native``; ``codes``: the call asks for quantized codes.

    TypeError naming ``argument`` when no backend owns ``native``.
    """
    if codes:
        return Quantized(native)
    backend = backend_of(native, argument)
    adapter = get_adapter(backend)
    parallel = parallel_verbs(backend, adapter, native)
    if parallel is not None:
        return Parallel(native, backend, parallel)
    with lora.base_of(adapter, native) as base:
        wrapped = base is not None
    return (LoRA if wrapped else Plain)(native, backend, adapter)


class Plain:
    """A native layer or model read and written by its adapter's verbs.

    ``native``: the object; ``backend``: its backend's name; ``verbs``: the object whose
    ``get_params``/``set_params``/``to_spec``/``trace`` the core calls (the adapter module here).
    """

    kind = "plain"

    def __init__(self, native: Any, backend: str, verbs: Any) -> None:
        self.native, self.backend, self.verbs = native, backend, verbs

    # -------------------------------------------------------------- what each kind reads and writes
    def read_spec(self):
        """The spec the object itself shows (no remembered metadata)."""
        return self.verbs.to_spec(self.native)

    def read(self) -> dict:
        """Canonical params as the adapter gives them (views allowed)."""
        return self.verbs.get_params(self.native)

    def write(self, own: dict, extra: dict, *, strict: bool) -> None:
        """Write validated ``own`` params; ``extra``: adapter (``lora_*``) keys the caller gave,
        refused on a layer that holds no adapter (a ConversionError naming them)."""
        if extra:
            lora.check_for_set(self.verbs, self.native, extra, (), strict=strict)
        self.verbs.set_params(self.native, own)  # a parallel model's: each rank keeps its block

    # -------------------------------------------------------------- the public verbs' side
    def spec(self):
        """``db.to_spec``: the spec read off the object, with the init/name metadata of the spec it
        was compiled from wherever the two agree (``registry._remembered_spec``)."""
        try:
            read = self.read_spec()
        except ConversionError as exc:
            if "db.linear_layers(" in str(exc):
                raise
            raise ConversionError(f"{exc}. {WHOLE_MODEL_HINT}") from None
        hint = remembered_spec(self.native)
        return read if hint is None else with_hint(read, hint)

    def get(self, *, copy: bool = True, local: bool = False) -> dict:
        """``db.get_params``: canonical arrays (snapshots with ``copy``); never an empty answer for
        an object that has, or hides, parameters."""
        if local:
            raise TypeError(f"local=True needs a parallel model (compiled with parallel=). "
                            f"Received: native of type {type(self.native).__name__}")
        try:
            params = self.read()
        except SpecError as exc:  # an unbuilt lazy layer: no parameters exist yet
            raise ConversionError(str(exc)) from None
        if not params:
            from .models import empty_params_error

            error = empty_params_error(self.verbs, self.native)
            if error is not None:
                raise error
        if not copy:
            return params
        # read off an accelerator, a writable array is already a host copy nobody else holds
        device_of = getattr(self.verbs, "device_of", None)
        fresh = callable(device_of) and not (device_of(self.native) or "cpu").startswith("cpu")
        return {k: v if fresh and isinstance(v, np.ndarray) and v.flags.writeable else np.array(v, copy=True)
                for k, v in params.items()}

    def set(self, params: Mapping, *, strict: bool = True, allow_nonfinite: bool = False) -> None:
        """``db.set_params``: every key, shape and value checked against the spec before anything
        is written."""
        spec = self.spec()
        own, extra = lora.split(params) if isinstance(params, Mapping) else (params, {})
        # a destination that places models on devices takes other frameworks' device arrays as they are
        keep_device = callable(getattr(self.verbs, "place", None))
        checked = validate_params(spec, own, strict=strict, allow_nonfinite=allow_nonfinite, keep_device=keep_device)
        check_masks_match(spec, checked)
        self.write(checked, extra, strict=strict)

    def source(self) -> tuple[Any, dict]:
        """``db.convert``'s reading: (spec, canonical params) of the object."""
        return self.spec(), self.read()


class Parallel(Plain):
    """A model compiled with ``parallel=``: every verb collective (full arrays on every rank);
    ``verbs`` is its :class:`~dense_bridge.parallel._dispatch.ParallelModelVerbs`."""

    kind = "parallel"
    verbs: ParallelModelVerbs

    def get(self, *, copy: bool = True, local: bool = False) -> dict:
        return self.verbs.params(self.native, local=local, copy=copy)


class LoRA(Plain):
    """A layer wrapping a LoRA adapter: its own params are the wrapped layer's, plus the canonical
    ``lora_*`` keys (``dense_bridge.lora``)."""

    kind = "lora"

    def read_spec(self):
        return lora.spec_of(self.verbs, self.native)

    def read(self) -> dict:
        return lora.read_params(self.verbs, self.native)

    def write(self, own: dict, extra: dict, *, strict: bool) -> None:
        kernel = own.get("kernel", np.zeros(0))
        extra = lora.check_for_set(self.verbs, self.native, extra, kernel.shape, strict=strict)
        lora.write_params(self.verbs, self.native, own, extra)

    def source(self) -> tuple[Any, dict]:
        lora.refuse_convert(self.verbs, self.native)  # a ConversionError: a plain layer would lose the adapter
        return super().source()


class Quantized:
    """A quantized linear layer asked for its codes (``dense_bridge.quant``): ``get`` gives
    "qkernel", per-group "scale" and "zero"/"offset", "bias" and "quant"; ``set`` moves codes
    only where the layer dequantizes them to the same floats bit for bit."""

    kind = "quantized"

    def __init__(self, native: Any) -> None:
        self.native = native

    def get(self, *, copy: bool = True, local: bool = False) -> dict:
        from .quant import get_quantized

        return get_quantized(self.native)  # always fresh copies

    def set(self, params: Mapping, *, strict: bool = True, allow_nonfinite: bool = False) -> None:
        from .quant import set_quantized

        set_quantized(self.native, dict(params))

    def spec(self):
        return resolve(self.native).spec()


def with_hint(read: Any, hint: Any) -> Any:
    """``read`` (the spec read off the native object) with init/name metadata from ``hint``
    wherever the two agree on everything the object itself can show."""
    if isinstance(read, Sequential) and isinstance(hint, Sequential) and len(read.layers) == len(hint.layers):
        layers = [with_hint(r, h) for r, h in zip(read.layers, hint.layers)]
        return Sequential(layers, in_features=read.in_features, name=read.name or hint.name)
    if isinstance(read, Dense) and isinstance(hint, Dense):
        candidate = read.replace(kernel_init=hint.kernel_init, bias_init=hint.bias_init,
                                 name=read.name if read.name else hint.name)
        filled = hint if hint.in_features is not None or read.in_features is None else \
            hint.with_in_features(read.in_features)
        if candidate.replace(name=None) == filled.replace(name=None):
            return candidate
    if isinstance(read, Bilinear) and isinstance(hint, Bilinear):
        candidate = read.replace(init=hint.init, name=read.name or hint.name)
        if candidate.replace(name=None) == hint.replace(name=None):
            return candidate
    return read
