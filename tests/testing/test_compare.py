"""db.testing.compare / assert_equivalent on real frameworks: no false alarms, every wrong port caught.

Correct ports: the same spec compiled with the same seed on two backends (bit-identical
parameters) and db.convert's output, over hypothesis-generated specs (widths <= 32: MLX's Linux
CPU matmul is slow) in float32, float16 and bfloat16, must pass. Wrong ports (the list below)
must fail and name the layer where they start. A backend whose framework is missing, or whose
adapter does not import, fails: a missing framework is skipped with the reason.
"""
from __future__ import annotations

import functools
import itertools
import json
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dense_bridge as db
from dense_bridge.activations import NAMES, Activation
from dense_bridge.testing import Report, Tolerance, assert_equivalent, compare

ALL = ("numpy", "torch", "keras", "mlx")
LOW_PRECISION = ("float16", "bfloat16")


# ------------------------------------------------------------------------------ backends
@functools.lru_cache(maxsize=None)
def _unavailable(name: str) -> str | None:
    """Why ``name`` cannot be tested here, or None when it can."""
    if name not in db.available_backends():
        return f"framework for backend {name!r} is not installed"
    from dense_bridge.registry._backends import get_adapter

    get_adapter(name)  # an installed framework whose adapter does not import is a failure, not a skip
    return None


def need(*names: str) -> None:
    for name in names:
        why = _unavailable(name)
        if why:
            pytest.skip(why)


@functools.lru_cache(maxsize=None)
def supports(backend: str, dtype: str) -> bool:
    """Whether ``backend`` compiles and traces a Dense in ``dtype`` (SpecError: it says it cannot)."""
    try:
        native = db.compile(db.Dense(2, in_features=2, dtype=dtype), backend, seed=0)
        compare(native, native)
    except db.SpecError:
        return False
    return True


def reference_for(name: str) -> str:
    """Another backend to compare against (the next available one in ALL; numpy at worst)."""
    start = ALL.index(name)
    for other in ALL[start + 1:] + ALL[:start]:
        if _unavailable(other) is None:
            return other
    return "numpy"


# ------------------------------------------------------------------------------ random specs
def _activations(dtype: str, width: int) -> list:
    acts = [Activation(n) for n in NAMES]
    acts += [Activation("leaky_relu", negative_slope=0.2), Activation("elu", alpha=0.5)]
    if dtype in LOW_PRECISION:
        # exp of exp overflows float16 (max 65504 = e^11); inf - inf comparisons mean nothing
        acts = [a for a in acts if a.name != "exponential"]
    if width == 1:
        # a softmax over one element is a constant, and Keras warns about it (a UserWarning, an
        # error under this suite's filterwarnings); MLX's width-1 segfault is fixed in its adapter
        acts = [a for a in acts if a.name not in ("softmax", "log_softmax")]
    return acts


@st.composite
def specs(draw, dtypes: tuple[str, ...]):
    """A lone Dense or a Sequential of 1-3 Dense layers (optional Activation/Identity layers)."""
    dtype = draw(st.sampled_from(dtypes))
    width = draw(st.integers(1, 32))
    layers = []
    for i in range(draw(st.integers(1, 3))):
        units = draw(st.integers(1, 32))
        mask = None
        if draw(st.integers(0, 4)) == 0:
            mask = db.wiring.random(width, units, 0.5, draw(st.integers(0, 99)))
        acts = _activations(dtype, units)
        layers.append(db.Dense(units, in_features=width if i == 0 else None, activation=draw(st.sampled_from(acts)),
                               use_bias=draw(st.booleans()), bias_init=draw(st.sampled_from(["zeros", "normal"])),
                               mask=mask, dtype=dtype))
        extra = draw(st.integers(0, 5))
        if extra == 0:
            layers.append(draw(st.sampled_from(acts)))
        elif extra == 1:
            layers.append(db.Identity())
        width = units
    if len(layers) == 1 and draw(st.booleans()):
        return layers[0]
    return db.Sequential(layers)


