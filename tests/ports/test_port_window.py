"""Twins that agree only within the sliding window of attention: mlx-lm's Llama code (which mlx-lm
runs Mistral with) applies no window where transformers' Mistral does. The port proceeds, states
the window it was measured within, and writes what mlx-lm's own loader makes of the source. Tiny
real models, no downloads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402


def _mistral(path, window):
    import torch
    import transformers

    from dense_bridge.backends.torch._ports import _randomize

    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=512, sliding_window=window)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(model, seed=5)
    model.save_pretrained(path)


def test_a_window_the_destination_does_not_apply_is_stated_and_the_weights_move(tmp_path):
    import mlx.core as mx
    import mlx_lm.utils as mu

    _mistral(tmp_path / "T", window=4096)
    report = db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    said = [d for d in report.discrepancies if "sliding window" in d]
    assert said and "4096 tokens" in said[0], report.discrepancies
    assert report.certificate["verification"]["positions"] < 256  # measured within the twins' window
    got, _ = mu.load_model(Path(tmp_path / "P"))
    want, _ = mu.load_model(Path(tmp_path / "T"))
    from mlx.utils import tree_flatten

    g, w = dict(tree_flatten(got.parameters())), dict(tree_flatten(want.parameters()))
    assert g.keys() == w.keys()
    for k in w:
        assert np.array_equal(np.array(g[k].astype(mx.float32)), np.array(w[k].astype(mx.float32))), k


def test_without_a_window_nothing_is_said(tmp_path):
    _mistral(tmp_path / "T", window=None)
    report = db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    assert not [d for d in report.discrepancies if "sliding window" in d], report.discrepancies
    assert report.certificate["verification"]["positions"] == 256
