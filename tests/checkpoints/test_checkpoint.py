"""db.save / db.load against real files and real frameworks: formats, sharding, bad files, atomicity."""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import checkpoints as checkpoint
from dense_bridge.checkpoints._io import parse_size
from dense_bridge.params._source import expected_params
from dense_bridge.checkpoints._safetensors import SafetensorsFile

from conftest import require_backend

ml_dtypes = pytest.importorskip("ml_dtypes")

# backend -> native file kinds it writes and reads
NATIVE = {"torch": (".pt", ".safetensors"), "keras": (".weights.h5", ".keras"), "mlx": (".safetensors", ".npz")}
FORMATS = [(b, ext) for b, exts in NATIVE.items() for ext in exts]


def make_spec(dtype: str = "float32", mask: bool = True):
    """A small MLP with an activation layer, a masked layer and the dtype under test."""
    first = db.Dense(6, in_features=5, activation="relu", dtype=dtype,
                     mask=db.wiring.random(5, 6, 0.5, seed=3) if mask else None)
    return db.Sequential([first, db.Activation("tanh"), db.Dense(3, activation="softmax", dtype=dtype)])


def spec_for(dtype: str):
    return make_spec(dtype, mask=True)


def bits(params: dict) -> dict:
    """name -> (dtype, shape, raw bytes): equal means bit-identical."""
    return {k: (np.asarray(v).dtype.name, np.shape(v), np.ascontiguousarray(v).tobytes()) for k, v in params.items()}


def raw_header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def tmp_leftovers(directory) -> list[str]:
    return [n for n in os.listdir(directory) if ".tmp-" in n]


