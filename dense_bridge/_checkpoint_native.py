"""Native checkpoint files (torch state dicts, Keras weights/models, MLX arrays), framework-free.

This module decides which framework a file belongs to (from the container the core sniffed,
the safetensors metadata and names, the members of a zip archive) and leaves every framework
detail to that adapter's file verbs (``backends/<fw>/_files.py``):

- ``file_info(path, container, *, files)`` -> (name -> (native shape, dtype), metadata), no spec needed;
- ``read_file(path, container, template, *, files, check)`` -> ``template`` (a model of that
  framework compiled from the spec through the one compile path, ``_api.build``) holding the
  file's tensors, after ``check(got, expected)`` compared names, native shapes and dtypes (every
  difference listed in one CheckpointError); a ``.keras`` file brings its own model;
- ``write_file(model, path, kind, *, temp, metadata)`` writes ``model`` into ``temp``, which the
  core renames to ``path`` atomically (``_checkpoint_io.AtomicFiles``).

So every native layout detail (torch weight (out, in), the mask buffer stored like the weight,
MLX Bilinear (out, in2, in1), Keras per-layer ``vars/0``...) stays in the adapter that defines it
and is never guessed from a shape. Safetensors files (torch's and MLX's) are opened by the core
once (consistent against a concurrent save; see ``_safetensors``) and handed to the adapter.
A native file whose framework is not installed raises ``BackendUnavailableError`` naming the file
and the extra to install.
"""
from __future__ import annotations

import copy
import math
import os
import zipfile
from collections.abc import Mapping
from typing import Callable, Iterator

import numpy as np

from ._checkpoint_io import AtomicFiles, check_writable
from ._checkpoint_meta import check_finite_params, mismatches, spec_from_json, spec_json
from ._dtypes import numpy_dtype
from ._errors import BackendUnavailableError, CheckpointError, ConversionError, DenseBridgeError, SpecError
from ._safetensors import SafetensorsFile
from ._pages import release_file_pages

__all__ = ["FORMATS", "SPEC_KEY", "NativeCheckpoint", "FileViews", "open_native", "file_adapter", "output_kind",
           "write_native", "structure_twin", "canonical_shapes"]

FORMATS = ("dense_bridge", "torch", "keras", "mlx", "flax", "equinox")
SPEC_KEY = "dense_bridge_spec"
TORCH_EXTS = (".pt", ".pth", ".bin")
LAYOUT_NOTES = {
    "torch": "torch layout: Linear weight (out_features, in_features), mask like the weight",
    "mlx": "MLX layout: Linear weight (out_features, in_features), Bilinear weight (out, in2, in1)",
    "keras": "Keras layout: Dense kernel (in_features, units) as layers/<name>/vars/0",
    "flax": "Flax layout: nnx.Linear kernel (in_features, units) under nested names (layers.0.kernel)",
    "equinox": "Equinox layout: unnamed records in the model's leaf order, Linear weight (out_features, "
               "in_features), the mask as a bool record",
    "onnx": "ONNX layout: MatMul on (in_features, units) initializers, Gemm transB=1 on (units, in_features)",
}
_KINDS = {"torch": "torch state dict", "keras": "Keras weights file", "mlx": "MLX weights file",
          "flax": "Flax msgpack state file", "equinox": "Equinox leaves file (.eqx)",
          "onnx": "ONNX model file (.onnx)"}
_NAMES = {"torch": "torch", "keras": "Keras", "mlx": "MLX", "flax": "Flax", "equinox": "Equinox", "onnx": "ONNX"}
#: Containers only one framework writes (sniffed by the core: ``checkpoint._kind``)
_OWN_CONTAINERS = {"msgpack": "flax", "eqx": "equinox", "onnx": "onnx"}
#: Containers that hold a whole model, structure included: read without a template
_CARRIES_MODEL = ("keras-model", "onnx")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def file_adapter(framework: str, what: str):
    """The adapter whose file verbs handle ``framework``'s files; BackendUnavailableError naming
    ``what`` (the file and the job) and the extra to install when the framework is missing or broken."""
    from ._registry import BACKENDS, get_adapter

    try:
        return get_adapter(framework)
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(f"{what} needs {framework}, which is not installed. Install it with: "
                                      f"{BACKENDS[framework].install}") from exc
    except ImportError as exc:  # installed but broken (a missing shared library, a version clash)
        raise BackendUnavailableError(f"{what} needs {framework}, which cannot be imported ({_first_line(exc)}). "
                                      f"Reinstall it with: {BACKENDS[framework].install}") from None


