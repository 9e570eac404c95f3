"""A text model mlx-lm implements twice (alone as ``"<name>_text"`` and inside its composite ``"<name>"``)
where the two differ: the port writes, and builds the source twin in, the form whose model holds the
weights. mlx-lm's ``llama4_text`` builds a dense feed-forward only; its ``llama4`` composite builds
transformers' mixture-of-experts layers (router, experts, shared expert). Real transformers and
mlx-lm, tiny configs, nothing downloaded; nothing but the models' parameter counts is computed."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402


def _configs(moe_layers: list[int]):
    """(the interchange config of a tiny transformers llama4_text, its weights' shapes)."""
    import transformers

    from dense_bridge.backends.torch import _ports as tp

    cfg = transformers.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=24,
                                        intermediate_size_mlp=48, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=1, moe_layers=moe_layers, max_position_embeddings=64,
                                        tie_word_embeddings=False)
    d = tp._plain_floats(cfg.to_dict())
    d.pop("transformers_version", None)
    own = tp.port_own_config("transformers", d)
    return tp.port_common_config("transformers", own), tp.port_shapes("transformers", own)


def test_experts_that_only_the_composite_holds_are_written_as_the_composite():
    from dense_bridge.backends.mlx import _ports as mp

    common, shapes = _configs([0, 1])
    own = mp.port_complete_config("mlx-lm", mp.port_own_config("mlx-lm", common), shapes)
    assert own["model_type"] == "llama4" and own["text_config"]["model_type"] == "llama4_text"
    # the composite holds exactly the source's weights (the text-only model would hold a dense MLP)
    built = {k: tuple(v) for k, v in mp.port_shapes("mlx-lm", own).items()}
    assert sum(int(np.prod(s)) for s in built.values()) == sum(int(np.prod(s)) for s in shapes.values())
    # a source directory in that form builds its twin in it too; one in the text-only form stays so
    small = mp.port_own_config("mlx-lm", common)
    assert mp.port_source_form("mlx-lm", small, mp.port_own_config("mlx-lm", common), built)["model_type"] \
        == "llama4"


def test_a_dense_text_model_stays_the_text_only_model():
    from dense_bridge.backends.mlx import _ports as mp

    common, shapes = _configs([])
    own = mp.port_complete_config("mlx-lm", mp.port_own_config("mlx-lm", common), shapes)
    assert own["model_type"] == "llama4_text"
    small = mp.port_own_config("mlx-lm", common)
    assert mp.port_source_form("mlx-lm", small, own, shapes) is small


def test_blocks_holding_different_numbers_of_weights_are_named_as_no_mapping_can_bridge():
    """A feed-forward 64 wide against one 48 wide: no mapping moves the one into the other, and the
    refusal says so (the two libraries build different layers), not only which calls differ."""
    import transformers
    from mlx_lm.models import llama

    cfg = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
    src = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=64, **cfg)).eval()
    dst = llama.Model(llama.ModelArgs.from_dict({"model_type": "llama", "intermediate_size": 48, **cfg}))
    ids = np.random.default_rng(0).integers(0, 64, (1, 5))
    with pytest.raises(db.ConversionError) as err:
        db.transfer(src, dst, mapping="auto", inputs=[ids])
    text = str(err.value)
    attn = 32 * 32 * 2 + 2 * 32 * 16  # q and o; k and v (2 key-value heads of 8: 16 wide)
    want_src, want_dst = attn + 3 * 32 * 64 + 2 * 32, attn + 3 * 32 * 48 + 2 * 32
    assert f"different layers numbered 0 for this config ({want_src} weights in src, {want_dst} in dst" in text, text
    assert text.index("different layers numbered 0") < text.index("differ in structure")  # the cause first
