"""Tensor-parallel Dense on Keras: ``keras.distribution.ModelParallel`` with a ``LayoutMap`` built
from the spec, on Keras' JAX backend only (the only one whose ``ModelParallel`` shards variables;
on TensorFlow and torch ``parallel=`` raises SpecError).

Layouts (canonical == Keras: kernel (in_features, units)), over the mesh axis ``"model"`` of N
devices:

- column: kernel ``(None, "model")`` (split along units), bias ``("model",)``, mask like the kernel;
- row: kernel ``("model", None)`` (split along in_features), mask like the kernel, bias replicated.

XLA (GSPMD) inserts every collective from these layouts; which outputs are gathered follows from
them, so the plan's ``gather_output``/``input_sharded`` need no code here. The mesh is
``DeviceMesh((1, N), ("batch", "model"))`` over ``jax.devices()`` unless ``group`` gives one (a
``keras.distribution.DeviceMesh`` with a ``"model"`` axis, or a 1-D one).

LayoutMap keys are regexes searched in each variable's path; a key that matches nothing leaves
its layer replicated without any error (FACTS). So each planned layer gets a name Keras itself
would generate (``keras.src.utils.naming`` rules, via ``uniquify``: read back as "no name" by
``to_spec``), the keys are anchored on those names, and after the build every variable's
sharding is read back and checked against the plan: a planned variable that is not split as
planned, or an unplanned one that is, raises SpecError.

JAX is single-controller: this process addresses every device, so ``get_params`` reads full
arrays (JAX gathers), ``get_params(local=True)`` gives this process's addressable block (the
whole tensor in one process), ``set_params`` assigns full arrays which Keras re-shards by the
variable's layout, and ``save`` writes one rank file. Launch: one process with N devices, e.g.
``KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=4 python script.py`` on CPU.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import keras
import numpy as np

from dense_bridge._errors import SpecError, received
from dense_bridge.parallel._plan import resolve_plan, split_axis
from dense_bridge.params._source import ParamSource
from dense_bridge.registry._remembered_spec import remember_spec
from dense_bridge.specs import Bilinear, Dense, Sequential

_STATE = "_dense_bridge_parallel"
_AXIS = "model"

__all__ = ["parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params", "parallel_to_spec",
           "parallel_trace", "parallel_barrier", "parallel_agree_seed", "shard_shapes"]


def _check_backend() -> None:
    if keras.backend.backend() != "jax":
        raise SpecError(f"parallel= on Keras needs Keras' JAX backend (keras.distribution.ModelParallel shards "
                        f"variables only there); Keras runs on {keras.backend.backend()!r}. Set KERAS_BACKEND=jax "
                        f"before importing keras. Received: KERAS_BACKEND={keras.backend.backend()!r}")


def _mesh(group: Any):
    """The DeviceMesh and the size of its "model" axis."""
    from keras import distribution as kd

    if group is None:
        devices = kd.list_devices()
        return kd.DeviceMesh((1, len(devices)), ("batch", _AXIS), devices=devices), len(devices)
    if not isinstance(group, kd.DeviceMesh):
        raise TypeError(f"group must be a keras.distribution.DeviceMesh (with a {_AXIS!r} axis, or 1-D) or None. "
                        f"{received('group', group)}")
    names = list(group.axis_names)
    if _AXIS not in names:
        if len(names) != 1:
            raise SpecError(f"group must have a {_AXIS!r} axis to shard along (or be 1-D). "
                            f"Received: group with axes {tuple(names)}")
        devices = np.asarray(group.devices).reshape(-1)
        return kd.DeviceMesh((1, devices.size), ("batch", _AXIS), devices=devices), int(devices.size)
    return group, int(group.shape[names.index(_AXIS)])


def _keras_name(layer: Dense) -> str:
    """The name Keras would give the layer the adapter builds for ``layer`` (a fresh one)."""
    from keras.src.utils.naming import to_snake_case, uniquify

    from ._layers import DenseBridgeDense

    exact = layer.activation.is_identity and layer.mask is None
    return uniquify(to_snake_case((keras.layers.Dense if exact else DenseBridgeDense).__name__))


def _layout(style: str | None, name: str, ndim: int) -> tuple:
    axes = [None] * ndim
    axis = None if style is None else split_axis(style, name)
    if axis is not None:
        axes[axis] = _AXIS
    return tuple(axes)


def parallel_compile(spec, block: Callable, parallel: Any, group: Any):
    """The Keras model for ``spec`` under ``ModelParallel``: every planned Dense's variables laid
    out along the mesh's "model" axis by a ``LayoutMap`` built from the spec, then checked.

    ``block(position, name, index)`` gives canonical blocks; JAX being single-controller, the
    whole tensor is read (index = every slice) and Keras/JAX place each device's shard.
    """
    _check_backend()
    from keras import distribution as kd

    mesh, n = _mesh(group)
    layers = spec.layers if isinstance(spec, Sequential) else (spec,)
    if any(isinstance(l, Bilinear) for l in layers):
        raise SpecError(f"parallel= shards Dense layers; Bilinear is not supported. Received: {spec!r}")
    plan = resolve_plan(spec, parallel, n)
    layout_map = kd.LayoutMap(mesh)
    named, names = [], {}
    for i, layer in enumerate(layers):
        if isinstance(layer, Dense) and i in plan and layer.name is None:
            layer = layer.replace(name=_keras_name(layer))
        if isinstance(layer, Dense) and i in plan:
            names[i] = layer.name
            for key, shape in layer.param_shapes().items():
                layout_map[rf"(^|/){re.escape(layer.name)}/{key}$"] = _layout(plan[i].style, key, len(shape))
        named.append(layer)
    taken = [names[i] for i in names]
    if len(set(taken)) != len(taken):
        raise SpecError(f"parallel layers need distinct names (their variables are laid out by name). "
                        f"Received: names {taken}")
    named_spec = Sequential(named, in_features=spec.in_features, name=spec.name) \
        if isinstance(spec, Sequential) else named[0]

    def stream(i: int, layer) -> dict[str, np.ndarray]:
        return {k: block(i, k, tuple(slice(0, d) for d in s)) for k, s in layer.param_shapes().items()}

    distribution = kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    from ._layers import compile as compile_keras

    with distribution.scope():
        model = compile_keras(named_spec, ParamSource(named_spec, stream=stream))
    model.__dict__[_STATE] = {"plan": plan, "mesh": mesh, "distribution": distribution, "names": names}
    check_layouts(model, layers, plan, n)
    remember_spec(model, spec)
    return model


def _keras_layers(model) -> tuple[list, bool]:
    """(the layer chain, whether canonical keys carry positions), as get_params reads them."""
    from ._to_spec import layers_of

    layers, keyed = layers_of(model)
    return list(layers), keyed


def shard_shapes(model) -> dict[str, list[tuple[int, ...]]]:
    """Canonical key -> the shape of each device's shard of that variable (device order)."""
    from ._params import layer_variables

    layers, seq = _keras_layers(model)
    out = {}
    for i, layer in enumerate(layers):
        for key, v in layer_variables(layer).items():
            shards = sorted(v.value.addressable_shards, key=lambda s: s.device.id)
            out[(f"{i}." if seq else "") + key] = [tuple(int(d) for d in s.data.shape) for s in shards]
    return out


