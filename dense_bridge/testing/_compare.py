"""compare(a, b): run two native models on identical data and compare every layer.

Both models get the same inputs and the same upstream gradient ``grad_out`` (standard normal
from ``seed`` unless given), rounded once to values that both models' dtypes represent
exactly, so neither side starts from a different number. Each adapter's ``trace`` runs its
framework's own forward and autograd backward for L = sum(y * grad_out); per layer we compare
the output, dL/dx (one per input), dL/dkernel and dL/dbias in float64 on the host.

Tolerance. The allowed error of each value is the docs/FACTS.md formula (``_tolerance``)

    C * (eps_dtype * (|b| + rms(b)) + eps_f32 * sqrt(K) * rms(b))

for its own rounding, with b (the second model) as the reference, eps_dtype the coarser of
the two models' dtypes, C = 4 for outputs and 10 for gradients, and K the fan-in of the
reduction that produced it: in_features for a Dense output, in1*in2 for a Bilinear output,
units for dL/dx (in2*units, in1*units for Bilinear), the number of batch rows for dL/dkernel and
dL/dbias, the axis length for softmax/log_softmax, 1 for elementwise activations. Inside a
model each value also inherits the differences of what it was computed from; those are carried
along by first-order propagation on the reference (``_propagate``): through a Dense in
quadrature over its weights, through an activation by the secant of f (and f' for gradients),
which also accounts for the magnified relative error in the tails of gelu/silu/softmax and for
a rounded value landing on the other side of a kink (relu' is 0 or 1). A lone layer fed exact
inputs gets exactly the docs/FACTS.md formula. Where a value's allowance is 0 (an all-zero
reference), any difference fails.

Empirical check (tests/testing/test_compare.py): every framework pair in float32/float16/bfloat16 over
random specs and seeds passes with margin, and every wrong port there (a transposed kernel, a
missing bias, another activation, a perturbed weight) fails at its layer.

``first_divergence`` is the first failing quantity in the order the computation produces them:
the forward outputs in layer order, then the backward in reverse layer order (for each layer:
dL/dkernel, dL/dbias, dL/dx). A wrong weight in layer 2 also spoils the gradients of layers 0
and 1 (backward flows through it), so "the first layer with any failure" would blame layer 0;
execution order names the layer where the difference starts.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._dtypes import numpy_dtype
from .._errors import ConversionError, SpecError, check_flag, received
from ..params._source import array_to_numpy
from ..registry._backends import backend_of
from ..parallel._dispatch import verbs_for
from ._gradients import computes_gradients, effective_grads
from ..activations import Activation
from ..registry._trace import LayerTrace, Trace
from ..specs import Bilinear, Dense, Identity, Sequential
from ._report import LayerResult, ModelInfo, QuantityResult, Report, first_failure
from ._rounding import coarsest, round_common
from ._degenerate import refuse_nonfinite_inputs, refuse_nonfinite_outputs
from ._elements import coarser_dtype, element_stats, elementwise_units
from ._isolated import LAYER_NOTE, Traced, forced_layer_traces
from ._structure import params_structure
from ._propagate import allowances
from ._tolerance import Tolerance

__all__ = ["compare", "assert_equivalent", "spec_differences", "function_differences"]

_DEFAULT_BATCH = 8


# ---------------------------------------------------------------------------- spec helpers
def layers_of(spec) -> list:
    return list(spec.layers) if isinstance(spec, Sequential) else [spec]


def _kind(spec) -> str:
    return type(spec).__name__


def _layer_dtype(layer) -> str | None:
    return getattr(layer, "dtype", None) if isinstance(layer, (Dense, Bilinear)) else None


def model_dtype(spec) -> str:
    """The dtype the model's input is cast to: its first layer with parameters (float32 if none)."""
    return next((d for d in map(_layer_dtype, layers_of(spec)) if d), "float32")


def output_dtype(spec) -> str:
    """The dtype of the model's output: its last layer with parameters (float32 if none)."""
    return next((d for d in map(_layer_dtype, reversed(layers_of(spec))) if d), "float32")


def _label(layer) -> str:
    if isinstance(layer, Dense):
        extra = "" if layer.activation.is_identity else f"+{layer.activation.name}"
        return f"Dense{extra}" + ("[mask]" if layer.mask is not None else "")
    if isinstance(layer, Activation):
        return f"Act({layer.name})"
    return type(layer).__name__


