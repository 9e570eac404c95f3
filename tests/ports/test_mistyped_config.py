"""A config setting one library stores in another type than the other reads (transformers' integer
``sliding_window_pattern``, a string of per-layer letters to mlx-lm) is refused naming the field,
its value and the type read, not blamed on another field. Tiny real models, no downloads."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402


def test_a_setting_in_a_type_the_destination_does_not_read_is_refused_by_name(tmp_path):
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
    with pytest.raises(db.DenseBridgeError) as err:
        db.port(tmp_path / "T", tmp_path / "P", to="mlx-lm", progress=False)
    msg = str(err.value)
    assert f"sliding_window_pattern={small['sliding_window_pattern']!r} (int)" in msg and "reads a str" in msg, msg
    assert "rope_scaling" not in msg.split(":")[1], msg  # not blamed on a field that is merely unset
    assert not os.path.exists(tmp_path / "P")
