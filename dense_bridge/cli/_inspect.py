"""``dense-bridge inspect SRC``: what a checkpoint holds: its format, spec (layers, widths,
activations, dtypes, parameter counts), every stored tensor and its NaN/Inf count."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

import dense_bridge as db
from .. import checkpoints
from ._common import EXIT_OK, SCAN_BLOCK, emit_json, human_bytes, read_spec
from ._text import table


def whole_model(entries, framework) -> tuple[list[dict], list[tuple[str, tuple, str]]]:
    """(linear layers recognised by name, the other tensors) of a file without a spec: other
    tensors (embedding tables, norms) say it holds a whole model, which no spec describes."""
    from ..models import file_linear_layers

    rows = file_linear_layers(entries, framework)
    taken = {t for r in rows for t in r["tensors"]}
    return rows, [e for e in entries if e[0] not in taken]


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
    try:
        ckpt = checkpoints.open_checkpoint(args.src, spec=spec, format=args.format)
    except db.CheckpointError:
        from .. import ports

        doc = ports.describe_file(args.src) if spec is None and args.format is None else None
        if doc is None:
            raise
        return _print_one_file_model(doc, args)
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
    doc["quantized_layers"] = checkpoints.quantized_layers(ckpt)  # codes kept: bits, groups, scheme per layer
    if ckpt.spec is None:  # a plain weights file: linear layers by name, layouts assumed (models.py)
        from ..models import file_linear_layers, format_file_linear_layers

        doc["linear_layers"] = checkpoints.quantized_linear_rows(file_linear_layers(entries, ckpt.framework),
                                                                 doc["quantized_layers"])
    if args.json:
        emit_json(doc)
        return EXIT_OK
    nfiles = len(doc["files"])
    print(f"{args.src}: {ckpt.kind}, {nfiles} file{'s' if nfiles != 1 else ''}, {human_bytes(ckpt.total_bytes)}")
    if ckpt.spec is None and not isinstance(ckpt, checkpoints.CanonicalCheckpoint) \
            and whole_model(entries, ckpt.framework)[1]:
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
    if doc["quantized_layers"]:
        print(checkpoints.format_quantized_layers(doc["quantized_layers"]))
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


def _print_one_file_model(doc: dict, args) -> int:
    if args.json:
        emit_json(doc)
        return EXIT_OK
    nfiles = len(doc["files"])
    print(f"{args.src}: {doc['kind']}, {nfiles} file{'s' if nfiles != 1 else ''}, {human_bytes(doc['bytes'])}")
    rows = doc["linear_layers"]
    print(f"linear layers ({len(rows)}):" if rows else "linear layers: none recognised by name")
    if rows:
        print(table(["layer", "in", "units", "bias", "type", "layout"],
                    [[r["layer"], r["in_features"], r["units"], "yes" if r["bias"] else "no", r["dtype"], r["layout"]]
                     for r in rows], right=(1, 2)))
    print()
    print(table(["tensor", "shape", "type", "values"],
                [[t["name"], "(" + ", ".join(map(str, t["shape"])) + ("," if len(t["shape"]) == 1 else "") + ")",
                  t["dtype"], f"{math.prod(t['shape']):,}"] for t in doc["tensors"]], right=(3,)))
    print(f"total: {len(doc['tensors'])} tensors, {sum(math.prod(t['shape']) for t in doc['tensors']):,} stored values")
    return EXIT_OK


def _nonfinite_counts(ckpt) -> dict[str, int] | None:
    """Canonical tensor name -> how many NaN/Inf values it holds (only those holding some), read
    one tensor at a time; None where the tensors cannot be read without a spec (native files)."""
    if ckpt.framework is not None and ckpt.spec is None:
        return None
    out = {}
    for name, tensor in ckpt.pending().items():
        flat = np.asarray(tensor.produce()).reshape(-1)
        # in blocks: the boolean temporaries stay small whatever the tensor's size
        count = sum(int(np.count_nonzero(~np.isfinite(flat[start:start + SCAN_BLOCK])))
                    for start in range(0, flat.size, SCAN_BLOCK))
        if count:
            out[name] = count
    return out


def _num_params(spec) -> int | None:
    try:
        return int(spec.num_params)
    except Exception:  # noqa: BLE001 - a lazy spec has no count yet
        return None
