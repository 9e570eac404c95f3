"""Every verb on CUDA models (issue 45): runs only where torch sees a CUDA device, skipped cleanly
elsewhere. float32 and bfloat16; CUDA against CUDA, CUDA against CPU, torch CUDA against JAX on
the same GPU (when JAX sees one, else its default device)."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA verbs are not tested here", allow_module_level=True)

import dense_bridge as db  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

transformers = pytest.importorskip("transformers")
HOST_CALLS = {"numpy", "cpu", "__array__", "tolist", "item"}
CUDA = torch.device("cuda", torch.cuda.current_device())


class Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket).split(".")[-1]
        self.ops[name] += 1
        if name in ("_to_copy", "copy_"):  # a copy whose source is on the GPU and whose result is not
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else torch.device(kwargs.get("device") or src.device)
            self.to_host += int(src.device.type == "cuda" and dst.type == "cpu")
        return func(*args, **kwargs)


def llama(seed: int, dtype=torch.float32, device=CUDA, layers: int = 2):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


IDS = np.random.default_rng(0).integers(0, 128, (2, 16))
SPEC = db.Sequential([db.Dense(32, in_features=16, activation="gelu"), db.Dense(8)])
X = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compile_and_compare_on_cuda(dtype):
    spec = SPEC if dtype == "float32" else db.Sequential([db.Dense(32, in_features=16, activation="gelu",
                                                                     dtype="bfloat16"),
                                                            db.Dense(8, dtype="bfloat16")])
    m = db.compile(spec, "torch", seed=0, device="cuda")
    assert all(p.device.type == "cuda" for p in m.parameters())
    ref = db.compile(spec, "numpy", seed=0)
    report = db.testing.compare(m, ref, inputs=X)
    assert report.passed, report
    params = db.get_params(m)  # host numpy, the canonical hub
    assert all(isinstance(v, np.ndarray) for v in params.values())
    np.testing.assert_array_equal(params["0.kernel"], db.get_params(ref)["0.kernel"])
    params["0.kernel"][0, 0] += 1  # the caller's own host copy (made once): the model does not change
    np.testing.assert_array_equal(db.get_params(m)["0.kernel"], db.get_params(ref)["0.kernel"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compare_models_cuda_pair_and_cuda_against_cpu(dtype):
    a = llama(0, dtype)
    b = llama(0, dtype)
    assert db.testing.compare_models(a, b, [IDS]).passed
    assert db.testing.compare_models(a, b, [IDS], grads=False).passed
    if dtype == torch.float32:  # bfloat16 kernels of the CPU and the GPU round differently
        c = llama(0, dtype, device="cpu")
        assert db.testing.compare_models(a, c, [IDS]).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transfer_between_cuda_llamas_stays_on_the_device(dtype):
    a, b = llama(0, dtype), llama(1, dtype)
    with Calls() as calls, Ops() as ops:
        db.transfer(a, b)
    assert not (HOST_CALLS & set(calls.names)), calls.names
    assert ops.to_host == 0 and ops.ops["_local_scalar_dense"] == 1, ops.ops
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert y.device.type == "cuda" and torch.equal(x, y), k


def test_transfer_cuda_to_cpu_and_back_and_auto():
    a, cpu = llama(0), llama(1, device="cpu")
    db.transfer(a, cpu)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(a.state_dict().values(), cpu.state_dict().values()))
    b = llama(2)
    db.transfer(cpu, b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = llama(3)
    report = db.transfer(a, c, mapping="auto", inputs=[IDS])
    assert "verified" in report.verification
    assert all(p.device.type == "cuda" for p in c.parameters())


def test_transfer_finds_nonfinite_on_the_device():
    a, b = llama(0), llama(1)
    with torch.no_grad():
        a.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(db.ConversionError, match="down_proj"):
        db.transfer(a, b)


@pytest.mark.parametrize("target", ["flax", "equinox"])
def test_convert_and_transfer_cuda_torch_with_jax(target):
    pytest.importorskip("jax")
    if target not in db.available_backends():
        pytest.skip(f"{target} is not installed")
    import jax

    m = db.compile(SPEC, "torch", seed=0, device="cuda")
    with Ops() as ops:
        out = db.convert(m, target)  # default: the source's GPU when JAX has one, through DLPack
    from dense_bridge.registry._backends import get_adapter

    where = get_adapter(target).device_of(out)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    assert where.startswith("cuda") if gpus else where.startswith("cpu"), where
    assert ops.to_host == 0 if gpus else True, ops.ops
    for k, v in db.get_params(m).items():
        np.testing.assert_array_equal(db.get_params(out)[k], v, err_msg=k)
    back = db.convert(out, "torch", device="cuda:0")
    assert all(p.device.type == "cuda" for p in back.parameters())
    fresh = db.compile(SPEC, target, seed=3, **({"device": "cuda"} if gpus else {}))
    db.transfer(m, fresh)  # DLPack from torch CUDA
    for k, v in db.get_params(m).items():
        np.testing.assert_array_equal(db.get_params(fresh)[k], v, err_msg=k)


def test_load_onto_cuda(tmp_path):
    m = db.compile(SPEC, "torch", seed=0)
    db.save(m, tmp_path / "m.safetensors")
    loaded = db.load(tmp_path / "m.safetensors", "torch", device="cuda")
    assert all(p.device.type == "cuda" for p in loaded.parameters())
    with pytest.raises(db.SpecError, match="device='cuda:99'"):
        db.load(tmp_path / "m.safetensors", "torch", device="cuda:99")


def test_port_verifies_on_cuda(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "ports"))
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from _models import save

    pytest.importorskip("mlx_lm")
    save(transformers, "llama", tmp_path / "src")
    report = db.port(tmp_path / "src", tmp_path / "out", to="mlx-lm", verify="twins", device="cuda")
    assert report.verification["passed"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compare_models_cuda_llama_against_its_cpu_twin_one_grad_mode(dtype):
    """compare_models in both modes (grads and outputs only) with each side's inputs on its own device."""
    a = llama(0, dtype)
    c = llama(0, torch.float32, device="cpu")
    report = db.testing.compare_models(a, c, [IDS], grads=False)
    assert report.passed if dtype == torch.float32 else report.compared, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transfer_auto_between_cuda_llamas(dtype):
    a, b = llama(0, dtype), llama(1, dtype)
    report = db.transfer(a, b, mapping="auto", inputs=[IDS])
    assert "verified" in report.verification
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert y.device.type == "cuda" and torch.equal(x, y), k


