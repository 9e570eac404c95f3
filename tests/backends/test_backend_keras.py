"""The Keras 3 adapter on the backend this process runs Keras on (KERAS_BACKEND tensorflow, jax
or torch: tests/backends/test_keras_backends.py runs this file under each): native classes, exact
activations, masks in Keras' training loops, lazy layers, Bilinear, to_spec of hand-built models,
params and trace.

float64 checks use tensor constants of the right dtype: TF passes Python floats through
float32 in places (FACTS.md "Precision"), which is exactly what these tests would catch. On JAX
they need jax_enable_x64 (the subprocess runner sets JAX_ENABLE_X64=1); without it float64 is a
SpecError, which tests/backends/test_keras_backends.py checks.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
kb = pytest.importorskip("dense_bridge.backends.keras")
BACKEND = keras.backend.backend()
if BACKEND == "jax":
    import jax

    if not jax.config.jax_enable_x64:
        pytest.skip("float64 checks on Keras-JAX need JAX_ENABLE_X64=1", allow_module_level=True)

import dense_bridge as db  # noqa: E402
from dense_bridge._dtypes import numpy_dtype  # noqa: E402
from dense_bridge.activations import NAMES, Activation  # noqa: E402
from dense_bridge.backends import numpy as npb  # noqa: E402

DTYPES = ("float32", "float64", "float16", "bfloat16")

# every activation with default parameters, plus non-default variants
ACTIVATIONS = [Activation(n) for n in NAMES] + [
    Activation("leaky_relu", negative_slope=0.2), Activation("leaky_relu", negative_slope=0.5),
    Activation("elu", alpha=0.7), Activation("selu", alpha=1.5, scale=1.25),
    Activation("softmax", axis=0), Activation("log_softmax", axis=0),
]


def _id(act: Activation) -> str:
    return act.name + "".join(f"-{v}" for v in act.params.values())


def T(x):
    """A backend tensor of ``x`` in its own dtype (float64 stays float64)."""
    x = np.asarray(x)
    return keras.ops.convert_to_tensor(x, dtype=x.dtype.name)


def N(y) -> np.ndarray:
    """A numpy array of a backend tensor."""
    return np.asarray(keras.ops.convert_to_numpy(y))


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of an array, so -0.0 != 0.0 and bfloat16 compares exactly."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def assert_same_bits(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(bits(a[k]), bits(b[k]), err_msg=k)


def close64(actual, expected, rtol=1e-12):
    """|a - e| <= rtol * (1 + |e|): float64 agreement far below any float32 rounding."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected) / (1.0 + np.abs(expected))
    assert err.max() <= rtol, f"max scaled error {err.max():.3e}"


def probe_points(width: int = 8) -> np.ndarray:
    """float64 inputs over [-10, 10] plus kinks and tiny values, shaped (n, width)."""
    x = np.concatenate([np.linspace(-10, 10, 8 * width - 8), [-3.0, 3.0, 6.0, 1e-9, -1e-9, 1e-3, -0.5, 0.25]])
    return x.reshape(-1, width)


# ============================================================ classes and names
def test_plain_dense_is_exactly_keras_dense_with_native_names():
    layer = db.compile(db.Dense(3, in_features=4), "keras", seed=0)
    assert type(layer) is keras.layers.Dense and layer.built
    assert [w.path.split("/")[-1] for w in layer.weights] == ["kernel", "bias"]
    assert tuple(layer.kernel.shape) == (4, 3)  # Keras layout == canonical: no transpose
    lazy = db.compile(db.Dense(3), "keras", seed=0)
    assert type(lazy) is keras.layers.Dense and not lazy.built


@pytest.mark.parametrize("spec", [db.Dense(3, in_features=4, activation="relu"),
                                  db.Dense(3, in_features=4, mask=db.wiring.banded(4, 3, 1)),
                                  db.Dense(3, activation="gelu")], ids=["act", "mask", "lazy-act"])
