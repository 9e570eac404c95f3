"""The ``capture`` verb on torch: per-call inputs, outputs and gradients of linear layers inside a model.

One forward pass with forward hooks on the captured layers (removed afterwards, even on error),
then one ``torch.autograd.grad`` of L = sum(out * cotangent) with respect to the captured layers'
parameters AND the recorded call outputs: dL/d(output) comes straight from autograd, per call,
and nothing touches the parameters' ``.grad``. The model runs in eval mode (dropout is the
inference identity) with its training flags restored afterwards; parameters of captured layers
are made to require grad for the pass and restored. See ``dense_bridge.registry._captures``.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from dense_bridge._errors import ConversionError
from dense_bridge.registry._captures import Call, Capture, select_output

from ._arrays import from_numpy as _from_numpy, to_numpy as _to_numpy
from ._lora import is_lora


def _float_dtype(model) -> torch.dtype:
    """Floating inputs are cast to the dtype of the model's first floating parameter."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _to_torch(value: np.ndarray, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A model input on the model's ``device`` (one host-to-device copy), floats in ``dtype``."""
    arr = np.asarray(value)
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        return _from_numpy(arr.astype(np.float32) if arr.dtype == np.float64 else arr).to(device, dtype, copy=True)
    return _from_numpy(arr).to(device, copy=True)  # integer token ids stay integers, bool masks stay bool


def _device(model) -> torch.device | None:
    """The device of the model's first parameter or buffer (where its inputs go)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _numpy(t) -> np.ndarray:
    return np.array(_to_numpy(t), copy=True)


def _canonical_grads(layer, grads: dict[str, torch.Tensor], native: bool = False) -> dict:
    """Native parameter gradients -> canonical names and layout, read by ``get_params`` itself.

    The gradients are swapped into the parameters' ``.data`` for one ``get_params`` call and the
    values swapped back (no copies): whatever layout the layer declares (nn.Linear's (out, in),
    transformers' Conv1D (in, out), ...) applies to its gradients exactly as to its weights.
    ``native``: read by ``device_params`` instead, so they stay tensors where autograd made them
    (canonical views of the gradients: the kernel of an (out, in) weight is its transpose); a
    LoRA wrapper's, or a layer's that ``device_params`` does not read, are read as numpy.
    """
    from dense_bridge._api import get_params  # the core dispatch: declarations of third-party classes

    from ._params import device_params

    saved = {}
    try:
        for name, g in grads.items():
            p = layer.get_parameter(name)  # dotted inside a LoRA wrapper ("lora_A.default.weight")
            saved[name] = p.data
            p.data = g.detach().to(p.dtype)
        found = device_params(layer) if native and not is_lora(layer) else None
        # the mask and a LoRA scale are not trained: no gradient to compare
        out = {k: v for k, v in (get_params(layer) if found is None else found).items()
               if k not in ("mask", "lora_scale")}
    finally:
        for name, data in saved.items():
            layer.get_parameter(name).data = data
    return out


