"""``db.port``: a whole model directory of one library written as another library's own directory.

The flow, with no per-architecture table and no library named here (each format's facts come
from its adapter's model-directory verbs, ``_dirs``):

1. refusals before any byte is written: the output (existing, inside the source), the source's
   files (index entries outside it, safetensors headers that lie), its config (remote code,
   an architecture the destination library does not build, named with what it offers);
2. tiny twins: the source config shrunk (structure kept), each side's model built by its own
   library from its own config, the destination's from the config exactly as it will be
   written; ``db.transfer(mapping="auto")`` between them, verified on generated tokens;
3. the recipes (``_rules``): every tensor the destination twin's saver wrote found among those the
   source twin's saver wrote, generalised over layer indices, applied to the real names and shapes;
4. streaming: each destination tensor made from its memory-mapped sources and written through
   the atomic writer into a directory beside ``out``, moved into place only when everything,
   the verification included, has passed; a certificate of every tensor (``_certificate``).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import CheckpointError, ConversionError, DenseBridgeError, SpecError, received
from ..checkpoints import _port_files as files
from ..checkpoints._io import parse_size
from ..checkpoints._safetensors import SafetensorsFile
from ..registry._devices import check_device_value, place_for_run, place_model, where as device_where
from . import _adapters, _certificate, _codes, _differ, _dirs, _interleaved, _rules, _tying, _zeros

#: Token positions of the generated inputs (a wrong rope base barely moves the first positions).
POSITIONS = 256
_VERIFY = ("auto", "twins", "full")
_DTYPES = ("float32", "float16", "bfloat16")


class PortMismatch(ConversionError):
    """The twins or the full models disagree beyond what the libraries' own differences explain:
    the mapping is wrong or a setting was lost; nothing was written (the command exits 1)."""


@dataclass
class PortReport:
    """What ``db.port`` did: ``out``, the ``source``/``destination`` formats, ``rules`` (the twins'
    layer mapping, generalised), ``tensors`` written, ``bytes`` written, ``verification`` (as in
    the certificate), ``discrepancies`` (library differences found and ported), ``certificate``
    (the whole certificate object), ``seconds``."""

    out: str
    source: str
    destination: str
    rules: list
    tensors: int
    bytes: int
    verification: dict
    certificate: dict
    discrepancies: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: ``text_only`` ports of a multimodal source: the stored source tensors not ported (other towers).
    dropped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        v = self.verification
        lines = [f"ported {self.source} -> {self.destination}: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB "
                 f"into {self.out} in {self.seconds:.1f} s",
                 f"verification: {v.get('mode')} ({'passed' if v.get('passed') else 'FAILED'}) on "
                 f"{v.get('positions')} positions; worst layer {v.get('worst_layer')} at "
                 f"{v.get('worst_tolerance_units')} tolerance units"]
        if v.get("kl_divergence") is not None:
            lines.append(f"next-token KL divergence {v['kl_divergence']:.3g}, top-1 agreement {v['top1_agreement']:.4f}")
        exact = sum(1 for t in self.certificate["tensors"].values() if t["exact"])
        lines.append(f"{exact}/{len(self.certificate['tensors'])} tensors bit-identical to their sources")
        lines += [f"library discrepancy: {d}" for d in self.discrepancies]
        if self.certificate["source"].get("text_only"):
            lines.append(f"text only: the text model alone was ported; {len(self.dropped)} source tensors of the other "
                         f"towers were not (e.g. {self.dropped[:3]}; all listed in the certificate)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"out": self.out, "source": self.source, "destination": self.destination, "rules": self.rules,
                "tensors": self.tensors, "bytes": self.bytes, "verification": self.verification,
                "discrepancies": self.discrepancies, "seconds": self.seconds,
                "text_only": bool(self.certificate["source"].get("text_only")), "dropped": self.dropped}


# ------------------------------------------------------------------------------ refusals
def _is_within(inner: str, outer: str) -> bool:
    inner, outer = os.path.realpath(inner), os.path.realpath(outer)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _check_out(src: str, out: str, overwrite: bool, one_file: bool = False) -> None:
    if one_file:  # the format writes one file: out is that file (its certificate beside it)
        if os.path.isdir(out) or (os.path.lexists(out) and not os.path.isfile(out)):
            raise CheckpointError(f"out {out!r} must be a file name for this format, and it is a directory or "
                                  "something else (nothing was written)")
        if os.path.realpath(out) == os.path.realpath(src) or _is_within(out, src):
            raise CheckpointError(f"out {out!r} is or lies inside src {src!r}: refused (nothing was written)")
        if os.path.lexists(out) and not overwrite:
            raise CheckpointError(f"out {out!r} exists: refused (pass overwrite=True, or --overwrite, to replace it; "
                                  "nothing was written)")
        return
    if _is_within(out, src):
        raise CheckpointError(f"out {out!r} lies inside src {src!r}: refused (nothing was written)")
    if _is_within(src, out):
        raise CheckpointError(f"out {out!r} holds src {src!r}: refused, even with overwrite (nothing was written)")
    if os.path.lexists(out):
        if not os.path.isdir(out) or os.path.islink(out):
            raise CheckpointError(f"out {out!r} exists and is not a directory: refused (nothing was written)")
        if os.listdir(out) and not overwrite:
            raise CheckpointError(f"out {out!r} exists and is not empty: refused (pass overwrite=True, or "
                                  "--overwrite, to replace it; nothing was written)")


def _source_files(src: str, weights: dict[str, str]) -> dict[str, str]:
    """Each weight file named by the source, checked to lie inside ``src``: relative name -> path."""
    out = {}
    for key, rel in weights.items():
        if rel in out:
            continue
        if os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in rel.replace("\\", "/").split("/"):
            raise CheckpointError(f"{src}: the weight index names {rel!r} for tensor {key!r}: an absolute path or one "
                                  "climbing out of the directory: refused (nothing was written)")
        path = os.path.join(src, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{src}: the weight index names {rel!r} for tensor {key!r}, which does not exist "
                                  "(a missing shard; nothing was written)")
        out[rel] = path
    return out


# ------------------------------------------------------------------------------ twins
def token_ids(vocab: int, positions: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, positions)).astype(np.int64)


def vocab_of(fmt, config: dict, shapes: dict[str, tuple[int, ...]]) -> int:
    """The vocabulary size ``fmt``'s adapter reads in ``config``, else the smallest first axis of a matrix."""
    v = fmt.port_describe(config)["vocab_size"]
    if isinstance(v, int) and v > 0:
        return v
    return min(s[0] for s in shapes.values() if len(s) == 2)


