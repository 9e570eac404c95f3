"""``dense-bridge port SRC --to FORMAT -o OUT``: a whole model directory into another library's own
directory (``db.port``). Exit 0 ported and verified, 1 the twins or full models disagree (nothing
written), 2 bad input or a refusal (nothing written)."""
from __future__ import annotations

import sys

from .. import ports
from ._common import EXIT_NOT_EQUIVALENT, EXIT_OK, emit_json, one_line, show_progress


def add_parser(sub) -> None:
    names = ports.formats()
    p = sub.add_parser("port", help="a whole model directory into another library's own directory, certified",
                       description="Port the model directory SRC (detected from its content) to FORMAT's own "
                                   "directory OUT: the mapping is inferred on tiny twins built by each library, "
                                   "tensors are streamed, OUT/port_certificate.json records every tensor. Exit 0 "
                                   "ported, 1 the models disagree (nothing written), 2 bad input or refused.")
    p.add_argument("src", metavar="SRC", help="model directory")
    p.add_argument("--to", required=True, choices=names, metavar="FORMAT", help=" or ".join(names))
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="directory to create (must not exist or be empty)")
    p.add_argument("--verify", choices=("auto", "twins", "full"), default="auto",
                   help="twins (always), full (both full models too), auto (full when they fit in memory)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="cast every tensor (default: keep)")
    p.add_argument("--max-shard-size", metavar="SIZE", help="bytes or e.g. 5GB (default: as many files as SRC)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT (never one holding SRC)")
    p.add_argument("--text-only", action="store_true",
                   help="port only the text model of a multimodal checkpoint (refused otherwise); the certificate "
                        "lists the tensors left out")
    p.add_argument("--quantize", metavar="Q", help="quantize on the way in with the destination library's own quantizer, "
                                                 "e.g. affine:4:64, mxfp4 or a mixed recipe such as mixed_3_6")
    p.add_argument("--outtype", help="the storage type of a format that writes its own file (see its guide)")
    p.add_argument("--device", help="where the verification runs the models: cpu, cuda, cuda:N, gpu, gpu:N")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter directory for SRC, in the adapter format of "
                                                    "SRC's own ecosystem, checked against SRC")
    p.add_argument("--adapter-mode", choices=("merge", "keep"), default="merge",
                   help="merge: into the weights, float64, rounded once (default); keep: written beside the model "
                        "in OUT/adapter/ in the destination's own adapter format")
    p.add_argument("--keep-codes", action="store_true",
                   help="a quantized SRC keeps its codes where the destination's arithmetic agrees bit for bit")
    p.add_argument("--requantize", action="store_true", help="with --keep-codes: new codes where they cannot move")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show a progress bar on stderr (default: only on a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_port)


def cmd_port(args) -> int:
    try:
        report = ports.port(args.src, args.output, to=args.to, verify=args.verify, dtype=args.dtype,
                            max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                            quantize=args.quantize, adapter=args.adapter, adapter_mode=args.adapter_mode,
                            keep_codes=args.keep_codes, outtype=args.outtype, requantize=args.requantize,
                            device=args.device, progress=show_progress(args), text_only=args.text_only)
    except ports.PortMismatch as exc:
        print(f"dense-bridge port: {one_line(exc)}", file=sys.stderr)
        if args.json:
            emit_json({"ported": False, "error": str(exc)})
        return EXIT_NOT_EQUIVALENT
    if args.json:
        emit_json({"ported": True, **report.to_dict()})
    else:
        print(report.summary())
    return EXIT_OK


def given_model_dirs(args) -> bool:
    """``check A B`` with two model directories some installed library reads."""
    return ports.is_model_dir(args.a) and ports.is_model_dir(args.b)


def check_model_dirs(args) -> int:
    """``dense-bridge check A B`` for two model directories: exit 0 equivalent, 1 naming the first
    diverging layer."""
    if args.positions < 1:
        from .. import ConversionError

        raise ConversionError(f"--positions must be a positive integer. Received: --positions={args.positions}")
    report, info = ports.check_dirs(args.a, args.b, positions=args.positions, seed=args.seed, isolated=args.isolated,
                                    device=args.device)
    if args.json:
        emit_json({**info, "passed": report.passed, "report": report.to_dict()})
    else:
        devices = info["devices"]
        print(f"A: {args.a} ({info['a']}), B: {args.b} ({info['b']}), {info['positions']} token positions"
              + (f", on {devices['a']} and {devices['b']}" if devices["a"] or devices["b"] else ""))
        print(report)
    return EXIT_OK if report.passed else EXIT_NOT_EQUIVALENT
