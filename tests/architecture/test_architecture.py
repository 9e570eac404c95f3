"""The architecture, checked: the adapter contract, a core that imports no framework, no import circles.

- Every registered adapter whose framework is installed exposes every verb of
  ``dense_bridge.registry._contract.REQUIRED_VERBS``, and every adapter package has the same files.
- No core module (``dense_bridge/``, checkpoints, testing, CLI and demo included) imports a framework,
  anywhere: module level, function bodies, ``importlib.import_module("...")`` and ``__import__``.
- The import graph of the package (function-level imports included) has no cycle.

All three read source files with ``ast``: nothing here imports a framework.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dense_bridge
from dense_bridge.registry._contract import OPTIONAL_FILES, OPTIONAL_VERBS, REQUIRED_FILES, REQUIRED_VERBS, problems
from dense_bridge.registry._backends import BACKENDS, available_backends, get_adapter

CORE = Path(dense_bridge.__file__).parent
ADAPTERS = CORE.parent / "backends"  # installed as dense_bridge.backends (pyproject package-dir)

FRAMEWORKS = {"torch", "tensorflow", "keras", "mlx", "h5py", "jax", "jaxlib", "flax", "equinox", "onnx", "onnxruntime"}

#: Verbs not yet offered by a backend: {(backend, verb): what is missing for it}. A verb leaves this
#: table when every adapter offers it and it joins REQUIRED_VERBS.
PENDING_VERBS: dict[tuple[str, str], str] = {}

#: Core modules still allowed a framework import, each with the reason it cannot go yet.
FRAMEWORK_IMPORT_ALLOWLIST: dict[str, str] = {}

#: Imports that still close a circle, (importer, imported), each with the reason it cannot go yet.
#: The cycle test drops these edges and fails on any circle left, and on an entry whose import is gone.
KNOWN_BACK_EDGES: dict[tuple[str, str], str] = {
}


# ------------------------------------------------------------------ the adapter contract
def _adapter_packages() -> list[Path]:
    # backends/_<name>/ is code several adapters of one family share (backends/_jax), not an adapter;
    # a file-format backend (FILE_FORMATS) runs nothing and is checked on its own below
    from dense_bridge.registry._backends import file_format_backends

    return sorted(p for p in ADAPTERS.iterdir()
                  if p.is_dir() and (p / "__init__.py").exists() and not p.name.startswith("_")
                  and p.name not in file_format_backends())


def test_file_format_backends_offer_the_port_verbs_alone():
    """A file-format backend (a format no framework runs here) is a package with its manifest and
    port verbs: every verb of the ports capability, declared in its manifest, and no layer verbs."""
    from dense_bridge.registry._backends import available_file_formats, file_format_backends, port_adapter
    from dense_bridge.registry._contract import PORTS as PORT_VERBS
    from dense_bridge.registry._manifest import PORTS

    for name, info in file_format_backends().items():
        path = ADAPTERS / name
        assert {"__init__.py", "_manifest.py", "_ports.py"} <= {f.name for f in path.glob("*.py")}, name
        assert PORTS in info.manifest.capabilities and info.manifest.port_formats, name
        if name not in available_file_formats():
            continue
        adapter = port_adapter(name)
        lacking = [v for v in PORT_VERBS.verbs if not callable(getattr(adapter, v, None))]
        assert not lacking, f"{name} lacks {lacking}"
        assert not any(callable(getattr(adapter, v, None)) for v in REQUIRED_VERBS), name


def test_every_backend_is_a_package_of_the_same_files():
    packages = {p.name: p for p in _adapter_packages()}
    loose = sorted(p.name for p in ADAPTERS.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"adapters are packages backends/<fw>/, not modules: {loose}"
    registered = {info.module.rsplit(".", 1)[1] for info in BACKENDS.values()}
    assert registered <= set(packages), f"registered adapters without a package: {registered - set(packages)}"
    allowed = set(REQUIRED_FILES) | set(OPTIONAL_FILES)
    problems = []
    for name, path in packages.items():
        files = {f.name for f in path.glob("*.py")}
        if missing := set(REQUIRED_FILES) - files:
            problems.append(f"backends/{name} lacks {sorted(missing)}")
        if extra := files - allowed:
            problems.append(f"backends/{name} has {sorted(extra)}, which no adapter role names "
                            f"(dense_bridge/registry/_contract.py REQUIRED_FILES/OPTIONAL_FILES)")
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_adapter_implements_the_whole_contract(name):
    if name not in available_backends():
        pytest.skip(f"framework for backend {name!r} is not installed")
    adapter = get_adapter(name)
    missing = [v for v in REQUIRED_VERBS if not callable(getattr(adapter, v, None))
               and (name, v) not in PENDING_VERBS]
    assert not missing, f"adapter {adapter.__name__} lacks the verbs {missing}"
    stale = [v for (b, v) in PENDING_VERBS if b == name and callable(getattr(adapter, v, None))]
    assert not stale, f"{stale} exist in {adapter.__name__} now: remove them from PENDING_VERBS"
    # every capability's verbs all or none, extras only beside them, manifest capabilities as declared
    declared = BACKENDS[name].manifest
    broken = [p for p in problems(adapter, declared.capabilities, bool(declared.formats))
              if not any(f"lacks {v}" in p for (b, v) in PENDING_VERBS if b == name)]
    assert not broken, f"adapter {adapter.__name__}: {broken}"
    # the verbs are the package's own (re-exported), not a framework function of the same name
    for verb in REQUIRED_VERBS + OPTIONAL_VERBS:
        fn = getattr(adapter, verb, None)
        if fn is not None:
            # its own package, or the family's shared one (backends/_jax for flax and equinox)
            assert fn.__module__.startswith((adapter.__name__, "dense_bridge.backends._")), (verb, fn.__module__)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_adapter_arrays_round_trip(name):
    """to_numpy(from_numpy(a)) gives back a's dtype and bits, bfloat16 included."""
    if name not in available_backends():
        pytest.skip(f"framework for backend {name!r} is not installed")
    import numpy as np

    from dense_bridge._dtypes import numpy_dtype

    adapter = get_adapter(name)
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        if name in ("mlx",) and dtype == "float64":
            continue  # MLX float64 lives on the CPU device only; covered in test_backend_mlx
        if name in ("flax", "equinox") and dtype == "float64" and not adapter._arrays.x64_enabled():
            continue  # JAX makes float64 only in 64-bit mode (SpecError otherwise): test_backend_flax
        a = rng.standard_normal((3, 4)).astype(numpy_dtype(dtype))
        back = adapter.to_numpy(adapter.from_numpy(a))
        assert back.dtype == a.dtype, (dtype, back.dtype)
        assert back.tobytes() == a.tobytes(), dtype


