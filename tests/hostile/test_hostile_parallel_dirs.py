"""Hostile sharded (tensor-parallel) checkpoint directories: nothing is misread, nothing hangs.

The directories are written by dense_bridge's own engine-free writer functions (the ranks'
files and the index a 2-rank save writes), then broken byte by byte or field by field: blocks
naming the same bytes, overlapping blocks, offsets into a rank file's header, gaps, unknown
index versions, malformed fields, deep JSON, FIFOs, NaN/Inf values, masks and dtypes that
disagree with the spec. Every case is one CheckpointError naming what is wrong, and the files
are byte-identical afterwards.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.parallel._plan import owned_index, params_plan, resolve_plan
from dense_bridge.parallel._sharded_dir import INDEX_NAME, build_index, write_index, write_rank_file

WORLD = 2
SPEC = db.Sequential([db.Dense(8, in_features=6, activation="relu", mask=db.wiring.banded(6, 8, 2)),
                      db.Dense(4)])


def params_of(seed: int) -> dict:
    params = db.get_params(db.compile(SPEC, "numpy", seed=seed))
    return {k: np.array(v) for k, v in params.items()}


def write_dir(directory, params: dict, spec=SPEC) -> str:
    """What a 2-rank ``db.save`` of a parallel model writes, from full canonical ``params``."""
    directory = str(directory)
    plan = resolve_plan(spec, "auto", WORLD)
    for rank in range(WORLD):
        mine = {}
        for key, (style, shape) in params_plan(spec, plan).items():
            index = owned_index(style, key, shape, rank, WORLD)
            if index is not None:
                mine[key] = np.ascontiguousarray(params[key][index])
        write_rank_file(directory, rank, WORLD, mine)
    write_index(directory, build_index(spec, plan, WORLD, {k: v.dtype.name for k, v in params.items()}))
    return directory


def index_of(directory) -> dict:
    with open(os.path.join(directory, INDEX_NAME)) as f:
        return json.load(f)


def put_index(directory, index: dict) -> None:
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump(index, f)


def snapshot(directory) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def refused(directory, match: str, **kwargs) -> db.CheckpointError:
    before = snapshot(directory)
    with pytest.raises(db.CheckpointError, match=match) as info:
        db.load(directory, **kwargs)
    assert snapshot(directory) == before
    return info.value


# ------------------------------------------------------------------ the valid directory
def test_directory_loads_bit_exact_with_and_without_backend(tmp_path):
    params = params_of(0)
    path = write_dir(tmp_path / "d", params)
    spec, got = db.load(path)
    assert spec == SPEC
    for k, v in params.items():
        np.testing.assert_array_equal(got[k], v)
    model = db.load(path, "numpy")
    for k, v in db.get_params(model).items():
        np.testing.assert_array_equal(v, params[k])


# ------------------------------------------------------------------ misread blocks
def test_two_blocks_naming_the_same_bytes_are_refused(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))
    index = index_of(path)
    shards = index["tensors"]["0.kernel"]["shards"]
    shards[1]["file"] = shards[0]["file"]  # rank 0's block read twice, rank 1's never
    put_index(path, index)
    refused(path, "same file")


def test_overlapping_blocks_are_refused(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))
    index = index_of(path)
    t = index["tensors"]["0.kernel"]  # (6, 8) split in columns: [0:4] and [4:8]
    t["shards"][0]["stop"][1] = 6  # [0:6] and [4:8] overlap; the volumes no longer add up either
    t["shards"][1]["start"] = [0, 4]
    t["shards"][1]["stop"] = [3, 8]
    # 6*6 + 3*4 = 48 = 6*8: the volumes add up, so only the overlap test can catch it
    put_index(path, index)
    refused(path, "overlap")


def test_gap_between_blocks_is_refused(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))
    index = index_of(path)
    index["tensors"]["0.kernel"]["shards"][1]["start"][1] = 5
    put_index(path, index)
    refused(path, "gap")


def _rank_file(path: str, rank: int = 0) -> str:
    return os.path.join(path, f"rank-{rank:05d}-of-{WORLD:05d}.safetensors")


def _rewrite_header(file: str, edit) -> None:
    with open(file, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    header, data = edit(header, data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def test_offsets_into_the_header_are_refused(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))

    def edit(header, data):
        entry = header["0.kernel"]
        entry["data_offsets"] = [entry["data_offsets"][0] - 16, entry["data_offsets"][1] - 16]
        return header, data

    _rewrite_header(_rank_file(path), edit)
    refused(path, "data_offsets|overlaps|unused")


def test_rank_file_tensors_sharing_bytes_are_refused(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))

    def edit(header, data):
        header["0.bias"]["data_offsets"] = list(header["0.kernel"]["data_offsets"][:1]) + \
            [header["0.kernel"]["data_offsets"][0] + 4 * 4]
        return header, data

    _rewrite_header(_rank_file(path), edit)
    refused(path, "overlaps|cover")


def test_rank_file_with_trailing_bytes_is_refused(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))
    with open(_rank_file(path), "ab") as f:
        f.write(b"\0" * 64)
    refused(path, "trailing bytes")


@pytest.mark.parametrize("version", [2, "1", None, 1.0, True])
def test_unknown_index_version_is_refused(tmp_path, version):
    path = write_dir(tmp_path / "d", params_of(0))
    index = index_of(path)
    if version is None:
        del index["version"]
    else:
        index["version"] = version
    put_index(path, index)
    refused(path, "index version")


@pytest.mark.parametrize("field,value", [("start", ["0", 0]), ("stop", [6, True]), ("start", None),
                                         ("file", 3), ("file", "../x.safetensors"), ("file", "/etc/passwd")])
def test_malformed_block_fields_are_checkpoint_errors(tmp_path, field, value):
    path = write_dir(tmp_path / "d", params_of(0))
    index = index_of(path)
    index["tensors"]["0.kernel"]["shards"][0][field] = value
    put_index(path, index)
    refused(path, "0.kernel")


@pytest.mark.parametrize("tensor", [[], "x", {"dtype": "float32", "shape": [6, 8], "shards": []},
                                    {"dtype": "complex64", "shape": [6, 8], "shards": [{}]},
                                    {"dtype": "float32", "shape": [-6, 8], "shards": [{}]}])
def test_malformed_tensor_entries_are_checkpoint_errors(tmp_path, tensor):
    path = write_dir(tmp_path / "d", params_of(0))
    index = index_of(path)
    index["tensors"]["0.kernel"] = tensor
    put_index(path, index)
    refused(path, "0.kernel")


def test_deep_json_index_is_a_checkpoint_error(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        f.write('{"format": ' + "[" * 200_000 + "]" * 200_000 + "}")
    refused(path, "nested")


# ------------------------------------------------------------------ the checks a file load applies
def test_nonfinite_values_are_refused_unless_allowed(tmp_path):
    params = params_of(0)
    params["1.kernel"][2, 1] = np.nan
    params["1.bias"][0] = np.inf
    path = write_dir(tmp_path / "d", params)
    refused(path, "NaN or Inf|NaN/Inf")
    refused(path, "NaN or Inf|NaN/Inf", backend="numpy")
    spec, got = db.load(path, allow_nonfinite=True)
    assert np.isnan(got["1.kernel"][2, 1]) and np.isinf(got["1.bias"][0])
    model = db.load(path, "numpy", allow_nonfinite=True)
    assert np.isnan(db.get_params(model)["1.kernel"][2, 1])


def test_mask_differing_from_the_spec_is_refused(tmp_path):
    params = params_of(0)
    params["0.mask"] = np.ones_like(params["0.mask"])  # a full mask, the spec says banded
    path = write_dir(tmp_path / "d", params)
    refused(path, "mask")
    refused(path, "mask", backend="numpy")


def test_dtype_differing_from_the_spec_is_refused(tmp_path):
    params = params_of(0)
    params["1.kernel"] = params["1.kernel"].astype(np.float64)
    path = write_dir(tmp_path / "d", params)
    refused(path, "float64")
    refused(path, "float64", backend="numpy")


def test_index_tensors_differing_from_its_spec_are_refused(tmp_path):
    path = write_dir(tmp_path / "d", params_of(0))
    index = index_of(path)
    index["tensors"]["0.extra"] = index["tensors"]["0.bias"]
    put_index(path, index)
    refused(path, "unexpected keys")


# ------------------------------------------------------------------ nothing hangs
_RUNNER = r"""
import sys, dense_bridge as db
try:
    db.load(sys.argv[1])
