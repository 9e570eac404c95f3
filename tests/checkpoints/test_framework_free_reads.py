"""Reading a checkpoint into numpy (``db.load(path)``, backend=None) imports no framework: a
canonical file, its sharded index, a params-only file and a canonical checkpoint keeping a
quantized layer's codes are read by the core alone, and a directory is recognised (or refused)
from the backends' manifests alone. Each read runs in a fresh interpreter that reports the
framework modules it imported."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import dense_bridge as db
from dense_bridge.checkpoints._canonical import metadata
from dense_bridge.checkpoints._canonical_write import write_canonical
from dense_bridge.checkpoints._safetensors import pending

FRAMEWORKS = {"torch", "tensorflow", "keras", "mlx", "mlx_lm", "h5py", "jax", "jaxlib", "flax", "equinox", "onnx",
              "onnxruntime", "transformers", "safetensors"}

READ = """
import json, sys
import numpy as np
import dense_bridge as db

for path in json.loads(sys.argv[1]):
    spec, params = db.load(path)
    print("read", path.rsplit("/", 1)[-1], spec is not None, sorted(params))
try:
    db.load(sys.argv[2])
except db.CheckpointError as exc:
    print("refused", "it is a directory" in str(exc))
print("imported", sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[3]))))
"""


def _quantized_canonical(path) -> None:
    """A canonical checkpoint keeping one quantized layer's codes (4-bit affine, one group)."""
    rng = np.random.default_rng(0)
    spec = db.Dense(3, in_features=8)
    tensors = {"qkernel": rng.integers(0, 16, (8, 3)).astype(np.uint8), "scale": np.ones((1, 3), np.float32),
               "offset": np.zeros((1, 3), np.float32), "bias": np.zeros(3, np.float32)}
    meta = metadata(spec, {k: pending(v) for k, v in tensors.items()}, "numpy")
    meta["quant"] = json.dumps({"": db.Quant(4, None, "affine").to_config()})
    write_canonical(str(path), {k: pending(v) for k, v in tensors.items()}, meta)


def test_reading_into_numpy_imports_no_framework(tmp_path):
    spec = db.Sequential([db.Dense(4, in_features=3, activation="relu"), db.Dense(2)])
    params = {"0.kernel": np.ones((3, 4), np.float32), "0.bias": np.zeros(4, np.float32),
              "1.kernel": np.ones((4, 2), np.float32), "1.bias": np.zeros(2, np.float32)}
    db.save((spec, params), tmp_path / "one.safetensors")
    db.save((spec, params), tmp_path / "sharded.safetensors", max_shard_size=40)
    db.save({"w": np.arange(6, dtype=np.float32)}, tmp_path / "params.safetensors")
    _quantized_canonical(tmp_path / "codes.safetensors")
    assert (tmp_path / "sharded.safetensors.index.json").exists()
    plain_dir = tmp_path / "model"  # a config and weights, but no format a manifest declares
    plain_dir.mkdir()
    (plain_dir / "config.json").write_text(json.dumps({"hidden_size": 4}))
    db.save({"w": np.zeros(2, np.float32)}, plain_dir / "model.safetensors")

    paths = [str(tmp_path / n) for n in ("one.safetensors", "sharded.safetensors.index.json", "params.safetensors",
                                         "codes.safetensors")]
    run = subprocess.run([sys.executable, "-c", READ, json.dumps(paths), str(plain_dir),
                          json.dumps(sorted(FRAMEWORKS))], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [
        "read one.safetensors True ['0.bias', '0.kernel', '1.bias', '1.kernel']",
        "read sharded.safetensors.index.json True ['0.bias', '0.kernel', '1.bias', '1.kernel']",
        "read params.safetensors False ['w']",
        "read codes.safetensors True ['bias', 'offset', 'qkernel', 'quant', 'scale']",
        "refused True",
        "imported []",
    ]
