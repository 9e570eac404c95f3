"""The GGUF file layer (backends/gguf/_file.py, _codes.py, _writer.py) against gguf-py itself:
files written by gguf-py's ``GGUFWriter`` read as ``gguf.GGUFReader`` reads them; every codec bit
for bit against ``gguf.quants``; codes moved into MLX whose ``mx.dequantize`` equals gguf's
dequantization; MLX 4-bit codes kept as Q4_1; our writer's files read by ``GGUFReader``."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
ml_dtypes = pytest.importorskip("ml_dtypes")

from dense_bridge import CheckpointError, ConversionError, SpecError  # noqa: E402
from dense_bridge.backends.gguf import _codes as codes  # noqa: E402
from dense_bridge.backends.gguf._file import file_info, open_gguf  # noqa: E402
from dense_bridge.backends.gguf._writer import GGUFOutput  # noqa: E402

T = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType


def _rng(seed=0):
    return np.random.default_rng(seed)


def valid_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q4_K bytes built from valid random blocks (gguf has no Q4_K quantizer): finite float16 d
    and dmin, random 6-bit scales and mins, random codes."""
    rng = _rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 0.05, n).astype("<f2").view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = rng.uniform(-0.05, 0.05, n).astype("<f2").view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // 256 * 144)


def write_with_gguf_py(path, tensors: dict, kv: list, **writer_kw):
    """A file written by gguf-py's own GGUFWriter; ``tensors``: name -> (array or raw bytes, raw type)."""
    w = gguf.GGUFWriter(str(path), "llama", **writer_kw)
    for key, value, vtype in kv:
        w.add_key_value(key, value, vtype)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sample_tensors():
    rng = _rng(1)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    return a, {
        "f32": (a, None), "f16": (a.astype(np.float16), None),
        "bf16": (gguf.quants.quantize(a, T.BF16), T.BF16),
        "q8_0": (gguf.quants.quantize(a, T.Q8_0), T.Q8_0), "q4_0": (gguf.quants.quantize(a, T.Q4_0), T.Q4_0),
        "q4_1": (gguf.quants.quantize(a, T.Q4_1), T.Q4_1), "q4_k": (valid_q4_k(4, 512), T.Q4_K),
        "i32": (np.arange(12, dtype=np.int32).reshape(3, 4), None),
        "vec": (rng.standard_normal(64).astype(np.float32), None),
        "cube": (rng.standard_normal((2, 3, 32)).astype(np.float32), None),
    }


SAMPLE_KV = [
    ("llama.context_length", 128, VT.UINT32), ("llama.rope.freq_base", 10000.5, VT.FLOAT32),
    ("u8", 7, VT.UINT8), ("i8", -7, VT.INT8), ("u16", 65535, VT.UINT16), ("i16", -300, VT.INT16),
    ("i32", -5, VT.INT32), ("u64", 2**40, VT.UINT64), ("i64", -2**40, VT.INT64), ("f64", 1.25, VT.FLOAT64),
    ("flag", True, VT.BOOL), ("name", "tiny é", VT.STRING),
    ("tokenizer.ggml.tokens", ["<s>", "a", "é", ""], VT.ARRAY), ("tokenizer.ggml.scores", [0.5, -1.5, 2.0], VT.ARRAY),
    ("tokenizer.ggml.token_type", [1, 2, 3], VT.ARRAY), ("nested", [[1, 2], [3]], VT.ARRAY),
]


def reader_value(field):
    if field.types[:2] == [VT.ARRAY, VT.ARRAY]:
        return "nested"  # gguf-py's contents() does not read nested arrays
    return field.contents()


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "model.gguf"
    a, tensors = sample_tensors()
    write_with_gguf_py(path, tensors, SAMPLE_KV)
    return path, a, tensors


