"""LoRA adapters across frameworks: PEFT and mlx-lm layers as one linear layer, transfer(lora=),
merge_lora, adapter files and the ``adapter`` CLI verb, on real libraries with tiny random configs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dense_bridge as db

# peft's get_peft_model reads a transformers property that transformers 5 deprecates: theirs, not ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

SAME = [(r"(.*)", r"\1")]
H, INTER, LAYERS, V = 32, 48, 2, 64
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
VARIANTS = {"lora": {}, "rslora": {"use_rslora": True}, "dora": {"use_dora": True}}


def _torch_stack():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    return torch, transformers, peft


def _llama_config(transformers):
    return transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    rms_norm_eps=1e-5, tie_word_embeddings=False)


def _peft_llama(variant: str, seed: int = 0, targets=TARGETS, peft_model=False, **extra):
    """A tiny transformers Llama with a trained-looking PEFT adapter (random factors and magnitude):
    the transformers model with PEFT's layers injected, or (``peft_model``) the PeftModel around it."""
    torch, transformers, peft = _torch_stack()
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(_llama_config(transformers)).eval()
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False,
                             **VARIANTS[variant], **extra)
    wrapped = peft.get_peft_model(base, config)
    model = wrapped.get_base_model().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_magnitude_vector") and "default" in m.lora_magnitude_vector:
                w = m.lora_magnitude_vector["default"].weight
                w.mul_(1 + 0.2 * torch.rand(w.shape, generator=gen))
    return wrapped if peft_model else model


def _plain_llama(seed: int = 0):
    torch, transformers, _ = _torch_stack()
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_llama_config(transformers)).eval()


def _mlx_llama():
    pytest.importorskip("mlx")
    pytest.importorskip("mlx_lm")
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=H, num_hidden_layers=LAYERS, intermediate_size=INTER, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V, tie_word_embeddings=False, rope_theta=10000.0))


IDS = np.random.default_rng(0).integers(0, V, (2, 7))


def _torch_logits(model):
    import torch

    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def _mlx_logits(model):
    import mlx.core as mx

    return np.asarray(model(mx.array(IDS)))


def _close(want, got, what):
    err = float(np.max(np.abs(want - got)))
    assert err < 2e-5 * max(1.0, float(np.max(np.abs(want)))), f"{what}: max abs error {err}"
    return err


def _far(want, got, what):
    assert float(np.max(np.abs(want - got))) > 1e-2, f"{what}: the adapter changed nothing"


# ----------------------------------------------------------------------------- one linear layer
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_peft_layer_is_one_linear_layer_with_canonical_adapter_keys(variant):
    model = _peft_llama(variant)
    layers = db.linear_layers(model)
    assert "model.layers.0.self_attn.q_proj" in layers
    assert not [p for p in layers if "lora_" in p or "base_layer" in p]
    assert len(layers) == LAYERS * 7 + 1  # q k v o gate up down per block, and lm_head
    q = layers["model.layers.0.self_attn.q_proj"]
    params = db.get_params(q)
    assert params["lora_a"].shape == (H, 8) and params["lora_b"].shape == (8, H)
    np.testing.assert_array_equal(params["lora_a"], q.lora_A["default"].weight.detach().numpy().T)
    np.testing.assert_array_equal(params["lora_b"], q.lora_B["default"].weight.detach().numpy().T)
    np.testing.assert_array_equal(params["kernel"], q.base_layer.weight.detach().numpy().T)
    assert params["lora_scale"].shape == () and params["lora_scale"].dtype == np.float64
    want_scale = 16 / np.sqrt(8) if variant == "rslora" else 2.0
    assert float(params["lora_scale"]) == want_scale
    assert ("lora_magnitude" in params) == (variant == "dora")
    # the effective kernel computes the layer: x @ kernel_eff matches PEFT's forward
    import torch

    x = np.random.default_rng(1).standard_normal((3, H)).astype(np.float32)
    with torch.no_grad():
        want = q(torch.tensor(x)).numpy()
    got = x.astype(np.float64) @ db.lora.effective_kernel(params["kernel"], params)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # set_params writes adapter keys too, checked like the rest
    db.set_params(q, {**params, "lora_scale": np.array(0.25)})
    assert q.scaling["default"] == 0.25
    with pytest.raises(db.ConversionError, match="lora_a"):
        db.set_params(q, {**params, "lora_a": np.zeros((H, 4), np.float32)})
    with pytest.raises(db.ConversionError, match=r"missing keys: \['lora_a'"):
        db.set_params(q, {"kernel": params["kernel"]})
    db.set_params(q, {"kernel": params["kernel"]}, strict=False)
    with pytest.raises(db.ConversionError, match="no adapter"):
        db.set_params(layers["model.layers.0.self_attn.k_proj"], {**db.get_params(
            layers["model.layers.0.self_attn.k_proj"]), "lora_scale": np.array(1.0)})


