"""Real ports as declarations: split and fused layers, ties, transforms, against the libraries' own
converters (keras-hub's ``from_preset`` and mlx-lm's ``load_model`` on a local ``save_pretrained``
directory), tiny random configs, no downloads.

Every weight dense_bridge moves is compared bit for bit with what the library's own converter
loads from the same directory; outputs are compared within float32 rounding of a deep network.
"""
from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import FF, H, HEADS, KV, LAYERS, POS, V  # noqa: F401  tiny sizes shared by the port tests
from _port_helpers import keras_hub_or_skip as _keras_hub, mlx_lm_or_skip as _mlx_lm  # noqa: F401
from _port_helpers import randomize as _randomize, transformers_or_skip as _transformers  # noqa: F401
from _port_helpers import LLAMA_TO_PHI3, PHI3_TO_LLAMA, _close, _phi3_pair  # noqa: F401


def _same_keras_weights(got, want) -> None:
    """Every variable of two Keras models equal bit for bit, paired by path (root name aside)."""
    a = {w.path.split("/", 1)[1]: np.asarray(w) for w in got.weights}
    b = {w.path.split("/", 1)[1]: np.asarray(w) for w in want.weights}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def _same_torch_weights(got, want) -> None:
    import torch

    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------- GPT-2 <-> keras-hub
def _gpt2_rules(prefix: str = "transformer\\.") -> list:
    """transformers GPT-2 paths -> keras-hub GPT2Backbone paths; c_attn SPLITS into query/key/value."""
    L = r"transformer_layer_\1"
    return [(prefix + r"wte", "token_embedding"), (prefix + r"wpe", "position_embedding"),
            (prefix + r"h\.(\d+)\.attn\.c_attn",
             [L + "/self_attention/query", L + "/self_attention/key", L + "/self_attention/value"]),
            (prefix + r"h\.(\d+)\.attn\.c_proj", L + "/self_attention/attention_output"),
            (prefix + r"h\.(\d+)\.ln_1", L + "/self_attention_layer_norm"),
            (prefix + r"h\.(\d+)\.mlp\.c_fc", L + "/feedforward_intermediate_dense"),
            (prefix + r"h\.(\d+)\.mlp\.c_proj", L + "/feedforward_output_dense"),
            (prefix + r"h\.(\d+)\.ln_2", L + "/feedforward_layer_norm"), (prefix + r"ln_f", "layer_norm")]


def _gpt2_back_rules(prefix: str = "transformer.") -> list:
    """keras-hub GPT2Backbone -> transformers GPT2LMHeadModel; query/key/value CONCATENATE into c_attn."""
    T, L = prefix + r"h.\1", r"transformer_layer_(\d+)"
    return [("token_embedding", prefix + "wte"), ("position_embedding", prefix + "wpe"),
            ((L + "/self_attention/query", L + "/self_attention/key", L + "/self_attention/value"), T + ".attn.c_attn"),
            (L + "/self_attention/attention_output", T + ".attn.c_proj"),
            (L + "/self_attention_layer_norm", T + ".ln_1"),
            (L + "/feedforward_intermediate_dense", T + ".mlp.c_fc"),
            (L + "/feedforward_output_dense", T + ".mlp.c_proj"),
            (L + "/feedforward_layer_norm", T + ".ln_2"), ("layer_norm", prefix + "ln_f")]


def _gpt2(tmp_path):
    transformers = _transformers()
    keras_hub = _keras_hub()
    import torch

    cfg = transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    src = transformers.GPT2LMHeadModel(cfg).eval()
    _randomize(src)
    src.save_pretrained(tmp_path / "gpt2")
    ref = keras_hub.models.GPT2Backbone.from_preset(str(tmp_path / "gpt2"))

    def fresh():
        return keras_hub.models.GPT2Backbone(vocabulary_size=V, num_layers=LAYERS, num_heads=HEADS, hidden_dim=H,
                                             intermediate_dim=4 * H, max_sequence_length=POS, dropout=0.0)
    return transformers, cfg, src, ref, fresh


