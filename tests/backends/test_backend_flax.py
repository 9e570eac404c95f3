"""The Flax NNX backend: masks under nnx.Optimizer, lazy widths, jax.nn defaults, float64,
reading hand-made NNX modules, optax-trained ports, and bit-exact conversion between all six backends.

Shapes stay small: every trace is one XLA compile (about 0.3-1 s on this machine).
"""
from __future__ import annotations

import functools
import itertools
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db

from conftest import ALL_BACKENDS, require_backend

require_backend("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

flax_backend = require_backend("flax")
BACKENDS = Path(db.__file__).parent.parent / "backends"


def _bits(params):
    return {k: (np.asarray(v).dtype.name, np.ascontiguousarray(np.asarray(v)).tobytes()) for k, v in params.items()}


# ------------------------------------------------------------------ every pair of the six backends
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_ordered_pair_of_the_six_backends_converts_bit_identically(dtype):
    names = [n for n in ALL_BACKENDS if n in db.available_backends()]
    assert {"flax", "equinox"} <= set(names)
    spec = db.Sequential([db.Dense(6, in_features=5, activation="gelu", dtype=dtype, bias_init="normal",
                                   mask=db.wiring.random(5, 6, 0.5, 3)),
                          db.Activation("leaky_relu", negative_slope=0.2), db.Dense(3, dtype=dtype, bias_init="normal")])
    start = {n: db.compile(spec, n, seed=7) for n in names}
    reference = _bits(db.get_params(start["numpy"]))
    pairs = 0
    for src, dst in itertools.permutations(names, 2):
        out = db.convert(start[src], to=dst)
        assert db.backend(out) == dst
        assert _bits(db.get_params(out)) == reference, (src, dst)
        assert db.to_spec(out) == spec, (src, dst)
        pairs += 1
    assert pairs == len(names) * (len(names) - 1)


# ------------------------------------------------------------------ what compile builds
def test_plain_dense_is_exactly_nnx_linear_with_the_canonical_kernel():
    spec = db.Dense(3, in_features=4, bias_init="normal")
    layer = db.compile(spec, "flax", seed=1)
    assert type(layer) is nnx.Linear
    params = db.get_params(db.compile(spec, "numpy", seed=1))
    np.testing.assert_array_equal(np.asarray(layer.kernel[...]), params["kernel"])  # (in, out): no transpose
    x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), x @ params["kernel"] + params["bias"], rtol=1e-5)


def test_mask_is_a_variable_not_a_param_and_holds_under_adamw_with_weight_decay():
    spec = db.Sequential([db.Dense(8, in_features=6, activation="tanh", mask=db.wiring.banded(6, 8, 1)),
                          db.Dense(2, mask=db.wiring.random(8, 2, 0.5, 0))])
    model = db.compile(spec, "flax", seed=0)
    mask0 = model.layers[0].mask
    assert isinstance(mask0, nnx.Variable) and not isinstance(mask0, nnx.Param)
    assert not any("mask" in str(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    before = db.get_params(model)
    opt = nnx.Optimizer(model, optax.adamw(0.05, weight_decay=0.5), wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 6)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(5)]
    assert losses[-1] < losses[0]
    after = db.get_params(model)
    for i, layer in ((0, spec.layers[0]), (1, spec.layers[1])):
        kernel = np.asarray(after[f"{i}.kernel"])
        assert (kernel[~layer.mask.adjacency] == 0).all(), "masked weights moved"
        assert not np.array_equal(kernel, before[f"{i}.kernel"]), "the layer did not train"
        np.testing.assert_array_equal(after[f"{i}.mask"], before[f"{i}.mask"])


def test_lazy_width_builds_on_the_first_eager_call_with_the_eager_bits():
    eager = db.get_params(db.compile(db.Dense(3, in_features=5, activation="relu"), "flax", seed=9))
    lazy = db.compile(db.Dense(3, activation="relu"), "flax", seed=9)
    with pytest.raises(db.ConversionError, match="(?i)first input"):
        db.get_params(lazy)
    assert db.to_spec(lazy).lazy
    lazy(jnp.ones((2, 5)))
    assert _bits(db.get_params(lazy)) == _bits(eager)
    assert db.to_spec(lazy).in_features == 5


def test_lazy_width_under_a_jax_transform_is_a_clear_spec_error():
    lazy = db.compile(db.Dense(3), "flax", seed=0)

    @jax.jit
    def run(x):
        return lazy(x)

    with pytest.raises(db.SpecError, match="eagerly"):
        run(jnp.ones((2, 5)))


# ------------------------------------------------------------------ jax.nn defaults, both ways
def test_jax_nn_defaults_are_read_exactly_and_written_explicitly():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), jax.nn.gelu, nnx.Linear(4, 4, rngs=rngs),
                           jax.nn.leaky_relu, functools.partial(jax.nn.gelu, approximate=False),
                           functools.partial(jax.nn.softmax, axis=0), jax.nn.selu)
    acts = [l for l in db.to_spec(model).layers if isinstance(l, db.Activation)]
    assert acts == [db.Activation("gelu_tanh"), db.Activation("leaky_relu", negative_slope=0.01),
                    db.Activation("gelu"), db.Activation("softmax", axis=0), db.Activation("selu")]
    compiled = db.compile(db.Sequential([db.Activation("gelu"), db.Activation("gelu_tanh"),
                                         db.Activation("leaky_relu", negative_slope=0.3),
                                         db.Activation("log_softmax")]), "flax")
    assert [(f.func, f.keywords) for f in compiled.layers] == [
        (jax.nn.gelu, {"approximate": False}), (jax.nn.gelu, {"approximate": True}),
        (flax_backend._activations.leaky_relu, {"negative_slope": 0.3}), (jax.nn.log_softmax, {"axis": -1})]