def _pair_dtypes(a: str, b: str) -> tuple[str, ...]:
    dtypes = tuple(d for d in ("float32", "float16", "bfloat16") if supports(a, d) and supports(b, d))
    assert "float32" in dtypes
    return dtypes


PAIRS = list(itertools.combinations(ALL, 2))
FEW = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------ correct ports
@pytest.mark.parametrize("a_name,b_name", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_same_seed_ports_pass_for_every_backend_pair(a_name, b_name):
    need(a_name, b_name)

    @FEW
    @given(spec=specs(_pair_dtypes(a_name, b_name)), seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 8))
    def check(spec, seed, batch):
        a, b = db.compile(spec, a_name, seed=seed), db.compile(spec, b_name, seed=seed)
        report = compare(a, b, seed=seed, batch_size=batch)
        assert report.passed, str(report)
        assert report.spec_differences == [], report.spec_differences

    check()


@pytest.mark.parametrize("a_name,b_name", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_converted_models_pass(a_name, b_name):
    need(a_name, b_name)

    @settings(FEW, max_examples=6)
    @given(spec=specs(_pair_dtypes(a_name, b_name)), seed=st.integers(0, 2**31 - 1))
    def check(spec, seed):
        a = db.compile(spec, a_name, seed=seed)
        report = compare(a, db.convert(a, to=b_name), seed=seed)
        assert report.passed, str(report)

    check()


@pytest.mark.parametrize("name", ALL)
def test_same_backend_same_seed_is_exact(name):
    need(name)
    spec = db.Sequential([db.Dense(7, in_features=5, activation="gelu", bias_init="normal"),
                          db.Activation("softmax"), db.Dense(3)])
    report = compare(db.compile(spec, name, seed=3), db.compile(spec, name, seed=3), seed=11)
    assert report.passed and report.worst.units == 0.0, str(report)


def test_float16_port_of_a_float32_model_passes_at_float16_tolerance():
    """Comparing across dtypes uses the coarser one; the dtype difference is listed, not failed."""
    spec32 = db.Sequential([db.Dense(8, in_features=6, activation="tanh"), db.Dense(4)])
    a = db.compile(spec32, "numpy", seed=1)
    params16 = {k: v.astype(np.float16) for k, v in db.get_params(a).items()}
    spec16 = db.Sequential([l.replace(dtype="float16") for l in spec32.layers])
    b = db.compile(spec16, "numpy", params=params16)
    a = db.compile(spec32, "numpy", params={k: v.astype(np.float32) for k, v in params16.items()})
    report = compare(a, b)
    assert report.passed, str(report)
    assert report.dtype == "float16"
    assert "layer 0 dtype: float32 vs float16" in report.spec_differences


# ------------------------------------------------------------------------------ wrong ports
def _base(act1="gelu") -> db.Sequential:
    """Three float32 layers; layer 1 (square 6x6, nonzero bias) is where each wrong port lives."""
    return db.Sequential([db.Dense(6, in_features=6, activation="tanh", bias_init="normal"),
                          db.Dense(6, activation=act1, bias_init="normal"),
                          db.Dense(3, bias_init="normal")])


def _params(native) -> dict:
    return {k: np.array(v, copy=True) for k, v in db.get_params(native).items()}


def _assert_diverges_at(report: Report, layer: int, quantity: str = "output") -> None:
    assert not report.passed, str(report)
    assert report.first_divergence == layer, str(report)
    assert report.first_failure.quantity == quantity, str(report)
    # every layer before it agrees (its gradients too: nothing upstream differs)
    for earlier in report.layers[:layer]:
        assert earlier["output"].passed, str(report)
    assert f"first divergence at layer {layer}" in str(report)


def _port(name: str, spec, params=None, seed=5):
    return db.compile(spec, name, seed=seed) if params is None else db.compile(spec, name, params=params)


@pytest.mark.parametrize("name", ALL)
def test_one_weight_scaled_by_1_001_fails_at_its_layer(name):
    need(name, reference_for(name))
    ref = _port(reference_for(name), _base())
    wrong = _port(name, _base())
    p = _params(wrong)
    # the weight with the largest magnitude: its input (a tanh output) is far from 0 on a normal batch
    i, j = np.unravel_index(np.argmax(np.abs(p["1.kernel"])), p["1.kernel"].shape)
    p["1.kernel"][i, j] *= np.float32(1.001)
    db.set_params(wrong, p)
    report = compare(wrong, ref)
    _assert_diverges_at(report, 1)
    assert report.spec_differences == []


@pytest.mark.parametrize("name", ALL)
def test_square_weight_transposed_fails_at_its_layer(name):
    need(name, reference_for(name))
    ref = _port(reference_for(name), _base())
    wrong = _port(name, _base())
    p = _params(wrong)
    p["1.kernel"] = np.ascontiguousarray(p["1.kernel"].T)  # shape (6, 6) fits: only layout catches it
    db.set_params(wrong, p)
    _assert_diverges_at(compare(wrong, ref), 1)


@pytest.mark.parametrize("name", ALL)
def test_dropped_bias_is_a_spec_difference_and_fails(name):
    need(name, reference_for(name))
    ref = _port(reference_for(name), _base())
    p = _params(ref)
    assert np.abs(p["1.bias"].astype(np.float64)).max() > 0.01  # the bias matters
    del p["1.bias"]
    no_bias = _base()
    no_bias = db.Sequential([no_bias.layers[0], no_bias.layers[1].replace(use_bias=False), no_bias.layers[2]])
    wrong = _port(name, no_bias, params=p)
    report = compare(wrong, ref)
    assert "layer 1 use_bias: False vs True" in report.spec_differences
    _assert_diverges_at(report, 1)
    assert report.layers[1]["dL/dbias"].note == "absent in a"


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("wrong_act,right_act,difference", [
    ("gelu_tanh", "gelu", "layer 1 activation: gelu_tanh vs gelu"),
    ("leaky_relu", Activation("leaky_relu", negative_slope=0.2), "layer 1 activation.negative_slope: 0.01 vs 0.2"),
], ids=["gelu_tanh-vs-gelu", "leaky-0.01-vs-0.2"])
def test_wrong_activation_fails_at_its_layer(name, wrong_act, right_act, difference):
    need(name, reference_for(name))
    ref = _port(reference_for(name), _base(right_act))
    wrong = _port(name, _base(wrong_act))
    report = compare(wrong, ref)
    assert report.spec_differences == [difference]
    _assert_diverges_at(report, 1)


@pytest.mark.parametrize("name", ALL)
def test_float32_weights_rounded_to_bfloat16_fail_at_their_layer(name):
    need(name, reference_for(name))
    ref = _port(reference_for(name), _base())
    wrong = _port(name, _base())
    p = _params(wrong)
    p["1.kernel"] = p["1.kernel"].astype(ml_dtypes.bfloat16).astype(np.float32)
    db.set_params(wrong, p)
    report = compare(wrong, ref)
    assert report.spec_differences == []  # still a float32 model: only the numbers tell
    _assert_diverges_at(report, 1)


@pytest.mark.parametrize("name", ALL)
def test_mask_not_applied_fails_at_its_layer(name):
    need(name, reference_for(name))
    mask = db.wiring.banded(6, 6, 1)
    masked = _base()
    masked = db.Sequential([masked.layers[0], masked.layers[1].replace(mask=mask), masked.layers[2]])
    full = _params(_port("numpy", _base()))  # a kernel with every entry nonzero
    assert (full["1.kernel"] != 0).all()
    ref = _port(reference_for(name), masked, params={**full, "1.mask": mask.as_array("float32")})
    wrong = _port(name, _base(), params=full)  # the port forgot the mask and uses the full kernel
    report = compare(wrong, ref)
    assert report.spec_differences == ["layer 1 mask: absent vs present (16 of 36 connections)"]
    _assert_diverges_at(report, 1)


SELU_TRUNCATED = Activation("selu", alpha=1.67326, scale=1.0507)  # MLX's constants


def _selu_model(name: str, act: Activation):
    """x -> x (identity kernel, no bias) -> selu: the selu sees exactly the given inputs."""
    spec = db.Sequential([db.Dense(4, in_features=4, use_bias=False), act])
    return _port(name, spec, params={"0.kernel": np.eye(4, dtype=np.float32)})


# selu's negative branch saturates at -scale*alpha, where the truncated constants are 2.9e-6
# relative off (about 2 tolerance units in float32); normal inputs would hide it.
SELU_INPUTS = -np.linspace(3.0, 12.0, 32, dtype=np.float32).reshape(8, 4)


@pytest.mark.parametrize("name", ALL)
def test_selu_with_truncated_constants_fails_in_float32(name):
    need(name, reference_for(name))
    report = compare(_selu_model(name, SELU_TRUNCATED), _selu_model(reference_for(name), Activation("selu")),
                     inputs=SELU_INPUTS)
    assert report.spec_differences == ["layer 1 activation.alpha: 1.67326 vs 1.6732632423543772",
                                       "layer 1 activation.scale: 1.0507 vs 1.0507009873554805"]
    _assert_diverges_at(report, 1)
    # and the same constants on both sides agree
    assert compare(_selu_model(name, Activation("selu")), _selu_model(reference_for(name), Activation("selu")),
                   inputs=SELU_INPUTS).passed


def test_hand_built_mlx_selu_differs_from_torch_selu():
    """mlx.nn.SELU really uses the truncated constants: a hand-written port from torch shows it."""
    need("mlx", "torch")
    import mlx.nn as mnn
    import torch

    t = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.SELU())
    m = mnn.Sequential(mnn.Linear(4, 4, bias=False), mnn.SELU())
    eye = {"0.kernel": np.eye(4, dtype=np.float32)}
    db.set_params(t, eye)
    db.set_params(m, eye)
    report = compare(m, t, inputs=SELU_INPUTS)
    assert "layer 1 activation.alpha: 1.67326 vs 1.6732632423543772" in report.spec_differences
    _assert_diverges_at(report, 1)


