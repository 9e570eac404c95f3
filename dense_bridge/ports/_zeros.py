"""Tensors of exact zeros a port writes or drops: a linear layer's bias held by one library only.

A destination layer with a bias its source layer lacks computes ``x @ W + 0``: the twins'
transfer writes the bias as exact zeros (``models._one_sided``), the destination twin's saved
tensor is all zeros and no source tensor, and its recipe is ``zeros`` (``_rules._zeros_made``): the
certificate entry has no sources, ``"zeros": true`` and ``ops`` ``["zeros"]``, and
``verify_port`` checks every value is zero.

The other way, a source vector (a bias, a router's per-expert score correction) whose name the
destination does not hold is dropped only where every value of it is exactly zero in the real
checkpoint (:func:`real_zero_templates`): the source twin's tensors of those names are zeroed
(:func:`zero_twin`) so that the twins compute what the real models compute, the twins' transfer
drops them (a zero bias into a layer without one) or leaves them unpaired, the twins' verification
shows the destination computes the same without them, and the port names them in the certificate
(``"dropped_zeros"``). A real tensor that holds any other value is not zeroed in the twin: the
transfer refuses it, and the refusal says that the destination's model has no place for it and
the largest value the real source holds there (:func:`explain`).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["unplaced", "real_zero_templates", "explain", "zero_twin", "fill_dtype", "entry", "ZEROS_OP"]

#: the certificate's ``ops`` of a tensor written as zeros
ZEROS_OP = "zeros"


def _role(name: str) -> str:
    """The last two components of a name's template (``q_proj.bias``, ``moe_statics.e_score_correction_bias``):
    how a file key and the model's parameter path name one tensor where a library saves it under
    another prefix than its module's (transformers' conversion mapping)."""
    from . import _rules

    return ".".join(_rules.template(name)[0].split(".")[-2:])


def _vector(shape: tuple[int, ...]) -> bool:
    """A vector, however stored: (n,), (1, n), (n, 1) (a router's per-expert correction kept (1, n))."""
    return 1 <= len(shape) <= 2 and sum(1 for d in shape if d > 1) <= 1


def unplaced(real_src: dict[str, tuple[int, ...]], dst_names) -> dict[str, list[str]]:
    """The real source's vectors whose name the destination does not hold, by template
    (``_rules.template``: every index a placeholder): biases and raw vectors that may have no
    counterpart in the destination's model (the twins' pairing decides)."""
    from . import _rules

    held = {_rules.template(k)[0] for k in dst_names}
    out: dict[str, list[str]] = {}
    for k, shape in real_src.items():
        t = _rules.template(k)[0]
        if _vector(tuple(shape)) and t not in held:
            out.setdefault(t, []).append(k)
    return out


def real_zero_templates(real_src: dict[str, tuple[int, ...]], read, dst_names) -> tuple[set[str], dict[str, float]]:
    """Templates of the real source's vectors (:func:`unplaced`) that are all exactly zero, and
    the largest magnitude of each of the others.

    Args:
        real_src: the real source's tensor names -> shapes.
        read: ``name -> numpy array`` of a real source tensor.
        dst_names: the destination's parameter names (a vector of a name the destination also
            holds has a counterpart: it moves as it is, zero or not).
    Returns:
        (templates every real tensor of which is exact zeros, {real tensor name: largest |value|}
        of the vectors of the other templates).
    """
    zeros, largest = set(), {}
    for t, keys in unplaced(real_src, dst_names).items():
        found = {k: float(np.max(np.abs(np.asarray(read(k), np.float64)))) if np.size(read(k)) else 0.0
                 for k in keys}
        if not any(found.values()):
            zeros.add(t)
        else:
            largest.update(found)
    return zeros, largest


def explain(message: str, largest: dict[str, float], destination: str = "the destination") -> str:
    """The sentence that says why the twins' pairing left a source vector over, where the real
    source holds it with values that are not zero: "" when the message names none of them.

    Args:
        message: the twins' refusal (it names the source twin's parameters left unpaired).
        largest: {real source tensor: largest |value|} (:func:`real_zero_templates`).
        destination: the destination format's name, as the sentence says it.
    """
    from . import _rules

    by_template: dict[str, tuple[str, float]] = {}
    for k, v in largest.items():
        t = _rules.template(k)[0]
        if v > by_template.get(t, ("", -1.0))[1]:
            by_template[t] = (k, v)
    named = []
    by_role = {_role(t): hit for t, hit in by_template.items()}
    for path in re.findall(r"'([^']+)'", message):
        hit = by_template.get(_rules.template(path)[0]) or by_role.get(_role(path))
        if hit is not None and hit not in named:
            named.append(hit)
    if not named:
        return ""
    listed = ", ".join(f"{k!r} (largest |value| {v:.6g})" for k, v in named[:4])
    return (f"{destination}'s model has no parameter for the source's {listed}: that library does not apply it, "
            f"and the real source holds it with values that are not zero, so a port without it would compute "
            f"differently (a tensor of exact zeros would be dropped, as it changes nothing). Port to a library "
            f"whose model applies it")


def zero_twin(model: Any, templates: set[str]) -> list[str]:
    """Zero, in place, the source twin's parameters whose template is in ``templates``.

    Args:
        model: the source twin (any framework the walk reads).
        templates: parameter templates (``_rules.template``) to zero.
    Returns:
        The parameter paths zeroed.
    """
    if not templates:
        return []
    from ..models._walk import walk
    from . import _rules

    done = []
    roles = {_role(t) for t in templates}
    for e in walk(model):
        names = [n for n in e.names if _rules.template(e.param_path(n))[0] in templates
                 or _role(e.param_path(n)) in roles]
        if not names:
            continue
        arrays = {n: np.asarray(v) for n, v in e.read().items()}
        for n in names:
            arrays[n] = np.zeros_like(arrays[n])
            done.append(e.param_path(n))
        e.write(arrays)
    return done


def fill_dtype(src_dtype: dict[str, Any]) -> np.dtype:
    """The dtype a tensor of zeros is written in: the real source's most common floating dtype
    (the dtype its other tensors keep).

    Args:
        src_dtype: the real source's tensor names -> numpy dtypes.
    Returns:
        A numpy dtype (float32 when the source holds no floating tensor).
    """
    counts: dict[Any, int] = {}
    for dt in src_dtype.values():
        dt = np.dtype(dt)
        if dt.kind == "f" or "float" in dt.name:
            counts[dt] = counts.get(dt, 0) + 1
    return max(counts, key=counts.get) if counts else np.dtype(np.float32)


def entry(shape: tuple[int, ...], dtype_name: str, file: str) -> dict:
    """The certificate entry of a tensor of zeros of ``shape`` (no sources; exact)."""
    return {"sources": [], "zeros": True, "shape": list(shape), "axis": None, "ops": [ZEROS_OP],
            "dtypes": [dtype_name, dtype_name], "exact": True, "max_ulp": 0, "codes": None, "file": file}
