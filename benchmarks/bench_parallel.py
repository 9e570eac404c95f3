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

``--memory`` measures instead what each rank (torch, MLX) or each device (Keras on JAX, Flax)
holds, for 4 x Dense(width) (default 2048: 64 MiB of float32 parameters) on 1, 2 and 4:

- params held: the bytes of the parameter blocks that rank/device holds (torch: DTensor local
  shards; MLX: the module's arrays; JAX: each device's addressable shards of every variable);
- torch and MLX, per rank (one process each): peak RSS growth while compiling and while running
  two train steps (Linux VmHWM, reset before each phase), and for MLX also its allocator's
  ``mx.get_peak_memory()`` over the two steps;
- Keras on JAX and Flax, per device (one process drives 4 virtual CPU devices, JAX being
  single-controller): JAX's CPU backend has no per-device allocator statistics
  (``Device.memory_stats()`` is None), so the train step's per-device peak is XLA's own figure
  for the compiled SPMD program (``compiled.memory_analysis().peak_memory_in_bytes``: one
  device's arguments, outputs and temporaries), next to the addressable-shard bytes.

    python benchmarks/bench_parallel.py --memory [--width 2048] [--batch 32] [--worlds 1 2 4]
        [--engines torch mlx keras flax]
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


# ------------------------------------------------------------------ memory (--memory)
def _mem_spec(width: int) -> db.Sequential:
    return spec(width)


def _rss_phase(fn):
    """(fn(), peak RSS growth in bytes during fn): VmHWM reset to the current RSS first."""
    from _memory import reset_peak, status_bytes

    reset_peak()
    base = status_bytes("VmRSS")
    out = fn()
    return out, status_bytes("VmHWM") - base


def _held(model) -> int:
    local = db.get_params(model, local=True, copy=False)
    return sum(s.array.nbytes for s in local.values())


def _torch_memory(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((args.batch, args.width)).astype(np.float32))
    par = {"parallel": "auto"} if world > 1 else {}
    db.compile(spec(8), "torch", seed=0, **par)  # first use imports DTensor's modules: not the model's memory
    model, compile_peak = _rss_phase(lambda: db.compile(spec(args.width), "torch", seed=0, **par))
    held = _held(model) if world > 1 else sum(p.nbytes for p in db.get_params(model).values())
    _, step_peak = _rss_phase(lambda: _time_steps(model, x, 1))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"held": held, "compile_rss": compile_peak, "step_rss": step_peak}, f)
    if world > 1:
        dist.destroy_process_group()


def _mlx_memory(args, out: str) -> None:
    """One MLX rank (under mlx.launch for world > 1): compile, two train steps."""
    import mlx.core as mx
    import mlx.nn as mnn
    import mlx.optimizers as optim

    group = mx.distributed.init()
    world, rank = group.size(), group.rank()
    par = {"parallel": "auto", "group": group} if world > 1 else {}
    db.compile(spec(8), "mlx", seed=0, **par)  # first use imports and allocates what any model needs
    model, compile_peak = _rss_phase(lambda: db.compile(spec(args.width), "mlx", seed=0, **par))
    mx.eval(model.parameters())
    held = _held(model) if world > 1 else sum(p.nbytes for p in db.get_params(model).values())
    x = mx.array(np.random.default_rng(0).standard_normal((args.batch, args.width)).astype(np.float32))
    opt = optim.SGD(learning_rate=1e-6)
    step = mnn.value_and_grad(model, lambda m, x: mx.sum(mx.square(m(x))))

    def train():
        for _ in range(2):
            _, grads = step(model, x)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)

    mx.reset_peak_memory()
    _, step_peak = _rss_phase(train)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"held": held, "compile_rss": compile_peak, "step_rss": step_peak,
                   "step_mlx_peak": mx.get_peak_memory(), "world": world}, f)


def _device_bytes(arrays) -> dict[int, int]:
    """Device id -> bytes of the shards of ``arrays`` that live on it."""
    held: dict[int, int] = {}
    for a in arrays:
        for s in a.addressable_shards:
            held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
    return held


