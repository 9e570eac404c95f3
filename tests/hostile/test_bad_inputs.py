"""Bad inputs: each raises the documented type, naming the argument and echoing the value."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

# (callable, expected exception, substrings the message must contain)
CASES = [
    (lambda: db.Dense(0), db.SpecError, ["units", "units=0"]),
    (lambda: db.Dense(-1), db.SpecError, ["units=-1"]),
    (lambda: db.Dense(2.5), TypeError, ["units", "2.5"]),
    (lambda: db.Dense("3"), TypeError, ["units", "'3'"]),
    (lambda: db.Dense(True), TypeError, ["units", "True"]),
    (lambda: db.Dense(3, in_features=0), db.SpecError, ["in_features=0"]),
    (lambda: db.Dense(3, use_bias="yes"), TypeError, ["use_bias", "'yes'"]),
    (lambda: db.Dense(3, activation="rleu"), db.SpecError, ["rleu", "relu"]),
    (lambda: db.Dense(3, activation=3), TypeError, ["activation", "3"]),
    (lambda: db.Dense(3, kernel_init="glorot_unifrom"), db.SpecError, ["kernel_init", "glorot_uniform"]),
    (lambda: db.Dense(3, bias_init=1.0), TypeError, ["bias_init", "1.0"]),
    (lambda: db.Init("normal", stdev=1.0), db.SpecError, ["stdev", "stddev"]),
    (lambda: db.Init("normal", stddev=-1.0), db.SpecError, ["stddev", "-1.0"]),
    (lambda: db.Activation("leaky_relu", slope=0.2), db.SpecError, ["slope"]),
    (lambda: db.Activation("elu", alpha="a"), TypeError, ["alpha", "'a'"]),
    (lambda: db.Dense(3, in_features=2, mask=np.ones((3, 3))), db.SpecError, ["mask", "(3, 3)"]),
    (lambda: db.Dense(3, in_features=2, mask=np.full((2, 3), 0.5)), db.SpecError, ["mask", "0.5"]),
    (lambda: db.Dense(3, mask="banded"), TypeError, ["mask", "'banded'"]),
    (lambda: db.wiring.random(4, 4, -0.1, seed=0), db.SpecError, ["density", "-0.1"]),
    (lambda: db.wiring.random(4, 4, 0.5, seed=-1), db.SpecError, ["seed", "-1"]),
    (lambda: db.wiring.banded(4, 4, -2), db.SpecError, ["bandwidth", "-2"]),
    (lambda: db.wiring.block_diagonal(4, 4, 5), db.SpecError, ["blocks", "5"]),
    (lambda: db.Dense(3, dtype="float8"), db.SpecError, ["dtype", "'float8'"]),
    (lambda: db.Dense(3, dtype="int32"), db.SpecError, ["dtype", "'int32'"]),
    (lambda: db.Dense(3, name=5), TypeError, ["name", "5"]),
    (lambda: db.Sequential([db.Dense(4, in_features=3), db.Dense(2, in_features=5)]), db.SpecError,
     ["layers[1]", "in_features=5", "4"]),
    (lambda: db.Sequential([db.Dense(4), "relu"]), TypeError, ["layers[1]", "'relu'"]),
    (lambda: db.Sequential(db.Dense(4)), TypeError, ["layers"]),
    (lambda: db.Sequential([db.Bilinear(2, 3, 4)]), db.SpecError, ["layers[0]", "Bilinear"]),
    (lambda: db.Bilinear(2, 0, 4), db.SpecError, ["in2_features=0"]),
    (lambda: db.compile(db.Dense(2, in_features=2), "tensorflow"), db.SpecError, ["backend", "keras"]),
    (lambda: db.compile(db.Dense(2, in_features=2), 3), TypeError, ["backend", "3"]),
    (lambda: db.compile("dense", "numpy"), TypeError, ["spec", "'dense'"]),
    (lambda: db.compile(db.Dense(2, in_features=2), "numpy", seed=-5), db.SpecError, ["seed", "-5"]),
    (lambda: db.compile(db.Dense(2, in_features=2), "numpy", seed=1.5), TypeError, ["seed", "1.5"]),
    (lambda: db.get_params(object()), TypeError, ["native", "object"]),
    (lambda: db.convert(db.compile(db.Dense(2, in_features=2), "numpy"), to="caffe"), db.SpecError, ["to", "caffe"]),
    (lambda: db.from_config({"class_name": "Conv2D", "config": {}}), db.SpecError, ["class_name", "Conv2D"]),
    (lambda: db.Dense(3, activation=db.Activation("relu")).flops(0), db.SpecError, ["batch_size", "0"]),
]


@pytest.mark.parametrize("make,error,needles", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_bad_input_raises_documented_error(make, error, needles):
    with pytest.raises(error) as info:
        make()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_spec_error_is_value_error_and_unavailable_is_import_error():
    assert issubclass(db.SpecError, ValueError) and issubclass(db.SpecError, db.DenseBridgeError)
    assert issubclass(db.BackendUnavailableError, ImportError)
    assert issubclass(db.ConversionError, db.DenseBridgeError) and issubclass(db.CheckpointError, db.DenseBridgeError)


def test_set_params_lists_every_offender_and_changes_nothing():
    layer = db.compile(db.Sequential([db.Dense(4, in_features=3), db.Dense(2)]), "numpy", seed=0)
    before = {k: v.copy() for k, v in db.get_params(layer).items()}
    bad = dict(before)
    bad["0.kernel"] = np.zeros((4, 3), np.float32)  # transposed
    del bad["1.bias"]
    bad["2.kernel"] = np.zeros((2, 2), np.float32)
    bad["0.bias"] = np.array([0, np.nan, 0, 0], np.float32)
    with pytest.raises(db.ConversionError) as info:
        db.set_params(layer, bad)
    msg = str(info.value)
    for needle in ["1.bias", "2.kernel", "expected shape (3, 4) for parameter 0.kernel, received (4, 3)", "NaN"]:
        assert needle in msg
    after = db.get_params(layer)
    assert all(np.array_equal(before[k], after[k]) for k in before)


MORE_CASES = [
    (lambda: db.Dense(2, dtype=None), TypeError, ["dtype", "None"]),
    (lambda: db.Sequential([db.Dense(3, in_features=2), db.Dense(2, dtype="float64")]), db.SpecError,
     ["dtype", "layers[1]=float64"]),
    (lambda: db.from_config({"class_name": "Sequential", "config": {}}), db.SpecError, ["Sequential", "malformed"]),
    (lambda: db.from_config({"class_name": "Identity", "config": {"junk": 1}}), db.SpecError, ["Identity"]),
    (lambda: db.from_config({"class_name": "Dense", "config": {"units": 2, "mask": {"shape": [2]}}}), db.SpecError,
     ["Dense"]),
]


@pytest.mark.parametrize("make,error,needles", MORE_CASES, ids=[f"more{i}" for i in range(len(MORE_CASES))])
def test_more_bad_inputs(make, error, needles):
    with pytest.raises(error) as info:
        make()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value!s}"


def test_activation_config_round_trips_through_from_config():
    act = db.Activation("leaky_relu", negative_slope=0.2)
    assert db.from_config(act.to_config()) == act
