"""The ``to_spec`` verb: one torch module -> its layer spec, and the chains behind it.

A chain position holds a Linear-family module, Bilinear, Identity, Dropout or an activation
module (:func:`_leaf_spec`). A chain is an ``nn.Sequential`` read position by position, or any
``nn.Module`` whose forward ``torch.fx`` traces as a single chain of layers and activations (a
leading ``x.view(-1, in_features)`` read as ``db.Flatten()``, as are ``nn.Flatten()`` and
``torch.flatten(x, 1)``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.fx
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from dense_bridge._errors import ConversionError, SpecError, received
from dense_bridge.models._layouts import declared, warn_dropout
from dense_bridge.activations import Activation
from dense_bridge.registry._remembered_spec import remembered_spec
from dense_bridge.specs import Bilinear, Dense, Flatten, Identity, Sequential

from ._quant import quant_layer
from ._activations import FUNCTIONS, METHODS, ExactActivation, activation_module, fn_spec, module_activation
from ._arrays import dtype_name, from_numpy
from ._layers import DenseLinear, LazyDense

# Modules pickled by dense_bridge 0.1 carry the remembered fields as a JSON-able dict here.
_LEGACY_META = "_dense_bridge_meta"


#: Third-party activation modules that compute an activation of dense_bridge's table, by dotted
#: class name (no import): transformers' NewGELU/FastGELU/AccurateGELU evaluate the tanh formula
#: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) in Python, GELUTanh/PytorchGELUTanh call
#: gelu(approximate="tanh"), GELUActivation the exact erf gelu (transformers/activations.py).
THIRD_PARTY_ACTIVATIONS = {
    "transformers.activations.NewGELUActivation": "gelu_tanh",
    "transformers.activations.FastGELUActivation": "gelu_tanh",
    "transformers.activations.AccurateGELUActivation": "gelu_tanh",
    "transformers.activations.GELUTanh": "gelu_tanh",
    "transformers.activations.PytorchGELUTanh": "gelu_tanh",
    "transformers.activations.GELUActivation": "gelu",
    "transformers.activations.SiLUActivation": "silu",
    "transformers.activations.MishActivation": "mish",
    "transformers.activations.LinearActivation": "linear",
}


def third_party_activation(m: nn.Module) -> Activation | None:
    """The table's Activation for a known third-party activation module (exact class), else None."""
    name = THIRD_PARTY_ACTIVATIONS.get(f"{type(m).__module__}.{type(m).__qualname__}")
    return None if name is None else Activation(name)


# ------------------------------------------------------------------ one module
def _remembered(m: nn.Module, cls: type) -> dict:
    """The spec fields torch cannot hold (initializers, name, a Sequential's in_features) that
    compile remembered on ``m``, as a dict; {} for a module built by hand."""
    spec = remembered_spec(m, cls)
    if spec is not None:
        fields = {"name": spec.name}
        if isinstance(spec, Dense):
            fields.update(kernel_init=spec.kernel_init, bias_init=spec.bias_init)
        elif isinstance(spec, Bilinear):
            fields.update(init=spec.init)
        elif isinstance(spec, Sequential):
            fields.update(in_features=spec.in_features)
        return fields
    return dict(getattr(m, _LEGACY_META, None) or {})  # a module pickled by dense_bridge 0.1


