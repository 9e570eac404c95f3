"""The architecture of file I/O, checked: every checkpoint file goes through dense_bridge.checkpoints.

- ONE safetensors reader/writer: only ``dense_bridge/checkpoints/_safetensors.py`` reads or writes
  a safetensors header's length field (``struct`` with a ``Q``, the little-endian u64) or spells
  the header's ``__metadata__`` key, and nothing imports the ``safetensors`` package (the tests
  use it as the reference our files must load in).
- ONE atomic writer: only ``dense_bridge/checkpoints/_io.py`` renames a file into place
  (``os.replace``/``os.rename``); everything else writes through its ``AtomicFiles`` (a whole
  directory moved into place is allow-listed below).
- No module outside ``dense_bridge/checkpoints/`` and ``backends/<fw>/_files.py`` opens a file
  (``open``, ``np.load``, ``h5py.File``, ``torch.load``, ``mx.load``, ``mmap``...), but where
  the allow-lists below say why.
- Orbax is neither imported nor a dependency: no format reaches it.

Like tests/architecture/test_architecture.py, everything here reads source files with ``ast``.
"""
from __future__ import annotations

import ast
import re

import pytest

import dense_bridge

from _source_scan import ADAPTERS, CORE, ROOT  # noqa: F401
from _source_scan import dotted as _dotted
from _source_scan import rel as _rel
from _source_scan import sources as _sources

SAFETENSORS_MODULE = "dense_bridge/checkpoints/_safetensors.py"
ATOMIC_WRITER = "dense_bridge/checkpoints/_io.py"

#: Calls that rename a file into place: the commit step only AtomicFiles may take.
RENAMES = {"os.replace", "os.rename"}
#: Calls that open a file's contents (a checkpoint, when they are given one).
OPENERS = {"open", "io.open", "os.open", "os.fdopen", "np.load", "numpy.load", "h5py.File", "safe_open",
           "torch.load", "mx.load", "mmap.mmap", "pickle.load"}

#: Renames outside the atomic writer: {(file, call): why}.
RENAME_ALLOWLIST: dict[tuple[str, str], str] = {
    ("dense_bridge/lora/_files.py", "os.replace"):
        "convert_adapter moves a finished adapter DIRECTORY into place; AtomicFiles commits files (each "
        "file in it was written through AtomicFiles)",
}

#: Files opened outside the checkpoints package and the adapters' _files.py: {(file, call): why}.
OPEN_ALLOWLIST: dict[tuple[str, str], str] = {
    ("dense_bridge/lora/_files.py", "open"): "LoRA adapter directories (adapter configs) read and written by "
                                             "db.load_adapter / db.save_adapter",
    ("dense_bridge/params/_memory_budget.py", "open"): "/proc/meminfo, the memory a load may take: no checkpoint",
    ("dense_bridge/cli/_main.py", "open"): "os.devnull, where a framework's import chatter goes",
    ("dense_bridge/parallel/_sharded_dir.py", "open"): "the sharded directory of a tensor-parallel save: rank "
                                                       "files written by the one safetensors writer into "
                                                       "AtomicFiles temporaries, and its index",
    ("backends/keras/_lora.py", "h5py.File"): "keras-hub's .lora.h5 adapter files, whose layout only Keras knows "
                                              "(db.load_adapter / db.save_adapter)",
    ("backends/keras/_manifest.py", "open"): "~/.keras/keras.json, the Keras engine's name: no checkpoint",
    ("backends/keras/_ports.py", "h5py.File"): "a keras-hub preset's model.weights.h5, written by db.port one "
                                               "dataset at a time into the port's temporary directory (renamed "
                                               "into place with it)",
    ("backends/torch/_capture.py", "torch.load"): "load_model: a whole pickled model for `check --mapping`, "
                                                  "only with trust_pickle=True",
    ("backends/gguf/_file.py", "mmap.mmap"): "GGUF tensors mapped from the descriptor open_readonly opened (the "
                                             "file layer of a format no framework reads here)",
    ("backends/gguf/_writer.py", "open"): "the GGUF file a port writes (into the port's atomic temporary)",
}
#: Modules that pack u64 fields of another binary format (not safetensors headers), with the reason.
HEADER_ALLOWLIST = {"backends/gguf/_file.py": "GGUF's header (u64 counts, lengths and dimensions)",
                    "backends/gguf/_writer.py": "GGUF's header (u64 counts, lengths and dimensions)"}


