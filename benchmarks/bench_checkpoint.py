"""Sharded checkpoint conversion: peak memory and throughput.

Builds a canonical checkpoint several times larger than its shard size (default 8 Dense layers of
1024x1024 float32 = 33.6 MB in 5 MB shards, one layer per shard), then converts it in fresh
subprocesses, one per target, and measures in each:

- peak traced memory: tracemalloc's peak over the conversion (numpy registers its array
  buffers with tracemalloc; framework-allocated tensors are not traced);
- peak RSS over start: the kernel's peak-RSS mark (VmHWM, reset with /proc/self/clear_refs) after
  the conversion minus VmRSS before it, with the frameworks already imported and warmed up by a tiny
  conversion (it counts everything: numpy, torch/MLX/TF buffers, mapped file pages); the
  ru_maxrss delta as well (it cannot be reset: a lower bound when imports peaked higher);
- throughput: checkpoint bytes / wall time of the conversion.

Streaming means: canonical -> canonical holds about one tensor; canonical -> a framework holds
the output model plus about one tensor (the source is mapped one tensor at a time).

    python benchmarks/bench_checkpoint.py [--layers 8] [--width 1024] [--shard-size 5MB] [--dtype float32]

Memory slope (issue 10): ``--slope W1,W2`` measures, for native conversions (``.pt -> keras``,
``.weights.h5 -> torch``, canonical -> torch/keras) and ``dense-bridge check``, the peak RSS over
start (VmHWM reset before the job) at two sizes of the same model (--layers x Dense(W x W)),
each in a fresh process with the frameworks imported and warmed up, and reports the growth per
checkpoint byte between them: the frameworks' fixed costs cancel. Targets: <= 1.3 for every
conversion, <= 1.5 for check.

    python benchmarks/bench_checkpoint.py --slope 1024,2048 --layers 8

Before and after: ``--baseline-rev REV`` runs every case twice, in fresh processes of the same
session, once on the working tree and once on the library as it was at git revision ``REV``
(``_baseline.py``: extracted from git and put first on ``PYTHONPATH``); each row names its code.

    python benchmarks/bench_checkpoint.py --baseline-rev 607d216
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _baseline import baseline_env, baseline_tree, checkpoint_module, import_quietly  # noqa: E402
from _memory import maxrss_bytes, reset_peak, status_bytes  # noqa: E402

TARGETS = {  # name -> (convert_file "to", output file name)
    "canonical (re-shard)": ("canonical", "out.safetensors"),
    "numpy params (db.load)": (None, None),
    "torch .pt": ("torch", "out.pt"),
    "mlx .safetensors": ("mlx", "out_mlx.safetensors"),
    "keras .weights.h5": ("keras", "out.weights.h5"),
}
TARGETS_OUT = {"canonical": "c.safetensors", "torch": "t.pt", "mlx": "m.safetensors", "keras": "k.weights.h5"}
NEEDS = {"torch .pt": "torch", "mlx .safetensors": "mlx", "keras .weights.h5": "keras"}


def _warm_up(to: str | None, workdir: str) -> None:
    """One tiny conversion first: the frameworks' first-call costs are not throughput."""
    import dense_bridge as db

    checkpoint = checkpoint_module()
    src = os.path.join(workdir, "warm.safetensors")
    db.save(db.compile(db.Sequential([db.Dense(4, in_features=4), db.Dense(4)]), "numpy", seed=0), src)
    if to is None:
        db.load(src)
    else:
        out = os.path.join(workdir, "warm_" + TARGETS_OUT[to])
        checkpoint.convert_file(src, to, out)