def test_gpt2_splits_into_keras_hub_and_concatenates_back(tmp_path):
    transformers, cfg, src, ref, fresh = _gpt2(tmp_path)
    import torch

    dst = fresh()
    report = db.transfer(src, dst, mapping=_gpt2_rules())
    _same_keras_weights(dst, ref)  # keras-hub's own converter, bit for bit
    # lm_head is wte's weight in torch and keras-hub's token_embedding(reverse=True): a tie, not a layer
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert report.not_moved_src == [] and report.not_moved_dst == []
    split = [m for m in report.moved if m[0] == "transformer.h.0.attn.c_attn"]
    assert [d for _, d, _ in split] == [f"transformer_layer_0/self_attention/{n}" for n in ("query", "key", "value")]
    assert all("split" in what and "bias" in what for _, _, what in split)

    ids = np.random.default_rng(0).integers(0, V, (2, 7))
    with torch.no_grad():
        want = src.transformer(torch.tensor(ids)).last_hidden_state.numpy()
    got = dst({"token_ids": ids, "padding_mask": np.ones((2, 7), bool)})
    _close(want, np.asarray(got), "gpt2 hidden states")

    back = transformers.GPT2LMHeadModel(cfg).eval()
    report = db.transfer(dst, back, mapping=_gpt2_back_rules())
    _same_torch_weights(back, src)  # the way back is exact: split then concatenated
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    joined = [m for m in report.moved if m[1] == "transformer.h.1.attn.c_attn"]
    assert len(joined) == 1 and "concatenated" in joined[0][2]


def test_compare_models_judges_a_fused_layer_against_its_split_counterparts(tmp_path):
    transformers, cfg, src, ref, fresh = _gpt2(tmp_path)
    dst = fresh()
    db.transfer(src, dst, mapping=_gpt2_rules())
    ids = np.random.default_rng(1).integers(0, V, (2, 7))
    inputs = ({"input_ids": ids}, {"token_ids": ids, "padding_mask": np.ones((2, 7), bool)})
    report = db.testing.compare_models(src.transformer, dst, inputs, mapping=_gpt2_rules(""))
    assert report.passed, report
    fused = "transformer_layer_0/self_attention/query+transformer_layer_0/self_attention/key+" \
            "transformer_layer_0/self_attention/value"
    assert ("h.0.attn.c_attn", fused) in report.pairs
    assert {q.quantity for layer in report.layers if fused in layer.layer_type for q in layer.quantities} >= \
        {"input", "output", "dL/dkernel", "dL/dbias"}
    # the way back: three split layers judged as the one fused layer they concatenate into
    back = db.testing.compare_models(dst, src.transformer, (inputs[1], inputs[0]), mapping=_gpt2_back_rules(""))
    assert back.passed, back
    # each split member (a keras-hub EinsumDense taking and giving per-head shapes) run alone, both ways
    for forced in (db.testing.compare_models(src.transformer, dst, inputs, mapping=_gpt2_rules(""), isolated=True),
                   db.testing.compare_models(dst, src.transformer, (inputs[1], inputs[0]),
                                             mapping=_gpt2_back_rules(""), isolated=True)):
        assert forced.passed, forced
        assert not any("cascaded mode" in n for n in forced.notes), forced.notes
    # key and value swapped in the split: found, at that fused layer
    bad = _gpt2_rules()
    bad[2] = (bad[2][0], [bad[2][1][0], bad[2][1][2], bad[2][1][1]])
    planted = fresh()
    db.transfer(src, planted, mapping=bad)
    report = db.testing.compare_models(src.transformer, planted, inputs, mapping=_gpt2_rules(""))
    assert not report.passed and report.first_divergence == fused


def test_report_rules_are_the_complete_mapping_reusable_as_json(tmp_path):
    transformers, cfg, src, ref, fresh = _gpt2(tmp_path)
    first = fresh()
    report = db.transfer(src, first, mapping=_gpt2_rules())
    rules = json.loads(json.dumps(report.rules))  # no functions: JSON-able
    # one exact rule per layer move: 2 tables, 6 per block (c_attn's split, c_proj, c_fc, mlp c_proj, 2 norms), ln_f
    assert len(rules) == 2 + 6 * LAYERS + 1
    assert ["transformer\\.h\\.0\\.attn\\.c_attn", [f"transformer_layer_0/self_attention/{n}" for n in
                                                         ("query", "key", "value")]] in rules
    second = fresh()  # another instance: Keras paths omit the root model's name
    again = db.transfer(src, second, mapping=rules)
    _same_keras_weights(second, ref)
    assert again.moved == report.moved and again.rules == report.rules


