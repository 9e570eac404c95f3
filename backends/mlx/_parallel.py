"""Tensor-parallel Dense on MLX: ``mx.distributed`` groups, ``AllToShardedLinear`` (column) and
``ShardedToAllLinear`` (row) from ``mlx.nn.layers.distributed``.

Layouts (canonical kernel (in_features, units) <-> MLX weight (units, in_features) = kernel.T),
with N = ``group.size()`` and r = ``group.rank()``:

- column (:class:`ColumnDense`, an ``nn.AllToShardedLinear``): weight (units/N, in_features) =
  canonical ``kernel[:, r*units/N:(r+1)*units/N].T``; bias (units/N,) its slice; mask like the
  weight. Input replicated, output sharded along the feature axis (MLX's own ``sum_gradients``
  all-sums dL/dx in the backward).
- row (:class:`RowDense`, an ``nn.ShardedToAllLinear``): weight (units, in_features/N) =
  canonical ``kernel[r*in/N:(r+1)*in/N, :].T``; bias (units,) replicated; mask like the weight.
  Input sharded along features, partial outputs summed with ``mx.distributed.all_sum``; output
  replicated.

Which layer is column and which row is the engine-neutral plan (``dense_bridge.parallel._plan``);
here the flow of the activation is followed through the chain: a column layer whose output goes
anywhere but into a row layer (the end of the model, a softmax over the features, another
column layer) gathers its output with ``mx.distributed.all_gather`` first, and a row layer fed
a replicated input takes its own slice of it. Activations between a column and a row layer
are elementwise and run on the shard.

The parallel model stays a plain ``nn.Sequential`` holding these modules: ``nn.value_and_grad``
and the optimizers work on it as on any MLX model, each rank holding and training its own shard.
Every verb on a parallel model is collective (every rank calls it, in the same order):
``parallel_get_params`` all-gathers full canonical arrays (``local=True``: this rank's blocks and
where they sit, no communication), ``parallel_set_params`` takes full ones and keeps this rank's
slice (no communication); ``db.save`` writes each rank's blocks into the sharded directory
(``dense_bridge.parallel._sharded_dir``). The plain verbs (``_params``, ``_to_spec``, ``_trace``)
never see a sharded layer: dense_bridge/parallel/_dispatch.py routes a parallel model here.
Launch: ``mlx.launch --backend ring -n 2 /path/to/python script.py`` (README, "Tensor
parallelism").
"""
from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import sum_gradients

from dense_bridge._errors import ConversionError, SpecError, received
from dense_bridge.parallel._plan import Shard as ShardView
from dense_bridge.parallel._plan import elementwise, resolve_plan, shard_index
from dense_bridge.registry._remembered_spec import remember_spec, remembered_spec
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Sequential

from ._activations import activation_fn
from ._arrays import check_dtype, dtype_name, to_mx, to_numpy
from ._layers import DenseLinear
from ._layers import compile as compile_layer
from ._params import layer_params, layer_subset, positions, set_layer
from ._to_spec import chain_spec
from ._to_spec import layer_spec as plain_layer_spec
from ._trace import canonical_grads, trace_chain

__all__ = ["ColumnDense", "RowDense", "ShardedDense", "parallel_compile", "parallel_state", "parallel_get_params",
           "parallel_set_params", "parallel_to_spec", "parallel_trace", "parallel_barrier", "parallel_agree_seed",
           "full_grads"]


def _check_group(group):
    if group is None:
        return mx.distributed.init()  # MLX's global group: a group of one in a plain process
    if not isinstance(group, mx.distributed.Group):
        raise TypeError(f"group must be an mlx.core.distributed.Group (mx.distributed.init()) or None. "
                        f"{received('group', group)}")
    return group


def _gather_features(y: mx.array, group) -> mx.array:
    """(..., k) shards along the last axis on every rank -> (..., N*k) in rank order.

    ``all_gather`` concatenates along axis 0, so the feature axis goes first and back; its vjp
    hands each rank its own slice of the cotangent.
    """
    return mx.moveaxis(mx.distributed.all_gather(mx.moveaxis(y, -1, 0), group=group), 0, -1)