def positions_for(fmt, config: dict, wanted: int) -> int:
    """``wanted`` token positions, or fewer where the model's positions end sooner."""
    limit = fmt.port_describe(config)["max_positions"]
    return min(wanted, limit) if isinstance(limit, int) and limit > 0 else wanted


def _read_all(path: str, fmt=None) -> dict[str, np.ndarray]:
    """Every tensor the saver wrote into the directory ``path`` (float32): its safetensors files,
    and the weight files ``fmt``'s layout names, read through its ``port_open``."""
    out = {}
    own = set(fmt.port_layout(1)["shards"]) if fmt is not None else set()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors") or name in own:
            with _dirs.open_weights(fmt, os.path.join(path, name)) if fmt is not None else \
                    SafetensorsFile(os.path.join(path, name)) as f:
                for key in f.keys():
                    out[key] = np.array(f.get(key), np.float32)
    return out


def model_inputs(src_fmt, dst_fmt, ids: np.ndarray, a=None, b=None):
    """The inputs of the models ``a`` and ``b`` for the token ids ``ids``, in the forms ``transfer``
    and ``compare_models`` take: ``[ids]``, or a pair where a format's ``port_inputs`` names its own."""
    def own(fmt, model):
        fn = _dirs.optional(fmt, "port_inputs")
        return fn(ids, model) if fn is not None else [ids]
    a, b = own(src_fmt, a), own(dst_fmt, b)
    return [ids] if isinstance(a, list) and isinstance(b, list) else (a, b)


