"""The ``get_params``/``set_params`` verbs: the reference keeps the canonical layout as is."""
from __future__ import annotations

import numpy as np

from ._layers import DenseLayer, SequentialModel, sublayers


def get_params(native) -> dict[str, np.ndarray]:
    return native.params()


def set_params(native, params: dict[str, np.ndarray]) -> None:
    seq = isinstance(native, SequentialModel)
    for i, layer in enumerate(sublayers(native)):
        prefix = f"{i}." if seq else ""
        for key in ("kernel", "bias", "mask"):
            if prefix + key in params:
                setattr(layer, key, np.array(params[prefix + key], copy=True))
        if isinstance(layer, DenseLayer) and layer.mask is not None and prefix + "kernel" in params:
            layer.kernel = layer.kernel * layer.mask  # masked weights are exactly 0 by contract
