"""db.port of a model whose layers all run one shared block (ALBERT: one layer group, its weights
stored once under fixed indices ``albert_layer_groups.0.albert_layers.0``) into keras-hub, whose
model holds that block once with no index, and back: the recipe learnt from the twins names the
source at its fixed indices. Judged against keras-hub's own import of the same directory, and the
round trip bit for bit. Real transformers and keras-hub; nothing downloaded, nothing mocked.
"""
from __future__ import annotations

import numpy as np

import dense_bridge as db

from _port_helpers import keras_hub_or_skip as _keras_hub, randomize as _randomize, transformers_or_skip as _transformers


def test_one_shared_layer_group_into_keras_hub_and_back(tmp_path):
    import keras
    from safetensors.numpy import load_file

    transformers = _transformers()
    keras_hub = _keras_hub()
    cfg = transformers.AlbertConfig(vocab_size=48, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                    num_labels=3, architectures=["AlbertForSequenceClassification"])
    model = transformers.AlbertForSequenceClassification(cfg).eval()
    _randomize(model)
    model.save_pretrained(tmp_path / "T")
    db.port(str(tmp_path / "T"), str(tmp_path / "K"), to="keras-hub", progress=False)
    got = keras_hub.models.AlbertBackbone.from_preset(str(tmp_path / "K"))
    want = keras_hub.models.AlbertBackbone.from_preset(str(tmp_path / "T"))  # keras-hub's own import
    assert len(got.weights) == len(want.weights)
    for g, w in zip(got.weights, want.weights):
        assert np.array_equal(keras.ops.convert_to_numpy(g), keras.ops.convert_to_numpy(w)), g.path
    db.port(str(tmp_path / "K"), str(tmp_path / "B"), to="transformers", progress=False)
    back, source = load_file(str(tmp_path / "B" / "model.safetensors")), load_file(str(tmp_path / "T" / "model.safetensors"))
    assert back.keys() == source.keys()
    for k in source:
        assert np.array_equal(back[k], source[k]), k