def _twins(src_fmt, dst_fmt, common: dict, transfer, compare_models, device=None, stored=None, zeros=frozenset(),
           unplaced=None):
    """Build, transfer and verify the twins; returns (transfer report, recipes, stored templates,
    twin parameter templates, discrepancies, twin verification dict)."""
    small = _dirs.shrink(common, src_fmt, dst_fmt)
    src_cfg = src_fmt.port_own_config(small)
    form = _dirs.optional(src_fmt, "port_source_form")
    if form is not None and stored:  # the twin built in the form the source's own directory takes
        src_cfg = form(src_cfg, src_fmt.port_own_config(common), stored)
    dst_cfg = _dirs.complete(dst_fmt, dst_fmt.port_own_config(small), src_fmt.port_shapes(src_cfg))
    a = _tying.source_twin(src_fmt, src_fmt.port_twin(src_cfg, seed=0), src_fmt.port_shapes(src_cfg), stored)
    _zeros.zero_twin(a, zeros)  # biases the real source holds as exact zeros, zero in its twin too
    a = place_for_run(a, device)  # None: the GPU when present
    b = place_for_run(dst_fmt.port_twin(dst_cfg, seed=1), device)
    vocab = vocab_of(src_fmt, src_cfg, src_fmt.port_shapes(src_cfg))
    positions = positions_for(src_fmt, src_cfg, POSITIONS)
    ids = token_ids(vocab, positions)
    discrepancies: list[str] = []
    try:  # inferred here, judged below by the same comparison transfer(verify=True) makes, measured once
        report = transfer(a, b, mapping="auto", inputs=model_inputs(src_fmt, dst_fmt, ids, a, b), verify=False)
    except ConversionError as exc:
        why = _zeros.explain(str(exc), unplaced or {}, dst_fmt.name)  # a source vector the destination's model has no place for
        raise PortMismatch(f"the twins cannot be paired, so no mapping was found (nothing was written): "
                           f"{why + ': ' if why else ''}{exc}") from None
    compared = compare_models(a, b, model_inputs(src_fmt, dst_fmt, ids, a, b), mapping=report.rules, grads=False,
                              judge="carried")
    verification = {"mode": "twins", "passed": True, "positions": positions, "devices": {"a": device_where(a), "b": device_where(b)}}
    if not compared.passed:  # a cut that shapes cannot tell from an interleaving: the interleaved one tried
        again = _interleaved.retry(a, b, report.rules, model_inputs(src_fmt, dst_fmt, ids, a, b), transfer,
                                   compare_models, lambda: _kl_top1(src_fmt.port_logits(a, ids),
                                                                    dst_fmt.port_logits(b, ids))[0])
        if again is not None:
            report, compared = again
    if not compared.passed:
        # the mapping may be right while the libraries compute different functions: judge every
        # linear layer alone; if each agrees, the difference lies in the code between them
        try:
            iso = _isolate(a, b, ids, report.rules, src_fmt, dst_fmt, compare_models)
        except DenseBridgeError:
            iso = None
        where = iso.discrepancy(src_fmt.name, dst_fmt.name, _KL_LIMIT, _TOP1_LIMIT) if iso is not None else None
        inside = None if where is not None else _within_window(a, b, ids, report.rules, src_fmt, dst_fmt, src_cfg,
                                                                   dst_cfg, compare_models)
        if where is None and inside is None and iso is not None and iso.agree:  # the weights pair; the code differs
            raise PortMismatch(_differ.refusal(
                iso, src_fmt, dst_fmt, src_cfg, dst_cfg, a, b, ids, lambda cfg: place_for_run(_tying.source_twin(
                    src_fmt, src_fmt.port_twin(cfg, seed=0), src_fmt.port_shapes(cfg), stored), device),
                _kl_top1, _KL_LIMIT, _TOP1_LIMIT, _differ.destination_builder(a, dst_fmt, transfer, report.rules,
                                                                               device))) from None
        if where is None and inside is None:
            raise PortMismatch(f"the twins disagree, so the mapping is wrong or a setting was lost (nothing was "
                               f"written): {compared.verdict()}") from None
        if inside is not None:  # the two libraries differ only beyond the sliding window: measured within it
            ids, compared, window = inside
            verification["positions"] = window
            real = (src_fmt.port_describe(common) or {}).get("window")
            discrepancies.append(
                f"twins: the two libraries agree on sequences up to the sliding window of attention ({window} "
                f"positions in the twins) and differ beyond it: one of them does not apply the window as the other "
                f"does, so the ported model computes like the source only for sequences of at most "
                f"{real if real else 'the window'} tokens")
        else:
            discrepancies.append(f"twins: {where}")
            verification["isolated"] = True
    verification.update(_measure(a, b, ids, report.rules, src_fmt, dst_fmt, compare_models, compared))
    with tempfile.TemporaryDirectory(prefix="dense-bridge-twins-") as tmp:
        sa, sb = os.path.join(tmp, "src"), os.path.join(tmp, "dst")
        src_fmt.port_save(a, sa)
        dst_fmt.port_save(b, sb)
        src_tensors, dst_tensors = _read_all(sa, src_fmt), _read_all(sb, dst_fmt)
    recipes = _rules.learn(src_tensors, dst_tensors)
    stored = {_rules.template(k)[0] for k in dst_tensors}
    recipes, stored, _ = _tying.drop_copies(dst_fmt, b, recipes, stored, dst_fmt.port_shapes(dst_cfg))
    twin_params = {_rules.template(k)[0] for k in dst_fmt.port_shapes(dst_cfg)}
    return report, recipes, stored, twin_params, discrepancies, verification


