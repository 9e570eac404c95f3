"""``dense-bridge adapter SRC_DIR --to FORMAT -o OUT_DIR``: convert a LoRA adapter directory between
PEFT and mlx-lm without loading any model (json + safetensors in, json + safetensors out).

What the target cannot hold exactly is refused with exit 2 and a line naming it
(``_adapter_files.AdapterRefused``): per-module scales into mlx-lm's single ``scale``, DoRA on
some layers only, adapters outside the last blocks of the stack. Per-module ranks into mlx-lm's
single ``rank`` are zero-padded (the same update exactly).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from .._errors import CheckpointError, SpecError

#: config.json keys that hold a transformer's block count, by model family
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def add_parser(sub) -> None:
    from ..checkpoints._adapter_files import MLX_FILES, MLX_LM, PEFT, PEFT_FILES

    p = sub.add_parser("adapter", help=f"convert a LoRA adapter directory between {PEFT} and {MLX_LM}",
                       description=f"Convert the LoRA adapter directory SRC_DIR ({PEFT}: {' + '.join(PEFT_FILES)}; "
                                   f"{MLX_LM}: {' + '.join(MLX_FILES)}) to FORMAT in OUT_DIR. Nothing in the files "
                                   f"runs. What FORMAT cannot hold exactly is refused (exit 2).")
    p.add_argument("src", metavar="SRC_DIR", help="adapter directory")
    p.add_argument("--to", required=True, choices=(PEFT, MLX_LM), metavar="FORMAT", help=f"{PEFT} or {MLX_LM}")
    p.add_argument("-o", "--output", required=True, metavar="OUT_DIR", help="output directory (created; must not exist)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--base-config", metavar="CONFIG", help=f"the base model's config.json (its layer count: {MLX_LM}'s "
                                                           f"num_layers counts from the end of the stack)")
    g.add_argument("--num-layers", type=int, metavar="N", help="the base model's number of transformer blocks")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_adapter)


def _layer_count(args) -> int | None:
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise SpecError(f"--num-layers must be a positive integer. Received: --num-layers={args.num_layers}")
        return args.num_layers
    if args.base_config is None:
        return None
    try:
        with open(args.base_config, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read --base-config {args.base_config}: {exc}") from None
    for key in LAYER_COUNT_KEYS:
        if isinstance(config, dict) and isinstance(config.get(key), int):
            return config[key]
    raise CheckpointError(f"--base-config {args.base_config} has none of {list(LAYER_COUNT_KEYS)}")


def cmd_adapter(args) -> int:
    from ..checkpoints._adapter_files import read_adapter_dir, write_adapter_dir

    out = args.output
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"-o {out} exists and is not an empty directory")
    fmt, layers, extra = read_adapter_dir(args.src)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    temp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)  # written whole, then renamed: no partial output
    try:
        write_adapter_dir(layers, temp, args.to, extra=extra, num_layers=_layer_count(args))
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(temp, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    summary = {"src": args.src, "from": fmt, "to": args.to, "output": out, "layers": len(layers)}
    print(json.dumps(summary) if args.json else f"{fmt} -> {args.to}: {len(layers)} adapted layers written to {out}")
    return 0
