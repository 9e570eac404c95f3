"""LoRA adapters between PEFT and keras-hub: Dense and attention_output rank for rank, the
EinsumDense query/value in Keras' per-head form, and keras-hub's .lora.h5 files."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import dense_bridge as db

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TARGETS = ["query", "value", "dense"]  # q, v, attention.output.dense, intermediate.dense, output.dense


def _ports():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("keras_hub")
    peft = pytest.importorskip("peft")
    from _compare_ports import BERT_RULES, bert_inputs, keras_bert, port_bert, torch_bert  # noqa: F401

    return peft, BERT_RULES, bert_inputs, keras_bert, port_bert, torch_bert


def _peft_bert(seed=0):
    peft, _, _, _, _, torch_bert = _ports()
    model = peft.get_peft_model(torch_bert(seed), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)).get_base_model().eval()
    return model


def _torch_out(model, inputs):
    import torch

    ids, segments, mask = inputs
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(segments),
                     attention_mask=torch.tensor(mask)).last_hidden_state.numpy()


def _keras_out(model, inputs):
    ids, segments, mask = inputs
    return np.asarray(model({"token_ids": ids, "segment_ids": segments, "padding_mask": mask})["sequence_output"])


def _inputs():
    ids = np.random.default_rng(0).integers(0, 50, (2, 7))
    return ids, np.zeros_like(ids), np.ones_like(ids)


def test_peft_bert_moves_into_keras_hub_and_back_exactly():
    peft, rules, _, keras_bert, port_bert, torch_bert = _ports()
    src = _peft_bert()
    dst = keras_bert()
    port_bert(torch_bert(0), dst)  # norms and embeddings; the linear layers come again below
    base = _keras_out(dst, _inputs())
    report = db.transfer(src, dst, mapping=rules, lora="keep", strict=False)
    assert "encoder.layer.0.attention.self.query" not in report.lora["merged"]
    want = _torch_out(src, _inputs())
    got = _keras_out(dst, _inputs())
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.max(np.abs(got - base)) > 1e-2  # the adapters act
    theirs, ours = db.linear_layers(src), db.linear_layers(dst)
    for t, k in [("encoder.layer.0.attention.output.dense", "transformer_layer_0/self_attention_layer/attention_output"),
                 ("encoder.layer.0.intermediate.dense", "transformer_layer_0/feedforward_intermediate_dense"),
                 ("encoder.layer.1.output.dense", "transformer_layer_1/feedforward_output_dense")]:
        a, b = db.get_params(theirs[t]), db.get_params(ours[k])
        for key in ("lora_a", "lora_b", "lora_scale"):  # rank for rank, bit for bit
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{k} {key}")
    # query/value: Keras' per-head form, rank 8 * heads; the update is the same
    q_t = db.get_params(theirs["encoder.layer.0.attention.self.query"])
    q_k = db.get_params(ours["transformer_layer_0/self_attention_layer/query"])
    heads = q_k["lora_a"].shape[1]
    assert q_k["lora_a"].ndim == 3 and q_k["lora_a"].shape[2] == 8 * heads and q_k["lora_b"].shape == (8 * heads, 32 // heads)
    np.testing.assert_array_equal(db.lora.update(q_k), db.lora.update(q_t))
    # compare_models: the port passes (gradients of the factors and the frozen kernel included), and a
    # mis-set scale is named
    _, _, bert_inputs, _, _, _ = _ports()
    report = db.testing.compare_models(src, dst, bert_inputs(0), mapping=rules)
    assert report.passed, str(report)
    ffn = ours["transformer_layer_1/feedforward_intermediate_dense"]
    db.set_params(ffn, {**db.get_params(ffn), "lora_scale": np.array(1.0)})
    report = db.testing.compare_models(src, dst, bert_inputs(0), mapping=rules)
    assert report.first_divergence == "transformer_layer_1/feedforward_intermediate_dense", str(report)
    # and back into plain transformers: PEFT attached, rank 8 again, factors bit for bit
    back = torch_bert(3)
    db.transfer(dst, back, mapping=_keras_to_torch(rules), lora="keep", strict=False)
    port_bert_back = db.linear_layers(back)
    q_b = db.get_params(port_bert_back["encoder.layer.0.attention.self.query"])
    for key in ("lora_a", "lora_b", "lora_scale"):
        np.testing.assert_array_equal(q_b[key], q_t[key])
    assert type(port_bert_back["encoder.layer.0.attention.self.query"]) is peft.tuners.lora.layer.Linear


def _keras_to_torch(rules):
    """BERT_RULES turned around: (keras path pattern, torch path replacement) per rule (the rules'
    only groups are the block index and query|key|value)."""
    out = []
    for pattern, repl in rules:
        keras_pattern = repl.replace(r"\1", r"(\d+)").replace(r"\2", "(query|key|value)")
        torch_repl = pattern.replace(r"(\d+)", r"\1").replace("\\.", ".").replace("(query|key|value)", r"\2")
        out.append((keras_pattern, torch_repl))
    return out


def test_merge_lora_on_keras_is_the_float64_reference():
    _, rules, _, keras_bert, port_bert, torch_bert = _ports()
    src = _peft_bert()
    dst = keras_bert()
    port_bert(torch_bert(0), dst)
    db.transfer(src, dst, mapping=rules, lora="keep", strict=False)
    want = _keras_out(dst, _inputs())
    before = {p: db.get_params(l) for p, l in db.linear_layers(dst).items()}
    report = db.merge_lora(dst)
    assert len(report.merged) == sum("lora_a" in p for p in before.values()) == 2 * 5 + 1  # and pooled_dense
    for p, layer in db.linear_layers(dst).items():
        assert not getattr(layer, "lora_enabled", False)
        if "lora_a" in before[p]:
            ref = db.lora.effective_kernel(before[p]["kernel"], before[p]).astype(np.float32)
            np.testing.assert_array_equal(db.get_params(layer)["kernel"], ref, err_msg=p)
    np.testing.assert_allclose(_keras_out(dst, _inputs()), want, atol=2e-5)


def test_keras_hub_lora_h5_round_trip(tmp_path):
    _, _, _, keras_bert, _, _ = _ports()
    model = keras_bert()
    model.enable_lora(4)
    for layer in db.linear_layers(model).values():
        if getattr(layer, "lora_enabled", False):
            layer.lora_kernel_b.assign(np.random.default_rng(0).standard_normal(layer.lora_kernel_b.shape) * 0.1)
    path = str(tmp_path / "bert.lora.h5")
    db.save_adapter(model, path, format="keras-hub")
    fresh = keras_bert()
    loaded = db.load_adapter(path, fresh)
    assert loaded and set(loaded.values()) == {4}
    got = db.get_params(db.linear_layers(fresh)["transformer_layer_0/self_attention_layer/query"])
    want = db.get_params(db.linear_layers(model)["transformer_layer_0/self_attention_layer/query"])
    for key in ("lora_a", "lora_b", "lora_scale"):
        np.testing.assert_array_equal(got[key], want[key])
    # keras-hub's own loader reads the file db wrote
    own = keras_bert()
    own.load_lora_weights(path)
    np.testing.assert_array_equal(db.get_params(db.linear_layers(own)["transformer_layer_0/self_attention_layer/value"])
                                  ["lora_b"], db.get_params(db.linear_layers(model)[
                                      "transformer_layer_0/self_attention_layer/value"])["lora_b"])


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("size", ["large", "tiny"])
def test_merge_lora_into_a_quantized_keras_dense_requantizes_in_the_same_mode(mode, size):
    """enable_lora on a quantized Dense (QLoRA): merge_lora dequantizes with Keras' own arithmetic, adds
    the float64 update, requantizes with Keras' own quantizer in the same mode, and reports how much of
    the update survived; an update far below one quantization step is erased and warned about."""
    keras = pytest.importorskip("keras")
    from dense_bridge.backends.keras._quant import KerasQuantLayer

    dense = keras.layers.Dense(24, dtype="float32")
    model = keras.Sequential([keras.Input((32,)), dense])
    dense.quantize(mode)
    dense.enable_lora(4)
    rng = np.random.default_rng(7)
    factor = 0.5 if size == "large" else 1e-5
    dense.lora_kernel_a.assign(rng.standard_normal((32, 4)).astype(np.float32) * factor)
    dense.lora_kernel_b.assign(rng.standard_normal((4, 24)).astype(np.float32) * factor)
    handle = KerasQuantLayer(dense)
    base = handle.dequantized()["kernel"]
    exact = base.astype(np.float64) + (float(dense.lora_alpha) / 4) * (
        np.asarray(dense.lora_kernel_a.numpy(), np.float64) @ np.asarray(dense.lora_kernel_b.numpy(), np.float64))
    expected = handle.quantize(exact.astype(base.dtype)).kernel

    if size == "tiny":
        with pytest.warns(UserWarning, match="requantizing erased most"), warnings.catch_warnings():
            # pytest.warns re-raises every warning it records, Keras' own numpy-2 chatter included
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"keras\.")
            report = db.merge_lora(model)
    else:
        report = db.merge_lora(model)

    assert dense.quantization_mode == mode and not dense.lora_enabled
    assert str(dense._kernel.dtype) == "int8"
    after = KerasQuantLayer(dense).dequantized()["kernel"]
    np.testing.assert_array_equal(after, expected)
    (path,) = report.survival
    if size == "large":
        assert report.survival[path] > 0.5
        assert not np.array_equal(after, base)
    else:
        assert report.survival[path] < 0.5
    assert "survived requantization" in str(report)
