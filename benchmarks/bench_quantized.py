"""Quantized layers: dequantization and code moves, against a numpy copy of the same packed bytes.

For an MLX ``QuantizedLinear`` (affine, 4-bit, group 32) and a torchao intx (4-bit, group 32)
layer of shape (units, in_features), times (median of interleaved samples, same run):

  dequantize   db.get_params(layer) (the framework's own dequantization, transposed to (in, units))
               vs numpy on the same bytes: unpack the uint32 words / read the int8 codes, then
               the scheme's arithmetic (``dense_bridge.quant.reference_dequantize``)
  read codes   db.get_params(layer, quantized=True) vs the numpy unpack alone
  move codes   db.transfer(src, dst) between two layers of the same format (codes checked
               bit-exact through both dequantizations, then written) vs the same work in numpy:
               unpack, dequantize twice and compare, repack the words (MLX) / copy the int8 codes
               (torchao)

Run:  python benchmarks/bench_quantized.py [--units 1024] [--in-features 1024] [--repeats 7]
MLX's Linux CPU build is slow (docs/FACTS.md); the default shape is modest. Ratios are what this
benchmark is for: on a shared machine the absolute times move with the load.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import dense_bridge as db  # noqa: E402
from _timing import compare_medians, fmt_time, table  # noqa: E402
from dense_bridge.quant import reference_dequantize  # noqa: E402


def mlx_cases(units: int, n: int) -> dict:
    import mlx.core as mx
    import mlx.nn as nn

    from dense_bridge.backends.mlx._quant import pack, unpack

    src = nn.QuantizedLinear(n, units, bias=False, group_size=32, bits=4)
    dst = nn.QuantizedLinear(n, units, bias=False, group_size=32, bits=4)
    mx.eval(src.parameters(), dst.parameters())
    words, scales, biases = (np.array(src[k]) for k in ("weight", "scales", "biases"))
    quant = db.Quant(4, 32, "affine")

    def numpy_dequantize():
        q = unpack(words, 4, n).T
        return reference_dequantize({"quant": quant, "qkernel": q, "scale": scales.T, "offset": biases.T})

    assert np.array_equal(numpy_dequantize(), db.get_params(src)["kernel"])  # the same values, or no timing
    return {
        "mlx dequantize": (lambda: db.get_params(src, copy=False), numpy_dequantize),
        "mlx read codes": (lambda: db.get_params(src, quantized=True), lambda: unpack(words, 4, n)),
        "mlx move codes": (lambda: db.transfer(src, dst),
                           lambda: (np.array_equal(numpy_dequantize(), numpy_dequantize()),
                                    pack(unpack(words, 4, n), 4))),
    }


def torchao_cases(units: int, n: int) -> dict:
    import torch
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                                  mapping_type=MappingType.ASYMMETRIC)
    src, dst = torch.nn.Linear(n, units, bias=False), torch.nn.Linear(n, units, bias=False)
    quantize_(src, config)
    quantize_(dst, config)
    q, s, z = (t.numpy() for t in (src.weight.qdata, src.weight.scale, src.weight.zero_point))
    quant = db.Quant(4, 32, "zero_point")

    def numpy_dequantize():
        return reference_dequantize({"quant": quant, "qkernel": q.T, "scale": s.T, "zero": z.T})

    assert np.array_equal(numpy_dequantize(), db.get_params(src)["kernel"])
    return {
        "torchao dequantize": (lambda: db.get_params(src, copy=False), numpy_dequantize),
        "torchao read codes": (lambda: db.get_params(src, quantized=True), lambda: np.ascontiguousarray(q.T)),
        "torchao move codes": (lambda: db.transfer(src, dst),
                               lambda: (np.array_equal(numpy_dequantize(), numpy_dequantize()),
                                        np.array(q, copy=True))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=1024)
    parser.add_argument("--in-features", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    cases: dict = {}
    for make in (mlx_cases, torchao_cases):
        try:
            cases.update(make(args.units, args.in_features))
        except ImportError as exc:
            print(f"skipped {make.__name__}: {exc}")
    rows = []
    for name, (ours, numpy_copy) in cases.items():
        t = compare_medians({"db": ours, "numpy": numpy_copy}, repeats=args.repeats)
        rows.append([name, fmt_time(t["db"]), fmt_time(t["numpy"]), f"{t['db'] / t['numpy']:.2f}"])
    print(f"Quantized layer ({args.units}, {args.in_features}), 4-bit, group 32; median of {args.repeats} "
          f"interleaved samples")
    print(table(rows, ["case", "dense_bridge", "numpy copy", "ratio"]))


if __name__ == "__main__":
    main()
