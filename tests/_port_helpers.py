"""What the real-model port tests share: tiny transformer sizes, skipping cleanly where a library is
missing, and parameters drawn at random (transformers zeroes biases and sets norm scales to 1)."""
from __future__ import annotations

import os

import numpy as np

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
V, H, HEADS, KV, FF, LAYERS, POS = 48, 32, 4, 2, 64, 2, 16


def transformers_or_skip():
    pytest.importorskip("torch")
    return pytest.importorskip("transformers")


def keras_hub_or_skip():
    from conftest import require_backend

    require_backend("keras")
    return pytest.importorskip("keras_hub")


def mlx_lm_or_skip():
    pytest.importorskip("mlx")
    return pytest.importorskip("mlx_lm")


def randomize(model, seed: int = 0, scale: float = 0.3) -> None:
    """Every parameter at random (transformers zeroes biases and sets norm scales to 1: a dropped
    bias or a swapped norm would go unseen)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name.lower() or ".ln_" in name or "ln_f" in name):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.2 if p.ndim == 1 else scale) * torch.randn(p.shape, generator=g))


def _close(a, b, what: str) -> float:
    """Within float32 rounding of a deep network: 1e-4 of the output's scale (a transposed or
    swapped projection is off by the scale itself)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err, scale = float(np.max(np.abs(a - b))), float(np.max(np.abs(a)))
    assert err <= 1e-4 * scale, f"{what}: max abs error {err:.3g} at output scale {scale:.3g}"
    return err


def _phi3_pair():
    transformers = transformers_or_skip()
    import torch

    kw = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              num_key_value_heads=KV, max_position_embeddings=POS, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(0)
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    randomize(phi3)
    return transformers, kw, phi3


#: Phi-3's fused qkv_proj ((heads + 2 kv_heads) * head_dim units) and gate_up_proj split by rules;
#: the grouped-query widths come from the destination layers themselves
PHI3_TO_LLAMA = [(r"(.*)\.qkv_proj", [r"\1.q_proj", r"\1.k_proj", r"\1.v_proj"]),
                 (r"(.*)\.gate_up_proj", [r"\1.gate_proj", r"\1.up_proj"]), (r"(.*)", r"\1")]
LLAMA_TO_PHI3 = [((r"(.*)\.q_proj", r"(.*)\.k_proj", r"(.*)\.v_proj"), r"\1.qkv_proj"),
                 ((r"(.*)\.gate_proj", r"(.*)\.up_proj"), r"\1.gate_up_proj"), (r"(.*)", r"\1")]