@pytest.mark.parametrize("target", ["flax", "equinox"])
def test_compare_cuda_torch_against_jax(target):
    pytest.importorskip("jax")
    if target not in db.available_backends():
        pytest.skip(f"{target} is not installed")
    m = db.compile(SPEC, "torch", seed=0, device="cuda")
    out = db.convert(m, target)  # on JAX's GPU when it has one, else its CPU
    for report in (db.testing.compare(m, out, inputs=X), db.testing.compare_models(m, out, [X]),
                   db.testing.compare_models(out, m, [X], grads=False)):
        assert report.passed, str(report)


def test_get_params_of_a_cuda_bfloat16_model():
    m = llama(0, torch.bfloat16)
    params = db.get_params(m.model.layers[0].mlp.up_proj)
    assert params["kernel"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(params["kernel"].view(np.uint16),
                                  m.model.layers[0].mlp.up_proj.weight.t().contiguous().cpu().view(torch.int16)
                                  .numpy().view(np.uint16))


def test_check_and_port_device_options_on_cuda(tmp_path):
    """``dense-bridge check --device cuda`` on two model directories, and the default (the GPU)."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).parents[1] / "ports"))
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from _models import save

    from dense_bridge import ports

    save(transformers, "llama", tmp_path / "a", seed=0)
    save(transformers, "llama", tmp_path / "b", seed=0)
    for device in ("cuda", None):
        report, info = ports.check_dirs(tmp_path / "a", tmp_path / "b", positions=32, device=device)
        assert report.passed and info["devices"]["a"].startswith("cuda"), info
    run = subprocess.run([sys.executable, "-m", "dense_bridge.cli", "check", str(tmp_path / "a"), str(tmp_path / "b"),
                          "--positions", "32", "--device", "cuda:0"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "on cuda:0 and cuda:0" in run.stdout, run.stdout + run.stderr
    pytest.importorskip("mlx_lm")
    report = db.port(tmp_path / "a", tmp_path / "out", to="mlx-lm", verify="full")  # twins on the GPU by default
    assert report.verification["passed"] and report.verification["twins"]["devices"]["a"].startswith("cuda")