# ------------------------------------------------------------------------------ report forms
@pytest.fixture
def failing_report() -> Report:
    a = db.compile(_base("gelu_tanh"), "numpy", seed=2)
    b = db.compile(_base("gelu"), "numpy", seed=2)
    return compare(a, b)


def test_report_text_names_layers_quantities_backends_and_verdict(failing_report):
    text = str(failing_report)
    for word in ("numpy Sequential (float32)", "layer", "quantity", "max abs err", "tol units",
                 "output", "dL/dx", "dL/dkernel", "dL/dbias", "Dense+gelu_tanh|Dense+gelu", "PASS", "FAIL",
                 "layer 1 activation: gelu_tanh vs gelu", "FAIL: first divergence at layer 1"):
        assert word in text, word
    lines = text.splitlines()
    table = [l for l in lines if l.strip().startswith(("0 ", "1 ", "2 "))]
    assert len(table) == 12 and len({len(l.split("  (")[0]) for l in table}) == 1  # fixed width


def test_report_dict_and_json(failing_report):
    d = failing_report.to_dict()
    assert d["passed"] is False and d["first_divergence"] == 1 and d["first_divergence_quantity"] == "output"
    assert d["a"]["backend"] == "numpy" and d["dtype"] == "float32"
    assert [q["quantity"] for q in d["layers"][1]["quantities"]] == ["output", "dL/dkernel", "dL/dbias", "dL/dx"]
    assert json.loads(failing_report.to_json()) == json.loads(json.dumps(d))


