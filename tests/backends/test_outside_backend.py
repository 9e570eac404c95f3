"""A backend from outside the package works everywhere a built-in one does.

The numpy reference adapter is copied into a temporary directory as the package ``npx_adapter``
(its imports of dense_bridge are the public ones: ``adapter_kit``, ``specs``, ``activations``,
``wiring``), given a file format of its own (``.npzx``: a magic number, a JSON header, raw bytes)
and a manifest declaring it, then registered both ways, each in a fresh subprocess:

- by a call, ``db.register_backend("npx", "npx_adapter")``;
- by an entry point, a ``.dist-info`` directory on ``sys.path`` whose ``entry_points.txt`` puts
  ``npx = npx_adapter`` in the ``dense_bridge.backends`` group (what ``pip install`` leaves).

Each runs the importable conformance suite against it, converts to and from torch, compares,
saves and loads its native file (recognised by content), and runs ``dense-bridge convert --to npx``.
No file of dense_bridge is edited (checked by hashing the package before and after).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "tensorflow", "keras", "mlx", "jax", "flax", "equinox", "h5py")

MANIFEST = '''\
"""NPX: the numpy reference adapter under another name, with a file format of its own."""
from dense_bridge.adapter_kit import FileFormat, Manifest, Match

MAGIC = b"NPZX\\x01"


def _npzx(probe):
    return Match.CERTAIN if probe.head.startswith(MAGIC) else Match.NO


MANIFEST = Manifest(
    install="pip install npx-adapter", display="NPX",
    formats=(FileFormat("NPX archive (.npzx)", container="npzx", sniff=_npzx, extensions=(".npzx",),
                        write_kind="npzx", temp_suffix=".npzx", stores_metadata=True),),
    layout_note="NPX layout: canonical, Dense kernel (in_features, units)",
)
'''

FILES = '''\
"""The .npzx format: MAGIC, a little-endian u64 header length, a JSON header
{"tensors": {name: [shape, dtype, offset]}, "metadata": {...}}, then each tensor's bytes."""
import json
import math
import struct

import numpy as np

from dense_bridge.adapter_kit import CheckpointError, dtype_name, numpy_dtype

from ._manifest import MAGIC
from ._params import get_params, set_params


def _header(path):
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise CheckpointError(f"cannot read {path}: not an .npzx file")
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 1 << 24:
            raise CheckpointError(f"cannot read {path}: a header of {size} bytes")
        header = json.loads(f.read(size))
    return header, len(MAGIC) + 8 + size


def _entries(header):
    return {k: (tuple(v[0]), v[1]) for k, v in header["tensors"].items()}


def file_info(path, container, *, files=None):
    header, _ = _header(path)
    return _entries(header), dict(header["metadata"])


def read_file(path, container, template, *, files=None, check, borrow=False):
    if template is None:
        raise CheckpointError(f"{path}: an .npzx file needs the model's structure (spec= or like=)")
    header, start = _header(path)
    expected = {k: (tuple(np.shape(v)), dtype_name(np.asarray(v).dtype)) for k, v in get_params(template).items()}
    check(_entries(header), expected)
    params = {}
    for name, (shape, dtype, offset) in header["tensors"].items():
        dt = numpy_dtype(dtype)
        params[name] = np.fromfile(path, dtype=dt, count=math.prod(shape), offset=start + offset).reshape(shape)
    set_params(template, params)
    return template


