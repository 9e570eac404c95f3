"""MLX's own checkpoint files: ``.safetensors`` (MLX names and layouts) and ``.npz``
(``mx.savez``); the ``file_info``/``read_file``/``write_file`` verbs.

Safetensors files are opened and parsed by the core (``dense_bridge.checkpoints._safetensors``), not by
``mx.load(path)``: the files stay the ones the core opened (a concurrent save may have replaced
the path since), and F64 tensors that other tools write read too. The native layout (Linear
``weight`` (out, in), Bilinear (out, in2, in1)) is MLX's own: ``file_views`` serves the file as
canonical views named by the rules of the model :func:`compile` builds (the core builds the
model from them), ``read_file`` loads it into a given model with ``load_weights(strict=True)``.

MLX neither writes nor reads F64 safetensors (``mx.load``: "unsupported dtype F64"), so an MLX
``.safetensors`` holding float64 is refused before anything is written: ``.npz`` holds it.
"""
from __future__ import annotations

from typing import Callable, Mapping

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dense_bridge.checkpoints._native import FileViews, layer_file_plan, planned_file_tensors
from dense_bridge._dtypes import dtype_name as canonical_dtype_name
from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import CheckpointError, first_line
from dense_bridge.checkpoints._safetensors import PendingTensor, SafetensorsFile, write_safetensors

from ._arrays import dtype_name, to_numpy

Entries = dict  # name -> (native shape, dtype name)


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _to_mlx(arr: np.ndarray, name: str, path: str) -> mx.array:
    """An MLX array copying ``arr`` in its own dtype (mx.array alone turns float64 into float32)."""
    if arr.dtype.name == "bfloat16":
        return mx.array(np.ascontiguousarray(arr).view(np.uint16), dtype=mx.uint16).view(mx.bfloat16)
    dtype = getattr(mx, arr.dtype.name, None)
    if not isinstance(dtype, mx.Dtype):
        raise CheckpointError(f"cannot read {path}: tensor {name!r} has dtype {arr.dtype.name}, which MLX has not")
    return mx.array(arr, dtype=dtype)


def _state(path: str, files: list[SafetensorsFile] | None) -> dict[str, mx.array]:
    if files:
        return {n: _to_mlx(f.get(n), n, path) for f in files for n in f.tensors}
    from dense_bridge.checkpoints._npz import npz_records

    # an .npz (safetensors came as files): headers checked before MLX allocates what they claim
    from dense_bridge.checkpoints._guard import input_file

    try:  # checked and loaded from one descriptor: a swap in between cannot pair two files
        with input_file(path, what="MLX weights file") as handle:
            npz_records(path, lambda reason: CheckpointError(f"cannot read {path} as MLX weights: {reason}"), handle)
            handle.seek(0)
            return dict(mx.load(handle, format="npz"))
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - mlx raises RuntimeError/ValueError for bad files
        raise CheckpointError(f"cannot read {path} as MLX weights: {first_line(exc)}") from None


def file_info(path: str, container: str, *, files: list[SafetensorsFile] | None = None
              ) -> tuple[Entries, dict[str, str]]:
    """(name -> (native shape, dtype name), string metadata) of an MLX file, without a spec."""
    if files:
        from dense_bridge._dtypes import dtype_name

        return ({n: (i.shape, dtype_name(i.numpy_dtype)) for f in files for n, i in f.tensors.items()},
                dict(files[0].metadata))
    return {k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in _state(path, None).items()}, {}


def file_views(path: str, container: str, spec, *, files: list[SafetensorsFile] | None = None,
               check: Callable[[Entries, Entries], None]):
    """Canonical views of an MLX file for ``spec``, with no MLX model built: a ``.safetensors``
    straight from the core's mapped files, an ``.npz`` from ``mx.load`` (its headers checked
    first). A load onto MLX builds its model from these, layer by layer, as from a canonical
    file; a conversion to another framework copies each layer once (see dense_bridge/registry/_contract.py).

    Names are those of the model :func:`compile` builds (:func:`_plan`); ``check(got, expected)``
    compares the file's names, shapes and dtypes with them first. None for a spec holding a
    layer those rules do not describe.
    """
    plan = _plan(spec)
    expected = planned_file_tensors(plan, spec)
    if expected is None:
        return None
    from ._quant_files import quant_file_layers

    if files:
        got = {n: (i.shape, canonical_dtype_name(i.numpy_dtype)) for f in files for n, i in f.tensors.items()}
        if quant_file_layers(got, path):
            return None  # quantized layers: MLX's own loader reads the file into a quantized template
        check(got, expected)
        where = {n: f for f in files for n in f.tensors}
        return FileViews(plan, lambda name: where[name].get(name))
    state = _state(path, None)
    got = {k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in state.items()}
    if quant_file_layers(got, path):
        return None  # quantized layers: MLX's own loader reads the file into a quantized template
    check(got, expected)
    return FileViews(plan, lambda name: to_numpy(state[name]))


