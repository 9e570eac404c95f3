"""``dense-bridge demo``: the whole job on built-in defaults, in a few seconds.

An MLP 32 -> 64 -> 64 -> 10 (relu, relu, softmax) is trained briefly on synthetic data (in
the first installed framework whose adapter trains, else in numpy with the reference backward),
ported with ``db.convert``
to every installed framework, checked layer by layer (outputs and gradients, in tolerance
units) with ``db.testing.compare``, saved as a canonical checkpoint (single and sharded) and
as each framework's own file, and reloaded bit for bit. Sizes stay small: MLX's Linux CPU
matmul is 50-70x slower than the others (docs/FACTS.md).
"""
from __future__ import annotations

import json
import numbers
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

IN, HIDDEN, OUT, N = 32, 64, 10, 256


def native_files(backends: list[str]) -> dict[str, str]:
    """backend -> the demo's file name in its first declared writable format (from the registry)."""
    from ..registry._backends import manifest

    out = {}
    for b in backends:
        ending = next((f.extensions[0] for f in manifest(b).formats if f.write_kind and f.extensions), None)
        if ending is not None:
            out[b] = f"demo_{b}{ending}"
    return out


def demo_spec():
    import dense_bridge as db

    return db.Sequential([
        db.Dense(HIDDEN, in_features=IN, activation="relu", kernel_init="he_uniform"),
        db.Dense(HIDDEN, activation="relu", kernel_init="he_uniform"),
        db.Dense(OUT, activation="softmax"),
    ], name="demo_mlp")


def synthetic_data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs (N, 32) and labels from a fixed random linear teacher: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, IN)).astype(np.float32)
    teacher = rng.standard_normal((IN, OUT))
    return x, np.argmax(x @ teacher, axis=1)


def _loss_acc(probs: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    p = np.clip(probs.astype(np.float64)[np.arange(len(y)), y], 1e-12, None)
    return float(-np.log(p).mean()), float((probs.argmax(axis=1) == y).mean())


def _bit_identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).dtype == np.asarray(b[k]).dtype
        and np.ascontiguousarray(a[k]).tobytes() == np.ascontiguousarray(b[k]).tobytes() for k in a)


class _Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, step: str, backends: str, passed: bool, seconds: float, detail: str = "",
            max_abs_error: float | None = None, units: float | None = None) -> None:
        self.rows.append({"step": step, "backends": backends, "detail": detail, "max_abs_error": max_abs_error,
                          "tolerance_units": units, "passed": passed, "seconds": round(seconds, 4)})