def test_activation_or_mask_gives_the_registered_subclass(spec):
    layer = db.compile(spec, "keras", seed=0)
    assert type(layer) is kb.DenseBridgeDense and isinstance(layer, keras.layers.Dense)
    assert keras.saving.get_registered_name(kb.DenseBridgeDense) == "dense_bridge>DenseBridgeDense"


def test_mask_is_a_non_trainable_weight_named_mask():
    layer = db.compile(db.Dense(3, in_features=4, mask=db.wiring.banded(4, 3, 1)), "keras", seed=0)
    assert [w.path.split("/")[-1] for w in layer.trainable_weights] == ["kernel", "bias"]
    assert [w.path.split("/")[-1] for w in layer.non_trainable_weights] == ["mask"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_variables_hold_the_spec_dtype(dtype):
    layer = db.compile(db.Dense(3, in_features=4, activation="tanh", mask=db.wiring.banded(4, 3, 1),
                                dtype=dtype), "keras", seed=0)
    assert {keras.backend.standardize_dtype(w.dtype) for w in layer.weights} == {dtype}
    y = layer(np.ones((2, 4), np.float32))
    assert keras.backend.standardize_dtype(y.dtype) == dtype


# ============================================================ same seed, same bits
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_seed_gives_the_numpy_backends_bits(dtype):
    spec = db.Sequential([db.Dense(5, in_features=4, mask=db.wiring.random(4, 5, 0.5, 1), dtype=dtype,
                                   kernel_init="he_normal", bias_init="torch_default"),
                          db.Activation("relu"), db.Dense(3, dtype=dtype)])
    assert_same_bits(db.get_params(db.compile(spec, "keras", seed=7)),
                     db.get_params(db.compile(spec, "numpy", seed=7)))


def test_bilinear_same_seed_same_bits_and_param_count():
    spec = db.Bilinear(3, 5, 2, dtype="bfloat16")
    layer = db.compile(spec, "keras", seed=3)
    assert_same_bits(db.get_params(layer), db.get_params(db.compile(spec, "numpy", seed=3)))
    assert layer.count_params() == spec.num_params == 2 * 3 * 5 + 2


# ============================================================ activations
@pytest.mark.parametrize("act", ACTIVATIONS, ids=_id)
def test_activation_float64_matches_reference(act):
    """Both the Dense activation and the Sequential activation layer, on an identity kernel."""
    x = probe_points()
    params = {"kernel": np.eye(8), "bias": np.zeros(8)}
    dense = db.compile(db.Dense(8, in_features=8, activation=act, dtype="float64"), "keras", params=params)
    close64(N(dense(T(x))), act.forward(x))
    seq = db.compile(db.Sequential([db.Dense(8, in_features=8, dtype="float64"), act]), "keras",
                     params={"0." + k: v for k, v in params.items()})
    close64(N(seq(T(x))), act.forward(x))


@pytest.mark.parametrize("act", ACTIVATIONS, ids=_id)
def test_activation_gradients_float64_match_reference(act):
    spec = db.Sequential([db.Dense(6, in_features=4, activation=act, dtype="float64"),
                          db.Dense(6, dtype="float64"), act])
    rng = np.random.default_rng(0)
    x, g = 3 * rng.normal(size=(5, 4)), rng.normal(size=(5, 6))
    assert_traces_close(spec, [x], g)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_activation_rounds_once_like_the_reference(dtype):
    act = Activation("gelu")
    x = probe_points().astype(numpy_dtype(dtype))
    y = N(kb.ExactActivation(act)(T(x)))
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(bits(y), bits(act.forward(x)))


def test_native_activation_layers_only_where_exact():
    s = db.Sequential([db.Dense(3, in_features=2, dtype="float64"), Activation("relu"), Activation("relu6"),
                       Activation("leaky_relu", negative_slope=0.5), Activation("leaky_relu"),
                       Activation("elu", alpha=0.7), Activation("softmax", axis=0), Activation("sigmoid"),
                       Activation("gelu"), Activation("log_softmax"), Activation("log_softmax", axis=0)])
    layers = db.compile(s, "keras", seed=0).layers
    kinds = [(type(l).__name__, getattr(l, "negative_slope", None) or getattr(l, "max_value", None))
             for l in layers[1:7]]
    assert kinds == [("ReLU", None), ("ReLU", 6.0), ("LeakyReLU", 0.5),
                     # 0.01 is not a float32: tf.nn.leaky_relu would round it (torch/JAX take a double)
                     ("Activation", None) if BACKEND == "tensorflow" else ("LeakyReLU", 0.01),
                     ("ELU", None), ("Softmax", None)]
    if BACKEND == "tensorflow":
        assert layers[7].activation is keras.activations.sigmoid
        assert layers[9].activation is keras.activations.log_softmax
    else:  # keras.ops rounds some float64 functions through float32 on JAX/torch: ours everywhere
        assert isinstance(layers[7].activation, kb.ExactActivation)
        assert isinstance(layers[9].activation, kb.ExactActivation)
    assert isinstance(layers[8].activation, kb.ExactActivation)  # tf.nn.gelu is 5e-9 off in float64
    assert isinstance(layers[10].activation, kb.ExactActivation)


# Keras' own activations, read with Keras' defaults made explicit.
KERAS_NAMES = {
    "linear": Activation("linear"), "relu": Activation("relu"), "relu6": Activation("relu6"),
    "leaky_relu": Activation("leaky_relu", negative_slope=0.2), "elu": Activation("elu", alpha=1.0),
    "selu": Activation("selu"), "gelu": Activation("gelu"), "silu": Activation("silu"),
    "swish": Activation("silu"), "sigmoid": Activation("sigmoid"), "hard_sigmoid": Activation("hard_sigmoid"),
    "hard_silu": Activation("hard_silu"), "hard_swish": Activation("hard_silu"), "tanh": Activation("tanh"),
    "softplus": Activation("softplus"), "softsign": Activation("softsign"), "mish": Activation("mish"),
    "softmax": Activation("softmax", axis=-1), "log_softmax": Activation("log_softmax", axis=-1),
    "exponential": Activation("exponential"),
}


@pytest.mark.parametrize("name", sorted(KERAS_NAMES))
def test_to_spec_reads_keras_activation_names_exactly(name):
    # Keras' own float64 layers compute in float32 on JAX/torch (keras.ops type promotion maps
    # float64 to float32 there): check the function read at float32 resolution on those
    dtype, rtol = ("float64", 1e-7) if BACKEND == "tensorflow" else ("float32", 2e-6)
    layer = keras.layers.Dense(8, activation=name, dtype=dtype)
    layer.build((None, 8))
    layer.kernel.assign(np.eye(8, dtype=dtype))
    spec = db.to_spec(layer)
    assert spec.activation == KERAS_NAMES[name]
    x = probe_points().astype(dtype)
    # what Keras computes is the function we read (1e-7: Keras' own float32 constants, see FACTS)
    close64(N(layer(T(x))), spec.activation.forward(x.astype(np.float64)), rtol=rtol)


def test_keras_activation_defaults_read_not_assumed():
    assert db.to_spec(keras.layers.LeakyReLU()) == Activation("leaky_relu", negative_slope=0.3)
    assert db.to_spec(keras.layers.LeakyReLU(negative_slope=0.05)).params["negative_slope"] == 0.05
    assert db.to_spec(keras.layers.ReLU(max_value=6)) == Activation("relu6")
    assert db.to_spec(keras.layers.ReLU(negative_slope=0.1)) == Activation("leaky_relu", negative_slope=0.1)
    assert db.to_spec(keras.layers.ELU(alpha=0.5)) == Activation("elu", alpha=0.5)
    assert db.to_spec(keras.layers.Softmax(axis=1)) == Activation("softmax", axis=1)
    assert db.to_spec(keras.layers.Activation("gelu")) == Activation("gelu")
    with pytest.raises(db.ConversionError, match="threshold"):
        db.to_spec(keras.layers.ReLU(threshold=1.0))
    with pytest.raises(db.ConversionError, match="celu"):
        db.to_spec(keras.layers.Dense(2, activation="celu"))


# ============================================================ masks and training
def _masked_model(seed=0):
    mask = db.wiring.random(6, 5, 0.4, seed)
    spec = db.Sequential([db.Dense(5, in_features=6, mask=mask, activation="tanh"), db.Dense(2)])
    return db.compile(spec, "keras", seed=seed), mask.adjacency


def _data(n=40):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32)


