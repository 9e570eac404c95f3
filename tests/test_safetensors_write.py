"""Writing tensors that are views (a weight kept transposed, as MLX keeps them): the bytes on disk
are the tensor in C order, whatever the view's strides, written in bounded blocks."""
from __future__ import annotations

import io

import numpy as np
import pytest

from dense_bridge._safetensors import _write_array


@pytest.mark.parametrize("shape", [(7, 5), (130, 67), (1, 9), (9, 1)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_transposed_views_are_written_in_c_order_in_blocks(shape, dtype):
    base = np.random.default_rng(0).standard_normal(shape[::-1]).astype(dtype)
    view = base.T  # (rows, cols) whose transpose is contiguous: the blocked-transpose path
    assert not view.flags.c_contiguous or min(shape) == 1
    out = io.BytesIO()
    _write_array(out, view, chunk=3 * view.itemsize * shape[1])  # a few rows per block
    assert out.getvalue() == np.ascontiguousarray(view).tobytes()


def test_other_strided_views_are_written_in_c_order():
    base = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)
    view = base[:, ::2, 1:]  # neither it nor its transpose is contiguous
    out = io.BytesIO()
    _write_array(out, view, chunk=64)
    assert out.getvalue() == np.ascontiguousarray(view).tobytes()