def _input_widths(spec) -> list[int] | None:
    """Input widths of the model (two for Bilinear); None when lazy or not fixed by the spec."""
    if isinstance(spec, Bilinear):
        return [spec.in1_features, spec.in2_features]
    width = spec.in_features if isinstance(spec, (Dense, Sequential)) else None
    return None if width is None else [width]


# ---------------------------------------------------------------------------- spec diff
def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _activation_diff(where: str, a: Activation, b: Activation) -> list[str]:
    if a.name != b.name:
        return [f"{where}: {a.name} vs {b.name}"]
    return [f"{where}.{k}: {_fmt(a.params[k])} vs {_fmt(b.params[k])}"
            for k in a.params if a.params[k] != b.params[k]]


def _mask_diff(where: str, a, b) -> list[str]:
    if a is None and b is None:
        return []
    if a is None or b is None:
        m = a if a is not None else b
        present = f"present ({m.num_connections} of {m.adjacency.size} connections)"
        return [f"{where}: {present} vs absent" if a is not None else f"{where}: absent vs {present}"]
    if a.shape != b.shape:
        return [f"{where}: shape {a.shape} vs {b.shape}"]
    n = int(np.count_nonzero(a.adjacency != b.adjacency))
    return [f"{where}: differs in {n} of {a.adjacency.size} entries"] if n else []


def _layer_diff(p: str, a, b) -> list[str]:
    if type(a) is not type(b):
        return [f"{p} type: {_label(a)} vs {_label(b)}"]
    if isinstance(a, Activation):
        return _activation_diff(f"{p} activation", a, b)
    out = []
    if isinstance(a, Dense):
        fields = ("units", "in_features", "use_bias", "dtype")
    elif isinstance(a, Bilinear):
        fields = ("in1_features", "in2_features", "units", "use_bias", "dtype")
    else:
        fields = ()
    for f in fields:
        va, vb = getattr(a, f), getattr(b, f)
        if f == "in_features" and (va is None or vb is None):
            continue  # a lazy layer takes its width from the input: not a difference in function
        if va != vb:
            out.append(f"{p} {f}: {_fmt(va)} vs {_fmt(vb)}")
    if isinstance(a, Dense):
        out += _activation_diff(f"{p} activation", a.activation, b.activation)
        out += _mask_diff(f"{p} mask", a.mask, b.mask)
    return out


def spec_differences(spec_a, spec_b) -> list[str]:
    """Readable field-by-field differences between two specs (initializers and names ignored:
    they do not change what the layers compute)."""
    out = []
    if type(spec_a) is not type(spec_b):
        out.append(f"model: {_kind(spec_a)} vs {_kind(spec_b)}")
    la, lb = layers_of(spec_a), layers_of(spec_b)
    if len(la) != len(lb):
        out.append(f"number of layers: {len(la)} vs {len(lb)}")
    for i, (x, y) in enumerate(zip(la, lb)):
        out += _layer_diff(f"layer {i}", x, y)
    return out


def _function_form(spec) -> list[tuple[int, Any]]:
    """(position, layer) of what a model computes: Identity and linear layers dropped, an
    Activation layer fused into the Dense before it when that Dense has none, an all-ones mask
    dropped; so Dense(relu) and Dense + Activation("relu") have the same form."""
    out: list[tuple[int, Any]] = []
    for i, layer in enumerate(layers_of(spec)):
        if isinstance(layer, Identity) or (isinstance(layer, Activation) and layer.is_identity):
            continue
        if isinstance(layer, Activation) and out and isinstance(out[-1][1], Dense) \
                and out[-1][1].activation.is_identity:
            out[-1] = (out[-1][0], out[-1][1].replace(activation=layer))
            continue
        if isinstance(layer, Dense) and layer.mask is not None and bool(np.all(layer.mask.adjacency)):
            layer = layer.replace(mask=None)
        out.append((i, layer))
    return out


def function_differences(spec_a, spec_b) -> list[str]:
    """The spec differences that change the function or its precision (what ``strict=True``
    fails on): dtype, activation and its parameters, mask, use_bias, widths, layers. Structure
    alone (Sequential vs lone layer, Identity layers, an activation fused or as its own layer)
    and initializers or names are not differences. Positions are a's (b's where they differ)."""
    fa, fb = _function_form(spec_a), _function_form(spec_b)
    out = []
    for (i, x), (j, y) in zip(fa, fb):
        out += _layer_diff(f"layer {i}" if i == j else f"layer {i} (b: layer {j})", x, y)
    for side, other, extra in (("a", "b", fa[len(fb):]), ("b", "a", fb[len(fa):])):
        out += [f"{side} layer {i} ({_label(layer)}): no counterpart in {other}" for i, layer in extra]
    return out


