"""File-to-file conversions into torch, Keras and MLX files build no model: the target
adapter lays the file out with its framework's own writer (``file_layout``) and the core fills
each tensor's bytes from the source's mapped views (``dense_bridge.checkpoints._native_stream``). The file
must be the one the framework writes for the real model: same names, layouts, dtypes,
metadata, readable by the framework itself; bad sources leave nothing behind."""
from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.checkpoints import _file_fill
from dense_bridge import checkpoints as checkpoint
from dense_bridge.checkpoints._canonical import metadata
from dense_bridge.checkpoints._canonical_write import write_canonical
from dense_bridge.checkpoints import _native as native_files
from conftest import require_backend

pytest.importorskip("ml_dtypes")

TARGETS = [("torch", "m.pt"), ("torch", "t.safetensors"), ("mlx", "m.safetensors"), ("keras", "m.weights.h5")]


def masked_spec(dtype: str = "float32"):
    return db.Sequential([db.Dense(6, in_features=5, activation="relu", dtype=dtype,
                                   mask=db.wiring.random(5, 6, 0.5, seed=3)),
                          db.Dense(4, dtype=dtype), db.Dense(3, use_bias=False, dtype=dtype)])


def bits(params: dict) -> dict:
    return {k: (np.asarray(v).dtype.name, np.shape(v), np.ascontiguousarray(v).tobytes()) for k, v in params.items()}


def convert_streaming(*args, **kwargs) -> dict:
    """``checkpoint.convert_file``, failing if it falls back to building the target model."""
    def refuse(*_a, **_k):
        raise AssertionError("the conversion built a model instead of streaming into the file")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint.CanonicalCheckpoint, "native", refuse)
        mp.setattr(native_files.NativeCheckpoint, "native", refuse)
        mp.setattr(native_files, "write_native", refuse)
        return checkpoint.convert_file(*args, **kwargs)


def _canonical(tmp_path, spec, seed=4, **save):
    model = db.compile(spec, "numpy", seed=seed)
    path = tmp_path / "c.safetensors"
    db.save(model, path, **save)
    return path, db.get_params(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("target,name", TARGETS, ids=[n for _, n in TARGETS])
def test_streamed_file_is_what_the_framework_reads(tmp_path, target, name, dtype):
    require_backend(target)
    spec = masked_spec(dtype)
    src, want = _canonical(tmp_path, spec, max_shard_size=200)  # sharded source
    out = tmp_path / name
    seen = []
    summary = convert_streaming(str(src) + ".index.json", target, str(out),
                                      progress=lambda done, total: seen.append((done, total)))
    assert summary["out"] == [str(out)] and seen[-1][0] == seen[-1][1] == sum(a.nbytes for a in want.values())
    # the framework's own loader, into a model dense_bridge compiled for the spec
    loaded = db.load(out, target, spec=spec)
    assert bits(db.get_params(loaded)) == bits(want)
    if name != "m.pt":  # a state dict has no place for metadata; the others carry the spec
        assert db.load(out)[0] == spec
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_torch_file_matches_torch_save_of_the_real_model(tmp_path):
    require_backend("torch")
    import torch

    spec = masked_spec()
    src, want = _canonical(tmp_path, spec)
    convert_streaming(str(src), "torch", str(tmp_path / "m.pt"))
    streamed = torch.load(tmp_path / "m.pt", weights_only=True)
    reference = db.compile(spec, "torch", seed=0)
    db.set_params(reference, want)
    expected = reference.state_dict()
    assert list(streamed) == list(expected) and streamed._metadata == expected._metadata
    for k, v in expected.items():
        assert streamed[k].is_contiguous() and streamed[k].dtype == v.dtype
        assert torch.equal(streamed[k], v), k
    with zipfile.ZipFile(tmp_path / "m.pt") as archive:  # every record's CRC-32 was written
        assert archive.testzip() is None


def test_mlx_file_is_byte_identical_to_the_model_path(tmp_path):
    require_backend("mlx")
    spec = masked_spec()
    src, want = _canonical(tmp_path, spec)
    convert_streaming(str(src), "mlx", str(tmp_path / "streamed.safetensors"))
    model = db.compile(spec, "mlx", seed=0)
    db.set_params(model, want)
    native_files.write_native(model, "mlx", str(tmp_path / "framework.safetensors"), spec=spec)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "framework.safetensors").read_bytes()


