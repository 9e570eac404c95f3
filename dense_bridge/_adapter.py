"""The contract every adapter module in ``dense_bridge.backends`` fulfils.

This is documentation plus a typing Protocol; the registry imports adapters by name and
calls these module-level functions. Canonical parameters follow ``dense_bridge._params``.

- ``owns(obj) -> bool``: is ``obj`` a layer/model of this framework that the adapter handles.
- ``compile(spec, source: ParamSource) -> native``: the framework's own object for ``spec``
  (Dense, Bilinear, Identity, Activation or Sequential). Parameters come from
  ``source.for_layer(index, layer_spec)`` (index = position in the Sequential, 0 for a lone
  layer), called when the input width is known (at build time for lazy layers). The adapter
  copies them into storage it owns; masks become non-trainable state. Where the framework can
  adopt memory (``torch.from_numpy``, DLPack), ``source.native_layer(index, layer_spec, perms)``
  returns fresh, aligned copies already in the framework's layout (one fast pass, NaN/Inf
  checked on the way) for the adapter to hand over without another copy.
- ``get_params(native) -> dict[str, np.ndarray]``: canonical names, layout and dtype.
  Arrays may be read-only views of the framework's memory: callers copy before mutating.
- ``set_params(native, params)``: ``params`` were validated by the core (names, shapes, dtypes,
  finiteness) against ``to_spec(native)``; write them all. Partial dicts (strict=False) write
  only the keys present.
- ``to_spec(native) -> spec``: the backend-neutral spec, activation parameters read exactly.
- ``trace(native, inputs: list[np.ndarray], grad_out: np.ndarray) -> Trace``: run forward and
  backward with the framework's own autograd for L = sum(y * grad_out); report every layer
  (``dense_bridge._trace``).
- ``walk(model) -> list[dense_bridge._layouts.Entry]``: every layer inside any model tree that
  holds parameters of its own (and every linear-family layer), in definition order, with its
  path in the framework's naming, its kind ("linear": works with get/set_params, to_spec and
  trace as a lone layer; "quantized"; "other": norms, embeddings, ...) and readers/writers of its
  own parameters in the framework's layout. Behind ``db.linear_layers`` and ``db.transfer``.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ._layouts import Entry
from ._params import ParamSource
from ._trace import Trace


class Adapter(Protocol):
    def owns(self, obj: Any) -> bool: ...
    def compile(self, spec: Any, source: ParamSource) -> Any: ...
    def get_params(self, native: Any) -> dict[str, np.ndarray]: ...
    def set_params(self, native: Any, params: dict[str, np.ndarray]) -> None: ...
    def to_spec(self, native: Any) -> Any: ...
    def trace(self, native: Any, inputs: list[np.ndarray], grad_out: np.ndarray) -> Trace: ...
    def walk(self, model: Any) -> list[Entry]: ...
