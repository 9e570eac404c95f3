"""GGUF codes moved, never requantized, through ``db.port`` (issue 43):

- GGUF -> mlx-lm with ``keep_codes=True``: Q4_0/Q4_1/Q8_0/Q4_K blocks become MLX affine group-32
  layers (float32 scales and biases) that ``mlx_lm.utils.load_model`` loads, whose
  ``mx.dequantize`` equals ``gguf.quants.dequantize`` of the source (bit for bit for Q4_1 and Q4_K,
  in value for Q4_0 and Q8_0); other quantized types refused by name, dequantized without it;
- an ``mlx_lm.convert -q`` directory (affine 4-bit, group 64) -> GGUF ``outtype="keep"``: codes and
  scales moved into Q4_1 blocks, identical, and llama.cpp runs the file.

Tiny random Llama models built by transformers (hidden 256 so Q4_K's 256-value rows fit), written as
GGUF by our port with gguf's quantizers; Q4_K and Q6_K blocks from valid random bytes, written with
the file layer's writer.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")
torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402
from dense_bridge._errors import ConversionError  # noqa: E402

from test_gguf_port import VOCAB, _tokenizer  # noqa: E402  (tests/ports on the path, as pytest puts it)

T = gguf.GGMLQuantizationType


def _llama(path: str, seed: int = 0) -> str:
    from dense_bridge.backends.torch._ports import _randomize

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    _tokenizer(path)
    return path


def _random_blocks(kind, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks of ``kind`` (Q4_K or Q6_K; gguf has no quantizer for them): random bytes
    with finite, small float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    n = rows * cols // block
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if kind == T.Q4_K:
        b[:, 0:2] = rng.uniform(1e-3, 0.02, n).astype("<f2").view(np.uint8).reshape(n, 2)
        b[:, 2:4] = rng.uniform(-0.02, 0.02, n).astype("<f2").view(np.uint8).reshape(n, 2)
    elif kind == T.MXFP4:  # E8M0 exponent first: 2**-9 .. 2**-5
        b[:, 0] = rng.integers(118, 123, n, dtype=np.uint8)
    else:  # Q6_K: d last
        b[:, -2:] = rng.uniform(1e-4, 1e-3, n).astype("<f2").view(np.uint8).reshape(n, 2)
    return b.reshape(rows, cols // block * size)


def _retyped(src: str, out: str, kinds: dict) -> str:
    """The GGUF file ``src`` written again with the file layer's writer, the tensors named in
    ``kinds`` ({name: type}) replaced by valid random blocks of that type."""
    from dense_bridge.backends.gguf._file import open_gguf
    from dense_bridge.backends.gguf._writer import GGUFOutput

    with open_gguf(src) as f:
        plan = [(n, t.shape, kinds.get(n, t.ggml_type)) for n, t in f.tensors.items()]
        with GGUFOutput(out, f.metadata, plan, types=f.metadata_types) as o:
            for i, (n, shape, kind) in enumerate(plan):
                o.write(n, _random_blocks(kind, shape[0], shape[1], i) if n in kinds else f.raw(n))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-codes")
    src = _llama(str(root / "llama"))
    out = {"src": src}
    for outtype in ("q4_0", "q4_1", "q8_0"):
        out[outtype] = str(root / f"{outtype}.gguf")
        db.port(src, out[outtype], to="gguf", outtype=outtype, verify="twins")
    # Q4_K on the q/k (permuted rows), gate and up matrices; the rest Q4_0
    out["q4_k"] = _retyped(out["q4_0"], str(root / "q4_k.gguf"),
                           {f"blk.{i}.{n}.weight": T.Q4_K for i in range(2) for n in ("attn_q", "attn_k", "ffn_up")})
    out["mxfp4"] = _retyped(out["q4_0"], str(root / "mxfp4.gguf"), {"blk.0.ffn_up.weight": T.MXFP4})
    out["q6_k"] = _retyped(out["q4_0"], str(root / "q6_k.gguf"), {"blk.1.attn_v.weight": T.Q6_K})
    return out


def _logical(path: str) -> dict:
    """{GGUF name: (type name, gguf's dequantization in logical order)} of a file."""
    from dense_bridge.backends.gguf._ports import _Logical

    with _Logical(path) as f:
        return {n: (f.tensors[n].type_name, np.array(f.get(n))) for n in f.keys()}


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_k"])
def test_keep_codes_moves_gguf_blocks_into_mlx_affine_layers(files, tmp_path, kind):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model
    from pathlib import Path

    out = str(tmp_path / "mlx")
    report = db.port(files[kind], out, to="mlx-lm", keep_codes=True, verify="twins")
    cert = report.certificate["tensors"]
    with open(os.path.join(out, "config.json")) as f:
        quant = json.load(f)["quantization"]
    bits = 8 if kind == "q8_0" else 4
    assert {k: quant[k] for k in ("group_size", "bits", "mode")} == {"group_size": 32, "bits": bits, "mode": "affine"}
    model, _ = load_model(Path(out))
    params = dict(tree_flatten(model.parameters()))
    source = _logical(files[kind])
    moved = 0
    for name, module in model.named_modules():
        if not hasattr(module, "scales"):
            continue
        entry = cert[f"{name}.weight"]
        assert entry["codes"] == "moved" and entry["max_abs_error"] == 0.0, (name, entry)
        gname = entry["sources"][0]["tensor"]
        gtype, want = source[gname]
        assert module.scales.dtype == mx.float32 and module.biases.dtype == mx.float32
        got = np.array(mx.dequantize(module.weight, module.scales, module.biases, 32, module.bits, "affine"))
        assert module.bits == (8 if gtype == "Q8_0" else 4)
        assert np.array_equal(got, want), name  # equal in value
        if gtype in ("Q4_1", "Q4_K"):
            assert got.tobytes() == want.tobytes(), name  # and bit for bit
        elif got.tobytes() != want.tobytes():  # Q4_0, Q8_0: a zero's sign may differ, and the certificate says so
            assert "sign of zero" in entry["ops"][-1] and np.array_equal(np.abs(got), np.abs(want))
        moved += 1
    quantized = [n for n, (t, _) in source.items() if t != "F32"]
    assert moved == len(quantized) == 16  # every matrix, the head and the embedding (mlx-lm quantizes embeddings)
    assert all(str(v.dtype) == "mlx.core.float32" for k, v in params.items() if k.endswith("norm.weight"))
    if kind == "q4_k":
        assert sum(1 for n, (t, _) in source.items() if t == "Q4_K") == 6
    check = db.verify_port(out)  # every stored code tensor recomputed from the GGUF blocks, bit for bit
    assert check.passed, check.problems[:3]


def test_keep_codes_moves_mxfp4_blocks_into_mlx_mxfp4_layers(files, tmp_path):
    from mlx_lm.utils import load_model
    from pathlib import Path

    out = str(tmp_path / "mlx")
    report = db.port(files["mxfp4"], out, to="mlx-lm", keep_codes=True, verify="twins")
    with open(os.path.join(out, "config.json")) as f:
        quant = json.load(f)["quantization"]
    layer = "model.layers.0.mlp.up_proj"
    assert quant[layer] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}  # a per-layer entry: its mode differs
    assert quant["mode"] == "affine" and quant["bits"] == 4
    assert report.certificate["tensors"][f"{layer}.weight"]["codes"] == "moved"
    model, _ = load_model(Path(out))
    module = model.model.layers[0].mlp.up_proj
    assert module.mode == "mxfp4" and module.scales.dtype == mx.uint8
    got = np.array(mx.dequantize(module.weight, module.scales, None, 32, 4, "mxfp4", dtype=mx.float32))
    assert np.array_equal(got, _logical(files["mxfp4"])["blk.0.ffn_up.weight"][1])  # in value


def test_keep_codes_refuses_other_types_by_name_and_dequantizes_them_without(files, tmp_path):
    with pytest.raises(ConversionError, match=r"blk\.1\.attn_v\.weight.*Q6_K"):
        db.port(files["q6_k"], str(tmp_path / "kept"), to="mlx-lm", keep_codes=True, verify="twins")
    assert not os.path.exists(tmp_path / "kept")
    report = db.port(files["q6_k"], str(tmp_path / "float"), to="mlx-lm", verify="twins")
    entry = report.certificate["tensors"]["model.layers.1.self_attn.v_proj.weight"]
    assert entry["codes"] == "dequantized" and "Q6_K" in entry["ops"][0]


# ------------------------------------------------------------------------------ mlx-lm 4-bit -> GGUF keep
def _mlx_q4(src: str, out: str, **kw) -> str:
    from mlx_lm import convert

    convert(src, out, quantize=True, **{"q_group_size": 64, "q_bits": 4, "dtype": "bfloat16", **kw})
    shutil.copy(os.path.join(src, "tokenizer.model"), out)  # llama.cpp's SentencePiece vocabulary
    return out


@pytest.fixture(scope="module")
def mlx_q4(files, tmp_path_factory):
    return _mlx_q4(files["src"], str(tmp_path_factory.mktemp("mlx-q4") / "q4"))


#: max |llama.cpp - mlx-lm| / std(logits), mlx-lm's model of the source with its float parameters
#: (the bfloat16 scales, biases and norms) widened exactly to float32: measured 0.099, all of it
#: llama.cpp quantizing the activations to Q8 blocks in each product (transformers running the
#: file's dequantized weights is 8e-6 from that mlx-lm model): about twice that. mlx-lm as it
#: loads the source (bfloat16 activations) is measured 0.40 away, bounded at twice that.
LOGIT_BOUND, LOGIT_BOUND_BF16, SAME_FUNCTION = 0.2, 0.8, 1e-4


def test_mlx_q4_codes_move_into_q4_1_blocks_and_llama_cpp_runs_them(files, mlx_q4, tmp_path):
    from dense_bridge.backends.gguf._ports import _Logical
    from dense_bridge.backends.mlx._port_quant import QuantizedWeights
    from dense_bridge.backends.mlx._ports import port_shapes
    from functools import partial

    path = str(tmp_path / "keep.gguf")
    report = db.port(mlx_q4, path, to="gguf", outtype="keep", verify="twins")
    cert = report.certificate
    assert cert["destination"]["outtype"] == "keep"
    moved = {n: e for n, e in cert["tensors"].items() if e.get("codes") == "moved"}
    assert len(moved) == 16 and all(e["ggml_type"] == "Q4_1" for e in moved.values())
    assert all(0 < e["max_abs_error"] < 1e-2 for e in moved.values())  # the runtimes' arithmetic, stated
    assert all(e["ggml_type"] == "F32" for n, e in cert["tensors"].items() if n not in moved)
    checked = db.verify_port(path)  # every Q4_1 tensor's bytes recomputed from the source's MLX codes
    assert checked.passed and checked.tensors == len(cert["tensors"]), str(checked)
    with QuantizedWeights(os.path.join(mlx_q4, "model.safetensors"), partial(port_shapes, "mlx-lm")) as src, \
            _Logical(path) as f:
        for name, entry in moved.items():
            c = src.codes_of(entry["sources"][0]["tensor"])
            codes = f.codes_of(name)  # the Q4_1 blocks read back as group-32 codes, rows in logical order
            assert np.array_equal(codes["weight"], c["weight"]), name  # codes identical
            assert np.array_equal(codes["scales"], np.repeat(c["scales"].astype(np.float32), 2, axis=1)), name
            assert np.array_equal(codes["biases"], np.repeat(c["biases"].astype(np.float32), 2, axis=1)), name
    lc = pytest.importorskip("llama_cpp")
    ids = np.random.default_rng(0).integers(3, VOCAB, 48).tolist()
    llm = lc.Llama(model_path=path, n_ctx=64, logits_all=True, flash_attn=False, type_k=0, type_v=0, verbose=False,
                   n_threads=2, n_batch=64)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)], np.float32)
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model
    from pathlib import Path

    from dense_bridge.backends.gguf._ports import port_load

    model, _ = load_model(Path(mlx_q4))  # mlx-lm's own model of the source, its codes as they are
    as_loaded = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))
    wide = np.array(model(mx.array([ids]))[0])
    with torch.no_grad():  # transformers' GGUF loader on the file: the Q4_1 blocks' own values
        file_model = port_load("gguf", path)(torch.tensor([ids])).logits[0].float().numpy()
    std = float(np.std(wide))
    errs = {k: float(np.max(np.abs(a - b)) / std) for k, (a, b) in
            {"llama.cpp vs mlx-lm (float32)": (theirs, wide), "llama.cpp vs mlx-lm (bfloat16)": (theirs, as_loaded),
             "file (transformers) vs mlx-lm (float32)": (file_model, wide)}.items()}
    print("max |difference| / std(logits):", {k: f"{v:.3g}" for k, v in errs.items()})
    assert errs["file (transformers) vs mlx-lm (float32)"] <= SAME_FUNCTION, errs  # the codes moved: same function
    assert errs["llama.cpp vs mlx-lm (float32)"] <= LOGIT_BOUND, errs
    assert errs["llama.cpp vs mlx-lm (bfloat16)"] <= LOGIT_BOUND_BF16, errs


