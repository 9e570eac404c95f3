"""The dense-bridge command as a user runs it: a subprocess, its exit code, stdout and stderr."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dense_bridge as db

# what a user gets: no TF log level of our choosing, so the CLI's own default is what is tested
ENV = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
ENV.pop("DENSE_BRIDGE_DEBUG", None)


def cli(*args, cwd=None, timeout=60, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dense_bridge.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout, env=ENV, preexec_fn=preexec_fn)


def spec():
    return db.Sequential([db.Dense(16, in_features=8, activation="relu"), db.Dense(4, activation="softmax")])


@pytest.fixture
def files(tmp_path):
    """A canonical checkpoint, its spec as JSON, and a second checkpoint with other weights."""
    db.save(db.compile(spec(), "numpy", seed=0), tmp_path / "m.safetensors")
    db.save(db.compile(spec(), "numpy", seed=1), tmp_path / "other.safetensors")
    (tmp_path / "spec.json").write_text(json.dumps(spec().to_config()))
    return tmp_path


def assert_one_line_error(run: subprocess.CompletedProcess, *needles: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr and lines[0].startswith("dense-bridge ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def bits(params):
    return {k: (v.dtype.name, v.shape, np.ascontiguousarray(v).tobytes()) for k, v in params.items()}


# ----------------------------------------------------------------------------- help
@pytest.mark.parametrize("command", [[], ["demo"], ["convert"], ["check"], ["inspect"]])
def test_help(command):
    run = cli(*command, "--help")
    assert run.returncode == 0 and "usage: dense-bridge" in run.stdout and run.stderr == ""


def test_no_command_is_a_usage_error():
    run = cli()
    assert run.returncode == 2 and "usage:" in run.stderr and "Traceback" not in run.stderr


# ----------------------------------------------------------------------------- demo
def test_demo_runs_everything_and_prints_the_table():
    run = cli("demo", timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "step" in out and "max abs err" in out and "tol units" in out and "result" in out
    assert "ALL PASS" in out and "FAIL" not in out
    for b in db.available_backends():
        assert b in out
    for b in set(db.available_backends()) - {"numpy", "torch" if "torch" in db.available_backends() else "numpy"}:
        assert f"{b} vs" in out  # outputs and gradients checked on every other framework
    assert "save + load canonical" in out and "bit-identical" in out
    assert run.stderr.strip() == "", run.stderr  # no framework noise


# ----------------------------------------------------------------------------- convert / inspect / check
def test_convert_round_trip_through_torch(files):
    pytest.importorskip("torch")
    run = cli("convert", files / "m.safetensors", "--to", "torch", "-o", files / "m.pt")
    assert run.returncode == 0 and "converted" in run.stdout, run.stderr
    run = cli("convert", files / "m.pt", "--to", "mlx", "-o", files / "m.npz")
    assert_one_line_error(run, "--spec")  # a state dict has no structure
    run = cli("convert", files / "m.pt", "--to", "canonical", "-o", files / "back.safetensors", "--spec",
              files / "spec.json", "--json")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["out"] == [str(files / "back.safetensors")] and summary["tensors"] == 4
    assert bits(db.load(files / "back.safetensors")[1]) == bits(db.load(files / "m.safetensors")[1])


def test_convert_sharded_with_progress(files):
    run = cli("convert", files / "m.safetensors", "--to", "canonical", "-o", files / "s" / "x.safetensors",
              "--max-shard-size", "300B", "--progress")
    assert_one_line_error(run, "does not exist")
    os.mkdir(files / "s")
    run = cli("convert", files / "m.safetensors", "--to", "canonical", "-o", files / "s" / "x.safetensors",
              "--max-shard-size", "300B", "--progress")
    assert run.returncode == 0, run.stderr
    assert "100.0%" in run.stderr and "shards" in run.stdout
    assert "x.safetensors.index.json" in os.listdir(files / "s")
    assert bits(db.load(files / "s" / "x.safetensors")[1]) == bits(db.load(files / "m.safetensors")[1])
    run = cli("convert", files / "m.safetensors", "--to", "canonical", "-o", files / "y.safetensors")
    assert run.stderr == ""  # no bar when stderr is not a terminal


def test_inspect(files):
    run = cli("inspect", files / "m.safetensors")
    assert run.returncode == 0, run.stderr
    assert "Dense" in run.stdout and "relu" in run.stdout and "(8, 16)" in run.stdout and "212 parameters" in run.stdout
    doc = json.loads(cli("inspect", files / "m.safetensors", "--json").stdout)
    assert doc["num_params"] == 212 and db.from_config(doc["spec"]) == spec()
    assert [t["name"] for t in doc["tensors"]] == ["0.kernel", "0.bias", "1.kernel", "1.bias"]
    assert doc["layers"][0]["activation"] == "relu" and doc["layers"][1]["units"] == 4


def test_inspect_refuses_a_native_file_that_does_not_fit_the_spec_given(files):
    """inspect compares a native file's names, shapes and dtypes with the spec before showing it."""
    pytest.importorskip("torch")
    assert cli("convert", files / "m.safetensors", "--to", "torch", "-o", files / "m.pt").returncode == 0
    assert cli("inspect", files / "m.pt", "--spec", files / "spec.json").returncode == 0
    wider = db.Sequential([db.Dense(16, in_features=9, activation="relu"), db.Dense(4, activation="softmax")])
    (files / "wider.json").write_text(json.dumps(wider.to_config()))
    assert_one_line_error(cli("inspect", files / "m.pt", "--spec", files / "wider.json"), "m.pt", "(16, 9)")


