"""Tensor-parallel train step on torch DTensor (gloo, CPU): 1, 2 and 4 processes.

The model: 4 x Dense(4096) (in 4096), compiled with ``db.compile(..., parallel="auto")``
(column, row, column, row); one train step = forward, backward of L = sum(y^2), plain SGD
update. Each process runs one intra-op thread (``torch.set_num_threads(1)``). Reported per
world size (median over the timed steps, rank 0; ranks agree within noise):

- step: the wall time of one train step;
- local compute: the same step on this rank's shard shapes with plain ``nn.Linear`` modules in
  one process (no DTensor, no communication): what the step would cost with free communication;
- comm share: 1 - local compute / step (communication plus DTensor bookkeeping);
- rank CPU: rank 0's process CPU time per step (all its threads, gloo's included): the work one
  rank does, which is what shrinks with N even when a loaded machine starves the wall clock;
- speedup: step(1) / step(N); ideal-scaling ratio: speedup / N.

The machine has 2 cores: 4 processes share 2 cores, so their ideal is a speedup of 2, not 4
(the table gives both ratios). The world-size-1 row is the plain single-process model.

    python benchmarks/bench_parallel.py [--width 4096] [--batch 32] [--steps 5] [--worlds 1 2 4]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dense_bridge as db  # noqa: E402


def spec(width: int) -> db.Sequential:
    return db.Sequential([db.Dense(width, in_features=width)] + [db.Dense(width) for _ in range(3)])


def _time_steps(model, x, steps: int, sync=lambda: None, cpu: list | None = None) -> list[float]:
    params = list(model.parameters())
    times = []
    for i in range(steps + 1):  # the first step warms up
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for p in params:
            p.grad = None
        model(x).square().sum().backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-1e-6)
        c1 = time.process_time()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.append(c1 - c0)
    return times


def _local_model(width: int, world: int) -> nn.Module:
    """This rank's shard shapes as plain Linear layers: column (out/N), row (in/N), ..."""
    w = width // world
    return nn.Sequential(nn.Linear(width, w), nn.Linear(w, width), nn.Linear(width, w), nn.Linear(w, width))


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((args.batch, args.width)).astype(np.float32))
    cpu: list[float] = []
    if world == 1:
        model = db.compile(spec(args.width), "torch", seed=0)
        step = _time_steps(model, x, args.steps, cpu=cpu)
        local = step
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = db.compile(spec(args.width), "torch", seed=0, parallel="auto")
        step = _time_steps(model, x, args.steps, sync=dist.barrier, cpu=cpu)
        del model
        local = _time_steps(_local_model(args.width, world), x, args.steps, sync=dist.barrier)
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step": statistics.median(step), "local": statistics.median(local),
                       "cpu": statistics.median(cpu)}, f)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "parallel.md"))
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for world in args.worlds:
            out = os.path.join(d, f"{world}.json")
            mp.spawn(_worker, args=(world, _port(), args, out), nprocs=world)
            with open(out) as f:
                rows[world] = json.load(f)
            print(world, rows[world], flush=True)
    base = rows.get(1, {}).get("step")
    load = os.getloadavg()
    lines = [f"# Tensor-parallel train step (torch DTensor, gloo, CPU)", "",
             f"`python benchmarks/bench_parallel.py --width {args.width} --batch {args.batch} --steps {args.steps}`: "
             f"4 x Dense({args.width}), batch {args.batch}, float32, one intra-op thread per process, "
             f"{os.cpu_count()} cores (4 processes share 2 cores: their ideal speedup here is 2). "
             f"Load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (the machine was shared: noisy).",
             "", "| processes | step (s) | local compute (s) | comm share | rank CPU (s) | speedup | speedup / N | speedup / min(N, cores) |",
             "|---|---|---|---|---|---|---|---|"]
    cores = os.cpu_count() or 1
    for world, r in rows.items():
        speed = base / r["step"] if base else float("nan")
        share = max(0.0, 1 - r["local"] / r["step"]) if world > 1 else 0.0
        lines.append(f"| {world} | {r['step']:.3f} | {r['local']:.3f} | {share:.0%} | {r['cpu']:.3f} | {speed:.2f} | "
                     f"{speed / world:.2f} | {speed / min(world, cores):.2f} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
