"""How much work one call of a public verb does inside dense_bridge, counted (not timed).

Four flows, one function each (:func:`convert`, :func:`transfer_explicit`, :func:`transfer_auto`,
:func:`compare_models`), on two pairs of models: two 2-layer numpy MLPs (db.compile of one spec)
and two tiny random transformers Llamas (2 decoder layers, same config). During one call of each,
``sys.setprofile`` sees every Python call, and the script counts:

- ``calls``: calls into library code (dense_bridge/ and its backends/);
- ``functions`` / ``modules``: distinct library functions and modules called;
- ``backend_of`` / ``get_adapter``: backend resolutions (``dense_bridge.registry._backends``);
- ``walks``: calls of ``dense_bridge.models.walk`` (the adapter's walk verb, counted where it runs);
- ``get_params``: calls of the owning adapter's ``get_params`` verb in all, and ``reads/layer``:
  the most times one linear layer of either model was read.

Each of ``backend_of``, ``get_adapter``, ``get_params`` and ``reads/layer`` reads "all (outside
testing)": in brackets, the calls not made from inside ``dense_bridge/testing`` (for
``transfer auto``: the transfer without its verification by ``compare_models``).

The calls are counted by code object, so references taken with ``from x import f`` are counted
too (wrapping module attributes would miss them).

Run:  python benchmarks/bench_flows.py [--root DIR]
``--root``: a checkout of dense_bridge to measure instead of the installed one (e.g. a
``git worktree add /tmp/before 659e986``), imported from DIR/dense_bridge and DIR/backends.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402


def _use_root(root: str) -> None:
    """Import dense_bridge (and dense_bridge.backends) from ``root`` instead of the installed tree."""
    import importlib.abc
    import importlib.machinery
    import importlib.util

    places = {"dense_bridge": os.path.join(root, "dense_bridge"),
              "dense_bridge.backends": os.path.join(root, "backends")}

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname in places:
                init = os.path.join(places[fullname], "__init__.py")
                return importlib.util.spec_from_file_location(fullname, init,
                                                              submodule_search_locations=[places[fullname]])
            return None

    sys.meta_path.insert(0, Finder())


class Counts:
    """One flow's counts, gathered by a profile hook while it runs."""

    def __init__(self, roots: tuple[str, ...], watched: dict) -> None:
        self.roots, self.watched = roots, watched
        self.calls = 0
        self.functions: set = set()
        self.modules: set = set()
        self.named: Counter = Counter()
        self.reads: Counter = Counter()  # id(layer) -> get_params calls on it
        self.reads_outside: Counter = Counter()  # the same, not under dense_bridge/testing
        self.testing = tuple(os.path.join(r, "testing") + os.sep for r in roots if r.endswith("dense_bridge" + os.sep))
        self.models = tuple(os.path.join(r, "models") + os.sep for r in roots if r.endswith("dense_bridge" + os.sep)) \
            + tuple(os.path.join(r, n) for r in roots if r.endswith("dense_bridge" + os.sep)
                    for n in ("models.py", "_mapping.py", "_auto_mapping.py", "_auto_transfer.py"))  # the old layout
        self.models_to_testing = 0  # calls into testing made by models code itself

    def hook(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.roots):
            return
        self.calls += 1
        if code.co_filename.startswith(self.testing) and frame.f_back is not None \
                and frame.f_back.f_code.co_filename.startswith(self.models):
            self.models_to_testing += 1
        self.functions.add(code)
        self.modules.add(code.co_filename)
        name = self.watched.get(code)
        if name is not None:
            outside = not self._under_testing(frame)
            self.named[name] += 1
            self.named[name + " outside"] += outside
            if name == "get_params":
                first = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
                self.reads[id(first)] += 1
                self.reads_outside[id(first)] += outside

    def _under_testing(self, frame) -> bool:
        """Is this call made (at any depth) by dense_bridge/testing (compare_models, the verification)?"""
        f = frame.f_back
        while f is not None:
            if f.f_code.co_filename.startswith(self.testing):
                return True
            f = f.f_back
        return False


def _watched() -> dict:
    """Code objects to count by name: backend resolution, the walk, every adapter's get_params."""
    import importlib

    from dense_bridge import models
    from dense_bridge.registry import _backends

    out = {_backends.backend_of.__code__: "backend_of", _backends.get_adapter.__code__: "get_adapter"}
    walk = getattr(models, "walk")
    out[getattr(walk, "__wrapped__", walk).__code__] = "walk"
    for name in ("numpy", "torch"):
        adapter = importlib.import_module(f"dense_bridge.backends.{name}")
        out[adapter.get_params.__code__] = "get_params"
    return out