# ------------------------------------------------------------------ no framework in the core
def _core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) for every import anywhere in ``tree``, function bodies included,
    and for ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__") and not node.args[0].value.startswith("."):
                out.append((node.lineno, node.args[0].value))
    return out


def test_core_imports_no_framework():
    offenders, allowed_seen = [], set()
    for path in _core_files():
        rel = path.relative_to(CORE).as_posix()
        hits = [(line, mod) for line, mod in _imported_names(ast.parse(path.read_text(), str(path)))
                if mod.split(".")[0] in FRAMEWORKS]
        if hits and rel in FRAMEWORK_IMPORT_ALLOWLIST:
            allowed_seen.add(rel)
            continue
        offenders += [f"dense_bridge/{rel}:{line} imports {mod}" for line, mod in hits]
    assert not offenders, "framework work belongs in an adapter verb:\n" + "\n".join(offenders)
    stale = set(FRAMEWORK_IMPORT_ALLOWLIST) - allowed_seen
    assert not stale, f"remove {sorted(stale)} from FRAMEWORK_IMPORT_ALLOWLIST: they import no framework now"


def test_the_ast_check_sees_imports_inside_functions():
    src = "def f():\n    import torch.nn\n    return __import__('mlx.core')\n" \
          "class C:\n    def g(self):\n        from keras import ops\n        importlib.import_module('jax')\n"
    found = {mod.split(".")[0] for _, mod in _imported_names(ast.parse(src))}
    assert found == {"torch", "mlx", "keras", "jax"}


def test_import_dense_bridge_imports_no_framework():
    code = ("import sys, dense_bridge as db; db.available_backends(); import dense_bridge.testing; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FRAMEWORKS)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ------------------------------------------------------------------ the core names no framework
def _builtin_extensions() -> set[str]:
    """Every name ending a built-in manifest declares, except those of the core's own formats:
    .safetensors (the canonical checkpoint) and numpy's .npz (the --inputs file)."""
    from dense_bridge.registry._backends import BUILTIN, manifest

    return {e for name in BUILTIN for f in manifest(name).formats for e in f.extensions} - {".safetensors", ".npz"}


def _forbidden_words() -> re.Pattern:
    """Framework names (the built-in backends but the numpy reference, and the packages they run on)
    as whole words ("torch_default", an initializer's name, is another word), and the file endings
    the built-in manifests declare."""
    from dense_bridge.registry._backends import BUILTIN, file_format_backends

    names = sorted((set(BUILTIN) - {"numpy"}) | FRAMEWORKS | set(file_format_backends()))
    endings = sorted(re.escape(e) for e in _builtin_extensions())
    return re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(names) + r")(?![A-Za-z0-9_])|(" + "|".join(endings)
                      + r")(?![A-Za-z0-9_])", re.IGNORECASE)


