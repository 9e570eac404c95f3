"""What a NaN/Inf scan can cost on this machine, measured without dense_bridge's plumbing.

The question behind it: can the exact finiteness check of a conversion cost at most 10% of the
copy a conversion must make, into MLX (where ``mx.array`` makes the copy) and into numpy memory
(where dense_bridge makes it)? Three tables answer it, each a median of --repeats rounds in which
every variant runs once (round-robin, so drift hits all alike):

1. Exact-test kernels, bytes per second on one core, on a block resident in L2 (256 KiB, the
   size a fused copy would check right after copying it) and on an array far beyond the caches:
   numpy's pairwise float32 sum (``np.add.reduce``), rows summed into one accumulator row first,
   ``maximum.reduce`` + ``minimum.reduce`` (NaN propagates through maximum; -Inf shows in the
   minimum), and a dot product with zeros (``x * 0`` is NaN exactly where ``x`` is NaN or Inf, and
   the sum of zeros never overflows). Beside them: a plain copy of the same bytes, 1 and 2 threads.

2. Copies in pieces, by where the destination starts relative to the source. glibc copies pieces
   of 2 KiB to 1 MiB with ``rep movsb``; on this CPU that runs 5x slower when the destination
   starts a few bytes after the source modulo 4 KiB (MLX's buffers start 24 bytes into a page).
   numpy's own integer loops (``np.positive`` on same-width unsigned views) copy the same bits
   without that trap.

3. Into MLX (--layers x --width^2 float32, when MLX is installed; MLX's buffer cache raised so that
   every variant gets recycled memory): ``mx.array`` copies alone (the
   user's port), the scan on the calling thread before the copies, the scan on a second core
   beside each copy (what dense_bridge ships), and dense_bridge writing MLX's memory itself
   (:func:`filled_arrays`: ``mx.load`` of a stream, MLX allocates each array and hands its
   memory over): the copy alone, the copy with each 256 KiB piece checked in numpy right after it
   (fused), with a second core checking each 4 MiB piece just copied (trailing), and with the C
   kernel counting in the copy's own pass. Filling is not shipped: MLX allocates that memory on
   its stream thread, whose malloc arena hands freed memory back to the system, so in a plain
   loop of conversions every call touches new pages (``bench_convert.py --plain --once``).

Where ``dense_bridge.params._copy_kernels`` is built (a C compiler at install), its count and its copy that
counts are measured beside numpy's kernels.

Run:  python benchmarks/bench_scan_limits.py [--layers 6] [--width 2048] [--repeats 15]
Writes benchmarks/results/scan_limits.md (--out).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from dense_bridge.params import _copy as _transfer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import table  # noqa: E402

L2_BLOCK = 1 << 16  # float32 elements: 256 KiB, a quarter of this CPU's 1 MiB L2
TRAIL_BLOCK = 1 << 20  # float32 elements: 4 MiB pieces handed to the trailing checker


# ------------------------------------------------------------------ exact tests
def max_min_finite(x: np.ndarray) -> bool:
    """Exact: maximum.reduce is NaN if any NaN and +Inf if any +Inf; minimum.reduce is -Inf if any -Inf."""
    return bool(np.maximum.reduce(x, axis=None) < np.inf) and bool(np.minimum.reduce(x, axis=None) > -np.inf)


def kernels(zeros: np.ndarray) -> dict[str, Callable[[np.ndarray], object]]:
    return {
        "pairwise sum": lambda x: np.add.reduce(x),
        "row sum (1024-wide rows)": lambda x: np.add.reduce(np.add.reduce(x.reshape(-1, 1024), axis=0)),
        "max + min": max_min_finite,
        "dot with zeros": lambda x: np.dot(x, zeros[:x.size]),
    }


def per_call(fn: Callable[[], object], seconds: float = 0.05) -> float:
    """Seconds per call of ``fn``, averaged over as many back-to-back calls as fill ``seconds``."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n


