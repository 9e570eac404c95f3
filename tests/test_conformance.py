"""One conformance suite, run against every backend (numpy, torch, keras, mlx, flax, equinox, onnx).

Each compiled layer is checked against the numpy reference computed in float64 from the very
same (dtype-rounded) parameters and inputs, within the FACTS.md tolerance:
C = 4 for outputs, 10 for gradients, K = the fan-in of the reduction behind each quantity.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge._dtypes import numpy_dtype
from dense_bridge.activations import NAMES
from dense_bridge.testing import error_units

from conftest import ALL_BACKENDS, require_backend, require_lazy

DTYPES = ("float32", "float64", "float16", "bfloat16")


@pytest.fixture(params=ALL_BACKENDS + ("onnx",))
def backend(request) -> str:
    """Every backend, the forward-only ones (onnx: onnxruntime has no autograd) included: their
    outputs are checked like every other backend's, their traces say they hold no gradients."""
    require_backend(request.param)
    return request.param


def compile_or_skip(spec, backend, **kw):
    try:
        return db.compile(spec, backend, **kw)
    except db.SpecError as exc:
        if "dtype" in str(exc):
            pytest.skip(f"{backend} does not support {getattr(spec, 'dtype', '?')}: {exc}")
        raise


def reference_trace(spec, params, inputs, grad_out):
    """The numpy reference in float64 from the same parameter values."""
    spec64 = _as_float64(spec)
    params64 = {k: np.asarray(v).astype(np.float64) for k, v in params.items()}
    ref = db.compile(spec64, "numpy", params=params64)
    adapter = require_backend("numpy")
    return adapter.trace(ref, [np.asarray(x).astype(np.float64) for x in inputs],
                         np.asarray(grad_out).astype(np.float64))


def _as_float64(spec):
    if isinstance(spec, db.Sequential):
        return db.Sequential([_as_float64(l) for l in spec.layers], in_features=spec.in_features)
    if isinstance(spec, (db.Dense, db.Bilinear)):
        return spec.replace(dtype="float64")
    return spec


def inputs_for(spec, dtype, shape_prefix=(6,), seed=0):
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    if isinstance(spec, db.Bilinear):
        return [rng.normal(size=shape_prefix + (spec.in1_features,)).astype(dt),
                rng.normal(size=shape_prefix + (spec.in2_features,)).astype(dt)]
    return [rng.normal(size=shape_prefix + (spec.in_features,)).astype(dt)]


def assert_trace_close(spec, backend_trace, ref_trace, dtype, batch):
    """Every layer's output, input grads and param grads within tolerance of the reference."""
    layers = spec.layers if isinstance(spec, db.Sequential) else [spec]
    fan = getattr(layers[0], "in_features", 1) or 1
    for i, (layer, got, ref) in enumerate(zip(layers, backend_trace.layers, ref_trace.layers)):
        if isinstance(layer, db.Dense):
            fan = layer.in_features
        elif isinstance(layer, db.Bilinear):
            fan = layer.in1_features * layer.in2_features
        out_units = getattr(layer, "units", fan)
        checks = [("output", got.output, ref.output, fan, 4.0)]
        if not backend_trace.gradients:  # a forward-only backend: nothing to compare, and it says so
            assert not got.input_grads and not got.param_grads, f"layer {i}: gradients from a forward-only trace"
            checks = checks[:1]
        else:
            checks += [(f"input_grad[{j}]", g, r, out_units, 10.0)
                       for j, (g, r) in enumerate(zip(got.input_grads, ref.input_grads))]
            checks += [(f"d{k}", got.param_grads.get(k), ref.param_grads[k], batch, 10.0) for k in ref.param_grads]
        for name, a, b, k, c in checks:
            assert a is not None, f"layer {i}: backend reported no {name}"
            assert np.shape(a) == np.shape(b), f"layer {i} {name}: shape {np.shape(a)} vs {np.shape(b)}"
            err, units = error_units(a, b, dtype, k, c)
            assert units <= 1.0, f"layer {i} {name}: max abs err {err:.3g} = {units:.2f} tolerance units"


def run_case(spec, backend, dtype, shape_prefix=(6,), seed=0):
    adapter = require_backend(backend)
    native = compile_or_skip(spec, backend, seed=seed)
    inputs = inputs_for(spec, dtype, shape_prefix, seed)
    trace = adapter.trace(native, inputs, _grad_out(spec, shape_prefix, dtype, seed))
    params = db.get_params(native)
    ref = reference_trace(_filled(spec, inputs), params, inputs, _grad_out(spec, shape_prefix, dtype, seed))
    batch = int(np.prod(shape_prefix))
    assert_trace_close(_filled(spec, inputs), trace, ref, dtype, batch)
    return native


def _filled(spec, inputs):
    if getattr(spec, "lazy", False):
        return spec.with_in_features(inputs[0].shape[-1])
    return spec