def measure(fn, layers: list) -> dict:
    """Run ``fn()`` once under the profile hook; the counts as a row dict."""
    import dense_bridge

    root = os.path.dirname(os.path.dirname(os.path.abspath(dense_bridge.__file__)))
    roots = (os.path.join(root, "dense_bridge") + os.sep, os.path.join(root, "backends") + os.sep,
             os.path.dirname(os.path.abspath(dense_bridge.__file__)) + os.sep)
    counts = Counts(roots, _watched())
    sys.setprofile(counts.hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    per_layer = max((counts.reads[id(x)] for x in layers), default=0)
    outside = max((counts.reads_outside[id(x)] for x in layers), default=0)
    named = counts.named
    return {"calls": counts.calls, "functions": len(counts.functions), "modules": len(counts.modules),
            "backend_of": f"{named['backend_of']} ({named['backend_of outside']})",
            "get_adapter": f"{named['get_adapter']} ({named['get_adapter outside']})",
            "walks": named["walk"], "get_params": f"{named['get_params']} ({named['get_params outside']})",
            "reads/layer": f"{per_layer} ({outside})", "models->testing": counts.models_to_testing}


# ----------------------------------------------------------------------------- models
def numpy_pair():
    import dense_bridge as db
    from dense_bridge.specs import Dense, Sequential

    spec = Sequential([Dense(8, activation="relu"), Dense(3)], in_features=6)
    a, b = db.compile(spec, "numpy", seed=0), db.compile(spec, "numpy", seed=1)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    return a, b, [x]


def llama_pair():
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    a = transformers.LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    b = transformers.LlamaForCausalLM(cfg).eval()
    ids = np.random.default_rng(0).integers(0, 64, (1, 8))
    return a, b, [ids]


def _linear(model) -> list:
    import dense_bridge as db

    return list(db.linear_layers(model).values())


# ----------------------------------------------------------------------------- flows
def convert(pair):
    """``db.convert(a, to=<a's own framework>)`` (chains only: a Llama is no chain)."""
    import dense_bridge as db

    a, _, _ = pair()
    if type(a).__module__.startswith("transformers"):
        return None
    return measure(lambda: db.convert(a, to="numpy"), _linear(a))


def transfer_explicit(pair):
    """``db.transfer(a, b, mapping=[(r"(.*)", r"\\1")])``: every layer and parameter by its own path."""
    import dense_bridge as db

    a, b, _ = pair()
    return measure(lambda: db.transfer(a, b, mapping=[(r"(.*)", r"\1")]), _linear(a) + _linear(b))


def transfer_auto(pair):
    """``db.transfer(a, b, mapping="auto", inputs=x)``, verified (the default)."""
    import dense_bridge as db

    a, b, x = pair()
    return measure(lambda: db.transfer(a, b, mapping="auto", inputs=x), _linear(a) + _linear(b))


def compare_models(pair):
    """``db.testing.compare_models(a, b, x)`` (gradients included)."""
    import dense_bridge as db

    a, b, x = pair()
    return measure(lambda: db.testing.compare_models(a, b, x), _linear(a) + _linear(b))


def mlx_lm_dir():
    """A 1-block random Llama saved by transformers and converted by ``mlx_lm.convert(quantize=True)``
    (4 bits, group 32) into a temporary directory; its path (None without MLX)."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("mlx_lm") is None:
        return None
    import tokenizers
    import torch
    import transformers
    from mlx_lm import convert as mlx_convert

    root = tempfile.mkdtemp(prefix="bench_flows_")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(os.path.join(root, "hf"))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(os.path.join(root, "hf"))
    mlx_convert(hf_path=os.path.join(root, "hf"), mlx_path=os.path.join(root, "mlx"), quantize=True,
                q_group_size=32, q_bits=4)
    return os.path.join(root, "mlx")


def load_dir(path):
    """``db.load(directory)`` of a quantized mlx-lm directory: (spec, params) with the codes."""
    import dense_bridge as db

    return measure(lambda: db.load(path), [])


FLOWS = {"convert": convert, "transfer explicit": transfer_explicit, "transfer auto": transfer_auto,
         "compare_models": compare_models}
PAIRS = {"numpy MLP (2 layers)": numpy_pair, "transformers Llama (2 decoder layers)": llama_pair}
COLUMNS = ["calls", "functions", "modules", "backend_of", "get_adapter", "walks", "get_params", "reads/layer",
           "models->testing"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", help="a dense_bridge checkout to measure instead of the installed one")
    args = parser.parse_args()
    if args.root:
        _use_root(os.path.abspath(args.root))
    import dense_bridge

    from _timing import table

    print(f"dense_bridge from {os.path.dirname(dense_bridge.__file__)}\n")
    for title, pair in PAIRS.items():
        for name, flow in FLOWS.items():  # warm: imports and first-call caches stay out of the counts
            flow(pair)
        rows = []
        for name, flow in FLOWS.items():
            row = flow(pair)
            rows.append([name] + (["n/a"] * len(COLUMNS) if row is None else [row[c] for c in COLUMNS]))
        print(f"### {title}\n")
        print(table(rows, ["flow"] + COLUMNS))
        print()
    path = mlx_lm_dir()
    if path is not None:
        load_dir(path)  # warm
        row = load_dir(path)
        print("### a 4-bit mlx-lm directory (mlx_lm.convert of a 1-block Llama)\n")
        print(table([["load"] + [row[c] for c in COLUMNS]], ["flow"] + COLUMNS))
        print()


if __name__ == "__main__":
    main()
