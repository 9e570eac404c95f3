"""Checkpoint safety: what a save may delete, leftovers of killed saves, header
validation as the safetensors reference does it, bounded work for small hostile input,
non-regular files, and the one NaN/Inf / mask / integer rule of load, set_params, compile
and convert.

Real files on disk, real frameworks; every case asserts what is on disk afterwards or the
exact error class and the file it names.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.checkpoints._io import RECLAIM_MIN_AGE_S, AtomicFiles

from conftest import require_backend

SPEC = db.Sequential([db.Dense(4, in_features=3, activation="relu"), db.Dense(2)])


def params(seed: int = 0) -> dict:
    return db.get_params(db.compile(SPEC, "numpy", seed=seed))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def age(path, seconds: float = RECLAIM_MIN_AGE_S + 60) -> None:
    """Make ``path`` look older than the reclaim guard (as a leftover of a save long killed)."""
    old = time.time() - seconds
    os.utime(path, (old, old))


# =============================================================== what a save may delete
def write_index(path, weight_map: dict, fmt: str = "dense_bridge") -> None:
    with open(path, "w") as f:
        json.dump({"metadata": {"format": fmt}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_an_edited_index_cannot_steer_deletions(tmp_path, sharded):
    # an old index (claiming to be ours) lists an unrelated file, the output itself and the index
    train = tmp_path / "train.py"
    train.write_text("print('precious')\n")
    out = tmp_path / "model.safetensors"
    index = tmp_path / "model.safetensors.index.json"
    write_index(index, {"a": "train.py", "b": "model.safetensors", "c": "model.safetensors.index.json",
                        "d": "../escape.txt"})
    escape = tmp_path.parent / "escape.txt"
    escape.write_text("outside")
    files = db.save((SPEC, params()), out, max_shard_size=64 if sharded else None)
    assert train.read_text() == "print('precious')\n"
    assert escape.read_text() == "outside"
    for f in files:
        assert os.path.isfile(f), f
    spec, got = db.load(out)
    assert spec == SPEC and same(got, params())


def test_a_hub_index_and_its_shards_are_never_removed(tmp_path):
    out = tmp_path / "model.safetensors"
    hub_shard = tmp_path / "model-00001-of-00001.safetensors"
    db.save(params(1), hub_shard)  # stands for a hub's own shard
    write_index(tmp_path / "model.safetensors.index.json", {"0.kernel": hub_shard.name}, fmt="pt")
    db.save((SPEC, params()), out)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert hub_shard.is_file()


def test_shards_of_another_tool_with_our_naming_scheme_are_kept(tmp_path):
    # a file that looks like one of our shards by name but was not written by a save of this path
    out = tmp_path / "model.safetensors"
    lookalike = tmp_path / "model-0123abcd-00001-of-00002.safetensors"
    db.save(params(1), lookalike)  # a dense_bridge file, but not a shard of model.safetensors' index
    lookalike_bytes = lookalike.read_bytes()
    db.save((SPEC, params()), out, max_shard_size=64)
    db.save((SPEC, params()), out)
    assert lookalike.read_bytes() == lookalike_bytes


def test_switching_between_single_and_sharded_cleans_only_our_files(tmp_path):
    out = tmp_path / "model.safetensors"
    shards = db.save((SPEC, params(0)), out, max_shard_size=64)
    assert len(shards) > 2
    db.save((SPEC, params(1)), out)  # single file: the old index and its shards go
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert same(db.load(out)[1], params(1))
    shards = db.save((SPEC, params(2)), out, max_shard_size=64)  # sharded again: the single file goes
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f) for f in shards)
    assert same(db.load(out)[1], params(2))


def test_a_sharded_save_refuses_to_be_shadowed_by_a_foreign_file(tmp_path):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"not ours at all")
    with pytest.raises(db.CheckpointError, match="not a dense_bridge checkpoint") as info:
        db.save((SPEC, params()), out, max_shard_size=64)
    assert str(out) in str(info.value)
    assert os.listdir(tmp_path) == ["model.safetensors"] and out.read_bytes() == b"not ours at all"


# =============================================================== leftovers of killed saves
def test_orphan_shards_and_old_temporaries_are_reclaimed(tmp_path):
    out = tmp_path / "model.safetensors"
    first = db.save((SPEC, params(0)), out, max_shard_size=64)
    # a killed save: shards renamed into place, its index never written; temporaries left behind
    orphan = tmp_path / "model-feedbeef-00001-of-00002.safetensors"
    first_id = json.loads(Path(first[-1]).read_text())["metadata"]["save_id"]
    orphan.write_bytes(Path(first[0]).read_bytes().replace(first_id.encode(), b"feedbeef"))
    temps = [tmp_path / "model.safetensors.tmp-0badc0de", tmp_path / "model.safetensors.index.json.tmp-12345678",
             tmp_path / "model-feedbeef-00002-of-00002.safetensors.tmp-abcdef01"]
    for t in temps:
        t.write_bytes(b"\0" * 100)
        age(t)
    young = tmp_path / "model.safetensors.tmp-0000beef"
    young.write_bytes(b"\0")  # a save may have created it this instant: kept
    unrelated = tmp_path / "notes.safetensors.tmp-0badc0de"
    unrelated.write_bytes(b"\0")
    age(unrelated)
    second = db.save((SPEC, params(1)), out, max_shard_size=64)
    left = set(os.listdir(tmp_path))
    assert left == {os.path.basename(f) for f in second} | {young.name, unrelated.name}
    assert same(db.load(out)[1], params(1))


def test_a_temporary_held_by_a_running_save_is_never_reclaimed(tmp_path):
    # another process is "saving": it holds its temporary's lock (as AtomicFiles does) and sleeps
    out = tmp_path / "model.safetensors"
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        from dense_bridge.checkpoints._io import AtomicFiles
        tx = AtomicFiles({str(out)!r})
        tmp = tx.temp_for({str(out)!r})
        old = time.time() - 3600
        os.utime(tmp, (old, old))
        open({str(ready)!r}, "w").write(tmp)
        time.sleep(60)
    """)])
    try:
        deadline = time.time() + 30
        while not ready.exists() or not ready.read_text():
            assert time.time() < deadline and holder.poll() is None, "holder did not start"
            time.sleep(0.05)
        tmp = ready.read_text()
        db.save((SPEC, params()), out)
        assert os.path.exists(tmp), "a running save's temporary was removed"
    finally:
        holder.kill()
        holder.wait()
    db.save((SPEC, params()), out)  # its owner is gone now: reclaimed
    assert not os.path.exists(tmp)


