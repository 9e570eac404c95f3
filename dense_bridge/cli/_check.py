"""``dense-bridge check A B``: the equivalence report of two checkpoints (layer by layer, one layer
pair in memory: ``testing.compare_checkpoints``; whole models through ``testing.compare`` where the
layers do not line up or with ``--isolated``) with every parameter's difference; exit 1 when not
equivalent. Whole native models (``--mapping``/``--inputs``) go to ``_whole_models``."""
from __future__ import annotations

import dense_bridge as db
from .. import checkpoints
from ._common import EXIT_NOT_EQUIVALENT, EXIT_OK, SCAN_BLOCK, emit_json, read_spec
from ._text import table


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


def _max_abs_diff(a, b) -> tuple[float, bool]:
    """(max |a - b| in float64, whether the bytes are equal), in blocks: a check of two large
    files holds one layer pair, not float64 copies of it."""
    import numpy as np

    fa, fb = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    same_bits = a.dtype == b.dtype
    block_max = [0.0]
    for start in range(0, fa.size, SCAN_BLOCK):
        ca, cb = fa[start:start + SCAN_BLOCK], fb[start:start + SCAN_BLOCK]
        block_max.append(np.abs(ca.astype(np.float64) - cb.astype(np.float64)).max())
        if same_bits:
            same_bits = np.ascontiguousarray(ca).tobytes() == np.ascontiguousarray(cb).tobytes()
    return float(np.max(block_max)), bool(same_bits)  # np.max keeps a NaN difference visible


def cmd_check(args) -> int:
    from ..testing import compare, compare_checkpoints, rows_structure
    from ._port import check_model_dirs, given_model_dirs

    if given_model_dirs(args):  # two model directories (db.port's formats): dense_bridge/ports
        return check_model_dirs(args)
    if getattr(args, "device", None) is not None:
        raise db.SpecError(f"--device applies to two model directories (or one-file models); {args.a} and {args.b} "
                           f"are checkpoints, compared where their frameworks load them. "
                           f"Received: --device={args.device!r}")

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
        emit_json(doc)
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
