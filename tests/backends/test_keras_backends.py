"""Keras 3 on each of its engines (KERAS_BACKEND tensorflow, jax, torch).

A process runs Keras on one engine, fixed at ``import keras``. So:

- ``test_keras_suite_under_engine[jax|torch]`` runs ONE pytest subprocess per non-default engine,
  selecting the keras-parametrized tests (``-k keras``) of the conformance, conversion,
  checkpoint and equivalence suites plus this file's engine tests. JAX runs with
  JAX_ENABLE_X64=1 so float64 is exercised there too (without it float64 is a SpecError:
  ``test_float64_without_x64_is_a_spec_error``).
- The ``test_keras_engine_*`` tests below run on whichever engine this process has (TensorFlow in
  the plain suite, jax/torch in those subprocesses): every ordered pair of backends converts
  bit-identically; masks hold through the engine's own training loop; a model trained with
  ``fit`` ports to MLX and torch with outputs and gradients within tolerance (db.testing.compare);
  ``.keras`` files written on TensorFlow load bit-identically on JAX and torch, and back.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db
from conftest import require_backend

ROOT = Path(__file__).resolve().parents[2]
CHILD = "DENSE_BRIDGE_KERAS_ENGINE_CHILD"  # set in the subprocesses: they do not recurse
SUITES = ["tests/testing/test_conformance.py", "tests/core/test_convert.py", "tests/checkpoints/test_checkpoint.py", "tests/testing/test_compare.py",
          "tests/backends/test_keras_backends.py", "tests/core/test_masked_cache_keras.py"]
ENGINE_PACKAGES = {"jax": "jax", "torch": "torch"}


def _engine() -> str:
    require_backend("keras")
    import keras

    return keras.backend.backend()


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _same_bits(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(_bits(a[k]), _bits(b[k]), err_msg=k)


def _env(engine: str) -> dict:
    env = {**os.environ, "KERAS_BACKEND": engine, CHILD: "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    if engine == "jax":
        env["JAX_ENABLE_X64"] = "1"
    return env


# ------------------------------------------------------------------ one subprocess per engine
@pytest.mark.skipif(bool(os.environ.get(CHILD)), reason="already inside an engine subprocess")
@pytest.mark.parametrize("engine", ["jax", "torch"])
def test_keras_suite_under_engine(engine, tmp_path):
    """The keras-parametrized conformance/convert/checkpoint/compare tests, with Keras on ``engine``."""
    import importlib.util

    require_backend("keras")
    if importlib.util.find_spec(ENGINE_PACKAGES[engine]) is None:
        pytest.skip(f"{engine} is not installed")
    want = _write_parent_file(tmp_path)
    np.savez(tmp_path / "parent.npz", **want)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "keras", *SUITES]
    done = subprocess.run(cmd, cwd=ROOT, env={**_env(engine), FILES: str(tmp_path)}, capture_output=True,
                          text=True, timeout=900)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"KERAS_BACKEND={engine}: {' '.join(cmd)}\n{tail}"
    assert " passed" in done.stdout and "no tests ran" not in done.stdout, tail
    import keras

    back = keras.saving.load_model(str(tmp_path / f"{engine}.keras"))  # written with Keras on ``engine``
    _same_bits(db.get_params(back), want)
    assert db.to_spec(back) == FILE_SPEC


@pytest.mark.skipif(bool(os.environ.get(CHILD)), reason="already inside an engine subprocess")
def test_keras_float64_without_x64_is_a_spec_error_on_jax():
    import importlib.util

    require_backend("keras")
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    code = ("import dense_bridge as db\n"
            "try:\n    db.compile(db.Dense(2, in_features=3, dtype='float64'), 'keras', seed=0)\n"
            "except db.SpecError as e:\n    print('SpecError', 'jax_enable_x64' in str(e))\n"
            "m = db.compile(db.Dense(2, in_features=3, dtype='float32'), 'keras', seed=0)\n"
            "print(type(m).__name__, db.available_backends())\n")
    env = {**_env("jax"), "JAX_ENABLE_X64": "0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "SpecError True"
    assert lines[1].startswith("Dense") and "keras" in lines[1]


# ------------------------------------------------------------------ on this process' engine
def _spec(dtype: str = "float32") -> db.Sequential:
    return db.Sequential([db.Dense(6, mask=db.wiring.random(5, 6, 0.5, 3), activation="gelu", dtype=dtype),
                          db.Activation("leaky_relu", negative_slope=0.1),
                          db.Dense(3, activation="tanh", dtype=dtype)], in_features=5)


SPEC = _spec()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_keras_engine_every_ordered_pair_converts_bit_identically(dtype):
    engine = _engine()
    if dtype == "float64" and engine == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            pytest.skip("float64 on Keras-JAX needs jax_enable_x64")
    spec = _spec(dtype)
    names = [n for n in ("numpy", "torch", "keras", "mlx") if n in db.available_backends()]
    if dtype == "float64":
        names = [n for n in names if n != "mlx"]  # MLX float64 is CPU-only and float32-accurate (FACTS)
    natives = {n: db.compile(spec, n, seed=7) for n in names}
    reference = db.get_params(natives["numpy"])
    for a in names:
        _same_bits(db.get_params(natives[a]), reference)  # same seed, same bits on every backend
        for b in names:
            there = db.convert(natives[a], to=b)
            _same_bits(db.get_params(there), reference)
            _same_bits(db.get_params(db.convert(there, to=a)), reference)
    assert db.to_spec(natives["keras"]) == spec


def _masked_model():
    return db.compile(SPEC, "keras", seed=1), SPEC.layers[0].mask.adjacency


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype(np.float32), rng.normal(size=(n, 3)).astype(np.float32)


def _assert_mask_held(model, adjacency, before):
    after = db.get_params(model)
    assert np.all(after["0.kernel"][~adjacency] == 0.0)
    _same_bits({"m": after["0.mask"]}, {"m": before["0.mask"]})
    assert np.all(after["0.kernel"][adjacency] != before["0.kernel"][adjacency]), "unmasked weights should train"


def test_keras_engine_mask_holds_through_fit_with_adamw():
    _engine()
    import keras

    model, adjacency = _masked_model()
    before = db.get_params(model)
    model.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.1), loss="mse")
    model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
    _assert_mask_held(model, adjacency, before)


def test_keras_engine_mask_holds_through_the_engines_own_loop():
    """TF: GradientTape; JAX: jax.grad over stateless_call with an optax-style update; torch:
    torch.optim.Adam (coupled weight decay) over the model's torch parameters."""
    engine = _engine()
    import keras

    model, adjacency = _masked_model()
    before = db.get_params(model)
    x, y = _data()
    if engine == "tensorflow":
        import tensorflow as tf

        opt = keras.optimizers.SGD(0.05, momentum=0.9)
        for i in range(0, 32, 4):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x[i:i + 4]) - y[i:i + 4]) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
    elif engine == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in model.trainable_variables]
        frozen = [v.value for v in model.non_trainable_variables]

        def loss_fn(tv, xb, yb):
            out, _ = model.stateless_call(tv, frozen, xb)
            return jnp.mean((out - yb) ** 2)

        grad = jax.jit(jax.grad(loss_fn))
        momentum = [jnp.zeros_like(t) for t in trainable]
        for i in range(0, 32, 4):  # SGD with momentum, written as optax.sgd(0.05, 0.9) does it
            g = grad(trainable, x[i:i + 4], y[i:i + 4])
            momentum = [0.9 * m + gi for m, gi in zip(momentum, g)]
            trainable = [t - 0.05 * m for t, m in zip(trainable, momentum)]
        for v, t in zip(model.trainable_variables, trainable):
            v.assign(t)
    else:
        import torch

        assert isinstance(model, torch.nn.Module)
        params = [p for p in model.parameters() if p.requires_grad]
        assert len(params) == 4  # kernel, bias twice: the mask is not a trainable parameter
        opt = torch.optim.Adam(params, lr=0.01, weight_decay=0.1)  # coupled: wd * w joins the gradient
        for i in range(0, 32, 4):
            opt.zero_grad()
            out = model(torch.from_numpy(x[i:i + 4]))
            loss = ((out - torch.from_numpy(y[i:i + 4])) ** 2).mean()
            loss.backward()
            opt.step()
    _assert_mask_held(model, adjacency, before)


