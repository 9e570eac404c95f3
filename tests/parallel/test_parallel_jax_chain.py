"""Sharded checkpoints across engines and world sizes, bit for bit:

torch DTensor on 4 gloo ranks saves -> MLX on 2 ring ranks loads, checks and saves -> Keras
ModelParallel on JAX over 4 devices (one process) loads, checks and saves -> one plain process
reads the directory whole. The chain runs twice per stage, in float32 and in bfloat16. Every
stage compares its gathered parameters (values and dtype) with the numpy draw of the same seed
(every backend draws the same bits), and each saved index records its world size, its dtype
and tiles each tensor exactly (``dense_bridge.parallel._sharded_dir`` validates that on every load).

The ``__main__`` block is the per-stage worker; each stage runs under its engine's own launcher
(``torch.distributed.run``, ``mlx.launch``, one JAX process with virtual CPU devices).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
SEED = 7


def _spec(dtype: str = "float32"):
    import dense_bridge as db

    mask = np.random.default_rng(5).random((16, 8)) < 0.5
    return db.Sequential([
        db.Dense(16, in_features=8, activation="relu", dtype=dtype),
        db.Dense(8, activation="tanh", mask=mask, dtype=dtype),
        db.Dense(12, use_bias=False, dtype=dtype),
        db.Dense(4, dtype=dtype),
    ])


DTYPES = {"": "float32", "_bf16": "bfloat16"}  # directory suffix -> the chain's dtype


def _reference(dtype: str = "float32") -> dict:
    import dense_bridge as db

    return db.get_params(db.compile(_spec(dtype), "numpy", seed=SEED))


def _same(params: dict, ref: dict) -> bool:
    return sorted(params) == sorted(ref) and all(
        params[k].dtype == ref[k].dtype and np.array_equal(params[k], ref[k]) for k in ref)


def _stage(stage: str, src: str, dst: str) -> None:
    """One engine's stage, for the float32 chain and the bfloat16 one (suffix ``_bf16``)."""
    import dense_bridge as db

    report: dict = {"stage": stage}
    if stage == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        report["world"] = dist.get_world_size()
    elif stage == "mlx":
        import mlx.core as mx

        group = mx.distributed.init()
        rank = group.rank()
        report["world"] = group.size()
    else:
        import jax

        from test_parallel_jax import keras_adapter_or_skip_report

        if not keras_adapter_or_skip_report(dst + ".rank0.json"):
            return
        rank = 0
        report["world"] = len(jax.devices())
    for suffix, dtype in DTYPES.items():
        if stage == "torch":
            model = db.compile(_spec(dtype), "torch", seed=SEED, parallel="auto")
        elif stage == "mlx":
            model = db.load(src + suffix, "mlx", parallel="auto", group=group)
            report["local_kernel_0" + suffix] = list(db.get_params(model, local=True)["0.kernel"].array.shape)
        else:
            from dense_bridge.backends.keras._parallel import shard_shapes

            model = db.load(src + suffix, "keras", parallel="auto")
            report["device_kernel_0" + suffix] = [list(s) for s in shard_shapes(model)["0.kernel"]]
        params = db.get_params(model)
        report["bit_exact" + suffix] = _same(params, _reference(dtype))
        report["dtypes" + suffix] = sorted({str(v.dtype) for v in params.values()})
        db.save(model, dst + suffix)
    if stage == "torch":
        dist.destroy_process_group()
    Path(dst + f".rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _stage(*sys.argv[1:4])
    sys.exit(0)


# ------------------------------------------------------------------ the test (pytest side)
import pytest  # noqa: E402


def _free_port(n: int = 1) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
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
    raise RuntimeError("no free port")


def _run(cmd: list[str], env: dict, timeout: float = 240) -> None:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent), TF_CPP_MIN_LOG_LEVEL="3", **env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _reports(dst: Path, n: int) -> list[dict]:
    missing = [r for r in range(n) if not Path(f"{dst}.rank{r}.json").exists()]
    assert not missing, f"{dst}: ranks {missing} wrote no report (a launcher may exit 0 when a rank fails)"
    return [json.loads(Path(f"{dst}.rank{r}.json").read_text()) for r in range(n)]


def test_torch4_to_mlx2_to_jax4_to_one_process_bit_exact(tmp_path):
    """The chain in float32 and in bfloat16 (each stage runs both)."""
    for m in ("torch.distributed", "mlx.core", "keras", "jax"):
        pytest.importorskip(m)
    import dense_bridge as db
    from dense_bridge.parallel._sharded_dir import read_index

    d1, d2, d3 = (str(tmp_path / n) for n in ("torch4", "mlx2", "jax4"))
    py = sys.executable
    _run([py, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
          "--master-port", str(_free_port()), str(HERE), "torch", "-", d1], {})
    _run([py, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
          "--backend", "ring", "-n", "2", "--starting-port", str(_free_port(2)), py, str(HERE), "mlx", d1, d2], {})
    _run([py, str(HERE), "jax", d2, d3], {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
                                          "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    reps = _reports(Path(d1), 4) + _reports(Path(d2), 2) + _reports(Path(d3), 1)
    if "skip" in reps[-1]:
        pytest.skip(f"the keras adapter does not run on KERAS_BACKEND=jax here: {reps[-1]['skip']}")
    assert [r["world"] for r in reps] == [4, 4, 4, 4, 2, 2, 4]
    for suffix, dtype in DTYPES.items():  # float32, and bfloat16 bit for bit through every engine
        assert all(r["bit_exact" + suffix] and r["dtypes" + suffix] == [dtype] for r in reps), (suffix, reps)
        assert all(r["local_kernel_0" + suffix] == [8, 8] for r in reps[4:6])  # 16 units over 2 MLX ranks
        assert reps[6]["device_kernel_0" + suffix] == [[8, 4]] * 4  # 16 units over 4 JAX devices
        # each index records the world size that wrote it, the slices of every tensor, the dtype
        dirs = [d + suffix for d in (d1, d2, d3)]
        assert [read_index(d)["world_size"] for d in dirs] == [4, 2, 1]
        assert [len(read_index(d)["tensors"]["0.kernel"]["shards"]) for d in dirs] == [4, 2, 1]
        assert {t["dtype"] for d in dirs for t in read_index(d)["tensors"].values()} == {dtype}
        spec, params = db.load(dirs[-1])
        assert spec == _spec(dtype)
        assert _same(params, _reference(dtype))
