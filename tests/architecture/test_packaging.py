"""Packaging: import pulls in no framework; the wheel installs dense_bridge.backends only."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "tensorflow", "keras", "mlx", "jax", "safetensors", "h5py")


def test_import_dense_bridge_imports_no_framework():
    code = ("import sys, dense_bridge as db; db.Dense(3); db.available_backends(); "
            "db.compile(db.Dense(2, in_features=2), 'numpy', seed=0); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_import_dense_bridge_loads_nothing_until_a_name_is_used():
    """``import dense_bridge`` loads neither numpy nor the spec modules (import in < 0.1 s); every
    public name still resolves, to the same object its module defines, and ``dir`` lists it."""
    code = ("import sys, dense_bridge as db; before = sorted(m for m in sys.modules "
            "if m == 'numpy' or m.startswith('dense_bridge.')); "
            "from dense_bridge import specs, checkpoints, testing; "
            "assert db.Dense is specs.Dense and db.save is checkpoints.save and db.testing is testing; "
            "assert all(hasattr(db, n) for n in db.__all__) and set(db.__all__) <= set(dir(db)); "
            "print(before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['dense_bridge._errors', 'dense_bridge._version']", out.stdout


def test_unknown_attribute_is_an_attribute_error():
    import dense_bridge as db

    with pytest.raises(AttributeError, match="no attribute 'Dence'"):
        db.Dence  # noqa: B018


def test_missing_framework_names_the_extra(monkeypatch):
    import dense_bridge as db
    from dense_bridge.registry import _backends as _registry

    monkeypatch.setattr(_registry, "_installed", lambda module: module == "numpy")
    with pytest.raises(db.BackendUnavailableError, match=r"pip install 'dense-bridge\[torch\]'"):
        db.compile(db.Dense(2, in_features=2), "torch")
    assert _registry.available_backends() == ["numpy"]


def test_wheel_contains_dense_bridge_backends_and_no_top_level_backends(tmp_path):
    pytest.importorskip("setuptools")
    # built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds, and a
    # stale build/ from an earlier run makes the next build fail on files that exist
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.so"))
    out = tmp_path / "wheel"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out)], capture_output=True, text=True)
    # setuptools is in the test extra, so the build has what it needs: a failure is the subject failing
    assert result.returncode == 0, f"the wheel did not build: {result.stderr.strip()[-2000:]}"
    wheel = next(out.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "dense_bridge/backends/__init__.py" in names and "dense_bridge/backends/numpy/__init__.py" in names
    for fw in ("numpy", "torch", "keras", "mlx"):
        assert f"dense_bridge/backends/{fw}/_arrays.py" in names, fw
        assert f"dense_bridge/backends/{fw}/_manifest.py" in names, fw  # discovered, never listed
    assert not any(n.startswith("backends/") for n in names)
    assert "dense_bridge/testing/conformance.py" in names and "dense_bridge/adapter_kit.py" in names
