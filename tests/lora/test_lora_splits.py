"""LoRA adapters on fused layers split and join with them in ``transfer(..., lora="keep"|"merge")``.

Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` against a Llama twin whose q/k/v and gate/up are
separate layers, with real PEFT adapters (random factors, tiny random configs):

- split: each piece keeps the fused ``lora_a`` and scale and takes its columns of ``lora_b``;
- join: ranks add up, ``lora_a`` side by side, ``lora_b`` block-diagonal, different scales folded
  into their blocks, so the joined update is the members' updates side by side;
- merge: the destination kernel is the float64 effective kernel rounded once.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from _port_helpers import LLAMA_TO_PHI3, PHI3_TO_LLAMA, V, _close, _phi3_pair

# peft's get_peft_model reads a transformers property that transformers 5 deprecates: theirs, not ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

IDS = np.random.default_rng(0).integers(0, V, (2, 7))
EPS32 = float(np.finfo(np.float32).eps)


def _logits(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def _peft(model, targets, seed: int = 1, **config):
    """``model`` with PEFT LoRA injected on ``targets``, random factors (B is not zero)."""
    import torch

    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = {"r": 4, "lora_alpha": 8, **config}
    wrapped = peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, init_lora_weights=False, **config))
    return wrapped.get_base_model().eval()


def _llama(transformers, kw, seed: int = 0):
    import torch
    from _port_helpers import randomize as _randomize

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    _randomize(model, seed)
    return model


def _params(model, path: str) -> dict:
    return {k: np.asarray(v) for k, v in db.get_params(model.get_submodule(path)).items()}


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before: dict) -> None:
    import torch

    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


QKV = ("q_proj", "k_proj", "v_proj")


def test_a_fused_adapter_splits_into_the_pieces_with_lora_keep():
    transformers, kw, phi3 = _phi3_pair()
    base = _logits(phi3)
    phi3 = _peft(phi3, ["qkv_proj", "gate_up_proj"])
    want = _logits(phi3)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    report = db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA, lora="keep")
    assert report.not_moved_src == [] and report.not_moved_dst == []
    assert sorted(report.lora["kept"]) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in
                                                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                  "mlp.gate_proj", "mlp.up_proj"))
    got = _logits(llama)  # the transfer wrapped dst's layers with PEFT's own lora.Linear
    _close(want, got, "phi3+lora vs split llama+lora")
    assert np.max(np.abs(got - base)) > 1e-2 * np.max(np.abs(base)), "the adapters changed nothing"

    fused = _params(phi3, "model.layers.1.self_attn.qkv_proj")
    start = 0
    for name in QKV:
        piece = _params(llama, f"model.layers.1.self_attn.{name}")
        units = piece["kernel"].shape[1]
        np.testing.assert_array_equal(piece["lora_a"], fused["lora_a"])  # (in, r): shared
        np.testing.assert_array_equal(piece["lora_b"], fused["lora_b"][:, start:start + units])  # (r, units_i)
        assert float(piece["lora_scale"]) == float(fused["lora_scale"]) == 2.0
        start += units
    assert start == fused["kernel"].shape[1]


def test_split_adapters_join_into_one_fused_adapter_with_lora_keep():
    transformers, kw, _ = _phi3_pair()
    llama = _llama(transformers, kw)
    base = _logits(llama)
    # different ranks and scales per member: the joined adapter folds the scales into lora_b
    llama = _peft(llama, list(QKV) + ["gate_proj", "up_proj"], rank_pattern={"k_proj": 2, "up_proj": 3},
                  alpha_pattern={"v_proj": 3, "up_proj": 6})
    want = _logits(llama)
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    report = db.transfer(llama, phi3, mapping=LLAMA_TO_PHI3, lora="keep")
    assert report.not_moved_src == [] and report.not_moved_dst == []
    got = _logits(phi3)
    _close(want, got, "split llama+lora vs phi3+joined lora")
    assert np.max(np.abs(got - base)) > 1e-2 * np.max(np.abs(base)), "the adapters changed nothing"

    # q, k, v scales 2, 4, 0.75: folded into lora_b under 1; gate and up both 2 (r 4 and 3): kept
    for fused_path, members, scale in (("self_attn.qkv_proj", [f"self_attn.{n}" for n in QKV], 1.0),
                                       ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"], 2.0)):
        joined = _params(phi3, f"model.layers.0.{fused_path}")
        parts = [_params(llama, f"model.layers.0.{p}") for p in members]
        ranks = [p["lora_a"].shape[1] for p in parts]
        assert joined["lora_a"].shape[1] == sum(ranks)
        np.testing.assert_array_equal(joined["lora_a"], np.concatenate([p["lora_a"] for p in parts], axis=1))
        assert [float(p["lora_scale"]) for p in parts] == ([2.0, 4.0, 0.75] if scale == 1.0 else [2.0, 2.0])
        assert float(joined["lora_scale"]) == scale
        # block-diagonal lora_b: member i's rows are zero outside its units
        row = col = 0
        for p, r in zip(parts, ranks):
            units = p["kernel"].shape[1]
            block = joined["lora_b"][row:row + r]
            assert not block[:, :col].any() and not block[:, col + units:].any()
            row, col = row + r, col + units
        # the joined update is the members' updates side by side, within one float32 rounding of lora_b
        ref = np.concatenate([db.lora.update(p) for p in parts], axis=1)
        bound = EPS32 * np.concatenate([np.abs(p["lora_a"]).astype(np.float64) @ np.abs(
            float(p["lora_scale"]) * p["lora_b"].astype(np.float64)) for p in parts], axis=1)
        err = np.abs(db.lora.update(joined) - ref)
        assert np.all(err <= bound), f"{fused_path}: {np.max(err / np.maximum(bound, 1e-300))} roundings"


def test_equal_scales_join_exactly_under_the_common_scale():
    transformers, kw, _ = _phi3_pair()
    llama = _peft(_llama(transformers, kw), list(QKV), rank_pattern={"k_proj": 2})  # r=2 scale 4, r=4 scale 2
    llama2 = _peft(_llama(transformers, kw), list(QKV), r=2, lora_alpha=4)  # all scales 2
    for src, common in ((llama, None), (llama2, 2.0)):
        phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
        db.transfer(src, phi3, mapping=LLAMA_TO_PHI3, lora="keep")
        joined = _params(phi3, "model.layers.1.self_attn.qkv_proj")
        parts = [_params(src, f"model.layers.1.self_attn.{n}") for n in QKV]
        if common is not None:
            assert float(joined["lora_scale"]) == common
            np.testing.assert_array_equal(  # no folding: the factors themselves, bit for bit
                joined["lora_b"][:2, :32], parts[0]["lora_b"])
        _close(_logits(src), _logits(phi3), "joined")


def test_lora_merge_splits_and_joins_into_the_float64_reference_rounded_once():
    transformers, kw, phi3 = _phi3_pair()
    phi3 = _peft(phi3, ["qkv_proj", "gate_up_proj"])
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    report = db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA, lora="merge")
    assert len(report.lora["merged"]) == 10 and report.lora["kept"] == []
    assert db.lora.lora_of(llama.model.layers[0].self_attn.q_proj) is None  # no adapter attached
    _close(_logits(phi3), _logits(llama), "phi3+lora vs merged split llama")
    fused = _params(phi3, "model.layers.0.mlp.gate_up_proj")
    ref = (fused["kernel"].astype(np.float64) + float(fused["lora_scale"]) *
           (fused["lora_a"].astype(np.float64) @ fused["lora_b"].astype(np.float64))).astype(np.float32)
    got = np.concatenate([_params(llama, f"model.layers.0.mlp.{n}")["kernel"] for n in ("gate_proj", "up_proj")], 1)
    np.testing.assert_array_equal(got, ref)

    src = _peft(_llama(transformers, kw), list(QKV) + ["gate_proj", "up_proj"], alpha_pattern={"v_proj": 3})
    back = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    db.transfer(src, back, mapping=LLAMA_TO_PHI3, lora="merge")
    _close(_logits(src), _logits(back), "llama+lora vs merged phi3")
    parts = [_params(src, f"model.layers.1.self_attn.{n}") for n in QKV]
    ref = np.concatenate([db.lora.effective_kernel(p["kernel"], db.lora.split(p)[1]) for p in parts], 1)
    np.testing.assert_array_equal(_params(back, "model.layers.1.self_attn.qkv_proj")["kernel"],
                                  ref.astype(np.float32))


def test_fused_adapter_refusals_leave_dst_unchanged():
    transformers, kw, phi3 = _phi3_pair()
    phi3 = _peft(phi3, ["qkv_proj"])
    llama = _llama(transformers, kw, seed=3)
    before = _state(llama)
    with pytest.raises(db.ConversionError, match=r"qkv_proj.*lora='keep' or lora='merge'"):
        db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA)  # lora=None: the adapter is never dropped silently
    _unchanged(llama, before)

    # a dst already holding adapters of another rank: refused, and nothing attached or written
    held = _peft(_llama(transformers, kw, seed=4), list(QKV), r=2, lora_alpha=4)
    before = _state(held)
    with pytest.raises(db.ConversionError, match="adapter ranks differ"):
        db.transfer(phi3, held, mapping=PHI3_TO_LLAMA, lora="keep")
    _unchanged(held, before)

    # layers of different in_features cannot join along units
    src = _peft(_llama(transformers, kw), list(QKV) + ["down_proj"])
    dst = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    before = _state(dst)
    rules = [((r"model\.layers\.0\.self_attn\.q_proj", r"model\.layers\.0\.self_attn\.k_proj",
               r"model\.layers\.0\.mlp\.down_proj"), "model.layers.0.self_attn.qkv_proj")] + LLAMA_TO_PHI3
    with pytest.raises(db.ConversionError, match=r"in_features \[32, 48\]"):
        db.transfer(src, dst, mapping=rules, lora="keep")
    _unchanged(dst, before)
    assert db.lora.lora_of(dst.model.layers[0].self_attn.qkv_proj) is None


def test_split_adapters_join_into_mlx_lm_phi3_as_one_lora_linear():
    pytest.importorskip("mlx")
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.models import phi3 as mlx_phi3
    from mlx_lm.tuner.lora import LoRALinear

    transformers, kw, _ = _phi3_pair()
    base = _logits(_llama(transformers, kw))
    llama = _peft(_llama(transformers, kw), list(QKV) + ["gate_proj", "up_proj"], rank_pattern={"k_proj": 2},
                  alpha_pattern={"v_proj": 3})
    dst = mlx_phi3.Model(mlx_phi3.ModelArgs(
        model_type="phi3", hidden_size=kw["hidden_size"], num_hidden_layers=kw["num_hidden_layers"],
        intermediate_size=kw["intermediate_size"], num_attention_heads=kw["num_attention_heads"],
        num_key_value_heads=kw["num_key_value_heads"], rms_norm_eps=kw["rms_norm_eps"], vocab_size=V,
        max_position_embeddings=kw["max_position_embeddings"]))
    db.transfer(llama, dst, mapping=LLAMA_TO_PHI3, lora="keep")
    qkv = dst.model.layers[0].self_attn.qkv_proj
    assert type(qkv) is LoRALinear and _params(llama, "model.layers.0.self_attn.q_proj")["lora_a"].shape[1] == 4
    assert db.get_params(qkv)["lora_a"].shape[1] == 4 + 2 + 4  # ranks add up
    got = np.asarray(dst(mx.array(IDS)))
    _close(_logits(llama), got, "llama+lora (torch) vs mlx-lm phi3+joined lora")
    assert np.max(np.abs(got - base)) > 1e-2 * np.max(np.abs(base)), "the adapters changed nothing"


def test_dora_splits_per_unit_and_a_join_of_dora_with_undora_members_is_refused():
    transformers, kw, phi3 = _phi3_pair()
    phi3 = _peft(phi3, ["qkv_proj"], use_dora=True)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    db.transfer(phi3, llama, mapping=PHI3_TO_LLAMA, lora="keep")  # DoRA's norm is per unit: it splits
    _close(_logits(phi3), _logits(llama), "phi3+dora vs split llama+dora")

    # DoRA on every member joins: magnitudes side by side, the norms stay per unit
    dora = _peft(_llama(transformers, kw), list(QKV), use_dora=True, alpha_pattern={"v_proj": 3})
    back = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    db.transfer(dora, back, mapping=LLAMA_TO_PHI3, lora="keep")
    assert "lora_magnitude" in db.get_params(back.model.layers[0].self_attn.qkv_proj)
    _close(_logits(dora), _logits(back), "llama+dora vs phi3+joined dora")

    # DoRA on q and k, none on v: v's units have no magnitude the joined DoRA layer could hold
    src = _peft(_llama(transformers, kw), ["q_proj", "k_proj"], use_dora=True)
    dst = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).eval()
    before = _state(dst)
    with pytest.raises(db.ConversionError, match="DoRA on some of the joined layers only"):
        db.transfer(src, dst, mapping=LLAMA_TO_PHI3, lora="keep")
    _unchanged(dst, before)


def test_per_head_interleaved_adapters_split_and_join_per_head():
    import torch
    from _port_helpers import FF, HEADS, POS, H, randomize as _randomize

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                                     intermediate_size=FF, max_position_embeddings=POS, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    neox = transformers.GPTNeoXModel(cfg).eval()
    _randomize(neox)
    neox = _peft(neox, ["query_key_value"])

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(H, H) for _ in range(3))

    split = Split()
    rule = {"layers.0.attention.query_key_value": {"to": ["q", "k", "v"], "heads": HEADS}}
    db.transfer(neox, split, mapping=rule, strict=False, lora="keep")
    x = torch.randn(2, 5, H)
    with torch.no_grad():  # GPT-NeoX's own reading of its fused output: per head, q | k | v
        qkv = neox.layers[0].attention.query_key_value(x).view(2, 5, HEADS, 3 * (H // HEADS))
        for mine, theirs in zip((split.q, split.k, split.v), qkv.chunk(3, dim=-1)):
            torch.testing.assert_close(mine(x), theirs.reshape(2, 5, H), rtol=0, atol=1e-5)

    # and back: the three adapters joined per head into a fresh GPT-NeoX compute what the first did
    fresh = transformers.GPTNeoXModel(cfg).eval()
    back = {("q", "k", "v"): {"to": "layers.0.attention.query_key_value", "heads": HEADS}}
    db.transfer(split, fresh, mapping=back, strict=False, lora="keep")
    assert db.get_params(fresh.layers[0].attention.query_key_value)["lora_a"].shape[1] == 3 * 4
    with torch.no_grad():
        torch.testing.assert_close(fresh.layers[0].attention.query_key_value(x),
                                   neox.layers[0].attention.query_key_value(x), rtol=0, atol=1e-5)
