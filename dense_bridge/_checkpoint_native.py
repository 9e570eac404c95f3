"""Native checkpoint files: torch state dicts, Keras weights/models, MLX arrays; read and written.

Reading goes through the framework itself: a template model is compiled from the spec (or
copied from ``like``), its own state names, native shapes and dtypes are compared with the
file's (every difference listed in one CheckpointError), then the framework loads the file
into it (``load_state_dict``, ``load_weights``) and ``db.get_params`` gives the canonical
parameters. So every native layout detail (torch weight (out, in), the mask buffer stored like
the weight, MLX Bilinear (out, in2, in1), Keras per-layer ``vars/0``...) stays in the adapter
that defines it and is never guessed from a shape.

Safetensors files (torch's and MLX's) are read with dense_bridge's own reader, opened once
(consistent against a concurrent save; see ``_safetensors``), also for MLX: ``mx.load``
would re-open the path, and refuses F64 tensors that other tools write.

Writing: torch ``.pt/.pth/.bin`` = ``torch.save(model.state_dict())``, torch or MLX
``.safetensors`` (the native names and layouts; the spec rides along in the metadata as
``dense_bridge_spec``), Keras ``.weights.h5`` (``save_weights``; spec in a root attribute)
and ``.keras`` (``model.save``), MLX ``.npz`` (``mx.savez``). All atomic. An MLX
``.safetensors`` holding float64 is refused: MLX itself neither writes nor reads F64
safetensors (``mx.load``: "unsupported dtype F64"), so MLX users could not open the file;
float64 goes to ``.npz``, which MLX reads.

Reading or writing a framework's format without that framework installed is a
CheckpointError naming the extra to install (``pip install 'dense-bridge[torch]'``).
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
import warnings
import zipfile

import numpy as np

from ._checkpoint_io import AtomicFiles, check_writable
from ._errors import CheckpointError, ConversionError, DenseBridgeError
from ._safetensors import PendingTensor, SafetensorsFile, pending, write_safetensors

FORMATS = ("dense_bridge", "torch", "keras", "mlx")
SPEC_KEY = "dense_bridge_spec"
TORCH_EXTS = (".pt", ".pth", ".bin")
LAYOUT_NOTES = {
    "torch": "torch layout: Linear weight (out_features, in_features), mask like the weight",
    "mlx": "MLX layout: Linear weight (out_features, in_features), Bilinear weight (out, in2, in1)",
    "keras": "Keras layout: Dense kernel (in_features, units) as layers/<name>/vars/0",
}
_KINDS = {"torch": "torch state dict", "keras": "Keras weights file", "mlx": "MLX weights file"}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _mlx_dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _torch_dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _torch_to_numpy(t) -> np.ndarray:
    import torch

    from ._dtypes import numpy_dtype

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()


def _numpy_to_mlx(arr: np.ndarray, name: str, path: str):
    """An MLX array copying ``arr`` in its own dtype (mx.array alone would turn float64 into float32)."""
    import mlx.core as mx

    dtype = getattr(mx, arr.dtype.name, None)
    if not isinstance(dtype, mx.Dtype):
        raise CheckpointError(f"cannot read {path}: tensor {name!r} has dtype {arr.dtype.name}, which MLX has not")
    return mx.array(arr, dtype=dtype)


def _numpy_to_torch(arr: np.ndarray):
    import torch

    arr = np.ascontiguousarray(arr)
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


# ============================================================================ reading
def open_native(path: str, container: str, *, spec=None, like=None, format: str | None = None,
                files: list[SafetensorsFile] | None = None) -> "NativeCheckpoint":
    """The native checkpoint at ``path`` whose container was sniffed as ``container``.

    Safetensors containers come with their ``files`` already opened (a sharded one: every
    shard of the index, read once by the caller).
    """
    framework, container = _framework_of(path, container, format, files)
    return NativeCheckpoint(path, framework, container, spec=spec, like=like, files=files)


def require_framework(framework: str, what: str) -> None:
    """CheckpointError naming the extra to install when ``framework`` is missing for ``what``."""
    from ._errors import BackendUnavailableError
    from ._registry import BACKENDS, get_adapter

    try:
        get_adapter(framework)
    except BackendUnavailableError:
        raise CheckpointError(f"{what} needs {framework}, which is not installed. Install it with: "
                              f"{BACKENDS[framework].install}") from None
    except ImportError as exc:  # installed but broken (a missing shared library, a version clash)
        raise CheckpointError(f"{what} needs {framework}, which cannot be imported ({_first_line(exc)}). "
                              f"Reinstall it with: {BACKENDS[framework].install}") from None


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
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
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
        self._state: dict | None = None
        self._template = None
        name = {"torch": "torch", "keras": "Keras", "mlx": "MLX"}[framework]
        self.kind = {"keras-model": "Keras model file (.keras)", "npz": "MLX weights file (.npz)",
                     "safetensors": f"{name} safetensors file",
                     "safetensors-index": f"{name} sharded safetensors checkpoint"}.get(container, _KINDS[framework])
        self.spec = spec if spec is not None else self._embedded_spec()
        if self.spec is None and container == "keras-model":
            self.spec = self._spec_from_model()

    def close(self) -> None:
        """Close the safetensors files' descriptors (a loaded template stays valid)."""
        for f in self.files or []:
            f.close()

    def __enter__(self) -> "NativeCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _require(self) -> None:
        require_framework(self.framework, f"reading {self.path} ({self.kind})")

    # -- what the file says about itself
    def _embedded_spec(self):
        from .checkpoint import _spec_from_json

        text = None
        if self.files:
            text = self.files[0].metadata.get(SPEC_KEY)
        elif self.container == "h5":
            h5 = _h5py()
            try:
                with h5.File(self.path, "r") as f:
                    raw = f.attrs.get(SPEC_KEY)
            except OSError as exc:
                raise CheckpointError(f"cannot read {self.path}: not a readable HDF5 file "
                                      f"({_first_line(exc)}; truncated or corrupted?)") from None
            text = raw.decode() if isinstance(raw, bytes) else raw
        return _spec_from_json(text, self.path) if text else None

    def _need_spec(self) -> None:
        if self.spec is None:
            what = {"torch": "a torch model", "keras": "a Keras model", "mlx": "an MLX model"}[self.framework]
            raise CheckpointError(
                f"{self.path} ({self.kind}) holds parameters but not the model's structure (layer types, "
                f"activations). Pass spec= (a dense_bridge spec) or like= ({what} of the same architecture) to "
                "db.load; on the command line --spec SPEC.json (a spec config, or a dense_bridge checkpoint to "
                "take the spec from)")

    # -- entries and raw state
    def entries(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, native shape, dtype) of every stored tensor, in the file's own names."""
        if self.files:
            from ._dtypes import dtype_name

            return [(n, i.shape, dtype_name(i.numpy_dtype)) for f in self.files for n, i in f.tensors.items()]
        if self.container == "h5":
            return [(n, s, d) for n, (s, d) in _h5_structure(self.path).items()]
        if self.container == "keras-model":
            from . import _api

            return [(k, tuple(v.shape), v.dtype.name) for k, v in _api.get_params(self.template(), copy=False).items()]
        state = self._raw_state()
        if self.framework == "torch":
            return [(k, tuple(v.shape), _torch_dtype_name(v.dtype)) for k, v in state.items()]
        return [(k, tuple(v.shape), _mlx_dtype_name(v.dtype)) for k, v in state.items()]

    @property
    def total_bytes(self) -> int:
        from ._dtypes import numpy_dtype

        total = 0
        for _, shape, dtype in self.entries():
            try:
                total += int(np.prod(shape)) * numpy_dtype(dtype).itemsize
            except Exception:  # noqa: BLE001 - an exotic dtype only affects the progress estimate
                total += int(np.prod(shape)) * 4
        return total

    def _raw_state(self) -> dict:
        if self._state is None:
            self._require()
            if self.framework == "torch":
                self._state = self._torch_state()
            elif self.framework == "mlx":
                self._state = self._mlx_state()
            else:  # pragma: no cover - keras files are read by keras itself
                raise AssertionError(self.framework)
        return self._state

    def _torch_state(self) -> dict:
        import torch

        if self.files:
            return {n: _numpy_to_torch(f.get(n)) for f in self.files for n in f.tensors}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's own notes about the legacy format
                state = torch.load(self.path, map_location="cpu", weights_only=True,
                                   mmap=self.container == "torch-zip")
        except Exception as exc:  # noqa: BLE001 - torch raises many types for bad files
            text = _first_line(exc)
            if "Weights only load failed" in str(exc):
                text = ("it holds pickled Python objects besides tensors, which torch.load(weights_only=True) "
                        "refuses (save model.state_dict() instead of the model)")
            raise CheckpointError(f"cannot read {self.path} as a torch checkpoint: {text}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"cannot read {self.path}: it holds a {type(state).__name__}, not a state dict "
                                  "(save model.state_dict())")
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"cannot read {self.path}: not a plain state dict; entries {bad[:6]} are not "
                                  "tensors (a training checkpoint? save checkpoint['model'] or the model's "
                                  "state_dict() on its own)")
        return state

    def _mlx_state(self) -> dict:
        import mlx.core as mx

        if self.files:
            # our reader, not mx.load(path): the files stay the ones opened (a concurrent save may
            # have replaced the path by now), and F64 (which mx.load refuses) reads too
            return {n: _numpy_to_mlx(f.get(n), n, self.path) for f in self.files for n in f.tensors}
        try:
            return dict(mx.load(self.path))
        except Exception as exc:  # noqa: BLE001 - mlx raises RuntimeError/ValueError for bad files
            raise CheckpointError(f"cannot read {self.path} as MLX weights: {_first_line(exc)}") from None

    # -- template: the framework object the file is loaded into
    def template(self):
        """The file loaded into a native model of its own framework (cached)."""
        if self._template is None:
            self._require()
            loader = {"torch": self._load_torch, "mlx": self._load_mlx, "keras": self._load_keras}[self.framework]
            self._template = loader()
        return self._template

    def _compile_template(self):
        from . import _api

        self._need_spec()
        try:
            return _api.compile(self.spec, self.framework, seed=0)
        except DenseBridgeError as exc:
            raise CheckpointError(f"{self.path}: cannot build a {self.framework} model for the spec: {exc}") from None

    def _check(self, got: dict, expected: dict) -> None:
        from .checkpoint import _mismatches

        problems = _mismatches(got, expected)
        if problems:
            src = "the given model" if self.like is not None else "the spec"
            raise CheckpointError(f"{self.path} does not match {src} ({LAYOUT_NOTES[self.framework]}): "
                                  + "; ".join(p.replace("the spec expects", "expected") for p in problems))

    def _load_torch(self):
        from . import _api

        if self.like is not None and _api.backend(self.like) == "torch":
            model = copy.deepcopy(self.like)
        else:
            model = self._compile_template()
        state = self._raw_state()
        expected = {k: (tuple(v.shape), _torch_dtype_name(v.dtype)) for k, v in model.state_dict().items()}
        self._check({k: (tuple(v.shape), _torch_dtype_name(v.dtype)) for k, v in state.items()}, expected)
        try:
            model.load_state_dict(state, strict=True)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"cannot load {self.path} into the torch model: {_first_line(exc)}") from None
        return model

    def _load_mlx(self):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        model = self._compile_template()
        state = self._raw_state()
        expected = {k: (tuple(v.shape), _mlx_dtype_name(v.dtype)) for k, v in tree_flatten(model.parameters())}
        self._check({k: (tuple(v.shape), _mlx_dtype_name(v.dtype)) for k, v in state.items()}, expected)
        try:
            model.load_weights(list(state.items()), strict=True)
        except (ValueError, RuntimeError) as exc:
            raise CheckpointError(f"cannot load {self.path} into the MLX model: {_first_line(exc)}") from None
        mx.eval(model.parameters())
        return model

    def _load_keras(self):
        if self.container == "keras-model":
            return self._keras_model()
        model = self._compile_template()
        d = tempfile.mkdtemp(prefix="dense_bridge-")
        try:
            # the structure Keras itself writes for this model: save it once and read it back
            scratch = os.path.join(d, "template.weights.h5")
            model.save_weights(scratch)
            expected, got = _h5_structure(scratch), _h5_structure(self.path)
            source = self.path
            if set(got) != set(expected):
                mapping = _keras_mapping(model, got, expected)
                if mapping is not None:
                    # the same layers under other class names (a plain keras Dense(activation=...)
                    # where the adapter builds its subclass): move the datasets to the template's names
                    got = {mapping[k]: v for k, v in got.items()}
                    self._check(got, expected)
                    _copy_datasets(self.path, scratch, mapping)
                    source = scratch
            self._check(got, expected)
            with _keras_named(source, ".weights.h5") as named:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("error")  # keras only warns when some weights did not load
                        model.load_weights(named)
                except Exception as exc:  # noqa: BLE001 - keras raises ValueError/KeyError/UserWarning
                    raise CheckpointError(f"cannot load {self.path} into the Keras model: {_first_line(exc)}") \
                        from None
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return model

    def _keras_model(self):
        import keras

        from ._registry import get_adapter

        # dense_bridge's own Keras classes (DenseBridgeDense, Bilinear, ExactActivation, ...) are
        # registered when the adapter is imported; a fresh process has not imported it yet
        get_adapter("keras")
        with _keras_named(self.path, ".keras") as named:
            try:
                return keras.saving.load_model(named)
            except Exception as exc:  # noqa: BLE001 - keras raises many types for bad or foreign files
                raise CheckpointError(f"cannot read {self.path} as a Keras model: {_first_line(exc)} (custom "
                                      "layers must be registered with keras.saving.register_keras_serializable)") \
                    from None

    def _spec_from_model(self):
        from . import _api

        try:
            return _api.to_spec(self.template())
        except (DenseBridgeError, TypeError) as exc:
            raise CheckpointError(f"{self.path}: the Keras model cannot be described as a dense_bridge spec: "
                                  f"{exc}") from None

    # -- the common surface with CanonicalCheckpoint
    def param_views(self) -> dict[str, np.ndarray]:
        """Canonical parameters as views of the loaded model's memory (do not mutate)."""
        from . import _api

        params = _api.get_params(self.template(), copy=False)
        if self.spec is not None and self.container == "keras-model":
            from ._params import validate_params

            try:  # a .keras file carries its own architecture: it must fit the spec given
                validate_params(self.spec, params)
            except ConversionError as exc:
                raise CheckpointError(f"{self.path} does not match the spec: {exc}") from None
        return params

    def params(self) -> dict[str, np.ndarray]:
        """Canonical parameters (in-memory copies)."""
        return {k: np.array(v) for k, v in self.param_views().items()}

    def native(self, backend: str, progress=None, allow_nonfinite: bool = False):
        """A native model on ``backend`` holding the file's parameters (NaN/Inf refused unless
        ``allow_nonfinite``: the one rule of load, set_params, compile and convert)."""
        from . import _api

        model = self.template()
        if backend == self.framework:
            if not allow_nonfinite:
                from .checkpoint import check_finite_params

                check_finite_params(_api.get_params(model, copy=False), self.path)
            if progress is not None:
                progress(1, 1)
            return model
        params = _api.get_params(model, copy=False)
        try:
            out = _api.compile(self.spec, backend, params=params, allow_nonfinite=allow_nonfinite)
        except ConversionError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None
        if progress is not None:
            progress(1, 1)
        return out


