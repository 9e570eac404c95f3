"""The ``dense-bridge`` command: demo, convert, check, inspect.

Exit codes: 0 ok, 1 not equivalent (check, demo), 2 bad input. Errors print one line on
stderr (``dense-bridge <command>: error: ...``), never a traceback; ``--json`` prints a JSON
document on stdout for scripts. Progress bars go to stderr, only on a terminal or with
``--progress``.

Built on the public API: ``dense_bridge`` (db.*), ``dense_bridge.checkpoints`` (open, convert,
and the safe readers of small files), ``dense_bridge.testing`` and the public modules ``specs``
and ``models``. The registry (``_registry``) is the one private module it reads: the backends
table (names for the choices, manifests for help texts and quiet imports) and the adapters'
optional verbs have no public face. ``tests/test_architecture.py`` holds it to that.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Sequence

import dense_bridge as db
from .. import checkpoints
from ._text import table

EXIT_OK, EXIT_NOT_EQUIVALENT, EXIT_BAD_INPUT = 0, 1, 2


def run_choices() -> tuple[str, ...]:
    """What --backend-a/-b accept: every registered backend (read from the registry at run time)."""
    from .._registry import names

    return names()


def backend_choices() -> tuple[str, ...]:
    """What --to accepts: the canonical format and every registered backend."""
    return ("canonical",) + run_choices()


def format_choices() -> tuple[str, ...]:
    """What --format accepts: every backend that declares a file format."""
    return tuple(n for n in checkpoints.format_names() if n != "dense_bridge")


def _output_help() -> str:
    """The endings each backend writes, from the registry: ".pt/.pth/.bin/.safetensors (torch), ..."."""
    from .._registry import backends

    parts = []
    for name, info in backends().items():
        endings = [e for f in info.manifest.formats if f.write_kind for e in f.extensions]
        if endings:
            parts.append(f"{'/'.join(dict.fromkeys(endings))} ({name})")
    return "output file: " + ", ".join(parts + ["any name for canonical"])


# ============================================================================ formatting helpers
def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


class ProgressBar:
    """``[#####-----]  42%  12.0/28.4 MB  85.3 MB/s`` on stderr, redrawn at most 10 times a second."""

    def __init__(self, label: str, enabled: bool, stream=None) -> None:
        self.label, self.enabled = label, enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        frac = 1.0 if total <= 0 else min(1.0, done / total)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = done / max(now - self.start, 1e-9)
        self.stream.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}%  {human_bytes(done)}/{human_bytes(total)}  "
                          f"{human_bytes(rate)}/s")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=_json_default))


def _json_default(value: Any):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


# ============================================================================ shared argument handling
def read_spec(text: str | None):
    """A spec from --spec: a JSON file of spec.to_config(), a dense_bridge checkpoint, or inline JSON."""
    if text is None:
        return None
    if text.lstrip().startswith("{"):
        return db.from_config(text)
    if not os.path.exists(text):
        raise db.CheckpointError(f"--spec {text}: no such file (give a spec JSON file, a dense_bridge checkpoint "
                                 "or inline JSON)")
    if os.path.isdir(text):
        raise db.CheckpointError(f"--spec {text}: it is a directory, not a spec JSON file")
    head, size = checkpoints.read_head(text, 1)  # a FIFO or device is refused, never waited on
    if head == b"{":
        if size > checkpoints.MAX_JSON_FILE:
            raise db.SpecError(f"--spec {text}: {size:,} bytes is too large for a spec JSON file "
                               f"(at most {checkpoints.MAX_JSON_FILE:,})")
        raw, _ = checkpoints.read_head(text, size)
        config = checkpoints.parse_json(raw, lambda reason: db.SpecError(f"--spec {text}: not a spec JSON file ({reason})"),
                            "JSON")
        if isinstance(config, dict) and "weight_map" in config:  # an index: take the checkpoint's spec
            return _spec_of_checkpoint(text)
        if isinstance(config, dict) and "spec" in config and "class_name" not in config:
            config = config["spec"]  # the output of `inspect --json`
        return db.from_config(config)
    return _spec_of_checkpoint(text)


def _spec_of_checkpoint(path: str):
    with checkpoints.open_checkpoint(path) as ckpt:
        if ckpt.spec is None:
            raise db.CheckpointError(f"--spec {path}: this checkpoint carries no spec to take")
        return ckpt.spec


