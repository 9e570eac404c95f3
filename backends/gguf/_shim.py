"""Interim GGUF reader and writer on gguf-py (GGUFReader/GGUFWriter), with the interface of the
file layer (``_file.open_gguf``, ``_writer.GGUFOutput``) until that lands; removed then."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dense_bridge.adapter_kit import CheckpointError


@dataclass(frozen=True)
class TensorInfo:
    """``shape`` in numpy order (GGUF's ``ne`` reversed), ``ggml_type`` (gguf.GGMLQuantizationType),
    ``numpy_dtype`` of what ``get`` returns, ``nbytes`` stored."""

    shape: tuple
    ggml_type: object
    numpy_dtype: np.dtype
    nbytes: int


def _value(field):
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]


class GGUFFile:
    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        try:
            self._reader = gguf.GGUFReader(path)
        except Exception as exc:  # noqa: BLE001 - gguf-py raises anything on a bad file
            raise CheckpointError(f"cannot read {path} as a GGUF file: {type(exc).__name__}: {str(exc)[:200]}") from None
        self.metadata = {k: _value(f) for k, f in self._reader.fields.items() if not k.startswith("GGUF.")}
        self._t = {t.name: t for t in self._reader.tensors}
        self.tensors = {}
        for t in self._reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            kind = t.tensor_type
            dt = {gguf.GGMLQuantizationType.F16: np.dtype(np.float16)}.get(kind)
            if kind == gguf.GGMLQuantizationType.BF16:
                from dense_bridge._dtypes import numpy_dtype

                dt = np.dtype(numpy_dtype("bfloat16"))
            self.tensors[t.name] = TensorInfo(shape, kind, dt or np.dtype(np.float32), int(t.n_bytes))

    def keys(self):
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        import gguf

        t = self._t[name]
        info = self.tensors[name]
        out = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        return out.astype(info.numpy_dtype) if out.dtype != info.numpy_dtype else out

    def raw(self, name: str) -> np.ndarray:
        return np.asarray(self._t[name].data)

    def close(self) -> None:
        self._reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_gguf(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist or is not a file")
    return GGUFFile(path)


class GGUFOutput:
    """A GGUF file written tensor by tensor: ``metadata`` {key: (value, GGUFValueType, sub type or
    None)}, ``plan`` [(name, numpy shape, ggml type)] in file order; ``write(name, encoded)`` takes
    each tensor already encoded (gguf.quants.quantize's output) in plan order."""

    def __init__(self, path: str, metadata: dict, plan: list) -> None:
        import gguf

        arch = metadata["general.architecture"][0]
        self._w = gguf.GGUFWriter(path, arch)
        for key, (value, vtype, sub) in metadata.items():
            if key == "general.architecture":
                continue
            self._w.add_key_value(key, value, vtype, sub_type=sub)
        for name, shape, kind in plan:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size
            self._w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
        self._w.write_header_to_file()
        self._w.write_kv_data_to_file()
        self._w.write_ti_data_to_file()

    def write(self, name: str, data: np.ndarray) -> None:
        self._w.write_tensor_data(np.ascontiguousarray(data))

    def close(self) -> None:
        self._w.close()
