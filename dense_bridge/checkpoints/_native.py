"""Native checkpoint files (each backend's own formats), framework-free and framework-blind.

Which backend a file belongs to is decided by the formats the backends declare in their
manifests (``backends/<fw>/_manifest.py``: content sniffing, extensions, labels, temporary
suffixes; see ``dense_bridge.registry._manifest``), through the registry: :func:`identify`. Every
framework detail is left to that adapter's file verbs (``backends/<fw>/_files.py``):

- ``file_info(path, container, *, files)`` -> (name -> (native shape, dtype), metadata), no spec needed;
- ``read_file(path, container, template, *, files, check)`` -> ``template`` (the user's
  ``like`` model, or, where the adapter offers no ``file_views`` for the file, a model of that
  framework compiled from the spec through the one compile path, ``_api.build``) holding the
  file's tensors, after ``check(got, expected)`` compared names, native shapes and dtypes (every
  difference listed in one CheckpointError); a format that ``carries_model`` brings its own model;
- ``write_file(model, path, kind, *, temp, metadata)`` writes ``model`` into ``temp``, which the
  core renames to ``path`` atomically (``_io.AtomicFiles``);
- ``file_views(path, container, spec, *, files, check)`` (optional) -> the file's canonical
  tensors, read when asked for, named by the adapter from the spec: a load builds its model from
  them through ``_api.build`` (as from a canonical file), a conversion streams them;
- ``file_layout(spec, path, kind, *, temp, metadata)`` (optional): a file's skeleton for
  ``_native_stream``.

So every native layout detail stays in the adapter that defines it and is never guessed from a
shape. Safetensors files are opened by the core once (consistent against a concurrent save;
see ``_safetensors``) and handed to the adapter. A native file whose framework is not installed
raises ``BackendUnavailableError`` naming the file and the extra to install.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Callable, Iterator

import numpy as np

from ._canonical import check_finite_params, mismatches, spec_from_json, spec_json
from ._io import AtomicFiles, check_room, check_writable, write_limit_cause
from .._dtypes import numpy_dtype
from .._errors import (BackendUnavailableError, CheckpointError, ConversionError, DenseBridgeError, SpecError, first_line)
from ..registry._manifest import FileFormat, Match, Probe
from ._safetensors import SafetensorsFile
from ._validate import LayerStream

__all__ = ["SPEC_KEY", "NativeCheckpoint", "is_native", "FileViews", "open_native", "identify", "supported_formats",
           "format_names", "file_adapter", "output_kind", "temp_suffix", "write_native", "structure_twin",
           "canonical_shapes"]

SPEC_KEY = "dense_bridge_spec"
_UNASKED = object()  # NativeCheckpoint._file_views / held_codes not computed yet (None is an answer)


def _backends():
    from ..registry._backends import backends

    return backends()


def format_names() -> tuple[str, ...]:
    """What ``format=`` accepts: "dense_bridge" and every backend that declares a file format."""
    return ("dense_bridge",) + tuple(n for n, info in _backends().items() if info.manifest.formats)


def supported_formats() -> str:
    """Every readable format in words, per backend, from the registry's declarations."""
    parts = ["dense_bridge .safetensors (+ .index.json)"]
    for name, info in _backends().items():
        endings = [e for f in info.manifest.formats if f.container for e in f.extensions]
        if endings:
            parts.append(f"{info.display} {'/'.join(dict.fromkeys(endings))}")
    return ", ".join(parts)