def _jax_memory(engine: str, args, out: str) -> None:
    """Keras on JAX or Flax in one process over 4 virtual CPU devices: per device, the bytes of
    its parameter shards and XLA's peak for the compiled train step (forward + backward)."""
    import jax
    import jax.numpy as jnp

    x = np.random.default_rng(0).standard_normal((args.batch, args.width)).astype(np.float32)
    assert not jax.devices()[0].memory_stats(), "this JAX backend has allocator stats: use them"
    rows = {}
    for world in args.worlds:
        devices = jax.devices()[:world]
        if engine == "keras":
            from keras import distribution as kd

            group = kd.DeviceMesh((world,), ("model",), devices=devices)
            model = db.compile(spec(args.width), "keras", seed=0, parallel="auto", group=group) if world > 1 \
                else db.compile(spec(args.width), "keras", seed=0)
            tv = [v.value for v in model.trainable_variables]
            ntv = [v.value for v in model.non_trainable_variables]

            def loss(tv, x):
                y, _ = model.stateless_call(tv, ntv, x)
                return jnp.sum(y * y)

            arrays, args_ = tv + ntv, (tv, x)
            lowered = jax.jit(jax.value_and_grad(loss)).lower(*args_)
        else:
            from flax import nnx
            from jax.sharding import AxisType

            mesh = jax.make_mesh((world,), ("model",), axis_types=(AxisType.Auto,), devices=devices)
            model = db.compile(spec(args.width), "flax", seed=0, parallel="auto", group=mesh) if world > 1 \
                else db.compile(spec(args.width), "flax", seed=0)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def loss(params, x):
                return jnp.sum(jnp.square(nnx.merge(graphdef, params, rest)(x)))

            arrays = jax.tree.leaves((params, rest))
            with jax.set_mesh(mesh):
                lowered = jax.jit(jax.value_and_grad(loss)).lower(params, x)
        stats = lowered.compile().memory_analysis()
        held = _device_bytes(arrays)
        rows[world] = {"held": [held.get(d.id, 0) for d in devices], "step_peak": stats.peak_memory_in_bytes,
                       "arguments": stats.argument_size_in_bytes, "temp": stats.temp_size_in_bytes}
        del model, arrays
    with open(out, "w") as f:
        json.dump(rows, f)


def _mlx_rows(args, d: str) -> dict:
    """Run the MLX worker at each world size (mlx.launch --backend ring for N > 1)."""
    import subprocess

    rows = {}
    me = [sys.executable, os.path.abspath(__file__), "--worker", "mlx", "--width", str(args.width),
          "--batch", str(args.batch)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    for world in args.worlds:
        out = os.path.join(d, f"mlx{world}")
        cmd = me + ["--out", out]
        if world > 1:
            cmd = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
                   "--backend", "ring", "-n", str(world), "--starting-port", str(_port_range(world))] + cmd
        subprocess.run(cmd, check=True, env=env)
        rows[world] = [json.load(open(f"{out}.{r}")) for r in range(world)]
    return rows


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_range(n: int) -> int:
    """A base port with base..base+n-1 free now (the ring backend listens on one per rank)."""
    return next(b for b in iter(_port, None) if b + n < 65535 and all(_free(p) for p in range(b, b + n)))


