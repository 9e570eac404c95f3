"""dense_bridge.params._copy_kernels, the optional C copy that counts NaN/Inf in the same pass, against numpy.

Every 2-byte bit pattern, random and special 4- and 8-byte patterns, every length up to past
the vector loops' tails with the bad value in each position, buffers that start off a vector
boundary, and the errors for buffers that do not fit. Where no C compiler was found at install
the extension is absent and these tests skip (the numpy fallback is tested wherever the copies
are, with the extension switched off).
"""
from __future__ import annotations

import shutil
import sysconfig

import ml_dtypes
import numpy as np
import pytest

from dense_bridge.params import _copy as _transfer

COPY_KERNELS = _transfer.COPY_KERNELS
needs_kernels = pytest.mark.skipif(COPY_KERNELS is None, reason="dense_bridge.params._copy_kernels is not built here")

MASKS = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0000000000000}
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _reference_count(bits: np.ndarray, dtype: str) -> int:
    with np.errstate(invalid="ignore"):  # ml_dtypes' isfinite warns on its own NaN patterns
        return int(np.count_nonzero(~np.isfinite(bits.view(DTYPES[dtype]))))


def test_extension_is_built_where_a_compiler_is():
    # setup.py builds it as optional: a broken build would otherwise pass unnoticed as the fallback
    if shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc") is None:
        pytest.skip("no C compiler on this machine")
    assert COPY_KERNELS is not None, "a C compiler is here but dense_bridge.params._copy_kernels was not built"


