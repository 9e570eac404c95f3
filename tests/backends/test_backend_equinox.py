"""The Equinox backend: one sample per call (jax.vmap), masks out of eqx.is_inexact_array
filtering under optax, eqx.nn.MLP read as a chain, lazy widths refused, and optax-trained ports.

Shapes stay small: every trace is one XLA compile.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend

eqx_backend = require_backend("equinox")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402


def _bits(params):
    return {k: (np.asarray(v).dtype.name, np.ascontiguousarray(np.asarray(v)).tobytes()) for k, v in params.items()}


def test_plain_dense_is_exactly_eqx_linear_with_weight_out_in():
    spec = db.Dense(3, in_features=4, bias_init="normal")
    layer = db.compile(spec, "equinox", seed=1)
    assert type(layer) is eqx.nn.Linear
    ref = db.get_params(db.compile(spec, "numpy", seed=1))
    np.testing.assert_array_equal(np.asarray(layer.weight), ref["kernel"].T)
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.vmap(layer)(jnp.asarray(x))), x @ ref["kernel"] + ref["bias"], rtol=1e-5)


def test_one_sample_per_call_and_a_batch_is_a_spec_error_naming_vmap():
    layer = db.compile(db.Dense(4, in_features=4, activation="relu"), "equinox", seed=0)
    with pytest.raises(db.SpecError, match="vmap"):
        layer(jnp.ones((4, 4)))  # square: eqx.nn.Linear's weight @ x would silently accept this
    assert jax.vmap(layer)(jnp.ones((3, 4))).shape == (3, 4)
    # trace, compare and compare's inputs vmap over any leading axes for you
    trace = eqx_backend.trace(layer, [np.ones((2, 3, 4), np.float32)], np.ones((2, 3, 4), np.float32))
    assert trace.layers[0].output.shape == (2, 3, 4)


def test_lazy_widths_and_cross_sample_softmax_are_spec_errors():
    with pytest.raises(db.SpecError, match="immutable.*in_features"):
        db.compile(db.Sequential([db.Dense(3), db.Dense(2)]), "equinox")
    assert db.to_spec(db.compile(db.Sequential([db.Dense(3), db.Dense(2)], in_features=4), "equinox")).layers[0].in_features == 4
    with pytest.raises(db.SpecError, match="axis 0"):
        db.compile(db.Dense(3, in_features=2, activation=db.Activation("softmax", axis=0)), "equinox")


def test_masks_stay_out_of_inexact_filtering_and_hold_under_adamw_with_weight_decay():
    spec = db.Sequential([db.Dense(8, in_features=6, activation="tanh", mask=db.wiring.banded(6, 8, 1)),
                          db.Dense(2, mask=db.wiring.random(8, 2, 0.5, 0))], in_features=6)
    model = db.compile(spec, "equinox", seed=0)
    assert model.layers[0].mask.dtype == jnp.bool_
    trainable = eqx.filter(model, eqx.is_inexact_array)
    assert trainable.layers[0].mask is None and trainable.layers[0].weight is not None
    before = db.get_params(model)
    opt = optax.adamw(0.05, weight_decay=0.5)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 6)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(5):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    after = db.get_params(model)
    for i, layer in enumerate(spec.layers):
        kernel = np.asarray(after[f"{i}.kernel"])
        assert (kernel[~layer.mask.adjacency] == 0).all(), "masked weights moved"
        assert not np.array_equal(kernel, before[f"{i}.kernel"]), "the layer did not train"
        np.testing.assert_array_equal(after[f"{i}.mask"], before[f"{i}.mask"])


def test_mlp_reads_as_a_chain_with_jax_nn_defaults_and_converts():
    mlp = eqx.nn.MLP(5, 3, width_size=8, depth=2, activation=jax.nn.gelu, key=jax.random.PRNGKey(0))
    spec = db.to_spec(mlp)
    assert [type(l).__name__ for l in spec.layers] == ["Dense", "Activation", "Dense", "Activation", "Dense"]
    assert spec.layers[1] == db.Activation("gelu_tanh")  # jax.nn.gelu's default is the tanh approximation
    assert sorted(db.get_params(mlp)) == ["0.bias", "0.kernel", "2.bias", "2.kernel", "4.bias", "4.kernel"]
    port = db.convert(mlp, to="torch" if "torch" in db.available_backends() else "numpy")
    db.testing.assert_equivalent(mlp, port)
    relu_mlp = eqx.nn.MLP(2, 2, 4, 1, final_activation=functools.partial(jax.nn.leaky_relu, negative_slope=0.1),
                          key=jax.random.PRNGKey(1))
    assert db.to_spec(relu_mlp).layers[-1] == db.Activation("leaky_relu", negative_slope=0.1)
    with pytest.raises(db.ConversionError, match="one neuron at a time"):
        db.to_spec(eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.softmax, key=jax.random.PRNGKey(0)))


def test_set_params_rebinds_the_fields_in_place_and_bilinear_converts():
    layer = db.compile(db.Dense(3, in_features=2), "equinox", seed=0)
    db.set_params(layer, {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(np.asarray(layer(jnp.ones(2))), [2.0, 2.0, 2.0])
    bil = db.compile(db.Bilinear(2, 3, 4), "equinox", seed=3)
    for target in ("numpy", "flax"):
        port = db.convert(bil, to=target)
        assert _bits(db.get_params(port)) == _bits(db.get_params(bil))
        db.testing.assert_equivalent(bil, port)


def test_float64_needs_jax_x64():
    with pytest.raises(db.SpecError, match="jax_enable_x64"):
        db.compile(db.Dense(2, in_features=2, dtype="float64"), "equinox")


def test_a_model_trained_with_optax_ports_to_torch_and_keras():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    model = eqx.nn.Sequential([eqx.nn.Linear(6, 16, key=keys[0]), eqx.nn.Lambda(jax.nn.relu),
                               eqx.nn.Linear(16, 8, key=keys[1]), eqx.nn.Lambda(jax.nn.tanh),
                               eqx.nn.Linear(8, 3, key=keys[2])])
    opt = optax.adamw(1e-2, weight_decay=1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 6)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(32, 3)), jnp.float32)

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(4):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    for target in ("torch", "keras"):
        if target not in db.available_backends():
            continue
        port = db.convert(model, to=target)
        assert db.testing.assert_equivalent(model, port, inputs=np.asarray(x[:8])).passed
        assert _bits(db.get_params(port)) == _bits(db.get_params(model))


def test_walk_paths_follow_field_order():
    class Net(eqx.Module):
        embed: eqx.nn.Embedding
        mlp: eqx.nn.MLP
        norm: eqx.nn.LayerNorm

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.embed = eqx.nn.Embedding(10, 4, key=k1)
            self.mlp = eqx.nn.MLP(4, 2, 8, 1, key=k2)
            self.norm = eqx.nn.LayerNorm(2)

    net = Net(jax.random.PRNGKey(0))
    assert list(db.linear_layers(net)) == ["mlp.layers.0", "mlp.layers.1"]
    assert [(e.path, e.kind) for e in eqx_backend.walk(net)] == [
        ("embed", "other"), ("mlp.layers.0", "linear"), ("mlp.layers.1", "linear"), ("norm", "other")]


def test_native_file_tree_serialise_leaves_round_trips_bit_exactly(tmp_path):
    spec = db.Sequential([db.Dense(4, in_features=3, activation="relu", mask=db.wiring.banded(3, 4, 1)),
                          db.Dense(2)])
    model = db.compile(spec, "equinox", seed=3)
    path = str(tmp_path / "m.eqx")
    eqx_backend.write_file(model, path, "eqx", temp=path)
    entries, _ = eqx_backend.file_info(path, "eqx")
    assert entries["leaf.0"] == ((4, 3), "float32") and entries["leaf.2"] == ((4, 3), "bool")

    def strict(got, expected):
        if got != expected:
            raise db.CheckpointError(f"differ: {got} vs {expected}")

    loaded = eqx_backend.read_file(path, "eqx", db.compile(spec, "equinox", seed=99), check=strict)
    assert _bits(db.get_params(loaded)) == _bits(db.get_params(model))
    with pytest.raises(db.CheckpointError, match="differ"):
        eqx_backend.read_file(path, "eqx", db.compile(db.Dense(2, in_features=3), "equinox"), check=strict)
    (tmp_path / "bad.eqx").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(db.CheckpointError, match="bad.eqx"):
        eqx_backend.file_info(str(tmp_path / "bad.eqx"), "eqx")


def test_capture_vmaps_the_model_and_compare_models_matches_a_torch_port():
    model = db.compile(db.Sequential([db.Dense(4, in_features=3, activation="tanh"), db.Dense(2)]), "equinox", seed=0)
    layers = dict(db.linear_layers(model))
    assert list(layers) == ["layers.0", "layers.1"]
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    cot = lambda shape: np.random.default_rng(7).standard_normal(shape)  # noqa: E731
    cap = eqx_backend.capture(model, [x], layers, cotangent=cot)
    assert [(c.path, c.output.shape) for c in cap.calls] == [("layers.0", (5, 4)), ("layers.1", (5, 2))]
    assert cap.pre_activation == {"layers.0"}  # the linear map alone, the tanh after it
    trace = eqx_backend.trace(model, [x], cot((5, 2)).astype(np.float32))
    np.testing.assert_allclose(cap.param_grads["layers.1"]["kernel"], trace.layers[1].param_grads["kernel"], rtol=1e-6)
    assert type(model.layers[0]) is eqx_backend.DenseLinear  # the classes are put back
    if "torch" in db.available_backends():
        assert db.testing.compare_models(model, db.convert(model, to="torch"), [x]).passed


def test_capture_refuses_a_layer_called_inside_the_models_own_vmap():
    class PerToken(eqx.Module):  # a sequence model that vmaps its projection over the tokens itself
        proj: eqx.nn.Linear

        def __call__(self, tokens):  # tokens (seq, 3) for one sample
            return jax.vmap(self.proj)(tokens)

    model = PerToken(eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0)))
    x = np.zeros((4, 5, 3), np.float32)  # batch 4, sequence 5
    with pytest.raises(db.ConversionError, match="inside the model's own jax.vmap"):
        eqx_backend.capture(model, [x], {"proj": model.proj}, cotangent=np.ones)
    assert type(model.proj) is eqx.nn.Linear  # the class is put back after the error


def _npy_record(shape, descr="<f4", data=b""):
    import io

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
    return header.getvalue() + data


@pytest.mark.parametrize("case, content, error", [
    ("claims 60000^2 in 2 KB", _npy_record((60000, 60000), data=b"\0" * 2000), "claims .*14400000000 bytes.* 2000 bytes"),
    ("object array", _npy_record((2,), descr="|O", data=b"\0" * 16), "Python objects"),
    ("not npy", b"PK\x03\x04 not an eqx file at all", "cannot read"),
    ("bad version", b"\x93NUMPY\x09\x00" + b"\0" * 64, "cannot read"),
])
def test_hostile_eqx_files_are_refused_from_their_headers_without_allocating(tmp_path, case, content, error):
    import tracemalloc

    path = tmp_path / "model.eqx"
    path.write_bytes(content)
    tracemalloc.start()
    try:
        with pytest.raises(db.CheckpointError, match=error):
            eqx_backend.file_info(str(path), "eqx")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{case}: {peak} bytes allocated for a {len(content)}-byte file"


def test_a_truncated_eqx_file_is_refused_naming_the_record(tmp_path):
    model = db.compile(db.Sequential([db.Dense(4, in_features=3), db.Dense(2)]), "equinox", seed=0)
    path = tmp_path / "model.eqx"
    with open(path, "wb") as f:
        eqx.tree_serialise_leaves(f, model)
    assert eqx_backend.file_info(str(path), "eqx")[0]["leaf.2"] == ((2, 4), "float32")
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(db.CheckpointError, match="record 3 .* only 5 bytes are left"):
        eqx_backend.file_info(str(path), "eqx")
    with pytest.raises(db.CheckpointError, match="record 3"):
        eqx_backend.read_file(str(path), "eqx", model, check=lambda got, expected: None)