# --------------------------------------------------------------------- Phi-3 <-> a split Llama twin
def test_phi3_fused_grouped_query_into_a_split_llama_twin_and_back(tmp_path):
    import torch

    transformers, kw, phi3 = _phi3_pair()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    report = db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA)
    assert report.not_moved_src == [] and report.not_moved_dst == []
    attn = phi3.model.layers[0].self_attn
    w = attn.qkv_proj.weight.detach()
    q, k = HEADS * H // HEADS, KV * H // HEADS
    assert torch.equal(llama.model.layers[0].self_attn.k_proj.weight, w[q:q + k])  # 16 of 64 units: grouped-query
    ids = np.random.default_rng(0).integers(0, V, (2, 7))
    with torch.no_grad():
        _close(phi3(torch.tensor(ids)).logits.numpy(), llama(torch.tensor(ids)).logits.numpy(), "phi3 vs llama")
    assert db.testing.compare_models(phi3, llama, [ids], mapping=PHI3_TO_LLAMA).passed
    assert db.testing.compare_models(llama, phi3, [ids], mapping=LLAMA_TO_PHI3).passed

    back = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    db.transfer(llama, back, mapping=LLAMA_TO_PHI3)
    _same_torch_weights(back, phi3)

    # mlx-lm's own loader reads the same fused layout from a save_pretrained directory: the split
    # layers joined again are its qkv_proj bit for bit
    if importlib.util.find_spec("mlx_lm") is not None and importlib.util.find_spec("mlx") is not None:
        from mlx_lm.utils import load_model

        phi3.save_pretrained(tmp_path / "phi3")
        ref, _ = load_model(tmp_path / "phi3")
        joined = torch.cat([getattr(llama.model.layers[1].self_attn, n).weight for n in ("q_proj", "k_proj", "v_proj")])
        np.testing.assert_array_equal(np.asarray(ref.model.layers[1].self_attn.qkv_proj.weight),
                                      joined.detach().numpy())


def test_a_split_whose_widths_do_not_add_up_is_refused_and_nothing_is_written():
    import torch

    transformers, kw, phi3 = _phi3_pair()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    wrong = [(r"(.*)\.qkv_proj", [r"\1.q_proj", r"\1.k_proj"]), (r"(.*)\.v_proj", r"\1.v_proj")] + PHI3_TO_LLAMA[1:]
    with pytest.raises(db.ConversionError, match=r"src has 64 units but the dst layers .* have \[32, 16\]"):
        db.transfer(phi3, llama, mapping=wrong)
    for k, v in llama.state_dict().items():
        assert torch.equal(v, before[k]), k