def _take(kind: str, spec: Dense, group, params: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """This rank's MLX arrays (weight/bias/mask, MLX layout) cut from full canonical ``params``."""
    n, r = int(group.size()), int(group.rank())
    shapes = spec.param_shapes()
    return _mlx_arrays({k: np.asarray(v)[shard_index(kind, k, shapes[k], r, n)] for k, v in params.items()},
                       spec.dtype, premasked=True)


class _MaskStaysFrozen(set):
    """A Module._no_grad set that keeps "mask" through every unfreeze (the mask never trains),
    as the single-process DenseLinear's does."""

    def clear(self) -> None:
        super().clear()
        self.add("mask")

    def difference_update(self, *others) -> None:
        super().difference_update(*others)
        self.add("mask")

    def discard(self, key) -> None:
        if key != "mask":
            super().discard(key)

    def remove(self, key) -> None:
        if key != "mask":
            super().remove(key)

    def __isub__(self, other):
        self.difference_update(other)
        return self


def _span(s: slice) -> str:
    return f"[{s.start}:{s.stop}]"


class ShardedDense:
    """What both parallel Dense kinds share: the frozen mask, the activation, the layer's spec
    and the slices this rank holds. ``kind`` is "column" or "row"."""

    kind: str = ""

    def _setup(self, spec: Dense, weight, bias, mask, group) -> None:
        nn.Module.__init__(self)  # not the MLX __init__: its random draws would be discarded
        self._no_grad = _MaskStaysFrozen(self._no_grad)
        self.group = group
        self._spec = spec
        self._act = None if spec.activation.is_identity else activation_fn(spec.activation)
        self.weight = weight
        if bias is not None:
            self.bias = bias
        if mask is not None:
            self.mask = mask
            self.freeze(keys=["mask"], recurse=False)

    @property
    def activation(self) -> Activation:
        return self._spec.activation

    @property
    def spec(self) -> Dense:
        """The full (unsharded) layer spec."""
        return self._spec

    def _masked_weight(self) -> mx.array:
        return DenseLinear._masked_weight(self) if "mask" in self else self["weight"]

    @property
    def to_quantized(self):
        raise AttributeError(f"{type(self).__name__} cannot be quantized: it carries a mask and an activation")

    def slices(self, name: str) -> tuple[slice, ...]:
        """Where this rank's block of canonical ``name`` (kernel, bias, mask) sits in the full tensor."""
        return shard_index(self.kind, name, self._spec.param_shapes()[name], int(self.group.rank()),
                           int(self.group.size()))

    def local(self) -> dict[str, np.ndarray]:
        """This rank's shards in the canonical layout (kernel (in, units) axes)."""
        out = {"kernel": to_numpy(self["weight"]).T}
        if "bias" in self:
            out["bias"] = to_numpy(self["bias"])
        if "mask" in self:
            out["mask"] = to_numpy(self["mask"]).T
        return out

    def gathered(self) -> dict[str, np.ndarray]:
        """Full canonical params: the shards all-gathered (collective: every rank calls it).

        A column weight (units/N, in) stacks along units, axis 0, which is ``all_gather``'s
        axis; a row weight (units, in/N) is gathered transposed, (in/N, units) stacked = kernel.
        """
        g = self.group
        arrays = {"weight": self["weight"]}
        if "mask" in self:
            arrays["mask"] = self["mask"]
        out = {}
        for name, a in arrays.items():
            if self.kind == "column":
                full = mx.distributed.all_gather(a, group=g).T
            else:
                full = mx.distributed.all_gather(mx.contiguous(a.T), group=g)
            mx.eval(full)
            out["kernel" if name == "weight" else name] = np.array(to_numpy(full))
        if "bias" in self:
            if self.kind == "column":
                full = mx.distributed.all_gather(self["bias"], group=g)
                mx.eval(full)
                out["bias"] = np.array(to_numpy(full))
            else:
                out["bias"] = np.array(to_numpy(self["bias"]))
        return {k: out[k] for k in ("kernel", "bias", "mask") if k in out}

    def take(self, params: dict[str, np.ndarray]) -> dict[str, mx.array]:
        """This rank's MLX arrays cut from full canonical ``params`` (kernel/bias/mask present)."""
        return _take(self.kind, self._spec, self.group, params)

    def set_full(self, params: dict[str, np.ndarray]) -> None:
        """Write full canonical params (a subset of kernel/bias/mask): keep this rank's slice."""
        new = self.take(params)
        if "mask" in self and ("weight" in new or "mask" in new):
            weight = new.get("weight", self["weight"]) * new.get("mask", self["mask"])
            mx.eval(weight)
            new["weight"] = weight  # masked weights are exactly 0 by contract
        self.update(new)

    def grads_gathered(self, grads: dict[str, mx.array]) -> dict[str, np.ndarray]:
        """Full canonical gradients from this rank's weight/bias gradient shards (collective)."""
        g = self.group
        out = {}
        if "weight" in grads:
            w = grads["weight"]
            full = mx.distributed.all_gather(w, group=g).T if self.kind == "column" else \
                mx.distributed.all_gather(mx.contiguous(w.T), group=g)
            mx.eval(full)
            out["kernel"] = np.array(to_numpy(full))
        if "bias" in grads:
            b = grads["bias"]
            full = mx.distributed.all_gather(b, group=g) if self.kind == "column" else b
            mx.eval(full)
            out["bias"] = np.array(to_numpy(full))
        return out


class ColumnDense(ShardedDense, nn.AllToShardedLinear):
    """Column-parallel Dense: y_r = f(x @ W_r.T + b_r), this rank's units/N output features.

    weight (units/N, in_features), bias (units/N,), mask (units/N, in_features). With
    ``gather_output`` the shards are all-gathered before the activation (needed for a softmax
    over the features, and wherever the next consumer wants every feature).
    """

    kind = "column"

    def __init__(self, spec: Dense, weight, bias, mask, group, gather_output: bool) -> None:
        self._setup(spec, weight, bias, mask, group)
        self.gather_output = bool(gather_output)

    def _extra_repr(self) -> str:
        act = "" if self.activation.is_identity else f", activation={self.activation!r}"
        return (f"input_dims={self._spec.in_features}, output_dims={self._spec.units}, "
                f"units {_span(self.slices('kernel')[1])}, bias={'bias' in self}{act}, "
                f"masked={'mask' in self}, gather_output={self.gather_output}")

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 0 or x.shape[-1] != self._spec.in_features:
            raise SpecError(f"x must have shape (*, in_features={self._spec.in_features}). "
                            f"Received: x of shape {tuple(x.shape)}")
        x = sum_gradients(self.group)(x)  # dL/dx is the sum of every rank's partial
        w = self._masked_weight()
        y = mx.addmm(self["bias"], x, w.T) if "bias" in self else x @ w.T
        if self.gather_output:
            y = _gather_features(y, self.group)
        return y if self._act is None else self._act(y)


class RowDense(ShardedDense, nn.ShardedToAllLinear):
    """Row-parallel Dense: y = f(all_sum_r(x_r @ W_r.T) + b), replicated on every rank.

    weight (units, in_features/N), bias (units,) replicated, mask (units, in_features/N). With
    ``split_input`` the input arrives replicated (full features) and this rank takes its slice.
    """

    kind = "row"

    def __init__(self, spec: Dense, weight, bias, mask, group, split_input: bool) -> None:
        self._setup(spec, weight, bias, mask, group)
        self.split_input = bool(split_input)

    def _extra_repr(self) -> str:
        act = "" if self.activation.is_identity else f", activation={self.activation!r}"
        return (f"input_dims={self._spec.in_features}, output_dims={self._spec.units}, "
                f"in_features {_span(self.slices('kernel')[0])}, bias={'bias' in self}{act}, "
                f"masked={'mask' in self}, split_input={self.split_input}")

    def __call__(self, x: mx.array) -> mx.array:
        shard = self["weight"].shape[1]
        if self.split_input:
            if x.ndim == 0 or x.shape[-1] != self._spec.in_features:
                raise SpecError(f"x must have shape (*, in_features={self._spec.in_features}). "
                                f"Received: x of shape {tuple(x.shape)}")
            x = sum_gradients(self.group)(x)
            start = self.group.rank() * shard
            x = x[..., start:start + shard]
        elif x.ndim == 0 or x.shape[-1] != shard:
            raise SpecError(f"x must have shape (*, in_features/N={shard}) (this rank's shard of a "
                            f"column layer's output). Received: x of shape {tuple(x.shape)}")
        y = mx.distributed.all_sum(x @ self._masked_weight().T, group=self.group)
        if "bias" in self:
            y = y + self["bias"]
        return y if self._act is None else self._act(y)


_STATE = "_dense_bridge_parallel"


def parallel_state(native: Any) -> dict | None:
    """{"plan", "group", "rank", "world_size"} of a model compiled with ``parallel=``, else None."""
    state = getattr(native, "__dict__", {}).get(_STATE)
    if state is None:
        return None
    group = state["group"]
    return {**state, "rank": int(group.rank()), "world_size": int(group.size())}


def parallel_compile(spec, block: Callable, parallel: Any, group: Any):
    """The parallel MLX model for ``spec`` on ``group`` (default: ``mx.distributed.init()``).

    ``block(position, name, index)`` gives this rank's canonical block of each parameter
    (``index``: a tuple of slices into the full canonical tensor), so no rank ever holds a full
    sharded tensor: each column/row layer is built straight from its own slices. The plan is
    ``dense_bridge.parallel._plan.resolve_plan`` (which layer gathers, which input arrives sharded).
    Replicated layers are built whole (with ``seed=None`` every rank draws them from rank 0's
    seed: :func:`parallel_agree_seed`).
    """
    group = _check_group(group)
    n, r = int(group.size()), int(group.rank())
    layers = spec.layers if isinstance(spec, Sequential) else (spec,)
    if any(isinstance(l, Bilinear) for l in layers):
        raise SpecError(f"parallel= shards Dense layers; Bilinear is not supported. Received: {spec!r}")
    plan = resolve_plan(spec, parallel, n)
    modules = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, Dense):
            modules.append(compile_layer(layer, None))  # no parameters: nothing to draw
            continue
        if layer.lazy:
            raise SpecError(f"a parallel model needs every in_features: layer {i} is lazy. Received: {layer!r}")
        check_dtype(layer.dtype)
        shapes = layer.param_shapes()
        p = plan.get(i)
        if p is None:  # replicated: the whole layer, as the plain compile builds it
            full = {k: block(i, k, tuple(slice(0, d) for d in s)) for k, s in shapes.items()}
            m = compile_layer(layer, _Given(full))
        else:
            parts = {k: block(i, k, shard_index(p.style, k, s, r, n)) for k, s in shapes.items()}
            arrays = _mlx_arrays(parts, layer.dtype)
            if p.style == "column":
                m = ColumnDense(layer, arrays["weight"], arrays.get("bias"), arrays.get("mask"), group,
                                gather_output=p.gather_output)
            else:
                m = RowDense(layer, arrays["weight"], arrays.get("bias"), arrays.get("mask"), group,
                             split_input=not p.input_sharded)
            remember_spec(m, layer)
        modules.append(m)
    model = nn.Sequential(*modules) if isinstance(spec, Sequential) else modules[0]
    model.__dict__[_STATE] = {"plan": plan, "group": group}
    remember_spec(model, spec)
    return model