# ============================================================================ reading
def open_native(path: str, container: str, *, spec=None, like=None, format: str | None = None,
                files: list[SafetensorsFile] | None = None) -> "NativeCheckpoint":
    """The native checkpoint at ``path`` whose container was sniffed as ``container``.

    Safetensors containers come with their ``files`` already opened (a sharded one: every
    shard of the index, read once by the caller).
    """
    framework, container = _framework_of(path, container, format, files)
    return NativeCheckpoint(path, framework, container, spec=spec, like=like, files=files)


def _framework_of(path: str, container: str, format: str | None, files) -> tuple[str, str]:
    ext = os.path.splitext(path)[1] or "(none)"
    if container in ("safetensors", "safetensors-index"):
        if format in ("torch", "mlx"):
            return format, container
        if format is not None and format != "dense_bridge":
            raise CheckpointError(f"{path} is a safetensors file, which holds torch or MLX weights, not {format}")
        meta = files[0].metadata if files else {}
        tag = meta.get("dense_bridge_backend") or meta.get("format", "")
        if tag in ("mlx",):
            return "mlx", container
        if tag in ("pt", "torch"):
            return "torch", container
        names = [n for f in (files or []) for n in f.tensors]
        if names and all(n.startswith("layers.") for n in names):
            return "mlx", container  # mlx.nn.Sequential keeps its modules in .layers
        return "torch", container
    if container == "zip":
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
            raise CheckpointError(f"cannot read {path} (extension {ext}): a zip archive that is truncated or "
                                  f"corrupted ({_first_line(exc)})") from None
        if any(n.endswith("data.pkl") for n in names):
            return "torch", "torch-zip"
        if "config.json" in names and any(n.endswith(".weights.h5") for n in names):
            return "keras", "keras-model"
        if names and all(n.endswith(".npy") for n in names):
            return "mlx", "npz"
        raise CheckpointError(f"cannot read {path} (extension {ext}): a zip archive that is not a torch, Keras "
                              f"or .npz checkpoint (it holds {names[:5]})")
    if container in _OWN_CONTAINERS:
        framework = _OWN_CONTAINERS[container]
        if format not in (None, framework):
            raise CheckpointError(f"{path} is a {_KINDS[framework]}, which holds {framework} weights, not {format}")
        return framework, container
    if container == "hdf5":
        return "keras", "h5"
    if container == "pickle":
        return "torch", "torch-legacy"
    raise CheckpointError(f"cannot read {path}: unknown container {container}")  # pragma: no cover


