"""mapping="auto" on wrapped layers: PEFT LoRA and quantized linear layers are one linear layer each
to the inference (as they are to ``linear_layers``); computed buffers are never parameters to pair;
errors blame the right thing (a backbone against a model with a head, the explicit rule that failed).

Real libraries throughout (transformers, peft, torchao, mlx-lm), tiny random configs, no downloads.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import FF, H, HEADS, KV, LAYERS, POS, V  # noqa: F401  tiny sizes shared by the port tests
from _port_helpers import mlx_lm_or_skip as _mlx_lm, randomize as _randomize, transformers_or_skip as _transformers

IDS = np.random.default_rng(0).integers(0, V, (2, 7))
# peft's get_peft_model reads a transformers property that transformers 5 deprecates: theirs, not ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _llama(seed: int = 0):
    transformers = _transformers()
    import torch

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=POS,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _randomize(model, seed=seed)
    return model


def _mlx_llama(tmp_path, src):
    """A fresh mlx-lm Llama built from ``src``'s saved config."""
    _mlx_lm()
    from mlx_lm.models import llama

    src.save_pretrained(tmp_path / "cfg")
    cfg = json.loads((tmp_path / "cfg" / "config.json").read_text())
    return lambda: llama.Model(llama.ModelArgs.from_dict(cfg))


def _torch_logits(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(IDS)).logits.numpy()


def _mlx_logits(model) -> np.ndarray:
    import mlx.core as mx

    return np.asarray(model(mx.array(IDS)))


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before: dict) -> None:
    import torch

    after = model.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k


# ----------------------------------------------------------------------------- PEFT LoRA
def _peft_llama(targets=("q_proj", "v_proj", "down_proj")):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets),
                                                          init_lora_weights=False))
    return model.eval()


