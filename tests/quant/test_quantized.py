"""Quantized linear layers across MLX, Keras and torchao (dense_bridge/quant.py): each framework's
own dequantization read bit for bit, codes moved exactly where the arithmetic agrees, refused
otherwise, requantized within the reported error, and an mlx-lm 4-bit model ported."""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.quant import reference_dequantize

from _quant_helpers import IN, OUT, empty_mlx_quantized_mlp, float_mlp, tiny_llama_as_mlx_lm_4bit


def _mx():
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    import mlx.nn as nn

    return mx, nn


def _torchao():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    import torchao.quantization as tq
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    return torch, tq, PerAxis, PerGroup, MappingType


def _keras():
    keras = pytest.importorskip("keras")
    from keras.src.quantizers.quantization_config import Int4QuantizationConfig

    return keras, Int4QuantizationConfig


# ----------------------------------------------------------------------------- format makers
def mlx_layer(bits=4, group=32, mode="affine", seed=0):
    mx, nn = _mx()
    mx.random.seed(seed)
    return nn.QuantizedLinear(IN, OUT, bias=True, group_size=group, bits=bits, mode=mode)


def torch_layer(config, seed=0):
    torch, tq, *_ = _torchao()
    torch.manual_seed(seed)
    layer = torch.nn.Linear(IN, OUT)
    tq.quantize_(layer, config)
    return layer


def torchao_int8():
    return torch_layer(_torchao()[1].Int8WeightOnlyConfig())


def torchao_intx(bits=4, group=32, asymmetric=False):
    torch, tq, PerAxis, PerGroup, MappingType = _torchao()
    return torch_layer(tq.IntxWeightOnlyConfig(
        weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(group) if group else PerAxis(0),
        mapping_type=MappingType.ASYMMETRIC if asymmetric else MappingType.SYMMETRIC))


_KERAS_POOL: dict = {}


def keras_layer(mode, block=None, seed=0):
    """A quantized Keras Dense in its initial state. Keras' quantize() runs gc.collect (0.4 s a
    call), so each configuration is made twice per session and later calls put the first
    values back into one of the two (alternating: a pair of the same format gets two objects)."""
    key = (mode, block, seed)
    if key not in _KERAS_POOL:
        layers = [_new_keras_layer(mode, block, seed) for _ in range(2)]
        _KERAS_POOL[key] = [layers, [[v.numpy() for v in layers[0].weights]], 0]
        return layers[0]
    layers, (values,), turn = _KERAS_POOL[key]
    _KERAS_POOL[key][2] = turn = 1 - turn
    for variable, value in zip(layers[turn].weights, values):
        variable.assign(value)
    return layers[turn]


def _new_keras_layer(mode, block, seed):
    keras, Int4QuantizationConfig = _keras()
    keras.utils.set_random_seed(seed)
    layer = keras.layers.Dense(OUT)
    layer.build((None, IN))
    layer.bias.assign(np.random.default_rng(seed).standard_normal(OUT).astype(np.float32))
    layer.quantize(mode, config=None if block is None else Int4QuantizationConfig(block_size=block))
    return layer


FORMATS = {
    "mlx-affine-4-32": lambda: mlx_layer(4, 32),
    "mlx-affine-8-64": lambda: mlx_layer(8, 64),
    "mlx-mxfp4": lambda: mlx_layer(4, 32, "mxfp4"),
    "torchao-int8": torchao_int8,
    "torchao-int4-32": lambda: torchao_intx(4, 32),
    "keras-int8": lambda: keras_layer("int8"),
    "keras-int4-32": lambda: keras_layer("int4", 32),
    "keras-int4-channel": lambda: keras_layer("int4", -1),
}
#: Pairs (besides each format into itself) whose codes move exactly, as measured on random weights:
#: the same arithmetic with compatible codes and groups. The README table states the same.
EXACT = {("torchao-int4-32", "keras-int4-32"), ("keras-int4-32", "torchao-int4-32"),
         ("keras-int4-channel", "keras-int8")}