def test_unknown_callables_and_mixed_precision_are_conversion_errors():
    with pytest.raises(db.ConversionError, match="callable"):
        db.to_spec(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), lambda x: x * 2))
    with pytest.raises(db.ConversionError, match="mixed"):
        db.to_spec(nnx.Linear(2, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("act", [db.Activation("relu"), db.Activation("relu6"), db.Activation("leaky_relu"),
                                 db.Activation("elu", alpha=2.0), db.Activation("selu"),
                                 db.Activation("hard_sigmoid"), db.Activation("hard_silu")], ids=repr)
def test_gradients_at_exact_kinks_match_the_reference(act):
    kinks = np.array([-3.0, 0.0, 3.0, 6.0, -6.0], np.float32)
    spec = db.Dense(5, in_features=5, activation=act, use_bias=False)
    params = {"kernel": np.eye(5, dtype=np.float32)}  # puts the kinks exactly at the activation
    got = flax_backend.trace(db.compile(spec, "flax", params=params), [kinks[None]], np.ones((1, 5), np.float32))
    ref = require_backend("numpy").trace(db.compile(spec, "numpy", params=params), [kinks[None]],
                                         np.ones((1, 5), np.float32))
    np.testing.assert_allclose(got.layers[0].input_grads[0], ref.layers[0].input_grads[0], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ float64
def test_float64_needs_jax_x64():
    with pytest.raises(db.SpecError, match="jax_enable_x64"):
        db.compile(db.Dense(2, in_features=2, dtype="float64"), "flax")
    jax.config.update("jax_enable_x64", True)
    try:
        spec = db.Dense(3, in_features=4, dtype="float64", activation="gelu", bias_init="normal")
        layer = db.compile(spec, "flax", seed=2)
        assert layer.kernel[...].dtype == jnp.float64
        db.testing.assert_equivalent(layer, db.compile(spec, "numpy", seed=2))
    finally:
        jax.config.update("jax_enable_x64", False)


# ------------------------------------------------------------------ a model trained with optax ports
def test_a_model_trained_with_optax_ports_to_torch_and_keras():
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(6, 16, rngs=rngs), jax.nn.relu, nnx.Linear(16, 8, rngs=rngs),
                           functools.partial(jax.nn.gelu, approximate=False), nnx.Linear(8, 3, rngs=rngs))
    opt = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=1e-2), wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 6)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(32, 3)), jnp.float32)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(4)]
    assert losses[-1] < losses[0]
    for target in ("torch", "keras"):
        if target not in db.available_backends():
            continue
        port = db.convert(model, to=target)
        report = db.testing.assert_equivalent(model, port, inputs=np.asarray(x[:8]))
        assert report.passed
        assert _bits(db.get_params(port)) == _bits(db.get_params(model))


# ------------------------------------------------------------------ walk
def test_walk_paths_are_dotted_attributes_in_definition_order():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.down = nnx.Linear(8, 4, rngs=rngs)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 4, rngs=rngs)
            self.blocks = nnx.List([Block(rngs), Block(rngs)])
            self.head = db.compile(db.Dense(2, in_features=4, mask=db.wiring.banded(4, 2, 1)), "flax")

    net = Net(nnx.Rngs(0))
    assert list(db.linear_layers(net)) == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"]
    entries = flax_backend.walk(net)
    assert [(e.path, e.kind) for e in entries][:3] == [("embed", "other"), ("blocks.0.up", "linear"),
                                                      ("blocks.0.norm", "other")]
    head = [e for e in entries if e.path == "head"][0]
    assert "mask" not in head.names  # part of the spec, not a parameter to move


def test_the_jax_adapters_share_one_array_and_activation_module():
    from dense_bridge.backends.equinox import _activations as eqx_act, _arrays as eqx_arr
    from dense_bridge.backends.flax import _activations as flax_act, _arrays as flax_arr

    assert flax_arr.to_jax is eqx_arr.to_jax and flax_arr.to_numpy is eqx_arr.to_numpy
    assert flax_act.activation_fn is eqx_act.activation_fn


# ------------------------------------------------------------------ native files
@pytest.mark.parametrize("kind", ["msgpack"])
def test_native_files_msgpack_round_trip_bit_exactly(tmp_path, kind):
    spec = db.Sequential([db.Dense(4, in_features=3, activation="relu", mask=db.wiring.banded(3, 4, 1)),
                          db.Dense(2, dtype="float32")])
    model = db.compile(spec, "flax", seed=3)
    path = tmp_path / ("m.msgpack" if kind == "msgpack" else "ckpt")
    flax_backend.write_file(model, str(path), kind, temp=str(path))
    entries, _ = flax_backend.file_info(str(path), kind)
    assert entries["layers.0.kernel"] == ((3, 4), "float32") and "layers.0.mask" in entries
    fresh = db.compile(spec, "flax", seed=99)

    def check(got, expected):
        assert got == expected

    loaded = flax_backend.read_file(str(path), kind, fresh, check=check)
    assert _bits(db.get_params(loaded)) == _bits(db.get_params(model))
    with pytest.raises(db.CheckpointError, match="differ|!="):
        def strict(got, expected):
            if got != expected:
                raise db.CheckpointError("differ")
        flax_backend.read_file(str(path), kind, db.compile(db.Dense(2, in_features=3), "flax"), check=strict)
