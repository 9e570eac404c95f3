"""Ports with quantized codes (issue 42, "Codes" and "quantize="): a quantized mlx-lm directory as
the source (by default its exact dequantization, bit for bit ``mlx_lm.utils.dequantize_model``;
``keep_codes=True``: torchao layers in transformers where the arithmetic agrees, else refused naming
the first differing value), and ``quantize=`` into mlx-lm with mlx-lm's own quantizer (code for code
``mlx_lm.convert -q``). Tiny random Llama (untied) and Qwen2 (tied), directories written by
``mlx_lm.convert`` itself, no downloads."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dense_bridge as db
from _port_helpers import mlx_lm_or_skip, randomize, transformers_or_skip

# widths that the group sizes divide (64, 128) so every projection is quantized, as in real models
_SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def _hf(transformers, name: str, path) -> None:
    import torch
    from tokenizers import Tokenizer, models

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "odd": transformers.LlamaConfig}[name]
    # "odd": an MLP width group 64 does not divide, so mlx-lm leaves down_proj float
    sizes = {**_SIZES, "intermediate_size": 160} if name == "odd" else _SIZES
    config = cls(**sizes, tie_word_embeddings=name == "qwen2")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed=1, scale=0.05)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{name: directory}: transformers sources and what mlx_lm.convert(quantize=True) made of them."""
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    pytest.importorskip("tokenizers")
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name in ("llama", "qwen2", "odd"):
        _hf(transformers, name, root / f"{name}-hf")
        out[name] = root / f"{name}-hf"
    made = {"llama-q4": ("llama", dict(q_bits=4, q_group_size=64)),
            "llama-mixed": ("llama", dict(quant_predicate="mixed_3_6")),
            "qwen2-q8": ("qwen2", dict(q_bits=8, q_group_size=32)),
            "qwen2-mxfp4": ("qwen2", dict(q_mode="mxfp4"))}
    for name, (base, kw) in made.items():
        convert(str(out[base]), mlx_path=str(root / name), quantize=True, **kw)
        out[name] = root / name
    return out


def _dequantized(path) -> dict:
    """Every parameter of ``mlx_lm.utils.dequantize_model`` of the quantized directory, as numpy."""
    from pathlib import Path

    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    from dense_bridge.backends.mlx._arrays import to_numpy

    model, _ = load_model(Path(path))
    return {k: to_numpy(v) for k, v in tree_flatten(dequantize_model(model).parameters())}


def _stored(path) -> dict:
    """Every tensor of the directory's safetensors files as stored (bfloat16 as ml_dtypes)."""
    from dense_bridge.checkpoints._safetensors import SafetensorsFile

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(path, name)) as f:
                out.update({k: np.array(f.get(k)) for k in f.keys()})
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name,verify", [("llama-q4", "full"), ("llama-mixed", "twins"), ("qwen2-q8", "twins"),
                                         ("qwen2-mxfp4", "twins")])
def test_a_quantized_mlx_lm_directory_ports_as_its_exact_dequantization(dirs, tmp_path, name, verify):
    """Default: every tensor transformers gets equals mlx_lm.utils.dequantize_model's, bit for bit and in
    the dtype it produces (mxfp4: bfloat16); the certificate says which were dequantized from which
    codes; verify_port confirms every entry from the files."""
    out = tmp_path / "hf"
    report = db.port(dirs[name], out, to="transformers", verify=verify)
    assert report.verification["passed"] and report.verification["mode"] == verify
    want = _dequantized(dirs[name])
    got = _stored(out)
    tied = "lm_head.weight" not in got
    assert set(got) == set(want) - ({"lm_head.weight"} if tied else set())
    for key, value in got.items():
        assert _same_bits(value, want[key]), key
    config = json.loads((dirs[name] / "config.json").read_text())["quantization"]
    entries = report.certificate["tensors"]
    quantized = {k for k, e in entries.items() if e["codes"] == "dequantized"}
    assert quantized == {k for k in got if k.endswith(".weight") and "norm" not in k}
    for key in quantized:
        parts = {s["part"]: s["tensor"] for s in entries[key]["quantized_sources"]}
        assert parts["weight"] == key and parts["scales"] == key[: -len("weight")] + "scales"
        assert ("biases" in parts) == (config["mode"] == "affine")
        assert entries[key]["ops"][0].startswith(f"dequantize {key}: mlx.core.dequantize")
    if name == "llama-mixed":  # mlx-lm's per-layer overrides: other bit widths, read as mlx-lm reads them
        assert any("6-bit" in entries[k]["ops"][0] for k in quantized)
        assert any("3-bit" in entries[k]["ops"][0] for k in quantized)
    assert db.verify_port(out).passed


