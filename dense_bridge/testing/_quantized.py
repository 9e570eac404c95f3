"""compare_models on quantized linear layers: what a float layer and its quantized port may differ by.

A quantized layer does not compute its float twin's function: it computes x @ Wq with Wq its
dequantized kernel, so its output differs from the float layer's by x @ (Wq - Wf), the error its
own quantization predicts. For a pair where either side is quantized (dense_bridge/quant.py):

- each side's ``output`` row is judged against its OWN kernel (y - x @ W - b: its rounding), and
  the note gives the predicted output error max |x @ (Wq - Wf)|, so the report says how much of
  the difference is quantization;
- a ``quantization`` row checks the codes themselves, group by group, in units of the group's
  own quantization step (its scale; for "divide", 1 / scale): every weight within 1.5 steps of
  the float one (MLX's affine rounding reaches 1 step: measured 0.9998 on random weights), and
  each group's MEAN error within half a step (rounding errors average out: about 0.05 step for
  a group of 32). A zero point off by one moves a whole group's mean by one step; one group's
  scale moved into another group scales its weights wrongly: either names the layer, where a
  bound on the summed output error would hide a single bad group among many good ones;
- Keras int8 quantizes its inputs too (``inputs_quantizer``): that side's prediction uses the
  input the layer actually multiplies (the adapter's ``effective_input``), not the captured one;
- backward, dL/dx leaves the pair through two kernels: the relative difference that makes
  (g @ Wa^T vs g @ Wb^T) is added to what the layers before it may carry, as the forward adds
  the outputs' difference;
- a quantized kernel has no parameter gradient (its codes are frozen integers), so the
  parameter-gradient rows are left out for such pairs, with a note.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..quant import expand, handle_of
from ._report import QuantityResult
from ._tolerance import rms

__all__ = ["QuantPair", "quantized_pairs", "quantization_row", "backward_spread"]


@dataclass
class QuantPair:
    """A matched pair with a quantized side: each side's own kernel and bias (float64), the
    per-weight step of the quantized side(s) and input transforms (Keras int8), for ``_judge``."""

    kernel_a: np.ndarray
    bias_a: np.ndarray | None
    step: np.ndarray  # (in, units): one quantization step per weight (the coarser side's where both)
    group: int  # weights per group along in_features (the coarser side's where both)
    input_a: Callable[[np.ndarray], np.ndarray] | None
    input_b: Callable[[np.ndarray], np.ndarray] | None
    what: str  # "a: 4-bit affine, group 32" ...


def _step(handle: Any) -> np.ndarray:
    """One quantization step per weight, (in_features, units), from the layer's own codes."""
    codes = handle.codes()
    scale = np.abs(expand(np.asarray(codes["scale"], dtype=np.float64), handle.in_features))
    if codes["quant"].scheme == "divide":
        return 1.0 / scale
    if codes["quant"].scheme in ("mxfp4", "nvfp4"):
        return 2.0 * scale  # e2m1's widest gap (between 4 and 6) is 2 units of the scale
    if codes["quant"].scheme == "mxfp8":
        return 32.0 * scale  # e4m3's widest gap (near 448) is 32 units of the scale
    return scale


def _input_fn(handle: Any) -> Callable[[np.ndarray], np.ndarray] | None:
    return handle.effective_input if getattr(handle, "quantizes_inputs", False) else None


def quantized_pairs(pairs, layers_a: dict, layers_b: dict, params_a: dict, adapters: tuple | None = None
                    ) -> dict[str, QuantPair]:
    """path in b -> QuantPair for every matched pair where either side is a quantized layer.
    ``adapters``: (a's adapter, b's), resolved once by the caller (else each layer's owner is looked up)."""
    from ..quant import describe, quant_layer

    def handle(layer, side: int, argument: str):
        return handle_of(layer, argument) if adapters is None else quant_layer(adapters[side], layer)

    out = {}
    for pa, pb in pairs:
        if layers_a.get(pa) is None or layers_b.get(pb) is None:  # a split/concatenated group ("p+q"): float layers only
            continue
        ha, hb = handle(layers_a[pa], 0, "a"), handle(layers_b[pb], 1, "b")
        if ha is None and hb is None:
            continue
        handles = [h for h in (ha, hb) if h is not None]
        steps = [_step(h) for h in handles]
        step = steps[0] if len(steps) == 1 else np.maximum(steps[0], steps[1])
        group = max(h.quant.group_size or h.in_features for h in handles)
        kernel = np.asarray(params_a[pa]["kernel"], dtype=np.float64)
        bias = np.asarray(params_a[pa]["bias"], dtype=np.float64) if "bias" in params_a[pa] else None
        what = "; ".join(f"{side}: {describe(h.quant)}" for side, h in (("a", ha), ("b", hb)) if h is not None)
        out[pb] = QuantPair(kernel, bias, step, group, None if ha is None else _input_fn(ha),
                            None if hb is None else _input_fn(hb), what)
    return out


