"""The adapter conformance suite, importable: run it against any backend, built-in or your own.

Subclass :class:`AdapterConformance` in a pytest test file and name the backend (registered
already, by ``dense_bridge.register_backend`` or an entry point); pytest collects every check::

    from dense_bridge.testing.conformance import AdapterConformance

    class TestMyBackend(AdapterConformance):
        backend = "mine"

Each compiled layer is checked against the numpy reference computed in float64 from the very
same (dtype-rounded) parameters and inputs, within the docs/FACTS.md tolerance: C = 4 for
outputs, 10 for gradients, K = the fan-in of the reduction behind each quantity. Gradients are
checked where the backend's manifest declares the ``gradients`` capability, outputs only
otherwise. Beyond the numbers: the contract's verbs, arrays across the boundary, get/set_params,
to_spec, walk, convert both ways with the reference, and a write-then-read of every file format
the manifest declares (through ``db.load`` and the CLI's conversion path). A check that does not
apply (a dtype the framework lacks, a lazy width an adapter refuses by design, no file formats,
no ``running`` capability: the numbers, walk and compare) is skipped with the reason. Needs
pytest (the suite is written for it, as fsspec's are).
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from .._dtypes import numpy_dtype
from ..activations import NAMES
from ._tolerance import error_units

__all__ = ["AdapterConformance", "DTYPES", "reference_trace", "assert_trace_close"]

DTYPES = ("float32", "float64", "float16", "bfloat16")


def _adapter(name: str):
    from ..registry._backends import get_adapter

    return get_adapter(name)


def _gradients(name: str) -> bool:
    from ..registry._manifest import GRADIENTS
    from ..registry._backends import has_capability

    return has_capability(name, GRADIENTS)


def _runs(name: str) -> bool:
    from ..registry._backends import offers

    return offers(name, "running")


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
    return _adapter("numpy").trace(ref, [np.asarray(x).astype(np.float64) for x in inputs],
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


def assert_trace_close(spec, backend_trace, ref_trace, dtype, batch, grads: bool = True):
    """Every layer's output (and, with ``grads``, input and parameter gradients) within
    tolerance of the reference."""
    layers = spec.layers if isinstance(spec, db.Sequential) else [spec]
    fan = getattr(layers[0], "in_features", 1) or 1
    assert len(backend_trace.layers) == len(ref_trace.layers), "one LayerTrace per layer of the spec"
    for i, (layer, got, ref) in enumerate(zip(layers, backend_trace.layers, ref_trace.layers)):
        if isinstance(layer, db.Dense):
            fan = layer.in_features
        elif isinstance(layer, db.Bilinear):
            fan = layer.in1_features * layer.in2_features
        out_units = getattr(layer, "units", fan)
        checks = [("output", got.output, ref.output, fan, 4.0)]
        if grads:
            assert len(got.input_grads) == len(ref.input_grads), f"layer {i}: one dL/dx per input"
            checks += [(f"input_grad[{j}]", g, r, out_units, 10.0)
                       for j, (g, r) in enumerate(zip(got.input_grads, ref.input_grads))]
            checks += [(f"d{k}", got.param_grads.get(k), ref.param_grads[k], batch, 10.0) for k in ref.param_grads]
        for name, a, b, k, c in checks:
            assert a is not None, f"layer {i}: backend reported no {name}"
            assert np.shape(a) == np.shape(b), f"layer {i} {name}: shape {np.shape(a)} vs {np.shape(b)}"
            err, units = error_units(a, b, dtype, k, c)
            assert units <= 1.0, f"layer {i} {name}: max abs err {err:.3g} = {units:.2f} tolerance units"


def _filled(spec, inputs):
    if getattr(spec, "lazy", False):
        return spec.with_in_features(inputs[0].shape[-1])
    return spec


def _grad_out(spec, shape_prefix, dtype, seed):
    units = spec.output_features(spec.in_features) if not isinstance(spec, db.Activation) else None
    rng = np.random.default_rng(seed + 1)
    return rng.normal(size=shape_prefix + (units,)).astype(numpy_dtype(dtype))


def _bits(params: dict) -> dict:
    return {k: (np.asarray(v).dtype.name, np.ascontiguousarray(np.asarray(v)).tobytes()) for k, v in params.items()}


#: The spec every file-format and conversion check writes.
FILE_SPEC = db.Sequential([db.Dense(4, in_features=3, activation="relu", bias_init="normal"), db.Dense(2)])


class AdapterConformance:
    """Every check of the suite, for the backend named by the subclass's ``backend``."""

    backend: str | None = None

    @pytest.fixture(autouse=True)
    def _available(self):
        if self.backend is None:
            pytest.skip("AdapterConformance: set backend = '<name>' in the subclass")
        if self.backend not in db.available_backends():
            pytest.skip(f"framework for backend {self.backend!r} is not installed")

    # ------------------------------------------------------------------ helpers
    @property
    def adapter(self):
        return _adapter(self.backend)

    def needs_running(self):
        if not _runs(self.backend):
            pytest.skip(f"{self.backend} does not offer the 'running' capability (trace, capture, walk, run_layer)")

    def run_case(self, spec, dtype, shape_prefix=(6,), seed=0):
        self.needs_running()
        native = compile_or_skip(spec, self.backend, seed=seed)
        inputs = inputs_for(spec, dtype, shape_prefix, seed)
        grads = _gradients(self.backend)
        g = _grad_out(spec, shape_prefix, dtype, seed)
        trace = self.adapter.trace(native, inputs, g if grads else None)
        params = db.get_params(native)
        ref = reference_trace(_filled(spec, inputs), params, inputs, g)
        assert_trace_close(_filled(spec, inputs), trace, ref, dtype, int(np.prod(shape_prefix)), grads)
        return native

    # ------------------------------------------------------------------ the contract
    def test_contract_verbs_and_manifest(self):
        from ..registry._contract import problems
        from ..registry._manifest import Manifest
        from ..registry._backends import manifest

        declared = manifest(self.backend)
        broken = problems(self.adapter, declared.capabilities, bool(declared.formats))
        assert not broken, f"the adapter breaks the contract: {broken}"
        assert isinstance(declared, Manifest)
        for fmt in declared.formats:
            assert fmt.label and (fmt.container or fmt.write_kind), fmt
            assert all(e == e.lower() and e.startswith(".") for e in fmt.extensions), fmt.extensions

    def test_arrays_round_trip(self):
        rng = np.random.default_rng(0)
        for dtype in DTYPES:
            a = rng.standard_normal((3, 4)).astype(numpy_dtype(dtype))
            try:
                native = self.adapter.from_numpy(a)
            except db.DenseBridgeError:
                continue  # a dtype the framework lacks (float64 in some modes): refused clearly
            back = self.adapter.to_numpy(native)
            assert back.dtype == a.dtype and back.tobytes() == a.tobytes(), dtype

    # ------------------------------------------------------------------ numbers against the reference
    @pytest.mark.parametrize("activation", NAMES)
    def test_every_activation_matches_reference(self, activation):
        self.run_case(db.Dense(7, in_features=12, activation=activation, bias_init="normal"), "float32")

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("activation", ["relu", "gelu", "softmax", "leaky_relu"])
    def test_every_dtype_matches_reference(self, dtype, activation):
        self.run_case(db.Dense(8, in_features=16, activation=activation, dtype=dtype, bias_init="normal"), dtype)

    @pytest.mark.parametrize("shape_prefix", [(5,), (2, 3)])
    def test_output_shapes_for_star_inputs(self, shape_prefix):
        self.run_case(db.Dense(4, in_features=6, activation="tanh"), "float32", shape_prefix=shape_prefix)

    def test_masked_no_bias_layer(self):
        spec = db.Dense(6, in_features=10, use_bias=False, mask=db.wiring.banded(10, 6, 2), activation="elu")
        native = self.run_case(spec, "float32")
        params = db.get_params(native)
        assert np.array_equal(np.asarray(params["mask"]) != 0, spec.mask.adjacency)
        assert (np.asarray(params["kernel"])[~spec.mask.adjacency] == 0).all()

    def test_sequential_mlp(self):
        spec = db.Sequential([db.Dense(16, in_features=12, activation="relu"), db.Dense(8, activation="gelu_tanh"),
                              db.Activation("leaky_relu", negative_slope=0.2), db.Identity(),
                              db.Dense(4, activation="log_softmax")])
        self.run_case(spec, "float32")

    def test_bilinear_non_square(self):
        self.run_case(db.Bilinear(3, 5, 4), "float32")

    def test_same_seed_same_bits_as_reference(self):
        for spec in (db.Dense(9, in_features=7, bias_init="torch_default"),
                     db.Sequential([db.Dense(5, in_features=4, mask=db.wiring.random(4, 5, 0.5, 0)), db.Dense(3)]),
                     db.Bilinear(2, 3, 4)):
            reference = db.get_params(db.compile(spec, "numpy", seed=11))
            assert _bits(db.get_params(compile_or_skip(spec, self.backend, seed=11))) == _bits(reference)

    # ------------------------------------------------------------------ reading the object back
    @pytest.mark.parametrize("spec", [
        db.Dense(5, in_features=3),
        db.Dense(5, in_features=3, activation=db.Activation("leaky_relu", negative_slope=0.2), use_bias=False),
        db.Dense(4, in_features=4, mask=db.wiring.block_diagonal(4, 4, 2), activation="softmax"),
        db.Dense(4, in_features=6, dtype="bfloat16", activation="gelu_tanh"),
        db.Sequential([db.Dense(8, in_features=4, activation="selu"), db.Activation("silu"), db.Identity(),
                       db.Dense(2)]),
        db.Bilinear(2, 3, 4, use_bias=False),
    ], ids=["plain", "leaky-nobias", "masked-softmax", "bf16", "sequential", "bilinear"])
    def test_to_spec_of_compiled_equals_spec(self, spec):
        native = compile_or_skip(spec, self.backend, seed=0)
        assert db.to_spec(native) == spec
        # what the object itself shows (initializers are not recoverable from weights) also matches
        assert _without_inits(self.adapter.to_spec(native)) == _without_inits(spec)

    def test_lazy_dense_same_params_as_eager(self):
        self.needs_running()
        eager = db.get_params(compile_or_skip(db.Dense(3, in_features=5), self.backend, seed=9))
        try:
            lazy = db.compile(db.Dense(3), self.backend, seed=9)
        except db.SpecError as exc:
            if "in_features" not in str(exc):
                raise
            pytest.skip(f"{self.backend} refuses lazy widths with a SpecError naming in_features (checked)")
        x = np.ones((2, 5), np.float32)
        self.adapter.trace(lazy, [x], np.ones((2, 3), np.float32) if _gradients(self.backend) else None)
        got = db.get_params(lazy)
        assert all(np.array_equal(np.asarray(got[k]), eager[k]) for k in eager)

    def test_get_set_params_round_trip_and_owner(self):
        native = db.compile(FILE_SPEC, self.backend, seed=0)
        assert db.backend(native) == self.backend
        other = {k: np.asarray(v) + 1 for k, v in db.get_params(db.compile(FILE_SPEC, "numpy", seed=1)).items()}
        db.set_params(native, other)
        assert _bits(db.get_params(native)) == _bits(other)

    def test_convert_to_and_from_the_reference(self):
        ref = db.compile(FILE_SPEC, "numpy", seed=3)
        native = db.convert(ref, to=self.backend)
        assert _bits(db.get_params(native)) == _bits(db.get_params(ref))
        back = db.convert(native, to="numpy")
        assert _bits(db.get_params(back)) == _bits(db.get_params(ref)) and db.to_spec(back) == FILE_SPEC
        if _runs(self.backend):
            report = db.testing.compare(native, ref, grads=_gradients(self.backend))
            assert report.passed, str(report)

    def test_walk_lists_the_linear_layers(self):
        self.needs_running()
        native = db.compile(FILE_SPEC, self.backend, seed=0)
        entries = [e for e in self.adapter.walk(native) if e.kind == "linear"]
        assert len(entries) == 2, entries

    # ------------------------------------------------------------------ files
    def test_every_declared_file_format_round_trips(self, tmp_path):
        from .. import checkpoints
        from ..checkpoints._native import write_native
        from ..registry._backends import manifest

        writable = [f for f in manifest(self.backend).formats if f.write_kind and f.extensions]
        if not writable:
            pytest.skip(f"{self.backend} declares no file format of its own")
        native = db.compile(FILE_SPEC, self.backend, seed=5)
        expected = _bits(db.get_params(native))
        canonical = tmp_path / "canonical.safetensors"
        db.save(native, canonical)
        for i, fmt in enumerate(writable):
            for how, path in (("write_native", tmp_path / f"w{i}{fmt.extensions[0]}"),
                              ("convert_file", tmp_path / f"c{i}{fmt.extensions[0]}")):
                if how == "write_native":
                    write_native(native, self.backend, str(path), spec=FILE_SPEC)
                else:
                    checkpoints.convert_file(str(canonical), self.backend, str(path))
                with checkpoints.open_checkpoint(path, spec=FILE_SPEC) as opened:
                    assert opened.framework == self.backend, (how, fmt.label, opened.kind)
                loaded = db.load(path, self.backend, spec=FILE_SPEC)
                assert _bits(db.get_params(loaded)) == expected, (how, fmt.label)
                spec, params = db.load(path, spec=FILE_SPEC)
                assert _bits(params) == expected and spec == FILE_SPEC, (how, fmt.label)


def _without_inits(spec):
    if isinstance(spec, db.Sequential):
        return db.Sequential([_without_inits(l) for l in spec.layers], in_features=spec.in_features)
    if isinstance(spec, db.Dense):
        return spec.replace(kernel_init="zeros", bias_init="zeros", name=None)
    if isinstance(spec, db.Bilinear):
        return spec.replace(init="zeros", name=None)
    return spec
