"""mapping="auto": a mapping inferred by running both models, verified before anything is kept.

Every port is checked against the libraries' own converters (mlx-lm's ``load_model`` and
keras-hub's ``from_preset`` on a local ``save_pretrained`` directory): bit for bit, with tiny
random configs and no downloads.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import FF, H, HEADS, KV, LAYERS, POS, V  # noqa: F401  tiny sizes shared by the port tests
from _port_helpers import keras_hub_or_skip as _keras_hub, mlx_lm_or_skip as _mlx_lm  # noqa: F401
from _port_helpers import randomize as _randomize, transformers_or_skip as _transformers  # noqa: F401
IDS = np.random.default_rng(0).integers(0, V, (2, 7))


def _same_mlx(got, want) -> None:
    from mlx.utils import tree_flatten

    a, b = dict(tree_flatten(got.parameters())), dict(tree_flatten(want.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def _same_keras(got, want) -> None:
    a = {w.path.split("/", 1)[1]: np.asarray(w) for w in got.weights}
    b = {w.path.split("/", 1)[1]: np.asarray(w) for w in want.weights}
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def _same_torch(got, want) -> None:
    import torch

    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _mlx_port(tmp_path, name, src, module, saved=None):
    """src saved (``saved``: the part to save), mlx-lm's own load_model as the reference, and a fresh
    mlx-lm model to port into."""
    from mlx_lm.utils import load_model

    (src if saved is None else saved).save_pretrained(tmp_path / name)
    ref, _ = load_model(tmp_path / name)
    cfg = json.loads((tmp_path / name / "config.json").read_text())
    return ref, lambda: module.Model(module.ModelArgs.from_dict(cfg))


# --------------------------------------------------------------------- transformers -> mlx-lm
def _llama(transformers, square: bool = False, eps: float = 1e-5, **extra):
    import torch

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=H if square else FF,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
                                   max_position_embeddings=POS, rms_norm_eps=eps, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=None, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _randomize(model)
    return model


def test_gpt2_into_mlx_lm_is_inferred_verified_and_bit_exact_and_its_rules_need_no_inputs(tmp_path):
    transformers = _transformers()
    _mlx_lm()
    from mlx_lm.models import gpt2

    cfg = transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  n_ctx=POS)  # mlx-lm's GPT-2 reads n_ctx
    src = transformers.GPT2LMHeadModel(cfg).eval()
    _randomize(src)
    # mlx-lm reads GPT-2 checkpoints as the hub holds them: the GPT2Model's own names (h.0..., no prefix)
    ref, fresh = _mlx_port(tmp_path, "gpt2", src, gpt2, saved=src.transformer)
    dst = fresh()
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    _same_mlx(dst, ref)
    assert "verified" in report.verification and "NOT" not in report.verification
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    json.dumps(report.to_dict())  # the inferred rules are plain data
    again = fresh()
    db.transfer(src, again, mapping=report.rules)  # reused without inputs on a fresh destination
    _same_mlx(again, ref)

    # the way back: mlx-lm -> transformers
    back = transformers.GPT2LMHeadModel(cfg).eval()
    db.transfer(dst, back, mapping="auto", inputs=[IDS])
    _same_torch(back, src)


def test_llama_into_mlx_lm_and_back(tmp_path):
    transformers = _transformers()
    _mlx_lm()
    from mlx_lm.models import llama

    src = _llama(transformers)
    ref, fresh = _mlx_port(tmp_path, "llama", src, llama)
    dst = fresh()
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    _same_mlx(dst, ref)
    assert report.not_moved_src == [] and report.not_moved_dst == []
    back = _llama(transformers)
    _randomize(back, seed=3)
    db.transfer(dst, back, mapping="auto", inputs=[IDS])
    _same_torch(back, src)


def test_execution_order_beats_definition_order_with_a_square_mlp(tmp_path):
    """mlx-lm's Llama MLP defines gate, down, up and calls gate, up, down; all three are square."""
    transformers = _transformers()
    _mlx_lm()
    from mlx_lm.models import llama

    src = _llama(transformers, square=True)
    ref, fresh = _mlx_port(tmp_path, "llama_sq", src, llama)
    dst = fresh()
    assert [n for n, _ in dst.model.layers[0].mlp.children().items()] == ["gate_proj", "down_proj", "up_proj"]
    with pytest.raises(db.ConversionError):  # by definition order the square up/down would swap: refused
        db.transfer(src, fresh(), mapping=None)
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    _same_mlx(dst, ref)
    pairs = {r[0]: r[1] for r in report.rules}
    assert pairs[r"model\.layers\.0\.mlp\.up_proj"] == "model.layers.0.mlp.up_proj"
    assert pairs[r"model\.layers\.0\.mlp\.down_proj"] == "model.layers.0.mlp.down_proj"


