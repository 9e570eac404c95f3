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


def save_as_pickles(model, path, max_shard_size=None) -> list[str]:
    """``model`` saved as transformers 4 saved it with ``safe_serialization=False`` (transformers 5
    writes safetensors only): ``config.json`` and ``torch.save`` of the state dict, tied tensors
    kept under both names (one storage), sharded by huggingface_hub's own splitter into
    ``pytorch_model-XXXXX-of-YYYYY.bin`` with ``pytorch_model.bin.index.json``. Returns the .bin names."""
    import json

    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    state = model.state_dict()
    split = split_torch_state_dict_into_shards(state, filename_pattern="pytorch_model{suffix}.bin",
                                               max_shard_size=max_shard_size or "5GB")
    for name, keys in split.filename_to_tensors.items():
        torch.save({k: state[k] for k in keys}, os.path.join(path, name))
    if split.is_sharded:
        with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f)
    return sorted(split.filename_to_tensors)
