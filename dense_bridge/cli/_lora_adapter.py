"""``dense-bridge adapter SRC_DIR --to FORMAT -o OUT_DIR``: convert a LoRA adapter directory between
the directory formats the backends declare (``db.ADAPTER_DIRECTORY_FORMATS``) without loading any
model (json + safetensors in, json + safetensors out).

The conversion is ``db.convert_adapter``. What the target cannot hold exactly is refused with
exit 2 and a line naming it (per-module scales into a format with one scale, DoRA on some layers
only, adapters outside the blocks a format can place them in), and so are NaN/Inf factors, alphas
and scales unless ``--allow-nonfinite``.
"""
from __future__ import annotations

import json

import dense_bridge as db
from .. import checkpoints
from .._errors import CheckpointError, SpecError

#: config.json keys that hold a transformer's block count, by model family
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")

def add_parser(sub) -> None:
    formats = db.ADAPTER_DIRECTORY_FORMATS  # format name -> the files its directory holds
    names = " or ".join(formats)
    holds = "; ".join(f"{name}: {' + '.join(files)}" for name, files in formats.items())
    p = sub.add_parser("adapter", help=f"convert a LoRA adapter directory between {names}",
                       description=f"Convert the LoRA adapter directory SRC_DIR ({holds}) to FORMAT in OUT_DIR. "
                                   f"Nothing in the files runs. What FORMAT cannot hold exactly is refused (exit 2).")
    p.add_argument("src", metavar="SRC_DIR", help="adapter directory")
    p.add_argument("--to", required=True, choices=tuple(formats), metavar="FORMAT", help=names)
    p.add_argument("-o", "--output", required=True, metavar="OUT_DIR", help="output directory (created; must not exist)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--base-config", metavar="CONFIG", help="the base model's JSON config file (its layer count: a format "
                                                           "may count adapted blocks from the end of the stack)")
    g.add_argument("--num-layers", type=int, metavar="N", help="the base model's number of transformer blocks")
    p.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf factors, alphas and scales")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_adapter)


def _layer_count(args) -> int | None:
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise SpecError(f"--num-layers must be a positive integer. Received: --num-layers={args.num_layers}")
        return args.num_layers
    if args.base_config is None:
        return None
    config = checkpoints.read_json_file(args.base_config, "--base-config file")
    for key in LAYER_COUNT_KEYS:
        if isinstance(config, dict) and isinstance(config.get(key), int):
            return config[key]
    raise CheckpointError(f"--base-config {args.base_config} has none of {list(LAYER_COUNT_KEYS)}")


def cmd_adapter(args) -> int:
    summary = db.convert_adapter(args.src, args.output, to=args.to, num_layers=_layer_count(args),
                                 allow_nonfinite=args.allow_nonfinite)
    print(json.dumps(summary) if args.json else
          f"{summary['from']} -> {args.to}: {summary['layers']} adapted layers written to {args.output}")
    return 0