#: Core string literals allowed to name a framework: {(file, literal): why}. Keep it short.
FRAMEWORK_NAME_ALLOWLIST: dict[tuple[str, str], str] = {
    **{("registry/_backends.py", name): "the registry's one line per built-in backend" for name in
       ("torch", "keras", "mlx", "flax", "equinox", "onnx")},
}


def _string_literals(tree: ast.AST):
    """(line, text) of every string constant that is not a docstring (f-string parts included)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            docstrings.add(id(node.body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_core_string_names_a_framework_or_its_file_format():
    """Tables keyed by framework names or file endings, sniffing by framework, messages listing
    frameworks: all of it belongs in the backends' manifests, which the core reads through the
    registry. Docstrings and comments may explain with examples; code may not depend on them."""
    offenders, stale = _core_literals_naming(_forbidden_words(), FRAMEWORK_NAME_ALLOWLIST)
    assert not offenders, "declare it in backends/<fw>/_manifest.py instead:\n" + "\n".join(offenders)
    assert not stale, f"stale: {stale}"


def _core_literals_naming(words: re.Pattern, allowed: dict) -> tuple[list[str], set]:
    """Core string literals (docstrings aside) that ``words`` finds and ``allowed`` does not
    excuse, as "file:line: text"; and the ``allowed`` entries nothing used (stale)."""
    offenders, used = [], set()
    for path in _core_files():
        rel = path.relative_to(CORE).as_posix()
        for line, text in _string_literals(ast.parse(path.read_text(), str(path))):
            if words.search(text):
                if (rel, text) in allowed:
                    used.add((rel, text))
                    continue
                offenders.append(f"dense_bridge/{rel}:{line}: {text[:90]!r}")
    return offenders, set(allowed) - used


def test_the_name_check_sees_tables_and_messages():
    words = _forbidden_words()
    src = ('FORMATS = {"torch": (".pt",)}\nSUFFIX = {".weights.h5": "k"}\nmsg = f"needs Keras {x}"\n'
           'ok = "torch_default"\n')
    hits = [t for _, t in _string_literals(ast.parse(src)) if words.search(t)]
    assert sorted(hits) == sorted(["torch", ".pt", ".weights.h5", "needs Keras "]), hits


def test_backend_facts_come_from_the_manifests():
    """Every fact the core needs about a backend's files and objects is its manifest's declaration."""
    from dense_bridge.registry._backends import BUILTIN, manifest

    declared = {name: manifest(name) for name in BUILTIN}
    assert {n for n, m in declared.items() if m.formats} == set(BUILTIN) - {"numpy"}
    top = max(declared, key=lambda n: declared[n].owner_priority)
    assert top == "keras"  # on its torch engine a Keras layer is a torch nn.Module too
    pyproject = (CORE.parent / "pyproject.toml").read_text()
    assert not re.search(r"^packages\s*=", pyproject, re.MULTILINE), "packages are discovered (setup.py)"


def test_manifests_load_without_their_framework():
    """The registry reads every manifest, sniffs a file and lists the formats, importing no framework."""
    code = ("import sys, dense_bridge as db; from dense_bridge.registry import _backends as _registry; from dense_bridge.checkpoints import _native as n; "
            "[_registry.manifest(b) for b in _registry.names()]; n.supported_formats(); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FRAMEWORKS)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_adapter_kit_offers_every_name_it_lists():
    """dense_bridge.adapter_kit, the public module outside adapters import from, resolves every
    name of its __all__ (each loaded from its core module on first use)."""
    from dense_bridge import adapter_kit

    assert isinstance(adapter_kit.CONTRACT_VERSION, int)
    missing = [n for n in adapter_kit.__all__ if getattr(adapter_kit, n, None) is None]
    assert not missing, missing
    assert adapter_kit.ParamSource.__module__ == "dense_bridge.params._source"
    assert set(adapter_kit.REQUIRED_VERBS) >= {"owns", "compile", "get_params", "to_spec"}
    assert {"running", "files", "lora", "quant", "parallel", "dcp"} <= set(adapter_kit.CAPABILITIES)
    assert "trace" in adapter_kit.RUNNING.verbs and "file_info" in adapter_kit.FILES.verbs


def test_the_contract_check_sees_half_groups_strays_and_missing_needs():
    import types

    module = types.ModuleType("probe")
    for verb in REQUIRED_VERBS + ("trace", "walk", "lora_folds_scale", "quant_file_layers", "quant_file_template"):
        setattr(module, verb, lambda *a: None)
    found = problems(module)
    assert any("part of the 'running' capability (trace, walk) but lacks capture, run_layer" in p for p in found), found
    assert any("offers lora_folds_scale without the 'lora' capability" in p for p in found), found
    assert any("'quant_files' capability needs the 'quant' capability" in p for p in found), found
    assert any("'quant_files' capability needs the 'files' capability" in p for p in found), found
    assert problems(module, frozenset({"dcp"})) != found  # a declared capability without its verbs
    plain = types.ModuleType("plain")
    for verb in REQUIRED_VERBS:
        setattr(plain, verb, lambda *a: None)
    assert problems(plain) == [] and problems(plain, formats=True) != []


def test_import_with_an_entry_point_installed_imports_no_framework(tmp_path):
    """An installed backend whose package imports a framework at the top is registered by its
    entry point's name only: importing dense_bridge, listing backends, compiling on the reference
    backend and sniffing a file import neither that package nor any framework."""
    package = tmp_path / "heavy_adapter"
    package.mkdir()
    (package / "__init__.py").write_text("import torch  # a framework, at the top\nraise SystemExit('imported')\n")
    (package / "_manifest.py").write_text("from dense_bridge.adapter_kit import Manifest\n"
                                          "MANIFEST = Manifest(requires=('torch',))\n")
    dist = tmp_path / "heavy_adapter-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: heavy-adapter\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[dense_bridge.backends]\nheavy = heavy_adapter\n")
    (tmp_path / "x.bin").write_bytes(b"not a checkpoint")
    code = ("import sys, dense_bridge as db; import dense_bridge.testing; names = db.available_backends(); "
            "db.compile(db.Dense(2, in_features=2), 'numpy', seed=0)\n"
            "try:\n    db.load(sys.argv[1])\nexcept db.CheckpointError:\n    pass\n"
            "from dense_bridge.registry._backends import names as registered\n"
            f"print('heavy' in registered(), sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{sorted(FRAMEWORKS | {'heavy_adapter'})!r}))")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.bin")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.stdout.strip() == "True []", out.stdout + out.stderr


# ------------------------------------------------------------------ private names stay private
#: ``from module import _name`` across modules still allowed: {(importing file, name): why}.
PRIVATE_IMPORT_ALLOWLIST: dict[tuple[str, str], str] = {
    # pickles of LazyDense name its pre-hook dense_bridge.backends.torch._check_width
    ("backends/torch/__init__.py", "_check_width"): "pickle compatibility",
}


def _imported_package_dir(path: Path, node: ast.ImportFrom) -> Path | None:
    """The directory of the package ``from <module> import ...`` names, when it is one of ours."""
    if node.level:
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
    else:
        top, _, node_module = (node.module or "").partition(".")
        if top != "dense_bridge":
            return None
        base, node = CORE, ast.ImportFrom(module=node_module or None, names=node.names, level=0)
    for part in (node.module or "").split("."):
        if part:
            base = base / part
    return base if base.is_dir() else None


def _is_module(stem: Path) -> bool:
    """A private module imported from its package is fine (``from .checkpoints import _native``)."""
    return stem.with_suffix(".py").is_file() or (stem / "__init__.py").is_file()


def _private_imports() -> list[tuple[str, int, str]]:
    """(file, line, name) for every ``from X import _name`` (a private module is fine to import:
    ``from . import _api``; a private name inside another module is not)."""
    root = CORE.parent
    out = []
    for path in _core_files() + sorted(ADAPTERS.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or node.level == 0):
                package = _imported_package_dir(path, node)
                out += [(rel, node.lineno, a.name) for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                        and not (package is not None and _is_module(package / a.name))]
    return out


def test_no_module_reaches_into_another_modules_private_names():
    def allowed(rel: str, name: str) -> bool:
        return any((f == rel or (f.endswith("*") and rel.startswith(f[:-1]))) and n in (name, "*")
                   for f, n in PRIVATE_IMPORT_ALLOWLIST)

    offenders = [f"{rel}:{line} imports {name}" for rel, line, name in _private_imports() if not allowed(rel, name)]
    assert not offenders, ("a name used by another module is public (no underscore) in its private module; "
                           "the core's API for adapters is listed in docs/ARCHITECTURE.md:\n" + "\n".join(offenders))


# ------------------------------------------------------------------ deliberate errors
#: ``raise ValueError/KeyError/RuntimeError/IndexError(...)`` still allowed: {(file, line text): why}.
BARE_RAISE_ALLOWLIST: dict[str, str] = {}
#: Python protocols where the builtin exception is the contract: Report[layer]["quantity"]
BARE_RAISE_PROTOCOL = {("dense_bridge/testing/_report.py", "__getitem__", "KeyError")}


def test_every_deliberate_error_is_a_dense_bridge_error_or_type_error():
    root = CORE.parent
    bare = ("ValueError", "KeyError", "RuntimeError", "IndexError", "AssertionError", "Exception")
    offenders = []
    for path in _core_files() + sorted(ADAPTERS.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(rel == f or (f.endswith("*") and rel.startswith(f[:-1])) for f in BARE_RAISE_ALLOWLIST):
            continue
        tree = ast.parse(path.read_text(), str(path))
        where: dict[int, str] = {}  # id(raise node) -> innermost enclosing function
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                where[id(node)] = fn.name  # inner functions come later in ast.walk: they win
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and getattr(node.exc.func, "id", None) in bare:
                name = where.get(id(node), "<module>")
                if (rel, name, node.exc.func.id) not in BARE_RAISE_PROTOCOL:
                    offenders.append(f"{rel}:{node.lineno} raises {node.exc.func.id} (in {name})")
    # assert_equivalent's AssertionError is its documented contract (pytest reads it)
    offenders = [o for o in offenders if "(in assert_equivalent)" not in o]
    assert not offenders, "raise a DenseBridgeError subclass (or TypeError):\n" + "\n".join(offenders)


# ------------------------------------------------------------------ no import circles
def _module_name(path: Path) -> str:
    if path.is_relative_to(ADAPTERS):
        parts = ("dense_bridge", "backends") + path.relative_to(ADAPTERS).with_suffix("").parts
    else:
        parts = ("dense_bridge",) + path.relative_to(CORE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in it, function bodies included).

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``.
    A parent package's ``__init__`` that Python runs on the way is not an edge: only what the
    source names is.
    """
    files = _core_files() + sorted(ADAPTERS.rglob("*.py"))
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rsplit(".", 1)[0]
        edges: set[str] = set()

        def resolve(base: str, names: list[str]) -> None:
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            if targets:
                edges.update(targets)
            if len(targets) < len(names) and base in modules:
                edges.add(base)

        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                resolve(base, [a.name for a in node.names])
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                f = node.func
                if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) == "import_module":
                    target = node.args[0].value
                    target = package + target if target.startswith(".") else target
                    if target in modules:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_has_no_cycle():
    graph = _import_graph()
    stale = [edge for edge in KNOWN_BACK_EDGES if edge[1] not in graph.get(edge[0], ())]
    assert not stale, f"remove {stale} from KNOWN_BACK_EDGES: that import is gone"
    for src, dst in KNOWN_BACK_EDGES:
        graph[src] = graph[src] - {dst}
    cycles = [sorted(c) for c in _cycles(graph)]
    assert not cycles, f"import circles (function-level imports included): {cycles}"