def _float(layer) -> np.ndarray:
    return np.asarray(db.get_params(layer)["kernel"], dtype=np.float64)


# ----------------------------------------------------------------------------- Quant
def test_quant_validates_and_round_trips_through_json():
    q = db.Quant(4, 32, "affine")
    assert db.Quant.from_config(json.loads(json.dumps(q.to_config()))) == q
    assert db.Quant.from_config(json.dumps(db.Quant(8, None, "divide").to_config())) == db.Quant(8, None, "divide")
    with pytest.raises(db.SpecError, match="bits.*Received: bits=9"):
        db.Quant(9, 32, "affine")
    with pytest.raises(db.SpecError, match="scheme.*Received: scheme='nf4'"):
        db.Quant(4, 32, "nf4")
    with pytest.raises(db.SpecError, match="group_size.*Received: group_size=0"):
        db.Quant(4, 0, "affine")
    with pytest.raises(db.SpecError, match="mxfp4.*groups of 32"):
        db.Quant(4, 64, "mxfp4")
    with pytest.raises(TypeError, match="bits"):
        db.Quant(True, 32, "affine")
    with pytest.raises(db.SpecError, match="keys"):
        db.Quant.from_config({"bits": 4})


# ----------------------------------------------------------------------------- each framework's own dequantization
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_mlx_affine_get_params_is_mx_dequantize_bit_for_bit(bits, group):
    mx, _ = _mx()
    layer = mlx_layer(bits, group)
    want = np.asarray(mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=group, bits=bits)).T
    got = db.get_params(layer)
    np.testing.assert_array_equal(got["kernel"], want)
    np.testing.assert_array_equal(got["bias"], np.asarray(layer.bias))
    codes = db.get_params(layer, quantized=True)
    assert codes["quant"] == db.Quant(bits, group, "affine")
    assert codes["qkernel"].shape == (IN, OUT) and codes["qkernel"].dtype == np.uint8
    assert codes["qkernel"].max() < 2 ** bits
    assert codes["scale"].shape == codes["offset"].shape == (IN // group, OUT)
    np.testing.assert_array_equal(reference_dequantize(codes), want)  # the numpy copy agrees


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8", "nvfp4"])
def test_mlx_microscaling_get_params_is_mx_dequantize(mode):
    mx, nn = _mx()
    layer = nn.QuantizedLinear(IN, OUT, bias=False, mode=mode)
    want = np.asarray(mx.dequantize(layer.weight, layer.scales, group_size=layer.group_size, bits=layer.bits,
                                    mode=mode, dtype=mx.float32)).T
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], want)
    codes = db.get_params(layer, quantized=True)
    assert codes["quant"].scheme == mode and "offset" not in codes
    np.testing.assert_array_equal(reference_dequantize(codes), want)


def test_mlx_bfloat16_layer_dequantizes_in_its_own_dtype():
    mx, nn = _mx()
    layer = nn.QuantizedLinear(IN, OUT, group_size=32, bits=4)
    layer.set_dtype(mx.bfloat16)
    kernel = db.get_params(layer)["kernel"]
    assert str(kernel.dtype) == "bfloat16"
    want = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=4)
    np.testing.assert_array_equal(kernel.view(np.uint16), np.asarray(want.view(mx.uint16)).T)
    assert db.to_spec(layer) == db.Dense(OUT, in_features=IN, kernel_init="mlx_default", bias_init="mlx_default",
                                         dtype="bfloat16")


@pytest.mark.parametrize("make", [torchao_int8, lambda: torchao_intx(2, 32), lambda: torchao_intx(4, 32, True),
                                  lambda: torchao_intx(8, None, True), lambda: torchao_intx(4, None)],
                         ids=["int8", "int2-g32", "int4-g32-asym", "int8-channel-asym", "int4-channel"])
