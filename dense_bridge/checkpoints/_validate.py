"""The checks a checkpoint's tensors pass on their way into a model or a file, one layer at a time.

Every reader that streams a file's parameters checks them the way ``db.load`` does, and all of
them do it here: names, shapes and dtypes against the spec (``validate_params``), masks that are
0/1 and equal to the spec's own wiring (``check_masks_match``), NaN/Inf refused unless allowed.

- :class:`LayerValidator`: the checks themselves, for one layer's tensors (``check_layer``) or
  for one rank's block of a tensor (``check_block``, a tensor-parallel load);
- :class:`LayerStream`: a ``ParamSource`` stream (``stream(index, layer) -> canonical params``)
  over tensors read by name when the adapter asks for that layer: a canonical file's mapped
  tensors, or a native file's canonical views (``NativeCheckpoint``);
- :class:`TensorsByLayer`: the same tensors handed out one by one in the order a writer wants
  them (a native file filled from another file), each layer checked when its first tensor is
  asked for and dropped as its tensors are handed out.

Names are canonical: "3.kernel" in a Sequential (position, dot, parameter), "kernel" for a lone layer.
"""
from __future__ import annotations

from typing import Callable, Container, Mapping

import numpy as np

from .._errors import CheckpointError, ConversionError
from ..params._source import check_masks_match, validate_params, validate_params_scan_later
from ..params._copy import count_nonfinite
from ..specs import Sequential, layer_param_shapes
from ._pages import release_file_pages

__all__ = ["LayerValidator", "LayerStream", "TensorsByLayer"]

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class LayerValidator:
    """The checks ``load`` applies to ``spec``'s parameters, one layer (or one block) at a time.

    ``allow_nonfinite``: NaN/Inf pass. ``scan_later``: values kept as they are (no cast) are not
    scanned for NaN/Inf here, because the caller scans them while copying them anyway
    (``_file_fill.fill(check_finite=True)``), so each byte is read once.
    """

    def __init__(self, spec, *, allow_nonfinite: bool = False, scan_later: bool = False) -> None:
        self.sequential = isinstance(spec, Sequential)
        self.layers = list(spec.layers) if self.sequential else [spec]
        self.allow_nonfinite = allow_nonfinite
        self.scan_later = scan_later

    def prefix(self, index: int) -> str:
        """The key prefix of layer ``index``'s tensors: "3." in a Sequential, "" for a lone layer."""
        return f"{index}." if self.sequential else ""

    def names(self, index: int, layer=None) -> list[str]:
        """The canonical names of layer ``index``'s tensors (``layer``: its spec, when the caller
        holds a more precise one, e.g. a lazy layer given its width)."""
        layer = self.layers[index] if layer is None else layer
        return [self.prefix(index) + key for key in layer_param_shapes(layer)]

    def check_layer(self, index: int, raw: Mapping[str, np.ndarray], layer=None) -> dict[str, np.ndarray]:
        """Layer ``index``'s tensors (``raw``: its own keys, "kernel", "bias", "mask") checked and
        cast to the spec's dtypes (views where no cast is needed); ConversionError naming the
        layer and every offender."""
        layer = self.layers[index] if layer is None else layer
        argument = f"parameters of layer {index}"
        if self.scan_later and not self.allow_nonfinite:
            checked = validate_params_scan_later(layer, raw, argument=argument)
        else:
            checked = validate_params(layer, raw, argument=argument, allow_nonfinite=self.allow_nonfinite)
        check_masks_match(layer, checked, prefix=self.prefix(index) or "0.")
        return checked

    def check_block(self, where: str, position: int, name: str, key: str, want: tuple,
                    block: np.ndarray) -> np.ndarray:
        """``block`` (the slice ``want`` of tensor ``key``, parameter ``name`` of layer
        ``position``) checked as a whole-tensor load checks it: NaN/Inf unless allowed, and a
        mask block against the spec's wiring at the same place; returned unchanged.
        CheckpointError naming ``where`` (the file or directory read)."""
        if not self.allow_nonfinite and (bad := count_nonfinite(block)):
            raise CheckpointError(f"{where}: tensor {key!r} holds {bad} NaN/Inf values (allow_nonfinite=True loads "
                                  "them)")
        if name == "mask" and ((block != 0) != self.layers[position].mask.adjacency[want]).any():
            raise CheckpointError(f"{where}: tensor {key!r} differs from the spec's mask in rows {want[0].start}:"
                                  f"{want[0].stop}, columns {want[1].start}:{want[1].stop}")
        return block


