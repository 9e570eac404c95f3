"""Tensor-parallel Dense on MLX's ring backend: real ``mlx.launch`` processes on CPU.

Each test launches ``mlx.launch --backend ring -n N <this python> <this file> <case> <outdir>``;
the ``__main__`` block below is the per-rank worker. It compiles the same spec single-process and
with ``parallel=``, checks outputs, parameter gradients (all-gathered from the shards), the shard
shapes, ``get_params``/``set_params``/``local_params`` and ``to_spec`` on every rank, and writes
one JSON report per rank; the test asserts every rank's report. Shapes stay tiny: MLX's Linux
CPU matmul is slow (FACTS), and the ranks share 2 cores.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()

# ------------------------------------------------------------------ the per-rank worker


def _spec(case: str):
    import dense_bridge as db

    mask = (np.random.default_rng(3).random((16, 8)) < 0.6).astype(np.float32)
    if case == "mlp4":
        # 4 Dense, parallel="auto": column, row, column, row; masks on a column and a row layer
        return db.Sequential([
            db.Dense(16, in_features=6, activation="relu"),
            db.Dense(8, activation="tanh", mask=mask),
            db.Dense(12, mask=np.ones((8, 12), np.float32) - np.eye(8, 12, dtype=np.float32)),
            db.Activation("gelu"),
            db.Dense(4),
        ])
    if case == "softmax_tail":
        # an odd chain: the last layer is column-parallel, its softmax needs every feature
        return db.Sequential([db.Dense(8, in_features=6, activation="silu"), db.Dense(4),
                              db.Dense(8, activation="softmax")])
    raise SystemExit(f"unknown case {case!r}")


def _digest(params: dict) -> str:
    import hashlib

    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode() + np.ascontiguousarray(params[k]).tobytes())
    return h.hexdigest()


def _worker(case: str, outdir: str) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    import dense_bridge as db
    from dense_bridge.backends import mlx as adapter
    from dense_bridge.backends.mlx._parallel import full_grads

    group = mx.distributed.init()
    n, r = group.size(), group.rank()
    report: dict = {"rank": r, "size": n, "checks": {}}
    checks = report["checks"]
    spec = _spec(case)
    single = db.compile(spec, "mlx", seed=7)
    par = db.compile(spec, "mlx", seed=7, parallel="auto", group=group)
    plan = {i: type(m).__name__ for i, m in enumerate(par.layers)}
    report["plan"] = plan

    # shard shapes, read off the live modules (never trusting the plan)
    shapes = {}
    for i, m in enumerate(par.layers):
        if isinstance(m, adapter.ColumnDense):
            full = spec.layers[i]
            assert tuple(m.weight.shape) == (full.units // n, full.in_features), (i, m.weight.shape)
            if "mask" in m:
                assert tuple(m.mask.shape) == tuple(m.weight.shape)
            assert tuple(m.bias.shape) == (full.units // n,)
        if isinstance(m, adapter.RowDense):
            full = spec.layers[i]
            assert tuple(m.weight.shape) == (full.units, full.in_features // n), (i, m.weight.shape)
            assert tuple(m.bias.shape) == (full.units,)
        if "weight" in m:
            shapes[i] = list(m.weight.shape)
    report["shard_shapes"] = shapes
    checks["shard_shapes"] = True

    # parameters: the gathered ones are the single-process ones, bit for bit
    full = db.get_params(par)
    ref = db.get_params(single)
    assert sorted(full) == sorted(ref)
    for k in ref:
        assert np.array_equal(full[k], ref[k]), k
    checks["get_params_bit_exact"] = True

    # local=True: this rank's shard and its slice of the full tensor
    local = db.get_params(par, local=True)
    for k, shard in local.items():
        assert np.array_equal(shard.array, ref[k][shard.index]), k
    checks["local_shards"] = True

    assert db.to_spec(par) == db.to_spec(single), (db.to_spec(par), db.to_spec(single))
    checks["to_spec"] = True

    # forward and parameter gradients of L = sum(y * g) vs the single-process model
    rng = np.random.default_rng(11)
    x = mx.array(rng.standard_normal((5, 6)).astype(np.float32))
    g = mx.array(rng.standard_normal((5, spec.layers[-1].units)).astype(np.float32))

    def loss(model, x):
        return mx.sum(model(x) * g)

    y_par, y_one = par(x), single(x)
    out_err = float(mx.max(mx.abs(y_par - y_one)))
    _, grads_par = nn.value_and_grad(par, loss)(par, x)
    _, grads_one = nn.value_and_grad(single, loss)(single, x)
    assert not any(k.endswith("mask") for k, _ in tree_flatten(grads_par))  # masks never train
    full_g = full_grads(par, grads_par)
    ref_g = {}
    for i, go in enumerate(grads_one["layers"]):
        if go:
            ref_g[f"{i}.kernel"] = np.array(go["weight"]).T
            ref_g[f"{i}.bias"] = np.array(go["bias"])
    assert sorted(full_g) == sorted(ref_g)
    grad_err = max(float(np.max(np.abs(full_g[k] - ref_g[k]))) for k in ref_g)
    report["max_abs_output_error"] = out_err
    report["max_abs_grad_error"] = grad_err
    assert out_err < 1e-5 and grad_err < 1e-5, (out_err, grad_err)
    checks["forward_backward"] = True

    # db.testing.compare holds the parallel model against the single-process one, layer by layer
    # (collective: the parallel trace all-gathers sharded outputs and gradients)
    db.testing.assert_equivalent(par, single)
    checks["compare"] = True

    # set_params takes full arrays and keeps this rank's slice; masked entries stay 0
    new = {k: (v * 2 + 1).astype(v.dtype) if not k.endswith("mask") else v for k, v in ref.items()}
    db.set_params(par, new)
    db.set_params(single, new)
    back = db.get_params(par)
    for k, v in db.get_params(single).items():
        assert np.array_equal(back[k], v), k
    assert np.allclose(np.array(par(x)), np.array(single(x)), atol=1e-5)
    checks["set_params"] = True

    # seed=None: every rank builds its block of one random model (rank 0's seed), a new one per call
    rand = db.Sequential([db.Dense(8, in_features=4, bias_init="glorot_uniform"),
                          db.Dense(8, bias_init="glorot_uniform"), db.Dense(4, bias_init="glorot_uniform")])
    draws = [db.get_params(db.compile(rand, "mlx", parallel={0: "column", 1: "row"}, group=group)) for _ in range(2)]
    report["seed_none_digest"] = _digest(draws[0])
    checks["seed_none_new_model_per_call"] = _digest(draws[0]) != _digest(draws[1])

    # a width that does not divide over the group raises SpecError naming the layer
    if n > 1:
        try:
            db.compile(db.Sequential([db.Dense(n + 1, in_features=4), db.Dense(2)]), "mlx", seed=0,
                       parallel="auto", group=group)
        except db.SpecError as exc:
            assert "divide" in str(exc), exc
            checks["indivisible_raises"] = True
    Path(outdir, f"rank{r}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
    sys.exit(0)


# ------------------------------------------------------------------ the tests (pytest side)
import pytest  # noqa: E402

pytest.importorskip("mlx.core")
pytest.importorskip("mlx.nn.layers.distributed")


def _free_base_port(n: int) -> int:
    """A port p with p..p+n-1 free now (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range for the ring backend")


def launch(case: str, n: int, outdir: Path, timeout: float = 120) -> list[dict]:
    """Run the worker on ``n`` ring ranks; return every rank's report (fails with their output)."""
    # mlx.launch's module has no __main__ guard: call its main() (the console script does the same)
    cmd = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
           "--backend", "ring", "-n", str(n),
           "--starting-port", str(_free_base_port(n)), sys.executable, str(HERE), case, str(outdir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    missing = [r for r in range(n) if not (outdir / f"rank{r}.json").exists()]
    # mlx.launch may exit 0 when a rank fails: a missing report is a failure too
    assert proc.returncode == 0 and not missing, \
        f"{' '.join(cmd)}\nranks without a report: {missing}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_mlp4_auto_matches_single_process(tmp_path, n):
    reports = launch("mlp4", n, tmp_path)
    for rep in reports:
        assert rep["size"] == n
        assert rep["plan"] == {"0": "ColumnDense", "1": "RowDense", "2": "ColumnDense", "3": "ExactActivation",
                               "4": "RowDense"}
        assert rep["checks"] == {"shard_shapes": True, "get_params_bit_exact": True, "local_shards": True,
                                 "to_spec": True, "forward_backward": True, "compare": True, "set_params": True,
                                 "seed_none_new_model_per_call": True, "indivisible_raises": True}
        assert rep["shard_shapes"]["0"] == [16 // n, 6] and rep["shard_shapes"]["1"] == [8, 16 // n]
        assert rep["max_abs_output_error"] < 1e-5 and rep["max_abs_grad_error"] < 1e-5
    # seed=None: rank 0's seed everywhere, so the gathered model (replicated layer 2 included) is one
    assert len({rep["seed_none_digest"] for rep in reports}) == 1, [rep["seed_none_digest"] for rep in reports]


def test_column_tail_with_softmax_gathers(tmp_path):
    reports = launch("softmax_tail", 2, tmp_path)
    for rep in reports:
        assert rep["checks"]["forward_backward"] and rep["checks"]["get_params_bit_exact"]
        assert rep["shard_shapes"]["2"] == [4, 4]  # 8 units over 2 ranks, in_features 4
