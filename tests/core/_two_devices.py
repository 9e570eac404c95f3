"""Run by tests/core/test_devices.py in a subprocess with two JAX host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``, read when JAX is imported): models placed
on device 1 stay there through compile, convert, transfer, compare and compare_models, their
inputs placed there (under ``jax.transfer_guard_device_to_device("disallow_explicit")``: an input made on
device 0 and moved would raise), with the same results as the same models on device 0. Prints
"OK" and one line per check; any failure raises."""
from __future__ import annotations

import contextlib

import jax
import numpy as np

import dense_bridge as db

assert len(jax.devices("cpu")) == 2, jax.devices()
D0, D1 = jax.devices("cpu")


def on(model, device) -> bool:
    leaves = [x for x in jax.tree_util.tree_leaves(_state(model)) if isinstance(x, jax.Array)]
    return bool(leaves) and all(x.devices() == {device} for x in leaves)


def verdict(report) -> list:
    """What a report judged, number by number: every compared quantity's errors and verdict."""
    return [(layer.index, q.quantity, q.max_abs_error, q.units, q.passed)
            for layer in report.layers for q in layer.quantities]


@contextlib.contextmanager
def _no_host_reading(fw: str):
    """Every way dense_bridge reads ``fw``'s arrays into numpy (the adapter's ``to_numpy``, the handles'
    host reading of a model to convert) raises inside: what runs there never left the device."""
    from dense_bridge import _handles
    from dense_bridge.registry._backends import get_adapter

    adapter = get_adapter(fw)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{fw} arrays read into numpy")
    saved = adapter.to_numpy, _handles.Plain.source
    adapter.to_numpy, _handles.Plain.source = refuse, refuse
    try:
        yield
    finally:
        adapter.to_numpy, _handles.Plain.source = saved


def _state(model):
    if db.backend(model) == "flax":
        from flax import nnx

        return nnx.state(model)
    return model


spec = db.Sequential([db.Dense(5, in_features=6, activation="tanh"), db.Dense(4)])
x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)

for fw in ("flax", "equinox"):
    if fw not in db.available_backends():
        print(f"skip {fw}")
        continue
    m1 = db.compile(spec, fw, seed=0, device="cpu:1")
    m0 = db.compile(spec, fw, seed=0, device=D0)
    assert on(m1, D1) and on(m0, D0), fw
    from dense_bridge.registry._backends import get_adapter

    assert get_adapter(fw).device_of(m1) == "cpu:1"
    print(f"{fw}: compile(device='cpu:1') on device 1")

    with jax.transfer_guard_device_to_device("disallow_explicit"):
        r1 = db.testing.compare(m1, m1, inputs=x)
        c1 = db.testing.compare_models(m1, m1, [x])
    r0 = db.testing.compare(m0, m0, inputs=x)
    c0 = db.testing.compare_models(m0, m0, [x])
    assert r1.passed and c1.passed and r0.passed and c0.passed, (r1, c1)
    assert on(m1, D1)
    out1 = np.asarray(get_adapter(fw).capture(m1, [x], {}, cotangent=np.ones).output)
    out0 = np.asarray(get_adapter(fw).capture(m0, [x], {}, cotangent=np.ones).output)
    np.testing.assert_array_equal(out1, out0)
    print(f"{fw}: compare, compare_models on device 1 (inputs placed there), outputs identical to device 0")

    # a model on device 0 against one on device 1, torch (host memory) against each: every side's
    # inputs and cotangents made on its own device (no device-to-device move), the same verdicts
    # and numbers as with everything on device 0 (passing and failing)
    other0 = db.compile(spec, fw, seed=3, device=D0)
    other1 = db.compile(spec, fw, seed=3, device=D1)
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        split = (db.testing.compare(m0, m1, inputs=x), db.testing.compare_models(m0, m1, [x]),
                 db.testing.compare(other0, m1, inputs=x), db.testing.compare_models(other0, m1, [x]))
    same = (db.testing.compare(m0, m0, inputs=x), db.testing.compare_models(m0, m0, [x]),
            db.testing.compare(other0, m0, inputs=x), db.testing.compare_models(other0, m0, [x]))
    assert [r.passed for r in split] == [r.passed for r in same] == [True, True, False, False], (split, same)
    assert [verdict(r) for r in split] == [verdict(r) for r in same]
    print(f"{fw}: device 0 against device 1, same verdicts as on device 0 alone")
    if "torch" in db.available_backends():
        t = db.convert(m0, "torch")
        with jax.transfer_guard_device_to_device("disallow_explicit"):
            on1 = [db.testing.compare(t, m, inputs=x) for m in (m1, other1)] + \
                  [db.testing.compare_models(t, m, [x]) for m in (m1, other1)] + \
                  [db.testing.compare_models(m, t, [x], grads=False) for m in (m1, other1)]
        on0 = [db.testing.compare(t, m, inputs=x) for m in (m0, other0)] + \
              [db.testing.compare_models(t, m, [x]) for m in (m0, other0)] + \
              [db.testing.compare_models(m, t, [x], grads=False) for m in (m0, other0)]
        assert [r.passed for r in on1] == [r.passed for r in on0] == [True, False] * 3, (on1, on0)
        assert [verdict(r) for r in on1] == [verdict(r) for r in on0]
        assert on(m1, D1) and on(other1, D1)
        print(f"{fw}: torch against {fw} on device 1, same verdicts as on device 0")

    # transfer into a model on device 1 (from device 0, from torch): it stays on device 1
    other = db.compile(spec, fw, seed=5, device="cpu:1")
    with jax.transfer_guard_host_to_device("disallow"):  # device arrays move device to device only
        db.transfer(m0, other)
    assert on(other, D1), fw
    for k, v in db.get_params(m0).items():
        np.testing.assert_array_equal(db.get_params(other)[k], v)
    if "torch" in db.available_backends():
        t = db.convert(m0, "torch")
        other = db.compile(spec, fw, seed=7, device="cpu:1")
        with jax.transfer_guard_host_to_device("disallow"):  # torch CPU memory arrives through DLPack
            db.transfer(t, other)
        assert on(other, D1)
        for k, v in db.get_params(t).items():
            np.testing.assert_array_equal(db.get_params(other)[k], v)
        # auto mapping verifies by running both models: dst's inputs go to device 1
        other = db.compile(spec, fw, seed=9, device="cpu:1")
        # the verification's inputs made on device 1 (torch's host memory reaches device 1 by one
        # explicit move per tensor: JAX imports it through DLPack as device 0's)
        with jax.transfer_guard_device_to_device("disallow"):
            db.transfer(t, other, mapping="auto", inputs=[x])
        assert on(other, D1)
    print(f"{fw}: transfer into a model on device 1 keeps it there, values identical")

    # convert: the default is the source's device; device= says otherwise
    for to in ("flax", "equinox"):
        if to in db.available_backends():
            # device to device: the source is never read into numpy (JAX's transfer guard does not see
            # a CPU device's arrays read in place, so the host reading itself is made to fail here)
            with _no_host_reading(fw):
                kept, moved = db.convert(m1, to), db.convert(m1, to, device="cpu:0")
            assert on(kept, D1) and on(moved, D0), (fw, to)
            for k, v in db.get_params(m1).items():
                np.testing.assert_array_equal(db.get_params(kept)[k], v)
                np.testing.assert_array_equal(db.get_params(moved)[k], v)
    print(f"{fw}: convert keeps device 1 by default; device='cpu:0' moves it")
print("OK")
