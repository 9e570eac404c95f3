"""Every malformed checkpoint of ``hostile_checkpoints`` is refused cleanly.

For each of the ~90 canonical cases (single file and sharded, float32 and bfloat16) and the ~60
Keras ``.weights.h5`` cases (read without a Keras model when the target is another backend): ``db.load`` with no
backend and on every installed backend raises a ``CheckpointError`` naming the file, and the
three CLI commands (``inspect``, ``convert``, ``check``, run through ``dense_bridge.cli._main.main``
exactly as the console script does) exit 2 with a one-line error naming it and no traceback.

All of it runs in one subprocess whose address space is capped at its size after importing the
frameworks + 256 MiB (``RLIMIT_AS``): a case that tried to allocate what a header claims fails
there. Each case also runs under a 10 s alarm (a FIFO can block an open() forever), and the whole
subprocess under a timeout, so nothing can hang the suite.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import dense_bridge as db

import hostile_checkpoints

RUNNER = textwrap.dedent(r"""
    import contextlib, io, json, os, resource, signal, sys, warnings
    warnings.simplefilter("ignore")
    import dense_bridge as db
    from dense_bridge.cli import _main as cli

    cases = json.loads(sys.argv[1])
    out_dir = sys.argv[2]
    backends = [b for b in db.available_backends() if b != "numpy"]
    for b in backends:  # frameworks fully started before the address-space cap
        db.get_params(db.compile(db.Dense(2, in_features=2), b, seed=0))
    vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))

    class Hang(Exception):
        pass

    def on_alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, on_alarm)

    def guarded(fn):
        signal.alarm(10)
        try:
            return fn()
        finally:
            signal.alarm(0)

    def load_result(path, backend):
        try:
            guarded(lambda: db.load(path, backend))
        except db.CheckpointError as exc:
            return "CheckpointError", path in str(exc)
        except Hang:
            return "HANG", False
        except BaseException as exc:
            return type(exc).__name__ + ": " + str(exc)[:200], False
        return "LOADED", False

    def cli_result(args, path):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = guarded(lambda: cli.main(args))
        except Hang:
            return "HANG", False
        except BaseException as exc:
            return type(exc).__name__ + ": " + str(exc)[:200], False
        text = err.getvalue()
        return code, path in text and "Traceback" not in text and len(text.strip().splitlines()) == 1

    results = {}
    for case, path in cases.items():
        r = {}
        for backend in [None] + db.available_backends():
            r[f"load:{backend}"] = load_result(path, backend)
        target = os.path.join(out_dir, case + ".safetensors")  # one each: a leftover blames its own case
        r["cli:inspect"] = cli_result(["inspect", path], path)
        r["cli:convert"] = cli_result(["convert", path, "--to", "numpy", "-o", target], path)
        r["cli:check"] = cli_result(["check", path, path], path)
        r["no output"] = (not os.path.exists(target), True)
        results[case] = r
    print(json.dumps(results))
""")


#: .weights.h5 cases whose structure is readable: ``inspect`` may list them (exit 0)
#: (the spec, embedded or given, is compared with the file's names, shapes and dtypes first; only
#: compressed values that do not decompress pass that, and every command reading values refuses them)
INSPECT_SHOWS_H5 = {"corrupt_gzip"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("hostile"))
    cases = hostile_checkpoints.make_all(directory)
    if "keras" in db.available_backends():  # the .weights.h5 cases need Keras to write the valid file
        cases.update(hostile_checkpoints.make_h5(directory))
    out = str(tmp_path_factory.mktemp("out"))
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases), out], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return cases, json.loads(run.stdout.strip().splitlines()[-1])


def test_there_are_at_least_60_cases_of_each_kind_needed(results):
    cases, _ = results
    assert len(cases) >= 60
    for kind in ("single-float32", "single-bfloat16", "sharded-float32", "sharded-bfloat16"):
        assert sum(c.startswith(kind) for c in cases) >= 10, kind
    if "keras" in db.available_backends():
        assert sum(c.startswith("h5-") for c in cases) >= 40


@pytest.mark.parametrize("case", sorted(
    f"{kind}-{dtype}-{name}" for kind, table in (("single", hostile_checkpoints.SINGLE),
                                                 ("sharded", hostile_checkpoints.SHARDED))
    for dtype in hostile_checkpoints.SPEC for name in table)
    + [f"h5-{dtype}-{name}" for dtype in hostile_checkpoints.SPEC for name in hostile_checkpoints.H5])
def test_every_reader_refuses_the_case_cleanly(results, case):
    _, got = results
    if case.startswith("h5-") and "keras" not in db.available_backends():
        pytest.skip("the .weights.h5 cases need Keras to write the valid file they break")
    r = got[case]
    for key, (outcome, names_file) in r.items():
        if key.startswith("load:"):
            assert outcome == "CheckpointError" and names_file, (key, outcome)
        elif key == "cli:inspect" and case.startswith("h5-") and outcome == 0:
            # inspect lists an HDF5 file's structure without reading values or matching it to the
            # spec: a file that disagrees with its spec (or whose compressed values are corrupt)
            # is shown as it is; every command that reads values refuses it (asserted here too)
            assert case.split("-", 2)[2] in INSPECT_SHOWS_H5, case
        elif key.startswith("cli:"):
            assert outcome == 2 and names_file, (key, outcome)
        else:
            assert outcome is True, key
    assert {f"load:{b}" for b in [None] + db.available_backends()} <= set(r)


def test_a_compressed_weights_file_larger_than_memory_is_refused_before_it_is_unpacked(tmp_path):
    """50 MB of gzip that unpacks to 49 GiB: no size in the file is wrong, so the stated limit
    (MemAvailable) refuses it, as a CheckpointError naming the file, before any allocation
    (the same capped subprocess as above: a 49 GiB array would fail there as MemoryError)."""
    if "keras" not in db.available_backends():
        pytest.skip("the .weights.h5 cases need Keras to write the valid file they break")
    path = hostile_checkpoints.make_h5_bomb(str(tmp_path))
    assert os.path.getsize(path) < 64 << 20
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps({"bomb": path}), str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])["bomb"]
    for key, (outcome, names_file) in r.items():
        if key.startswith("load:"):
            assert outcome == "CheckpointError" and names_file, (key, outcome)
        elif key != "cli:inspect":  # inspect lists the structure, reads no values
            assert outcome in (2, True) and names_file, (key, outcome)
