"""False alarms and found faults of compare_models, cascaded and isolated, pinned and at 1 and 2 threads.

Not part of CI: it runs hundreds of whole-model passes. Ports (correct, then with planted faults):

- BERT (transformers vs keras-hub), GPT-2 and Llama (transformers vs mlx-lm) of tests/_compare_ports.py,
  float32 and bfloat16, with the planted faults of tests/testing/test_compare_models.py (a transposed
  square projection, a dropped bias, a kernel rounded to bfloat16, gelu exact instead of tanh);
- LoRA and DoRA kept as adapters: a PEFT Llama into mlx-lm with ``lora="keep"`` (faults: an
  adapter mis-scaled, one dropped);
- quantized: a transformers Llama into an mlx-lm Llama quantized to 4 bits, group 32, by MLX's own
  quantizer (fault: one group's zero point off by one step);
- fused: Phi-3's fused qkv_proj/gate_up_proj into a split Llama (fault: one member's kernel x 1.01).

Each setting runs in its own process: ``taskset -c 0`` (one core, 1 thread), and unpinned at 1 and
2 threads (OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, which MLX's CPU matmuls use
too, and torch.set_num_threads). In each, correct ports over model draws x seeds (inputs and
cotangent) in both modes until ``--reports`` reports: every failing one is a false alarm (0
expected); then every planted fault in both modes: found when the report fails at the fault's
path and row.

    TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/python benchmarks/false_alarms.py [--reports 200]

Writes benchmarks/results/false_alarms.md (and .json beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"

MODES = (("cascaded", False), ("isolated", True))
#: the rows that judge a linear layer's own work (forced calls in isolated mode)
OWN_ROWS = ("output", "dL/dx", "dL/dkernel", "dL/dbias")
SAME = [(r"(.*)", r"\1")]
#: (name, command prefix, threads)
SETTINGS = (("taskset -c 0, 1 thread", ["taskset", "-c", "0"], 1), ("1 thread", [], 1), ("2 threads", [], 2))
#: (port, dtype) of the correct ports
CONFIGS = (("bert", "float32"), ("bert", "bfloat16"), ("gpt2", "float32"), ("gpt2", "bfloat16"),
           ("llama", "float32"), ("llama", "bfloat16"), ("lora", "float32"), ("dora", "float32"),
           ("quantized", "float32"), ("fused", "float32"))
DRAWS = 2  # model draws per port; the seeds (inputs, cotangent) vary within each


# ---------------------------------------------------------------------------- the ports
def _setup_paths() -> None:
    for p in (TESTS, TESTS / "lora", TESTS / "testing"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def build(name: str, draw: int, dtype: str = "float32"):
    """(a, b, inputs(seed), mapping) of a correct port; a is the original, b the port."""
    import numpy as np

    import dense_bridge as db
    import _compare_ports as P
    from test_compare_models import _bert, _mlx_port

    lm = lambda seed: P.lm_inputs(seed)  # noqa: E731
    if name == "bert":
        port, src = _bert(draw, dtype)
        return src, port, P.bert_inputs, P.BERT_RULES
    if name in ("gpt2", "llama"):
        port, src = _mlx_port(name, draw, dtype)
        return src, port, lm, SAME
    if name in ("lora", "dora"):
        from test_lora import V, _mlx_llama, _peft_llama

        src, port = _peft_llama(name, seed=draw), _mlx_llama()
        db.transfer(src, port, mapping=SAME, lora="keep")
        return src, port, lambda seed: [np.random.default_rng(seed).integers(0, V, (2, 7))], SAME
    if name == "quantized":
        import mlx.nn as nn

        src, port = P.torch_llama(draw), P.mlx_llama()
        nn.quantize(port, group_size=32, bits=4)
        db.transfer(src, port, mapping=SAME)  # MLX's own quantizer
        return src, port, lm, SAME
    if name == "fused":
        import torch
        import transformers
        from _port_helpers import PHI3_TO_LLAMA, V, _phi3_pair, randomize

        _, kw, _ = _phi3_pair()
        torch.manual_seed(draw)
        phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
        randomize(phi3, draw)
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
        db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA)
        return phi3, llama, lambda seed: [np.random.default_rng(seed).integers(0, V, (2, 7))], PHI3_TO_LLAMA
    raise ValueError(name)


def _compare(built, seed: int, isolated: bool):
    import dense_bridge as db

    a, b, inputs, mapping = built
    return db.testing.compare_models(a, b, inputs(seed), mapping=mapping, seed=seed, isolated=isolated)


def _more_faults() -> dict:
    """The planted faults of the LoRA, quantized and fused ports: name -> fault -> (plant(b),
    expected path in a, row)."""
    import numpy as np

    import dense_bridge as db

    def misscale(port):
        layer = db.linear_layers(port)["model.layers.1.self_attn.v_proj"]
        db.set_params(layer, {**db.get_params(layer), "lora_scale": np.array(1.0)})

    def drop(port):
        attn = port.model.layers[0].self_attn
        attn.o_proj = attn.o_proj.linear

    def zero_point(port):
        import mlx.core as mx

        layer = port.model.layers[1].mlp.up_proj
        scales, biases = np.array(layer.scales), np.array(layer.biases)
        biases[3, 0] += scales[3, 0]
        layer.update({"scales": mx.array(scales), "biases": mx.array(biases)})

    def member(port):
        import torch

        with torch.no_grad():
            port.model.layers[0].self_attn.k_proj.weight.mul_(1.01)

    adapters = {"misscaled": (misscale, "model.layers.1.self_attn.v_proj", "output"),
                "dropped": (drop, "model.layers.0.self_attn.o_proj", "output")}
    return {"lora": adapters, "dora": adapters,
            "quantized": {"zero point": (zero_point, "model.layers.1.mlp.up_proj", "quantization")},
            "fused": {"k_proj x 1.01": (member, "model.layers.0.self_attn.qkv_proj", "output")}}


def faults() -> list[dict]:
    import dense_bridge as db
    from test_compare_models import FAULTS, _plant_gelu, _set

    cases = []
    for name, planted in FAULTS.items():
        for fault, (where, change, expected, row) in planted.items():
            def plant(port, name=name, where=where, change=change):
                if change is None:
                    _plant_gelu(name, port, where)
                else:
                    _set(db.linear_layers(port)[where], **change)
            cases.append((name, fault, plant, expected, row))
    for name, planted in _more_faults().items():
        cases += [(name, fault, plant, expected, row) for fault, (plant, expected, row) in planted.items()]
    rows = []
    for name, fault, plant, expected, row in cases:
        built = build(name, 0)
        plant(built[1])
        for mode, isolated in MODES:
            report = _compare(built, 0, isolated)
            f = report.first_failure
            found = (not report.passed and report.first_divergence_a == expected and f is not None
                     and f.quantity == row)
            rows.append({"port": name, "fault": fault, "mode": mode, "expected": f"{expected} ({row})",
                         "named": None if f is None else f"{report.first_divergence_a} ({f.quantity})",
                         "units": None if f is None else f.units, "found": found,
                         "fraction": None if f is None or f.stats is None else f.stats.fraction})
            print(f"{name}-{fault} {mode}: {'found' if found else 'MISSED'} at {rows[-1]['named']}", flush=True)
    return rows


def false_alarms(reports: int) -> list[dict]:
    per_config = max(1, -(-reports // (len(CONFIGS) * len(MODES))))  # seeds per (port, dtype)
    seeds_per_draw = max(1, -(-per_config // DRAWS))
    rows = []
    for name, dtype in CONFIGS:
        stats = {mode: {"alarms": 0, "worst": 0.0, "own": 0.0, "runs": 0, "seconds": 0.0, "first": None}
                 for mode, _ in MODES}
        done = 0
        for draw in range(DRAWS):
            if done >= per_config:
                break
            built = build(name, draw, dtype)
            for seed in range(draw * seeds_per_draw, (draw + 1) * seeds_per_draw):
                if done >= per_config:
                    break
                done += 1
                for mode, isolated in MODES:
                    t = time.perf_counter()
                    report = _compare(built, seed, isolated)
                    s = stats[mode]
                    s["seconds"] += time.perf_counter() - t
                    s["runs"] += 1
                    s["worst"] = max(s["worst"], report.worst.units)
                    s["own"] = max([s["own"]] + [q.units for q in report.rows if q.quantity in OWN_ROWS])
                    if not report.passed:
                        s["alarms"] += 1
                        s["first"] = s["first"] or f"{name} {dtype} {mode} seed {seed}: {report.verdict()}"
        for mode, _ in MODES:
            s = stats[mode]
            rows.append({"port": name, "dtype": dtype, "mode": mode, "runs": s["runs"],
                         "false_alarms": s["alarms"], "worst_units": s["worst"], "worst_own_units": s["own"],
                         "seconds_per_run": s["seconds"] / max(1, s["runs"]), "first_alarm": s["first"]})
            print(f"{name} {dtype} {mode}: {s['alarms']} false alarms in {s['runs']} runs, worst "
                  f"{s['worst']:.3f} units", flush=True)
    return rows


def worker(threads: int, reports: int, out: str) -> int:
    """One setting, in this process (the thread variables were set before it started)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    warnings.simplefilter("ignore")
    _setup_paths()
    import torch

    torch.set_num_threads(threads)
    t = time.perf_counter()
    found = faults()
    alarms = false_alarms(reports)
    Path(out).write_text(json.dumps({"threads": threads, "torch_threads": torch.get_num_threads(),
                                     "affinity": sorted(os.sched_getaffinity(0)), "false_alarms": alarms,
                                     "faults": found, "seconds": time.perf_counter() - t}))
    return 0


