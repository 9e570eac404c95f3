"""Large files (issue 18): a 2 GiB sharded canonical checkpoint to torch, MLX and Keras files and
back, against this machine's limit for the same bytes.

The limit of a file conversion is what moving the same bytes from file to file costs at least:
read every source file, write the bytes to a temporary beside the output, fsync it, rename it
(one thread, plain ``os.read``/``os.write`` in 16 MiB pieces). Each conversion is timed with the
same steps the library takes (``checkpoint.convert_file``, which writes a temporary, fsyncs and
renames), and the two are interleaved, round after round, with the page cache dropped before
every sample (``sync; echo 3 > /proc/sys/vm/drop_caches`` as root; otherwise the files' pages are
evicted with ``posix_fadvise(DONTNEED)`` after an fsync, said in the output), so every sample
reads from the disk as a first conversion would.

Reported per direction: seconds (median), GB/s of checkpoint bytes, the limit for the same
source and output bytes measured in the same round, and convert / limit (target >= 0.7).

Run:  python benchmarks/bench_large_files.py [--gib 2] [--repeats 3] [--dir /tmp]
Writes benchmarks/results/large_files.md (--out).

Before and after: ``--baseline-rev REV`` also times every conversion on the library as it was at
git revision ``REV`` (``_baseline.py``) and, the same way, on the working tree, in the same
rounds, caches dropped the same way: each in a fresh process that imports its copy and every
adapter first and then times ``convert_file`` alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _baseline import baseline_env, baseline_tree, checkpoint_module, import_quietly  # noqa: E402
from _timing import table  # noqa: E402

PIECE = 16 << 20
INDEX = "canonical/model.safetensors.index.json"
DIRECTIONS = [  # (label, source file, target, output file, framework needed)
    ("canonical -> torch .pt", INDEX, "torch", "m.pt", "torch"),
    ("canonical -> mlx .safetensors", INDEX, "mlx", "m.mlx.safetensors", "mlx"),
    ("canonical -> keras .weights.h5", INDEX, "keras", "m.weights.h5", "keras"),
    ("torch .pt -> canonical (sharded)", "m.pt", "canonical", "back_torch/model.safetensors", "torch"),
    ("mlx -> canonical (sharded)", "m.mlx.safetensors", "canonical", "back_mlx/model.safetensors", "mlx"),
    ("keras -> canonical (sharded)", "m.weights.h5", "canonical", "back_keras/model.safetensors", "keras"),
]


def drop_caches(paths: list[str]) -> str:
    """Empty the page cache (root), else evict ``paths``' pages; returns which was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise(DONTNEED)"


def files_of(path: str) -> list[str]:
    """The files a checkpoint at ``path`` consists of (an index and its shards, or itself)."""
    if path.endswith(".index.json"):
        import json

        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [path] + [os.path.join(os.path.dirname(path), s) for s in shards]
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path))
    if not os.path.exists(path) and os.path.exists(path + ".index.json"):
        return files_of(path + ".index.json")
    return [path]


def copy_limit(sources: list[str], out_dir: str, out_bytes: int) -> None:
    """Read every source file, write ``out_bytes`` of what was read to a temporary in ``out_dir``,
    fsync, rename: the least a file-to-file conversion of these bytes costs."""
    tmp = os.path.join(out_dir, ".limit.tmp")
    buf = bytearray(PIECE)
    view = memoryview(buf)
    left = out_bytes
    fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for src in sources:
            fd = os.open(src, os.O_RDONLY)
            try:
                while True:
                    n = os.readv(fd, [view])
                    if n == 0:
                        break
                    if left > 0:
                        k = min(n, left)
                        os.write(fd_out, view[:k])
                        left -= k
            finally:
                os.close(fd)
        while left > 0:  # an output larger than its source (headers): write the rest too
            k = min(PIECE, left)
            os.write(fd_out, view[:k])
            left -= k
        os.fsync(fd_out)
    finally:
        os.close(fd_out)
    os.replace(tmp, os.path.join(out_dir, ".limit"))
    os.remove(os.path.join(out_dir, ".limit"))


def make_source(root: str, gib: float, shard: str) -> tuple[object, int]:
    import dense_bridge as db

    width = 8192
    layers = max(1, round(gib * (1 << 30) / (4 * width * (width + 1))))
    spec = db.Sequential([db.Dense(width, in_features=width) for _ in range(layers)])
    rng = np.random.default_rng(0)
    params = {}
    for i in range(layers):
        params[f"{i}.kernel"] = rng.standard_normal((width, width), dtype=np.float32)
        params[f"{i}.bias"] = rng.standard_normal((width,), dtype=np.float32)
    os.makedirs(os.path.join(root, "canonical"))
    db.save((spec, params), os.path.join(root, "canonical", "model.safetensors"), max_shard_size=shard)
    return spec, sum(a.nbytes for a in params.values())


def convert_worker(job: str) -> float:
    """One ``convert_file`` in this process (on whichever tree ``PYTHONPATH`` gives); its seconds."""
    args = json.loads(job)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != repo]  # PYTHONPATH's copy, not this tree
    import_quietly()
    from dense_bridge.registry._backends import available_backends, get_adapter

    for backend in available_backends():  # imports are not what is measured
        get_adapter(backend)
    checkpoint = checkpoint_module()
    start = time.perf_counter()
    checkpoint.convert_file(args["src"], args["to"], args["out"], **args["kwargs"])
    return time.perf_counter() - start


