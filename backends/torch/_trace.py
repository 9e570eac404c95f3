"""The ``trace`` verb: forward and torch autograd backward of L = sum(y * grad_out), every
layer's output, input gradients and canonical parameter gradients recorded.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from dense_bridge._errors import SpecError
from dense_bridge._trace import LayerTrace, Trace
from dense_bridge.specs import Identity

from dense_bridge._layouts import declared

from ._leaves import _declared_tensors, _has_params
from ._tensors import _TORCH_DTYPES, _from_numpy, _to_numpy
from ._to_spec import _chain, _identity, _is_container, _Step, to_spec


def _steps(native: nn.Module) -> list[_Step]:
    if not _is_container(native):
        spec = to_spec(native)
        return [_Step(spec, native, _identity if isinstance(spec, Identity) else native)]
    return _chain(native)


def _input_dtype(steps: list[_Step], x: np.ndarray) -> torch.dtype:
    """The first parameterised layer's dtype (torch's Linear rejects any other input dtype)."""
    for s in steps:
        if _has_params(s.module):
            return _param_tensors(s.module)[0][1].dtype
    # parameterless: the input's own float dtype; numpy's rule for integer input is float64
    return _TORCH_DTYPES.get(np.asarray(x).dtype.name, torch.float64)


def _param_tensors(m: nn.Module | None) -> list[tuple[str, torch.Tensor, bool]]:
    """(canonical name, tensor, transposed?) of a step's parameters."""
    if not _has_params(m):
        return []
    if declared(m) is not None:
        kernel, bias, transposed = _declared_tensors(m)
        return [("kernel", kernel, transposed)] + ([] if bias is None else [("bias", bias, False)])
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
