"""A config setting one library stores in another type than the other reads (transformers' integer
``sliding_window_pattern``, a string of per-layer letters to mlx-lm) is written in the type the
destination reads where the config's list of layer kinds decides it, else refused naming the field,
its value and the type read (tests/ports/test_config_forms.py). Tiny real models, no downloads."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402


def test_a_setting_in_a_type_the_destination_does_not_read_is_written_in_its_type(tmp_path):
    import torch
    import transformers

    from dense_bridge.backends.torch import _ports as tp

    d = {k: v for k, v in tp._plain_floats(transformers.Exaone4Config().to_dict()).items()
         if k != "transformers_version"}
    d["model_type"] = "exaone4"
    small = tp.port_shrink("transformers", d)
    assert isinstance(small["sliding_window_pattern"], int)
    model = transformers.AutoModelForCausalLM.from_config(tp._config(small), dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "T")
    # the period is read from transformers' list of layer kinds as mlx-lm's string of per-layer letters
    # (tests/ports/test_config_forms.py); without that list it is refused naming the field, its value and type
    db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", progress=False)
    import json

    written = json.loads((tmp_path / "P" / "config.json").read_text())
    assert isinstance(written["sliding_window_pattern"], str), written["sliding_window_pattern"]
    assert len(written["sliding_window_pattern"]) == small["sliding_window_pattern"]
