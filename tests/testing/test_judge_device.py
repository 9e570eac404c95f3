"""compare_models judges torch captures in torch (``array_namespace``), float64 where they live.

Held against the reference path (``_namespace.host_only``: captures read as numpy, judged with
numpy) on the same comparisons, row by row and number by number: a Llama pair that agrees, one
with a perturbed layer (must fail at the same row), in float32 and bfloat16, float32 against
bfloat16. Then the proof that nothing whole reaches numpy while capturing and judging: every
host reading of a tensor larger than a few scalars raises there, and the verdict is the same.
CUDA: the same equality on a CUDA pair and a CUDA-vs-CPU pair (skipped without CUDA).
"""
from __future__ import annotations

import contextlib
import importlib
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dense_bridge as db  # noqa: E402
from dense_bridge.testing import _namespace  # noqa: E402

cm_module = importlib.import_module("dense_bridge.testing.compare_models")  # the module, not the verb

REL = 1e-12


def _llama(seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval().to(dtype)


def _pair(dtype_a=torch.float32, dtype_b=torch.float32, perturb: str | None = None):
    """(a, b): the same Llama, ``perturb``'s weight in a scaled by 1.01 (1.5 in bfloat16, whose
    allowances are 256 times wider)."""
    a, b = _llama(0, dtype_a), _llama(1, dtype_b)
    b.load_state_dict({k: v.to(dtype_b) for k, v in a.state_dict().items()})
    if perturb is not None:
        with torch.no_grad():
            a.get_submodule(perturb).weight.mul_(1.5 if dtype_a == torch.bfloat16 else 1.01)
    return a, b


IDS = [np.random.default_rng(0).integers(0, 97, (2, 12))]


@contextlib.contextmanager
def _chosen():
    """Records the namespace each comparison is judged in."""
    seen = []
    original = _namespace.choose

    def spy(*args, **kwargs):
        got = original(*args, **kwargs)
        seen.append(got[0].name)
        return got
    _namespace.choose = spy
    try:
        yield seen
    finally:
        _namespace.choose = original


def _close(x, y) -> bool:
    if isinstance(x, float) or isinstance(y, float):
        if x is None or y is None:
            return x is y
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        if math.isinf(x) or math.isinf(y):
            return x == y
        return abs(x - y) <= REL * max(abs(x), abs(y)) or x == y
    return x == y


#: in tolerance units: where what is judged is a difference left after a float64 cancellation (a
#: kernel's gradient minus x^T dL/dz, which another BLAS sums in another order), float64 rounding
#: moves it by eps64 x the terms' size, ~1e-16 / eps32 ~ 1e-9 units, not 1e-12 of what is left
UNITS = 1e-9


def _within_units(key: str, x: dict, y: dict) -> bool:
    """The max error and units of a row agree to :data:`UNITS` tolerance units."""
    if key == "units":
        return abs(x["units"] - y["units"]) <= UNITS
    if key == "err" and x["units"] > 0 and math.isfinite(x["units"]):
        return abs(x["err"] - y["err"]) <= UNITS * x["err"] / x["units"]  # err / units: the allowance there
    return False


def _fields(q) -> dict:
    d = {"layer": q.layer, "label": q.layer_type, "quantity": q.quantity, "err": q.max_abs_error,
         "units": q.units, "passed": q.passed, "k": q.fan_in, "shape": tuple(q.shape), "note": q.note}
    if q.stats is not None:
        d.update({f"stats.{k}": (v if not isinstance(v, list) else tuple(v)) for k, v in vars(q.stats).items()})
    else:
        d["stats"] = None
    return d


def assert_same_reports(ra, rb) -> None:
    """Every row of the two reports equal: strings, counts, ULPs, worst elements and verdicts
    exactly, numbers to 1e-12 relative (max error and units: or to :data:`UNITS` units)."""
    rows_a = [_fields(q) for layer in ra.layers for q in layer.quantities]
    rows_b = [_fields(q) for layer in rb.layers for q in layer.quantities]
    assert len(rows_a) == len(rows_b) and rows_a, (len(rows_a), len(rows_b))
    for x, y in zip(rows_a, rows_b):
        assert x.keys() == y.keys(), (x, y)
        bad = {k: (x[k], y[k]) for k in x if not _close(x[k], y[k]) and not _within_units(k, x, y)}
        assert not bad, (x["label"], x["quantity"], bad)
    assert ra.passed == rb.passed and ra.first_divergence == rb.first_divergence
    assert ra.notes == rb.notes


def _both(a, b, **kw):
    with _chosen() as seen:
        with _namespace.host_only():
            ref = db.testing.compare_models(a, b, IDS, **kw)
        got = db.testing.compare_models(a, b, IDS, **kw)
    assert seen == ["numpy", "torch"], seen
    return ref, got


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16)], ids=["f32", "bf16", "f32-bf16"])
def test_agreeing_pair_same_report(dtypes):
    ref, got = _both(*_pair(*dtypes))
    assert ref.passed, ref.verdict()
    assert_same_reports(ref, got)
    assert any(q.stats is not None and q.stats.n_total for layer in got.layers for q in layer.quantities)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_perturbed_layer_fails_at_same_row(dtype):
    ref, got = _both(*_pair(dtype, dtype, perturb="model.layers.1.mlp.down_proj"))
    assert not ref.passed
    assert ref.first_divergence == "model.layers.1.mlp.down_proj", ref.verdict()
    assert_same_reports(ref, got)
    f = got.first_failure
    assert f.quantity == "output" and f.stats is not None and f.stats.n_out > 0 and f.stats.worst_index is not None


