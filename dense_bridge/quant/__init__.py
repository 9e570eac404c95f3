"""Quantized linear layers, framework-neutral: the scheme (:class:`Quant`), the canonical codes,
and the rule that decides, per layer, whether codes move exactly from one format into another.

Canonical quantized parameters (``db.get_params(layer, quantized=True)``), groups along
in_features (``G = in_features / group_size``; one group when ``group_size`` is None):

- ``"qkernel"`` (in_features, units): one integer code per weight, unpacked; ``uint8`` where the
  format's codes are unsigned (MLX: 0 .. 2**bits - 1), ``int8`` where they are signed
  (torchao, Keras: -2**(bits-1) .. 2**(bits-1) - 1);
- ``"scale"`` (G, units), and by scheme ``"zero"`` (G, units) or ``"offset"`` (G, units);
- ``"bias"`` (units,) where the layer has one, float, never quantized;
- ``"quant"``: the scheme as a :class:`Quant`. It lives in the params, not in the spec: the spec
  describes the function (a quantized layer reads as the float ``Dense`` it stands for), the
  params describe how its weights are stored. A checkpoint stores it per position in its
  metadata ``quant``, beside the float spec (``checkpoints/_quantized.py``).

Schemes, each named by the arithmetic its framework dequantizes with (w is the float kernel):

=============  ==========================================  =================================
scheme         w                                           used by
=============  ==========================================  =================================
"affine"       f(f(scale * q) + offset), two roundings     MLX ``mode="affine"``
"zero_point"   f((q - zero) * scale), one rounding         torchao int8/intx, Keras int4 groups
"divide"       f(q / scale)                                Keras int8, Keras int4 per-channel
"mxfp4" ...    fp(q) * scale (q a small float's bits)      MLX microscaling modes
=============  ==========================================  =================================

Equal codes are not enough for an exact move: the same codes give other floats under another
arithmetic. So a move is decided by computing: :func:`recode` rewrites the source's codes in the
destination's scheme and grouping (shifting signed/unsigned codes, turning an offset into a zero
point), the destination's adapter dequantizes the candidate with its framework's own function,
and :func:`check_exact` compares it with the source's own dequantization bit for bit.

Adapters offer the optional verb ``quant_layer(layer) -> QuantLayer | None`` (``None``: not a
quantized layer; a ``ConversionError`` naming the mode for a quantized layer dense_bridge cannot
read). Its methods, all in the canonical layout:

- ``quant`` (a :class:`Quant`), ``signed`` (are its codes signed), ``in_features``, ``units``,
  ``has_bias``, ``scale_dtype`` (numpy dtype its scales are stored in);
- ``spec()``: the float ``Dense`` it stands for;
- ``dequantized()`` -> {"kernel" (in, units), "bias"}: the framework's own dequantization;
- ``codes()`` -> the canonical quantized params above;
- ``encode(qparams)`` -> :class:`Candidate` holding codes already in this layer's scheme;
- ``quantize(kernel, bias)`` -> :class:`Candidate` from a float kernel, with the framework's own
  quantizer and this layer's bits and groups;
- optionally ``quantizes_inputs`` and ``effective_input(x)`` (Keras int8 rounds its inputs too:
  ``testing/_quantized.py`` predicts its forward with them).

``dequantized``/``quantize`` + ``Candidate.write`` are the per-framework dequantize/requantize
other features build on (merging an update into a quantized kernel: dequantize, add, quantize).
Adapters also offer ``quant_build(layer, quant)`` (a float layer quantized by the framework, for
``db.convert(..., quant=)``), and a walk entry of a quantized table (MLX ``QuantizedEmbedding``)
carries ``extra["quantized_table"]`` so that two tables of one format move as codes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .._errors import ConversionError, SpecError, check_type, received

__all__ = ["Quant", "SCHEMES", "Candidate", "recode", "check_exact", "expand", "code_range",
           "quant_layer", "QUANT_KEYS"]

#: Microscaling modes: codes are the bits of a tiny float, scaled per group of 32 (nvfp4: 16).
MICROSCALING = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
SCHEMES = ("affine", "zero_point", "divide") + tuple(MICROSCALING)
#: Keys of canonical quantized params besides "bias".
QUANT_KEYS = ("qkernel", "scale", "zero", "offset", "quant")


@dataclass(frozen=True)
class Quant:
    """How a quantized linear layer stores its weights: ``bits`` per code, ``group_size``
    weights along in_features sharing one scale (None: one group per output unit, i.e.
    per-channel), and ``scheme`` (the dequantization arithmetic, see the module doc)."""

    bits: int
    group_size: int | None
    scheme: str

    def __post_init__(self) -> None:
        check_type("bits", self.bits, int, "an integer from 1 to 8")
        if not 1 <= self.bits <= 8:
            raise SpecError(f"bits must be an integer from 1 to 8. {received('bits', self.bits)}")
        if self.group_size is not None:
            check_type("group_size", self.group_size, int, "a positive integer or None (per-channel)")
            if self.group_size < 1:
                raise SpecError(f"group_size must be a positive integer or None (per-channel). "
                                f"{received('group_size', self.group_size)}")
        if self.scheme not in SCHEMES:
            raise SpecError(f"scheme must be one of {list(SCHEMES)}. {received('scheme', self.scheme)}")
        if self.scheme in MICROSCALING and (self.bits, self.group_size) != MICROSCALING[self.scheme]:
            bits, group = MICROSCALING[self.scheme]
            raise SpecError(f"scheme {self.scheme!r} has {bits}-bit codes in groups of {group}. "
                            f"Received: bits={self.bits}, group_size={self.group_size}")

    def to_config(self) -> dict:
        """A JSON-able dict; ``Quant.from_config(q.to_config()) == q``."""
        return {"bits": self.bits, "group_size": self.group_size, "scheme": self.scheme}

    @classmethod
    def from_config(cls, config: Any) -> "Quant":
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError:
                raise SpecError(f"a Quant config must be a dict or its JSON. {received('config', config)}") from None
        if not isinstance(config, dict) or set(config) != {"bits", "group_size", "scheme"}:
            raise SpecError(f"a Quant config has exactly the keys bits, group_size, scheme. "
                            f"{received('config', config)}")
        return cls(config["bits"], config["group_size"], config["scheme"])

    def groups(self, in_features: int) -> int:
        """How many groups along in_features (a SpecError where they do not divide it)."""
        size = self.group_size or in_features
        if in_features % size:
            raise SpecError(f"group_size {size} does not divide in_features {in_features}")
        return in_features // size


def code_range(bits: int, signed: bool) -> tuple[int, int]:
    """The integers a ``bits``-bit code holds: [0, 2**bits) or [-2**(bits-1), 2**(bits-1))."""
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


@dataclass
class Candidate:
    """Codes ready for one destination layer, not written yet.

    ``kernel``: (in_features, units), what the destination framework's own dequantization makes
    of them (computed, not predicted). ``write()`` stores them (and the bias) in the layer and
    returns a function that puts the previous storage back.
    """

    kernel: np.ndarray
    write: Callable[[], Callable[[], None]]


def quant_layer(adapter: Any, layer: Any) -> Any:
    """The adapter's quantized-layer handle for ``layer``, or None (not quantized, or the
    adapter has no ``quant_layer`` verb)."""
    verb = getattr(adapter, "quant_layer", None)
    return None if verb is None else verb(layer)


def expand(values: np.ndarray, in_features: int) -> np.ndarray:
    """Per-group values (G, units) repeated to one per weight (in_features, units)."""
    values = np.asarray(values)
    return np.repeat(values, in_features // values.shape[0], axis=0)


def _regroup(full: np.ndarray, group: int, what: str) -> np.ndarray | str:
    """(in, units) values constant within each destination group -> (G, units), else a reason."""
    n, units = full.shape
    blocks = full.reshape(n // group, group, units)
    first = blocks[:, :1, :]
    same = (blocks == first) | (np.isnan(blocks) & np.isnan(first))
    if not same.all():
        g = int(np.argwhere(~same.all(axis=(1, 2)))[0, 0])
        return (f"the destination groups {group} weights along in_features per {what}, and the source's "
                f"{what} differs inside destination group {g}")
    return np.ascontiguousarray(first[:, 0, :])


def _dst_group(dst_quant: Quant, in_features: int) -> int:
    return dst_quant.group_size or in_features


def recode(qp: dict, dst_quant: Quant, dst_signed: bool, float_dtype: Any = np.float32) -> dict | str:
    """The source's canonical codes ``qp`` rewritten in the destination's scheme, bits and groups.

    Returns canonical quantized params for ``dst_quant`` (``float_dtype``: the destination's scale
    dtype), or a sentence saying why the destination cannot hold these codes at all (another
    floating-point code, codes out of range, a zero point that is not an integer, groups that
    straddle the source's). Whether it holds them *exactly* is :func:`check_exact`'s question.
    """
    src: Quant = qp["quant"]
    q = np.asarray(qp["qkernel"]).astype(np.int64)
    n = q.shape[0]
    if src.scheme in MICROSCALING or dst_quant.scheme in MICROSCALING:
        if src.scheme != dst_quant.scheme:
            return (f"{src.scheme!r} codes are {'floating-point bits' if src.scheme in MICROSCALING else 'integers'} "
                    f"and {dst_quant.scheme!r} codes are "
                    f"{'floating-point bits' if dst_quant.scheme in MICROSCALING else 'integers'}: no code maps onto "
                    f"the other format")
        return dict(qp, quant=dst_quant)
    src_signed = np.asarray(qp["qkernel"]).dtype.kind == "i"
    # shift the codes so both ranges share their centre: MLX 0..15 -> torchao -8..7
    centre_src = 0 if src_signed else 1 << (src.bits - 1)
    centre_dst = 0 if dst_signed else 1 << (dst_quant.bits - 1)
    shift = centre_dst - centre_src
    lo, hi = code_range(dst_quant.bits, dst_signed)
    q_dst = q + shift
    if q_dst.size and (q_dst.min() < lo or q_dst.max() > hi):
        return (f"the source's {src.bits}-bit codes, shifted by {shift}, span {int(q_dst.min())}..{int(q_dst.max())}, "
                f"outside the destination's {dst_quant.bits}-bit range {lo}..{hi}")
    scale = expand(np.asarray(qp["scale"], dtype=np.float64), n)
    # what the source subtracts before scaling, as one number per weight: w = (q - zero) * scale
    if src.scheme == "zero_point":
        zero = expand(np.asarray(qp["zero"], dtype=np.float64), n)
    elif src.scheme == "affine":
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = -expand(np.asarray(qp["offset"], dtype=np.float64), n) / scale
    else:  # divide: w = q / scale, no zero point
        zero = np.zeros_like(scale)
    zero_dst = zero + shift
    out: dict[str, Any] = {"quant": dst_quant, "qkernel": q_dst.astype(np.int8 if dst_signed else np.uint8)}
    group = _dst_group(dst_quant, n)
    if dst_quant.scheme == "affine":
        if src.scheme == "divide":
            scale = 1.0 / scale
        offset = _regroup(-zero_dst * scale, group, "offset")
        if isinstance(offset, str):
            return offset
        out["offset"] = offset.astype(float_dtype)
    elif dst_quant.scheme == "zero_point":
        if src.scheme == "divide":
            scale = 1.0 / scale
        z = _regroup(zero_dst, group, "zero point")
        if isinstance(z, str):
            return z
        if not (np.isfinite(z).all() and (z == np.round(z)).all()):
            bad = int(np.argwhere(~(np.isfinite(z) & (z == np.round(z))))[0, 0])
            return (f"the source's offset is not an integer multiple of its scale (group {bad}: zero point "
                    f"{float(np.ravel(z[bad])[0])!r}), and the destination's zero points are integers")
        zlo, zhi = (-128, 127) if dst_signed else (0, 255)
        if z.size and (z.min() < zlo or z.max() > zhi):
            return f"the source's zero points span {z.min():g}..{z.max():g}, outside the destination's int8 range"
        out["zero"] = z.astype(np.int8 if dst_signed else np.uint8)
    else:  # divide
        if src.scheme != "divide":
            scale = 1.0 / scale
        if np.any(zero_dst != 0):
            return "the destination divides codes by a scale with no zero point, and the source's zero point is not 0"
    s = _regroup(scale, group, "scale")
    if isinstance(s, str):
        return s
    out["scale"] = s.astype(float_dtype)
    if "bias" in qp:
        out["bias"] = qp["bias"]
    return out


def check_exact(want: np.ndarray, got: np.ndarray) -> str | None:
    """None when ``got`` equals ``want`` bit for bit (sign of zero included); else a sentence
    saying how many dequantized values differ and where the first one is."""
    a = np.asarray(want, dtype=np.float64)
    b = np.asarray(got, dtype=np.float64)
    if a.shape != b.shape:
        return f"the dequantized kernels differ in shape: {a.shape} vs {b.shape}"
    same = ((a == b) & (np.signbit(a) == np.signbit(b))) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return None
    bad = np.argwhere(~same)
    i, j = (int(v) for v in bad[0])
    return (f"the destination's dequantization of the same codes differs from the source's in {len(bad)} of "
            f"{a.size} values ({100 * len(bad) / a.size:.1f}%), first at kernel[{i}, {j}]: {float(a[i, j])!r} vs "
            f"{float(b[i, j])!r}")


def max_error(want: np.ndarray, got: np.ndarray) -> float:
    """Largest |got - want| (float64), the error a requantization reports."""
    a = np.asarray(want, dtype=np.float64)
    b = np.asarray(got, dtype=np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def describe(quant: Quant) -> str:
    group = "per-channel" if quant.group_size is None else f"group {quant.group_size}"
    return f"{quant.bits}-bit {quant.scheme}, {group}"


def check_quantized_params(params: dict, handle: Any, argument: str = "params") -> dict:
    """Validate canonical quantized params (names, shapes, integer codes) for ``handle``'s layer."""
    quant = params.get("quant")
    if not isinstance(quant, Quant):
        raise TypeError(f"{argument}['quant'] must be a dense_bridge Quant. {received(argument + '[quant]', quant)}")
    allowed = {"qkernel", "scale", "quant", "bias", "zero" if quant.scheme == "zero_point" else
               "offset" if quant.scheme == "affine" else "scale"}
    unexpected = sorted(set(params) - allowed)
    missing = sorted(allowed - set(params) - {"bias"})
    problems = []
    if unexpected:
        problems.append(f"unexpected keys {unexpected} for scheme {quant.scheme!r}")
    if missing:
        problems.append(f"missing keys {missing}")
    n, units = handle.in_features, handle.units
    try:
        groups = quant.groups(n)
    except SpecError as exc:
        problems.append(str(exc))
        groups = None
    want = {"qkernel": (n, units), "bias": (units,)}
    if groups is not None:
        want.update(scale=(groups, units), zero=(groups, units), offset=(groups, units))
    for k, v in params.items():
        if k == "quant" or k not in want:
            continue
        shape = tuple(np.shape(v))
        if shape != want[k]:
            problems.append(f"{k} has shape {shape}, expected {want[k]}")
    q = params.get("qkernel")
    if q is not None and np.asarray(q).dtype.kind not in "iu":
        problems.append(f"qkernel must hold integers, got dtype {np.asarray(q).dtype}")
    if problems:
        raise ConversionError(f"cannot set quantized params: " + "; ".join(problems))
    return params


def move(handle: Any, params: dict, qparams: dict | None, *, requantize: bool, where: str) -> tuple[Candidate, str]:
    """How canonical weights reach the quantized layer behind ``handle``: a :class:`Candidate`
    and a phrase for the report.

    ``params``: the source's float {"kernel", "bias"} (for a quantized source, its own exact
    dequantization); ``qparams``: the source's canonical codes, None for a float source.
    Codes move when the destination dequantizes them to the source's floats bit for bit;
    otherwise ``requantize=True`` quantizes ``params`` with the destination's quantizer, and
    ``requantize=False`` raises a ConversionError naming ``where`` and the reason. A float
    source is always quantized by the destination (it has no codes to keep).
    """
    kernel = np.asarray(params["kernel"])
    if kernel.shape != (handle.in_features, handle.units):
        raise ConversionError(f"{where}: the source kernel {kernel.shape} does not fit the destination "
                              f"(in_features, units) = {(handle.in_features, handle.units)}")
    if ("bias" in params) != handle.has_bias:
        raise ConversionError(f"{where}: a bias on one side only (source {'has' if 'bias' in params else 'has no'} "
                              f"bias, destination {'has' if handle.has_bias else 'has no'} bias)")
    if not np.isfinite(np.asarray(kernel, dtype=np.float32)).all():
        raise ConversionError(f"{where}: the source kernel holds NaN or Inf")
    bias = params.get("bias")
    if qparams is None:
        cand = handle.quantize(kernel, bias)
        error = max_error(kernel, cand.kernel)
        return cand, f"quantized by the destination ({describe(handle.quant)}), max error {error:.3g}"
    reason = recode(qparams, handle.quant, handle.signed, handle.scale_dtype)
    if not isinstance(reason, str):
        cand = handle.encode(reason)
        reason = check_exact(kernel, cand.kernel)
        if reason is None:
            return cand, f"codes moved exactly ({describe(qparams['quant'])} -> {describe(handle.quant)})"
    if requantize:
        cand = handle.quantize(kernel, bias)
        return cand, (f"requantized by the destination ({describe(handle.quant)}), max error "
                      f"{max_error(kernel, cand.kernel):.3g}")
    raise ConversionError(f"{where}: the codes ({describe(qparams['quant'])}) cannot move exactly into "
                          f"{describe(handle.quant)}: {reason}. Pass requantize=True to quantize with the "
                          f"destination's own quantizer (the largest error is reported per layer)")


# ----------------------------------------------------------------------------- the public verbs' side
def handle_of(layer: Any, argument: str = "native") -> Any:
    """The quantized-layer handle of ``layer`` (None when it is not a quantized linear layer)."""
    from ..registry._backends import adapter_for

    return quant_layer(adapter_for(layer, argument), layer)


def unreadable(entries: list) -> list:
    """Walk entries of kind "quantized" that no adapter reads, with ``note`` saying why."""
    bad = []
    for e in entries:
        if e.kind != "quantized":
            continue
        try:
            readable = handle_of(e.layer) is not None
        except ConversionError as exc:
            e.note, readable = str(exc), False
        if not readable:
            bad.append(e)
    return bad


def into_quantized(s: Any, d: Any, writes: list, report: Any, requantize: bool) -> tuple[str | None, str]:
    """``transfer``'s step for one pair whose destination ``d`` is a quantized layer: queue a
    :class:`Candidate` in ``writes`` and return (None, what moved), or (a problem, "")."""
    from ..registry._backends import adapter_for

    where = f"{s.path or '<root>'!r} -> {d.path or '<root>'!r}"
    try:
        handle = handle_of(d.layer, "dst")
        src = handle_of(s.layer, "src")
        params = src.dequantized() if src is not None else adapter_for(s.layer, "src").get_params(s.layer)
        params = {k: v for k, v in params.items() if k in ("kernel", "bias")}
        cand, what = move(handle, params, src.codes() if src is not None else None, requantize=requantize,
                          where=where)
    except (ConversionError, SpecError) as exc:
        return str(exc), ""
    if "max error" in what:
        report.quant_errors[d.path] = max_error(params["kernel"], cand.kernel)
    writes.append((d, "quantized", cand))
    return None, what


def get_quantized(native: Any) -> dict:
    """``db.get_params(native, quantized=True)``: canonical codes (fresh copies) and the Quant."""
    handle = handle_of(native)
    if handle is None:
        t = type(native)
        raise ConversionError(f"get_params(quantized=True): {t.__module__}.{t.__qualname__} is not a quantized linear "
                              f"layer its backend reads (no quant_layer handle for it: see the README's "
                              f"quantized layers). "
                              f"{received('native', native)}"[:600])
    return {k: v if isinstance(v, Quant) else np.array(v, copy=True) for k, v in handle.codes().items()}


def set_quantized(native: Any, params: dict) -> str:
    """``db.set_params(native, params)`` with canonical codes: they move exactly or not at all.
    Returns what happened ("codes moved exactly ...")."""
    handle = handle_of(native)
    if handle is None:
        raise ConversionError(f"set_params: params carry codes ('quant'), but native is not a quantized linear layer. "
                              f"{received('native', native)}"[:600])
    check_quantized_params(params, handle)
    want = {"kernel": reference_dequantize(params)}
    if "bias" in params:
        want["bias"] = params["bias"]
    cand, what = move(handle, want, params, requantize=False, where="set_params")
    cand.write()
    return what


_FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def reference_dequantize(qp: dict) -> np.ndarray:
    """The float kernel (in, units) that canonical codes stand for, in numpy, rounding as each
    scheme's framework does (arithmetic in the scale's dtype): the reference the adapters'
    own dequantizations are tested against, and the source floats of ``set_params`` with codes."""
    quant: Quant = qp["quant"]
    q = np.asarray(qp["qkernel"])
    scale = np.asarray(qp["scale"])
    n = q.shape[0]
    dt = scale.dtype if scale.dtype.kind == "f" or str(scale.dtype) == "bfloat16" else np.dtype(np.float32)
    s = expand(scale, n).astype(dt)
    if quant.scheme == "affine":
        return (s * q.astype(dt)).astype(dt) + expand(np.asarray(qp["offset"]), n).astype(dt)
    if quant.scheme == "zero_point":
        return ((q.astype(dt) - expand(np.asarray(qp["zero"]), n).astype(dt)) * s).astype(dt)
    if quant.scheme == "divide":
        return (q.astype(dt) / s).astype(dt)
    if quant.scheme == "mxfp8":
        import ml_dtypes

        values = q.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        values = _FP4[q.astype(np.int64) & 15]
    return values * s.astype(np.float32)


def check_quant(quant: Any) -> None:
    if not isinstance(quant, Quant):
        raise TypeError(f"quant must be a dense_bridge Quant or None. {received('quant', quant)}")


def quantize_converted(native: Any, target: Any, quant: Quant, requantize: bool) -> Any:
    """``db.convert(native, to, quant=...)``'s second half: ``target`` (native converted to a float
    layer, its exact dequantization) quantized by its framework as ``quant``, then ``native``'s
    codes moved in exactly, or its floats requantized (``requantize=True``), or a ConversionError."""
    from ..registry._backends import adapter_for
    from ..specs import Dense

    adapter = adapter_for(target, "to")
    spec = adapter.to_spec(target)
    if not isinstance(spec, Dense) or spec.mask is not None or not spec.activation.is_identity:
        raise ConversionError(f"convert(quant=...) converts one linear layer without activation or mask; native "
                              f"reads as {spec!r}"[:400])
    build = getattr(adapter, "quant_build", None)
    if build is None:
        raise ConversionError(f"the {adapter.__name__.rsplit('.', 1)[-1]!r} backend has no quantized layers "
                              f"(no quant_build verb)")
    src = handle_of(native)
    params = {k: v for k, v in adapter.get_params(target).items() if k in ("kernel", "bias")}
    target = build(target, quant)
    cand, _ = move(quant_layer(adapter, target), params, None if src is None else src.codes(),
                   requantize=requantize, where="convert")
    cand.write()
    return target


def same_quantized_tables(s: Any, d: Any) -> Candidate | None:
    """A :class:`Candidate` moving the native codes of walk entry ``s`` into ``d`` when both are
    quantized tables (embeddings) of one format (the adapters' ``extra["quantized_table"]``:
    ``format``, ``read()`` -> native arrays, ``write(arrays)``); None otherwise."""
    a, b = s.extra.get("quantized_table"), d.extra.get("quantized_table")
    if a is None or b is None or a["format"] != b["format"]:
        return None
    arrays = a["read"]()

    def write():
        before = b["read"]()
        b["write"](arrays)
        return lambda: b["write"](before)

    return Candidate(np.zeros((0, 0)), write)
