"""GGUF (llama.cpp's format) as a port destination and source, against the oracles:

- writing: llama.cpp's own converter (``convert_hf_to_gguf.py``, run offline as a subprocess from
  a llama.cpp source tree: ``DENSE_BRIDGE_LLAMA_CPP``, or the llama-cpp-python sdist unpacked under
  /work/wheels/src) writes the same tiny random models; every tensor's bytes and type are identical;
- reading: a converter-made file ported to transformers equals transformers' own GGUF loading bit
  for bit; a file we write reads back to the source's tensors exactly;
- running: llama.cpp (``llama_cpp``, where installed) computes the logits transformers computes.

Tiny random Llama, Mistral, Qwen2, Qwen3 and Phi-3 models (tied and untied heads) are built by
transformers, each with a real SentencePiece tokenizer trained here on a few sentences.
"""
from __future__ import annotations

import glob
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")
torch = pytest.importorskip("torch")

import dense_bridge as db  # noqa: E402
from dense_bridge._errors import CheckpointError, ConversionError  # noqa: E402

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "A port moves every tensor exactly.",
             "llama.cpp runs GGUF files on laptops.", "Hello world, hello tensors.", "Numbers 123 456 and symbols !?",
             "dense bridge writes certificates"]
VOCAB = 320
MODELS = {  # model type -> (config class, extra settings)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
}


def llama_cpp_dir() -> str | None:
    from dense_bridge.backends.gguf._tokenizer import llama_cpp_dir as found

    return found()


def _tokenizer(path: str, symbols=()) -> None:
    """A SentencePiece tokenizer trained here; ``symbols``: pieces it must hold whatever the text."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SENTENCES * 20), model_writer=buf, vocab_size=VOCAB,
                                   model_type="bpe", character_coverage=1.0, byte_fallback=True, bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=-1, minloglevel=2, user_defined_symbols=list(symbols))
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(buf.getvalue())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "add_bos_token": True, "add_eos_token": False,
                   "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)


def make_model(root, kind: str, tied: bool, seed: int = 0) -> str:
    """A tiny random transformers model of ``kind`` saved with a SentencePiece tokenizer."""
    from dense_bridge.backends.torch._ports import _randomize

    path = os.path.join(str(root), f"{kind}-{'tied' if tied else 'untied'}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cls, extra = MODELS[kind]
    cfg = getattr(transformers, cls)(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                                     **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    # llama.cpp sets token attributes by name in a file whose general.name says Phi-3 and stops (std::out_of_range)
    # where the vocabulary lacks one of them: Phi-3's own vocabulary holds "<|endoftext|>", so this one does too
    _tokenizer(path, ("<|endoftext|>",) if kind == "phi3" else ())
    return path


def convert(src: str, out: str, outtype: str) -> str:
    """llama.cpp's converter run on ``src`` (offline, its own gguf-py first on the path)."""
    root = llama_cpp_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(root, "gguf-py"))
    res = subprocess.run([sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), src, "--outfile", out,
                          "--outtype", outtype], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def tensors_of(path: str) -> dict:
    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), t.data.tobytes()) for t in r.tensors}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-models")


needs_converter = pytest.mark.skipif(llama_cpp_dir() is None, reason="llama.cpp's converter (convert_hf_to_gguf.py) "
                                     "not found: set DENSE_BRIDGE_LLAMA_CPP to a llama.cpp source tree")

CASES = [("llama", False, "f32"), ("llama", False, "f16"), ("llama", False, "bf16"), ("llama", False, "q8_0"),
         ("llama", True, "f32"), ("mistral", False, "f32"), ("mistral", True, "q8_0"), ("qwen2", False, "f32"),
         ("qwen2", True, "q8_0"), ("qwen3", False, "f32"), ("qwen3", True, "q8_0"), ("phi3", False, "f32"),
         ("phi3", False, "q8_0")]


