"""The ``trace`` verb: forward and torch autograd backward of L = sum(y * grad_out), every
layer's output, input gradients and canonical parameter gradients recorded; and ``train_sgd``
(the demo's training loop, torch autograd).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from dense_bridge._errors import SpecError
from dense_bridge.registry._trace import LayerTrace, Trace
from dense_bridge.specs import Identity

from ._arrays import TORCH_DTYPES, from_numpy, to_numpy
from dense_bridge.models._layouts import declared

from ._to_spec import Step, chain, declared_tensors, has_params, identity, is_container, to_spec


def _steps(native: nn.Module) -> list[Step]:
    if not is_container(native):
        spec = to_spec(native)
        return [Step(spec, native, identity if isinstance(spec, Identity) else native)]
    return chain(native)


def _input_dtype(steps: list[Step], x: np.ndarray) -> torch.dtype:
    """The first parameterised layer's dtype (torch's Linear rejects any other input dtype)."""
    for s in steps:
        if has_params(s.module):
            return _param_tensors(s.module)[0][1].dtype
    # parameterless: the input's own float dtype; numpy's rule for integer input is float64
    return TORCH_DTYPES.get(np.asarray(x).dtype.name, torch.float64)


def _param_tensors(m: nn.Module | None) -> list[tuple[str, torch.Tensor, bool]]:
    """(canonical name, tensor, transposed?) of a step's parameters."""
    if not has_params(m):
        return []
    if declared(m) is not None:
        kernel, bias, transposed = declared_tensors(m)
        return [("kernel", kernel, transposed)] + ([] if bias is None else [("bias", bias, False)])
    out = [("kernel", m.weight, type(m) is not nn.Bilinear)]
    if m.bias is not None:
        out.append(("bias", m.bias, False))
    return out


def _forward_steps(steps: list[Step], xs: list[torch.Tensor]):
    """Run the steps keeping every layer's inputs and output (the graph retains them)."""
    layer_inputs, outputs, cur = [], [], xs
    for step in steps:
        if has_params(step.module):
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
    device = next((t.device for s in steps if s.module is not None for t in s.module.parameters()), None)
    xs = [from_numpy(np.asarray(x)).to(device, dtype, copy=True).requires_grad_(True) for x in inputs]
    params = [_param_tensors(s.module) for s in steps]
    frozen = [t for group in params for _, t, _ in group if not t.requires_grad]
    for t in frozen:  # gradients are reported for every parameter, frozen or not
        t.requires_grad_(True)
    try:
        with torch.enable_grad():
            layer_inputs, outputs = _forward_steps(steps, xs)
            y = outputs[-1]
            g = from_numpy(np.asarray(grad_out)).to(y.device, y.dtype)
            if tuple(g.shape) != tuple(y.shape):
                raise SpecError(f"grad_out must have the output's shape {tuple(y.shape)}. "
                                f"Received: grad_out of shape {tuple(g.shape)}")
            wrt = [t for group in layer_inputs for t in group] + [t for group in params for _, t, _ in group]
            grads = iter(torch.autograd.grad(y, wrt, grad_outputs=g, allow_unused=True))
    finally:
        for t in frozen:
            t.requires_grad_(False)

    def _grad(value, like):  # allow_unused gives None for an unused input: its gradient is 0
        return to_numpy(torch.zeros_like(like) if value is None else value)

    dxs = [tuple(_grad(next(grads), x) for x in group) for group in layer_inputs]
    records = []
    for i, group in enumerate(params):
        pg = {}
        for name, t, transposed in group:
            gt = next(grads)
            gt = torch.zeros_like(t) if gt is None else gt
            pg[name] = to_numpy(gt.t() if transposed else gt)
        records.append(LayerTrace(to_numpy(outputs[i]), dxs[i], pg))
    return Trace(records)


def train_sgd(native: nn.Module, inputs: np.ndarray, labels: np.ndarray, *, steps: int,
              lr: float) -> tuple[np.ndarray, np.ndarray]:
    """Plain SGD with torch autograd on L = mean(-log p[label]), p = native(inputs) (probabilities).

    inputs (N, in_features), labels (N,) integers. Returns the output probabilities (N, classes)
    before the first step and after the last. The optimizer is written out: ``torch.optim``
    imports ``torch._dynamo`` (2 s here) for a loop this small.
    """
    x, y = from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(np.asarray(labels, dtype=np.int64))
    threads = torch.get_num_threads()
    # one thread: for a model this small, intra-op threads only add contention (60 steps take
    # about 0.1 s on one thread and seconds with two on a busy 2-core machine)
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            before = to_numpy(native(x)).copy()
        for _ in range(steps):
            probs = native(x)
            loss = torch.nn.functional.nll_loss(torch.log(probs.clamp_min(1e-12)), y)
            native.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in native.parameters():
                    p -= lr * p.grad
        with torch.no_grad():
            after = to_numpy(native(x)).copy()
    finally:
        torch.set_num_threads(threads)
    return before, after


def run_layer(layer: nn.Module, x: np.ndarray, grad_out: np.ndarray | None):
    """One call of ``layer`` alone on ``x`` (its native input shape and dtype), and torch autograd's
    backward from ``grad_out`` (dL/d(output), the output's shape): ``(output, dL/dx, canonical
    parameter gradients)`` as numpy. ``grad_out`` None: forward only (``(output, None, {})``).

    The output is what ``capture`` records for the layer (hooks see the module's return value);
    the layer runs in eval mode and its ``.grad`` fields are left untouched.
    """
    from ._capture import canonical_grads as _canonical_grads

    grads = grad_out is not None
    device = next((t.device for t in layer.parameters()), None)
    xt = from_numpy(np.ascontiguousarray(x)).to(device, copy=True).requires_grad_(grads)
    from ._quant import is_quantized

    # a torchao weight holds frozen codes: no gradient (and zeros_like of it is not implemented)
    params = [(n, p) for n, p in layer.named_parameters(recurse=False) if not (n == "weight" and is_quantized(layer))]
    flags = [(p, p.requires_grad) for _, p in params]
    modes = [(m, m.training) for m in layer.modules()]
    try:
        layer.eval()
        for p, _ in flags:
            p.requires_grad_(grads)
        with torch.enable_grad() if grads else torch.no_grad():
            y = layer(xt)
        if not grads:
            return np.array(to_numpy(y), copy=True), None, {}
        g = from_numpy(np.ascontiguousarray(grad_out)).to(y.device, y.dtype)
        got = torch.autograd.grad(y, [xt] + [p for _, p in params], grad_outputs=g, allow_unused=True)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training
    dx = torch.zeros_like(xt) if got[0] is None else got[0]
    pg = {n: torch.zeros_like(p) if gp is None else gp for (n, p), gp in zip(params, got[1:])}
    return (np.array(to_numpy(y.detach()), copy=True), np.array(to_numpy(dx), copy=True),
            _canonical_grads(layer, pg) if pg else {})
