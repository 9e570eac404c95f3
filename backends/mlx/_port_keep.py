"""``keep_codes=True`` into mlx-lm directories: a quantized source's codes written as mlx-lm writes
quantized models, moved, never requantized.

The source's adapter gives each layer's codes already in MLX's layout (``codes_of``: ``weight``
uint32 packed along the input axis, ``scales`` and, affine, ``biases`` (units, in / group),
``bits``, ``group_size``, ``mode``; a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K blocks become affine
group-32 layers with float32 scales and biases, MXFP4 blocks mxfp4). A layer is written quantized
only where mlx-lm's model quantizes that module (``to_quantized``: linear layers and embeddings;
norms stay float) and ``mx.dequantize`` of the codes equals the source's exact dequantization in
value (a zero's sign aside: -0.0 == +0.0); else the first differing value is named
(``requantize=True``: ``mx.quantize`` of the float weight, group 32, the source's bits).

The files are mlx-lm's: ``<layer>.weight``/``.scales``/``.biases`` in the safetensors files the
float port wrote, config.json's ``"quantization"`` (and ``"quantization_config"``) holding the
most common setting and, by layer path, each layer whose bits or mode differ, which
``mlx_lm.utils.load_model`` reads.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np

from dense_bridge.adapter_kit import ConversionError

LAYOUT = "mlx-lm quantized layers (weight/scales/biases, config.json \"quantization\"), as mlx_lm.convert -q writes"


def _modules(path: str) -> dict[str, object]:
    """{layer path: module} of the modules mlx-lm's model for the directory quantizes (to_quantized)."""
    from pathlib import Path

    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), lazy=True)
    return {name: m for name, m in model.named_modules() if hasattr(m, "to_quantized")}


def _first_difference(name: str, got: np.ndarray, want: np.ndarray) -> str:
    a, b = got.astype(np.float32), want.astype(np.float32)
    differ = np.flatnonzero((a != b).reshape(-1) & ~(np.isnan(a) & np.isnan(b)).reshape(-1))
    index = tuple(int(k) for k in np.unravel_index(int(differ[0]), a.shape))
    return (f"tensor {name!r} at index {index}: mx.dequantize of the moved codes gives {float(a[index])!r}, the "
            f"source's exact dequantization {float(b[index])!r} ({differ.size} of {a.size} values differ)")


