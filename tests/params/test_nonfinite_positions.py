"""The NaN/Inf check of compile(params=...) and convert, wherever the bad value sits.

The check rides along with the copies (``dense_bridge.params._copy``: in the C kernel's own pass,
copy or transpose, or scanned per group of source rows inside numpy's cache-blocked transpose, per
strip on each core) or runs beside the framework's own copy (``ParamSource.for_layer``: MLX, Flax,
Equinox), and 2-byte floats are tested through their bits. Every test runs with the C kernel
and with the numpy fallback.
Each of those splits an array into pieces, so a value in the wrong piece could slip through: these
tests put one NaN, +Inf or -Inf in each class of position, on every ordered pair of backends and
from canonical params, in float32, float16 and bfloat16, and check that it is refused and named,
and that ``allow_nonfinite=True`` moves it bit for bit.

Sizes: a kernel of 41 x 6500 float32 (41 x 13000 for 2-byte floats) is just over 1 MiB, the size
from which a layout change takes the cache-blocked transpose. Its tiles are 16 source rows x 2048
columns and the scan reads back groups of whole tiles, so rows 32-40 and the last 356 (712)
columns are partial tiles (the tails), read from either side: (in, units) for layers stored like
the canonical kernel (Keras, Flax), (units, in) for the others.
"""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.params import _source as _params, _copy as _transfer

from conftest import ALL_BACKENDS, require_backend

DTYPES = ("float32", "float16", "bfloat16")
IN = 41  # rows of the canonical kernel: two full 16-row tiles, then a 9-row tail
UNITS = {"float32": 6500, "float16": 13000, "bfloat16": 13000}  # just over 1 MiB, partial last tile
#: Raw bits of the bad values: a quiet NaN with a payload (copies must keep it), +Inf, -Inf.
BAD_BITS = {
    "float32": {"nan": 0x7FC0_1234, "+inf": 0x7F80_0000, "-inf": 0xFF80_0000},
    "float16": {"nan": 0x7E05, "+inf": 0x7C00, "-inf": 0xFC00},
    "bfloat16": {"nan": 0x7FC5, "+inf": 0x7F80, "-inf": 0xFF80},
}
_UINT = {4: np.uint32, 2: np.uint16}


