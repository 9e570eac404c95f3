"""Equivalence cannot be fooled by degenerate inputs: all-NaN/Inf inputs, or outputs that are all
NaN/Inf on both sides, make ``compare``/``compare_models`` raise a SpecError saying so, and
``dense-bridge check`` exit 2 with one line: never "equivalent".
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dense_bridge as db

SPEC = db.Sequential([db.Dense(4, in_features=3, activation="relu"), db.Dense(2)])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_compare_refuses_all_nonfinite_inputs(value):
    a, b = db.compile(SPEC, "numpy", seed=0), db.compile(SPEC, "numpy", seed=1)  # different models
    with pytest.raises(db.SpecError, match="every value is NaN or Inf"):
        db.testing.compare(a, b, inputs=np.full((2, 3), value))


def test_compare_with_some_finite_inputs_still_judges():
    a, b = db.compile(SPEC, "numpy", seed=0), db.compile(SPEC, "numpy", seed=1)
    x = np.array([[np.nan, 1.0, 2.0], [0.5, -1.0, 3.0]])
    assert not db.testing.compare(a, b, inputs=x).passed  # the finite row tells them apart


def test_compare_refuses_outputs_all_nonfinite_on_both_sides():
    nan = {k: np.full_like(v, np.nan) for k, v in db.get_params(db.compile(SPEC, "numpy", seed=0)).items()}
    a = db.compile(SPEC, "numpy", params=nan, allow_nonfinite=True)
    b = db.compile(SPEC, "numpy", params=nan, allow_nonfinite=True)
    with pytest.raises(db.SpecError, match="outputs are all NaN or Inf"):
        db.testing.compare(a, b)


def _torch_models(nan_weights: bool = False):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    a, b = torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.nn.Sequential(torch.nn.Linear(3, 2))
    if nan_weights:
        for m in (a, b):
            with torch.no_grad():
                m[0].weight.fill_(float("nan"))
    return a, b


def test_compare_models_refuses_all_nonfinite_inputs():
    a, b = _torch_models()
    with pytest.raises(db.SpecError, match="inputs\\[0\\]: every value is NaN or Inf"):
        db.testing.compare_models(a, b, [np.full((2, 3), np.nan, np.float32)])


def test_compare_models_refuses_outputs_all_nonfinite_on_both_sides():
    a, b = _torch_models(nan_weights=True)
    with pytest.raises(db.SpecError, match="outputs are all NaN or Inf"):
        db.testing.compare_models(a, b, [np.ones((2, 3), np.float32)])


def test_check_exits_2_with_one_line_on_all_nan_inputs(tmp_path):
    torch = pytest.importorskip("torch")
    a, b = _torch_models()
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    np.savez(tmp_path / "x.npz", np.full((2, 3), np.nan, np.float32))
    run = subprocess.run([sys.executable, "-m", "dense_bridge.cli", "check", str(tmp_path / "a.pt"),
                          str(tmp_path / "b.pt"), "--trust-pickle", "--inputs", str(tmp_path / "x.npz")],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore"))
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "NaN or Inf" in lines[0], run.stderr
    assert "equivalent" not in run.stdout
