"""MLX arrays filled by dense_bridge (backends/mlx/_fill.py): MLX allocates through ``mx.load`` of a
stream, dense_bridge copies into that memory with the NaN/Inf check in the same pass.

Against the path it replaces (``mx.array`` copies with the scan beside them, forced by switching
the C kernel off): the same classes, the same bits in every dtype, the same refusals with the same
words, errors raised on the calling thread once MLX has finished, and no thread left behind.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import dense_bridge as db  # noqa: E402
from dense_bridge import _transfer  # noqa: E402
from dense_bridge.backends.mlx import _fill, _layers  # noqa: E402

needs_fused = pytest.mark.skipif(_transfer.FUSED is None, reason="dense_bridge._fused is not built here")
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
FILLED = ("float32", "float16", "bfloat16")  # MLX's safetensors reader has no float64


def _torch_mlp(dtype: str, bias: bool = True) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40, bias=bias), torch.nn.ReLU(),
                               torch.nn.Linear(40, 8, bias=bias)).to(TORCH[dtype])


def _bits(array) -> np.ndarray:
    a = np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    a = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


@pytest.fixture
def counted_fills(monkeypatch):
    """How many arrays went through _fill.filled_arrays (so a test knows which path ran)."""
    made = []
    real = _fill.filled_arrays

    def counting(arrays, fill):
        made.extend(arrays)
        return real(arrays, fill)
    monkeypatch.setattr(_layers, "filled_arrays", counting)
    return made


@needs_fused
@pytest.mark.parametrize("dtype", list(TORCH))
@pytest.mark.parametrize("bias", [True, False])
def test_torch_to_mlx_is_filled_bit_for_bit(counted_fills, dtype, bias):
    model = _torch_mlp(dtype, bias)
    out = db.convert(model, to="mlx")
    assert len(counted_fills) == ((4 if bias else 2) if dtype in FILLED else 0)
    assert [type(m) for m in out.layers] == [nn.Linear, nn.ReLU, nn.Linear]
    for mine, theirs in ((out.layers[0], model[0]), (out.layers[2], model[2])):
        assert mine.weight.dtype == getattr(mx, dtype)
        assert np.array_equal(_bits(mine.weight), _torch_bits(theirs.weight))
        if bias:
            assert np.array_equal(_bits(mine.bias), _torch_bits(theirs.bias))
        else:
            assert "bias" not in mine
    x = np.random.default_rng(1).standard_normal((3, 24)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x).to(TORCH[dtype])).float().numpy()
    got = np.asarray(out(mx.array(x).astype(getattr(mx, dtype))).astype(mx.float32))
    np.testing.assert_allclose(got, expected, rtol=2e-2 if dtype in ("float16", "bfloat16") else 1e-5, atol=1e-2)


@needs_fused
def test_same_result_as_mx_array_path(monkeypatch, counted_fills):
    model = _torch_mlp("float32")
    filled = db.convert(model, to="mlx")
    assert counted_fills
    monkeypatch.setattr(_transfer, "FUSED", None)
    copied = db.convert(model, to="mlx")
    for a, b in zip(filled.layers, copied.layers):
        assert type(a) is type(b)
        for key in ("weight", "bias"):
            if key in a:
                assert np.array_equal(_bits(a[key]), _bits(b[key]))


@pytest.mark.parametrize("fused", [True, False], ids=["filled", "mx.array"])
@pytest.mark.parametrize("where", [(0, "weight", (3, 5)), (2, "weight", (7, 39)), (2, "bias", (7,))])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_refused_with_the_same_words(monkeypatch, fused, where, value):
    if fused and _transfer.FUSED is None:
        pytest.skip("dense_bridge._fused is not built here")
    if not fused:
        monkeypatch.setattr(_transfer, "FUSED", None)
    model = _torch_mlp("float32")
    layer, name, index = where
    with torch.no_grad():
        getattr(model[layer], name)[index] = value
    key = f"{layer}.{'kernel' if name == 'weight' else 'bias'}"
    threads = threading.active_count()
    with pytest.raises(db.ConversionError, match=rf"params do not fit Sequential: {key}: 1 NaN or Inf value\(s\)$"):
        db.convert(model, to="mlx")
    assert threading.active_count() == threads
    out = db.convert(model, to="mlx", allow_nonfinite=True)  # moved bit for bit
    mine = out.layers[layer][name]
    assert np.array_equal(_bits(mine), _torch_bits(getattr(model[layer], name)))


@needs_fused
def test_kernels_stored_in_out_and_masks_keep_mx_array(counted_fills):
    """A kernel stored (in, out) (numpy/Keras/canonical) is transposed by MLX's own copy, and a
    masked layer goes through its own path: neither is filled."""
    spec = db.Sequential([db.Dense(8, mask=np.tril(np.ones((6, 8), np.float32))), db.Dense(4)], in_features=6)
    reference = db.compile(spec, "numpy", seed=2)
    out = db.convert(reference, to="mlx")
    assert counted_fills == []
    np.testing.assert_array_equal(np.asarray(out.layers[1].weight), db.get_params(reference)["1.kernel"].T)


@needs_fused
def test_a_sequential_is_filled_in_one_load(counted_fills, monkeypatch):
    loads = []
    real = mx.load
    monkeypatch.setattr(_fill.mx, "load", lambda *a, **k: loads.append(1) or real(*a, **k))
    db.convert(_torch_mlp("float32"), to="mlx")
    assert len(loads) == 1 and len(counted_fills) == 4


def test_fill_errors_come_back_after_mlx_finishes():
    seen, done = [], []

    def fill(i, out):
        seen.append(i)
        if i == 1:
            raise KeyError("planted")
        out[...] = i
        done.append(i)
    threads = threading.active_count()
    with pytest.raises(KeyError, match="planted"):
        _fill.filled_arrays([((4, 3), "float32"), ((5,), "float32"), ((2, 2), "float16")], fill)
    # MLX reads in its own order; nothing is filled after the error, and MLX's load ended first
    assert seen[-1] == 1 and done == seen[:-1]
    assert threading.active_count() == threads


def test_filled_arrays_every_dtype_and_no_empty_ones():
    assert not _fill.can_fill("float64")
    arrays = [((3, 4), "float32"), ((5,), "float16"), ((2, 3), "bfloat16")]
    values = [np.arange(12, dtype=np.float32).reshape(3, 4) / 3, np.arange(5, dtype=np.float16) / 3,
              (np.arange(6) / 3).astype(ml_dtypes.bfloat16).reshape(2, 3)]

    def fill(i, out):
        assert out.flags.writeable and out.flags.c_contiguous and out.shape == arrays[i][0]
        out[...] = values[i]
    got = _fill.filled_arrays(arrays, fill)
    for array, value in zip(got, values):
        assert np.array_equal(_bits(array), value.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[value.itemsize]))
    with pytest.raises(db.ConversionError, match="no empty arrays"):
        _fill.filled_arrays([((0, 3), "float32")], fill)
