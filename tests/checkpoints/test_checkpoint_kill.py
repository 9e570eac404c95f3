"""Saves killed at random moments: the path always loads the old checkpoint
or the new one exactly, and what killed saves leave behind does not accumulate.

A subprocess saves generation after generation of parameters to one path (``gen k`` has its
own values, a pure function of k), printing "start k" before and "done k" after each save; the
test SIGKILLs it after a random delay (fixed seed), at whatever moment of a save that falls on:
writing a temporary, syncing, renaming, between the shards and the index, sweeping. Then:

- ``db.load(path)`` equals, bit for bit, the last generation whose save completed (or the
  previous contents) or the one being saved when the kill came: never a mix, never an error;
- the directory holds, besides the checkpoint's own files, at most what the saves killed since
  the last completed one can leave (each: its temporaries and, sharded, the shards it renamed
  before its index): everything older was reclaimed by the save that completed after it. Temporaries are reclaimed only when no
  process holds their lock and they are older than ``RECLAIM_MIN_AGE_S``; the test stands in
  for the time between kills by aging every leftover past that guard (instead of sleeping);
- after the last kill one complete save leaves exactly the checkpoint's files.

Single file and sharded (index + shards), 16 kills each.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np

import dense_bridge as db
from dense_bridge.checkpoints._io import RECLAIM_MIN_AGE_S

KILLS = 16  # per layout: 32 in all
SHARD = 96 * 1024  # bytes: the ~260 KB checkpoint below is 3-4 shards

GEN = textwrap.dedent("""
    import numpy as np
    import dense_bridge as db

    SPEC = db.Sequential([db.Dense(128, in_features=96, activation="relu"), db.Dense(128), db.Dense(64)])

    def gen(k):
        rng = np.random.default_rng(1000 + k)
        out = {}
        for i, layer in enumerate(SPEC.layers):
            out[f"{i}.kernel"] = rng.standard_normal((layer.in_features, layer.units), dtype=np.float32)
            out[f"{i}.bias"] = np.full((layer.units,), k, dtype=np.float32)  # the generation, readable
        return out
""")

WORKER = GEN + textwrap.dedent("""
    import sys
    path, shard, first, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    params = {k: gen(k) for k in range(first, first + 40)}  # ready before the first save
    limit = int(shard) if shard != "0" else None
    db.save((SPEC, params[first]), warm, max_shard_size=limit)  # lazy imports done: kills land in saves
    print("ready", flush=True)
    for k in range(first, first + 40):
        print("start", k, flush=True)
        db.save((SPEC, params[k]), path, max_shard_size=limit)
        print("done", k, flush=True)
""")

namespace: dict = {}
exec(GEN, namespace)
SPEC, gen = namespace["SPEC"], namespace["gen"]


def _bits(params: dict) -> dict:
    return {k: np.asarray(v).tobytes() for k, v in params.items()}


def _checkpoint_files(path: str) -> set[str]:
    """The files the checkpoint at ``path`` consists of now (single: itself; sharded: index + shards)."""
    index = path + ".index.json"
    if os.path.exists(index) and not os.path.exists(path):
        with open(index) as f:
            shards = set(json.load(f)["weight_map"].values())
        return {os.path.basename(index)} | shards
    return {os.path.basename(path)}


def _age_leftovers(directory: str, keep: set[str]) -> list[str]:
    old = time.time() - RECLAIM_MIN_AGE_S - 60
    left = sorted(n for n in os.listdir(directory) if n not in keep)
    for n in left:
        os.utime(os.path.join(directory, n), (old, old))
    return left


def _progress(out: str) -> tuple[list[int], list[int]]:
    """The generations the worker started and finished saving, from its "start k"/"done k" lines.

    Only complete lines (ended by a newline) are read as numbers. The kill may cut the last
    line short: a cut "done" (any prefix of "done k" past "d") still proves that the save
    before it returned, since the worker prints it only after ``db.save``, so it counts for the
    generation started last; a cut "start" line proves nothing and is ignored.
    """
    *lines, tail = out.split("\n")
    started: list[int] = []
    done: list[int] = []
    for line in lines:
        word, _, number = line.partition(" ")
        if word in ("start", "done"):
            (started if word == "start" else done).append(int(number))
    if tail and "done".startswith(tail[:4]) and started and (not done or done[-1] != started[-1]):
        done.append(started[-1])
    return started, done


def _kill_loop(tmp_path, shard: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    directory = tmp_path / "ck"
    directory.mkdir()
    path = str(directory / "model.safetensors")
    warm = str(tmp_path / "warm.safetensors")
    db.save((SPEC, gen(0)), path, max_shard_size=shard or None)
    current = 0  # the generation the path holds
    max_shards = 0
    leftovers_seen = []
    unreclaimed = 0  # kills since the last save that completed
    first = 1
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", WORKER, path, str(shard), str(first), warm],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.08))  # a save of this size takes 5-30 ms: kills land anywhere in one
        proc.kill()
        proc.wait(timeout=30)
        out = proc.stdout.read()  # not communicate(timeout=): it would skip readline's buffer
        proc.stdout.close()
        started, done = _progress(out)
        old = done[-1] if done else current
        candidates = {old} | ({started[-1]} if started else set())
        spec, params = db.load(path)
        assert spec == SPEC
        got = _bits(params)
        matches = [k for k in candidates if got == _bits(gen(k))]
        assert matches, (f"after a kill the path holds none of generations {sorted(candidates)} exactly: "
                         f"{ {k: float(np.asarray(v).ravel()[0]) for k, v in params.items() if 'bias' in k} } "
                         f"{sorted(os.listdir(tmp_path))} {out}")
        current = matches[0]
        first = max(started, default=first - 1) + 1
        keep = _checkpoint_files(path)
        max_shards = max(max_shards, len(keep))
        left = _age_leftovers(str(directory), keep)
        leftovers_seen.append((len(left), bool(started) and (not done or done[-1] != started[-1])))
        # a killed save leaves at most its temporaries (file or index, one per shard) and the
        # shards it renamed before its index; the next save that completes reclaims all of it,
        # so what is left comes from the kills since the last completed save only
        unreclaimed = 1 if done else unreclaimed + 1
        assert len(left) <= unreclaimed * (2 * max_shards + 1), (left, out)
    # a complete save after the last kill leaves exactly the checkpoint
    db.save((SPEC, gen(first)), path, max_shard_size=shard or None)
    assert sorted(os.listdir(directory)) == sorted(_checkpoint_files(path))
    assert _bits(db.load(path)[1]) == _bits(gen(first))
    return leftovers_seen


def test_killed_single_file_saves_load_old_or_new_and_leave_nothing_behind(tmp_path):
    seen = _kill_loop(tmp_path, 0, seed=10)
    print("leftovers after each kill, (count, killed mid-save):", seen)
    assert sum(mid for _, mid in seen) >= KILLS // 3  # the kills did land inside saves


def test_killed_sharded_saves_load_old_or_new_and_leave_nothing_behind(tmp_path):
    seen = _kill_loop(tmp_path, SHARD, seed=11)
    print("leftovers after each kill, (count, killed mid-save):", seen)
    assert sum(mid for _, mid in seen) >= KILLS // 3
