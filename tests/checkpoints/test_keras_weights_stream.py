""".weights.h5 -> another framework without a Keras model (memory near one copy).

A conversion of a Keras weights file to torch/MLX/numpy reads the HDF5 datasets straight from
the file, one layer when the target asks for it (``backends/keras/_files.file_views``), instead
of loading the whole file into a Keras template first. These tests hold that path to the same
results as the template path, bit for bit, and to the same refusals of bad files.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import CheckpointError
from dense_bridge.checkpoints import _native as native_files

from conftest import require_backend

h5py = pytest.importorskip("h5py")

TARGETS = ["numpy", "torch", "mlx"]


def _spec(dtype: str, *, mask: bool = True, bias: bool = True):
    first = db.Dense(6, in_features=5, activation="relu", dtype=dtype, use_bias=bias,
                     mask=db.wiring.random(5, 6, 0.5, seed=3) if mask else None)
    return db.Sequential([first, db.Activation("tanh"), db.Dense(4, dtype=dtype, use_bias=bias),
                          db.Identity(), db.Dense(3, activation="softmax", dtype=dtype)])


def _bits(params: dict) -> dict:
    return {k: (np.asarray(v).dtype.name, np.shape(v), np.ascontiguousarray(v).tobytes()) for k, v in params.items()}


def _weights_file(tmp_path, spec, seed: int = 1):
    require_backend("keras")
    model = db.compile(spec, "keras", seed=seed)
    path = str(tmp_path / "m.weights.h5")
    native_files.write_native(model, "keras", path, spec=spec)
    return model, path


class _PathSpy:
    """Records which way NativeCheckpoint read the file (the real methods run unchanged)."""

    def __init__(self, monkeypatch) -> None:
        self.streamed = []
        original = native_files.NativeCheckpoint._file_views

        def spy(checkpoint):
            views = original(checkpoint)
            self.streamed.append(views is not None)
            return views

        monkeypatch.setattr(native_files.NativeCheckpoint, "_file_views", spy)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype,mask,bias", [("float32", True, True), ("bfloat16", True, True),
                                             ("float32", False, False), ("float16", True, False)])
def test_streamed_read_is_bit_exact_and_builds_no_keras_model(tmp_path, monkeypatch, target, dtype, mask, bias):
    require_backend(target)
    spec = _spec(dtype, mask=mask, bias=bias)
    model, path = _weights_file(tmp_path, spec)
    spy = _PathSpy(monkeypatch)
    out = db.load(path, target)
    assert spy.streamed == [True]
    assert db.backend(out) == target
    assert _bits(db.get_params(out)) == _bits(db.get_params(model))


def test_plain_keras_file_with_other_class_names_streams_bit_exact(tmp_path, monkeypatch):
    """A user's keras.Sequential of plain Dense layers with activations: the adapter would build
    its own Dense subclass, so the names differ; Keras' per-class counter gives the order."""
    require_backend("keras")
    import keras

    km = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                           keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    path = str(tmp_path / "user.weights.h5")
    km.save_weights(path)
    spy = _PathSpy(monkeypatch)
    out = db.load(path, "numpy", spec=db.to_spec(km))
    assert spy.streamed == [True]
    assert _bits(db.get_params(out)) == _bits(db.get_params(km))


def _rewrite(path: str, out: str, **dataset_options) -> None:
    """A copy of the weights file whose datasets are stored with ``dataset_options`` (h5py)."""
    with h5py.File(path, "r") as src, h5py.File(out, "w") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                data = obj[()]
                options = dataset_options if data.ndim else {}
                made = dst.create_dataset(name, data=data, **options)
                for key, value in obj.attrs.items():
                    made.attrs[key] = value
            else:
                dst.require_group(name)

        src.visititems(visit)


@pytest.mark.parametrize("options", [{"chunks": True, "compression": "gzip"}, {"chunks": True}],
                         ids=["gzip", "chunked"])
def test_chunked_or_compressed_datasets_are_read_by_h5py(tmp_path, options):
    spec = _spec("bfloat16")
    model, path = _weights_file(tmp_path, spec)
    other = str(tmp_path / "packed.weights.h5")
    _rewrite(path, other, **options)
    with h5py.File(other) as f:
        assert f["layers/dense_bridge_dense/vars/0"].chunks is not None
    assert _bits(db.get_params(db.load(other, "numpy"))) == _bits(db.get_params(model))


def test_dataset_bytes_beyond_the_end_of_the_file_are_a_checkpoint_error(tmp_path):
    spec = _spec("float32")
    _, path = _weights_file(tmp_path, spec)
    offsets = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: offsets.append(obj.id.get_offset()) if isinstance(obj, h5py.Dataset) else None)
    with open(path, "r+b") as f:
        f.truncate(max(offsets) + 8)  # the header and every dataset but the last stay whole
    with pytest.raises(CheckpointError, match="m.weights.h5"):
        db.load(path, "numpy")


@pytest.mark.parametrize("target", ["numpy", "keras"])
def test_external_storage_is_refused_not_followed(tmp_path, target):
    spec = _spec("float32", mask=False)
    model, path = _weights_file(tmp_path, spec)
    secret = tmp_path / "elsewhere.bin"
    kernel = np.asarray(db.get_params(model)["2.kernel"])  # saved as layers/dense
    secret.write_bytes(kernel.tobytes())
    other = str(tmp_path / "external.weights.h5")
    _rewrite(path, other)
    with h5py.File(other, "a") as f:
        name = "layers/dense/vars/0"
        del f[name]
        f.create_dataset(name, shape=kernel.shape, dtype=kernel.dtype, external=[(str(secret), 0, kernel.nbytes)])
    with pytest.raises(CheckpointError, match="external.weights.h5.*other files"):
        db.load(other, target)