def test_torchao_get_params_is_its_dequantize_bit_for_bit(make):
    torch = _torchao()[0]
    layer = make()
    with torch.no_grad():
        want = layer.weight.dequantize().numpy().T
    np.testing.assert_array_equal(db.get_params(layer)["kernel"], want)
    codes = db.get_params(layer, quantized=True)
    assert codes["quant"].scheme == "zero_point" and codes["qkernel"].dtype == np.int8
    np.testing.assert_array_equal(reference_dequantize(codes), want)
    assert db.to_spec(layer).units == OUT


def _keras_float_kernel(layer) -> np.ndarray:
    """The kernel Keras' own quantized forward differentiates through: dL/dx for an identity
    upstream gradient is float_kernel.T exactly (one nonzero product per output)."""
    tf = pytest.importorskip("tensorflow")
    keras = _keras()[0]
    if keras.backend.backend() != "tensorflow":
        pytest.skip("reads Keras' gradient with tf.GradientTape")
    x = tf.zeros((OUT, IN))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
    return tape.gradient(y, x, output_gradients=tf.eye(OUT)).numpy().T


@pytest.mark.parametrize("mode,block", [("int8", None), ("int4", -1), ("int4", 32), ("int4", None)])
def test_keras_get_params_is_keras_own_dequantization(mode, block):
    layer = keras_layer(mode, block)
    got = db.get_params(layer)["kernel"]
    np.testing.assert_array_equal(got, _keras_float_kernel(layer))
    codes = db.get_params(layer, quantized=True)
    np.testing.assert_array_equal(reference_dequantize(codes), got)
    assert codes["quant"].scheme == ("divide" if mode == "int8" or block == -1 else "zero_point")


def test_keras_einsum_int8_reads_through_its_equation():
    keras = _keras()[0]
    layer = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 2, 4), bias_axes="de")
    layer.build((None, 3, IN))
    float_kernel = layer.kernel.numpy().reshape(IN, 8)
    layer.quantize("int8")
    codes = db.get_params(layer, quantized=True)
    assert codes["qkernel"].shape == (IN, 8) and codes["scale"].shape == (1, 8)
    kernel = db.get_params(layer)["kernel"]
    assert np.abs(kernel - float_kernel).max() <= np.abs(float_kernel).max() / 127
    np.testing.assert_array_equal(kernel, reference_dequantize(codes))


@pytest.mark.parametrize("equation,out,shape", [("abc,cde->abde", (None, 2, 4), (None, 3, IN)),
                                                 ("abcd,cde->abe", (None, 8), (None, 3, 2, 32))])
@pytest.mark.parametrize("block", [-1, 32])
def test_keras_einsum_int4_is_keras_own_dequantization(equation, out, shape, block):
    tf = pytest.importorskip("tensorflow")
    keras, Int4QuantizationConfig = _keras()
    if keras.backend.backend() != "tensorflow":
        pytest.skip("reads Keras' gradient with tf.GradientTape")
    layer = keras.layers.EinsumDense(equation, output_shape=out)
    layer.build(shape)
    layer.quantize("int4", config=Int4QuantizationConfig(block_size=block))
    kernel = db.get_params(layer)["kernel"]
    n_in, units = kernel.shape
    x = tf.zeros((units, 1) + tuple(shape[2:]))  # one row per unit, its second batch axis 1
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
    grad = tape.gradient(y, x, output_gradients=tf.reshape(tf.eye(units), tuple(y.shape)))
    np.testing.assert_array_equal(grad.numpy().reshape(units, n_in).T, kernel)  # Keras' own float kernel
    np.testing.assert_array_equal(reference_dequantize(db.get_params(layer, quantized=True)), kernel)


def test_unreadable_quantized_modes_are_refused_by_name():
    keras = _keras()[0]
    layer = keras.layers.Dense(4)
    layer.build((None, 8))
    layer.quantize("float8")
    with pytest.raises(db.ConversionError, match="'float8' mode"):
        db.linear_layers(keras.Sequential([keras.Input((8,)), layer]))
    with pytest.raises(db.ConversionError, match="not a quantized linear layer"):
        db.get_params(keras_layer("int8").__class__(3), quantized=True)