@needs_converter
@pytest.mark.parametrize("kind,tied,outtype", CASES, ids=[f"{k}-{'tied' if t else 'untied'}-{o}" for k, t, o in CASES])
def test_writes_the_tensor_bytes_llama_cpps_converter_writes(models, tmp_path, kind, tied, outtype):
    src = make_model(models, kind, tied)
    ours = str(tmp_path / "ours.gguf")
    report = db.port(src, ours, to="gguf", outtype=outtype, verify="twins")
    theirs = tensors_of(convert(src, str(tmp_path / "theirs.gguf"), outtype))
    mine = tensors_of(ours)
    assert sorted(mine) == sorted(theirs)
    assert ("output.weight" in mine) == (not tied)
    differ = [n for n in mine if mine[n] != theirs[n]]
    assert not differ, [(n, mine[n][:2], theirs[n][:2]) for n in differ]
    # every hyperparameter and tokenizer key we write is the converter's, with its value
    from dense_bridge.backends.gguf._file import open_gguf

    with open_gguf(ours) as ra, open_gguf(str(tmp_path / "theirs.gguf")) as rb:
        arch = ra.metadata["general.architecture"]
        for key, value in ra.metadata.items():
            if key == "general.name":
                continue
            if key == f"{arch}.vocab_size" and key not in rb.metadata:  # transformers' key, read where present
                assert value == len(rb.metadata["tokenizer.ggml.tokens"])
                continue
            assert key in rb.metadata, key
            assert value == rb.metadata[key] and ra.metadata_types[key] == rb.metadata_types[key], key
    with open(ours + ".port_certificate.json") as f:
        cert = json.load(f)
    assert set(cert["tensors"]) == set(mine) and cert["destination"]["outtype"] == outtype
    q = cert["tensors"][next(n for n in sorted(mine) if n.startswith("blk.0.attn_q") and n.endswith(".weight"))]
    assert q["permuted"] == (arch == "llama")  # llama.cpp permutes llama-family q/k rows only
    if outtype == "f32":
        assert all(t["exact"] for t in cert["tensors"].values()) and report.tensors == len(mine)
    if outtype == "q8_0":
        assert q["codes"] == "quantized" and q["ggml_type"] == "Q8_0"


@needs_converter
@pytest.mark.parametrize("kind,outtype", [("llama", "f32"), ("llama", "q8_0"), ("qwen2", "f16"), ("phi3", "bf16")])
def test_reads_a_converter_file_as_transformers_gguf_loader_does(models, tmp_path, kind, outtype):
    src = make_model(models, kind, tied=False)
    path = convert(src, str(tmp_path / "m.gguf"), outtype)
    out = str(tmp_path / "hf")
    db.port(path, out, to="transformers", verify="twins")
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").state_dict()
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert theirs[k].dtype == torch.float32 or ours[k].dtype == theirs[k].dtype
        assert torch.equal(ours[k].float(), theirs[k].float()), k


@pytest.mark.parametrize("kind,tied", [("llama", False), ("mistral", True), ("qwen3", True), ("phi3", False)])
def test_round_trip_through_gguf_is_exact(models, tmp_path, kind, tied):
    src = make_model(models, kind, tied)
    path = str(tmp_path / "m.gguf")
    report = db.port(src, path, to="gguf")
    assert report.verification["mode"] == "full" and report.verification["passed"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left beside it
    back = str(tmp_path / "back")
    db.port(path, back, to="transformers")
    a = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(back).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_refusals_leave_nothing(models, tmp_path):
    src = make_model(models, "llama", tied=False)
    path = str(tmp_path / "m.gguf")
    with pytest.raises(ConversionError, match="outtype"):
        db.port(src, path, to="gguf", outtype="q3_k")
    with pytest.raises(ConversionError, match="outtype"):
        db.port(src, str(tmp_path / "dir"), to="transformers", outtype="f16")
    bare = str(tmp_path / "bare")
    os.makedirs(bare)
    for n in os.listdir(src):
        if n not in ("tokenizer.model", "tokenizer_config.json"):
            os.link(os.path.join(src, n), os.path.join(bare, n))
    with pytest.raises(ConversionError, match="tokenizer"):
        db.port(bare, path, to="gguf", verify="twins")
    assert os.listdir(tmp_path) == ["bare"]
    with open(path, "wb"):
        pass
    with pytest.raises(CheckpointError, match="exists"):
        db.port(src, path, to="gguf")
    assert os.path.getsize(path) == 0


def test_an_architecture_the_gguf_loader_does_not_map_is_refused_by_name(tmp_path):
    cfg = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128)
    src = str(tmp_path / "neox")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    with pytest.raises(ConversionError, match="gpt_neox") as exc:
        db.port(src, str(tmp_path / "m.gguf"), to="gguf")
    assert "llama" in str(exc.value)  # what it does offer
    assert not os.path.exists(tmp_path / "m.gguf")


