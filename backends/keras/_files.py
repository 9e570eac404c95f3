"""Keras's own checkpoint files: ``.weights.h5`` (``save_weights``) and ``.keras`` (``model.save``);
the ``file_info``/``read_file``/``write_file`` verbs.

A weights file is read by Keras itself: the structure Keras writes for a model built from the
spec (saved once into a scratch file) is compared with the file's (every difference listed in
one CheckpointError), then ``load_weights`` fills the model, so the layout (kernel (in, units) as
``layers/<name>/vars/0``) is Keras's own. A file whose layers differ from the template's only in
class names (a plain ``keras.layers.Dense(activation=...)`` where the adapter builds its own
subclass) is remapped by Keras's naming rule. The spec rides in a root attribute of the HDF5 file
(``dense_bridge_spec``), returned by ``file_info`` as metadata. A ``.keras`` file carries its own
model, loaded with dense_bridge's Keras classes registered.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import shutil
import tempfile
import warnings
from typing import Callable, Mapping

import h5py
import keras
import numpy as np

from dense_bridge.checkpoints._native import FileViews, canonical_shapes
from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import CheckpointError, DenseBridgeError, first_line
from dense_bridge.params._memory_budget import available_memory
from dense_bridge.checkpoints._guard import input_file, input_path, open_input
from dense_bridge.checkpoints._safetensors import SafetensorsFile

from ._params import layer_variables
from ._to_spec import layers_of

Entries = dict  # name -> (native shape, dtype name)
SPEC_ATTR = "dense_bridge_spec"


def h5_structure(path: str) -> Entries:
    """Dataset path -> (shape, dtype) of a Keras weights file (bfloat16 from its "dtype" attribute)."""
    out: Entries = {}
    foreign: list[str] = []
    problems: list[str] = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and (obj.is_virtual or obj.external):
            foreign.append(name)
        elif isinstance(obj, h5py.Dataset):
            dtype = obj.attrs.get("dtype")
            dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
            out[name] = (tuple(int(d) for d in obj.shape), str(dtype) if dtype else obj.dtype.name)
            problem = _storage_problem(obj, size)
            if problem:
                problems.append(f"dataset {name} {problem}")

    def visit_link(name, link):
        # HDF5 resolves an external link by opening the file it names, a soft link by aliasing
        # another path; Keras never writes either, and neither is followed here
        if isinstance(link, (h5py.ExternalLink, h5py.SoftLink)):
            linked.append(f"{name} -> {getattr(link, 'filename', '')}:{link.path}")

    linked: list[str] = []
    try:
        with input_path(path, what="Keras HDF5 file") as checked, h5py.File(checked, "r") as f:
            size = os.path.getsize(checked)
            f.visititems_links(visit_link)
            if not linked:
                f.visititems(visit)
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - h5py raises OSError/KeyError/RuntimeError for bad files
        raise CheckpointError(f"cannot read {path}: not a readable HDF5 file ({first_line(exc)}; truncated or "
                              "corrupted?)") from None
    if linked:
        raise CheckpointError(f"{path}: links {linked[:5]} point elsewhere (HDF5 external or soft links, which "
                              "could read other files); dense_bridge does not follow them")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems[:5]) + (" (truncated or corrupted?)"))
    if foreign:
        # values kept in other files, named by this one (Keras itself would read them): never followed
        raise CheckpointError(f"{path}: datasets {foreign[:5]} keep their values in other files (virtual or "
                              "external storage), which dense_bridge does not follow")
    return out


def _storage_problem(dataset, file_size: int) -> str | None:
    """Why ``dataset``'s stored bytes cannot be its values, or None. HDF5 reads storage that was
    never written (an unallocated dataset, a missing chunk) as the fill value, zeros by default:
    a weights file must store every value, inside the file, in a numeric (or bfloat16 void) type."""
    if dataset.dtype.kind not in "fiuV" or (dataset.dtype.kind == "V" and dataset.dtype.itemsize != 2):
        return f"has type {dataset.dtype}, not a number"
    nbytes = math.prod(dataset.shape or ()) * dataset.dtype.itemsize
    if nbytes == 0:
        return None
    if dataset.chunks is None:
        offset, stored = dataset.id.get_offset(), dataset.id.get_storage_size()
        if stored < nbytes:
            return f"stores {stored} of its {nbytes} bytes (the rest would read as zeros)"
        if offset is not None and offset + nbytes > file_size:
            return f"claims bytes {offset}..{offset + nbytes} but the file has {file_size}"
        return None
    expected = math.prod(-(-n // c) for n, c in zip(dataset.shape, dataset.chunks))
    count = dataset.id.get_num_chunks()
    if count != expected:
        return f"stores {count} of its {expected} chunks (the rest would read as zeros)"
    for i in range(count):  # bounded by the file: every stored chunk has an index entry in it
        info = dataset.id.get_chunk_info(i)
        if info.byte_offset is None or info.byte_offset + info.size > file_size:
            return f"has a chunk at bytes {info.byte_offset}..+{info.size} but the file has {file_size}"
    return None


def _h5_spec_attr(path: str) -> str | None:
    try:
        with input_path(path, what="Keras HDF5 file") as checked, h5py.File(checked, "r") as f:
            raw = f.attrs.get(SPEC_ATTR)
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - see h5_structure
        raise CheckpointError(f"cannot read {path}: not a readable HDF5 file ({first_line(exc)}; truncated or "
                              "corrupted?)") from None
    if raw is None:
        return None
    if isinstance(raw, bytes):
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise CheckpointError(f"{path}: its {SPEC_ATTR} attribute is not UTF-8 text") from None
    if not isinstance(raw, str):
        raise CheckpointError(f"{path}: its {SPEC_ATTR} attribute is not text (it is a {type(raw).__name__})")
    return raw


_VAR = re.compile(r"^layers/([^/]+)/vars/(\d+)$")
_SUFFIX = re.compile(r"^(.*?)(?:_(\d+))?$")


def _snake(name: str) -> str:
    """Keras' own naming of saved layers: the class name in snake_case (keras.src.utils.naming)."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _var_groups(struct: Entries) -> dict[str, list[str]] | None:
    """layer group -> its variable paths, for a flat Sequential/functional file; None otherwise."""
    groups: dict[str, list[str]] = {}
    for path in struct:
        m = _VAR.match(path)
        if m is None:
            return None
        groups.setdefault(m.group(1), []).append(path)
    return groups


