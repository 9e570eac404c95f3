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
