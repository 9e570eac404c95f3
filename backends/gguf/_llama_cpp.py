"""llama.cpp's own quantizer, through llama-cpp-python (``llama_cpp``): the K-quant and other
outtypes gguf-py has no quantizer for.

A whole file is quantized by ``llama_model_quantize`` (llama.cpp's ``llama-quantize``: it picks
each tensor's type for the file type, e.g. Q6_K for some matrices of a Q4_K_M file, and a fallback
where a row does not fill its blocks); one tensor's blocks are recomputed by ggml's
``ggml_quantize_chunk``, the function ``llama_model_quantize`` calls for every tensor (no importance
matrix), so the certificate's check reproduces each tensor's bytes without requantizing the file.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from dense_bridge.adapter_kit import BackendUnavailableError, CheckpointError, ConversionError

#: outtype -> the name of llama.cpp's file type (``LLAMA_FTYPE_MOSTLY_<name>``): the types llama.cpp
#: quantizes without an importance matrix and gguf-py and transformers' GGUF loader dequantize.
OUTTYPES = {"q2_k": "Q2_K", "q3_k_s": "Q3_K_S", "q3_k_m": "Q3_K_M", "q3_k_l": "Q3_K_L", "q4_k_s": "Q4_K_S",
            "q4_k_m": "Q4_K_M", "q5_k_s": "Q5_K_S", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q5_0": "Q5_0",
            "q5_1": "Q5_1"}


def _module():
    try:
        import llama_cpp
    except ImportError:
        raise BackendUnavailableError("K-quant and other llama.cpp outtypes are quantized by llama.cpp's own "
                                      "quantizer, from llama-cpp-python, which is not installed: pip install "
                                      "llama-cpp-python (nothing was written)") from None
    return llama_cpp


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return "unknown"


def quantize_file(src: str, out: str, outtype: str, threads: int | None = None) -> None:
    """The float GGUF file ``src`` quantized into ``out`` by ``llama_model_quantize`` (file type
    ``OUTTYPES[outtype]``, default parameters: no importance matrix, the output tensor quantized
    too). CheckpointError (``out`` removed) when llama.cpp fails."""
    lc = _module()
    ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{OUTTYPES[outtype]}", None)
    if ftype is None:
        raise ConversionError(f"the installed llama-cpp-python ({version()}) has no file type "
                              f"LLAMA_FTYPE_MOSTLY_{OUTTYPES[outtype]} for outtype {outtype!r} (nothing was written)")
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = int(threads or 0)  # 0: llama.cpp's own choice (the hardware threads)
    rc = lc.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params))
    if rc != 0 or not os.path.isfile(out):
        try:
            os.remove(out)
        except OSError:
            pass
        raise CheckpointError(f"llama.cpp's quantizer (llama_model_quantize, {OUTTYPES[outtype]}) failed on {src} "
                              f"with status {rc} (nothing was written)")


def _chunk():
    lib = _module().llama_cpp._lib  # libllama; ggml's symbols resolve through its dependencies
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    return fn


def quantize_rows(value: np.ndarray, ggml_type) -> np.ndarray:
    """``value`` (float, rows along the last axis) quantized by ggml's ``ggml_quantize_chunk`` into
    ``ggml_type``'s blocks, as ``llama_model_quantize`` quantizes a float32 tensor without an
    importance matrix: uint8, one row's bytes per row."""
    import gguf

    kind = gguf.GGMLQuantizationType(int(ggml_type))
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows = np.ascontiguousarray(np.asarray(value, np.float32).reshape(-1, value.shape[-1]))
    if rows.shape[1] % block:
        raise ConversionError(f"rows of {rows.shape[1]} values do not fill {kind.name} blocks of {block}")
    out = np.zeros((rows.shape[0], rows.shape[1] // block * size), np.uint8)
    done = _chunk()(int(kind), rows.ctypes.data, out.ctypes.data, 0, rows.shape[0], rows.shape[1], None)
    if done != out.nbytes:
        raise ConversionError(f"ggml_quantize_chunk wrote {done} bytes of {kind.name}, not {out.nbytes}")
    return out
