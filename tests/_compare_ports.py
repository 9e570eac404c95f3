"""Tiny random third-party models and their ports, for the compare_models tests (no downloads).

- transformers BERT (torch, ``hidden_act="gelu_pytorch_tanh"``) and keras-hub's ``BertBackbone``
  (whose FFN uses the tanh gelu);
- transformers GPT-2 and mlx-lm's GPT-2 (``gelu_new`` = mlx ``gelu_approx``);
- transformers Llama (``intermediate_size == hidden_size``: square MLP matrices; biases on, so
  that a dropped one can be planted) and mlx-lm's Llama (MLP defined gate, down, up: by-order
  matching would swap up and down).

Every parameter of the source is drawn at random first (transformers zeroes biases and sets norm
scales to 1, under which a dropped bias or a swapped norm would go unseen). The ports go through
``db.transfer`` with the mappings below; the parameters dense_bridge does not describe (embedding
tables, norms) follow its name table.
"""
from __future__ import annotations

import os

import numpy as np

import dense_bridge as db

V, H, HEADS, FF, LAYERS, POS = 48, 32, 4, 64, 2, 16

#: torch BERT path -> keras-hub BertBackbone path, as (regex, replacement) rules
BERT_RULES = [
    (r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)", r"transformer_layer_\1/self_attention_layer/\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense", r"transformer_layer_\1/self_attention_layer/attention_output"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense", r"transformer_layer_\1/feedforward_intermediate_dense"),
    (r"encoder\.layer\.(\d+)\.output\.dense", r"transformer_layer_\1/feedforward_output_dense"),
    (r"pooler\.dense", r"pooled_dense"),
]


def _randomize_torch(model, seed: int, scale: float = 0.5) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("LayerNorm.weight") or name.endswith("ln_1.weight") or name.endswith("ln_2.weight") \
                    or name.endswith("ln_f.weight") or "norm.weight" in name or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def _to_np(t) -> np.ndarray:
    return t.detach().float().numpy()


# ---------------------------------------------------------------------------- BERT
def torch_bert(seed: int = 0):
    import torch
    import transformers

    cfg = transformers.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                  intermediate_size=FF, max_position_embeddings=POS, type_vocab_size=2,
                                  hidden_act="gelu_pytorch_tanh", initializer_range=0.5,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = transformers.BertModel(cfg).eval()
    _randomize_torch(model, seed, scale=0.25)
    return model


def keras_bert(dtype: str = "float32"):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras_hub

    return keras_hub.models.BertBackbone(vocabulary_size=V, num_layers=LAYERS, num_heads=HEADS, hidden_dim=H,
                                         intermediate_dim=FF, max_sequence_length=POS, num_segments=2, dropout=0.0,
                                         dtype=dtype)


def port_bert(src, dst) -> None:
    """Copy a transformers BertModel into a keras-hub BertBackbone (linear layers by BERT_RULES)."""
    db.transfer(src, dst, allow_narrowing=True, mapping=BERT_RULES + [
        (r"embeddings\.word_embeddings", "token_embedding"),
        (r"embeddings\.position_embeddings", "position_embedding"),
        (r"embeddings\.token_type_embeddings", "segment_embedding"),
        (r"embeddings\.LayerNorm", "embeddings_layer_norm"),
        (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm", r"transformer_layer_\1/self_attention_layer_norm"),
        (r"encoder\.layer\.(\d+)\.output\.LayerNorm", r"transformer_layer_\1/feedforward_layer_norm"),
    ])


def bert_inputs(seed: int, batch: int = 2, seq: int = 7):
    """(torch keywords, keras-hub keywords): the same token ids, segments and padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (batch, seq))
    seg = (np.arange(seq) >= seq // 2).astype(np.int64)[None].repeat(batch, 0)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, -2:] = 0  # padding in the second row
    return ({"input_ids": ids, "token_type_ids": seg, "attention_mask": mask},
            {"token_ids": ids, "segment_ids": seg, "padding_mask": mask.astype(bool)})


# ---------------------------------------------------------------------------- GPT-2
def torch_gpt2(seed: int = 0):
    import torch
    import transformers

    cfg = transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2Model(cfg).eval()
    _randomize_torch(model, seed, scale=0.3)
    return model


def mlx_gpt2(dtype: str = "float32"):
    import mlx.core as mx
    from mlx_lm.models import gpt2

    args = gpt2.ModelArgs(model_type="gpt2", n_ctx=POS, n_embd=H, n_head=HEADS, n_layer=LAYERS, n_positions=POS,
                          layer_norm_epsilon=1e-5, vocab_size=V)
    model = gpt2.Model(args).model  # the transformer without the tied head: hidden states, as GPT2Model
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    return model


def port_gpt2(src, dst) -> None:
    db.transfer(src, dst, mapping=[(r"(.*)", r"\1")], allow_narrowing=True)  # into bfloat16 twins too


# ---------------------------------------------------------------------------- Llama
def torch_llama(seed: int = 0):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=H, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POS,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _randomize_torch(model, seed, scale=0.3)
    return model


def mlx_llama(dtype: str = "float32"):
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=H, num_hidden_layers=LAYERS, intermediate_size=H,
                           num_attention_heads=HEADS, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V,
                           max_position_embeddings=POS, tie_word_embeddings=False, attention_bias=True,
                           mlp_bias=True)
    model = llama.Model(args)
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    return model


def port_llama(src, dst) -> None:
    db.transfer(src, dst, mapping=[(r"(.*)", r"\1")], allow_narrowing=True)  # into bfloat16 twins too


def lm_inputs(seed: int, batch: int = 2, seq: int = 7):
    return [np.random.default_rng(seed).integers(0, V, (batch, seq))]