class NativeCheckpoint:
    """A framework's own checkpoint file. Names, shapes and dtypes are read without a spec;
    parameters need one (``spec``/``like``) unless the file carries it (``.keras``, files we wrote)."""

    def __init__(self, path: str, framework: str, container: str, *, spec=None, like=None,
                 files: list[SafetensorsFile] | None = None) -> None:
        self.path, self.framework, self.container = path, framework, container
        self.files = files
        self.like = like
        self._info: tuple[dict, dict] | None = None
        self._template = None
        name = _NAMES[framework]
        self.kind = {"keras-model": "Keras model file (.keras)", "npz": "MLX weights file (.npz)",
                     "safetensors": f"{name} safetensors file",
                     "safetensors-index": f"{name} sharded safetensors checkpoint"}.get(container, _KINDS[framework])
        self.spec = spec if spec is not None else self._embedded_spec()
        if self.spec is None and container == "keras-model":
            self.spec = self._spec_from_model()
        elif self.spec is None and container in _CARRIES_MODEL:
            # an exported graph (a whole transformer) has no spec, yet loads as the model it is
            try:
                self.spec = self._spec_from_model()
            except CheckpointError:
                self.spec = None

    def close(self) -> None:
        """Close the safetensors files' descriptors (a loaded template stays valid)."""
        for f in self.files or []:
            f.close()

    def __enter__(self) -> "NativeCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _adapter(self):
        return file_adapter(self.framework, f"reading {self.path} ({self.kind})")

    # -- what the file says about itself
    def _file_info(self) -> tuple[dict, dict]:
        """(name -> (native shape, dtype name), metadata), from the adapter (cached)."""
        if self._info is None:
            if self.files:  # the core parsed these headers already: no framework needed
                from ._dtypes import dtype_name

                self._info = ({n: (i.shape, dtype_name(i.numpy_dtype)) for f in self.files
                               for n, i in f.tensors.items()}, dict(self.files[0].metadata))
            else:
                self._info = self._adapter().file_info(self.path, self.container, files=None)
        return self._info

    def _embedded_spec(self):
        if self.files:
            text = self.files[0].metadata.get(SPEC_KEY)
        elif self.container == "h5":
            text = self._file_info()[1].get(SPEC_KEY)
        else:
            text = None
        return spec_from_json(text, self.path) if text else None

    def _need_spec(self) -> None:
        if self.spec is None:
            name = _NAMES[self.framework]
            what = f"{'an' if name[0] in 'AEIMO' else 'a'} {name} model"
            raise CheckpointError(
                f"{self.path} ({self.kind}) holds parameters but not the model's structure (layer types, "
                f"activations). Pass spec= (a dense_bridge spec) or like= ({what} of the same architecture) to "
                "db.load; on the command line --spec SPEC.json (a spec config, or a dense_bridge checkpoint to "
                "take the spec from)")

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, native shape, dtype) of every stored tensor, in the file's own names (a
        ``.keras`` file: its model's canonical parameters, the model being loaded anyway)."""
        if self.container in _CARRIES_MODEL and self.spec is not None:
            from . import _api

            return [(k, tuple(v.shape), v.dtype.name) for k, v in _api.get_params(self.template(), copy=False).items()]
        return [(n, tuple(s), d) for n, (s, d) in self._file_info()[0].items()]

    @property
    def total_bytes(self) -> int:
        from ._dtypes import numpy_dtype

        total = 0
        for _, shape, dtype in self.entries():
            try:
                itemsize = numpy_dtype(dtype).itemsize
            except DenseBridgeError:  # an exotic dtype only affects the progress estimate
                itemsize = 4
            total += int(np.prod(shape, dtype=object)) * itemsize
        return total

    # -- template: the framework object the file is loaded into
    def template(self, borrow: bool = False):
        """The file loaded into a native model of its own framework (cached). ``borrow``: the
        model is only read from and dropped (a conversion), so the adapter may leave its tensors
        in the file's mapping (torch zip files) instead of copying them."""
        if self._template is None:
            adapter = self._adapter()
            model = None
            if self.container not in _CARRIES_MODEL:
                model = self._new_template()
            self._template = adapter.read_file(self.path, self.container, model, files=self.files, check=self._check,
                                               borrow=borrow)
        return self._template

    def _new_template(self):
        from . import _api
        from ._params import ParamSource

        if self.like is not None and _api.backend(self.like) == self.framework:
            return copy.deepcopy(self.like)  # the user's own class, whatever the spec would compile to
        self._need_spec()
        try:
            return _api.build(self.framework, ParamSource(self.spec, seed=0))
        except DenseBridgeError as exc:
            raise CheckpointError(f"{self.path}: cannot build a {self.framework} model for the spec: {exc}") from None

    def _check(self, got: dict, expected: dict) -> None:
        problems = mismatches(got, expected)
        if problems:
            src = "the given model" if self.like is not None else "the spec"
            raise CheckpointError(f"{self.path} does not match {src} ({LAYOUT_NOTES[self.framework]}): "
                                  + "; ".join(p.replace("the spec expects", "expected") for p in problems))

    def _spec_from_model(self):
        from . import _api

        try:
            return _api.to_spec(self.template())
        except (DenseBridgeError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: the {_NAMES[self.framework]} model cannot be described as a "
                                  f"dense_bridge spec: {exc}") from None

    # -- the common surface with CanonicalCheckpoint
    def param_views(self) -> dict[str, np.ndarray]:
        """Canonical parameters as views of the loaded model's memory (do not mutate)."""
        from . import _api

        params = _api.get_params(self.template(), copy=False)
        if self.spec is not None and self.container in _CARRIES_MODEL:
            from ._params import validate_params

            try:  # a .keras file carries its own architecture: it must fit the spec given
                validate_params(self.spec, params, allow_nonfinite=True)
            except ConversionError as exc:
                raise CheckpointError(f"{self.path} does not match the spec: {exc}") from None
        return params

    def pending(self) -> dict:
        """Canonical tensors to write (``_safetensors.PendingTensor``): each read from the file
        when its turn comes where the adapter serves the file directly (``file_views``), else
        views of the loaded model."""
        from ._safetensors import PendingTensor, pending

        views = self._file_views() if self.spec is not None and self.container not in _CARRIES_MODEL else None
        if views is None:
            return {k: pending(np.asarray(v)) for k, v in self.param_views().items()}
        # the adapter checked the file's shapes and dtypes against these
        return {name: PendingTensor(np.dtype(numpy_dtype(dtype)), shape, lambda n=name: np.asarray(views[n]))
                for name, (shape, dtype) in canonical_shapes(self.spec).items() if name in views}

    def params(self) -> dict[str, np.ndarray]:
        """Canonical parameters (in-memory copies)."""
        return {k: np.array(v) for k, v in self.param_views().items()}

    def native(self, backend: str, progress=None, allow_nonfinite: bool = False):
        """A native model on ``backend`` holding the file's parameters (NaN/Inf refused unless
        ``allow_nonfinite``: the one rule of load, set_params, compile and convert).

        To another backend the parameters stream layer by layer (``ParamSource(stream=)``, the
        path canonical checkpoints take): each layer is validated when the target asks for it,
        and the file pages behind the layer read before it are released (:func:`release_file_pages`),
        so a file the adapter left mapped (torch zip) is never resident whole beside the target.
        """
        from . import _api
        from ._params import ParamSource

        if backend == self.framework:
            model = self.template()
            if not allow_nonfinite and self.spec is None:  # a whole exported graph: every parameter it holds
                from .models import walk

                check_finite_params({e.param_path(n): v for e in walk(model) for n, v in e.read().items()}, self.path)
            elif not allow_nonfinite:
                check_finite_params(_api.get_params(model, copy=False), self.path)
            if progress is not None:
                progress(1, 1)
            return model
        stream = self.layer_stream(allow_nonfinite)
        try:
            out = _api.build(backend, ParamSource(self.spec, stream=stream))
        except (ConversionError, SpecError) as exc:  # SpecError: the file's spec needs more memory than there is
            raise CheckpointError(f"{self.path}: {exc}") from None
        finally:
            stream.release()
        if progress is not None:
            progress(1, 1)
        return out

    def layer_stream(self, allow_nonfinite: bool = False) -> "_ViewStream":
        """``stream(index, layer_spec)`` -> that layer's validated canonical params: views of the
        file where the adapter can serve them (``file_views``), else of a template loaded with
        ``borrow`` (a torch zip stays mapped); the pages of the layer read before are dropped."""
        from . import _api

        self._need_spec()
        views = self._file_views()
        if views is None:
            views = _api.get_params(self.template(borrow=True), copy=False)
        return _ViewStream(self.spec, views, allow_nonfinite)

    def verify_structure(self) -> None:
        """Compare the file's tensor names, shapes and dtypes with what a model of its spec saves,
        reading no values (``dense-bridge inspect``): a CheckpointError listing every difference.

        Done where the adapter serves the file without a model (``file_views``: torch zip,
        safetensors, ``.weights.h5``); a ``.keras`` file carries its own model, and other files
        (legacy torch pickles, ``.npz``) are checked when they are loaded.
        """
        if self.spec is None or self.container in _CARRIES_MODEL:
            return
        if self._file_views() is not None:
            return  # the adapter compared every name, shape and dtype
        # no per-name check here (a lone layer, a legacy pickle): at least the sizes must agree
        wanted = sum(math.prod(shape) for shape, _ in canonical_shapes(self.spec).values())
        stored = sum(math.prod(shape) for _, shape, _ in self.entries())
        if wanted != stored:
            raise CheckpointError(f"{self.path} does not match its spec: the spec has {wanted:,} parameter values, "
                                  f"the file stores {stored:,}")

    def _file_views(self):
        """The file's canonical parameters straight from the file (adapter verb ``file_views``),
        or None where the adapter offers no such path for it: no model of the file's framework
        is built, so a conversion holds the target and one layer of the file, not two models."""
        from . import _api
        from ._params import ParamSource

        serve = getattr(self._adapter(), "file_views", None)
        if serve is None or self.like is not None:  # the user's own class: only its framework reads it
            return None
        try:
            twin = _api.build(self.framework, ParamSource(structure_twin(self.spec), seed=0))
        except DenseBridgeError:
            return None  # a spec the twin cannot express: the full template path decides
        return serve(self.path, self.container, twin, self.spec, files=self.files, check=self._check)


