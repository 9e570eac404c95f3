"""Complete transfers (API v4 "Transfer completeness"): mapping=None moves every parameter whose
path and shape agree, strict=True means every parameter of dst is written (computed buffers and
ties aside; running statistics included), a failed auto transfer leaves a self-modifying dst as it
was, and keyword inputs come as a dict or a list holding one dict. Real torch/transformers models,
tiny random configs."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db


def _torch():
    return pytest.importorskip("torch")


def _llama(seed: int):
    torch = _torch()
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: make them differ between the two models
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _state(model) -> dict:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def _assert_same_state(model, before: dict) -> None:
    after = _state(model)
    assert after.keys() == before.keys()
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)


def _logits(model, ids):
    torch = _torch()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


IDS = np.random.default_rng(0).integers(0, 64, (2, 7))


def test_two_llamas_of_one_config_transfer_completely_without_a_mapping():
    a, b = _llama(0), _llama(1)
    assert np.abs(_logits(a, IDS) - _logits(b, IDS)).max() > 0.01
    inv_freq = b.model.rotary_emb.inv_freq.clone().numpy()
    report = db.transfer(a, b)  # linear layers by order, embeddings and norms by path
    np.testing.assert_array_equal(_logits(b, IDS), _logits(a, IDS))  # bit-identical
    assert report.not_moved_src == [] and report.not_moved_dst == []
    moved = {d for _, d, _ in report.moved}
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"} <= moved
    # rotary inv_freq is a computed buffer (non-persistent): never asked for, never written
    assert "inv_freq" not in str(report)
    np.testing.assert_array_equal(b.model.rotary_emb.inv_freq.numpy(), inv_freq)
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[k].numpy(), v.numpy(), err_msg=k)


def test_a_mapping_that_leaves_the_embedding_unwritten_fails_naming_it_and_writes_nothing():
    a, b = _llama(0), _llama(1)
    rules = [(r"(model\.layers\..*|model\.norm|lm_head)", r"\1")]  # every layer but the embedding
    before = _state(b)
    with pytest.raises(db.ConversionError, match=r"left unwritten: \['model\.embed_tokens\.weight'\]") as err:
        db.transfer(a, b, mapping=rules)
    assert "nothing was written" in str(err.value)
    _assert_same_state(b, before)
    report = db.transfer(a, b, mapping=rules, strict=False)  # writes what is matched, lists the rest
    assert report.not_moved_dst == ["model.embed_tokens.weight"]
    assert report.not_moved_src == ["model.embed_tokens.weight"]
    np.testing.assert_array_equal(b.model.norm.weight.detach().numpy(), a.model.norm.weight.detach().numpy())
    np.testing.assert_array_equal(b.model.embed_tokens.weight.detach().numpy(), before["model.embed_tokens.weight"])


def _bn_net(torch, seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def test_batchnorm_running_statistics_are_written_and_required():
    torch = _torch()
    src, dst = _bn_net(torch, 0), _bn_net(torch, 1)
    src.train()
    with torch.no_grad():  # running statistics away from their initial 0 / 1
        for i in range(3):
            src(torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) * 3 + 1)
    src.eval(), dst.eval()
    report = db.transfer(src, dst)
    for name in ("running_mean", "running_var", "weight", "bias"):
        np.testing.assert_array_equal(getattr(dst[1], name).detach().numpy(), getattr(src[1], name).detach().numpy())
    assert ("1.running_mean", "1.running_mean", "parameter") in report.moved
    x = torch.randn(5, 4)
    with torch.no_grad():
        np.testing.assert_array_equal(dst(x).numpy(), src(x).numpy())
    # mapping only the linear layers leaves the norm and its statistics unwritten: named, nothing written
    fresh = _bn_net(torch, 2)
    before = _state(fresh)
    with pytest.raises(db.ConversionError) as err:
        db.transfer(src, fresh, mapping={"0": "0", "3": "3"})
    for name in ("1.weight", "1.bias", "1.running_mean", "1.running_var"):
        assert repr(name) in str(err.value)
    _assert_same_state(fresh, before)


class _Drifting:
    """A torch model whose forward changes its own norm scale (and an unused layer the inference
    leaves unpaired, so that the auto transfer fails after the model ran)."""

    @staticmethod
    def make(torch, seed: int, drift: bool):
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up = torch.nn.Linear(4, 8)
                self.norm = torch.nn.LayerNorm(8)
                self.down = torch.nn.Linear(8, 3)
                if drift:
                    self.spare = torch.nn.Linear(3, 3)  # never called: unpaired

            def forward(self, x):
                h = self.norm(self.up(x))
                if drift:
                    with torch.no_grad():
                        self.norm.weight.add_(1.0)
                        self.up.weight.mul_(2.0)
                return self.down(torch.relu(h))

        torch.manual_seed(seed)
        return Net().eval()


def test_a_failed_auto_transfer_leaves_a_self_modifying_dst_exactly_as_it_was():
    torch = _torch()
    src, dst = _Drifting.make(torch, 0, False), _Drifting.make(torch, 1, True)
    x = [np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)]
    before = _state(dst)
    with pytest.raises(db.ConversionError, match="unpaired.*spare"):
        db.transfer(src, dst, mapping="auto", inputs=x)
    _assert_same_state(dst, before)  # the recording forward's drift is undone too


def test_auto_takes_a_list_holding_one_dict_of_keyword_inputs():
    a, b = _llama(0), _llama(1)
    report = db.transfer(a, b, mapping="auto", inputs=[{"input_ids": IDS}])
    assert "verified" in report.verification
    assert report.not_moved_dst == []
    np.testing.assert_array_equal(_logits(b, IDS), _logits(a, IDS))
    # the same inputs as a pair (src inputs, dst inputs), each a list holding one dict
    c = _llama(2)
    db.transfer(a, c, mapping="auto", inputs=([{"input_ids": IDS}], [{"input_ids": IDS}]))
    np.testing.assert_array_equal(_logits(c, IDS), _logits(a, IDS))


@pytest.mark.parametrize("form", ["numpy list", "torch tensor", "python lists", "dict", "bare array"])
def test_auto_reads_inputs_in_every_form_compare_models_reads(form):
    """transfer(mapping="auto") and compare_models read inputs through one reader: the forms a
    user writes work alike, and a form that is none of them is one TypeError naming it."""
    torch = _torch()
    inputs = {"numpy list": [IDS], "torch tensor": [torch.from_numpy(IDS)], "python lists": IDS.tolist(),
              "dict": {"input_ids": IDS}, "bare array": IDS}[form]
    a, b = _llama(0), _llama(1)
    db.transfer(a, b, mapping="auto", inputs=inputs)
    np.testing.assert_array_equal(_logits(b, IDS), _logits(a, IDS))


def test_auto_refuses_inputs_of_no_form_and_empty_inputs_before_any_model_runs():
    a, b = _llama(0), _llama(1)
    before = _state(b)
    with pytest.raises(TypeError, match="inputs must be"):
        db.transfer(a, b, mapping="auto", inputs="input_ids")
    with pytest.raises(db.SpecError, match="at least one element|no rows|empty|shape"):
        db.transfer(a, b, mapping="auto", inputs=[IDS[:0]])
    _assert_same_state(b, before)