def write_file(model, path, kind, *, temp, metadata=None):
    if kind != "npzx":
        raise CheckpointError(f"cannot write {path}: NPX writes .npzx files, not {kind!r}")
    params = {k: np.ascontiguousarray(v) for k, v in get_params(model).items()}
    tensors, offset = {}, 0
    for name, a in params.items():
        tensors[name] = [list(a.shape), dtype_name(a.dtype), offset]
        offset += a.nbytes
    header = json.dumps({"tensors": tensors, "metadata": dict(metadata or {})}).encode()
    with open(temp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for a in params.values():
            f.write(a.tobytes())
'''

CONFORMANCE = '''\
import dense_bridge as db
from dense_bridge.testing.conformance import AdapterConformance

REGISTER = {register!r}
if REGISTER:
    db.register_backend("npx", "npx_adapter", install_hint="pip install npx-adapter")


class TestNpx(AdapterConformance):
    backend = "npx"
'''

#: Runs in a fresh process after the registration (a call, or none: the entry point).
SCENARIO = '''\
import os, sys
import numpy as np
import dense_bridge as db

FRAMEWORKS = {frameworks!r}
out = sys.argv[1]
if {register!r}:
    db.register_backend("npx", "npx_adapter", install_hint="pip install npx-adapter")
names = db.available_backends()
assert "npx" in names, names
assert "npx_adapter" not in sys.modules, "imported before first use"
seen = sorted(m for m in sys.modules if m.split(".")[0] in FRAMEWORKS)
assert seen == [], seen

spec = db.Sequential([db.Dense(5, in_features=3, activation="relu", bias_init="normal"), db.Dense(2)])
model = db.compile(spec, "npx", seed=0)
assert type(model).__module__.startswith("npx_adapter") and db.backend(model) == "npx"
assert "npx_adapter" in sys.modules
want = {{k: np.asarray(v).copy() for k, v in db.get_params(model).items()}}

def same(params):
    return sorted(params) == sorted(want) and all(
        np.asarray(params[k]).tobytes() == want[k].tobytes() for k in want)

# its own file: written, recognised by content (any name), read back with and without a spec
path = os.path.join(out, "m.npzx")
from dense_bridge import checkpoints as checkpoint
from dense_bridge.checkpoints._native import write_native
write_native(model, "npx", path, spec=spec)
renamed = os.path.join(out, "renamed.bin")
with open(path, "rb") as f, open(renamed, "wb") as g:
    g.write(f.read())
for p in (path, renamed):
    with checkpoint.open_checkpoint(p) as c:
        assert c.framework == "npx" and c.kind == "NPX archive (.npzx)", (c.framework, c.kind)
    loaded_spec, params = db.load(p)
    assert loaded_spec == spec and same(params)
    assert same(db.get_params(db.load(p, "npx")))

if "torch" in names:
    t = db.convert(model, to="torch")
    assert same(db.get_params(t))
    back = db.convert(t, to="npx")
    assert db.backend(back) == "npx" and same(db.get_params(back))
    report = db.testing.compare(back, t)
    assert report.passed and report.rows, str(report)
    models = db.testing.compare_models(back, t, [np.ones((2, 3), np.float32)])
    assert models.passed, str(models)
    assert list(db.linear_layers(back)) == ["0", "1"], db.linear_layers(back)
    db.transfer(t, back)
    assert db.load(path, "torch").__class__.__module__.startswith("torch")
    pt = os.path.join(out, "from_npx.pt")
    checkpoint.convert_file(path, "torch", pt)
    assert same(db.get_params(db.load(pt, "npx", spec=spec)))
db.save(model, os.path.join(out, "canonical.safetensors"))

# the command line: --to choices come from the registry at run time
from dense_bridge.cli import _main as cli
assert cli.main(["convert", os.path.join(out, "canonical.safetensors"), "--to", "npx",
                 "-o", os.path.join(out, "cli.npzx")]) == 0
assert same(db.load(os.path.join(out, "cli.npzx"))[1])
assert cli.main(["check", os.path.join(out, "cli.npzx"), os.path.join(out, "canonical.safetensors"),
                 "--backend-a", "npx", "--backend-b", "npx"]) == 0
print("SCENARIO OK")
'''


def _tree_hash() -> str:
    digest = hashlib.sha256()
    for folder in ("dense_bridge", "backends"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding the package npx_adapter: backends/numpy copied, its file format added."""
    root = tmp_path_factory.mktemp("site")
    package = root / "npx_adapter"
    shutil.copytree(ROOT / "backends" / "numpy", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_manifest.py").write_text(MANIFEST)
    (package / "_files.py").write_text(FILES)
    return root


def _env(*paths: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def _entry_point_dist(root: Path) -> Path:
    """What ``pip install`` of a distribution with that entry point leaves on sys.path."""
    dist = root / "npx_adapter-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: npx-adapter\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[dense_bridge.backends]\nnpx = npx_adapter\n")
    return root


def test_the_copied_adapter_uses_only_the_public_api(site):
    private = []
    for path in (site / "npx_adapter").glob("*.py"):
        private += [f"{path.name}: {m}" for m in re.findall(r"from (dense_bridge[\w.]*) import", path.read_text())
                    if any(part.startswith("_") for part in m.split(".")[1:])]
    assert not private, private


@pytest.mark.parametrize("how", ["register_backend", "entry_point"])
def test_outside_backend_works_everywhere(site, tmp_path, how):
    before = _tree_hash()
    register = how == "register_backend"
    paths = [site]
    if not register:
        ep_root = tmp_path / "ep"
        ep_root.mkdir()
        paths.append(_entry_point_dist(ep_root))
    env = _env(*paths)
    code = SCENARIO.format(frameworks=FRAMEWORKS, register=register)
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "SCENARIO OK" in run.stdout, (run.stdout + run.stderr)[-4000:]

    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_npx_conformance.py").write_text(CONFORMANCE.format(register=register))
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-W", "error",
                          "--rootdir", str(suite), str(suite)], cwd=suite, env=env, capture_output=True, text=True,
                         timeout=600)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert re.search(r"test_every_declared_file_format_round_trips PASSED", run.stdout), tail
    assert " failed" not in run.stdout and re.search(r"\d+ passed", run.stdout), tail

    if not register:  # the installed command itself, its --to choices read from the registry
        exe = Path(sys.executable).with_name("dense-bridge")
        command = [str(exe)] if exe.exists() else [sys.executable, "-m", "dense_bridge.cli"]
        helped = subprocess.run(command + ["convert", "--help"], env=env, capture_output=True, text=True, timeout=120)
        flat = " ".join(helped.stdout.split())  # argparse wraps the list of endings where it likes
        assert "npx" in flat and ".npzx (npx)" in flat, helped.stdout
        src = tmp_path / "canonical.safetensors"
        done = subprocess.run(command + ["convert", str(src), "--to", "npx", "-o", str(tmp_path / "ep.npzx")],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "converted" in done.stdout, done.stdout + done.stderr
        shown = subprocess.run(command + ["inspect", str(tmp_path / "ep.npzx")], env=env, capture_output=True,
                               text=True, timeout=120)
        assert shown.returncode == 0 and "NPX archive (.npzx)" in shown.stdout, shown.stdout + shown.stderr
    assert _tree_hash() == before, "a file of dense_bridge changed"


def test_import_with_an_entry_point_installed_imports_no_framework(site, tmp_path):
    """The entry point is read by name: neither its package nor any framework is imported by
    ``import dense_bridge``, by listing the backends, or by compiling on the reference backend."""
    env = _env(site, _entry_point_dist(tmp_path))
    code = ("import sys, dense_bridge as db; import dense_bridge.testing; names = db.available_backends(); "
            "db.compile(db.Dense(2, in_features=2), 'numpy', seed=0); "
            f"print('npx' in names, sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS + ('npx_adapter',)!r}))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "True []", run.stdout + run.stderr


# ------------------------------------------------------------------ register_backend's arguments
def test_register_backend_checks_its_arguments():
    from dense_bridge.registry import _backends as _registry

    with pytest.raises(TypeError, match="name must be.*Received: name=3"):
        db.register_backend(3, "x")
    with pytest.raises(db.SpecError, match="lower-case.*Received: name='Bad Name'"):
        db.register_backend("Bad Name", "x")
    with pytest.raises(db.SpecError, match="canonical"):
        db.register_backend("canonical", "x")
    with pytest.raises(db.SpecError, match="dotted module name.*Received: module='not a module'"):
        db.register_backend("fine", "not a module")
    with pytest.raises(TypeError, match="module must be.*Received: module=3"):
        db.register_backend("fine", 3)
    with pytest.raises(TypeError, match="install_hint"):
        db.register_backend("fine", "x", install_hint=3)
    with pytest.raises(db.SpecError, match="'torch' is already registered.*replace=True"):
        db.register_backend("torch", "my_torch_adapter")
    with pytest.raises(TypeError, match="lacks owns"):
        db.register_backend("empty", types.ModuleType("empty"))
    assert "fine" not in _registry.names() and "empty" not in _registry.names()


def test_a_registered_module_that_is_missing_names_its_install_hint():
    from dense_bridge.registry import _backends as _registry

    db.register_backend("ghost", "no_such_adapter_pkg", install_hint="pip install ghost-adapter")
    try:
        assert "ghost" not in db.available_backends()
        with pytest.raises(db.BackendUnavailableError, match="pip install ghost-adapter"):
            db.compile(db.Dense(2, in_features=2), "ghost")
        with pytest.raises(db.SpecError, match="already registered"):
            db.register_backend("ghost", "another_pkg")
        db.register_backend("ghost", "another_pkg", replace=True)
        assert _registry.backends()["ghost"].module == "another_pkg"
    finally:
        _registry.BACKENDS.pop("ghost", None)


# ------------------------------------------------------------------ a backend without autograd
@pytest.fixture
def forward_only():
    """The numpy reference as a module object whose manifest declares no gradients and whose
    trace runs forward only (grad_out=None), owning the reference's objects first."""
    from dense_bridge.registry import _backends as _registry
    from dense_bridge.registry._manifest import Manifest

    reference = _registry.get_adapter("numpy")
    module = types.ModuleType("forward_only_adapter")
    for verb in dir(reference):
        if not verb.startswith("_"):
            setattr(module, verb, getattr(reference, verb))
    seen = []

    def trace(native, inputs, grad_out):
        seen.append(grad_out)
        assert grad_out is None, "an adapter without gradients is traced forward only"
        out = reference.trace(native, inputs, np.zeros_like(np.asarray(native.forward(*inputs))))
        return type(out)([type(l)(l.output, (), {}) for l in out.layers])

    def capture(model, inputs, layers, *, cotangent, select=None, grads=True):
        assert not grads
        return reference.capture(model, inputs, layers, cotangent=cotangent, select=select, grads=False)

    module.trace, module.capture = trace, capture
    module.MANIFEST = Manifest(capabilities=frozenset(), owner_priority=100)
    db.register_backend("fwd", module)
    try:
        yield seen
    finally:
        _registry.BACKENDS.pop("fwd", None)


def test_forward_only_backend_compares_outputs_and_says_gradients_were_not_compared(forward_only):
    spec = db.Sequential([db.Dense(4, in_features=3, activation="tanh"), db.Dense(2)])
    a = db.compile(spec, "fwd", seed=0)
    assert db.backend(a) == "fwd"
    b = db.compile(spec, "fwd", seed=0)
    report = db.testing.compare(a, b, grads=False)
    assert report.passed and forward_only and all(g is None for g in forward_only)
    assert not any(r.quantity.startswith("dL/") for r in report.rows)
    assert "gradients were NOT compared" in str(report) and "gradients were NOT compared" in report.to_dict()["notes"][-1]
    # the default grads=True compares outputs only on a forward-only side, and says which side it was
    default = db.testing.compare(a, b)
    assert default.passed and not any(r.quantity.startswith("dL/") for r in default.rows)
    assert any("gradients were NOT compared" in n and "'fwd'" in n and "forward only" in n for n in default.notes)
    models = db.testing.compare_models(a, b, [np.ones((2, 3), np.float32)], grads=False)
    assert models.passed and any("gradients were NOT compared" in n for n in models.notes)
    default_models = db.testing.compare_models(a, b, [np.ones((2, 3), np.float32)])
    assert default_models.passed and any("gradients were NOT compared" in n and "forward only" in n
                                         for n in default_models.notes)


def test_a_missing_optional_verb_is_a_clear_error(forward_only):
    from dense_bridge.registry._backends import optional_verb

    with pytest.raises(db.ConversionError, match="reading x needs the 'no_such_verb' verb.*'fwd' backend"):
        optional_verb("fwd", "no_such_verb", "reading x")


# ------------------------------------------------------------------ capabilities: groups of verbs, all or none
RUNNING_IMPORTS = ("from ._trace import run_layer, trace, train_sgd\nfrom ._capture import capture\n"
                   "from ._models import walk\n")

NORUN_SUITE = '''\
import dense_bridge as db
from dense_bridge.testing.conformance import AdapterConformance

db.register_backend("norun", "norun_adapter")


class TestNorun(AdapterConformance):
    backend = "norun"
'''


@pytest.fixture(scope="module")
def norun_site(tmp_path_factory) -> Path:
    """``norun_adapter``: the numpy reference without the ``running`` capability (its ``__init__``
    exports no trace, capture, walk, run_layer or train_sgd)."""
    root = tmp_path_factory.mktemp("norun")
    package = root / "norun_adapter"
    shutil.copytree(ROOT / "backends" / "numpy", package, ignore=shutil.ignore_patterns("__pycache__"))
    init = (package / "__init__.py").read_text()
    assert RUNNING_IMPORTS in init
    init = init.replace(RUNNING_IMPORTS, "")
    for verb in ("trace", "capture", "walk", "train_sgd", "run_layer"):
        init = init.replace(f'"{verb}", ', "").replace(f', "{verb}"', "")
    (package / "__init__.py").write_text(init)
    return root


@pytest.fixture
def norun(norun_site, monkeypatch):
    from dense_bridge.registry import _backends as _registry

    monkeypatch.syspath_prepend(str(norun_site))
    db.register_backend("norun", "norun_adapter")
    try:
        yield "norun"
    finally:
        _registry.BACKENDS.pop("norun", None)


def test_a_backend_that_cannot_run_models_compiles_converts_and_says_why_it_cannot_compare(norun):
    from dense_bridge.registry._backends import get_adapter, offers

    adapter = get_adapter("norun")
    assert not hasattr(adapter, "trace") and not hasattr(adapter, "capture")
    assert not offers("norun", "running") and offers("norun", "files") and offers("numpy", "running")
    spec = db.Sequential([db.Dense(5, in_features=3, activation="relu", bias_init="normal"), db.Dense(2)])
    model = db.compile(spec, "norun", seed=0)
    assert db.backend(model) == "norun" and db.to_spec(model) == spec
    ref = db.compile(spec, "numpy", seed=0)
    want = db.get_params(ref)
    assert all(np.array_equal(db.get_params(model)[k], want[k]) for k in want)
    there = db.convert(model, to="numpy")
    assert db.backend(there) == "numpy" and all(np.array_equal(db.get_params(there)[k], want[k]) for k in want)
    back = db.convert(ref, to="norun")
    assert db.backend(back) == "norun" and all(np.array_equal(db.get_params(back)[k], want[k]) for k in want)
    db.set_params(model, {k: v + 1 for k, v in want.items()})
    assert np.array_equal(db.get_params(model)["1.bias"], want["1.bias"] + 1)
    needs = r"comparing a \(a 'norun' model\) needs the 'running' capability.*trace, capture, walk, run_layer.*'norun'"
    with pytest.raises(db.ConversionError, match=needs):
        db.testing.compare(model, ref)
    with pytest.raises(db.ConversionError, match=needs):
        db.testing.compare_models(model, ref, [np.ones((2, 3), np.float32)])
    with pytest.raises(db.ConversionError, match="comparing b .*'running' capability"):
        db.testing.compare(ref, model, grads=False)


def test_the_conformance_suite_skips_the_running_checks_of_a_backend_without_them(norun_site, tmp_path):
    (tmp_path / "test_norun_conformance.py").write_text(NORUN_SUITE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir",
                          str(tmp_path), str(tmp_path)], cwd=tmp_path, env=_env(norun_site), capture_output=True,
                         text=True, timeout=600)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0 and re.search(r"\d+ passed", run.stdout), tail
    assert "does not offer the 'running' capability" in run.stdout and " failed" not in run.stdout, tail


def _reference_module(name: str, drop=(), **extra) -> types.ModuleType:
    """The numpy reference adapter's verbs in a module of its own, less ``drop``, plus ``extra``."""
    from dense_bridge.registry._backends import get_adapter

    reference = get_adapter("numpy")
    module = types.ModuleType(name)
    for verb in dir(reference):
        if not verb.startswith("_") and verb not in drop:
            setattr(module, verb, getattr(reference, verb))
    for verb, value in extra.items():
        setattr(module, verb, value)
    return module


def _no_verb(*args, **kwargs):
    raise AssertionError("never called")


@pytest.mark.parametrize("drop, extra, message", [
    (("capture",), {}, r"part of the 'running' capability \(trace, walk, run_layer\) but lacks capture"),
    (("file_info", "write_file"), {}, r"part of the 'files' capability \(read_file\) but lacks file_info, write_file"),
    ((), {"lora_base": _no_verb, "read_lora": _no_verb}, r"part of the 'lora' capability \(lora_base, read_lora\) "
                                                         r"but lacks write_lora, lora_heads"),
    (("trace", "capture", "walk", "run_layer"), {}, r"offers train_sgd without the 'running' capability"),
    ((), {"lora_quantized": _no_verb, "lora_dequantize": _no_verb, "lora_requantize": _no_verb,
          "replace_lora": _no_verb}, r"'quant_lora' capability needs the 'lora' capability"),
    ((), {"parallel_state": _no_verb}, r"part of the 'parallel' capability"),
], ids=["running", "files", "lora", "extra-alone", "needs", "parallel"])
def test_half_a_capability_is_refused_at_registration(drop, extra, message):
    from dense_bridge.registry import _backends as _registry

    module = _reference_module("half_adapter", drop, **extra)
    with pytest.raises(TypeError, match=message):
        db.register_backend("half", module)
    assert "half" not in _registry.names()


def test_a_manifest_capability_must_match_the_verbs():
    from dense_bridge.registry import _backends as _registry
    from dense_bridge.registry._manifest import PARALLEL, FileFormat, Manifest

    module = _reference_module("declaring_adapter", MANIFEST=Manifest(capabilities=frozenset({PARALLEL})))
    with pytest.raises(TypeError, match="manifest declares the 'parallel' capability but it offers none of it"):
        db.register_backend("declaring", module)
    module = _reference_module("formats_adapter", ("file_info", "read_file", "write_file"),
                               MANIFEST=Manifest(formats=(FileFormat("x", container="x"),)))
    with pytest.raises(TypeError, match="declares file formats but it lacks the 'files' capability"):
        db.register_backend("formats", module)
    assert "declaring" not in _registry.names() and "formats" not in _registry.names()


def test_half_a_capability_registered_by_name_is_refused_when_first_imported(norun_site, tmp_path, monkeypatch):
    """A dotted name is imported on first use, so the check runs then: the backend is unusable
    with an error naming what it lacks."""
    from dense_bridge.registry import _backends as _registry

    package = tmp_path / "halfname_adapter"
    shutil.copytree(norun_site / "norun_adapter", package, ignore=shutil.ignore_patterns("__pycache__"))
    init = package / "__init__.py"
    init.write_text(init.read_text() + "\nfrom ._capture import capture  # the running capability, half of it\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    db.register_backend("halfname", "halfname_adapter")
    try:
        with pytest.raises(db.BackendUnavailableError, match=r"'halfname'.*part of the 'running' capability "
                                                             r"\(capture\) but lacks trace, walk, run_layer"):
            db.compile(db.Dense(2, in_features=2), "halfname")
    finally:
        _registry.BACKENDS.pop("halfname", None)