class LayerStream:
    """A ``ParamSource`` stream: ``stream(index, layer)`` -> that layer's checked canonical params,
    each tensor read (``read(name)``) only when the adapter asks for its layer.

    ``present``: the names the source holds (a missing one is reported by the checks, with the
    others). ``progress(done, total)`` is called after each layer with the bytes read so far.
    ``drop_pages``: the source arrays are views of a mapping that outlives them (a native file an
    adapter mapped whole): their pages are given back when the next layer is asked for, by
    which time the target holds its own copy; a canonical file's tensors are each their own
    mapping, unmapped with the array, and need none of this.
    """

    def __init__(self, spec, read: Callable[[str], np.ndarray], present: Container[str], *,
                 allow_nonfinite: bool = False, progress: Progress | None = None, total: int = 0,
                 drop_pages: bool = False) -> None:
        self._validator = LayerValidator(spec, allow_nonfinite=allow_nonfinite)
        self._read, self._present = read, present
        self._progress, self._total, self._done = progress, total, 0
        self._drop_pages = drop_pages
        self._held: list[np.ndarray] = []

    def __call__(self, index: int, layer) -> dict[str, np.ndarray]:
        self.release()
        prefix = self._validator.prefix(index)
        raw = {name[len(prefix):]: self._read(name) for name in self._validator.names(index, layer)
               if name in self._present}
        checked = self._validator.check_layer(index, raw, layer)
        if self._drop_pages:
            self._held.extend(raw.values())
        self._done += sum(a.nbytes for a in raw.values())
        if self._progress is not None:
            self._progress(self._done, self._total)
        return checked

    def release(self) -> None:
        """Give back the file pages of the layers read so far (``drop_pages`` only)."""
        release_file_pages(self._held)
        self._held.clear()


class TensorsByLayer:
    """Canonical tensors checked one layer at a time, handed out one tensor at a time.

    ``get(name)`` returns the checked array (a view of the source where no cast is needed); the
    first tensor asked for of a layer reads and checks the whole layer (``tensors[name].produce()``,
    ``_safetensors.PendingTensor``), and each array is dropped once handed out, so at most the
    layers being written are held. NaN/Inf in values kept as they are are left to the writer's
    scan (``scan_later``), which reads each byte once anyway. Errors are CheckpointErrors.
    """

    def __init__(self, spec, tensors: Mapping[str, object]) -> None:
        self._validator = LayerValidator(spec, scan_later=True)
        self._tensors = tensors
        self._layer_of = {name: i for i in range(len(self._validator.layers)) for name in self._validator.names(i)}
        self._held: dict[int, dict[str, np.ndarray]] = {}

    def get(self, name: str) -> np.ndarray:
        i = self._layer_of[name]
        if i not in self._held:
            prefix = self._validator.prefix(i)
            raw = {key[len(prefix):]: np.asarray(self._tensors[key].produce())
                   for key in self._validator.names(i) if key in self._tensors}
            try:
                checked = self._validator.check_layer(i, raw)
            except ConversionError as exc:
                raise CheckpointError(str(exc)) from None
            self._held[i] = {prefix + k: v for k, v in checked.items()}
        held = self._held[i]
        value = held.pop(name)
        if not held:
            del self._held[i]
        return value
