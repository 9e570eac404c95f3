"""A fixed sample of the coverage table (benchmarks/coverage.py), so that a regression shows in CI:
one dense and one mixture-of-experts architecture ported transformers -> mlx-lm, every weight
bit-identical to mlx-lm's own loader on the same source, and back, bit-identical to the source;
a state-space architecture ported both ways and another refused with its reason; the dense one
into keras-hub (equal to keras-hub's own import of the same directory) and back; the dense one with a PEFT adapter kept
for mlx-lm; and an mlx-lm quantized model ported as its exact dequantization. And no
architecture named in the package."""
from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import re
import tokenize

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

import dense_bridge as db  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _harness():
    spec = importlib.util.spec_from_file_location("coverage_harness", os.path.join(ROOT, "benchmarks", "coverage.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny(model_type: str, path: str) -> None:
    """The harness's tiny random model of ``model_type``, saved by ``save_pretrained``."""
    import torch
    import transformers

    from dense_bridge.backends.torch import _ports as tp

    cfg, _ = _harness()._tiny_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(tp._config(cfg), dtype=torch.float32).eval()
    tp._randomize(model, seed=7)
    model.save_pretrained(path)


def _port_both_ways(tmp_path, model_type: str) -> None:
    from pathlib import Path

    import mlx_lm.utils as mu

    h = _harness()
    t, p, back = tmp_path / "T", tmp_path / "P", tmp_path / "back"
    _tiny(model_type, str(t))
    db.port(t, p, to="mlx-lm", verify="twins", progress=False)
    with open(p / "config.json") as f:
        written = json.load(f)
    ref, _ = mu.load_model(Path(t), model_config=written)  # mlx-lm's own conversion of the same files
    got, _ = mu.load_model(Path(p))
    diff = h._first_difference(h._params_mlx(got), h._params_mlx(ref), "vs mlx-lm's own load")
    assert diff is None, diff
    db.port(p, back, to="transformers", verify="twins", progress=False)
    diff = h._first_difference(h._files(str(back)), h._files(str(t)), "round trip")
    assert diff is None, diff


def test_a_dense_architecture_ports_both_ways_bit_identical(tmp_path):
    _port_both_ways(tmp_path, "llama")


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v2", "lfm2_moe"])
def test_a_mixture_of_experts_ports_both_ways_bit_identical(tmp_path, model_type):
    """Mixtral: transformers stores the experts as one fused (experts, 2*ffn, hidden) gate_up stack
    and saves one file tensor per expert; mlx-lm holds and saves three stacks (a move along a new
    axis). DeepSeek-V2: transformers runs the router as a linear layer beside the shared expert,
    mlx-lm keeps it as a bare matrix its gate multiplies by (the run's one extra layer paired with
    the other side's matrix). LFM2-MoE: expert stacks beside depthwise convolutions stored
    (channels, 1, width) on one side and (channels, width, 1) on the other (raw parameters, never
    taken for an expert bank)."""
    _port_both_ways(tmp_path, model_type)


def test_a_state_space_architecture_ports_both_ways_bit_identical(tmp_path):
    """Mamba: the depthwise conv1d with its last two axes exchanged, A_log and D by name; mlx-lm
    runs x_proj once per position where transformers runs it once on all of them (the calls joined
    for the comparison) and transformers never calls dt_proj as a module (its calls in mlx-lm left
    uncompared, judged where their values arrive)."""
    _port_both_ways(tmp_path, "mamba")


def test_a_state_space_architecture_is_refused_with_its_reason(tmp_path):
    # expected refusal: every weight pairs, but transformers' Mamba2 normalises the gated output per
    # group of channels (n_groups) where mlx-lm's normalises all of them at once
    t = tmp_path / "T"
    _tiny("mamba2", str(t))
    with pytest.raises(db.ConversionError, match="compute different functions") as got:
        db.port(t, tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    assert "mixer.in_proj" in str(got.value) and "mixer.out_proj" in str(got.value)
    assert not (tmp_path / "P").exists()


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_a_keras_hub_architecture_ports_both_ways_bit_identical(tmp_path, model_type):
    """A dense architecture, and a mixture-of-experts one whose router transformers keeps as a
    matrix it applies itself ('weight' (experts, hidden)) and keras-hub as a Dense ('kernel'
    (hidden, experts)): paired by the widths its calls show."""
    from _port_helpers import keras_hub_or_skip

    keras_hub = keras_hub_or_skip()
    import keras

    h = _harness()
    t, k, back = tmp_path / "T", tmp_path / "K", tmp_path / "back"
    _tiny(model_type, str(t))
    db.port(t, k, to="keras-hub", verify="twins", progress=False)

    def weights(backbone):  # the counters Keras appends to the layers it names itself dropped
        return {re.sub(r"_\d+(?=/|$)", "", v.path.split("/", 1)[-1]): np.asarray(keras.ops.convert_to_numpy(v))
                for v in backbone.weights}
    got = weights(keras_hub.models.Backbone.from_preset(str(k)))  # keras-hub's own loader on the port
    ref = weights(keras_hub.models.Backbone.from_preset(str(t)))  # keras-hub's own import of the same source
    diff = h._first_difference(got, ref, "vs keras-hub's own import")
    assert diff is None, diff
    db.port(k, back, to="transformers", verify="twins", progress=False)
    diff = h._first_difference(h._files(str(back)), h._files(str(t)), "round trip")
    assert diff is None, diff
    # from mlx-lm's own load of the same files (its expert stacks: gate and up alike in shape,
    # paired with keras-hub's by their names), into the same keras-hub weights
    from pathlib import Path

    import mlx_lm.utils as mu

    m, k2 = tmp_path / "M", tmp_path / "K2"
    model, config = mu.load_model(Path(t))
    mu.save_model(str(m), model)
    (m / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    db.port(m, k2, to="keras-hub", verify="twins", progress=False)
    diff = h._first_difference(weights(keras_hub.models.Backbone.from_preset(str(k2))), ref, "mlx-lm -> keras-hub")
    assert diff is None, diff


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's, not ours
def test_a_peft_adapter_is_kept_for_mlx_lm_on_bit_identical_base_weights(tmp_path):
    """The dense row with a PEFT adapter: the base weights as mlx-lm's own loader makes them, the
    adapter in mlx-lm's own adapter files, loaded by mlx-lm's ``load_adapters``: PEFT's logits."""
    from pathlib import Path

    peft = pytest.importorskip("peft")
    import mlx.core as mx
    import torch
    import transformers
    import mlx_lm.utils as mu
    from mlx_lm.tuner.utils import load_adapters

    h = _harness()
    t, a, p = tmp_path / "T", tmp_path / "A", tmp_path / "P"
    _tiny("llama", str(t))
    wrapped = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(t),
                                  peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                  lora_dropout=0.0, init_lora_weights=False)).eval()
    wrapped.save_pretrained(a)
    db.port(t, p, to="mlx-lm", adapter=a, adapter_mode="keep", verify="twins", progress=False)
    ref, _ = mu.load_model(Path(t))
    got, _ = mu.load_model(Path(p))
    diff = h._first_difference(h._params_mlx(got), h._params_mlx(ref), "base vs mlx-lm's own load")
    assert diff is None, diff
    got = load_adapters(got, str(p / "adapter"))
    got.eval()
    ids = np.random.default_rng(0).integers(0, 64, (1, 12))
    with torch.no_grad():
        want = wrapped(torch.as_tensor(ids)).logits.numpy()
    have = np.asarray(got(mx.array(ids.astype(np.int32))).astype(mx.float32))
    err = float(np.max(np.abs(have - want)))
    assert err <= 1e-4 * float(np.max(np.abs(want))), err


def test_a_quantized_mlx_lm_model_ports_as_its_exact_dequantization(tmp_path):
    """The dense row quantized by mlx-lm's own quantizer (8 bits, groups of 64 along in_features;
    layers whose width 64 does not divide stay float, as mlx-lm leaves them): into transformers,
    every tensor is bit for bit ``mlx_lm.utils.dequantize_model``'s."""
    from pathlib import Path

    import mlx_lm.utils as mu

    h = _harness()
    t, q, hf = tmp_path / "T", tmp_path / "Q", tmp_path / "HF"
    _tiny("llama", str(t))
    model, config = mu.load_model(Path(t))
    model, config = mu.quantize_model(model, config, group_size=64, bits=8)
    mu.save_model(q, model)
    mu.save_config(config, q / "config.json")
    report = db.port(q, hf, to="transformers", verify="twins", progress=False)
    assert report.verification["passed"]
    dequantized = {k for k, e in report.certificate["tensors"].items() if e["codes"] == "dequantized"}
    assert "model.layers.0.self_attn.q_proj.weight" in dequantized
    want, _ = mu.load_model(Path(q))
    diff = h._first_difference(h._files(str(hf)), h._params_mlx(mu.dequantize_model(want)), "vs dequantize_model")
    assert diff is None, diff


#: Library names that contain an architecture's name: llama.cpp, its Python package and its C API's
#: symbols (``llama_model_quantize``, ``llama_backend_init``, ``LLAMA_FTYPE_MOSTLY_Q4_K_M``).
_LIBRARY_NAMES = re.compile(r"(?i)llama[._-]cpp|\bllama_(?:model|backend)_\w+|\bllama_ftype_\w+")

#: Words that are a file format's own vocabulary where they appear, not architectures: GGUF's
#: ``tokenizer.ggml.model`` values name its two vocabulary kinds (SentencePiece "llama", BPE "gpt2").
_FORMAT_WORDS = {os.path.join("backends", "gguf", "_tokenizer.py"): {"llama", "gpt2"}}


def _code_words(path: str) -> set[str]:
    """Every word of a Python file outside its docstrings: identifiers, string literals, comments."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.add((first.lineno, first.col_offset))
    words: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING and tok.start in docstrings:
            continue
        if tok.type in (tokenize.NAME, tokenize.STRING, tokenize.COMMENT):
            string = _LIBRARY_NAMES.sub(" ", tok.string)  # llama.cpp is a library, not an architecture
            words.update(w.lower() for w in re.findall(r"[A-Za-z0-9_]+", string))
            words.update(w.lower() for w in re.findall(r"[A-Za-z0-9]+", string))
    return words


def test_no_architecture_is_named_in_the_package_outside_docstrings():
    import transformers

    import mlx_lm.utils as mu

    names = {mt for mt, _ in _harness().model_types()}
    names |= {k for k in getattr(mu, "MODEL_REMAPPING", {}) if k in transformers.CONFIG_MAPPING}
    assert len(names) > 80, sorted(names)  # the table's model types, from transformers' CONFIG_MAPPING
    found = {}
    for top in ("dense_bridge", "backends"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    hits = names & (_code_words(path) - _FORMAT_WORDS.get(os.path.relpath(path, ROOT), set()))
                    if hits:
                        found[os.path.relpath(path, ROOT)] = sorted(hits)
    assert not found, f"architecture names in code (not docstrings): {found}"