def test_torchao_with_activation_quantization_is_refused_by_name():
    torch, tq, *_ = _torchao()
    model = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    tq.quantize_(model, tq.Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(db.ConversionError, match="0 .*Int8Tensor with activation quantization"):
        db.linear_layers(model)


def test_bad_arguments_name_themselves():
    src, dst = mlx_layer(4, 32), mlx_layer(4, 32, seed=1)
    with pytest.raises(TypeError, match="requantize.*Received: requantize='yes'"):
        db.transfer(src, dst, requantize="yes")
    with pytest.raises(TypeError, match="quantized.*Received: quantized=1"):
        db.get_params(src, quantized=1)
    codes = db.get_params(src, quantized=True)
    with pytest.raises(TypeError, match="quant"):
        db.set_params(dst, {**codes, "quant": "4-bit"})
    with pytest.raises(db.ConversionError, match="unexpected keys \\['zero'\\]"):
        db.set_params(dst, {**codes, "zero": codes["offset"]})
    with pytest.raises(db.ConversionError, match="qkernel must hold integers"):
        db.set_params(dst, {**codes, "qkernel": codes["qkernel"].astype(np.float32)})


# ----------------------------------------------------------------------------- every pair of formats
@pytest.mark.parametrize("dst_name", list(FORMATS))
@pytest.mark.parametrize("src_name", list(FORMATS))
def test_every_pair_moves_exactly_where_the_table_says_else_refuses_or_requantizes(src_name, dst_name):
    src, dst = FORMATS[src_name](), FORMATS[dst_name]()
    want = _float(src)
    before = _float(dst)
    exact = src_name == dst_name or (src_name, dst_name) in EXACT
    if exact:
        report = db.transfer(src, dst)
        np.testing.assert_array_equal(_float(dst), want)  # dequantized values bit-identical
        a, b = db.get_params(src, quantized=True), db.get_params(dst, quantized=True)
        centre = [int(c["qkernel"].dtype.kind == "u") * 2 ** (c["quant"].bits - 1) for c in (a, b)]
        # codes equal (an unsigned format's codes centred on 2**(bits-1), a signed one's on 0)
        np.testing.assert_array_equal(a["qkernel"].astype(int) - centre[0], b["qkernel"].astype(int) - centre[1])
        assert "codes moved exactly" in report.moved[0][2] and report.quant_errors == {}
        return
    with pytest.raises(db.ConversionError, match="cannot move exactly.*requantize=True"):
        db.transfer(src, dst)
    np.testing.assert_array_equal(_float(dst), before)  # nothing written
    report = db.transfer(src, dst, requantize=True)
    err = np.abs(_float(dst) - want).max()
    assert report.quant_errors[""] == err  # the error reported is the error made
    # within the destination's own quantization step: half a step of its coarsest group
    step = np.abs(want).max() / (2 ** (db.get_params(dst, quantized=True)["quant"].bits - 1) - 1)
    assert err <= step * 2.01


def test_refusal_names_the_layer_and_writes_nothing_in_a_model():
    torch = _torchao()[0]
    _, nn = _mx()
    tq = _torchao()[1]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = mlx_layer(4, 32)
            self.down = mlx_layer(4, 32, seed=1)

    src = Block()
    dst = torch.nn.Sequential()
    dst.add_module("up", torch.nn.Linear(IN, OUT))
    dst.add_module("down", torch.nn.Linear(IN, OUT))
    tq.quantize_(dst, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                              granularity=_torchao()[3](32)))
    snapshot = {k: _float(v) for k, v in db.linear_layers(dst).items()}
    with pytest.raises(db.ConversionError, match=r"'up' -> 'up'.*differs from the source's in \d+ of 512"):
        db.transfer(src, dst, mapping=[(r"(.*)", r"\1")])
    assert all(np.array_equal(_float(v), snapshot[k]) for k, v in db.linear_layers(dst).items())
    report = db.transfer(src, dst, mapping=[(r"(.*)", r"\1")], requantize=True)
    assert set(report.quant_errors) == {"up", "down"} and all(e > 0 for e in report.quant_errors.values())