def layer_groups(entries: dict) -> dict[str, dict[int, tuple]]:
    """layer group -> {variable index: (shape, dtype)} of a ``.weights.h5``'s flat layers."""
    out: dict[str, dict[int, tuple]] = {}
    for name, info in entries.items():
        parts = name.split("/")
        if len(parts) == 4 and parts[0] == "layers" and parts[2] == "vars" and parts[3].isdigit():
            out.setdefault(parts[1], {})[int(parts[3])] = (tuple(info[0]), info[1])
    return out


def saved_names(model) -> list[tuple[object, str]]:
    """(layer, the group name Keras saves it under) for each layer of ``model`` in order:
    snake_case(class name), then ``_1``, ``_2``... for later layers of the same class."""
    used: dict[str, int] = {}
    out = []
    for layer in getattr(model, "layers", [model]):
        base = _snake(type(layer).__name__)
        out.append((layer, base if base not in used else f"{base}_{used[base] + 1}"))
        used[base] = used.get(base, -1) + 1
    return out


def _mapping(model, got: Entries, expected: Entries) -> dict[str, str] | None:
    """File variable path -> template variable path when the two differ only in class names.

    Keras names each saved layer snake_case(class) plus a per-class counter in layer order, so
    within one class the counter gives the order. Remapped only when the file's layers with
    variables are all of one class (the order is then certain) and the counts match.
    """
    fg, eg = _var_groups(got), _var_groups(expected)
    if fg is None or eg is None or len(fg) != len(eg):
        return None
    if len({_SUFFIX.match(n).group(1) for n in fg}) != 1:
        return None
    file_order = sorted(fg, key=lambda n: int(_SUFFIX.match(n).group(2) or 0))
    template_order = [name for _, name in saved_names(model) if name in eg]
    if len(template_order) != len(eg):
        return None
    mapping = {}
    for f, t in zip(file_order, template_order):
        if len(fg[f]) != len(eg[t]):
            return None
        for path in fg[f]:
            mapping[path] = f"layers/{t}/vars/{path.rsplit('/', 1)[1]}"
    return mapping