def _grad_out(spec, shape_prefix, dtype, seed):
    units = spec.output_features(spec.in_features) if not isinstance(spec, db.Activation) else None
    rng = np.random.default_rng(seed + 1)
    return rng.normal(size=shape_prefix + (units,)).astype(numpy_dtype(dtype))


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("activation", NAMES)
def test_every_activation_matches_reference(backend, activation):
    spec = db.Dense(7, in_features=12, activation=activation, bias_init="normal")
    run_case(spec, backend, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu", "softmax", "leaky_relu"])
def test_every_dtype_matches_reference(backend, dtype, activation):
    spec = db.Dense(8, in_features=16, activation=activation, dtype=dtype, bias_init="normal")
    run_case(spec, backend, dtype)


@pytest.mark.parametrize("shape_prefix", [(5,), (2, 3)])
def test_output_shapes_for_star_inputs(backend, shape_prefix):
    spec = db.Dense(4, in_features=6, activation="tanh")
    run_case(spec, backend, "float32", shape_prefix=shape_prefix)


def test_masked_no_bias_layer(backend):
    spec = db.Dense(6, in_features=10, use_bias=False, mask=db.wiring.banded(10, 6, 2), activation="elu")
    native = run_case(spec, backend, "float32")
    params = db.get_params(native)
    assert np.array_equal(np.asarray(params["mask"]) != 0, spec.mask.adjacency)
    assert (np.asarray(params["kernel"])[~spec.mask.adjacency] == 0).all()


def test_sequential_mlp(backend):
    spec = db.Sequential([db.Dense(16, in_features=12, activation="relu"), db.Dense(8, activation="gelu_tanh"),
                          db.Activation("leaky_relu", negative_slope=0.2), db.Identity(),
                          db.Dense(4, activation="log_softmax")])
    run_case(spec, backend, "float32")


def test_bilinear_non_square(backend):
    run_case(db.Bilinear(3, 5, 4), backend, "float32")


def test_same_seed_same_bits_on_every_backend():
    specs = [db.Dense(9, in_features=7, bias_init="torch_default"),
             db.Dense(9, in_features=7, dtype="bfloat16", bias_init="normal"),
             db.Sequential([db.Dense(5, in_features=4, mask=db.wiring.random(4, 5, 0.5, 0)), db.Dense(3)]),
             db.Bilinear(2, 3, 4)]
    for spec in specs:
        reference = db.get_params(db.compile(spec, "numpy", seed=11))
        for backend in db.available_backends():
            if backend == "onnx" and getattr(spec, "dtype", None) == "bfloat16":
                with pytest.raises(db.SpecError, match="bfloat16"):  # no bfloat16 MatMul in onnxruntime's CPU provider
                    db.compile(spec, backend, seed=11)
                continue
            params = db.get_params(compile_or_skip(spec, backend, seed=11))
            assert sorted(params) == sorted(reference), backend
            for k, v in reference.items():
                got = np.asarray(params[k])
                assert got.dtype == v.dtype, (backend, k, got.dtype)
                assert got.tobytes() == np.ascontiguousarray(v).tobytes(), (backend, k)


@pytest.mark.parametrize("spec", [
    db.Dense(5, in_features=3),
    db.Dense(5, in_features=3, activation=db.Activation("leaky_relu", negative_slope=0.2), use_bias=False),
    db.Dense(4, in_features=4, mask=db.wiring.block_diagonal(4, 4, 2), activation="softmax"),
    db.Dense(4, in_features=6, dtype="bfloat16", activation="gelu_tanh"),
    db.Sequential([db.Dense(8, in_features=4, activation="selu"), db.Activation("silu"), db.Identity(), db.Dense(2)]),
    db.Bilinear(2, 3, 4, use_bias=False),
], ids=["plain", "leaky-nobias", "masked-softmax", "bf16", "sequential", "bilinear"])
def test_to_spec_of_compiled_equals_spec(backend, spec):
    native = compile_or_skip(spec, backend, seed=0)
    assert db.to_spec(native) == spec
    # what the object itself shows (initializers are not recoverable from weights) also matches
    assert _without_inits(require_backend(backend).to_spec(native)) == _without_inits(spec)


def _without_inits(spec):
    if isinstance(spec, db.Sequential):
        return db.Sequential([_without_inits(l) for l in spec.layers], in_features=spec.in_features)
    if isinstance(spec, db.Dense):
        return spec.replace(kernel_init="zeros", bias_init="zeros", name=None)
    if isinstance(spec, db.Bilinear):
        return spec.replace(init="zeros", name=None)
    return spec


def test_lazy_dense_same_params_as_eager(backend):
    adapter = require_backend(backend)
    require_lazy(backend)
    eager = db.get_params(compile_or_skip(db.Dense(3, in_features=5), backend, seed=9))
    lazy = compile_or_skip(db.Dense(3), backend, seed=9)
    x = np.ones((2, 5), np.float32)
    adapter.trace(lazy, [x], np.ones((2, 3), np.float32))
    got = db.get_params(lazy)
    assert all(np.array_equal(np.asarray(got[k]), eager[k]) for k in eager)
