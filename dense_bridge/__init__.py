"""dense_bridge: one backend-neutral Dense spec, compiled to torch, Keras, MLX and numpy.

Importing this package imports no framework; adapters load on first use.
"""
from __future__ import annotations

from . import wiring
from ._api import available_backends, backend, compile, convert, get_params, set_params, to_spec
from ._errors import (BackendUnavailableError, CheckpointError, ConversionError, DenseBridgeError,
                      SpecError)
from .models import linear_layers, register_layout, transfer
from ._version import __version__
from .activations import Activation
from .initializers import Init
from .specs import Bilinear, Dense, Flatten, Identity, Sequential, from_config


__all__ = [
    "Dense", "Bilinear", "Identity", "Flatten", "Sequential", "Activation", "Init", "wiring", "from_config",
    "available_backends", "backend", "compile", "get_params", "set_params", "to_spec", "convert",
    "save", "load", "testing", "linear_layers", "register_layout", "transfer",
    "DenseBridgeError", "SpecError", "ConversionError", "CheckpointError", "BackendUnavailableError",
]


def __getattr__(name: str):
    # checkpoints and testing pull in more code (safetensors, report rendering): load on first use
    if name in ("save", "load"):
        from . import checkpoint

        return getattr(checkpoint, name)
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module 'dense_bridge' has no attribute {name!r}")