def test_power_of_two_scales_move_mlx_codes_into_torchao_without_requantize():
    mx, _ = _mx()
    torch = _torchao()[0]
    src = mlx_layer(4, 32)
    rng = np.random.default_rng(3)
    groups = IN // 32
    scale = np.ldexp(1.0, rng.integers(-8, -3, (OUT, groups))).astype(np.float32)
    zero = rng.integers(0, 16, (OUT, groups))
    src.update({"scales": mx.array(scale), "biases": mx.array((-zero * scale).astype(np.float32))})
    dst = torchao_intx(4, 32, asymmetric=True)
    report = db.transfer(src, dst)
    assert "codes moved exactly" in report.moved[0][2]
    np.testing.assert_array_equal(_float(dst), _float(src))
    mlx_codes = db.get_params(src, quantized=True)["qkernel"].astype(int)
    np.testing.assert_array_equal(dst.weight.qdata.numpy().T.astype(int), mlx_codes - 8)
    with torch.no_grad():
        np.testing.assert_array_equal(dst.weight.dequantize().numpy().T, _float(src))
    back = mlx_layer(4, 32, seed=5)  # and back again, exactly
    db.transfer(dst, back)
    np.testing.assert_array_equal(_float(back), _float(src))


def test_set_params_moves_codes_exactly_or_refuses():
    src, dst = keras_layer("int4", 32), torchao_intx(4, 32)
    codes = db.get_params(src, quantized=True)
    db.set_params(dst, codes)
    np.testing.assert_array_equal(_float(dst), _float(src))
    mlx_dst = mlx_layer(4, 32)
    before = _float(mlx_dst)
    with pytest.raises(db.ConversionError, match="set_params.*cannot move exactly"):
        db.set_params(mlx_dst, codes)
    np.testing.assert_array_equal(_float(mlx_dst), before)
    with pytest.raises(db.ConversionError, match="qkernel has shape"):
        db.set_params(dst, {**codes, "qkernel": codes["qkernel"][:32]})


def test_quantized_into_float_dequantizes_and_float_into_quantized_quantizes():
    torch = _torchao()[0]
    src = mlx_layer(3, 32)
    dense = torch.nn.Linear(IN, OUT)
    report = db.transfer(src, dense)
    np.testing.assert_array_equal(dense.weight.detach().numpy().T, _float(src))
    assert "dequantized exactly" in report.moved[0][2]
    converted = db.convert(src, "torch")  # convert: the float layer the codes stand for
    np.testing.assert_array_equal(converted.weight.detach().numpy().T, _float(src))
    dst = keras_layer("int8")
    report = db.transfer(dense, dst)
    err = np.abs(_float(dst) - _float(src)).max()
    assert report.quant_errors[""] == err and 0 < err < 0.01
    db.set_params(dst, db.get_params(dense))  # float params into a quantized layer: its quantizer
    assert np.abs(_float(dst) - _float(src)).max() == err


# ----------------------------------------------------------------------------- mlx-lm, 4-bit, group 32
@pytest.fixture(scope="module")
def mlx_lm_llama(tmp_path_factory):
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model

    root = tmp_path_factory.mktemp("llama")
    config = tiny_llama_as_mlx_lm_4bit(root)
    model, _ = load_model(root / "mlx")
    return model, config, root / "hf"


def test_mlx_lm_4bit_model_into_its_transformers_twin_dequantizes_exactly(mlx_lm_llama):
    mx, nn = _mx()
    transformers = pytest.importorskip("transformers")
    src, config, _ = mlx_lm_llama
    layers = db.linear_layers(src)
    assert all(type(l) is nn.QuantizedLinear for l in layers.values()) and len(layers) == 8
    assert type(src.model.embed_tokens) is nn.QuantizedEmbedding
    twin = transformers.LlamaForCausalLM(config).eval()
    report = db.transfer(src, twin, mapping=[(r"(.*)", r"\1")])
    assert report.not_moved_src == [] and report.not_moved_dst == []
    torch_modules = dict(twin.named_modules())
    for path, layer in layers.items():
        want = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=4)
        np.testing.assert_array_equal(torch_modules[path].weight.detach().numpy(), np.asarray(want), err_msg=path)
    table = src.model.embed_tokens
    want = mx.dequantize(table.weight, table.scales, table.biases, group_size=32, bits=4)
    np.testing.assert_array_equal(twin.model.embed_tokens.weight.detach().numpy(), np.asarray(want))