def test_peft_conv1d_fan_in_fan_out_keeps_factor_layouts():
    torch, transformers, peft = _torch_stack()
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=H, n_layer=1, n_head=4,
                                                                n_positions=16)).eval()
    model = peft.get_peft_model(gpt2, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                      fan_in_fan_out=True, init_lora_weights=False)).get_base_model()
    layer = db.linear_layers(model)["transformer.h.0.attn.c_attn"]
    params = db.get_params(layer)
    assert params["kernel"].shape == (H, 3 * H)  # Conv1D stores (in, out): canonical as is
    np.testing.assert_array_equal(params["kernel"], layer.base_layer.weight.detach().numpy())
    assert params["lora_a"].shape == (H, 4) and params["lora_b"].shape == (4, 3 * H)
    np.testing.assert_array_equal(params["lora_a"], layer.lora_A["default"].weight.detach().numpy().T)
    x = np.random.default_rng(2).standard_normal((2, 3, H)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.tensor(x)).numpy()
    got = x.astype(np.float64) @ db.lora.effective_kernel(params["kernel"], params) + params["bias"]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_layer_with_two_adapters_is_refused_naming_both():
    model = _peft_llama("lora", targets=["q_proj"])
    q = db.linear_layers(model)["model.layers.0.self_attn.q_proj"]
    import peft

    q.update_layer("second", 4, lora_alpha=4, config=peft.LoraConfig(r=4, lora_alpha=4))
    with pytest.raises(db.ConversionError, match=r"\['default', 'second'\]"):
        db.get_params(q)


def test_convert_of_a_lora_layer_says_what_to_do():
    q = db.linear_layers(_peft_llama("lora", targets=["q_proj"]))["model.layers.0.self_attn.q_proj"]
    with pytest.raises(db.ConversionError, match="merge_lora"):
        db.convert(q, to="numpy")


