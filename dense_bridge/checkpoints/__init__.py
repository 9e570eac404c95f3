"""Checkpoints: every file dense_bridge reads or writes, and its one face.

``save``/``load`` (also ``db.save``/``db.load``), ``open_checkpoint`` (a file, shard index or
model directory as tensors and spec, nothing built) and ``convert_file`` (file to file, no model
built). The modules behind them, one job each:

- the verbs: ``_save`` (save), ``_load`` (load, open_checkpoint: which checkpoint a path is),
  ``_convert_file`` (convert_file);
- the canonical checkpoint: its format, metadata and reader (``_canonical``), its atomic,
  shard-aware writer (``_canonical_write``), codes of quantized layers kept (``_quantized``);
- native files through each backend's ``_files.py`` (``_native``), quantized model directories a
  backend's manifest declares (``_model_dir``), files streamed into another framework's format
  (``_native_stream``, ``_file_fill``, ``_pages``);
- the plumbing: the one safetensors reader/writer (``_safetensors``), opening a path's files
  consistently against concurrent saves (``_open_files``), the one atomic writer
  (``_io.AtomicFiles``, ``_io.write_text``), the one layer-by-layer check of streamed tensors
  (``_validate``: ``LayerValidator``, also for a tensor-parallel load's blocks), npz records
  (``_npz``), a file's first bytes (``_sniff``) and the guard that keeps outputs off inputs
  (``_path_guard``).
"""
from ._canonical import CanonicalCheckpoint
from ._convert_file import convert_file
from ._load import load, open_checkpoint
from ._save import save
from ._validate import LayerValidator

__all__ = ["save", "load", "open_checkpoint", "convert_file", "CanonicalCheckpoint", "LayerValidator"]

# What the command line needs besides the verbs: small JSON and .npz files read the safe way (a FIFO
# or device refused, never waited on), which format a file is, and the guard that keeps outputs off inputs.
from ._convert_file import CANONICAL_TARGETS
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
