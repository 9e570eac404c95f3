"""The ``walk`` verb for numpy reference models: the layers holding parameters, by position.

A reference model is always a chain (a SequentialModel or one layer), so its paths are the
positions of its Sequential ("0", "2", ...), or "" for a lone layer.
"""
from __future__ import annotations

import numpy as np

from dense_bridge.adapter_kit import Entry

from ._layers import BilinearLayer, DenseLayer, SequentialModel


def walk(native) -> list[Entry]:
    """Every Dense/Bilinear reference layer of ``native`` with its position as path."""
    seq = isinstance(native, SequentialModel)
    layers = native.layers if seq else [native]
    out = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, (DenseLayer, BilinearLayer)):
            continue

        def read(layer=layer) -> dict[str, np.ndarray]:
            return dict(layer.params())

        def write(arrays: dict[str, np.ndarray], layer=layer) -> None:
            for k, a in arrays.items():
                setattr(layer, k, np.array(a, copy=True))

        built = layer.built if isinstance(layer, DenseLayer) else True
        names = tuple(layer.params()) if built else ()
        out.append(Entry(str(i) if seq else "", layer, "linear", names,
                         {n: id(getattr(layer, n)) for n in names},
                         {n: tuple(getattr(layer, n).shape) for n in names}, read, write))
    return out
