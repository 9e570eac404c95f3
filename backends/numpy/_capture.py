"""The ``capture`` verb on the numpy reference: per-call inputs, outputs and gradients of its layers.

Reference models are chains (``SequentialModel``) whose ``forward``/``backward`` call each
layer's; the captured layers' ``forward`` and ``backward`` are wrapped through instance
attributes for the duration of the capture and ALWAYS restored. dL/d(output) of a call is what
the chain hands that layer's ``backward``; parameter gradients are the layer's own ``grads``
(already canonical). Inputs: one array (the chain's input), positional.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dense_bridge.adapter_kit import SpecError
from dense_bridge.adapter_kit import Call, Capture, select_output


def _is_float(x) -> bool:
    return isinstance(x, np.ndarray) and (np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16")


def capture(model, inputs, layers: dict[str, Any], *, cotangent: Callable[[tuple], np.ndarray],
            select=None, grads: bool = True) -> Capture:
    """One forward (and backward) of a reference model recording every call of ``layers``."""
    if isinstance(inputs, dict):
        raise SpecError(f"numpy reference models take positional inputs (a list of arrays). Received: inputs "
                        f"with keys {sorted(inputs)}")
    log: list[Call] = []
    pending: dict[str, list[Call]] = {}  # calls whose backward is still to come, per layer
    patched = []
    try:
        for path, layer in layers.items():
            fwd, bwd = layer.forward, layer.backward

            def forward(*xs, _path=path, _fwd=fwd):
                y = _fwd(*xs)
                done = pending.setdefault(_path, [])
                call = Call(_path, sum(c.path == _path for c in log), tuple(np.array(x) for x in xs), np.array(y))
                log.append(call)
                done.append(call)
                return y

            def backward(g, _path=path, _bwd=bwd):
                calls = pending.get(_path) or []
                if calls:
                    calls.pop().output_grad = np.array(g)
                return _bwd(g)

            layer.forward, layer.backward = forward, backward
            patched.append(layer)
        out = select_output(model.forward(*[np.asarray(x) for x in inputs]), select, _is_float)
        result = Capture(log, {}, np.array(out))
        if grads:
            model.backward(np.asarray(cotangent(tuple(np.shape(out)))).astype(np.asarray(out).dtype))
            for path, layer in layers.items():
                if getattr(layer, "grads", None):
                    result.param_grads[path] = {k: np.array(v) for k, v in layer.grads.items()}
        return result
    finally:
        for layer in patched:
            for name in ("forward", "backward"):
                layer.__dict__.pop(name, None)
