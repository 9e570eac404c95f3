"""Tied output heads as each library's loader ties them: mlx-lm ties a model's head to its
embedding only when the files hold no head (its ``sanitize``), transformers by its config. A port
of a tied transformers model writes no head for mlx-lm (as mlx-lm's own load of the source holds
none), and an mlx-lm directory without a head ports back to the tied transformers model. Tiny real
models, no downloads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402
from dense_bridge.checkpoints._safetensors import SafetensorsFile  # noqa: E402


def _keys(path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with SafetensorsFile(str(f)) as s:
            out.update({k: np.array(s.get(k), np.float32) for k in s.keys()})
    return out


def test_a_tied_head_is_left_to_the_loader_that_ties_it_both_ways(tmp_path):
    import torch
    import transformers
    from mlx.utils import tree_flatten

    import mlx_lm.utils as mu
    from dense_bridge.backends.torch import _ports as tp

    # the library's default config, shrunk by the port's own shrink (its layer pattern kept)
    d = {k: v for k, v in tp._plain_floats(transformers.Gemma3TextConfig().to_dict()).items()
         if k != "transformers_version"}
    d.update(model_type="gemma3_text", tie_word_embeddings=True)
    cfg = tp._config(tp.port_shrink("transformers", d))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tp._randomize(model, seed=3)
    model.save_pretrained(tmp_path / "T")
    assert not any("lm_head" in k for k in _keys(tmp_path / "T"))  # transformers stores a tied head once

    db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", progress=False)
    written = _keys(tmp_path / "P")
    assert not any("lm_head" in k for k in written), sorted(written)
    ported, _ = mu.load_model(Path(tmp_path / "P"))
    with open(tmp_path / "P" / "config.json") as f:
        own, _ = mu.load_model(Path(tmp_path / "T"), model_config=json.load(f))  # mlx-lm's own read of the source
    got, want = dict(tree_flatten(ported.parameters())), dict(tree_flatten(own.parameters()))
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(np.array(got[k]), np.array(want[k])) for k in want)

    # back: an mlx-lm directory with no head (tied by its loader) to the tied transformers model
    db.port(tmp_path / "P", tmp_path / "Q", to="transformers", progress=False)
    back, source = _keys(tmp_path / "Q"), _keys(tmp_path / "T")
    assert sorted(back) == sorted(source)
    assert all(np.array_equal(back[k], source[k]) for k in source)