def test_not_a_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 24)
    with pytest.raises(CheckpointError):
        db.port(str(bad), str(tmp_path / "out"), to="transformers")
    assert not os.path.exists(tmp_path / "out")


#: (model, outtype, tied, bound on the largest logit difference relative to the logits' spread). For f32
#: files, float32 agreement; for quantized files llama.cpp also quantizes the activations (to Q8 blocks) in
#: each product, so it is compared with transformers running the file's own (dequantized) weights, within
#: about twice what was measured (q8_0 0.083, q4_1 0.124 of the logits' std; f32 4e-6). Phi-3 runs since its
#: tiny vocabulary holds "<|endoftext|>" (see make_model): llama.cpp's vocabulary loader looks that token up
#: by name (token_to_id.at) in any file whose general.name contains "phi3" or "phi-3".
LOGIT_CASES = [("llama", "f32", False, 1e-5), ("qwen2", "f32", True, 1e-5), ("qwen3", "f32", False, 1e-5),
               ("mistral", "f32", True, 1e-5), ("phi3", "f32", False, 1e-5), ("llama", "q8_0", False, 0.2),
               ("llama", "q4_1", False, 0.3)]


@pytest.mark.parametrize("kind,outtype,tied,bound", LOGIT_CASES, ids=[f"{k}-{o}" for k, o, _, _ in LOGIT_CASES])
def test_llama_cpp_computes_the_logits_transformers_computes(models, tmp_path, kind, outtype, tied, bound):
    lc = pytest.importorskip("llama_cpp")
    src = make_model(models, kind, tied=tied)
    path = str(tmp_path / "m.gguf")
    db.port(src, path, to="gguf", outtype=outtype, verify="twins")
    ids = np.random.default_rng(0).integers(3, VOCAB, 48).tolist()
    llm = lc.Llama(model_path=path, n_ctx=64, logits_all=True, flash_attn=False, type_k=0, type_v=0, verbose=False,
                   n_threads=2, n_batch=64)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)], np.float32)
    # transformers runs the float source (f32) or the file's own dequantized weights (quantized types)
    reference = src if outtype == "f32" else None
    if reference is None:
        from dense_bridge.backends.gguf._ports import port_load

        model = port_load("gguf", path)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(reference).eval()
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].float().numpy()
    err = float(np.max(np.abs(theirs - ours)) / np.std(ours))
    print(f"{kind} {outtype}: max |llama.cpp - transformers| / std(logits) = {err:.3g}")
    assert err <= bound, err


def test_a_quantizing_outtype_is_measured_and_certified(models, tmp_path):
    src = make_model(models, "llama", tied=False)
    path = str(tmp_path / "m.gguf")
    report = db.port(src, path, to="gguf", outtype="q8_0")  # verify="auto": the full models run
    v = report.verification
    assert v["mode"] == "full" and v["passed"] and v["lossy"]["tensors"] > 0
    assert v["kl_divergence"] < 1e-2 and v["top1_agreement"] > 0.9
    cert = report.certificate["tensors"]
    assert cert["blk.0.ffn_down.weight"]["codes"] == "quantized" and not cert["blk.0.ffn_down.weight"]["exact"]
    assert cert["blk.0.attn_norm.weight"]["ggml_type"] == "F32" and cert["blk.0.attn_norm.weight"]["exact"]