# ----------------------------------------------------------------------------- canonical format
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_canonical_file_layout_and_metadata(tmp_path, dtype):
    spec = spec_for(dtype)
    model = db.compile(spec, "numpy", seed=1)
    path = tmp_path / "m.safetensors"
    assert db.save(model, path) == [str(path)]
    header = raw_header(path)
    meta = header.pop("__metadata__")
    assert meta["format"] == "dense_bridge" and meta["format_version"] == "1"
    assert db.from_config(json.loads(meta["spec"])) == spec
    assert set(json.loads(meta["layout"]).values()) == {"canonical"}
    assert "kernel (in_features, units)" in meta["layout_note"]
    assert json.loads(meta["dtypes"])["2.kernel"] == dtype
    code = "BF16" if dtype == "bfloat16" else "F32"
    assert header["2.kernel"]["dtype"] == code and header["2.kernel"]["shape"] == [6, 3]
    assert header["0.kernel"]["shape"] == [5, 6]  # canonical (in_features, units), never transposed
    loaded_spec, params = db.load(path)
    assert loaded_spec == spec
    assert bits(params) == bits(db.get_params(model))
    assert params["2.kernel"].dtype == ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def test_official_safetensors_library_reads_our_bfloat16(tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    model = db.compile(spec_for("bfloat16"), "numpy", seed=2)
    path = tmp_path / "m.safetensors"
    db.save(model, path)
    tensors = st_torch.load_file(str(path))
    assert tensors["0.kernel"].dtype == torch.bfloat16
    ours = db.get_params(model)["0.kernel"]
    assert tensors["0.kernel"].view(torch.int16).numpy().tobytes() == ours.tobytes()


def test_we_read_files_of_the_official_library(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    w = torch.randn(4, 3).to(torch.bfloat16)
    st_torch.save_file({"weight": w, "bias": torch.zeros(4)}, str(tmp_path / "t.safetensors"))
    f = SafetensorsFile(tmp_path / "t.safetensors")
    assert f.get("weight").dtype == ml_dtypes.bfloat16
    assert f.get("weight").tobytes() == w.view(torch.int16).numpy().tobytes()


def test_params_only_checkpoint(tmp_path):
    params = {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "bias": np.ones(4, ml_dtypes.bfloat16)}
    path = tmp_path / "p.safetensors"
    db.save(params, path)
    assert "spec_note" in raw_header(path)["__metadata__"]
    spec, loaded = db.load(path)
    assert spec is None and bits(loaded) == bits(params)
    with pytest.raises(db.CheckpointError, match="spec="):
        db.load(path, "numpy")
    # the file's dtypes are kept, never cast: a spec disagreeing with them is an error
    with pytest.raises(db.CheckpointError, match="bias: file has dtype bfloat16, the spec expects float32"):
        db.load(path, "numpy", spec=db.Dense(4, in_features=3))


def test_spec_and_params_tuple(tmp_path):
    spec = make_spec()
    params = db.get_params(db.compile(spec, "numpy", seed=4))
    db.save((spec, params), tmp_path / "t.safetensors")
    loaded_spec, loaded = db.load(tmp_path / "t.safetensors")
    assert loaded_spec == spec and bits(loaded) == bits(params)


def test_lazy_spec_takes_width_from_checkpoint(tmp_path):
    lazy = db.Sequential([db.Dense(4, activation="relu"), db.Dense(2)])
    params = db.get_params(db.compile(lazy.with_in_features(3), "numpy", seed=0))
    db.save((lazy.with_in_features(3), params), tmp_path / "w.safetensors")
    model = db.load(tmp_path / "w.safetensors", "numpy", spec=lazy)
    assert bits(db.get_params(model)) == bits(params)


# ----------------------------------------------------------------------------- every backend and format
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_canonical_round_trip_every_backend(tmp_path, backend, dtype):
    spec = spec_for(dtype)
    model = db.compile(spec, backend, seed=5)
    want = bits(db.get_params(model))
    path = tmp_path / f"{backend}.safetensors"
    db.save(model, path)
    again = db.load(path, backend)
    assert db.backend(again) == backend
    assert bits(db.get_params(again)) == want
    assert db.to_spec(again) == db.to_spec(model)
    for other in db.available_backends():  # and onto every other framework
        if other == "onnx" and dtype == "bfloat16":
            continue  # refused at compile: onnxruntime's CPU provider has no bfloat16 MatMul (test_backend_onnx)
        assert bits(db.get_params(db.load(path, other))) == want, other


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend_name,ext", FORMATS, ids=[f"{b}{e}" for b, e in FORMATS])
def test_native_format_round_trip(tmp_path, backend_name, ext, dtype):
    require_backend(backend_name)
    spec = spec_for(dtype)
    source = db.compile(spec, "numpy", seed=6)
    want = bits(db.get_params(source))
    canonical = tmp_path / "c.safetensors"
    db.save(source, canonical)
    out = tmp_path / f"native{ext}"
    summary = checkpoint.convert_file(str(canonical), backend_name, str(out))
    assert summary["out"] == [str(out)]
    # the framework itself reads the file it would write
    native = db.load(out, backend_name, spec=spec)
    assert db.backend(native) == backend_name and bits(db.get_params(native)) == want
    loaded_spec, params = db.load(out, spec=spec)
    assert loaded_spec == spec and bits(params) == want
    # and back to a canonical checkpoint, bit for bit
    back = tmp_path / "back.safetensors"
    checkpoint.convert_file(str(out), "canonical", str(back), spec=spec)
    assert bits(db.load(back)[1]) == want


def test_native_files_written_by_the_frameworks_themselves(tmp_path):
    """Files users make with torch.save / model.save_weights / mx.savez, not through dense_bridge."""
    spec = make_spec()
    want = bits(db.get_params(db.compile(spec, "numpy", seed=7)))
    if "torch" in db.available_backends():
        import torch

        t = db.compile(spec, "torch", seed=7)
        torch.save(t.state_dict(), tmp_path / "user.pth")
        assert bits(db.load(tmp_path / "user.pth", spec=spec)[1]) == want
    if "mlx" in db.available_backends():
        import mlx.core as mx
        from mlx.utils import tree_flatten

        m = db.compile(spec, "mlx", seed=7)
        mx.savez(str(tmp_path / "user.npz"), **dict(tree_flatten(m.parameters())))
        m.save_weights(str(tmp_path / "user.safetensors"))
        assert bits(db.load(tmp_path / "user.npz", spec=spec)[1]) == want
        assert bits(db.load(tmp_path / "user.safetensors", spec=spec)[1]) == want


def test_plain_keras_weights_file_with_spec(tmp_path):
    require_backend("keras")
    import keras

    km = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                           keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    km.save_weights(str(tmp_path / "user.weights.h5"))
    spec = db.to_spec(km)
    # the adapter builds its own Dense subclass for activated layers: the file's names differ
    torch_model = db.load(tmp_path / "user.weights.h5", "numpy", spec=spec)
    assert bits(db.get_params(torch_model)) == bits(db.get_params(km))


def test_keras_model_file_carries_its_spec(tmp_path):
    require_backend("keras")
    spec = make_spec()
    k = db.compile(spec, "keras", seed=8)
    path = tmp_path / "m.keras"
    k.save(path)
    loaded_spec, params = db.load(path)
    assert loaded_spec == spec and bits(params) == bits(db.get_params(k))


def test_torch_like_names_a_custom_module(tmp_path):
    require_backend("torch")
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 2)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    mine = MLP()
    torch.save(mine.state_dict(), tmp_path / "mlp.pt")
    with pytest.raises(db.CheckpointError, match="fc1.weight"):
        db.load(tmp_path / "mlp.pt", spec=db.to_spec(mine))  # positional names expected: says which differ
    spec, params = db.load(tmp_path / "mlp.pt", like=MLP())
    assert spec == db.to_spec(mine) and bits(params) == bits(db.get_params(mine))


# ----------------------------------------------------------------------------- sharding and streaming
def test_sharded_save_and_load(tmp_path):
    spec = db.Sequential([db.Dense(32, in_features=32) for _ in range(6)])
    model = db.compile(spec, "numpy", seed=9)
    want = bits(db.get_params(model))
    path = tmp_path / "model.safetensors"
    files = db.save(model, path, max_shard_size="10kB")
    index = tmp_path / "model.safetensors.index.json"
    assert files[-1] == str(index) and not path.exists()
    shards = sorted(n for n in os.listdir(tmp_path) if n.startswith("model-"))
    save_id = shards[0].split("-")[1]  # unique per save: concurrent saves never share a shard name
    assert re.fullmatch(r"[0-9a-f]{8}", save_id)
    assert shards == [f"model-{save_id}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert len(shards) >= 3
    doc = json.loads(index.read_text())
    assert doc["metadata"]["format"] == "dense_bridge" and doc["metadata"]["total_size"] == 6 * 33 * 32 * 4
    assert set(doc["weight_map"].values()) == set(shards)
    for shard in shards:
        assert os.path.getsize(tmp_path / shard) < 10_000 + 1000
    for name in (path, index):  # by the save path or by the index
        loaded_spec, params = db.load(name)
        assert loaded_spec == spec and bits(params) == want
    for b in db.available_backends():
        assert bits(db.get_params(db.load(index, b))) == want
    with pytest.raises(db.CheckpointError, match="shard 1/.*index"):
        db.load(tmp_path / shards[0])


def test_resaving_replaces_stale_files(tmp_path):
    spec = db.Sequential([db.Dense(16, in_features=16) for _ in range(4)])
    model = db.compile(spec, "numpy", seed=1)
    path = tmp_path / "m.safetensors"
    db.save(model, path)
    db.save(model, path, max_shard_size=1200)  # one 1088-byte layer per shard
    assert not path.exists()  # the single file would shadow the new index
    assert len(os.listdir(tmp_path)) == 4 + 1
    db.save(model, path, max_shard_size=2200)  # two layers per shard: the four old shards go
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 3 and names[-1] == "m.safetensors.index.json"
    assert set(json.loads((tmp_path / names[-1]).read_text())["weight_map"].values()) == set(names[:2])
    assert [n.split("-", 2)[2] for n in names[:2]] == ["00001-of-00002.safetensors", "00002-of-00002.safetensors"]
    assert bits(db.load(path)[1]) == bits(db.get_params(model))
    db.save(model, path)
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_streaming_conversion_holds_one_tensor(tmp_path):
    import tracemalloc

    spec = db.Sequential([db.Dense(256, in_features=256) for _ in range(8)])  # 8 x 256 kB kernels
    db.save(db.compile(spec, "numpy", seed=0), tmp_path / "big.safetensors", max_shard_size="600kB")
    tracemalloc.start()
    checkpoint.convert_file(str(tmp_path / "big.safetensors.index.json"), "canonical",
                            str(tmp_path / "re.safetensors"), max_shard_size="1MB")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 600_000, peak  # the checkpoint is 2.1 MB; one kernel is 262 kB
    assert bits(db.load(tmp_path / "re.safetensors")[1]) == bits(db.load(tmp_path / "big.safetensors")[1])


def test_parse_size():
    assert parse_size("10MB") == 10_000_000 and parse_size("4MiB") == 4 << 20 and parse_size(123) == 123
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size(None) is None
    for bad in ("ten", "10XB", "-3", 0):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    with pytest.raises(TypeError):
        parse_size(1.5)


# ----------------------------------------------------------------------------- bad files
def _bad_file(tmp_path, kind: str):
    """(path, load kwargs) for each kind of bad input."""
    spec = make_spec()
    good = tmp_path / "good.safetensors"
    db.save(db.compile(spec, "numpy", seed=0), good)
    data = good.read_bytes()
    if kind == "empty":
        (tmp_path / "e.safetensors").write_bytes(b"")
        return tmp_path / "e.safetensors", {}
    if kind == "truncated":
        (tmp_path / "t.safetensors").write_bytes(data[: len(data) - 50])
        return tmp_path / "t.safetensors", {}
    if kind == "truncated-in-header":
        (tmp_path / "h.safetensors").write_bytes(data[:40])
        return tmp_path / "h.safetensors", {}
    if kind == "corrupted-header":
        (n,) = struct.unpack("<Q", data[:8])
        (tmp_path / "c.safetensors").write_bytes(data[:8] + b"{" + b"\x00garbage" * (n // 8) + data[9 + 8 * (n // 8):])
        return tmp_path / "c.safetensors", {}
    if kind == "wrong-offsets":
        header = raw_header(good)
        header["0.kernel"]["data_offsets"][1] += 4
        raw = json.dumps(header).encode()
        body = data[8 + struct.unpack("<Q", data[:8])[0]:]
        (tmp_path / "o.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body)
        return tmp_path / "o.safetensors", {}
    if kind == "text-as-pt":
        (tmp_path / "x.pt").write_text("hello, I am not a checkpoint\n")
        return tmp_path / "x.pt", {"spec": spec}
    if kind == "json-as-safetensors":
        (tmp_path / "j.safetensors").write_text('{"not": "an index"}')
        return tmp_path / "j.safetensors", {}
    if kind == "missing":
        return tmp_path / "nope.safetensors", {}
    if kind == "directory":
        return tmp_path, {}
    if kind == "other-architecture":
        other = db.Sequential([db.Dense(7, in_features=5), db.Dense(3)])
        db.save(db.compile(other, "numpy", seed=0), tmp_path / "other.safetensors")
        return tmp_path / "other.safetensors", {"spec": spec}
    raise AssertionError(kind)


BAD = ["empty", "truncated", "truncated-in-header", "corrupted-header", "wrong-offsets", "text-as-pt",
       "json-as-safetensors", "missing", "directory", "other-architecture"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_files_raise_checkpoint_error(tmp_path, kind):
    path, kwargs = _bad_file(tmp_path, kind)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if (tmp_path / n).is_file()}
    with pytest.raises(db.CheckpointError) as info:
        db.load(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message and str(path.name if path != tmp_path else path) in message
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if (tmp_path / n).is_file()}
    assert after == before  # reading never changes a file


def test_other_architecture_says_what_differs(tmp_path):
    path, kwargs = _bad_file(tmp_path, "other-architecture")
    with pytest.raises(db.CheckpointError) as info:
        db.load(path, **kwargs)
    msg = str(info.value)
    assert "missing keys ['0.mask', '2.kernel', '2.bias']" in msg
    assert "unexpected keys ['1.kernel', '1.bias']" in msg
    assert "0.kernel: file has shape (5, 7), the spec expects (5, 6)" in msg


@pytest.mark.parametrize("backend_name,ext", FORMATS, ids=[f"{b}{e}" for b, e in FORMATS])
def test_native_files_of_other_architecture_and_truncated(tmp_path, backend_name, ext):
    require_backend(backend_name)
    spec, other = make_spec(), db.Sequential([db.Dense(6, in_features=4, activation="relu"), db.Dense(3)])
    out = tmp_path / f"other{ext}"
    checkpoint.convert_file(str(_saved(tmp_path, other)), backend_name, str(out))
    with pytest.raises(db.CheckpointError, match="does not match|missing keys|expected|not be described"):
        db.load(out, spec=spec)
    data = out.read_bytes()
    cut = tmp_path / f"cut{ext}"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(db.CheckpointError):
        db.load(cut, spec=other)


def _saved(tmp_path, spec):
    p = tmp_path / "src.safetensors"
    db.save(db.compile(spec, "numpy", seed=0), p)
    return p


def test_native_file_without_spec_says_what_is_needed(tmp_path):
    require_backend("torch")
    out = tmp_path / "m.pt"
    checkpoint.convert_file(str(_saved(tmp_path, make_spec())), "torch", str(out))
    with pytest.raises(db.CheckpointError, match=r"holds parameters but not the model's structure.*spec=.*like="):
        db.load(out)


def test_pickled_torch_model_is_refused(tmp_path):
    require_backend("torch")
    import torch

    torch.save(db.compile(make_spec(), "torch", seed=0), tmp_path / "whole.pt")
    with pytest.raises(db.CheckpointError, match="weights_only"):
        db.load(tmp_path / "whole.pt", spec=make_spec())
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 3}, tmp_path / "train.pt")
    with pytest.raises(db.CheckpointError, match="not a plain state dict"):
        db.load(tmp_path / "train.pt", spec=make_spec())


# ----------------------------------------------------------------------------- writing safely
def test_unwritable_outputs(tmp_path):
    model = db.compile(make_spec(), "numpy", seed=0)
    (tmp_path / "afile").write_text("x")
    for target, match in [(tmp_path, "is a directory"), (tmp_path / "no" / "m.safetensors", "does not exist"),
                          (tmp_path / "afile" / "m.safetensors", "is a file, not a directory")]:
        with pytest.raises(db.CheckpointError, match=match):
            db.save(model, target)
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_failed_saves_leave_the_previous_file(tmp_path):
    path = tmp_path / "m.safetensors"
    db.save(db.compile(make_spec(), "numpy", seed=0), path)
    before = path.read_bytes()
    wrong = db.get_params(db.compile(db.Sequential([db.Dense(4, in_features=5)]), "numpy", seed=0))
    with pytest.raises(db.CheckpointError, match=str(path)):
        db.save((make_spec(), wrong), path)  # spec/params mismatch
    with pytest.raises(db.CheckpointError, match=r"params\['b'\]"):
        db.save({"a": np.ones(3), "b": object()}, path)
    with pytest.raises(TypeError, match="obj"):
        db.save(make_spec(), path)
    assert path.read_bytes() == before and tmp_leftovers(tmp_path) == []


FAIL_MID_WRITE = textwrap.dedent("""
    import resource, signal, sys
    import numpy as np
    import dense_bridge as db
    limit = int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    # 15 kB, 30 kB, 30 kB: with 20 kB shards the first shard is written whole, the second fails
    params = {"a": np.full((60, 64), 1, np.float32), "b": np.full((120, 64), 2, np.float32),
              "c": np.full((120, 64), 3, np.float32)}
    try:
        db.save(params, sys.argv[1], max_shard_size=None if sys.argv[3] == "-" else int(sys.argv[3]))
    except db.CheckpointError as exc:
        print("CheckpointError:", exc)
""")


@pytest.mark.parametrize("shard", ["-", "20000"])
def test_failure_mid_write_leaves_previous_checkpoint(tmp_path, shard):
    """A write that fails half way (file size limit: like a full disk) changes nothing on disk."""
    path = tmp_path / "m.safetensors"
    small = {f"w{i}": np.zeros((4,), np.float32) for i in range(8)}
    db.save(small, path, max_shard_size=None if shard == "-" else 40)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    run = subprocess.run([sys.executable, "-c", FAIL_MID_WRITE, str(path), "20000", shard],
                         capture_output=True, text=True, timeout=60)
    assert "CheckpointError: cannot write" in run.stdout, run.stdout + run.stderr
    assert "nothing was changed on disk" in run.stdout
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    assert after == before  # old files intact, no temporaries, no half-written shards


def test_future_format_version_is_refused(tmp_path):
    db.save({"w": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    data = (tmp_path / "a.safetensors").read_bytes().replace(b'"format_version":"1"', b'"format_version":"9"')
    (tmp_path / "b.safetensors").write_bytes(data)
    with pytest.raises(db.CheckpointError, match="format_version 9"):
        db.load(tmp_path / "b.safetensors")


def test_load_rejects_bad_arguments(tmp_path):
    path = _saved(tmp_path, make_spec())
    with pytest.raises(TypeError, match="path"):
        db.load(3)
    with pytest.raises(db.SpecError, match="backend"):
        db.load(path, "tensorflw")
    with pytest.raises(ValueError, match="format"):
        db.load(path, format="caffe")


def test_hub_style_sharded_torch_safetensors(tmp_path):
    """A model-hub checkpoint: torch-named safetensors shards plus an index without our metadata."""
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    spec = make_spec("bfloat16")
    model = db.compile(spec, "torch", seed=3)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = list(state)
    halves = {"hub-00001-of-00002.safetensors": names[:2], "hub-00002-of-00002.safetensors": names[2:]}
    for fname, keys in halves.items():
        st_torch.save_file({k: state[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "hub.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(db.CheckpointError, match="spec="):
        db.load(tmp_path / "hub.safetensors.index.json")
    loaded_spec, params = db.load(tmp_path / "hub.safetensors.index.json", spec=spec)
    assert bits(params) == bits(db.get_params(model))
    assert torch.equal(db.load(tmp_path / "hub.safetensors.index.json", "torch", spec=spec)[0].weight,
                       model[0].weight)


def test_keras_file_with_dense_bridge_layers_loads_in_a_fresh_process(tmp_path):
    """db.load registers dense_bridge's Keras classes itself before keras.saving.load_model."""
    pytest.importorskip("keras")
    path = tmp_path / "m.keras"
    model = db.compile(db.Sequential([db.Dense(4, in_features=3, activation="gelu",
                                               mask=db.wiring.banded(3, 4, 1)), db.Dense(2)]), "keras", seed=0)
    model.save(str(path))
    code = ("import dense_bridge as db, sys; spec, params = db.load(sys.argv[1]); "
            "print(spec.layers[0].activation.name, sorted(params))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "gelu" and "'0.mask'" in out.stdout


# ----------------------------------------------------------------------------- concurrent saves and loads
def _filled(spec, value: float) -> tuple:
    """(spec, params) with every parameter equal to ``value``: a mixed read shows as two values."""
    return spec, {k: np.full(s, value, d) for k, (s, d) in expected_params(spec).items()}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def test_reader_keeps_the_file_it_opened_when_a_save_replaces_it(tmp_path):
    """A save's os.replace landing between reading the header and the tensors never mixes files."""
    path = tmp_path / "m.safetensors"
    db.save(_filled(db.Dense(4, in_features=4), 1.0), path)
    ckpt = checkpoint.open_checkpoint(path)  # header parsed, no tensor read yet
    other = db.Sequential([db.Dense(2, in_features=2, dtype="float16"), db.Dense(300, dtype="float16")])
    db.save(db.compile(other, "numpy", seed=0), path)  # what another process does meanwhile
    spec, params = ckpt.spec, ckpt.params()
    ckpt.close()
    assert spec == db.Dense(4, in_features=4)
    assert {k: v.tolist() for k, v in params.items()} == {"kernel": [[1.0] * 4] * 4, "bias": [1.0] * 4}
    assert db.load(path)[0] == other  # and the path now reads the new file


def test_sharded_reader_survives_a_resave_between_index_and_shards(tmp_path):
    spec = db.Sequential([db.Dense(16, in_features=16) for _ in range(4)])
    path = tmp_path / "m.safetensors"
    db.save(_filled(spec, 1.0), path, max_shard_size=1200)
    ckpt = checkpoint.open_checkpoint(path)  # every shard open: a resave may now delete them
    db.save(_filled(spec, 2.0), path, max_shard_size=2200)
    assert {float(x) for v in ckpt.params().values() for x in np.unique(v)} == {1.0}
    ckpt.close()
    assert {float(x) for v in db.load(path)[1].values() for x in np.unique(v)} == {2.0}


def test_concurrent_saves_and_loads_of_one_path(tmp_path):
    """Two writers (sharded and single-file saves of different values) and a reader, all on one path:
    every load sees one whole checkpoint, and the last save leaves exactly its files behind."""
    import threading

    spec = db.Sequential([db.Dense(16, in_features=16) for _ in range(4)])
    path = tmp_path / "m.safetensors"
    db.save(_filled(spec, 1.0), path)
    failures = []

    def writer(value, shard):
        try:
            for i in range(60):
                db.save(_filled(spec, value), path, max_shard_size=shard if i % 3 else None)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append(exc)

    writers = [threading.Thread(target=writer, args=(1.0, 1200)), threading.Thread(target=writer, args=(2.0, 2200))]
    fds = _open_fds()
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers) or reads < 20:
        try:
            _, params = db.load(path)
        except Exception as exc:  # noqa: BLE001
            failures.append(exc)
            break
        values = {float(x) for v in params.values() for x in np.unique(v)}
        assert values in ({1.0}, {2.0}), values  # never one file's header with another's bytes
        reads += 1
    for w in writers:
        w.join()
    assert failures == []
    assert _open_fds() == fds  # every descriptor closed again
    names = sorted(os.listdir(tmp_path))
    if names != ["m.safetensors"]:  # the last save was sharded: the index and exactly its shards
        assert names[-1] == "m.safetensors.index.json"
        assert sorted(set(json.loads((tmp_path / names[-1]).read_text())["weight_map"].values())) == names[:-1]
    assert len({float(x) for v in db.load(path)[1].values() for x in np.unique(v)}) == 1


def test_resave_removes_only_what_the_replaced_index_named(tmp_path):
    """Other files matching the shard pattern (another save's, a user's) are never deleted."""
    spec = db.Sequential([db.Dense(16, in_features=16) for _ in range(2)])
    path = tmp_path / "m.safetensors"
    first = db.save(_filled(spec, 1.0), path, max_shard_size=1200)
    (tmp_path / "m-00001-of-00002.safetensors").write_bytes(b"someone else's")
    second = db.save(_filled(spec, 2.0), path, max_shard_size=1200)
    assert not any(os.path.exists(f) for f in first[:-1])
    assert sorted(os.listdir(tmp_path)) == sorted(["m-00001-of-00002.safetensors"] + [os.path.basename(f)
                                                                                      for f in second])


# ----------------------------------------------------------------------------- review findings
def test_reserved_metadata_key_is_refused_before_writing(tmp_path):
    path = tmp_path / "m.safetensors"
    db.save({"a": np.zeros(2, np.float32)}, path)
    before = path.read_bytes()
    for shard in (None, 8):
        with pytest.raises(db.CheckpointError, match="'__metadata__' is reserved"):
            db.save({"__metadata__": np.ones(3, np.float32), "a": np.zeros(2, np.float32)}, path,
                    max_shard_size=shard)
    assert os.listdir(tmp_path) == ["m.safetensors"] and path.read_bytes() == before


def test_load_like_names_like(tmp_path):
    path = _saved(tmp_path, make_spec())
    with pytest.raises(TypeError, match=r"like must be a native model.*Received: like=3") as info:
        db.load(path, like=3)
    assert "native=" not in str(info.value)


def test_save_lazy_spec_takes_width_from_params(tmp_path):
    lazy = db.Sequential([db.Dense(4, activation="relu"), db.Dense(2)])
    params = db.get_params(db.compile(lazy.with_in_features(3), "numpy", seed=0))
    db.save((lazy, params), tmp_path / "w.safetensors")  # as db.compile(lazy, params=...) infers it
    spec, loaded = db.load(tmp_path / "w.safetensors")
    assert spec == lazy.with_in_features(3) and bits(loaded) == bits(params)


BLOCK_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:  # torch as if not installed: find_spec and import both fail
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    import dense_bridge as db
    spec = db.from_config(sys.argv[2])
    for kwargs in ({"spec": spec}, {}):
        try:
            db.load(sys.argv[1], **kwargs)
        except db.BackendUnavailableError as exc:  # a missing framework, not a bad file
            print("BackendUnavailableError:", isinstance(exc, ImportError), exc)
""")


def test_torch_file_without_torch_names_the_extra(tmp_path):
    require_backend("torch")
    path = tmp_path / "m.pt"
    checkpoint.convert_file(str(_saved(tmp_path, make_spec())), "torch", str(path))
    run = subprocess.run([sys.executable, "-c", BLOCK_TORCH, str(path), json.dumps(make_spec().to_config())],
                         capture_output=True, text=True, timeout=60)
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2, run.stdout + run.stderr
    for line in lines:
        assert line.startswith("BackendUnavailableError: True")
        assert "needs torch, which is not installed" in line and "pip install 'dense-bridge[torch]'" in line
        assert "m.pt" in line


def test_mlx_safetensors_refuses_float64_and_reads_f64_written_elsewhere(tmp_path):
    require_backend("mlx")
    st_numpy = pytest.importorskip("safetensors.numpy")
    spec = db.Dense(3, in_features=2, dtype="float64")
    src = _saved(tmp_path, spec)
    out = tmp_path / "m.safetensors"
    # MLX neither writes nor reads F64 safetensors: such a file would be MLX's in name only
    with pytest.raises(db.CheckpointError, match=r"MLX cannot read float64.*\.npz"):
        checkpoint.convert_file(str(src), "mlx", str(out))
    assert not out.exists() and tmp_leftovers(tmp_path) == []
    checkpoint.convert_file(str(src), "mlx", str(tmp_path / "m.npz"))  # what the error suggests
    want = bits(db.load(src)[1])
    assert bits(db.load(tmp_path / "m.npz", spec=spec)[1]) == want
    # an F64 file in MLX's names written by another tool still loads (our reader, not mx.load)
    weights = {"weight": np.ascontiguousarray(db.load(src)[1]["kernel"].T), "bias": db.load(src)[1]["bias"]}
    st_numpy.save_file(weights, str(tmp_path / "other.safetensors"), metadata={"format": "mlx"})
    model = db.load(tmp_path / "other.safetensors", "mlx", spec=spec)
    assert bits(db.get_params(model)) == want


def test_release_file_pages_frees_only_clean_file_pages_and_keeps_values(tmp_path):
    """Streaming a native file to another backend drops the file pages of each layer once read
    (memory near one copy); anonymous memory, whose pages madvise would zero, is never touched."""
    from dense_bridge.checkpoints._pages import release_file_pages

    a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)  # 1 MiB
    path = tmp_path / "a.bin"
    a.tofile(path)
    anon = a.copy()
    assert release_file_pages([anon, anon.T]) == 0
    assert np.array_equal(anon, a)
    mapped = np.memmap(path, dtype=np.float32, mode="c", shape=a.shape)  # private file mapping, as torch's mmap
    assert float(mapped.sum()) == float(a.sum())  # resident now
    released = release_file_pages([mapped.T])  # a transposed view, as canonical kernels of torch weights are
    if sys.platform.startswith("linux"):
        assert released >= a.nbytes - 2 * 4096
    assert np.array_equal(mapped, a)  # faulted back in from the file: the same values


def test_a_torch_zip_file_converts_to_another_backend_bit_exact_after_page_release(tmp_path):
    require_backend("torch")
    spec = db.Sequential([db.Dense(64, in_features=48, activation="relu", mask=db.wiring.banded(48, 64, 3)),
                          db.Dense(16)])
    src = _saved(tmp_path, spec)
    checkpoint.convert_file(str(src), "torch", str(tmp_path / "t.pt"))
    want = bits(db.load(src)[1])
    for to in [b for b in ("numpy", "mlx", "keras") if b in db.available_backends()]:
        model = db.load(tmp_path / "t.pt", to, spec=spec)
        assert bits(db.get_params(model)) == want, to