def identify(probe: Probe, format: str | None = None) -> tuple[str, FileFormat]:
    """(backend, its FileFormat) holding the file ``probe`` describes: every registered format's
    ``sniff`` is asked (safetensors formats for safetensors files, the others for the rest); the
    highest ``Match`` wins, a tie goes to the backend registered first. ``format`` (a backend
    name) takes that backend's best format that fits at all; CheckpointError when none does or
    no format knows the file."""
    safetensors = probe.metadata is not None
    from ..registry._backends import formats

    scored = []
    for order, (backend, fmt) in enumerate(formats()):
        if fmt.sniff is None or fmt.container is None or fmt.safetensors != safetensors:
            continue
        try:
            score = int(fmt.sniff(probe))
        except DenseBridgeError:
            raise
        except Exception as exc:  # noqa: BLE001 - a backend's sniff failed: name it, never its traceback
            raise CheckpointError(f"cannot read {probe.path}: the {backend} backend's {fmt.label!r} format failed to "
                                  f"check it ({type(exc).__name__}: {first_line(exc)})") from None
        if score > Match.NO:
            scored.append((score, -order, backend, fmt))
    if format is not None and format != "dense_bridge":
        mine = [s for s in scored if s[2] == format]
        if mine:
            _, _, backend, fmt = max(mine, key=lambda s: s[:2])
            return backend, fmt
        if scored:
            label = max(scored, key=lambda s: s[:2])[3].label
            owners = " or ".join(dict.fromkeys(s[2] for s in scored))
            raise CheckpointError(f"{probe.path} is a {label}, which holds {owners} weights, not {format}")
    if not scored:
        what = f"its first bytes {probe.head[:12]!r}"
        if safetensors:
            what = "a safetensors file whose metadata and names"
        elif probe.zip_names() is not None:
            what = f"a zip archive holding {probe.zip_names()[:5]}, which"
        raise CheckpointError(f"cannot read {probe.path} (extension {probe.ext}): {what} match no supported format. "
                              f"Supported: {supported_formats()}")
    _, _, backend, fmt = max(scored, key=lambda s: s[:2])
    return backend, fmt


def is_native(obj: object) -> bool:
    """Is ``obj`` a model or layer of a registered backend (not a spec, dict or array)?"""
    from ..registry._backends import backend_of

    try:
        backend_of(obj)
    except TypeError:
        return False
    return True


def file_adapter(framework: str, what: str):
    """The adapter whose file verbs handle ``framework``'s files; BackendUnavailableError naming
    ``what`` (the file and the job) and the extra to install when the framework is missing or broken."""
    from ..registry._backends import get_adapter

    try:
        return get_adapter(framework)
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(f"{what} needs {framework}, which is not installed. Install it with: "
                                      f"{_backends()[framework].install}") from exc
    except ImportError as exc:  # installed but broken (a missing shared library, a version clash)
        raise BackendUnavailableError(f"{what} needs {framework}, which cannot be imported ({first_line(exc)}). "
                                      f"Reinstall it with: {_backends()[framework].install}") from None


# ============================================================================ reading
def open_native(path: str, probe: Probe, *, index: bool = False, spec=None, like=None, format: str | None = None,
                files: list[SafetensorsFile] | None = None) -> "NativeCheckpoint":
    """The native checkpoint at ``path``, recognised from ``probe`` (:func:`identify`).

    Safetensors containers come with their ``files`` already opened (``index``: every shard
    of a sharded checkpoint's index, read once by the caller).
    """
    framework, fmt = identify(probe, format)
    return NativeCheckpoint(path, framework, fmt, index=index, spec=spec, like=like, files=files)


