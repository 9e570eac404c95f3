"""db.port into and out of keras-hub presets, against keras-hub's own transformers importer.

Every tiny random model is saved by transformers' ``save_pretrained``, ported to a keras-hub
preset, loaded by keras-hub's own ``from_preset`` (backbone and causal LM, as they are) and
compared variable for variable with keras-hub's own import of the same transformers directory
(``from_preset`` on it), its logits with transformers'; then ported back and loaded by
``from_pretrained``: bit-identical to the original. Keras runs on the engine this process's Keras
configuration names (KERAS_BACKEND or keras.json), as every Keras test here does. Nothing is
downloaded; nothing is mocked.

Some of keras-hub's converters round weights through float16 (Qwen2, Mistral, Gemma): the sources
hold float16-representable values, so "keras-hub's own import" is exact too and comparable bit for bit.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import _close, keras_hub_or_skip, mlx_lm_or_skip, transformers_or_skip
from _models import V, configs

DECODERS = ["llama", "qwen2", "mistral", "gemma", "gpt2"]
IDS = np.random.default_rng(0).integers(0, V, (1, 40))


def _save(transformers, name, path):
    import torch

    from _port_helpers import randomize

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs(transformers)[name]).eval()
    randomize(model, seed=0)
    with torch.no_grad():  # values keras-hub's float16 round trip keeps (see the module docstring)
        for p in model.parameters():
            p.copy_(p.half().float())
    model.save_pretrained(path)
    return model


def _keras_weights(backbone) -> list[tuple[str, np.ndarray]]:
    import keras

    return [(v.path.split("/", 1)[-1], np.asarray(keras.ops.convert_to_numpy(v))) for v in backbone.weights]


def _keras_logits(task, ids):
    import keras

    out = task({"token_ids": ids.astype(np.int32), "padding_mask": np.ones_like(ids, np.int32)}, training=False)
    return np.asarray(keras.ops.convert_to_numpy(out))


def _torch_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


@pytest.fixture(scope="module", params=DECODERS)
def ported(request, tmp_path_factory):
    """(name, transformers model, its dir, the preset, the port report, the way back, its report)."""
    transformers = transformers_or_skip()
    keras_hub_or_skip()
    name = request.param
    root = tmp_path_factory.mktemp(name)
    src = _save(transformers, name, root / "src")
    report = db.port(root / "src", root / "preset", to="keras-hub")
    back_report = db.port(root / "preset", root / "back", to="transformers", verify="twins")
    return name, src, root, report, back_report


def test_the_preset_is_keras_hubs_own_import(ported):
    keras_hub = keras_hub_or_skip()
    name, src, root, report, _ = ported
    assert report.verification["passed"] and report.verification["mode"] == "full"
    assert report.verification["top1_agreement"] == 1.0
    mine = keras_hub.models.Backbone.from_preset(str(root / "preset"))  # as it is
    theirs = keras_hub.models.Backbone.from_preset(str(root / "src"))  # keras-hub's own importer
    assert type(mine) is type(theirs)
    assert {k: v for k, v in mine.get_config().items() if k != "name"} == \
        {k: v for k, v in theirs.get_config().items() if k != "name"}
    a, b = _keras_weights(mine), _keras_weights(theirs)
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{name}: {k}"
    task = keras_hub.models.CausalLM.from_preset(str(root / "preset"), preprocessor=None)
    _close(_torch_logits(src, IDS), _keras_logits(task, IDS), f"{name} logits, keras-hub vs transformers")
    assert all(t["exact"] for t in report.certificate["tensors"].values())
    assert db.verify_port(root / "preset").passed


def test_the_way_back_is_bit_identical(ported):
    transformers = transformers_or_skip()
    import torch

    name, src, root, _, back_report = ported
    assert back_report.verification["passed"]
    back = transformers.AutoModelForCausalLM.from_pretrained(root / "back").eval()
    a, b = src.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name}: {k}"
    assert db.verify_port(root / "back").passed


def test_mlx_lm_into_keras_hub_and_back(tmp_path):
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    mlx_lm_or_skip()
    _save(transformers, "qwen2", tmp_path / "src")
    db.port(tmp_path / "src", tmp_path / "mlx", to="mlx-lm", verify="twins")
    report = db.port(tmp_path / "mlx", tmp_path / "preset", to="keras-hub", verify="twins")
    assert report.source == "mlx-lm" and report.verification["passed"]
    mine = keras_hub.models.Backbone.from_preset(str(tmp_path / "preset"))
    theirs = keras_hub.models.Backbone.from_preset(str(tmp_path / "src"))
    for (k, x), (_, y) in zip(_keras_weights(mine), _keras_weights(theirs)):
        assert np.array_equal(x, y), k

    # and out of keras-hub into mlx-lm: mlx-lm's own loader reads what the first port wrote, bit for bit
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    db.port(tmp_path / "preset", tmp_path / "mlx2", to="mlx-lm", verify="twins")
    want = dict(tree_flatten(load_model(Path(tmp_path / "mlx"))[0].parameters()))
    got = dict(tree_flatten(load_model(Path(tmp_path / "mlx2"))[0].parameters()))
    assert want.keys() == got.keys()
    for k in want:
        assert mx.array_equal(want[k], got[k]).item(), k


def test_a_model_type_keras_hub_does_not_import_is_refused_naming_what_it_offers(tmp_path):
    transformers = transformers_or_skip()
    keras_hub_or_skip()
    cfg = transformers.Phi3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    with pytest.raises(db.ConversionError, match="'phi3'") as err:
        db.port(tmp_path / "src", tmp_path / "out", to="keras-hub")
    assert "llama" in str(err.value) and "qwen2" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_preset_whose_config_the_importer_cannot_give_back_is_refused_naming_the_key(tmp_path):
    """keras-hub's Llama importer does not read rms_norm_eps: a preset with another epsilon has no
    transformers config that imports back to it."""
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    _save(transformers, "llama", tmp_path / "src")
    backbone = keras_hub.models.Backbone.from_preset(str(tmp_path / "src"))
    config = {k: v for k, v in backbone.get_config().items() if k != "name"}
    other = type(backbone).from_config({**config, "layer_norm_epsilon": 1e-3})
    keras_hub.models.CausalLM.from_preset  # noqa: B018 - the task class is keras-hub's own
    task = keras_hub.models.Llama3CausalLM(backbone=other, preprocessor=None)
    task.save_to_preset(str(tmp_path / "preset"))
    with pytest.raises(db.ConversionError, match="layer_norm_epsilon"):
        db.port(tmp_path / "preset", tmp_path / "out", to="transformers")
    assert not (tmp_path / "out").exists()
    assert json.loads((tmp_path / "preset" / "config.json").read_text())["config"]["layer_norm_epsilon"] == 1e-3


def _tiny_tokenizer(transformers, path):
    """A byte-level BPE tokenizer trained here on a few sentences, saved by transformers."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world", "the port keeps the tokenizer", "keras hub presets"] * 4,
                            vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)


