"""Checkpoints: every file dense_bridge reads or writes, and its one face.

``save``/``load`` (also ``db.save``/``db.load``), ``open_checkpoint`` (a file, shard index or
directory as tensors and spec, nothing built) and ``convert_file`` (file to file, no model built).
The modules behind it: the one safetensors reader/writer (``_safetensors``), the one atomic writer
(``_io.AtomicFiles``), framework files through each backend's ``_files.py`` (``_native``), files
streamed into another framework's format (``_native_stream``, ``_file_fill``, ``_pages``), npz
records (``_npz``) and the guard that keeps outputs off inputs (``_path_guard``).
"""
from ._flows import CanonicalCheckpoint, convert_file, load, open_checkpoint, save
from . import _quantized  # noqa: F401  registers itself in _extensions: checkpoints keeping quantized codes

__all__ = ["save", "load", "open_checkpoint", "convert_file", "CanonicalCheckpoint"]