def _assert_mask_held(model, adjacency, before):
    after = db.get_params(model)
    assert np.all(after["0.kernel"][~adjacency] == 0.0)
    np.testing.assert_array_equal(bits(after["0.mask"]), bits(before["0.mask"]))
    moved = after["0.kernel"][adjacency] != before["0.kernel"][adjacency]
    assert moved.all(), "unmasked weights should train"


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    lambda: keras.optimizers.Adam(0.01),
    lambda: keras.optimizers.SGD(0.05, weight_decay=0.1),  # decoupled: w -= lr * wd * w keeps 0 at 0
], ids=["sgd-momentum", "adam", "sgd-weight-decay"])
def test_masked_weights_stay_zero_through_fit(optimizer):
    model, adjacency = _masked_model()
    before = {k: np.array(v) for k, v in db.get_params(model).items()}
    model.compile(optimizer=optimizer(), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)  # 20 steps
    assert int(N(model.optimizer.iterations)) == 20
    _assert_mask_held(model, adjacency, before)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.GradientTape: JAX/torch loops in test_keras_backends.py")
def test_masked_weights_stay_zero_through_a_gradient_tape_loop():
    import tensorflow as tf

    model, adjacency = _masked_model(seed=1)
    before = {k: np.array(v) for k, v in db.get_params(model).items()}
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    x, y = _data(20)
    for step in range(20):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[step:step + 1]) - y[step:step + 1]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    assert len(model.trainable_variables) == 4  # the mask never trains
    _assert_mask_held(model, adjacency, before)


