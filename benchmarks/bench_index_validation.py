"""Validating a sharded checkpoint's index: time against the number of blocks.

A hostile (or just very sharded) ``dense_bridge_parallel.json`` can list many blocks per tensor;
``dense_bridge.parallel._sharded_dir.validate_tiling`` checks that they tile the tensor exactly (inside the shape, no
overlap, no gap, one file each) with one pass summing the blocks' signed corners (linear in n),
where comparing every pair of blocks took more than 30 s at 20,000 blocks. Timed here for one 2-D tensor split into n
blocks in two layouts (n column strips of one row band; a sqrt(n) x sqrt(n) grid), and the
pairwise check on a small n for scale (it grows as n^2: its 20,000 figure is extrapolated).

    python benchmarks/bench_index_validation.py [--blocks 20000 200000] [--repeats 3]

Writes benchmarks/results/index_validation.md.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from dense_bridge.parallel._sharded_dir import validate_tiling

HERE = os.path.dirname(os.path.abspath(__file__))


def strips(n: int) -> dict:
    """One (4, n) tensor in n column strips of width 1."""
    return {"dtype": "float32", "shape": [4, n],
            "shards": [{"file": f"rank-{i}.safetensors", "start": [0, i], "stop": [4, i + 1]} for i in range(n)]}


def grid(n: int) -> dict:
    """One (s, s) tensor in s * s single-element blocks, s = isqrt(n)."""
    s = math.isqrt(n)
    return {"dtype": "float32", "shape": [s, s],
            "shards": [{"file": f"rank-{i * s + j}.safetensors", "start": [i, j], "stop": [i + 1, j + 1]}
                       for i in range(s) for j in range(s)]}


def pairwise(tensor: dict) -> None:
    """The all-pairs overlap check, for scale."""
    blocks = [(s["start"], s["stop"]) for s in tensor["shards"]]
    for n, (a, b) in enumerate(blocks):
        for a2, b2 in blocks[:n]:
            if all(x < y2 and x2 < y for x, y, x2, y2 in zip(a, b, a2, b2)):
                raise ValueError("overlap")


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[20_000, 200_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairwise-blocks", type=int, default=2_000)
    args = parser.parse_args()
    rows = []
    for n in args.blocks:
        for name, make in (("column strips", strips), ("grid", grid)):
            tensor = make(n)
            count = len(tensor["shards"])
            seconds = timed(lambda: validate_tiling("t", tensor), args.repeats)
            rows.append(f"| {name} | {count:,} | {seconds * 1e3:.0f} ms | {seconds / count * 1e6:.2f} us |")
            print(rows[-1], flush=True)
    small = strips(args.pairwise_blocks)
    pair = timed(lambda: pairwise(small), 1)
    scale = (20_000 / args.pairwise_blocks) ** 2
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = "\n".join([
        "# Sharded index validation: time against the number of blocks",
        "",
        f"Command: `python benchmarks/bench_index_validation.py --blocks {' '.join(map(str, args.blocks))} "
        f"--repeats {args.repeats}`",
        "",
        f"Machine: {os.cpu_count()} CPUs, load average {load:.2f} at the end (shared machine: absolute times are "
        "rough, the growth with n is the point); median of the repeats.",
        "",
        "| layout | blocks | validate_tiling | per block |",
        "|---|---|---|---|",
        *rows,
        "",
        f"For scale, the all-pairs check: {pair:.2f} s at {args.pairwise_blocks:,} column strips, so about "
        f"{pair * scale:.0f} s at 20,000 (n^2).",
        "",
    ])
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "index_validation.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