class _Given:
    """A ParamSource stand-in for one replicated layer whose canonical params are already read."""

    def __init__(self, params: dict) -> None:
        self._params = params

    def for_layer(self, index: int, layer) -> dict:
        return self._params


def _mlx_arrays(parts: dict[str, np.ndarray], dtype: str, premasked: bool = False) -> dict[str, mx.array]:
    """Canonical blocks (kernel/mask (in, units) axes) -> MLX arrays (weight (units, in) axes)."""
    out = {}
    for name, value in parts.items():
        value = np.asarray(value)
        if name == "kernel" and "mask" in parts and not premasked:
            value = value * np.asarray(parts["mask"])  # masked weights are exactly 0 by contract
        out["weight" if name == "kernel" else name] = to_mx(value.T if value.ndim == 2 else value, dtype)
    return out


def parallel_agree_seed(group, seed: int) -> int:
    """``compile(seed=None, parallel=...)``: rank 0's seed on every rank of ``group``, so each
    rank keeps its block of one random model. Rank 0's two 32-bit halves, zeros elsewhere,
    all-summed (``mx.distributed`` has no broadcast)."""
    group = _check_group(group)
    if group.size() == 1:
        return int(seed)
    halves = [seed >> 32, seed & 0xFFFFFFFF] if group.rank() == 0 else [0, 0]
    total = mx.distributed.all_sum(mx.array(halves, dtype=mx.uint32), group=group)
    hi, lo = (int(v) for v in np.array(total))
    return hi << 32 | lo


