"""Nothing is lost: outputs never overwrite inputs; killed or failing writes of every output kind
leave the old output intact (or the converted one complete) and no temporaries behind.

- ``convert -o`` onto its source (by name, through a symlink, a hard link, onto an index's shard
  or the index a canonical save would write) and ``check --html`` onto any input: exit 2 with one
  line before anything is written, every file byte-identical afterwards.
- A convert to each output kind (canonical single and sharded, torch .pt/.safetensors, Keras
  .weights.h5/.keras, MLX .safetensors/.npz, Flax .msgpack, Equinox .eqx) under a file-size
  limit (RLIMIT_FSIZE in a subprocess): exit 2, one line naming the output and the limit, no
  traceback, no "Exception ignored", the previous output byte-identical, no temporaries.
- A convert loop to each output kind SIGKILLed at a random moment: the output loads as the old
  or the converted one exactly, and the next run reclaims the killed run's temporaries.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import checkpoints as checkpoint
from dense_bridge.checkpoints._io import RECLAIM_MIN_AGE_S

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
SPEC = db.Sequential([db.Dense(96, in_features=64, activation="relu"), db.Dense(32)])

#: (backend for --to, output file name): every output kind convert writes
KINDS = [("canonical", "out.safetensors"), ("torch", "out.pt"), ("torch", "out_torch.safetensors"),
         ("keras", "out.weights.h5"), ("keras", "out.keras"), ("mlx", "out_mlx.safetensors"),
         ("mlx", "out.npz"), ("flax", "out.msgpack"), ("equinox", "out.eqx")]


def _require(backend: str) -> None:
    if backend != "canonical" and backend not in db.available_backends():
        pytest.skip(f"framework for backend {backend!r} is not installed")


def cli(*args, timeout=300, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dense_bridge.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV, preexec_fn=preexec_fn)


def one_line_error(run: subprocess.CompletedProcess, *needles: str) -> str:
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr
    assert lines[0].startswith("dense-bridge ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def params_of(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for i, layer in enumerate(SPEC.layers):
        out[f"{i}.kernel"] = rng.standard_normal((layer.in_features, layer.units), dtype=np.float32)
        out[f"{i}.bias"] = np.full((layer.units,), seed, dtype=np.float32)
    return out


def snapshot(directory) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full) and not os.path.islink(full):
            with open(full, "rb") as f:
                out[name] = f.read()
    return out


def bits(params: dict) -> dict:
    return {k: np.ascontiguousarray(v).tobytes() for k, v in params.items()}


# ------------------------------------------------------------------ outputs over inputs
@pytest.fixture
def files(tmp_path):
    db.save((SPEC, params_of(1)), tmp_path / "a.safetensors")
    db.save((SPEC, params_of(2)), tmp_path / "b.safetensors")
    db.save((SPEC, params_of(3)), tmp_path / "sharded.safetensors", max_shard_size=20_000)
    (tmp_path / "spec.json").write_text(json.dumps(SPEC.to_config()))
    np.savez(tmp_path / "x.npz", np.ones((2, 64), np.float32))
    (tmp_path / "map.json").write_text('{"0": "0"}')
    os.symlink(tmp_path / "a.safetensors", tmp_path / "link.safetensors")
    os.link(tmp_path / "a.safetensors", tmp_path / "hard.safetensors")
    return tmp_path


def _shard(files) -> str:
    return next(n for n in os.listdir(files) if n.startswith("sharded-") and n.endswith(".safetensors"))


@pytest.mark.parametrize("case", ["same", "dot-slash", "symlink", "hardlink", "spec-file", "shard-of-index",
                                  "index-of-canonical-save", "native-onto-source"])
def test_convert_refuses_an_output_that_is_an_input(files, case):
    src, to, out, extra = files / "a.safetensors", "canonical", None, []
    if case == "same":
        out = src
    elif case == "dot-slash":
        out = f"{files}/./a.safetensors"
    elif case == "symlink":
        out = files / "link.safetensors"
    elif case == "hardlink":
        out = files / "hard.safetensors"
    elif case == "spec-file":
        out, extra = files / "spec.json", ["--spec", files / "spec.json"]
    elif case == "shard-of-index":
        src, out = files / "sharded.safetensors.index.json", files / _shard(files)
    elif case == "index-of-canonical-save":  # -o x.safetensors --max-shard-size writes x.safetensors.index.json
        src, out = files / "sharded.safetensors.index.json", files / "sharded.safetensors"
        extra = ["--max-shard-size", "20000"]
    elif case == "native-onto-source":
        to, out = "torch", files / "link.safetensors"
    before = snapshot(files)
    line = one_line_error(cli("convert", src, "--to", to, "-o", out, *extra), "would overwrite the input")
    assert str(out) in line
    assert snapshot(files) == before  # byte-identical, nothing added, no temporaries


def test_convert_library_refuses_an_output_that_is_an_input(files):
    before = snapshot(files)
    with pytest.raises(db.CheckpointError, match="would overwrite the input src"):
        checkpoint.convert_file(str(files / "sharded.safetensors.index.json"), "canonical", str(files / _shard(files)))
    with pytest.raises(db.CheckpointError, match="would overwrite the input src"):
        checkpoint.convert_file(str(files / "a.safetensors"), "canonical", str(files / "link.safetensors"))
    assert snapshot(files) == before


@pytest.mark.parametrize("html", ["a", "b", "link-to-b", "spec", "shard"])
def test_check_html_refuses_to_overwrite_an_input(files, html):
    a, b = files / "a.safetensors", files / "b.safetensors"
    target = {"a": a, "b": b, "spec": files / "spec.json"}.get(html)
    if html == "link-to-b":
        target = files / "html-link"
        os.symlink(b, target)
    if html == "shard":
        b = files / "sharded.safetensors.index.json"
        target = files / _shard(files)
    before = snapshot(files)
    one_line_error(cli("check", a, b, "--spec", files / "spec.json", "--html", target), "--html",
                   "would overwrite the input")
    assert snapshot(files) == before


def test_check_html_refuses_whole_model_inputs(files):
    before = snapshot(files)
    one_line_error(cli("check", files / "m1.pt", files / "m2.pt", "--inputs", files / "x.npz",
                       "--html", files / "x.npz"), "--html", "--inputs")
    one_line_error(cli("check", files / "m1.pt", files / "m2.pt", "--inputs", files / "x.npz",
                       "--mapping", files / "map.json", "--html", files / "map.json"), "--mapping")
    assert snapshot(files) == before


def test_check_html_elsewhere_is_written(files):
    run = cli("check", files / "a.safetensors", files / "a.safetensors", "--html", files / "report.html")
    assert run.returncode == 0, run.stderr
    assert (files / "report.html").read_text().lstrip().lower().startswith("<!doctype html")


# ------------------------------------------------------------------ disk full, every output kind
def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("to,name", KINDS)
def test_write_past_the_file_size_limit_is_one_clear_error(tmp_path, to, name):
    _require(to)
    src = tmp_path / "src.safetensors"
    db.save((SPEC, params_of(5)), src)  # ~38 kB of parameters
    out = tmp_path / name
    out.write_bytes(b"previous output")
    before = snapshot(tmp_path)
    run = cli("convert", src, "--to", to, "-o", out, preexec_fn=_limit_file_size(16_000))
    one_line_error(run, f"cannot write {out}", "RLIMIT_FSIZE", "nothing was changed on disk")
    assert snapshot(tmp_path) == before  # the old output intact, no partial file, no temporary


@pytest.mark.parametrize("to,name", KINDS)
def test_a_limit_below_the_file_header_is_refused_before_the_framework_writes(tmp_path, to, name):
    """Under a 100-byte limit HDF5 itself crashed (exit -11) when its first write was refused:
    the room is asked for before any framework's writer starts."""
    _require(to)
    src = tmp_path / "src.safetensors"
    db.save((SPEC, params_of(5)), src)
    before = snapshot(tmp_path)
    run = cli("convert", src, "--to", to, "-o", tmp_path / name, preexec_fn=_limit_file_size(100))
    one_line_error(run, f"cannot write {tmp_path / name}", "RLIMIT_FSIZE", "nothing was changed on disk")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ killed converts, every output kind