def quantization_row(i: int, label: str, pair: QuantPair, kernel_b: np.ndarray, x_b: np.ndarray) -> QuantityResult:
    """The ``quantization`` row: |W_a - W_b| per weight in units of one quantization step, with
    the output error this quantization predicts on b's input (max |x_b @ (W_a - W_b)|)."""
    kernel_b = np.asarray(kernel_b, dtype=np.float64)
    signed = pair.kernel_a - kernel_b
    diff = np.abs(signed)
    rounding = 4 * np.finfo(np.float32).eps * np.abs(pair.kernel_a)  # the dequantized value's own rounding
    n, units = diff.shape
    g = pair.group if n % pair.group == 0 else n
    mean_err = np.abs(signed.reshape(n // g, g, units).mean(axis=1))
    mean_step = pair.step.reshape(n // g, g, units).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        each = np.where(diff == 0, 0.0, diff / (1.5 * pair.step + rounding))
        means = np.where(mean_err == 0, 0.0, mean_err / (0.5 * mean_step + rounding.reshape(n // g, g, units).max(1)))
    worst = float(max(each.max(), means.max())) if diff.size else 0.0
    predicted = float(np.abs(x_b @ signed).max()) if x_b.size else 0.0
    note = f"{pair.what}; predicted output error max |x @ (Wa - Wb)| = {predicted:.3g}"
    if means.size and means.max() > 1.0:
        grp, col = (int(v) for v in np.argwhere(means > 1.0)[0])
        note += (f"; group {grp} of unit {col} (kernel rows {grp * g}..{grp * g + g - 1}) is off by "
                 f"{mean_err[grp, col] / mean_step[grp, col]:.2f} steps on average")
    elif each.size and each.max() > 1.0:
        row, col = (int(v) for v in np.argwhere(each > 1.0)[0])
        note += (f"; kernel[{row}, {col}] is {diff[row, col] / pair.step[row, col]:.2f} steps from the float weight "
                 f"({pair.kernel_a[row, col]:.6g} vs {kernel_b[row, col]:.6g})")
    return QuantityResult(i, label, "quantization", float(diff.max()) if diff.size else 0.0, worst, worst <= 1.0,
                          n, tuple(diff.shape), note)


def backward_spread(pair: QuantPair, g_b: np.ndarray, kernel_b: np.ndarray) -> float:
    """The largest relative difference (|a - b| / (|b| + rms b)) between g @ Wa^T and g @ Wb^T:
    what the quantization adds to the input gradient leaving the layer."""
    kb = np.asarray(kernel_b, dtype=np.float64)
    da, db_ = np.asarray(g_b, dtype=np.float64) @ pair.kernel_a.T, np.asarray(g_b, dtype=np.float64) @ kb.T
    if not da.size:
        return 0.0
    return float(np.max(np.abs(da - db_) / (np.abs(db_) + rms(db_) + 1e-300)))


def without_kernel_difference(pair: QuantPair, dx_a: np.ndarray, dz: np.ndarray, kernel_b: np.ndarray) -> np.ndarray:
    """a's dL/dx (rows, in) as it would be through b's kernel: dx_a - dz @ (Wa - Wb)^T in float64,
    the share of the difference that is the quantization's own (isolated mode's ``dL/dx`` row),
    so that what is left is each side's rounding and any real error of its backward."""
    diff = pair.kernel_a - np.asarray(kernel_b, dtype=np.float64)
    return np.asarray(dx_a, dtype=np.float64) - np.asarray(dz, dtype=np.float64) @ diff.T


def table_spread(walk_a: list, walk_b: list) -> tuple[float, list[str]]:
    """What quantized tables (embeddings) put into a comparison before its first linear layer.

    A quantized embedding is not a linear layer: its rows reach the first layer through code
    dense_bridge does not describe (norms, attention). For every walk entry of either model
    carrying ``extra["quantized_table"]`` (MLX ``QuantizedEmbedding``), its table is paired with
    the other model's table at the same path, else with its one table of the same shape, and the
    largest relative difference (|a - b| / (|b| + rms b)) is returned with a note per pair: the
    comparison then lets the code after it carry that much, as it does after a linear layer.
    ``walk_a``/``walk_b``: the two models' walks (``models.walk``), as the caller holds them.
    """
    sides = (walk_a, walk_b)
    spread, notes = 0.0, []
    for k, entries in enumerate(sides):
        other = {e.path: e for e in sides[1 - k]}
        for e in entries:
            if "quantized_table" not in e.extra:
                continue
            table = np.asarray(e.read()["weight"], dtype=np.float64)
            twin = other.get(e.path)
            if twin is None or not any(tuple(s) == table.shape for s in twin.shapes.values()):
                same = [t for t in other.values() if any(tuple(s) == table.shape for s in t.shapes.values())]
                twin = same[0] if len(same) == 1 else None
            if twin is None or "quantized_table" in twin.extra and k == 1:
                continue  # no partner, or the pair was measured from a's side already
            name = next(n for n, s in twin.shapes.items() if tuple(s) == table.shape)
            ref = np.asarray(twin.read()[name], dtype=np.float64)
            a_t, b_t = (table, ref) if k == 0 else (ref, table)
            rel = float(np.max(np.abs(a_t - b_t) / (np.abs(b_t) + rms(b_t) + 1e-300)))
            spread = max(spread, rel)
            notes.append(f"{e.path}: a quantized table (vs {twin.path or '<root>'}), largest relative difference "
                         f"{rel:.3g}, carried into the code after it")
    return spread, notes