def test_check_and_inspect_read_gguf_files(models, tmp_path):
    src = make_model(models, "qwen2", tied=True)
    path = str(tmp_path / "m.gguf")
    db.port(src, path, to="gguf", verify="twins")
    cli = [sys.executable, "-m", "dense_bridge.cli"]
    res = subprocess.run(cli + ["check", path, src, "--positions", "32"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "bit-identical" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    res = subprocess.run(cli + ["inspect", path], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "blk.0.attn_q.weight" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]


def _minimal_gguf_writer_file(src_gguf: str, out: str) -> None:
    """The tensors of ``src_gguf`` rewritten by gguf-py's own GGUFWriter with only the
    hyperparameters (no tokenizer): the minimal file transformers' GGUF loader reads."""
    from dense_bridge.backends.gguf._file import open_gguf

    with open_gguf(src_gguf) as f:
        arch = f.metadata["general.architecture"]
        w = gguf.GGUFWriter(out, arch)
        for k, v in f.metadata.items():
            if k.startswith(arch + ".") or k == "general.name":
                t, e = f.metadata_types[k]
                w.add_key_value(k, v, t, sub_type=e)
        w.add_uint32(f"{arch}.vocab_size", VOCAB)
        for name in f.keys():
            w.add_tensor(name, np.array(f.get(name), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_reads_a_gguf_writer_file_as_transformers_gguf_loader_does(models, tmp_path, kind):
    src = make_model(models, kind, tied=False)
    first = str(tmp_path / "first.gguf")
    db.port(src, first, to="gguf", verify="twins")
    path = str(tmp_path / "m.gguf")
    _minimal_gguf_writer_file(first, path)
    out = str(tmp_path / "hf")
    db.port(path, out, to="transformers", verify="twins")
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    if kind == "qwen3":  # transformers' loader reads no head_dim for Qwen3: compared with the source instead
        theirs = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    else:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@needs_converter
def test_reads_split_gguf_files(models, tmp_path):
    src = make_model(models, "llama", tied=False)
    root = llama_cpp_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(root, "gguf-py"))
    res = subprocess.run([sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), src, "--outfile",
                          str(tmp_path / "m.gguf"), "--outtype", "f32", "--split-max-tensors", "8"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    parts = sorted(glob.glob(str(tmp_path / "m-*-of-*.gguf")))
    assert len(parts) == 3, parts
    out = str(tmp_path / "hf")
    report = db.port(parts[1], out, to="transformers", verify="twins")  # any part names the model
    assert sorted(report.certificate["source"]["files"]) == sorted(os.path.basename(p) for p in parts)
    a = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ the certificate re-checked
def _flip_a_byte_of(path: str, tensor: str) -> None:
    """One byte in the middle of ``tensor``'s stored data changed in place (the file stays readable)."""
    from dense_bridge.backends.gguf._file import open_gguf

    with open_gguf(path) as f:
        info = f.tensors[tensor]
        at = info.offset + info.nbytes // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("kind,tied,outtype", [("llama", False, "f32"), ("llama", True, "bf16"), ("qwen2", False, "q8_0"),
                                               ("llama", False, "q4_0")])
def test_verify_port_recomputes_every_tensor_of_a_gguf_destination(models, tmp_path, kind, tied, outtype):
    src = make_model(models, kind, tied)
    path = str(tmp_path / "m.gguf")
    report = db.port(src, path, to="gguf", outtype=outtype, verify="twins")
    checked = db.verify_port(path)
    assert checked.passed and checked.tensors == len(report.certificate["tensors"]), str(checked)
    q = report.certificate["tensors"]["blk.0.attn_q.weight"]
    assert (q["recompute"]["permute"] is not None) == (kind == "llama") == q["permuted"]
    assert any("permute rows" in op for op in q["encoding"]) == (kind == "llama")
    cli = [sys.executable, "-m", "dense_bridge.cli", "verify", path]
    assert subprocess.run(cli, capture_output=True, text=True, timeout=600).returncode == 0
    # a byte changed in a permuted matrix: the file's hash and that tensor's recomputed bytes both disagree
    _flip_a_byte_of(path, "blk.0.attn_q.weight")
    checked = db.verify_port(path)
    assert not checked.passed
    assert any("'blk.0.attn_q.weight'" in p and "recomputed" in p for p in checked.problems), checked.problems
    assert any("sha256" in p for p in checked.problems) and len(checked.problems) == 2, checked.problems
    res = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and "blk.0.attn_q.weight" in res.stdout + res.stderr


def test_verify_port_rechecks_a_gguf_source(models, tmp_path):
    src = make_model(models, "llama", tied=False)
    path = str(tmp_path / "m.gguf")
    db.port(src, path, to="gguf", outtype="q8_0", verify="twins")
    out = str(tmp_path / "hf")
    report = db.port(path, out, to="transformers", verify="twins")
    q = report.certificate["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["codes"] == "dequantized" and q["ops"][0].startswith("dequantize blk.0.attn_q.weight")
    assert db.verify_port(out).passed
    _flip_a_byte_of(path, "blk.1.ffn_up.weight")
    checked = db.verify_port(out)
    assert not checked.passed and any("model.layers.1.mlp.up_proj.weight" in p for p in checked.problems), \
        checked.problems


# ------------------------------------------------------------------------------ llama.cpp's own quantizer
def make_wide_llama(root) -> str:
    """A tiny random Llama whose rows fill K-quant super-blocks (256 values), so llama.cpp's
    quantizer writes K-quant blocks rather than its fallbacks."""
    from dense_bridge.backends.torch._ports import _randomize

    path = os.path.join(str(root), "llama-wide")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(model, 0)
    model.save_pretrained(path)
    _tokenizer(path)
    return path


#: (outtype, GGUF types llama.cpp must have written, bound on max |llama.cpp - transformers running the
#: file's own dequantized weights| / std(logits), bound on max |llama.cpp - transformers running the float
#: source| / std(logits)). Measured here (llama-cpp-python 0.3.36, this 2-layer random Llama, 48 positions):
#: q6_k 0.136 / 0.519, q4_k_m 0.148 / 1.32, q5_0 0.093 / 0.798 (q8_0 0.083 / 0.124; q5_k_m 0.128 / 0.607;
#: q3_k_m 0.12 / 2.55; q2_k 0.131 / 3.67). The first is llama.cpp quantizing the activations to Q8 blocks
#: in each product (bounded at about twice it); the second adds the weights' own quantization error, which
#: random weights make large (bounded at about 1.5 times it). Each tensor's own error is in the certificate.
KQUANT_CASES = [("q4_k_m", {"Q4_K", "Q6_K"}, 0.3, 2.0), ("q6_k", {"Q6_K"}, 0.3, 0.8), ("q5_0", {"Q5_0"}, 0.3, 1.2)]


@pytest.mark.parametrize("outtype,types,bound,bound_source", KQUANT_CASES, ids=[c[0] for c in KQUANT_CASES])
def test_llama_cpp_quantizes_k_quant_outtypes_and_runs_them(models, tmp_path, outtype, types, bound, bound_source):
    lc = pytest.importorskip("llama_cpp")
    from dense_bridge.backends.gguf._ports import port_load

    src = make_wide_llama(models)
    path = str(tmp_path / "m.gguf")
    report = db.port(src, path, to="gguf", outtype=outtype, verify="twins")
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "m.gguf.port_certificate.json"]  # the F32 file removed
    cert = report.certificate["tensors"]
    written = {e["ggml_type"] for e in cert.values()}
    assert types <= written, written
    for name, e in cert.items():
        if e["ggml_type"] == "F32":
            assert e["exact"] and name.endswith("norm.weight"), name
            continue
        assert e["codes"] == "quantized" and e["recompute"]["by"] == "llama.cpp", name
        assert "llama_model_quantize" in e["quantized_by"] and 0 < e["max_abs_error"] < 0.5, (name, e)
    checked = db.verify_port(path)  # each tensor's blocks recomputed by ggml's own quantizer
    assert checked.passed, str(checked)
    ids = np.random.default_rng(0).integers(3, VOCAB, 48).tolist()
    llm = lc.Llama(model_path=path, n_ctx=64, logits_all=True, flash_attn=False, type_k=0, type_v=0, verbose=False,
                   n_threads=2, n_batch=64)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)], np.float32)
    with torch.no_grad():
        own = port_load("gguf", path)(torch.tensor([ids])).logits[0].float().numpy()
        source = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(torch.tensor([ids])).logits[0].numpy()
    err = float(np.max(np.abs(theirs - own)) / np.std(own))
    err_source = float(np.max(np.abs(theirs - source)) / np.std(source))
    print(f"{outtype}: max |llama.cpp - transformers(file)| / std = {err:.3g}; vs the float source {err_source:.3g}")
    assert err <= bound and err_source <= bound_source, (err, err_source)