# ---------------------------------------------------------------------------- inputs


def _as_array(value, argument: str) -> np.ndarray:
    arr = array_to_numpy(value)
    if arr is None or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
                           or arr.dtype.name == "bfloat16"):
        kind = "" if arr is None else f" (got dtype {arr.dtype})"
        raise TypeError(f"{argument} must be a real numeric array{kind}. {received(argument, value)}")
    return arr.astype(np.float64)


def _given_inputs(inputs, n_inputs: int) -> tuple[list[np.ndarray], list[tuple[int, ...]]]:
    """The user's inputs as float64 arrays (one, or a pair (x1, x2) for a Bilinear) and their
    shapes as given, in any form ``_inputs`` reads (an array of any framework, a list holding it,
    a dict, a list holding one dict). A 1-D input is one sample (Keras' Dense rejects 1-D,
    min_ndim=2; torch, numpy and MLX accept it), so every backend gets it as (1, in_features)."""
    from ..models._inputs import layer_inputs

    arrays = [x.astype(np.float64) for x in layer_inputs(inputs, n_inputs)]
    names = ["inputs"] if n_inputs == 1 else ["inputs[0]", "inputs[1]"]
    for name, x in zip(names, arrays):
        if x.ndim < 1 or x.shape[-1] == 0 or x.size == 0:
            raise SpecError(f"{name} must have shape (*, in_features) with at least one row and one feature. "
                            f"Received: {name} of shape {x.shape}")
    shapes = [x.shape for x in arrays]
    arrays = [x[np.newaxis] if x.ndim == 1 else x for x in arrays]
    if n_inputs == 2 and arrays[0].shape[:-1] != arrays[1].shape[:-1]:
        raise SpecError(f"inputs x1 and x2 must have the same batch shape. Received: inputs of shapes "
                        f"{arrays[0].shape} and {arrays[1].shape}")
    return arrays, shapes


def _want(widths) -> str:
    return " and ".join(f"(*, {w})" for w in widths)


def check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {type(value).__name__}. "
                        f"{received(name, value)}")
    if value < minimum:
        raise SpecError(f"{name} must be an integer >= {minimum}. {received(name, value)}")
    return int(value)




def output_width(spec, widths: list[int]) -> int:
    if isinstance(spec, (Dense, Bilinear, Sequential)):
        return spec.output_features(widths[0]) if not isinstance(spec, Bilinear) else spec.units
    return widths[0]


# ---------------------------------------------------------------------------- comparing
_PARAM_ORDER = ("kernel", "bias")


def compare_layer(i: int | None, label: str, ta, tb, allowed: dict, grads: bool,
                   dx_names: list[str]) -> LayerResult:
    rows = [_quantity(i, label, "output", ta.output, tb.output, allowed.get("output"))]
    if grads:
        names = sorted(set(ta.param_grads) | set(tb.param_grads),
                       key=lambda k: (_PARAM_ORDER.index(k) if k in _PARAM_ORDER else 9, k))
        for k in names:
            rows.append(_quantity(i, label, f"dL/d{k}", ta.param_grads.get(k), tb.param_grads.get(k),
                                  allowed.get(f"dL/d{k}")))
        for n, ga, gb in zip(dx_names, ta.input_grads, tb.input_grads):
            rows.append(_quantity(i, label, n, ga, gb, allowed.get(n)))
    return LayerResult(i, label, tuple(rows))


def _quantity(i, label, name, a, b, allowed) -> QuantityResult:
    """One row; ``allowed`` = (elementwise allowance, K) from the propagation on b (or None)."""
    k = 0 if allowed is None else allowed[1]
    if a is None or b is None:
        side = "a" if a is None else "b"
        shape = tuple(np.shape(b if a is None else a))
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, shape, f"absent in {side}")
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return QuantityResult(i, label, name, math.inf, math.inf, False, k, tuple(a.shape),
                              f"shape {a.shape} vs {b.shape}")
    diff, elementwise = elementwise_units(a, b, allowed[0])
    err = float(diff.max()) if diff.size else 0.0
    units = float(elementwise.max()) if diff.size else 0.0
    stats = element_stats(a, b, elementwise, coarser_dtype(a.dtype, b.dtype))
    note = ""
    if not math.isfinite(units):
        bad_a = int((~np.isfinite(a.astype(np.float64))).sum())
        bad_b = int((~np.isfinite(b.astype(np.float64))).sum())
        if bad_a != bad_b:
            note = f"non-finite values: {bad_a} in a, {bad_b} in b"
    return QuantityResult(i, label, name, err, units, units <= 1.0, k, tuple(a.shape), note, stats)