def _calls(tree: ast.AST):
    """(line, dotted name) of every call of a plain or dotted name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _dotted(node.func)) is not None:
            yield node.lineno, name, node


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def header_work(source: str) -> list[str]:
    """What in ``source`` reads or writes a safetensors header by hand: a ``struct`` call whose
    format holds ``Q`` (the header's u64 length), the ``__metadata__`` key outside docstrings,
    an import of the ``safetensors`` package."""
    tree = ast.parse(source)
    found = []
    for line, name, node in _calls(tree):
        if name.startswith("struct.") and node.args and isinstance(node.args[0], ast.Constant) \
                and "Q" in str(node.args[0].value):
            found.append(f"{line}: {name}({node.args[0].value!r})")
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == "__metadata__" and id(node) not in docs:
            found.append(f"{node.lineno}: '__metadata__'")
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "safetensors"]
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "safetensors":
            found.append(f"{node.lineno}: from {node.module} import ...")
    return found


def test_one_module_reads_and_writes_safetensors_headers():
    where = {_rel(p): header_work(p.read_text()) for p in _sources()}
    offenders = {f: w for f, w in where.items() if w and f != SAFETENSORS_MODULE and f not in HEADER_ALLOWLIST}
    assert not offenders, f"read and write safetensors through {SAFETENSORS_MODULE}: {offenders}"
    assert where[SAFETENSORS_MODULE], "the reader/writer itself must be seen by the check"


def test_the_header_check_sees_a_hand_written_header():
    hand = ('import json, struct\n'
            'def write(f, header):\n'
            '    header["__metadata__"] = {}\n'
            '    f.write(struct.pack("<Q", 8))\n'
            'def read(f):\n'
            '    from safetensors.numpy import load_file\n'
            '    (n,) = struct.unpack("<Q", f.read(8))\n')
    assert len(header_work(hand)) == 4
    assert header_work('import struct\nstruct.pack("<I", 1)\n"""__metadata__ in words"""\n') == []


def _uses(names: set[str]) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for path in _sources():
        for line, name, _ in _calls(ast.parse(path.read_text(), str(path))):
            if name in names:
                out.setdefault((_rel(path), name), []).append(line)
    return out


def test_one_atomic_writer():
    uses = {k: v for k, v in _uses(RENAMES).items() if k[0] != ATOMIC_WRITER}
    unexplained = {f"{f}:{lines} {name}" for (f, name), lines in uses.items() if (f, name) not in RENAME_ALLOWLIST}
    assert not unexplained, f"write through {ATOMIC_WRITER} (AtomicFiles / write_text): {sorted(unexplained)}"
    assert not set(RENAME_ALLOWLIST) - set(uses), f"stale: {set(RENAME_ALLOWLIST) - set(uses)}"
    assert (ATOMIC_WRITER, "os.replace") in _uses(RENAMES), "the atomic writer itself must be seen by the check"


def _reads_checkpoints(rel: str) -> bool:
    """The modules whose job is checkpoint files: the checkpoints package, each adapter's
    ``_files.py``, and torch's DCP reader (``_parallel.py``: ``.metadata`` and its data files)."""
    return (rel.startswith("dense_bridge/checkpoints/") or re.fullmatch(r"backends/[a-z_]+/_files\.py", rel) is not None
            or rel == "backends/torch/_parallel.py")


def test_no_module_outside_the_checkpoints_package_opens_files():
    uses = {k: v for k, v in _uses(OPENERS).items() if not _reads_checkpoints(k[0])}
    unexplained = {f"{f}:{lines} {name}" for (f, name), lines in uses.items() if (f, name) not in OPEN_ALLOWLIST}
    assert not unexplained, ("open checkpoint files in dense_bridge/checkpoints/ or backends/<fw>/_files.py "
                             f"(or allow-list the call with the reason): {sorted(unexplained)}")
    assert not set(OPEN_ALLOWLIST) - set(uses), f"stale: {set(OPEN_ALLOWLIST) - set(uses)}"


def test_the_open_check_sees_calls_inside_functions():
    tree = ast.parse("def f(p):\n    import numpy as np\n    with open(p) as g:\n        return np.load(g)\n")
    assert sorted(name for _, name, _ in _calls(tree) if name in OPENERS) == ["np.load", "open"]


def test_orbax_is_neither_imported_nor_a_dependency():
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] == "orbax"], f"{_rel(path)} imports orbax"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for deps in extras.values() for d in deps if d.lower().startswith(("orbax", "tensorstore"))]