def test_tied_qwen2_into_mlx_lm(tmp_path):
    transformers = _transformers()
    _mlx_lm()
    import torch
    from mlx_lm.models import qwen2

    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=POS,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    src = transformers.Qwen2ForCausalLM(cfg).eval()
    _randomize(src)
    ref, fresh = _mlx_port(tmp_path, "qwen2", src, qwen2)
    dst = fresh()
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    _same_mlx(dst, ref)
    assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert db.testing.compare_models(src, dst, [IDS], mapping="auto").passed

    # the way back into an untied head: mlx-lm calls embed_tokens.as_linear (no module of its own),
    # recorded as the table called as the head; the untied lm_head gets the table
    untied = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**src.config.to_dict(),
                                                                        "tie_word_embeddings": False})).eval()
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    db.transfer(dst, untied, mapping="auto", inputs=[IDS])
    assert torch.equal(untied.lm_head.weight, src.lm_head.weight)
    assert torch.equal(untied.model.layers[1].mlp.down_proj.weight, src.model.layers[1].mlp.down_proj.weight)


# --------------------------------------------------------------------- transformers -> keras-hub
def _gpt2_keras(tmp_path):
    transformers = _transformers()
    keras_hub = _keras_hub()
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    src = transformers.GPT2Model(cfg).eval()
    _randomize(src)
    src.save_pretrained(tmp_path / "gpt2")
    ref = keras_hub.models.GPT2Backbone.from_preset(str(tmp_path / "gpt2"))

    def fresh():
        return keras_hub.models.GPT2Backbone(vocabulary_size=V, num_layers=LAYERS, num_heads=HEADS, hidden_dim=H,
                                             intermediate_dim=4 * H, max_sequence_length=POS, dropout=0.0)
    return transformers, cfg, src, ref, fresh


KERAS_INPUTS = ([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)})


def test_gpt2_into_keras_hub_splits_the_fused_projection_and_comes_back(tmp_path):
    transformers, cfg, src, ref, fresh = _gpt2_keras(tmp_path)
    dst = fresh()
    report = db.transfer(src, dst, mapping="auto", inputs=KERAS_INPUTS)
    _same_keras(dst, ref)
    fused = [r for r in report.rules if isinstance(r[1], list)]
    assert len(fused) == LAYERS and fused[0][1][0].endswith("query")  # c_attn split into query/key/value
    again = fresh()
    db.transfer(src, again, mapping=report.rules)
    _same_keras(again, ref)

    back = transformers.GPT2Model(cfg).eval()
    db.transfer(dst, back, mapping="auto", inputs=KERAS_INPUTS[::-1])
    _same_torch(back, src)


def test_bert_into_keras_hub_pairs_embeddings_looked_up_in_another_order(tmp_path):
    transformers = _transformers()
    keras_hub = _keras_hub()
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                  intermediate_size=FF, max_position_embeddings=POS, type_vocab_size=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  hidden_act="gelu_new")  # keras-hub BERT computes the tanh gelu
    src = transformers.BertModel(cfg).eval()
    _randomize(src)
    src.save_pretrained(tmp_path / "bert")
    ref = keras_hub.models.BertBackbone.from_preset(str(tmp_path / "bert"))
    dst = keras_hub.models.BertBackbone.from_config(
        {k: v for k, v in ref.get_config().items() if k not in ("name", "trainable")})
    seg = np.zeros_like(IDS)
    inputs = ({"input_ids": IDS, "token_type_ids": seg},
              {"token_ids": IDS, "segment_ids": seg, "padding_mask": np.ones_like(IDS)})
    db.transfer(src, dst, mapping="auto", inputs=inputs)
    _same_keras(dst, ref)


