"""Which backend a native file belongs to, decided by the formats the manifests declare.

Every built-in format is recognised by content (tests/testing/test_conformance.py writes and reads each
one); here: what must NOT be taken for a framework's file, the legacy torch format in its
pickle protocols, and ``format=`` against a file of another backend.
"""
from __future__ import annotations

import io
import pickle

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import checkpoints as checkpoint
from dense_bridge.checkpoints._native import identify, supported_formats
from dense_bridge.registry._manifest import Match, Probe

SPEC = db.Sequential([db.Dense(3, in_features=2, activation="relu"), db.Dense(1)])


def test_a_plain_pickle_is_no_torch_file(tmp_path):
    """A PaddlePaddle .pdparams is a pickle of a dict: no registered format claims it (and it is
    never unpickled: a file's content runs no code)."""
    path = tmp_path / "model.pdparams"
    path.write_bytes(pickle.dumps({"linear_0.w_0": [[1.0, 2.0]]}, protocol=4))
    with pytest.raises(db.CheckpointError, match=r"match no supported format\. Supported: .*torch \.pt") as info:
        db.load(path, spec=SPEC)
    assert "torch state dict" not in str(info.value)
    renamed = tmp_path / "model.pt"  # the extension alone does not make it torch's
    renamed.write_bytes(path.read_bytes())
    with pytest.raises(db.CheckpointError, match="match no supported format"):
        db.load(renamed, spec=SPEC)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_legacy_torch_files_are_recognised_by_torch_magic_number(tmp_path, protocol):
    torch = pytest.importorskip("torch")
    model = db.compile(SPEC, "torch", seed=0)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    path = tmp_path / "legacy.weights"  # any name: the content says torch
    path.write_bytes(buffer.getvalue())
    with checkpoint.open_checkpoint(path, spec=SPEC) as opened:
        assert (opened.framework, opened.container) == ("torch", "torch-legacy")
    if protocol > 2:
        return  # recognised; torch.load(weights_only=True) itself refuses legacy files of protocol 4+
    _, params = db.load(path, spec=SPEC)
    want = db.get_params(model)
    assert all(np.array_equal(params[k], want[k]) for k in want)


def test_safetensors_are_read_as_their_tag_says_or_as_format_names(tmp_path):
    pytest.importorskip("torch")
    src = tmp_path / "c.safetensors"
    db.save(db.compile(SPEC, "numpy", seed=1), src)
    out = tmp_path / "t.safetensors"
    checkpoint.convert_file(str(src), "torch", str(out))
    with checkpoint.open_checkpoint(out, spec=SPEC) as opened:
        assert opened.framework == "torch"  # tagged by the writer
    if "mlx" in db.available_backends():
        with checkpoint.open_checkpoint(out, spec=SPEC, format="mlx") as opened:
            assert opened.framework == "mlx"  # the caller may read a shared container otherwise
    if "keras" in db.available_backends():
        with pytest.raises(db.CheckpointError, match=r"holds torch or mlx weights, not keras"):
            checkpoint.open_checkpoint(out, spec=SPEC, format="keras")


def test_the_highest_match_wins_and_unknown_bytes_list_what_is_supported(tmp_path):
    names_only_layers = Probe(str(tmp_path / "x.safetensors"), b"", 0, metadata={},
                              tensor_names=["layers.0.weight", "layers.0.bias"])
    assert identify(names_only_layers)[0] == "mlx"  # LIKELY (mlx.nn.Sequential's names) beats DEFAULT
    plain = Probe(str(tmp_path / "x.safetensors"), b"", 0, metadata={}, tensor_names=["0.weight"])
    assert identify(plain)[0] == "torch"  # the usual reading of a bare safetensors file
    assert Match.CERTAIN > Match.LIKELY > Match.DEFAULT > Match.FITS > Match.NO
    text = supported_formats()
    for piece in ("dense_bridge .safetensors", "torch .pt/.pth/.bin/.safetensors", "Keras .weights.h5/.keras",
                  "MLX .safetensors/.npz", "Flax .msgpack", "Equinox .eqx"):
        assert piece in text, text