class NativeCheckpoint:
    """A framework's own checkpoint file. Names, shapes and dtypes are read without a spec;
    parameters need one (``spec``/``like``) unless the file carries it (``.keras``, files we wrote)."""

    def __init__(self, path: str, framework: str, file_format: FileFormat, *, index: bool = False, spec=None,
                 like=None, files: list[SafetensorsFile] | None = None) -> None:
        self.path, self.framework, self.format = path, framework, file_format
        # what the adapter's file verbs receive: the declared container ("safetensors-index": sharded)
        self.container = file_format.container + ("-index" if index else "")
        self.index = index
        self.files = files
        self.like = like
        self._info: tuple[dict, dict] | None = None
        self._template = None
        self._views = _UNASKED
        self._codes = _UNASKED
        self.kind = file_format.label + (", sharded with an index" if index else "")
        self.spec = spec if spec is not None else self._embedded_spec()
        if self.spec is None and file_format.carries_model:
            try:
                self.spec = self._spec_from_model()
            except CheckpointError:
                if not self._loads_without_spec():
                    raise

    def close(self) -> None:
        """Close the safetensors files' descriptors (a loaded template stays valid)."""
        for f in self.files or []:
            f.close()

    def __enter__(self) -> "NativeCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def adapter(self):
        """The adapter of the file's framework (imported now); BackendUnavailableError naming
        the file and what to install when the framework is missing."""
        return file_adapter(self.framework, f"reading {self.path} ({self.kind})")

    # -- what the file says about itself
    def file_info(self) -> tuple[dict, dict]:
        """(name -> (native shape, dtype name), metadata) in the file's own names, without a spec
        (cached): from the safetensors headers the core parsed, else the adapter's ``file_info``."""
        if self._info is None:
            if self.files:  # the core parsed these headers already: no framework needed
                from .._dtypes import dtype_name

                self._info = ({n: (i.shape, dtype_name(i.numpy_dtype)) for f in self.files
                               for n, i in f.tensors.items()}, dict(self.files[0].metadata))
            else:
                self._info = self.adapter().file_info(self.path, self.container, files=None)
        return self._info

    def _embedded_spec(self):
        if self.files:
            text = self.files[0].metadata.get(SPEC_KEY)
        elif self.format.stores_metadata:
            text = self.file_info()[1].get(SPEC_KEY)
        else:
            text = None
        return spec_from_json(text, self.path) if text else None

    def _need_spec(self) -> None:
        if self.spec is None:
            name = _backends()[self.framework].display
            what = f"{'an' if name[0] in 'AEIMO' else 'a'} {name} model"
            raise CheckpointError(
                f"{self.path} ({self.kind}) holds parameters but not the model's structure (layer types, "
                f"activations). Pass spec= (a dense_bridge spec) or like= ({what} of the same architecture) to "
                "db.load; on the command line --spec SPEC.json (a spec config, or a dense_bridge checkpoint to "
                "take the spec from)")

    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, native shape, dtype) of every stored tensor, in the file's own names (a
        ``.keras`` file: its model's canonical parameters, the model being loaded anyway)."""
        if self.format.carries_model and self.spec is not None:
            from .. import _api

            return [(k, tuple(v.shape), v.dtype.name) for k, v in _api.get_params(self.template(), copy=False).items()]
        return [(n, tuple(s), d) for n, (s, d) in self.file_info()[0].items()]

    @property
    def source_backend(self) -> str:
        """The backend whose own format the file is."""
        return self.framework

    @property
    def total_bytes(self) -> int:
        from .._dtypes import numpy_dtype

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
            adapter = self.adapter()
            model = None
            if not self.format.carries_model:
                model = self._new_template()
            self._template = adapter.read_file(self.path, self.container, model, files=self.files, check=self._check,
                                               borrow=borrow)
        return self._template

    def _new_template(self):
        from .. import _api
        from ..params._source import ParamSource

        if self.like is not None and _api.backend(self.like) == self.framework:
            return copy.deepcopy(self.like)  # the user's own class, whatever the spec would compile to
        self._need_spec()
        try:
            model = _api.build(self.framework, ParamSource(self.spec, seed=0))
        except DenseBridgeError as exc:
            raise CheckpointError(f"{self.path}: cannot build a {self.framework} model for the spec: {exc}") from None
        if self.held_codes() is not None:  # the file's quantized layers, built as the framework reads them
            model = self.adapter().quant_file_template(model, self.file_info()[0], self.path)
        return model

    def held_codes(self) -> dict | None:
        """{layer name: Quant or None (the scheme needs the spec)} of the quantized layers whose
        codes the file holds (the adapter's ``quant_file_layers``, asked once); None when it holds
        none, or its framework reads none or is not installed here (no codes we could rebuild)."""
        if self._codes is _UNASKED:
            try:
                verb = getattr(self.adapter(), "quant_file_layers", None)
            except BackendUnavailableError:
                return None
            self._codes = (verb(self.file_info()[0], self.path) or None) if verb is not None else None
        return self._codes

    def _check(self, got: dict, expected: dict) -> None:
        problems = mismatches(got, expected)
        if problems:
            src = "the given model" if self.like is not None else "the spec"
            note = _backends()[self.framework].manifest.layout_note or f"{self.framework} layout"
            raise CheckpointError(f"{self.path} does not match {src} ({note}): "
                                  + "; ".join(p.replace("the spec expects", "expected") for p in problems)
                                  + (_by_name_hint(got, expected) if self.like is None else ""))

    def _loads_without_spec(self) -> bool:
        """A graph no spec describes (an exported transformer in an ``.onnx`` file) is still a model:
        it loads on its own backend and its linear layers are found by ``db.linear_layers``; only a
        conversion needs a spec. Decided by the adapter reading its layers (``walk``) without error."""
        from ..models import walk

        try:
            return bool(walk(self.template()))
        except (DenseBridgeError, TypeError):
            return False

    def _spec_from_model(self):
        from .. import _api

        try:
            return _api.to_spec(self.template())
        except (DenseBridgeError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: the {_backends()[self.framework].display} model cannot be described "
                                  "as a dense_bridge spec: "
                                  f"{exc}") from None

    # -- the common surface with CanonicalCheckpoint
    def param_views(self) -> dict[str, np.ndarray]:
        """Canonical parameters as views of the file (``file_views``) or of the loaded model's
        memory (do not mutate)."""
        from .. import _api

        views = self._file_views()
        if views is not None:
            return {name: views[name] for name in views}
        params = _api.get_params(self.template(), copy=False)
        if self.spec is not None and self.format.carries_model:
            from ..params._source import validate_params

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

        views = self._file_views() if self.spec is not None and not self.format.carries_model else None
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

        The parameters stream layer by layer (``ParamSource(stream=)``, the path canonical
        checkpoints take), onto the file's own framework too where its adapter serves the file
        (``file_views``): each layer is validated when the target asks for it, and the file pages
        behind the layer read before it are released (``LayerStream(drop_pages=True)``), so a
        file the adapter left mapped (torch zip) is never resident whole beside the target.
        Where only the framework's loader reads the file (a ``like`` model, a ``.keras`` file,
        an Equinox file, a legacy Keras layout), the model it loads into is returned.
        """
        from .. import _api
        from ..params._source import ParamSource

        if backend == self.framework and self._file_views() is None:  # only the framework's own loader reads it
            model = self.template()
            if not allow_nonfinite:
                if self.spec is None:  # a whole graph without a spec: every parameter it holds
                    from ..models import walk

                    check_finite_params({e.param_path(n): v for e in walk(model) for n, v in e.read().items()},
                                        self.path)
                else:
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

    def layer_stream(self, allow_nonfinite: bool = False, progress=None) -> LayerStream:
        """``stream(index, layer_spec)`` -> that layer's validated canonical params: views of the
        file where the adapter can serve them (``file_views``), else of a template loaded with
        ``borrow`` (a torch zip stays mapped); the pages of the layer read before are dropped."""
        from .. import _api

        self._need_spec()
        views = self._file_views()
        if views is None:
            views = _api.get_params(self.template(borrow=True), copy=False)
        return LayerStream(self.spec, views.__getitem__, views, allow_nonfinite=allow_nonfinite, progress=progress,
                           total=self.total_bytes if progress is not None else 0, drop_pages=True)

    def verify_structure(self) -> None:
        """Compare the file's tensor names, shapes and dtypes with what a model of its spec saves,
        reading no values (``dense-bridge inspect``): a CheckpointError listing every difference.

        Done where the adapter serves the file without a model (``file_views``: torch and MLX
        files, Flax msgpack, ``.weights.h5``); a ``.keras`` file carries its own model, and other
        files (Equinox) are checked when they are loaded, here only by their total size.
        """
        if self.spec is None or self.format.carries_model:
            return
        if self.held_codes() is not None:
            self.template()  # quantized layers: their shapes checked as the framework's model loads them
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
        """The file's canonical parameters straight from the file (adapter verb ``file_views``,
        asked once), or None where the adapter offers no such path for it. No model of the file's
        framework is drawn to be overwritten: a load builds its model from these views through
        the one compile path, and a conversion holds the target and one layer of the file."""
        if self._views is _UNASKED:
            self._views = None
            # like=: the user's own class, which only its framework's loader reads
            if self.like is None and self.spec is not None and not self.format.carries_model:
                serve = getattr(self.adapter(), "file_views", None)
                if serve is not None:
                    self._views = serve(self.path, self.container, self.spec, files=self.files, check=self._check)
        return self._views


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

    def __contains__(self, canonical: object) -> bool:  # from the plan: Mapping's default would read the tensor
        return canonical in self._plan

    def __getitem__(self, canonical: str) -> np.ndarray:
        name, axes = self._plan[canonical]
        return self._read(name).transpose(axes)


def _by_name_hint(got: dict, expected: dict) -> str:
    """When the file names its layers (``enc.weight``) where a spec's positions are expected
    (``0.weight``): how to match them by name instead."""
    if not got or set(got) & set(expected):
        return ""
    names = sorted({k.rsplit(".", 1)[0] for k in got})[:4]
    return (f". The file names its layers ({', '.join(names)}), a spec matches them by position (0, 1, ...): "
            "pass like= (a model of the same architecture) to match them by name")


def layer_file_plan(spec, *, container: str, kernel: str, dense_axes: tuple[int, int],
                    bilinear_axes: tuple[int, int, int]) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """canonical name -> (the framework's own tensor name, axes between the canonical and the
    framework's layout) for a model an adapter compiles from ``spec``; None when a layer holds
    parameters these rules do not describe. The rules every adapter with plain names shares:
    position ``i``'s tensors are ``<container><i>.<kernel>``, ``.bias`` and ``.mask`` (a lone
    layer: no prefix at all), a mask stored in the Dense kernel's layout (``dense_axes``), and
    activations, Identity and Flatten holding none. Adapters document their own names and axes."""
    from ..specs import Bilinear, Dense, Sequential, layer_param_shapes

    layers = spec.layers if isinstance(spec, Sequential) else [spec]
    plan: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, layer in enumerate(layers):
        prefix = f"{i}." if isinstance(spec, Sequential) else ""
        where = container + prefix if prefix else ""
        if isinstance(layer, (Dense, Bilinear)):
            plan[prefix + "kernel"] = (where + kernel, dense_axes if isinstance(layer, Dense) else bilinear_axes)
            if layer.use_bias:
                plan[prefix + "bias"] = (where + "bias", (0,))
            if isinstance(layer, Dense) and layer.mask is not None:
                plan[prefix + "mask"] = (where + "mask", dense_axes)
        elif layer_param_shapes(layer):
            return None
    return plan


def canonical_shapes(spec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical name ("3.kernel", or "kernel" for a lone layer) -> (shape, dtype name) of every
    parameter ``spec`` has: what a file of it must hold, in the canonical layout."""
    from ..specs import Sequential, layer_param_shapes

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
    framework's files, for a few bytes of parameters. For an adapter whose framework writes a
    file's structure only from a model (Keras' ``save_weights``: ``file_layout``)."""
    from ..specs import Bilinear, Dense, Sequential

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


# ============================================================================ writing
def _writable(backend: str) -> list[FileFormat]:
    return [f for f in _backends()[backend].manifest.formats if f.write_kind and f.extensions]


def output_kind(backend: str, out: str) -> str:
    """The file kind to write for ``backend`` at ``out``: the first of its declared formats whose
    extensions end the name; CheckpointError if none does."""
    writable = _writable(backend)
    if not writable:
        raise CheckpointError(f"cannot write {out}: no native file format for backend {backend!r}")
    lower = out.lower()
    for fmt in writable:
        if lower.endswith(fmt.extensions):
            return fmt.write_kind
    endings = list(dict.fromkeys(e for f in writable for e in f.extensions))
    listed = ", ".join(endings[:-1]) + " or " + endings[-1] if len(endings) > 1 else endings[0]
    raise CheckpointError(f"cannot write {out}: {_backends()[backend].display} files end in {listed}")


def temp_suffix(backend: str, kind: str) -> str:
    """The suffix a temporary of ``kind`` needs for the framework's writer to accept it (Keras
    insists on its extensions; ``mx.savez`` appends ".npz" to a name without it)."""
    return next((f.temp_suffix for f in _writable(backend) if f.write_kind == kind), "")


def write_native(model, backend: str, out: str, *, spec=None) -> list[str]:
    """Write ``model`` in ``backend``'s own format at ``out`` (atomically); return the files written."""
    kind = output_kind(backend, out)
    check_writable(out)
    adapter = file_adapter(backend, f"writing {out}")
    # the framework's own writer fills the file: it must not meet a refused write (HDF5 crashes)
    check_room(out, _tensor_bytes(spec))
    metadata = {"dense_bridge_backend": backend}
    if spec is not None:
        metadata[SPEC_KEY] = spec_json(spec)
    try:
        with AtomicFiles(out) as tx:
            adapter.write_file(model, out, kind, temp=tx.temp_for(out, temp_suffix(backend, kind)), metadata=metadata)
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the framework's writer failed; temporaries are gone
        cause = write_limit_cause(out)
        raise CheckpointError(f"cannot write {out}: {type(exc).__name__}: {first_line(exc)}"
                              f"{f' ({cause})' if cause else ''} (nothing was changed on disk)") from exc
    return [out]


def _tensor_bytes(spec) -> int:
    """The bytes of ``spec``'s canonical tensors (0 without a spec)."""
    if spec is None:
        return 0
    from .._dtypes import numpy_dtype

    return sum(int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize
               for shape, dtype in canonical_shapes(spec).values())