def describe(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


# NonDynamicallyQuantizableLinear: nn.MultiheadAttention's out_proj, an nn.Linear in all but name
LINEAR_TYPES = (nn.Linear, DenseLinear, nn.LazyLinear, LazyDense, nn.modules.linear.NonDynamicallyQuantizableLinear)


def has_params(m: nn.Module | None) -> bool:
    """Is ``m`` a layer whose parameters dense_bridge reads (Linear family or Bilinear)?"""
    return m is not None and (type(m) in LINEAR_TYPES + (nn.Bilinear,) or declared(m) is not None)


def declared_tensors(m: nn.Module) -> tuple[object, object | None, bool]:
    """(kernel tensor, bias tensor or None, stored transposed?) of a class declared with
    db.register_layout (transformers' Conv1D: weight (in, out), not transposed)."""
    decl = declared(m)
    kernel = getattr(m, decl.kernel, None)
    if kernel is None or getattr(kernel, "ndim", 0) != 2:
        raise ConversionError(f"cannot read {describe(m)}: its layout declaration names the kernel "
                              f"attribute {decl.kernel!r}, which is {type(kernel).__name__}, not a 2-D tensor")
    bias = getattr(m, decl.bias, None) if decl.bias else None
    units = int(kernel.shape[0 if decl.transposed else 1])
    if bias is not None and tuple(getattr(bias, "shape", ())) != (units,):
        raise ConversionError(f"cannot read {describe(m)}: its layout declaration names the bias attribute "
                              f"{decl.bias!r} of shape {tuple(getattr(bias, 'shape', ()))}, but the kernel "
                              f"{decl.kernel!r} of shape {tuple(kernel.shape)} has {units} units")
    return kernel, bias, decl.transposed


def _hook_fix(m: nn.Module) -> str:
    """Why a module's weight/bias is not a Parameter (a forward pre-hook computes it), and the fix."""
    hooks = list(m._forward_pre_hooks.values())
    pruned = [h._tensor_name for h in hooks if isinstance(h, prune.BasePruningMethod)]
    if pruned:
        removes = "; ".join(f"torch.nn.utils.prune.remove(module, {n!r})" for n in pruned)
        return (f"{' and '.join(pruned)} pruned with torch.nn.utils.prune (<name> = <name>_orig * <name>_mask, "
                f"recomputed at every forward). Make the pruning permanent first: {removes}; for a mask that "
                f"stays enforced, use db.Dense(..., mask=...)")
    kinds = {type(h).__name__ for h in hooks}
    if "WeightNorm" in kinds:
        return ("weight computed by the legacy torch.nn.utils.weight_norm hook (from weight_g, weight_v). Bake it in "
                "first: torch.nn.utils.remove_weight_norm(module)")
    if "SpectralNorm" in kinds:
        return ("weight computed by the legacy torch.nn.utils.spectral_norm hook (from weight_orig). Bake it in "
                "first: torch.nn.utils.remove_spectral_norm(module)")
    return "weight or bias computed rather than registered as a Parameter; make it a plain nn.Parameter first"


def check_plain_params(m: nn.Module, where: str) -> None:
    """ConversionError for a Linear/Bilinear whose weight or bias is computed, not stored.

    torch's prune, parametrize (weight_norm, spectral_norm, orthogonal, ...) and the legacy
    weight_norm/spectral_norm hooks replace the ``weight`` Parameter by a tensor recomputed from other ones at
    every forward: a value written into it is lost at the next call, and one read from it goes
    stale after ``opt.step()``. Only the user can choose how to bake it in.
    """
    if not isinstance(m, (nn.Linear, nn.Bilinear)):
        return
    if parametrize.is_parametrized(m):
        names = list(m.parametrizations.keys())
        removes = "; ".join(f"torch.nn.utils.parametrize.remove_parametrizations(module, {n!r})" for n in names)
        raise ConversionError(
            f"cannot convert {where}: {type(m).__name__} has its {' and '.join(names)} parametrized with "
            f"torch.nn.utils.parametrize (weight_norm, spectral_norm, ...: recomputed from "
            f"parametrizations.<name>.original at every access), so dense_bridge cannot read or write it "
            f"exactly. Bake it in first: {removes}")
    # a reparametrized tensor is deleted from _parameters (a bias=False layer keeps "bias": None)
    if "weight" not in m._parameters or "bias" not in m._parameters:
        raise ConversionError(f"cannot convert {where}: {type(m).__name__} has its {_hook_fix(m)}")


def _dense_spec(m: nn.Module, where: str) -> Dense:
    lazy = isinstance(m, nn.LazyLinear) and m.has_uninitialized_params()
    act = getattr(m, "activation", None)
    activation = Activation("linear") if act is None or type(act) is nn.Identity else \
        module_activation(act, f"{where}.activation")
    if activation is None:
        raise ConversionError(f"{where}.activation is {describe(act)}, not a known activation module")
    mask = getattr(m, "mask", None)
    meta = _remembered(m, Dense)
    return Dense(
        m.out_features, in_features=None if lazy else m.in_features, use_bias=m.bias is not None,
        # read as bool: the mask is 0/1 in the layer dtype, and Wiring takes no bfloat16
        activation=activation, mask=None if mask is None else (mask.detach().cpu() != 0).numpy().T,
        # a hand-built nn.Linear was initialised with torch's U(+-1/sqrt(in)) for both
        kernel_init=meta.get("kernel_init", "torch_default"), bias_init=meta.get("bias_init", "torch_default"),
        dtype=dtype_name(m.weight.dtype, where), name=meta.get("name"))


def _leaf_spec(m: nn.Module, where: str):
    """The spec of a single module, or None when ``m`` is not one dense_bridge knows as a layer."""
    quantized = quant_layer(m)
    if quantized is not None:  # a torchao Linear in a chain: the float Dense it stands for
        return quantized.spec()
    check_plain_params(m, where)
    kind = type(m)
    if kind in LINEAR_TYPES:
        return _dense_spec(m, where)
    if kind is nn.Bilinear:
        meta = _remembered(m, Bilinear)
        return Bilinear(m.in1_features, m.in2_features, m.out_features, use_bias=m.bias is not None,
                        init=meta.get("init", "torch_default"), dtype=dtype_name(m.weight.dtype, where),
                        name=meta.get("name"))
    if declared(m) is not None:
        kernel, bias, transposed = declared_tensors(m)
        units, in_features = kernel.shape if transposed else kernel.shape[::-1]
        return Dense(int(units), in_features=int(in_features), use_bias=bias is not None,
                     kernel_init="torch_default", bias_init="zeros", dtype=dtype_name(kernel.dtype, where))
    if kind is nn.Flatten:
        if (m.start_dim, m.end_dim) != (1, -1):
            raise ConversionError(f"cannot convert {where}: nn.Flatten(start_dim={m.start_dim}, end_dim={m.end_dim}) "
                                  f"is not db.Flatten() (start_dim=1, end_dim=-1)")
        return Flatten()
    if kind is nn.Identity:
        return Identity(name=_remembered(m, Identity).get("name"))
    if kind in (nn.Dropout, nn.AlphaDropout):
        warn_dropout(f"{where} ({describe(m)})", m.p)
        return Identity()  # dropout's eval-mode function; training-time dropout is not carried over
    third_party = third_party_activation(m)
    if third_party is not None:
        return third_party
    return module_activation(m, where)


# ------------------------------------------------------------------ chains
class Step:
    """One position of a chain: its spec, the module holding its parameters, how to run it."""

    __slots__ = ("spec", "module", "run")

    def __init__(self, spec, module: nn.Module | None, run: Callable) -> None:
        self.spec, self.module, self.run = spec, module, run


_OWN_LEAVES = (DenseLinear, LazyDense, ExactActivation)


def is_container(m: nn.Module) -> bool:
    """Modules whose forward calls other modules: traced into rather than read as a layer."""
    if isinstance(m, nn.Sequential):
        return True
    return type(m) not in _OWN_LEAVES and not type(m).__module__.startswith("torch.nn") and declared(m) is None \
        and third_party_activation(m) is None


class _Tracer(torch.fx.Tracer):
    """fx tracer that keeps dense_bridge's own modules as leaves (torch.nn ones already are)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m) in _OWN_LEAVES or declared(m) is not None or third_party_activation(m) is not None \
            or super().is_leaf_module(m, qualname)


_RESHAPES = {"view", "reshape"}


def _node_name(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
    return f"node {node.name!r} ({node.op} {target})"


def _bind(node: torch.fx.Node, names: tuple[str, ...], where: str) -> dict:
    if len(node.args) > len(names):
        raise ConversionError(f"{where} has {len(node.args)} positional arguments; expected at most {len(names)}")
    bound = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key not in names or key in bound:
            raise ConversionError(f"{where} has an unexpected argument {key}={value!r}")
        bound[key] = value
    return bound


def _is_flatten(node: torch.fx.Node) -> int | None:
    """N for ``x.view(-1, N)`` / ``x.reshape(-1, N)`` (also with a tuple), else None."""
    if node.op != "call_method" or node.target not in _RESHAPES or node.kwargs:
        return None
    shape = node.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if len(shape) == 2 and shape[0] == -1 and isinstance(shape[1], int) and shape[1] > 0:
        return shape[1]
    return None


def _replay(node: torch.fx.Node) -> Callable:
    """Run a traced function/method node on a new chain input (its other arguments as traced)."""
    args, kwargs = list(node.args[1:]), dict(node.kwargs)
    if node.op == "call_method":
        return lambda x: getattr(x, node.target)(*args, **kwargs)
    if "input" in kwargs:  # F.relu(input=x)
        return lambda x: node.target(*node.args, **{**kwargs, "input": x})
    return lambda x: node.target(x, *args, **kwargs)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _traced_chain(root: nn.Module, what: str) -> list[Step]:
    """The chain of a module's forward, read with torch.fx; ConversionError naming any offender."""
    try:
        graph = _Tracer().trace(root)
    except Exception as exc:  # noqa: BLE001 - any trace failure means "not a plain chain"
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if isinstance(exc, torch.fx.proxy.TraceError):  # Python control flow: torch.export specialises it
            return _exported_chain(root, what, why)
        raise ConversionError(f"cannot convert {what}: torch.fx could not trace its forward ({why}). Only a "
                              f"chain of Linear layers and activations converts")
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ConversionError(f"cannot convert {what}: its forward takes {len(inputs)} inputs "
                              f"({', '.join(n.name for n in inputs)}); only single-input chains convert")
    steps: list[Step] = []
    flatten: tuple[torch.fx.Node, int] | None = None
    cur = inputs[0]
    for node in nodes:
        if node.op == "placeholder":
            continue
        where = f"{what}, {_node_name(node)}"
        if node.op == "output":
            if node.args[0] is not cur:
                raise ConversionError(f"cannot convert {what}: it returns {node.args[0]!r}, not the last value "
                                      f"of a single chain")
            break
        used = node.all_input_nodes
        if used != [cur]:
            raise ConversionError(f"cannot convert {where}: it uses {[n.name for n in used]} where a chain "
                                  f"uses only the previous step's output {cur.name!r} (branches, residual "
                                  f"connections, parameters used directly and second inputs do not convert)")
        if len(cur.users) != 1:
            raise ConversionError(f"cannot convert {what}: the value {cur.name!r} feeds "
                                  f"{[u.name for u in cur.users]} (a branch or residual connection), at {where}")
        if _is_flatten(node) is not None:
            if steps:
                raise ConversionError(f"cannot convert {where}: a reshape inside the chain (only a leading "
                                      f"x.view(-1, in_features) converts, read as db.Flatten())")
            flatten = (node, _is_flatten(node))
            # the MNIST flattening of tutorial MLPs: db.Flatten() (on (batch, ...) images it is that)
            steps.append(Step(Flatten(), None, _replay(node)))
        else:
            steps.append(_node_step(root, node, cur, where))
        cur = node
    first = next((s.spec for s in steps if isinstance(s.spec, Dense)), None)
    if flatten is not None and first is not None and first.in_features not in (None, flatten[1]):
        raise ConversionError(f"cannot convert {what}, {_node_name(flatten[0])}: it flattens the input to "
                              f"{flatten[1]} features but the first Linear takes in_features={first.in_features}")
    return steps


# ------------------------------------------------------------------ torch.export fallback
#: aten ops a forward calls directly (not through a module) that are an activation of the table.
_ATEN_ACTIVATIONS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "silu": "silu",
                     "mish": "mish", "hardsigmoid": "hard_sigmoid", "hardswish": "hard_silu", "exp": "exponential",
                     "selu": "selu", "softsign": "softsign"}