def worker(target: str, src: str, workdir: str, shard_size: str) -> dict:
    """One conversion in this (fresh) process; the measurements as a dict."""
    import tracemalloc

    import dense_bridge as db

    checkpoint = checkpoint_module()
    to, name = TARGETS[target]
    if target in NEEDS:
        from dense_bridge.registry._backends import get_adapter

        get_adapter(NEEDS[target])  # import the framework before the baseline
    if to == "keras":
        import_quietly(["keras"])
    _warm_up(to, workdir)
    ckpt = checkpoint.open_checkpoint(src)
    nbytes = ckpt.total_bytes
    del ckpt
    import gc

    gc.collect()
    maxrss0 = maxrss_bytes()
    rss0 = status_bytes("VmRSS")
    exact = reset_peak()
    tracemalloc.start()
    t = time.perf_counter()
    if to is None:
        _, params = db.load(src)
        held = sum(v.nbytes for v in params.values())
    else:
        out = os.path.join(workdir, name)
        checkpoint.convert_file(src, to, out, max_shard_size=shard_size if to == "canonical" else None)
        held = 0
    seconds = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    hwm = status_bytes("VmHWM")
    return {"target": target, "seconds": seconds, "bytes": nbytes, "peak_traced": peak,
            "maxrss_delta": maxrss_bytes() - maxrss0,
            "peak_rss_over_start": (hwm - rss0) if exact and hwm is not None and rss0 is not None else None,
            "held_output": held, "library": os.path.dirname(db.__file__)}