def test_keras_engine_fit_model_ports_to_mlx_and_torch_within_tolerance():
    _engine()
    import keras

    model = db.compile(SPEC, "keras", seed=2)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(*_data(), batch_size=8, epochs=2, verbose=0)
    x = np.random.default_rng(5).normal(size=(4, 5)).astype(np.float32)
    targets = [n for n in ("torch", "mlx") if n in db.available_backends()]
    if not targets:
        pytest.skip("neither torch nor mlx is installed")
    for target in targets:
        port = db.convert(model, to=target)
        _same_bits(db.get_params(port), db.get_params(model))
        report = db.testing.compare(model, port, inputs=x)
        assert report.passed, f"{target}:\n{report}"


def test_keras_engine_owns_its_layers_before_torch():
    engine = _engine()
    import keras

    layer = db.compile(db.Dense(2, in_features=3), "keras", seed=0)
    from dense_bridge.registry._backends import backend_of

    assert backend_of(layer) == "keras"
    assert backend_of(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])) == "keras"
    if engine == "torch":
        import torch

        assert isinstance(layer, torch.nn.Module)  # a torch module too, read as the Keras layer
        assert db.to_spec(layer) == db.Dense(2, in_features=3)


FILE_SPEC = db.Sequential([db.Dense(4, mask=db.wiring.banded(3, 4, 1), activation="selu"), db.Dense(2)],
                          in_features=3)
