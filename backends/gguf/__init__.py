"""GGUF (llama.cpp's file format): a port source and destination (``db.port``), no framework.

This package is a file-format backend: it offers the port verbs of the ``ports`` capability
(``_ports.py``) and nothing that runs or builds layers, because nothing runs GGUF here; its twins
are transformers' models of the file. Logical tensors are in numpy order (GGUF's dimensions
reversed: a weight matrix is (out, in)) and transformers' row order; the file's own encoding (the
llama-family q/k row permutation, quantized blocks) is applied and undone here.
"""
from ._ports import (port_common_config, port_contents, port_describe, port_detect, port_example, port_layout,
                     port_inspect, port_load, port_logits, port_open, port_own_config, port_recompute_codes, port_save, port_shapes, port_shrink,
                     port_twin, port_write, port_write_extras)

__all__ = ["port_common_config", "port_contents", "port_describe", "port_detect", "port_example", "port_layout",
           "port_inspect", "port_load", "port_logits", "port_open", "port_own_config", "port_recompute_codes", "port_save", "port_shapes", "port_shrink",
           "port_twin", "port_write", "port_write_extras"]