def _copy_datasets(src_path: str, dst_path: str, mapping: dict[str, str]) -> None:
    """Replace datasets of ``dst_path`` by those of ``src_path`` (attributes, e.g. bfloat16, kept)."""
    with input_path(src_path, what="Keras HDF5 file") as checked, h5py.File(checked, "r") as src, \
            h5py.File(dst_path, "a") as dst:
        for s_path, d_path in mapping.items():
            if d_path in dst:
                del dst[d_path]
            parent, name = d_path.rsplit("/", 1)
            src.copy(src[s_path], dst.require_group(parent), name=name)


class _named:
    """``path`` under a name Keras accepts (it insists on the extension): a symlink in a temp dir."""

    def __init__(self, path: str, suffix: str) -> None:
        self.path, self.suffix, self.dir = path, suffix, None

    def __enter__(self) -> str:
        if self.path.endswith(self.suffix):
            return self.path
        self.dir = tempfile.mkdtemp(prefix="dense_bridge-")
        link = os.path.join(self.dir, "file" + self.suffix)
        try:
            os.symlink(os.path.abspath(self.path), link)
        except OSError:  # pragma: no cover - filesystems without symlinks
            shutil.copyfile(self.path, link)
        return link

    def __exit__(self, *exc) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


#: A ``.keras`` member may expand at most this much over its stored size (Keras stores members
#: uncompressed; DEFLATE itself tops out near 1032:1) once it is larger than the floor below.
_ZIP_MAX_EXPANSION = 100
_ZIP_EXPANSION_FLOOR = 1 << 24


def _check_archive(path: str) -> None:
    """Refuse a ``.keras`` archive whose members would expand beyond reason before Keras reads
    them: Keras's own guard starts at 4 GiB per member, so a 3.9 GiB member deflated into a few
    megabytes would still be read into memory whole. Each member may expand at most
    _ZIP_MAX_EXPANSION times over _ZIP_EXPANSION_FLOOR, and all of them together must fit the
    memory available (MemAvailable)."""
    import zipfile

    try:
        with input_file(path, what="Keras model archive") as handle, zipfile.ZipFile(handle) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path} as a Keras model: {first_line(exc)}") from None
    for info in members:
        if info.file_size > _ZIP_EXPANSION_FLOOR and info.file_size > _ZIP_MAX_EXPANSION * max(info.compress_size, 1):
            raise CheckpointError(f"{path}: archive member {info.filename!r} claims {info.file_size:,} bytes from "
                                  f"{info.compress_size:,} stored (a decompression bomb?): refused")
    total = sum(i.file_size for i in members if i.compress_type != zipfile.ZIP_STORED)
    available = available_memory()
    if available is not None and total > available:
        raise CheckpointError(f"{path}: its compressed members expand to {total:,} bytes but only {available:,} "
                              "bytes of memory are available (MemAvailable): refused")


def _load_model(path: str):
    _check_archive(path)
    with input_path(path, what="Keras model archive") as checked, _named(checked, ".keras") as named:
        try:
            return keras.saving.load_model(named)
        except Exception as exc:  # noqa: BLE001 - keras raises many types for bad or foreign files
            raise CheckpointError(f"cannot read {path} as a Keras model: {first_line(exc)} (custom layers must "
                                  "be registered with keras.saving.register_keras_serializable)") from None