def _run_worker(name: str, src: str, workdir: str, args, tree: str | None = None) -> dict:
    """One case in a fresh process, on the working tree or on the baseline ``tree``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--src", src, "--workdir", workdir,
           "--shard-size", args.shard_size, "--layers", str(args.layers), "--width", str(args.width),
           "--dtype", args.dtype]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**baseline_env(tree), "TF_CPP_MIN_LOG_LEVEL": "2"})
    if run.returncode != 0:
        raise SystemExit(f"{name} failed:\n{run.stderr}")
    row = json.loads(run.stdout.strip().splitlines()[-1])
    if tree is not None and not row.get("library", "").startswith(tree):
        raise SystemExit(f"the baseline run imported {row.get('library')}, not the copy in {tree}")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--shard-size", default="5MB")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"))
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of: " + ", ".join(TARGETS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--slope", metavar="W1,W2",
                   help="memory slope mode (issue 10): peak RSS per checkpoint byte of native conversions and "
                        "check, between --layers x Dense(W1) and --layers x Dense(W2)")
    p.add_argument("--slope-cases", default=",".join(SLOPE_CASES),
                   help="comma-separated subset of: " + ", ".join(SLOPE_CASES))
    p.add_argument("--baseline-rev", default=None, metavar="REV",
                   help="also run every case on the library as it was at git revision REV, side by side")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.worker == "slope-make":
        print(slope_make(args.workdir, args.layers, args.width))
        return 0
    if args.worker and args.worker.startswith("slope:"):
        print(json.dumps(slope_worker(args.worker[len("slope:"):], args.workdir)))
        return 0
    codes = [("working tree", None)]
    if args.baseline_rev and not args.worker:
        codes.append((args.baseline_rev, baseline_tree(args.baseline_rev)))
    if args.slope:
        return slope_main(args, codes)
    if args.worker == "make":
        import dense_bridge as db

        spec = db.Sequential([db.Dense(args.width, in_features=args.width, dtype=args.dtype, kernel_init="normal")
                              for _ in range(args.layers)])
        t = time.perf_counter()
        files = db.save(db.compile(spec, "numpy", seed=0), args.src, max_shard_size=args.shard_size)
        print(json.dumps({"files": files, "seconds": time.perf_counter() - t}))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.src, args.workdir, args.shard_size)))
        return 0

    from dense_bridge.checkpoints._io import parse_size
    from dense_bridge.registry._backends import available_backends

    workdir = tempfile.mkdtemp(prefix="bench-checkpoint-")
    try:
        src = os.path.join(workdir, "model.safetensors")
        made = _run_worker("make", src, workdir, args)
        files, build = made["files"], made["seconds"]
        total = sum(os.path.getsize(f) for f in files[:-1])
        shard_limit = parse_size(args.shard_size)
        print(f"checkpoint: {args.layers} x Dense({args.width}x{args.width}, {args.dtype}) = {total / 1e6:.1f} MB in "
              f"{len(files) - 1} shards (max_shard_size {args.shard_size}); written in {build:.2f} s")
        available = available_backends()
        rows = []
        for target in args.targets.split(","):
            target = target.strip()
            if target not in TARGETS:
                raise SystemExit(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
            if target in NEEDS and NEEDS[target] not in available:
                continue
            for code, tree in codes:  # the same case back to back on each code: the same load
                rows.append({**_run_worker(target, src, workdir, args, tree), "code": code})
        if args.json:
            print(json.dumps({"layers": args.layers, "width": args.width, "dtype": args.dtype,
                              "shard_size": args.shard_size, "checkpoint_bytes": total, "rows": rows}, indent=2))
            return 0
        mb = 1e6
        header = (f"{'target':<24} {'code':<14} {'time s':>7} {'MB/s':>7} {'peak traced MB':>15} {'peak RSS - start MB':>20} "
                  f"{'ru_maxrss delta MB':>19} {'output held MB':>15}")
        print(header)
        print("-" * len(header))
        for r in rows:
            exact = "n/a" if r["peak_rss_over_start"] is None else f"{r['peak_rss_over_start'] / mb:.1f}"
            print(f"{r['target']:<24} {r['code'][:14]:<14} {r['seconds']:>7.3f} {r['bytes'] / mb / r['seconds']:>7.0f} "
                  f"{r['peak_traced'] / mb:>15.1f} {exact:>20} {r['maxrss_delta'] / mb:>19.1f} "
                  f"{r['held_output'] / mb:>15.1f}")
        largest = args.width * args.width * {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[args.dtype]
        print(f"(checkpoint {total / mb:.1f} MB, largest tensor {largest / mb:.1f} MB, shard limit "
              f"{shard_limit / mb:.1f} MB. peak RSS - start: VmHWM after the conversion minus VmRSS before it, "
              "the peak reset with /proc/self/clear_refs; it includes the output model and mapped file pages. "
              "'output held': numpy params returned by db.load)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


# ============================================================================ memory slope (issue 10)
SLOPE_CASES = {  # name -> (source file, what runs, frameworks it needs, target)
    ".pt -> keras": ("t.pt", "convert keras", ("torch", "keras"), 1.3),
    ".weights.h5 -> torch": ("k.weights.h5", "convert torch", ("torch", "keras"), 1.3),
    "canonical -> torch": ("c.safetensors", "convert torch", ("torch",), 1.3),
    "canonical -> keras": ("c.safetensors", "convert keras", ("keras",), 1.3),
    "canonical -> mlx": ("c.safetensors", "convert mlx", ("mlx",), 1.3),
    ".pt -> canonical": ("t.pt", "convert canonical", ("torch",), 1.3),
    "check .pt vs .weights.h5": ("t.pt", "check k.weights.h5", ("torch", "keras"), 1.5),
    "check --no-grads": ("t.pt", "check-outputs k.weights.h5", ("torch", "keras"), 1.5),
}


def slope_make(workdir: str, layers: int, width: int) -> int:
    """The same model as canonical, torch .pt and Keras .weights.h5 files in ``workdir``; its bytes."""
    import dense_bridge as db
    from dense_bridge.registry._backends import available_backends

    checkpoint = checkpoint_module()
    spec = db.Sequential([db.Dense(width, in_features=width, kernel_init="normal") for _ in range(layers)])
    src = os.path.join(workdir, "c.safetensors")
    db.save(db.compile(spec, "numpy", seed=0), src)
    for to, name in (("torch", "t.pt"), ("keras", "k.weights.h5")):
        if to in available_backends():
            checkpoint.convert_file(src, to, os.path.join(workdir, name))
    return layers * (width * width + width) * 4


def slope_worker(case: str, workdir: str) -> dict:
    """Peak RSS over start of one case in this fresh process, frameworks imported and warmed up."""
    import contextlib
    import gc
    import io

    from dense_bridge import cli
    from dense_bridge.registry._backends import get_adapter

    src, job, needs, _ = SLOPE_CASES[case]
    if "keras" in needs:
        import_quietly(["keras"])
    for fw in needs:
        get_adapter(fw)
    warm = os.path.join(workdir, "warm")
    os.makedirs(warm, exist_ok=True)
    slope_make(warm, 2, 4)  # first-call costs of every path, on a tiny model
    verb, arg = job.split()

    def run(d: str) -> None:
        spec = os.path.join(d, "c.safetensors")  # .pt and .weights.h5 from elsewhere carry no spec
        with contextlib.redirect_stdout(io.StringIO()):
            if verb == "convert":
                out = os.path.join(d, "out." + {"torch": "pt", "keras": "weights.h5", "mlx": "safetensors",
                                                 "canonical": "back.safetensors"}[arg])
                code = cli.main(["convert", os.path.join(d, src), "--to", arg, "-o", out, "--no-progress", "--spec", spec])
            else:
                flags = ["--no-grads"] if verb == "check-outputs" else []
                code = cli.main(["check", os.path.join(d, src), os.path.join(d, arg), "--spec", spec, *flags])
        if code not in (0, 1):
            raise SystemExit(f"{case}: exit {code}")

    run(warm)
    gc.collect()
    rss0 = status_bytes("VmRSS")
    if not reset_peak():
        raise SystemExit("the peak-RSS mark cannot be reset here (/proc/self/clear_refs)")
    t = time.perf_counter()
    run(workdir)
    return {"case": case, "seconds": time.perf_counter() - t, "peak_over_start": status_bytes("VmHWM") - rss0}


def slope_main(args, codes) -> int:
    """Peak-RSS growth per checkpoint byte between two sizes of the same model (imports cancel)."""
    from dense_bridge.registry._backends import available_backends

    available = set(available_backends())
    widths = [int(w) for w in args.slope.split(",")]
    rows = {}
    root = tempfile.mkdtemp(prefix="bench-slope-")
    try:
        sizes = []
        for w in widths:
            d = os.path.join(root, f"w{w}")
            os.makedirs(d)
            made = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "slope-make", "--workdir",
                                   d, "--layers", str(args.layers), "--width", str(w)],
                                  capture_output=True, text=True)
            if made.returncode:
                raise SystemExit(made.stderr)
            sizes.append((d, int(made.stdout.split()[-1])))
        for (case, (_, _, needs, target)), (code, tree) in [(c, k) for c in SLOPE_CASES.items() for k in codes]:
            if case not in [c.strip() for c in args.slope_cases.split(",")] or not set(needs) <= available:
                continue
            peaks = []
            for d, nbytes in sizes:
                run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "slope:" + case,
                                      "--workdir", d], capture_output=True, text=True, env=baseline_env(tree))
                if run.returncode:
                    raise SystemExit(f"{case} failed:\n{run.stderr[-3000:]}")
                peaks.append((nbytes, json.loads(run.stdout.strip().splitlines()[-1])))
            (b0, r0), (b1, r1) = peaks[0], peaks[-1]
            rows[case if len(codes) == 1 else f"{case} [{code[:12]}]"] = {"bytes": [b0, b1], "peak_over_start": [r0["peak_over_start"], r1["peak_over_start"]],
                          "seconds": [r0["seconds"], r1["seconds"]],
                          "slope": (r1["peak_over_start"] - r0["peak_over_start"]) / (b1 - b0), "target": target}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    mb = 1e6
    header = f"{'case':<41} {'sizes MB':>15} {'peak RSS - start MB':>22} {'time s':>13} {'slope':>6} {'target':>7}"
    print(header)
    print("-" * len(header))
    for case, r in rows.items():
        print(f"{case:<41} {r['bytes'][0] / mb:>7.1f},{r['bytes'][1] / mb:>7.1f} "
              f"{r['peak_over_start'][0] / mb:>10.1f},{r['peak_over_start'][1] / mb:>11.1f} "
              f"{r['seconds'][0]:>6.2f},{r['seconds'][1]:>6.2f} {r['slope']:>6.2f} {'<= ' + str(r['target']):>7}")
    print(f"({args.layers} x Dense(w x w) float32 for w in {widths}; slope = growth of (peak RSS - start) per "
          "checkpoint byte between the two sizes, so the frameworks' own import and warm-up cost cancels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
