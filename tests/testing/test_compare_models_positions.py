"""compare_models over long sequences: attention mixes T positions (a softmax normalised over them,
then a weighted sum over them), and the allowance of what reaches a layer grows with T.

A tiny random transformers Gemma computing attention eagerly is ported into its own architecture
computing it with torch's fused scaled_dot_product_attention (another kernel, another order of
rounding), and compared over 256 positions: it passes over several draws, while faults planted in
the port (a transposed projection, another gelu, attention scaled by 1.001, a kernel rounded to
bfloat16) are still named at their layer and row."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from _port_helpers import randomize, transformers_or_skip

SAME = [(r"(.*)", r"\1")]
V, T = 48, 256


def _gemma(attention: str, seed: int):
    transformers = transformers_or_skip()
    import torch

    config = transformers.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=T, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=None, attn_implementation=attention)
    torch.manual_seed(seed)
    model = transformers.GemmaForCausalLM(config).eval()
    randomize(model, seed)
    return model


def _port(seed: int):
    src, port = _gemma("eager", seed), _gemma("sdpa", seed + 100)
    db.transfer(src, port, mapping=SAME)
    return src, port, [np.random.default_rng(seed).integers(0, V, (1, T))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_correct_gemma_port_passes_over_256_positions(seed):
    src, port, inputs = _port(seed)
    report = db.testing.compare_models(src, port, inputs, seed=seed)
    assert report.passed, str(report)
    o_proj = [q for layer in report.layers if layer.layer_type.endswith("o_proj") for q in layer.quantities
              if q.quantity == "input"]
    assert len(o_proj) == 2 and all(q.units < 0.5 for q in o_proj), [q.units for q in o_proj]


def _transpose(port):
    layer = db.linear_layers(port)["model.layers.0.self_attn.o_proj"]
    params = db.get_params(layer)
    db.set_params(layer, {**params, "kernel": np.ascontiguousarray(params["kernel"].T)})


def _gelu(port):
    import torch

    port.model.layers[0].mlp.act_fn = torch.nn.GELU()  # exact gelu where Gemma's is the tanh form


def _scaling(port):
    port.model.layers[1].self_attn.scaling *= 1.001


def _bfloat16(port):
    import ml_dtypes

    layer = db.linear_layers(port)["model.layers.1.self_attn.q_proj"]
    params = db.get_params(layer)
    db.set_params(layer, {**params, "kernel": params["kernel"].astype(ml_dtypes.bfloat16).astype(np.float32)})


@pytest.mark.parametrize("plant,where,row", [
    (_transpose, "model.layers.0.self_attn.o_proj", "output"),
    (_gelu, "model.layers.0.mlp.down_proj", "input"),
    (_scaling, "model.layers.1.self_attn.o_proj", "input"),
    (_bfloat16, "model.layers.1.self_attn.q_proj", "output"),
])
def test_faults_in_a_gemma_port_are_named_over_256_positions(plant, where, row):
    src, port, inputs = _port(0)
    plant(port)
    report = db.testing.compare_models(src, port, inputs)
    assert not report.passed and report.first_divergence == where, str(report)
    assert report.first_failure.quantity == row, str(report)