# --------------------------------------------------------------------- refusals
def test_mapping_auto_needs_inputs_and_refuses_models_that_differ_in_structure():
    transformers = _transformers()
    src = _llama(transformers)
    with pytest.raises(TypeError, match="inputs"):
        db.transfer(src, _llama(transformers), mapping="auto")
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, max_position_embeddings=POS, tie_word_embeddings=False, pad_token_id=None)).eval()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(db.ConversionError, match="differ in structure") as err:
        db.transfer(src, other, mapping="auto", inputs=[IDS])
    assert "nothing was written" in str(err.value)
    _same_state(other, before)


def _same_state(model, before) -> None:
    import torch

    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _attention(k_first: bool):
    """A one-head attention whose q and k have equal widths; ``k_first`` computes k before q."""
    import torch

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(8, 8)
            self.k = torch.nn.Linear(8, 8)
            self.v = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, x):
            if k_first:
                k = self.k(x)
                q = self.q(x)
            else:
                q = self.q(x)
                k = self.k(x)
            scores = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + torch.triu(torch.full((5, 5), -1e9), 1), -1)
            return self.out(scores @ self.v(x))

    torch.manual_seed(0)
    return Attention().eval()


def test_a_destination_computing_k_before_q_is_paired_right_or_refused_never_transferred_wrong():
    _transformers()
    import torch

    src, dst = _attention(False), _attention(True)
    _randomize(src)
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    report = db.transfer(src, dst, mapping="auto", inputs=[x])  # the names agree: paired by name
    with torch.no_grad():
        np.testing.assert_allclose(dst(torch.tensor(x)).numpy(), src(torch.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)
    assert ("q", "q") in [(r[0], r[1]) for r in report.rules]

    # names that say nothing: by order k would take q's weights; verification refuses, dst unchanged
    renamed = _attention(True)
    renamed.a, renamed.b = renamed.k, renamed.q  # first called: a (k); then b (q)
    del renamed.k, renamed.q
    renamed.forward = lambda x, m=renamed: _renamed_forward(m, x)
    before = {k: v.clone() for k, v in renamed.state_dict().items()}
    with pytest.raises(db.ConversionError, match="upstream|model output") as err:
        db.transfer(src, renamed, mapping="auto", inputs=[x])
    assert "dst was left unchanged" in str(err.value)
    _same_state(renamed, before)


def _renamed_forward(m, x):
    import torch

    k, q = m.a(x), m.b(x)
    scores = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + torch.triu(torch.full((5, 5), -1e9), 1), -1)
    return m.out(scores @ m.v(x))


# --------------------------------------------------------------------- more architectures
def _decoder(transformers, arch: str, **extra):
    """A tiny random transformers causal LM of ``arch`` (Mistral, Phi3, Gemma, Qwen2, Qwen3, Llama)."""
    import torch

    kw = dict(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              num_key_value_heads=KV, max_position_embeddings=POS, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if arch in ("Gemma", "Qwen3"):
        kw["head_dim"] = H // HEADS
    if arch in ("Qwen2", "Qwen3"):  # mlx-lm's Qwen defaults to 1e6 when the config holds rope_parameters only
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    kw.update(extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**kw)).eval()
    _randomize(model)
    return model


@pytest.mark.parametrize("arch", ["Mistral", "Phi3", "Qwen3"])
def test_decoders_into_mlx_lm(tmp_path, arch):
    """Phi-3 fused into fused; Qwen3 calls q_proj, q_norm, k_proj, k_norm in transformers and q, k,
    v, then the norms in mlx-lm: pairing per kind agrees."""
    transformers = _transformers()
    _mlx_lm()
    from mlx_lm.utils import load_model

    src = _decoder(transformers, arch)
    src.save_pretrained(tmp_path / arch)
    ref, _ = load_model(tmp_path / arch)
    dst = type(ref)(ref.args)
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS])
    _same_mlx(dst, ref)
    assert report.not_moved_src == [] and report.not_moved_dst == []


