"""Models on devices, proved on the CPU (issue 45).

- torch -> torch: a ``TorchFunctionMode`` and a ``TorchDispatchMode`` record every call and aten op
  of a transfer between two Llamas: no ``.numpy()``/``.cpu()``/``__array__``/``.tolist()``, one
  copy per written tensor straight from src's storage (all in one ``aten._foreach_copy_``, no undo
  snapshot), one reduction per tensor (their 2-norm, in one fused ``aten._foreach_norm``) and exactly one host synchronisation (``aten._local_scalar_dense``: the NaN/Inf
  verdict). The same recorders see the host path of ``get_params`` (a control: they can fail).
- torch -> Flax/Equinox and back: DLPack, under ``jax.transfer_guard("disallow")`` (no host
  <-> device transfer of JAX's) and the same torch recorders (no numpy conversion of a tensor).
- JAX with two host devices (a subprocess: ``XLA_FLAGS`` is read at import): models placed on
  device 1 stay there through every verb (``tests/core/_two_devices.py``).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: torch calls that bring a tensor's data to the host (a numpy view or copy, a Python list)
HOST_CALLS = {"numpy", "cpu", "__array__", "tolist", "item"}


class Calls(TorchFunctionMode):
    """Every torch function and Tensor method called, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class Ops(TorchDispatchMode):
    """Every aten op run, with the source storages of the copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.copy_sources: list[int] = []
        self.to_cpu = 0
        self.reduced = 0  # tensors reduced by aten._foreach_norm

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket).split(".")[-1]
        self.ops[name] += 1
        if name == "copy_":
            self.copy_sources.append(args[1].untyped_storage().data_ptr())
        if name == "_foreach_copy_":  # the plain in-place copies of a transfer, all in one call
            self.copy_sources += [t.untyped_storage().data_ptr() for t in args[1]]
        if name == "_foreach_norm":
            self.reduced += len(args[0])
        if name == "_to_copy" and str(kwargs.get("device", "")) == "cpu":
            self.to_cpu += 1
        return func(*args, **kwargs)


def _llamas(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(1)
    b = transformers.LlamaForCausalLM(cfg)
    return a, b


def test_torch_transfer_makes_no_host_round_trip_and_one_sync():
    a, b = _llamas()
    src_storages = {p.untyped_storage().data_ptr() for p in a.parameters()}
    n = len(list(b.parameters()))
    with Calls() as calls, Ops() as ops:
        report = db.transfer(a, b)
    assert not (HOST_CALLS & set(calls.names)), {k: calls.names[k] for k in HOST_CALLS & set(calls.names)}
    assert ops.ops["_local_scalar_dense"] == 1, ops.ops  # the NaN/Inf verdict, once for the whole model
    assert ops.to_cpu == 0
    # one reduction per tensor (their 2-norm, fused: one aten._foreach_norm of all of them; lm_head is
    # tied: not read twice), one test of the peaks
    assert ops.ops["_foreach_norm"] == 1 and ops.reduced == n and ops.ops["all"] == 1, (ops.reduced, ops.ops)
    # every write is one copy straight from src's storage, all in one call, and no undo snapshot
    # (clone) of dst: each is an in-place copy that cannot fail once the checks passed
    writes = [s for s in ops.copy_sources if s in src_storages]
    assert len(writes) == n and ops.ops["_foreach_copy_"] == 1, (len(writes), n, ops.ops)
    assert ops.ops["clone"] == 0 and ops.ops["copy_"] == 0, ops.ops
    assert report.not_moved_dst == []
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k


def test_recorders_see_the_host_path():
    """The control: reading params as host numpy is visible to the same recorders."""
    a, _ = _llamas(1)
    with Calls() as calls:
        db.get_params(a.model.layers[0].mlp.up_proj)
    assert calls.names["numpy"] >= 1


def test_torch_nonfinite_found_on_the_device_and_nothing_written():
    a, b = _llamas(1)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with torch.no_grad():
        a.model.layers[0].self_attn.q_proj.weight[1, 2] = float("nan")
        a.model.norm.weight[0] = float("inf")
    with Ops() as ops, pytest.raises(db.ConversionError) as err:
        db.transfer(a, b)
    assert "q_proj" in str(err.value) and "'model.norm.weight' holds NaN or Inf" in str(err.value)
    assert ops.ops["_local_scalar_dense"] == 1  # one sync found both; naming them costs one copy of the flags
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k


def _torch_chain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))


@pytest.mark.parametrize("target", ["flax", "equinox"])
def test_torch_to_jax_through_dlpack(target):
    pytest.importorskip("jax")
    if target not in db.available_backends():
        pytest.skip(f"{target} is not installed")
    import jax

    src = _torch_chain()
    dst = db.convert(src, target)
    with torch.no_grad():
        for p in src.parameters():
            p.mul_(-1.5)  # new values, to see them arrive
    want = {k: np.array(v) for k, v in db.get_params(src).items()}
    with Calls() as calls, jax.transfer_guard("disallow"):
        db.transfer(src, dst)
    assert not (HOST_CALLS & set(calls.names)), calls.names
    got = db.get_params(dst)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # dst owns its arrays: changing src afterwards changes nothing in dst
    with torch.no_grad():
        src[0].weight.zero_()
    np.testing.assert_array_equal(db.get_params(dst)["0.kernel"], want["0.kernel"])
    # and back: JAX -> torch through DLPack, copy_ on the device
    back = _torch_chain()
    with Calls() as calls, jax.transfer_guard("disallow"):
        db.transfer(dst, back)
    assert not (HOST_CALLS & set(calls.names)), calls.names
    for k, v in db.get_params(back).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)


def test_device_argument_rejected_naming_it():
    from dense_bridge.registry._backends import get_adapter

    torch_adapter = get_adapter("torch")
    with pytest.raises(db.SpecError, match="device='tpu:3'"):
        torch_adapter.parse_device("tpu:3")
    with pytest.raises(TypeError, match="device=3"):
        torch_adapter.parse_device(3)
    assert torch_adapter.parse_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(db.SpecError, match="CUDA device"):
            torch_adapter.parse_device("gpu:0")


def test_jax_models_on_a_second_device_stay_there():
    """tests/core/_two_devices.py with two JAX host devices: compile(device=), compare,
    compare_models (inputs placed on device 1: a device-to-device move would raise), transfer
    (from device 0, from torch, mapping="auto") and convert keep models on device 1, with the same
    values as on device 0."""
    pytest.importorskip("jax")
    if not {"flax", "equinox"} & set(db.available_backends()):
        pytest.skip("neither Flax nor Equinox is installed")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).with_name("_two_devices.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr[-4000:]
    assert "transfer into a model on device 1 keeps it there" in done.stdout


SPEC = db.Sequential([db.Dense(5, in_features=6, activation="tanh"), db.Dense(4)])


def test_device_on_compile_convert_and_load(tmp_path):
    m = db.compile(SPEC, "torch", seed=0, device="cpu")
    assert all(p.device.type == "cpu" for p in m.parameters())
    np.testing.assert_array_equal(db.get_params(m)["0.kernel"], db.get_params(db.compile(SPEC, "numpy", seed=0))["0.kernel"])
    for bad, error, match in (("tpu", db.SpecError, "device='tpu'"), (3, TypeError, "device=3"),
                              ("cuda:x", db.SpecError, "device='cuda:x'")):
        with pytest.raises(error, match=match):
            db.compile(SPEC, "torch", seed=0, device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(db.SpecError, match="CUDA device this machine does not have.*device='cuda'"):
            db.compile(SPEC, "torch", seed=0, device="cuda")
        with pytest.raises(db.SpecError, match="device='gpu:0'"):
            db.convert(m, "torch", device="gpu:0")
    if "mlx" in db.available_backends():  # a backend without the devices capability names itself
        with pytest.raises(db.SpecError, match="'mlx' does not"):
            db.compile(SPEC, "mlx", seed=0, device="cpu")
    db.save(m, tmp_path / "m.safetensors")
    loaded = db.load(tmp_path / "m.safetensors", "torch", device=torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    with pytest.raises(db.SpecError, match="needs a backend"):
        db.load(tmp_path / "m.safetensors", device="cpu")
    with pytest.raises(db.SpecError, match="device='tpu'"):
        db.load(tmp_path / "m.safetensors", "torch", device="tpu")
    if "flax" in db.available_backends():
        from dense_bridge.registry._backends import get_adapter

        out = db.convert(m, "flax")  # default: the source's device (host memory: JAX's CPU device)
        assert get_adapter("flax").device_of(out) == "cpu:0"


def test_port_refuses_a_bad_device_before_reading_anything(tmp_path):
    with pytest.raises(db.SpecError, match="device='tpu:0'"):
        db.port(tmp_path / "nowhere", tmp_path / "out", to="mlx-lm", device="tpu:0")
    assert not (tmp_path / "out").exists()


def test_port_verifies_its_twins_on_the_device_given(tmp_path):
    """device= reaches the port's verification: the torch twin placed on it (the CPU here; CUDA in
    tests/gpu), a twin whose framework places nothing (MLX) left where its framework puts it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("mlx_lm")
    sys.path.insert(0, str(Path(__file__).parents[1] / "ports"))
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from _models import save

    save(transformers, "llama", tmp_path / "src")
    report = db.port(tmp_path / "src", tmp_path / "out", to="mlx-lm", verify="twins", device="cpu")
    assert report.verification["passed"]
    with pytest.raises(db.SpecError, match="device='cuda:7'"):
        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has 8 CUDA devices")
        db.port(tmp_path / "src", tmp_path / "out2", to="mlx-lm", verify="twins", device="cuda:7")
    assert not (tmp_path / "out2").exists()