#: A difference between the libraries is ported (and named) only when the next-token distributions
#: still agree this closely; a setting lost in translation (a rope base) moves them far more.
_KL_LIMIT, _TOP1_LIMIT = 1e-3, 0.98


def _within_window(a, b, ids, rules, src_fmt, dst_fmt, src_cfg, dst_cfg, compare_models):
    """Whether twins that disagree on ``ids`` agree on sequences no longer than the sliding window of
    attention either config sets (a library that ignores the window computes the same function up to
    it). Returns (the shortened ids (1, window), their comparison, window) when they do, else None."""
    windows = [w for w in ((src_fmt.port_describe(src_cfg) or {}).get("window"),
                           (dst_fmt.port_describe(dst_cfg) or {}).get("window")) if isinstance(w, int)]
    window = min(windows) if windows else None
    if window is None or window < 2 or window >= ids.shape[-1]:
        return None
    short = np.ascontiguousarray(ids[..., :window])
    try:
        compared = compare_models(a, b, model_inputs(src_fmt, dst_fmt, short, a, b), mapping=rules, grads=False,
                                  judge="carried")
    except DenseBridgeError:
        return None
    return (short, compared, window) if compared.passed else None


def _measure(a, b, ids, rules, src_fmt, dst_fmt, compare_models, report=None) -> dict:
    """The worst layer (in tolerance units) and the next-token KL and top-1 agreement of two models
    (``report``: their comparison, when already made)."""
    if report is None:
        report = compare_models(a, b, model_inputs(src_fmt, dst_fmt, ids, a, b), mapping=rules, grads=False,
                                judge="carried")
    worst = report.worst
    la, lb = src_fmt.port_logits(a, ids), dst_fmt.port_logits(b, ids)
    kl, top1 = _kl_top1(la, lb)
    return {"worst_layer": None if worst is None else f"{worst.layer_type} ({worst.quantity})",
            "worst_tolerance_units": None if worst is None else float(worst.units),
            "kl_divergence": kl, "top1_agreement": top1,
            "max_abs_logit_error": float(np.max(np.abs(la.astype(np.float64) - lb)))}


def _isolate(a, b, ids, rules, src_fmt, dst_fmt, compare_models) -> "_differ.Isolation":
    """Every linear layer of b run alone on what its counterpart in a received, and the next-token
    KL and top-1 agreement (``_differ.isolate``)."""
    return _differ.isolate(a, b, ids, rules, src_fmt, dst_fmt, compare_models, _kl_top1,
                           model_inputs(src_fmt, dst_fmt, ids, a, b))


def _library_difference(a, b, ids, rules, src_fmt, dst_fmt, compare_models) -> str | None:
    """Words for where two models that the mapping pairs right compute different functions, or
    None when the mapping itself is at fault: every linear layer of b run alone on what its
    counterpart in a received agrees (isolated comparison), only the code between them differs, and
    the next-token distributions stay close (KL, top-1)."""
    return _isolate(a, b, ids, rules, src_fmt, dst_fmt, compare_models).discrepancy(
        src_fmt.name, dst_fmt.name, _KL_LIMIT, _TOP1_LIMIT)


# ------------------------------------------------------------------------------ writing
def _shard(moves: list[_rules.Move], count: int, nbytes) -> list[list[_rules.Move]]:
    total = sum(nbytes(m) for m in moves)
    target = total / max(count, 1)
    shards: list[list[_rules.Move]] = [[]]
    size = 0
    for m in moves:
        if size and size + nbytes(m) > target * 1.0001 and len(shards) < count:
            shards.append([])
            size = 0
        shards[-1].append(m)
        size += nbytes(m)
    return shards