def file_info(path: str, container: str, *, files: list[SafetensorsFile] | None = None
              ) -> tuple[Entries, dict[str, str]]:
    """(name -> (native shape, dtype name), string metadata) of a Keras file, without a spec.

    ``.weights.h5``: dataset paths; metadata holds the spec attribute when the file has one.
    ``.keras``: the model's weights by variable path (the model is loaded to read them).
    """
    if container == "keras-model":
        model = _load_model(path)
        return {v.path: (tuple(v.shape), str(v.dtype)) for v in model.weights}, {}
    if container != "h5":
        raise CheckpointError(f"cannot read {path} as a Keras file (container {container!r})")
    spec = _h5_spec_attr(path)
    return h5_structure(path), ({SPEC_ATTR: spec} if spec else {})


def read_file(path: str, container: str, template, *, files: list[SafetensorsFile] | None = None,
              check: Callable[[Entries, Entries], None], borrow: bool = False):
    """A Keras model holding the file's weights: ``template`` (built for the spec) filled from a
    ``.weights.h5`` (``check(got, expected)`` lists every difference first), or the model a
    ``.keras`` file carries (``template`` None). ``borrow`` changes nothing here (TF copies)."""
    if container == "keras-model":
        return _load_model(path)
    if template is None:
        raise CheckpointError(f"{path}: a Keras weights file needs the model's structure (spec= or like=)")
    d = tempfile.mkdtemp(prefix="dense_bridge-")
    try:
        # the structure Keras itself writes for this model: save it once and read it back
        scratch = os.path.join(d, "template.weights.h5")
        template.save_weights(scratch)
        expected, got = h5_structure(scratch), h5_structure(path)
        source = path
        if set(got) != set(expected):
            mapping = _mapping(template, got, expected)
            if mapping is not None:
                got = {mapping[k]: v for k, v in got.items()}
                check(got, expected)
                _copy_datasets(path, scratch, mapping)
                source = scratch
        check(got, expected)
        with input_path(source, what="Keras HDF5 file") as checked, _named(checked, ".weights.h5") as named:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # keras only warns when some weights did not load
                    template.load_weights(named)
            except Exception as exc:  # noqa: BLE001 - keras raises ValueError/KeyError/UserWarning
                raise CheckpointError(f"cannot load {path} into the Keras model: {first_line(exc)}") from None
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return template


# ------------------------------------------------------------------ streaming a weights file
def file_views(path: str, container: str, spec, *, files: list[SafetensorsFile] | None = None,
               check: Callable[[Entries, Entries], None]) -> Mapping[str, np.ndarray] | None:
    """The canonical parameters of a ``.weights.h5`` read straight from the file, no Keras model
    built: what a conversion to another framework needs, which copies each layer once.

    Keras' own ``save_weights`` of :func:`_twin` (the layer classes :func:`compile` builds for
    ``spec``, every width 1) gives the dataset paths the file must have; each variable's canonical name comes from its layer's
    own ``save_own_variables`` store (Dense: kernel "0", bias "1"; the mask "mask"), never from a
    shape. The file is checked against the spec's shapes and dtypes with ``check`` (every
    difference in one CheckpointError) before anything is read. Returns canonical name ->
    array, each read when first asked for (``FileViews`` over :class:`DatasetReader`); None where this path does
    not apply (a ``.keras`` file, a lone layer, names only Keras' loader can resolve): the
    caller then loads a full template with :func:`read_file`.
    """
    twin = _twin(spec) if container == "h5" else None
    if twin is None:
        return None
    if any(0 in v and v[0][1] == "int8" for v in layer_groups(h5_structure(path)).values()):
        return None  # quantized layers: Keras' own loader reads the file into a quantized template
    roles = _roles(twin)
    if roles is None:
        return None
    d = tempfile.mkdtemp(prefix="dense_bridge-")
    try:
        scratch = os.path.join(d, "twin.weights.h5")
        twin.save_weights(scratch)
        twin_paths = set(h5_structure(scratch))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if twin_paths != set(roles):
        return None  # the twin saves something this reader does not know: let Keras load it
    shapes = canonical_shapes(spec)
    expected = {p: (shapes[name][0], shapes[name][1]) for p, name in roles.items()}
    got = h5_structure(path)
    source_of = {p: p for p in got}  # template path -> the file's own dataset path
    if set(got) != set(expected):
        mapping = _mapping(twin, got, expected)
        if mapping is not None:
            source_of = {mapping[p]: p for p in got}
            got = {mapping[k]: v for k, v in got.items()}
    check(got, expected)
    reader = DatasetReader(path, {source_of[p]: expected[p] for p in roles})
    return FileViews({roles[p]: (source_of[p], tuple(range(len(expected[p][0])))) for p in roles}, reader.read)