def test_the_cycle_check_sees_function_level_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]
    g = _import_graph()
    # a function-level import is an edge: _demo imports the checkpoints package inside run()
    assert "dense_bridge.checkpoints" in g["dense_bridge.cli._demo"]
    # adapters import the core, never the reverse
    assert "dense_bridge.params._source" in g["dense_bridge.backends.torch._layers"]
    assert not any(e.startswith("dense_bridge.backends") for m, es in g.items()
                   if not m.startswith("dense_bridge.backends") for e in es)


# ------------------------------------------------------------------ the command line on the public API
#: private core modules the command line may import, and why
CLI_PRIVATE_IMPORTS = {
    "dense_bridge.registry._backends": "the backends table (choices, help texts, quiet imports from the manifests) and the "
                              "adapters' optional verbs (train_sgd, load_model) have no public face",
    "dense_bridge._errors": "the error classes' message helpers (check_type, received) phrase its argument errors",
}


def _cli_reaches_private(graph: dict[str, set[str]], sources: dict[str, str]) -> list[str]:
    """What the command line imports beyond the public API: a module with a private path component
    outside dense_bridge.cli (unless CLI_PRIVATE_IMPORTS says why), or ``x._name`` read off a module."""
    out = []
    for module, edges in graph.items():
        if not module.startswith("dense_bridge.cli"):
            continue
        for target in sorted(edges):
            private = any(part.startswith("_") for part in target.split("."))
            if private and not target.startswith("dense_bridge.cli") and target not in CLI_PRIVATE_IMPORTS:
                out.append(f"{module} imports {target}")
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append(f"{module}:{node.lineno} reads .{node.attr}")
    return out


