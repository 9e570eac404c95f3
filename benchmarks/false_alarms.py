"""False alarms and found faults of compare_models, cascaded and isolated (teacher forcing).

Not part of CI: it runs hundreds of whole-model passes. For the BERT (transformers vs keras-hub),
GPT-2 and Llama (transformers vs mlx-lm) ports of tests/_compare_ports.py:

1. correct ports over SEEDS seeds (model draws x input and cotangent draws, as
   tests/testing/test_compare_models.py draws them) in float32 and bfloat16, each in both modes: every
   failing report is a false alarm (0 expected); the worst tolerance units seen are kept;
2. every planted fault of tests/testing/test_compare_models.py (a transposed square projection, a dropped
   bias, a kernel rounded to bfloat16, gelu exact instead of tanh) in both modes: found when the
   report fails with its first divergence at the fault's path and row.

    TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/python benchmarks/false_alarms.py [--seeds 50] [--dtypes float32,bfloat16]

Writes benchmarks/results/false_alarms.md (and .json beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
warnings.simplefilter("ignore")

import dense_bridge as db  # noqa: E402
from test_compare_models import FAULTS, MODEL_DRAWS, _bert, _compare, _mlx_port, _plant_gelu, _set  # noqa: E402

PORTS = ("bert", "gpt2", "llama")
MODES = (("cascaded", False), ("isolated", True))
#: the rows that judge a linear layer's own work (forced calls in isolated mode)
OWN_ROWS = ("output", "dL/dx", "dL/dkernel", "dL/dbias")


def _port(name: str, draw: int, dtype: str = "float32"):
    return _bert(draw, dtype) if name == "bert" else _mlx_port(name, draw, dtype)


def false_alarms(seeds: int, dtypes: list[str]) -> list[dict]:
    rows = []
    draws = min(MODEL_DRAWS, seeds)
    per_draw = max(1, seeds // draws)
    for name in PORTS:
        for dtype in dtypes:
            stats = {mode: {"alarms": 0, "worst": 0.0, "own": 0.0, "runs": 0, "seconds": 0.0,
                             "first": None} for mode, _ in MODES}
            for draw in range(draws):
                port, src = _port(name, draw, dtype)
                for seed in range(draw * per_draw, (draw + 1) * per_draw):
                    for mode, isolated in MODES:
                        t = time.perf_counter()
                        report = _compare(name, port, src, seed, isolated=isolated)
                        s = stats[mode]
                        s["seconds"] += time.perf_counter() - t
                        s["runs"] += 1
                        s["worst"] = max(s["worst"], report.worst.units)
                        s["own"] = max([s["own"]] + [q.units for q in report.rows if q.quantity in OWN_ROWS])
                        if not report.passed:
                            s["alarms"] += 1
                            s["first"] = s["first"] or f"seed {seed}: {report.verdict()}"
            for mode, _ in MODES:
                s = stats[mode]
                rows.append({"port": name, "dtype": dtype, "mode": mode, "runs": s["runs"],
                             "false_alarms": s["alarms"], "worst_units": s["worst"], "worst_own_units": s["own"],
                             "seconds_per_run": s["seconds"] / max(1, s["runs"]), "first_alarm": s["first"]})
                print(f"{name} {dtype} {mode}: {s['alarms']} false alarms in {s['runs']} runs, worst "
                      f"{s['worst']:.3f} units", flush=True)
    return rows


def faults() -> list[dict]:
    rows = []
    for name, cases in FAULTS.items():
        for fault, (where, change, expected, row) in cases.items():
            port, src = _port(name, 0)
            if change is None:
                _plant_gelu(name, port, where)
            else:
                _set(db.linear_layers(port)[where], **change)
            for mode, isolated in MODES:
                report = _compare(name, port, src, 0, isolated=isolated)
                f = report.first_failure
                found = (not report.passed and report.first_divergence_a == expected and f is not None
                         and f.quantity == row)
                rows.append({"port": name, "fault": fault, "mode": mode, "expected": f"{expected} ({row})",
                             "named": None if f is None else f"{report.first_divergence_a} ({f.quantity})",
                             "units": None if f is None else f.units, "found": found,
                             "fraction": None if f is None or f.stats is None else f.stats.fraction})
                print(f"{name}-{fault} {mode}: {'found' if found else 'MISSED'} at {rows[-1]['named']}", flush=True)
    return rows


def _md(alarms: list[dict], found: list[dict], seeds: int, seconds: float) -> str:
    lines = ["# compare_models: false alarms and planted faults, cascaded vs isolated", "",
             f"`TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/python benchmarks/false_alarms.py --seeds {seeds}` "
             f"({seconds / 60:.1f} min on {platform.machine()}, {os.cpu_count()} cores shared with other jobs: "
             f"times are indicative only).", "",
             "## Correct ports (0 false alarms expected)", "",
             "| port | dtype | mode | runs | false alarms | worst tolerance units | worst of the layers' own rows "
             "(output, dL/dx, dL/dkernel, dL/dbias) | s per run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in alarms:
        lines.append(f"| {r['port']} | {r['dtype']} | {r['mode']} | {r['runs']} | {r['false_alarms']} | "
                     f"{r['worst_units']:.3f} | {r['worst_own_units']:.3f} | {r['seconds_per_run']:.2f} |")
    lines += ["", "## Planted faults (each must be named at its path and row)", "",
              "| port | fault | mode | expected | named | units | elements out of tolerance | found |",
              "|---|---|---|---|---|---|---|---|"]
    for r in found:
        units = "-" if r["units"] is None else f"{r['units']:.3g}"
        lines.append(f"| {r['port']} | {r['fault']} | {r['mode']} | {r['expected']} | {r['named']} | {units} | "
                     f"{r['fraction'] or '-'} | {'yes' if r['found'] else '**no**'} |")
    total_alarms = sum(r["false_alarms"] for r in alarms)
    missed = [r for r in found if not r["found"]]
    lines += ["", f"Total: {total_alarms} false alarms in {sum(r['runs'] for r in alarms)} reports; "
                  f"{len(found) - len(missed)}/{len(found)} planted faults found at their path."]
    first = [r["first_alarm"] for r in alarms if r["first_alarm"]]
    if first:
        lines += ["", "First false alarm of each row that had one:", ""] + [f"- {x}" for x in first]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=50, help="seeds per port and dtype (default 50)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--out", default=str(HERE / "results" / "false_alarms.md"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny models on a shared machine: the thread pool costs more than it gives
    t = time.perf_counter()
    found = faults()
    alarms = false_alarms(args.seeds, args.dtypes.split(","))
    seconds = time.perf_counter() - t
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_md(alarms, found, args.seeds, seconds))
    out.with_suffix(".json").write_text(json.dumps({"seeds": args.seeds, "false_alarms": alarms, "faults": found},
                                                   indent=2))
    print(f"wrote {out}")
    return 0 if not any(r["false_alarms"] for r in alarms) and all(r["found"] for r in found) else 1


if __name__ == "__main__":
    sys.exit(main())