def test_atomic_files_lock_is_released_on_commit_and_abort(tmp_path):
    from dense_bridge.checkpoints._io import reclaim_temporaries, temp_pattern

    target = str(tmp_path / "x.bin")
    tx = AtomicFiles(target)
    tmp = tx.temp_for(target)
    age(tmp)
    assert reclaim_temporaries(str(tmp_path), temp_pattern(target)) == []  # locked by tx
    tx.abort()
    assert not os.path.exists(tmp)
    with AtomicFiles(target) as tx:
        tmp = tx.temp_for(target)
        Path(tmp).write_bytes(b"data")
    assert Path(target).read_bytes() == b"data" and not os.path.exists(tmp)


# =============================================================== header validation
def st_file(path, header: dict, data: bytes, *, length_delta: int = 0, raw_header: bytes | None = None) -> str:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) + length_delta) + raw + data)
    return str(path)


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
DATA = np.arange(4, dtype=np.float32).tobytes()


def edited(**entries) -> dict:
    header = json.loads(json.dumps(GOOD))
    for name, changes in entries.items():
        header[name].update(changes)
    return header


HEADER_CASES = {
    "bool offsets": (edited(b={"data_offsets": [8, True]}), DATA, {}, "data_offsets"),
    "float offsets": (edited(b={"data_offsets": [8.0, 16]}), DATA, {}, "data_offsets"),
    "begin > end": (edited(b={"data_offsets": [16, 8]}), DATA, {}, "data_offsets"),
    "out of range": (edited(b={"data_offsets": [8, 24]}), DATA, {}, "truncated"),
    "overlap": (edited(b={"data_offsets": [4, 12]}), DATA[:12], {}, "overlaps"),
    "same bytes twice": (edited(b={"data_offsets": [0, 8]}), DATA[:8], {}, "overlaps"),
    "gap": (edited(b={"data_offsets": [12, 20]}), DATA + DATA[:4], {}, "unused"),
    "trailing bytes": (GOOD, DATA + b"\0" * 8, {}, "cover"),
    "length one short": (GOOD, DATA, {"length_delta": -1}, ""),
    "length one long": (GOOD, DATA, {"length_delta": 1}, ""),
    "byte count": (edited(b={"shape": [3]}), DATA, {}, "needs"),
    "list dtype": (edited(a={"dtype": ["F32"]}), DATA, {}, "dtype"),
    "unknown dtype": (edited(a={"dtype": "F31"}), DATA, {}, "dtype"),
    "bool shape": (edited(a={"shape": [True, 2]}), DATA, {}, "shape"),
    "huge shape": (edited(a={"shape": [2**40, 2**40]}), DATA, {}, "needs"),
    "negative shape": (edited(a={"shape": [-2]}), DATA, {}, "shape"),
    "deep nesting": (None, DATA, {"raw_header": b'{"x":' + b"[" * 100000 + b"]" * 100000 + b"}"}, "nested"),
    "5000-digit int": (None, DATA, {"raw_header": b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],'
                                    b'"data_offsets":[0,8]}}'}, "JSON"),
    "duplicate key": (None, DATA, {"raw_header": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                   b'"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'}, "twice"),
    "not an object": (None, DATA, {"raw_header": b"[1, 2]"}, "no supported format"),
    "array metadata": (None, DATA, {"raw_header": b'{"__metadata__": [], "a": 1}'}, "header"),
    "metadata not strings": ({**GOOD, "__metadata__": {"format": ["x"]}}, DATA, {}, "metadata"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_malformed_headers_are_checkpoint_errors_naming_the_file(tmp_path, case):
    header, data, kw, needle = HEADER_CASES[case]
    path = st_file(tmp_path / "bad.safetensors", header, data, **kw)
    with pytest.raises(db.CheckpointError) as info:
        db.load(path, spec=db.Dense(2, in_features=1))
    assert path in str(info.value)
    assert needle in str(info.value)


def test_the_good_file_of_those_cases_loads(tmp_path):
    # the reference cases above differ from this one file by one edit each
    from dense_bridge.checkpoints._safetensors import SafetensorsFile

    with SafetensorsFile(st_file(tmp_path / "good.safetensors", GOOD, DATA)) as f:
        np.testing.assert_array_equal(f.get("b"), [2, 3])


def canonical_with_spec_meta(tmp_path, spec_json: str) -> str:
    path = tmp_path / "meta.safetensors"
    db.save(db.get_params(db.compile(db.Dense(2, in_features=2), "numpy", seed=0)), path)
    from dense_bridge.checkpoints._safetensors import SafetensorsFile

    with SafetensorsFile(path) as f:
        meta = dict(f.metadata)
        tensors = {n: np.array(f.get(n)) for n in f.keys()}
    meta["spec"] = spec_json
    header, offset, blobs = {"__metadata__": meta}, 0, []
    for n, a in tensors.items():
        header[n] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    return st_file(path, header, b"".join(blobs))


SPEC_CASES = {
    "1-D mask": {"class_name": "Dense", "config": {"units": 2, "in_features": 2, "mask": {
        "shape": [4], "packbits_base64": "AA=="}}},
    "60000x60000 mask from 4 bytes": {"class_name": "Dense", "config": {"units": 60000, "in_features": 60000,
                                                                        "mask": {"shape": [60000, 60000],
                                                                                 "packbits_base64": "AAAA"}}},
    "list class name": {"class_name": ["Dense"], "config": {}},
    "deep config": json.loads("[" * 500 + "]" * 500),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_a_bad_spec_in_the_metadata_is_a_checkpoint_error(tmp_path, case):
    path = canonical_with_spec_meta(tmp_path, json.dumps(SPEC_CASES[case]))
    with pytest.raises(db.CheckpointError, match="spec in its metadata") as info:
        db.load(path)
    assert path in str(info.value)


def test_hostile_files_allocate_little_under_an_address_space_limit(tmp_path):
    # a 2 KB file claiming a 60000x60000 mask (gigabytes to allocate), read in a process
    # whose address space is capped at its start + 256 MiB
    bad = canonical_with_spec_meta(tmp_path, json.dumps(SPEC_CASES["60000x60000 mask from 4 bytes"]))
    huge = st_file(tmp_path / "huge.safetensors", edited(a={"shape": [2**20, 2**20]}), DATA)
    code = textwrap.dedent(f"""
        import resource, sys
        import dense_bridge as db
        vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        for path in ({bad!r}, {huge!r}):
            try:
                db.load(path)
            except db.CheckpointError as exc:
                assert path in str(exc), exc
            else:
                sys.exit("loaded " + path)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


# =============================================================== non-regular files
def test_fifo_and_directory_are_refused_at_once(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    shard_fifo = tmp_path / "s-00001-of-00001.safetensors"
    os.mkfifo(shard_fifo)
    index = tmp_path / "s.safetensors.index.json"
    write_index(index, {"0.kernel": shard_fifo.name})
    code = textwrap.dedent(f"""
        import dense_bridge as db
        for path in ({str(fifo)!r}, {str(index)!r}, {str(tmp_path)!r}):
            try:
                db.load(path, spec=db.Dense(2, in_features=2))
            except db.CheckpointError as exc:
                print(type(exc).__name__, exc)
            else:
                print("LOADED", path)
    """)
    # a FIFO can block an open() forever: the subprocess timeout is the hang guard
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and len(lines) == 3, run.stdout + run.stderr
    assert "FIFO" in lines[0] and str(fifo) in lines[0]
    assert "FIFO" in lines[1] and str(shard_fifo) in lines[1]
    assert "directory" in lines[2]


# =============================================================== bounded compile
def test_compiling_more_than_memory_is_a_spec_error_naming_the_bytes(backend):
    for spec in (db.Dense(10**12, in_features=1000), db.Sequential([db.Dense(4, in_features=2), db.Dense(10**6),
                                                                      db.Dense(10**7)])):
        with pytest.raises(db.SpecError, match=r"needs [\d,]+ bytes .* only [\d,]+ bytes of memory"):
            db.compile(spec, backend, seed=0)


# =============================================================== one rule everywhere
def nan_params() -> dict:
    p = params()
    p["1.bias"] = np.array([np.nan, 1.0], np.float32)
    return p


def test_load_without_backend_refuses_nan_unless_allowed(tmp_path):
    path = tmp_path / "nan.safetensors"
    db.save((SPEC, nan_params()), path, allow_nonfinite=True)
    with pytest.raises(db.CheckpointError, match=r"1\.bias: 1 NaN or Inf") as info:
        db.load(path)
    assert str(path) in str(info.value)
    spec, got = db.load(path, allow_nonfinite=True)
    assert np.isnan(got["1.bias"][0])
    db.save(nan_params(), tmp_path / "params_only.safetensors")  # no spec: still refused
    with pytest.raises(db.CheckpointError, match="NaN or Inf"):
        db.load(tmp_path / "params_only.safetensors")


def test_the_nan_rule_is_the_same_for_every_verb(tmp_path, backend):
    path = tmp_path / "nan.safetensors"
    db.save((SPEC, nan_params()), path, allow_nonfinite=True)
    with pytest.raises(db.CheckpointError, match="NaN or Inf"):
        db.load(path, backend)
    model = db.load(path, backend, allow_nonfinite=True)
    assert np.isnan(db.get_params(model)["1.bias"][0])
    with pytest.raises(db.ConversionError, match="NaN or Inf"):
        db.convert(model, to="numpy")
    assert np.isnan(db.get_params(db.convert(model, to="numpy", allow_nonfinite=True))["1.bias"][0])
    clean = db.compile(SPEC, backend, seed=0)
    with pytest.raises(db.ConversionError, match="NaN or Inf"):
        db.set_params(clean, nan_params())
    db.set_params(clean, nan_params(), allow_nonfinite=True)
    with pytest.raises(db.ConversionError, match="NaN or Inf"):
        db.compile(SPEC, backend, params=nan_params())
    assert np.isnan(db.get_params(db.compile(SPEC, backend, params=nan_params(), allow_nonfinite=True))["1.bias"][0])


def test_a_stored_mask_that_differs_from_the_spec_is_refused(tmp_path):
    spec = db.Dense(3, in_features=3, mask=db.wiring.banded(3, 3, 0))
    p = db.get_params(db.compile(spec, "numpy", seed=0))
    p["mask"] = np.ones((3, 3), np.float32)
    path = tmp_path / "m.safetensors"
    db.save(p, path)  # params only: nothing to check against yet
    with pytest.raises(db.CheckpointError, match="6 of 9 mask entries differ"):
        db.load(path, spec=spec)
    with pytest.raises(db.CheckpointError, match="6 of 9 mask entries differ"):
        db.load(path, "numpy", spec=spec)


def test_integer_params_only_where_exact():
    spec = db.Dense(2, in_features=2, use_bias=False)
    exact = {"kernel": np.array([[1, 2], [3, 2**24]], np.int64)}
    np.testing.assert_array_equal(db.get_params(db.compile(spec, "numpy", params=exact))["kernel"],
                                  exact["kernel"].astype(np.float32))
    with pytest.raises(db.ConversionError, match=r"1 integer value\(s\) of dtype int64 are not exact in float32"):
        db.compile(spec, "numpy", params={"kernel": np.array([[1, 2], [3, 2**24 + 1]], np.int64)})


# =============================================================== the command line
def test_cli_exits_2_without_traceback_on_hostile_files(tmp_path):
    bad = st_file(tmp_path / "bad.safetensors", edited(b={"data_offsets": [4, 12]}), DATA[:12])
    deep = st_file(tmp_path / "deep.safetensors", None, DATA,
                   raw_header=b'{"x":' + b"[" * 100000 + b"]" * 100000 + b"}")
    meta = canonical_with_spec_meta(tmp_path, json.dumps(SPEC_CASES["1-D mask"]))
    for path in (bad, deep, meta):
        for args in (["inspect", path], ["convert", path, "--to", "numpy", "-o", str(tmp_path / "o.safetensors")],
                     ["check", path, path]):
            run = subprocess.run([sys.executable, "-m", "dense_bridge.cli", *args], capture_output=True, text=True,
                                 timeout=60, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
            assert run.returncode == 2, (args, run.stdout, run.stderr)
            assert "Traceback" not in run.stderr and path in run.stderr, (args, run.stderr)
            assert not os.path.exists(tmp_path / "o.safetensors")
