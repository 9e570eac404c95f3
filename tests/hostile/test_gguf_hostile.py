"""Hostile GGUF files: every lie a header can tell is a CheckpointError naming the file (and the
key or tensor), in bounded time and memory.

Each file is built byte by byte here (gguf-py's writer cannot write a lie). Every case is opened
under ``tracemalloc`` (numpy registers its allocations there): a reader that allocated what a
header claims (arrays of billions, strings of exabytes) would show it; and under a time bound.
"""
from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from dense_bridge import CheckpointError  # noqa: E402
from dense_bridge.backends.gguf._file import open_gguf  # noqa: E402

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_CODES = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q",
          I64: "<q", F64: "<d"}
#: a case may take this long (a cold import of gguf's quant tables is done by the fixture)
SECONDS = 2.0
#: and allocate this much (the largest honest file here is a few kB)
PEAK_BYTES = 8 << 20


def s(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, value) -> bytes:
    return s(key) + struct.pack("<I", vtype) + val(vtype, value)


def val(vtype: int, value) -> bytes:
    if vtype == STR:
        return s(value)
    if vtype == ARR:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(val(etype, v) for v in items)
    return struct.pack(_CODES[vtype], value)


def ti(name: str, ne: list[int], gtype: int, offset: int, n_dims: int | None = None) -> bytes:
    n = len(ne) if n_dims is None else n_dims
    return s(name) + struct.pack("<I", n) + struct.pack(f"<{len(ne)}q", *ne) + struct.pack("<IQ", gtype, offset)


def gguf_bytes(kvs: list[bytes], infos: list[bytes], data: bytes, *, n_tensors=None, n_kv=None, version=3,
               magic=b"GGUF", alignment=32) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    return head + data


def valid() -> bytes:
    """A small honest file: a few metadata types and two tensors (F32 and Q8_0)."""
    kvs = [kv("general.architecture", STR, "llama"), kv("llama.context_length", U32, 64),
           kv("tokenizer.ggml.tokens", ARR, (STR, ["a", "b"])), kv("tokenizer.ggml.scores", ARR, (F32, [0.0, 1.0]))]
    infos = [ti("a.weight", [32, 2], 0, 0), ti("b.weight", [32, 2], 8, 256)]
    return gguf_bytes(kvs, infos, bytes(256) + bytes(68) + bytes(28))