# ----------------------------------------------------------------------------- transfer(lora=)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_peft_llama_moves_into_mlx_lm_with_lora_keep(variant, tmp_path):
    src = _peft_llama(variant)
    base_logits = _torch_logits(_plain_llama())
    want = _torch_logits(src)
    _far(want, base_logits, "PEFT vs base")
    # lora=None: an error listing every adapted layer, nothing written
    dst = _mlx_llama()
    with pytest.raises(db.ConversionError, match=r"(?s)q_proj.*LoRA adapter.*v_proj.*lora='keep'"):
        db.transfer(src, dst, mapping=SAME)
    report = db.transfer(src, dst, mapping=SAME, lora="keep")
    assert len(report.lora["kept"]) == LAYERS * len(TARGETS)
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    wrapper = DoRALinear if variant == "dora" else LoRALinear
    assert type(dst.model.layers[0].self_attn.q_proj) is wrapper
    got = _mlx_logits(dst)
    _close(want, got, f"{variant}: PEFT vs mlx-lm port")
    _far(got, base_logits, f"{variant}: mlx-lm port vs base")  # the update is there (no silent zeros)
    # mlx-lm's own adapter loading of the directory save_adapter wrote gives the same outputs
    from mlx_lm.tuner.utils import load_adapters

    out = tmp_path / "mlx"
    db.save_adapter(src, out, format="mlx-lm")
    plain = _mlx_llama()
    db.transfer(_plain_llama(), plain, mapping=SAME)
    load_adapters(plain, str(out))
    _close(want, _mlx_logits(plain), f"{variant}: mlx-lm load_adapters")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["num_layers"] == LAYERS and config["lora_parameters"]["rank"] == 8
    assert config["fine_tune_type"] == ("dora" if variant == "dora" else "lora")
    assert sorted(config["lora_parameters"]["keys"]) == ["mlp.down_proj", "self_attn.o_proj", "self_attn.q_proj",
                                                         "self_attn.v_proj"]
    # the CLI's conversion of the PEFT directory likewise
    peft_dir, cli_dir = tmp_path / "peft", tmp_path / "cli"
    _save_peft(src, peft_dir)
    run = subprocess.run([sys.executable, "-m", "dense_bridge.cli", "adapter", str(peft_dir), "--to", "mlx-lm",
                          "-o", str(cli_dir), "--num-layers", str(LAYERS)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    plain = _mlx_llama()
    db.transfer(_plain_llama(), plain, mapping=SAME)
    load_adapters(plain, str(cli_dir))
    _close(want, _mlx_logits(plain), f"{variant}: CLI conversion loaded by mlx-lm")


def _save_peft(model, path):
    """PEFT's own save_pretrained of the adapter injected into ``model``."""
    import peft

    state = peft.get_peft_model_state_dict(model)
    config = next(iter(model.peft_config.values()))
    os.makedirs(path, exist_ok=True)
    from safetensors.torch import save_file

    save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))


def test_mlx_lm_adapters_move_back_into_plain_transformers_as_peft(tmp_path):
    peft = pytest.importorskip("peft")
    src = _peft_llama("lora")
    want = _torch_logits(src)
    mid = _mlx_llama()
    db.transfer(src, mid, mapping=SAME, lora="keep")
    back = _plain_llama(seed=5)  # other base weights: all of them move
    db.transfer(mid, back, mapping=SAME, lora="keep")
    q = back.model.layers[0].self_attn.q_proj
    assert type(q) is peft.tuners.lora.layer.Linear  # PEFT's own class, attached
    _close(want, _torch_logits(back), "mlx-lm -> transformers + PEFT")
    # files both ways: PEFT dir from the MLX model, read by PEFT itself
    db.save_adapter(mid, tmp_path / "peft", format="peft")
    loaded = peft.PeftModel.from_pretrained(_plain_llama(), str(tmp_path / "peft")).eval()
    _close(want, _torch_logits(loaded), "PeftModel.from_pretrained of save_adapter(format='peft')")
    # load_adapter of a PEFT dir into a plain mlx-lm model
    plain = _mlx_llama()
    db.transfer(_plain_llama(), plain, mapping=SAME)
    ranks = db.load_adapter(tmp_path / "peft", plain)
    assert set(ranks.values()) == {8} and len(ranks) == LAYERS * len(TARGETS)
    _close(want, _mlx_logits(plain), "load_adapter(peft dir, mlx model)")


def test_lora_merge_mode_adds_into_destination_kernels():
    src = _peft_llama("dora")
    dst = _mlx_llama()
    report = db.transfer(src, dst, mapping=SAME, lora="merge")
    assert "model.layers.0.self_attn.q_proj" in report.lora["merged"]
    import mlx.nn as nn

    assert type(dst.model.layers[0].self_attn.q_proj) is nn.Linear
    _close(_torch_logits(src), _mlx_logits(dst), "merge")