# ---------------------------------------------------------------------------- the report
def _md(results: list[dict], reports: int, seconds: float) -> str:
    lines = ["# compare_models: false alarms and planted faults, pinned and at 1 and 2 threads", "",
             f"`TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/python benchmarks/false_alarms.py --reports {reports}` "
             f"({seconds / 60:.1f} min on {platform.machine()}, {os.cpu_count()} cores shared with other jobs: "
             f"times are indicative only). Each setting ran in its own process; threads set through "
             f"OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS and torch.set_num_threads.", ""]
    total_alarms = total_runs = total_found = total_faults = 0
    for res in results:
        alarms, found = res["false_alarms"], res["faults"]
        runs = sum(r["runs"] for r in alarms)
        n_alarms = sum(r["false_alarms"] for r in alarms)
        missed = [r for r in found if not r["found"]]
        total_alarms, total_runs = total_alarms + n_alarms, total_runs + runs
        total_found, total_faults = total_found + len(found) - len(missed), total_faults + len(found)
        lines += [f"## {res['setting']} (cores {res['affinity']}, torch threads {res['torch_threads']})", "",
                  f"{n_alarms} false alarms in {runs} reports of correct ports; {len(found) - len(missed)}/"
                  f"{len(found)} planted faults found at their path and row.", "",
                  "| port | dtype | mode | runs | false alarms | worst tolerance units | worst of the layers' own "
                  "rows (output, dL/dx, dL/dkernel, dL/dbias) | s per run |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in alarms:
            lines.append(f"| {r['port']} | {r['dtype']} | {r['mode']} | {r['runs']} | {r['false_alarms']} | "
                         f"{r['worst_units']:.3f} | {r['worst_own_units']:.3f} | {r['seconds_per_run']:.2f} |")
        lines += ["", "| port | fault | mode | expected | named | units | elements out of tolerance | found |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in found:
            units = "-" if r["units"] is None else f"{r['units']:.3g}"
            lines.append(f"| {r['port']} | {r['fault']} | {r['mode']} | {r['expected']} | {r['named']} | {units} | "
                         f"{r['fraction'] or '-'} | {'yes' if r['found'] else '**no**'} |")
        first = [r["first_alarm"] for r in alarms if r["first_alarm"]]
        if first:
            lines += ["", "First false alarm of each row that had one:", ""] + [f"- {x}" for x in first]
        lines.append("")
    lines += [f"Total: {total_alarms} false alarms in {total_runs} reports; {total_found}/{total_faults} planted "
              f"faults found at their path and row."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=200, help="reports of correct ports per setting (default 200)")
    parser.add_argument("--settings", default=",".join(str(i) for i in range(len(SETTINGS))),
                        help="which settings, by index: " + "; ".join(f"{i}: {s[0]}" for i, s in enumerate(SETTINGS)))
    parser.add_argument("--out", default=str(HERE / "results" / "false_alarms.md"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.threads, args.reports, args.json)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    results = []
    for index in (int(i) for i in args.settings.split(",")):
        name, prefix, threads = SETTINGS[index]
        part = out.with_name(f"{out.stem}.{index}.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "OPENBLAS_NUM_THREADS": str(threads), "TF_CPP_MIN_LOG_LEVEL": "3"}
        print(f"== {name}", flush=True)
        subprocess.run(prefix + [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(threads),
                                 "--reports", str(args.reports), "--json", str(part)], env=env, check=True)
        res = json.loads(part.read_text())
        part.unlink()
        res["setting"] = name
        results.append(res)
    seconds = time.perf_counter() - t
    out.write_text(_md(results, args.reports, seconds))
    out.with_suffix(".json").write_text(json.dumps({"reports_per_setting": args.reports, "settings": results},
                                                   indent=2))
    print(f"wrote {out}")
    bad = any(r["false_alarms"] for res in results for r in res["false_alarms"]) or \
        not all(r["found"] for res in results for r in res["faults"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
