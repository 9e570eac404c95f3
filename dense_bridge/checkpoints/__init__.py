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
from . import _quantized  # noqa: F401  registers itself in _extensions: checkpoints keeping quantized codes
from ._validate import LayerValidator

__all__ = ["save", "load", "open_checkpoint", "convert_file", "CanonicalCheckpoint", "LayerValidator"]

# What the command line needs besides the verbs: small JSON and .npz files read the safe way (a FIFO
# or device refused, never waited on), which format a file is, and the guard that keeps outputs off inputs.
from ._flows import CANONICAL_TARGETS
from ._native import format_names, supported_formats
from ._npz import read_npz
from ._path_guard import canonical_outputs, input_files, refuse_overwrite
from ._safetensors import MAX_JSON_FILE, parse_json, read_json_file
from ._sniff import file_backend, read_head

# what `dense-bridge inspect` says of quantized layers whose codes a checkpoint keeps (_quantized)
from ._quantized import correct_linear_rows as quantized_linear_rows
from ._quantized import format_summary as format_quantized_layers
from ._quantized import summary as quantized_layers

__all__ += ["quantized_layers", "format_quantized_layers", "quantized_linear_rows"]
__all__ += ["CANONICAL_TARGETS", "format_names", "supported_formats", "read_npz", "canonical_outputs", "input_files",
            "refuse_overwrite", "MAX_JSON_FILE", "parse_json", "read_json_file", "file_backend", "read_head"]