def test_mlx_lm_4bit_model_into_torchao_intx_requantizes_with_errors_per_layer(mlx_lm_llama):
    torch, tq, _, PerGroup, MappingType = _torchao()
    transformers = pytest.importorskip("transformers")
    src, config, _ = mlx_lm_llama
    twin = transformers.LlamaForCausalLM(config).eval()
    tq.quantize_(twin, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                                               mapping_type=MappingType.ASYMMETRIC))
    with pytest.raises(db.ConversionError, match=r"model\.layers\.0\.self_attn\.q_proj.*cannot move exactly"):
        db.transfer(src, twin, mapping=[(r"(.*)", r"\1")])
    report = db.transfer(src, twin, mapping=[(r"(.*)", r"\1")], requantize=True)
    assert set(report.quant_errors) == set(db.linear_layers(src))
    modules = dict(twin.named_modules())
    for path, err in report.quant_errors.items():
        got = modules[path].weight.dequantize().numpy()
        want = db.get_params(db.linear_layers(src)[path])["kernel"].T
        assert err == np.abs(got - want).max() and 0 < err < 0.2, path


# ----------------------------------------------------------------------------- compare_models, float vs quantized
def _mlx_quantized_mlp(float_model):
    model = empty_mlx_quantized_mlp()
    report = db.transfer(float_model, model)  # float into quantized: MLX's own quantizer
    assert set(report.quant_errors) == {"layers.0", "layers.2"}
    return model


def _inputs():
    return [np.random.default_rng(1).standard_normal((4, IN)).astype(np.float32)]


def test_compare_models_float_vs_quantized_passes_and_reports_the_predicted_error():
    from dense_bridge.testing import compare_models

    ref = float_mlp()
    report = compare_models(_mlx_quantized_mlp(ref), ref, _inputs())
    assert report.passed, str(report)
    rows = [q for layer in report.layers for q in layer.quantities if q.quantity == "quantization"]
    assert len(rows) == 2 and all("predicted output error" in q.note for q in rows)
    assert any("quantized (a: 4-bit affine, group 32)" in n for n in report.notes)
    # both ways: the quantized model as the reference
    back = compare_models(ref, _mlx_quantized_mlp(ref), _inputs())
    assert back.passed, str(back)


@pytest.mark.parametrize("damage", ["swapped group scales", "zero point off by one"])
def test_compare_models_names_the_layer_whose_codes_moved_wrong(damage):
    mx, _ = _mx()
    from dense_bridge.testing import compare_models

    ref = float_mlp()
    model = _mlx_quantized_mlp(ref)
    layer = model.layers[2]
    scales, biases = np.array(layer.scales), np.array(layer.biases)
    if damage == "swapped group scales":  # one unit's group-0 scale moved into group 1 and back
        scales[3, [0, 1]] = scales[3, [1, 0]]
    else:  # group 0 of unit 3 reads its codes one step off
        biases[3, 0] += scales[3, 0]
    layer.update({"scales": mx.array(scales), "biases": mx.array(biases)})
    report = compare_models(model, ref, _inputs())
    assert not report.passed
    assert report.first_divergence == "2"
    assert report.first_failure.quantity == "quantization"
    assert "group 0 of unit 3" in report.first_failure.note or "kernel[" in report.first_failure.note


