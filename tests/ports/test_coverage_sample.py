"""A fixed sample of the coverage table (benchmarks/coverage.py), so that a regression shows in CI:
one dense and one mixture-of-experts architecture ported transformers -> mlx-lm, every weight
bit-identical to mlx-lm's own loader on the same source, and back, bit-identical to the source;
a state-space architecture refused with its reason. And no architecture named in the package."""
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


def test_a_mixture_of_experts_ports_both_ways_bit_identical(tmp_path):
    # transformers stores Mixtral's experts as one fused (experts, 2*ffn, hidden) gate_up stack and
    # saves one file tensor per expert; mlx-lm holds and saves three stacks: a move along a new axis
    _port_both_ways(tmp_path, "mixtral")


def test_a_state_space_architecture_is_refused_with_its_reason(tmp_path):
    # expected refusal: every parameter pairs (the depthwise conv1d with its last two axes
    # exchanged, A_log and D by name, dt_proj never called as a module by transformers' reference
    # path), but mlx-lm's Mamba runs x_proj once per position where transformers runs it once on
    # all of them, so the twins' layer-by-layer verification cannot line their calls up
    t = tmp_path / "T"
    _tiny("mamba", str(t))
    with pytest.raises(db.ConversionError, match="the twins disagree"):
        db.port(t, tmp_path / "P", to="mlx-lm", verify="twins", progress=False)
    assert not (tmp_path / "P").exists()


#: Library names that contain an architecture's name.
_LIBRARY_NAMES = re.compile(r"(?i)llama[._-]cpp")

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
