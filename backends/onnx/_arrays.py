"""Arrays across the ONNX boundary: ``TensorProto`` <-> numpy (dtype kept, bfloat16 as
``ml_dtypes.bfloat16``), the dtype table, and in-place initializer writes.

An ONNX model keeps its parameters as ``TensorProto`` initializers in ``model.graph.initializer``;
onnxruntime hands back plain numpy arrays. Both verbs accept numpy arrays too.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

#: dense_bridge dtype name -> ONNX element type
ELEM_TYPES: dict[str, int] = {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE,
                              "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
FLOAT_TYPES = frozenset(ELEM_TYPES.values())


def dtype_name_of(elem_type: int) -> str | None:
    """The dense_bridge dtype name of an ONNX floating element type (None for other types)."""
    return next((n for n, t in ELEM_TYPES.items() if t == elem_type), None)


def to_numpy(array) -> np.ndarray:
    """The adapter verb: a ``TensorProto`` (initializer) as numpy, dtype kept; numpy passes through.

    The tensor must hold its data (external data is loaded by ``db.load``/``_files.read_model``).
    """
    if isinstance(array, TensorProto):
        if array.data_location == TensorProto.EXTERNAL:
            from dense_bridge._errors import ConversionError

            raise ConversionError(f"initializer {array.name!r} keeps its data in an external file that was not "
                                  f"loaded: read the model with db.load(path) (or onnx.load) first")
        return numpy_helper.to_array(array)
    return np.asarray(array)


def from_numpy(array, name: str = "") -> TensorProto:
    """The adapter verb: a numpy array as a ``TensorProto`` (a copy), dtype kept."""
    arr = np.asarray(array)
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would also turn a 0-d array into 1-d)
        arr = arr.copy(order="C")
    return numpy_helper.from_array(arr, name)


def write_initializer(tensor: TensorProto, value: np.ndarray) -> None:
    """Replace ``tensor``'s data by ``value`` (same dtype and shape already checked), in place:
    the initializer keeps its name and its position, and external-data fields are dropped."""
    new = from_numpy(value.astype(to_numpy_dtype(tensor.data_type), copy=False), tensor.name)
    tensor.CopyFrom(new)


def to_numpy_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
