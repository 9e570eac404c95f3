"""Tensor parallelism on torch: gloo on CPU, 2 and 4 ranks, in ONE spawn of 4 processes.

A spawn costs seconds here (4 interpreters importing torch on 2 cores), so every check runs in
one process group of 4, forked from a forkserver that imported torch once (``start_workers``),
in three stages separated by barriers; the 2-rank runs are on a
``DeviceMesh`` of ranks 0 and 1 passed as ``group=`` (ranks 2 and 3 wait):

- A, 2 ranks: compile/compare/shard shapes, an explicit plan, save (sharded and DCP);
- B, 4 ranks: load A's checkpoints (2->4), compare, set_params, train, save; bfloat16; seed=None;
  a single-file checkpoint loaded with parallel= (bytes read and peak memory measured); save of
  that 64 MiB model (memory measured);
- C, 2 ranks: load B's checkpoints (4->2, memory measured).

The test process then loads every directory whole. Worker assertions fail the test through
mp.spawn's ProcessRaisedException.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
import torch.multiprocessing as mp  # noqa: E402

import dense_bridge as db  # noqa: E402
from dense_bridge.parallel._plan import resolve_plan  # noqa: E402
from dense_bridge.parallel._sharded_dir import INDEX_NAME, read_index  # noqa: E402
from dense_bridge.checkpoints import open_checkpoint  # noqa: E402

WORLD = 4


def mlp(dtype="float32"):
    """The 4-layer MLP of the issue: a mask on a column layer, softmax at the end."""
    return db.Sequential([db.Dense(32, in_features=16, activation="relu", dtype=dtype),
                          db.Dense(16, activation="gelu", dtype=dtype),
                          db.Dense(32, activation="tanh", mask=db.wiring.random(16, 32, 0.5, 1), dtype=dtype),
                          db.Dense(8, activation="softmax", dtype=dtype)])


def gathering_mlp():
    """A column layer followed by log_softmax (gathers first), and a fused softmax on a column layer."""
    return db.Sequential([db.Dense(16, in_features=8), db.Activation("log_softmax"), db.Dense(8),
                          db.Dense(16, activation="relu"), db.Dense(8, activation="softmax")])


def random_bias_mlp():
    """Every parameter drawn from the seed (biases too), and a replicated layer (position 2) in
    the plan SEED_NONE_PLAN: ranks drawing different models would show in every tensor."""
    return db.Sequential([db.Dense(8, in_features=4, bias_init="glorot_uniform"),
                          db.Dense(8, bias_init="glorot_uniform"), db.Dense(4, bias_init="glorot_uniform")])


SEED_NONE_PLAN = {0: "column", 1: "row"}
BIG = db.Sequential([db.Dense(2048, in_features=2048), db.Dense(2048), db.Dense(2048), db.Dense(2048)])  # 64 MiB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bytes_read() -> int:
    """Bytes this process has read through read/pread (``rchar``; mmap'd pages not counted)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def peak_rss_growth(fn):
    """(result, peak RSS - RSS before) of ``fn()``, sampled every 0.5 ms by a thread."""
    import ctypes

    # hand freed heap memory back first, so reusing it cannot hide an allocation during fn
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    t = threading.Thread(target=sample)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return out, max(peak[0], _rss()) - start


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _same(a, b):
    assert set(a) == set(b), (sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def _check_model(spec, world, group=None):
    """Outputs and gradients (db.testing.compare, every layer), shard shapes and dtypes."""
    model = db.compile(spec, "torch", seed=0, parallel="auto", group=group)
    ref = db.compile(spec, "torch", seed=0)
    report = db.testing.compare(model, ref, seed=1)
    assert report.passed, str(report)
    full = db.get_params(ref)
    _same(db.get_params(model), full)
    local = db.get_params(model, local=True)
    plan = resolve_plan(spec, "auto", world)
    assert sorted(local) == sorted(full)
    for key, shard in local.items():
        pos, name = key.split(".")
        assert shard.array.dtype == full[key].dtype, (key, shard.array.dtype)
        assert np.array_equal(full[key][shard.index], shard.array), key
        style = plan[int(pos)].style
        split = {"column": {"kernel": 1, "mask": 1, "bias": 0}, "row": {"kernel": 0, "mask": 0}}[style].get(name)
        expected = list(full[key].shape)
        if split is not None:
            expected[split] //= world
        assert list(shard.array.shape) == expected, (key, shard.array.shape, expected)
    return model, ref, report


def _train_step(model, ref, spec):
    """One SGD step with momentum and weight decay on both: same params, masked weights stay 0."""
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((6, spec.in_features)).astype(np.float32))
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        for _ in range(2):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    got, want = db.get_params(model), db.get_params(ref)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    masked = got["2.mask"] == 0
    assert masked.any() and (got["2.kernel"][masked] == 0).all()
    mask = model[2].mask
    assert type(mask).__name__ == "DTensor" and mask.to_local().shape != mask.shape  # sharded, not replicated


def _dump(d, name, value):
    with open(os.path.join(d, name), "w") as f:
        json.dump(value, f)


def _stage_a(rank, d, mesh2):
    """2 ranks on ``mesh2``: compare, an explicit plan with a replicated layer, saves."""
    spec = mlp()
    model, _, _ = _check_model(spec, 2, mesh2)
    other = db.compile(spec, "torch", seed=0, parallel={0: "column", 2: "column", 3: "row"}, group=mesh2)
    assert type(other[1].weight).__name__ == "Parameter" and type(other[0].weight).__name__ == "DTensor"
    report = db.testing.compare(other, db.compile(spec, "torch", seed=0), seed=3)
    assert report.passed, str(report)
    db.save(model, os.path.join(d, "tp2"))
    db.save(model, os.path.join(d, "dcp2"), format="dcp")
    bf = db.compile(mlp("bfloat16"), "torch", seed=0, parallel="auto", group=mesh2)
    db.save(bf, os.path.join(d, "bf2"))


def _stage_b(rank, d):
    """4 ranks over the world (group=None)."""
    spec = mlp()
    want = db.get_params(db.compile(spec, "torch", seed=0))
    for name in ("tp2", "dcp2"):  # 2 -> 4, bit-exact
        loaded = db.load(os.path.join(d, name), "torch", parallel="auto")
        _same(db.get_params(loaded), want)
    model, ref, _ = _check_model(spec, WORLD)
    _check_model(gathering_mlp(), WORLD)
    new = db.get_params(db.compile(spec, "torch", seed=5))  # set_params scatters by declaration
    db.set_params(model, new)
    _same(db.get_params(model), new)
    db.set_params(model, want)
    db.save(model, os.path.join(d, "tp4"))
    db.save(model, os.path.join(d, "dcp4"), format="dcp")
    _train_step(model, ref, spec)
    del model, ref

    # bfloat16: shards keep the dtype, outputs within bfloat16's tolerance, 2 -> 4 bit-exact
    bspec = mlp("bfloat16")
    bf, _, report = _check_model(bspec, WORLD)
    assert report.dtype == "bfloat16" and bf[0].weight.dtype == torch.bfloat16, (report.dtype, bf[0].weight.dtype)
    bwant = db.get_params(db.compile(bspec, "numpy", seed=0))
    _same(db.get_params(db.load(os.path.join(d, "bf2"), "torch", parallel="auto")), bwant)
    db.save(bf, os.path.join(d, "bf4"))
    if rank == 0:
        _dump(d, "bf-report.json", {"dtype": str(report.dtype), "rows": len(report.rows),
                                   "worst_units": report.worst.units, "worst_abs": report.worst.max_abs_error})

    # seed=None: one random model (rank 0's seed) on every rank, a new one per call
    a = db.get_params(db.compile(random_bias_mlp(), "torch", parallel=SEED_NONE_PLAN))
    b = db.get_params(db.compile(random_bias_mlp(), "torch", parallel=SEED_NONE_PLAN))
    views = [None] * WORLD
    dist.all_gather_object(views, a)
    for other in views[1:]:
        _same(other, views[0])  # the replicated layer 2 and the row bias too: the same draw everywhere
    assert not np.array_equal(a["0.kernel"], b["0.kernel"])

    # a single-file checkpoint (saved by one process) loaded with parallel=: each rank reads its blocks
    single = os.path.join(d, "big.safetensors")
    before = _bytes_read()
    big, grew = peak_rss_growth(lambda: db.load(single, "torch", parallel="auto"))
    read = _bytes_read() - before
    local = db.get_params(big, local=True, copy=False)
    with open_checkpoint(single) as ckpt:
        for key, s in local.items():
            assert np.array_equal(ckpt.get(key)[s.index], s.array), key
    _dump(d, f"single-{rank}.json", {"read": read, "peak_growth": grew,
                                     "shard": sum(s.array.nbytes for s in local.values())})
    _, grew = peak_rss_growth(lambda: db.save(big, os.path.join(d, "big4")))
    _dump(d, f"save-mem-{rank}.json", {"peak_growth": grew})


def _stage_c(rank, d, mesh2):
    """2 ranks on ``mesh2``: 4 -> 2 loads bit-exact, and the 64 MiB one measured."""
    want = db.get_params(db.compile(mlp(), "torch", seed=0))
    for name in ("tp4", "dcp4"):
        loaded = db.load(os.path.join(d, name), "torch", parallel="auto", group=mesh2)
        _same(db.get_params(loaded), want)
    bf = db.load(os.path.join(d, "bf4"), "torch", parallel="auto", group=mesh2)
    _same(db.get_params(bf), db.get_params(db.compile(mlp("bfloat16"), "numpy", seed=0)))
    big, grew = peak_rss_growth(lambda: db.load(os.path.join(d, "big4"), "torch", parallel="auto", group=mesh2))
    local = db.get_params(big, local=True, copy=False)
    _dump(d, f"load-mem-{rank}.json", {"peak_growth": grew, "shard": sum(s.array.nbytes for s in local.values())})


def _worker(rank, world, port, d):
    from torch.distributed.device_mesh import DeviceMesh

    _init(rank, world, port)
    mesh2 = DeviceMesh("cpu", [0, 1])  # every rank makes it (a new process group); only 0 and 1 use it
    if rank < 2:
        _stage_a(rank, d, mesh2)
    dist.barrier()
    _stage_b(rank, d)
    dist.barrier()
    if rank < 2:
        _stage_c(rank, d, mesh2)
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what every worker imports, imported once by the forkserver the workers are forked from
PRELOAD = ["torch", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "dense_bridge.backends.torch",
           "dense_bridge.parallel._save_load", "dense_bridge.parallel._dcp", "dense_bridge.testing", __name__]


def start_workers(fn, args, nprocs):
    """``mp.spawn`` semantics (a worker's exception fails the call), but the processes are forked
    from a forkserver that imported torch and dense_bridge once: 4 spawned interpreters each
    importing torch cost ~8 s of the 2 cores, forks ~2 s. The forkserver itself is a fresh
    process (no threads, no OpenMP pool), so forking it is safe; spawn where there is none."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.spawn(fn, args=args, nprocs=nprocs)
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tp"))
    db.save(db.compile(BIG, "numpy", seed=0), os.path.join(d, "big.safetensors"))  # one process, one file
    start_workers(_worker, (WORLD, _port(), d), WORLD)
    return d


def test_parallel_matches_single_process_and_checkpoints_reshard(runs):
    """2 and 4 ranks: compare passes, shard shapes, training with masks, 2->4 and 4->2 loads
    (sharded directory and DCP) bit-exact; all asserted inside the workers."""
    want = db.get_params(db.compile(mlp(), "torch", seed=0))
    for name in ("tp2", "tp4", "dcp2", "dcp4"):  # N -> 1: one process reads it whole
        spec, params = db.load(os.path.join(runs, name))
        assert spec == mlp()
        _same(params, want)
    files = sorted(os.listdir(os.path.join(runs, "tp4")))
    assert files == [INDEX_NAME] + [f"rank-{r:05d}-of-00004.safetensors" for r in range(4)]
    native = db.load(os.path.join(runs, "tp4"), "torch")
    _same(db.get_params(native), want)


def test_bfloat16_shards_and_checkpoints_bit_exact(runs):
    """bfloat16 on 2 and 4 ranks: compare passed at bfloat16 tolerance inside the workers; the
    2 -> 4 -> 2 -> 1 checkpoint chain keeps every bit and the dtype."""
    want = db.get_params(db.compile(mlp("bfloat16"), "numpy", seed=0))
    assert all(str(v.dtype) == "bfloat16" for v in want.values())
    for name in ("bf2", "bf4"):
        spec, params = db.load(os.path.join(runs, name))
        assert spec == mlp("bfloat16")
        _same(params, want)
        assert {t["dtype"] for t in read_index(os.path.join(runs, name))["tensors"].values()} == {"bfloat16"}
    rep = _json(os.path.join(runs, "bf-report.json"))  # compare on 4 ranks, every layer
    assert rep["dtype"] == "bfloat16" and rep["rows"] >= 16 and rep["worst_units"] <= 1, rep
    print(f"bfloat16, 4 ranks vs one process: worst {rep['worst_units']:.3f} tolerance units, "
          f"max abs error {rep['worst_abs']:.2e}")


def test_single_file_loads_in_parallel_reading_only_the_blocks(runs):
    """A 64 MiB single .safetensors file (saved by one process) loaded with parallel= on 4 ranks:
    each rank reads (pread bytes, /proc/self/io rchar) and grows by about its quarter, not the
    file; the blocks were checked bit-exact against the file inside the workers."""
    full = 4 * 2048 * 2049 * 4
    for r in range(WORLD):
        m = _json(os.path.join(runs, f"single-{r}.json"))
        print(f"single file -> 4 ranks, rank {r}: read {m['read'] / 2**20:.1f} MiB, peak RSS growth "
              f"{m['peak_growth'] / 2**20:.1f} MiB (shard {m['shard'] / 2**20:.1f} MiB, file {full / 2**20:.1f} MiB)")
        assert m["shard"] < full / WORLD * 1.01
        assert m["read"] < m["shard"] * 1.1 + (1 << 20), (r, m)
        assert m["peak_growth"] < m["shard"] * 1.6 + (8 << 20), (r, m)


def test_single_file_parallel_load_refuses_what_it_cannot_slice(tmp_path):
    """Errors before any process group is needed: no backend, a file without a spec."""
    path = str(tmp_path / "p.safetensors")
    db.save(db.get_params(db.compile(mlp(), "numpy", seed=0)), path)  # params only: no spec inside
    with pytest.raises(db.SpecError, match="backend"):
        db.load(path, parallel="auto")
    with pytest.raises(db.CheckpointError, match="spec"):
        db.load(path, "torch", parallel="auto")


def _json(path):
    with open(path) as f:
        return json.load(f)


def test_peak_memory_near_the_shard(runs):
    """Save (4 ranks) and load (2 ranks) of a 64 MiB model: each rank's peak RSS growth stays
    near its own shard (16 / 32 MiB), below the whole model: no gather to one process. Measured
    numbers are printed (pytest -s) for the report."""
    full = 4 * 2048 * 2049 * 4
    for r in range(4):
        grew = _json(os.path.join(runs, f"save-mem-{r}.json"))["peak_growth"]
        print(f"save, 4 ranks, rank {r}: peak RSS growth {grew / 2**20:.1f} MiB (shard {full / 4 / 2**20:.1f} MiB)")
        assert grew < full / 4 * 1.6, (r, grew, full)
    for r in range(2):
        m = _json(os.path.join(runs, f"load-mem-{r}.json"))
        print(f"load 4->2, rank {r}: peak RSS growth {m['peak_growth'] / 2**20:.1f} MiB "
              f"(shard {m['shard'] / 2**20:.1f} MiB, model {full / 2**20:.1f} MiB)")
        assert m["shard"] < full * 0.6  # a row layer's bias is replicated
        assert m["peak_growth"] < m["shard"] * 1.6 + (8 << 20), (r, m)
        assert m["peak_growth"] < full


def test_index_slices_must_tile(runs, tmp_path):
    for case in ("gap", "overlap", "outside"):
        d = tmp_path / case
        shutil.copytree(os.path.join(runs, "tp2"), d)
        index = json.loads((d / INDEX_NAME).read_text())
        shards = index["tensors"]["0.kernel"]["shards"]
        if case == "gap":
            del shards[1]
        elif case == "overlap":
            shards[1]["start"][1] -= 1
        else:
            shards[1]["stop"][1] += 1
        (d / INDEX_NAME).write_text(json.dumps(index))
        with pytest.raises(db.CheckpointError, match="0.kernel"):
            db.load(d)
    read_index(os.path.join(runs, "tp2"))  # the untouched one is valid


def test_plan_rules():
    plan = resolve_plan(mlp(), "auto", 4)
    assert [(p.style, p.input_sharded, p.gather_output) for p in plan.values()] == [
        ("column", False, False), ("row", True, False), ("column", False, False), ("row", True, False)]
    plan = resolve_plan(gathering_mlp(), "auto", 2)  # log_softmax after a column layer: gathered
    assert [(i, p.style, p.gather_output) for i, p in plan.items()] == [
        (0, "column", True), (2, "column", False), (3, "row", False), (4, "column", True)]
    with pytest.raises(db.SpecError, match="divide by 3"):
        resolve_plan(mlp(), "auto", 3)
    with pytest.raises(db.SpecError, match="Dense"):
        resolve_plan(gathering_mlp(), {1: "row"}, 2)
    with pytest.raises(db.SpecError, match="column"):
        resolve_plan(mlp(), {0: "diagonal"}, 2)
    plan = resolve_plan(mlp(), {0: "column", 3: "row"}, 2)  # a replicated layer next: gather
    assert plan[0].gather_output and not plan[3].input_sharded


def test_parallel_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(db.DenseBridgeError, match="torch.distributed"):
        db.compile(mlp(), "torch", seed=0, parallel="auto")