def test_mask_holds_from_the_first_forward_pass():
    mask = db.wiring.banded(4, 3, 1)
    spec = db.Dense(3, in_features=4, mask=mask)
    kernel = np.arange(1.0, 13.0, dtype=np.float32).reshape(4, 3)  # non-zero under the mask too
    layer = db.compile(spec, "keras", params={"kernel": kernel, "bias": np.zeros(3, np.float32),
                                              "mask": mask.as_array("float32")})
    stored = db.get_params(layer)["kernel"]
    np.testing.assert_array_equal(stored, kernel * mask.adjacency)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(N(layer(x)), x @ (kernel * mask.adjacency))


# ============================================================ lazy layers
@pytest.mark.parametrize("activation", [None, "relu"])
def test_lazy_dense_draws_the_eager_params(activation):
    kw = dict(activation=activation, kernel_init="torch_default", bias_init="torch_default")
    lazy = db.compile(db.Dense(3, **kw), "keras", seed=5)
    with pytest.raises(db.ConversionError, match="lazy"):
        db.get_params(lazy)
    lazy(np.ones((2, 4), np.float32))
    eager = db.compile(db.Dense(3, in_features=4, **kw), "keras", seed=5)
    assert_same_bits(db.get_params(lazy), db.get_params(eager))
    assert db.to_spec(lazy) == db.to_spec(eager) == db.Dense(3, in_features=4, **kw)
    with pytest.raises(ValueError, match=r"expected axis -1 of input shape to have value 4.*\(2, 5\)"):
        lazy(np.ones((2, 5), np.float32))


def test_lazy_sequential_draws_the_eager_params():
    layers = [db.Dense(4, activation="relu"), db.Dense(2)]
    lazy = db.compile(db.Sequential(layers), "keras", seed=2)
    assert db.to_spec(lazy).in_features is None
    lazy(np.ones((1, 3), np.float32))
    eager = db.compile(db.Sequential(layers, in_features=3), "keras", seed=2)
    assert_same_bits(db.get_params(lazy), db.get_params(eager))
    assert db.to_spec(lazy) == db.Sequential(layers, in_features=3)