# ------------------------------------------------------------------------------ keras helpers
def _h5py():
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py comes with keras
        raise CheckpointError("reading Keras .weights.h5 files needs h5py: pip install h5py") from exc
    return h5py


def _h5_structure(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Dataset path -> (shape, dtype) of a Keras weights file (bfloat16 from its "dtype" attribute)."""
    h5 = _h5py()
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def visit(name, obj):
        if isinstance(obj, h5.Dataset):
            dtype = obj.attrs.get("dtype")
            dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
            out[name] = (tuple(obj.shape), str(dtype) if dtype else obj.dtype.name)

    try:
        with h5.File(path, "r") as f:
            f.visititems(visit)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: not a readable HDF5 file ({_first_line(exc)}; truncated or "
                              "corrupted?)") from None
    return out


_VAR = re.compile(r"^layers/([^/]+)/vars/(\d+)$")
_SUFFIX = re.compile(r"^(.*?)(?:_(\d+))?$")


def _snake(name: str) -> str:
    """Keras' own naming of saved layers: the class name in snake_case (keras.src.utils.naming)."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _var_groups(struct: dict) -> dict[str, list[str]] | None:
    """layer group -> its variable paths, for a flat Sequential/functional file; None otherwise."""
    groups: dict[str, list[str]] = {}
    for path in struct:
        m = _VAR.match(path)
        if m is None:
            return None
        groups.setdefault(m.group(1), []).append(path)
    return groups


def _keras_mapping(model, got: dict, expected: dict) -> dict[str, str] | None:
    """File variable path -> template variable path when the two differ only in class names.

    Keras names each saved layer snake_case(class) plus a per-class counter in layer order, so
    within one class the counter gives the order. Remapped only when the file's layers with
    variables are all of one class (the order is then certain) and the counts match.
    """
    fg, eg = _var_groups(got), _var_groups(expected)
    if fg is None or eg is None or len(fg) != len(eg):
        return None
    bases = {_SUFFIX.match(n).group(1) for n in fg}
    if len(bases) != 1:
        return None
    file_order = sorted(fg, key=lambda n: int(_SUFFIX.match(n).group(2) or 0))
    used: dict[str, int] = {}
    template_order = []
    for layer in getattr(model, "layers", [model]):
        base = _snake(type(layer).__name__)
        name = base if base not in used else f"{base}_{used[base] + 1}"
        used[base] = used.get(base, -1) + 1
        if name in eg:
            template_order.append(name)
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
    h5 = _h5py()
    with h5.File(src_path, "r") as src, h5.File(dst_path, "a") as dst:
        for s_path, d_path in mapping.items():
            if d_path in dst:
                del dst[d_path]
            parent, name = d_path.rsplit("/", 1)
            src.copy(src[s_path], dst.require_group(parent), name=name)


class _keras_named:
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


# ============================================================================ writing
def output_kind(backend: str, out: str) -> str:
    """The file kind to write for ``backend`` at ``out`` (by extension); CheckpointError if none fits."""
    lower = out.lower()
    if backend == "torch":
        if lower.endswith(TORCH_EXTS):
            return "torch-pickle"
        if lower.endswith(".safetensors"):
            return "safetensors"
        raise CheckpointError(f"cannot write {out}: torch checkpoints end in .pt, .pth, .bin or .safetensors")
    if backend == "keras":
        if lower.endswith(".weights.h5"):
            return "keras-weights"
        if lower.endswith(".keras"):
            return "keras-model"
        raise CheckpointError(f"cannot write {out}: Keras checkpoints end in .weights.h5 (weights) or .keras "
                              "(whole model)")
    if backend == "mlx":
        if lower.endswith(".safetensors"):
            return "safetensors"
        if lower.endswith(".npz"):
            return "npz"
        raise CheckpointError(f"cannot write {out}: MLX checkpoints end in .safetensors or .npz")
    raise CheckpointError(f"cannot write {out}: no native file format for backend {backend!r}")


def native_state(model, backend: str) -> dict[str, PendingTensor]:
    """The model's own parameter names and native layouts, each turned into numpy only when
    written (zero-copy views where the framework allows), so a write holds one tensor at a time."""
    from ._dtypes import numpy_dtype

    if backend == "torch":
        out = {}
        for k, v in model.state_dict().items():
            dtype = numpy_dtype("bfloat16") if _torch_dtype_name(v.dtype) == "bfloat16" else \
                np.dtype(_torch_dtype_name(v.dtype))
            out[k] = PendingTensor(dtype, tuple(v.shape), _later(_torch_to_numpy, v))
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten

    def to_numpy(v):
        if v.dtype == mx.bfloat16:  # numpy cannot view MLX bfloat16 directly: through its uint16 bits
            return np.asarray(v.view(mx.uint16)).view(numpy_dtype("bfloat16"))
        return np.asarray(v)

    return {k: PendingTensor(numpy_dtype(_mlx_dtype_name(v.dtype)) if _mlx_dtype_name(v.dtype) == "bfloat16"
                             else np.dtype(_mlx_dtype_name(v.dtype)), tuple(v.shape), _later(to_numpy, v))
            for k, v in tree_flatten(model.parameters())}


def _refuse_mlx_float64(state: dict[str, PendingTensor], out: str) -> None:
    """MLX reads no F64 safetensors (mx.load: "unsupported dtype F64"): such a file would be MLX's in
    name only. Refused before anything is written; .npz holds float64 for MLX."""
    wide = [k for k, t in state.items() if t.dtype == np.float64]
    if wide:
        raise CheckpointError(f"cannot write {out}: MLX cannot read float64 tensors from .safetensors (mx.load "
                              f"refuses dtype F64), and {wide} are float64. Write an MLX .npz instead (MLX reads "
                              "float64 there), or a canonical checkpoint (--to canonical)")


def _later(fn, value):
    return lambda: fn(value)


def write_native(model, backend: str, out: str, *, spec=None) -> list[str]:
    """Write ``model`` in ``backend``'s own format at ``out`` (atomically); return the files written."""
    from .checkpoint import _metadata, _spec_json, write_canonical

    if backend == "numpy":
        from . import _api

        params = _api.get_params(model, copy=False)
        tensors = {k: pending(np.asarray(v)) for k, v in params.items()}
        return write_canonical(out, tensors, _metadata(spec, tensors, "numpy"))
    kind = output_kind(backend, out)
    check_writable(out)
    require_framework(backend, f"writing {out}")
    state = native_state(model, backend) if kind == "safetensors" else None
    if backend == "mlx" and kind == "safetensors":
        _refuse_mlx_float64(state, out)
    spec_json = _spec_json(spec) if spec is not None else None
    try:
        with AtomicFiles(out) as tx:
            if kind == "torch-pickle":
                import torch

                tmp = tx.temp_for(out)
                torch.save(model.state_dict(), tmp)
            elif kind == "safetensors":
                tmp = tx.temp_for(out, ".safetensors")
                meta = {"format": "pt" if backend == "torch" else "mlx", "dense_bridge_backend": backend}
                if spec_json:
                    meta[SPEC_KEY] = spec_json
                with open(tmp, "wb") as f:
                    write_safetensors(f, state, meta)
            elif kind == "npz":
                import mlx.core as mx
                from mlx.utils import tree_flatten

                tmp = tx.temp_for(out, ".npz")
                mx.savez(tmp, **dict(tree_flatten(model.parameters())))
            elif kind == "keras-weights":
                tmp = tx.temp_for(out, ".weights.h5")
                model.save_weights(tmp)
                if spec_json:
                    with _h5py().File(tmp, "a") as f:
                        f.attrs[SPEC_KEY] = spec_json
            elif kind == "keras-model":
                tmp = tx.temp_for(out, ".keras")
                model.save(tmp)
    except DenseBridgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the framework's writer failed; temporaries are gone
        raise CheckpointError(f"cannot write {out}: {type(exc).__name__}: {_first_line(exc)} (nothing was "
                              "changed on disk)") from exc
    return [out]

