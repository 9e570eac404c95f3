"""mapping="auto" on tables one library stores differently: a position table whose source reserves
leading rows (positions start after the padding id), and one token table held under several names.

Real tiny transformers models against keras-hub's own import of the same directory
(``from_preset``), variable for variable; nothing downloaded, nothing mocked.
"""
from __future__ import annotations

import json

import numpy as np

import dense_bridge as db

from _port_helpers import keras_hub_or_skip as _keras_hub, randomize as _randomize, transformers_or_skip as _transformers

V, H, HEADS, FF, LAYERS, POS = 48, 32, 4, 64, 2, 64
#: no padding id among them (transformers' RoBERTa gives padding tokens the padding position)
IDS = np.random.default_rng(0).integers(3, V, (1, 12))


def _same_keras(got, want) -> None:
    a = {w.path.split("/", 1)[1]: np.asarray(w) for w in got.weights}
    b = {w.path.split("/", 1)[1]: np.asarray(w) for w in want.weights}
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def _fresh(ref):
    return type(ref).from_config({k: v for k, v in ref.get_config().items() if k not in ("name", "trainable")})


def test_a_position_table_with_reserved_leading_rows_moves_as_its_last_rows(tmp_path):
    import torch

    transformers = _transformers()
    keras_hub = _keras_hub()
    cfg = transformers.RobertaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     intermediate_size=FF, max_position_embeddings=POS, type_vocab_size=1,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
                                     layer_norm_eps=1e-5)  # keras-hub RoBERTa's epsilon
    whole = transformers.RobertaForMaskedLM(cfg).eval()  # saved as keras-hub's importer reads it ("roberta.")
    _randomize(whole)
    src = whole.roberta
    with torch.no_grad():  # keras-hub's RoBERTa adds no token-type row: a zero one computes alike
        src.embeddings.token_type_embeddings.weight.zero_()
    whole.save_pretrained(tmp_path / "roberta")
    ref = keras_hub.models.RobertaBackbone.from_preset(str(tmp_path / "roberta"))  # keras-hub's own import
    assert ref.embeddings.position_embedding.position_embeddings.shape[0] == POS - 2
    dst = _fresh(ref)
    inputs = ([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)})
    # strict=False leaves the token-type table keras-hub lacks; verification judges the rest
    report = db.transfer(src, dst, mapping="auto", inputs=inputs, strict=False)
    _same_keras(dst, ref)
    assert any("position_embeddings" in str(r[0]) and "rows[2:]" in repr(r[1]) for r in report.rules)


def test_an_encoder_decoder_token_table_held_under_three_names_moves_once_with_both_position_tables(tmp_path):
    transformers = _transformers()
    keras_hub = _keras_hub()
    cfg = transformers.BartConfig(vocab_size=V, d_model=H, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                  encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FF,
                                  decoder_ffn_dim=FF, max_position_embeddings=POS, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, activation_function="gelu")
    src = transformers.BartModel(cfg).eval()
    _randomize(src)
    src.save_pretrained(tmp_path / "bart")
    path = tmp_path / "bart" / "config.json"  # keras-hub's importer reads the count the released configs hold
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_hidden_layers": LAYERS}))
    ref = keras_hub.models.BartBackbone.from_preset(str(tmp_path / "bart"))
    dst = _fresh(ref)
    ones = np.ones_like(IDS)
    inputs = ({"input_ids": IDS, "decoder_input_ids": IDS},
              {"encoder_token_ids": IDS, "encoder_padding_mask": ones, "decoder_token_ids": IDS,
               "decoder_padding_mask": ones})
    # strict: shared/encoder/decoder tables are one. verify=False: the tables are judged here against
    # keras-hub's own import (BART's norms, all of one shape, are paired by execution order, which the
    # two libraries' graphs do not share: not this test's subject)
    report = db.transfer(src, dst, mapping="auto", inputs=inputs, verify=False)
    pairs = [(w.path, np.asarray(w), np.asarray(r)) for w, r in zip(dst.weights, ref.weights)
             if "embedding" in w.path and "norm" not in w.path]
    assert len(pairs) == 3  # the token table, the encoder's and the decoder's position tables
    for path, got, want in pairs:
        assert np.array_equal(got, want), path
    assert sum("rows[2:]" in repr(r[1]) for r in report.rules) == 2


def test_a_token_type_row_the_destination_cannot_hold_is_refused_by_name(tmp_path):
    import pytest

    transformers = _transformers()
    keras_hub = _keras_hub()
    cfg = transformers.RobertaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                                     intermediate_size=FF, max_position_embeddings=POS, type_vocab_size=1,
                                     pad_token_id=1, layer_norm_eps=1e-5)
    src = transformers.RobertaModel(cfg, add_pooling_layer=False).eval()
    _randomize(src)  # a random token-type row: added to every token by transformers, absent from keras-hub
    dst = keras_hub.models.RobertaBackbone(vocabulary_size=V, num_layers=1, num_heads=HEADS, hidden_dim=H,
                                           intermediate_dim=FF, max_sequence_length=POS - 2, dropout=0.0)
    before = [np.asarray(w).copy() for w in dst.weights]
    inputs = ([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)})
    with pytest.raises(db.DenseBridgeError, match=r"token_type_embeddings.weight' \(1, 32\) have no counterpart in dst"):
        db.transfer(src, dst, mapping="auto", inputs=inputs)
    assert all(np.array_equal(np.asarray(w), x) for w, x in zip(dst.weights, before))  # nothing written
