"""Hostile arguments and declarations: every error is a clear DenseBridgeError (or TypeError).

Layout declarations that cannot be right (kernel and bias naming one attribute, a bias that is not
the kernel's units), and the checks every load path applies before allocating.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend


# ------------------------------------------------------------------ register_layout
def test_register_layout_refuses_kernel_and_bias_naming_one_attribute():
    with pytest.raises(db.SpecError, match="two different attributes.*kernel='w', bias='w'"):
        db.register_layout("some.pkg.Layer", kernel="w", bias="w", layout="in_out")


def _declared(cls, **kwargs):
    from dense_bridge.models import _layouts

    decl = db.register_layout(f"{cls.__module__}.{cls.__qualname__}", **kwargs)
    return decl, lambda: _layouts._DECLARED.pop(decl.cls)


def test_torch_declared_bias_that_is_not_the_units_is_refused():
    torch = pytest.importorskip("torch")

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 3))  # in_out: 5 in, 3 units
            self.b = torch.nn.Parameter(torch.randn(5))  # not (3,)

        def forward(self, x):
            return x @ self.w

    _, undo = _declared(Odd, kernel="w", bias="b", layout="in_out")
    try:
        with pytest.raises(db.ConversionError, match=r"bias attribute 'b' of shape \(5,\).*3 units"):
            db.to_spec(Odd())
        with pytest.raises(db.ConversionError, match="3 units"):
            db.get_params(Odd())
    finally:
        undo()


def test_mlx_declared_bias_that_is_not_the_units_is_refused():
    require_backend("mlx")
    import mlx.core as mx
    import mlx.nn as nn

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.zeros((3, 4))  # out_in: 3 units, 4 in
            self.b = mx.zeros((4,))

        def __call__(self, x):
            return x @ self.w.T

    _, undo = _declared(Odd, kernel="w", bias="b", layout="out_in")
    try:
        with pytest.raises(db.SpecError, match=r"bias 'b' of shape \(4,\).*3 units"):
            db.to_spec(Odd())
    finally:
        undo()


# ------------------------------------------------------------------ mappings
def _torch_pair():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    b = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return a, b


def _state(model) -> dict:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("replacement", [r"\9", r"\g<name>", r"\g<1", "\\"])
def test_bad_regex_replacement_is_a_spec_error_and_changes_nothing(replacement):
    a, b = _torch_pair()
    before = _state(b)
    with pytest.raises(db.SpecError, match="replacement"):
        db.transfer(a, b, mapping=[(r"(\d+)", replacement)])
    with pytest.raises(db.SpecError, match="replacement"):
        db.testing.compare_models(a, b, np.ones((2, 3), np.float32), mapping=[(r"(\d+)", replacement)])
    assert all(np.array_equal(v, _state(b)[k]) for k, v in before.items())


@pytest.mark.parametrize("mapping", [{}, [], {"nowhere": "0"}, [("zzz", "0")]])
def test_empty_or_non_matching_mapping_is_a_dense_bridge_error(mapping):
    a, b = _torch_pair()
    before = _state(b)
    with pytest.raises(db.DenseBridgeError):
        db.transfer(a, b, mapping=mapping)
    assert all(np.array_equal(v, _state(b)[k]) for k, v in before.items())


# ------------------------------------------------------------------ .npz given to the CLI and to MLX
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zipfile  # noqa: E402

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a terabyte claim believed dies here

    return subprocess.run([sys.executable, "-m", "dense_bridge.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV, preexec_fn=limit)


def one_line_error(run, *needles) -> str:
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _terabyte_npz(path) -> None:
    import io

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**6, 10**6)})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("arr_0.npy", header.getvalue() + b"\0" * 64)


@pytest.fixture
def models(tmp_path):
    torch = pytest.importorskip("torch")
    a, b = _torch_pair()
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return tmp_path


def test_cli_inputs_npy_where_npz_expected_is_one_line(models):
    np.save(models / "x.npy", np.ones((2, 3), np.float32))
    one_line_error(cli("check", models / "a.pt", models / "b.pt", "--trust-pickle", "--inputs", models / "x.npy"),
                   "--inputs", "x.npy", "single .npy")


def test_cli_inputs_npz_claiming_terabytes_is_one_line(models):
    _terabyte_npz(models / "x.npz")
    one_line_error(cli("check", models / "a.pt", models / "b.pt", "--trust-pickle", "--inputs", models / "x.npz"),
                   "--inputs", "8,000,000,000,000 bytes")


def test_cli_deep_json_mapping_and_spec_are_one_line(models):
    (models / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    np.savez(models / "x.npz", np.ones((2, 3), np.float32))
    one_line_error(cli("check", models / "a.pt", models / "b.pt", "--trust-pickle", "--inputs", models / "x.npz",
                       "--mapping", models / "deep.json"), "deep.json", "nested")
    (models / "deepspec.json").write_text("{" + '"a":' * 0 + '"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    db.save(db.compile(db.Dense(2, in_features=3), "numpy", seed=0), models / "m.safetensors")
    one_line_error(cli("inspect", models / "m.safetensors", "--spec", models / "deepspec.json"), "deepspec.json",
                   "nested")


def test_mlx_npz_claiming_terabytes_is_a_checkpoint_error(tmp_path):
    require_backend("mlx")
    _terabyte_npz(tmp_path / "w.npz")
    with pytest.raises(db.CheckpointError, match="w.npz.*8,000,000,000,000 bytes"):
        db.load(str(tmp_path / "w.npz"), spec=db.Dense(2, in_features=3), format="mlx")


# ------------------------------------------------------------------ NaN/Inf in inspect and convert
@pytest.fixture
def nonfinite(tmp_path):
    spec = db.Sequential([db.Dense(4, in_features=3), db.Dense(2)])
    params = {k: np.array(v) for k, v in db.get_params(db.compile(spec, "numpy", seed=0)).items()}
    params["0.kernel"][0, 0] = np.nan
    params["1.bias"][:] = np.inf
    db.save((spec, params), tmp_path / "nan.safetensors", allow_nonfinite=True)
    return tmp_path


def test_inspect_counts_nan_and_inf_per_tensor(nonfinite):
    import json

    run = cli("inspect", nonfinite / "nan.safetensors", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["nonfinite"] == {"0.kernel": 1, "1.bias": 2}
    run = cli("inspect", nonfinite / "nan.safetensors")
    assert "NaN/Inf: 0.kernel: 1 value; 1.bias: 2 values" in run.stdout
    db.save(db.compile(db.Dense(2, in_features=3), "numpy", seed=0), nonfinite / "ok.safetensors")
    assert "NaN/Inf: none" in cli("inspect", nonfinite / "ok.safetensors").stdout


@pytest.mark.parametrize("to,name", [("canonical", "out.safetensors"), ("torch", "out.pt"), ("mlx", "out.npz")])
def test_convert_refuses_nan_unless_allowed(nonfinite, to, name):
    if to != "canonical":
        require_backend(to)
    before = sorted(os.listdir(nonfinite))
    line = one_line_error(cli("convert", nonfinite / "nan.safetensors", "--to", to, "-o", nonfinite / name),
                          "nan.safetensors", "NaN")
    assert "Inf" in line and "kernel" in line
    assert sorted(os.listdir(nonfinite)) == before  # no output, no temporary
    run = cli("convert", nonfinite / "nan.safetensors", "--to", to, "-o", nonfinite / name, "--allow-nonfinite")
    assert run.returncode == 0, run.stderr
    spec = db.Sequential([db.Dense(4, in_features=3), db.Dense(2)])
    _, params = db.load(str(nonfinite / name), spec=spec, allow_nonfinite=True)
    assert np.isnan(params["0.kernel"][0, 0]) and np.isinf(params["1.bias"]).all()


# ------------------------------------------------------------------ a named state dict with spec=
def test_named_state_dict_with_spec_suggests_like(tmp_path):
    torch = pytest.importorskip("torch")

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.act, self.dec = torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.dec(self.act(self.enc(x)))

    model = Named()
    torch.save(model.state_dict(), tmp_path / "named.pt")
    spec = db.Sequential([db.Dense(4, in_features=3, activation="relu"), db.Dense(2)])
    with pytest.raises(db.CheckpointError, match=r"names its layers \(dec, enc\).*pass like="):
        db.load(str(tmp_path / "named.pt"), spec=spec)
    loaded = db.load(str(tmp_path / "named.pt"), "torch", like=Named())
    np.testing.assert_array_equal(loaded.enc.weight.detach().numpy(), model.enc.weight.detach().numpy())