def test_gemma_into_mlx_lm_fails_verification_by_design_and_verify_false_keeps_it(tmp_path):
    """mlx-lm's Gemma computes another gelu than transformers': verification names where."""
    transformers = _transformers()
    _mlx_lm()
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    src = _decoder(transformers, "Gemma", tie_word_embeddings=True)
    src.save_pretrained(tmp_path / "gemma")
    ref, _ = load_model(tmp_path / "gemma")
    dst = type(ref)(ref.args)
    before = {k: np.array(v) for k, v in tree_flatten(dst.parameters())}
    with pytest.raises(db.ConversionError, match="First disagreeing pair") as err:
        db.transfer(src, dst, mapping="auto", inputs=[IDS])
    # the input of the first down_proj differs: the activation before it (tanh vs exact gelu)
    assert "model.layers.0.mlp.down_proj" in str(err.value) and "upstream" in str(err.value)
    for k, v in tree_flatten(dst.parameters()):  # refused: dst unchanged
        np.testing.assert_array_equal(np.asarray(v), before[k], err_msg=k)
    report = db.transfer(src, dst, mapping="auto", inputs=[IDS], verify=False)
    assert "NOT verified" in report.verification and "NOT verified" in str(report)
    _same_mlx(dst, ref)


def _keras_port(tmp_path, name, src, backbone, task=None):
    """src saved; keras-hub's own from_preset as the reference; a fresh backbone (or task model)."""
    keras_hub = _keras_hub()
    src.save_pretrained(tmp_path / name)
    ref = getattr(keras_hub.models, backbone).from_preset(str(tmp_path / name))
    config = {k: v for k, v in ref.get_config().items() if k not in ("name", "trainable")}
    dst = getattr(keras_hub.models, backbone).from_config(config)
    if task is not None:
        dst = getattr(keras_hub.models, task)(backbone=dst, preprocessor=None)
    return ref, dst


@pytest.mark.parametrize("arch", ["Qwen2", "Gemma"])
def test_decoders_into_keras_hub_backbones(tmp_path, arch):
    transformers = _transformers()
    import torch

    src = _decoder(transformers, arch, tie_word_embeddings=True)
    with torch.no_grad():  # keras-hub's converters round through float16 for some: start from such values
        for p in src.parameters():
            p.copy_(p.half().float())
    ref, dst = _keras_port(tmp_path, arch, src, f"{arch}Backbone")
    inputs = ([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)})
    body = src.model
    db.transfer(body, dst, mapping="auto", inputs=inputs)
    _same_keras(dst, ref)


def test_llama_into_a_keras_hub_task_model_and_back(tmp_path):
    transformers = _transformers()
    # keras-hub's Llama converter does not read rms_norm_eps (its layers use 1e-6): verification
    # refuses a source with another epsilon, so the source uses keras-hub's
    src = _llama(transformers, eps=1e-6)
    ref, dst = _keras_port(tmp_path, "llama", src, "LlamaBackbone", task="LlamaCausalLM")
    inputs = ([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)})
    db.transfer(src, dst, mapping="auto", inputs=inputs)
    _same_keras(dst.backbone, ref)
    back = _llama(transformers, eps=1e-6)
    _randomize(back, seed=5)
    db.transfer(dst, back, mapping="auto", inputs=inputs[::-1])  # the way back: keras-hub -> transformers
    _same_torch(back, src)


