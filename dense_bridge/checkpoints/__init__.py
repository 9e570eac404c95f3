"""Checkpoints: every file dense_bridge reads or writes, and its one face.

``save``/``load`` (also ``db.save``/``db.load``), ``open_checkpoint`` (a file, shard index or
directory as tensors and spec, nothing built) and ``convert_file`` (file to file, no model built).
The modules behind it: the one safetensors reader/writer (``_safetensors``), the one atomic writer
(``_io.AtomicFiles``, ``_io.write_text``), the one layer-by-layer check of streamed tensors
(``_validate``: ``LayerValidator``, also for a tensor-parallel load's blocks), framework files
through each backend's ``_files.py`` (``_native``), files streamed into another framework's
format (``_native_stream``, ``_file_fill``, ``_pages``), the spec in a file's metadata
(``_meta``), npz records (``_npz``), PEFT and mlx-lm adapter directories (``_adapter_files``)
and the guard that keeps outputs off inputs (``_path_guard``).
"""
from ._flows import CanonicalCheckpoint, convert_file, load, open_checkpoint, save
from ._validate import LayerValidator

__all__ = ["save", "load", "open_checkpoint", "convert_file", "CanonicalCheckpoint", "LayerValidator"]
