"""Hostile torch.distributed.checkpoint (DCP) directories: no code from the directory runs.

DCP pickles its ``.metadata``; dense_bridge reads it through an allow-list unpickler (DCP's own
metadata classes, torch.Size, torch dtypes, paths, plain containers) and refuses non-tensor
entries, which DCP would ``torch.load(weights_only=False)``. Each code-execution case has a
positive control: the same payload does run (it creates a marker file) when unpickled plainly,
so a test that passes cannot be a payload that would never have fired.

Directories written by dense_bridge and by torch's own ``dcp.save`` still load bit-exactly.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import dense_bridge as db  # noqa: E402

SPEC = db.Sequential([db.Dense(6, in_features=4, activation="relu"), db.Dense(3)])


class _RunsCode:
    """Unpickling this runs ``os.system("touch <marker>")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _payload(marker: str) -> bytes:
    return pickle.dumps(_RunsCode(marker))


def _saved(tmp_path, name="ckpt"):
    model = db.compile(SPEC, "torch", seed=3)
    path = str(tmp_path / name)
    db.save(model, path, format="dcp")
    return model, path


def _snapshot(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def _metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()  # a trusted file of our own making: plain pickle


# ------------------------------------------------------------------ still loads
def test_dense_bridge_dcp_directory_loads_bit_exact(tmp_path):
    model, path = _saved(tmp_path)
    spec, params = db.load(path)
    assert spec == SPEC
    for key, value in db.get_params(model).items():
        np.testing.assert_array_equal(params[key], value)
    again = db.load(path, "torch")
    for key, value in db.get_params(again).items():
        np.testing.assert_array_equal(params[key], value)


def test_torch_dcp_save_directory_loads_with_spec(tmp_path):
    model = db.compile(SPEC, "torch", seed=4)
    path = str(tmp_path / "torch_own")
    dcp.save({k: v.clone() for k, v in model.state_dict().items()}, checkpoint_id=path, no_dist=True)
    assert not os.path.exists(os.path.join(path, "dense_bridge_spec.json"))
    spec, params = db.load(path, spec=SPEC)
    for key, value in db.get_params(model).items():
        np.testing.assert_array_equal(params[key], value)


# ------------------------------------------------------------------ code in .metadata
def test_metadata_that_runs_code_is_refused_unrun(tmp_path):
    _, path = _saved(tmp_path)
    marker = tmp_path / "ran"
    payload = _payload(str(marker))
    pickle.loads(payload)  # positive control: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(payload)
    before = _snapshot(path)
    with pytest.raises(db.CheckpointError, match=r"\.metadata names posix\.system.*refused"):
        db.load(path)
    with pytest.raises(db.CheckpointError, match=r"refused"):
        db.load(path, "torch")
    assert not marker.exists()
    assert _snapshot(path) == before


def test_payload_hidden_inside_real_metadata_is_refused(tmp_path):
    _, path = _saved(tmp_path)
    marker = tmp_path / "ran"
    meta = _metadata(path)
    meta.storage_meta.modules = [_RunsCode(str(marker))]  # a field deep inside DCP's own dataclass
    payload = pickle.dumps(meta)
    pickle.loads(payload)  # positive control
    assert marker.exists()
    marker.unlink()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(payload)
    with pytest.raises(db.CheckpointError, match="never holds"):
        db.load(path)
    assert not marker.exists()


@pytest.mark.parametrize("global_name", [b"builtins\neval\n", b"subprocess\nPopen\n", b"torch\nload\n",
                                         b"torch.distributed.checkpoint.filesystem\nFileSystemReader\n"])
def test_metadata_naming_any_other_global_is_refused(tmp_path, global_name):
    _, path = _saved(tmp_path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"c" + global_name + b".")  # protocol 0: GLOBAL, STOP
    with pytest.raises(db.CheckpointError, match="never holds"):
        db.load(path)


def test_tensor_stored_as_pickled_bytes_is_refused_unrun(tmp_path):
    """A .metadata that calls a tensor "bytes": DCP would torch.load(weights_only=False) the data."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _, path = _saved(tmp_path)
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_RunsCode(str(marker)), buf)
    blob = buf.getvalue()
    torch.load(io.BytesIO(blob), weights_only=False)  # positive control: how DCP reads bytes entries
    assert marker.exists()
    marker.unlink()
    meta = _metadata(path)
    fqn = next(k for k in meta.state_dict_metadata if k.endswith("weight"))
    meta.state_dict_metadata[fqn] = BytesStorageMetadata()
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    info = meta.storage_data.pop(index)
    with open(os.path.join(path, "evil.distcp"), "wb") as f:
        f.write(blob)
    meta.storage_data[type(index)(fqn)] = type(info)(relative_path="evil.distcp", offset=0, length=len(blob))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(db.CheckpointError, match="pickled bytes"):
        db.load(path)
    assert not marker.exists()


# ------------------------------------------------------------------ files it points at
@pytest.mark.parametrize("relative", ["../outside.distcp", "/etc/passwd", "sub/x.distcp", ".."])
def test_data_file_outside_the_directory_is_refused(tmp_path, relative):
    _, path = _saved(tmp_path)
    meta = _metadata(path)
    for index, info in list(meta.storage_data.items()):
        meta.storage_data[index] = type(info)(relative_path=relative, offset=info.offset, length=info.length)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(db.CheckpointError, match="outside its directory"):
        db.load(path)


def test_negative_byte_range_is_refused(tmp_path):
    _, path = _saved(tmp_path)
    meta = _metadata(path)
    index, info = next(iter(meta.storage_data.items()))
    meta.storage_data[index] = type(info)(relative_path=info.relative_path, offset=-8, length=info.length)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(db.CheckpointError, match="bad byte range"):
        db.load(path)


@pytest.mark.parametrize("junk", [b"", b"\x80\x04", b"not a pickle at all", pickle.dumps([1, 2, 3]),
                                  pickle.dumps({"a": (1, 2)})])
def test_malformed_metadata_is_a_checkpoint_error(tmp_path, junk):
    _, path = _saved(tmp_path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(junk)
    with pytest.raises(db.CheckpointError, match=r"\.metadata"):
        db.load(path)


def test_dcp_not_fitting_the_model_is_one_checkpoint_error(tmp_path):
    """DCP's CheckpointException is a BaseException: it must not leave the library."""
    _, path = _saved(tmp_path)
    other = db.Sequential([db.Dense(5, in_features=4, activation="relu"), db.Dense(3)])
    with pytest.raises(db.CheckpointError) as info:
        db.load(path, spec=other)
    assert "\n" not in str(info.value)


# FIFOs and symlinks to them: refused at once. A regression would block forever in open(), so
# each case runs in a subprocess under a generous timeout (never a timed assertion).
_FIFO_RUNNER = r"""
import sys, dense_bridge as db
try:
    db.load(sys.argv[1])
except db.CheckpointError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("victim,via_symlink", [(".metadata", False), (".metadata", True),
                                                ("data", False), ("data", True),
                                                ("dense_bridge_spec.json", False)])
def test_fifo_in_a_dcp_directory_is_refused_at_once(tmp_path, victim, via_symlink):
    _, path = _saved(tmp_path)
    if victim == "data":
        victim = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    target = os.path.join(path, victim)
    os.remove(target)
    if via_symlink:
        fifo = str(tmp_path / "pipe")
        os.mkfifo(fifo)
        os.symlink(fifo, target)
    else:
        os.mkfifo(target)
    run = subprocess.run([sys.executable, "-c", _FIFO_RUNNER, path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("REFUSED") and "FIFO" in run.stdout, run.stdout


def test_deep_json_spec_file_is_a_checkpoint_error(tmp_path):
    _, path = _saved(tmp_path)
    with open(os.path.join(path, "dense_bridge_spec.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(db.CheckpointError, match="nested"):
        db.load(path)


def test_spec_file_claiming_more_than_available_memory_is_refused(tmp_path):
    _, path = _saved(tmp_path)
    huge = db.Dense(200_000, in_features=200_000, dtype="float64")  # 320 GB of parameters
    with open(os.path.join(path, "dense_bridge_spec.json"), "w") as f:
        json.dump(huge.to_config(), f)
    with pytest.raises(db.CheckpointError, match="MemAvailable"):
        db.load(path)