def test_mistral_untied_head_is_paired_through_the_keras_hub_task_model(tmp_path):
    transformers = _transformers()
    import torch

    src = _decoder(transformers, "Mistral")
    with torch.no_grad():  # keras-hub's Mistral converter rounds through float16
        for p in src.parameters():
            p.copy_(p.half().float())
    ref, dst = _keras_port(tmp_path, "mistral", src, "MistralBackbone", task="MistralCausalLM")
    inputs = ([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)})
    report = db.transfer(src, dst, mapping="auto", inputs=inputs)
    _same_keras(dst.backbone, ref)
    np.testing.assert_array_equal(np.asarray(dst.backbone.token_embedding.reverse_embeddings),
                                  src.lm_head.weight.detach().numpy().T)
    assert [d for s_, d in report.rules if s_ == "lm_head"][0].endswith("token_embedding/reverse_embeddings")


def test_distilbert_into_keras_hub(tmp_path):
    transformers = _transformers()
    cfg = transformers.DistilBertConfig(vocab_size=V, dim=H, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FF,
                                        max_position_embeddings=POS, dropout=0.0, attention_dropout=0.0,
                                        activation="gelu", pad_token_id=0)
    full = transformers.DistilBertForMaskedLM(cfg).eval()  # keras-hub reads the "distilbert." names
    _randomize(full)
    ref, dst = _keras_port(tmp_path, "distilbert", full, "DistilBertBackbone")
    inputs = ([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)})
    db.transfer(full.distilbert, dst, mapping="auto", inputs=inputs)
    _same_keras(dst, ref)


def test_expert_stacks_without_a_counterpart_are_named():
    """A dense model into a mixture of experts: the expert stacks pair with nothing, and the
    refusal names them (stacks with a counterpart pair along an axis: tests/ports/test_coverage_sample.py)."""
    _transformers()
    _mlx_lm()
    from mlx_lm.models import mixtral

    dst = mixtral.Model(mixtral.ModelArgs(model_type="mixtral", vocab_size=V, hidden_size=H, intermediate_size=FF,
                                          num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV,
                                          num_local_experts=2, num_experts_per_tok=1))
    src = _llama(_transformers())
    with pytest.raises(db.ConversionError, match="left unpaired") as err:
        db.transfer(src, dst, mapping="auto", inputs=[IDS])
    assert "switch_mlp.gate_proj.weight" in str(err.value)


def test_explicit_entries_take_precedence_and_the_rest_is_inferred():
    """db.auto(rules): the names say nothing, so the q/k pair is given; v and out are inferred."""
    _transformers()
    import torch

    src, dst = _attention(False), _attention(True)
    _randomize(src)
    dst.a, dst.b = dst.k, dst.q
    del dst.k, dst.q
    dst.forward = lambda x, m=dst: _renamed_forward(m, x)
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    report = db.transfer(src, dst, mapping=db.auto({"q": "b", "k": "a"}), inputs=[x])
    with torch.no_grad():
        np.testing.assert_allclose(dst(torch.tensor(x)).numpy(), src(torch.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)
    assert sorted((r[0], r[1]) for r in report.rules) == [("k", "a"), ("out", "out"), ("q", "b"), ("v", "v")]
    with pytest.raises(TypeError, match="mapping"):
        db.auto(42)


def test_a_keras_hub_tied_head_called_with_reverse_fills_an_untied_transformers_head(tmp_path):
    """keras-hub calls its tied table as the head (token_embedding(x, reverse=True)), no module of
    its own: recorded as the table called as the head, it fills transformers' untied lm_head."""
    transformers = _transformers()
    keras_hub = _keras_hub()
    import torch

    src = _decoder(transformers, "Qwen2", tie_word_embeddings=True)
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(p.half().float())
    ref, _ = _keras_port(tmp_path, "qwen2", src, "Qwen2Backbone")
    task = keras_hub.models.Qwen2CausalLM(backbone=ref, preprocessor=None)
    untied = _decoder(transformers, "Qwen2", tie_word_embeddings=False)
    inputs = ({"token_ids": IDS, "padding_mask": np.ones_like(IDS)}, [IDS])
    db.transfer(task, untied, mapping="auto", inputs=inputs)
    assert torch.equal(untied.lm_head.weight, src.model.embed_tokens.weight)
    assert torch.equal(untied.model.layers[1].self_attn.k_proj.weight, src.model.layers[1].self_attn.k_proj.weight)
