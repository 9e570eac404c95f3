"""Tensor-parallel Dense on Flax NNX: sharding annotations (``out_sharding`` metadata) on a named
mesh axis, with each variable placed as a ``NamedSharding`` on that mesh.

Layouts (canonical == Flax: kernel (in_features, units)), over the mesh axis ``"model"`` of N
devices:

- column: kernel ``(None, "model")``, bias ``("model",)``, mask like the kernel;
- row: kernel ``("model", None)``, mask like the kernel, bias replicated.

JAX (GSPMD) inserts the collectives from these placements. The mesh must have axis type
``AxisType.Auto`` (the default mesh does): under explicit axes JAX's sharding-in-types raises
``ShardingTypeError`` in the row-parallel matmul, whose contraction runs over the split axis
(FACTS). Run the model under ``jax.set_mesh(mesh)`` as Flax's own sharding guide does; eager
calls on the placed arrays work too.

After placing, every variable's live sharding is read back and checked against the plan (a
SpecError names any that is not split as planned). ``set_params`` writes full arrays and places
each again by its annotation, so the layout survives it. JAX is single-controller: ``local=True``
gives this process's addressable block (in one process, the whole tensor).
Launch: one process, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python x.py`` on CPU.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dense_bridge._errors import SpecError, received
from dense_bridge.backends._jax.parallel import addressable_block, agree_seed, barrier, layout_problems
from dense_bridge.parallel._plan import resolve_plan, split_axis
from dense_bridge.params._source import ParamSource
from dense_bridge.registry._remembered_spec import remember_spec
from dense_bridge.specs import Bilinear, Dense, Sequential

_STATE = "_dense_bridge_parallel"
_AXIS = "model"

__all__ = ["parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params", "parallel_to_spec",
           "parallel_trace", "parallel_barrier", "parallel_agree_seed", "shard_shapes"]


def _mesh(group: Any) -> tuple[Mesh, int]:
    """The mesh and the size of its "model" axis (default: every device on one Auto axis)."""
    if group is None:
        mesh = jax.make_mesh((len(jax.devices()),), (_AXIS,), axis_types=(AxisType.Auto,))
        return mesh, mesh.shape[_AXIS]
    if not isinstance(group, Mesh):
        raise TypeError(f"group must be a jax.sharding.Mesh with a {_AXIS!r} axis (or None for every device). "
                        f"{received('group', group)}")
    if _AXIS not in group.axis_names:
        raise SpecError(f"group must have a mesh axis named {_AXIS!r} to shard along. "
                        f"Received: group with axes {tuple(group.axis_names)}")
    kind = dict(zip(group.axis_names, group.axis_types))[_AXIS]
    if kind != AxisType.Auto:
        raise SpecError(f"the {_AXIS!r} axis of group must be AxisType.Auto: with {kind} axes JAX's sharding in types "
                        f"refuses the row-parallel matmul (ShardingTypeError). Make the mesh with "
                        f"jax.make_mesh(shape, names, axis_types=(AxisType.Auto, ...)). Received: {kind}")
    return group, group.shape[_AXIS]


def _axes(style: str | None, name: str, ndim: int) -> tuple:
    axes = [None] * ndim
    axis = None if style is None else split_axis(style, name)
    if axis is not None:
        axes[axis] = _AXIS
    return tuple(axes)


def _variables(m) -> dict[str, Any]:
    """Canonical name -> the nnx Variable of one Dense layer (kernel, bias, mask)."""
    from ._layers import Mask

    out = {"kernel": m.kernel}
    if m.bias is not None:
        out["bias"] = m.bias
    if isinstance(getattr(m, "mask", None), Mask):
        out["mask"] = m.mask
    return out


def _modules(model) -> list:
    return list(model.layers) if type(model) is nnx.Sequential else [model]


def _place(var, mesh: Mesh, axes: tuple) -> None:
    """Annotate ``var`` with ``axes`` on ``mesh`` and put its value there."""
    var.set_metadata(out_sharding=axes)
    var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, PartitionSpec(*axes))))


def parallel_compile(spec, block: Callable, parallel: Any, group: Any):
    """The Flax NNX model for ``spec`` with every planned Dense's variables annotated and placed
    along the mesh's "model" axis (see the module docstring); checked after placing.

    ``block(position, name, index)`` gives canonical blocks; JAX being single-controller, the
    whole tensor is read and ``jax.device_put`` splits it over the devices.
    """
    mesh, n = _mesh(group)
    layers = spec.layers if isinstance(spec, Sequential) else (spec,)
    if any(isinstance(l, Bilinear) for l in layers):
        raise SpecError(f"parallel= shards Dense layers; Bilinear is not supported. Received: {spec!r}")
    plan = resolve_plan(spec, parallel, n)

    def stream(i: int, layer) -> dict[str, np.ndarray]:
        return {k: block(i, k, tuple(slice(0, d) for d in s)) for k, s in layer.param_shapes().items()}

    from ._layers import compile as compile_flax

    model = compile_flax(spec, ParamSource(spec, stream=stream))
    for i, m in enumerate(_modules(model)):
        if isinstance(layers[i], Dense):
            style = plan[i].style if i in plan else None
            for name, var in _variables(m).items():
                _place(var, mesh, _axes(style, name, var.get_value().ndim))
    model.__dict__[_STATE] = {"plan": plan, "mesh": mesh}
    check_layouts(model, layers, plan, n)
    remember_spec(model, spec)
    return model


def shard_shapes(model) -> dict[str, list[tuple[int, ...]]]:
    """Canonical key -> the shape of each device's shard of that variable (device order)."""
    seq = type(model) is nnx.Sequential
    out = {}
    for i, m in enumerate(_modules(model)):
        if not hasattr(m, "kernel"):
            continue
        for name, var in _variables(m).items():
            shards = sorted(var.get_value().addressable_shards, key=lambda s: s.device.id)
            out[(f"{i}." if seq else "") + name] = [tuple(int(d) for d in s.data.shape) for s in shards]
    return out


