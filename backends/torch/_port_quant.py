"""``keep_codes=True`` into transformers directories: a quantized source's codes written as torchao
weight-only tensors, the layout transformers' torchao support saves and loads itself
(``TorchAoConfig`` + safetensors: ``<layer>._weight_qdata`` / ``_weight_scale`` /
``_weight_zero_point`` with torchao's metadata).

torchao's ``IntxUnpackedToInt8Tensor`` (``IntxWeightOnlyConfig``: 1..8-bit signed codes, one int8
each, groups along in_features, an int8 zero point per group) dequantizes as ``f((q - zero) *
scale)``, one rounding. An affine source (MLX: ``f(f(scale * q) + offset)``, two roundings) moves
into it with ``q - 2**(bits-1)`` and the zero point ``round(-offset / scale) - 2**(bits-1)``; the
move is kept only where torchao's own dequantization of the candidate equals the source's exact
dequantization bit for bit, else the first differing value is named (``requantize=True``: the
layer is quantized by torchao's own quantizer, through ``from_pretrained(quantization_config=)``
exactly as transformers does it, and the largest error is reported). Embedding tables stay float
(transformers quantizes linear layers; the certificate says "dequantized").
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

from dense_bridge.adapter_kit import ConversionError

from ._arrays import to_numpy

import contextlib


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars off and warnings held back while it loads and saves (the port
    reports in its own words)."""
    import logging
    import warnings

    from transformers.utils import logging as tlog

    bars = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
        if bars:
            tlog.enable_progress_bar()


LAYOUT = "torchao IntxUnpackedToInt8Tensor (IntxWeightOnlyConfig, asymmetric, per-group), via TorchAoConfig"


def _config_for(bits: int, group: int):
    import torch
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    return IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(group),
                                mapping_type=MappingType.ASYMMETRIC)


def _candidate(template, codes: dict):
    """The torchao tensor holding ``codes`` (canonical affine: ``qcodes`` (units, in) unsigned,
    ``scale``/``offset`` (units, G)) in ``template``'s class, dtype and grouping."""
    import torch

    bits = int(codes["bits"])
    shift = 1 << (bits - 1)
    q = torch.from_numpy(np.asarray(codes["qcodes"], np.int16) - shift).to(torch.int8)
    scale = np.asarray(codes["scale"])
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.rint(-np.asarray(codes["offset"], np.float64) / np.asarray(scale, np.float64))
    zero = np.nan_to_num(zero, nan=0.0, posinf=127 + shift, neginf=-128 + shift)
    zero = torch.from_numpy(np.clip(zero - shift, -128, 127).astype(np.int8))
    scale_t = torch.from_numpy(np.array(scale, copy=True)).to(template.scale.dtype)
    cls = type(template)
    return cls(q, scale_t.reshape(template.scale.shape), zero.reshape(template.zero_point.shape),
               template.target_dtype, tuple(template.block_size), template.dtype, None)


def _first_difference(name: str, got: np.ndarray, want: np.ndarray) -> str:
    a, b = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    differ = np.flatnonzero(((a != b) | (np.signbit(a) != np.signbit(b))).reshape(-1))
    index = tuple(int(k) for k in np.unravel_index(int(differ[0]), a.shape))
    return (f"tensor {name!r} at index {index}: torchao dequantizes the moved codes to {float(a[index])!r}, the "
            f"source's exact dequantization is {float(b[index])!r} ({differ.size} of {a.size} values differ)")


