"""db.port(..., adapter=DIR, adapter_mode="merge" | "keep"): a PEFT or mlx-lm LoRA adapter carried
through a port, judged by the libraries' own code.

Tiny random Llama (GQA) and Qwen2 (tied head) models saved by ``save_pretrained``; PEFT's own
``LoraConfig`` with per-layer ``rank_pattern``/``alpha_pattern`` (scales 2 and 4), factors drawn at
random (PEFT starts B at zero) and saved by ``PeftModel.save_pretrained``. Merged: the destination
loaded by its own loader against PEFT's ``merge_and_unload()``. Kept: mlx-lm's own ``load`` with
``adapter_path`` (``load_adapters``), and PEFT's ``PeftModel.from_pretrained`` after the way back,
against the PEFT model's logits. Bad adapter directories are refused naming the file or module,
with nothing written. Nothing is downloaded; nothing is mocked.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import _close, mlx_lm_or_skip, transformers_or_skip
from _models import V, save

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
#: per-layer ranks and alphas: scales lora_alpha / r = 8/4 = 2 (default), 8/2 = 4 (q_proj), 16/4 = 4 (v_proj)
LORA = dict(r=4, lora_alpha=8, rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 16})
IDS = np.random.default_rng(7).integers(0, V, (1, 40))


def _torch_logits(model, ids=IDS):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _mlx_logits(model, ids=IDS):
    import mlx.core as mx

    return np.asarray(model(mx.array(ids.astype(np.int32))).astype(mx.float32))


def _peft_adapter(base, path, seed: int, **overrides):
    """A PEFT adapter on ``base`` (a deep copy is wrapped), factors random, saved into ``path``;
    returns the PeftModel."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**{"target_modules": TARGETS, "lora_dropout": 0.0, **LORA, **overrides})
    model = get_peft_model(copy.deepcopy(base), config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


def _merged(peft_model):
    import copy

    return copy.deepcopy(peft_model).merge_and_unload().eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    transformers = transformers_or_skip()
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("llama")
    base = save(transformers, "llama", root / "src")
    peft_model = _peft_adapter(base, root / "adapter", seed=1)
    return {"root": root, "base": base, "peft": peft_model, "logits": _torch_logits(peft_model),
            "merged": _torch_logits(_merged(peft_model))}


@pytest.fixture(scope="module")
def llama_mlx_keep(llama):
    """The Llama ported to mlx-lm with its PEFT adapter kept: an mlx-lm directory and adapters."""
    mlx_lm_or_skip()
    out = llama["root"] / "mlx-keep"
    report = db.port(llama["root"] / "src", out, to="mlx-lm", adapter=llama["root"] / "adapter",
                     adapter_mode="keep")
    return out, report


def test_merged_into_mlx_lm_equals_peft_merge_and_unload(llama):
    mlx_lm_or_skip()
    from mlx_lm.utils import load_model

    out = llama["root"] / "mlx-merge"
    report = db.port(llama["root"] / "src", out, to="mlx-lm", adapter=llama["root"] / "adapter")
    assert report.verification["passed"] and report.verification["mode"] == "full"
    model, _ = load_model(out)  # mlx-lm's own loader, no adapter: the weights hold it
    _close(llama["merged"], _mlx_logits(model), "mlx-lm merged vs PEFT merge_and_unload")
    assert np.max(np.abs(llama["merged"] - _torch_logits(llama["base"]))) > 1e-2  # the adapter changes the model
    cert = json.loads((out / "port_certificate.json").read_text())
    assert cert["adapter"]["mode"] == "merge" and cert["adapter"]["format"] == "peft"
    merged = {k: t for k, t in cert["tensors"].items() if any("merge_lora" in o for o in t["ops"])}
    # every adapted layer (4 kinds x 3 blocks) lands in one destination tensor
    assert len(merged) == len(TARGETS) * 3 and len(cert["adapter"]["merged"]) == len(TARGETS) * 3
    for name, t in merged.items():
        assert t["exact"] is False and isinstance(t["max_ulp"], int) and t["max_ulp"] <= 1, (name, t)
        assert t["dtypes"] == ["float32", "float64", "float32"]
        assert t["sources"][0]["merge_lora"]["computed_in"] == "float64"
    assert all(t["exact"] for k, t in cert["tensors"].items() if k not in merged)
    assert db.verify_port(out).passed


def test_kept_for_mlx_lm_loads_with_its_own_load_adapters(llama, llama_mlx_keep):
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    out, report = llama_mlx_keep
    assert report.verification["passed"]
    cert = report.certificate
    written = cert["adapter"]["written"]
    assert written["format"] == "mlx-lm" and written["path"] == "adapter"
    assert set(written["files"]) == {"adapter/adapters.safetensors", "adapter/adapter_config.json"}
    assert written["folded"] == {"rank": 4, "scale": 4.0}  # per-layer scales 2/4 folded exactly into lora_b
    for name in written["files"]:
        assert cert["destination"]["files"][name] == written["files"][name]
    model, _ = load_model(out)  # what mlx_lm.load(out, adapter_path=...) does, without a tokenizer
    model = load_adapters(model, str(out / "adapter"))
    model.eval()
    _close(llama["logits"], _mlx_logits(model), "mlx-lm kept adapter vs PEFT")
    base, _ = load_model(out)
    _close(_torch_logits(llama["base"]), _mlx_logits(base), "mlx-lm base vs transformers base")
    assert db.verify_port(out).passed


def test_mlx_lm_adapter_kept_back_into_transformers_loads_with_peft(llama, llama_mlx_keep):
    transformers = transformers_or_skip()
    from peft import PeftModel

    src, _ = llama_mlx_keep
    out = llama["root"] / "back-keep"
    report = db.port(src, out, to="transformers", adapter=src / "adapter", adapter_mode="keep")
    assert report.certificate["adapter"]["format"] == "mlx-lm"
    assert report.certificate["adapter"]["written"]["format"] == "peft"
    base = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    model = PeftModel.from_pretrained(base, out / "adapter").eval()
    _close(llama["logits"], _torch_logits(model), "PEFT from_pretrained of the kept adapter vs PEFT")
    assert db.verify_port(out).passed


def test_mlx_lm_adapter_merged_into_transformers(llama, llama_mlx_keep):
    transformers = transformers_or_skip()
    src, _ = llama_mlx_keep
    out = llama["root"] / "back-merge"
    report = db.port(src, out, to="transformers", adapter=src / "adapter")
    assert report.verification["passed"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    _close(llama["merged"], _torch_logits(model), "transformers merged vs PEFT merge_and_unload")


def test_qwen2_tied_head_with_per_layer_patterns_merged(tmp_path):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    pytest.importorskip("peft")
    from mlx_lm.utils import load_model

    base = save(transformers, "qwen2", tmp_path / "src", seed=3)
    peft_model = _peft_adapter(base, tmp_path / "adapter", seed=4, target_modules=["q_proj", "k_proj", "up_proj"],
                               rank_pattern={"k_proj": 2, "up_proj": 8}, alpha_pattern={"up_proj": 4})
    report = db.port(tmp_path / "src", tmp_path / "out", to="mlx-lm", adapter=tmp_path / "adapter")
    model, _ = load_model(tmp_path / "out")
    _close(_torch_logits(_merged(peft_model)), _mlx_logits(model), "qwen2 merged vs PEFT merge_and_unload")
    assert len(report.certificate["adapter"]["merged"]) == 9
    # up_proj's scale 4/8 = 0.5 against 2 elsewhere: a power of two, so kept too
    db.port(tmp_path / "src", tmp_path / "keep", to="mlx-lm", adapter=tmp_path / "adapter", adapter_mode="keep",
            verify="twins")
    from mlx_lm.tuner.utils import load_adapters

    kept, _ = load_model(tmp_path / "keep")
    kept = load_adapters(kept, str(tmp_path / "keep" / "adapter"))
    _close(_torch_logits(peft_model), _mlx_logits(kept), "qwen2 kept adapter (mlx-lm load_adapters) vs PEFT")


def test_dora_is_merged_and_refused_for_keep(tmp_path, llama):
    mlx_lm_or_skip()
    from mlx_lm.utils import load_model

    peft_model = _peft_adapter(llama["base"], tmp_path / "dora", seed=5, use_dora=True,
                               target_modules=["q_proj", "v_proj"])
    db.port(llama["root"] / "src", tmp_path / "out", to="mlx-lm", adapter=tmp_path / "dora")
    model, _ = load_model(tmp_path / "out")
    _close(_torch_logits(_merged(peft_model)), _mlx_logits(model), "DoRA merged vs PEFT merge_and_unload")
    with pytest.raises(db.ConversionError, match="DoRA"):
        db.port(llama["root"] / "src", tmp_path / "keep", to="mlx-lm", adapter=tmp_path / "dora", adapter_mode="keep")
    assert not (tmp_path / "keep").exists()


# ----------------------------------------------------------------------------- refusals
def _bad_copy(llama, tmp_path, name):
    bad = tmp_path / name
    shutil.copytree(llama["root"] / "adapter", bad)
    return bad


def _refused(llama, tmp_path, adapter, error, match, mode="merge"):
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        db.port(llama["root"] / "src", out, to="mlx-lm", adapter=adapter, adapter_mode=mode, verify="twins")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in tmp_path.iterdir()
                                                                 if not p.name.startswith("."))


def test_a_missing_config_is_refused_naming_the_file(tmp_path, llama):
    bad = _bad_copy(llama, tmp_path, "noconfig")
    os.remove(bad / "adapter_config.json")
    _refused(llama, tmp_path, bad, db.CheckpointError, "adapter_config.json")


def test_a_module_not_in_the_model_is_refused_naming_it(tmp_path, llama):
    from safetensors.numpy import load_file, save_file

    bad = _bad_copy(llama, tmp_path, "module")
    tensors = load_file(bad / "adapter_model.safetensors")
    tensors = {k.replace("layers.1.self_attn.o_proj", "layers.1.self_attn.x_proj"): v for k, v in tensors.items()}
    save_file(tensors, bad / "adapter_model.safetensors")
    config = json.loads((bad / "adapter_config.json").read_text())
    config["target_modules"] = TARGETS + ["x_proj"]
    (bad / "adapter_config.json").write_text(json.dumps(config))
    _refused(llama, tmp_path, bad, db.ConversionError, r"model\.layers\.1\.self_attn\.x_proj")


def test_a_layer_beyond_the_model_is_refused_naming_it(tmp_path, llama):
    from safetensors.numpy import load_file, save_file

    bad = _bad_copy(llama, tmp_path, "block")
    tensors = load_file(bad / "adapter_model.safetensors")
    tensors.update({k.replace("layers.2.", "layers.7."): v for k, v in tensors.items() if "layers.2." in k})
    save_file(tensors, bad / "adapter_model.safetensors")
    _refused(llama, tmp_path, bad, db.ConversionError, r"model\.layers\.7\.")


def test_wrong_base_shapes_are_refused_naming_the_module(tmp_path, llama):
    from safetensors.numpy import load_file, save_file

    bad = _bad_copy(llama, tmp_path, "shapes")
    tensors = load_file(bad / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    tensors[key] = np.concatenate([tensors[key], tensors[key]], axis=1)  # in_features doubled
    save_file(tensors, bad / "adapter_model.safetensors")
    _refused(llama, tmp_path, bad, db.ConversionError, r"model\.layers\.0\.mlp\.down_proj.*do not fit")


def test_an_adapter_of_another_ecosystem_is_refused(tmp_path, llama, llama_mlx_keep):
    src, _ = llama_mlx_keep
    _refused(llama, tmp_path, src / "adapter", db.ConversionError, "mlx-lm adapter.*peft")


def test_a_scale_that_cannot_be_folded_is_refused_for_keep_naming_the_layer(tmp_path, llama):
    mlx_lm_or_skip()
    bad = _bad_copy(llama, tmp_path, "scale")
    config = json.loads((bad / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"v_proj": 12}  # scale 3 against 2: no power of two
    (bad / "adapter_config.json").write_text(json.dumps(config))
    _refused(llama, tmp_path, bad, db.ConversionError, r"v_proj.*power", mode="keep")


def test_cli_port_with_an_adapter(tmp_path, llama):
    mlx_lm_or_skip()
    from dense_bridge.cli import main

    code = main(["port", str(llama["root"] / "src"), "--to", "mlx-lm", "-o", str(tmp_path / "out"),
                 "--adapter", str(llama["root"] / "adapter"), "--adapter-mode", "keep", "--verify", "twins",
                 "--json"])
    assert code == 0
    assert (tmp_path / "out" / "adapter" / "adapters.safetensors").is_file()


# ----------------------------------------------------------------------------- keras-hub's .lora.h5
def _keras_llama(keras_hub, weights=None):
    from _models import FF, H, HEADS, KV, LAYERS

    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=V, num_layers=LAYERS, num_query_heads=HEADS,
                                              num_key_value_heads=KV, hidden_dim=H, intermediate_dim=FF,
                                              rope_max_wavelength=500000.0, layer_norm_epsilon=1e-6,
                                              name="llama_backbone")  # one name: the layer paths the rules name
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if weights is not None:
        model.set_weights(weights)
    return model


def _keras_logits(model, ids=IDS):
    import keras

    out = model({"token_ids": ids.astype(np.int32), "padding_mask": np.ones_like(ids, dtype=np.int32)})
    return np.asarray(keras.ops.convert_to_numpy(out), np.float32)


@pytest.fixture(scope="module")
def keras_llama(llama):
    """A keras-hub LlamaCausalLM built directly, holding the transformers Llama's weights
    (db.transfer, mapping inferred): its weights and the transfer's layer rules."""
    from _port_helpers import keras_hub_or_skip

    keras_hub = keras_hub_or_skip()
    model = _keras_llama(keras_hub)
    report = db.transfer(llama["base"], model, mapping="auto",
                         inputs=([IDS], {"token_ids": IDS, "padding_mask": np.ones_like(IDS)}))
    _close(_torch_logits(llama["base"]), _keras_logits(model), "keras-hub base vs transformers base")
    return keras_hub, model.get_weights(), report.rules


def test_keras_hub_lora_h5_loads_with_load_lora_weights_default_layers(tmp_path, llama, keras_llama):
    """q_proj (rank 2, scale 4) and v_proj (rank 4, scale 4): per-head ranks 8 and 8, scale 4 folded
    into B; keras-hub's load_lora_weights alone enables query/value and reads the file."""
    from dense_bridge.ports._adapters import write_model_file

    keras_hub, weights, rules = keras_llama
    peft_model = _peft_adapter(llama["base"], tmp_path / "qv", seed=8, target_modules=["q_proj", "v_proj"])
    info = write_model_file(tmp_path / "qv", rules, _keras_llama(keras_hub, weights), tmp_path / "qv.lora.h5")
    assert info["rank"] == 8 and info["scale"] == 1.0 and info["default_names"] and not info["zero_filled"]
    assert info["target_layer_names"] == ["query", "value"]
    model = _keras_llama(keras_hub, weights)
    model.backbone.load_lora_weights(str(tmp_path / "qv.lora.h5"))  # keras-hub's own loader, as it is
    _close(_torch_logits(peft_model), _keras_logits(model), "keras-hub load_lora_weights vs PEFT")


def test_keras_hub_lora_h5_of_per_layer_ranks_and_scales(tmp_path, llama, keras_llama):
    """The q/v/o/down adapter (ranks 2 and 4, scales 4 and 2): padded to one rank, scales folded;
    keras-hub enables the four layer names and loads the file."""
    from dense_bridge.ports._adapters import write_model_file

    keras_hub, weights, rules = keras_llama
    info = write_model_file(llama["root"] / "adapter", rules, _keras_llama(keras_hub, weights),
                            tmp_path / "all.lora.h5")
    assert not info["default_names"]
    model = _keras_llama(keras_hub, weights)
    model.backbone.enable_lora(info["rank"], target_layer_names=info["target_layer_names"])
    model.backbone.load_lora_weights(str(tmp_path / "all.lora.h5"))
    _close(llama["logits"], _keras_logits(model), "keras-hub load_lora_weights vs PEFT (per-layer ranks/scales)")


def test_keras_hub_refuses_a_scale_it_cannot_fold_naming_the_layer(tmp_path, llama, keras_llama):
    from dense_bridge.ports._adapters import write_model_file

    keras_hub, weights, rules = keras_llama
    _peft_adapter(llama["base"], tmp_path / "odd", seed=9, target_modules=["q_proj", "v_proj"],
                  alpha_pattern={"v_proj": 12})  # scale 3: no power of two
    with pytest.raises(db.ConversionError, match=r"transformer_layer_\d/self_attention/value.*powers of two"):
        write_model_file(tmp_path / "odd", rules, _keras_llama(keras_hub, weights), tmp_path / "odd.lora.h5")
    assert not (tmp_path / "odd.lora.h5").exists()


def test_verify_port_checks_the_kept_adapter_files(tmp_path, llama_mlx_keep):
    src, _ = llama_mlx_keep
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    assert db.verify_port(out).passed
    config = out / "adapter" / "adapter_config.json"
    config.write_text(config.read_text().replace('"scale": 4.0', '"scale": 8.0'))
    report = db.verify_port(out)
    assert not report.passed and any("adapter/adapter_config.json" in p for p in report.problems)


def test_merged_into_bfloat16_rounds_once_and_says_so(tmp_path, llama):
    """dtype='bfloat16': the float64 merge rounded once to bfloat16 (at most half a unit in the last
    place: max_ulp 1 after the ceiling), recomputed bit for bit by verify_port."""
    mlx_lm_or_skip()
    out = tmp_path / "bf16"
    report = db.port(llama["root"] / "src", out, to="mlx-lm", adapter=llama["root"] / "adapter", dtype="bfloat16",
                     verify="twins")
    merged = [t for t in report.certificate["tensors"].values() if t["sources"][0].get("merge_lora")]
    assert merged and all(t["dtypes"] == ["float32", "float64", "bfloat16"] and t["max_ulp"] == 1 for t in merged)
    assert db.verify_port(out).passed


# ----------------------------------------------------------------------------- port(to="keras-hub")
def _keras_hub_port_or_skip():
    from dense_bridge.ports import formats

    if "keras-hub" not in formats():
        pytest.skip("no keras-hub port format in this tree")


def test_keras_hub_port_merged_and_kept(tmp_path, llama):
    """transformers + PEFT -> keras-hub preset: merged (from_preset logits vs merge_and_unload) and kept
    (from_preset, then keras-hub's own enable_lora/load_lora_weights on out/adapter/adapter.lora.h5,
    logits vs PEFT)."""
    from _port_helpers import keras_hub_or_skip

    keras_hub = keras_hub_or_skip()
    _keras_hub_port_or_skip()
    merged = tmp_path / "merged"
    db.port(llama["root"] / "src", merged, to="keras-hub", adapter=llama["root"] / "adapter")
    task = keras_hub.models.CausalLM.from_preset(str(merged), preprocessor=None)
    _close(llama["merged"], _keras_logits(task), "keras-hub preset merged vs PEFT merge_and_unload")

    kept = tmp_path / "kept"
    report = db.port(llama["root"] / "src", kept, to="keras-hub", adapter=llama["root"] / "adapter",
                     adapter_mode="keep", verify="twins")  # the base's logits are judged below
    written = report.certificate["adapter"]["written"]
    assert written["format"] == "keras-hub" and set(written["files"]) == {"adapter/adapter.lora.h5"}
    task = keras_hub.models.CausalLM.from_preset(str(kept), preprocessor=None)
    _close(_torch_logits(llama["base"]), _keras_logits(task), "keras-hub preset base vs transformers base")
    task.backbone.enable_lora(written["rank"], target_layer_names=written["target_layer_names"])
    task.backbone.load_lora_weights(str(kept / "adapter" / "adapter.lora.h5"))
    _close(llama["logits"], _keras_logits(task), "keras-hub kept adapter vs PEFT")
    assert db.verify_port(kept).passed


def test_keras_hub_lora_h5_fills_uncovered_blocks_with_zero_factors(tmp_path, llama, keras_llama):
    """An adapter on block 1 only: keras-hub enables query/value in every block and reads each one's
    factors, so blocks 0 and 2 get zeros (no update, exactly)."""
    from dense_bridge.ports._adapters import write_model_file

    keras_hub, weights, rules = keras_llama
    peft_model = _peft_adapter(llama["base"], tmp_path / "one", seed=10, target_modules=["q_proj", "v_proj"],
                               layers_to_transform=[1])
    info = write_model_file(tmp_path / "one", rules, _keras_llama(keras_hub, weights), tmp_path / "one.lora.h5")
    assert len(info["zero_filled"]) == 4 and info["default_names"]
    model = _keras_llama(keras_hub, weights)
    model.backbone.load_lora_weights(str(tmp_path / "one.lora.h5"))
    _close(_torch_logits(peft_model), _keras_logits(model), "keras-hub one-block adapter vs PEFT")