FILES = "DENSE_BRIDGE_KERAS_FILES"  # a folder: the parent's .keras file in, the child's out


def _write_parent_file(folder: Path) -> dict:
    model = db.compile(FILE_SPEC, "keras", seed=4)
    model.save(str(folder / "parent.keras"))
    return db.get_params(model)


def test_keras_engine_reads_and_writes_keras_files_of_other_engines():
    """In an engine subprocess: the parent's .keras file (Keras on TensorFlow: mask, exact
    activation) loads here with the same spec and bits, and this engine writes one back that
    the parent then loads (test_keras_suite_under_engine)."""
    _engine()
    folder = os.environ.get(FILES)
    if not folder:
        pytest.skip("runs inside test_keras_suite_under_engine's subprocesses")
    import keras

    folder = Path(folder)
    loaded = keras.saving.load_model(str(folder / "parent.keras"))
    want = dict(np.load(folder / "parent.npz"))
    _same_bits(db.get_params(loaded), want)
    assert db.to_spec(loaded) == FILE_SPEC
    loaded.save(str(folder / f"{keras.backend.backend()}.keras"))


@pytest.mark.skipif(bool(os.environ.get(CHILD)), reason="already inside an engine subprocess")
def test_bert_port_compares_without_outputs_on_the_torch_engine():
    """keras-hub's BertBackbone returns {pooled_output, sequence_output} in another order on the torch
    engine than transformers' (last_hidden_state, pooler_output): compare_models pairs the outputs by
    shape, so the port of tests/_compare_ports passes with the default outputs and says so."""
    import importlib.util

    require_backend("keras")
    for package in ("torch", "transformers", "keras_hub"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    script = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import torch; torch.set_num_threads(1)\n"
        "import dense_bridge as db, _compare_ports as P\n"
        "src = P.torch_bert(0); port = P.keras_bert('float32'); P.port_bert(src, port)\n"
        "r = db.testing.compare_models(src, port, P.bert_inputs(0), mapping=P.BERT_RULES, seed=0)\n"
        "assert r.passed, str(r)\n"
        "assert any('both (2, 7, 32)' in n for n in r.notes), r.notes\n"
        "print('BERT OK')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env("torch"), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "BERT OK" in done.stdout, (done.stdout + done.stderr)[-4000:]