def test_bad_lora_arguments():
    src, dst = _peft_llama("lora"), _mlx_llama()
    with pytest.raises(TypeError, match="lora"):
        db.transfer(src, dst, mapping=SAME, lora="fuse")
    with pytest.raises(TypeError, match="allow_rounding"):
        db.transfer(src, dst, mapping=SAME, lora="keep", allow_rounding="yes")
    with pytest.raises(db.SpecError, match="format"):
        db.save_adapter(src, "/nonexistent", format="onnx")


# ----------------------------------------------------------------------------- merge_lora
def _float64_merged(params):
    """The reference, written out here (not dense_bridge's code): W + s * A @ B in float64, DoRA's
    m * V / ||V|| per unit column, rounded once to the kernel's dtype."""
    f64 = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    v = f64["kernel"] + float(f64["lora_scale"]) * (f64["lora_a"] @ f64["lora_b"])
    if "lora_magnitude" in f64:
        v = v * (f64["lora_magnitude"] / np.sqrt(np.sum(v * v, axis=0)))[None, :]
    return v.astype(params["kernel"].dtype)


def _merge_bound(params, dora):
    """How far a framework's float32 merge may sit from the float64 one rounded once: a few eps of
    |W| + s|A||B| (the float32 update's rounding, then the add's)."""
    size = np.abs(params["kernel"]) + float(params["lora_scale"]) * np.abs(params["lora_a"]) @ np.abs(params["lora_b"])
    return (4 if dora else 2) * np.finfo(np.float32).eps * size


def _ulps(a, b):
    ai = a.astype(np.float32).view(np.int32).astype(np.int64)
    bi = b.astype(np.float32).view(np.int32).astype(np.int64)
    return int(np.max(np.abs(ai - bi)))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_merge_lora_is_the_float64_reference_rounded_once(variant):
    torch = pytest.importorskip("torch")
    model = _peft_llama(variant)
    before = {p: db.get_params(l) for p, l in db.linear_layers(model).items()}
    want = _torch_logits(model)
    twin = _peft_llama(variant, peft_model=True).merge_and_unload()  # PEFT's own merge, on a twin
    report = db.merge_lora(model)
    assert len(report.merged) == LAYERS * len(TARGETS)
    after = db.linear_layers(model)
    assert isinstance(after["model.layers.0.self_attn.q_proj"], torch.nn.Linear)
    for p, params in before.items():
        if "lora_a" not in params:
            continue
        got = db.get_params(after[p])["kernel"]
        ref = _float64_merged(params)
        if variant == "dora":
            assert _ulps(got, ref) <= 2, p
        else:
            np.testing.assert_array_equal(got, ref, err_msg=p)
        # PEFT's merge rounds a float32 update first (measured: up to 1.62 eps of |W| + s|A||B|, 1.92 for DoRA)
        peft_w = dict(twin.named_modules())[p].weight.detach().numpy().T
        assert np.all(np.abs(peft_w.astype(np.float64) - got) <= _merge_bound(params, variant == "dora")), p
    _close(want, _torch_logits(model), "merged model")
    assert str(report).startswith("merge_lora: ")


@pytest.mark.parametrize("dora", [False, True])
def test_merge_lora_on_mlx_matches_reference_and_mlx_lm_fuse(dora):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    src = _peft_llama("dora" if dora else "lora")
    model, twin = _mlx_llama(), _mlx_llama()
    db.transfer(src, model, mapping=SAME, lora="keep")
    db.transfer(src, twin, mapping=SAME, lora="keep")
    before = {p: db.get_params(l) for p, l in db.linear_layers(model).items()}
    want = _mlx_logits(model)
    db.merge_lora(model)
    q = twin.model.layers[1].self_attn.q_proj
    fused = q.fuse()
    mx.eval(fused.weight)
    got = db.get_params(model.model.layers[1].self_attn.q_proj)["kernel"]
    params = before["model.layers.1.self_attn.q_proj"]
    ref = _float64_merged(params)
    assert _ulps(got, ref) <= (2 if dora else 0)
    theirs = np.asarray(fused.weight).T
    assert np.all(np.abs(theirs.astype(np.float64) - got) <= _merge_bound(params, dora))
    _close(want, _mlx_logits(model), "merged mlx model")