@pytest.fixture(autouse=True, params=["C kernel", "numpy"])
def kernel(request, monkeypatch):
    """Every test twice: with the C copy and transpose that count in the same pass
    (``dense_bridge.params._copy_kernels``) and with the numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(_transfer, "COPY_KERNELS", None)
    elif _transfer.COPY_KERNELS is None:
        pytest.skip("dense_bridge.params._copy_kernels is not built here")
    return request.param


def positions(units: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Position class -> (parameter, index): the first and last element, one inside the first
    full tile, one in the tile that is a tail along both axes from either side (rows 32-40 of
    the (in, units) kernel, and the last 4 rows of its (units, in) transpose), and the bias."""
    return {"first": ("kernel", (0, 0)), "last": ("kernel", (IN - 1, units - 1)),
            "inside a tile": ("kernel", (5, 1000)), "tile's tail": ("kernel", (35, units - 2)),
            "bias": ("bias", (units // 2,))}


def _numpy_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def _finite_params(dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    units = UNITS[dtype]
    return {"kernel": rng.uniform(-1, 1, (IN, units)).astype(_numpy_dtype(dtype)),
            "bias": rng.uniform(-1, 1, units).astype(_numpy_dtype(dtype))}


def _put_bits(array: np.ndarray, index: tuple[int, ...], bits: int) -> None:
    array.view(_UINT[array.dtype.itemsize])[index] = bits


def _spec(dtype: str) -> db.Dense:
    return db.Dense(UNITS[dtype], in_features=IN, dtype=dtype)


def _require(backend: str, dtype: str) -> None:
    """Skip unless ``backend`` is installed and holds ``dtype``."""
    require_backend(backend)
    try:
        db.compile(db.Dense(2, in_features=2, dtype=dtype), backend, seed=0)
    except (db.SpecError, db.ConversionError) as exc:
        pytest.skip(f"{backend} does not hold {dtype}: {exc}")


def _bits(params) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(np.asarray(v)).tobytes() for k, v in params.items()}


@pytest.fixture(autouse=True)
def _scan_beside_framework_copies(monkeypatch):
    # the kernels here are ~1 MiB: let them take the background scan that real-sized kernels take
    # into MLX, Flax and Equinox (biases stay on the calling thread)
    monkeypatch.setattr(_params, "_SCAN_AHEAD_BYTES", 1 << 20)
    monkeypatch.setattr(_params, "core_to_spare", lambda: True)  # even on a busy machine


_SOURCES: dict[tuple, object] = {}


def _source(backend: str, dtype: str, params_key: tuple, params: dict[str, np.ndarray]):
    """The ``backend`` layer holding ``params`` (built once per module: several targets read it)."""
    key = (backend, dtype, params_key)
    if key not in _SOURCES:
        _SOURCES[key] = db.compile(_spec(dtype), backend, params=params, allow_nonfinite=True)
    return _SOURCES[key]


def _refusals(make, dtype: str) -> list[str]:
    """What escapes: for each bad value and position class, ``make(params_key, params)`` must
    raise a ConversionError naming the parameter with exactly one NaN/Inf value."""
    escaped = []
    for (value, bits), (where, (key, index)) in itertools.product(BAD_BITS[dtype].items(),
                                                                  positions(UNITS[dtype]).items()):
        params = _finite_params(dtype)
        _put_bits(params[key], index, bits)
        try:
            make((value, where), params)
        except db.ConversionError as exc:
            if f"{key}: 1 NaN or Inf value(s)" not in str(exc):
                escaped.append(f"{value} at {where}: wrong message {exc}")
            continue
        escaped.append(f"{value} at {where} ({key}{list(index)}) was accepted")
    return escaped


def _all_bad(dtype: str) -> dict[str, np.ndarray]:
    """Finite params with every bad value in every position class at once."""
    params = _finite_params(dtype)
    spots = list(positions(UNITS[dtype]).values())
    for n, (key, index) in enumerate(spots):
        for m, bits in enumerate(BAD_BITS[dtype].values()):
            last = index[-1] - m if index[-1] >= 2 else index[-1] + m  # three neighbours, one of each
            shifted = index[:-1] + (last,)
            _put_bits(params[key], shifted, bits)
    return params


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", ALL_BACKENDS)
def test_compile_from_params_refuses_every_position(target, dtype):
    _require(target, dtype)
    escaped = _refusals(lambda _, params: db.compile(_spec(dtype), target, params=params), dtype)
    assert not escaped, escaped


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source,target", list(itertools.permutations(ALL_BACKENDS, 2)))
def test_convert_refuses_every_position(source, target, dtype):
    _require(source, dtype)
    _require(target, dtype)
    escaped = _refusals(lambda key, params: db.convert(_source(source, dtype, key, params), to=target), dtype)
    assert not escaped, escaped


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ("params",) + ALL_BACKENDS)
def test_allow_nonfinite_moves_them_bit_for_bit(source, dtype):
    # from canonical params (compile) or from a source layer (convert) into every other backend
    if source != "params":
        _require(source, dtype)
    params = _all_bad(dtype)
    expected = _bits(params)
    for target in ALL_BACKENDS:
        if target == source or target not in db.available_backends():
            continue
        _require(target, dtype)
        if source == "params":
            out = db.compile(_spec(dtype), target, params=params, allow_nonfinite=True)
        else:
            out = db.convert(_source(source, dtype, "all bad", params), to=target, allow_nonfinite=True)
        assert _bits(db.get_params(out)) == expected, f"{source} -> {target}"


# ------------------------------------------------------------------ the copy kernels themselves
@pytest.mark.parametrize("threads", [False, True], ids=["one thread", "strips on every core"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("perm", [None, (1, 0)], ids=["same layout", "transposed"])
def test_native_copy_counts_every_position(monkeypatch, perm, dtype, threads):
    # native_copy is what the torch and Keras targets fill their buffers with; its threaded
    # strips split the rows again, so a value just before and just after a strip edge is tried
    if threads:
        if _transfer._cores() < 2:
            pytest.skip("one core: native_copy never splits a copy")
        monkeypatch.setattr(_transfer, "_THREADED", 1 << 20)
    params = _finite_params(dtype)
    units = UNITS[dtype]
    spots = [index for key, index in positions(units).values() if key == "kernel"]
    spots += _strip_edges(units, params["kernel"].itemsize, perm)
    for bits, index in itertools.product(BAD_BITS[dtype].values(), spots):
        kernel = params["kernel"].copy()
        _put_bits(kernel, index, bits)
        out, count = _transfer.native_copy(kernel, perm, check_finite=True)
        assert count == 1, (hex(bits), index)
        assert out.tobytes() == np.ascontiguousarray(kernel.transpose(perm) if perm else kernel).tobytes()
        assert _transfer.is_aligned(out)


def _strip_edges(units: int, itemsize: int, perm) -> list[tuple[int, int]]:
    """Kernel indices of the last element of the first strip of a threaded native_copy and the
    first of the second (strips as ``_transfer._on_cores`` cuts them on this machine)."""
    cores = max(2, _transfer._cores())
    if perm is None:  # flat chunks of a multiple of 4096 elements
        step = -(-IN * units // (cores * 4096)) * 4096
        return [divmod(step - 1, units), divmod(step, units)]
    unit = _transfer._tile_rows(itemsize)  # output rows (kernel columns) per strip
    step = -(-units // (cores * unit)) * unit
    return [(IN - 1, step - 1), (0, step)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_two_byte_test_is_exact_for_every_bit_pattern(dtype):
    # every one of the 65536 patterns: the count agrees with numpy's isfinite in float32, and
    # each NaN/Inf pattern alone among all the finite ones is found
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(_numpy_dtype(dtype))
    finite = np.isfinite(patterns.astype(np.float32))
    assert _transfer.count_nonfinite(patterns) == int(np.count_nonzero(~finite))
    base = patterns[finite]
    assert _transfer.count_nonfinite(base) == 0
    for bad in patterns[~finite]:
        trial = base.copy()
        trial[len(trial) // 2] = bad
        assert _transfer.count_nonfinite(trial) == 1, hex(int(np.asarray(bad).view(np.uint16)))