def _check_args(to, verify, dtype, overwrite, max_shard_size, progress, text_only=False):
    if not isinstance(text_only, bool):
        raise TypeError(f"text_only must be a bool. {received('text_only', text_only)}")
    if not isinstance(to, str):
        raise TypeError(f"to must be a format name (str). {received('to', to)}")
    if verify not in _VERIFY:
        raise ConversionError(f"verify must be one of {_VERIFY}. {received('verify', verify)}")
    if dtype is not None and dtype not in _DTYPES:
        raise ConversionError(f"dtype must be one of {_DTYPES} or None. {received('dtype', dtype)}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool. {received('overwrite', overwrite)}")
    parse_size(max_shard_size)
    if progress is not None and not isinstance(progress, bool) and not callable(progress):
        raise TypeError(f"progress must be None, a bool or a callable. {received('progress', progress)}")


def _unsupported(**given) -> None:
    for name, (value, default) in given.items():
        if value != default:
            raise ConversionError(f"{name}= is not implemented by this port yet: {received(name, value)}")


def port(src: Any, out: Any, *, to: str, verify: str = "auto", dtype: str | None = None, quantize=None,
         adapter=None, adapter_mode: str = "merge", keep_codes: bool = False, outtype=None,
         requantize: bool = False, max_shard_size=None, overwrite: bool = False, device=None,
         progress=None, text_only: bool = False) -> PortReport:
    """Write the model directory ``src`` as the library ``to``'s own directory ``out`` (API.md,
    "Whole checkpoints").

    Args:
        src: a model directory of any format an installed adapter declares, or a one-file model a
            format claims (detected from its content; a part of a split file names the whole model).
        out: the directory to create; it must not exist or be empty (``overwrite=True`` replaces it).
            For a format that writes its own one file (``port_write``): that file, its certificate
            beside it (``<out>.port_certificate.json``), both moved into place when all has passed.
        outtype: that format's storage type (GGUF: f32, f16, bf16, q8_0, q4_0, q4_1, keep, q4_k_m...); others refuse it.
        to: the destination format, one of :func:`dense_bridge.ports.formats` (transformers, mlx-lm).
        verify: ``"twins"`` (always done), ``"full"`` (also both full models, loaded by their own
            loaders, on generated inputs of 256 positions), ``"auto"`` (full when both fit in the
            memory available).
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` or None (keep each tensor's).
        adapter: a LoRA adapter directory for ``src`` in its own ecosystem's format (checked against
            it); ``adapter_mode="merge"`` merges it into the weights (float64, one rounding to the
            destination dtype, certified), ``"keep"`` writes it into ``out/adapter/`` in the
            destination's own adapter format (``ports._adapters``).
        max_shard_size: bytes or ``"5GB"``; default: as many files as the source.
        progress: True/False, or a callable ``(tensors_done, tensors_total, bytes_done, bytes_total)``.
        text_only: port only the text model of a multimodal checkpoint (refused otherwise); the
            certificate's ``source`` then says ``"text_only": true`` and lists the tensors ``"dropped"``.
        device: where the verification runs the models ("cpu", "cuda", "cuda:N", "gpu", "gpu:N" or
            a framework's device object). None: the twins on their framework's GPU when it sees
            one, else the CPU; the full models where their loaders put them. The certificate's
            ``verification["devices"]`` says where the twins ran.

    Returns:
        A :class:`PortReport`; ``out/port_certificate.json`` holds its certificate.
    """
    t0 = time.perf_counter()
    _check_args(to, verify, dtype, overwrite, max_shard_size, progress, text_only)
    check_device_value(device)  # the verification's models run there (dense_bridge/registry/_devices.py)
    if adapter_mode not in ("merge", "keep"):
        raise ConversionError(f"adapter_mode must be 'merge' or 'keep'. {received('adapter_mode', adapter_mode)}")
    src, out = os.fspath(src), os.fspath(out)
    dst_fmt = _dirs.Format(to)
    one_file = dst_fmt.offers("port_write")
    if outtype is not None and not one_file:
        raise ConversionError(f"outtype is the storage type of a format that writes its own file; {to!r} does not: "
                              f"{received('outtype', outtype)}")
    src_fmt = _dirs.detect(src)
    _check_out(src, out, overwrite, one_file)
    root = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))  # a one-file source's directory
    adapter = _adapters.open_job(adapter, adapter_mode, src_fmt, dst_fmt, out)  # read, checked (None: none)

    contents = src_fmt.port_contents(src, text_only=True) if text_only else src_fmt.port_contents(src)
    file_keys = contents.setdefault("file_keys", {})  # a name the port uses -> the key stored in the file
    src_paths = _source_files(root, contents["weights"])
    opened = {}
    try:  # lying headers, and pickles holding anything but tensors, refused here
        for rel, path in src_paths.items():
            opened[rel] = _dirs.open_weights(src_fmt, path)
    except BaseException:
        for f in opened.values():
            f.close()
        raise
    real_src: dict[str, tuple[int, ...]] = {}
    src_dtype: dict[str, np.dtype] = {}
    for key, rel in contents["weights"].items():
        info = opened[rel].tensors.get(file_keys.get(key, key))
        if info is None:
            raise CheckpointError(f"{src_paths[rel]} lacks tensor {file_keys.get(key, key)!r}, which the index places there "
                                  "(nothing was written)")
        real_src[key], src_dtype[key] = tuple(info.shape), info.numpy_dtype
    try:
        _codes.check(src_fmt, dst_fmt, contents, opened, quantize=quantize, keep_codes=keep_codes, requantize=requantize)
    except BaseException:
        for f in opened.values():
            f.close()
        raise
    codes = {"quantize": quantize, "keep_codes": keep_codes, "requantize": requantize}
    hashes = files.Hashes()  # the source's hashes run while the twins are built and checked
    for rel in _certificate.source_names(src_fmt, src_paths, contents["extras"]):
        hashes.add(("source", rel), os.path.join(root, rel))
    try:
        return _port(src, out, src_fmt, dst_fmt, contents, src_paths, opened, real_src, src_dtype, hashes, t0,
                     verify=verify, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, progress=progress,
                     codes=codes, adapter=adapter, device=device, outtype=outtype)
    finally:
        hashes.close()
        for f in opened.values():
            f.close()