def parallel_get_params(native, local: bool = False) -> dict:
    """Full canonical params on every rank (all-gathered: collective), or with ``local`` this
    rank's blocks as :class:`dense_bridge.parallel._plan.Shard` (array, index into the full tensor);
    replicated layers come whole with full slices."""
    mx.eval(native.parameters())
    out: dict = {}
    for prefix, m in positions(native):
        if isinstance(m, ShardedDense):
            got = m.local() if local else m.gathered()
            for key, value in got.items():
                out[prefix + key] = ShardView(value, m.slices(key)) if local else value
            continue
        for key, value in (layer_params(m) if isinstance(m, nn.Module) else {}).items():
            out[prefix + key] = ShardView(value, tuple(slice(0, d) for d in value.shape)) if local else value
    return out


def parallel_set_params(native, params: dict[str, np.ndarray]) -> None:
    """Write full canonical ``params``: a sharded layer keeps this rank's slice (no communication),
    a replicated one takes them whole."""
    for prefix, m in positions(native):
        if isinstance(m, ShardedDense):
            if get := layer_subset(params, prefix):
                m.set_full(get)
        else:
            set_layer(m, params, prefix)


def parallel_to_spec(native):
    """The full (unsharded) spec, each sharded layer's checked against the shard it holds."""
    def read_layer(m, where: str):
        return layer_spec(m) if isinstance(m, ShardedDense) else plain_layer_spec(m, where)

    return chain_spec(native, read_layer)