def test_carried_judge_same_report():
    a, b = _pair(perturb="model.layers.0.self_attn.o_proj")
    ref, got = _both(a, b, grads=False, judge="carried")
    assert not ref.passed
    assert_same_reports(ref, got)


@pytest.mark.parametrize("pair", [("torch", "keras"), ("numpy", "torch"), ("torch", "mlx")])
def test_mixed_frameworks_same_report(pair):
    """A torch model against one whose captures are numpy (judged in torch, the other side's
    arrays brought there once per quantity), with activations inside the layers (computed on the
    host from the namespace's arrays): the same report as the host path, faults included."""
    from _mlp_pairs import activated_mlp_pair

    a, b, x = activated_mlp_pair(pair)
    for broken in (False, True):
        if broken:
            layer = list(db.linear_layers(b).values())[1]
            params = db.get_params(layer)
            db.set_params(layer, {**params, "bias": params["bias"] + 0.01})
        with _chosen() as seen:
            with _namespace.host_only():
                ref = db.testing.compare_models(a, b, x)
            got = db.testing.compare_models(a, b, x)
        assert seen == ["numpy", "torch"] and ref.passed != broken, (seen, str(ref))
        assert_same_reports(ref, got)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
def test_lora_pair_same_report():
    """peft LoRA layers: judged through their effective kernel, each side's adapter rounding
    computed on the host; their parameter gradients are read as numpy (not plain nn.Linear)."""
    peft = pytest.importorskip("peft")
    import copy

    wrapped = peft.get_peft_model(_llama(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              init_lora_weights=False))
    a = wrapped.get_base_model().eval()  # the transformers model with PEFT's layers injected
    b = copy.deepcopy(a)
    ref, got = _both(a, b)
    assert ref.passed, str(ref)
    assert_same_reports(ref, got)