_ATEN_SHAPES = {"view", "reshape", "flatten", "_unsafe_view"}
_ATEN_NOOPS = {"clone", "contiguous", "alias", "detach", "dropout"}


def _example_input(root: nn.Module, what: str) -> torch.Tensor:
    """The input given with ``db.to_spec(model, example=x)``, else a (2, in_features) zero input from
    the first Linear in definition order (batch 2: no specialisation on a batch of one)."""
    given = getattr(root, "_dense_bridge_example", None)  # dense_bridge.models.EXAMPLE_ATTR
    if given is not None:
        first_param = next(root.parameters(), None)
        dtype = first_param.dtype if first_param is not None else torch.float32
        return from_numpy(np.ascontiguousarray(given)).to(dtype)
    first = next((m for m in root.modules() if isinstance(m, (nn.Linear, nn.Bilinear)) or declared(m) is not None),
                 None)
    if first is None or isinstance(first, nn.Bilinear) or isinstance(first, nn.LazyLinear):
        raise ConversionError(f"cannot convert {what}: torch.fx could not trace its forward and no Linear layer "
                              f"gives the width of an example input for torch.export")
    weight = first.weight if declared(first) is None else declared_tensors(first)[0]
    width = first.in_features if declared(first) is None else int(weight.shape[0 if not declared(first).transposed else 1])
    return torch.zeros(2, width, dtype=weight.dtype, device=weight.device)


