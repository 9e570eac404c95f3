"""Adapter files dense_bridge writes load in the owning library's own loader with the same outputs
(PEFT's ``PeftModel.from_pretrained``, mlx-lm's ``mlx_lm.tuner.utils.load_adapters``, keras-hub's
``load_lora_weights``), and files that are hostile or contradict themselves are refused, naming the
file and the key, with nothing attached, merged or written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.lora import _files as lora_files
from test_lora import LAYERS, SAME, TARGETS, VARIANTS, _close, _far, _mlx_llama, _mlx_logits, _peft_llama, \
    _plain_llama, _torch_logits

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _keys(path, name):
    from dense_bridge.checkpoints._safetensors import SafetensorsFile

    with SafetensorsFile(os.path.join(path, name)) as f:
        return list(f.tensors)


def _peft_load(path):
    """PEFT's own loader; a key it does not find is only a warning there, so warnings fail the test."""
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(missing|unexpected).*", category=UserWarning)
        return peft.PeftModel.from_pretrained(_plain_llama(), str(path)).eval()


# ----------------------------------------------------------------------------- the owners' loaders
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_adapter_of_a_peft_model_loads_in_peft_and_mlx_lm(tmp_path, variant):
    """Issue 47: a PeftModel's walk paths carry its own ``base_model.model.`` prefix; the files name
    layers by their base-model path (one PEFT prefix, never two), so PEFT and mlx-lm load them."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.tuner.utils import load_adapters

    src = _peft_llama(variant, peft_model=True)
    want = _torch_logits(src)
    _far(want, _torch_logits(_plain_llama()), f"{variant}: the adapter acts")
    db.save_adapter(src, tmp_path / "peft", format="peft")
    keys = _keys(tmp_path / "peft", "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert not [k for k in keys if k.count("base_model.model.") != 1]
    _close(want, _torch_logits(_peft_load(tmp_path / "peft")), f"{variant}: PeftModel.from_pretrained")
    # the injected base model saves the very same files
    db.save_adapter(src.get_base_model(), tmp_path / "base", format="peft")
    assert sorted(_keys(tmp_path / "base", "adapter_model.safetensors")) == sorted(keys)
    # mlx-lm's own loader, from the PeftModel
    db.save_adapter(src, tmp_path / "mlx", format="mlx-lm")
    plain = _mlx_llama()
    db.transfer(_plain_llama(), plain, mapping=SAME)
    load_adapters(plain, str(tmp_path / "mlx"))
    _close(want, _mlx_logits(plain), f"{variant}: mlx-lm load_adapters of a PeftModel's adapters")
    # load_adapter into a PeftModel: the prefix is put back
    peft = pytest.importorskip("peft")
    target = peft.get_peft_model(_plain_llama(), peft.LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS,
                                                                 **VARIANTS[variant])).eval()
    loaded = db.load_adapter(tmp_path / "mlx", target)
    assert all(p.startswith("base_model.model.model.layers.") for p in loaded)
    _close(want, _torch_logits(target), f"{variant}: load_adapter into a PeftModel")


def test_mlx_lm_model_adapters_load_in_mlx_lm_and_peft(tmp_path):
    """An mlx-lm model holding LoRALinear layers: save_adapter in both directory formats, each read by
    its owner, the same outputs as the mlx-lm model; convert_adapter between them likewise."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.tuner.utils import load_adapters

    src = _peft_llama("lora")
    mlx_src = _mlx_llama()
    db.transfer(src, mlx_src, mapping=SAME, lora="keep")
    want = _mlx_logits(mlx_src)
    db.save_adapter(mlx_src, tmp_path / "mlx", format="mlx-lm")
    db.save_adapter(mlx_src, tmp_path / "peft", format="peft")
    plain = _mlx_llama()
    db.transfer(_plain_llama(), plain, mapping=SAME)
    load_adapters(plain, str(tmp_path / "mlx"))
    _close(want, _mlx_logits(plain), "mlx-lm load_adapters of save_adapter(mlx model)")
    _close(want, _torch_logits(_peft_load(tmp_path / "peft")), "PEFT of save_adapter(mlx model)")
    db.convert_adapter(str(tmp_path / "peft"), str(tmp_path / "mlx2"), to="mlx-lm", num_layers=LAYERS)
    plain = _mlx_llama()
    db.transfer(_plain_llama(), plain, mapping=SAME)
    load_adapters(plain, str(tmp_path / "mlx2"))
    _close(want, _mlx_logits(plain), "mlx-lm load_adapters of convert_adapter(peft -> mlx-lm)")
    db.convert_adapter(str(tmp_path / "mlx"), str(tmp_path / "peft2"), to="peft")
    _close(want, _torch_logits(_peft_load(tmp_path / "peft2")), "PEFT of convert_adapter(mlx-lm -> peft)")