class FileViews(Mapping):
    """What an adapter's ``file_views`` returns: canonical name -> the file's tensor in canonical
    axis order, read only when asked for (and not kept).

    ``plan``: canonical name -> (the tensor's name in the file, the axes that put the file's
    layout in canonical order: (1, 0) for an (out, in) weight, identity where the layouts agree);
    ``read(name)`` gives the file's tensor as a numpy array, a view of a mapping where it can.
    """

    def __init__(self, plan: Mapping[str, tuple[str, tuple[int, ...]]], read: Callable[[str], np.ndarray]) -> None:
        self._plan, self._read = dict(plan), read

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)

    def __getitem__(self, canonical: str) -> np.ndarray:
        name, axes = self._plan[canonical]
        return self._read(name).transpose(axes)


def canonical_shapes(spec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical name ("3.kernel", or "kernel" for a lone layer) -> (shape, dtype name) of every
    parameter ``spec`` has: what a file of it must hold, in the canonical layout."""
    from .specs import Sequential, layer_param_shapes

    layers = spec.layers if isinstance(spec, Sequential) else [spec]
    out = {}
    for i, layer in enumerate(layers):
        prefix = f"{i}." if isinstance(spec, Sequential) else ""
        for key, shape in layer_param_shapes(layer).items():
            out[prefix + key] = (tuple(shape), getattr(layer, "dtype", "float32"))
    return out


def planned_file_tensors(plan, spec) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """File tensor name -> (shape in the file, dtype name) for an adapter's ``plan``
    ({canonical name: (file tensor name, axes)}, canonical = file tensor.transpose(axes));
    None when there is no plan or it does not cover exactly ``spec``'s parameters."""
    shapes = canonical_shapes(spec)
    if plan is None or set(plan) != set(shapes):
        return None
    # canonical.shape[i] = native.shape[axes[i]], so native.shape[j] = canonical.shape[argsort(axes)[j]]
    return {name: (tuple(shapes[c][0][a] for a in np.argsort(axes)), shapes[c][1])
            for c, (name, axes) in plan.items()}


def structure_twin(spec):
    """``spec`` with every width 1 (units, in_features, Bilinear inputs; a mask becomes [[1]]):
    the same layers, classes, activations, biases and dtypes, hence the same names in any
    framework's files, for a few bytes of parameters (see the adapter verb ``file_views``)."""
    from .specs import Bilinear, Dense, Sequential

    def shrink(layer):
        if isinstance(layer, Dense):
            return layer.replace(units=1, in_features=1, mask=None if layer.mask is None else np.ones((1, 1)))
        if isinstance(layer, Bilinear):
            return layer.replace(in1_features=1, in2_features=1, units=1)
        return layer

    if isinstance(spec, Sequential):
        return Sequential([shrink(l) for l in spec.layers], in_features=None if spec.in_features is None else 1,
                          name=spec.name)
    return shrink(spec)


class _ViewStream:
    """Canonical views of a loaded template handed out layer by layer (a ParamSource stream)."""

    def __init__(self, spec, views: dict, allow_nonfinite: bool) -> None:
        from .specs import Sequential

        self._views, self._allow_nonfinite = views, allow_nonfinite
        self._sequential = isinstance(spec, Sequential)
        self._read: list[np.ndarray] = []

    def __call__(self, index: int, layer) -> dict[str, np.ndarray]:
        from ._params import check_masks_match, validate_params
        from .specs import layer_param_shapes

        self.release()  # the target holds its own copy of the layers before this one by now
        prefix = f"{index}." if self._sequential else ""
        raw = {k: self._views[prefix + k] for k in layer_param_shapes(layer) if prefix + k in self._views}
        checked = validate_params(layer, raw, argument=f"parameters of layer {index}",
                                  allow_nonfinite=self._allow_nonfinite)
        check_masks_match(layer, checked, prefix=prefix or "0.")
        self._read.extend(raw.values())
        return checked

    def release(self) -> None:
        release_file_pages(self._read)
        self._read.clear()


# ============================================================================ writing
#: Per backend: (file name endings, kind) in the order they are tried, and what the error says
#: the files end in when none fits.
OUTPUT_KINDS = {
    "torch": ([(TORCH_EXTS, "torch-pickle"), ((".safetensors",), "safetensors")],
              "torch checkpoints end in .pt, .pth, .bin or .safetensors"),
    "keras": ([((".weights.h5",), "keras-weights"), ((".keras",), "keras-model")],
              "Keras checkpoints end in .weights.h5 (weights) or .keras (whole model)"),
    "mlx": ([((".safetensors",), "safetensors"), ((".npz",), "npz")],
            "MLX checkpoints end in .safetensors or .npz"),
    "flax": ([((".msgpack",), "msgpack")], "Flax state files end in .msgpack (flax.serialization)"),
    "equinox": ([((".eqx",), "eqx")], "Equinox files end in .eqx (eqx.tree_serialise_leaves)"),
    "onnx": ([((".onnx",), "onnx")], "ONNX models end in .onnx"),
}


def output_kind(backend: str, out: str) -> str:
    """The file kind to write for ``backend`` at ``out`` (by extension); CheckpointError if none fits."""
    if backend not in OUTPUT_KINDS:
        raise CheckpointError(f"cannot write {out}: no native file format for backend {backend!r}")
    endings, expected = OUTPUT_KINDS[backend]
    lower = out.lower()
    for suffixes, kind in endings:
        if lower.endswith(suffixes):
            return kind
    raise CheckpointError(f"cannot write {out}: {expected}")


#: The suffix a temporary needs for the framework's writer to accept it (Keras insists on its
#: extensions; ``mx.savez`` appends ".npz" to a name without it).
TEMP_SUFFIX = {"torch-pickle": "", "safetensors": ".safetensors", "npz": ".npz",
                "keras-weights": ".weights.h5", "keras-model": ".keras", "msgpack": ".msgpack", "eqx": ".eqx",
               "onnx": ".onnx"}


def write_native(model, backend: str, out: str, *, spec=None) -> list[str]:
    """Write ``model`` in ``backend``'s own format at ``out`` (atomically); return the files written."""
    kind = output_kind(backend, out)
    check_writable(out)
    adapter = file_adapter(backend, f"writing {out}")
    metadata = {"dense_bridge_backend": backend}
    if spec is not None:
        metadata[SPEC_KEY] = spec_json(spec)
    try:
        with AtomicFiles(out) as tx:
            adapter.write_file(model, out, kind, temp=tx.temp_for(out, TEMP_SUFFIX[kind]), metadata=metadata)
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the framework's writer failed; temporaries are gone
        raise CheckpointError(f"cannot write {out}: {type(exc).__name__}: {_first_line(exc)} (nothing was "
                              "changed on disk)") from exc
    return [out]