def dx_names(spec_layer) -> list[str]:
    return ["dL/dx1", "dL/dx2"] if isinstance(spec_layer, Bilinear) else ["dL/dx"]


def feed(spec_a, spec_b, inputs, grad_out, seed: int, batch_size: int, notes: list[str]):
    """(inputs, grad_out) as float64 arrays both models' dtypes hold exactly, or why there are none.

    Inputs that fit neither model, or fit no model where one width would feed both, are the
    caller's error (SpecError); models that no single input can feed are a failed report.
    """
    pair_a, pair_b = isinstance(spec_a, Bilinear), isinstance(spec_b, Bilinear)
    if pair_a != pair_b:
        return "one model is a Bilinear (two inputs), the other is not"
    widths_a, widths_b = _input_widths(spec_a), _input_widths(spec_b)
    rng = np.random.default_rng(seed)
    if inputs is not None:
        xs, shapes = _given_inputs(inputs, 2 if pair_a else 1)
        given = [x.shape[-1] for x in xs]
        batched = any(len(shape) == 1 for shape in shapes)
        if batched:
            notes.append(f"1-D inputs are one sample: a batch axis was added for both models, "
                         f"compared as {', '.join(str(x.shape) for x in xs)}")
        fits = [w is None or w == given for w in (widths_a, widths_b)]
        feedable = widths_a is None or widths_b is None or widths_a == widths_b  # some input fits both
        if not all(fits) and (feedable or not any(fits)):
            want = _want(widths_a or widths_b) if feedable else f"{_want(widths_a)} (a) or {_want(widths_b)} (b)"
            raise SpecError(f"inputs do not fit the models: they take {want}, the last axis being in_features. "
                            f"Received: inputs of shape {', '.join(map(str, shapes))}")
        if not all(fits):
            return f"inputs have width(s) {given} but a takes {widths_a} and b {widths_b}"
    else:
        if widths_a is None and widths_b is None:
            raise SpecError("compare: neither model has a fixed input width (lazy, or a lone activation); "
                            "pass inputs=... (an array of shape (batch, in_features))")
        if widths_a is not None and widths_b is not None and widths_a != widths_b:
            return f"a takes input width(s) {widths_a}, b takes {widths_b}"
        batched = False
        xs = [rng.standard_normal((batch_size, w)) for w in (widths_a or widths_b)]
    xs = [round_common(x, [model_dtype(spec_a), model_dtype(spec_b)]) for x in xs]
    widths = [x.shape[-1] for x in xs]
    out_a, out_b = output_width(spec_a, widths), output_width(spec_b, widths)
    if out_a != out_b:
        return f"a produces {out_a} output features, b {out_b}"
    out_shape = xs[0].shape[:-1] + (out_a,)
    if grad_out is None:
        g = rng.standard_normal(out_shape)
    else:
        g = _as_array(grad_out, "grad_out")
        if batched and g.shape == out_shape[1:]:
            g = g[np.newaxis]  # the 1-D sample's gradient, batched like its input
        if g.shape != out_shape:
            raise SpecError(f"grad_out must have the output's shape {out_shape}. "
                            f"Received: grad_out of shape {g.shape}")
    return xs, round_common(g, [output_dtype(spec_a), output_dtype(spec_b)])


def feed_report(report: Report, spec_a, spec_b, inputs, grad_out, seed: int, batch_size: int):
    """:func:`feed` for ``report``: (inputs, grad_out) with their shapes recorded, or None with
    the report marked not compared and the reason in its notes."""
    fed = feed(spec_a, spec_b, inputs, grad_out, seed, batch_size, report.notes)
    if isinstance(fed, str):
        report.compared = False
        report.notes.append(f"numeric comparison skipped: {fed}")
        return None
    report.input_shapes = [tuple(x.shape) for x in fed[0]]
    return fed


def _identity_trace(xs: list[np.ndarray], g: np.ndarray) -> Trace:
    """What an empty Sequential computes: its output is its input, dL/dx is grad_out."""
    return Trace([LayerTrace(xs[0].copy(), (g.copy(),), {})])


