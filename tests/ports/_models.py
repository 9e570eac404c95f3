"""Tiny random transformers checkpoints of each architecture the port tests cover, saved with
``save_pretrained`` (no downloads): GQA, tied heads, fused projections, Conv1D, biases."""
from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

V, H, HEADS, KV, FF, LAYERS, POS = 96, 32, 4, 2, 64, 3, 512


def configs(transformers) -> dict:
    """name -> config of a tiny model of that architecture."""
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=POS,
                  bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return {
        # transformers 5 writes the rope base under rope_parameters, which mlx-lm 0.32 does not read
        "llama": transformers.LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False),
        "qwen2": transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0),
        "mistral": transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None),
        "qwen3": transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True),
        "gemma": transformers.GemmaConfig(**common, head_dim=16, hidden_activation="gelu_pytorch_tanh"),
        "phi3": transformers.Phi3Config(**{**common, "pad_token_id": 0}, tie_word_embeddings=False),
        "gpt2": transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                                        bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0),
    }


def save(transformers, name: str, path, seed: int = 0, dtype=None):
    """A tiny random ``name`` model saved into ``path``; returns the model."""
    import torch

    from _port_helpers import randomize

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs(transformers)[name]).eval()
    randomize(model, seed=seed)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return model