def test_per_module_ranks_and_scales_load_in_peft(tmp_path):
    """rank_pattern / alpha_pattern written for the layers off the common rank and alpha: PEFT reads
    them back exactly (and target_modules names the adapted layers only)."""
    peft = pytest.importorskip("peft")
    src = _peft_llama("lora", peft_model=True, rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 3})
    want = _torch_logits(src)
    db.save_adapter(src, tmp_path / "peft", format="peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert set(config["rank_pattern"].values()) == {4} and set(config["alpha_pattern"].values()) == {3}
    assert sorted(config["target_modules"]) == sorted(lora_files.model_adapters(src))
    _close(want, _torch_logits(_peft_load(tmp_path / "peft")), "PEFT with rank_pattern/alpha_pattern")
    assert type(_peft_load(tmp_path / "peft").base_model.model.model.layers[0].self_attn.o_proj) is \
        peft.tuners.lora.layer.Linear


def _keras_hub_out(model, inputs):
    return np.asarray(model(inputs)["sequence_output"])


def test_keras_hub_files_both_ways(tmp_path):
    """keras-hub's enable_lora adapters: db.save_adapter's file loads in keras-hub's load_lora_weights,
    and keras-hub's save_lora_weights file in db.load_adapter, each with the same outputs."""
    from _compare_ports import bert_inputs, keras_bert

    pytest.importorskip("keras_hub")
    model = keras_bert()
    base = model.get_weights()  # every twin below starts from these base weights

    def twin():
        other = keras_bert()
        other.set_weights(base)
        return other

    model.enable_lora(4)
    rng = np.random.default_rng(0)
    for layer in db.linear_layers(model).values():
        if getattr(layer, "lora_enabled", False):
            layer.lora_kernel_a.assign(rng.standard_normal(layer.lora_kernel_a.shape).astype(np.float32) * 0.3)
            layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape).astype(np.float32) * 0.3)
    inputs = bert_inputs(0)[1]
    want = _keras_hub_out(model, inputs)
    _far(want, _keras_hub_out(twin(), inputs), "keras-hub adapters act")
    ours = str(tmp_path / "ours.lora.h5")
    db.save_adapter(model, ours, format="keras-hub")
    assert os.listdir(tmp_path) == ["ours.lora.h5"]  # no temporary left
    own = twin()
    own.load_lora_weights(ours)
    _close(want, _keras_hub_out(own, inputs), "keras-hub load_lora_weights of db.save_adapter")
    theirs = str(tmp_path / "theirs.lora.h5")
    model.save_lora_weights(theirs)
    fresh = twin()
    loaded = db.load_adapter(theirs, fresh)
    assert set(loaded.values()) == {4} and len(loaded) == 2 * 2  # query and value of 2 blocks
    _close(want, _keras_hub_out(fresh, inputs), "db.load_adapter of keras-hub save_lora_weights")


def test_a_peft_directory_is_read_and_converted_without_torch(tmp_path):
    """The PEFT and mlx-lm formats live in backends/torch and backends/mlx, framework-free: reading
    and converting a directory imports neither framework."""
    _adapter_dir(tmp_path / "peft")
    code = ("import sys, dense_bridge as db\n"
            "s = db.convert_adapter(sys.argv[1], sys.argv[2], to='mlx-lm', num_layers=2)\n"
            "db.convert_adapter(sys.argv[2], sys.argv[3], to='peft')\n"
            "print(s['layers'], sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'peft', 'mlx', 'mlx_lm', 'keras', 'tensorflow', 'jax', 'safetensors')))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "peft"), str(tmp_path / "mlx"),
                          str(tmp_path / "back")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "2 []", run.stdout
    _, layers, _ = lora_files.read_adapter_dir(str(tmp_path / "back"))
    _, first, _ = lora_files.read_adapter_dir(str(tmp_path / "peft"))
    for p in first:
        np.testing.assert_array_equal(db.lora.update(layers[p]), db.lora.update(first[p]))


# ----------------------------------------------------------------------------- hostile and contradictory files
IN, OUT, R = 6, 5, 2
PATHS = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]


