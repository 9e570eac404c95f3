"""Writing a framework's own checkpoint file straight from canonical tensors, no model built.

A file-to-file conversion (``checkpoints.convert_file``, ``dense-bridge convert``) into torch,
Keras or MLX files builds no model of the target framework: a model would cost a copy of every
tensor in framework memory and a second pass over it when the framework writes the file.
Where the target adapter offers the ``file_layout`` verb, this module:

1. asks the adapter to write the file's skeleton for the spec into the temporary with the
   framework's own writer (``torch.save`` under ``skip_data``, Keras' ``save_weights`` plus
   h5py, the safetensors header): the framework's own names, every tensor's bytes left to fill;
2. fills each tensor's bytes at its offset from the source's mapped views, transposed into the
   framework's layout piece by piece (:func:`dense_bridge.checkpoints._file_fill.fill`, pipelined);
3. lets the adapter finish the file (torch: the zip's CRC-32 fields), then fsyncs and renames.

The source tensors are validated layer by layer exactly as ``load`` validates them (shapes,
dtypes, masks that are 0/1 and the spec's own wiring, NaN/Inf refused unless allowed), each
layer when its first tensor's turn comes, so a bad file leaves nothing behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from .._errors import CheckpointError, DenseBridgeError, first_line


@dataclass
class FileLayout:
    """Where an adapter's skeleton file wants each canonical tensor (the ``file_layout`` verb's answer).

    ``places``: canonical name -> (byte offset in the temporary, ``axes``): the bytes at the
    offset are the native tensor in C order, the one whose ``transpose(axes)`` is the canonical
    tensor (``file_views``' convention: ``(1, 0)`` for a torch/MLX weight (out, in)).
    ``finish(checksums)``: called after every tensor is written, with each canonical name's
    CRC-32 of the bytes written, for formats that keep checksums (torch's zip); None otherwise.
    """

    places: dict[str, tuple[int, tuple[int, ...]]]
    finish: Callable[[dict[str, int]], None] | None = None


class _NoLayout(Exception):
    """The adapter cannot lay this file out: the caller takes the model path instead."""


def stream_native(tensors: Mapping[str, object], spec, backend: str, out: str, *,
                  allow_nonfinite: bool = False, progress: Callable[[int, int], None] | None = None
                  ) -> list[str] | None:
    """Write ``backend``'s own file at ``out`` from canonical ``tensors`` (name ->
    ``_safetensors.PendingTensor``, each produced when its turn comes) for ``spec``; return the
    files written, or None where the adapter offers no ``file_layout`` for this file kind (the
    caller then builds the model and lets the framework write it). Atomic: a failure leaves no
    file and changes nothing at ``out``.
    """
    from ._io import AtomicFiles, check_room, check_writable
    from ._canonical import spec_json
    from ._native import SPEC_KEY, canonical_shapes, file_adapter, output_kind, temp_suffix
    from ._file_fill import Slot, fill
    from ._validate import TensorsByLayer

    kind = output_kind(backend, out)
    adapter = file_adapter(backend, f"writing {out}")
    lay_out = getattr(adapter, "file_layout", None)
    if lay_out is None:
        return None
    shapes = canonical_shapes(spec)
    if set(shapes) != set(tensors):
        return None  # the model path reports exactly what is missing or unexpected
    check_writable(out)
    metadata = {"dense_bridge_backend": backend, SPEC_KEY: spec_json(spec)}
    checked = TensorsByLayer(spec, tensors)
    total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(_numpy(d)).itemsize for s, d in shapes.values())
    check_room(out, total)  # the framework writes the file's skeleton: it must not meet a refused write
    done = [0]

    def tick(_name: str, nbytes: int) -> None:
        done[0] += nbytes
        if progress is not None:
            progress(done[0], total)

    try:
        with AtomicFiles(out) as tx:
            temp = tx.temp_for(out, temp_suffix(backend, kind))
            layout = lay_out(spec, out, kind, temp=temp, metadata=metadata)
            if layout is None or set(layout.places) != set(shapes):
                raise _NoLayout
            slots = []
            for name, (offset, axes) in layout.places.items():
                shape, dtype = shapes[name]
                to_native = tuple(int(a) for a in np.argsort(axes))  # native = canonical.transpose(this)
                slots.append(Slot(name, offset, np.dtype(_numpy(dtype)), tuple(shape[a] for a in to_native),
                                  lambda n=name, a=to_native: checked.get(n).transpose(a)))
            slots.sort(key=lambda s: s.offset)  # the output is written front to back
            with open(temp, "r+b") as f:
                crcs = fill(f.fileno(), slots, check_finite=not allow_nonfinite,
                            checksums=layout.finish is not None, on_tensor=tick)
            if layout.finish is not None:
                layout.finish(crcs)
    except _NoLayout:
        return None
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the framework's skeleton writer failed; nothing was left
        from ._io import write_limit_cause

        cause = write_limit_cause(out)
        raise CheckpointError(f"cannot write {out}: {type(exc).__name__}: {first_line(exc)}"
                              f"{f' ({cause})' if cause else ''} (nothing was changed on disk)") from exc
    return [out]


def _numpy(dtype_name: str) -> np.dtype:
    from .._dtypes import numpy_dtype

    return numpy_dtype(dtype_name)