def parallel_trace(native, inputs, grad_out):
    """The ``trace`` verb on a parallel model (collective): sharded outputs, input gradients and
    parameter gradients all-gathered, so ``db.testing.compare`` holds it against one process."""
    def layer_grads(m, grads):
        return m.grads_gathered(grads) if isinstance(m, ShardedDense) else canonical_grads(m, grads)

    return gather_trace(native, trace_chain(native, inputs, grad_out, layer_grads))


def parallel_barrier(native) -> None:
    """Every rank of the model's group reaches this point (an all_sum of one number: MLX has no
    barrier of its own)."""
    group = native.__dict__[_STATE]["group"]
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))


def full_grads(native, grads: dict) -> dict[str, np.ndarray]:
    """Canonical full gradients from ``nn.value_and_grad``'s tree for a parallel model (collective:
    sharded layers all-gather their gradient shards). The mask never has a gradient."""
    layers_grads = grads["layers"] if type(native) is nn.Sequential else [grads]
    out = {}
    for (prefix, m), g in zip(positions(native), layers_grads):
        if not g:
            continue
        if isinstance(m, ShardedDense):
            got = m.grads_gathered(g)
        else:
            got = {"kernel": np.array(to_numpy(g["weight"])).T}
            if "bias" in g:
                got["bias"] = np.array(to_numpy(g["bias"]))
        for key, value in got.items():
            out[prefix + key] = value
    return out


def _sharded_outputs(native) -> list[bool]:
    """Per position: is the layer's output this rank's slice of the features (not yet gathered)?"""
    plan = native.__dict__[_STATE]["plan"]
    spec = remembered_spec(native)  # the spec parallel_compile built this model from
    layers = spec.layers if isinstance(spec, Sequential) else (spec,)
    out, sharded = [], False
    for i, layer in enumerate(layers):
        p = plan.get(i)
        if p is not None and p.style == "column":
            sharded = not p.gather_output
        elif p is not None or isinstance(layer, Dense) or not elementwise(layer):
            sharded = False
        out.append(sharded)
    return out


def gather_trace(native, trace):
    """A parallel model's trace with every sharded output and input gradient all-gathered
    (collective), so ``db.testing.compare`` holds it against a single-process model; parameter
    gradients are gathered already (``ShardedDense.grads_gathered``)."""
    group = native.__dict__[_STATE]["group"]
    sharded = _sharded_outputs(native)

    def whole(a: np.ndarray) -> np.ndarray:
        full = _gather_features(to_mx(a, a.dtype.name), group)
        mx.eval(full)
        return np.array(to_numpy(full))

    for i, rec in enumerate(trace.layers):
        if sharded[i]:
            rec.output = whole(rec.output)
        if i > 0 and sharded[i - 1]:
            rec.input_grads = tuple(whole(g) for g in rec.input_grads)
    return trace


def layer_spec(m) -> Dense:
    """The full spec of a sharded layer, checked against the shard it holds."""
    spec, n = m.spec, m.group.size()
    units, shard_in = (int(s) for s in m["weight"].shape)
    expected = (spec.units // n, spec.in_features) if m.kind == "column" else (spec.units, spec.in_features // n)
    if (units, shard_in) != expected:
        raise ConversionError(f"a {m.kind}-parallel MLX layer holds a weight of shape {(units, shard_in)}; "
                              f"its spec {spec!r} over {n} ranks needs {expected}")
    dtype = dtype_name(m["weight"].dtype, "weight")
    return spec if dtype == spec.dtype else spec.replace(dtype=dtype)