def test_a_transformers_tokenizer_is_translated_by_keras_hubs_importer(tmp_path):
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    _save(transformers, "qwen2", tmp_path / "src")
    _tiny_tokenizer(transformers, tmp_path / "src")
    report = db.port(tmp_path / "src", tmp_path / "preset", to="keras-hub", verify="twins")
    assert "tokenizer.json" in report.certificate["destination"]["files"]
    mine = keras_hub.models.Tokenizer.from_preset(str(tmp_path / "preset"))
    theirs = keras_hub.models.Tokenizer.from_preset(str(tmp_path / "src"))
    text = "hello the port"
    assert np.array_equal(np.asarray(mine(text)), np.asarray(theirs(text)))
    task = keras_hub.models.CausalLM.from_preset(str(tmp_path / "preset"))  # with its preprocessor
    assert task.preprocessor is not None
    assert db.verify_port(tmp_path / "preset").passed
    # keras-hub's own tokenizer has no translation back into transformers': refused naming its file
    with pytest.raises(db.ConversionError, match="tokenizer.json"):
        db.port(tmp_path / "preset", tmp_path / "back", to="transformers")
    assert not (tmp_path / "back").exists()


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A BERT sequence classifier ported to a keras-hub TextClassifier preset and back."""
    transformers = transformers_or_skip()
    keras_hub_or_skip()
    import torch

    from _port_helpers import randomize

    root = tmp_path_factory.mktemp("bert")
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=512, type_vocab_size=2,
                                  hidden_act="gelu_new",  # keras-hub's BERT computes the tanh gelu
                                  num_labels=3, architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    src = transformers.BertForSequenceClassification(cfg).eval()
    randomize(src, seed=0)
    src.save_pretrained(root / "src")
    report = db.port(root / "src", root / "preset", to="keras-hub")
    back_report = db.port(root / "preset", root / "back", to="transformers", verify="twins")
    return src, root, report, back_report


def test_bert_classifier_into_a_keras_hub_text_classifier_with_its_head_and_back(bert):
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    import keras
    import torch

    src, root, report, back_report = bert
    assert report.verification["passed"] and report.verification["mode"] == "full"
    mine = keras_hub.models.Backbone.from_preset(str(root / "preset"))
    theirs = keras_hub.models.Backbone.from_preset(str(root / "src"))  # keras-hub's own importer
    for (k, x), (_, y) in zip(_keras_weights(mine), _keras_weights(theirs)):
        assert np.array_equal(x, y), k
    task = keras_hub.models.TextClassifier.from_preset(str(root / "preset"), preprocessor=None)
    assert task.num_classes == 3 and (root / "preset" / "task.weights.h5").is_file()
    got = np.asarray(keras.ops.convert_to_numpy(task({"token_ids": IDS.astype(np.int32),
                                                      "segment_ids": np.zeros_like(IDS, np.int32),
                                                      "padding_mask": np.ones_like(IDS, np.int32)},
                                                     training=False)))
    with torch.no_grad():
        want = src(torch.as_tensor(IDS)).logits.numpy()
    _close(want, got, "BERT classifier logits, keras-hub vs transformers")
    assert db.verify_port(root / "preset").passed

    assert back_report.verification["passed"]
    back = transformers.AutoModelForSequenceClassification.from_pretrained(root / "back").eval()
    a, b = src.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_sharded_keras_hub_preset_is_read_shard_by_shard(tmp_path):
    """keras-hub saves a big backbone as shards named by model.weights.json: ported as one."""
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    src = _save(transformers, "llama", tmp_path / "src")
    task = keras_hub.models.CausalLM.from_preset(str(tmp_path / "src"), preprocessor=None)
    task.save_to_preset(str(tmp_path / "preset"), max_shard_size=20e3 / 2 ** 30)  # 20 kB shards
    shards = sorted(p.name for p in (tmp_path / "preset").glob("model_*.weights.h5"))
    assert len(shards) > 2 and not (tmp_path / "preset" / "model.weights.h5").exists()
    report = db.port(tmp_path / "preset", tmp_path / "back", to="transformers", verify="twins")
    assert report.source == "keras-hub"
    import torch

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    a, b = src.state_dict(), back.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert db.verify_port(tmp_path / "back").passed


def test_a_backbone_class_two_model_types_share_goes_back_as_its_own_with_its_flags(tmp_path):
    """keras-hub's Gemma and Gemma 2 importers both make a GemmaBackbone; Gemma 2's query scale flag
    is head_dim == query_pre_attn_scalar in transformers' config (no number alone gives it): the way
    back finds the model type whose importer gives the preset's config back, the two numbers kept
    equal, and is bit-identical to the source."""
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    import torch

    from _port_helpers import randomize

    cfg = transformers.Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    query_pre_attn_scalar=8, sliding_window=16, pad_token_id=0)
    src = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(src, seed=0)
    with torch.no_grad():  # float16-representable (see the module docstring)
        for p in src.parameters():
            p.copy_(p.half().float())
    src.save_pretrained(tmp_path / "src")
    db.port(tmp_path / "src", tmp_path / "preset", to="keras-hub", verify="twins")
    mine = keras_hub.models.Backbone.from_preset(str(tmp_path / "preset"))
    theirs = keras_hub.models.Backbone.from_preset(str(tmp_path / "src"))
    assert mine.get_config()["query_head_dim_normalize"] and mine.get_config()["use_post_ffw_norm"]
    for (k, x), (_, y) in zip(_keras_weights(mine), _keras_weights(theirs)):
        assert np.array_equal(x, y), k
    db.port(tmp_path / "preset", tmp_path / "back", to="transformers", verify="twins")
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back_cfg["model_type"] == "gemma2" and back_cfg["query_pre_attn_scalar"] == back_cfg["head_dim"] == 8
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    a, b = src.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_keras_hub_preset_whose_flags_compare_two_numbers_keeps_them_in_its_twins(tmp_path):
    """A Gemma 2 preset with head_dim == query_pre_attn_scalar wider than the twins' head width: the
    twins' shrink keeps the two equal (else keras-hub's importer would give the keras-hub twin
    another query scale and the twins would disagree), so the preset ports back to transformers."""
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    import torch

    from _port_helpers import randomize

    cfg = transformers.Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                                    query_pre_attn_scalar=48, sliding_window=16, pad_token_id=0)
    src = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(src, seed=0)
    with torch.no_grad():  # float16-representable (see the module docstring)
        for p in src.parameters():
            p.copy_(p.half().float())
    src.save_pretrained(tmp_path / "src")
    task = keras_hub.models.CausalLM.from_preset(str(tmp_path / "src"), preprocessor=None)  # keras-hub's import
    assert task.backbone.get_config()["query_head_dim_normalize"]
    task.save_to_preset(str(tmp_path / "preset"))
    report = db.port(tmp_path / "preset", tmp_path / "back", to="transformers", verify="twins")
    assert report.verification["passed"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.query_pre_attn_scalar == back.config.head_dim == 48
    a, b = src.state_dict(), back.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
