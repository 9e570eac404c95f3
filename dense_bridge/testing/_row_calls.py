"""Calls over a share of the rows joined into one call over all of them, before judging.

One library may run a layer once over a whole sequence, (batch, positions, in), where the other
runs it once per position, (batch, in) each time (a selective scan written as a loop over
positions: every step projects that position's row alone). Both computed the same rows; only
the number of calls differs. So, for a compared pair whose one side made ONE call and the other
N > 1 calls whose rows add up to that call's rows (inputs and outputs alike), the N calls are
joined into one call, as the single call holds them:

- each of the N calls is read as (lead, *, features) with ``lead`` its first axis; when every
  call's ``lead`` is the single call's first axis (the batch), the calls are joined along the
  axis after it, in call order (positions); otherwise their rows are concatenated in call order;
- the result is reshaped to the single call's native shape, so everything after (the judge's
  positions per example, teacher forcing's reshaping) reads it as that call;
- dL/d(output) is joined the same way (kept only when every call has one); parameter gradients
  are already summed over calls by the framework.

The joined call takes the place of the first of the N calls.

A layer one model never calls as a module (its forward reads the weights directly, as
transformers' Mamba reads ``dt_proj.weight``) has no call to compare with the other model's
calls of its counterpart: those calls are left out of the comparison, noted; what the layer
computes is still judged where it arrives (the next compared layer's input, the model output).

Anything else (both sides calling
a layer several times, rows that do not add up, several inputs) is left as it is: the judge
reports the call counts as it always does.
"""
from __future__ import annotations

import numpy as np

from ..registry._captures import Call, Capture

__all__ = ["join_row_calls"]


def _rows(x, width: int) -> int | None:
    """Rows of a value whose trailing axes hold ``width`` features, or None if none do."""
    shape = tuple(int(d) for d in np.shape(x))
    size = 1
    for k in range(len(shape) - 1, -1, -1):
        size *= shape[k]
        if size == width:
            return int(np.prod(shape[:k])) if k else 1
        if size > width:
            break
    return None


def _join(parts: list, like, width: int, host) -> np.ndarray:
    """``parts`` (each (..., width)) joined into an array of ``like``'s native shape (see the module
    docstring: along positions when each part leads with ``like``'s batch, else row after row)."""
    arrays = [host(p) for p in parts]
    shape = tuple(int(d) for d in np.shape(like))
    lead = shape[0] if len(shape) > 1 else None
    if lead is not None and all(a.ndim > 1 and a.shape[0] == lead for a in arrays):
        joined = np.concatenate([a.reshape(lead, -1, width) for a in arrays], axis=1)
    else:
        joined = np.concatenate([a.reshape(-1, width) for a in arrays], axis=0)
    return joined.reshape(shape)


def _joinable(one: Call, many: list[Call], n_in: int, n_out: int) -> bool:
    if len(one.inputs) != 1 or any(len(c.inputs) != 1 for c in many):
        return False
    for get, width in ((lambda c: c.inputs[0], n_in), (lambda c: c.output, n_out)):
        total, rows = _rows(get(one), width), [_rows(get(c), width) for c in many]
        if total is None or any(r is None for r in rows) or sum(rows) != total:
            return False
    return True


def _joined(one: Call, many: list[Call], n_in: int, n_out: int, host) -> Call:
    x = _join([c.inputs[0] for c in many], one.inputs[0], n_in, host)
    y = _join([c.output for c in many], one.output, n_out, host)
    grads = [c.output_grad for c in many]
    like = one.output_grad if one.output_grad is not None else one.output
    g = None if any(v is None for v in grads) else _join(grads, like, n_out, host)
    return Call(many[0].path, 0, (x,), y, g)


def _replace(cap: Capture, path: str, call: Call | None, note: str) -> Capture:
    """``cap`` with every call of ``path`` replaced by ``call`` where the first one was (None:
    removed), and ``note``."""
    calls, placed = [], False
    for c in cap.calls:
        if c.path != path:
            calls.append(c)
        elif not placed and call is not None:
            calls.append(call)
            placed = True
    return Capture(calls, cap.param_grads, cap.output, list(cap.notes) + [note], set(cap.pre_activation))


def join_row_calls(cap_a: Capture, cap_b: Capture, pairs: list[tuple[str, str]], params_a: dict, params_b: dict,
                   to_numpy=(None, None)) -> tuple[Capture, Capture]:
    """The captures with each pair's N calls on one side joined into one where the other side made
    one call over the same rows (module docstring); the joined side's capture notes it.

    Args:
        cap_a, cap_b: the two models' captures (groups already merged).
        pairs: (path in a, path in b) of every compared pair.
        params_a, params_b: canonical parameters per pair path; "kernel" (in, units) gives the widths.
        to_numpy: each side's adapter verb for a capture holding its framework's arrays, or None
            (numpy already); the joined calls are numpy.

    Returns:
        (cap_a, cap_b).
    """
    for pa, pb in pairs:
        ka, kb = params_a.get(pa, {}).get("kernel"), params_b.get(pb, {}).get("kernel")
        if ka is None or kb is None or np.ndim(kb) != 2:
            continue
        n_in, n_out = (int(d) for d in np.shape(kb))
        calls_a = [c for c in cap_a.calls if c.path == pa]
        calls_b = [c for c in cap_b.calls if c.path == pb]
        for one, many, side in ((calls_a, calls_b, "b"), (calls_b, calls_a, "a")):
            if not one and many:  # the other model reads this layer's weights without calling it
                path, other = (pa, pb) if side == "a" else (pb, pa)
                note = (f"{path}: called {len(many)} time(s) here, while its counterpart {other} is never called as a "
                        f"module (its model reads the weights directly): these calls are not compared; what the "
                        f"layer computes is judged where it arrives (the next compared layer's input, the model "
                        f"output)")
                kept = _replace(cap_a if side == "a" else cap_b, path, None, note)
                cap_a, cap_b = (kept, cap_b) if side == "a" else (cap_a, kept)
                break
            if len(one) != 1 or len(many) < 2 or not _joinable(one[0], many, n_in, n_out):
                continue
            conv = to_numpy[0 if side == "a" else 1]
            host = (lambda v, f=conv: np.asarray(v if f is None else f(v)))
            path, other = (pa, pb) if side == "a" else (pb, pa)
            note = (f"{path}: called {len(many)} times, each over a share of the rows {other} takes in one call; the "
                    f"calls are joined into one over the same rows and compared with that call")
            joined = _replace(cap_a if side == "a" else cap_b, path, _joined(one[0], many, n_in, n_out, host), note)
            cap_a, cap_b = (joined, cap_b) if side == "a" else (cap_a, joined)
            break
    return cap_a, cap_b
