"""A keras-hub port builds the backbone's weight structure once per config: every verb that asks
for it (shapes, completion, the writer) gets the same answer, and another config its own. Real
keras-hub, a tiny config, nothing downloaded."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("keras_hub")


def test_the_structure_of_one_config_is_built_once_and_another_config_gets_its_own():
    from dense_bridge.backends.keras import _ports as kp

    common = {"model_type": "gemma", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
              "tie_word_embeddings": True}
    own = kp.port_own_config("keras-hub", common)
    first = kp._structure(own)
    assert kp._structure(dict(own)) is first  # an equal config: not built again
    shapes = kp.port_shapes("keras-hub", own)
    assert shapes and all(isinstance(s, tuple) for s in shapes.values())
    wider = kp.port_own_config("keras-hub", {**common, "intermediate_size": 96})
    other = kp.port_shapes("keras-hub", wider)
    assert other != shapes  # a different config is not answered from the first one's
    assert kp.port_shapes("keras-hub", own) == shapes


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e9


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_translating_a_config_whose_importer_builds_a_sub_model_allocates_none_of_it():
    """keras-hub's Gemma 3 importer builds its vision encoder while translating the config: 12 layers
    1024 wide (about 150M weights, 0.6 GB) stay declared, never allocated, now and at the next build."""
    import transformers

    from dense_bridge.backends.keras import _ports as kp

    hf = transformers.Gemma3Config().to_dict()
    hf["vision_config"].update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16)
    before = _rss_gb()
    kw = kp._import_config(kp._converter("gemma3"), hf)
    common = {"model_type": "gemma", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    kp._structure(kp.port_own_config("keras-hub", common))  # a later stateless build allocates none of it either
    assert kw.get("vision_encoder") is not None
    assert _rss_gb() - before < 0.3, f"{_rss_gb() - before:.2f} GB allocated"