@pytest.mark.parametrize("make_dst", ["keras-int8", "torchao-int4"])
def test_compare_models_keras_int8_and_torchao_ports_pass(make_dst):
    from dense_bridge.testing import compare_models

    ref = float_mlp()
    if make_dst == "keras-int8":
        keras = _keras()[0]
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(IN), keras.layers.ReLU(),
                                  keras.layers.Dense(OUT)])
        db.transfer(ref, model)
        for layer in (model.layers[0], model.layers[2]):  # inputs are quantized too: judged with the
            layer.quantize("int8")                         # input each layer multiplies
    else:
        torch, tq, _, PerGroup, _ = _torchao()
        model = float_mlp()
        tq.quantize_(model, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    report = compare_models(model, ref, _inputs())
    assert report.passed, str(report)
    assert sum(q.quantity == "quantization" for layer in report.layers for q in layer.quantities) == 2


def test_convert_with_quant_builds_the_targets_quantized_layer_and_moves_codes():
    torch = _torchao()[0]
    src = keras_layer("int4", 32)
    out = db.convert(src, "torch", quant=db.Quant(4, 32, "zero_point"))  # same arithmetic: exact
    assert type(out.weight).__name__ == "IntxUnpackedToInt8Tensor"
    np.testing.assert_array_equal(_float(out), _float(src))
    m = mlx_layer(4, 32)
    with pytest.raises(db.ConversionError, match="convert: the codes .* cannot move exactly"):
        db.convert(m, "torch", quant=db.Quant(4, 32, "zero_point"))
    back = db.convert(m, "mlx", quant=db.Quant(4, 32, "affine"))
    np.testing.assert_array_equal(_float(back), _float(m))
    requantized = db.convert(m, "keras", quant=db.Quant(4, 32, "zero_point"), requantize=True)
    assert requantized.quantization_mode == "int4"
    assert np.abs(_float(requantized) - _float(m)).max() <= np.abs(db.get_params(m, quantized=True)["scale"]).max()
    with pytest.raises(db.ConversionError, match="Keras quantizes as int8"):
        db.convert(m, "keras", quant=db.Quant(3, 32, "zero_point"), requantize=True)
    with pytest.raises(TypeError, match="quant must be"):
        db.convert(m, "torch", quant="int4")
    plain = db.convert(m, "torch")  # without quant: the float layer the codes stand for
    assert isinstance(plain.weight, torch.nn.Parameter) and np.array_equal(_float(plain), _float(m))


def test_compare_models_without_keras_input_quantization_would_fail(monkeypatch):
    """The accounting for Keras int8's input quantization is what makes the port pass."""
    from dense_bridge.backends.keras._quant import KerasQuantLayer
    from dense_bridge.testing import compare_models

    keras = _keras()[0]
    ref = float_mlp()
    model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(IN), keras.layers.ReLU(), keras.layers.Dense(OUT)])
    db.transfer(ref, model)
    for layer in (model.layers[0], model.layers[2]):
        layer.quantize("int8")
    assert compare_models(model, ref, _inputs()).passed
    monkeypatch.setattr(KerasQuantLayer, "quantizes_inputs", False, raising=False)
    monkeypatch.setattr(KerasQuantLayer, "effective_input", lambda self, x: np.asarray(x, np.float64))
    report = compare_models(model, ref, _inputs())
    assert not report.passed and report.first_failure.quantity == "output"