def capture(model, inputs, layers: dict[str, Any], *, cotangent: Callable[[tuple], np.ndarray],
            select=None, grads: bool = True, native: bool = False) -> Capture:
    """One forward (and backward) of ``model`` recording every call of ``layers`` (path -> module).

    ``inputs``: a list of numpy arrays (positional) or a dict (keyword); floating arrays are cast
    to the model's parameter dtype, integer and bool arrays keep their type. ``native``: the
    recorded arrays stay detached tensors on the model's device (judged there through
    ``array_namespace``); else numpy copies.
    """
    keep = (lambda t: t.detach()) if native else _numpy
    dtype, device = _float_dtype(model), _device(model)
    if isinstance(inputs, dict):
        args, kwargs = [], {k: _to_torch(v, dtype, device) for k, v in inputs.items()}
    else:
        args, kwargs = [_to_torch(v, dtype, device) for v in inputs], {}
    records: list[list] = []  # [path, call, input tensors, output tensor]
    counts: dict[str, int] = {}

    def hook_for(path):
        def hook(module, hook_args, output):
            n = counts.get(path, 0)
            counts[path] = n + 1
            # a layer returning several tensors (a router: its logits, then the scores and indices
            # it picked) is recorded by its first floating-point one
            main = output if isinstance(output, torch.Tensor) else next(
                (o for o in output if _is_float(o)), None) if isinstance(output, (tuple, list)) else None
            records.append([path, n, tuple(a for a in hook_args if isinstance(a, torch.Tensor)), main])
            # the model goes on with a copy: an in-place op on it later (``x += residual``) changes
            # neither the recorded values nor the tensor whose gradient is dL/d(output)
            return output.clone() if isinstance(output, torch.Tensor) else None
        return hook

    modes = [(m, m.training) for m in model.modules()]
    # a LoRA wrapper is one layer whose parameters sit in its children (base_layer, lora_A, lora_B)
    wanted = {path: [(n, p) for n, p in layer.named_parameters(recurse=is_lora(layer))]
              for path, layer in layers.items()}
    flags = [(p, p.requires_grad) for ps in wanted.values() for _, p in ps]
    handles = []
    try:
        model.eval()
        for p, _ in flags:
            p.requires_grad_(grads)
        for path, layer in layers.items():
            handles.append(layer.register_forward_hook(hook_for(path)))
        with torch.enable_grad() if grads else torch.no_grad():
            out = select_output(model(*args, **kwargs), select, _is_float)
        for h in handles:
            h.remove()
        handles = []
        # the model has finished with them: nothing writes a recorded tensor after this point
        calls = [Call(path, n, tuple(keep(x) for x in xs), keep(y) if y is not None else np.zeros((0,), np.float32))
                 for path, n, xs, y in records]
        result = Capture(calls, {}, keep(out))
        if not grads:
            return result
        cot = _to_torch(cotangent(tuple(out.shape)), out.dtype, out.device)
        outs = [r[3] for r in records]
        params = [p for ps in wanted.values() for _, p in ps]
        sources = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad] + params
        got = torch.autograd.grad(out, sources, grad_outputs=cot, allow_unused=True) if out.requires_grad \
            else [None] * len(sources)
        by_id = {id(t): g for t, g in zip(sources, got)}
        for call, y in zip(calls, outs):
            g = by_id.get(id(y))
            call.output_grad = None if g is None else keep(g)
        uses: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        for path, ps in wanted.items():
            tied = [n for n, p in ps if uses.get(id(p), 0) > 1]
            if tied:
                result.notes.append(f"{path}: {', '.join(tied)} shared with another part of the model "
                                    f"(tied): its gradient sums every use, not compared")
                continue
            gs = {n: by_id.get(id(p)) for n, p in ps}
            if ps and all(g is not None for g in gs.values()):
                try:
                    result.param_grads[path] = _canonical_grads(layers[path], gs, native)
                except ConversionError as exc:  # a layer get_params cannot read: say so, compare the rest
                    result.notes.append(f"{path}: parameter gradients not compared ({exc})")
        return result
    finally:
        for h in handles:
            h.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training


def load_model(path: str, *, trust_pickle: bool = False):
    """A whole ``nn.Module`` saved with ``torch.save(model)`` (for ``dense-bridge check --mapping``).

    Unpickling runs code named in the file, so it happens only with ``trust_pickle``.
    """
    from dense_bridge._errors import CheckpointError
    from dense_bridge.checkpoints._guard import input_path

    if not trust_pickle:
        raise CheckpointError(f"{path}: a whole torch model is a pickle, and loading one runs code from the file: "
                              f"pass --trust-pickle if you trust it")
    try:
        with input_path(path, what="torch model file", whole=True) as checked:
            obj = torch.load(checked, map_location="cpu", weights_only=False)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise CheckpointError(f"{path}: cannot load a torch model ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, torch.nn.Module):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a whole nn.Module (save one with "
                              f"torch.save(model); a state dict is a checkpoint: check it without --mapping)")
    return obj.eval()


#: for ``run_layer`` (``_trace.py``): the same canonical reading of one layer's gradients
canonical_grads = _canonical_grads
