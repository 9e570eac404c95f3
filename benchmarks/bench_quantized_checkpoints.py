"""Checkpoints of quantized models: keeping the codes against writing their exact dequantization.

For a chain of ``--layers`` quantized linear layers of (``--width``, ``--width``) (MLX affine
4-bit group 32; torchao intx 4-bit group 32), side by side in one run (medians of interleaved
samples):

  codes        db.save(model, "q.safetensors"): canonical checkpoint with codes (unpacked, one
               byte per code, scales and offsets/zero points), then db.load(path, backend): the
               backend's quantized layers rebuilt with the same codes
  dequantized  what db.save wrote before codes were kept: the float kernels
               (db.save((spec, db.get_params(model)))), then db.load(path, backend): a float model
  mlx file     (MLX only) db.save(model, path, format="mlx"): MLX's own packed layout
               (uint32 words, scales, biases), then db.load(path, "mlx")

Bytes are the files' sizes. Run:
  python benchmarks/bench_quantized_checkpoints.py [--width 512] [--layers 4] [--repeats 5]
On a shared machine the absolute times move with the load; the bytes do not.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import dense_bridge as db  # noqa: E402
from _timing import compare_medians, fmt_time, table  # noqa: E402


def mlx_model(width: int, layers: int):
    import mlx.core as mx
    import mlx.nn as nn

    mx.random.seed(0)
    model = nn.Sequential(*[nn.QuantizedLinear(width, width, group_size=32, bits=4) for _ in range(layers)])
    mx.eval(model.parameters())
    return model


def torchao_model(width: int, layers: int):
    import torch
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32),
                                          mapping_type=MappingType.ASYMMETRIC))
    return model


def run(name: str, backend: str, model, repeats: int, directory: str) -> list[list[str]]:
    spec, floats = db.to_spec(model), db.get_params(model)
    stem = backend
    paths = {"codes": os.path.join(directory, f"{stem}-codes.safetensors"),
             "dequantized": os.path.join(directory, f"{stem}-float.safetensors")}
    saves = {"codes": lambda: db.save(model, paths["codes"]),
             "dequantized": lambda: db.save((spec, floats), paths["dequantized"])}
    if backend == "mlx":
        paths["mlx file"] = os.path.join(directory, f"{stem}-mlx.safetensors")
        saves["mlx file"] = lambda: db.save(model, paths["mlx file"], format="mlx")
    save_t = compare_medians(saves, repeats=repeats)
    loads = {k: (lambda p=p: db.load(p, backend)) for k, p in paths.items()}
    load_t = compare_medians(loads, repeats=repeats)
    base = os.path.getsize(paths["dequantized"])
    return [[name, k, f"{os.path.getsize(p):,}", f"{os.path.getsize(p) / base:.2f}", fmt_time(save_t[k]),
             fmt_time(load_t[k])] for k, p in paths.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        try:
            rows += run("MLX affine 4/32", "mlx", mlx_model(args.width, args.layers), args.repeats, d)
        except ImportError as exc:
            print(f"MLX skipped: {exc}")
        try:
            rows += run("torchao intx 4/32", "torch", torchao_model(args.width, args.layers), args.repeats, d)
        except ImportError as exc:
            print(f"torchao skipped: {exc}")
    print(f"{args.layers} layers of {args.width} x {args.width}, {args.repeats} interleaved samples each\n")
    print(table(rows, ["model", "checkpoint", "bytes", "vs dequantized", "save", "load"]))


if __name__ == "__main__":
    main()
