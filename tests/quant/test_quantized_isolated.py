"""compare_models(isolated=True) (teacher forcing) on quantized pairs: every layer run on the input
its counterpart received, so each quantized layer is judged on its own quantization error alone;
a layer whose codes moved wrong (a group's scale in another group) is still named."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

from _quant_helpers import IN, OUT, empty_mlx_quantized_mlp, float_mlp


def _mx():
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    import mlx.nn as nn

    return mx, nn


def mlx_port(float_model):
    """The float MLP's port into MLX QuantizedLinear layers (4-bit, group 32) by db.transfer."""
    model = empty_mlx_quantized_mlp()
    db.transfer(float_model, model, mapping={"0": "layers.0", "2": "layers.2"})
    return model


def inputs():
    return [np.random.default_rng(1).standard_normal((4, IN)).astype(np.float32)]


def _rows(report, quantity):
    return {str(layer.index): q for layer in report.layers for q in layer.quantities if q.quantity == quantity}


@pytest.mark.parametrize("quantized_first", [True, False])
def test_isolated_float_vs_quantized_port_passes_on_each_layers_own_error(quantized_first):
    from dense_bridge.testing import compare_models

    ref = float_mlp()
    port = mlx_port(ref)
    a, b = (port, ref) if quantized_first else (ref, port)
    report = compare_models(a, b, inputs(), isolated=True)
    assert report.passed, str(report)
    rows = _rows(report, "quantization")
    assert len(rows) == 2 and all("predicted output error" in q.note for q in rows.values())
    # the quantized layers really ran alone (MLX has no gradient for codes: only x and the bias are
    # differentiated), and their dL/dx rows judge those calls, the kernels' own difference taken out
    assert not [n for n in report.notes if "cannot run alone" in n], report.notes
    assert set(_rows(report, "dL/dx")) == {"0", "1"}


@pytest.mark.parametrize("make", ["keras-int8", "torchao-int4"])
def test_isolated_keras_int8_and_torchao_ports_pass(make):
    from dense_bridge.testing import compare_models

    ref = float_mlp()
    if make == "keras-int8":
        keras = pytest.importorskip("keras")
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(IN), keras.layers.ReLU(),
                                  keras.layers.Dense(OUT)])
        db.transfer(ref, model)
        for layer in (model.layers[0], model.layers[2]):
            layer.quantize("int8")  # its inputs are quantized too: judged with the input it multiplies
    else:
        torch = pytest.importorskip("torch")
        pytest.importorskip("torchao")
        from torchao.quantization import IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        model = float_mlp()
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    report = compare_models(model, ref, inputs(), isolated=True)
    assert report.passed, str(report)
    assert not [n for n in report.notes if "cannot run alone" in n], report.notes
    assert len(_rows(report, "quantization")) == 2


@pytest.mark.parametrize("damage", ["a group's scale moved into the next group", "a zero point off by one step"])
def test_isolated_comparison_names_the_layer_whose_codes_moved_wrong(damage):
    mx, _ = _mx()
    from dense_bridge.testing import compare_models

    ref = float_mlp()
    port = mlx_port(ref)
    layer = port.layers[2]
    scales, biases = np.array(layer.scales), np.array(layer.biases)
    if damage.startswith("a group's scale"):
        scales[3, [0, 1]] = scales[3, [1, 0]]
    else:
        biases[3, 0] += scales[3, 0]
    layer.update({"scales": mx.array(scales), "biases": mx.array(biases)})
    report = compare_models(port, ref, inputs(), isolated=True)
    assert not report.passed
    assert report.first_divergence == "2"
    assert report.first_failure.quantity == "quantization"
    assert "unit 3" in report.first_failure.note or "kernel[" in report.first_failure.note
    assert _rows(report, "quantization")["0"].passed  # the first layer, untouched, still passes
