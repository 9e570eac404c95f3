"""The ``to_spec`` verb: a reference layer carries its spec; a mask replaced by set_params is read back."""
from __future__ import annotations

from dense_bridge.specs import Sequential
from dense_bridge.wiring import Wiring

from ._layers import DenseLayer, SequentialModel


def to_spec(native):
    if isinstance(native, SequentialModel):
        return Sequential([to_spec(l) for l in native.layers], in_features=native.spec.in_features,
                          name=native.spec.name)
    if isinstance(native, DenseLayer) and native.mask is not None:
        # set_params may have replaced the mask: the stored array, not the spec it started
        # from, is what the layer computes with
        wiring = Wiring(native.mask != 0, kind=native.spec.mask.kind, allow_empty_outputs=True)
        if wiring != native.spec.mask:
            return native.spec.replace(mask=wiring)
    return native.spec