def convert_on(tree: str | None, src: str, to: str, out: str, kwargs: dict) -> float:
    """Seconds of ``convert_file`` on the baseline ``tree`` (None: the working tree), in a fresh process."""
    job = json.dumps({"src": src, "to": to, "out": out, "kwargs": kwargs})
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--convert-worker", job], capture_output=True,
                         text=True, env={**baseline_env(tree), "TF_CPP_MIN_LOG_LEVEL": "2"})
    if run.returncode:
        raise SystemExit(f"baseline conversion {src} -> {to} failed:\n{run.stderr[-3000:]}")
    library, seconds = run.stdout.strip().splitlines()[-1].split()
    if tree is not None and not library.startswith(tree):
        raise SystemExit(f"the baseline run imported {library}, not the copy in {tree}")
    return float(seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size (8192-wide float32 Dense layers)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-size", default="512MB")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "large_files.md"))
    parser.add_argument("--baseline-rev", default=None, metavar="REV",
                        help="also time each conversion on the library as it was at git revision REV")
    parser.add_argument("--convert-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.convert_worker:
        seconds = convert_worker(args.convert_worker)  # imports the library: nothing before it may
        print(os.path.dirname(sys.modules["dense_bridge"].__file__), seconds)
        return 0
    from dense_bridge.registry._backends import available_backends

    checkpoint = checkpoint_module()
    tree = baseline_tree(args.baseline_rev) if args.baseline_rev else None
    import_quietly()
    root = tempfile.mkdtemp(prefix="bench-large-", dir=args.dir)
    load_before = os.getloadavg()
    try:
        spec, nbytes = make_source(root, args.gib, args.shard_size)
        have = set(available_backends())
        directions = [d[:4] for d in DIRECTIONS if d[4] in have]
        for sub in ("back_torch", "back_mlx", "back_keras"):
            os.makedirs(os.path.join(root, sub))
        # the native files once, so the way back has sources
        for _, src, to, out in [d for d in directions if d[1] == INDEX]:
            checkpoint.convert_file(os.path.join(root, src), to, os.path.join(root, out))
        samples: dict[str, dict[str, list[float]]] = {d[0]: {"convert": [], "limit": [], "baseline": [],
                                                            "working tree": []} for d in directions}
        how = ""
        for _ in range(args.repeats):
            for label, src, to, out in directions:
                src_path, out_path = os.path.join(root, src), os.path.join(root, out)
                sources = files_of(src_path)
                kwargs = {"max_shard_size": args.shard_size} if to == "canonical" else {}
                extra = {} if src.startswith("canonical") else {"spec": spec.to_config()}  # native files carry none
                # convert first (its output size is the limit's), then the limit, caches dropped before each
                how = drop_caches(sources)
                start = time.perf_counter()
                checkpoint.convert_file(src_path, to, out_path, **kwargs, **extra)
                samples[label]["convert"].append(time.perf_counter() - start)
                out_bytes = sum(os.path.getsize(p) for p in files_of(out_path))
                how = drop_caches(sources)
                start = time.perf_counter()
                copy_limit(sources, os.path.dirname(out_path), out_bytes)
                samples[label]["limit"].append(time.perf_counter() - start)
                if tree is not None:  # the working tree and REV in the same kind of fresh process
                    for code, where in (("working tree", None), ("baseline", tree)):
                        how = drop_caches(sources)
                        samples[label][code].append(convert_on(where, src_path, to, out_path, {**kwargs, **extra}))
                print(label, samples[label], file=sys.stderr, flush=True)
        rows = []
        for label, _, _, _ in directions:
            c, lim = statistics.median(samples[label]["convert"]), statistics.median(samples[label]["limit"])
            rows.append([label, f"{c:.2f}", f"{nbytes / c / 1e9:.2f}", f"{lim:.2f}", f"{nbytes / lim / 1e9:.2f}",
                         f"**{lim / c:.2f}**"])
            if tree is not None:
                w, b = statistics.median(samples[label]["working tree"]), statistics.median(samples[label]["baseline"])
                rows[-1] += [f"{w:.2f}", f"{b:.2f}", f"{b / w:.2f}"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    header = ["direction", "convert s", "convert GB/s", "limit s", "limit GB/s", "convert / limit (>= 0.7)"]
    if tree is not None:
        header += ["working tree s (fresh process)", f"{args.baseline_rev} s (fresh process)",
                   f"{args.baseline_rev} / working tree"]
    text = table(rows, header)
    print(text)
    command = "python benchmarks/bench_large_files.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = ["# Large checkpoint files: conversion vs read + write + fsync + rename", "",
              f"Command: `{command.strip()}`", "",
              f"Checkpoint: {nbytes / 1e9:.2f} GB float32 ({len(spec.layers)} x Dense(8192)), canonical in "
              f"{args.shard_size} shards. Medians of {args.repeats} rounds; in each round every direction's "
              f"conversion and its limit run back to back, the page cache emptied before each ({how}).", "",
              f"Machine: {os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} "
              f"GiB; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (shared machine).", "",
              "limit: read every source file, write as many bytes as the conversion wrote to a temporary, fsync, "
              "rename (one thread, 16 MiB os.read/os.write).", "", text, ""]
    with open(args.out, "w") as f:
        f.write("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
