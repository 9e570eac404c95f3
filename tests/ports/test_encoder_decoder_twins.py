"""db.port's twins of an encoder-decoder transformers model (BART): the whole model built, both
stacks shrunk alike, and the same token ids given to the encoder and the decoder on both sides
(transformers and keras-hub), so the two libraries' models run on one input and can be paired.

Real transformers and keras-hub models, tiny configs; nothing downloaded, nothing mocked.
"""
from __future__ import annotations

import numpy as np

from _port_helpers import keras_hub_or_skip as _keras_hub, transformers_or_skip as _transformers

IDS = np.random.default_rng(0).integers(3, 48, (1, 10))


def test_the_shrink_keeps_the_decoder_as_deep_as_the_encoder_and_the_twin_is_the_whole_model():
    transformers = _transformers()
    from dense_bridge.backends.torch import _ports as tp

    common = {**transformers.BartConfig().to_dict(), "architectures": ["BartForConditionalGeneration"]}
    assert common["encoder_layers"] == common["decoder_layers"] == 12
    small = tp.port_shrink("transformers", common)
    # transformers sizes the decoder's cache by num_hidden_layers (the encoder's count): a deeper
    # decoder fails its own forward (IndexError)
    assert small["decoder_layers"] == small["encoder_layers"] < 12
    assert tp._auto(small) is transformers.AutoModelForSeq2SeqLM  # not BartForCausalLM, the decoder alone


def test_both_libraries_get_the_ids_on_the_encoder_and_the_decoder_side():
    import torch

    transformers = _transformers()
    keras_hub = _keras_hub()
    from dense_bridge.backends.keras import _ports as kp
    from dense_bridge.backends.torch import _ports as tp

    cfg = transformers.BartConfig(vocab_size=48, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32)
    model = transformers.BartForConditionalGeneration(cfg).eval()
    given = tp.port_inputs("transformers", IDS, model)
    assert set(given) == {"input_ids", "decoder_input_ids"}
    assert np.array_equal(given["decoder_input_ids"], IDS)
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(IDS), decoder_input_ids=torch.as_tensor(IDS)).logits.numpy()
    assert np.array_equal(tp.port_logits("transformers", model, IDS), want)
    decoder_only = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=48, n_embd=16, n_layer=1,
                                                                        n_head=2, n_positions=32)).eval()
    assert isinstance(tp.port_inputs("transformers", IDS, decoder_only), list)

    backbone = keras_hub.models.BartBackbone(vocabulary_size=48, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=32)
    k_in = kp.port_inputs("keras-hub", IDS, backbone)
    assert set(k_in) == {"encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask"}
    assert np.array_equal(k_in["decoder_token_ids"], IDS)
    out = backbone(k_in)  # runs: every input the backbone declares is given
    assert "decoder_sequence_output" in out