def test_a_peft_wrapped_llama_goes_through_auto_into_mlx_lm_merged_or_kept(tmp_path):
    src = _peft_llama()
    fresh = _mlx_llama(tmp_path, _llama())
    # the wrapped layer is ONE linear layer to the inference: the adapter never unbalances the pairing
    with pytest.raises(db.ConversionError) as err:
        db.transfer(src, fresh(), mapping="auto", inputs=[IDS])
    text = str(err.value)
    assert "holds a LoRA adapter (rank 4): pass lora='keep' or lora='merge'" in text
    assert "layers.0.self_attn.q_proj" in text and "unpaired" not in text and "structure" not in text

    want = _torch_logits(src)  # PEFT's own forward: base + scale * B A
    merged = fresh()
    report = db.transfer(src, merged, mapping="auto", inputs=[IDS], lora="merge")
    assert "verified" in report.verification and "NOT" not in report.verification
    assert len(report.lora["merged"]) == LAYERS * 3
    np.testing.assert_allclose(_mlx_logits(merged), want, rtol=1e-4, atol=1e-4)

    kept = fresh()
    report = db.transfer(src, kept, mapping="auto", inputs=[IDS], lora="keep")
    assert len(report.lora["kept"]) == LAYERS * 3
    got = db.get_params(db.linear_layers(kept)["model.layers.1.self_attn.v_proj"])
    ref = db.get_params(db.linear_layers(src)["base_model.model.model.layers.1.self_attn.v_proj"])
    for k in ("kernel", "lora_a", "lora_b", "lora_scale"):
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    np.testing.assert_allclose(_mlx_logits(kept), want, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:The following .*_pattern keys did not match:RuntimeWarning")  # peft's own
def test_peft_lora_on_raw_expert_and_router_parameters_merges_on_request_and_is_named_otherwise(tmp_path):
    """PEFT's "all-linear" on transformers 5's Mixtral also wraps the router weight and the fused
    expert stacks (``ParamWrapper``: LoRA on raw parameters, nested one per parameter). Their
    factors are adapter parts, not linear layers. No destination holds such an adapter: without
    ``lora="merge"`` they are named; with it each update is merged into its parameter (float64,
    one rounding) and moves wherever the inferred mapping sends the parameter."""
    import copy

    transformers = _transformers()
    peft = pytest.importorskip("peft")
    import torch

    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=1,
                                     num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=POS,
                                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(0)
    base = transformers.MixtralForCausalLM(cfg).eval()
    _randomize(base)
    original = _state(base)
    src = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     init_lora_weights=False)).eval()
    paths = list(db.linear_layers(src))
    assert not [p for p in paths if "lora_" in p], paths  # factors are no linear layers
    assert "base_model.model.model.layers.0.self_attn.q_proj" in paths
    dst = transformers.MixtralForCausalLM(cfg).eval()
    before = _state(dst)
    for lora in (None, "keep"):
        with pytest.raises(db.ConversionError) as err:
            db.transfer(src, dst, mapping="auto", inputs=[IDS], lora=lora)
        text = str(err.value)
        assert "'base_model.model.model.layers.0.mlp.gate' is a PEFT" in text
        assert "on the parameters ['weight'] of MixtralTopKRouter" in text
        assert "on the parameters ['gate_up_proj', 'down_proj'] of MixtralExperts" in text
        assert "pass lora='merge' to merge it into the parameters it updates" in text
        assert "unpaired" not in text and "not matched" not in text and "structure" not in text
        _unchanged(dst, before)

    report = db.transfer(src, dst, mapping="auto", inputs=[IDS], lora="merge")
    assert "verified" in report.verification
    assert {"base_model.model.model.layers.0.mlp.gate", "base_model.model.model.layers.0.mlp.experts",
            "base_model.model.model.layers.0.mlp.experts.base_layer"} <= set(report.lora["merged"])
    # the reference: PEFT's own update, computed on a float64 copy, added to the float64 base, rounded once
    wide = copy.deepcopy(src).double()
    block = wide.base_model.model.model.layers[0].mlp
    with torch.no_grad():
        want = {"model.layers.0.mlp.gate.weight":
                block.gate.base_layer.weight + block.gate.get_delta_weight("default"),
                "model.layers.0.mlp.experts.gate_up_proj":
                block.experts.base_layer.base_layer.gate_up_proj + block.experts.base_layer.get_delta_weight("default"),
                "model.layers.0.mlp.experts.down_proj":
                block.experts.base_layer.base_layer.down_proj + block.experts.get_delta_weight("default")}
    state = dst.state_dict()
    for name, value in want.items():
        assert torch.equal(state[name], value.float()), name
        assert not torch.equal(state[name], original[name]), name  # the update is there
    with torch.no_grad():
        np.testing.assert_allclose(_torch_logits(dst), src(torch.as_tensor(IDS)).logits.numpy(), rtol=1e-4, atol=1e-4)
    # into mlx-lm's stacked SwitchGLU, split from the merged fused stack
    _mlx_lm()
    from mlx_lm.models import mixtral

    dst.save_pretrained(tmp_path / "cfg")
    args = mixtral.ModelArgs.from_dict(json.loads((tmp_path / "cfg" / "config.json").read_text()))
    into = mixtral.Model(args)
    db.transfer(src, into, mapping="auto", inputs=[IDS], lora="merge")
    np.testing.assert_allclose(_mlx_logits(into), _torch_logits(dst), rtol=1e-4, atol=1e-4)


def test_peft_lora_on_a_linear_layers_raw_weight_is_refused_for_merge_naming_it():
    """``target_parameters`` on a linear layer's weight wraps it in a ``ParamWrapper``: its weight is
    read in the canonical layout, where no update is added, so a merge is refused by name (never
    moved without its update)."""
    peft = pytest.importorskip("peft")
    src = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=[],
                                                         target_parameters=["self_attn.q_proj.weight"],
                                                         init_lora_weights=False)).eval()
    dst = _llama(seed=1)
    before = _state(dst)
    for mapping in (None, "auto"):
        with pytest.raises(db.ConversionError) as err:
            db.transfer(src, dst, mapping=mapping, inputs=[IDS], lora="merge", strict=False)
        assert ("src 'base_model.model.model.layers.0.self_attn.q_proj' holds an adapter on the parameter "
                "'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight' of the linear layer") in str(err.value)
        _unchanged(dst, before)


# ----------------------------------------------------------------------------- quantized
def _torchao():
    pytest.importorskip("torchao")
    import torchao.quantization as tq

    return tq