def test_the_command_line_uses_only_the_public_api():
    """dense_bridge/cli/* imports dense_bridge (db.*), dense_bridge.checkpoints, dense_bridge.testing and
    the other public modules, its own package, and only the private modules CLI_PRIVATE_IMPORTS names."""
    sources = {_module_name(p): p.read_text() for p in sorted((CORE / "cli").glob("*.py"))}
    assert "dense_bridge.cli._main" in sources
    offenders = _cli_reaches_private(_import_graph(), sources)
    assert not offenders, "the command line reaches past the public API:\n" + "\n".join(offenders)


def test_the_public_api_check_sees_private_modules_and_attributes():
    graph = {"dense_bridge.cli._x": {"dense_bridge.checkpoints._load", "dense_bridge.cli._text", "dense_bridge",
                                     "dense_bridge.registry._backends"}}
    found = _cli_reaches_private(graph, {"dense_bridge.cli._x": "import dense_bridge as db\ndb._api.get_params\n"})
    assert found == ["dense_bridge.cli._x imports dense_bridge.checkpoints._load", "dense_bridge.cli._x:2 reads ._api"]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_optional_train_sgd_verb_trains_the_demo_model(name):
    """Where an adapter offers train_sgd, it lowers the demo loss, and torch and the numpy
    reference agree on the first step (same spec, seed and data)."""
    if name not in available_backends():
        pytest.skip(f"framework for backend {name!r} is not installed")
    adapter = get_adapter(name)
    if not hasattr(adapter, "train_sgd"):
        pytest.skip(f"{name} offers no train_sgd (optional verb)")
    import numpy as np

    from dense_bridge.cli import _demo

    x, y = _demo.synthetic_data(0)
    model = dense_bridge.compile(_demo.demo_spec(), name, seed=0)
    before, after = adapter.train_sgd(model, x, y, steps=5, lr=0.5)
    assert before.shape == after.shape == (len(x), _demo.OUT)
    assert _demo._loss_acc(after, y)[0] < _demo._loss_acc(before, y)[0]
    ref = dense_bridge.compile(_demo.demo_spec(), "numpy", seed=0)
    ref_before, ref_after = get_adapter("numpy").train_sgd(ref, x, y, steps=1, lr=0.5)
    np.testing.assert_allclose(before, ref_before, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ tensor parallelism: one contract, one dispatch
def _verb_binding_lines(tree: ast.Module, verbs: set[str]) -> list[str]:
    """How an adapter ``__init__`` binds each verb name other than by importing it from its own
    modules: a ``def`` (an override or a wrapper) or an assignment (``get_params = wrap(...)``)."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in verbs:
            out.append(f"line {node.lineno}: def {node.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out += [f"line {node.lineno}: {t.id} = ..." for t in targets if isinstance(t, ast.Name) and t.id in verbs]
    return out


#: Verbs an adapter ``__init__`` may define itself: a one-line ownership test, no other verb inside.
DEFINED_IN_INIT = {"owns"}


def test_no_backend_init_wraps_a_verb():
    """Each verb is a function of the package's own modules, re-exported as it is: no ``__init__``
    rebinds a verb (a wrapper that dispatches a parallel model, an override of set_params)."""
    from dense_bridge.registry._contract import OPTIONAL_VERBS

    verbs = set(REQUIRED_VERBS) | set(OPTIONAL_VERBS)
    offenders = []
    for package in _adapter_packages():
        tree = ast.parse((package / "__init__.py").read_text())
        offenders += [f"backends/{package.name}/__init__.py {line}"
                      for line in _verb_binding_lines(tree, verbs - DEFINED_IN_INIT)]
    assert not offenders, "import each verb from the module that does the work:\n" + "\n".join(offenders)


def test_plain_verbs_never_see_a_parallel_model():
    """Only an adapter's ``__init__`` imports its ``_parallel`` module: get_params, set_params,
    to_spec and trace (``_params``, ``_to_spec``, ``_trace``, ...) hold no parallel branch, because
    dense_bridge/parallel/_dispatch.py sends a parallel model to the parallel_* verbs."""
    offenders = []
    for package in _adapter_packages():
        for path in sorted(package.glob("*.py")):
            if path.name in ("__init__.py", "_parallel.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (
                        (node.level == 1 and node.module == "_parallel")
                        or (node.level == 1 and node.module is None and any(a.name == "_parallel" for a in node.names))
                        or (node.module or "").endswith(f"backends.{package.name}._parallel")):
                    offenders.append(f"backends/{package.name}/{path.name}:{node.lineno}")
    assert not offenders, "a plain verb module imports _parallel:\n" + "\n".join(offenders)


def test_the_verb_check_sees_wrappers():
    src = ("from ._params import get_params, set_params\nfrom ._parallel import parallel_state\n"
           "get_params = wrap(get_params)\n\ndef set_params(native, params):\n    pass\n\ndef owns(obj):\n    return True\n")
    found = _verb_binding_lines(ast.parse(src), {"get_params", "set_params", "parallel_state"})
    assert found == ["line 3: get_params = ...", "line 5: def set_params"], found


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_parallel_and_dcp_verbs_follow_the_manifest(name):
    """A backend whose manifest declares ``parallel`` offers every verb of PARALLEL_VERBS, its
    own functions under exactly those names; one that does not offers none (likewise ``dcp`` and
    DCP_VERBS); no adapter exports another ``parallel_*`` name."""
    if name not in available_backends():
        pytest.skip(f"framework for backend {name!r} is not installed")
    from dense_bridge.registry._contract import DCP_VERBS, PARALLEL_VERBS
    from dense_bridge.registry._manifest import DCP, PARALLEL
    from dense_bridge.registry._backends import has_capability

    adapter = get_adapter(name)
    for capability, verbs in ((PARALLEL, PARALLEL_VERBS), (DCP, DCP_VERBS)):
        offered = [v for v in verbs if callable(getattr(adapter, v, None))]
        if has_capability(name, capability):
            assert offered == list(verbs), f"{name} declares {capability!r} but lacks {sorted(set(verbs) - set(offered))}"
            for verb in verbs:
                assert getattr(adapter, verb).__module__.startswith(adapter.__name__), (verb, getattr(adapter, verb).__module__)
        else:
            assert not offered, f"{name} offers {offered} without declaring {capability!r} in its manifest"
    stray = sorted(n for n in dir(adapter) if n.startswith("parallel_") and n not in PARALLEL_VERBS)
    assert not stray, f"{name} exports {stray}: parallel verbs are exactly dense_bridge.registry._contract.PARALLEL_VERBS"


#: The core modules that may name a parallel or DCP verb: the contract that lists them, and the
#: one module that calls them.
PARALLEL_VERB_NAMERS = {"registry/_contract.py", "parallel/_dispatch.py"}


def _verb_mentions(tree: ast.AST, verbs: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every attribute access, name or non-docstring string naming one of ``verbs``."""
    out = [(node.lineno, node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in verbs]
    out += [(node.lineno, node.id) for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id in verbs]
    out += [(line, text) for line, text in _string_literals(tree) if text in verbs]
    return out


def test_the_core_dispatches_parallel_verbs_in_one_module():
    """Only dense_bridge/parallel/_dispatch.py calls (or looks up) a parallel or DCP verb: the
    public verbs, save/load and testing.compare reach them through it."""
    from dense_bridge.registry._contract import DCP_VERBS, PARALLEL_VERBS

    verbs = set(PARALLEL_VERBS) | set(DCP_VERBS)
    offenders, namers = [], set()
    for path in _core_files():
        rel = path.relative_to(CORE).as_posix()
        hits = _verb_mentions(ast.parse(path.read_text(), str(path)), verbs)
        if hits:
            namers.add(rel)
        if rel not in PARALLEL_VERB_NAMERS:
            offenders += [f"dense_bridge/{rel}:{line} names {name}" for line, name in hits]
    assert not offenders, "call parallel verbs through dense_bridge/parallel/_dispatch.py:\n" + "\n".join(offenders)
    assert namers == PARALLEL_VERB_NAMERS, namers


def test_the_dispatch_check_sees_calls_and_lookups():
    src = ('"""parallel_state in a docstring is fine."""\nadapter.parallel_trace(m, x, g)\n'
           'optional_verb(b, "save_dcp", "why")\nfrom x import parallel_barrier\nparallel_barrier(m)\n')
    found = _verb_mentions(ast.parse(src), {"parallel_state", "parallel_trace", "save_dcp", "parallel_barrier"})
    assert sorted(found) == [(2, "parallel_trace"), (3, "save_dcp"), (5, "parallel_barrier")], found


# ------------------------------------------------------------------ the core names no ecosystem format
#: Libraries of the model ecosystems, and the file names, key grammars and config keys of their
#: formats. A format lives with the framework that runs it (backends/<fw>/), reached through the
#: manifest and the optional verbs; the core sees only what a backend declares.
ECOSYSTEM_WORDS = ("transformers", "peft", "mlx_lm", "mlx-lm", "keras_hub", "keras-hub", "torchao", "gguf",
                   "llama.cpp", "llama_cpp", "config.json", "adapter_config", "adapter_model", "adapters.safetensors",
                   "pytorch_model", "base_model", "lora_A", "lora_B", "lora_magnitude_vector", "lora_alpha",
                   "rank_pattern", "alpha_pattern", "fine_tune_type", "lora_parameters", "quantization_config",
                   "model_type", "auto_map", "rope_theta", "tie_word_embeddings", "Conv1D")

#: Core string literals allowed to name an ecosystem word: {(file, literal): why}. Keep it short.
ECOSYSTEM_NAME_ALLOWLIST: dict[tuple[str, str], str] = {}


def _ecosystem_words() -> re.Pattern:
    # case-sensitive: dense_bridge's own canonical adapter names are lora_a/lora_b
    return re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(re.escape(w) for w in ECOSYSTEM_WORDS) + r")(?![A-Za-z0-9])")


def test_no_core_string_names_an_ecosystem_library_or_its_file_format():
    """PEFT and mlx-lm adapter directories, transformers and mlx-lm model directories, keras-hub
    presets, GGUF: their file names, key grammars and config keys are backend knowledge.
    Docstrings and comments may explain with examples; code may not depend on them."""
    offenders, stale = _core_literals_naming(_ecosystem_words(), ECOSYSTEM_NAME_ALLOWLIST)
    assert not offenders, "declare it in backends/<fw>/ instead:\n" + "\n".join(offenders)
    assert not stale, f"stale: {stale}"


def test_the_ecosystem_check_sees_file_names_and_key_grammar():
    words = _ecosystem_words()
    src = ('NAME = "adapter_config.json"\nKEY = f"base_model.model.{p}.lora_A.weight"\nlib = "mlx-lm"\n'
           'ok = "transformed"\nok2 = "model_types_seen"\n')
    hits = [t for _, t in _string_literals(ast.parse(src)) if words.search(t)]
    assert sorted(hits) == sorted(["adapter_config.json", "base_model.model.", ".lora_A.weight", "mlx-lm"]), hits


# ------------------------------------------------------------------ imports point down the layer order
def _layer_order() -> list[tuple[str, list[str]]]:
    """The layers of docs/ARCHITECTURE.md's "Layers" table, bottom first: (name, module prefixes).

    The table sits between ``<!-- layers -->`` and ``<!-- /layers -->``; each row is
    ``| n | layer name | module prefixes, space-separated, relative to dense_bridge |``.
    """
    doc = (CORE.parent / "docs" / "ARCHITECTURE.md").read_text()
    table = doc.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            rows.append((cells[1], [("dense_bridge" if p == "(package)" else f"dense_bridge.{p}")
                                    for p in cells[2].replace("`", "").split()]))
    return rows


def _layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The index of the layer whose longest prefix names ``module`` (a module-level entry such as
    ``checkpoints._io`` wins over its package's)."""
    best = None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def _upward_imports(graph: dict[str, set[str]], layers) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        if module.startswith("dense_bridge.backends"):
            continue  # adapters sit on top of the whole core (and the core never imports them)
        here = _layer_of(module, layers)
        if here is None:
            out.append(f"{module} is in no layer of docs/ARCHITECTURE.md")
            continue
        for target in sorted(targets):
            there = _layer_of(target, layers)
            if there is not None and there > here:
                out.append(f"{module} ({layers[here][0]}) imports {target} ({layers[there][0]})")
    return out


def test_every_import_points_down_the_layer_order():
    """Each module imports only its own layer and those below it (function-level imports
    included), in the order docs/ARCHITECTURE.md writes down."""
    layers = _layer_order()
    assert len(layers) >= 6, layers
    offenders = _upward_imports(_import_graph(), layers)
    assert not offenders, "imports against the layer order of docs/ARCHITECTURE.md:\n" + "\n".join(offenders)


def test_the_layer_check_sees_an_upward_import():
    layers = [("low", ["dense_bridge.a", "dense_bridge.b._io"]), ("high", ["dense_bridge.b"])]
    graph = {"dense_bridge.a.x": {"dense_bridge.b.y", "dense_bridge.b._io"}, "dense_bridge.b.y": {"dense_bridge.a.x"},
             "dense_bridge.c": set()}
    assert _upward_imports(graph, layers) == ["dense_bridge.a.x (low) imports dense_bridge.b.y (high)",
                                              "dense_bridge.c is in no layer of docs/ARCHITECTURE.md"]


def test_tests_and_benchmarks_import_the_adapters_by_their_installed_name():
    """``backends`` is installed as ``dense_bridge.backends``: importing it as a top-level
    ``backends`` (the checkout's folder on sys.path) makes a second copy of an adapter whose classes
    re-register with Keras, so a model saved afterwards loads as the copy's classes."""
    root = CORE.parent
    offenders = []
    for path in sorted(list((root / "tests").rglob("*.py")) + list((root / "benchmarks").rglob("*.py"))):
        for line, name in _imported_names(ast.parse(path.read_text(), str(path))):
            if name == "backends" or name.startswith("backends."):
                offenders.append(f"{path.relative_to(root)}:{line} imports {name}")
    assert not offenders, "import dense_bridge.backends.<fw> instead:\n" + "\n".join(offenders)