# --------------------------------------------------------------------- RoBERTa -> keras-hub, a transform
def test_roberta_into_keras_hub_with_a_transformed_position_table(tmp_path):
    transformers = _transformers()
    keras_hub = _keras_hub()
    import torch

    cfg = transformers.RobertaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     intermediate_size=FF, max_position_embeddings=POS + 2, type_vocab_size=1,
                                     pad_token_id=1, hidden_act="gelu", hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    full = transformers.RobertaForMaskedLM(cfg).eval()
    _randomize(full)
    src = full.roberta
    with torch.no_grad():  # keras-hub's RoBERTa has no token-type table: the source's one row must be 0
        src.embeddings.token_type_embeddings.weight.zero_()
    full.save_pretrained(tmp_path / "roberta")
    ref = keras_hub.models.RobertaBackbone.from_preset(str(tmp_path / "roberta"))
    dst = keras_hub.models.RobertaBackbone(vocabulary_size=V, num_layers=LAYERS, num_heads=HEADS, hidden_dim=H,
                                           intermediate_dim=FF, max_sequence_length=POS, dropout=0.0)
    mapping = {"embeddings.word_embeddings": "embeddings/token_embedding",
               # RoBERTa's 2 leading rows are its padding offset; keras-hub starts at position 0
               "embeddings.position_embeddings.weight": ("embeddings/position_embedding/embeddings", lambda a: a[2:]),
               "embeddings.LayerNorm": "embeddings_layer_norm"}
    for i in range(LAYERS):
        t, k = f"encoder.layer.{i}.", f"transformer_layer_{i}/"
        mapping.update({t + f"attention.self.{n}": k + f"self_attention_layer/{n}" for n in ("query", "key", "value")})
        mapping.update({t + "attention.output.dense": k + "self_attention_layer/attention_output",
                        t + "attention.output.LayerNorm": k + "self_attention_layer_norm",
                        t + "intermediate.dense": k + "feedforward_intermediate_dense",
                        t + "output.dense": k + "feedforward_output_dense",
                        t + "output.LayerNorm": k + "feedforward_layer_norm"})
    report = db.transfer(src, dst, mapping=mapping)
    _same_keras_weights(dst, ref)
    assert report.not_moved_src == ["embeddings.token_type_embeddings.weight"] and report.not_moved_dst == []
    assert ("embeddings.position_embeddings.weight", "embeddings/position_embedding/embeddings",
            "parameter, transformed by <lambda>") in report.moved
    assert callable(report.rules[-1][1][1]) or any(isinstance(r[1], tuple) for r in report.rules)

    ids = np.random.default_rng(0).integers(2, V, (2, 7))  # no padding token: positions 2.. in both
    with torch.no_grad():
        want = src(input_ids=torch.tensor(ids)).last_hidden_state.numpy()
    got = dst({"token_ids": ids, "padding_mask": np.ones((2, 7), bool)})
    _close(want, np.asarray(got), "roberta sequence output")

    # the report's rules hold the transform: reusable as mapping= in Python
    again = keras_hub.models.RobertaBackbone(vocabulary_size=V, num_layers=LAYERS, num_heads=HEADS, hidden_dim=H,
                                             intermediate_dim=FF, max_sequence_length=POS, dropout=0.0)
    db.transfer(src, again, mapping=report.rules)
    _same_keras_weights(again, ref)

    # a transform's result is checked like any other value: the wrong shape writes nothing
    before = np.asarray(dst.embeddings.position_embedding.position_embeddings).copy()
    with pytest.raises(db.ConversionError, match=r"\(18, 32\) does not fit dst parameter"):
        db.transfer(src, dst, mapping={**mapping, "embeddings.position_embeddings.weight":
                                       ("embeddings/position_embedding/embeddings", lambda a: a)})
    np.testing.assert_array_equal(np.asarray(dst.embeddings.position_embedding.position_embeddings), before)
    with pytest.raises(db.ConversionError, match="transform raised ZeroDivisionError"):
        db.transfer(src, dst, mapping={**mapping, "embeddings.position_embeddings.weight":
                                       ("embeddings/position_embedding/embeddings", lambda a: 1 / 0)})


# --------------------------------------------------------------------- tied Qwen2 -> mlx-lm
def _qwen2(tmp_path, tied: bool = True):
    transformers = _transformers()
    import torch

    # transformers 5 writes rope_parameters only; mlx-lm's Qwen2 then takes its own default 1e6
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=POS,
                                   rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    src = transformers.Qwen2ForCausalLM(cfg).eval()
    _randomize(src)
    return transformers, cfg, src


def test_identity_rule_on_tied_qwen2_into_mlx_lm(tmp_path):
    _mlx_lm()
    import mlx.core as mx
    import torch
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2
    from mlx_lm.utils import load_model

    transformers, cfg, src = _qwen2(tmp_path)
    assert src.lm_head.weight is src.model.embed_tokens.weight
    src.save_pretrained(tmp_path / "qwen2")
    ref, _ = load_model(tmp_path / "qwen2")
    dst = qwen2.Model(qwen2.ModelArgs.from_dict(json.loads((tmp_path / "qwen2" / "config.json").read_text())))
    assert not hasattr(dst, "lm_head")  # mlx-lm calls embed_tokens.as_linear
    report = db.transfer(src, dst, mapping=[("(.*)", r"\1")])  # lm_head: tied, follows embed_tokens
    assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert report.not_moved_src == [] and report.not_moved_dst == []
    got, want = dict(tree_flatten(dst.parameters())), dict(tree_flatten(ref.parameters()))
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    ids = np.random.default_rng(0).integers(0, V, (2, 7))
    with torch.no_grad():
        logits = src(torch.tensor(ids)).logits.numpy()
    _close(logits, np.asarray(dst(mx.array(ids))), "qwen2 logits")
    compared = db.testing.compare_models(src, dst, [ids], mapping=[("(.*)", r"\1")])  # the tied head too
    assert compared.passed, compared

    # a tied source head fills an untied destination head with the embedding's values
    untied = qwen2.Model(qwen2.ModelArgs.from_dict({**json.loads((tmp_path / "qwen2" / "config.json").read_text()),
                                                    "tie_word_embeddings": False}))
    report = db.transfer(src, untied, mapping=[("(.*)", r"\1")])
    np.testing.assert_array_equal(np.asarray(untied.lm_head.weight), src.lm_head.weight.detach().numpy())
    assert ("lm_head", "lm_head", "kernel (canonical)") in report.moved


