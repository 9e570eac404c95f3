"""Two checkpoints compared layer by layer (``testing._compare_files``, behind ``dense-bridge check``)
give the report that ``compare`` gives for their whole models: same rows, same verdicts, the
same first divergence, the same numbers (``check`` holds one layer pair, not two models).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge import checkpoints as checkpoint
from dense_bridge.checkpoints import _native as native_files
from dense_bridge.testing import compare
from dense_bridge.testing._compare_files import compare_checkpoints, segments

from conftest import require_backend


def _spec(dtype: str = "float32"):
    return db.Sequential([
        db.Activation("tanh"),  # before the first Dense: joins its segment
        db.Dense(12, in_features=6, activation="relu", dtype=dtype, mask=db.wiring.random(6, 12, 0.6, seed=2)),
        db.Activation("gelu"), db.Identity(),
        db.Dense(8, dtype=dtype, use_bias=False),
        db.Dense(5, activation="softmax", dtype=dtype),
    ])


def _file(tmp_path, name: str, model, backend: str) -> str:
    """``model`` saved as ``backend``'s own file (canonical safetensors for numpy)."""
    if backend == "numpy":
        path = str(tmp_path / f"{name}.safetensors")
        db.save(model, path)
    else:
        path = str(tmp_path / f"{name}{'.weights.h5' if backend == 'keras' else '.pt' if backend == 'torch' else '.safetensors'}")
        native_files.write_native(model, backend, path, spec=db.to_spec(model))
    return path


def _rows(report) -> list[tuple]:
    return [(q.layer, q.layer_type, q.quantity, q.passed, q.fan_in, q.shape) for layer in report.layers
            for q in layer.quantities]


def _numbers(report) -> list[float]:
    return [q.max_abs_error for layer in report.layers for q in layer.quantities]


def _both(tmp_path, a, backend_a, b, backend_b, **options):
    """(streamed report, whole-model report) for the files of models ``a`` and ``b``."""
    pa, pb = _file(tmp_path, "a", a, backend_a), _file(tmp_path, "b", b, backend_b)
    with checkpoint.open_checkpoint(pa, spec=db.to_spec(a)) as ca, \
            checkpoint.open_checkpoint(pb, spec=db.to_spec(b)) as cb:
        streamed = compare_checkpoints(ca, backend_a, cb, backend_b, **options)
        whole = compare(ca.native(backend_a), cb.native(backend_b), **options)
    return streamed, whole


PAIRS = [("torch", "keras"), ("keras", "torch"), ("numpy", "torch"), ("mlx", "numpy")]


@pytest.mark.parametrize("grads", [True, False], ids=["grads", "outputs"])
@pytest.mark.parametrize("backend_a,backend_b", PAIRS)
def test_streamed_report_equals_the_whole_model_report(tmp_path, backend_a, backend_b, grads):
    require_backend(backend_a)
    require_backend(backend_b)
    spec = _spec()
    a = db.compile(spec, backend_a, seed=4)
    b = db.convert(a, to=backend_b)
    streamed, whole = _both(tmp_path, a, backend_a, b, backend_b, grads=grads, seed=3)
    assert streamed is not None and streamed.passed and whole.passed
    assert _rows(streamed) == _rows(whole)
    assert len(streamed.layers) == len(spec.layers)
    quantities = {q.quantity for layer in streamed.layers for q in layer.quantities}
    assert quantities == ({"output", "dL/dx", "dL/dkernel", "dL/dbias"} if grads else {"output"})
    # the same inputs and upstream gradient reach every layer: the errors agree to rounding
    np.testing.assert_allclose(_numbers(streamed), _numbers(whole), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("backend_a,backend_b", [("torch", "keras"), ("numpy", "mlx")])
def test_a_wrong_layer_is_named_as_in_the_whole_model_report(tmp_path, backend_a, backend_b):
    require_backend(backend_a)
    require_backend(backend_b)
    spec = _spec()
    a = db.compile(spec, backend_a, seed=4)
    params = {k: np.array(v) for k, v in db.get_params(a).items()}
    params["4.kernel"] = params["4.kernel"] * np.float32(1.01)  # layer 4 off by 1%
    b = db.compile(spec, backend_b, params=params)
    streamed, whole = _both(tmp_path, a, backend_a, b, backend_b, seed=0)
    assert not streamed.passed and not whole.passed
    assert streamed.first_failure.layer == whole.first_failure.layer == 4
    assert streamed.first_failure.quantity == whole.first_failure.quantity == "output"
    assert _rows(streamed) == _rows(whole)


def test_bfloat16_files_stream_with_the_dtypes_of_the_whole_model(tmp_path):
    require_backend("torch")
    require_backend("keras")
    spec = _spec("bfloat16")
    a = db.compile(spec, "torch", seed=1)
    b = db.convert(a, to="keras")
    streamed, whole = _both(tmp_path, a, "torch", b, "keras", seed=2)
    assert streamed.dtype == whole.dtype == "bfloat16"
    assert streamed.passed and whole.passed
    assert _rows(streamed) == _rows(whole)
    np.testing.assert_allclose(_numbers(streamed), _numbers(whole), rtol=1e-6, atol=1e-12)


def test_layers_that_do_not_line_up_are_left_to_the_whole_model_compare(tmp_path):
    fused = db.Sequential([db.Dense(4, in_features=3, activation="relu"), db.Dense(2)])
    split = db.Sequential([db.Dense(4, in_features=3), db.Activation("relu"), db.Dense(2)])
    a = db.compile(fused, "numpy", seed=0)
    pa_ = db.get_params(a)
    b = db.compile(split, "numpy", params={"0.kernel": pa_["0.kernel"], "0.bias": pa_["0.bias"],
                                           "2.kernel": pa_["1.kernel"], "2.bias": pa_["1.bias"]})
    pa, pb = _file(tmp_path, "a", a, "numpy"), _file(tmp_path, "b", b, "numpy")
    with checkpoint.open_checkpoint(pa) as ca, checkpoint.open_checkpoint(pb) as cb:
        assert compare_checkpoints(ca, "numpy", cb, "numpy") is None


def test_segments_hold_one_dense_each():
    spec = _spec()
    assert segments(list(spec.layers)) == [(0, 4), (4, 5), (5, 6)]
    assert segments([db.Activation("relu")]) is None
    assert math.prod(end - start for start, end in segments(list(spec.layers))) == 4


def test_nonfinite_parameters_in_a_file_are_a_checkpoint_error_naming_it(tmp_path):
    spec = _spec()
    a = db.compile(spec, "numpy", seed=0)
    params = {k: np.array(v) for k, v in db.get_params(a).items()}
    params["5.bias"][0] = np.nan
    pa = str(tmp_path / "nan.safetensors")
    db.save((spec, params), pa, allow_nonfinite=True)
    pb = _file(tmp_path, "b", a, "numpy")
    with checkpoint.open_checkpoint(pa) as ca, checkpoint.open_checkpoint(pb) as cb:
        with pytest.raises(db.CheckpointError, match=r"nan\.safetensors.*layer 5.*bias.*NaN"):
            compare_checkpoints(ca, "numpy", cb, "numpy")