def _awkward(rng, n: int, dtype: str) -> np.ndarray:
    """Values that test every branch of the element statistics: +-0, NaN, +-Inf, tiny, huge, repeats."""
    span = 3 if dtype == "float16" else 8  # within the dtype's range (numpy warns on an overflowing cast)
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-span, span, n)
    special = [0.0, -0.0, np.nan, np.inf, -np.inf, {"float64": 1e-310, "float16": 1e-7}.get(dtype, 1e-40), -1.0, 1.0]
    x[rng.integers(0, n, n // 4)] = rng.choice(special, n // 4)
    return x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_element_stats_same_in_torch(dtype):
    """Element statistics (ULPs in every dtype, NaN/Inf bookkeeping, the worst element, the
    histogram) and units are the same computed by numpy and by torch, element for element."""
    from dense_bridge.backends.torch._namespace import TorchNamespace
    from dense_bridge.testing._elements import element_stats, elementwise_units, ulp_distance

    tx = TorchNamespace(torch.device("cpu"))
    rng = np.random.default_rng(3)
    for trial in range(6):
        a = _awkward(rng, 301, dtype)
        b = a.copy() if trial == 0 else (_awkward(rng, 301, dtype) if trial == 1 else
                                          a * (1 + rng.standard_normal(301) * 1e-3))
        if trial == 2:
            b[:] = np.nan  # nothing comparable: max and median ULP infinite
        allowed = np.abs(b) * 1e-3 if trial != 3 else 0.0  # 0: every difference is inf units
        d_np, u_np = elementwise_units(a, b, allowed)
        d_t, u_t = elementwise_units(a, b, allowed, tx)
        np.testing.assert_array_equal(d_t.numpy(), d_np)
        np.testing.assert_array_equal(u_t.numpy(), u_np)
        np.testing.assert_array_equal(ulp_distance(a, b, dtype, tx).numpy(), ulp_distance(a, b, dtype))
        shaped = (a.reshape(7, 43), b.reshape(7, 43), u_np.reshape(7, 43))
        ref = element_stats(*shaped, dtype)
        got = element_stats(*(torch.from_numpy(v) for v in shaped), dtype, tx)
        assert vars(got) == vars(ref) or all(_close(x, y) for x, y in zip(vars(got).values(), vars(ref).values())), \
            (vars(got), vars(ref))


#: tensors up to this many elements may reach the host (the stacked scalars of one row)
SMALL = 64


@contextlib.contextmanager
def _no_whole_tensor_on_host():
    """Every way a torch tensor's values reach numpy or Python (``numpy()``, so ``np.asarray`` and
    ``__array__`` too, ``tolist``, ``cpu()`` of a device tensor) raises for a tensor of more than
    SMALL elements."""
    saved = {name: getattr(torch.Tensor, name) for name in ("numpy", "tolist", "cpu", "__array__")}

    def guard(name):
        original = saved[name]

        def method(self, *args, **kwargs):
            if self.numel() > SMALL:
                raise AssertionError(f"a tensor of {tuple(self.shape)} read on the host ({name}) while judging")
            return original(self, *args, **kwargs)
        return method
    for name in saved:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def _guard(monkeypatch) -> None:
    """From here on, capturing and judging (everything after the parameters are read) run under
    :func:`_no_whole_tensor_on_host`."""
    from dense_bridge.testing import _comparison

    capture, judge = _comparison.Comparison.capture, cm_module.judge_rows

    def guarded_capture(self, *args, **kwargs):
        with _no_whole_tensor_on_host():
            return capture(self, *args, **kwargs)

    def guarded_judge(*args, **kwargs):
        with _no_whole_tensor_on_host():
            return judge(*args, **kwargs)
    monkeypatch.setattr(_comparison.Comparison, "capture", guarded_capture)
    monkeypatch.setattr(cm_module, "judge_rows", guarded_judge)


@pytest.fixture
def guarded_judging(monkeypatch):
    _guard(monkeypatch)


class _TwoInputs(torch.nn.Module):
    """A Bilinear (two inputs: judged as values) between two Linears."""

    def __init__(self):
        super().__init__()
        self.inp, self.bil, self.out = torch.nn.Linear(6, 5), torch.nn.Bilinear(5, 5, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(torch.tanh(self.bil(h, h)))


def test_two_input_layer_judged_as_values_on_the_device(monkeypatch):
    """A layer of two inputs is compared as values, and its parameter gradients (read by
    ``device_params``) stay tensors: nothing whole reaches the host."""
    torch.manual_seed(0)
    a = _TwoInputs()
    b = _TwoInputs()
    b.load_state_dict(a.state_dict())
    x = [np.random.default_rng(0).standard_normal((4, 6))]
    with _namespace.host_only():
        ref = db.testing.compare_models(a, b, x)
    _guard(monkeypatch)
    with _chosen() as seen:
        got = db.testing.compare_models(a, b, x)
    assert seen == ["torch"] and ref.passed
    assert any(q.note.startswith("not a one-input linear map") for layer in got.layers for q in layer.quantities)
    assert_same_reports(ref, got)


def test_guard_catches_host_path(guarded_judging):
    """The guard is not vacuous: the host path reads whole tensors and fails under it."""
    a, b = _pair()
    with _namespace.host_only(), pytest.raises(AssertionError, match="read on the host"):
        db.testing.compare_models(a, b, IDS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_judged_without_whole_tensors_on_host(dtype, monkeypatch):
    a, b = _pair(dtype, dtype, perturb="model.layers.0.mlp.up_proj")
    with _namespace.host_only():
        ref = db.testing.compare_models(a, b, IDS)
    _guard(monkeypatch)
    got = db.testing.compare_models(a, b, IDS)
    assert got.first_divergence == ref.first_divergence == "model.layers.0.mlp.up_proj"
    assert_same_reports(ref, got)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("where", ["cuda-cuda", "cuda-cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_same_report(where, dtype):
    a, b = _pair(dtype, dtype, perturb="model.layers.1.self_attn.q_proj")
    ref_a, ref_b = a, b
    with _namespace.host_only():
        ref = db.testing.compare_models(ref_a, ref_b, IDS)
    a = a.to("cuda")
    b = b.to("cuda") if where == "cuda-cuda" else b
    got = db.testing.compare_models(a, b, IDS)
    assert got.first_divergence == ref.first_divergence
    for x, y in zip([q for layer in ref.layers for q in layer.quantities],
                    [q for layer in got.layers for q in layer.quantities]):
        assert x.passed == y.passed and x.quantity == y.quantity