def test_the_full_verification_of_a_quantized_source_compares_its_own_quantized_model(dirs, tmp_path):
    """The full comparison runs mlx-lm's quantized model (QuantizedLinear) against the float
    destination: no false alarm (the dequantization is exact), and the next-token distributions agree."""
    report = db.port(dirs["qwen2-q8"], tmp_path / "hf", to="transformers", verify="full")
    v = report.verification
    assert v["mode"] == "full" and v["passed"] and v["kl_divergence"] < 1e-6 and v["top1_agreement"] == 1.0


@pytest.mark.parametrize("base,spec,kw", [("llama", "affine:4:64", dict(q_bits=4, q_group_size=64)),
                                          ("qwen2", "affine:8:32", dict(q_bits=8, q_group_size=32)),
                                          ("odd", "affine:3:64", dict(q_bits=3, q_group_size=64)),
                                          ("llama", "affine:4:64", dict(q_bits=4, q_group_size=64, dtype="bfloat16")),
                                          ("qwen2", "mxfp4", dict(q_mode="mxfp4")),
                                          ("llama", "nvfp4", dict(q_mode="nvfp4")),
                                          ("llama", "mixed_3_6", dict(quant_predicate="mixed_3_6"))])
def test_quantize_equals_mlx_lm_convert_code_for_code(dirs, tmp_path, base, spec, kw):
    """quantize= into mlx-lm: every tensor (packed codes, scales, biases, the float ones) and
    config["quantization"] (and its hub copy) equal what mlx_lm.convert(quantize=True) writes for the
    same transformers directory; the certificate gives each quantized tensor's largest error."""
    from mlx_lm import convert

    theirs = tmp_path / "theirs"
    convert(str(dirs[base]), mlx_path=str(theirs), quantize=True, **kw)
    out = tmp_path / "ours"
    report = db.port(dirs[base], out, to="mlx-lm", quantize=spec, verify="twins", dtype=kw.get("dtype"))
    if spec.startswith("mixed"):  # mlx-lm's per-layer entries, other bit widths among them
        entries = json.loads((out / "config.json").read_text())["quantization"]
        assert {v["bits"] for k, v in entries.items() if isinstance(v, dict)} == {3, 6}
    want, got = _stored(theirs), _stored(out)
    assert set(got) == set(want)
    if base == "odd":  # a layer mlx-lm leaves float, left float here too
        assert "model.layers.0.mlp.down_proj.scales" not in got and got["model.layers.0.mlp.down_proj.weight"].ndim == 2
        assert "model.layers.0.mlp.up_proj.scales" in got
    for key in want:
        assert _same_bits(got[key], want[key]), key
    a, b = (json.loads((p / "config.json").read_text()) for p in (out, theirs))
    assert a["quantization"] == b["quantization"] and a["quantization_config"] == b["quantization_config"]
    entries = report.certificate["tensors"]
    scales = [k for k in got if k.endswith(".scales")]
    assert scales and all(entries[k]["codes"] == "quantized" for k in scales)
    errors = report.verification["codes"]["max_abs_error"]
    assert set(errors) == {k[: -len("scales")] + "weight" for k in scales}
    assert all(0 < e < 0.1 for e in errors.values())
    codes = report.verification["codes"]  # loaded by mlx-lm's loader; its distance from the float model stated
    assert codes["loaded"] and 0 <= codes["kl_divergence_vs_float"] < float("inf")
    assert codes["largest_error"] == max(errors.values())
    assert db.verify_port(out).passed
    import mlx_lm

    mlx_lm.load(str(out))  # mlx-lm's own loader reads it as it is