def test_check_equivalent_and_not(files):
    run = cli("check", files / "m.safetensors", files / "m.safetensors")
    assert run.returncode == 0 and "PASS" in run.stdout, run.stdout + run.stderr
    run = cli("check", files / "m.safetensors", files / "other.safetensors")
    assert run.returncode == 1 and "FAIL" in run.stdout and "NOT equivalent" in run.stdout
    doc = json.loads(cli("check", files / "m.safetensors", files / "other.safetensors", "--json").stdout)
    assert doc["equivalent"] is False and doc["report"]["passed"] is False


def test_check_across_frameworks(files):
    pytest.importorskip("torch")
    assert cli("convert", files / "m.safetensors", "--to", "torch", "-o", files / "m.pt").returncode == 0
    run = cli("check", files / "m.pt", files / "m.safetensors", "--spec", files / "m.safetensors", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(run.stdout)
    assert doc["a"]["backend"] == "torch" and doc["b"]["backend"] == "numpy"
    assert all(p["bit_identical"] for p in doc["parameters"])


def test_check_strict_fails_a_bfloat16_copy_and_writes_html(files, tmp_path):
    spec, params = db.load(files / "m.safetensors")
    half = db.from_config(json.loads(json.dumps(spec.to_config()).replace('"float32"', '"bfloat16"')))
    db.save((half, {k: v.astype(db._dtypes.numpy_dtype("bfloat16")) for k, v in params.items()}),
            tmp_path / "half.safetensors")
    page = tmp_path / "report.html"
    loose = cli("check", tmp_path / "half.safetensors", files / "m.safetensors", "--html", page)
    assert loose.returncode == 0, loose.stdout + loose.stderr  # numerically within bfloat16 tolerance
    assert "<svg" in page.read_text()
    strict = cli("check", tmp_path / "half.safetensors", files / "m.safetensors", "--strict")
    assert strict.returncode == 1 and "strict" in strict.stdout


# ----------------------------------------------------------------------------- bad input
def _bad_inputs(d):
    (d / "empty.safetensors").write_bytes(b"")
    data = (d / "m.safetensors").read_bytes()
    (d / "trunc.safetensors").write_bytes(data[:-40])
    (d / "corrupt.safetensors").write_bytes(data[:8] + b"{\x00\x01" + data[11:])
    (d / "text.pt").write_text("not a checkpoint")
    (d / "afile").write_text("x")
    other = db.Sequential([db.Dense(5, in_features=8), db.Dense(4)])
    (d / "other.json").write_text(json.dumps(other.to_config()))
    return [
        (["inspect", d / "empty.safetensors"], "empty"),
        (["inspect", d / "trunc.safetensors"], "truncated"),
        (["inspect", d / "corrupt.safetensors"], "corrupted header"),
        (["inspect", d / "text.pt"], "match no supported format"),
        (["inspect", d / "missing.safetensors"], "no such file"),
        (["inspect", d], "is a directory"),
        (["convert", d / "m.safetensors", "--to", "canonical", "-o", d / "out.safetensors", "--spec",
          d / "other.json"], "does not match the spec"),
        (["convert", d / "m.safetensors", "--to", "canonical", "-o", d / "afile" / "x.safetensors"],
         "is a file, not a directory"),
        (["convert", d / "m.safetensors", "--to", "canonical", "-o", d], "is a directory"),
        (["convert", d / "m.safetensors", "--to", "canonical", "-o", d / "out.safetensors", "--max-shard-size",
          "lots"], "max_shard_size"),
        (["convert", d / "m.safetensors", "--to", "keras", "-o", d / "out.pt"], ".weights.h5"),
        (["check", d / "m.safetensors", d / "text.pt"], "text.pt"),
    ]


def test_bad_inputs_one_line_exit_2_nothing_lost(files):
    (files / "out.safetensors").write_bytes(b"previous contents")
    cases = _bad_inputs(files)
    before = {n: (files / n).read_bytes() for n in os.listdir(files) if (files / n).is_file()}
    for args, needle in cases:
        assert_one_line_error(cli(*args), needle)
    after = {n: (files / n).read_bytes() for n in os.listdir(files) if (files / n).is_file()}
    assert after == before  # no temporaries, no partial outputs, the old out.safetensors untouched


def test_write_failing_mid_way_keeps_the_old_output(files):
    """The output filesystem fills up (RLIMIT_FSIZE) half way through: exit 2, old file intact."""
    import resource
    import signal

    spec_big = db.Sequential([db.Dense(64, in_features=64) for _ in range(4)])  # 66 kB
    db.save(db.compile(spec_big, "numpy", seed=0), files / "big.safetensors")
    (files / "out.safetensors").write_bytes(b"previous contents")

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))

    run = cli("convert", files / "big.safetensors", "--to", "canonical", "-o", files / "out.safetensors",
              preexec_fn=limit)
    assert_one_line_error(run, "nothing was changed on disk")
    assert (files / "out.safetensors").read_bytes() == b"previous contents"
    assert not [n for n in os.listdir(files) if ".tmp-" in n]


def test_keras_model_with_dense_bridge_layers_inspects_in_a_fresh_process(tmp_path):
    """A .keras file using dense_bridge's own Keras classes (masked, gelu) reads in a new process:
    the CLI registers them with keras.saving before loading the model."""
    pytest.importorskip("keras")
    masked = db.Sequential([db.Dense(4, in_features=3, activation="gelu", mask=db.wiring.banded(3, 4, 1)),
                            db.Dense(2)])
    db.save(db.compile(masked, "numpy", seed=0), tmp_path / "m.safetensors")
    run = cli("convert", tmp_path / "m.safetensors", "--to", "keras", "-o", tmp_path / "x.keras", timeout=120)
    assert run.returncode == 0, run.stderr
    run = cli("inspect", tmp_path / "x.keras", "--json", timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # TensorFlow's start-up noise stays silenced
    doc = json.loads(run.stdout)
    assert db.from_config(doc["spec"]) == masked
    assert "0.mask" in [t["name"] for t in doc["tensors"]]
    assert cli("inspect", tmp_path / "x.keras", timeout=120).returncode == 0
