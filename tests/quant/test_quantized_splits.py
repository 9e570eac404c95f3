"""Splits and concatenations with quantized layers in ``db.transfer`` (dense_bridge/quant/_moves.py):
along units the codes split and join exactly (groups run along in_features); a destination whose
groups straddle the source's, or sources stored in different schemes, are refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

IN, H = 64, 16


def _mx():
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    import mlx.nn as nn

    return mx, nn


def fused(seed=0, group=32, bits=4):
    mx, nn = _mx()

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            mx.random.seed(seed)
            self.qkv = nn.QuantizedLinear(IN, 3 * H, group_size=group, bits=bits)

    return Fused()


def parts(seed=1, group=32, bits=4, quantized=True):
    mx, nn = _mx()

    class Parts(nn.Module):
        def __init__(self):
            super().__init__()
            mx.random.seed(seed)
            make = (lambda: nn.QuantizedLinear(IN, H, group_size=group, bits=bits)) if quantized else \
                (lambda: nn.Linear(IN, H))
            self.q, self.k, self.v = make(), make(), make()

    return Parts()


def codes(layer):
    return db.get_params(layer, quantized=True)


def test_a_fused_quantized_layer_splits_into_quantized_parts_as_codes_exactly():
    src, dst = fused(), parts()
    report = db.transfer(src, dst, mapping={"qkv": ["q", "k", "v"]})
    whole = codes(src.qkv)
    for i, name in enumerate("qkv"):
        got = codes(getattr(dst, name))
        for k in ("qkernel", "scale", "offset", "bias"):
            np.testing.assert_array_equal(got[k], whole[k][..., i * H:(i + 1) * H], err_msg=f"{name}.{k}")
    assert all("codes moved exactly" in what and "(split)" in what for _, _, what in report.moved)
    back = fused(seed=5)  # and joined again: the same codes as the original fused layer
    db.transfer(dst, back, mapping={("q", "k", "v"): "qkv"})
    for k in ("qkernel", "scale", "offset", "bias"):
        np.testing.assert_array_equal(codes(back.qkv)[k], whole[k])


def test_a_fused_quantized_layer_splits_per_head_and_into_float_parts_exactly():
    torch = pytest.importorskip("torch")
    src = fused()
    dst = torch.nn.ModuleDict({"q": torch.nn.Linear(IN, H), "k": torch.nn.Linear(IN, H), "v": torch.nn.Linear(IN, H)})
    db.transfer(src, dst, mapping={"qkv": {"to": ["q", "k", "v"], "heads": 2}})
    kernel = db.get_params(src.qkv)["kernel"].reshape(IN, 2, 3, H // 2)  # head-major: q, k, v of each head
    for i, name in enumerate("qkv"):
        np.testing.assert_array_equal(dst[name].weight.detach().numpy().T, kernel[:, :, i, :].reshape(IN, H))
    quantized = parts()
    db.transfer(src, quantized, mapping={"qkv": {"to": ["q", "k", "v"], "heads": 2}})
    for i, name in enumerate("qkv"):
        np.testing.assert_array_equal(db.get_params(getattr(quantized, name))["kernel"],
                                      kernel[:, :, i, :].reshape(IN, H))


def test_destination_groups_straddling_the_sources_are_refused_naming_the_group():
    src, dst = fused(group=32), parts(group=64)
    before = codes(dst.q)["qkernel"].copy()
    with pytest.raises(db.ConversionError, match=r"into 'q'.*cannot move exactly into 4-bit affine, group 64: the "
                                                 r"destination groups 64 weights along in_features per offset, and "
                                                 r"the source's offset differs inside destination group 0"):
        db.transfer(src, dst, mapping={"qkv": ["q", "k", "v"]})
    np.testing.assert_array_equal(codes(dst.q)["qkernel"], before)  # all-or-nothing
    report = db.transfer(src, dst, mapping={"qkv": ["q", "k", "v"]}, requantize=True)
    assert set(report.quant_errors) == {"q", "k", "v"} and max(report.quant_errors.values()) > 0
    coarse, fine = fused(group=64), parts(group=32)  # finer destination groups: each within one source group
    db.transfer(coarse, fine, mapping={"qkv": ["q", "k", "v"]})
    np.testing.assert_array_equal(db.get_params(fine.k)["kernel"], db.get_params(coarse.qkv)["kernel"][:, H:2 * H])


def test_parts_stored_differently_join_only_with_requantize():
    mx, nn = _mx()
    src = parts()
    src.k = nn.QuantizedLinear(IN, H, group_size=64, bits=4)  # another scheme in the middle
    dst = fused()
    before = codes(dst.qkv)["qkernel"].copy()
    with pytest.raises(db.ConversionError, match=r"different schemes.*pass requantize=True"):
        db.transfer(src, dst, mapping={("q", "k", "v"): "qkv"})
    np.testing.assert_array_equal(codes(dst.qkv)["qkernel"], before)
    report = db.transfer(src, dst, mapping={("q", "k", "v"): "qkv"}, requantize=True)
    assert report.quant_errors["qkv"] > 0
    floats = parts(quantized=False)  # float parts into a quantized fused layer: its own quantizer
    report = db.transfer(floats, dst, mapping={("q", "k", "v"): "qkv"})
    assert "quantized by the destination" in report.moved[0][2]