def test_wrong_shape_is_listed_before_anything_is_read(tmp_path, monkeypatch):
    spec = _spec("float32")
    _, path = _weights_file(tmp_path, spec)
    wider = _spec("float32").layers
    other_spec = db.Sequential([wider[0], wider[1], db.Dense(5), wider[3], db.Dense(3, activation="softmax")])
    spy = _PathSpy(monkeypatch)
    with pytest.raises(CheckpointError, match=r"m\.weights\.h5 does not match the spec.*\(6, 5\)"):
        db.load(path, "numpy", spec=other_spec)
    assert spy.streamed == []  # refused inside the streaming reader, before any view was made


def test_structure_twin_keeps_classes_and_shrinks_every_width():
    spec = _spec("bfloat16")
    twin = native_files.structure_twin(spec)
    assert [type(l) for l in twin.layers] == [type(l) for l in spec.layers]
    dense = [l for l in twin.layers if isinstance(l, db.Dense)]
    assert all((l.units, l.in_features) == (1, 1) and l.dtype == "bfloat16" for l in dense)
    assert dense[0].mask is not None and dense[0].mask.shape == (1, 1)
    assert [l.use_bias for l in dense] == [l.use_bias for l in spec.layers if isinstance(l, db.Dense)]
    assert [l.activation for l in dense] == [l.activation for l in spec.layers if isinstance(l, db.Dense)]


# ------------------------------------------------------------------ MLX .safetensors, the same way
@pytest.mark.parametrize("target", ["numpy", "torch", "canonical"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_file_streams_bit_exact_without_an_mlx_model(tmp_path, monkeypatch, target, dtype):
    require_backend("mlx")
    if target != "canonical":
        require_backend(target)
    from dense_bridge import checkpoints as checkpoint

    spec = _spec(dtype)
    model = db.compile(spec, "mlx", seed=2)
    path = str(tmp_path / "m.safetensors")
    native_files.write_native(model, "mlx", path, spec=spec)
    spy = _PathSpy(monkeypatch)
    if target == "canonical":
        out = str(tmp_path / "c.safetensors")
        checkpoint.convert_file(path, "canonical", out)
        got = db.load(out)[1]
    else:
        got = db.get_params(db.load(path, target))
    assert spy.streamed == [True]
    assert _bits(got) == _bits(db.get_params(model))


# ------------------------------------------------------------------ torch .pt (zip) and torch .safetensors
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("target", ["numpy", "keras", "canonical"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_file_streams_bit_exact_without_a_torch_model(tmp_path, monkeypatch, suffix, target, dtype):
    require_backend("torch")
    if target != "canonical":
        require_backend(target)
    from dense_bridge import checkpoints as checkpoint

    spec = _spec(dtype)
    model = db.compile(spec, "torch", seed=3)
    path = str(tmp_path / f"m{suffix}")
    native_files.write_native(model, "torch", path, spec=spec)
    spy = _PathSpy(monkeypatch)
    if target == "canonical":
        out = str(tmp_path / "c.safetensors")
        checkpoint.convert_file(path, "canonical", out, spec=spec)
        got = db.load(out)[1]
    else:
        got = db.get_params(db.load(path, target, spec=spec))
    assert spy.streamed == [True]
    assert _bits(got) == _bits(db.get_params(model))


def test_torch_file_with_other_names_is_refused_listing_them(tmp_path):
    require_backend("torch")
    import torch

    spec = _spec("float32")
    model = db.compile(spec, "torch", seed=3)
    path = str(tmp_path / "renamed.pt")
    torch.save({"model." + k: v for k, v in model.state_dict().items()}, path)
    with pytest.raises(CheckpointError, match=r"renamed\.pt does not match the spec"):
        db.load(path, "numpy", spec=spec)


# ------------------------------------------------------------------ a .weights.h5 conversion that fails part-way
@pytest.mark.parametrize("target", ["torch", "canonical", "mlx"])
def test_a_conversion_that_fails_mid_stream_leaves_nothing_behind(tmp_path, monkeypatch, target):
    """The first layer reads fine, a later one's compressed chunk is corrupt: the streamed
    conversion stops with a CheckpointError naming the file, and no output, shard or temporary
    file is left where the output would have gone."""
    if target != "canonical":
        require_backend(target)
    from dense_bridge import checkpoints as checkpoint

    spec = _spec("float32")
    _, path = _weights_file(tmp_path, spec)
    packed = str(tmp_path / "packed.weights.h5")
    _rewrite(path, packed, chunks=True, compression="gzip")
    with h5py.File(packed) as f:
        at = f["layers/dense/vars/0"].id.get_chunk_info(0).byte_offset  # layer 2 (plain Dense); layer 0 reads fine
    with open(packed, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 8)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / {"torch": "m.pt", "canonical": "m.safetensors", "mlx": "m.safetensors"}[target])
    spy = _PathSpy(monkeypatch)
    with pytest.raises(CheckpointError, match="packed.weights.h5"):
        checkpoint.convert_file(packed, target, out)
    assert spy.streamed == [True]  # it failed inside the streaming reader, not before it
    assert sorted(p.name for p in out_dir.iterdir()) == []