# ----------------------------------------------------------------------------- compare_models
@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_compare_models_passes_on_a_lora_port_and_names_a_dropped_or_misscaled_adapter(variant):
    """The adapter's own path (x @ A over in_features, then @ B over the rank, times the scale,
    then the add; DoRA's per-unit norm) is part of each side's allowed rounding, and the layer is
    judged through its effective kernel: correct ports pass at torch's 1 and 2 threads and over
    several draws, while a mis-scaled or dropped adapter is named at its layer."""
    import torch

    threads = torch.get_num_threads()
    try:
        for seed in range(3):
            src = _peft_llama(variant, seed=seed)
            port = _mlx_llama()
            db.transfer(src, port, mapping=SAME, lora="keep")
            inputs = [np.random.default_rng(seed).integers(0, V, (2, 7))]
            for n in (1, 2):
                torch.set_num_threads(n)
                for isolated in (False, True):
                    report = db.testing.compare_models(src, port, inputs, mapping=SAME, seed=seed, isolated=isolated)
                    assert report.passed, f"seed {seed}, {n} thread(s), isolated={isolated}: {report}"
        torch.set_num_threads(1)
        # one adapter mis-scaled, by 2x and by 1%
        layer = db.linear_layers(port)["model.layers.1.self_attn.v_proj"]
        good = db.get_params(layer)
        for scale in (1.0, float(good["lora_scale"]) * 1.01):
            db.set_params(layer, {**good, "lora_scale": np.array(scale)})
            report = db.testing.compare_models(src, port, inputs, mapping=SAME)
            assert not report.passed and report.first_divergence == "model.layers.1.self_attn.v_proj", str(report)
            assert report.first_failure.quantity == "output"
        db.set_params(layer, good)
        assert db.testing.compare_models(src, port, inputs, mapping=SAME).passed
        # one adapter dropped
        from mlx_lm.tuner.dora import DoRALinear
        from mlx_lm.tuner.lora import LoRALinear

        attn = port.model.layers[0].self_attn
        assert type(attn.o_proj) is (DoRALinear if variant == "dora" else LoRALinear)
        attn.o_proj = attn.o_proj.linear
        for n in (1, 2):
            torch.set_num_threads(n)
            report = db.testing.compare_models(src, port, inputs, mapping=SAME)
            assert not report.passed and report.first_divergence == "model.layers.0.self_attn.o_proj", str(report)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- the CLI refuses
def test_cli_refuses_what_mlx_lm_cannot_hold(tmp_path):
    src = _peft_llama("lora", rank_pattern={"down_proj": 4})  # alpha 16 / r 4: another scale
    _save_peft(src, tmp_path / "peft")
    run = subprocess.run([sys.executable, "-m", "dense_bridge.cli", "adapter", str(tmp_path / "peft"), "--to",
                          "mlx-lm", "-o", str(tmp_path / "out"), "--num-layers", "2"], capture_output=True, text=True)
    assert run.returncode == 2 and "one scale" in run.stderr and "down_proj" in run.stderr
    assert not (tmp_path / "out").exists()
    # adapters only in block 0 of 2: not the last blocks of the stack
    only_first = _peft_llama("lora", layers_to_transform=[0])
    _save_peft(only_first, tmp_path / "first")
    run = subprocess.run([sys.executable, "-m", "dense_bridge.cli", "adapter", str(tmp_path / "first"), "--to",
                          "mlx-lm", "-o", str(tmp_path / "out2"), "--num-layers", "2"], capture_output=True, text=True)
    assert run.returncode == 2 and "model.layers.1" in run.stderr, run.stderr
    # no layer count for mlx-lm's num_layers
    run = subprocess.run([sys.executable, "-m", "dense_bridge.cli", "adapter", str(tmp_path / "first"), "--to",
                          "mlx-lm", "-o", str(tmp_path / "out3")], capture_output=True, text=True)
    assert run.returncode == 2 and "--num-layers" in run.stderr