def _jax_rows(engine: str, args, d: str) -> dict:
    import subprocess

    out = os.path.join(d, engine)
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={max(args.worlds)}",
               PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", engine, "--width", str(args.width),
                    "--batch", str(args.batch), "--worlds", *map(str, args.worlds), "--out", out],
                   check=True, env=env)
    return {int(k): v for k, v in json.load(open(out)).items()}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def memory_main(args) -> str:
    full = sum(int(np.prod(s)) * 4 for l in spec(args.width).layers for s in l.param_shapes().values())
    lines = [f"`nice python benchmarks/bench_parallel.py --memory --width {args.width} --batch {args.batch}`: "
             f"4 x Dense({args.width}) (column, row, column, row), float32, {_mib(full)} MiB of parameters, "
             f"batch {args.batch}. MiB; \"ideal\" = whole / N (a row layer's bias is replicated, so slightly more). "
             "Memory does not depend on the load; times are not reported here.", "",
             "| engine | N | rank/device | params held | ideal | compile peak RSS growth | train-step peak | how the peak is measured |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        for engine in args.engines:
            if engine == "torch":
                for world in args.worlds:
                    out = os.path.join(d, f"torch{world}")
                    mp.spawn(_torch_memory, args=(world, _port(), args, out), nprocs=world)
                    for r in range(world):
                        m = json.load(open(f"{out}.{r}"))
                        lines.append(f"| torch | {world} | rank {r} | {_mib(m['held'])} | {_mib(full / world)} | "
                                     f"{_mib(m['compile_rss'])} | {_mib(m['step_rss'])} | RSS growth (VmHWM), 1 step |")
            elif engine == "mlx":
                for world, ranks in _mlx_rows(args, d).items():
                    for r, m in enumerate(ranks):
                        lines.append(f"| mlx | {world} | rank {r} | {_mib(m['held'])} | {_mib(full / world)} | "
                                     f"{_mib(m['compile_rss'])} | {_mib(m['step_mlx_peak'])} "
                                     f"(RSS {_mib(m['step_rss'])}) | mx.get_peak_memory(), 2 steps |")
            else:
                for world, m in _jax_rows(engine, args, d).items():
                    for dev, held in enumerate(m["held"]):
                        lines.append(f"| {engine} (JAX) | {world} | device {dev} | {_mib(held)} | "
                                     f"{_mib(full / world)} | - | {_mib(m['step_peak'])} | "
                                     f"XLA memory_analysis of the jitted step, per device |")
            print("\n".join(lines[-1:]), flush=True)
    load = open("/proc/loadavg").read().split()[:3]
    lines.append("")
    lines.append(f"Load average at the end: {' / '.join(load)}; {os.cpu_count()} cores. torch and MLX ranks are "
                 "separate processes (gloo; mlx.launch --backend ring), Keras and Flax one process driving "
                 "N of 4 virtual CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`). "
                 "Compile peaks include drawing each whole layer from the seed (one layer at a time) "
                 "before keeping this rank's block; loading a sharded checkpoint reads only the block.")
    return "\n".join(lines) + "\n"


def write_section(path: str, title: str, body: str) -> None:
    """Replace (or append) the ``## title`` section of the results file, keeping the others."""
    text = open(path).read() if os.path.exists(path) else "# Tensor parallelism\n"
    head = f"## {title}\n"
    start = text.find(head)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + head + "\n" + body
    else:
        end = text.find("\n## ", start + len(head))
        text = text[:start] + head + "\n" + body + (text[end:] if end >= 0 else "")
    with open(path, "w") as f:
        f.write(text)


TIME_TITLE = "Train step time (torch DTensor, gloo, CPU)"
MEMORY_TITLE = "Memory per rank and per device (torch, MLX, Keras on JAX, Flax)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--memory", action="store_true", help="per-rank/per-device memory instead of time")
    ap.add_argument("--engines", nargs="+", default=["torch", "mlx", "keras", "flax"])
    ap.add_argument("--worker", choices=["mlx", "keras", "flax"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "parallel.md"))
    args = ap.parse_args()
    if args.width is None:
        args.width = 2048 if args.memory or args.worker else 4096
    if args.worker == "mlx":
        return _mlx_memory(args, args.out)
    if args.worker:
        return _jax_memory(args.worker, args, args.out)
    if args.memory:
        text = memory_main(args)
        write_section(args.out, MEMORY_TITLE, text)
        print(text)
        return
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
    lines = [f"`python benchmarks/bench_parallel.py --width {args.width} --batch {args.batch} --steps {args.steps}`: "
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
    write_section(args.out, TIME_TITLE, text)
    print(text)


if __name__ == "__main__":
    main()