def test_the_way_back_is_the_exact_dequantization(dirs, tmp_path):
    """transformers -> mlx-lm quantize="affine:4:64" -> transformers: the float model back equals
    dequantize_model of the quantized directory, bit for bit."""
    db.port(dirs["llama"], tmp_path / "q", to="mlx-lm", quantize="affine:4:64", verify="twins")
    db.port(tmp_path / "q", tmp_path / "back", to="transformers", verify="twins")
    want, got = _dequantized(tmp_path / "q"), _stored(tmp_path / "back")
    assert set(got) == set(want)
    assert all(_same_bits(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kw,error,words", [
    (dict(quantize="affine:7:64"), db.ConversionError, ["quantize", "affine:7:64"]),
    (dict(quantize="affine:4:48"), db.ConversionError, ["quantize", "affine:4:48"]),
    (dict(quantize="int4"), db.ConversionError, ["quantize", "int4", "mxfp4"]),
    (dict(quantize=4), TypeError, ["quantize", "4"]),
    (dict(quantize="affine:4:64", keep_codes=True), db.ConversionError, ["quantize", "keep_codes"]),
    (dict(requantize=True), db.ConversionError, ["requantize", "keep_codes"]),
    (dict(keep_codes="yes"), TypeError, ["keep_codes", "yes"]),
    (dict(keep_codes=True), db.ConversionError, ["keep_codes", "True"]),
])
def test_bad_codes_arguments_are_refused_naming_them(dirs, tmp_path, kw, error, words):
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        db.port(dirs["llama"], out, to="mlx-lm", **kw)
    for w in words:
        assert w in str(info.value)
    assert not out.exists()


def test_quantize_into_a_destination_without_a_quantizer_is_refused(dirs, tmp_path):
    with pytest.raises(db.ConversionError, match="quantize") as info:
        db.port(dirs["llama-q4"], tmp_path / "out", to="transformers", quantize="affine:4:64")
    assert "mlx-lm" in str(info.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ keep_codes
def _exact_in_torchao(src, dst) -> None:
    """``src`` (an affine mlx-lm directory) copied to ``dst`` with every scale a positive power of two and
    every bias ``-zero * scale`` for an integer zero: codes whose MLX dequantization f(f(scale * q) +
    bias) and torchao's f((q - zero) * scale) agree bit for bit (every product and sum is exact)."""
    import shutil

    import mlx.core as mx

    shutil.copytree(src, dst)
    for name in sorted(os.listdir(dst)):
        if not name.endswith(".safetensors"):
            continue
        t = mx.load(str(dst / name))
        for key in [k for k in t if k.endswith(".biases")]:
            layer = key[: -len("biases")]
            s, b = np.array(t[layer + "scales"]), np.array(t[key])
            s2 = (2.0 ** np.round(np.log2(np.abs(s)))).astype(s.dtype)
            t[layer + "scales"], t[key] = mx.array(s2), mx.array((-np.clip(np.round(-b / s2), -100, 100) * s2)
                                                               .astype(s.dtype))
        mx.save_safetensors(str(dst / name), t, metadata={"format": "mlx"})


def _torchao_layers(path) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m.weight).__module__.startswith("torchao.")}


def test_keep_codes_moves_codes_whose_arithmetic_agrees_into_torchao(dirs, tmp_path):
    """Codes torchao dequantizes exactly as MLX does move as they are: transformers loads
    IntxUnpackedToInt8Tensor layers (its own torchao support) holding the source's codes, whose
    dequantization equals mlx_lm.utils.dequantize_model bit for bit; the embedding table (which
    transformers quantizes not) is the exact dequantization; verify_port holds."""
    pytest.importorskip("torchao")
    import torch

    from dense_bridge.backends.mlx import port_open

    src = tmp_path / "exact"
    _exact_in_torchao(dirs["llama-q4"], src)
    out = tmp_path / "hf"
    report = db.port(src, out, to="transformers", keep_codes=True, verify="full")
    kept = report.verification["codes"]["kept"]
    assert kept and all(v == {"codes": "moved", "max_abs_error": 0.0} for v in kept.values())
    assert report.verification["codes"]["largest_error"] == 0.0
    want = _dequantized(src)
    layers = _torchao_layers(out)
    assert {f"{n}.weight" for n in layers} == set(kept)
    with port_open("mlx-lm", str(src / "model.safetensors")) as f:
        for name, m in layers.items():
            with torch.no_grad():
                got = m.weight.dequantize().numpy()
            assert _same_bits(got, want[f"{name}.weight"]), name
            codes = f.codes_of(f"{name}.weight")
            assert np.array_equal(m.weight.qdata.numpy().astype(np.int16), codes["qcodes"].astype(np.int16) - 8), name
    entries = report.certificate["tensors"]
    assert entries["model.embed_tokens.weight"]["codes"] == "dequantized"
    assert {e["codes"] for k, e in entries.items() if "._weight_" in k} == {"moved"}
    assert db.verify_port(out).passed