# ----------------------------------------------------------------------------- Flax, and frameworks without adapters
def _toy_peft(alpha):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(8, 6)
            self.o = torch.nn.Linear(6, 4)

        def forward(self, x):
            return self.o(self.q(x))

    torch.manual_seed(0)
    return peft.get_peft_model(Toy(), peft.LoraConfig(r=4, lora_alpha=alpha, target_modules=["q"],
                                                      init_lora_weights=False)).get_base_model().eval()


def _toy_out(model, x):
    import torch

    with torch.no_grad():
        return model(torch.tensor(x)).numpy()


def test_flax_lora_linear_holds_a_power_of_two_scale_exactly_and_rounds_others_only_when_allowed():
    pytest.importorskip("flax")
    import jax.numpy as jnp
    from flax import nnx

    class Toy(nnx.Module):
        def __init__(self):
            self.q = nnx.Linear(8, 6, rngs=nnx.Rngs(0))
            self.o = nnx.Linear(6, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.o(self.q(x))

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    src = _toy_peft(alpha=8)  # scale 2: folded into lora_b exactly
    dst = Toy()
    report = db.transfer(src, dst, mapping=SAME, lora="keep")
    assert type(dst.q) is nnx.LoRALinear and report.lora["rounding"] == {}
    theirs, ours = db.get_params(db.linear_layers(src)["q"]), db.get_params(dst.q)
    np.testing.assert_array_equal(ours["lora_a"], theirs["lora_a"])
    np.testing.assert_array_equal(ours["lora_b"], theirs["lora_b"] * 2)
    assert float(ours["lora_scale"]) == 1.0
    np.testing.assert_allclose(np.asarray(dst(jnp.asarray(x))), _toy_out(src, x), atol=1e-6)
    # alpha 6 / r 4 = 1.5: folding rounds; refused, then accepted and reported
    src = _toy_peft(alpha=6)
    dst = Toy()
    with pytest.raises(db.ConversionError, match="allow_rounding=True"):
        db.transfer(src, dst, mapping=SAME, lora="keep")
    assert type(dst.q) is nnx.Linear  # nothing was attached
    report = db.transfer(src, dst, mapping=SAME, lora="keep", allow_rounding=True)
    assert 0 < report.lora["rounding"]["q"] < 1e-6
    np.testing.assert_allclose(np.asarray(dst(jnp.asarray(x))), _toy_out(src, x), atol=1e-6)
    db.merge_lora(dst)
    assert type(dst.q) is nnx.Linear
    np.testing.assert_allclose(np.asarray(dst(jnp.asarray(x))), _toy_out(src, x), atol=1e-6)


def test_a_framework_without_adapter_classes_takes_merge_only():
    src = _toy_peft(alpha=8)
    dst = db.compile(db.Sequential([db.Dense(6, in_features=8), db.Dense(4)]), "numpy", seed=0)
    with pytest.raises(db.ConversionError, match="lora='merge'"):
        db.transfer(src, dst, lora="keep")
    db.transfer(src, dst, lora="merge")
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(dst.forward(x), _toy_out(src, x), atol=1e-5)


# ----------------------------------------------------------------------------- quantized bases
def _quantized_lora_block(update_size):
    """A 4-bit MLX QuantizedLinear (group 32) under an mlx-lm LoRALinear whose update has ``update_size``."""
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    import mlx.nn as nn
    from mlx_lm.tuner.lora import LoRALinear

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 32)

        def __call__(self, x):
            return self.proj(x)

    mx.random.seed(0)
    block = Block()
    block.proj = LoRALinear.from_base(nn.QuantizedLinear.from_linear(block.proj, group_size=32, bits=4), r=4, scale=1.0)
    rng = np.random.default_rng(0)
    block.proj.lora_a = mx.array(rng.standard_normal((64, 4)).astype(np.float32) / 8)
    block.proj.lora_b = mx.array(rng.standard_normal((4, 32)).astype(np.float32) * update_size)
    return block


