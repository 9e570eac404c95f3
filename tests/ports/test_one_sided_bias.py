"""A linear layer's bias held by one library only (mlx-lm's PhiMoE builds every attention
projection and its head with a bias, transformers' only when its config asks): written as exact
zeros where the source's layer has none (``x @ W`` is ``x @ W + 0``), stated in the certificate
(recipe ``zeros``); dropped on the way back only where every value is exactly zero, else refused
naming the layer and the largest value. Real torch, MLX, transformers and mlx-lm, tiny models."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("mlx")

import dense_bridge as db  # noqa: E402


def _torch_model(bias: bool):
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 4, bias=bias)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    return M()


def _mlx_model(bias: bool):
    import mlx.core as mx
    import mlx.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 4, bias=bias)

        def __call__(self, x):
            return self.proj(x)

    mx.random.seed(1)
    return M()


def test_a_bias_the_source_lacks_is_written_as_exact_zeros():
    src, dst = _torch_model(bias=False), _mlx_model(bias=True)
    assert np.any(np.asarray(dst.proj.bias))  # random before: the zeros are the transfer's
    report = db.transfer(src, dst)
    np.testing.assert_array_equal(np.asarray(dst.proj.bias), np.zeros(4, np.float32))
    np.testing.assert_array_equal(np.asarray(dst.proj.weight), src.proj.weight.detach().numpy())
    assert any("exact zeros" in what for _, _, what in report.moved)


def test_a_zero_bias_is_dropped_and_any_other_refused_naming_the_layer_and_value():
    import mlx.core as mx
    import torch

    src, dst = _mlx_model(bias=True), _torch_model(bias=False)
    before = dst.proj.weight.detach().clone()
    src.proj.bias = mx.array(np.array([0.0, 0.0, -0.75, 0.25], np.float32))
    with pytest.raises(db.DenseBridgeError) as info:
        db.transfer(src, dst)
    msg = str(info.value)
    assert "proj" in msg and "exactly zero" in msg and "-0.75" in msg and "unit 2" in msg
    assert torch.equal(dst.proj.weight, before)  # nothing written
    src.proj.bias = mx.zeros((4,))
    db.transfer(src, dst)
    np.testing.assert_array_equal(dst.proj.weight.detach().numpy(), np.asarray(src.proj.weight))


def test_phimoe_ports_both_ways_with_the_zero_biases_stated(tmp_path):
    """transformers' PhiMoE (no attention bias, no head bias) -> mlx-lm (both): the biases are
    written as zeros, the certificate says so and verify_port checks them; mlx-lm's files back to
    transformers drop the zeros (named in the certificate) and give the source back bit for bit;
    a non-zero bias there is refused."""
    pytest.importorskip("transformers")
    pytest.importorskip("mlx_lm")
    from safetensors.numpy import load_file, save_file

    import importlib.util
    import os

    import torch
    import transformers

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_coverage_fixes.py")
    spec = importlib.util.spec_from_file_location("test_coverage_fixes_", here)
    fixes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixes)
    h, _tp = fixes._harness(), fixes._tp
    t, p, back = tmp_path / "T", tmp_path / "P", tmp_path / "back"
    cfg, _ = h._tiny_config("phimoe")
    model = transformers.AutoModelForCausalLM.from_config(_tp()._config(cfg), dtype=torch.float32).eval()
    _tp()._randomize(model, seed=7)
    model.save_pretrained(t)
    r1 = db.port(t, p, to="mlx-lm", verify="twins", progress=False)
    zeros = {k: e for k, e in r1.certificate["tensors"].items() if e.get("zeros")}
    assert "lm_head.bias" in zeros and "model.layers.1.self_attn.q_proj.bias" in zeros
    assert all(e["ops"] == ["zeros"] and e["sources"] == [] and e["exact"] for e in zeros.values())
    assert db.verify_port(p)
    r2 = db.port(p, back, to="transformers", verify="twins", progress=False)
    assert "lm_head.bias" in r2.certificate["dropped_zeros"]
    assert h._first_difference(h._files(str(back)), h._files(str(t)), "round trip") is None
    # a bias that is not zero has no place in transformers' layer: refused, nothing written
    files = sorted(p.glob("model*.safetensors"))
    tensors = load_file(files[0])
    key = next(k for k in zeros if k in tensors)
    tensors[key] = tensors[key] + np.float32(0.5)
    save_file(tensors, str(files[0]), metadata={"format": "mlx"})
    assert not db.verify_port(p)  # the certificate's zeros no longer hold
    with pytest.raises(db.DenseBridgeError) as info:
        db.port(p, tmp_path / "bad", to="transformers", verify="twins", progress=False)
    assert "exactly zero" in str(info.value)
    assert not (tmp_path / "bad").exists()
    json.dumps(r1.certificate)  # the certificate stays JSON


def test_a_router_correction_the_destination_lacks_is_dropped_only_when_zero(tmp_path):
    """transformers' ERNIE-4.5-MoE adds a per-expert correction (moe_statics.e_score_correction_bias,
    (1, experts)) to the router's scores before choosing experts; mlx-lm's model has no such
    parameter (its loader drops it). Non-zero, the port refuses, naming it and its largest value;
    exact zeros change nothing: dropped, named in the certificate, the models verified equal."""
    pytest.importorskip("transformers")
    pytest.importorskip("mlx_lm")
    import importlib.util
    import os

    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_coverage_fixes.py")
    spec = importlib.util.spec_from_file_location("test_coverage_fixes_", here)
    fixes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixes)
    h, _tp = fixes._harness(), fixes._tp
    t = tmp_path / "T"
    cfg, _ = h._tiny_config("ernie4_5_moe")
    model = transformers.AutoModelForCausalLM.from_config(_tp()._config(cfg), dtype=torch.float32).eval()
    _tp()._randomize(model, seed=7)
    model.save_pretrained(t)
    with pytest.raises(db.DenseBridgeError) as info:
        db.port(t, tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    msg = str(info.value)
    assert "e_score_correction_bias" in msg and "mlx-lm's model has no parameter for" in msg and "largest |value|" in msg
    assert not (tmp_path / "P").exists()
    f = sorted(t.glob("*.safetensors"))[0]
    tensors = load_file(f)
    keys = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert keys
    for k in keys:
        tensors[k] = np.zeros_like(tensors[k])
    save_file(tensors, str(f), metadata={"format": "pt"})
    r = db.port(t, tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    assert r.certificate["dropped_zeros"] == keys
    assert r.verification["passed"]