def test_keep_codes_refuses_naming_the_first_differing_value(dirs, tmp_path):
    """mlx_lm.convert's own codes (a float bias, not an integer zero point) do not dequantize the same
    in torchao: refused, naming the tensor, the index and both values; nothing written."""
    pytest.importorskip("torchao")
    out = tmp_path / "hf"
    with pytest.raises(db.ConversionError) as info:
        db.port(dirs["llama-q4"], out, to="transformers", keep_codes=True, verify="twins")
    msg = str(info.value)
    assert "keep_codes" in msg and "requantize=True" in msg
    import re

    m = re.search(r"tensor '([^']+)' at index \((\d+), (\d+)\): torchao dequantizes the moved codes to (\S+), the "
                  r"source's exact dequantization is (\S+) \(", msg)
    assert m, msg
    name, i, j, theirs, ours = m.group(1), int(m.group(2)), int(m.group(3)), float(m.group(4)), float(m.group(5))
    # bit patterns, not values: the first difference may be a signed zero (0.0 from scale * q + bias,
    # -0.0 from (q - zero) * scale with a negative scale)
    assert repr(ours) == repr(float(_dequantized(dirs["llama-q4"])[name][i, j])) and repr(theirs) != repr(ours)
    assert not out.exists()


@pytest.mark.parametrize("name", ["llama-q4", "qwen2-q8"])  # qwen2: tied table, biased q/k/v projections
def test_keep_codes_with_requantize_writes_torchao_codes_and_reports_the_largest_error(dirs, tmp_path, name):
    pytest.importorskip("torchao")
    import torch

    out = tmp_path / "hf"
    report = db.port(dirs[name], out, to="transformers", keep_codes=True, requantize=True, verify="twins")
    codes = report.verification["codes"]
    assert codes["kept"] and {v["codes"] for v in codes["kept"].values()} == {"quantized"}
    want = _dequantized(dirs[name])
    layers = _torchao_layers(out)
    worst = 0.0
    for name, m in layers.items():
        with torch.no_grad():
            err = float(np.max(np.abs(m.weight.dequantize().numpy().astype(np.float64) - want[f"{name}.weight"])))
        assert err == pytest.approx(codes["kept"][f"{name}.weight"]["max_abs_error"], rel=1e-6, abs=1e-12)
        worst = max(worst, err)
    assert codes["largest_error"] == pytest.approx(worst) and 0 < worst < 0.05
    assert codes["loaded"] and codes["top1_agreement_vs_float"] > 0.5
    assert db.verify_port(out).passed


def test_keep_codes_of_a_microscaling_source_is_refused_naming_the_mode(dirs, tmp_path):
    pytest.importorskip("torchao")
    with pytest.raises(db.ConversionError, match="mxfp4") as info:
        db.port(dirs["qwen2-mxfp4"], tmp_path / "hf", to="transformers", keep_codes=True, verify="twins")
    assert "requantize=True" in str(info.value)
    assert not (tmp_path / "hf").exists()


def test_verify_port_recomputes_codes_and_names_a_changed_one(dirs, tmp_path):
    """verify_port recomputes every quantized tensor with the destination library's quantizer; a code
    changed in the file (its sha256 updated in the certificate, so only the recomputation can tell)
    is named."""
    from dense_bridge.checkpoints._port_files import sha256_file
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "q"
    db.port(dirs["llama"], out, to="mlx-lm", quantize="affine:4:64", verify="twins")
    assert db.verify_port(out).passed
    name = next(n for n in os.listdir(out) if n.endswith(".safetensors"))
    tensors = load_file(str(out / name))
    key = "model.layers.1.mlp.down_proj.weight"
    tensors[key] = tensors[key].copy()
    tensors[key][3, 5] ^= np.uint32(1)
    save_file(tensors, str(out / name), metadata={"format": "mlx"})
    cert = json.loads((out / "port_certificate.json").read_text())
    cert["destination"]["files"][name] = sha256_file(str(out / name))
    (out / "port_certificate.json").write_text(json.dumps(cert))
    report = db.verify_port(out)
    assert not report.passed and len(report.problems) == 1 and key in report.problems[0]