def kernel_table(repeats: int) -> tuple[list[list[str]], list[str]]:
    rng = np.random.default_rng(0)
    big_n = 16 << 20  # 64 MiB of float32: twice the L3
    small = rng.standard_normal(L2_BLOCK, dtype=np.float32)
    big = rng.standard_normal(big_n, dtype=np.float32)
    bigs = [big, rng.standard_normal(big_n, dtype=np.float32)]
    zeros = np.zeros(big_n, np.float32)
    small_out, big_outs = np.empty_like(small), [np.ones_like(b) for b in bigs]

    def two_threads(job: Callable[[int], object]) -> None:
        t = threading.Thread(target=job, args=(1,))
        t.start()
        job(0)
        t.join()

    fns: dict[str, dict[str, Callable[[], object]]] = {}
    for name, k in kernels(zeros).items():
        fns[name] = {"l2": lambda k=k: k(small), "dram": lambda k=k: k(big),
                     "dram2": lambda k=k: two_threads(lambda i: k(bigs[i]))}
    if _transfer.COPY_KERNELS is not None:
        fused = _transfer.COPY_KERNELS
        mask = 0x7F800000
        fns["C count (dense_bridge.params._copy_kernels)"] = {
            "l2": lambda: fused.count(small, 4, mask), "dram": lambda: fused.count(big, 4, mask),
            "dram2": lambda: two_threads(lambda i: fused.count(bigs[i], 4, mask))}
        fns["C copy + count (dense_bridge.params._copy_kernels)"] = {
            "l2": lambda: fused.copy_count(small_out.view(np.uint32), small.view(np.uint32), 4, mask),
            "dram": lambda: fused.copy_count(big_outs[0].view(np.uint32), bigs[0].view(np.uint32), 4, mask),
            "dram2": lambda: two_threads(lambda i: fused.copy_count(big_outs[i].view(np.uint32),
                                                                     bigs[i].view(np.uint32), 4, mask))}
    fns["copy (np.copyto)"] = {"l2": lambda: np.copyto(small_out, small),
                               "dram": lambda: np.copyto(big_outs[0], bigs[0]),
                               "dram2": lambda: two_threads(lambda i: np.copyto(big_outs[i], bigs[i]))}
    samples = {(r, c): [] for r in fns for c in ("l2", "dram", "dram2")}
    for _ in range(repeats):
        for r, cols in fns.items():
            for c, fn in cols.items():
                samples[(r, c)].append(per_call(fn, 0.02 if c == "l2" else 0.1))
    rows = []
    for r in fns:
        gb = {c: (small.nbytes if c == "l2" else big.nbytes * (2 if c == "dram2" else 1))
              / statistics.median(samples[(r, c)]) / 1e9 for c in ("l2", "dram", "dram2")}
        rows.append([r, f"{gb['l2']:.1f}", f"{gb['dram']:.1f}", f"{gb['dram2']:.1f}"])
    return rows, ["kernel", "GB/s, 256 KiB in L2, 1 core", "GB/s, 64 MiB, 1 core", "GB/s, 2 x 64 MiB, 2 cores"]


