"""What the real-model port tests share: tiny transformer sizes, skipping cleanly where a library is
missing, and parameters drawn at random (transformers zeroes biases and sets norm scales to 1)."""
from __future__ import annotations

import os

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
