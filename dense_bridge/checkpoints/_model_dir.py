"""Quantized model directories a backend's ecosystem writes (mlx-lm's: a config beside the
weights), opened as their weights file with what the config says about its quantized layers.

The directory is recognised through the backends' manifests (``Manifest.model_dirs``: the
config file's name, the weights file's names, what in the config marks the format), so nothing
here names a framework, and none is imported until a directory is recognised. The quantized
layers (their schemes checked against the config, their widths read from the packing) come from
the adapter's ``model_dir_layers`` verb.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._errors import CheckpointError, DenseBridgeError, first_line
from ..registry._manifest import ModelDir
from ._native import NativeCheckpoint
from ._safetensors import read_json_file

__all__ = ["find_model_dir", "QuantizedDirectory"]


def find_model_dir(path: str) -> tuple[str, ModelDir, str, Any] | None:
    """(backend, its ModelDir, the weights file, what the config says) of the first declared
    model directory format the directory ``path`` has, in registry order; None for any other
    directory. Reads the config (the safe way: a FIFO refused) and no framework."""
    from ..registry._backends import backends

    for backend, info in backends().items():
        for fmt in info.manifest.model_dirs:
            config = os.path.join(path, fmt.config)
            weights = next((os.path.join(path, n) for n in fmt.weights if os.path.isfile(os.path.join(path, n))), None)
            if weights is None or not os.path.isfile(config):
                continue
            settings = _settings(fmt, backend, read_json_file(config, "model config"), config)
            if settings is not None:
                return backend, fmt, weights, settings
    return None


def _settings(fmt: ModelDir, backend: str, config: dict, where: str) -> Any:
    """``fmt.settings(config)``; a backend's failing declaration named, never its traceback."""
    try:
        return fmt.settings(config)
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - a manifest's function failed on this config
        raise CheckpointError(f"cannot read {where}: the {backend} backend's {fmt.label!r} failed to read it "
                              f"({type(exc).__name__}: {first_line(exc)})") from None


class QuantizedDirectory(NativeCheckpoint):
    """A quantized model directory read as its weights file (a safetensors file or index).

    ``quant_layers``: {layer name: (Quant, in_features, units)}, as the adapter reads them
    against the config (``model_dir_layers``); ``directory``: the directory. No spec: the model
    is the ecosystem's own (a whole language model), so ``params()`` gives every tensor as
    stored, packed codes included, and ``db.transfer`` moves it into a built model.
    """

    def __init__(self, directory: str, weights: NativeCheckpoint, model_dir: ModelDir, settings: Any) -> None:
        """Take over ``weights`` (opened as the backend's file, its descriptors now this
        checkpoint's) and ask the adapter for the quantized layers ``settings`` describe."""
        if not weights.files:
            weights.close()
            raise CheckpointError(f"cannot read {directory}: its weights file {weights.path} is not a safetensors file "
                                  f"or index ({weights.kind}), as a {model_dir.label} holds")
        super().__init__(weights.path, weights.framework, weights.format, index=weights.index, files=weights.files)
        self.directory = directory
        try:
            verb = getattr(self.adapter(), "model_dir_layers", None)
            if verb is None:
                raise CheckpointError(f"cannot read {directory}: the {self.framework} backend declares the "
                                      f"{model_dir.label} but its adapter has no 'model_dir_layers' verb")
            self.quant_layers: dict[str, tuple] = dict(verb(self.file_info()[0], directory, settings))
        except BaseException:
            self.close()
            raise
        self.kind = (f"{model_dir.label} ({len(self.quant_layers)} quantized layers; "
                     f"{os.path.basename(weights.path)} + {model_dir.config})")

    def params(self) -> dict[str, np.ndarray]:
        """Every tensor of the weights files as stored (packed codes included), in-memory copies."""
        return {n: np.array(f.get(n)) for f in self.files for n in f.tensors}