def _port(src, out, src_fmt, dst_fmt, contents, src_paths, opened, real_src, src_dtype, hashes, t0, *, verify, dtype,
          max_shard_size, overwrite, progress, codes=None, adapter=None, device=None, outtype=None) -> PortReport:
    from .._transfer import transfer
    from ..testing import compare_models

    common = src_fmt.port_common_config(contents["config"])
    dst_config = _dirs.complete(dst_fmt, dst_fmt.port_own_config(common), real_src)
    real_dst = dst_fmt.port_shapes(dst_config)  # an architecture it does not build is refused here

    dropped, unplaced = _zeros.real_zero_templates(real_src, lambda k: opened[contents["weights"][k]].get(
        contents["file_keys"].get(k, k)), real_dst)
    report, recipes, stored, twin_params, discrepancies, verification = _twins(
        src_fmt, dst_fmt, common, transfer, compare_models, device, stored=real_src, zeros=dropped,
        unplaced=unplaced)
    moves = _rules.plan(recipes, stored, twin_params, real_src, real_dst, dropped)
    rules = _rules.generalise_layer_rules(report.rules)
    if adapter is not None:  # checked against the source; merge: the adapted weights merged as they are read
        opened = adapter.bind(src_fmt, dst_fmt, common, real_src, src_dtype, opened, contents["weights"],
                              contents["file_keys"], rules, dtype, real_dst)

    out_dtype = {m.target: (np.dtype(_numpy_dtype(dtype)) if dtype else _zeros.fill_dtype(src_dtype) if not m.sources
                            else src_dtype[_rules.split_view(m.sources[0][0])[0]]) for m in moves}

    def nbytes(m):
        return out_dtype[m.target].itemsize * int(np.prod(m.shape))

    total = sum(nbytes(m) for m in moves)
    limit = parse_size(max_shard_size)
    count = max(1, -(-total // limit)) if limit else len(src_paths)
    free = files.free_bytes(os.path.dirname(os.path.abspath(out)) or ".")
    if free is not None and free < total + (64 << 20):
        raise CheckpointError(f"not enough free disk space for {out}: {total:,} bytes needed, {free:,} free "
                              "(nothing was written)")
    root = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    one_file = dst_fmt.offers("port_write")
    notes: dict[str, dict] = {}
    write = None
    if one_file:  # the format writes its one file itself, in its own encoding
        count = 1
        extras = {n: os.path.join(root, n) for n in contents["extras"]}  # the source's files besides weights
        config_name = src_fmt.port_layout(1)["config"]
        if config_name and os.path.isfile(os.path.join(root, config_name)):
            extras[config_name] = os.path.join(root, config_name)

        codes_from = _codes.sources_of(moves, opened, contents["weights"], contents["file_keys"])

        def write(path, tensors, on_tensor=None):
            notes.update(dst_fmt.port_write(path, dst_config, tensors, outtype=outtype, extras=extras,
                                            on_tensor=on_tensor, codes=codes_from) or {})
            return os.path.getsize(path)
    shards = _shard(moves, count, nbytes)
    layout = dst_fmt.port_layout(len(shards))
    if len(layout["shards"]) < len(shards):  # a format that writes fewer files (one, say)
        shards = _shard(moves, len(layout["shards"]), nbytes)
    if one_file:
        layout = dict(layout, shards=[os.path.basename(out)], index=None, config=None, extras=())

    tmp = files.new_output_dir(out)
    try:
        cert_tensors, written = _certificate.write_all(tmp, shards, layout, opened, contents["weights"], out_dtype,
                                                       nbytes, total, progress, hashes, contents["file_keys"],
                                                       writer=write if one_file else _dirs.writer(dst_fmt, dst_config))
        for name, note in notes.items():  # what the format's own encoding did to each tensor
            cert_tensors[name].update(note)
        _codes.annotate(cert_tensors, opened)
        write_config = _dirs.optional(dst_fmt, "port_write_config")
        if write_config is not None:
            write_config(tmp, dst_config, src)
        elif layout["config"]:
            files.write_json(os.path.join(tmp, layout["config"]), dst_config)
        shared = [n for n in contents["extras"] if n in layout["extras"]]
        for name in shared:
            files.copy_file(os.path.join(root, name), os.path.join(tmp, name))
        source_extras = _dirs.optional(src_fmt, "port_write_extras")  # files a one-file source carries inside
        if source_extras is not None and not one_file:
            source_extras(src, tmp, [n for n in layout["extras"] if n not in shared])
        lossy = sorted(n for n, e in cert_tensors.items() if not e.get("exact", True) and e.get("codes") == "quantized")
        verification = _verify_full(verify, src_fmt, dst_fmt, src, tmp, common, real_src, src_dtype, rules,
                                    verification, compare_models, discrepancies, bool(contents["file_keys"]), adapter,
                                    lossy=lossy, device=device)
        if codes and _codes.active(codes["quantize"], codes["keep_codes"]):
            _codes.finish(tmp, src_fmt, dst_fmt, cert_tensors, opened, **codes, source_config=contents["config"],
                          dtype=dtype, hashes=hashes, float_model_logits=_float_logits(dst_fmt, tmp, common, real_src),
                          verification=verification)
        certificate = _certificate.build(root, src_fmt, dst_fmt, tmp, src_paths, contents, report, rules,
                                         verification, cert_tensors, discrepancies, shared, hashes)
        used = {_rules.split_view(x[0])[0] for m in moves for x in m.sources}
        gone = sorted(k for k in real_src if k not in used and _rules.template(k)[0] in dropped)
        if gone:  # source biases of exact zeros that the destination's layers have no place for
            certificate["dropped_zeros"] = gone
        if one_file:
            certificate["destination"]["outtype"] = outtype
        if adapter is not None:
            adapter.finish(tmp, certificate)
        files.write_json(os.path.join(tmp, _certificate.NAME), certificate)
        if not verification.get("passed"):
            raise PortMismatch(f"the full models disagree (nothing was written): {verification.get('detail')}")
        if one_file:
            files.finish_output_file(tmp, out, _certificate.file_certificate(out), overwrite=overwrite)
        else:
            files.finish_output_dir(tmp, out, overwrite=overwrite)
    except BaseException:
        files.discard_dir(tmp)
        raise
    return PortReport(out, src_fmt.name, dst_fmt.name, rules, len(moves), written, verification, certificate,
                      discrepancies, time.perf_counter() - t0, list(contents.get("dropped", [])))


def _float_logits(fmt, path, common, real_src):
    """A judge of a model against the float directory ``path`` as it is now (before codes are
    written into it): ``fn(model) -> (next-token KL, top-1 agreement, largest logit error)``."""
    positions = positions_for(fmt, common, POSITIONS)
    ids = token_ids(vocab_of(fmt, common, real_src), positions, seed=1)
    reference = fmt.port_logits(fmt.port_load(path), ids)

    def judge(model):
        got = fmt.port_logits(model, ids)
        kl, top1 = _kl_top1(reference, got)
        return kl, top1, float(np.max(np.abs(reference.astype(np.float64) - got)))
    return judge


def _numpy_dtype(name: str):
    from .._dtypes import numpy_dtype

    return numpy_dtype(name)


# ------------------------------------------------------------------------------ full verification
def _fits(real_src, src_dtype) -> bool:
    from ..params._memory_budget import available_memory

    need = sum(4 * int(np.prod(s)) for s in real_src.values()) * 2 + (512 << 20)  # both models, float32
    have = available_memory()
    return have is not None and need <= have * 0.8


def _kl_top1(p_logits: np.ndarray, q_logits: np.ndarray) -> tuple[float, float]:
    """Mean next-token KL(p || q) and top-1 agreement over every position."""
    p = p_logits.astype(np.float64).reshape(-1, p_logits.shape[-1])
    q = q_logits.astype(np.float64).reshape(-1, q_logits.shape[-1])
    lp = p - p.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))
    top1 = float(np.mean(p.argmax(-1) == q.argmax(-1)))
    return max(kl, 0.0), top1


