"""db.testing.compare_models on real third-party models and their ports (tiny random configs).

transformers BERT (torch) vs keras-hub's BertBackbone, transformers GPT-2 and Llama vs mlx-lm's:
the correct ports pass (50 seeds each in float32 and bfloat16: 5 model draws x 10 input and
cotangent draws), and each planted fault is named at the right path:

- one square projection transposed, one bias dropped, one layer's weights rounded to bfloat16:
  at that layer, as its own output ("output" row);
- gelu exact instead of tanh in one FFN: at the input of the FFN's output projection (the
  activation runs between the two linear layers).

Called as users check a port: ``compare_models(original, port, inputs, mapping=<the mapping the
port was made with>)``; ``first_divergence`` is the port's path, ``first_divergence_a`` the
original's.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import _compare_ports as P
import dense_bridge as db

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

SEEDS = 50
MODEL_DRAWS = 5  # seeds share a model build: seed s uses model draw s // (SEEDS // MODEL_DRAWS)
SAME = [(r"(.*)", r"\1")]  # GPT-2 and Llama paths agree between transformers and mlx-lm


def _need(*modules):
    for m in modules:
        pytest.importorskip(m)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: torch's thread pool costs 10x more than it gives."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _bert(model_seed: int, dtype: str = "float32"):
    _need("torch", "transformers", "keras_hub")
    src = P.torch_bert(model_seed)
    port = P.keras_bert(dtype)
    P.port_bert(src, port)
    if dtype == "bfloat16":
        import torch

        src = src.to(torch.bfloat16)
    return port, src


def _mlx_port(name: str, model_seed: int, dtype: str = "float32"):
    _need("torch", "transformers", "mlx", "mlx_lm")
    src = getattr(P, f"torch_{name}")(model_seed)
    port = getattr(P, f"mlx_{name}")(dtype)
    getattr(P, f"port_{name}")(src, port)
    if dtype == "bfloat16":
        import torch

        src = src.to(torch.bfloat16)
    return port, src


def _compare(name, port, src, seed=0, **kw):
    """compare_models(original, port) with the mapping the port was made with."""
    if name == "bert":
        return db.testing.compare_models(src, port, P.bert_inputs(seed), mapping=P.BERT_RULES, seed=seed, **kw)
    return db.testing.compare_models(src, port, P.lm_inputs(seed), mapping=SAME, seed=seed, **kw)


# ---------------------------------------------------------------------------- correct ports
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_correct_ports_pass_over_50_seeds(name, dtype):
    per_model = SEEDS // MODEL_DRAWS
    worst, reports = 0.0, 0
    for draw in range(MODEL_DRAWS):
        port, src = _bert(draw, dtype) if name == "bert" else _mlx_port(name, draw, dtype)
        for seed in range(draw * per_model, (draw + 1) * per_model):
            report = _compare(name, port, src, seed)
            assert report.passed, str(report)
            assert report.first_divergence is None
            worst = max(worst, report.worst.units)
            reports += 1
    assert reports == SEEDS
    # every matched layer was compared, forward and backward
    kinds = {q.quantity for q in report.rows}
    assert {"input", "output", "dL/dy", "dL/dkernel", "model output"} <= kinds
    print(f"{name} {dtype}: worst {worst:.3f} tolerance units over {SEEDS} seeds")


def test_bert_report_pairs_every_linear_layer_in_execution_order():
    port, src = _bert(0)
    report = _compare("bert", port, src)
    assert report.passed, str(report)
    torch_paths = [pa for pa, _, _ in report.calls]
    assert torch_paths[:6] == ["encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key",
                               "encoder.layer.0.attention.self.value", "encoder.layer.0.attention.output.dense",
                               "encoder.layer.0.intermediate.dense", "encoder.layer.0.output.dense"]
    assert torch_paths[-1] == "pooler.dense" and len(torch_paths) == 2 * 6 + 1
    assert report.calls[0][1] == "transformer_layer_0/self_attention_layer/query"
    # the EinsumDense output (batch, seq, heads, head_dim) was read as (batch*seq, hidden)
    assert report.layers[0]["output"].shape == (2 * 7, P.H)
    d = json.loads(report.to_json())
    assert d["passed"] and d["first_divergence"] is None and len(d["pairs"]) == 13
    page = report.to_html()
    assert "<svg" in page and "encoder.layer.0.attention.self.query" in page


# ---------------------------------------------------------------------------- planted faults
def _set(layer, **change):
    params = db.get_params(layer)
    params.update({k: f(params[k]) for k, f in change.items()})
    db.set_params(layer, params)


def _transpose(k):
    assert k.shape[0] == k.shape[1], "a square projection"
    return np.ascontiguousarray(k.T)


def _to_bf16(k):
    from dense_bridge._dtypes import numpy_dtype

    return k.astype(numpy_dtype("bfloat16")).astype(k.dtype)


FAULTS = {
    # name: {fault: (port layer to change, what, expected path in the original (a), row)}
    "bert": {
        "transpose": ("transformer_layer_1/self_attention_layer/attention_output", {"kernel": _transpose},
                      "encoder.layer.1.attention.output.dense", "output"),
        "bias": ("transformer_layer_0/feedforward_output_dense", {"bias": np.zeros_like},
                 "encoder.layer.0.output.dense", "output"),
        "bf16": ("transformer_layer_0/self_attention_layer/query", {"kernel": _to_bf16},
                 "encoder.layer.0.attention.self.query", "output"),
        "gelu": ("transformer_layer_1/feedforward_intermediate_dense", None, "encoder.layer.1.output.dense", "input"),
    },
    "gpt2": {
        "transpose": ("h.1.attn.c_proj", {"kernel": _transpose}, "h.1.attn.c_proj", "output"),
        "bias": ("h.0.mlp.c_fc", {"bias": np.zeros_like}, "h.0.mlp.c_fc", "output"),
        "bf16": ("h.1.attn.c_attn", {"kernel": _to_bf16}, "h.1.attn.c_attn", "output"),
        "gelu": ("h.0.mlp", None, "h.0.mlp.c_proj", "input"),
    },
    "llama": {
        "transpose": ("model.layers.1.mlp.down_proj", {"kernel": _transpose}, "model.layers.1.mlp.down_proj", "output"),
        "bias": ("model.layers.0.self_attn.v_proj", {"bias": np.zeros_like}, "model.layers.0.self_attn.v_proj",
                 "output"),
        "bf16": ("model.layers.1.mlp.up_proj", {"kernel": _to_bf16}, "model.layers.1.mlp.up_proj", "output"),
    },
}


def _plant_gelu(name, port, where):
    if name == "bert":
        import keras

        layer = db.linear_layers(port)[where]
        layer.activation = keras.activations.gelu  # exact (erf); keras-hub's BERT uses the tanh form
        return
    import mlx.nn as nn

    mlp = port
    for part in where.split("."):
        mlp = mlp[int(part)] if part.isdigit() else getattr(mlp, part)
    cls = type(mlp)
    mlp.__class__ = type("ExactGeluMLP", (cls,), {"__call__": lambda self, x: self.c_proj(nn.gelu(self.c_fc(x)))})


CASES = [(name, fault) for name, faults in FAULTS.items() for fault in faults]


@pytest.mark.parametrize("name,fault", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_planted_fault_is_named_at_its_path(name, fault):
    port, src = _bert(0) if name == "bert" else _mlx_port(name, 0)
    where, change, expected, row = FAULTS[name][fault]
    if change is None:
        _plant_gelu(name, port, where)
    else:
        _set(db.linear_layers(port)[where], **change)
    report = _compare(name, port, src)
    assert not report.passed
    assert report.first_divergence_a == expected, str(report)
    assert report.first_failure.quantity == row, str(report)
    assert report.first_divergence in report.verdict()
    if row == "output":  # the port's layer itself is named
        assert report.first_divergence == where
        # one bad layer is named once: every other layer's own output stays within tolerance
        bad = [pa for (pa, _, _), layer in zip(report.calls, report.layers) if not layer["output"].passed]
        assert bad == [expected], str(report)
    assert json.loads(report.to_json())["first_divergence_a"] == expected
    f = report.first_failure
    print(f"{name}-{fault}: {f.quantity} {f.units:.3g} units at {report.first_divergence_a}")


# ---------------------------------------------------------------------------- arguments
def test_outputs_selectors_and_grads_off():
    port, src = _mlx_port("llama", 0)
    report = db.testing.compare_models(src, port, P.lm_inputs(0), mapping=SAME, grads=False)
    assert report.passed and {q.quantity for q in report.rows} == {"input", "output", "model output"}
    # select the logits explicitly (a ModelOutput field by name; mlx-lm returns the array itself)
    report = db.testing.compare_models(src, port, P.lm_inputs(0), mapping=SAME, outputs=("logits", None))
    assert report.passed, str(report)


def test_bad_arguments_name_themselves():
    port, src = _mlx_port("gpt2", 0)
    with pytest.raises(TypeError, match="outputs"):
        db.testing.compare_models(src, port, P.lm_inputs(0), mapping=SAME, outputs="logits")
    with pytest.raises(TypeError, match="inputs"):
        db.testing.compare_models(src, port, None, mapping=SAME)
    with pytest.raises(TypeError, match="grads"):
        db.testing.compare_models(src, port, P.lm_inputs(0), mapping=SAME, grads="yes")


# ---------------------------------------------------------------------------- structure
def _twice_net(calls: int):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            for _ in range(calls):
                x = torch.tanh(self.lin(x))
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def test_calls_compared_call_by_call_and_unmatched_layers_named():
    _need("torch")
    x = [np.random.default_rng(0).standard_normal((3, 4))]
    a, b = _twice_net(2), _twice_net(2)
    report = db.testing.compare_models(a, b, x)
    assert report.passed, str(report)
    assert [(pb, n) for _, pb, n in report.calls] == [("lin", 0), ("lin", 1), ("head", 0)]
    assert report.layers[1].layer_type == "lin [call 1]"
    # a layer called more often in a than in b: the report fails, naming it
    once = _twice_net(1)
    once.load_state_dict(a.state_dict())
    report = db.testing.compare_models(a, once, x)
    assert not report.passed and any(q.quantity == "calls" and not q.passed for q in report.rows)
    assert report.first_divergence == "head"  # the first value that differs: what reaches the head
    # a mapping that pairs only some layers: the others are named as not compared
    report = db.testing.compare_models(a, b, x, mapping={"lin": "lin"})
    assert report.passed and [pb for _, pb, _ in report.calls] == ["lin", "lin"]
    assert any("head" in n and "not compared" in n for n in report.notes)


def test_float32_original_against_bfloat16_port_is_judged_at_bfloat16():
    _need("torch", "transformers", "mlx", "mlx_lm")
    src = P.torch_llama(0)
    port = P.mlx_llama("bfloat16")
    P.port_llama(src, port)
    report = db.testing.compare_models(src, port, P.lm_inputs(0), mapping=SAME)
    assert report.passed, str(report)
    assert (report.a.dtype, report.b.dtype, report.dtype) == ("float32", "bfloat16", "bfloat16")


@pytest.mark.parametrize("pair", [("torch", "keras"), ("keras", "mlx"), ("numpy", "torch")])
def test_mlps_with_activations_inside_their_layers(pair):
    """Keras captures a Dense before its activation, torch's and MLX's dense_bridge layers apply it
    inside: each output is judged through its own activation, gradients before it."""
    from _mlp_pairs import activated_mlp_pair

    a, b, x = activated_mlp_pair(pair)
    report = db.testing.compare_models(a, b, x)
    assert report.passed, str(report)
    # a wrong bias in b's middle layer is named there
    layer = list(db.linear_layers(b).values())[1]
    params = db.get_params(layer)
    db.set_params(layer, {**params, "bias": params["bias"] + 0.01})
    report = db.testing.compare_models(a, b, x)
    assert report.first_divergence == list(db.linear_layers(b))[1]
    assert report.first_failure.quantity == "output"


# ---------------------------------------------------------------------------- verdict-only path
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_carried_judging_passes_correct_ports_and_judges_every_call(name, dtype):
    """The private path db.transfer(mapping="auto") verifies with: correct ports pass, every call's
    input and output and the model output are rows, and nothing else is computed."""
    port, src = _bert(0, dtype) if name == "bert" else _mlx_port(name, 0, dtype)
    for seed in range(3):
        report = _compare(name, port, src, seed, grads=False, judge="carried")
        assert report.passed, str(report)
        assert report.structure is None
        assert len(report.layers) == len(report.calls) + 1  # one row pair per call, then the model output
        assert all({q.quantity for q in layer.quantities} == {"input", "output"} for layer in report.layers[:-1])
        assert [q.quantity for q in report.layers[-1].quantities] == ["model output"]


@pytest.mark.parametrize("name,fault", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_carried_judging_fails_planted_faults_at_the_same_layer(name, fault):
    """A transposed kernel, a dropped bias, a kernel rounded to bfloat16 or a swapped activation
    fails the verdict-only path at the layer and row the full comparison names."""
    port, src = _bert(0) if name == "bert" else _mlx_port(name, 0)
    where, change, expected, row = FAULTS[name][fault]
    if change is None:
        _plant_gelu(name, port, where)
    else:
        _set(db.linear_layers(port)[where], **change)
    report = _compare(name, port, src, grads=False, judge="carried")
    assert not report.passed
    assert report.first_divergence_a == expected, str(report)
    assert report.first_failure.quantity == row, str(report)