def _adapter_dir(path, *, tensors=None, config=None, fmt="peft", nan_in=None):
    """A small adapter directory written with the safetensors package and json (not dense_bridge):
    rank R on q_proj of two blocks, ``tensors``/``config`` overriding entries (None values drop them)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    os.makedirs(path, exist_ok=True)
    if fmt == "peft":
        base = {}
        for p in PATHS:
            base[f"base_model.model.{p}.lora_A.weight"] = rng.standard_normal((R, IN)).astype(np.float32)
            base[f"base_model.model.{p}.lora_B.weight"] = rng.standard_normal((OUT, R)).astype(np.float32)
        cfg = {"peft_type": "LORA", "r": R, "lora_alpha": 4, "target_modules": ["q_proj"], "use_dora": False}
        weights = "adapter_model.safetensors"
    else:
        base = {}
        for p in PATHS:
            base[f"{p}.lora_a"] = rng.standard_normal((IN, R)).astype(np.float32)
            base[f"{p}.lora_b"] = rng.standard_normal((R, OUT)).astype(np.float32)
        cfg = {"fine_tune_type": "lora", "num_layers": 2,
               "lora_parameters": {"rank": R, "scale": 2.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]}}
        weights = "adapters.safetensors"
    base.update(tensors or {})
    cfg.update(config or {})
    if nan_in:
        base[nan_in] = base[nan_in].copy()
        base[nan_in].flat[3] = np.nan
    save_file({k: v for k, v in base.items() if v is not None}, os.path.join(path, weights))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f)
    return str(path)


def _refused(src, match, error=db.CheckpointError, **kw):
    out = os.path.join(os.path.dirname(src), "out")
    with pytest.raises(error, match=match) as info:
        db.convert_adapter(src, out, to=kw.pop("to", "mlx-lm"), num_layers=2, **kw)
    assert not os.path.exists(out)
    assert src in str(info.value), str(info.value)
    return str(info.value)


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_nonfinite_factors_alpha_and_scale_are_refused_unless_allowed(tmp_path):
    src = _adapter_dir(tmp_path / "nan", nan_in=A0)
    msg = _refused(src, r"model\.layers\.0\.self_attn\.q_proj.*lora_a holds 1 NaN/Inf")
    assert "allow_nonfinite" in msg
    summary = db.convert_adapter(src, str(tmp_path / "ok"), to="mlx-lm", num_layers=2, allow_nonfinite=True)
    assert summary["layers"] == 2
    # the CLI: nonzero exit naming the file and layer; --allow-nonfinite converts
    cli = [sys.executable, "-m", "dense_bridge.cli", "adapter", src, "--to", "mlx-lm", "--num-layers", "2", "-o"]
    run = subprocess.run(cli + [str(tmp_path / "cli")], capture_output=True, text=True)
    assert run.returncode != 0 and "NaN" in run.stderr and "q_proj" in run.stderr, run.stderr
    assert not os.path.exists(tmp_path / "cli")
    run = subprocess.run(cli + [str(tmp_path / "cli"), "--allow-nonfinite"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    # alpha and scale from the config
    for value in (float("nan"), float("inf")):
        src = _adapter_dir(tmp_path / f"alpha{value}", config={"lora_alpha": value})
        _refused(src, r"lora_scale holds 1 NaN/Inf")
        src = _adapter_dir(tmp_path / f"scale{value}", fmt="mlx-lm",
                           config={"lora_parameters": {"rank": R, "scale": value, "keys": ["self_attn.q_proj"]}})
        _refused(src, r"lora_scale holds 1 NaN/Inf", to="peft")


def test_load_and_save_adapter_refuse_nonfinite_values(tmp_path):
    src = _adapter_dir(tmp_path / "nan", nan_in=A0)
    model = _plain_llama()
    with pytest.raises(db.CheckpointError, match="lora_a holds 1 NaN/Inf"):
        db.load_adapter(src, model)
    assert not db.lora.lora_of(model.model.layers[1].self_attn.q_proj)
    peft_model = _peft_llama("lora", targets=["q_proj"])
    layer = peft_model.model.layers[1].self_attn.q_proj
    import torch

    with torch.no_grad():
        layer.lora_B["default"].weight[0, 0] = float("inf")
    with pytest.raises(db.ConversionError, match=r"model\.layers\.1\.self_attn\.q_proj.*lora_b holds 1 NaN/Inf"):
        db.save_adapter(peft_model, tmp_path / "out", format="peft")
    assert not os.path.exists(tmp_path / "out")
    db.save_adapter(peft_model, tmp_path / "out", format="peft", allow_nonfinite=True)


def test_configs_contradicting_their_tensors_are_refused(tmp_path):
    """What PEFT / mlx-lm would trip over or silently drop, named with its config key."""
    cases = {
        "rank": ({"config": {"r": 4}}, r"rank 2/2 but the config says r=4"),
        "rank_pattern": ({"config": {"rank_pattern": {"layers\\.1\\..*": 10 ** 9}}},
                         r"config says rank_pattern\[.*\]=1000000000"),
        "inconsistent": ({"tensors": {A0: np.zeros((3, IN), np.float32)}}, r"rank 3/2"),
        "dora": ({"config": {"use_dora": True}}, r"use_dora=True but layer 'model\.layers\.0\.self_attn\.q_proj' has "
                                                 r"no lora_magnitude_vector"),
        "targets": ({"config": {"target_modules": ["v_proj"]}}, r"target_modules \['v_proj'\] names no module"),
        "target_regex": ({"config": {"target_modules": r".*\.k_proj"}}, r"does not match it"),
        "layers_to_transform": ({"config": {"layers_to_transform": [1]}}, r"layers_to_transform \[1\]"),
        "nested": ({"config": {"rank_pattern": {"(a+)+$": 2}}}, r"nests one quantifier"),
        "long": ({"config": {"alpha_pattern": {"q" * 600: 2}}}, r"pattern of 600 characters"),
        "not_lora": ({"tensors": {"base_model.model.lm_head.weight": np.zeros((2, 2), np.float32)}},
                     r"'base_model\.model\.lm_head\.weight' is not a LoRA factor"),
        "lacks_b": ({"tensors": {A0.replace("lora_A", "lora_B"): None}}, r"lacks .*q_proj\.lora_B\.weight"),
        "bool_rank": ({"config": {"r": True}}, r"r must be an integer"),
    }
    for name, (override, match) in cases.items():
        _refused(_adapter_dir(tmp_path / name / "src", **override), match)
    mlx_cases = {
        "rank": ({"config": {"lora_parameters": {"rank": 3, "scale": 1.0}}}, r"lora_parameters\.rank is 3"),
        "dora": ({"config": {"fine_tune_type": "dora"}}, r"fine_tune_type 'dora' but layer .* has no m"),
        "keys": ({"config": {"lora_parameters": {"rank": R, "scale": 1.0, "keys": ["mlp.down_proj"]}}},
                 r"lora_parameters\.keys \['mlp\.down_proj'\] names no module"),
        "magnitude": ({"tensors": {f"{PATHS[0]}.m": np.ones(OUT, np.float32)}}, r"holds m"),
        "full": ({"config": {"fine_tune_type": "full"}}, r"fine_tune_type 'full' is not an adapter"),
        "no_scale": ({"config": {"lora_parameters": {"rank": R}}}, r"no 'scale'"),
        "num_layers": ({"config": {"num_layers": 1}}, r"num_layers 1 .* blocks 0 to 1"),
    }
    for name, (override, match) in mlx_cases.items():
        _refused(_adapter_dir(tmp_path / f"mlx_{name}" / "src", fmt="mlx-lm", **override), match, to="peft")


def test_two_file_layers_onto_one_model_layer_are_refused(tmp_path):
    src = _adapter_dir(tmp_path / "peft")
    model = _plain_llama()
    with pytest.raises(db.ConversionError, match=r"both map onto 'model\.layers\.0\.self_attn\.q_proj'"):
        db.load_adapter(src, model, mapping=lambda p: "model.layers.0.self_attn.q_proj")
    assert db.lora.lora_of(model.model.layers[0].self_attn.q_proj) is None


def test_one_format_never_overwrites_another_formats_directory(tmp_path):
    mlx_dir = _adapter_dir(tmp_path / "mlx", fmt="mlx-lm")
    before = {n: Path(mlx_dir, n).read_bytes() for n in os.listdir(mlx_dir)}
    model = _peft_llama("lora", targets=["q_proj"])
    with pytest.raises(db.CheckpointError, match=r"adapter_config\.json"):
        db.save_adapter(model, mlx_dir, format="peft")
    assert {n: Path(mlx_dir, n).read_bytes() for n in os.listdir(mlx_dir)} == before
    peft_dir = _adapter_dir(tmp_path / "peft")
    with pytest.raises(db.CheckpointError, match=r"adapter_config\.json"):
        db.save_adapter(model, peft_dir, format="mlx-lm")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(db.CheckpointError, match=r"file: a peft adapter is a directory"):
        db.save_adapter(model, tmp_path / "file", format="peft")
    db.save_adapter(model, peft_dir, format="peft")  # its own format: replaced whole
    _, layers, _ = lora_files.read_adapter_dir(peft_dir)
    assert sorted(layers) == [f"model.layers.{i}.self_attn.q_proj" for i in range(LAYERS)]


# ----------------------------------------------------------------------------- merge_lora
def _tiny_peft(dtype):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = peft.get_peft_model(Tiny().to(dtype), peft.LoraConfig(r=2, lora_alpha=2, target_modules=["a", "b"],
                                                                  init_lora_weights=False)).get_base_model()
    return torch, model


@pytest.mark.parametrize("how", ["nan", "overflow"])
def test_merge_lora_refuses_nonfinite_kernels_and_changes_nothing(how):
    torch = pytest.importorskip("torch")
    torch, model = _tiny_peft(torch.float16)
    with torch.no_grad():
        if how == "nan":
            model.b.lora_A["default"].weight[0, 0] = float("nan")
        else:  # finite factors whose update overflows float16 (max 65504)
            model.b.lora_A["default"].weight.fill_(300.0)
            model.b.lora_B["default"].weight.fill_(300.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(db.ConversionError, match=r"layer 'b'.*NaN/Inf"):
        db.merge_lora(model)
    assert db.lora.lora_of(model.a) is not None and db.lora.lora_of(model.b) is not None  # nothing detached
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert torch.equal(v, after[k]) or (torch.isnan(v).any() and torch.equal(v.isnan(), after[k].isnan())), k


# ----------------------------------------------------------------------------- keras-hub .lora.h5
def _keras_pair():
    """A tiny Keras model of three Dense layers, LoRA enabled at rank 2 on the first two (factors
    random), and a fresh twin."""
    from conftest import require_backend

    require_backend("keras")
    import keras

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6), keras.layers.Dense(5),
                                 keras.layers.Dense(3)])

    src = make()
    rng = np.random.default_rng(0)
    for layer in src.layers[:2]:
        layer.enable_lora(2)
        layer.lora_kernel_a.assign(rng.standard_normal(layer.lora_kernel_a.shape).astype(np.float32))
        layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape).astype(np.float32))
    return src, make()


def _h5(path, build):
    import h5py

    with h5py.File(path, "w") as f:
        f.create_group("lora/vars")["rank"] = 2
        build(f)
    return str(path)


def _factors(f, key, a_shape=(4, 2), b_shape=(2, 6), fill=0.5):
    f[f"lora/{key}/vars/lora_kernel_a"] = np.full(a_shape, fill, np.float32)
    f[f"lora/{key}/vars/lora_kernel_b"] = np.full(b_shape, fill, np.float32)


def test_keras_hub_file_round_trip_and_atomic_refusing_save(tmp_path):
    src, fresh = _keras_pair()
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    path = str(tmp_path / "m.lora.h5")
    db.save_adapter(src, path, format="keras-hub")
    assert db.load_adapter(path, fresh) == {fresh.layers[0].path: 2, fresh.layers[1].path: 2}
    np.testing.assert_allclose(np.asarray(fresh(x)), np.asarray(src(x)), atol=1e-6)
    before = Path(path).read_bytes()
    src.layers[1].lora_kernel_b.assign(np.full((2, 5), np.nan, np.float32))
    with pytest.raises(db.ConversionError, match=r"layer 1 .*lora_kernel_b holds 10 NaN/Inf"):
        db.save_adapter(src, path, format="keras-hub")
    assert Path(path).read_bytes() == before and os.listdir(tmp_path) == ["m.lora.h5"]


def test_hostile_keras_hub_files_are_refused_before_anything_is_attached(tmp_path):
    import h5py

    target = tmp_path / "other.h5"
    with h5py.File(target, "w") as f:
        f["data"] = np.ones((4, 2), np.float32)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.ones(8, np.float32).tobytes())

    def external_link(f):
        _factors(f, "0")
        f["lora/1/vars/lora_kernel_a"] = h5py.ExternalLink(str(target), "data")

    def external_storage(f):
        _factors(f, "0")
        f.create_dataset("lora/1/vars/lora_kernel_a", shape=(4, 2), dtype=np.float32, external=[(str(raw), 0, 32)])

    def virtual(f):
        _factors(f, "0")
        layout = h5py.VirtualLayout(shape=(4, 2), dtype=np.float32)
        layout[:] = h5py.VirtualSource(str(target), "data", shape=(4, 2))
        f.create_virtual_dataset("lora/1/vars/lora_kernel_a", layout)

    def huge(f):
        _factors(f, "0")
        f.create_dataset("lora/1/vars/lora_kernel_a", shape=(30000, 30000), dtype=np.float32)

    def soft(f):
        _factors(f, "0")
        f["lora/1/vars/lora_kernel_a"] = h5py.SoftLink("/lora/0/vars/lora_kernel_a")

    cases = {"external_link": (external_link, "external link"),
             "external_storage": (external_storage, "external files"),
             "virtual": (virtual, "virtual dataset"), "huge": (huge, r"declares shape \(30000, 30000\)"),
             "soft": (soft, "soft link"),
             "negative": (lambda f: _factors(f, "-1"), r"lora/'-1' is not a layer index"),
             "leading_zero": (lambda f: (_factors(f, "0"), _factors(f, "00")), r"lora/'00' is not a layer index"),
             "no_rank": (None, "no lora/vars/rank")}
    for name, (build, match) in cases.items():
        _, fresh = _keras_pair()
        if build is None:
            with h5py.File(tmp_path / f"{name}.lora.h5", "w") as f:
                _factors(f, "0")
            path = str(tmp_path / f"{name}.lora.h5")
        else:
            path = _h5(tmp_path / f"{name}.lora.h5", build)
        if name == "huge":
            assert os.path.getsize(path) < 16384
        with pytest.raises(db.CheckpointError, match=match) as info:
            db.load_adapter(path, fresh)
        assert path in str(info.value)
        assert not any(getattr(lyr, "lora_enabled", False) for lyr in fresh.layers), name


def test_a_bad_second_layer_leaves_the_first_unattached(tmp_path):
    cases = {"shape": (lambda f: (_factors(f, "0"), _factors(f, "1", (6, 2), (2, 4))), r"lora/1 .*do not fit"),
             "nan": (lambda f: (_factors(f, "0"), _factors(f, "1", (6, 2), (2, 5), fill=np.nan)),
                     r"lora/1/vars/lora_kernel_a holds 12 NaN/Inf"),
             "index": (lambda f: (_factors(f, "0"), _factors(f, "7")), r"lora/7: layer index 7 is not")}
    for name, (build, match) in cases.items():
        _, fresh = _keras_pair()
        path = _h5(tmp_path / f"{name}.lora.h5", build)
        with pytest.raises(db.ConversionError, match=match) as info:
            db.load_adapter(path, fresh)
        assert path in str(info.value)
        assert not any(getattr(lyr, "lora_enabled", False) for lyr in fresh.layers), name
    _, fresh = _keras_pair()
    loaded = db.load_adapter(str(tmp_path / "nan.lora.h5"), fresh, allow_nonfinite=True)
    assert len(loaded) == 2