def test_quantized_tables_of_one_format_move_as_codes_and_into_float_tables_dequantized():
    mx, nn = _mx()
    torch = pytest.importorskip("torch")

    class Tok(nn.Module):
        def __init__(self, seed):
            super().__init__()
            mx.random.seed(seed)
            self.embed = nn.QuantizedEmbedding(16, IN, group_size=32, bits=4)

    src, dst = Tok(0), Tok(1)
    report = db.transfer(src, dst, mapping={"embed": "embed"})
    assert report.moved == [("embed", "embed", "codes moved exactly (quantized table)")]
    for k in ("weight", "scales", "biases"):
        np.testing.assert_array_equal(np.asarray(dst.embed[k]), np.asarray(src.embed[k]))
    table = torch.nn.Sequential()
    table.add_module("embed", torch.nn.Embedding(16, IN))
    db.transfer(src, table, mapping={"embed": "embed"})
    want = mx.dequantize(src.embed.weight, src.embed.scales, src.embed.biases, group_size=32, bits=4)
    np.testing.assert_array_equal(table.embed.weight.detach().numpy(), np.asarray(want))
    back = Tok(2)  # a float table into a quantized one: MLX's own quantizer, within one step
    db.transfer(table, back, mapping={"embed": "embed"})
    got = mx.dequantize(back.embed.weight, back.embed.scales, back.embed.biases, group_size=32, bits=4)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= np.abs(np.asarray(back.embed.scales)).max()


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("fw", ["mlx", "keras", "torchao"])
def test_save_keeps_a_quantized_chains_codes_and_a_float_load_dequantizes_them_exactly(fw, tmp_path):
    """db.save of a chain holding quantized layers writes their codes (the spec is the float
    chain, the scheme in the metadata: tests/quant/test_quantized_checkpoints.py); loaded on a backend
    without quantized layers they are the float kernels they stand for, bit for bit."""
    if fw == "mlx":
        _, nn = _mx()
        model = nn.Sequential(nn.QuantizedLinear(IN, IN, group_size=32, bits=4), nn.ReLU(),
                              nn.QuantizedLinear(IN, OUT, group_size=64, bits=8))
        layers = [model.layers[0], model.layers[2]]
    elif fw == "keras":
        keras = _keras()[0]
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(IN), keras.layers.ReLU(),
                                  keras.layers.Dense(OUT)])
        model.layers[0].quantize("int8")
        model.layers[2].quantize("int4")
        layers = [model.layers[0], model.layers[2]]
    else:
        torch, tq, _, PerGroup, _ = _torchao()
        model = torch.nn.Sequential(torch.nn.Linear(IN, IN), torch.nn.ReLU(), torch.nn.Linear(IN, OUT))
        tq.quantize_(model, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
        layers = [model[0], model[2]]
    spec = db.to_spec(model)
    assert [type(l).__name__ for l in spec.layers] == ["Dense", "Activation", "Dense"]
    db.save(model, tmp_path / "q.safetensors")
    loaded_spec, params = db.load(tmp_path / "q.safetensors")
    floats = db.get_params(db.load(tmp_path / "q.safetensors", "numpy"))
    for position, layer in zip((0, 2), layers):
        np.testing.assert_array_equal(params[f"{position}.qkernel"], db.get_params(layer, quantized=True)["qkernel"])
        np.testing.assert_array_equal(floats[f"{position}.kernel"], _float(layer))
    assert loaded_spec.layers[0].units == IN


def test_mlx_quantized_safetensors_load_into_a_quantized_model_as_codes(tmp_path):
    mx, nn = _mx()
    from mlx.utils import tree_flatten

    src = nn.Sequential(mlx_layer(4, 32))
    path = str(tmp_path / "model.safetensors")
    mx.save_safetensors(path, dict(tree_flatten(src.parameters())))  # what mlx-lm writes: weight/scales/biases
    like = nn.Sequential(mlx_layer(4, 32, seed=7))
    loaded = db.load(path, "mlx", like=like)
    for k in ("weight", "scales", "biases", "bias"):
        np.testing.assert_array_equal(np.asarray(loaded.layers[0][k]), np.asarray(src.layers[0][k]))
    with pytest.raises(db.CheckpointError, match="spec=|like="):
        db.load(path)


def test_compare_models_mlx_lm_4bit_model_against_its_float_original(mlx_lm_llama):
    """The float transformers model mlx_lm.convert quantized, against the quantized MLX model:
    every quantized layer within its own quantization, the predicted error reported."""
    transformers = pytest.importorskip("transformers")
    from dense_bridge.testing import compare_models

    src, _, hf_dir = mlx_lm_llama
    original = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ids = np.random.default_rng(0).integers(0, 64, (2, 5))
    report = compare_models(src, original, [ids], mapping=[(r"(.*)", r"\1")])
    assert report.passed, str(report)
    rows = [q for layer in report.layers for q in layer.quantities if q.quantity == "quantization"]
    assert len(rows) == 8 and all("predicted output error" in q.note for q in rows)