def _aten_name(node) -> str:
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _exported_chain(root: nn.Module, what: str, fx_error: str) -> list[Step]:
    """The chain of a forward that branches on static properties (``x.ndim``, shapes), read with
    ``torch.export`` on an example input: export specialises the branch that input takes, and a
    warning says which input that was. Linear layers and activation modules are found through
    each node's ``nn_module_stack``; direct aten calls map to activations, Flatten or nothing."""
    import warnings

    example = _example_input(root, what)
    was_training = root.training
    root.eval()
    try:
        program = torch.export.export(root, (example,), strict=False)
    except Exception as exc:  # noqa: BLE001 - export failing too means the forward is not readable
        raise ConversionError(f"cannot convert {what}: torch.fx could not trace its forward ({fx_error}) and "
                              f"torch.export failed on an example input of shape {tuple(example.shape)} "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        root.train(was_training)
    graph = program.graph
    params = {n for n in graph.nodes if n.op == "placeholder" and n.name in
              {**program.graph_signature.inputs_to_parameters, **program.graph_signature.inputs_to_buffers}}
    inputs = [n for n in graph.nodes if n.op == "placeholder" and n not in params]
    if len(inputs) != 1:
        raise ConversionError(f"cannot convert {what}: its forward takes {len(inputs)} inputs; only single-input "
                              f"chains convert")
    steps: list[Step] = []
    cur, current_module = inputs[0], None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            if node.args[0] not in ((cur,), [cur], cur):
                raise ConversionError(f"cannot convert {what}: it does not return the last value of a single chain")
            break
        where = f"{what}, exported node {node.name!r} ({node.target})"
        used = [n for n in node.all_input_nodes if n not in params]
        if used != [cur] or len(cur.users) != 1:
            raise ConversionError(f"cannot convert {where}: not a single chain (a branch, residual connection or "
                                  f"second input)")
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        path = stack[-1][0] if stack else ""
        module = root.get_submodule(path) if path else root
        if module is not root and not is_container(module):
            if module is not current_module:  # a module's first op stands for the whole module
                spec = _leaf_spec(module, where)
                if spec is None:
                    raise ConversionError(f"cannot convert {where}: {describe(module)} is not a Linear layer, "
                                          f"Identity, Dropout or activation module")
                steps.append(Step(spec, module, module))
                current_module = module
            cur = node
            continue
        current_module = None
        name = _aten_name(node)
        args, kwargs = list(node.args[1:]), dict(node.kwargs)
        if name in _ATEN_NOOPS:
            if name == "dropout":
                warn_dropout(where, args[0] if args else None)
                steps.append(Step(Identity(), None, identity))
            cur = node
            continue
        if name in _ATEN_SHAPES:
            in_shape, out_shape = tuple(node.args[0].meta["val"].shape), tuple(node.meta["val"].shape)
            if in_shape == out_shape:
                cur = node
                continue
            if len(out_shape) == 2 and out_shape[0] == in_shape[0]:
                steps.append(Step(Flatten(), None, lambda x: torch.flatten(x, 1)))
                cur = node
                continue
            raise ConversionError(f"cannot convert {where}: a reshape {in_shape} -> {out_shape} that is not "
                                  f"db.Flatten()")
        if name in _ATEN_ACTIVATIONS:
            spec = Activation(_ATEN_ACTIVATIONS[name])
        elif name == "gelu":
            spec = Activation("gelu_tanh" if kwargs.get("approximate", "none") == "tanh" else "gelu")
        elif name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
            spec = _axis_activation(name.lstrip("_"), args[0] if args else kwargs.get("dim"), where)
        elif name == "leaky_relu":
            spec = Activation("leaky_relu", negative_slope=float(args[0]) if args else 0.01)
        elif name == "elu" and not args[1:] and not kwargs:
            spec = Activation("elu", alpha=float(args[0]) if args else 1.0)
        else:
            raise ConversionError(f"cannot convert {where}: not a Linear layer or a known activation")
        steps.append(Step(spec, None, activation_module(spec)))
        cur = node
    warnings.warn(f"{what}: torch.fx could not trace its forward ({fx_error}); read with torch.export on an example "
                  f"input of shape {tuple(example.shape)}, which specialises its control flow: the spec is the branch "
                  f"that input takes ({len(steps)} steps: {', '.join(type(s.spec).__name__ for s in steps)})",
                  UserWarning, stacklevel=4)
    return steps


def _axis_activation(name: str, dim, where: str) -> Activation:
    if dim not in (-1, 1):
        raise ConversionError(f"cannot convert {where}: {name} over dim={dim}; dense_bridge's acts on the last axis")
    return Activation(name, axis=-1) if name == "softmax" else Activation(name)


def _node_step(root: nn.Module, node: torch.fx.Node, cur, where: str) -> Step:
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        spec = _leaf_spec(module, where)
        if spec is None or isinstance(spec, Bilinear):
            raise ConversionError(f"cannot convert {where}: {describe(module)} is not a Linear layer, "
                                  f"Identity, Dropout or activation module")
        if node.args[0] is not cur or len(node.args) != 1 or node.kwargs:
            raise ConversionError(f"cannot convert {where}: called with extra arguments")
        return Step(spec, module, module)
    table = FUNCTIONS if node.op == "call_function" else METHODS if node.op == "call_method" else {}
    key = node.target
    try:
        entry = table.get(key)
    except TypeError:  # unhashable target
        entry = None
    if entry is None:
        raise ConversionError(f"cannot convert {where}: not a Linear layer or a known activation")
    name, names = entry
    bound = _bind(node, names, where)
    if bound.get("input") is not cur:
        raise ConversionError(f"cannot convert {where}: the chain value is not its input")
    spec = fn_spec(name, bound, where)
    # dropout runs as what the spec says it is (identity), even if traced in training mode
    return Step(spec, None, identity if isinstance(spec, Identity) else _replay(node))


def _memory_span(t: torch.Tensor) -> tuple | None:
    """(device, first byte, end byte) of the memory a tensor covers; None where it has none."""
    if t is None or isinstance(t, nn.parameter.UninitializedTensorMixin) or t.device.type == "meta" \
            or t.numel() == 0 or is_traceable_wrapper_subclass(t):  # torchao's tensors own no storage themselves
        return None
    start = t.data_ptr()
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return (str(t.device), start, start + extent * t.element_size())


def _check_untied(what: str, steps: list[Step]) -> None:
    """ConversionError when two positions share a parameter (tied weights) or its memory.

    ``lin2.weight = lin1.weight`` (or an ``nn.Parameter`` over the same storage) passes the
    same-module check, but set_params would keep only the last write and convert would untie
    them: dense_bridge layers own their parameters.
    """
    spans = []
    for i, step in enumerate(steps):
        if not has_params(step.module):
            continue
        m = step.module
        for name, t in list(m._parameters.items()) + list(m._buffers.items()):
            span = _memory_span(t)
            if span is not None:
                spans.append((span, i, name, t))
    spans.sort(key=lambda e: e[0])
    reach = None  # the entry reaching furthest so far: any overlap with an earlier one overlaps it
    for entry in spans:
        (device, start, end), i, name, t = entry
        if reach is not None and reach[0][0] == device and start < reach[0][2]:
            _, j, other, u = reach
            if j > i:  # name the earlier position first
                (i, name), (j, other) = (j, other), (i, name)
            how = "the same Parameter" if t is u else "tensors sharing memory"
            raise ConversionError(
                f"cannot convert {what}: the {other} of chain position {j} and the {name} of chain position {i} "
                f"are {how} (tied weights, e.g. lin2.weight = lin1.weight); dense_bridge layers own their "
                f"parameters: untie them (lin2.weight = nn.Parameter(lin1.weight.detach().clone()))")
        if reach is None or reach[0][0] != device or end > reach[0][2]:
            reach = entry


def chain(native: nn.Module) -> list[Step]:
    """Positions of a container (nn.Sequential or a traced nn.Module) as steps."""
    steps = _chain_steps(native)
    seen: dict[int, int] = {}
    for i, step in enumerate(steps):
        if has_params(step.module):
            if id(step.module) in seen:
                raise ConversionError(f"cannot convert {describe(native)}: the same {type(step.module).__name__} "
                                      f"is used at chain positions {seen[id(step.module)]} and {i} (shared "
                                      f"weights); dense_bridge layers own their parameters")
            seen[id(step.module)] = i
        if isinstance(step.spec, Identity) and step.module is not None and type(step.module) is not nn.Identity:
            step.run = identity  # Dropout: its eval-mode function, whatever the module's mode
    _check_untied(describe(native), steps)
    return steps


def _chain_steps(native: nn.Module) -> list[Step]:
    what = describe(native)
    if type(native) is nn.Sequential:
        children = list(native)
        if not any(is_container(c) for c in children):
            steps = []
            for i, child in enumerate(children):
                where = f"{what} position {i}"
                spec = _leaf_spec(child, where)
                if spec is None or isinstance(spec, Bilinear):
                    raise ConversionError(f"cannot convert {where}: {describe(child)} is not a Linear layer, "
                                          f"Identity, Dropout or activation module")
                steps.append(Step(spec, child, child))
            return steps
    return _traced_chain(native, what)


def _check_one_dtype(what: str, layers: list) -> None:
    """ConversionError naming the positions when a chain's layers mix dtypes.

    A Sequential spec has one dtype (the core rejects mixed ones); torch runs a mixed chain only
    with casts between layers that the spec cannot express, so say so before the core's error.
    """
    dtypes = {i: l.dtype for i, l in enumerate(layers) if isinstance(l, (Dense, Bilinear))}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"position {i}: {d}" for i, d in dtypes.items())
        raise ConversionError(f"cannot convert {what}: its layers mix dtypes ({listed}); a Sequential has one "
                              f"dtype: cast the model to one first (e.g. model.to(torch.float32))")


def to_spec(native: nn.Module):
    """The spec of a torch module: a layer, an nn.Sequential, or an nn.Module chain (see module doc)."""
    what = describe(native)
    quantized = quant_layer(native)
    if quantized is not None:  # the float Dense a torchao-quantized Linear stands for
        return quantized.spec()
    if not is_container(native):
        spec = _leaf_spec(native, what)
        if spec is None:
            raise ConversionError(f"cannot convert {what}: not a Linear, Bilinear, Identity, Dropout, activation "
                                  f"or container module. {received('native', native)}")
        return spec
    steps = chain(native)
    meta = _remembered(native, Sequential)
    layers = [s.spec for s in steps]
    _check_one_dtype(what, layers)
    try:
        try:
            return Sequential(layers, in_features=meta.get("in_features"), name=meta.get("name"))
        except SpecError:
            if not meta:
                raise
            return Sequential(layers)  # the module changed since compile: read it as it is now
    except (SpecError, TypeError) as exc:
        raise ConversionError(f"cannot convert {what}: its layers do not form a valid Sequential: {exc}") from None
