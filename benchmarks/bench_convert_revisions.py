"""``db.convert`` of the working tree against the library at a git revision, same session.

    python benchmarks/bench_convert_revisions.py --baseline-rev 40ad585 [--rounds 2] [--layers 6 --width 2048]

Each round runs one fresh process per tree (the baseline imported through ``PYTHONPATH``, see
``_baseline.py``), alternating, so both see the same machine; each process times ``db.convert``
on every ordered pair of torch, Keras and MLX (median of ``--repeats``), in milliseconds.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baseline import baseline_env, baseline_tree  # noqa: E402

PAIRS = [("torch", "keras"), ("keras", "torch"), ("torch", "mlx"), ("mlx", "torch"), ("mlx", "keras"), ("keras", "mlx")]


def worker(layers: int, width: int, repeats: int) -> None:
    import statistics
    import time

    import dense_bridge as db

    spec = db.Sequential([db.Dense(width, in_features=width, activation="relu") for _ in range(layers)])
    sources = {f: db.compile(spec, f, seed=0) for f in {a for a, _ in PAIRS}}
    cells = []
    for a, b in PAIRS:
        db.convert(sources[a], to=b)  # warm: imports and first allocations outside the timing
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model = db.convert(sources[a], to=b)
            times.append(time.perf_counter() - start)
            del model
        cells.append(f"{statistics.median(times) * 1e3:.1f}")
    print(" ".join(cells))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-rev", required=True, metavar="REV")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.layers, args.width, args.repeats)
        return 0
    tree = baseline_tree(args.baseline_rev)
    cmd = [sys.executable, os.path.abspath(__file__), "--baseline-rev", args.baseline_rev, "--worker",
           "--layers", str(args.layers), "--width", str(args.width), "--repeats", str(args.repeats)]
    results = {"before": [], "after": []}
    for _ in range(args.rounds):
        for label, env_tree in (("before", tree), ("after", None)):
            env = baseline_env(env_tree)
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
            out = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=True).stdout
            results[label].append(out.split("\n")[-2].split())
    print(f"db.convert, {args.layers} x Dense({args.width}x{args.width}) float32, median of {args.repeats}, ms "
          f"(before = {args.baseline_rev}, after = working tree)\n")
    print("| pair | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " |")
    print("|---|" + "---|" * args.rounds)
    for i, (a, b) in enumerate(PAIRS):
        cells = [f"{results['before'][r][i]} -> {results['after'][r][i]}" for r in range(args.rounds)]
        print(f"| {a} -> {b} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