def _quiet_backends(args) -> list[str]:
    """Installed backends declaring ``quiet_import`` that this command will use: named by
    --to/--backend-a/-b, owning one of its files, or all of them for the demo."""
    from .._registry import available_backends, backends

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
    from .._registry import available_backends, backends, get_adapter

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


def _show_progress(args) -> bool:
    if getattr(args, "progress", None) is not None:
        return bool(args.progress)
    return sys.stderr.isatty()


# ============================================================================ convert
def cmd_convert(args) -> int:
    spec = read_spec(args.spec)
    bar = ProgressBar(f"converting {os.path.basename(args.src)}", _show_progress(args))
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
        _emit_json(summary)
        return EXIT_OK
    outs = summary["out"]
    where = outs[0] if len(outs) == 1 else f"{len(outs) - 1} shards + {os.path.basename(outs[-1])}"
    print(f"converted {args.src} -> {where} ({summary['to']}): {summary['tensors']} tensors, "
          f"{human_bytes(summary['bytes'])} in {seconds:.2f} s ({human_bytes(summary['bytes_per_second'])}/s)")
    return EXIT_OK


def _whole_model(entries, framework) -> tuple[list[dict], list[tuple[str, tuple, str]]]:
    """(linear layers recognised by name, the other tensors) of a file without a spec: other
    tensors (embedding tables, norms) say it holds a whole model, which no spec describes."""
    from ..models import file_linear_layers

    rows = file_linear_layers(entries, framework)
    taken = {t for r in rows for t in r["tensors"]}
    return rows, [e for e in entries if e[0] not in taken]


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
    rows, others = _whole_model(entries, ckpt.framework)
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
            f"    src = transformers.AutoModel.from_pretrained(DIR)  # the model this file belongs to\n"
            f"    db.transfer(src, dst, mapping=[(r\"(.*)\", r\"\\1\")])  # dst: the same architecture in {target}\n"
            f"(README \"Port a real model\": rules for differing paths, fused layers, tied heads.)\n"
            f"Found {found}")


# ============================================================================ inspect
def _activation_text(act) -> str:
    if act is None:
        return ""
    defaults = db.Activation(act.name).params
    extra = {k: v for k, v in act.params.items() if defaults.get(k) != v}
    return act.name + (f"({', '.join(f'{k}={v}' for k, v in extra.items())})" if extra else "")


def layer_rows(spec) -> list[dict]:
    """One dict per layer position: type, widths, activation, dtype, parameter count."""
    layers = list(spec.layers) if isinstance(spec, db.Sequential) else [spec]
    rows = []
    for i, layer in enumerate(layers):
        row: dict[str, Any] = {"position": i, "type": type(layer).__name__, "in_features": None, "units": None,
                               "activation": "", "dtype": "", "params": 0, "mask_density": None}
        if isinstance(layer, db.Dense):
            row.update(in_features=layer.in_features, units=layer.units, activation=_activation_text(layer.activation),
                       dtype=layer.dtype, params=layer.num_params if layer.in_features else None)
            if layer.activation.is_identity:
                row["activation"] = "linear"
            if layer.mask is not None:
                row["mask_density"] = round(layer.mask.density, 4)
        elif isinstance(layer, db.Bilinear):
            row.update(in_features=f"{layer.in1_features}x{layer.in2_features}", units=layer.units,
                       dtype=layer.dtype, params=layer.num_params)
        elif isinstance(layer, db.Activation):
            row.update(type="Activation", activation=_activation_text(layer))
        rows.append(row)
    return rows


