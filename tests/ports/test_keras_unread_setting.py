"""Twins that compute different functions because the destination's model does not do what a
source setting asks, where the destination cannot list the settings it takes (keras-hub: its
config has its own names): the refusal still names the setting, found by putting each of the
source's settings that differ from its library's defaults back to the default. Real transformers
and keras-hub, a tiny model, nothing downloaded."""
from __future__ import annotations

import pytest

import dense_bridge as db
from dense_bridge.ports import PortMismatch

from _port_helpers import keras_hub_or_skip, transformers_or_skip


def test_a_setting_keras_hubs_model_does_not_do_is_named_in_the_refusal(tmp_path):
    transformers = transformers_or_skip()
    keras_hub_or_skip()
    import torch

    from _port_helpers import randomize

    cfg = transformers.GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=8, pad_token_id=0,
                                   use_bidirectional_attention=True)  # keras-hub's Gemma attends causally
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed=0)
    with torch.no_grad():  # float16-representable: keras-hub's Gemma importer rounds through float16
        for p in model.parameters():
            p.copy_(p.half().float())
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(PortMismatch) as err:
        db.port(tmp_path / "src", tmp_path / "out", to="keras-hub", progress=False)
    words = str(err.value)
    assert "use_bidirectional_attention=True" in words and "not its library's default" in words, words
    assert "no setting the port could change" not in words
    assert not (tmp_path / "out").exists()