# ------------------------------------------------------------------ copies in pieces
def piece_table(repeats: int) -> tuple[list[list[str]], list[str]]:
    n = 4 << 20  # 16 MiB of float32, copied in 256 KiB pieces
    src = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    raw = np.ones(n * 4 + 8192, np.uint8)
    page = (-raw.ctypes.data) % 4096
    src_offset = src.ctypes.data % 4096

    def pieces(dst: np.ndarray, how: str) -> Callable[[], None]:
        d, s = dst.view(np.uint32), src.view(np.uint32)

        def run() -> None:
            for c in range(0, n, L2_BLOCK):
                if how == "np.copyto":
                    np.copyto(d[c:c + L2_BLOCK], s[c:c + L2_BLOCK])
                else:
                    np.positive(s[c:c + L2_BLOCK], out=d[c:c + L2_BLOCK])
        return run
    rows = []
    for delta in (0, 8, 16, 48, 128, 4096 - 64):
        start = page + (src_offset + delta) % 4096
        dst = raw[start:start + n * 4].view(np.float32)
        times = {how: statistics.median(per_call(pieces(dst, how), 0.05) for _ in range(max(3, repeats // 3)))
                 for how in ("np.copyto", "np.positive (uint32)")}
        rows.append([str(delta)] + [f"{src.nbytes / t / 1e9:.1f}" for t in times.values()])
    return rows, ["destination - source (mod 4096), bytes", "np.copyto GB/s", "np.positive on uint32 views GB/s"]


# ------------------------------------------------------------------ into MLX
def filled_arrays(arrays: list[tuple[tuple[int, ...], str]], fill: Callable[[int, np.ndarray], None]) -> list:
    """MLX arrays whose memory MLX allocates and ``fill(index, out)`` writes: ``mx.load`` of an
    in-memory safetensors stream, whose ``readinto`` (on MLX's reader thread) only hands each
    array's memory over; the calling thread fills it while MLX allocates the next one. (Measured
    here, not shipped: see docs/ARCHITECTURE.md on ``_fused.c``.)"""
    import io
    import queue

    import mlx.core as mx

    from dense_bridge.checkpoints._safetensors import PendingTensor, header_bytes

    tensors = {str(i): PendingTensor(np.dtype(dtype), tuple(shape), produce=None)
               for i, (shape, dtype) in enumerate(arrays)}
    head, order = header_bytes(tensors, None)
    starts, at = {}, len(head)
    for name in order:
        starts[at] = int(name)
        at += tensors[name].nbytes
    handed: queue.SimpleQueue = queue.SimpleQueue()

    class Stream(io.RawIOBase):
        pos = 0

        def readable(self):
            return True

        def seekable(self):
            return True

        def seek(self, offset, whence=0):
            self.pos = offset + (0, self.pos, at)[whence]
            return self.pos

        def tell(self):
            return self.pos

        def readinto(self, buffer):
            view = memoryview(buffer).cast("B")
            n = view.nbytes
            if self.pos < len(head):
                n = len(head[self.pos:self.pos + n])
                view[:n] = head[self.pos:self.pos + n]
            else:
                i = starts[self.pos]
                handed.put((i, np.frombuffer(view, arrays[i][1]).reshape(arrays[i][0])))
            self.pos += n
            return n
    loaded: dict = {}
    done = object()

    def load():
        try:
            loaded.update(mx.load(Stream(), format="safetensors", stream=mx.cpu))
        finally:
            handed.put(done)
    loader = threading.Thread(target=load)
    loader.start()
    while (item := handed.get()) is not done:
        fill(*item)
    loader.join()
    return [loaded[str(i)] for i in range(len(arrays))]


def mlx_table(layers: int, width: int, repeats: int) -> tuple[list[list[str]], list[str]] | None:
    try:
        import mlx.core as mx
    except ImportError:
        return None
    srcs = [np.random.default_rng(i).standard_normal((width, width), dtype=np.float32) for i in range(layers)]
    scanner = ThreadPoolExecutor(1)
    bad: list[int] = []

    def port():
        out = [mx.array(s) for s in srcs]
        mx.eval(out)
        return out

    def inline():
        out = []
        for s in srcs:
            bad.append(_transfer.count_nonfinite(s) > 0)  # dense_bridge's scan: the C count where built
            out.append(mx.array(s))
        mx.eval(out)
        return out

    def beside():
        out, futures = [], []
        for s in srcs:
            started = threading.Event()

            def scan(s=s, started=started):
                started.set()
                return _transfer.count_nonfinite(s) > 0
            futures.append(scanner.submit(scan))
            started.wait()
            out.append(mx.array(s))
        mx.eval(out)
        bad.extend(f.result() for f in futures)
        return out

    def copy_only(i, out):
        np.positive(srcs[i].reshape(-1).view(np.uint32), out=out.reshape(-1).view(np.uint32))

    def fused(i, out):
        o, s, f = out.reshape(-1).view(np.uint32), srcs[i].reshape(-1).view(np.uint32), srcs[i].reshape(-1)
        for c in range(0, s.size, L2_BLOCK):
            np.positive(s[c:c + L2_BLOCK], out=o[c:c + L2_BLOCK])
            bad.append(not max_min_finite(f[c:c + L2_BLOCK]))

    trailing_checks: list = []

    def trailing(i, out):
        o, s, f = out.reshape(-1).view(np.uint32), srcs[i].reshape(-1).view(np.uint32), srcs[i].reshape(-1)
        for c in range(0, s.size, TRAIL_BLOCK):
            np.positive(s[c:c + TRAIL_BLOCK], out=o[c:c + TRAIL_BLOCK])
            trailing_checks.append(scanner.submit(max_min_finite, f[c:c + TRAIL_BLOCK]))

    def with_c_kernel(i, out):  # the C copy that counts, on every core for 8 MiB and more
        bad.append(_transfer.copy_into(out, srcs[i], check_finite=True) > 0)

    def through_load(fill):
        def run():
            out = filled_arrays([(s.shape, "float32") for s in srcs], fill)
            bad.extend(not ok.result() for ok in trailing_checks)
            trailing_checks.clear()
            return out
        return run

    check = through_load(copy_only)()
    assert all(np.array_equal(np.asarray(a), s) for a, s in zip(check, srcs)), "mx.load fill is not exact"
    del check
    # every variant on recycled memory: this table weighs copies and checks, not page faults or which
    # thread's malloc arena an allocation lands in (bench_convert.py --plain and --once measure those)
    cache_limit = mx.set_cache_limit(4 * sum(s.nbytes for s in srcs))
    fns = {"mx.array copies (the user's port)": port,
           "scan, then mx.array (inline)": inline,
           "scan on a 2nd core beside mx.array (shipped)": beside,
           "own copy into MLX memory via mx.load, no check": through_load(copy_only),
           "own copy, each 256 KiB checked after it in numpy (fused)": through_load(fused),
           "own copy, 2nd core checks 4 MiB pieces behind it in numpy": through_load(trailing)}
    if _transfer.COPY_KERNELS is not None:
        fns["own copy, C kernel counts in the copy's pass"] = through_load(with_c_kernel)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            out = fn()
            samples[k].append(time.perf_counter() - start)
            del out
            gc.collect()
    mx.set_cache_limit(cache_limit)
    assert not any(bad), "a finite source was judged non-finite"
    port_s = samples["mx.array copies (the user's port)"]
    rows = [[k, f"{statistics.median(v) * 1e3:.2f}", f"{statistics.median(p / t for p, t in zip(port_s, v)):.2f}x"]
            for k, v in samples.items()]
    return rows, ["into MLX", "ms", "port / this (>= 0.95x wanted)"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "scan_limits.md"))
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    parts = [("Exact-test kernels and copies, one and two cores", kernel_table(args.repeats)),
             ("Copies in 256 KiB pieces, by the destination's start relative to the source",
              piece_table(args.repeats))]
    into_mlx = mlx_table(args.layers, args.width, args.repeats)
    if into_mlx is not None:
        mb = args.layers * args.width * args.width * 4 / 1e6
        parts.append((f"Into MLX: {args.layers} float32 arrays {args.width}x{args.width} ({mb:.0f} MB), "
                      "median of per-round ratios", into_mlx))
    load_after = os.getloadavg()
    command = "python benchmarks/bench_scan_limits.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = ["# What a NaN/Inf scan can cost on this machine", "", f"Command: `{command.strip()}`", "",
              f"Machine: {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
              ""]
    for title, (rows, header) in parts:
        report += [f"## {title}", "", table(rows, header), ""]
    text = "\n".join(report)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