def cmd_inspect(args) -> int:
    from ..specs import layer_config

    spec = read_spec(args.spec)
    ckpt = checkpoints.open_checkpoint(args.src, spec=spec, format=args.format)
    if hasattr(ckpt, "verify_structure"):  # a native file and its spec must agree before it is shown
        ckpt.verify_structure()
    entries = ckpt.entries()
    total_values = sum(math.prod(s) for _, s, _ in entries)
    doc: dict[str, Any] = {
        "path": args.src, "kind": ckpt.kind, "framework": ckpt.framework or "dense_bridge",
        "files": [f.path for f in getattr(ckpt, "files", None) or []] or [args.src],
        "bytes": ckpt.total_bytes,
        "spec": None if ckpt.spec is None else layer_config(ckpt.spec),
        "layers": [] if ckpt.spec is None else layer_rows(ckpt.spec),
        "num_params": None if ckpt.spec is None else _num_params(ckpt.spec),
        "tensors": [{"name": n, "shape": list(s), "dtype": d, "count": math.prod(s)} for n, s, d in entries],
        "stored_values": total_values,
        "nonfinite": _nonfinite_counts(ckpt),
    }
    if isinstance(ckpt, checkpoints.CanonicalCheckpoint):
        doc["format_version"] = ckpt.meta.get("format_version")
    if ckpt.spec is None:  # a plain weights file: linear layers by name, layouts assumed (models.py)
        from ..models import file_linear_layers, format_file_linear_layers

        doc["linear_layers"] = file_linear_layers(entries, ckpt.framework)
    if args.json:
        _emit_json(doc)
        return EXIT_OK
    nfiles = len(doc["files"])
    print(f"{args.src}: {ckpt.kind}, {nfiles} file{'s' if nfiles != 1 else ''}, {human_bytes(ckpt.total_bytes)}")
    if ckpt.spec is None and not isinstance(ckpt, checkpoints.CanonicalCheckpoint) \
            and _whole_model(entries, ckpt.framework)[1]:
        print("spec: none stored, and none fits: besides linear layers the file holds other tensors (embeddings, "
              "norms): a whole model (move it with db.transfer into a model built in the target framework)")
        print(format_file_linear_layers(doc["linear_layers"]))
    elif ckpt.spec is None:
        print("spec: none stored (pass --spec SPEC.json to see layers)")
        print(format_file_linear_layers(doc["linear_layers"]))
    else:
        name = getattr(ckpt.spec, "name", None)
        print(f"spec: {type(ckpt.spec).__name__}" + (f" {name!r}" if name else ""))
        rows = [[r["position"], r["type"], "" if r["in_features"] is None else r["in_features"],
                 "" if r["units"] is None else r["units"], r["activation"], r["dtype"],
                 "" if r["params"] is None else f"{r['params']:,}",
                 "" if r["mask_density"] is None else f"{r['mask_density']:.3f}"] for r in doc["layers"]]
        print(table(["pos", "layer", "in", "units", "activation", "dtype", "params", "mask"], rows, right=(0, 2, 3, 6)))
    print()
    rows = [[n, "(" + ", ".join(str(x) for x in s) + ("," if len(s) == 1 else "") + ")", d, f"{math.prod(s):,}"]
            for n, s, d in entries]
    print(table(["tensor", "shape", "dtype", "values"], rows, right=(3,)))
    if doc["num_params"] is not None:
        print(f"total: {doc['num_params']:,} parameters ({len(entries)} tensors, {total_values:,} stored values)")
    else:
        print(f"total: {len(entries)} tensors, {total_values:,} stored values")
    bad = doc["nonfinite"]
    if bad is None:
        print("NaN/Inf: not counted (this file's tensors read with a spec: pass --spec SPEC.json)")
    elif bad:
        print("NaN/Inf: " + "; ".join(f"{name}: {count:,} value{'s' if count != 1 else ''}" for name, count in bad.items())
              + " (loads and conversions refuse them unless allow_nonfinite / --allow-nonfinite)")
    else:
        print("NaN/Inf: none")
    return EXIT_OK


def _nonfinite_counts(ckpt) -> dict[str, int] | None:
    """Canonical tensor name -> how many NaN/Inf values it holds (only those holding some), read
    one tensor at a time; None where the tensors cannot be read without a spec (native files)."""
    import numpy as np

    if ckpt.framework is not None and ckpt.spec is None:
        return None
    out = {}
    for name, tensor in ckpt.pending().items():
        flat = np.asarray(tensor.produce()).reshape(-1)
        # in blocks: the boolean temporaries stay small whatever the tensor's size
        count = sum(int(np.count_nonzero(~np.isfinite(flat[start:start + _DIFF_BLOCK])))
                    for start in range(0, flat.size, _DIFF_BLOCK))
        if count:
            out[name] = count
    return out


def _num_params(spec) -> int | None:
    try:
        return int(spec.num_params)
    except Exception:  # noqa: BLE001 - a lazy spec has no count yet
        return None


# ============================================================================ check
def _open_checkpoint(path: str, spec, backend: str | None, fmt: str | None):
    """(the opened checkpoint, the backend its model runs on: --backend-a/b, else its own framework)."""
    ckpt = checkpoints.open_checkpoint(path, spec=spec, format=fmt)
    backend = backend or ckpt.framework or "numpy"
    if ckpt.spec is None:
        raise db.CheckpointError(f"{path} carries no spec: pass --spec SPEC.json")
    return ckpt, backend


