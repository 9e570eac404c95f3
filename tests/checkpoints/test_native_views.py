"""A native file reaches a model through one path: the adapter's ``file_views`` named from the spec.

- A native file loaded onto its own framework is built from the file's tensors through the
  ``ParamSource`` stream (as a canonical file is): no model is drawn from a seed to be
  overwritten (``NativeCheckpoint._new_template`` is never called), bit for bit.
- A conversion into another framework's file compiles no structure twin to learn names: the
  target adapter names the tensors from the spec (``file_layout``).
- Each adapter's names from the spec are the names its framework gives the model it compiles,
  for every activation, masks, biases on and off, and a Bilinear layer.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import activations
from dense_bridge import checkpoints
from dense_bridge.checkpoints import _native

FILES = [("torch", "m.pt"), ("torch", "m.safetensors"), ("mlx", "m.safetensors"), ("mlx", "m.npz"),
         ("flax", "m.msgpack"), ("keras", "m.weights.h5"), ("equinox", "m.eqx")]


def every_activation_spec() -> db.Sequential:
    """Width 3 throughout: a masked Dense, then each activation followed by a Dense."""
    layers = [db.Dense(3, in_features=2, activation="relu", mask=db.wiring.banded(2, 3, 1))]
    for i, name in enumerate(activations.NAMES):
        layers += [activations.get(name), db.Dense(3, use_bias=bool(i % 2))]
    return db.Sequential(layers + [db.Dense(2)], in_features=2)


def _bits(params: dict) -> dict:
    return {k: np.asarray(v).tobytes() for k, v in params.items()}


@pytest.mark.parametrize("backend,name", FILES)
def test_a_native_file_loads_onto_its_framework_without_a_drawn_template(tmp_path, monkeypatch, backend, name):
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core", "flax": "flax", "keras": "keras",
                         "equinox": "equinox"}[backend])
    spec = every_activation_spec()
    model = db.compile(spec, backend, seed=4)
    path = str(tmp_path / name)
    _native.write_native(model, backend, path)

    def drawn(self):
        raise AssertionError("a model was drawn from a seed to be overwritten")

    monkeypatch.setattr(_native.NativeCheckpoint, "_new_template", drawn)
    loaded = db.load(path, backend, spec=spec)
    assert db.backend(loaded) == backend
    assert _bits(db.get_params(loaded)) == _bits(db.get_params(model))
    _, params = db.load(path, spec=spec)  # the same views, as numpy
    assert _bits(params) == _bits(db.get_params(model))


@pytest.mark.parametrize("backend,name", [("torch", "m.pt"), ("mlx", "m.safetensors")])
def test_a_nonfinite_value_is_refused_on_the_files_own_framework_too(tmp_path, backend, name):
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[backend])
    spec = db.Sequential([db.Dense(3, in_features=2), db.Dense(2)])
    params = db.get_params(db.compile(spec, "numpy", seed=0))
    params["1.bias"] = params["1.bias"].copy()
    params["1.bias"][0] = np.nan
    model = db.compile(spec, backend, params=params, allow_nonfinite=True)
    path = str(tmp_path / name)
    _native.write_native(model, backend, path)
    with pytest.raises(db.CheckpointError, match="NaN"):
        db.load(path, backend, spec=spec)
    loaded = db.load(path, backend, spec=spec, allow_nonfinite=True)
    assert np.isnan(np.asarray(db.get_params(loaded)["1.bias"])[0])


@pytest.mark.parametrize("target,name", [("torch", "out.pt"), ("torch", "out.safetensors"), ("mlx", "out.safetensors")])
def test_a_conversion_compiles_no_structure_twin(tmp_path, monkeypatch, target, name):
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[target])
    spec = every_activation_spec()
    src = str(tmp_path / "src.safetensors")
    model = db.compile(spec, "numpy", seed=2)
    db.save(model, src)

    def twin(spec):
        raise AssertionError("a structure twin was compiled to learn the target's names")

    monkeypatch.setattr(_native, "structure_twin", twin)
    out = str(tmp_path / name)
    checkpoints.convert_file(src, target, out)
    back = db.load(out, target, spec=spec)
    assert _bits(db.get_params(back)) == _bits(db.get_params(model))


def _native_arrays(backend: str, model) -> dict[str, np.ndarray]:
    """The framework's own tensors of ``model`` by the names it gives them."""
    if backend == "torch":
        return {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if backend == "mlx":
        from mlx.utils import tree_flatten

        return {k: np.asarray(v) for k, v in tree_flatten(model.parameters())}
    from flax import nnx

    from dense_bridge.backends.flax import _files

    return {k: np.asarray(v) for k, v in _files._flat(nnx.to_pure_dict(nnx.state(model))).items()}


@pytest.mark.parametrize("backend", ["torch", "mlx", "flax"])
@pytest.mark.parametrize("spec", [every_activation_spec(), db.Dense(3, in_features=2, use_bias=False),
                                  db.Bilinear(3, 4, 2)], ids=["chain", "dense", "bilinear"])
def test_names_from_the_spec_are_the_frameworks_own(backend, spec):
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core", "flax": "flax"}[backend])
    from importlib import import_module

    plan = import_module(f"dense_bridge.backends.{backend}._files")._plan(spec)
    assert plan is not None and set(plan) == set(_native.canonical_shapes(spec))
    model = db.compile(spec, backend, seed=0)
    native, canonical = _native_arrays(backend, model), db.get_params(model)
    assert sorted(name for name, _ in plan.values()) == sorted(native)
    for name, (stored, axes) in plan.items():  # canonical = native.transpose(axes)
        assert np.array_equal(native[stored].transpose(axes), canonical[name]), name


@pytest.mark.parametrize("spec", [every_activation_spec(), db.Dense(3, in_features=2, use_bias=False),
                                  db.Bilinear(3, 4, 2)], ids=["chain", "dense", "bilinear"])
def test_equinox_leaf_order_from_the_spec_is_equinox_own(spec):
    """An .eqx file has no names: the record order must be jax's leaf order of the compiled model."""
    pytest.importorskip("equinox")
    import equinox as eqx
    import jax

    from dense_bridge.backends.equinox import _files

    order = _files._plan(spec)
    model = db.compile(spec, "equinox", seed=0)
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(model) if eqx.is_array(leaf)]
    canonical = db.get_params(model)
    assert len(order) == len(leaves) and {name for name, _ in order} == set(canonical)
    for (name, axes), leaf in zip(order, leaves):
        assert np.array_equal(leaf.transpose(axes).astype(canonical[name].dtype), canonical[name]), name


def test_an_eqx_record_written_big_endian_loads_as_the_same_values(tmp_path):
    """np.save on a big-endian machine writes '>f4' records: mapped in place, they are served in this
    machine's byte order with the same values (never the bytes reinterpreted)."""
    pytest.importorskip("equinox")
    spec = db.Dense(3, in_features=2)
    params = db.get_params(db.compile(spec, "equinox", seed=1))
    path = tmp_path / "be.eqx"
    with open(path, "wb") as f:  # Equinox's leaf order: weight (units, in), then bias
        np.save(f, np.ascontiguousarray(params["kernel"].T).astype(">f4"))
        np.save(f, params["bias"].astype(">f4"))
    _, loaded = db.load(str(path), spec=spec)
    assert _bits(loaded) == _bits(params)
    assert _bits(db.get_params(db.load(str(path), "equinox", spec=spec))) == _bits(params)
