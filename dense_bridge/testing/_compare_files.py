"""compare_checkpoints: two checkpoint files compared layer by layer, one layer pair in memory.

``compare(a, b)`` (``_compare``) traces two whole models; for two checkpoints that means both
models, both sets of parameter gradients and b's float64 kernels at once, about nine times the
file's size. Here the same comparison streams instead:

1. forward, segment by segment: a segment is one layer with parameters plus the parameter-free
   layers (activations, Identity) around it, compiled as a small Sequential on each backend from
   that layer's tensors only (so Keras gives its activation layers the Dense's dtype, as in the
   whole model). Each side runs on its own previous output; only the batch-sized inputs are
   kept, plus b's output allowances (``_propagate.Propagation``);
2. backward, segments in reverse: each segment is compiled again from the files and traced
   with its own upstream gradient (each side's dL/dx of the segment after it), which gives
   every row the whole-model comparison has (output, dL/dkernel, dL/dbias, dL/dx), compared
   at once and dropped.

Every layer's inputs and upstream gradient are exactly what the whole model would feed it, so
the report matches ``compare`` on the same models: the same rows and verdicts, the same
numbers where a framework computes a layer alone as it does inside the chain (torch, numpy,
MLX, Keras; XLA may fuse a jitted chain differently, within the tolerance). Specs whose layers
do not line up (a Dense+relu against Dense and an Activation layer) are not streamed: the
caller falls back to ``compare``.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .._api import build
from .._dtypes import numpy_dtype
from .._errors import CheckpointError, ConversionError, SpecError
from ..params._memory_budget import return_freed_memory
from ..params._source import ParamSource
from ..registry._manifest import GRADIENTS
from ..registry._backends import get_adapter, has_capability
from ._gradients import effective_grads
from ..specs import Dense, Sequential, layer_param_shapes
from ._compare import (compare_layer, dx_names, feed_report, layer_label, layers_of, model_dtype, new_report, output_dtype, output_width)
from ._propagate import Propagation
from ._report import Report, first_failure
from ._tolerance import Tolerance

__all__ = ["compare_checkpoints", "segments"]

ParamsSeen = Callable[[dict, dict], None]


def segments(layers: list) -> list[tuple[int, int]] | None:
    """[start, end) ranges that cover ``layers``, each holding exactly one Dense (parameter-free
    layers before the first Dense join it; later ones join the Dense before them); None when
    there is no Dense (nothing to stream) or a layer kind this path does not handle."""
    starts = [i for i, layer in enumerate(layers) if isinstance(layer, Dense)]
    if not starts or any(layer_param_shapes(l) and not isinstance(l, Dense) for l in layers):
        return None
    bounds = [0] + starts[1:] + [len(layers)]
    return list(zip(bounds[:-1], bounds[1:]))


class _Side:
    """One checkpoint on one backend: compiles a segment from that segment's tensors only."""

    def __init__(self, checkpoint, backend: str, spec) -> None:
        self.path, self.backend, self.spec = checkpoint.path, backend, spec
        self.layers = layers_of(spec)
        self.stream = checkpoint.layer_stream()
        self.adapter = get_adapter(backend)
        self.gradients = has_capability(backend, GRADIENTS)  # else traced forward only (grad_out=None)

    def params(self, i: int) -> dict[str, np.ndarray]:
        if not layer_param_shapes(self.layers[i]):
            return {}
        try:
            return self.stream(i, self.layers[i])
        except ConversionError as exc:  # NaN/Inf, a mask that differs from the spec's: the file's fault
            raise CheckpointError(f"{self.path}: {exc}") from None

    def trace(self, start: int, end: int, x: np.ndarray, g: np.ndarray):
        """Forward and backward of layers[start:end] alone, on ``x`` with upstream ``g``."""
        part = Sequential(self.layers[start:end])
        try:
            model = build(self.backend, ParamSource(part, stream=lambda j, layer: self.params(start + j)))
        except SpecError as exc:  # the file's spec claims layers larger than the memory there is
            raise CheckpointError(f"{self.path}: {exc}") from None
        try:
            return self.adapter.trace(model, [x], g if self.gradients else None)
        finally:
            del model
            self.stream.release()