def test_torchao_int8_llama_through_auto_dequantized_codes_or_quantized_by_the_destination():
    tq = _torchao()
    q = _llama()
    tq.quantize_(q, tq.Int8WeightOnlyConfig())
    # quantized into float: the exact dequantization torchao itself computes
    plain = _llama(seed=1)
    report = db.transfer(q, plain, mapping="auto", inputs=[IDS])
    assert "verified" in report.verification
    for path, layer in db.linear_layers(q).items():
        np.testing.assert_array_equal(db.get_params(db.linear_layers(plain)[path])["kernel"],
                                      db.get_params(layer)["kernel"], err_msg=path)
    assert ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj",
            "kernel (canonical, dequantized exactly)") in report.moved
    # quantized into the same format: the codes move
    q2 = _llama(seed=2)
    tq.quantize_(q2, tq.Int8WeightOnlyConfig())
    report = db.transfer(q, q2, mapping="auto", inputs=[IDS])
    assert all("codes moved exactly" in what for _, d, what in report.moved if "proj" in d or d == "lm_head")
    for path, layer in db.linear_layers(q).items():
        got, want = db.get_params(db.linear_layers(q2)[path], quantized=True), db.get_params(layer, quantized=True)
        np.testing.assert_array_equal(got["qkernel"], want["qkernel"], err_msg=path)
    # float into quantized: the destination's own quantizer, its largest error reported per layer
    q3 = _llama(seed=3)
    tq.quantize_(q3, tq.Int8WeightOnlyConfig())
    report = db.transfer(_llama(), q3, mapping="auto", inputs=[IDS])
    assert sorted(report.quant_errors) == sorted(db.linear_layers(q3))
    assert all(0 < e < 0.05 for e in report.quant_errors.values()), report.quant_errors


def test_torchao_int4_llama_through_auto_is_its_exact_dequantization():
    tq = _torchao()
    import torch
    from torchao.quantization.granularity import PerGroup

    q = _llama()
    tq.quantize_(q, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)))
    plain = _llama(seed=1)
    report = db.transfer(q, plain, mapping="auto", inputs=[IDS])
    assert "verified" in report.verification and report.not_moved_dst == []
    for path, layer in db.linear_layers(q).items():
        assert db.get_params(layer, quantized=True)["qkernel"].max() <= 7, path  # 4-bit codes
        np.testing.assert_array_equal(db.get_params(db.linear_layers(plain)[path])["kernel"],
                                      db.get_params(layer)["kernel"], err_msg=path)


def test_an_mlx_quantized_mlx_lm_model_goes_through_auto_both_ways(tmp_path):
    src = _llama()
    fresh = _mlx_llama(tmp_path, src)
    import mlx.nn as nn

    q = fresh()
    db.transfer(src, q, mapping="auto", inputs=[IDS])
    nn.quantize(q, group_size=32, bits=8)  # mlx-lm's own quantization of a ported model
    back = _llama(seed=1)
    report = db.transfer(q, back, mapping="auto", inputs=[IDS])
    assert "verified" in report.verification and not report.not_moved_dst
    for path, layer in db.linear_layers(q).items():
        np.testing.assert_array_equal(db.get_params(db.linear_layers(back)[path])["kernel"],
                                      db.get_params(layer)["kernel"], err_msg=path)
    into = fresh()
    nn.quantize(into, group_size=32, bits=8)
    report = db.transfer(src, into, mapping="auto", inputs=[IDS])
    assert sorted(report.quant_errors) == sorted(db.linear_layers(into))
    assert all("quantized by the destination (8-bit affine, group 32)" in what
               for _, d, what in report.moved if d in report.quant_errors)


def test_torchao_int8_codes_into_mlx_affine_are_refused_by_layer_unless_requantized(tmp_path):
    tq = _torchao()
    import mlx.nn as nn

    fresh = _mlx_llama(tmp_path, _llama())
    q = _llama()
    tq.quantize_(q, tq.Int8WeightOnlyConfig())
    dst = fresh()
    nn.quantize(dst, group_size=32, bits=8)
    with pytest.raises(db.ConversionError) as err:
        db.transfer(q, dst, mapping="auto", inputs=[IDS])
    text = str(err.value)
    assert ("'model.layers.0.self_attn.q_proj' -> 'model.layers.0.self_attn.q_proj': the codes (8-bit zero_point, "
            "per-channel) cannot move exactly into 8-bit affine, group 32") in text
    assert "requantize=True" in text and "unpaired" not in text
    report = db.transfer(q, dst, mapping="auto", inputs=[IDS], requantize=True)
    assert sorted(report.quant_errors) == sorted(db.linear_layers(dst))