@pytest.mark.parametrize("target,name", [("torch", "b.pt"), ("mlx", "b.safetensors")], ids=["torch", "mlx"])
def test_bilinear_kernels_are_laid_out_in_the_frameworks_axes(tmp_path, target, name):
    require_backend(target)
    spec = db.Bilinear(3, 4, 5)  # a lone layer: names without a position prefix
    src, want = _canonical(tmp_path, spec)
    convert_streaming(str(src), target, str(tmp_path / name))
    assert bits(db.get_params(db.load(tmp_path / name, target, spec=spec))) == bits(want)


@pytest.mark.parametrize("target,name", TARGETS, ids=[n for _, n in TARGETS])
def test_nonfinite_source_leaves_nothing(tmp_path, target, name):
    require_backend(target)
    spec = masked_spec()
    model = db.compile(spec, "numpy", seed=1)
    params = db.get_params(model)
    params["1.kernel"][2, 1] = np.nan
    db.save((spec, params), tmp_path / "c.safetensors", allow_nonfinite=True)
    (tmp_path / name).write_bytes(b"earlier file")  # must survive the failed conversion
    with pytest.raises(db.CheckpointError, match="1.kernel.*NaN"):
        convert_streaming(str(tmp_path / "c.safetensors"), target, str(tmp_path / name))
    assert (tmp_path / name).read_bytes() == b"earlier file"
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


@pytest.mark.parametrize("target,name", TARGETS, ids=[n for _, n in TARGETS])
def test_a_mask_that_is_not_the_specs_wiring_is_refused(tmp_path, target, name):
    require_backend(target)
    spec = masked_spec()
    src, params = _canonical(tmp_path, spec)
    params["0.mask"] = 1 - params["0.mask"]  # 0/1 still, but not the spec's wiring
    from dense_bridge.checkpoints._safetensors import pending

    tensors = {k: pending(v) for k, v in params.items()}
    write_canonical(str(src), tensors, metadata(spec, tensors, "numpy"))
    with pytest.raises(db.CheckpointError, match="mask"):
        convert_streaming(str(src), target, str(tmp_path / name))
    assert not (tmp_path / name).exists()


SOURCES = [("torch", ".pt"), ("mlx", ".safetensors"), ("keras", ".weights.h5")]
PAIRS = [(s, e, t, n) for s, e in SOURCES for t, n in TARGETS if s != t and n != "t.safetensors"]


@pytest.mark.parametrize("source,ext,target,name", PAIRS, ids=[f"{s}-{t}" for s, _, t, _ in PAIRS])
def test_native_to_native_streams_too(tmp_path, source, ext, target, name):
    require_backend(source)
    require_backend(target)
    spec = masked_spec()
    model = db.compile(spec, source, seed=9)
    want = db.get_params(model)
    native_files.write_native(model, source, str(tmp_path / f"src{ext}"), spec=spec)
    convert_streaming(str(tmp_path / f"src{ext}"), target, str(tmp_path / name), spec=spec)
    assert bits(db.get_params(db.load(tmp_path / name, target, spec=spec))) == bits(want)


def test_memory_is_a_few_pieces_not_the_model(tmp_path, monkeypatch):
    """canonical -> torch transposes every kernel: through buffers of a piece each, never a tensor."""
    require_backend("torch")
    import tracemalloc

    monkeypatch.setattr(_file_fill, "PIECE", 64 << 10)
    monkeypatch.setattr(_file_fill, "_INLINE", 0)  # the worker threads' path, with its buffers
    spec = db.Sequential([db.Dense(256, in_features=256) for _ in range(8)])  # 8 x 262 kB kernels
    src, want = _canonical(tmp_path, spec)
    tracemalloc.start()
    convert_streaming(str(src), "torch", str(tmp_path / "m.pt"))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 700_000, peak  # the checkpoint is 2.1 MB
    assert bits(db.get_params(db.load(tmp_path / "m.pt", "torch", spec=spec))) == bits(want)


def test_float64_into_mlx_safetensors_is_refused_naming_the_output(tmp_path):
    require_backend("mlx")
    spec = masked_spec("float64")
    src, _ = _canonical(tmp_path, spec)
    with pytest.raises(db.CheckpointError, match=r"m\.safetensors.*float64.*\.npz"):
        convert_streaming(str(src), "mlx", str(tmp_path / "m.safetensors"))
    assert not (tmp_path / "m.safetensors").exists()