def test_report_json_encodes_infinite_errors_as_strings():
    a = db.compile(db.Dense(3, in_features=2, use_bias=False), "numpy", seed=0)
    b = db.compile(db.Dense(3, in_features=2), "numpy", seed=0)
    d = json.loads(compare(a, b).to_json())
    bias = next(q for q in d["layers"][0]["quantities"] if q["quantity"] == "dL/dbias")
    assert bias["units"] == "inf" and bias["max_abs_error"] == "inf" and bias["note"] == "absent in a"


def test_report_html_is_self_contained_and_written_atomically(failing_report, tmp_path):
    path = tmp_path / "sub" / "report.html"
    page = failing_report.to_html(path)
    assert path.read_text(encoding="utf-8") == page
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<svg" in page and "tolerance (1 unit)" in page and "dL/dkernel" in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert os.listdir(path.parent) == ["report.html"]  # no temporary file left behind
    # a failed write leaves the old page untouched and no temporary file
    before = path.read_text(encoding="utf-8")
    (tmp_path / "blocker").write_text("a file, not a folder")
    with pytest.raises(OSError):
        failing_report.to_html(tmp_path / "blocker" / "x.html")
    assert path.read_text(encoding="utf-8") == before


def test_assert_equivalent_raises_with_the_report_as_message():
    a = db.compile(_base("gelu_tanh"), "numpy", seed=2)
    b = db.compile(_base("gelu"), "numpy", seed=2)
    with pytest.raises(AssertionError) as info:
        assert_equivalent(a, b, seed=4)
    assert str(info.value) == str(compare(a, b, seed=4))
    ok = assert_equivalent(b, db.compile(_base("gelu"), "numpy", seed=2))
    assert ok.passed