def test_llama_cpp_outtypes_are_refused_naming_llama_cpp_python_where_it_is_absent(models, tmp_path):
    src = make_model(models, "llama", tied=False)
    code = ("import sys; sys.modules['llama_cpp'] = None\n"  # llama-cpp-python not importable in this process
            "import dense_bridge as db\n"
            "from dense_bridge._errors import DenseBridgeError\n"
            f"try:\n    db.port({src!r}, {str(tmp_path / 'm.gguf')!r}, to='gguf', outtype='q4_k_m', verify='twins')\n"
            "except DenseBridgeError as exc:\n    print('REFUSED', type(exc).__name__, exc)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "REFUSED" in res.stdout and "llama-cpp-python" in res.stdout, res.stdout + res.stderr[-2000:]
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------ tokenizers both ways
def _vocab_file(name: str) -> str | None:
    """One of the vocabulary-only GGUF files llama.cpp ships for its tokenizer tests (``models/``)."""
    root = llama_cpp_dir()
    path = os.path.join(root, "models", f"ggml-vocab-{name}.gguf") if root else None
    return path if path and os.path.isfile(path) else None


def _vocab_texts(name: str) -> list[str]:
    """llama.cpp's tokenizer test texts for that vocabulary (``.inp``), plus chat-like text."""
    with open(_vocab_file(name) + ".inp", encoding="utf-8") as f:
        texts = [t.strip("\n") for t in f.read().split("\n__ggml_vocab_test__\n")]
    return [t for t in texts if t] + ["<|im_start|>user\nHi 123 🦙<|im_end|>\n"]


@pytest.fixture(scope="module")
def qwen2_bpe(models):
    """A tiny random Qwen2 whose tokenizer is Qwen2's real byte-level BPE (151,936 tokens): read by
    transformers' GGUF tokenizer converter from llama.cpp's ``ggml-vocab-qwen2.gguf``, saved by
    ``save_pretrained`` (tokenizer.json, merges inside)."""
    path = os.path.join(str(models), "qwen2-bpe")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from dense_bridge.backends.torch._ports import _randomize

        vocab = _vocab_file("qwen2")
        tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(vocab), gguf_file=os.path.basename(vocab))
        cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                       max_position_embeddings=256)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        _randomize(model, 0)
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return path