def check_layouts(model, layers, plan: dict, n: int) -> None:
    """Every variable's live sharding against the plan (never trusting the LayoutMap): a planned
    kernel/bias/mask must be split N ways along its planned axis, every other one whole on
    every device. SpecError naming each variable that is not."""
    from dense_bridge.backends._jax.parallel import layout_problems  # here: on TF or torch Keras never imports JAX

    wrong = layout_problems(shard_shapes(model), layers, plan, n, _keras_layers(model)[1])
    if wrong:
        raise SpecError("the Keras ModelParallel layout did not shard the model as planned (a LayoutMap key that "
                        "matches no variable leaves it replicated silently): " + "; ".join(wrong))


def parallel_state(native: Any) -> dict | None:
    """{"plan", "mesh", "rank", "world_size", ...} of a model compiled with ``parallel=``, else None.

    rank/world_size are JAX processes (single-controller: one process addresses every device).
    """
    state = getattr(native, "__dict__", {}).get(_STATE)
    if state is None:
        return None
    import jax

    return {**state, "rank": int(jax.process_index()), "world_size": int(jax.process_count())}


def parallel_get_params(native, local: bool = False) -> dict:
    """Full canonical params (JAX assembles them from the device shards), or with ``local`` this
    process's addressable block of each, as :class:`dense_bridge.parallel._plan.Shard`: the bounding
    block of the shards this process addresses, checked to be tiled by them exactly (in one
    process: the whole tensor)."""
    from dense_bridge.backends._jax.parallel import addressable_block

    from ._params import get_params, layer_variables

    if not local:
        return get_params(native)
    layers, seq = _keras_layers(native)
    out = {}
    for i, layer in enumerate(layers):
        for key, v in layer_variables(layer).items():
            out[(f"{i}." if seq else "") + key] = addressable_block(v.value)
    return out


def parallel_set_params(native, params) -> None:
    """Write full canonical ``params``: Keras assigns them to each variable, which keeps its
    layout, so JAX re-shards them by it (the plain ``set_params``)."""
    from ._params import set_params

    set_params(native, params)


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
    from dense_bridge.backends._jax.parallel import barrier

    barrier()


def parallel_agree_seed(group, seed: int) -> int:
    """``compile(seed=None, parallel=...)``: JAX process 0's seed (in one process, ``seed``)."""
    _check_backend()
    from dense_bridge.backends._jax.parallel import agree_seed

    return agree_seed(seed)