# ------------------------------------------------------------------------------ options and edges
def test_outputs_only_and_given_inputs_and_tolerance_override():
    a = db.compile(_base("gelu_tanh"), "numpy", seed=2)
    b = db.compile(_base("gelu"), "numpy", seed=2)
    x = np.random.default_rng(0).standard_normal((2, 3, 6))
    report = compare(a, b, inputs=x, grads=False)
    assert [q.quantity for q in report.rows] == ["output"] * 3 and report.input_shapes == [(2, 3, 6)]
    loose = compare(a, b, inputs=x, tolerance=Tolerance(c_output=1e6, c_gradient=1e6))
    assert loose.passed, str(loose)
    with pytest.raises(TypeError, match="tolerance"):
        compare(a, b, tolerance=4.0)


def test_bilinear_takes_a_pair_of_inputs():
    spec = db.Bilinear(3, 4, 2)
    names = [n for n in ("numpy", "torch", "mlx") if _unavailable(n) is None]
    models = [db.compile(spec, n, seed=1) for n in names]
    for other in models:
        report = compare(models[0], other, seed=2)
        assert report.passed and [q.quantity for q in report.rows] == \
            ["output", "dL/dkernel", "dL/dbias", "dL/dx1", "dL/dx2"], str(report)
    x1, x2 = np.ones((5, 3)), np.ones((5, 4))
    assert compare(models[0], models[-1], inputs=(x1, x2)).input_shapes == [(5, 3), (5, 4)]
    with pytest.raises(db.SpecError, match="pair"):
        compare(models[0], models[-1], inputs=x1)


def test_lazy_models_need_inputs():
    lazy = db.compile(db.Dense(3), "numpy", seed=0)
    with pytest.raises(db.SpecError, match="inputs="):
        compare(lazy, db.compile(db.Dense(3), "numpy", seed=0))
    report = compare(lazy, db.compile(db.Dense(3, in_features=4), "numpy", seed=0), inputs=np.ones((2, 4)))
    assert report.passed, str(report)


def test_models_that_cannot_be_fed_the_same_data_fail_with_a_note():
    a = db.compile(db.Dense(3, in_features=4), "numpy", seed=0)
    b = db.compile(db.Dense(3, in_features=5), "numpy", seed=0)
    report = compare(a, b)
    assert not report.passed and not report.compared
    assert "layer 0 in_features: 4 vs 5" in report.spec_differences
    assert "numeric comparison skipped" in str(report)


def test_layers_that_do_not_line_up_are_compared_end_to_end():
    """Dense(relu) in one framework, Dense + ReLU layer in another: same function."""
    fused = db.compile(db.Sequential([db.Dense(5, in_features=3, activation="relu"), db.Dense(2)]), "numpy", seed=1)
    p = db.get_params(fused)
    split = db.compile(db.Sequential([db.Dense(5, in_features=3), db.Activation("relu"), db.Dense(2)]), "numpy",
                       params={"0.kernel": p["0.kernel"], "0.bias": p["0.bias"], "2.kernel": p["1.kernel"],
                               "2.bias": p["1.bias"]})
    report = compare(fused, split)
    assert report.passed, str(report)
    assert [(l.index, [q.quantity for q in l.quantities]) for l in report.layers] == [(None, ["output", "dL/dx"])]
    assert "do not line up" in report.notes[0]


