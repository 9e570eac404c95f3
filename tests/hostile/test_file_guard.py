"""Every reader opens its file through the one guard (dense_bridge/checkpoints/_guard.py).

For each reader kind (safetensors, Keras .weights.h5, keras-hub .lora.h5, ONNX, torch .pt/.bin,
npz, MLX .safetensors/.npz, Flax msgpack, Equinox eqx) a FIFO, a FIFO behind a symlink, a
symlink to /dev/zero, a directory named like the weight file and a file deleted between listing
and reading each give a CheckpointError naming the file, at once: SIGALRM ends a test that
blocks (a reader waiting on a FIFO would otherwise hang the run). The guard's own checks (a
symlink out of the folder, a size past the limit, the memory available) are tested on it and
through the readers that take them.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import checkpoints as checkpoint
from dense_bridge._errors import CheckpointError
from dense_bridge.checkpoints import _guard
from dense_bridge.checkpoints._safetensors import read_json_file

from conftest import require_backend

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")

SPEC = db.Sequential([db.Dense(5, in_features=3, activation="relu"), db.Dense(2)])


@pytest.fixture(autouse=True)
def _deadline():
    """Fail (never hang) when a reader blocks: SIGALRM interrupts the blocked call (a library may
    turn the interrupted open into its own error, so the alarm going off fails the test itself)."""
    fired = []

    def expired(signum, frame):
        fired.append(signum)
        raise TimeoutError("a reader blocked on a file the guard should have refused")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired, "a reader blocked (interrupted after 20 s) on a file the guard should have refused"


def _safetensors(path):
    from dense_bridge.checkpoints._safetensors import SafetensorsFile

    SafetensorsFile(path).close()


def _keras_h5(path):
    from dense_bridge.backends.keras._files import file_info

    file_info(path, "h5")


def _keras_lora(path):
    import keras

    from dense_bridge.backends.keras._lora import load_lora_h5

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    load_lora_h5(model, path)


def _onnx(path):
    from dense_bridge.backends.onnx._files import read_model

    read_model(path)


def _torch(container):
    def read(path):
        from dense_bridge.backends.torch._files import file_info

        file_info(path, container)
    return read


def _torch_port_bin(path):
    from dense_bridge.backends.torch._ports import PickleWeights

    PickleWeights(path)


def _npz(path):
    from dense_bridge.checkpoints._npz import read_npz

    read_npz(path, lambda reason: CheckpointError(f"cannot read {path}: {reason}"))


def _mlx_npz(path):
    from dense_bridge.backends.mlx._files import file_info

    file_info(path, "npz")


def _flax(path):
    from dense_bridge.backends.flax._files import file_info

    file_info(path, "msgpack")


def _equinox(path):
    from dense_bridge.backends.equinox._files import file_info

    file_info(path, "eqx")


#: kind -> (backend needed, file name, reader, backend that writes a valid file of it or None)
READERS = {
    "safetensors": (None, "model.safetensors", _safetensors, "numpy"),
    "keras .weights.h5": ("keras", "model.weights.h5", _keras_h5, "keras"),
    "keras-hub .lora.h5": ("keras", "adapter.lora.h5", _keras_lora, None),
    "onnx": ("onnx", "model.onnx", _onnx, "onnx"),
    "torch .pt": ("torch", "model.pt", _torch("torch-zip"), "torch"),
    "torch .bin (legacy)": ("torch", "pytorch_model.bin", _torch("torch-legacy"), None),
    "torch port .bin": ("torch", "pytorch_model.bin", _torch_port_bin, None),
    "npz": (None, "model.npz", _npz, None),
    "mlx .npz": ("mlx", "weights.npz", _mlx_npz, None),
    "mlx .safetensors": ("mlx", "model.safetensors", _safetensors, "mlx"),
    "flax msgpack": ("flax", "model.msgpack", _flax, "flax"),
    "equinox eqx": ("equinox", "model.eqx", _equinox, "equinox"),
}


def _hostile(tmp_path, name: str, how: str) -> str:
    """``name`` in a model folder made hostile ``how``; returns its path."""
    folder = tmp_path / "model"
    folder.mkdir()
    target = folder / name
    if how == "fifo":
        os.mkfifo(target)
    elif how == "fifo via symlink":
        os.mkfifo(tmp_path / "pipe")
        os.symlink(tmp_path / "pipe", target)
    elif how == "/dev/zero symlink":
        os.symlink("/dev/zero", target)
    elif how == "directory":
        target.mkdir()
    elif how == "deleted":
        target.write_bytes(b"\0" * 64)
        listed = sorted(os.listdir(folder))  # listed here, removed before the reader opens it
        assert listed == [name]
        target.unlink()
    return str(target)


@pytest.mark.parametrize("how", ["fifo", "fifo via symlink", "/dev/zero symlink", "directory", "deleted"])
@pytest.mark.parametrize("kind", list(READERS))
def test_every_reader_refuses_a_hostile_file_at_once(tmp_path, kind, how):
    backend, name, read, _ = READERS[kind]
    if backend:
        require_backend(backend)
    path = _hostile(tmp_path, name, how)
    with pytest.raises(CheckpointError) as caught:
        read(path)
    assert path in str(caught.value), caught.value


@pytest.mark.parametrize("kind", [k for k, v in READERS.items() if v[3]])
def test_every_reader_still_reads_a_good_file(tmp_path, kind):
    """The refusals above are the guard's, not a reader that reads nothing."""
    backend, name, read, writer = READERS[kind]
    if backend:
        require_backend(backend)
    src = str(tmp_path / "src.safetensors")
    db.save(db.compile(SPEC, "numpy", seed=0), src)
    out = str(tmp_path / name)
    if writer == "numpy":
        out = src
    else:
        checkpoint.convert_file(src, writer, out)
    read(out)