def test_keep_refuses_codes_q4_1_cannot_hold(files, tmp_path):
    eight = _mlx_q4(files["src"], str(tmp_path / "q8"), q_bits=8)
    with pytest.raises(ConversionError, match=r"tensor '.*\.weight'.*8-bit"):
        db.port(eight, str(tmp_path / "a.gguf"), to="gguf", outtype="keep", verify="twins")
    wide = _mlx_q4(files["src"], str(tmp_path / "f32"), dtype="float32")  # float32 scales: not float16 values
    with pytest.raises(ConversionError, match=r"tensor '.*\.weight'.*not float16 values"):
        db.port(wide, str(tmp_path / "b.gguf"), to="gguf", outtype="keep", verify="twins")
    with pytest.raises(ConversionError, match=r"tensor '.*\.weight'.*Q4_0 blocks"):  # GGUF blocks are not MLX codes
        db.port(files["q4_0"], str(tmp_path / "d.gguf"), to="gguf", outtype="keep", verify="twins")
    with pytest.raises(ConversionError, match="holds no quantized tensors"):
        db.port(files["src"], str(tmp_path / "c.gguf"), to="gguf", outtype="keep", verify="twins")
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".gguf")]


# ------------------------------------------------------------------------------ GGUF -> transformers (torchao)
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_keep_codes_moves_gguf_blocks_into_torchao_layers(files, tmp_path, kind):
    pytest.importorskip("torchao")
    out = str(tmp_path / "hf")
    report = db.port(files[kind], out, to="transformers", keep_codes=True, verify="twins")
    cert = report.certificate
    moved = {n: e for n, e in cert["tensors"].items() if e.get("codes") == "moved"}
    # every linear layer's blocks moved (torchao: d * (q - 8) and d * q are one rounding, as in gguf);
    # the embedding table stays float (transformers quantizes linear layers only)
    assert moved and all("blk." in e["sources"][0]["tensor"] or e["sources"][0]["tensor"] == "output.weight"
                         for e in moved.values())
    assert cert["tensors"]["model.embed_tokens.weight"]["codes"] == "dequantized"
    codes = cert["verification"]["codes"]
    assert codes["passed"] and codes["largest_error"] == 0.0 and codes["kl_divergence_vs_float"] < 1e-6
    assert db.verify_port(out).passed
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # transformers' own torchao loading
    ids = torch.tensor([np.random.default_rng(0).integers(3, VOCAB, 24).tolist()])
    float_out = str(tmp_path / "float")
    db.port(files[kind], float_out, to="transformers", verify="twins")
    with torch.no_grad():
        a = model(ids).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(float_out)(ids).logits
    assert torch.equal(a, b)


def test_keep_codes_into_torchao_refuses_q4_1_naming_the_first_differing_value(files, tmp_path):
    pytest.importorskip("torchao")
    out = str(tmp_path / "hf")
    # Q4_1's d * q + m rounds twice; torchao's (q - zero) * scale once: the values differ, refused by name
    with pytest.raises(ConversionError, match=r"q_proj\.weight' at index") as exc:
        db.port(files["q4_1"], out, to="transformers", keep_codes=True, verify="twins")
    assert "requantize=True" in str(exc.value)
    assert not os.path.exists(out)
