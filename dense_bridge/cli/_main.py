"""The ``dense-bridge`` command: demo, convert, check, inspect, adapter (parser and entry point).

Exit codes: 0 ok, 1 not equivalent (check, demo), 2 bad input. Errors print one line on
stderr (``dense-bridge <command>: error: ...``), never a traceback; ``--json`` prints a JSON
document on stdout for scripts. Progress bars go to stderr, only on a terminal or with
``--progress``. Each command lives in its own module (``_convert``, ``_inspect``, ``_check``,
``_whole_models``, ``_adapter``, ``_demo``); ``_common`` holds what they share.

Built on the public API: ``dense_bridge`` (db.*), ``dense_bridge.checkpoints`` (open, convert,
and the safe readers of small files), ``dense_bridge.testing`` and the public modules ``specs``
and ``models``. The registry (``_registry``) is the one private module it reads: the backends
table (names for the choices, manifests for help texts and quiet imports) and the adapters'
optional verbs have no public face. ``tests/architecture/test_architecture.py`` holds it to that.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Sequence

import dense_bridge as db
from .. import checkpoints
from ._check import cmd_check
from ._common import EXIT_BAD_INPUT, one_line
from ._convert import cmd_convert
from ._inspect import cmd_inspect


def run_choices() -> tuple[str, ...]:
    """What --backend-a/-b accept: every registered backend (read from the registry at run time)."""
    from ..registry._backends import names

    return names()


def backend_choices() -> tuple[str, ...]:
    """What --to accepts: the canonical format and every registered backend."""
    return ("canonical",) + run_choices()


def format_choices() -> tuple[str, ...]:
    """What --format accepts: every backend that declares a file format."""
    return tuple(n for n in checkpoints.format_names() if n != "dense_bridge")


def _output_help() -> str:
    """The endings each backend writes, from the registry: ".pt/.pth/.bin/.safetensors (torch), ..."."""
    from ..registry._backends import backends

    parts = []
    for name, info in backends().items():
        endings = [e for f in info.manifest.formats if f.write_kind for e in f.extensions]
        if endings:
            parts.append(f"{'/'.join(dict.fromkeys(endings))} ({name})")
    return "output file: " + ", ".join(parts + ["any name for canonical"])

def _quiet_backends(args) -> list[str]:
    """Installed backends declaring ``quiet_import`` that this command will use: named by
    --to/--backend-a/-b, owning one of its files, or all of them for the demo."""
    from ..registry._backends import available_backends, backends

    quiet = [n for n in available_backends() if backends()[n].manifest.quiet_import]
    if not quiet or args.command == "demo":
        return quiet
    wanted = {getattr(args, k, None) for k in ("to", "backend_a", "backend_b")}
    wanted |= {checkpoints.file_backend(getattr(args, k, None)) for k in ("src", "a", "b")}
    return [n for n in quiet if n in wanted]


def import_quietly(names: Sequence[str] | None = None) -> None:
    """Import these backends' adapters (default: every installed one declaring ``quiet_import``)
    with file descriptor 2 silenced.

    TensorFlow's C++ start-up lines (absl "All log messages before absl::InitializeLog()",
    oneDNN notices) bypass TF_CPP_MIN_LOG_LEVEL and Python; they would bury our one-line errors.
    Importing an adapter also registers its own classes with its framework (Keras'
    ``keras.saving`` needs dense_bridge's layer classes before it loads a file using them).
    """
    from ..registry._backends import available_backends, backends, get_adapter

    if names is None:
        names = [n for n in available_backends() if backends()[n].manifest.quiet_import]
    if not names:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                for name in names:
                    get_adapter(name)  # imports the framework with the adapter
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def cmd_demo(args) -> int:
    from . import _demo

    return _demo.run(json_output=args.json, steps=args.steps, seed=args.seed, keep=args.keep)


# ============================================================================ outputs never overwrite inputs
def refuse_writing_inputs(args) -> None:
    """CheckpointError (exit 2) before anything runs when an output path (``convert -o``,
    ``check --html``) is, or resolves to, one of the command's input files."""
    def given(*options: str) -> dict[str, list[str]]:
        found = {}
        for option in options:
            value = getattr(args, option.lstrip("-").replace("-", "_"), None)
            if isinstance(value, str) and not value.lstrip().startswith("{"):  # inline JSON is no file
                found[option] = checkpoints.input_files(value)
        return found

    if args.command == "convert":
        canonical = args.to in checkpoints.CANONICAL_TARGETS
        out = checkpoints.canonical_outputs(args.output) if canonical else [args.output]
        checkpoints.refuse_overwrite({"-o": out}, {"SRC": checkpoints.input_files(args.src), **given("--spec")})
    elif args.command == "check" and args.html:
        inputs = {"A": checkpoints.input_files(args.a), "B": checkpoints.input_files(args.b),
                  **given("--spec", "--spec-a", "--spec-b", "--mapping", "--inputs", "--inputs-b")}
        checkpoints.refuse_overwrite({"--html": [args.html]}, inputs)


# ============================================================================ parser and main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dense-bridge",
        description=f"Port Dense/MLP models between frameworks ({', '.join(run_choices())}): convert checkpoints, "
                    "check equivalence, inspect files. Exit codes: 0 ok, 1 not equivalent, 2 bad input.")
    parser.add_argument("--version", action="version", version=f"dense-bridge {db.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,port,verify,convert,check,inspect,adapter}")
    sub.required = True

    p = sub.add_parser("demo", help="build, train, port, check and save an MLP on every installed framework",
                       description="Build an MLP, train it briefly (on the first installed backend whose adapter trains), port it "
                                   "to every installed framework, check outputs and gradients, save and reload "
                                   "it, and print what happened.")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed for data and initial weights (default 0)")
    p.add_argument("--keep", metavar="DIR", help="write the demo's checkpoints to DIR instead of a temp dir")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("convert", help="convert a checkpoint to another framework's format",
                       description=f"Convert SRC (a {checkpoints.supported_formats()} file) to BACKEND's format at OUT. "
                                   "--to canonical (or numpy) writes a dense_bridge checkpoint, shardable with "
                                   "--max-shard-size. Files without a stored spec need --spec.")
    p.add_argument("src", metavar="SRC", help="source checkpoint")
    p.add_argument("--to", required=True, choices=backend_choices(), metavar="BACKEND",
                   help=f"target: {', '.join(backend_choices())}")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help=_output_help())
    p.add_argument("--spec", metavar="SPEC", help="spec JSON file (spec.to_config()), or a checkpoint to take it from")
    p.add_argument("--format", choices=format_choices(),
                   help="how to read a native SRC when its content is ambiguous (e.g. a bare .safetensors)")
    p.add_argument("--max-shard-size", metavar="SIZE", help="shard a canonical output: bytes or e.g. 10MB, 4MiB, 1GB")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="write NaN/Inf parameters too (refused by default, as every load and save refuses them)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show a progress bar on stderr (default: only on a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("check", help="equivalence report for two checkpoints or models (exit 1 if they differ)",
                       description="Load A and B (each on its own framework; canonical checkpoints on numpy), run "
                                   "both on the same inputs and compare outputs and gradients layer by layer. "
                                   "Exit 0 equivalent, 1 not equivalent, 2 bad input.")
    p.add_argument("a", metavar="A", help="first checkpoint or whole-model file")
    p.add_argument("b", metavar="B", help="second checkpoint or whole-model file (the reference)")
    p.add_argument("--spec", metavar="SPEC", help="spec for files that carry none (both sides)")
    p.add_argument("--spec-a", metavar="SPEC", help="spec for A only")
    p.add_argument("--spec-b", metavar="SPEC", help="spec for B only")
    p.add_argument("--backend-a", choices=run_choices(), help="run A on this backend")
    p.add_argument("--backend-b", choices=run_choices(), help="run B on this backend")
    p.add_argument("--format", choices=format_choices(), help="how to read ambiguous native files")
    p.add_argument("--batch-size", type=int, default=8, help="rows of random input (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--no-grads", action="store_true", help="compare outputs only")
    p.add_argument("--strict", action="store_true",
                   help="also fail when the specs differ in dtype, activation, mask or bias, not only on numbers")
    p.add_argument("--isolated", action="store_true",
                   help="teacher forcing: run each layer of B on the input and output gradient its counterpart in A "
                        "received, so each layer's own error is judged with nothing carried from before it")
    p.add_argument("--html", metavar="PATH", help="also write the report as an HTML page with a per-layer error chart")
    p.add_argument("--positions", type=int, default=256, help="token positions for two model directories (default 256)")
    p.add_argument("--device", help="two model directories: where both models run: cpu, cuda, cuda:N, gpu, gpu:N "
                                    "(default: each on its framework's GPU when present, else the CPU)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_check)
    from ._whole_models import add_arguments as add_model_check  # whole native models: --mapping, --inputs

    add_model_check(p)

    p = sub.add_parser("inspect", help="layers, shapes, dtypes and parameter counts of a checkpoint",
                       description="Show what SRC holds: its format, spec (layers, widths, activations, dtypes, "
                                   "parameter counts) and every stored tensor.")
    p.add_argument("src", metavar="SRC", help="checkpoint or model file")
    p.add_argument("--spec", metavar="SPEC", help="spec for files that carry none")
    p.add_argument("--format", choices=format_choices(), help="how to read ambiguous native files")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)
    from ._lora_adapter import add_parser as add_adapter  # LoRA adapter directories

    add_adapter(sub)
    from . import _port, _verify  # whole model directories (db.port, db.verify_port)

    _port.add_parser(sub)
    _verify.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    # TensorFlow's C++ log lines are noise here, errors included: the GPU build of TensorFlow (which
    # keras-hub pulls in) logs a failed cuInit at ERROR level on every CPU-only machine. Our own
    # errors reach the user through Python exceptions, never through that log.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if not sys.warnoptions:
        warnings.simplefilter("ignore")  # frameworks' deprecation chatter would bury the one-line errors
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return int(exc.code or 0)
    try:
        refuse_writing_inputs(args)
        import_quietly(_quiet_backends(args))
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - every failure is one line and exit 2 (1 is "not equivalent")
        if os.environ.get("DENSE_BRIDGE_DEBUG"):
            raise  # developers: the full traceback
        known = isinstance(exc, (db.DenseBridgeError, OSError, ValueError, TypeError, KeyError, RuntimeError))
        text = one_line(exc) if known else f"{type(exc).__name__}: {one_line(exc)}"
        print(f"dense-bridge {args.command}: error: {text}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"dense-bridge {args.command}: interrupted", file=sys.stderr)
        return 130
