"""Hostile Flax .msgpack and Equinox .eqx files: nothing is misread, nothing hangs or blows up.

- msgpack keys that collide once flattened (``0`` and ``"0"``, ``"a.b"`` beside ``{"a": {"b"}}``)
  are refused as ambiguous: which value would load otherwise depends on dictionary order.
- an .eqx record header with a negative or overflowing shape is refused at once (a negative
  dimension would make a reader seek backwards and loop forever while memory grows): run in
  a subprocess under a memory limit (RLIMIT_AS) and a generous timeout.
- FIFOs (and symlinks to them) in place of either file are refused without blocking.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import checkpoints as checkpoint

from conftest import require_backend

SPEC = db.Sequential([db.Dense(5, in_features=3, activation="relu"), db.Dense(2)])


def _saved(tmp_path, backend: str, ext: str) -> str:
    require_backend(backend)
    src = str(tmp_path / "src.safetensors")
    db.save(db.compile(SPEC, "numpy", seed=0), src)
    out = str(tmp_path / f"model{ext}")
    checkpoint.convert_file(src, backend, out)
    return out


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------ Flax msgpack
def _tree(path: str):
    from flax import serialization

    return serialization.msgpack_restore(_bytes(path))


def _write_tree(path: str, tree) -> None:
    """``tree`` as Flax's msgpack, keys in their dict order (flax's own serializer sorts keys and
    cannot sort 0 beside "0"): arrays through flax's ext hook, as flax writes them."""
    import msgpack
    from flax import serialization

    with open(path, "wb") as f:
        f.write(msgpack.packb(tree, default=serialization._msgpack_ext_pack, strict_types=False))


def test_msgpack_keys_colliding_after_flattening_are_refused(tmp_path):
    path = _saved(tmp_path, "flax", ".msgpack")
    tree = _tree(path)
    assert 0 in tree["layers"]  # NNX writes a Sequential's positions as integer keys
    other = {k: np.asarray(v) + 1 if not isinstance(v, dict) else {kk: np.asarray(vv) + 1 for kk, vv in v.items()}
             for k, v in tree["layers"][0].items()}
    tree["layers"]["0"] = other  # the string "0": the same dotted names, other values
    _write_tree(path, tree)
    before = _bytes(path)
    with pytest.raises(db.CheckpointError, match="ambiguous"):
        db.load(path, spec=SPEC)
    with pytest.raises(db.CheckpointError, match="ambiguous"):
        db.load(path, "flax", spec=SPEC)
    assert _bytes(path) == before


def test_msgpack_dotted_key_beside_nested_key_is_refused(tmp_path):
    path = _saved(tmp_path, "flax", ".msgpack")
    tree = _tree(path)
    inner = tree["layers"][1]
    tree["layers.1"] = {k: v for k, v in inner.items()}  # "layers.1.kernel..." twice
    _write_tree(path, tree)
    with pytest.raises(db.CheckpointError, match="ambiguous"):
        db.load(path, spec=SPEC)


def test_msgpack_deep_nesting_is_a_checkpoint_error(tmp_path):
    path = _saved(tmp_path, "flax", ".msgpack")
    tree: dict = {"x": np.zeros(1, np.float32)}
    for _ in range(200):
        tree = {"n": tree}
    _write_tree(path, tree)
    with pytest.raises(db.CheckpointError):
        db.load(path, spec=SPEC)


# ------------------------------------------------------------------ Equinox .eqx
def _npy_header(shape_text: str) -> bytes:
    """A .npy version 1.0 header whose shape field is ``shape_text``, verbatim."""
    body = ("{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text + ", }").encode("latin1")
    body += b" " * (-(len(body) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


_EQX_RUNNER = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a regression that grows memory dies, never swaps
import dense_bridge as db
spec = db.Sequential([db.Dense(5, in_features=3, activation="relu"), db.Dense(2)])
try:
    db.load(sys.argv[1], spec=spec)
    print("LOADED")
except db.CheckpointError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.parametrize("shape", ["(-4, 3)", "(3, -1)", "(-1,)", "(4611686018427387904, 4611686018427387904)",
                                   "(3.5, 2)", "('a',)"])
def test_eqx_record_with_a_negative_or_overflowing_shape_is_refused_at_once(tmp_path, shape):
    require_backend("equinox")
    bad = tmp_path / "bad.eqx"
    bad.write_bytes(_npy_header(shape) + b"\0" * 256 + _npy_header("(2,)") + b"\0" * 8)
    # a regression loops forever or grows without bound: the timeout and RLIMIT_AS catch it
    run = subprocess.run([sys.executable, "-c", _EQX_RUNNER, str(bad)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("REFUSED") and "bad.eqx" in run.stdout, run.stdout


# ------------------------------------------------------------------ FIFOs
_FIFO_RUNNER = r"""
import sys, dense_bridge as db
spec = db.Sequential([db.Dense(5, in_features=3, activation="relu"), db.Dense(2)])
try:
    db.load(sys.argv[1], spec=spec, format=sys.argv[2])
except db.CheckpointError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("backend,ext", [("flax", ".msgpack"), ("equinox", ".eqx")])
@pytest.mark.parametrize("via_symlink", [False, True])
def test_fifo_in_place_of_a_jax_file_is_refused_at_once(tmp_path, backend, ext, via_symlink):
    require_backend(backend)
    target = tmp_path / f"model{ext}"
    if via_symlink:
        os.mkfifo(tmp_path / "pipe")
        os.symlink(tmp_path / "pipe", target)
    else:
        os.mkfifo(target)
    run = subprocess.run([sys.executable, "-c", _FIFO_RUNNER, str(target), backend], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("REFUSED") and "FIFO" in run.stdout, run.stdout