def test_spec_differences_field_by_field():
    base = db.Sequential([db.Dense(4, in_features=3, activation="relu", mask=db.wiring.banded(3, 4, 0)),
                          db.Activation("elu"), db.Dense(2)])
    other = db.Sequential([db.Dense(4, in_features=3, activation="relu", mask=db.wiring.banded(3, 4, 1),
                                    dtype="bfloat16"),
                           db.Identity(), db.Dense(5, dtype="bfloat16", use_bias=False)])
    assert db.testing.spec_differences(base, other) == [
        "layer 0 dtype: float32 vs bfloat16",
        "layer 0 mask: differs in 4 of 12 entries",
        "layer 1 type: Act(elu) vs Identity",
        "layer 2 units: 2 vs 5",
        "layer 2 use_bias: True vs False",
        "layer 2 dtype: float32 vs bfloat16",
    ]
    assert db.testing.spec_differences(base, base) == []
    assert db.testing.spec_differences(db.Dense(2, in_features=3), base)[:2] == ["model: Dense vs Sequential",
                                                                                   "number of layers: 1 vs 3"]


# ------------------------------------------------------------------------------ review findings
@pytest.mark.parametrize("name", ALL)
def test_empty_sequential_is_the_identity(name):
    """Sequential([]) crashed with IndexError; it is x -> x on every backend."""
    need(name)
    empty = db.compile(db.Sequential([]), name, seed=0)
    reference = db.compile(db.Sequential([]), "numpy", seed=0)
    nothing = compare(empty, reference)  # no width anywhere: passes with nothing to compare
    assert nothing.passed and nothing.rows == [] and "nothing to compare" in nothing.notes[0], str(nothing)
    x = np.random.default_rng(0).standard_normal((3, 4))
    report = compare(empty, reference, inputs=x)
    assert report.passed and report.worst.units == 0.0, str(report)
    assert "a is an empty Sequential: its output is its input" in str(report)
    identity = db.compile(db.Sequential([db.Identity()], in_features=4), "numpy", seed=0)
    assert compare(empty, identity, inputs=x, strict=True).passed
    # an empty model is not equivalent to a layer that computes something
    dense = db.compile(db.Dense(4, in_features=4, bias_init="normal"), "numpy", seed=0)
    assert not compare(empty, dense).passed and not compare(dense, empty).passed