def port_keep_codes(fmt: str, path: str, layers: dict, requantize: bool) -> dict:
    """Rewrite the float transformers directory ``path`` with torchao codes for ``layers``
    ({float weight name: canonical codes with ``"reference"``, the exact dequantization written}).

    Returns:
        {"tensors": {float weight name: {"codes": "moved" | "quantized", "stored": {stored tensor:
        dtype name}, "ops", "max_abs_error"}}, "files": {stored tensor: file}, "layout"}.
        ConversionError naming the first differing value where codes cannot move and
        ``requantize`` is False (nothing is rewritten then).
    """
    import torch
    import transformers
    from torchao.quantization import FqnToConfig

    with _quiet():
        plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    linear = {}
    for target, codes in layers.items():
        fqn = target[: -len(".weight")] if target.endswith(".weight") else None
        try:
            module = plain.get_submodule(fqn) if fqn else None
        except AttributeError:
            module = None
        if isinstance(module, torch.nn.Linear) and module.weight.shape == tuple(codes["reference"].shape):
            linear[fqn] = (target, codes)
    del plain
    problems = [f"{t!r} is {c['mode']} (codes of a small float's bits): torchao's weight-only integer layouts "
                f"hold no such codes" for t, c in (v for v in linear.values()) if c["mode"] != "affine"]
    if problems and not requantize:
        raise ConversionError("keep_codes=True cannot keep these codes (pass requantize=True for torchao's own codes; "
                              "nothing was written): " + "; ".join(problems[:4]))
    # keyed by the weight itself: keyed by the module, transformers 5.24 hands torchao its bias too
    config = transformers.TorchAoConfig(quant_type=FqnToConfig(
        {f"{fqn}.weight": _config_for(int(c["bits"]), int(c["group_size"])) for fqn, (_, c) in linear.items()}))
    with _quiet():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto", quantization_config=config)
    done: dict[str, dict] = {}
    for fqn, (target, codes) in linear.items():
        module = model.get_submodule(fqn)
        w = module.weight
        if not type(w).__module__.startswith("torchao."):
            continue  # transformers' torchao support leaves it float (modules_to_not_convert): dequantized
        ref = np.asarray(codes["reference"])
        kind = None
        if codes["mode"] == "affine":
            cand = _candidate(w, codes)
            with torch.no_grad():
                got = to_numpy(cand.dequantize())
            if got.dtype == ref.dtype and got.tobytes() == ref.tobytes():
                module.weight = torch.nn.Parameter(cand, requires_grad=False)
                kind, err = "moved", 0.0
            elif not requantize:
                raise ConversionError("keep_codes=True: the source's codes do not dequantize the same in torchao's "
                                      f"{type(w).__name__} (MLX computes f(f(scale * q) + bias), torchao f((q - zero) "
                                      "* scale)): " + _first_difference(target, got, ref)
                                      + "; pass requantize=True for torchao's own codes (nothing was written)")
        if kind is None:
            with torch.no_grad():
                got = to_numpy(w.dequantize())
            kind = "quantized"
            err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
        scale_dtype = str(module.weight.scale.dtype).replace("torch.", "")
        op = (f"move {codes['mode']} {codes['bits']}-bit codes, group {codes['group_size']}, into torchao "
              f"{type(w).__name__} (q - {1 << (int(codes['bits']) - 1)}, zero = round(-bias / scale) - "
              f"{1 << (int(codes['bits']) - 1)}): its dequantization equals the source's bit for bit"
              if kind == "moved" else
              f"quantize with torchao IntxWeightOnlyConfig(int{codes['bits']}, group {codes['group_size']}, "
              f"asymmetric) through transformers' TorchAoConfig")
        stored = {f"{fqn}._weight_qdata": "int8", f"{fqn}._weight_scale": scale_dtype,
                  f"{fqn}._weight_zero_point": "int8"}
        recipe = {"kind": kind, "bits": int(codes["bits"]), "group_size": int(codes["group_size"]),
                  "scale_dtype": scale_dtype, "float_dtype": str(ref.dtype)}
        done[target] = {"codes": kind, "max_abs_error": err, "ops": [op], "stored": stored,
                        "recompute": {k: {**recipe, "part": k.rsplit("._weight_", 1)[1]} for k in stored}}
    with tempfile.TemporaryDirectory(prefix="dense-bridge-torchao-", dir=os.path.dirname(os.path.abspath(path))) as t:
        with _quiet():
            model.save_pretrained(t)
        for name in os.listdir(path):
            if name.endswith(".safetensors") or name == "model.safetensors.index.json":
                os.remove(os.path.join(path, name))
        for name in os.listdir(t):
            if name.endswith(".safetensors") or name in ("model.safetensors.index.json", "config.json"):
                shutil.move(os.path.join(t, name), os.path.join(path, name))
    return {"tensors": done, "files": _weight_map(path), "layout": LAYOUT}


def _weight_map(path: str) -> dict[str, str]:
    from dense_bridge.adapter_kit import SafetensorsFile

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with SafetensorsFile(os.path.join(path, name)) as f:
                out.update({k: name for k in f.keys()})
    return out


def port_recompute_codes(fmt: str, recipe: dict, value: np.ndarray, codes: dict | None) -> np.ndarray:
    """The stored torchao tensor ``recipe["part"]`` ("qdata", "scale", "zero_point") computed again
    (``db.verify_port``): for moved codes from the source's canonical ``codes`` (the rewrite of the
    module docstring), for new ones by torchao's quantizer on ``value``, the float weight in
    ``recipe["float_dtype"]`` (what transformers' TorchAoConfig quantized)."""
    import torch

    if recipe["kind"] == "moved":
        template = _template(recipe, tuple(np.asarray(codes["qcodes"]).shape))
        w = _candidate(template, codes)
    else:
        from torchao.quantization import quantize_

        units, n = value.shape
        lin = torch.nn.Linear(n, units, bias=False, dtype=_torch(value).dtype)
        with torch.no_grad():
            lin.weight.copy_(_torch(value))
        quantize_(lin, _config_for(recipe["bits"], recipe["group_size"]))
        w = lin.weight
    part = {"qdata": w.qdata, "scale": w.scale, "zero_point": w.zero_point}[recipe["part"]]
    return np.ascontiguousarray(to_numpy(part.detach()))


def _torch(value: np.ndarray):
    from ._arrays import from_numpy

    return from_numpy(np.ascontiguousarray(value))


def _template(recipe: dict, shape: tuple[int, ...]):
    """A torchao tensor of ``shape`` in the recipe's bits, groups and scale dtype (its values unused)."""
    import torch
    from torchao.quantization import quantize_

    dtype = getattr(torch, recipe["scale_dtype"])
    lin = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
    quantize_(lin, _config_for(recipe["bits"], recipe["group_size"]))
    return lin.weight