def test_an_untied_head_into_a_tied_one_names_the_tie():
    import torch

    transformers, cfg, tied = _qwen2(None)
    _, _, untied = _qwen2(None, tied=False)
    with torch.no_grad():
        untied.lm_head.weight.add_(1.0)  # the head differs from the table: the tie cannot hold both
    before = tied.model.embed_tokens.weight.detach().clone()
    with pytest.raises(db.ConversionError, match=r"'lm_head\.weight' gets both .* tied to 'model\.embed_tokens\.weight'"):
        db.transfer(untied, tied, mapping=[("(.*)", r"\1")])
    assert torch.equal(tied.model.embed_tokens.weight, before)
    # tied into tied: the same tie on both sides, kept (moves once, with the embedding)
    _, _, other = _qwen2(None)
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(2.0)
    report = db.transfer(other, tied, mapping=[("(.*)", r"\1")])
    assert report.tied["lm_head.weight"] == "model.embed_tokens.weight"
    assert torch.equal(tied.lm_head.weight, other.model.embed_tokens.weight)


# --------------------------------------------------------------------- Mistral -> keras-hub, untied head
def test_mistral_into_keras_hub_with_its_untied_head(tmp_path):
    transformers = _transformers()
    keras_hub = _keras_hub()
    import torch

    cfg = transformers.MistralConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=POS,
                                     rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=None)
    torch.manual_seed(0)
    src = transformers.MistralForCausalLM(cfg).eval()
    _randomize(src)
    with torch.no_grad():  # keras-hub's Mistral converter rounds through float16: start from such values
        for p in src.parameters():
            p.copy_(p.half().float())
    src.save_pretrained(tmp_path / "mistral")
    ref = keras_hub.models.MistralBackbone.from_preset(str(tmp_path / "mistral"))
    config = {k: v for k, v in ref.get_config().items() if k not in ("name", "trainable")}
    dst = keras_hub.models.MistralBackbone.from_config(config)
    L = r"transformer_layer_\1"
    rules = [(r"model\.embed_tokens", "token_embedding"), (r"lm_head", "token_embedding/reverse_embeddings"),
             (r"model\.layers\.(\d+)\.self_attn\.q_proj", L + "/self_attention/query"),
             (r"model\.layers\.(\d+)\.self_attn\.k_proj", L + "/self_attention/key"),
             (r"model\.layers\.(\d+)\.self_attn\.v_proj", L + "/self_attention/value"),
             (r"model\.layers\.(\d+)\.self_attn\.o_proj", L + "/self_attention/attention_output"),
             (r"model\.layers\.(\d+)\.mlp\.gate_proj", L + "/feedforward_gate_dense"),
             (r"model\.layers\.(\d+)\.mlp\.up_proj", L + "/feedforward_intermediate_dense"),
             (r"model\.layers\.(\d+)\.mlp\.down_proj", L + "/feedforward_output_dense"),
             (r"model\.layers\.(\d+)\.input_layernorm", L + "/self_attention_layernorm"),
             (r"model\.layers\.(\d+)\.post_attention_layernorm", L + "/feedforward_layernorm"),
             (r"model\.norm", "sequence_output_layernorm")]
    # keras-hub's untied head: reverse_embeddings (hidden, vocab), an (in, out) linear map
    head = db.linear_layers(dst)["token_embedding/reverse_embeddings"]
    assert db.get_params(head)["kernel"].shape == (H, V)
    report = db.transfer(src, dst, mapping=rules)
    assert ("lm_head", "token_embedding/reverse_embeddings", "kernel (canonical)") in report.moved
    assert report.not_moved_src == [] and report.not_moved_dst == []
    _same_keras_weights(dst, ref)
    ids = np.random.default_rng(0).integers(0, V, (2, 7))
    with torch.no_grad():
        want = src(torch.tensor(ids)).logits.numpy()
    hidden = dst({"token_ids": ids, "padding_mask": np.ones((2, 7), bool)})
    _close(want, np.asarray(dst.token_embedding(hidden, reverse=True)), "mistral logits")
    np.testing.assert_array_equal(db.get_params(head)["kernel"], src.lm_head.weight.detach().numpy().T)
    # and back: keras-hub's head is read like any linear layer (the report's exact rules, inverted)
    back = transformers.MistralForCausalLM(cfg).eval()
    inverse = [(re.escape(r), re.sub(r"\\(.)", r"\1", p)) for p, r in report.rules]
    assert db.transfer(dst, back, mapping=inverse).not_moved_dst == []
    _same_torch_weights(back, src)
    # like any lone linear layer: its spec, and compare (its call is the head: reverse=True)
    spec = db.to_spec(head)
    assert (spec.in_features, spec.units, spec.use_bias, spec.activation.is_identity) == (H, V, False, True)
    assert db.testing.compare(head, db.convert(head, "numpy")).passed


