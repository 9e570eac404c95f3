"""``dense-bridge convert SRC --to BACKEND -o OUT``: a checkpoint into another framework's format,
file to file (``checkpoints.convert_file``), with advice instead of an error for a whole model."""
from __future__ import annotations

import os
import sys
import time

import dense_bridge as db
from .. import checkpoints
from ._common import EXIT_BAD_INPUT, EXIT_OK, ProgressBar, emit_json, human_bytes, read_spec, show_progress
from ._inspect import whole_model


def cmd_convert(args) -> int:
    spec = read_spec(args.spec)
    bar = ProgressBar(f"converting {os.path.basename(args.src)}", show_progress(args))
    start = time.perf_counter()
    try:
        summary = checkpoints.convert_file(args.src, args.to, args.output, spec=spec, format=args.format,
                                          max_shard_size=args.max_shard_size, progress=bar,
                                          allow_nonfinite=args.allow_nonfinite)
    except db.CheckpointError:
        advice = None if spec is not None else _whole_model_advice(args.src, args.format, args.to)
        if advice is None:
            raise
        print(f"dense-bridge convert: error: {advice}", file=sys.stderr)  # several lines: the example stays readable
        return EXIT_BAD_INPUT
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    summary["seconds"] = round(seconds, 4)
    summary["bytes_per_second"] = round(summary["bytes"] / max(seconds, 1e-9))
    if args.json:
        emit_json(summary)
        return EXIT_OK
    outs = summary["out"]
    where = outs[0] if len(outs) == 1 else f"{len(outs) - 1} shards + {os.path.basename(outs[-1])}"
    print(f"converted {args.src} -> {where} ({summary['to']}): {summary['tensors']} tensors, "
          f"{human_bytes(summary['bytes'])} in {seconds:.2f} s ({human_bytes(summary['bytes_per_second'])}/s)")
    return EXIT_OK


def _whole_model_advice(src: str, format: str | None, target: str) -> str | None:
    """What to do with a whole model's checkpoint, and what it holds (None when the file is a plain
    chain of linear layers: then --spec is the answer, as the original error says)."""
    try:
        ckpt = checkpoints.open_checkpoint(src, format=format)
        entries = ckpt.entries()
    except db.DenseBridgeError:
        return None
    if ckpt.spec is not None or isinstance(ckpt, checkpoints.CanonicalCheckpoint):
        return None  # the failure is not a missing structure; a canonical file's tensors are layers'
    rows, others = whole_model(entries, ckpt.framework)
    if not others:
        return None

    def shape(s) -> str:
        return "(" + ", ".join(str(x) for x in s) + ("," if len(s) == 1 else "") + ")"

    others = sorted(others, key=lambda e: -len(e[1]))  # tables (2-D) first: they say what the model is
    lin = ", ".join(f"{r['layer']} (in={r['in_features']}, units={r['units']}, layout {r['layout']})" for r in rows[:6])
    rest = ", ".join(f"{n} {shape(s)}" for n, s, _ in others[:6])
    more = ", ..." if len(rows) > 6 else ""
    found = (f"{len(rows)} linear layers recognised by name" + (f": {lin}{more}" if rows else "")
             + f"; {len(others)} other tensors (embeddings, norms: no Dense layer holds them): {rest}"
             + (", ..." if len(others) > 6 else ""))
    return (f"{src} holds a whole model ({len(entries)} tensors), not a chain of Dense layers: no dense_bridge spec "
            f"describes it, so --spec cannot help and convert cannot rebuild it. Build the model in {target} with its "
            f"own library, then move the weights in Python:\n"
            f"    src = ...  # the model this file belongs to, loaded by its own library\n"
            f"    db.transfer(src, dst, mapping=[(r\"(.*)\", r\"\\1\")])  # dst: the same architecture in {target}\n"
            f"(README \"Port a real model\": rules for differing paths, fused layers, tied heads.)\n"
            f"Found {found}")
