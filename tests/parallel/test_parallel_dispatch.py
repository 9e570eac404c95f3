"""The one dispatch of tensor-parallel verbs (dense_bridge/parallel/_dispatch.py), on what needs
no process group: which backends take ``parallel=``, what a plain model and other objects are
routed to, and the errors for what only a parallel model (or a DCP-writing backend) can do.

The collective paths themselves run in tests/parallel/test_parallel.py (torch), test_parallel_mlx.py and
test_parallel_jax.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.registry._contract import PARALLEL_VERBS
from dense_bridge.registry._manifest import PARALLEL
from dense_bridge.registry._backends import available_backends, get_adapter, has_capability
from dense_bridge.parallel import _dispatch, is_parallel_dir, is_parallel_model

SPEC = db.Sequential([db.Dense(4, in_features=3, activation="relu"), db.Dense(2)])


def test_a_backend_without_the_capability_refuses_parallel():
    assert not has_capability("numpy", PARALLEL)
    with pytest.raises(db.SpecError, match=r"parallel= is not supported on the 'numpy' backend.*'parallel' capability"):
        db.compile(SPEC, "numpy", seed=0, parallel="auto")


@pytest.mark.parametrize("backend", ["torch", "mlx", "keras", "flax"])
def test_the_engines_declare_parallelism_and_offer_every_verb(backend):
    if backend not in available_backends():
        pytest.skip(f"{backend} is not installed")
    adapter = get_adapter(backend)
    assert has_capability(backend, PARALLEL)
    assert all(callable(getattr(adapter, verb)) for verb in PARALLEL_VERBS)


def test_plain_models_and_other_objects_take_the_plain_verbs(tmp_path):
    model = db.compile(SPEC, "numpy", seed=0)
    adapter = get_adapter("numpy")
    assert _dispatch.verbs_for(model) is adapter  # no view in between for a plain model
    assert _dispatch.state_of(model) is None
    for obj in (model, SPEC, {"0.kernel": np.zeros((3, 4))}, (SPEC, {}), "a string", None):
        assert not is_parallel_model(obj)
    with pytest.raises(TypeError, match="native"):
        _dispatch.verbs_for(object())
    assert not is_parallel_dir(tmp_path) and not is_parallel_dir(tmp_path / "missing")
    assert is_parallel_dir(tmp_path, "dcp")  # format="dcp" names the kind: its reader says what is missing


def test_local_params_need_a_parallel_model():
    model = db.compile(SPEC, "numpy", seed=0)
    with pytest.raises(TypeError, match="local=True needs a parallel model"):
        db.get_params(model, local=True)


def test_dcp_saves_need_a_backend_that_writes_them(tmp_path):
    model = db.compile(SPEC, "numpy", seed=0)
    with pytest.raises(db.CheckpointError, match=r'format="dcp".*save_dcp.*Received: obj of type'):
        db.save(model, tmp_path / "ckpt", format="dcp")
    with pytest.raises(db.CheckpointError, match='format="dcp"'):
        db.save((SPEC, db.get_params(model)), tmp_path / "ckpt", format="dcp")
    assert not (tmp_path / "ckpt").exists()


def test_rank_files_are_plain_safetensors_written_atomically(tmp_path):
    """A rank file goes through the one safetensors writer (transposed views included) and the one
    atomic writer: the reference ``safetensors`` reader loads it bit for bit, and no temporary is left."""
    st = pytest.importorskip("safetensors.numpy")
    from dense_bridge.parallel._sharded_dir import FORMAT, rank_file, write_json, write_rank_file

    rng = np.random.default_rng(0)
    shards = {"0.kernel": rng.standard_normal((6, 4)).astype(np.float32).T,  # a transposed view, as torch hands it
              "0.bias": rng.standard_normal(4).astype(np.float16), "1.mask": np.ones((4, 2), np.float32)}
    name = write_rank_file(str(tmp_path / "ckpt"), 1, 2, shards)
    assert name == rank_file(1, 2) == "rank-00001-of-00002.safetensors"
    loaded = st.load_file(str(tmp_path / "ckpt" / name))
    assert sorted(loaded) == sorted(shards)
    for key, a in shards.items():
        assert loaded[key].dtype == a.dtype and np.array_equal(loaded[key], a), key
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ckpt" / name), "np") as f:
        assert f.metadata() == {"format": FORMAT}
    write_json(str(tmp_path / "ckpt" / "x.json"), {"a": [1, 2]})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [name, "x.json"]


def test_a_parallel_model_takes_the_parallel_verbs_everywhere(tmp_path):
    """A parallel model in this process (Flax on JAX's one CPU device: a mesh of one): the public
    verbs reach the parallel_* verbs through the view, every other name is the adapter's own, and
    save/load go to the sharded directory."""
    if "flax" not in available_backends():
        pytest.skip("flax is not installed")
    from dense_bridge.parallel._sharded_dir import INDEX_NAME

    model = db.compile(SPEC, "flax", seed=0, parallel="auto")
    want = db.get_params(db.compile(SPEC, "numpy", seed=0))
    verbs = _dispatch.verbs_for(model)
    assert isinstance(verbs, _dispatch.ParallelModelVerbs) and verbs.backend == "flax"
    assert verbs.walk is get_adapter("flax").walk  # not a parallel verb: the adapter's own
    assert is_parallel_model(model) and _dispatch.state_of(model)["world_size"] == 1
    got = db.get_params(model)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    local = db.get_params(model, local=True)
    assert all(np.array_equal(want[k][s.index], s.array) for k, s in local.items())
    assert db.to_spec(model) == SPEC
    report = db.testing.compare(model, db.compile(SPEC, "numpy", seed=0), seed=1)
    assert report.passed, str(report)
    other = db.get_params(db.compile(SPEC, "numpy", seed=3))
    db.set_params(model, other)
    assert all(np.array_equal(db.get_params(model)[k], other[k]) for k in other)
    written = db.save(model, tmp_path / "tp")
    assert sorted(os.path.basename(f) for f in written) == sorted([INDEX_NAME, "rank-00000-of-00001.safetensors"])
    spec, params = db.load(tmp_path / "tp")
    assert spec == SPEC and all(np.array_equal(params[k], other[k]) for k in other)
    with pytest.raises(db.CheckpointError, match="sharded directory"):
        db.save(model, tmp_path / "m.safetensors", format="safetensors")