def check_tolerance(tolerance) -> Tolerance:
    if tolerance is None:
        return Tolerance()
    if not isinstance(tolerance, Tolerance):
        raise TypeError(f"tolerance must be a dense_bridge.testing.Tolerance or None, got "
                        f"{type(tolerance).__name__}. {received('tolerance', tolerance)}")
    return tolerance


def new_report(spec_a, spec_b, backend_a: str, backend_b: str, tolerance: Tolerance, seed: int,
               given_inputs: bool, strict: bool) -> Report:
    """An empty Report for models of ``spec_a`` and ``spec_b``: their dtypes (the coarser one is
    the comparison's), and how the specs differ (structurally and in function)."""
    dt_a = coarsest([d for d in map(_layer_dtype, layers_of(spec_a)) if d] or ["float32"])
    dt_b = coarsest([d for d in map(_layer_dtype, layers_of(spec_b)) if d] or ["float32"])
    return Report(ModelInfo(backend_a, _kind(spec_a), dt_a), ModelInfo(backend_b, _kind(spec_b), dt_b),
                  coarsest([dt_a, dt_b]), tolerance, [], seed, given_inputs,
                  spec_differences=spec_differences(spec_a, spec_b), strict=strict,
                  strict_differences=function_differences(spec_a, spec_b))


def layer_label(la: list, lb: list, i: int) -> str:
    """Layer ``i``'s name in the report: its kind, or "a's|b's" where the two differ."""
    if i < len(la) and _label(la[i]) == _label(lb[i]):
        return _label(la[i])
    return f"{_label(la[i]) if i < len(la) else '?'}|{_label(lb[i])}"