def test_npz_reads_a_good_archive(tmp_path):
    path = str(tmp_path / "a.npz")
    np.savez(path, w=np.arange(6, dtype=np.float32).reshape(2, 3))
    from dense_bridge.checkpoints._npz import read_npz

    got = read_npz(path, lambda reason: CheckpointError(reason))
    np.testing.assert_array_equal(got["w"], np.arange(6, dtype=np.float32).reshape(2, 3))


# ------------------------------------------------------------------ the guard's own checks
def test_a_symlink_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"x" * 16)
    os.symlink(outside, folder / "model.safetensors")
    (folder / "inner.bin").write_bytes(b"y" * 16)
    os.symlink(folder / "inner.bin", folder / "alias.bin")
    with pytest.raises(CheckpointError, match="outside the folder") as caught:
        _guard.open_input(folder / "model.safetensors", what="safetensors file", inside=folder)
    assert str(folder / "model.safetensors") in str(caught.value)
    with pytest.raises(CheckpointError, match="outside the folder"):
        _guard.open_input(folder / ".." / "secret.bin", what="weight file", inside=folder)
    os.close(_guard.open_input(folder / "alias.bin", what="weight file", inside=folder))  # a link inside is fine


def test_onnx_external_data_linked_out_of_the_folder_is_refused(tmp_path):
    require_backend("onnx")
    import onnx
    from onnx import helper, numpy_helper

    from dense_bridge.backends.onnx._files import read_model

    folder = tmp_path / "model"
    folder.mkdir()
    weight = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])], [weight])
    model = helper.make_model(graph)
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    assert read_model(str(folder / "model.onnx")).graph.initializer[0].raw_data  # the good file reads
    data = folder / "model.onnx.data"
    os.replace(data, tmp_path / "elsewhere.data")
    os.symlink(tmp_path / "elsewhere.data", data)
    with pytest.raises(CheckpointError, match="outside") as caught:
        read_model(str(folder / "model.onnx"))
    assert str(folder / "model.onnx") in str(caught.value)
    os.unlink(data)
    os.mkfifo(data)
    with pytest.raises(CheckpointError, match="FIFO") as caught:
        read_model(str(folder / "model.onnx"))
    assert "model.onnx.data" in str(caught.value)


def test_a_file_past_its_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": "' + "x" * 1000 + '"}')
    with pytest.raises(CheckpointError, match="more than the 100 allowed") as caught:
        _guard.open_input(path, what="model config", limit=100)
    assert str(path) in str(caught.value) and "model config" in str(caught.value)
    with pytest.raises(CheckpointError, match="more than the 100 allowed") as caught:
        read_json_file(str(path), "model config", limit=100)
    assert str(path) in str(caught.value)
    assert read_json_file(str(path), "model config")["a"] == "x" * 1000


def test_a_file_past_the_memory_available_is_refused_when_read_whole(tmp_path, monkeypatch):
    path = tmp_path / "model.msgpack"
    path.write_bytes(b"\x80" * 4096)
    monkeypatch.setattr(_guard, "available_memory", lambda: 1024)  # a machine with 1 KiB free
    with pytest.raises(CheckpointError, match="only 1,024 bytes of memory") as caught:
        _guard.open_input(path, what="Flax msgpack checkpoint", whole=True)
    assert str(path) in str(caught.value)
    os.close(_guard.open_input(path, what="Flax msgpack checkpoint"))  # mapped, not read whole: no check


def test_input_path_hands_over_the_checked_inode_not_the_name(tmp_path):
    """A swap of the name after the check changes nothing: the library opens the same inode."""
    path = tmp_path / "model.bin"
    path.write_bytes(b"first")
    with _guard.input_path(path, what="weight file") as checked:
        os.replace(tmp_path / "model.bin", tmp_path / "old.bin")
        os.mkfifo(path)  # a FIFO where the checked file was
        with open(checked, "rb") as f:
            assert f.read() == b"first"
