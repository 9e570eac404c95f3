"""Every file the library reads is opened through ONE guard: ``dense_bridge/checkpoints/_guard.py``.

The guard (``open_input``, ``input_path``, ``input_file``, and ``open_readonly`` beneath them)
refuses a FIFO, a device, a directory or a socket without blocking, a file outside the folder it
was read from, and a size past its limit or the memory available, with a CheckpointError naming
the file. So no other module may call a reading opener (``open`` for reading, ``os.open``,
``h5py.File``, ``onnx.load``, ``torch.load``, ``np.load``, ``safe_open``, ``mx.load``,
``zipfile.ZipFile``, ``eqx.tree_deserialise_leaves``, ``pickle.load``) on anything but what the
guard handed over: the name bound by ``with input_path(...)/input_file(...) as NAME`` or
``NAME = open_input(...)/open_readonly(...)`` in the same module, or a ``handle`` parameter (an
already-guarded file passed in). Opens for writing are not reads. What is left is allow-listed
below with the reason.
"""
from __future__ import annotations

import ast

from _source_scan import ADAPTERS, CORE, ROOT  # noqa: F401
from _source_scan import dotted as _dotted
from _source_scan import rel as _rel
from _source_scan import sources as _sources

GUARD = "dense_bridge/checkpoints/_guard.py"

#: Calls that open a file (or take a path and open it) to read it.
READERS = {"open", "io.open", "os.open", "np.load", "numpy.load", "h5py.File", "safe_open", "torch.load",
           "mx.load", "onnx.load", "onnx.load_model", "pickle.load", "zipfile.ZipFile", "zipfile.is_zipfile",
           "eqx.tree_deserialise_leaves"}
#: The guard's calls; a name bound from one of them is a guarded file.
GUARD_CALLS = {"open_input", "input_path", "input_file", "open_readonly"}
#: Parameter names that carry a file the caller already opened through the guard.
HANDLE_PARAMS = {"handle"}

#: Reading opens outside the guard: {(file, call): why}.
ALLOWLIST: dict[tuple[str, str], str] = {
    ("dense_bridge/params/_memory_budget.py", "open"): "/proc/meminfo, the memory available: a kernel file, "
                                                       "no input",
    ("dense_bridge/checkpoints/_pages.py", "open"): "/proc/self/maps, this process's own mappings: no input",
    ("backends/keras/_manifest.py", "open"): "~/.keras/keras.json, the Keras engine's name: no input",
    ("dense_bridge/checkpoints/_io.py", "os.open"): "files and folders this library has just written, opened "
                                                    "to fsync them (and the sweep's O_NOFOLLOW|O_NONBLOCK look "
                                                    "at its own shard names): nothing is read",
    ("backends/torch/_files.py", "zipfile.ZipFile"): "the temporary torch.save archive this writer has just made "
                                                     "(its record offsets and CRCs): its own output, no input",
}


def _guarded_names(tree: ast.AST) -> set[str]:
    """Names bound from the guard: ``with guard(...) as NAME`` and ``NAME = guard(...)``."""
    names = set(HANDLE_PARAMS)

    def from_guard(value) -> bool:
        return isinstance(value, ast.Call) and (_dotted(value.func) or "").rsplit(".", 1)[-1] in GUARD_CALLS

    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if from_guard(item.context_expr) and isinstance(item.optional_vars, ast.Name):
                    names.add(item.optional_vars.id)
        elif isinstance(node, ast.Assign) and from_guard(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _writes(name: str, call: ast.Call) -> bool:
    """The call opens for writing (a mode with w, a, x or +; O_WRONLY/O_RDWR/O_CREAT flags)."""
    if name in ("open", "io.open", "h5py.File"):
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        text = _literal(mode)
        return text is not None and any(c in text for c in "wax+")
    if name == "os.open" and len(call.args) > 1:
        flags = ast.unparse(call.args[1])
        return any(f in flags for f in ("O_WRONLY", "O_RDWR", "O_CREAT"))
    return False


def unguarded_reads(source: str) -> list[tuple[int, str]]:
    """(line, call) of every reading open in ``source`` whose file did not come from the guard."""
    tree = ast.parse(source)
    guarded = _guarded_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (name := _dotted(node.func)) not in READERS:
            continue
        if _writes(name, node):
            continue
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Name) and first.id in guarded:
            continue
        found.append((node.lineno, name))
    return sorted(found)


def test_every_read_goes_through_the_guard():
    seen: dict[tuple[str, str], list[int]] = {}
    for path in _sources():
        rel = _rel(path)
        if rel == GUARD:
            continue
        for line, name in unguarded_reads(path.read_text()):
            seen.setdefault((rel, name), []).append(line)
    unexplained = sorted(f"{f}:{lines} {name}" for (f, name), lines in seen.items() if (f, name) not in ALLOWLIST)
    assert not unexplained, (f"open files to read through {GUARD} (open_input / input_path / input_file), or "
                             f"allow-list the call with the reason: {unexplained}")
    assert not set(ALLOWLIST) - set(seen), f"stale allow-list entries: {set(ALLOWLIST) - set(seen)}"


def test_the_guard_itself_is_seen_opening():
    assert [name for _, name in unguarded_reads((ROOT / GUARD).read_text())] == ["os.open"]


def test_the_check_tells_guarded_reads_from_bare_ones():
    source = ("import h5py, torch, numpy as np\n"
              "def bad(p):\n"
              "    with h5py.File(p, 'r') as f:\n"              # bare: 3
              "        pass\n"
              "    torch.load(p)\n"                            # bare: 5
              "    with open(p) as g:\n"                       # bare: 6
              "        np.load(g)\n"                           # bare: 7 (g is not from the guard)
              "def good(p, handle):\n"
              "    with input_path(p, what='x') as checked, h5py.File(checked, 'r') as f:\n"
              "        pass\n"
              "    with input_file(p, what='x') as f2:\n"
              "        np.load(f2)\n"
              "    np.load(handle)\n"
              "    with open(p, 'wb') as out, h5py.File(p, 'a') as h:\n"
              "        pass\n")
    assert unguarded_reads(source) == [(3, "h5py.File"), (5, "torch.load"), (6, "open"), (7, "np.load")]