@needs_kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_two_byte_pattern(dtype):
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty_like(bits)
    assert COPY_KERNELS.copy_count(out, bits, 2, MASKS[dtype]) == _reference_count(bits, dtype)
    assert np.array_equal(out, bits)
    assert COPY_KERNELS.count(bits, 2, MASKS[dtype]) == _reference_count(bits, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_random_and_special_wide_patterns(dtype):
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    uint = UINTS[itemsize]
    rng = np.random.default_rng(7)
    bits = rng.integers(0, np.iinfo(uint).max, 1 << 18, dtype=uint, endpoint=True)
    specials = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, np.finfo(DTYPES[dtype]).max,
                         np.finfo(DTYPES[dtype]).tiny / 2], DTYPES[dtype]).view(uint)
    bits[rng.choice(bits.size, 64, replace=False)] = np.resize(specials, 64)
    out = np.empty_like(bits)
    assert COPY_KERNELS.copy_count(out, bits, itemsize, MASKS[dtype]) == _reference_count(bits, dtype)
    assert np.array_equal(out, bits)
    assert COPY_KERNELS.count(bits, itemsize, MASKS[dtype]) == _reference_count(bits, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", list(MASKS))
def test_every_length_and_position(dtype):
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    uint = UINTS[itemsize]
    inf = np.array([np.inf], DTYPES[dtype]).view(uint)[0]
    for n in range(0, 70):
        finite = np.ones(n, DTYPES[dtype]).view(uint)
        out = np.zeros_like(finite)
        assert COPY_KERNELS.copy_count(out, finite, itemsize, MASKS[dtype]) == 0
        assert np.array_equal(out, finite)
        for k in range(n):
            bad = finite.copy()
            bad[k] = inf
            assert COPY_KERNELS.copy_count(out, bad, itemsize, MASKS[dtype]) == 1, (n, k)
            assert out[k] == inf
            assert COPY_KERNELS.count(bad, itemsize, MASKS[dtype]) == 1, (n, k)


@needs_kernels
@pytest.mark.parametrize("start", [0, 4, 8, 24, 40])
def test_buffers_off_vector_boundaries(start):
    raw = np.zeros(4096 + 128, np.uint8)
    base = (-raw.ctypes.data) % 64
    src = raw[base + start:base + start + 4096].view(np.uint32)
    src[:] = np.arange(src.size, dtype=np.float32).view(np.uint32)
    src[517] = 0xFF800000  # -Inf
    dst_raw = np.zeros_like(raw)
    dst = dst_raw[base + 24:base + 24 + 4096].view(np.uint32)  # where MLX's buffers start
    assert COPY_KERNELS.copy_count(dst, src, 4, MASKS["float32"]) == 1
    assert np.array_equal(dst, src)


@needs_kernels
def test_mask_zero_copies_without_counting():
    src = np.array([np.nan, 1.0, np.inf], np.float32).view(np.uint32)
    out = np.zeros_like(src)
    assert COPY_KERNELS.copy_count(out, src, 4, 0) == 0
    assert np.array_equal(out, src)


@needs_kernels
def test_buffers_that_do_not_fit_are_refused():
    a = np.zeros(8, np.uint32)
    with pytest.raises(ValueError, match="dst has 32 bytes and src 28"):
        COPY_KERNELS.copy_count(np.zeros(8, np.uint32), a[:7], 4, MASKS["float32"])
    with pytest.raises(ValueError, match="itemsize must be 2, 4 or 8. Received: itemsize=3"):
        COPY_KERNELS.count(a, 3, 0x7F)
    with pytest.raises(ValueError, match="not a multiple of itemsize=8"):
        COPY_KERNELS.count(np.zeros(3, np.uint32), 8, MASKS["float64"])
    with pytest.raises(ValueError, match="wider than itemsize=2"):
        COPY_KERNELS.count(np.zeros(4, np.uint16), 2, MASKS["float32"])
    readonly = np.zeros(8, np.uint32)
    readonly.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        COPY_KERNELS.copy_count(readonly, a, 4, MASKS["float32"])
    with pytest.raises((TypeError, BufferError, ValueError)):
        COPY_KERNELS.count(np.zeros((4, 4), np.uint32)[:, ::2], 4, MASKS["float32"])  # not contiguous


@pytest.mark.parametrize("fused", [True, False], ids=["C kernel", "numpy"])
@pytest.mark.parametrize("dtype", list(MASKS))
def test_transfer_gives_the_same_counts_either_way(monkeypatch, fused, dtype):
    if fused and COPY_KERNELS is None:
        pytest.skip("dense_bridge.params._copy_kernels is not built here")
    if not fused:
        monkeypatch.setattr(_transfer, "COPY_KERNELS", None)
    rng = np.random.default_rng(3)
    value = rng.uniform(-3, 3, (300, 70)).astype(DTYPES[dtype])
    value[4, 9], value[299, 69], value[150, 0] = np.nan, np.inf, -np.inf
    assert _transfer.count_nonfinite(value) == 3
    for perm in (None, (1, 0)):
        out, count = _transfer.native_copy(value, perm, check_finite=True)
        expected = value if perm is None else value.T
        assert count == 3 and np.array_equal(out.view(UINTS[out.itemsize]), np.ascontiguousarray(expected).view(
            UINTS[out.itemsize]))
    raw = np.zeros(value.nbytes + 1, np.uint8)  # one byte off: the C kernel is not given it
    raw[1:] = value.reshape(-1).view(np.uint8)
    misaligned = raw[1:].view(DTYPES[dtype]).reshape(value.shape)
    assert not misaligned.flags.aligned
    assert _transfer.count_nonfinite(misaligned) == 3
    out, count = _transfer.native_copy(misaligned, check_finite=True)
    assert count == 3 and np.array_equal(out.view(UINTS[out.itemsize]), value.view(UINTS[out.itemsize]))


needs_transpose = pytest.mark.skipif(COPY_KERNELS is None or not COPY_KERNELS.has_transpose(),
                                     reason="the C transpose needs dense_bridge.params._copy_kernels and AVX2")


@needs_transpose
@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (8, 8), (9, 17), (16, 130), (131, 257), (41, 6500)])
def test_transpose_matches_numpy_in_strips(shape):
    n, m = shape
    rng = np.random.default_rng(n * 1000 + m)
    src = rng.integers(0, 2**32, (n, m), dtype=np.uint64).astype(np.uint32)  # every bit pattern class
    expected_bad = _reference_count(src, "float32")
    for strip in (m, 1, 7, 8, 64):
        dst = np.zeros((m, n), np.uint32)
        bad = sum(COPY_KERNELS.transpose_count(dst, src, n, m, MASKS["float32"], a, min(strip, m - a))
                  for a in range(0, m, strip))
        assert np.array_equal(dst, src.T), (shape, strip)
        assert bad == expected_bad, (shape, strip)


@needs_transpose
def test_transpose_finds_every_position():
    n, m = 19, 13  # 8 x 8 blocks, a ragged row tail and a ragged column tail
    inf = np.array([np.inf], np.float32).view(np.uint32)[0]
    for i in range(n):
        for j in range(m):
            src = np.ones((n, m), np.float32).view(np.uint32)
            src[i, j] = inf
            dst = np.zeros((m, n), np.uint32)
            assert COPY_KERNELS.transpose_count(dst, src, n, m, MASKS["float32"], 0, m) == 1, (i, j)
            assert dst[j, i] == inf


@needs_transpose
def test_transpose_refuses_what_does_not_fit():
    src, dst = np.zeros((4, 6), np.uint32), np.zeros((6, 4), np.uint32)
    with pytest.raises(ValueError, match=r"rows \[first, first \+ count\) = \[5, 7\) must lie in \[0, m=6\)"):
        COPY_KERNELS.transpose_count(dst, src, 4, 6, MASKS["float32"], 5, 2)
    with pytest.raises(ValueError, match="both must be n \\* m \\* 4 = 96"):
        COPY_KERNELS.transpose_count(np.zeros((6, 3), np.uint32), src, 4, 6, MASKS["float32"], 0, 6)
    with pytest.raises(ValueError, match="wider than 4 bytes"):
        COPY_KERNELS.transpose_count(dst, src, 4, 6, MASKS["float64"], 0, 6)
