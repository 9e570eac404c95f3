"""Real third-party model code (transformers, keras-hub, mlx-lm) from tiny random configs, no downloads:
linear layers found by path and layout, whole models transferred across frameworks."""
from __future__ import annotations

import os

import numpy as np
import pytest

import dense_bridge as db

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _gpt2_torch(seed: int = 0):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_linear_layers_finds_every_gpt2_conv1d_in_its_in_out_layout():
    model = _gpt2_torch()
    from transformers.pytorch_utils import Conv1D

    layers = db.linear_layers(model)
    conv = [p for p, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(conv) == 8
    assert list(layers) == conv + ["lm_head"]
    for path in conv:
        layer = layers[path]
        params = db.get_params(layer)
        # Conv1D keeps weight (in, out): the canonical kernel IS the weight, untransposed
        np.testing.assert_array_equal(params["kernel"], layer.weight.detach().numpy())
        assert db.to_spec(layer).in_features == layer.weight.shape[0]
        for to in ("mlx", "keras"):
            if to not in db.available_backends():
                continue
            other = db.convert(layer, to)
            got = db.get_params(other)
            for k in params:
                assert np.array_equal(np.asarray(got[k]), params[k]), (path, to, k)
    # the square attention projection converts exactly both ways: layout by declaration, not shape
    proj = layers["transformer.h.0.attn.c_proj"]
    back = db.convert(db.convert(proj, "numpy"), "torch")
    assert np.array_equal(back.weight.detach().numpy(), proj.weight.detach().numpy().T)
    assert db.testing.compare(proj, db.convert(proj, "numpy")).passed


# --------------------------------------------------------------------- BERT -> keras-hub
#: transformers BertModel paths -> keras-hub BertBackbone paths (the README example).
BERT_RULES = [
    (r"embeddings\.word_embeddings", "token_embedding"),
    (r"embeddings\.position_embeddings", "position_embedding"),
    (r"embeddings\.token_type_embeddings", "segment_embedding"),
    (r"embeddings\.LayerNorm", "embeddings_layer_norm"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)", r"transformer_layer_\1/self_attention_layer/\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense", r"transformer_layer_\1/self_attention_layer/attention_output"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm", r"transformer_layer_\1/self_attention_layer_norm"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense", r"transformer_layer_\1/feedforward_intermediate_dense"),
    (r"encoder\.layer\.(\d+)\.output\.dense", r"transformer_layer_\1/feedforward_output_dense"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm", r"transformer_layer_\1/feedforward_layer_norm"),
    (r"pooler\.dense", "pooled_dense"),
]


def _close(a, b, what):
    """Within float32 rounding of a deep network: 1e-4 of the output's scale (a transposed or
    swapped projection is off by the scale itself)."""
    err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
    scale = float(np.max(np.abs(a)))
    assert err <= 1e-4 * scale, f"{what}: max abs error {err:.3g} at output scale {scale:.3g}"
    return err


def test_transformers_bert_transfers_into_keras_hub_bert_backbone():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from conftest import require_backend

    require_backend("keras")
    keras_hub = pytest.importorskip("keras_hub")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=16, type_vocab_size=2, hidden_act="gelu_pytorch_tanh", initializer_range=0.5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    src = transformers.BertModel(config).eval()
    dst = keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=32,
                                        intermediate_dim=37, max_sequence_length=16, num_segments=2, dropout=0.0)
    report = db.transfer(src, dst, mapping=BERT_RULES)
    assert report.not_moved_src == [] and report.not_moved_dst == []
    moved = {s: d for s, d, _ in report.moved}
    assert moved["encoder.layer.1.attention.self.query"] == "transformer_layer_1/self_attention_layer/query"
    assert moved["embeddings.LayerNorm.weight"] == "embeddings_layer_norm/gamma"

    rng = np.random.default_rng(0)
    ids, segments = rng.integers(0, 50, (2, 10)), rng.integers(0, 2, (2, 10))
    with torch.no_grad():
        want = src(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(segments),
                   attention_mask=torch.ones(2, 10, dtype=torch.long))
    got = dst({"token_ids": ids, "segment_ids": segments, "padding_mask": np.ones((2, 10), "int32")})
    _close(want.last_hidden_state.numpy(), np.asarray(got["sequence_output"]), "sequence_output")
    _close(want.pooler_output.numpy(), np.asarray(got["pooled_output"]), "pooled_output")
    # the EinsumDense query kernel (hidden, heads, head_dim) holds torch's weight (heads*head_dim, hidden).T
    query = db.linear_layers(dst)["transformer_layer_0/self_attention_layer/query"]
    np.testing.assert_array_equal(
        query.kernel.numpy().reshape(32, 32), src.encoder.layer[0].attention.self.query.weight.detach().numpy().T)


# --------------------------------------------------------------------- Llama, GPT-2 -> mlx-lm
def _mlx_lm():
    pytest.importorskip("mlx")
    return pytest.importorskip("mlx_lm")


def test_transformers_llama_transfers_into_mlx_lm_llama_with_square_mlp():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _mlx_lm()
    import mlx.core as mx
    from mlx_lm.models import llama

    # intermediate_size == hidden_size: gate, up and down are all square, so only names tell them apart
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(config).eval()
    rope = getattr(config, "rope_parameters", None) or {}
    dst = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64, tie_word_embeddings=False,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))))
    # by order, up (transformers' 2nd) would land in down (mlx-lm's 2nd): refused, naming them
    with pytest.raises(db.ConversionError, match="up_proj.*down_proj"):
        db.transfer(src, dst)
    report = db.transfer(src, dst, mapping=[(r"(.*)", r"\1")])  # both use the same paths
    assert report.not_moved_src == [] and report.not_moved_dst == []
    ids = np.random.default_rng(0).integers(0, 64, (2, 7))
    with torch.no_grad():
        want = src(torch.tensor(ids)).logits.numpy()
    _close(want, np.asarray(dst(mx.array(ids))), "llama logits")
    # the test can see a swap: up and down exchanged is far off
    swapped = [(r"(.*)\.up_proj", r"\1.down_proj"), (r"(.*)\.down_proj", r"\1.up_proj"), (r"(.*)", r"\1")]
    db.transfer(src, dst, mapping=swapped)
    with pytest.raises(AssertionError, match="llama logits"):
        _close(want, np.asarray(dst(mx.array(ids))), "llama logits")