# ============================================================ Bilinear
def test_bilinear_matches_the_numpy_reference():
    spec = db.Bilinear(3, 5, 4, dtype="float64")  # in1 != in2: a swapped axis cannot pass
    layer = db.compile(spec, "keras", seed=1)
    rng = np.random.default_rng(2)
    x1, x2, g = rng.normal(size=(6, 3)), rng.normal(size=(6, 5)), rng.normal(size=(6, 4))
    kernel, bias = db.get_params(layer)["kernel"], db.get_params(layer)["bias"]
    close64(N(layer(T(x1), T(x2))), np.einsum("ni,kij,nj->nk", x1, kernel, x2) + bias)
    assert_traces_close(spec, [x1, x2], g)


# ============================================================ to_spec round trips
ROUND_TRIP = {
    **{f"act-{_id(a)}": db.Dense(4, in_features=3, activation=a) for a in ACTIVATIONS},
    "mask": db.Dense(3, in_features=4, mask=db.wiring.block_diagonal(4, 3, 1)),
    "mask-act-f64": db.Dense(3, in_features=4, mask=db.wiring.banded(4, 3, 1), activation="elu",
                             dtype="float64"),
    "no-bias": db.Dense(3, in_features=4, use_bias=False),
    **{f"dtype-{d}": db.Dense(3, in_features=4, dtype=d) for d in DTYPES},
    "inits": db.Dense(3, in_features=4, kernel_init="mlx_default", bias_init=db.Init("normal", stddev=0.1)),
    "inits-2": db.Dense(3, in_features=4, kernel_init=db.Init("orthogonal", gain=2.0), bias_init="he_uniform"),
    "named": db.Dense(3, in_features=4, name="hidden"),
    "lazy": db.Dense(3, activation="relu"),
    "sequential": db.Sequential([db.Dense(8, activation="relu"), db.Identity(), db.Activation("gelu"),
                                 db.Dense(2), db.Activation("softmax")], in_features=5,
                                name="mlp"),
    "sequential-lazy": db.Sequential([db.Activation("tanh"), db.Dense(4), db.Dense(2, activation="silu")]),
    "bilinear": db.Bilinear(3, 5, 2, use_bias=False, init="glorot_uniform", dtype="float16", name="bil"),
    "identity": db.Identity(),
    "activation": db.Activation("leaky_relu", negative_slope=0.25),
}


@pytest.mark.parametrize("spec", list(ROUND_TRIP.values()), ids=list(ROUND_TRIP))
def test_to_spec_of_compile_is_the_spec(spec):
    native = db.compile(spec, "keras", seed=0)
    assert db.to_spec(native) == spec
    assert kb.to_spec(native) == spec  # read off the Keras object alone, without compile's spec hint