def compare_checkpoints(ckpt_a, backend_a: str, ckpt_b, backend_b: str, *, grads: bool = True, seed: int = 0,
                        batch_size: int = 8, strict: bool = False, tolerance: Tolerance | None = None,
                        params_seen: ParamsSeen | None = None) -> Report | None:
    """The report ``compare`` gives for the two checkpoints' models, computed holding one layer
    pair at a time; None when the specs cannot be streamed (call ``compare`` on the models).

    ``ckpt_a``/``ckpt_b``: opened checkpoints (``dense_bridge.checkpoints.open_checkpoint``) with specs;
    ``params_seen(params_a, params_b)`` is called once per layer with parameters with the
    two layers' canonical tensors, keyed as in the files ("3.kernel"), while they are at hand.
    """
    spec_a, spec_b = ckpt_a.spec, ckpt_b.spec
    if not (isinstance(spec_a, Sequential) and isinstance(spec_b, Sequential)):
        return None  # a lone layer is one layer pair already
    la, lb = layers_of(spec_a), layers_of(spec_b)
    parts = segments(lb)
    if parts is None or len(la) != len(lb) or segments(la) != parts:
        return None
    tolerance = tolerance or Tolerance()
    grads, grads_note = effective_grads({"a": backend_a, "b": backend_b}, grads)
    report = new_report(spec_a, spec_b, backend_a, backend_b, tolerance, seed, False, strict)
    fed = feed_report(report, spec_a, spec_b, None, None, seed, batch_size)
    if fed is None:
        return report
    xs, g = fed
    a, b = _Side(ckpt_a, backend_a, spec_a), _Side(ckpt_b, backend_b, spec_b)
    propagation = Propagation(xs, report.dtype, tolerance)
    try:
        inputs, allowed = _forward(a, b, parts, xs[0], propagation, report, grads, params_seen)
        if grads:
            report.layers.extend(_backward(a, b, parts, inputs, allowed, g, propagation))
    finally:
        a.stream.release()
        b.stream.release()
    if grads_note:
        report.notes.append(grads_note)
    report.first_failure = first_failure(report.layers)
    return report


def _forward(a: _Side, b: _Side, parts, x, propagation: Propagation, report: Report, grads: bool,
             params_seen: ParamsSeen | None) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[dict]]:
    """Run every segment forward; return each segment's inputs (a's, b's) and each layer's
    output allowance. Without ``grads`` the outputs are compared here, into ``report``."""
    x_a = x.astype(numpy_dtype(model_dtype(a.spec)))
    x_b = x.astype(numpy_dtype(model_dtype(b.spec)))
    inputs, allowances = [], []
    for start, end in parts:
        inputs.append((x_a, x_b))
        width = output_width(Sequential(b.layers[start:end]), [x_b.shape[-1]])
        zeros = np.zeros(x_b.shape[:-1] + (width,))
        dtype_a, dtype_b = (numpy_dtype(output_dtype(Sequential(s.layers[start:end]))) for s in (a, b))
        trace_a = a.trace(start, end, x_a, zeros.astype(dtype_a))
        trace_b = b.trace(start, end, x_b, zeros.astype(dtype_b))
        for j, i in enumerate(range(start, end)):
            p_a, p_b = a.params(i), b.params(i)
            if params_seen is not None and (p_a or p_b):
                params_seen({f"{i}.{k}": v for k, v in p_a.items()}, {f"{i}.{k}": v for k, v in p_b.items()})
            allowances.append(propagation.forward(i, b.layers[i], p_b, trace_b.layers[j].output))
            if not grads:
                report.layers.append(compare_layer(i, layer_label(a.layers, b.layers, i), trace_a.layers[j],
                                                   trace_b.layers[j], allowances[i], False, dx_names(b.layers[i])))
        x_a, x_b = trace_a.layers[-1].output, trace_b.layers[-1].output
        del trace_a, trace_b
        return_freed_memory()  # one layer pair at a time, also in what the allocators keep
    return inputs, allowances


def _backward(a: _Side, b: _Side, parts, inputs, allowances: list[dict], g,
              propagation: Propagation) -> list:
    """Trace every segment with its upstream gradient, in reverse; each layer's LayerResult."""
    rows: list = [None] * len(allowances)
    g_a = g.astype(numpy_dtype(output_dtype(a.spec)))
    g_b = g.astype(numpy_dtype(output_dtype(b.spec)))
    propagation.start_backward(g)
    for (start, end), (x_a, x_b) in zip(reversed(parts), reversed(inputs)):
        trace_a = a.trace(start, end, x_a, g_a)
        trace_b = b.trace(start, end, x_b, g_b)
        for j in range(end - start - 1, -1, -1):
            i = start + j
            allowed = dict(allowances[i])
            allowed.update(propagation.backward(i, b.layers[i], b.params(i), trace_b.layers[j]))
            rows[i] = compare_layer(i, layer_label(a.layers, b.layers, i), trace_a.layers[j], trace_b.layers[j],
                                    allowed, True, dx_names(b.layers[i]))
        g_a, g_b = trace_a.layers[0].input_grads[0], trace_b.layers[0].input_grads[0]
        del trace_a, trace_b
        return_freed_memory()
    return rows