def test_transformers_gpt2_transfers_into_mlx_lm_gpt2_with_tied_head():
    torch = pytest.importorskip("torch")
    _mlx_lm()
    import mlx.core as mx
    from mlx_lm.models import gpt2

    src = _gpt2_torch()
    with torch.no_grad():  # layer norms start at 1/0: make them count
        for name, p in src.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.uniform_(0.5, 1.5)
    dst = gpt2.Model(gpt2.ModelArgs(model_type="gpt2", n_ctx=16, n_embd=32, n_head=2, n_layer=2, n_positions=16,
                                    layer_norm_epsilon=1e-5, vocab_size=64))
    report = db.transfer(src, dst, mapping=[(r"transformer\.(.*)", r"model.\1")])
    # lm_head is wte's weight in torch; mlx-lm calls wte.as_linear: it moves once, with wte
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert report.not_moved_src == [] and report.not_moved_dst == []
    ids = np.random.default_rng(0).integers(0, 64, (2, 9))
    with torch.no_grad():
        want = src(torch.tensor(ids)).logits.numpy()
    _close(want, np.asarray(dst(mx.array(ids))), "gpt2 logits")


def test_keras_hub_feedforward_dense_reads_as_a_lone_layer():
    from conftest import require_backend

    require_backend("keras")
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=12, max_sequence_length=8, dropout=0.0)
    layers = db.linear_layers(backbone)
    ffn = layers["transformer_layer_0/feedforward_intermediate_dense"]
    # keras-hub's gelu_approximate is keras.activations.gelu(x, approximate=True): the table's gelu_tanh
    assert db.to_spec(ffn).activation == db.Activation("gelu_tanh")
    for path in ("transformer_layer_0/self_attention_layer/key", "transformer_layer_0/feedforward_intermediate_dense",
                 "pooled_dense"):
        layer = layers[path]
        assert db.testing.compare(layer, db.convert(layer, "numpy")).passed, path