def _twin(spec):
    """The Keras model :func:`compile` builds for ``spec`` with every width 1
    (``structure_twin``), or None where that is no Sequential model. Keras names a weights file's
    groups after its layers' classes and counts, and writes them (attributes included) only
    through ``save_weights`` of a model of those classes: width 1 makes that model a few bytes."""
    from dense_bridge.params._source import ParamSource
    from dense_bridge.checkpoints._native import structure_twin

    from ._layers import compile

    small = structure_twin(spec)
    try:
        twin = compile(small, ParamSource(small, seed=0))
    except DenseBridgeError:
        return None
    return twin if isinstance(twin, keras.Model) else None


def _roles(twin) -> dict[str, str] | None:
    """Dataset path -> canonical parameter name ("0.kernel") for a compiled Sequential; None when
    a layer stores something that is not one of its canonical variables."""
    layers, keyed = layers_of(twin)
    position = {id(layer): i for i, layer in enumerate(layers)}
    roles: dict[str, str] = {}
    for layer, group in saved_names(twin):
        if id(layer) not in position:
            continue
        try:
            canonical = layer_variables(layer)
        except DenseBridgeError:
            return None
        if not canonical:
            continue
        store: dict = {}
        layer.save_own_variables(store)
        prefix = f"{position[id(layer)]}." if keyed else ""
        for key, value in store.items():
            name = next((n for n, v in canonical.items() if v is value), None)
            if name is None:
                return None
            roles[f"layers/{group}/vars/{key}"] = prefix + name
    return roles


class DatasetReader:
    """A dataset's values by its path in the file, read when asked for and not kept.

    A contiguous, unfiltered dataset in native byte order is mapped copy-on-write from one
    descriptor opened once (a save that replaces the file meanwhile does not change what is
    read); its clean pages are the file's, which the caller may drop after copying the layer.
    Anything else (chunked, compressed, big-endian) is read by h5py from the same descriptor.
    The byte range is checked against the file's size before mapping, so a dataset that claims
    more than the file holds is a CheckpointError, never a SIGBUS.
    """

    def __init__(self, path: str, entries: dict[str, tuple[tuple[int, ...], str]]) -> None:
        self.path, self._entries = path, entries  # dataset path -> (shape, dtype) the spec expects

    def read(self, dataset_path: str) -> np.ndarray:
        shape, dtype_name = self._entries[dataset_path]
        dtype = numpy_dtype(dtype_name)
        fd = open_input(self.path, what="Keras HDF5 file")
        try:
            with os.fdopen(os.dup(fd), "rb") as handle:
                try:
                    with h5py.File(handle, "r") as f:
                        return self._read(f[dataset_path], fd, shape, dtype, dataset_path)
                except (DenseBridgeError, MemoryError):
                    raise
                except Exception as exc:  # noqa: BLE001 - h5py raises OSError/KeyError/RuntimeError
                    raise CheckpointError(f"cannot read {dataset_path} from {self.path}: {first_line(exc)}") \
                        from None
        finally:
            os.close(fd)

    def _read(self, dataset, fd: int, shape, dtype: np.dtype, where: str) -> np.ndarray:
        nbytes = dtype.itemsize * math.prod(shape)
        if tuple(dataset.shape) != tuple(shape) or dataset.dtype.itemsize != dtype.itemsize:
            raise CheckpointError(f"{self.path}: dataset {where} changed while it was read")
        if dataset.is_virtual or dataset.external:  # the file was replaced since h5_structure looked
            raise CheckpointError(f"{self.path}: datasets ['{where}'] keep their values in other files (virtual "
                                  "or external storage), which dense_bridge does not follow")
        offset = dataset.id.get_offset()
        plain = dataset.chunks is None and dataset.compression is None and dataset.dtype.isnative \
            and offset is not None
        if plain and nbytes:
            if offset + nbytes > os.fstat(fd).st_size:
                raise CheckpointError(f"{self.path}: dataset {where} claims bytes {offset}..{offset + nbytes} "
                                      f"but the file has {os.fstat(fd).st_size} (truncated?)")
            skip = offset % mmap.ALLOCATIONGRANULARITY
            mapped = mmap.mmap(fd, skip + nbytes, access=mmap.ACCESS_COPY, offset=offset - skip)
            return np.frombuffer(mapped, dtype=dtype, count=math.prod(shape), offset=skip).reshape(shape)
        available = available_memory()
        if available is not None and nbytes > available:  # compressed: the file's size bounds nothing
            raise CheckpointError(f"{self.path}: dataset {where} decompresses to {nbytes:,} bytes but only "
                                  f"{available:,} bytes of memory are available (MemAvailable)")
        raw = dataset[()]  # shape and item size were checked against the spec, the size against memory
        if raw.dtype.kind == "V" or dtype.name == "bfloat16":
            return np.ascontiguousarray(raw).view(dtype).reshape(shape)
        return np.asarray(raw, dtype=dtype).reshape(shape)