def test_keras_file_round_trip_keeps_spec_and_params(tmp_path):
    spec = db.Sequential([db.Dense(5, mask=db.wiring.random(4, 5, 0.5, 0), activation=Activation("leaky_relu"),
                                   bias_init="torch_default"),
                          db.Activation("gelu"), db.Dense(2)], in_features=4)
    model = db.compile(spec, "keras", seed=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert db.to_spec(loaded) == spec  # initializers, activation parameters and mask survive the file
    assert_same_bits(db.get_params(loaded), db.get_params(model))

    i1, i2 = keras.Input((3,)), keras.Input((5,))
    bil = db.compile(db.Bilinear(3, 5, 2), "keras", seed=0)
    fn = keras.Model([i1, i2], bil(i1, i2))
    fn.save(path)
    assert_same_bits(db.get_params(keras.saving.load_model(path).layers[-1]), db.get_params(bil))


# ============================================================ hand-built Keras models
def _seed_mlps():
    """The MLPs of seed 003, as Keras users write them."""
    L = keras.layers
    seq = keras.Sequential([keras.Input((784,)), L.Dense(128, activation="relu"), L.Dense(10, activation="softmax")])
    added = keras.Sequential([keras.Input((784,))])
    for layer in (L.Dense(128), L.Activation("relu"), L.Dense(64), L.Activation("relu"), L.Dense(10),
                  L.Activation("softmax")):
        added.add(layer)
    inp = keras.Input((784,))
    x = L.Dense(128, activation="relu")(inp)
    x = L.Dropout(0.2)(x)
    x = L.Dense(64, activation="relu")(x)
    functional = keras.Model(inp, L.Dense(10, activation="softmax")(x))
    return seq, added, functional


def test_to_spec_of_seed_mlps():
    seq, added, functional = _seed_mlps()
    assert db.to_spec(seq) == db.Sequential([db.Dense(128, activation="relu"), db.Dense(10, activation="softmax")],
                                            in_features=784)
    relu, softmax = Activation("relu"), Activation("softmax")
    assert db.to_spec(added) == db.Sequential([db.Dense(128), relu, db.Dense(64), relu, db.Dense(10), softmax],
                                              in_features=784)
    assert db.to_spec(functional) == db.Sequential(
        [db.Dense(128, activation="relu"), db.Identity(), db.Dense(64, activation="relu"),
         db.Dense(10, activation="softmax")], in_features=784)
    assert sorted(db.get_params(functional)) == ["0.bias", "0.kernel", "2.bias", "2.kernel", "3.bias", "3.kernel"]


def test_hand_built_models_read_keras_leaky_defaults():
    L = keras.layers
    inp = keras.Input((4,))
    x = L.LeakyReLU()(L.Dense(3)(inp))
    model = keras.Model(inp, L.Dense(2, activation="leaky_relu")(x))
    spec = db.to_spec(model)
    assert spec.layers[1] == Activation("leaky_relu", negative_slope=0.3)
    assert spec.layers[2].activation == Activation("leaky_relu", negative_slope=0.2)


def test_hand_built_model_params_convert_and_agree():
    _, added, functional = _seed_mlps()
    x = np.random.default_rng(0).normal(size=(3, 784)).astype(np.float32)
    for model in (added, functional):
        ref = db.convert(model, to="numpy")
        assert_same_bits(db.get_params(ref), db.get_params(model))
        np.testing.assert_allclose(ref.forward(x), N(model(x, training=False)), atol=1e-6)


def test_unsupported_structures_name_the_layer():
    L = keras.layers
    inp = keras.Input((4,))
    residual = keras.Model(inp, L.Add(name="skip")([inp, L.Dense(4)(inp)]))
    with pytest.raises(db.ConversionError, match=r"'skip'.*Add"):
        db.to_spec(residual)
    flat = keras.Sequential([keras.Input((2, 2)), L.Reshape((4,), name="flat"), L.Dense(3)])
    with pytest.raises(db.ConversionError, match=r"'flat'.*Reshape"):
        db.to_spec(flat)
    with pytest.raises(db.ConversionError, match=r"'flat'.*Reshape"):
        db.get_params(flat)

    class Custom(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(db.ConversionError, match="subclassed"):
        db.to_spec(Custom())


# ============================================================ get/set params
@pytest.mark.parametrize("dtype", DTYPES)
def test_set_then_get_round_trips_bits(dtype):
    spec = db.Sequential([db.Dense(4, in_features=3, mask=db.wiring.banded(3, 4, 1), dtype=dtype), Activation("relu"),
                          db.Dense(2, dtype=dtype)])
    model = db.compile(spec, "keras", seed=0)
    rng = np.random.default_rng(1)
    dt = numpy_dtype(dtype)
    new = {k: rng.normal(size=v.shape).astype(dt) for k, v in db.get_params(model).items()}
    new["0.mask"] = db.wiring.banded(3, 4, 1).as_array(dt)
    new["0.kernel"] = new["0.kernel"] * new["0.mask"]
    new["2.kernel"] = np.asfortranarray(new["2.kernel"])  # a transposed view, as from torch's weight.T
    db.set_params(model, new)
    got = db.get_params(model)
    assert got["0.kernel"].dtype == dt  # bfloat16 stays ml_dtypes.bfloat16, never widened
    assert_same_bits(got, {k: np.ascontiguousarray(v) for k, v in new.items()})


def test_get_params_are_read_only_snapshots():
    layer = db.compile(db.Dense(3, in_features=4), "keras", seed=0)
    first = db.get_params(layer, copy=False)
    assert not first["kernel"].flags.writeable
    kept = first["kernel"].copy()
    snapshot = db.get_params(layer)  # copy=True: the caller's own arrays on every backend
    db.set_params(layer, {"kernel": np.ones((4, 3), np.float32), "bias": np.ones(3, np.float32)})
    np.testing.assert_array_equal(snapshot["kernel"], kept)
    # TF copies on write; on JAX/torch (donated or in-place updated buffers) the read is a copy
    np.testing.assert_array_equal(first["kernel"], kept)
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], 1.0)