def port_keep_codes(fmt: str, path: str, layers: dict, requantize: bool) -> dict:
    """Rewrite the float mlx-lm directory ``path`` with the source's codes for ``layers`` ({float
    weight name: codes in MLX's layout with ``"reference"``, the exact dequantization written}).

    Returns:
        {"tensors": {float weight name: {"codes": "moved" | "quantized", "stored": {stored tensor:
        dtype name}, "ops", "max_abs_error", "recompute"}}, "files": {stored tensor: file},
        "layout"}. ConversionError naming the first differing value where codes cannot move and
        ``requantize`` is False (the directory is then left as it was).
    """
    import mlx.core as mx

    from ._arrays import from_numpy, to_numpy
    from ._port_quant import CONFIG, _weight_map

    modules = _modules(path)
    weights = _weight_map(path)
    plan: dict[str, dict] = {}  # target -> {"layer", "parts": {leaf: array}, "codes", "setting", "err"}
    for target, codes in layers.items():
        layer = target[: -len(".weight")] if target.endswith(".weight") else None
        module = modules.get(layer)
        ref = np.asarray(codes["reference"])
        if module is None or target not in weights or tuple(module.weight.shape) != tuple(ref.shape):
            continue  # mlx-lm does not quantize it: the exact dequantization stays (certificate: dequantized)
        bits, group, mode = int(codes["bits"]), int(codes["group_size"]), codes["mode"]
        parts = {"weight": codes["weight"], "scales": codes["scales"]}
        if codes.get("biases") is not None:
            parts["biases"] = codes["biases"]
        got = mx.dequantize(*(from_numpy(np.ascontiguousarray(parts[k])) for k in ("weight", "scales")),
                            from_numpy(np.ascontiguousarray(parts["biases"])) if "biases" in parts else None,
                            group, bits, mode, dtype=mx.float32)
        got = to_numpy(got)
        same = bool(np.array_equal(got, ref.astype(np.float32)))
        if same:
            kind, err = "moved", 0.0
            bitwise = got.tobytes() == ref.astype(np.float32).tobytes()
            op = (f"move {mode} {bits}-bit codes, group {group}, into MLX's layout ({codes.get('ggml_type', mode)} "
                  f"blocks): mx.dequantize equals the source's dequantization "
                  + ("bit for bit" if bitwise else "in value; bit for bit but the sign of zero (-0.0 / +0.0)"))
        elif not requantize:
            raise ConversionError("keep_codes=True: the source's codes do not dequantize the same in MLX: "
                                  + _first_difference(target, got, ref)
                                  + "; pass requantize=True for MLX's own codes (nothing was written)")
        else:
            mode, group = "affine", 32 if ref.shape[-1] % 32 == 0 else 64
            q = mx.quantize(from_numpy(np.ascontiguousarray(ref, np.float32)), group, bits, mode=mode)
            parts = {"weight": to_numpy(q[0]), "scales": to_numpy(q[1]), "biases": to_numpy(q[2])}
            back = to_numpy(mx.dequantize(q[0], q[1], q[2], group, bits, mode))
            kind, err = "quantized", float(np.max(np.abs(back.astype(np.float64) - ref)))
            op = f"quantize affine {bits}-bit, group {group} (mx.quantize)"
        plan[target] = {"layer": layer, "parts": parts, "kind": kind, "err": err, "op": op,
                        "setting": {"group_size": group, "bits": bits, "mode": mode}}
    if not plan:
        return {"tensors": {}, "files": weights, "layout": LAYOUT}

    # every file holding a moved layer rewritten with its codes; the others as they are
    by_file: dict[str, list[str]] = {}
    for target in plan:
        by_file.setdefault(weights[target], []).append(target)
    for rel, targets in by_file.items():
        full = os.path.join(path, rel)
        arrays = dict(mx.load(full))
        for target in targets:
            p = plan[target]
            del arrays[target]
            for leaf, a in p["parts"].items():
                arrays[f"{p['layer']}.{leaf}"] = from_numpy(np.ascontiguousarray(a))
        tmp = full + ".codes.safetensors"
        mx.save_safetensors(tmp, arrays, metadata={"format": "mlx"})
        os.replace(tmp, full)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            idx = json.load(f)
        wm = idx.get("weight_map", {})
        for target, p in plan.items():
            rel = wm.pop(target)
            for leaf in p["parts"]:
                wm[f"{p['layer']}.{leaf}"] = rel
        idx["weight_map"] = dict(sorted(wm.items()))
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)

    config_path = os.path.join(path, CONFIG)
    with open(config_path) as f:
        config = json.load(f)
    common = Counter(tuple(sorted(p["setting"].items())) for p in plan.values()).most_common(1)[0][0]
    quantization: dict = dict(common)
    for p in plan.values():
        if tuple(sorted(p["setting"].items())) != common:
            quantization[p["layer"]] = dict(p["setting"])
    config["quantization"] = quantization
    config["quantization_config"] = quantization
    with open(config_path + ".tmp", "w") as f:
        json.dump(config, f, indent=4)
    os.replace(config_path + ".tmp", config_path)

    done = {}
    for target, p in plan.items():
        stored = {f"{p['layer']}.{leaf}": str(np.asarray(a).dtype) for leaf, a in p["parts"].items()}
        done[target] = {"codes": p["kind"], "max_abs_error": p["err"], "ops": [p["op"]], "stored": stored,
                        "recompute": {k: {"kind": p["kind"], **p["setting"], "float_dtype": "float32",
                                          "part": k.rsplit(".", 1)[1]} for k in stored}}
    return {"tensors": done, "files": _weight_map(path), "layout": LAYOUT}
