"""Tensor-parallel Dense on JAX (issue 17): Keras ``ModelParallel`` on Keras' JAX backend, over 4
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


def _spec():
    import dense_bridge as db

    mask = np.random.default_rng(3).random((16, 8)) < 0.6
    return db.Sequential([
        db.Dense(16, in_features=6, activation="relu"),
        db.Dense(8, activation="tanh", mask=mask),
        db.Dense(12),
        db.Activation("gelu"),
        db.Dense(4),
    ])


def _keras_worker(out: str) -> None:
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
    expected = {"0.kernel": (6, 16 // n), "0.bias": (16 // n,), "1.kernel": (16 // n, 8), "1.mask": (16 // n, 8),
                "1.bias": (8,), "2.kernel": (8, 12 // n), "2.bias": (12 // n,), "4.kernel": (12 // n, 4),
                "4.bias": (4,)}
    assert {k: set(v) for k, v in shapes.items()} == {k: {v} for k, v in expected.items()}, shapes
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
    if keras_adapter_or_skip_report(sys.argv[2]):
        {"keras": _keras_worker, "keras_other": _keras_other_backend_worker}[sys.argv[1]](sys.argv[2])
    sys.exit(0)


# ------------------------------------------------------------------ the tests (pytest side)
import pytest  # noqa: E402


def run_worker(case: str, out: Path, keras_backend: str = "jax", timeout: float = 180) -> dict:
    env = dict(os.environ, KERAS_BACKEND=keras_backend, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
               PYTHONPATH=str(HERE.parent), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, str(HERE), case, str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(out.read_text())
    if "skip" in report:
        pytest.skip(f"the keras adapter does not run on KERAS_BACKEND={keras_backend} here: {report['skip']}")
    return report


def _need(*modules: str) -> None:
    for m in modules:
        pytest.importorskip(m)


def test_keras_model_parallel_matches_single_device(tmp_path):
    _need("keras", "jax")
    rep = run_worker("keras", tmp_path / "keras.json")
    assert rep["devices"] == DEVICES
    assert rep["checks"] == {"shard_shapes": True, "replicated_layer_detected": True,
                             "get_params_bit_exact": True, "local_is_this_process": True, "to_spec": True,
                             "forward_backward": True, "set_params_keeps_layout": True,
                             "indivisible_raises": True}
    assert rep["shard_shapes"]["0.kernel"] == [[6, 4]] * DEVICES
    assert rep["shard_shapes"]["4.bias"] == [[4]] * DEVICES  # a row layer's bias is replicated
    assert rep["max_abs_output_error"] < 1e-5 and rep["max_abs_grad_error"] < 1e-5
    # every device holds less than the whole model: the Dense kernels are split 4 ways
    assert all(b < rep["param_bytes_total"] / 2 for b in rep["param_bytes_per_device"].values())


def test_keras_parallel_on_other_backends_raises(tmp_path):
    _need("keras", "torch")
    rep = run_worker("keras_other", tmp_path / "other.json", keras_backend="torch")
    assert "KERAS_BACKEND=jax" in rep["error"] and "'torch'" in rep["error"]
