"""Hostile arguments and declarations: every error is a clear DenseBridgeError (or TypeError).

Layout declarations that cannot be right (kernel and bias naming one attribute, a bias that is not
the kernel's units), and the checks every load path applies before allocating.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend


# ------------------------------------------------------------------ register_layout
def test_register_layout_refuses_kernel_and_bias_naming_one_attribute():
    with pytest.raises(db.SpecError, match="two different attributes.*kernel='w', bias='w'"):
        db.register_layout("some.pkg.Layer", kernel="w", bias="w", layout="in_out")


def _declared(cls, **kwargs):
    from dense_bridge import _layouts

    decl = db.register_layout(f"{cls.__module__}.{cls.__qualname__}", **kwargs)
    return decl, lambda: _layouts._DECLARED.pop(decl.cls)


def test_torch_declared_bias_that_is_not_the_units_is_refused():
    torch = pytest.importorskip("torch")

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 3))  # in_out: 5 in, 3 units
            self.b = torch.nn.Parameter(torch.randn(5))  # not (3,)

        def forward(self, x):
            return x @ self.w

    _, undo = _declared(Odd, kernel="w", bias="b", layout="in_out")
    try:
        with pytest.raises(db.ConversionError, match=r"bias attribute 'b' of shape \(5,\).*3 units"):
            db.to_spec(Odd())
        with pytest.raises(db.ConversionError, match="3 units"):
            db.get_params(Odd())
    finally:
        undo()


def test_mlx_declared_bias_that_is_not_the_units_is_refused():
    require_backend("mlx")
    import mlx.core as mx
    import mlx.nn as nn

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.zeros((3, 4))  # out_in: 3 units, 4 in
            self.b = mx.zeros((4,))

        def __call__(self, x):
            return x @ self.w.T

    _, undo = _declared(Odd, kernel="w", bias="b", layout="out_in")
    try:
        with pytest.raises(db.SpecError, match=r"bias 'b' of shape \(4,\).*3 units"):
            db.to_spec(Odd())
    finally:
        undo()