@pytest.mark.parametrize("a_name,b_name", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_one_dimensional_inputs_get_a_batch_axis_for_every_backend(a_name, b_name):
    """Keras' Dense rejects 1-D inputs (min_ndim=2) where the others accept them: all get (1, n)."""
    need(a_name, b_name)
    spec = db.Sequential([db.Dense(3, in_features=4, activation="tanh", bias_init="normal")])
    a, b = db.compile(spec, a_name, seed=1), db.compile(spec, b_name, seed=1)
    for first, second in ((a, b), (b, a)):
        report = compare(first, second, inputs=np.ones(4))
        assert report.passed and report.input_shapes == [(1, 4)], str(report)
        assert any("batch axis was added" in n for n in report.notes), report.notes
    report = compare(a, b, inputs=np.ones(4), grad_out=np.ones(3))  # the sample's gradient, 1-D too
    assert report.passed and report.layers[0]["output"].shape == (1, 3), str(report)


def test_bilinear_one_dimensional_and_mismatched_inputs():
    models = [db.compile(db.Bilinear(3, 4, 2), n, seed=1) for n in ("numpy", "torch", "mlx")
              if _unavailable(n) is None]
    report = compare(models[0], models[-1], inputs=(np.ones(3), np.ones(4)))
    assert report.passed and report.input_shapes == [(1, 3), (1, 4)], str(report)
    with pytest.raises(db.SpecError, match=r"same batch shape.*\(2, 3\) and \(3, 4\)"):
        compare(models[0], models[-1], inputs=(np.ones((2, 3)), np.ones((3, 4))))
    with pytest.raises(db.SpecError, match=r"\(\*, 3\) and \(\*, 4\).*\(2, 3\), \(2, 5\)"):
        compare(models[0], models[-1], inputs=(np.ones((2, 3)), np.ones((2, 5))))


@pytest.mark.parametrize("kwargs,error,words", [
    ({"grads": "no"}, TypeError, ["grads", "'no'"]),
    ({"grads": 1}, TypeError, ["grads", "grads=1"]),
    ({"strict": "yes"}, TypeError, ["strict", "'yes'"]),
    ({"seed": 1.5}, TypeError, ["seed", "seed=1.5"]),
    ({"seed": -1}, db.SpecError, ["seed", "seed=-1"]),
    ({"seed": True}, TypeError, ["seed", "seed=True"]),
    ({"tolerance": 3}, TypeError, ["tolerance", "tolerance=3"]),
    ({"batch_size": 0}, db.SpecError, ["batch_size", "batch_size=0"]),
    ({"batch_size": "8"}, TypeError, ["batch_size", "'8'"]),
    ({"inputs": "abc"}, TypeError, ["inputs", "'abc'"]),
    ({"inputs": {"x": 1}}, TypeError, ["inputs", "{'x': 1}"]),
    ({"inputs": np.ones((2, 4), dtype=complex)}, TypeError, ["inputs", "complex128"]),
    ({"inputs": np.ones((2, 5))}, db.SpecError, ["inputs", "(*, 4)", "(2, 5)"]),
    ({"inputs": np.ones(5)}, db.SpecError, ["inputs", "(*, 4)", "(5,)"]),
    ({"inputs": np.ones((0, 4))}, db.SpecError, ["inputs", "(0, 4)"]),
    ({"inputs": np.float64(1.0)}, db.SpecError, ["inputs", "()"]),
    ({"grad_out": "x"}, TypeError, ["grad_out", "'x'"]),
    ({"grad_out": np.ones((8, 2))}, db.SpecError, ["grad_out", "(8, 3)", "(8, 2)"]),
])
def test_bad_arguments_raise_naming_the_argument_and_value(kwargs, error, words):
    model = db.compile(db.Dense(3, in_features=4), "numpy", seed=0)
    with pytest.raises(error) as info:
        compare(model, model, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("name", [n for n in ALL if n != "numpy"])
def test_wrong_input_width_is_a_spec_error_not_a_framework_error(name):
    need(name)
    spec = db.Dense(3, in_features=4)
    a, b = db.compile(spec, name, seed=0), db.compile(spec, "numpy", seed=0)
    for first, second in ((a, b), (b, a)):
        with pytest.raises(db.SpecError, match=r"inputs.*\(\*, 4\).*\(2, 5\)"):
            compare(first, second, inputs=np.ones((2, 5)))
    lazy = db.compile(db.Dense(3), name, seed=0)  # lazy on one side: the other fixes the width
    with pytest.raises(db.SpecError, match=r"\(\*, 4\).*\(2, 6\)"):
        compare(lazy, b, inputs=np.ones((2, 6)))
    wider = db.compile(db.Dense(3, in_features=5), "numpy", seed=0)  # fits neither model
    with pytest.raises(db.SpecError, match=r"\(\*, 4\) \(a\) or \(\*, 5\) \(b\).*\(2, 6\)"):
        compare(a, wider, inputs=np.ones((2, 6)))


def _bf16_port():
    """A float32 model and a bfloat16 port with the same (bfloat16-representable) weights."""
    spec32 = db.Sequential([db.Dense(8, in_features=6, activation="tanh"), db.Dense(4)])
    p16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in db.get_params(db.compile(spec32, "numpy", seed=1)).items()}
    a = db.compile(spec32, "numpy", params={k: v.astype(np.float32) for k, v in p16.items()})
    b = db.compile(db.Sequential([l.replace(dtype="bfloat16") for l in spec32.layers]), "numpy", params=p16)
    return a, b


def test_strict_mode_fails_a_bfloat16_port_that_numerically_passes():
    a, b = _bf16_port()
    default = compare(a, b)
    assert default.passed and not default.strict, str(default)  # default: numeric only
    assert default.strict_differences == ["layer 0 dtype: float32 vs bfloat16", "layer 1 dtype: float32 vs bfloat16"]
    strict = compare(a, b, strict=True)
    assert not strict.passed and strict.first_failure is None and all(l.passed for l in strict.layers)
    assert strict.verdict().startswith("FAIL (strict: the specs differ in 2 field(s)"), strict.verdict()
    assert "layer 0 dtype: float32 vs bfloat16" in str(strict) and "strict" in str(strict).splitlines()[3]
    d = strict.to_dict()
    assert d["strict"] is True and d["passed"] is False and len(d["strict_differences"]) == 2
    assert "strict" in strict.to_html()
    with pytest.raises(AssertionError, match="strict"):
        assert_equivalent(a, b, strict=True)
    assert assert_equivalent(a, b).passed


@pytest.mark.parametrize("change,difference", [
    ({"activation": "gelu_tanh"}, "layer 0 activation: gelu vs gelu_tanh"),
    ({"use_bias": False}, "layer 0 use_bias: True vs False"),
    ({"mask": db.wiring.banded(4, 4, 1)}, "layer 0 mask: absent vs present (10 of 16 connections)"),
    ({"dtype": "float16"}, "layer 0 dtype: float32 vs float16"),
], ids=["activation", "use_bias", "mask", "dtype"])
def test_strict_mode_fails_on_each_function_changing_field(change, difference):
    base = db.Dense(4, in_features=4, activation="gelu")
    a, b = db.compile(base, "numpy", seed=0), db.compile(base.replace(**change), "numpy", seed=0)
    report = compare(a, b, strict=True, tolerance=Tolerance(c_output=1e9, c_gradient=1e9))  # numbers: ignored
    assert report.strict_differences == [difference]
    assert not report.passed and difference in report.verdict(), str(report)
    if "use_bias" not in change:  # a missing bias already fails numerically (dL/dbias absent in b)
        assert compare(a, b, tolerance=Tolerance(c_output=1e9, c_gradient=1e9)).passed  # default: numbers only


def test_strict_mode_activation_params_and_what_is_not_a_difference():
    leaky = db.compile(db.Dense(4, in_features=3, activation="leaky_relu"), "numpy", seed=0)
    leaky2 = db.compile(db.Dense(4, in_features=3, activation=Activation("leaky_relu", negative_slope=0.2)),
                        "numpy", seed=0)
    assert compare(leaky, leaky2, strict=True).strict_differences == \
        ["layer 0 activation.negative_slope: 0.01 vs 0.2"]
    # same function, other structure / initializer / name / all-ones mask: strict passes
    fused = db.compile(db.Sequential([db.Dense(5, in_features=3, activation="relu"), db.Dense(2)]), "numpy", seed=1)
    p = db.get_params(fused)
    split = db.compile(db.Sequential([db.Dense(5, in_features=3, kernel_init="he_normal", name="first"),
                                      db.Activation("relu"), db.Identity(),
                                      db.Dense(2, mask=db.wiring.dense(5, 2))]), "numpy",
                       params={"0.kernel": p["0.kernel"], "0.bias": p["0.bias"], "3.kernel": p["1.kernel"],
                               "3.bias": p["1.bias"], "3.mask": np.ones((5, 2), np.float32)})
    report = compare(fused, split, strict=True)
    assert report.spec_differences and report.strict_differences == [] and report.passed, str(report)
    # positions are a's, with b's where the structure differs
    other = db.Sequential([db.Dense(5, in_features=3), db.Dense(3, dtype="float32")])
    assert db.testing.function_differences(db.to_spec(split), other) == [
        "layer 0 activation: relu vs linear", "layer 3 (b: layer 1) units: 2 vs 3"]
    assert db.testing.function_differences(db.to_spec(split), db.Sequential([db.Dense(5, in_features=3)])) == [
        "layer 0 activation: relu vs linear", "a layer 3 (Dense): no counterpart in b"]
