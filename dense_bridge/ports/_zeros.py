"""Tensors of exact zeros a port writes or drops: a linear layer's bias held by one library only.

A destination layer with a bias its source layer lacks computes ``x @ W + 0``: the twins'
transfer writes the bias as exact zeros (``models._one_sided``), the destination twin's saved
tensor is all zeros and no source tensor, and its recipe is ``zeros`` (:func:`written`): the
certificate entry has no sources, ``"zeros": true`` and ``ops`` ``["zeros"]``, and
``verify_port`` checks every value is zero.

The other way, a source tensor with no destination counterpart is dropped only where every
value of it is exactly zero in the real checkpoint (:func:`real_zero_templates`): the source
twin's tensors of those names are zeroed (:func:`zero_twin`) so that the twins compute what the
real models compute, the twins' transfer drops them (a zero bias into a layer without one), and
the port names them in the certificate (``"dropped_zeros"``). A real tensor that holds any other
value is not zeroed in the twin: the transfer refuses it, naming the layer and its largest value.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["written", "real_zero_templates", "zero_twin", "fill_dtype", "entry", "ZEROS_OP"]

#: the certificate's ``ops`` of a tensor written as zeros
ZEROS_OP = "zeros"


def written(d: np.ndarray, src: dict[str, np.ndarray]) -> bool:
    """Is the destination twin's tensor ``d`` a tensor of zeros that no source tensor is?

    Args:
        d: the destination twin's saved tensor (float32).
        src: the source twin's saved tensors (file key -> float32 array).
    Returns:
        True when every value of ``d`` is zero and no source tensor of its shape is all zeros
        (an all-zero source of its shape is a copy, which the value search finds).
    """
    if not d.size or np.any(d):
        return False
    return not any(np.shape(s) == d.shape and not np.any(s) for s in src.values())


def _tail(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def real_zero_templates(real_src: dict[str, tuple[int, ...]], read, dst_names) -> set[str]:
    """Templates of the real source's biases that are all exactly zero and whose name the
    destination does not hold (``_rules.template``: every index a placeholder).

    Args:
        real_src: the real source's tensor names -> shapes.
        read: ``name -> numpy array`` of a real source tensor.
        dst_names: the destination twin's parameter names (a bias of a name the destination also
            holds has a counterpart: it moves as it is, zero or not).
    Returns:
        The templates every real tensor of which is a 1-D bias of exact zeros.
    """
    from . import _rules

    held = {_rules.template(k)[0] for k in dst_names}
    by_template: dict[str, list[str]] = {}
    for k, shape in real_src.items():
        t = _rules.template(k)[0]
        if len(tuple(shape)) == 1 and _tail(k) == "bias" and t not in held:
            by_template.setdefault(t, []).append(k)
    out = set()
    for t, keys in by_template.items():
        if all(not np.any(np.asarray(read(k))) for k in keys):
            out.add(t)
    return out


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
    for e in walk(model):
        names = [n for n in e.names if _rules.template(e.param_path(n))[0] in templates]
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