def write_file(model, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``model`` into ``temp``, the temporary the core renames to ``path``.

    ``kind``: "keras-weights" (``save_weights``; ``metadata[SPEC_ATTR]`` stored as a root
    attribute) or "keras-model" (``model.save``: the whole model).
    """
    if kind == "keras-weights":
        model.save_weights(temp)
        spec = (metadata or {}).get(SPEC_ATTR)
        if spec:
            with h5py.File(temp, "a") as f:
                f.attrs[SPEC_ATTR] = spec
    elif kind == "keras-model":
        model.save(temp)
    else:
        raise CheckpointError(f"cannot write {path}: Keras writes .weights.h5 or .keras, not {kind!r}")


def file_layout(spec, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None):
    """A ``.weights.h5`` for ``spec`` laid out in ``temp`` with every dataset's bytes left to fill,
    and where each canonical tensor goes (``_native_stream.FileLayout``; Keras' layout is the
    canonical one, so every ``axes`` is the identity).

    Keras' own ``save_weights`` of :func:`_twin` writes the file (groups, attributes, dataset
    names: what ``load_weights`` expects); each variable's dataset is then replaced by one of the
    full shape with the twin's HDF5 type and attributes, contiguous, its storage allocated at
    creation and never filled (a sparse region), and its offset read from HDF5. None for
    ``.keras`` files and twins whose variables :func:`_roles` cannot name.
    """
    from dense_bridge.checkpoints._native_stream import FileLayout

    twin = _twin(spec) if kind == "keras-weights" else None
    if twin is None:
        return None
    roles = _roles(twin)
    if roles is None:
        return None
    twin.save_weights(temp)
    shapes = canonical_shapes(spec)
    places = {}
    with h5py.File(temp, "a") as f:
        if set(_datasets(f)) != set(roles):
            return None
        for dataset_path, canonical in roles.items():
            old = f[dataset_path]
            attrs, htype = dict(old.attrs), old.id.get_type()
            parent, name = dataset_path.rsplit("/", 1)
            del f[dataset_path]
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_layout(h5py.h5d.CONTIGUOUS)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # an offset now, the bytes come later
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # no zeros written first
            shape = shapes[canonical][0]
            dsid = h5py.h5d.create(f[parent].id, name.encode(), htype, h5py.h5s.create_simple(shape), dcpl=dcpl)
            dataset = h5py.Dataset(dsid)
            for key, value in attrs.items():
                dataset.attrs[key] = value
            offset = dsid.get_offset()
            if offset is None or htype.get_size() != numpy_dtype(shapes[canonical][1]).itemsize:
                return None
            places[canonical] = (offset, tuple(range(len(shape))))
        if metadata and metadata.get(SPEC_ATTR):
            f.attrs[SPEC_ATTR] = metadata[SPEC_ATTR]
    return FileLayout(places)


def _datasets(f) -> list[str]:
    found = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    return found
