"""Hostile ``.keras`` archives: no code from the file runs, no member expands without bound.

- A Lambda layer carries Python bytecode: the positive control loads the same file with Keras'
  safe mode off and the lambda runs (it writes a marker file); through dense_bridge it is refused
  and the marker never appears.
- A member that deflates from kilobytes to tens of megabytes (a decompression bomb, below Keras'
  own 4 GiB floor) is refused before Keras reads it.
- HDF5 links and external storage in ``.weights.h5`` are covered in test_hostile_checkpoints.py.
"""
from __future__ import annotations

import os
import zipfile

import pytest

import dense_bridge as db

from conftest import require_backend


def _lambda_model(path: str, marker: str) -> None:
    import keras

    x = keras.Input((4,))
    y = keras.layers.Dense(3)(x)
    y = keras.layers.Lambda(lambda t: (open(marker, "w").close(), t)[1])(y)  # noqa: SIM115 - the payload
    keras.Model(x, y).save(path)


def test_keras_lambda_code_is_refused_unrun(tmp_path):
    require_backend("keras")
    import keras

    path, marker = str(tmp_path / "lambda.keras"), str(tmp_path / "ran")
    _lambda_model(path, marker)
    os.remove(marker)  # saving traced the lambda once
    keras.saving.load_model(path, safe_mode=False)  # positive control: the file's code runs
    assert os.path.exists(marker)
    os.remove(marker)
    with pytest.raises(db.CheckpointError, match="Lambda"):
        db.load(path)
    assert not os.path.exists(marker)


def test_keras_archive_bomb_is_refused_before_keras_reads_it(tmp_path):
    require_backend("keras")
    import keras

    x = keras.Input((4,))
    keras.Model(x, keras.layers.Dense(3)(x)).save(tmp_path / "ok.keras")
    with zipfile.ZipFile(tmp_path / "ok.keras") as z:
        members = {n: z.read(n) for n in z.namelist()}
    bomb = tmp_path / "bomb.keras"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            if name == "config.json":
                data = data[:-1] + b" " * (64 << 20) + data[-1:]  # 64 MiB of blanks: valid JSON, ~64 kB stored
            z.writestr(name, data)
    assert os.path.getsize(bomb) < 1 << 20
    with pytest.raises(db.CheckpointError, match="decompression bomb"):
        db.load(str(bomb))
