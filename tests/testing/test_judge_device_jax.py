"""compare_models judges Flax and Equinox captures in jax.numpy, float64 on the model's device,
when JAX's 64-bit mode is on (``backends/_jax/namespace.py``), else on the host.

64-bit mode and a second host device are process-wide and read when JAX starts, so the judged
comparisons run in a subprocess (this file run as a script, ``JAX_ENABLE_X64=1`` and two host
devices): pairs of Flax, Equinox and torch MLPs with activations inside their layers, agreeing
and with a planted fault, a on device 0 and b on device 1, each report held against the host
path's (``_namespace.host_only``) row by row. Here, without 64-bit mode, the JAX adapters offer
no namespace and a Flax pair is judged on the host.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db

SPEC = db.Sequential([db.Dense(16, activation="gelu"), db.Dense(8, activation="tanh"), db.Dense(4)], in_features=6)
X = [np.random.default_rng(0).standard_normal((5, 6))]
PAIRS = [("flax", "flax"), ("equinox", "flax"), ("flax", "equinox"), ("torch", "flax"), ("flax", "torch")]


def _available(pair) -> bool:
    return set(pair) <= set(db.available_backends())


def test_without_x64_jax_is_judged_on_the_host():
    jax = pytest.importorskip("jax")
    if not _available(("flax",)):
        pytest.skip("Flax is not installed")
    if jax.config.read("jax_enable_x64"):
        pytest.skip("this process runs JAX in 64-bit mode")
    from test_judge_device import _chosen

    a, b = (db.compile(SPEC, "flax", seed=0) for _ in range(2))
    with _chosen() as seen:
        assert db.testing.compare_models(a, b, X).passed
    assert seen == ["numpy"]


def test_jax_x64_pairs_judged_on_the_device_with_the_same_reports():
    pytest.importorskip("jax")
    if not {"flax", "equinox"} & set(db.available_backends()):
        pytest.skip("neither Flax nor Equinox is installed")
    env = {**os.environ, "JAX_ENABLE_X64": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr[-4000:]
    assert "('flax', 'flax') fault=True: jax on cpu:1" in done.stdout, done.stdout


def _main() -> None:
    import jax

    sys.path.insert(0, str(Path(__file__).parent))
    from test_judge_device import assert_same_reports

    from dense_bridge.testing import _namespace

    assert jax.config.read("jax_enable_x64") and len(jax.devices("cpu")) == 2
    d0, d1 = jax.devices("cpu")
    chosen = []
    original = _namespace.choose

    def spy(*args, **kwargs):
        got = original(*args, **kwargs)
        chosen.append(got[0])
        return got
    _namespace.choose = spy
    for pair in PAIRS:
        if not _available(pair):
            print(pair, "skipped: not installed")
            continue
        a, b = (db.compile(SPEC, name, seed=0, device=dev if name != "torch" else None)
                for name, dev in zip(pair, (d0, d1)))
        for fault in (False, True):
            if fault:  # b's middle bias off by 0.01: named at that layer
                layer = list(db.linear_layers(b).values())[1]
                params = db.get_params(layer)
                db.set_params(layer, {**params, "bias": params["bias"] + 0.01})
            chosen.clear()
            with _namespace.host_only():
                ref = db.testing.compare_models(a, b, X)
            got = db.testing.compare_models(a, b, X)
            assert ref.passed != fault, str(ref)
            if fault:
                assert got.first_divergence == list(db.linear_layers(b))[1], str(got)
            assert_same_reports(ref, got)
            xp = chosen[-1]
            assert chosen[0].name == "numpy" and xp.name == ("torch" if pair[1] == "torch" else "jax"), chosen
            print(f"{pair} fault={fault}: {xp.name} on {getattr(xp, 'device', '')}")
    print("OK")


if __name__ == "__main__":
    _main()
