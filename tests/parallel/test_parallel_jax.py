"""Tensor-parallel Dense on JAX: Keras ``ModelParallel`` on Keras' JAX backend, over 4
virtual CPU devices in one process (JAX is single-controller).

Each test runs the ``__main__`` worker below in a subprocess with ``KERAS_BACKEND`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` set before JAX starts (the device count
is fixed at JAX's first use, and the test process may already have JAX on one device). The
worker checks every variable's shard shapes read off the live arrays (never the LayoutMap),
outputs and parameter gradients against the single-device model, and get/set_params; the test
asserts its JSON report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
DEVICES = 4


def _spec(dtype: str = "float32"):
    import dense_bridge as db

    mask = np.random.default_rng(3).random((16, 8)) < 0.6
    return db.Sequential([
        db.Dense(16, in_features=6, activation="relu", dtype=dtype),
        db.Dense(8, activation="tanh", mask=mask, dtype=dtype),
        db.Dense(12, dtype=dtype),
        db.Activation("gelu"),
        db.Dense(4, dtype=dtype),
    ])


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in b)


def _keras_compare(par, one, seed_other: int, spec) -> dict:
    """db.testing.compare of the parallel model against the single-device one (outputs and
    parameter gradients, layer by layer), and against other parameters (it must fail then)."""
    import dense_bridge as db
    from dense_bridge.backends.keras import _parallel as kp

    shapes = kp.shard_shapes(par)
    report = db.testing.compare(par, one, seed=1)
    other = db.testing.compare(par, db.compile(spec, "keras", seed=seed_other), seed=1)
    assert kp.shard_shapes(par) == shapes  # compare ran the sharded variables, and left them so
    return {"passed": report.passed, "dtype": str(report.dtype), "rows": len(report.rows),
            "worst_units": report.worst.units, "worst_abs": report.worst.max_abs_error,
            "other_params_fail": not other.passed, "text": str(report) if not report.passed else ""}


def _keras_bfloat16(tmp: Path) -> dict:
    """bfloat16 under ModelParallel: shard shapes, the dtype kept on every variable, compare at
    bfloat16 tolerance, and save -> load (whole, and onto 4 devices) bit-exact."""
    import dense_bridge as db
    from dense_bridge.parallel._sharded_dir import read_index
    from dense_bridge.backends.keras import _parallel as kp

    spec = _spec("bfloat16")
    par = db.compile(spec, "keras", seed=7, parallel="auto")
    one = db.compile(spec, "keras", seed=7)
    shapes = kp.shard_shapes(par)
    out = {"shard_shapes_ok": {k: set(v) for k, v in shapes.items()} == {k: {v} for k, v in _expected_shards(4).items()},
           "variable_dtypes": sorted({str(v.dtype) for v in par.variables}),
           "compare": _keras_compare(par, one, 8, spec)}
    want = db.get_params(db.compile(spec, "numpy", seed=7))
    out["get_params_bit_exact"] = _same(db.get_params(par), want)
    db.save(par, str(tmp / "bf_keras4"))
    _, whole = db.load(str(tmp / "bf_keras4"))
    again = db.load(str(tmp / "bf_keras4"), "keras", parallel="auto")
    out["checkpoint_bit_exact"] = _same(whole, want) and _same(db.get_params(again), want)
    out["index_dtypes"] = sorted({t["dtype"] for t in read_index(str(tmp / "bf_keras4"))["tensors"].values()})
    return out


def _keras_worker(tmp: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import keras

    import dense_bridge as db
    from dense_bridge.backends.keras import _parallel as kp

    n = len(jax.devices())
    report: dict = {"devices": n, "checks": {}}
    checks = report["checks"]
    spec = _spec()
    par = db.compile(spec, "keras", seed=7, parallel="auto")
    one = db.compile(spec, "keras", seed=7)

    # shard shapes read off the live arrays, per device
    shapes = kp.shard_shapes(par)
    report["shard_shapes"] = {k: [list(s) for s in v] for k, v in shapes.items()}
    assert {k: set(v) for k, v in shapes.items()} == {k: {v} for k, v in _expected_shards(n).items()}, shapes
    checks["shard_shapes"] = True

    # the check behind compile is real: the single-device model fails it for the same plan
    plan = par.__dict__[kp._STATE]["plan"]
    try:
        kp.check_layouts(one, spec.layers, plan, n)
    except db.SpecError as exc:
        checks["replicated_layer_detected"] = "0.kernel" in str(exc) and "silently" in str(exc)

    ref = db.get_params(one)
    full = db.get_params(par)
    assert sorted(full) == sorted(ref) and all(np.array_equal(full[k], ref[k]) for k in ref)
    checks["get_params_bit_exact"] = True
    local = db.get_params(par, local=True)  # one process addresses every device: whole tensors
    assert all(np.array_equal(local[k].array, ref[k][local[k].index]) for k in ref)
    assert all(local[k].array.shape == ref[k].shape for k in ref)
    checks["local_is_this_process"] = True
    assert db.to_spec(par) == spec
    checks["to_spec"] = True

    # per-device memory of the parameters: the sharded ones split N ways
    per_device: dict = {}
    for v in par.variables:
        for s in v.value.addressable_shards:
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
    total = sum(a.nbytes for a in ref.values())
    report["param_bytes_per_device"] = per_device
    report["param_bytes_total"] = total

    # outputs and parameter gradients of L = sum(y * g) through Keras' stateless_call
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    g = rng.standard_normal((5, 4)).astype(np.float32)

    def grads(model):
        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]

        def loss(tv):
            y, _ = model.stateless_call(tv, ntv, x)
            return jnp.sum(y * g), y

        (_, y), gr = jax.value_and_grad(loss, has_aux=True)(tv)
        return y, gr

    y_par, g_par = grads(par)
    y_one, g_one = grads(one)
    report["compare"] = _keras_compare(par, one, 8, spec)
    report["max_abs_output_error"] = float(np.max(np.abs(np.asarray(y_par) - np.asarray(y_one))))
    report["max_abs_grad_error"] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                                       for a, b in zip(g_par, g_one))
    assert report["max_abs_output_error"] < 1e-5 and report["max_abs_grad_error"] < 1e-5, report
    checks["forward_backward"] = True

    new = {k: (v * 2 + 1).astype(v.dtype) if not k.endswith("mask") else v for k, v in ref.items()}
    db.set_params(par, new)
    db.set_params(one, new)
    assert kp.shard_shapes(par) == shapes  # Keras re-shards assigned values by the layout
    back, want = db.get_params(par), db.get_params(one)
    assert all(np.array_equal(back[k], want[k]) for k in want)
    checks["set_params_keeps_layout"] = True

    try:
        db.compile(db.Sequential([db.Dense(6, in_features=4), db.Dense(2)]), "keras", seed=0, parallel="auto")
    except db.SpecError as exc:
        checks["indivisible_raises"] = "divide" in str(exc)

    # a single-file checkpoint saved by one process loads onto the 4 devices
    db.save(one, str(tmp / "one.safetensors"))
    loaded = db.load(str(tmp / "one.safetensors"), "keras", parallel="auto")
    assert kp.shard_shapes(loaded) == shapes and _same(db.get_params(loaded), db.get_params(one))
    checks["single_file_parallel_load"] = True
    # ... checked block by block as a whole load checks it: NaN/Inf, and the mask against the spec
    bad = dict(ref, **{"2.kernel": np.full_like(ref["2.kernel"], np.nan)})
    db.save((spec, bad), str(tmp / "nan.safetensors"), allow_nonfinite=True)
    try:
        db.load(str(tmp / "nan.safetensors"), "keras", parallel="auto")
    except db.CheckpointError as exc:
        checks["single_file_nan_refused"] = "2.kernel" in str(exc) and "NaN" in str(exc)
    kept = db.get_params(db.load(str(tmp / "nan.safetensors"), "keras", parallel="auto", allow_nonfinite=True))
    checks["single_file_allow_nonfinite"] = bool(np.isnan(kept["2.kernel"]).all())
    layers = list(spec.layers)
    layers[1] = layers[1].replace(mask=~spec.layers[1].mask.adjacency)
    try:
        db.load(str(tmp / "one.safetensors"), "keras", parallel="auto", spec=db.Sequential(layers))
    except db.CheckpointError as exc:
        checks["single_file_mask_checked"] = "1.mask" in str(exc)

    # seed=None: one process drives every device, so one draw; a new model per call
    a, b = (db.get_params(db.compile(spec, "keras", parallel="auto")) for _ in range(2))
    checks["seed_none_new_model_per_call"] = not np.array_equal(a["0.kernel"], b["0.kernel"])

    report["bfloat16"] = _keras_bfloat16(tmp)
    return report


def _flax_worker() -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType

    import dense_bridge as db
    from dense_bridge.backends.flax import _parallel as fp

    n = len(jax.devices())
    report: dict = {"devices": n, "checks": {}}
    checks = report["checks"]
    spec = _spec()
    mesh = jax.make_mesh((n,), ("model",), axis_types=(AxisType.Auto,))
    par = db.compile(spec, "flax", seed=7, parallel="auto", group=mesh)
    one = db.compile(spec, "flax", seed=7)
    shapes = fp.shard_shapes(par)
    report["shard_shapes"] = {k: [list(s) for s in v] for k, v in shapes.items()}
    assert {k: set(v) for k, v in shapes.items()} == {k: {v} for k, v in _expected_shards(n).items()}, shapes
    # the annotations are Flax's own: nnx.get_partition_spec reads them back
    specs = nnx.get_partition_spec(nnx.state(par, nnx.Param))
    assert tuple(specs["layers"][0]["kernel"].get_value()) == (None, "model")
    assert tuple(specs["layers"][4]["kernel"].get_value()) == ("model", None)
    checks["shard_shapes"] = True

    ref = db.get_params(one)
    full = db.get_params(par)
    assert sorted(full) == sorted(ref) and all(np.array_equal(full[k], ref[k]) for k in ref)
    local = db.get_params(par, local=True)
    assert all(local[k].array.shape == ref[k].shape and np.array_equal(local[k].array, ref[k]) for k in ref)
    checks["params"] = True

    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    g = rng.standard_normal((5, 4)).astype(np.float32)

    def loss(model):
        return jnp.sum(model(x) * g)

    with jax.set_mesh(mesh):
        y_par = par(x)
        g_par = nnx.grad(loss)(par)
    y_one, g_one = one(x), nnx.grad(loss)(one)
    flat_par = dict(nnx.to_flat_state(g_par))
    flat_one = dict(nnx.to_flat_state(g_one))
    assert sorted(flat_par) == sorted(flat_one) and not any("mask" in k for k in flat_one)
    report["max_abs_output_error"] = float(np.max(np.abs(np.asarray(y_par) - np.asarray(y_one))))
    report["max_abs_grad_error"] = max(float(np.max(np.abs(np.asarray(flat_par[k].get_value())
                                                              - np.asarray(flat_one[k].get_value()))))
                                       for k in flat_one)
    assert report["max_abs_output_error"] < 1e-5 and report["max_abs_grad_error"] < 1e-5, report
    db.testing.assert_equivalent(par, one)  # layer by layer, through the adapter's trace
    checks["forward_backward"] = True

    new = {k: (v * 2 + 1).astype(v.dtype) if not k.endswith("mask") else v for k, v in ref.items()}
    db.set_params(par, new)
    db.set_params(one, new)
    assert fp.shard_shapes(par) == shapes  # placed again by annotation
    back, want = db.get_params(par), db.get_params(one)
    assert all(np.array_equal(back[k], want[k]) for k in want)
    checks["set_params_keeps_layout"] = True

    explicit = jax.make_mesh((n,), ("model",), axis_types=(AxisType.Explicit,))
    try:
        db.compile(spec, "flax", seed=7, parallel="auto", group=explicit)
    except db.SpecError as exc:
        checks["explicit_axes_refused"] = "AxisType.Auto" in str(exc)
    return report


def _expected_shards(n: int) -> dict:
    """Per canonical key of _spec() under parallel="auto" on n devices: each device's shard."""
    return {"0.kernel": (6, 16 // n), "0.bias": (16 // n,), "1.kernel": (16 // n, 8), "1.mask": (16 // n, 8),
            "1.bias": (8,), "2.kernel": (8, 12 // n), "2.bias": (12 // n,), "4.kernel": (12 // n, 4),
            "4.bias": (4,)}


def _jax_worker(out: str) -> None:
    """Keras on JAX and Flax in one process (one JAX start-up for both); a section whose adapter
    is unavailable here reports why, for its test to skip."""
    import dense_bridge as db

    report = {}
    try:
        import dense_bridge.backends.keras  # noqa: F401
    except db.BackendUnavailableError as exc:
        report["keras"] = {"skip": str(exc)}
    else:
        report["keras"] = _keras_worker(Path(out).parent)
    if "flax" in db.available_backends():
        report["flax"] = _flax_worker()
    else:
        report["flax"] = {"skip": "the flax backend is not available here"}
    Path(out).write_text(json.dumps(report))


def _keras_other_backend_worker(out: str) -> None:
    import dense_bridge as db

    try:
        db.compile(_spec(), "keras", seed=0, parallel="auto")
    except db.SpecError as exc:
        Path(out).write_text(json.dumps({"error": str(exc)}))


def keras_adapter_or_skip_report(out: str) -> bool:
    """Import the keras adapter on this KERAS_BACKEND; if it refuses (an install whose adapter
    runs on TensorFlow only), write a skip report for the test to read and say so."""
    import dense_bridge as db

    try:
        import dense_bridge.backends.keras  # noqa: F401
    except db.BackendUnavailableError as exc:
        Path(out).write_text(json.dumps({"skip": str(exc)}))
        return False
    return True


if __name__ == "__main__":
    if sys.argv[1] == "jax":
        _jax_worker(sys.argv[2])
    elif keras_adapter_or_skip_report(sys.argv[2]):
        _keras_other_backend_worker(sys.argv[2])
    sys.exit(0)


# ------------------------------------------------------------------ the tests (pytest side)
import pytest  # noqa: E402


def run_worker(case: str, out: Path, keras_backend: str = "jax", timeout: float = 240) -> dict:
    env = dict(os.environ, KERAS_BACKEND=keras_backend, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               PYTHONPATH=str(HERE.parent), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, str(HERE), case, str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


def _section(report: dict, name: str) -> dict:
    if "skip" in report[name]:
        pytest.skip(f"{name} on JAX is not available here: {report[name]['skip']}")
    return report[name]


@pytest.fixture(scope="module")
def jax_report(tmp_path_factory):
    """The Keras-on-JAX and Flax worker, run once for the module (one JAX start-up)."""
    pytest.importorskip("jax")
    return run_worker("jax", tmp_path_factory.mktemp("jax") / "report.json")


def _need(*modules: str) -> None:
    for m in modules:
        pytest.importorskip(m)


def test_keras_model_parallel_matches_single_device(jax_report):
    _need("keras")
    rep = _section(jax_report, "keras")
    assert rep["devices"] == DEVICES
    assert rep["checks"] == {"shard_shapes": True, "replicated_layer_detected": True,
                             "get_params_bit_exact": True, "local_is_this_process": True, "to_spec": True,
                             "forward_backward": True, "set_params_keeps_layout": True,
                             "indivisible_raises": True, "single_file_parallel_load": True,
                             "single_file_nan_refused": True, "single_file_allow_nonfinite": True,
                             "single_file_mask_checked": True,
                             "seed_none_new_model_per_call": True}
    assert rep["shard_shapes"]["0.kernel"] == [[6, 4]] * DEVICES
    assert rep["shard_shapes"]["4.bias"] == [[4]] * DEVICES  # a row layer's bias is replicated
    assert rep["max_abs_output_error"] < 1e-5 and rep["max_abs_grad_error"] < 1e-5
    # every device holds less than the whole model: the Dense kernels are split 4 ways
    assert all(b < rep["param_bytes_total"] / 2 for b in rep["param_bytes_per_device"].values())


def test_keras_parallel_compare_against_single_device(jax_report):
    """db.testing.compare (the library's own report) of the ModelParallel model against the
    single-device one: outputs and parameter gradients of every layer within float32 tolerance;
    the same compare against other parameters fails (so it measures something)."""
    _need("keras")
    cmp = _section(jax_report, "keras")["compare"]
    assert cmp["passed"], cmp["text"]
    assert cmp["dtype"] == "float32" and cmp["rows"] == 18 and cmp["worst_units"] <= 1
    assert cmp["other_params_fail"]


def test_keras_parallel_bfloat16(jax_report):
    """bfloat16 on 4 devices: shard shapes, every variable still bfloat16, compare within the
    bfloat16 tolerance, and the sharded checkpoint round trip bit-exact in bfloat16."""
    _need("keras")
    bf = _section(jax_report, "keras")["bfloat16"]
    assert bf["shard_shapes_ok"] and bf["variable_dtypes"] == ["bfloat16"]
    assert bf["compare"]["passed"] and bf["compare"]["dtype"] == "bfloat16", bf["compare"]["text"]
    assert bf["compare"]["worst_units"] <= 1 and bf["compare"]["other_params_fail"]
    assert bf["get_params_bit_exact"] and bf["checkpoint_bit_exact"] and bf["index_dtypes"] == ["bfloat16"]


def test_keras_parallel_on_other_backends_raises(tmp_path):
    _need("keras", "torch")
    rep = run_worker("keras_other", tmp_path / "other.json", keras_backend="torch")
    if "skip" in rep:
        pytest.skip(f"the keras adapter does not run on KERAS_BACKEND=torch here: {rep['skip']}")
    assert "KERAS_BACKEND=jax" in rep["error"] and "'torch'" in rep["error"]


def test_keras_parallel_on_tensorflow_raises():
    from dense_bridge.backends.keras._manifest import keras_backend_package

    if keras_backend_package() != "tensorflow":
        pytest.skip("this process's Keras does not run on TensorFlow")
    _need("keras", "tensorflow")
    import dense_bridge as db

    with pytest.raises(db.SpecError, match="KERAS_BACKEND=jax"):
        db.compile(_spec(), "keras", seed=0, parallel="auto")


def test_flax_sharding_annotations_match_single_device(jax_report):
    _need("flax")
    rep = _section(jax_report, "flax")
    assert rep["devices"] == DEVICES
    assert rep["checks"] == {"shard_shapes": True, "params": True, "forward_backward": True,
                             "set_params_keeps_layout": True, "explicit_axes_refused": True}
    assert rep["shard_shapes"]["2.kernel"] == [[8, 3]] * DEVICES
    assert rep["max_abs_output_error"] < 1e-5 and rep["max_abs_grad_error"] < 1e-5