def run(json_output: bool = False, steps: int = 60, seed: int = 0, keep: str | None = None) -> int:
    """Run the demo, print its table (or JSON); 0 when every step passed, else 1."""
    import dense_bridge as db

    from .. import checkpoints
    from .._errors import check_type, received
    from ..registry._backends import get_adapter, has_capability
    from ..adapter_kit import GRADIENTS
    from ..testing import compare
    from ._text import table

    check_type("steps", steps, numbers.Integral, "a non-negative integer")
    if steps < 0:
        raise db.SpecError(f"steps must be a non-negative integer. {received('steps', steps)}")
    backends = db.available_backends()
    # the first installed framework whose adapter trains (the train_sgd verb), else the reference
    reference = "numpy"
    trainer = next(b for b in [b for b in backends if b != reference] + [reference]
                   if hasattr(get_adapter(b), "train_sgd"))
    spec = demo_spec()
    x, y = synthetic_data(seed)
    rows = _Rows()
    workdir = keep or tempfile.mkdtemp(prefix="dense-bridge-demo-")
    os.makedirs(workdir, exist_ok=True)
    try:
        t = time.perf_counter()
        model = db.compile(spec, trainer, seed=seed)
        probs_before, probs_after = get_adapter(trainer).train_sgd(model, x, y, steps=steps, lr=0.5)
        before, after = _loss_acc(probs_before, y), _loss_acc(probs_after, y)
        how = "SGD, reference backward" if trainer == reference else f"SGD, {trainer} autograd"
        rows.add(f"train {steps} steps ({how})", trainer,
                 after[0] < before[0] or steps == 0, time.perf_counter() - t,
                 f"loss {before[0]:.2f} -> {after[0]:.2f}, accuracy {before[1]:.0%} -> {after[1]:.0%}")
        original = {k: np.array(v) for k, v in db.get_params(model).items()}

        ported = {trainer: model}
        for b in backends:
            if b == trainer:
                continue
            t = time.perf_counter()
            ported[b] = db.convert(model, to=b)
            same = _bit_identical(original, db.get_params(ported[b]))
            rows.add("port (db.convert)", f"{trainer} -> {b}", same, time.perf_counter() - t,
                     "parameters bit-identical" if same else "parameters differ", 0.0 if same else None)
        for b, other in ported.items():
            if b == trainer:
                continue
            t = time.perf_counter()
            grads = has_capability(b, GRADIENTS)  # an inference engine (onnxruntime) runs forward only
            report = compare(other, model, seed=seed, grads=grads)
            worst = report.worst
            rows.add("outputs + gradients" if grads else "outputs (forward only)", f"{b} vs {trainer}", bool(report.passed), time.perf_counter() - t,
                     f"{len(report.rows)} quantities" if report.passed else report.verdict(),
                     None if worst is None else worst.max_abs_error, None if worst is None else worst.units)

        from ..ports import headline  # whole model directories: one library's own into another's and back

        for r in headline(os.path.join(workdir, "ports"), seed=seed):
            rows.add(r["step"], r["backends"], r["passed"], r["seconds"], r["detail"], r["max_abs_error"])

        path = os.path.join(workdir, "demo.safetensors")
        t = time.perf_counter()
        db.save(model, path)
        reloaded = db.load(path, trainer)
        same = _bit_identical(original, db.get_params(reloaded)) and db.to_spec(reloaded) == db.to_spec(model)
        rows.add("save + load canonical", trainer, same, time.perf_counter() - t,
                 f"{os.path.getsize(path):,} bytes, bit-identical" if same else "reloaded parameters differ", 0.0)

        sharded = os.path.join(workdir, "sharded", "demo.safetensors")
        os.makedirs(os.path.dirname(sharded), exist_ok=True)
        t = time.perf_counter()
        files = db.save(model, sharded, max_shard_size="10kB")
        spec2, params2 = db.load(sharded)
        same = _bit_identical(original, params2) and spec2 == db.to_spec(model)
        rows.add("save + load sharded", "numpy", same, time.perf_counter() - t,
                 f"{len(files) - 1} shards + index, bit-identical" if same else "reloaded parameters differ", 0.0)

        for b, name in native_files(backends).items():
            out = os.path.join(workdir, name)
            t = time.perf_counter()
            checkpoints.convert_file(path, b, out)
            native = db.load(out, b, spec=db.to_spec(model))
            same = _bit_identical(original, db.get_params(native))
            rows.add(f"native file {name}", f"canonical -> {b} -> {b}", same, time.perf_counter() - t,
                     "bit-identical" if same else "parameters differ", 0.0)
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)

    ok = all(r["passed"] for r in rows.rows)
    if json_output:
        print(json.dumps({"model": _model_doc(spec), "trainer": trainer, "backends": backends, "passed": ok,
                          "rows": rows.rows}, indent=2))
        return 0 if ok else 1
    print(f"dense-bridge demo: {spec.name} {IN} -> {HIDDEN} -> {HIDDEN} -> {OUT} (relu, relu, softmax), "
          f"float32, {spec.num_params:,} parameters; {N} synthetic samples")
    print(f"installed backends: {', '.join(backends)}; trained in {trainer}" +
          (f"; files kept in {workdir}" if keep else ""))
    print()
    body = [[r["step"], r["backends"], _fmt(r["max_abs_error"], "{:.2e}"), _fmt(r["tolerance_units"], "{:.3f}"),
             "PASS" if r["passed"] else "FAIL", f"{r['seconds']:.2f} s", r["detail"]] for r in rows.rows]
    print(table(["step", "backends", "max abs err", "tol units", "result", "time", "detail"], body,
                right=(2, 3, 5)))
    print()
    total = sum(r["seconds"] for r in rows.rows)
    print(f"{'ALL PASS' if ok else 'SOME STEPS FAILED'}: {len(rows.rows)} steps in {total:.2f} s "
          "(tol units: worst error / allowed error; <= 1 passes)")
    return 0 if ok else 1


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _model_doc(spec) -> dict:
    from ..specs import layer_config

    return {"config": layer_config(spec), "num_params": spec.num_params}
