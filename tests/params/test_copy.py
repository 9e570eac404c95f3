"""Conversion copies: bit-exact fresh aligned buffers, the blocked transpose, fused NaN/Inf checks,
deferred validation."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.params import _copy as _transfer
from dense_bridge.params._source import ParamSource, validate_params

from conftest import require_backend

# 1024 x 1024 float32 = 4 MiB: large enough for the cache-blocked transpose
BIG = 1024


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _array(shape, dtype="float32", seed=0):
    from dense_bridge._dtypes import numpy_dtype

    return np.random.default_rng(seed).standard_normal(shape).astype(numpy_dtype(dtype))


# ------------------------------------------------------------------ native_copy
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(5, 7), (BIG, BIG), (2 * BIG, BIG + 76), (3, 512, 640)])
@pytest.mark.parametrize("perm", [None, "swap"])
def test_native_copy_is_a_fresh_aligned_bit_exact_copy(dtype, shape, perm):
    src = _array(shape, dtype)
    order = None if perm is None else tuple(range(len(shape) - 2)) + (len(shape) - 1, len(shape) - 2)
    out, bad = _transfer.native_copy(src, order)
    expected = src if order is None else src.transpose(order)
    assert bad == 0
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert out.flags.c_contiguous and out.flags.writeable and _transfer.is_aligned(out)
    assert not np.shares_memory(out, src)
    assert _bits(out) == _bits(expected)


@pytest.mark.parametrize("shape", [(BIG, BIG), (BIG + 3, 700)])
def test_native_copy_of_transposed_views_undoes_the_transpose(shape):
    weight = _array(shape)  # e.g. torch's (out, in) weight; the canonical kernel is its .T view
    kernel = weight.T
    out, _ = _transfer.native_copy(kernel)
    assert _bits(out) == _bits(np.ascontiguousarray(kernel))
    back, _ = _transfer.native_copy(kernel, (1, 0))  # the torch layout again, from the view
    assert _bits(back) == _bits(weight)


def test_native_copy_keeps_nan_payloads_and_signed_zeros():
    src = _array((BIG, BIG))
    bits = src.view(np.uint32)
    bits[0, :4] = [0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000]  # payload NaNs, -0.0, +inf
    out, bad = _transfer.native_copy(src.T, check_finite=True)
    assert _bits(out) == _bits(np.ascontiguousarray(src.T))
    assert bad == 3


@pytest.mark.parametrize("view", ["plain", "transposed", "small"])
def test_fused_check_counts_every_nonfinite_value_exactly(view):
    n = 8 if view == "small" else BIG
    src = _array((n, n))
    spots = [(0, 0), (n - 1, n - 1), (n // 2, 3), (63, n - 1), (64, 0)] if n > 8 else [(0, 0), (7, 7)]
    for i, (r, c) in enumerate(spots):
        src[r, c] = [np.nan, np.inf, -np.inf][i % 3]
    arg = src.T if view == "transposed" else src
    _, bad = _transfer.native_copy(arg, check_finite=True)
    assert bad == len(spots)
    assert _transfer.count_nonfinite(arg) == len(spots)


def test_overflowing_sums_are_not_mistaken_for_infinities():
    src = np.full((BIG, BIG), 3e38, np.float32)  # finite, but every row sum overflows
    assert _transfer.native_copy(src, check_finite=True)[1] == 0
    assert _transfer.native_copy(src.T, check_finite=True)[1] == 0
    assert _transfer.count_nonfinite(src) == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_two_byte_floats_are_checked_by_their_bits(monkeypatch, dtype):
    # the largest finite values, subnormals and signed zeros are finite; every NaN payload and
    # both infinities are not; strided views and chunk borders count alike
    monkeypatch.setattr(_transfer, "_BITS_CHUNK", 1000)
    src = _array((300, 70), dtype)
    import ml_dtypes

    limits = ml_dtypes.finfo(src.dtype)  # numpy's finfo knows no bfloat16
    src[0, :3] = [limits.max, -limits.max, -0.0]
    src[1, 0] = limits.smallest_subnormal
    assert _transfer.count_nonfinite(src) == 0
    bits = src.view(np.uint16)
    exponent = {"float16": 0x7C00, "bfloat16": 0x7F80}[dtype]
    spots = [(2, 1), (14, 69), (15, 0), (299, 68)]  # 14/15: either side of a 1000-element chunk
    for (r, c), pattern in zip(spots, [exponent, exponent | 0x8000, exponent | 1, exponent | 0x8003]):
        bits[r, c] = pattern  # +Inf, -Inf, a NaN, a negative NaN with a payload
    assert _transfer.count_nonfinite(src) == len(spots)
    assert _transfer.count_nonfinite(src[:, ::2]) == 2  # even columns: (15, 0) and (299, 68)
    assert _transfer.count_nonfinite(src.T) == len(spots)
    assert _transfer.count_nonfinite(src[2, 1]) == 1  # a 0-d view
    assert _transfer.native_copy(src.T, check_finite=True)[1] == len(spots)


def test_integer_and_bool_arrays_have_no_nonfinite_values():
    assert _transfer.count_nonfinite(np.ones((BIG, BIG), np.int32)) == 0
    assert _transfer.native_copy(np.ones((4, 4), bool), check_finite=True)[1] == 0


# ------------------------------------------------------------------ deferred NaN/Inf checks
def _spec():
    return db.Sequential([db.Dense(6, in_features=5, activation="relu"), db.Dense(3)])


def _params_with_nan():
    params = db.get_params(db.compile(_spec(), "numpy", seed=0))
    params = {k: np.array(v) for k, v in params.items()}
    params["0.kernel"][1, 2] = np.nan
    params["1.bias"][0] = np.inf
    return params


def test_compile_reports_every_nonfinite_parameter_like_validate_params(backend):
    params = _params_with_nan()
    with pytest.raises(db.ConversionError) as eager:
        validate_params(_spec(), params)
    with pytest.raises(db.ConversionError) as deferred:
        db.compile(_spec(), backend, params=params)
    assert str(deferred.value) == str(eager.value)
    assert "0.kernel: 1 NaN or Inf value(s)" in str(eager.value) and "1.bias" in str(eager.value)


def test_nonfinite_and_other_problems_are_reported_together(backend):
    params = _params_with_nan()
    params["1.kernel"] = np.zeros((3, 6), np.float32)  # transposed: a shape problem too
    with pytest.raises(db.ConversionError) as info:
        db.compile(_spec(), backend, params=params)
    message = str(info.value)
    assert "0.kernel: 1 NaN" in message and "1.bias: 1 NaN" in message and "expected shape (6, 3)" in message


def test_finish_scans_what_no_adapter_asked_for():
    params = _params_with_nan()
    params["0.kernel"][1, 2] = 0.0
    source = ParamSource(_spec(), params=params, defer_finite_check=True)
    source.native_layer(0, source.spec.layers[0])  # finite: no error
    with pytest.raises(db.ConversionError, match=r"1\.bias: 1 NaN or Inf"):
        source.finish()


def test_big_arrays_are_scanned_on_a_background_thread_for_adapters_that_copy_themselves(monkeypatch):
    # MLX, Flax and Equinox copy with their own framework (for_layer): the scans of big arrays
    # run beside those copies and finish() still names every offender, in key order
    from dense_bridge.params import _source as _params

    monkeypatch.setattr(_params, "_SCAN_AHEAD_BYTES", 64)  # 0.kernel (120 B) and 1.kernel (72 B)
    monkeypatch.setattr(_params, "core_to_spare", lambda: True)  # whatever else runs on this machine
    params = _params_with_nan()
    params["1.kernel"][0, 0] = -np.inf
    source = ParamSource(_spec(), params=params, defer_finite_check=True)
    for i, layer in enumerate(source.spec.layers):
        source.for_layer(i, layer)
    assert isinstance(source._pending["0.kernel"], _params.Future)  # scanned on the thread
    assert not isinstance(source._pending["1.bias"], _params.Future)  # small: scanned inline
    with pytest.raises(db.ConversionError) as info:
        source.finish()
    message = str(info.value)
    assert message.index("0.kernel: 1 NaN") < message.index("1.kernel: 1 NaN") < message.index("1.bias: 1 NaN")
    assert source._scanner._shutdown


def test_big_arrays_are_scanned_inline_without_a_core_to_spare(monkeypatch):
    # on a machine whose cores are all busy the scans stay on the calling thread, same verdict
    from dense_bridge.params import _source as _params

    monkeypatch.setattr(_params, "_SCAN_AHEAD_BYTES", 64)
    monkeypatch.setattr(_params, "core_to_spare", lambda: False)
    params = _params_with_nan()
    source = ParamSource(_spec(), params=params, defer_finite_check=True)
    for i, layer in enumerate(source.spec.layers):
        source.for_layer(i, layer)
    assert source._scanner is None and not any(isinstance(c, _params.Future) for c in source._pending.values())
    with pytest.raises(db.ConversionError, match=r"0\.kernel: 1 NaN.*1\.bias: 1 NaN"):
        source.finish()


def test_masks_and_cast_values_are_still_checked_up_front():
    spec = db.Dense(4, in_features=4, mask=db.wiring.banded(4, 4, 1))
    params = db.get_params(db.compile(spec, "numpy", seed=0))
    bad_mask = {**params, "mask": np.where(np.eye(4) > 0, np.nan, 1.0).astype(np.float32)}
    with pytest.raises(db.ConversionError, match="mask: 4 NaN or Inf"):
        ParamSource(spec, params=bad_mask, defer_finite_check=True)
    wide = {**params, "kernel": np.full((4, 4), 0.5)}  # float64 given: cast to float32 when validated
    source = ParamSource(spec, params=wide, defer_finite_check=True)
    assert "kernel" not in source._unchecked  # scanned as given, before the cast, as validate_params does


def _poison(model, framework: str) -> None:
    """Put a NaN into the first kernel through the framework itself (a diverged training run)."""
    if framework == "torch":
        import torch

        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    elif framework == "keras":
        kernel = model.layers[0].kernel
        value = np.array(kernel.numpy())
        value[0, 0] = np.nan
        kernel.assign(value)
    else:
        import mlx.core as mx

        weight = np.array(model.layers[0].weight)
        weight[0, 0] = np.nan
        model.layers[0].weight = mx.array(weight)


@pytest.mark.parametrize("src,dst", [("torch", "keras"), ("keras", "mlx"), ("mlx", "torch")])
def test_convert_refuses_a_model_with_nan_weights_by_name(src, dst):
    require_backend(src)
    require_backend(dst)
    model = db.compile(_spec(), src, seed=0)
    _poison(model, src)
    with pytest.raises(db.ConversionError, match=r"params do not fit Sequential: 0\.kernel: 1 NaN or Inf value\(s\)$"):
        db.convert(model, to=dst)


# ------------------------------------------------------------------ ownership of converted memory
@pytest.mark.parametrize("dst", ["torch", "keras", "mlx"])
def test_compiled_parameters_never_alias_the_given_arrays(dst):
    require_backend(dst)
    spec = db.Sequential([db.Dense(BIG, in_features=BIG), db.Dense(8)])
    params = {k: np.array(v) for k, v in db.get_params(db.compile(spec, "numpy", seed=1)).items()}
    given = {k: v.copy() for k, v in params.items()}
    model = db.compile(spec, dst, params=given)
    for v in given.values():
        v[...] = 0  # the caller reuses its buffers
    got = db.get_params(model)
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in params.items()}


@pytest.mark.parametrize("src,dst", [("torch", "keras"), ("keras", "torch"), ("torch", "mlx"),
                                     ("mlx", "torch"), ("keras", "mlx"), ("mlx", "keras")])
def test_large_layers_convert_bit_identically_and_train_independently(src, dst):
    require_backend(src)
    require_backend(dst)
    spec = db.Sequential([db.Dense(BIG, in_features=BIG), db.Dense(BIG)])
    a = db.compile(spec, src, seed=2)
    b = db.convert(a, to=dst)
    before = {k: _bits(v) for k, v in db.get_params(a).items()}
    assert {k: _bits(v) for k, v in db.get_params(b).items()} == before
    c = db.convert(b, to=src)
    assert {k: _bits(v) for k, v in db.get_params(c).items()} == before
    # writing into the converted model leaves the source untouched (separate memory)
    db.set_params(b, {"0.kernel": np.zeros((BIG, BIG), np.float32)}, strict=False)
    assert {k: _bits(v) for k, v in db.get_params(a).items()} == before


def test_torch_tensors_made_from_fresh_buffers_behave_like_torch_allocated_ones():
    torch = pytest.importorskip("torch")
    require_backend("torch")
    model = db.compile(db.Sequential([db.Dense(BIG, in_features=BIG), db.Dense(4)]), "torch", seed=3)
    weight = model[0].weight
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad and weight.is_contiguous()
    assert weight.data_ptr() % _transfer.ALIGN == 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = weight.detach().clone()
    model(torch.ones(2, BIG)).sum().backward()
    opt.step()
    assert not torch.equal(before, weight.detach())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = db.compile(db.Sequential([db.Dense(BIG, in_features=BIG), db.Dense(4)]), "torch", seed=4)
    fresh.load_state_dict(state)
    assert torch.equal(fresh[0].weight, weight)


@pytest.mark.parametrize("cores", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_copies_split_over_cores_are_bit_identical_and_count_every_nonfinite(monkeypatch, cores, dtype):
    """native_copy's threaded path (copies of _THREADED bytes and more), forced onto small arrays and
    an uneven number of strips: transposed views, plain copies and batched (3-D) transposes."""
    from dense_bridge.params import _copy as _transfer

    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    monkeypatch.setattr(_transfer, "_THREADED", 1)
    monkeypatch.setattr(_transfer, "_SMALL", 1)
    monkeypatch.setattr(_transfer, "_cores", lambda: cores)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((300, 200)).astype(np_dtype)
    base[7, 9] = np.nan
    base[250, 3] = np.inf
    batched = rng.standard_normal((3, 130, 70)).astype(np_dtype)
    for src, perm in ((base, (1, 0)), (base, None), (batched, (0, 2, 1))):
        out, bad = _transfer.native_copy(src, perm, check_finite=True)
        expected = np.ascontiguousarray(src if perm is None else src.transpose(perm))
        assert out.flags.c_contiguous and _transfer.is_aligned(out)
        assert out.tobytes() == expected.tobytes()
        assert bad == (2 if src is base else 0)