def test_reader_agrees_with_gguf_reader(written):
    path, _, tensors = written
    ref = gguf.GGUFReader(str(path))
    with open_gguf(path) as f:
        assert f.version == 3 and f.alignment == 32
        for name, field in ref.fields.items():
            if name.startswith("GGUF."):
                continue
            assert f.metadata_types[name][0] == field.types[0], name
            value = reader_value(field)
            if value == "nested":
                assert f.metadata[name] == [[1, 2], [3]]
            elif isinstance(value, float):
                assert f.metadata[name] == pytest.approx(value, rel=0, abs=0), name
            else:
                assert f.metadata[name] == value, name
        assert set(f.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
        assert f.keys() == [t.name for t in ref.tensors]
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.shape == tuple(int(x) for x in reversed(t.shape)), t.name
            assert info.ggml_type == t.tensor_type and info.nbytes == t.n_bytes
            assert info.offset == t.data_offset
            assert np.array_equal(f.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
    # numpy order: a torch (out, in) weight reads (out, in)
    assert f.tensors["f32"].shape == (8, 64) and f.tensors["cube"].shape == (2, 3, 32)


def test_get_returns_stored_floats_mapped_and_dequantizes_codes(written):
    path, a, tensors = written
    with open_gguf(path) as f:
        got = f.get("f32")
        assert got.dtype == np.float32 and np.array_equal(got, a) and not got.flags.owndata  # mapped, no copy
        got = f.get("f16")
        assert got.dtype == np.float16 and np.array_equal(got, a.astype(np.float16))
        got = f.get("bf16")
        assert got.dtype == ml_dtypes.bfloat16 and f.tensors["bf16"].numpy_dtype == got.dtype
        assert np.array_equal(got.astype(np.float32), gguf.quants.dequantize(tensors["bf16"][0], T.BF16))
        for name in ("q8_0", "q4_0", "q4_1", "q4_k"):
            got = f.get(name)
            assert got.dtype == np.float32 and f.tensors[name].numpy_dtype == np.float32
            ref = gguf.quants.dequantize(tensors[name][0], tensors[name][1])
            assert got.shape == f.tensors[name].shape
            assert np.array_equal(got.view(np.uint32), ref.reshape(got.shape).view(np.uint32)), name
        assert f.get("i32").dtype == np.int32 and np.array_equal(f.get("i32"), tensors["i32"][0])
        got = f.get("f32")
    got[0, 0] = 99.0  # copy-on-write: the file is untouched
    with open_gguf(path) as f:
        assert f.get("f32")[0, 0] == a[0, 0]
        with pytest.raises(CheckpointError, match="no tensor 'nope'"):
            f.get("nope")
    with pytest.raises(CheckpointError, match="closed"):
        f.get("f32")


def test_port_open_protocol_and_file_info(written):
    """What the port reads weight files through (SafetensorsFile's surface) and what inspect lists."""
    path, _, _ = written
    f = open_gguf(str(path))
    try:
        for name in f.keys():
            info = f.tensors[name]
            arr = f.get(name)
            assert arr.shape == info.shape and arr.dtype == info.numpy_dtype, name
    finally:
        f.close()
    assert f.closed
    entries, meta = file_info(str(path), "gguf")
    assert entries["q4_k"] == ((4, 512), "q4_k") and entries["f32"] == ((8, 64), "f32")
    assert meta["llama.context_length"] == 128


@pytest.mark.parametrize("name", codes.QUANTIZABLE)
def test_quantize_and_dequantize_are_gguf_own(name, monkeypatch):
    rng = _rng(2)
    x = rng.standard_normal((9, 96)).astype(np.float32) * 3
    x[0, :32] = 0.0  # an all-zero block
    monkeypatch.setattr(codes, "CHUNK", 200)  # several chunks of rows: chunking changes nothing
    raw = codes.quantize(x, name)
    ref = gguf.quants.quantize(x, T[name])
    assert raw.dtype == np.uint8
    assert np.array_equal(raw.reshape(-1), np.ascontiguousarray(ref).view(np.uint8).reshape(-1))
    back = codes.dequantize(raw, name, x.shape)
    ref_back = gguf.quants.dequantize(np.ascontiguousarray(ref).view(np.uint8).reshape(raw.shape), T[name])
    assert back.dtype == np.float32 and np.array_equal(back.view(np.uint32), ref_back.reshape(x.shape).view(np.uint32))
    # float64 input is taken through float32 first, as llama.cpp's converter does
    assert np.array_equal(codes.quantize(x.astype(np.float64), name), raw)


def test_codec_refusals():
    with pytest.raises(ConversionError, match="Q4_K is not written here"):
        codes.quantize(np.zeros((2, 256), np.float32), "Q4_K")
    with pytest.raises(ConversionError, match="multiple of 32"):
        codes.quantize(np.zeros((2, 33), np.float32), "q8_0")
    with pytest.raises(TypeError, match="floats"):
        codes.quantize(np.zeros((2, 32), np.int32), "q8_0")
    with pytest.raises(SpecError, match="GGML type"):
        codes.quantize(np.zeros((2, 32), np.float32), "q9_9")
    with pytest.raises(ConversionError, match="takes 68 bytes; got 67"):
        codes.dequantize(np.zeros(67, np.uint8), "q8_0", (2, 32))


# --------------------------------------------------------------------------- into MLX
mx = None


def _mlx():
    global mx
    mx = pytest.importorskip("mlx.core")
    return mx


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_codes_move_into_mlx_affine_exactly(name):
    """mx.dequantize of the moved codes with float32 scales and biases equals gguf's dequantization:
    bit for bit for Q4_1 and Q4_K; for Q4_0 and Q8_0 equal in value, the bits differing only in
    the sign of zeros (gguf: d * 0 = -0.0 for negative d; MLX: 8d - 8d = +0.0)."""
    mx = _mlx()
    shape = (6, 512)
    if name == "Q4_K":
        raw = valid_q4_k(*shape, seed=3)
    else:
        x = _rng(3).standard_normal(shape).astype(np.float32)
        x[1, 64:96] = 0.0
        raw = codes.quantize(x, name)
    ref = gguf.quants.dequantize(raw, T[name]).reshape(shape)
    w, scales, biases = codes.to_mlx_affine(raw, name, shape)
    bits = codes.MLX_AFFINE_BITS[name]
    assert w.dtype == np.uint32 and w.shape == (6, 512 * bits // 32)
    assert scales.dtype == biases.dtype == np.float32 and scales.shape == biases.shape == (6, 16)
    got = np.array(mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=32, bits=bits))
    assert got.dtype == np.float32
    assert np.array_equal(got, ref)
    differ = _bits(got) != _bits(ref)
    if name in ("Q4_1", "Q4_K"):
        assert not differ.any()
    else:
        assert np.all(ref[differ] == 0.0)
    # float16 scales: MLX computes in float16 and the values differ (why the layers keep float32)
    half = np.array(mx.dequantize(mx.array(w), mx.array(scales).astype(mx.float16), mx.array(biases).astype(mx.float16),
                                  group_size=32, bits=bits).astype(mx.float32))
    assert not np.array_equal(half, ref)


def test_mlx_packing_is_mlx_own():
    """Our packing is the one mx.quantize writes: MLX's own codes unpacked and repacked are unchanged,
    and moved into Q4_1 and back they are the same words."""
    mx = _mlx()
    x = mx.array(_rng(4).standard_normal((4, 256)).astype(np.float32))
    w, s, b = mx.quantize(x, group_size=32, bits=4)
    raw, report = codes.from_mlx_affine_q4(np.array(w), np.array(s), np.array(b), 32)
    w2, _, _ = codes.to_mlx_affine(raw, "Q4_1", (4, 256))
    assert np.array_equal(w2, np.array(w))


def test_other_types_refused_by_name():
    raw = np.zeros(176, np.uint8)
    with pytest.raises(ConversionError, match=r"Q5_K has no exact MLX layout .*; dequantize instead"):
        codes.to_mlx_affine(raw, "Q5_K", (1, 256))


def test_mxfp4_moves_into_mlx_mxfp4():
    mx = _mlx()
    shape = (5, 256)
    x = _rng(5).standard_normal(shape).astype(np.float32)
    raw = gguf.quants.quantize(x, T.MXFP4)
    ref = gguf.quants.dequantize(raw, T.MXFP4)
    w, scales = codes.to_mlx_mxfp4(raw, shape)
    assert scales.dtype == np.uint8 and np.array_equal(scales.reshape(-1), raw.reshape(-1, 17)[:, 0])  # copied
    got = np.array(mx.dequantize(mx.array(w), mx.array(scales), group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))
    assert np.array_equal(_bits(got), _bits(ref))
    # any bytes (exponents 0..254, every code): equal in value, bits differing only in zeros' sign
    blocks = _rng(11).integers(0, 256, (64, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(64) * 4  # 0 .. 252
    ref = gguf.quants.dequantize(blocks.reshape(4, -1), T.MXFP4)
    w, scales = codes.to_mlx_mxfp4(blocks.reshape(4, -1), (4, 512))
    got = np.array(mx.dequantize(mx.array(w), mx.array(scales), group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))
    assert np.array_equal(got, ref) and np.all(ref[_bits(got) != _bits(ref)] == 0)
    blocks[3, 0] = 255
    with pytest.raises(ConversionError, match="exponent byte 255"):
        codes.to_mlx_mxfp4(blocks.reshape(4, -1), (4, 512))
    # and MLX's own mxfp4 codes are laid out the same way: moved into GGUF blocks they dequantize alike
    wq, sq = mx.quantize(mx.array(x), group_size=32, bits=4, mode="mxfp4")
    blocks = np.empty((5 * 8, 17), np.uint8)
    blocks[:, 0] = np.array(sq).reshape(-1)
    c = codes._unpack4(np.array(wq)).reshape(-1, 2, 16)
    blocks[:, 1:] = c[:, 0] | (c[:, 1] << 4)
    mlx_vals = np.array(mx.dequantize(wq, sq, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))
    assert np.array_equal(gguf.quants.dequantize(blocks, T.MXFP4).reshape(shape), mlx_vals)


def _bf16(a) -> np.ndarray:
    """An MLX bfloat16 array as ml_dtypes.bfloat16 (numpy's buffer protocol has no bfloat16)."""
    return np.array(a.view(mx.uint16)).view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_keep_mlx_q4_as_q4_1_codes_identical(group_size):
    """mx.quantize(bits=4) codes of a bfloat16 model become Q4_1 blocks unchanged; the bfloat16 scales
    and biases are float16 values, so gguf dequantizes each block to exactly MLX's affine map
    computed in float32."""
    mx = _mlx()
    x = mx.array(_rng(6).standard_normal((8, 256)).astype(np.float32) * 0.05).astype(mx.bfloat16)
    w, s, b = mx.quantize(x, group_size=group_size, bits=4)
    s32, b32 = np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))
    raw, report = codes.from_mlx_affine_q4(np.array(w), _bf16(s), _bf16(b), group_size)
    assert raw.shape == (8, 256 // 32 * 20)
    assert report == {"exact": True, "inexact_scales": 0, "inexact_biases": 0, "max_abs_error": 0.0}
    blocks = raw.reshape(-1, 20)
    # codes identical
    unpacked = codes._unpack4(np.array(w)).reshape(-1, 2, 16)
    assert np.array_equal(blocks[:, 4:], unpacked[:, 0] | (unpacked[:, 1] << 4))
    # scales and biases identical, shared by the group's blocks
    per = group_size // 32
    assert np.array_equal(blocks[:, 0:2].copy().view("<f2").astype(np.float32).reshape(8, -1), np.repeat(s32, per, 1))
    assert np.array_equal(blocks[:, 2:4].copy().view("<f2").astype(np.float32).reshape(8, -1), np.repeat(b32, per, 1))
    ref = np.array(mx.dequantize(w, mx.array(s32), mx.array(b32), group_size=group_size, bits=4))
    assert np.array_equal(_bits(gguf.quants.dequantize(raw, T.Q4_1)), _bits(ref))


def test_keep_states_scales_float16_cannot_hold():
    mx = _mlx()
    x = mx.array(_rng(7).standard_normal((4, 128)).astype(np.float32))
    w, s, b = mx.quantize(x, group_size=64, bits=4)  # float32 scales: most are no float16 value
    raw, report = codes.from_mlx_affine_q4(np.array(w), np.array(s), np.array(b), 64)
    assert not report["exact"] and report["inexact_scales"] > 0
    ours = gguf.quants.dequantize(raw, T.Q4_1).astype(np.float64)
    q = codes._unpack4(np.array(w)).astype(np.float64).reshape(4, 2, 64)
    exact = (np.array(s, np.float64)[..., None] * q + np.array(b, np.float64)[..., None]).reshape(4, 128)
    # the reported bound is the largest difference of parameters times codes (float64): the
    # values gguf computes stay within it plus float32 rounding
    assert 0 < report["max_abs_error"] < 1e-2
    assert np.abs(ours - exact).max() <= report["max_abs_error"] + 1e-6
    with pytest.raises(ConversionError, match="multiple of 32"):
        codes.from_mlx_affine_q4(np.array(w), np.array(s), np.array(b), 48)
    with pytest.raises(ConversionError, match="scales and biases must be"):
        codes.from_mlx_affine_q4(np.array(w), np.array(s)[:, :1], np.array(b), 64)


# --------------------------------------------------------------------------- writer
def test_writer_output_is_gguf_py_output(tmp_path, written):
    """Written from a read file's metadata (types kept) and raw bytes, the file is byte for byte the one
    gguf-py's GGUFWriter wrote."""
    path, _, _ = written
    out = tmp_path / "copy.gguf"
    with open_gguf(path) as f:
        plan = [(n, t.shape, t.ggml_type) for n, t in f.tensors.items()]
        with GGUFOutput(out, f.metadata, plan, types=f.metadata_types) as o:
            for n in f.keys():
                o.write(n, f.raw(n))
    assert out.read_bytes() == path.read_bytes()


def test_writer_quantizes_and_infers_types(tmp_path):
    rng = _rng(8)
    arrays = {n: rng.standard_normal((4, 64)).astype(np.float32) for n in codes.QUANTIZABLE}
    meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.rope.freq_base": 1e4,
            "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1, 1],
            "tokenizer.ggml.scores": [0.0, -1.0], "tokenizer.ggml.add_bos_token": True, "neg": -3,
            "tokenizer.ggml.bos_token_id": 1, "split.count": 1,
            "typed": (5, VT.UINT8, None), "typed.arr": ([1, 2], VT.ARRAY, VT.UINT16), "typed.f": (2.5, VT.FLOAT64)}
    plan = [(f"t.{n}", (4, 64), n) for n in codes.QUANTIZABLE] + [("raw.q4_k", (2, 256), "Q4_K"), ("ids", (3,), "I32")]
    path = tmp_path / "out.gguf"
    q4k = valid_q4_k(2, 256)
    out = GGUFOutput(path, meta, plan, types={"split.count": VT.UINT16})
    for n in codes.QUANTIZABLE:
        out.write(f"t.{n}", arrays[n])
    out.write("raw.q4_k", q4k.tobytes())
    out.write("ids", np.array([1, 2, 3]))
    out.close()
    ref = gguf.GGUFReader(str(path))
    types = {k: f.types[0] for k, f in ref.fields.items()}
    assert types["llama.block_count"] == VT.UINT32 and types["llama.rope.freq_base"] == VT.FLOAT32
    assert types["neg"] == VT.INT32 and types["split.count"] == VT.UINT16 and types["tokenizer.ggml.add_bos_token"] == VT.BOOL
    assert ref.fields["tokenizer.ggml.token_type"].types == [VT.ARRAY, VT.INT32]
    assert ref.fields["tokenizer.ggml.scores"].types == [VT.ARRAY, VT.FLOAT32]
    assert ref.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    assert types["typed"] == VT.UINT8 and ref.fields["typed"].contents() == 5 and types["typed.f"] == VT.FLOAT64
    assert ref.fields["typed.arr"].types == [VT.ARRAY, VT.UINT16] and ref.fields["typed.arr"].contents() == [1, 2]
    by_name = {t.name: t for t in ref.tensors}
    for n in codes.QUANTIZABLE:
        t = by_name[f"t.{n}"]
        expect = np.ascontiguousarray(gguf.quants.quantize(arrays[n], T[n])).view(np.uint8).reshape(-1)
        assert t.tensor_type == T[n] and np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), expect), n
    assert np.array_equal(np.asarray(by_name["raw.q4_k"].data).view(np.uint8).reshape(-1), q4k.reshape(-1))
    with open_gguf(path) as f:
        for t in ref.tensors:
            assert np.array_equal(f.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
        assert np.array_equal(f.get("ids"), [1, 2, 3]) and f.get("ids").dtype == np.int32
        assert f.metadata["neg"] == -3 and f.metadata["tokenizer.ggml.scores"] == [0.0, -1.0]


def test_writer_refusals_leave_no_file(tmp_path):
    path = tmp_path / "bad.gguf"
    plan = [("a", (2, 32), "F32"), ("b", (2, 32), "Q8_0")]
    with pytest.raises(SpecError, match="not.*multiple|no multiple of the block size 32"):
        GGUFOutput(path, {}, [("a", (2, 33), "Q8_0")])
    with pytest.raises(SpecError, match="appears twice"):
        GGUFOutput(path, {}, [("a", (2, 32), "F32"), ("a", (2, 32), "F32")])
    with pytest.raises(SpecError, match="63"):
        GGUFOutput(path, {}, [("x" * 64, (2, 32), "F32")])
    with pytest.raises(SpecError, match="empty list"):
        GGUFOutput(path, {"k": []}, plan)
    with pytest.raises(SpecError, match="does not fit UINT8"):
        GGUFOutput(path, {"k": 300}, plan, types={"k": VT.UINT8})
    assert not path.exists()
    out = GGUFOutput(path, {}, plan)
    with pytest.raises(SpecError, match="expected 'a' next"):
        out.write("b", np.zeros((2, 32), np.float32))
    with pytest.raises(SpecError, match="takes 256 bytes; got 3"):
        out.write("a", b"abc")
    out.write("a", np.zeros((2, 32), np.float32))
    with pytest.raises(CheckpointError, match="first: 'b'.*removed"):
        out.close()
    assert not path.exists()
    with pytest.raises(RuntimeError):
        with GGUFOutput(path, {}, plan) as out:
            raise RuntimeError("interrupted")
    assert not path.exists()


# --------------------------------------------------------------------------- split models
def test_split_model_opens_every_part(tmp_path):
    a, tensors = sample_tensors()
    write_with_gguf_py(tmp_path / "model.gguf", tensors, SAMPLE_KV, split_max_tensors=4)
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for part in parts:  # any part's name opens the whole model
        with open_gguf(tmp_path / part) as f:
            assert f.keys() == list(tensors) and len(f.paths) == 3
            assert f.metadata["llama.context_length"] == 128 and f.metadata["split.count"] == 3
            assert np.array_equal(f.get("f32"), a)
            assert np.array_equal(f.get("cube"), tensors["cube"][0])
            assert f.tensors["cube"].path.endswith("00003-of-00003.gguf")
    # a single file that is merely named like one part of one
    write_with_gguf_py(tmp_path / "one-00001-of-00001.gguf", {"f32": tensors["f32"]}, [])
    with open_gguf(tmp_path / "one-00001-of-00001.gguf") as f:
        assert f.keys() == ["f32"] and np.array_equal(f.get("f32"), a)
    (tmp_path / parts[2]).unlink()
    with pytest.raises(CheckpointError, match="model-00003-of-00003.gguf: no such file"):
        open_gguf(tmp_path / parts[0])
    (tmp_path / parts[1]).rename(tmp_path / "lone.gguf")
    with pytest.raises(CheckpointError, match="lone.gguf is part 1 .* split into 3 files"):
        open_gguf(tmp_path / "lone.gguf")


# --------------------------------------------------------------------------- inspect
def test_describe_lists_linear_layers_with_their_types(tmp_path):
    from dense_bridge.backends.gguf._file import describe

    rng = _rng(9)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    tensors = {"token_embd.weight": (a, None), "blk.0.attn_q.weight": (gguf.quants.quantize(a, T.Q8_0), T.Q8_0),
               "blk.0.attn_q.bias": (np.zeros(64, np.float32), None), "blk.0.ffn_down.weight": (valid_q4_k(4, 256), T.Q4_K),
               "blk.0.attn_norm.weight": (np.ones(32, np.float32), None), "output.weight": (a.astype(np.float16), None)}
    path = tmp_path / "m.gguf"
    write_with_gguf_py(path, tensors, [])
    doc = describe(path)
    assert doc["kind"] == "GGUF file (version 3)" and doc["architecture"] == "llama"
    assert doc["bytes"] == path.stat().st_size and doc["files"] == [str(path)]
    rows = {r["layer"]: r for r in doc["linear_layers"]}
    assert sorted(rows) == ["blk.0.attn_q", "blk.0.ffn_down", "output"]  # no embedding table, no norm
    assert rows["blk.0.attn_q"] == {"layer": "blk.0.attn_q", "in_features": 32, "units": 64, "bias": True,
                                    "dtype": "Q8_0", "layout": "out_in", "layout_source": rows["blk.0.attn_q"]["layout_source"],
                                    "tensors": ["blk.0.attn_q.weight", "blk.0.attn_q.bias"]}
    assert (rows["blk.0.ffn_down"]["in_features"], rows["blk.0.ffn_down"]["units"], rows["blk.0.ffn_down"]["dtype"]) \
        == (256, 4, "Q4_K")
    assert rows["output"]["dtype"] == "F16"
    assert {t["name"]: t["dtype"] for t in doc["tensors"]}["blk.0.attn_norm.weight"] == "F32"


def test_cli_inspect_reads_gguf(tmp_path, capsys):
    """``dense-bridge inspect model.gguf``: through the port format's ``port_inspect`` verb (the GGUF
    port format is registered by the port layer's backend)."""
    from dense_bridge.ports._dirs import formats

    if "gguf" not in formats():
        pytest.skip("the gguf port format is not registered in this tree (backends/gguf/_manifest.py)")
    from dense_bridge.cli._main import main

    a = _rng(10).standard_normal((64, 32)).astype(np.float32)
    path = tmp_path / "m.gguf"
    write_with_gguf_py(path, {"blk.0.attn_q.weight": (gguf.quants.quantize(a, T.Q4_0), T.Q4_0)}, [])
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GGUF file (version 3)" in out and "blk.0.attn_q" in out and "Q4_0" in out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:100])
    assert main(["inspect", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