# --------------------------------------------------------------------- dtypes, heads, errors
def test_widening_is_exact_and_narrowing_needs_consent():
    torch = pytest.importorskip("torch")
    import ml_dtypes

    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    wide = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    db.transfer(src, wide, mapping=[("(.*)", r"\1")])
    assert torch.equal(wide[0].weight, src[0].weight.float()) and torch.equal(wide[1].weight, src[1].weight.float())
    narrow = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.float16)
    with pytest.raises(db.ConversionError, match=r"narrowing casts round values: 0 \(kernel\) \(bfloat16 -> float16\)"
                                                 r".*allow_narrowing=True"):
        db.transfer(src, narrow, mapping=[("(.*)", r"\1")])
    report = db.transfer(wide, narrow, mapping=[("(.*)", r"\1")], allow_narrowing=True)
    assert "1.weight" in report.narrowed and "0 (kernel)" in report.narrowed
    want = db.get_params(wide[0])["kernel"].astype(np.float16)
    np.testing.assert_array_equal(db.get_params(narrow[0])["kernel"], want)
    assert ml_dtypes is not None
    with pytest.raises(TypeError, match="allow_narrowing"):
        db.transfer(wide, narrow, allow_narrowing="yes")


def test_a_plain_split_of_interleaved_heads_is_refused_and_declared_heads_split_per_head():
    transformers = _transformers()
    import torch

    cfg = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                                     intermediate_size=FF, max_position_embeddings=POS, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    neox = transformers.GPTNeoXModel(cfg).eval()
    _randomize(neox)

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(H, H) for _ in range(3))

    split = Split()
    rule = {"layers.0.attention.query_key_value": ["q", "k", "v"]}
    with pytest.raises(db.ConversionError, match="interleave per head.*'heads': n"):
        db.transfer(neox, split, mapping=rule, strict=False)
    db.transfer(neox, split, mapping={"layers.0.attention.query_key_value": {"to": ["q", "k", "v"], "heads": HEADS}},
                strict=False)
    # GPT-NeoX's own reading of its fused output: per head, q | k | v of head_size each
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        qkv = neox.layers[0].attention.query_key_value(x).view(2, 5, HEADS, 3 * (H // HEADS))
        q, k, v = qkv.chunk(3, dim=-1)
        for mine, theirs in ((split.q, q), (split.k, k), (split.v, v)):
            torch.testing.assert_close(mine(x), theirs.reshape(2, 5, H), rtol=0, atol=1e-6)


def test_compare_models_with_a_mapping_that_pairs_nothing_names_the_rules():
    torch = pytest.importorskip("torch")
    a = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    b = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    with pytest.raises(db.ConversionError, match=r"pairs no linear layer.*matched nothing: \['encoder\\\\.\(\\\\d\+\)'\]"):
        db.testing.compare_models(a, b, [x], mapping=[(r"encoder\.(\d+)", r"\1")])
    with pytest.raises(db.ConversionError, match="pairs no linear layer"):
        db.testing.compare_models(a, b, [x], mapping={})
    # a dst layer written twice without a concatenation is named
    with pytest.raises(db.ConversionError, match="gets both '0' and '2'"):
        db.transfer(a, b, mapping={"0": "0", "2": "0"})


# --------------------------------------------------------------------- the command line on whole models
def test_inspect_orients_a_gpt2_checkpoint_by_its_biases_and_convert_says_to_transfer(tmp_path, capsys):
    transformers = _transformers()
    from dense_bridge.cli import _main as cli

    cfg = transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=1, n_head=HEADS,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2Model(cfg).save_pretrained(tmp_path / "gpt2")
    path = str(tmp_path / "gpt2" / "model.safetensors")
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    # c_attn: weight (32, 96), bias (96,): the bias names the output axis, whatever torch's convention says
    assert "h.0.attn.c_attn  in=32     units=96     bias=yes" in out and "layout in_out (from its bias)" in out
    assert "h.0.attn.c_proj  in=32     units=32     bias=yes" in out and "layout unknown (square)" in out
    assert "none fits" in out and "db.transfer" in out
    assert cli.main(["inspect", path, "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)["linear_layers"]}
    assert rows["h.0.mlp.c_proj"]["layout"] == "in_out" and rows["h.0.mlp.c_proj"]["in_features"] == 4 * H
    assert rows["h.0.attn.c_proj"]["layout"] == "unknown"

    assert cli.main(["convert", path, "--to", "numpy", "-o", str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "holds a whole model" in err and "--spec cannot help" in err
    assert 'db.transfer(src, dst, mapping=[(r"(.*)", r"\\1")])' in err  # the two-line example
    assert "h.0.attn.c_attn (in=32, units=96, layout in_out)" in err and "wte.weight (48, 32)" in err
    assert not (tmp_path / "out.safetensors").exists()


def test_rules_carry_across_keras_instances_whose_layers_are_auto_numbered_differently():
    torch = pytest.importorskip("torch")
    from conftest import require_backend

    require_backend("keras")
    import keras

    def mlp():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.LayerNormalization(epsilon=1e-5), keras.layers.Dense(3)])

    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    first, second = mlp(), mlp()
    assert [l.name for l in first.layers] != [l.name for l in second.layers]  # "dense" vs "dense_2"
    report = db.transfer(src, first, mapping={"0": first.layers[0].name, "2": first.layers[1].name,
                                              "3": first.layers[2].name})
    # the rules name the layers as every instance numbers them
    assert [r[1] for r in report.rules] == ["dense", "layer_normalization", "dense_1"]
    db.transfer(src, second, mapping=json.loads(json.dumps(report.rules)))
    for a, b in zip(first.weights, second.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        _close(src(torch.tensor(x)).numpy(), np.asarray(second(x)), "second instance")
    back = db.transfer(second, src, mapping=[(r, re.sub(r"\\(.)", r"\1", p)) for p, r in report.rules])
    assert [m[0] for m in back.moved][:1] == [second.layers[0].name]


def test_a_lone_reversible_embedding_reads_as_its_head_when_untied_and_as_a_tie_when_tied():
    from conftest import require_backend

    require_backend("keras")
    import keras

    untied = keras.layers.ReversibleEmbedding(10, 4, tie_weights=False)
    untied.build((None,))
    assert list(db.linear_layers(untied)) == ["reverse_embeddings"]
    np.testing.assert_array_equal(db.get_params(untied)["kernel"], np.asarray(untied.reverse_embeddings))
    tied = keras.layers.ReversibleEmbedding(10, 4)
    tied.build((None,))
    assert db.linear_layers(tied) == {}  # the head is the table transposed: no layer of its own
    with pytest.raises(db.ConversionError, match="tie_weights=True.*the head follows"):
        db.get_params(tied)


def test_dict_and_callable_forms_split_and_concatenate_too():
    torch = pytest.importorskip("torch")

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(6, 10), torch.nn.Linear(10, 6)

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.out = (torch.nn.Linear(6, 6), torch.nn.Linear(6, 2), torch.nn.Linear(6, 2),
                                                torch.nn.Linear(10, 6))

    torch.manual_seed(0)
    fused, split = Fused(), Split()
    report = db.transfer(fused, split, mapping={"qkv": ["q", "k", "v"], "out": "out"})
    w, b = fused.qkv.weight.detach(), fused.qkv.bias.detach()
    for layer, rows in ((split.q, slice(0, 6)), (split.k, slice(6, 8)), (split.v, slice(8, 10))):
        assert torch.equal(layer.weight, w[rows]) and torch.equal(layer.bias, b[rows])
    assert report.rules[0] == ("qkv", ["q", "k", "v"])
    back = Fused()
    db.transfer(split, back, mapping={("q", "k", "v"): "qkv", "out": "out"})
    assert torch.equal(back.qkv.weight, fused.qkv.weight) and torch.equal(back.qkv.bias, fused.qkv.bias)
    other = Split()
    db.transfer(fused, other, mapping=lambda path: ["q", "k", "v"] if path == "qkv" else path)
    assert torch.equal(other.v.weight, w[8:10])
    # a split of a layer into layers with and without a bias is refused, naming them
    nobias = Split()
    nobias.k = torch.nn.Linear(6, 2, bias=False)
    with pytest.raises(db.ConversionError, match="dst layers differ in parameters"):
        db.transfer(fused, nobias, mapping={"qkv": ["q", "k", "v"], "out": "out"})
    with pytest.raises(TypeError, match="a concatenation goes into one destination layer"):
        db.transfer(split, back, mapping={("q", "k"): ["qkv", "out"]})


def test_compare_models_joins_split_layers_per_declared_head():
    torch = pytest.importorskip("torch")
    heads, hd = 2, 3

    class Fused(torch.nn.Module):  # GPT-NeoX's reading: per head, q | k | v of hd each
        def __init__(self):
            super().__init__()
            self.query_key_value, self.out = torch.nn.Linear(4, 3 * heads * hd), torch.nn.Linear(heads * hd, 4)

        def forward(self, x):
            q, k, v = self.query_key_value(x).view(*x.shape[:-1], heads, 3 * hd).chunk(3, dim=-1)
            return self.out((torch.tanh(q * k) + v).flatten(-2))

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(4, heads * hd) for _ in range(3))
            self.out = torch.nn.Linear(heads * hd, 4)

        def forward(self, x):
            return self.out(torch.tanh(self.q(x) * self.k(x)) + self.v(x))

    torch.manual_seed(0)
    fused, split = Fused(), Split()
    mapping = {"query_key_value": {"to": ["q", "k", "v"], "heads": heads}, "out": "out"}
    report = db.transfer(fused, split, mapping=mapping)
    assert report.rules[0] == ("query_key_value", {"to": ["q", "k", "v"], "heads": heads})
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    with torch.no_grad():
        _close(fused(torch.tensor(x)).numpy(), split(torch.tensor(x)).numpy(), "per-head split")
    compared = db.testing.compare_models(fused, split, [x], mapping=mapping)
    assert compared.passed, compared
    assert ("query_key_value", "q+k+v") in compared.pairs
    # judged as blocks (heads=1) the same weights disagree, at that layer
    blocks = {"query_key_value": {"to": ["q", "k", "v"], "heads": 1}, "out": "out"}
    assert db.testing.compare_models(fused, split, [x], mapping=blocks).first_divergence == "q+k+v"


def test_split_layers_count_as_matched_in_the_structure_and_are_named_in_isolated_mode():
    transformers, kw, phi3 = _phi3_pair()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA)
    ids = np.random.default_rng(0).integers(0, V, (2, 7))
    for a, b, mapping in ((llama, phi3, LLAMA_TO_PHI3), (phi3, llama, PHI3_TO_LLAMA)):
        report = db.testing.compare_models(a, b, [ids], mapping=mapping, isolated=True)
        assert report.passed, report
        assert report.structure.clean, report.structure.lines()
        # every layer ran alone, the split/fused groups member by member: none judged as in cascaded mode
        assert not any("cascaded mode" in n for n in report.notes), report.notes
        fused = [layer for layer in report.layers if "qkv_proj" in layer.layer_type]
        assert fused and all({"output", "dL/dx", "dL/dkernel"} <= {q.quantity for q in layer.quantities}
                             for layer in fused)


def test_isolated_mode_blames_a_fault_in_one_member_of_a_split_on_its_group_alone():
    import torch

    transformers, kw, phi3 = _phi3_pair()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA)
    with torch.no_grad():
        llama.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
    ids = np.random.default_rng(0).integers(0, V, (2, 7))
    report = db.testing.compare_models(phi3, llama, [ids], mapping=PHI3_TO_LLAMA, isolated=True)
    group = "model.layers.0.self_attn.q_proj+model.layers.0.self_attn.k_proj+model.layers.0.self_attn.v_proj"
    assert not report.passed
    assert report.first_failure.layer_type.startswith(group) and report.first_failure.quantity == "output", report
    failed = {layer.layer_type.split(" ")[0] for layer in report.layers if layer.index is not None and not layer.passed}
    assert failed == {group}, failed
    # judged on the members run alone (a dL/dx row exists only for forced calls), not on the cascaded pass
    assert not any("cascaded mode" in n for n in report.notes), report.notes
    assert any(q.quantity == "dL/dx" for layer in report.layers if layer.layer_type.startswith(group)
               for q in layer.quantities)
    # teacher forcing: the layers after it ran on a's values, so the next layer's rows pass
    nxt = [layer for layer in report.layers if layer.layer_type.startswith("model.layers.1.")]
    assert nxt and all(layer.passed for layer in nxt)