needs_vocab = pytest.mark.skipif(llama_cpp_dir() is None or _vocab_file("qwen2") is None,
                                 reason="llama.cpp's source tree (its converter and models/ggml-vocab-*.gguf) not found")


@needs_vocab
def test_a_bpe_tokenizer_is_written_as_llama_cpps_converter_writes_it(qwen2_bpe, tmp_path):
    ours = str(tmp_path / "ours.gguf")
    db.port(qwen2_bpe, ours, to="gguf", verify="twins")
    theirs = convert(qwen2_bpe, str(tmp_path / "theirs.gguf"), "f32")
    from dense_bridge.backends.gguf._file import open_gguf

    with open_gguf(ours) as a, open_gguf(theirs) as b, open_gguf(_vocab_file("qwen2")) as original:
        keys = sorted(k for k in set(a.metadata) | set(b.metadata) if k.startswith("tokenizer."))
        assert {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.merges"} <= set(keys)
        for k in keys:
            assert k in a.metadata and k in b.metadata, k
            assert a.metadata[k] == b.metadata[k] and a.metadata_types[k] == b.metadata_types[k], k
        assert a.metadata["tokenizer.ggml.model"] == "gpt2" and a.metadata["tokenizer.ggml.pre"] == "qwen2"
        for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            assert a.metadata[k] == original.metadata[k], k  # and llama.cpp's own file of Qwen2's vocabulary


def _encodes_alike(a: str, b: str, texts) -> None:
    ta, tb = transformers.AutoTokenizer.from_pretrained(a), transformers.AutoTokenizer.from_pretrained(b)
    assert len(ta) == len(tb)
    for t in texts:
        assert ta.encode(t) == tb.encode(t), t
        assert ta.decode(ta.encode(t)) == tb.decode(tb.encode(t)), t


@needs_vocab
@pytest.mark.parametrize("writer", ["converter", "dense_bridge"])
def test_a_gguf_sources_tokenizer_reaches_transformers_and_mlx_lm(models, qwen2_bpe, tmp_path, writer):
    texts = _vocab_texts("qwen2")
    for src, kind in ((qwen2_bpe, "bpe"), (make_model(models, "llama", tied=False), "spm")):
        path = str(tmp_path / f"{kind}.gguf")
        if writer == "converter":
            convert(src, path, "f32")
        else:
            db.port(src, path, to="gguf", verify="twins")
        for to in ("transformers", "mlx-lm") if writer == "dense_bridge" else ("transformers",):
            if to == "mlx-lm":
                pytest.importorskip("mlx_lm")
            out = str(tmp_path / f"{kind}-{to}")
            report = db.port(path, out, to=to, verify="twins")
            assert "tokenizer.json" in report.certificate["destination"]["files"]
            _encodes_alike(src, out, texts if kind == "bpe" else SENTENCES + texts)
            assert db.verify_port(out).passed
    if writer == "dense_bridge":  # the ported directory loads in mlx-lm with its tokenizer
        from mlx_lm import load

        _, tok = load(str(tmp_path / "spm-mlx-lm"))
        assert tok.encode(SENTENCES[0]) == transformers.AutoTokenizer.from_pretrained(src).encode(SENTENCES[0])


@needs_converter
def test_tokens_added_beside_a_sentencepiece_model_are_written_as_the_converter_writes_them(tmp_path):
    """Chat markers and user tokens added beside ``tokenizer.model`` (``added_tokens.json``,
    ``added_tokens_decoder``) keep their ids and kinds; the embedding's rows past them are padding."""
    from dense_bridge.backends.gguf._file import open_gguf
    from dense_bridge.backends.torch._ports import _randomize

    src = str(tmp_path / "llama-added")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB + 8, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(model, 0)
    model.save_pretrained(src)
    _tokenizer(src)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc["added_tokens_decoder"] = {
        str(VOCAB): {"content": "<|im_start|>", "special": True},
        str(VOCAB + 1): {"content": "<|im_end|>", "special": False},  # looks special: a control token all the same
        str(VOCAB + 2): {"content": "\u2581hello", "special": False},  # user-defined: written with a plain space
    }
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    with open(os.path.join(src, "added_tokens.json"), "w") as f:
        json.dump({"<tool>": VOCAB + 3}, f)
    ours = str(tmp_path / "ours.gguf")
    db.port(src, ours, to="gguf", verify="twins")
    theirs = convert(src, str(tmp_path / "theirs.gguf"), "f32")
    with open_gguf(ours) as a, open_gguf(theirs) as b:
        for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            assert a.metadata[k] == b.metadata[k], (k, a.metadata[k][VOCAB - 1:], b.metadata[k][VOCAB - 1:])
        tokens, types = a.metadata["tokenizer.ggml.tokens"], a.metadata["tokenizer.ggml.token_type"]
        assert tokens[VOCAB:VOCAB + 5] == ["<|im_start|>", "<|im_end|>", " hello", "<tool>", f"[PAD{VOCAB + 4}]"]
        assert types[VOCAB:VOCAB + 5] == [3, 3, 4, 4, 5]  # control, control, user-defined, user-defined, unused