def _plan(spec) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """canonical name -> (MLX parameter name, axes: canonical = native.transpose(axes)) of the model
    :func:`compile` builds for ``spec``; None for a layer these rules do not describe.

    A Sequential keeps its layers in ``layers``: position ``i``'s arrays are
    ``"layers.<i>.weight"``, ``.bias``, ``.mask`` (a lone layer: no prefix); activations, Identity
    and Flatten hold none. Each Dense ``weight`` (out, in) is the canonical kernel transposed, its
    ``mask`` likewise, a Bilinear ``weight`` (units, in2, in1) is the kernel with axes 1 and 2 swapped.
    """
    return layer_file_plan(spec, container="layers.", kernel="weight", dense_axes=(1, 0), bilinear_axes=(0, 2, 1))


def read_file(path: str, container: str, template, *, files: list[SafetensorsFile] | None = None,
              check: Callable[[Entries, Entries], None], borrow: bool = False):
    """``template`` (an MLX model built for the file's spec) holding the file's arrays;
    ``check(got, expected)`` raises a CheckpointError listing every difference first. ``borrow``
    (the caller only reads the parameters out) changes nothing here: the arrays are copied."""
    if template is None:
        raise CheckpointError(f"{path}: MLX weights need the model's structure (spec= or like=)")
    state = _state(path, files)
    expected = {k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in tree_flatten(template.parameters())}
    check({k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in state.items()}, expected)
    try:
        template.load_weights(list(state.items()), strict=True)
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load {path} into the MLX model: {first_line(exc)}") from None
    mx.eval(template.parameters())
    return template


def _pending(model) -> dict[str, PendingTensor]:
    """The model's arrays, each turned into numpy (a zero-copy view) only when written."""
    out = {}
    for k, v in tree_flatten(model.parameters()):
        # the dtype from the name: a reshape of a transposed view (how MLX may keep a weight)
        # would copy the whole array just to learn it
        integer = _dtype_name(v.dtype)  # a quantized layer's packed codes and uint8 scales
        dtype = np.dtype(integer) if integer.startswith(("int", "uint")) else numpy_dtype(dtype_name(v.dtype, k))
        out[k] = PendingTensor(dtype, tuple(v.shape), (lambda a=v: to_numpy(a)))
    return out


def _refuse_float64(path: str, dtypes: Mapping[str, np.dtype]) -> None:
    wide = [k for k, d in dtypes.items() if d == np.float64]
    if wide:
        raise CheckpointError(f"cannot write {path}: MLX cannot read float64 tensors from .safetensors "
                              f"(mx.load refuses dtype F64), and {wide} are float64. Write an MLX .npz "
                              "instead (MLX reads float64 there), or a canonical checkpoint (--to canonical)")


def write_file(model, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``model``'s arrays into ``temp``, the temporary the core renames to ``path``.

    ``kind``: "safetensors" (MLX names and layouts, ``metadata`` alongside, "format" = "mlx";
    float64 refused: MLX cannot read it back) or "npz" (``mx.savez``).
    """
    if kind == "safetensors":
        state = _pending(model)
        _refuse_float64(path, {k: t.dtype for k, t in state.items()})
        with open(temp, "wb") as f:
            write_safetensors(f, state, {"format": "mlx", **(metadata or {})})
    elif kind == "npz":
        _savez_closed(temp, dict(tree_flatten(model.parameters())))
    else:
        raise CheckpointError(f"cannot write {path}: MLX writes .safetensors or .npz, not {kind!r}")


def _savez_closed(temp: str, arrays: dict) -> None:
    """``mx.savez(temp, **arrays)``, its zip writer's fate included: ``mx.savez`` leaves its
    ``zipfile.ZipFile`` to the garbage collector, whose ``close`` (the central directory written
    last) then fails only as "Exception ignored in ZipFile.__del__" on stderr, where a full disk
    or a file-size limit would be lost and a truncated archive kept. Here that collection happens
    inside the call, and its error is raised like the writer's own."""
    import gc
    import sys

    lost: list[BaseException] = []
    failure = None
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: lost.append(unraisable.exc_value)
    try:
        try:
            mx.savez(temp, **arrays)
        except Exception as exc:  # noqa: BLE001 - re-raised below, once its writer is closed
            # the traceback's frames hold the writer: drop them so it is collected below
            failure = exc.with_traceback(None)
            failure.__context__ = failure.__cause__ = None
        gc.collect()  # the abandoned writer closes here, under the hook above
    finally:
        sys.unraisablehook = hook
    if failure is not None:
        raise failure
    if lost:
        raise lost[0].with_traceback(None)


def file_layout(spec, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None):
    """The header of an MLX ``.safetensors`` for ``spec`` written into ``temp`` (MLX's names and
    layouts from :func:`_plan`, "format" = "mlx" and ``metadata``), and where each canonical
    tensor's bytes go (``_native_stream.FileLayout``); float64 refused as :func:`write_file`
    refuses it. None for ``.npz`` (``mx.savez`` writes it) and for specs the rules do not cover.
    """
    from dense_bridge.checkpoints._native_stream import FileLayout
    from dense_bridge.checkpoints._safetensors import write_header

    if kind != "safetensors":
        return None
    plan = _plan(spec)
    tensors = planned_file_tensors(plan, spec)
    if tensors is None:
        return None
    native = {name: PendingTensor(np.dtype(numpy_dtype(dtype)), shape, None) for name, (shape, dtype) in tensors.items()}
    _refuse_float64(path, {k: t.dtype for k, t in native.items()})
    offsets = write_header(temp, native, {"format": "mlx", **(metadata or {})})
    return FileLayout({c: (offsets[name], axes) for c, (name, axes) in plan.items()})