# ----------------------------------------------------------------------------- computed buffers
def test_computed_buffers_are_never_asked_for_and_every_real_parameter_left_is_named(tmp_path):
    """Llama holds rotary ``inv_freq`` buffers (non-persistent: recomputed from the config); mlx-lm
    computes its frequencies without storing any. A strict transfer is complete without them, and
    one that leaves real parameters out names every one of them and no buffer."""
    src = _llama()
    assert any(n.endswith("inv_freq") for n, _ in src.named_buffers())
    fresh = _mlx_llama(tmp_path, src)
    report = db.transfer(src, fresh(), mapping="auto", inputs=[IDS])
    assert report.not_moved_src == [] and report.not_moved_dst == []
    back = _llama(seed=1)
    report = db.transfer(fresh(), back, mapping="auto", inputs=[IDS])
    assert not [p for p in report.not_moved_dst + report.not_moved_src if "inv_freq" in p]
    # two torch models: same architecture, by path; then an explicit mapping of the linear layers only
    report = db.transfer(src, _llama(seed=2))
    assert report.not_moved_dst == []
    linear_only = {p: p for p in db.linear_layers(src)}
    dst = _llama(seed=3)
    before = _state(dst)
    with pytest.raises(db.ConversionError) as err:
        db.transfer(src, dst, mapping=linear_only)
    text = str(err.value)
    left = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(LAYERS) for n in ("input_layernorm", "post_attention_layernorm")]
    for p in left:
        assert repr(p) in text, p
    assert "inv_freq" not in text and "rotary" not in text
    _unchanged(dst, before)


# ----------------------------------------------------------------------------- errors that blame the right thing
def test_a_backbone_against_a_model_with_a_head_is_named_as_such(tmp_path):
    src = _llama()
    fresh = _mlx_llama(tmp_path, src)
    cases = [(src.model, fresh(), "src returns (2, 7, 32) (hidden states of width 32) where dst returns (2, 7, 48)"),
             (fresh(), _llama(seed=1).model, "dst returns (2, 7, 32) (hidden states of width 32) where src returns "
                                             "(2, 7, 48)"),
             (src.model, _llama(seed=1), "src returns (2, 7, 32) (hidden states of width 32) where dst returns "
                                         "(2, 7, 48)"),
             (src, _llama(seed=1).model, "dst returns (2, 7, 32)")]
    for a, b, where in cases:
        with pytest.raises(db.ConversionError) as err:
            db.transfer(a, b, mapping="auto", inputs=[IDS])
        text = str(err.value)
        assert "the outputs are hidden states on one side and logits on the other" in text, text
        assert where in text and "through its head 'lm_head' (32 -> 48)" in text and "give the task model" in text
    # strict=False leaves the head, and the verification says why the outputs cannot agree, first
    dst = _llama(seed=1)
    before = _state(dst)
    with pytest.raises(db.ConversionError) as err:
        db.transfer(src.model, dst, mapping="auto", inputs=[IDS], strict=False)
    text = str(err.value)
    assert text.startswith("mapping='auto': the inferred transfer does not reproduce src on the inputs (dst was left "
                           "unchanged). The outputs are hidden states on one side and logits on the other: "), text
    _unchanged(dst, before)
    report = db.transfer(src.model, dst, mapping="auto", inputs=[IDS], strict=False, verify=False)
    assert report.not_moved_dst == ["lm_head.weight"]


def test_an_explicit_mapping_that_fails_names_the_rule_and_the_layer():
    src, dst = _llama(), _llama(seed=1)
    before = _state(dst)
    rule = r"model\.layers\.(\d+)\.self_attn\.q_proj"
    with pytest.raises(db.ConversionError) as err:
        db.transfer(src, dst, mapping=[(rule, r"model.layers.\1.self_attn.k_proj"), (r"(.*)", r"\1")])
    text = str(err.value)
    assert (f"src model.layers.0.self_attn.q_proj (torch.nn.modules.linear.Linear) kernel (32, 32) does not fit dst "
            f"model.layers.0.self_attn.k_proj (torch.nn.modules.linear.Linear) kernel (32, 16)") in text
    assert f"(mapping rule {rule!r})" in text
    assert ("dst layer 'model.layers.1.self_attn.k_proj' gets both 'model.layers.1.self_attn.q_proj' and "
            "'model.layers.1.self_attn.k_proj' (mapping rules '(.*)', " + repr(rule) + ")") in text
    _unchanged(dst, before)
    # a dict entry is its own rule
    with pytest.raises(db.ConversionError) as err:
        db.transfer(src, dst, mapping={"model.layers.0.mlp.up_proj": "model.layers.0.mlp.down_proj"}, strict=False)
    assert "(mapping rule 'model.layers.0.mlp.up_proj')" in str(err.value)
    _unchanged(dst, before)
