"""Flax .msgpack and Equinox .eqx files through db.load, the CLI's convert/inspect/check, and bad input.

The adapters write and read them (``backends/flax/_files.py``, ``backends/equinox/_files.py``);
these tests check the routing: the core sniffs the container, names the framework, and moves the
parameters bit for bit to every other framework's file and back.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db
from conftest import require_backend
from dense_bridge.cli import _main as cli
from dense_bridge.checkpoints._native import write_native

SPEC = db.Sequential([db.Dense(6, in_features=4, activation="tanh"), db.Dense(3, mask=np.tri(6, 3, dtype=bool))])
FILES = {"flax": "model.msgpack", "equinox": "model.eqx"}


def _saved(tmp_path, backend):
    require_backend(backend)
    model = db.compile(SPEC, backend, seed=3)
    path = str(tmp_path / FILES[backend])
    assert write_native(model, backend, path) == [path]
    return model, path


@pytest.mark.parametrize("backend", sorted(FILES))
def test_load_reads_the_file_with_a_spec_or_like_bit_for_bit(tmp_path, backend):
    model, path = _saved(tmp_path, backend)
    want = db.get_params(model)
    spec, params = db.load(path, spec=SPEC)
    assert spec == SPEC and sorted(params) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(params[k], np.asarray(want[k]))
    again = db.load(path, backend, like=model)
    assert db.testing.compare(again, model).passed
    with pytest.raises(db.CheckpointError, match="holds parameters but not the model's structure"):
        db.load(path)
    with pytest.raises(db.CheckpointError, match="does not match the spec"):
        db.load(path, spec=db.Sequential([db.Dense(6, in_features=5), db.Dense(3)]))


@pytest.mark.parametrize("backend", sorted(FILES))
def test_cli_converts_to_every_framework_file_and_back(tmp_path, backend, capsys):
    model, path = _saved(tmp_path, backend)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC.to_config()))
    want = {k: np.asarray(v) for k, v in db.get_params(model).items()}
    outputs = {"torch": "t.pt", "keras": "k.weights.h5", "mlx": "m.safetensors", "canonical": "c.safetensors",
               "flax": "f.msgpack", "equinox": "e.eqx"}
    for target, name in outputs.items():
        if target != "canonical" and target not in db.available_backends():
            continue
        out = str(tmp_path / name)
        assert cli.main(["convert", path, "--to", target, "-o", out, "--spec", str(spec_file), "--no-progress"]) == 0
        _, got = db.load(out, spec=SPEC)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{backend} -> {target}: {k}")
        back = str(tmp_path / ("back_" + FILES[backend]))
        assert cli.main(["convert", out, "--to", backend, "-o", back, "--spec", str(spec_file), "--no-progress"]) == 0
        _, got = db.load(back, spec=SPEC)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{target} -> {backend}: {k}")
    capsys.readouterr()
    assert cli.main(["inspect", path, "--spec", str(spec_file)]) == 0
    assert backend.capitalize()[:3].lower() in capsys.readouterr().out.lower()
    assert cli.main(["check", path, str(tmp_path / "c.safetensors"), "--spec", str(spec_file)]) == 0


@pytest.mark.parametrize("backend", sorted(FILES))
def test_a_wrong_extension_or_a_damaged_file_is_a_clear_error_and_writes_nothing(tmp_path, backend):
    model, path = _saved(tmp_path, backend)
    with pytest.raises(db.CheckpointError, match=r"\.msgpack|\.eqx"):
        write_native(model, backend, str(tmp_path / "model.bin"))
    assert not (tmp_path / "model.bin").exists()
    raw = Path(path).read_bytes()
    cut = tmp_path / ("cut" + FILES[backend][5:])
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(db.CheckpointError, match="cut"):
        db.load(str(cut), spec=SPEC)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC.to_config()))
    out = tmp_path / "never.safetensors"
    assert cli.main(["convert", str(cut), "--to", "canonical", "-o", str(out), "--spec", str(spec_file)]) == 2
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [FILES[backend], cut.name, "spec.json"])


def test_an_eqx_file_claiming_a_huge_record_is_refused_by_load_before_allocating(tmp_path):
    import io
    import tracemalloc

    require_backend("equinox")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (60000, 60000)})
    bomb = tmp_path / "bomb.eqx"
    bomb.write_bytes(header.getvalue() + b"\0" * 2000)
    tracemalloc.start()
    try:
        with pytest.raises(db.CheckpointError, match="bomb.eqx.*claims"):
            db.load(str(bomb), spec=SPEC)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_msgpack_is_told_apart_from_pickle_and_needs_its_extension(tmp_path):
    _, path = _saved(tmp_path, "flax")
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(Path(path).read_bytes())
    with pytest.raises(db.CheckpointError, match="match no supported format.*Flax .msgpack"):
        db.load(str(renamed), spec=SPEC)
    with pytest.raises(db.CheckpointError, match="holds flax weights, not torch"):
        db.load(path, spec=SPEC, format="torch")
