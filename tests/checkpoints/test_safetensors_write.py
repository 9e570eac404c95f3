"""Filling a file's tensor slots (``dense_bridge.checkpoints._file_fill.fill``, what every checkpoint writer
ends with): the bytes on disk are each tensor in C order, little-endian, whatever the source
view's strides, written in bounded pieces while the next piece is prepared; NaN/Inf refusals
name the tensor; checksums are zlib's CRC-32 of the bytes written."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from dense_bridge.checkpoints import _file_fill
from dense_bridge._errors import CheckpointError
from dense_bridge.checkpoints._file_fill import Slot, fill
from dense_bridge.checkpoints._safetensors import PendingTensor, SafetensorsFile, write_safetensors


@pytest.fixture(params=["workers", "writer"])
def small_pieces(monkeypatch, request):
    """A few rows per piece, so every split path runs; prepared by the worker threads, or (tensors
    under _INLINE bytes) by the writing thread itself."""
    monkeypatch.setattr(_file_fill, "PIECE", 96)
    monkeypatch.setattr(_file_fill, "_INLINE", 0 if request.param == "workers" else 1 << 30)


def _fill_and_read(tmp_path, arrays: dict[str, np.ndarray], **kwargs) -> tuple[bytes, list[int], dict]:
    slots, offset, starts = [], 16, []  # a 16-byte "header" before the first slot
    for name, a in arrays.items():
        slots.append(Slot(name, offset, a.dtype, a.shape, lambda a=a: a))
        starts.append(offset)
        offset += a.nbytes
    path = tmp_path / "out.bin"
    with open(path, "wb") as f:
        f.write(b"H" * 16)
        f.flush()
        crcs = fill(f.fileno(), slots, **kwargs)
    return path.read_bytes(), starts, crcs


def _views() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base3 = rng.standard_normal((3, 7, 5)).astype(np.float32)
    return {
        "transposed": rng.standard_normal((13, 9)).astype(np.float32).T,  # the blocked-transpose path
        "transposed_f16": rng.standard_normal((40, 3)).astype(np.float16).T,
        "swapped_3d": base3.swapaxes(1, 2),  # a Bilinear kernel in MLX's layout
        "strided": np.arange(4 * 6 * 5, dtype=np.float64).reshape(4, 6, 5)[:, ::2, 1:],
        "big_endian": np.arange(30, dtype=">f4").reshape(5, 6),
        "bias": rng.standard_normal(50).astype(np.float32),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "wide_row": rng.standard_normal((2, 40)).astype(np.float64),  # one row > a piece: split inside it
    }


@pytest.mark.usefixtures("small_pieces")
def test_every_view_is_written_in_c_order_little_endian_at_its_offset(tmp_path):
    arrays = _views()
    raw, starts, crcs = _fill_and_read(tmp_path, arrays, checksums=True)
    assert raw[:16] == b"H" * 16
    for (name, a), start in zip(arrays.items(), starts):
        expected = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        assert raw[start:start + len(expected)] == expected, name
        assert crcs[name] == zlib.crc32(expected), name


@pytest.mark.usefixtures("small_pieces")
def test_nonfinite_values_are_refused_naming_the_tensor_in_both_paths(tmp_path):
    for bad in (np.array([[1.0, np.nan], [0.0, 1.0]], np.float32).T,  # transposed
                np.array([1.0, np.inf], np.float32)):  # contiguous
        with pytest.raises(CheckpointError, match=r"'w'.*NaN/Inf"):
            _fill_and_read(tmp_path, {"ok": np.ones(3, np.float32), "w": bad}, check_finite=True)
        _fill_and_read(tmp_path, {"w": bad})  # allowed unless asked


@pytest.mark.usefixtures("small_pieces")
def test_a_failing_producer_stops_the_fill_and_its_error_arrives(tmp_path):
    def broken():
        raise OSError("the source vanished")

    slots = [Slot("a", 0, np.dtype(np.float32), (4,), lambda: np.ones(4, np.float32)),
             Slot("b", 16, np.dtype(np.float32), (4,), broken)]
    with open(tmp_path / "f", "wb") as f, pytest.raises(OSError, match="vanished"):
        fill(f.fileno(), slots)


@pytest.mark.usefixtures("small_pieces")
def test_a_producer_returning_the_wrong_shape_is_refused(tmp_path):
    slots = [Slot("a", 0, np.dtype(np.float32), (4,), lambda: np.ones(5, np.float32))]
    with open(tmp_path / "f", "wb") as f, pytest.raises(CheckpointError, match="'a' changed while being written"):
        fill(f.fileno(), slots)


@pytest.mark.usefixtures("small_pieces")
def test_a_failing_write_stops_the_worker(tmp_path):
    arrays = {f"t{i}": np.ones((64, 64), np.float32).T for i in range(6)}
    slots = [Slot(n, 0, a.dtype, a.shape, lambda a=a: a) for n, a in arrays.items()]
    (tmp_path / "f").write_bytes(b"")
    with open(tmp_path / "f", "rb") as f, pytest.raises(OSError):
        fill(f.fileno(), slots)  # a read-only descriptor: the first pwrite fails


@pytest.mark.usefixtures("small_pieces")
def test_safetensors_written_from_mapped_transposed_views_reads_back(tmp_path):
    rng = np.random.default_rng(1)
    src = {"a": rng.standard_normal((33, 17)).astype(np.float32), "b": rng.standard_normal(17).astype(np.float32)}
    with open(tmp_path / "src.safetensors", "wb") as f:
        write_safetensors(f, {k: PendingTensor(v.dtype, v.shape, lambda v=v: v) for k, v in src.items()})
    with SafetensorsFile(tmp_path / "src.safetensors") as mapped:
        views = {"a_t": mapped.get("a").T, "b": mapped.get("b")}
        with open(tmp_path / "out.safetensors", "wb") as f:
            total = write_safetensors(f, {k: PendingTensor(v.dtype, v.shape, lambda v=v: v) for k, v in views.items()})
            assert f.tell() == total
    with SafetensorsFile(tmp_path / "out.safetensors") as back:
        np.testing.assert_array_equal(back.get("a_t"), src["a"].T)
        np.testing.assert_array_equal(back.get("b"), src["b"])
    assert (tmp_path / "out.safetensors").stat().st_size == total