def test_merge_lora_into_a_4_bit_mlx_base_reports_what_survived():
    import mlx.core as mx
    import mlx.nn as nn

    x = mx.array(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
    large = _quantized_lora_block(0.5)
    want = np.asarray(large(x))
    from dense_bridge.models import walk

    assert [e.kind for e in walk(large) if e.path == "proj"] == ["quantized"]
    report = db.merge_lora(large)
    large_survival = report.survival["proj"]
    assert type(large.proj) is nn.QuantizedLinear and large.proj.bits == 4 and large.proj.group_size == 32
    assert report.survival["proj"] > 0.8
    got = np.asarray(large(x))
    assert np.max(np.abs(got - want)) < 0.25 * np.max(np.abs(want))  # 4-bit rounding, but the fine-tune is there
    tiny = _quantized_lora_block(1e-4)
    with pytest.warns(UserWarning, match=r"erased most.*proj"):
        report = db.merge_lora(tiny)
    assert report.survival["proj"] < 0.5
    assert report.change_ratio["proj"] > 0  # requantization noise: codes flip, the update is not there
    print(f"survived: large update {large_survival:.4f}, tiny update {report.survival['proj']:.4f}")


def test_peft_parts_that_are_not_lora_linear_layers_are_named_not_dropped():
    src = _peft_llama("lora", targets=["q_proj", "embed_tokens"], modules_to_save=["lm_head"])
    rules = [(r"(.*)\.base_layer", r"\1"), (r"lm_head\.original_module", "lm_head"), (r"(model\.layers\..*)", r"\1"),
             (r"model\.norm", "model.norm")]
    with pytest.raises(db.ConversionError) as info:
        db.transfer(src, _mlx_llama(), mapping=rules, lora="keep", strict=False)
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 2, str(info.value)
    assert "'model.embed_tokens' is a PEFT" in problems[0] and "lora_embedding_A.default" in problems[0]
    assert "'lm_head' is a PEFT ModulesToSaveWrapper" in problems[1] and "modules_to_save.default.weight" in problems[1]


def test_dora_into_a_framework_without_dora_is_refused_before_anything_is_written():
    pytest.importorskip("flax")
    from flax import nnx

    src = _peft_llama("dora", targets=["q_proj"])

    class Toy(nnx.Module):
        def __init__(self):
            self.q = nnx.Linear(H, H, use_bias=False, rngs=nnx.Rngs(0))

    dst = Toy()
    before = np.array(dst.q.kernel.get_value())
    with pytest.raises(db.ConversionError, match="no DoRA adapter class"):
        db.transfer(src, dst, mapping={"model.layers.0.self_attn.q_proj": "q"}, lora="keep", strict=False)
    assert type(dst.q) is nnx.Linear
    np.testing.assert_array_equal(np.asarray(dst.q.kernel.get_value()), before)


def test_cli_round_trip_peft_mlx_lm_peft_with_base_config_and_load_adapter_into_torch(tmp_path):
    peft = pytest.importorskip("peft")
    src = _peft_llama("rslora")
    want = _torch_logits(src)
    _save_peft(src, tmp_path / "peft")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS, "model_type": "llama"}))
    cli = [sys.executable, "-m", "dense_bridge.cli", "adapter"]
    run = subprocess.run(cli + [str(tmp_path / "peft"), "--to", "mlx-lm", "-o", str(tmp_path / "mlx"),
                                "--base-config", str(tmp_path / "config.json")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    run = subprocess.run(cli + [str(tmp_path / "mlx"), "--to", "peft", "-o", str(tmp_path / "back"), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["layers"] == LAYERS * len(TARGETS)
    loaded = peft.PeftModel.from_pretrained(_plain_llama(), str(tmp_path / "back")).eval()
    _close(want, _torch_logits(loaded), "PEFT -> mlx-lm -> PEFT through the CLI")
    # db.load_adapter of the mlx-lm directory into a plain transformers model: PEFT's class attached
    plain = _plain_llama()
    ranks = db.load_adapter(tmp_path / "mlx", plain)
    assert len(ranks) == LAYERS * len(TARGETS)
    assert type(plain.model.layers[1].mlp.down_proj) is peft.tuners.lora.layer.Linear
    _close(want, _torch_logits(plain), "load_adapter(mlx-lm dir, transformers model)")
    # a mapping that sends a file layer nowhere is refused, nothing attached
    fresh = _plain_llama()
    with pytest.raises(db.ConversionError, match="no such linear layer"):
        db.load_adapter(tmp_path / "mlx", fresh, mapping={"model.layers.0.self_attn.q_proj": "nowhere"})
    assert not db.lora.lora_of(fresh.model.layers[0].self_attn.v_proj)


def test_convert_adapter_writes_whole_directories_or_nothing(tmp_path):
    """db.convert_adapter (behind `dense-bridge adapter`): PEFT -> mlx-lm -> PEFT keeps the update
    exactly; a refused conversion and a non-empty output directory leave nothing behind."""
    peft = pytest.importorskip("peft")
    src = _peft_llama("lora")
    want = _torch_logits(src)
    _save_peft(src, tmp_path / "peft")
    assert set(db.ADAPTER_DIRECTORY_FORMATS) == {"peft", "mlx-lm"}
    summary = db.convert_adapter(str(tmp_path / "peft"), str(tmp_path / "mlx"), to="mlx-lm", num_layers=LAYERS)
    assert summary == {"src": str(tmp_path / "peft"), "from": "peft", "to": "mlx-lm", "output": str(tmp_path / "mlx"),
                       "layers": LAYERS * len(TARGETS)}
    assert sorted(os.listdir(tmp_path / "mlx")) == sorted(db.ADAPTER_DIRECTORY_FORMATS["mlx-lm"])
    db.convert_adapter(str(tmp_path / "mlx"), str(tmp_path / "back"), to="peft")
    loaded = peft.PeftModel.from_pretrained(_plain_llama(), str(tmp_path / "back")).eval()
    _close(want, _torch_logits(loaded), "db.convert_adapter PEFT -> mlx-lm -> PEFT")
    # refused (adapters only in block 0 of 2 cannot be mlx-lm's last blocks): no output, no temporary left
    _save_peft(_peft_llama("lora", layers_to_transform=[0]), tmp_path / "first")
    with pytest.raises(db.ConversionError, match="model.layers.1"):
        db.convert_adapter(str(tmp_path / "first"), str(tmp_path / "out"), to="mlx-lm", num_layers=LAYERS)
    assert sorted(os.listdir(tmp_path)) == ["back", "first", "mlx", "peft"]
    # a layer count of 10^8 (a flag, a config): the first blocks without adapters are named; nothing
    # of the count's size is built (a set of every expected key took gigabytes)
    with pytest.raises(db.ConversionError, match=r"100000000 blocks.*model\.layers\.2\."):
        db.convert_adapter(str(tmp_path / "peft"), str(tmp_path / "huge"), to="mlx-lm", num_layers=10**8)
    assert sorted(os.listdir(tmp_path)) == ["back", "first", "mlx", "peft"]
    with pytest.raises(db.CheckpointError, match="not an empty directory"):
        db.convert_adapter(str(tmp_path / "peft"), str(tmp_path / "back"), to="mlx-lm", num_layers=LAYERS)