def check(tmp_path, content: bytes, *patterns: str, name: str = "hostile.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as err:
            open_gguf(path).close()
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert str(path) in message, message
    for p in patterns:
        assert p in message, (p, message)
    assert elapsed < SECONDS, (elapsed, message)
    assert peak < PEAK_BYTES, (peak, message)
    return message


@pytest.fixture(autouse=True)
def _warm(tmp_path):
    """gguf's tables imported before anything is timed or traced."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(valid())
    with open_gguf(path) as f:
        assert f.keys() == ["a.weight", "b.weight"] and f.metadata["tokenizer.ggml.tokens"] == ["a", "b"]


def test_the_valid_base_file_reads_in_gguf_py_too(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(valid())
    ref = gguf.GGUFReader(str(path))
    assert [t.name for t in ref.tensors] == ["a.weight", "b.weight"]
    with open_gguf(path) as f:
        assert np.array_equal(f.get("b.weight"), np.zeros((2, 32), np.float32))


def test_bad_magic_and_version(tmp_path):
    check(tmp_path, b"GGML" + valid()[4:], "not a GGUF file", "b'GGML'")
    check(tmp_path, b"", "not a GGUF file")
    check(tmp_path, gguf_bytes([], [], b"", version=1), "GGUF version 1")
    check(tmp_path, gguf_bytes([], [], b"", version=99), "GGUF version 99")
    big = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    check(tmp_path, big, "big-endian")


def test_truncated_anywhere(tmp_path):
    """Every prefix of an honest file: cut in the header, the metadata, the tensor infos, the data."""
    content = valid()
    end = len(content) - 28  # the last tensor's end: the padding after it is optional
    for n in list(range(0, 200)) + list(range(200, end, 7)) + [end - 1]:
        check(tmp_path, content[:n], name=f"cut{n}.gguf")


def test_lengths_and_counts_past_the_end(tmp_path):
    check(tmp_path, gguf_bytes([struct.pack("<Q", 2**62) + b"key"], [], b""), "metadata key #0", "2")
    check(tmp_path, gguf_bytes([s("k") + struct.pack("<I", STR) + struct.pack("<Q", 2**40) + b"abc"], [], b""),
          "metadata key 'k'", "claims 1099511627776 bytes")
    check(tmp_path, gguf_bytes([s("k") + struct.pack("<I", STR) + struct.pack("<Q", 2**20) + b"abc"], [], b""),
          "metadata key 'k'", "truncated")
    check(tmp_path, gguf_bytes([], [], b"", n_kv=2**40), "metadata entries")
    check(tmp_path, gguf_bytes([], [], b"", n_tensors=2**40), "tensors")
    check(tmp_path, gguf_bytes([], [], b"", n_kv=2**64 - 1), "metadata entries")
    # arrays claiming billions of elements, of every kind
    for etype in (U8, F32, U64, STR, ARR):
        head = s("arr") + struct.pack("<I", ARR) + struct.pack("<IQ", etype, 3_000_000_000)
        check(tmp_path, gguf_bytes([head], [], bytes(64)), "metadata key 'arr'", "3000000000 elements")
    # a nested array whose inner array lies
    inner = struct.pack("<IQ", U32, 2**50)
    head = s("nest") + struct.pack("<I", ARR) + struct.pack("<IQ", ARR, 1) + inner
    check(tmp_path, gguf_bytes([head], [], b""), "nest")
    # many honest-looking elements: more than the metadata limit, refused before building them
    count = (1 << 23) + 1
    head = s("many") + struct.pack("<I", ARR) + struct.pack("<IQ", U8, count) + bytes(count)
    check(tmp_path, gguf_bytes([head], [], b""), "many", "8388608")


def test_nesting_too_deep(tmp_path):
    value = struct.pack("<IQ", U8, 0)
    for _ in range(10):
        value = struct.pack("<IQ", ARR, 1) + value
    check(tmp_path, gguf_bytes([s("deep") + struct.pack("<I", ARR) + value], [], b""), "deep", "nests arrays deeper")


def test_unknown_value_types(tmp_path):
    check(tmp_path, gguf_bytes([s("k") + struct.pack("<I", 13) + bytes(8)], [], b""), "'k'", "unknown value type 13")
    check(tmp_path, gguf_bytes([s("k") + struct.pack("<I", 2**31)], [], b""), "unknown value type")
    check(tmp_path, gguf_bytes([s("k") + struct.pack("<I", ARR) + struct.pack("<IQ", 77, 1) + bytes(8)], [], b""),
          "'k'", "unknown value type 77")
    check(tmp_path, gguf_bytes([kv("flag", BOOL, 2)], [], b""), "flag", "BOOL holding 2")
    check(tmp_path, gguf_bytes([s(b"\xff\xfekey") + struct.pack("<I", U8) + b"\0"], [], b""), "not UTF-8")


def test_duplicate_names(tmp_path):
    check(tmp_path, gguf_bytes([kv("k", U8, 1), kv("k", U8, 2)], [], b""), "metadata key 'k' appears twice")
    infos = [ti("w", [32], 0, 0), ti("w", [32], 0, 128)]
    check(tmp_path, gguf_bytes([], infos, bytes(256)), "tensor 'w' appears twice")


def test_dimension_counts_and_dimensions(tmp_path):
    for n_dims in (0, 5, 2**31, 2**32 - 1):
        check(tmp_path, gguf_bytes([], [ti("w", [32], 0, 0, n_dims=n_dims)], bytes(128)),
              "tensor 'w'", f"{n_dims} dimensions")
    check(tmp_path, gguf_bytes([], [ti("w", [32, -1], 0, 0)], bytes(128)), "tensor 'w'", "negative dimension")
    # dimensions whose product overflows 64 bits
    check(tmp_path, gguf_bytes([], [ti("w", [2**40, 2**40, 2**40], 0, 0)], bytes(128)), "tensor 'w'", "needs")
    check(tmp_path, gguf_bytes([], [ti("w", [2**62, 4], 0, 0)], bytes(128)), "tensor 'w'")


def test_unknown_ggml_types(tmp_path):
    for code in (4, 5, 31, 999, 2**32 - 1):  # 4, 5: Q4_2 and Q4_3, long removed
        check(tmp_path, gguf_bytes([], [ti("w", [32], code, 0)], bytes(128)), "tensor 'w'", f"unknown ggml type {code}")


def test_shape_not_divisible_by_block(tmp_path):
    check(tmp_path, gguf_bytes([], [ti("w", [33, 2], 2, 0)], bytes(128)), "tensor 'w'", "Q4_0 block size 32")
    check(tmp_path, gguf_bytes([], [ti("w", [128], 12, 0)], bytes(256)), "tensor 'w'", "Q4_K block size 256")


def test_lying_offsets(tmp_path):
    check(tmp_path, gguf_bytes([], [ti("w", [32], 0, 7)], bytes(256)), "tensor 'w'", "not a multiple of the alignment 32")
    check(tmp_path, gguf_bytes([], [ti("w", [32], 0, 2**60)], bytes(256)), "tensor 'w'", "truncated")
    check(tmp_path, gguf_bytes([], [ti("w", [64], 0, 0)], bytes(128)), "tensor 'w'", "needs 256 bytes")
    check(tmp_path, gguf_bytes([], [ti("w", [64], 0, 0)], bytes(250)), "tensor 'w'", "truncated")  # size past the end
    overlap = [ti("a", [32, 2], 0, 0), ti("b", [32], 0, 128)]
    check(tmp_path, gguf_bytes([], overlap, bytes(512)), "tensor 'b'", "overlap")
    same = [ti("a", [32], 0, 0), ti("b", [32], 0, 0)]
    check(tmp_path, gguf_bytes([], same, bytes(512)), "overlap")


def test_bad_alignment(tmp_path):
    for value in (0, 3, 48):
        check(tmp_path, gguf_bytes([kv("general.alignment", U32, value)], [], b""), "general.alignment", "power of two")
    check(tmp_path, gguf_bytes([kv("general.alignment", U64, 32)], [], b""), "general.alignment must be a UINT32")


def test_split_parts_that_lie(tmp_path):
    def part(no: int, count: int, total: int, tensors: list[str]) -> bytes:
        kvs = [kv("split.no", U16, no), kv("split.count", U16, count), kv("split.tensors.count", I32, total)]
        infos = [ti(t, [32], 0, 128 * i) for i, t in enumerate(tensors)]
        return gguf_bytes(kvs, infos, bytes(128 * len(tensors)))

    (tmp_path / "m-00002-of-00002.gguf").write_bytes(part(1, 2, 2, ["b"]))
    check(tmp_path, part(1, 2, 2, ["a"]), "split.no=1", name="m-00001-of-00002.gguf")
    check(tmp_path, part(0, 3, 2, ["a"]), "split.count=3", name="m-00001-of-00002.gguf")
    check(tmp_path, part(0, 2, 5, ["a"]), "hold 2 tensors but split.tensors.count says 5", name="m-00001-of-00002.gguf")
    check(tmp_path, part(0, 2, 2, ["b"]), "tensor 'b' is also in", name="m-00001-of-00002.gguf")
    check(tmp_path, gguf_bytes([], [], b""), "lacks the integer 'split.no'", name="m-00001-of-00002.gguf")
    check(tmp_path, part(0, 2, 2, ["a"]), "part 0 (counted from 0) of a GGUF model split into 2", name="alone.gguf")
    check(tmp_path, part(0, 2, 2, ["a"]), "cannot be", name="m-00003-of-00002.gguf")


def test_not_a_regular_file(tmp_path):
    """A FIFO is refused, never waited on; a directory or a missing file named."""
    import os

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="pipe.gguf: it is a FIFO"):
        open_gguf(fifo)
    assert time.perf_counter() - start < SECONDS
    with pytest.raises(CheckpointError, match="not a regular file|directory"):
        open_gguf(tmp_path)
    with pytest.raises(CheckpointError, match="missing.gguf: no such file"):
        open_gguf(tmp_path / "missing.gguf")