def compare(a, b, *, inputs=None, grads: bool = True, seed: int = 0, tolerance: Tolerance | None = None,
            batch_size: int = _DEFAULT_BATCH, grad_out=None, strict: bool = False, isolated: bool = False) -> Report:
    """Run native models ``a`` and ``b`` (any backends, the same one too) on identical data and
    compare every layer's output, dL/dx, dL/dkernel and dL/dbias (``b`` is the reference).

    ``inputs``: an array (*, in_features) of any framework (numpy, torch, jax, mx; or a nested
    Python list), alone, in a list or in a dict of one entry (a list holding one dict too), or
    ``(x1, x2)`` for a Bilinear (``_inputs``); an input without rows is a SpecError. A 1-D array
    is one sample and gets a batch axis (1, in_features) for both models (noted in the report).
    Default: standard normal of shape (batch_size, in_features) from ``seed``. ``grad_out``
    (dL/dy of the final output) defaults to standard normal from ``seed`` too. Both are rounded
    once to values that both models' dtypes hold exactly. ``grads=False`` compares outputs only.
    ``tolerance``: a :class:`Tolerance` overriding C (outputs 4, gradients 10) or adding atol.

    Passing. By default (``strict=False``) the verdict is numeric only: a float16 or bfloat16
    port of a float32 model passes when its numbers agree at the coarser dtype's tolerance, and
    ``report.spec_differences`` merely lists how the specs differ. ``strict=True`` also fails
    when the specs differ in anything that changes the function or its precision (dtype,
    activation or its parameters, mask, use_bias, widths, layers: ``report.strict_differences``,
    see :func:`function_differences`); structure alone (an activation fused into its Dense or
    as its own layer, Identity layers), initializers and names never count.

    An empty Sequential is the identity: its output is its input, compared as one Identity
    layer (noted); two empty models with no input width pass with nothing to compare.
    ``isolated=True`` (teacher forcing): every layer of b runs alone on the input a's layer
    received and backward from the gradient a's layer received, so each row holds that layer's
    own error with nothing carried from before it (see ``_isolated``).

    Returns a :class:`Report`. Wrong argument types raise TypeError, bad values SpecError.
    """
    tolerance = check_tolerance(tolerance)
    grads, strict = check_flag("grads", grads), check_flag("strict", strict)
    isolated = check_flag("isolated", isolated)
    seed, batch_size = check_count("seed", seed, 0), check_count("batch_size", batch_size, 1)
    adapter_a, adapter_b = verbs_for(a, "a"), verbs_for(b, "b")  # a parallel model's trace is gathered whole
    spec_a, spec_b = adapter_a.to_spec(a), adapter_b.to_spec(b)
    la, lb = layers_of(spec_a), layers_of(spec_b)
    report = new_report(spec_a, spec_b, backend_of(a, "a"), backend_of(b, "b"), tolerance, seed,
                        inputs is not None, strict)
    dtype = report.dtype
    grads, grads_note = effective_grads({"a": report.a.backend, "b": report.b.backend}, grads)
    able = computes_gradients({"a": report.a.backend, "b": report.b.backend})

    empty = [side for side, layers in (("a", la), ("b", lb)) if not layers]
    if len(empty) == 2 and inputs is None and _input_widths(spec_a) is None and _input_widths(spec_b) is None:
        report.notes.append("both models are empty Sequentials (the identity) with no input width: "
                            "nothing to compare (pass inputs=... to compare their outputs)")
        return report
    for side in empty:
        report.notes.append(f"{side} is an empty Sequential: its output is its input (compared as one "
                            f"Identity layer)")

    fed = feed_report(report, spec_a, spec_b, inputs, grad_out, seed, batch_size)
    if fed is None:
        return report
    xs, g = fed
    refuse_nonfinite_inputs(zip(["inputs"] if len(xs) == 1 else ["inputs[0]", "inputs[1]"], xs))
    in_a, in_b = model_dtype(spec_a), model_dtype(spec_b)
    out_a, out_b = output_dtype(spec_a), output_dtype(spec_b)
    # an empty native Sequential is not traced (frameworks differ on what it does); it is x -> x
    trace_a = _identity_trace(xs, g) if not la else \
        adapter_a.trace(a, [x.astype(numpy_dtype(in_a)) for x in xs], g.astype(numpy_dtype(out_a)) if able["a"] else None)
    trace_b = _identity_trace(xs, g) if not lb else \
        adapter_b.trace(b, [x.astype(numpy_dtype(in_b)) for x in xs], g.astype(numpy_dtype(out_b)) if able["b"] else None)
    la, lb = la or [Identity()], lb or [Identity()]
    refuse_nonfinite_outputs(trace_a.layers[-1].output, trace_b.layers[-1].output)

    if len(trace_b.layers) != len(lb):
        raise ConversionError(f"b's adapter traced {len(trace_b.layers)} layers for a spec of {len(lb)}")
    params_b = adapter_b.get_params(b) if "b" not in empty else {}
    if not empty:
        report.structure = params_structure(adapter_a.get_params(a), params_b)
    allowed = allowances(lb, trace_b, params_b, "{}." if isinstance(spec_b, Sequential) else "", xs, g,
                         dtype, tolerance, grads=grads)
    traced_b = trace_b.layers
    if isolated:
        forced = "the layers of a and b do not line up" if len(trace_a.layers) != len(lb) or empty else \
            forced_layer_traces(Traced(backend_of(b, "b"), lb, params_b, trace_a, trace_b, xs, g, in_b, dtype,
                                       tolerance, grads))
        if isinstance(forced, str):
            report.notes.append(f"isolated: not applied ({forced}); compared as cascaded")
        else:
            traced_b, allowed = forced
            report.isolated = True
            report.notes.append(LAYER_NOTE)
    if len(trace_a.layers) == len(lb):
        for i, (ta, tb) in enumerate(zip(trace_a.layers, traced_b)):
            report.layers.append(compare_layer(i, layer_label(la, lb, i), ta, tb, allowed[i], grads,
                                               dx_names(lb[i])))
    else:
        # Layers do not line up (say Dense(relu) vs Dense + Activation): compare end to end only.
        report.notes.append(f"the layers do not line up ({len(trace_a.layers)} vs {len(trace_b.layers)}): "
                            "compared the model output and dL/dinput only")
        ta, tb = trace_a.layers[-1], trace_b.layers[-1]
        rows = [_quantity(None, "model", "output", ta.output, tb.output, allowed[-1]["output"])]
        if grads:
            for n, ga, gb in zip(dx_names(lb[0]), trace_a.layers[0].input_grads, trace_b.layers[0].input_grads):
                rows.append(_quantity(None, "model", n, ga, gb, allowed[0][n]))
        report.layers.append(LayerResult(None, "model", tuple(rows)))
    if grads_note:
        report.notes.append(grads_note)
    report.first_failure = first_failure(report.layers)
    return report


def assert_equivalent(a, b, **kwargs) -> Report:
    """compare(a, b, **kwargs); raise AssertionError with the report as message unless it passes.

    Numeric only by default; ``strict=True`` also fails on spec differences that change the
    function or its precision (see :func:`compare`).
    """
    report = compare(a, b, **kwargs)
    if not report.passed:
        raise AssertionError(str(report))
    return report