WORKER = textwrap.dedent("""
    import sys
    from dense_bridge import checkpoints as checkpoint
    srcs, to, out = sys.argv[1:3], sys.argv[3], sys.argv[4]
    checkpoint.convert_file(srcs[0], to, out, max_shard_size=SHARD)  # imports done, the old output written
    print("ready", flush=True)
    k = 0
    while True:
        print("start", k % 2, flush=True)
        checkpoint.convert_file(srcs[k % 2], to, out, max_shard_size=SHARD)
        print("done", k % 2, flush=True)
        k += 1
""")


def _loaded_bits(out: str, to: str) -> dict:
    spec, params = db.load(out, spec=SPEC)  # some native files carry no spec
    assert spec == SPEC
    return bits(params)


@pytest.mark.parametrize("to,name", KINDS + [("canonical-sharded", "sharded_out.safetensors")])
def test_killed_convert_leaves_old_or_new_output_and_reclaims_temporaries(tmp_path, to, name):
    target = "canonical" if to == "canonical-sharded" else to
    _require(target)
    shard = "20000" if to == "canonical-sharded" else "None"
    srcs = [str(tmp_path / "gen0.safetensors"), str(tmp_path / "gen1.safetensors")]
    for k, src in enumerate(srcs):
        db.save((SPEC, params_of(10 + k)), src)
    out = str(tmp_path / "out" / name)
    os.mkdir(tmp_path / "out")
    expected = [bits(params_of(10)), bits(params_of(11))]
    rng = random.Random(hash(name) % 1000)
    for attempt in range(1 if target == "keras" else 2):  # Keras' start-up costs seconds per run
        proc = subprocess.Popen([sys.executable, "-c", f"SHARD = {shard}\n" + WORKER, *srcs, target, out],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.4))  # lands anywhere in one of the conversions
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        assert _loaded_bits(out, target) in expected  # old or converted, complete: never a mix or a partial file
    # what the killed runs left (temporaries, a sharded run's renamed shards) is reclaimed by the
    # next run once no process holds it; the test ages it past the reclaim guard instead of sleeping
    old = time.time() - RECLAIM_MIN_AGE_S - 60
    for n in os.listdir(tmp_path / "out"):
        os.utime(tmp_path / "out" / n, (old, old))
    files = checkpoint.convert_file(srcs[0], target, out, max_shard_size=None if shard == "None" else int(shard))["out"]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.path.basename(f) for f in files)
    assert _loaded_bits(out, target) == expected[0]