def check_layouts(model, layers, plan: dict, n: int) -> None:
    """Every Dense variable's live sharding against the plan; SpecError naming any that differs."""
    wrong = layout_problems(shard_shapes(model), layers, plan, n, type(model) is nnx.Sequential)
    if wrong:
        raise SpecError("the Flax model is not sharded as planned: " + "; ".join(wrong))


def parallel_state(native: Any) -> dict | None:
    """{"plan", "mesh", "rank", "world_size"} of a model compiled with ``parallel=``, else None
    (rank/world_size are JAX processes: one process drives every device)."""
    state = getattr(native, "__dict__", {}).get(_STATE)
    if state is None:
        return None
    return {**state, "rank": int(jax.process_index()), "world_size": int(jax.process_count())}


def parallel_set_params(native, params: dict) -> None:
    """The plain ``set_params`` (which writes unplaced arrays), then every annotated variable
    placed again by its annotation."""
    from ._params import set_params

    set_params(native, params)
    mesh = native.__dict__[_STATE]["mesh"]
    for m in _modules(native):
        if not hasattr(m, "kernel"):
            continue
        for var in _variables(m).values():
            axes = var.get_metadata().get("out_sharding")
            if axes is not None:
                var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, PartitionSpec(*axes))))


def parallel_get_params(native, local: bool = False) -> dict:
    """Full canonical params (JAX assembles them), or with ``local`` this process's addressable
    block of each as :class:`dense_bridge.parallel._plan.Shard` (in one process: the whole tensor)."""
    from ._params import get_params

    if not local:
        return get_params(native)
    seq = type(native) is nnx.Sequential
    out = {}
    for i, m in enumerate(_modules(native)):
        if not hasattr(m, "kernel"):
            continue
        for name, var in _variables(m).items():
            out[(f"{i}." if seq else "") + name] = addressable_block(var.get_value())
    return out


def parallel_to_spec(native):
    """The full spec: JAX arrays are global, so the plain ``to_spec`` reads every shape whole."""
    from ._to_spec import to_spec

    return to_spec(native)


def parallel_trace(native, inputs, grad_out):
    """The plain ``trace``: JAX is single-controller, so every output and gradient it computes is
    the whole array already (GSPMD inserts the collectives)."""
    from ._trace import trace

    return trace(native, inputs, grad_out)


def parallel_barrier(native) -> None:
    """Every JAX process reaches this point (a no-op with one process)."""
    barrier()


def parallel_agree_seed(group, seed: int) -> int:
    """``compile(seed=None, parallel=...)``: JAX process 0's seed (in one process, ``seed``)."""
    return agree_seed(seed)