def test_set_params_rejects_bad_keys_and_changes_nothing():
    model = db.compile(db.Sequential([db.Dense(3, in_features=2), Activation("relu"), db.Dense(1)]), "keras", seed=0)
    before = {k: np.array(v) for k, v in db.get_params(model).items()}
    with pytest.raises(db.ConversionError, match="missing keys.*unexpected keys.*expected shape"):
        db.set_params(model, {"0.kernel": np.zeros((3, 2), np.float32), "1.kernel": np.zeros(1)})
    assert_same_bits({k: np.array(v) for k, v in db.get_params(model).items()}, before)


def test_set_params_refuses_a_new_mask_and_changes_nothing():
    # the mask is part of the spec: one rule with load/compile/convert
    layer = db.compile(db.Dense(3, in_features=3, mask=db.wiring.dense(3, 3)), "keras", seed=0)
    before = db.get_params(layer)
    eye = np.eye(3, dtype=np.float32)
    with pytest.raises(db.ConversionError, match="6 of 9 mask entries differ"):
        db.set_params(layer, {"mask": eye}, strict=False)
    after = db.get_params(layer)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert db.to_spec(layer).mask == db.wiring.dense(3, 3)


# ============================================================ trace
def assert_traces_close(spec, inputs, grad_out, rtol=1e-11):
    """Keras' autograd trace vs the numpy reference backward, float64, same params."""
    model = db.compile(spec, "keras", seed=3)
    ref = db.compile(spec, "numpy", params=db.get_params(model))
    got = kb.trace(model, inputs, grad_out)
    want = npb.trace(ref, inputs, grad_out)
    assert len(got.layers) == len(want.layers)
    for i, (g, w) in enumerate(zip(got.layers, want.layers)):
        close64(g.output, w.output, rtol)
        assert len(g.input_grads) == len(w.input_grads)
        for a, b in zip(g.input_grads, w.input_grads):
            close64(a, b, rtol)
        assert sorted(g.param_grads) == sorted(w.param_grads), i
        for k in w.param_grads:
            close64(g.param_grads[k], w.param_grads[k], rtol)


def test_trace_of_a_masked_mlp_matches_the_reference_backward():
    spec = db.Sequential([db.Dense(5, in_features=4, mask=db.wiring.random(4, 5, 0.5, 2), activation="selu",
                                   dtype="float64"), db.Identity(), db.Dense(3, dtype="float64"),
                          db.Activation("log_softmax")])
    rng = np.random.default_rng(4)
    assert_traces_close(spec, [rng.normal(size=(7, 4))], rng.normal(size=(7, 3)))


def test_trace_casts_inputs_to_the_layer_dtype():
    layer = db.compile(db.Dense(2, in_features=3, dtype="bfloat16"), "keras", seed=0)
    t = kb.trace(layer, [np.ones((2, 3))], np.ones((2, 2)))
    rec = t.layers[0]
    assert rec.output.dtype == rec.input_grads[0].dtype == rec.param_grads["kernel"].dtype == numpy_dtype("bfloat16")
    assert rec.param_grads["kernel"].shape == (3, 2)
