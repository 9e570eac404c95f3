"""``--device`` of ``dense-bridge check`` and ``dense-bridge port`` (issue 45), as a user runs them.

On this CPU-only machine: the CPU accepted (the models run there and the output says so), a name
no framework reads and a CUDA device this machine does not have refused with exit 2, naming the
argument and echoing the value, with nothing written. The CUDA runs are in tests/gpu."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dense_bridge as db
from dense_bridge import ports

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "ports"))
sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from test_cli import ENV  # noqa: E402


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dense_bridge.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=Path(__file__).parents[2])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from _models import save

    root = tmp_path_factory.mktemp("dirs")
    save(transformers, "llama", root / "a", seed=0)
    save(transformers, "llama", root / "b", seed=0)
    return root


def test_check_two_model_dirs_on_the_device_named(dirs):
    run = cli("check", dirs / "a", dirs / "b", "--positions", 16, "--device", "cpu")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on cpu and cpu" in run.stdout, run.stdout
    report, info = ports.check_dirs(dirs / "a", dirs / "b", positions=16, device="cpu")
    assert report.passed and info["devices"] == {"a": "cpu", "b": "cpu"}
    # default: each model on its framework's GPU when it sees one, else the CPU
    report, info = ports.check_dirs(dirs / "a", dirs / "b", positions=16)
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert report.passed and info["devices"]["a"].startswith(want.partition(":")[0]), info


@pytest.mark.parametrize("value, needle", [("tpu", "device='tpu'"), ("cuda:x", "device='cuda:x'")])
def test_check_refuses_a_device_name_naming_the_option(dirs, value, needle):
    run = cli("check", dirs / "a", dirs / "b", "--positions", 16, "--device", value)
    assert run.returncode == 2 and needle in run.stderr, (run.returncode, run.stderr)


def test_check_refuses_a_cuda_device_this_machine_lacks(dirs):
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    run = cli("check", dirs / "a", dirs / "b", "--positions", 16, "--device", missing)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert f"'{missing}'" in run.stderr and "CUDA device this machine does not have" in run.stderr, run.stderr


def test_check_of_checkpoints_refuses_device(tmp_path):
    spec = db.Sequential([db.Dense(8, in_features=4, activation="tanh"), db.Dense(3)])
    db.save(db.compile(spec, "torch", seed=0), tmp_path / "a.safetensors")
    db.save(db.compile(spec, "torch", seed=0), tmp_path / "b.safetensors")
    # checkpoints are compared layer by layer where their frameworks load them: --device is refused, named
    run = cli("check", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--backend-a", "torch",
              "--backend-b", "numpy", "--device", "cpu")
    assert run.returncode == 2 and "--device='cpu'" in run.stderr and "two model directories" in run.stderr, run.stderr


def test_port_device_option(dirs, tmp_path):
    pytest.importorskip("mlx_lm")
    run = cli("port", dirs / "a", "--to", "mlx-lm", "-o", tmp_path / "bad", "--verify", "twins", "--device", "tpu:0")
    assert run.returncode == 2 and "device='tpu:0'" in run.stderr, run.stderr
    assert not (tmp_path / "bad").exists()
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    run = cli("port", dirs / "a", "--to", "mlx-lm", "-o", tmp_path / "bad", "--verify", "twins", "--device", missing)
    assert run.returncode == 2 and f"'{missing}'" in run.stderr, run.stderr
    assert not (tmp_path / "bad").exists()
    report = db.port(dirs / "a", tmp_path / "out", to="mlx-lm", verify="twins", device="cpu")
    # the torch twin ran on the CPU named; MLX places nothing (no devices capability): None
    assert report.verification["passed"] and report.verification["devices"] == {"a": "cpu", "b": None}