except db.CheckpointError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("victim,via_symlink", [("index", False), ("index", True), ("rank", False), ("rank", True)])
def test_fifo_index_or_rank_file_is_refused_at_once(tmp_path, victim, via_symlink):
    path = write_dir(tmp_path / "d", params_of(0))
    target = os.path.join(path, INDEX_NAME) if victim == "index" else _rank_file(path, 1)
    os.remove(target)
    if via_symlink:
        os.mkfifo(tmp_path / "pipe")
        os.symlink(tmp_path / "pipe", target)
    else:
        os.mkfifo(target)
    # a regression blocks in open() forever: a generous timeout catches it, no timed assertion
    run = subprocess.run([sys.executable, "-c", _RUNNER, path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("REFUSED") and "FIFO" in run.stdout, run.stdout


def test_tiling_check_agrees_with_counting_every_element():
    """The corner-sum test against its definition, on random small block sets (1-D to 3-D)."""
    import itertools
    import math
    import random

    from dense_bridge.parallel._sharded_dir import _tiles_exactly

    rng = random.Random(0)
    valid = 0
    for _ in range(3000):
        shape = [rng.randint(1, 4) for _ in range(rng.choice([1, 2, 3]))]
        boxes = []
        for _ in range(rng.randint(1, 5)):
            a = [rng.randint(0, s - 1) for s in shape]
            boxes.append((a, [rng.randint(x + 1, s) for x, s in zip(a, shape)]))
        if rng.random() < 0.4:  # a real split of the whole tensor, sometimes
            axis = rng.randrange(len(shape))
            if shape[axis] > 1:
                cut = rng.randint(1, shape[axis] - 1)
                b1, a2 = list(shape), [0] * len(shape)
                b1[axis], a2[axis] = cut, cut
                boxes = [([0] * len(shape), b1), (a2, list(shape))]
        counts: dict = {}
        for a, b in boxes:
            for element in itertools.product(*[range(x, y) for x, y in zip(a, b)]):
                counts[element] = counts.get(element, 0) + 1
        exact = len(counts) == math.prod(shape) and all(c == 1 for c in counts.values())
        valid += exact
        assert _tiles_exactly(shape, boxes) == exact, (shape, boxes)
    assert valid > 500  # both outcomes exercised


_MANY = r"""
import json, sys
from dense_bridge.parallel._sharded_dir import validate_tiling
n = int(sys.argv[1])
tensor = {"dtype": "float32", "shape": [4, n],
          "shards": [{"file": f"rank-{i}.safetensors", "start": [0, i], "stop": [4, i + 1]} for i in range(n)]}
validate_tiling("t", tensor)
tensor["shards"][-1]["start"][1] -= 1  # the last block overlapping its neighbour
try:
    validate_tiling("t", tensor)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_index_of_20000_blocks_is_validated_without_hanging():
    # an all-pairs check took minutes here; a generous timeout catches a regression, no timed assertion
    run = subprocess.run([sys.executable, "-c", _MANY, "20000"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("CheckpointError") and "overlap" in run.stdout, run.stdout


_HUGE = r"""
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # an allocation attempt fails here, never swaps
import dense_bridge as db
from dense_bridge.parallel._sharded_dir import INDEX_NAME
path = sys.argv[1]
spec = db.Dense(200_000, in_features=200_000, dtype="float64")  # 320 GB of parameters
with open(os.path.join(path, INDEX_NAME), "w") as f:
    json.dump({"format": "dense_bridge.parallel", "version": 1, "world_size": 1, "spec": spec.to_config(),
               "plan": {}, "tensors": {
                   "kernel": {"dtype": "float64", "shape": [200_000, 200_000], "shards": [
                       {"file": "rank-00000-of-00001.safetensors", "start": [0, 0], "stop": [200_000, 200_000]}]},
                   "bias": {"dtype": "float64", "shape": [200_000], "shards": [
                       {"file": "rank-00000-of-00001.safetensors", "start": [0], "stop": [200_000]}]}}}, f)
for backend in (None, "numpy"):
    try:
        db.load(path, backend)
        print("LOADED")
    except db.CheckpointError as exc:
        print("REFUSED", exc)
"""


def test_spec_claiming_more_than_available_memory_is_refused_before_allocating(tmp_path):
    os.mkdir(tmp_path / "d")
    run = subprocess.run([sys.executable, "-c", _HUGE, str(tmp_path / "d")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2 and all(l.startswith("REFUSED") and "MemAvailable" in l for l in lines), run.stdout
