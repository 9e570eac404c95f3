"""Public verbs on every backend: snapshots, all-or-nothing loads, and review regressions."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend, require_lazy


def test_get_params_are_snapshots_by_default(backend):
    model = db.compile(db.Sequential([db.Dense(3, in_features=2), db.Dense(2)]), backend, seed=0)
    before = db.get_params(model)
    kept = {k: v.copy() for k, v in before.items()}
    db.set_params(model, {k: (np.asarray(v) + 1).astype(v.dtype) for k, v in before.items()})
    assert all(np.array_equal(before[k], kept[k]) for k in kept)  # the snapshot did not move
    before["0.kernel"][...] = 7  # and it is the caller's to change
    assert not np.array_equal(db.get_params(model)["0.kernel"], before["0.kernel"])


def test_values_that_overflow_the_dtype_are_rejected(backend):
    spec = db.Dense(2, in_features=2, dtype="float16")
    with pytest.raises(db.ConversionError, match="after casting to float16"):
        db.compile(spec, backend, params={"kernel": np.full((2, 2), 1e6), "bias": np.zeros(2)})


def test_reversed_views_load_and_failed_loads_change_nothing(backend):
    model = db.compile(db.Sequential([db.Dense(3, in_features=2), db.Dense(2)]), backend, seed=0)
    start = db.get_params(model)
    new = {k: (v + 1).astype(v.dtype) for k, v in start.items()}
    new["1.bias"] = new["1.bias"].copy()[::-1].copy()[::-1]  # a negative-stride view
    db.set_params(model, new)
    assert all(np.array_equal(db.get_params(model)[k], new[k]) for k in new)
    broken = dict(new, **{"1.bias": np.array([np.nan, 0.0], np.float32)})
    broken["0.kernel"] = broken["0.kernel"] + 5
    with pytest.raises(db.ConversionError, match="1.bias"):
        db.set_params(model, broken)
    assert all(np.array_equal(db.get_params(model)[k], new[k]) for k in new)


def test_complex_parameters_are_rejected(backend):
    model = db.compile(db.Dense(2, in_features=2), backend, seed=0)
    with pytest.raises(db.ConversionError, match="real numeric"):
        db.set_params(model, {"kernel": np.ones((2, 2), np.complex64), "bias": np.zeros(2, np.float32)})


def test_params_mask_must_match_the_spec(backend):
    spec = db.Dense(3, in_features=2, mask=db.wiring.banded(2, 3, 0))
    with pytest.raises(db.ConversionError, match="mask"):
        db.compile(spec, backend, params={"kernel": np.ones((2, 3), np.float32),
                                          "bias": np.zeros(3, np.float32), "mask": np.ones((2, 3), np.float32)})


def test_set_params_refuses_a_mask_that_differs_from_the_models(backend):
    # one rule with load, compile(params=) and convert: the mask is part of the spec, never
    # silently replaced; the error names the layer and how many entries differ
    spec = db.Sequential([db.Dense(3, in_features=2), db.Dense(3, mask=db.wiring.banded(3, 3, 0))])
    model = db.compile(spec, backend, seed=0)
    before = db.get_params(model)
    with pytest.raises(db.ConversionError, match=r"layer 1: 6 of 9 mask entries differ"):
        db.set_params(model, {"1.mask": np.ones((3, 3), np.float32)}, strict=False)
    after = db.get_params(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with pytest.raises(db.ConversionError, match=r"layer 1: 6 of 9 mask entries differ"):
        db.compile(spec, backend, params={**before, "1.mask": np.ones((3, 3), np.float32)})
    db.set_params(model, {"1.mask": before["1.mask"]}, strict=False)  # the same mask is fine


@pytest.mark.parametrize("bad,error", [("no", TypeError), (1, TypeError)])
def test_strict_and_copy_take_only_bools(bad, error):
    model = db.compile(db.Dense(2, in_features=2), "numpy", seed=0)
    with pytest.raises(error, match="strict"):
        db.set_params(model, db.get_params(model), strict=bad)
    with pytest.raises(error, match="copy"):
        db.get_params(model, copy=bad)


def test_unbuilt_lazy_get_params_is_a_conversion_error_everywhere(backend):
    require_lazy(backend)
    with pytest.raises(db.ConversionError):
        db.get_params(db.compile(db.Dense(3), backend, seed=0))


# ----------------------------------------------------------------- available_backends, errors
def test_available_backends_decides_keras_by_the_package_keras_backend_names(monkeypatch, tmp_path):
    import sys

    from dense_bridge.registry import _backends as _registry

    if "keras" not in db.available_backends():
        pytest.skip("keras is not installed")
    engine = _registry.manifest("keras").runtime_requires  # read without importing Keras
    monkeypatch.setenv("KERAS_BACKEND", "no_such_framework_pkg")
    assert "keras" not in db.available_backends()
    with pytest.raises(db.BackendUnavailableError, match="no_such_framework_pkg"):
        _registry.get_adapter("keras")
    monkeypatch.delenv("KERAS_BACKEND")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    (tmp_path / "keras.json").write_text('{"backend": "jax"}')
    assert engine() == ("jax",)
    (tmp_path / "keras.json").write_text("not json")
    assert engine() == ("tensorflow",)
    assert db.available_backends(check=False) == _registry.available_backends()
    assert sys.modules.get("no_such_framework_pkg") is None


def test_available_backends_check_compiles_a_1x1_dense_on_each():
    checked = db.available_backends(check=True)
    assert "numpy" in checked and set(checked) <= set(db.available_backends())
    for name in checked:  # every listed one really works
        assert db.get_params(db.compile(db.Dense(1, in_features=1), name, seed=0))["kernel"].shape == (1, 1)
    with pytest.raises(TypeError, match="check"):
        db.available_backends(check="yes")


def test_deliberate_errors_are_dense_bridge_errors():
    from dense_bridge.testing._tolerance import Tolerance

    with pytest.raises(db.SpecError, match="c_output"):
        Tolerance(c_output=-1.0)
    with pytest.raises(db.SpecError, match="grad_out"):
        db.Activation("relu").vjp(np.zeros(3), None, np.zeros(4))
    with pytest.raises(db.SpecError, match="y must"):
        db.Activation("relu").vjp(np.zeros(3), np.zeros(2), np.zeros(3))
    from dense_bridge.cli import _demo

    with pytest.raises(db.SpecError, match="steps"):
        _demo.run(steps=-1)
    with pytest.raises(TypeError, match="steps"):
        _demo.run(steps=1.5)
    layer = db.compile(db.Dense(2, in_features=2), "numpy", seed=0)
    with pytest.raises(db.DenseBridgeError, match="before forward"):
        layer.backward(np.zeros((1, 2)))


def test_one_compile_path_remembers_the_spec_once():
    from dense_bridge.params._source import ParamSource
    from dense_bridge.registry._remembered_spec import remembered_spec

    spec = db.Sequential([db.Dense(3, in_features=2, kernel_init="he_normal", name="a"), db.Dense(1)], name="m")
    calls = []

    def stream(index, layer):
        calls.append(index)
        from dense_bridge.params._source import initial_layer_params

        return initial_layer_params(layer, 7, index)

    for backend in db.available_backends():
        calls.clear()
        native = db._api.build(backend, ParamSource(spec, stream=stream))
        assert calls == [0, 1]  # asked layer by layer
        if backend != "onnx":  # an onnx.ModelProto takes no attributes: it keeps the spec in metadata_props
            assert remembered_spec(native) == spec
        assert db.to_spec(native) == spec
        same = db.compile(spec, backend, seed=7)
        for k, v in db.get_params(same).items():
            np.testing.assert_array_equal(v, db.get_params(native)[k])
    with pytest.raises(TypeError, match="not both"):
        ParamSource(spec, params={}, stream=stream)


# ------------------------------------------------------------------ one resolution per call
def _calls_while(fn, *functions):
    """(fn's result, how many times each of ``functions`` was entered while it ran)."""
    import sys

    codes = {f.__code__: f.__name__ for f in functions}
    counts = dict.fromkeys(codes.values(), 0)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, counts


def test_each_verb_resolves_its_object_once(backend):
    """get_params, set_params, to_spec and convert find the owning backend at most twice per call,
    and decide ownership by asking the adapters at most once per type."""
    from dense_bridge.registry import _backends

    spec = db.Sequential([db.Dense(4, in_features=3, activation="relu"), db.Dense(2)])
    model = db.compile(spec, backend, seed=0)
    params = db.get_params(model)
    verbs = {"get_params": lambda: db.get_params(model), "set_params": lambda: db.set_params(model, params),
             "to_spec": lambda: db.to_spec(model), "convert": lambda: db.convert(model, "numpy")}
    for name, call in verbs.items():
        _, counts = _calls_while(call, _backends.backend_of)
        assert counts["backend_of"] <= 2, (name, counts)
    owns = _backends.get_adapter(backend).owns
    _, counts = _calls_while(lambda: [db.get_params(model) for _ in range(3)], owns)
    assert counts["owns"] == 0, counts  # the type's owner was kept from the first call


def test_handles_say_what_an_object_is():
    from dense_bridge import _handles

    model = db.compile(db.Dense(2, in_features=3), "numpy", seed=0)
    handle = _handles.resolve(model)
    assert type(handle) is _handles.Plain and handle.backend == "numpy" and handle.spec() == db.to_spec(model)
    assert _handles.resolve(model, codes=True).kind == "quantized"
    with pytest.raises(db.ConversionError, match="not a quantized linear layer"):
        db.get_params(model, quantized=True)
    with pytest.raises(TypeError, match="local=True needs a parallel model"):
        db.get_params(model, local=True)
    with pytest.raises(db.ConversionError, match="adapter keys.*no adapter"):
        db.set_params(model, {**db.get_params(model), "lora_a": np.zeros((3, 1))})
    with pytest.raises(TypeError, match="native must be a layer or model"):
        _handles.resolve(object())


def test_a_backend_registered_later_wins_the_types_it_owns_first():
    """Ownership is kept per type; registering a backend that claims the type by a higher
    priority takes it over at once, and removing that backend gives it back."""
    import types

    from dense_bridge.registry import _backends
    from dense_bridge.registry._manifest import Manifest

    model = db.compile(db.Dense(2, in_features=3), "numpy", seed=0)
    assert db.backend(model) == "numpy"  # the type's owner is now kept
    reference = _backends.get_adapter("numpy")
    module = types.ModuleType("claiming_adapter")
    for verb in dir(reference):
        if not verb.startswith("_"):
            setattr(module, verb, getattr(reference, verb))
    module.MANIFEST = Manifest(owner_priority=100)
    db.register_backend("claiming", module)
    try:
        assert db.backend(model) == "claiming"
    finally:
        _backends.BACKENDS.pop("claiming", None)
    assert db.backend(model) == "numpy"