def _verify_full(verify, src_fmt, dst_fmt, src, tmp, common, real_src, src_dtype, rules, twins, compare_models,
                 discrepancies, text_only=False, adapter=None, lossy=(), device=None):
    out = dict(twins)
    out["twins"] = dict(twins)
    if verify == "twins" or (verify == "auto" and not _fits(real_src, src_dtype)):
        out["mode"] = "twins"
        out["full_skipped"] = "verify='twins'" if verify == "twins" else "the two full models do not fit in memory"
        return out
    a = src_fmt.port_load(src, text_only=True) if text_only else src_fmt.port_load(src)  # its text model alone
    if adapter is not None:
        a = adapter.source_model(a)
    b = dst_fmt.port_load(tmp)
    if device is not None:  # the full models on the GPU only when asked: they may not fit its memory
        a, b = place_model(a, device, strict=False), place_model(b, device, strict=False)
    positions = positions_for(src_fmt, common, POSITIONS)
    ids = token_ids(vocab_of(src_fmt, common, real_src), positions, seed=1)
    inputs = model_inputs(src_fmt, dst_fmt, ids, a, b)
    try:
        report = compare_models(a, b, inputs, mapping=rules, grads=False, judge="carried")
    except (ConversionError, SpecError):
        # the twins' rules name layers by paths the full models spell otherwise (a library that
        # numbers nested models per process): the mapping is inferred again on the full models
        rules = "auto"
        report = compare_models(a, b, inputs, mapping=rules, grads=False, judge="carried")
    out.update({"mode": "full", "positions": positions, "passed": bool(report.passed),
                "devices": {"a": device_where(a), "b": device_where(b)}})
    out.update(_measure(a, b, ids, rules, src_fmt, dst_fmt, compare_models, report))
    if not report.passed and lossy:
        # the destination quantizes (codes "quantized" in the certificate): the full models differ by
        # that rounding, measured and reported, not judged; each tensor's encoding is certified
        out["passed"] = True
        out["lossy"] = {"tensors": len(lossy), "detail": report.verdict()[:300]}
        discrepancies.append(f"full models: {len(lossy)} tensors quantized by the destination's encoding: next-token "
                             f"KL {out['kl_divergence']:.3g}, top-1 agreement {out['top1_agreement']:.4f} (measured)")
    elif not report.passed:
        where = _library_difference(a, b, ids, rules, src_fmt, dst_fmt, compare_models)
        if where is None:
            out["passed"] = False
            out["detail"] = report.verdict()[:500] if callable(report.verdict) else str(report.verdict)[:500]
        else:
            out["passed"] = True
            out["isolated"] = True
            discrepancies.append(f"full models: {where}")
    return out