def _received(model) -> tuple[list, list]:
    """Hooks recording the (device type, dtype) of every tensor each module of ``model`` receives."""
    seen: list = []

    def hook(module, args, kwargs):
        seen.extend((t.device.type, t.dtype) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
    return seen, [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]


def test_torch_inputs_made_on_the_models_device_in_its_dtype():
    """torch on a CPU-only machine has one real device, so where the inputs go is proved on the
    placement functions themselves (the capture's and the trace's), with ``torch.device`` objects:
    the model's device read from its parameters ("meta" here: any device but the CPU would do)
    and every input made there, floats in the model's dtype, token ids kept integers. The verbs
    then run bfloat16 models: every layer receives bfloat16 (token ids stay integers)."""
    from dense_bridge.backends.torch import _capture

    layer = torch.nn.Linear(3, 2, device="meta", dtype=torch.bfloat16)
    device = _capture._device(layer)
    assert device == torch.device("meta") and _capture._float_dtype(layer) == torch.bfloat16
    x = _capture._to_torch(np.ones((2, 3), np.float64), _capture._float_dtype(layer), device)
    ids = _capture._to_torch(np.arange(6).reshape(2, 3), torch.bfloat16, device)
    assert (x.device, x.dtype) == (device, torch.bfloat16) and (ids.device, ids.dtype) == (device, torch.int64)

    a, _ = _llamas(1)
    a = a.to(torch.bfloat16)
    b = copy.deepcopy(a)
    ids = np.random.default_rng(0).integers(0, 64, (2, 8))
    seen, handles = _received(a)
    assert db.testing.compare_models(a, b, [ids]).passed
    for h in handles:
        h.remove()
    assert ("cpu", torch.int64) in seen and ("cpu", torch.bfloat16) in seen
    m = db.compile(SPEC, "torch", seed=0).to(torch.bfloat16)
    seen, handles = _received(m)
    db.testing.compare(m, db.compile(SPEC, "torch", seed=0).to(torch.bfloat16), inputs=np.ones((2, 6), np.float32))
    for h in handles:
        h.remove()
    assert seen and set(seen) == {("cpu", torch.bfloat16)}, seen  # float32 inputs cast to the model's dtype


@pytest.mark.parametrize("target", ["torch", "flax", "equinox"])
def test_set_params_takes_torch_tensors_without_a_host_round_trip(target):
    """``set_params`` of torch tensors (a model's own ``device_params``) into a model of a
    framework that places models: checked where they live (one reduction each, one host
    synchronisation), never converted to numpy; NaN found there, named, nothing written."""
    if target not in db.available_backends():
        pytest.skip(f"{target} is not installed")
    from dense_bridge.registry._backends import get_adapter

    src = _torch_chain()
    dst = db.compile(db.to_spec(src), target, seed=5)
    tensors = get_adapter("torch").device_params(src)
    with Calls() as calls:
        db.set_params(dst, tensors)
    assert not (HOST_CALLS & set(calls.names)), calls.names
    for k, v in db.get_params(src).items():
        np.testing.assert_array_equal(db.get_params(dst)[k], v, err_msg=k)
    before = db.get_params(dst)
    bad = {k: v.clone() for k, v in tensors.items()}
    bad["2.kernel"][0, 1] = float("nan")
    with pytest.raises(db.ConversionError, match=r"2\.kernel: 1 NaN or Inf"):
        db.set_params(dst, bad)
    for k, v in before.items():
        np.testing.assert_array_equal(db.get_params(dst)[k], v, err_msg=k)
    with pytest.raises(db.ConversionError, match=r"expected shape \(5, 4\) for parameter 2.kernel"):
        db.set_params(dst, {**tensors, "2.kernel": tensors["2.kernel"][:, :3]})


def test_set_params_casts_a_narrowing_device_array_on_the_host_path():
    """A float32 tensor into a float16 layer may overflow: it is checked after the cast (the
    host path), so a value beyond float16's range is refused as Inf, naming the cast."""
    spec = db.Dense(3, in_features=2, dtype="float16")
    dst = db.compile(spec, "torch", seed=0)
    big = torch.full((2, 3), 1e6)
    with pytest.raises(db.ConversionError, match="after casting to float16"):
        db.set_params(dst, {"kernel": big, "bias": torch.zeros(3)})


def test_set_params_names_a_tensor_without_data():
    """A meta tensor (no data) cannot be checked where it lives: refused naming its key, nothing written."""
    m = db.compile(db.Dense(3, in_features=2), "torch", seed=0)
    before = db.get_params(m)
    with pytest.raises(db.ConversionError, match=r"kernel: cannot be read where it lives") as info:
        db.set_params(m, {"kernel": torch.empty(2, 3, device="meta"), "bias": torch.zeros(3)})
    assert "bias" not in str(info.value)
    np.testing.assert_array_equal(db.get_params(m)["kernel"], before["kernel"])


@pytest.mark.parametrize("source", ["flax", "equinox"])
def test_set_params_takes_jax_arrays_into_torch_without_a_host_round_trip(source):
    """JAX arrays (a Flax/Equinox model's own ``device_params``) into a torch model: checked by JAX
    where they live and imported by DLPack; never read into numpy (the validation's reading of a
    foreign array raises inside: JAX's transfer guard does not see a CPU array read in place)."""
    pytest.importorskip("jax")
    if source not in db.available_backends():
        pytest.skip(f"{source} is not installed")
    from dense_bridge.registry._backends import get_adapter

    spec = db.to_spec(_torch_chain())
    src = db.compile(spec, source, seed=4)
    dst = _torch_chain()
    arrays = get_adapter(source).device_params(src)

    from dense_bridge.params import _source

    def refuse(value):
        raise AssertionError(f"a {type(value).__name__} read into numpy")
    saved = _source.array_to_numpy
    _source.array_to_numpy = refuse
    try:
        db.set_params(dst, arrays)
    finally:
        _source.array_to_numpy = saved
    for k, v in db.get_params(src).items():
        np.testing.assert_array_equal(db.get_params(dst)[k], v, err_msg=k)
