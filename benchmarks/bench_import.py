"""Start-up cost: ``import dense_bridge`` and the first ``compile`` on each backend.

Each sample is a fresh Python process (warm file caches: one untimed process first). Reported:
the median of --repeats samples of ``import dense_bridge`` alone (target < 0.1 s; it imports no
framework and not numpy: public names load on first use), of the import plus a first spec (what
touching ``db.Dense`` costs: the spec modules and numpy), of numpy alone for scale, and of ``import dense_bridge`` + the first ``db.compile(Dense(4, in_features=4), b)``
per installed backend (which includes importing that framework).

Run:  python benchmarks/bench_import.py [--repeats 10]
Writes benchmarks/results/import.md (--out).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_IMPORT = ("import time; t = time.perf_counter(); import dense_bridge; "
           "print(time.perf_counter() - t)")
_SPEC = ("import time; t = time.perf_counter(); import dense_bridge as db; "
         "db.Sequential([db.Dense(4, in_features=4), db.Dense(2)]); print(time.perf_counter() - t)")
_NUMPY = "import time; t = time.perf_counter(); import numpy; print(time.perf_counter() - t)"
_FIRST = ("import time; t = time.perf_counter(); import dense_bridge as db; t1 = time.perf_counter(); "
          "db.compile(db.Dense(4, in_features=4), {b!r}, seed=0); print(t1 - t, time.perf_counter() - t1)")


def _run(code: str) -> list[float]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return [float(v) for v in out.stdout.split()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "import.md"))
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import dense_bridge as db

    load_before = os.getloadavg()
    _run(_IMPORT)  # warm the file caches
    imports = [_run(_IMPORT)[0] for _ in range(args.repeats)]
    first_spec = [_run(_SPEC)[0] for _ in range(args.repeats)]
    numpy_only = [_run(_NUMPY)[0] for _ in range(args.repeats)]
    rows = [["import dense_bridge", f"{statistics.median(imports) * 1e3:.0f} ms",
             f"{min(imports) * 1e3:.0f}-{max(imports) * 1e3:.0f} ms"],
            ["import dense_bridge + a first spec (`db.Sequential([db.Dense(...)])`: loads the spec modules "
             "and numpy)", f"{statistics.median(first_spec) * 1e3:.0f} ms",
             f"{min(first_spec) * 1e3:.0f}-{max(first_spec) * 1e3:.0f} ms"],
            ["for scale: import numpy alone (the only dependency)", f"{statistics.median(numpy_only) * 1e3:.0f} ms",
             f"{min(numpy_only) * 1e3:.0f}-{max(numpy_only) * 1e3:.0f} ms"]]
    for b in db.available_backends():
        _run(_FIRST.format(b=b))
        samples = [_run(_FIRST.format(b=b))[1] for _ in range(max(3, args.repeats // 3))]
        rows.append([f"first db.compile on {b} (spec modules, adapter and framework imports included)",
                     f"{statistics.median(samples) * 1e3:.0f} ms", f"{min(samples) * 1e3:.0f}-{max(samples) * 1e3:.0f} ms"])
    load_after = os.getloadavg()
    text = "\n".join(["| what | median | range |", "|---|---|---|"] + [f"| {' | '.join(r)} |" for r in rows])
    command = "python benchmarks/bench_import.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = ["# Start-up cost", "", f"Command: `{command.strip()}`", "",
              f"Machine: {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
              f"fresh process per sample, warm file caches; {args.repeats} samples for the import "
              f"({max(3, args.repeats // 3)} per backend).", "", text, ""]
    print(text)
    with open(args.out, "w") as f:
        f.write("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