def param_diffs(pa: dict, pb: dict) -> list[dict]:
    """Per canonical parameter: shapes, dtypes, max abs difference and whether the bits agree."""
    rows = []
    for k in list(pa) + [k for k in pb if k not in pa]:
        a, b = pa.get(k), pb.get(k)
        row = {"name": k, "shape_a": None if a is None else list(a.shape),
               "shape_b": None if b is None else list(b.shape),
               "dtype_a": None if a is None else a.dtype.name, "dtype_b": None if b is None else b.dtype.name,
               "max_abs_diff": None, "bit_identical": False}
        if a is not None and b is not None and a.shape == b.shape:
            row["max_abs_diff"], row["bit_identical"] = _max_abs_diff(a, b)
        rows.append(row)
    return rows


_DIFF_BLOCK = 1 << 18  # elements per step: float64 temporaries of 2 MB, whatever the tensor's size


def _max_abs_diff(a, b) -> tuple[float, bool]:
    """(max |a - b| in float64, whether the bytes are equal), in blocks: a check of two large
    files holds one layer pair, not float64 copies of it."""
    import numpy as np

    fa, fb = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    same_bits = a.dtype == b.dtype
    block_max = [0.0]
    for start in range(0, fa.size, _DIFF_BLOCK):
        ca, cb = fa[start:start + _DIFF_BLOCK], fb[start:start + _DIFF_BLOCK]
        block_max.append(np.abs(ca.astype(np.float64) - cb.astype(np.float64)).max())
        if same_bits:
            same_bits = np.ascontiguousarray(ca).tobytes() == np.ascontiguousarray(cb).tobytes()
    return float(np.max(block_max)), bool(same_bits)  # np.max keeps a NaN difference visible


def cmd_check(args) -> int:
    from ..testing import compare, compare_checkpoints, rows_structure

    spec_a = read_spec(args.spec_a or args.spec)
    spec_b = read_spec(args.spec_b or args.spec)
    ckpt_a, backend_a = _open_checkpoint(args.a, spec_a, args.backend_a, args.format)
    ckpt_b, backend_b = _open_checkpoint(args.b, spec_b, args.backend_b, args.format)
    options = dict(grads=not args.no_grads, seed=args.seed, batch_size=args.batch_size, strict=args.strict)
    diffs: list[dict] = []
    # layer by layer, one layer pair in memory, not two models; whole models only where layers do not line up
    # or when each layer of B runs on what A's received (--isolated)
    report = None if args.isolated else compare_checkpoints(
        ckpt_a, backend_a, ckpt_b, backend_b, params_seen=lambda pa, pb: diffs.extend(param_diffs(pa, pb)), **options)
    if report is None:
        a, b = ckpt_a.native(backend_a), ckpt_b.native(backend_b)
        report = compare(a, b, isolated=args.isolated, **options)
        diffs = param_diffs(db.get_params(a, copy=False), db.get_params(b, copy=False))
    if report.structure is None:  # streamed: the parameter rows read on the way say it
        report.structure = rows_structure(diffs)
    if args.html:
        report.to_html(args.html)  # atomic; a page with the table and the per-layer error chart
    passed = bool(report.passed)
    if args.json:
        doc = {"a": {"path": args.a, "backend": backend_a}, "b": {"path": args.b, "backend": backend_b},
               "equivalent": passed, "parameters": diffs, "report": report.to_dict()}
        _emit_json(doc)
        return EXIT_OK if passed else EXIT_NOT_EQUIVALENT
    print(f"a: {args.a} ({backend_a})")
    print(f"b: {args.b} ({backend_b})")
    rows = [[d["name"], "x".join(map(str, d["shape_a"] or [])) or "-", "x".join(map(str, d["shape_b"] or [])) or "-",
             d["dtype_a"] or "-", "-" if d["max_abs_diff"] is None else f"{d['max_abs_diff']:.3e}",
             "yes" if d["bit_identical"] else "no"] for d in diffs]
    print(table(["parameter", "shape a", "shape b", "dtype", "max abs diff", "bit-identical"], rows, right=(4,)))
    print()
    print(str(report))
    print("equivalent" if passed else "NOT equivalent")
    return EXIT_OK if passed else EXIT_NOT_EQUIVALENT


# ============================================================================ demo
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
    sub = parser.add_subparsers(dest="command", metavar="{demo,convert,check,inspect,adapter}")
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
    from ._adapter import add_parser as add_adapter  # LoRA adapter directories

    add_adapter(sub)
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
