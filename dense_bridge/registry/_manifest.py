"""What the core may know of a backend without importing its framework: its manifest.

Every adapter package has a ``_manifest.py`` that imports no framework (only this module, from
``dense_bridge.adapter_kit``) and defines ``MANIFEST = Manifest(...)``: the packages it needs,
what to install, which adapter wins when two own one object, what it can do (gradients), and
its file formats with their content sniffing. The registry loads that file on its own, without
running the package's ``__init__`` (which imports the framework), so a ``.pt`` file can be
recognised, and its missing framework named, on a machine without torch.

Everything the core derives about files (which framework a file belongs to, the kind handed to
the adapter's file verbs, the output kind and temporary suffix for an output name, the labels
``inspect`` prints, the "Supported:" list) comes from these declarations, never from a table
of framework names in the core.
"""
from __future__ import annotations

import enum
import os
import zipfile
from dataclasses import dataclass, field
from typing import Callable

from .._errors import CheckpointError, first_line

__all__ = ["Match", "Probe", "FileFormat", "ModelDir", "FileNames", "AdapterFormat", "Manifest", "GRADIENTS", "PARALLEL",
           "DCP", "PORTS", "LORA_FILE_VERBS"]

#: Capability: ``trace``/``capture`` compute gradients (the framework has autograd, or the
#: adapter a hand-written backward). Without it a backend runs forward only (``grads=False``).
GRADIENTS = "gradients"
#: Capability: the adapter compiles onto its framework's tensor-parallel machinery and offers
#: every verb of ``dense_bridge.registry._contract.PARALLEL_VERBS`` (``db.compile(..., parallel=)``).
PARALLEL = "parallel"
#: Capability: the adapter reads and writes distributed-checkpoint directories (a ``.metadata``
#: file beside the data) with the verbs of ``dense_bridge.registry._contract.DCP_VERBS`` (``format="dcp"``).
DCP = "dcp"
#: Capability: the adapter reads and writes whole model directories of the libraries its manifest
#: names in ``port_formats`` (db.port), with the verbs of ``dense_bridge.registry._contract.PORTS``.
PORTS = "ports"


class Match(enum.IntEnum):
    """How sure a format's ``sniff`` is that a file is of that format; the highest wins, and a
    tie goes to the backend registered first (the built-ins in their order, then the others)."""

    NO = 0
    FITS = 1      # the container fits: readable this way when the caller names the backend (format=)
    DEFAULT = 2   # the usual reading of this container when nothing in the file says otherwise
    LIKELY = 3    # the file's conventions (names, extension with a matching first byte) point here
    CERTAIN = 4   # a signature only this format has (a magic number, a member, a tag it writes)


class Probe:
    """What the core read of a file, for the formats' ``sniff`` functions (no framework needed).

    ``path``; ``name``: its base name in lower case (``name.endswith(".weights.h5")``); ``size``
    in bytes; ``head``: its first 64 bytes. Safetensors files (opened by the core) also give
    ``metadata`` (the header's string metadata) and ``tensor_names``; other files give None.
    ``reopen``: a zero-argument callable giving a context manager of the file opened for reading
    through the core's file guard (a FIFO or device refused, never waited on); without it a zip
    archive's member names are unknown (None).
    """

    def __init__(self, path: str, head: bytes, size: int, *, metadata: dict | None = None,
                 tensor_names: list[str] | None = None, reopen=None) -> None:
        self.path, self.head, self.size, self._reopen = path, head, size, reopen
        self.name = os.path.basename(path).lower()
        self.metadata, self.tensor_names = metadata, tensor_names
        self._zip: list[str] | None | bool = False

    @property
    def ext(self) -> str:
        """The last extension as written ("(none)" without one), for messages."""
        return os.path.splitext(self.path)[1] or "(none)"

    def zip_names(self) -> list[str] | None:
        """The member names of a zip archive (read once), None when the file is no zip archive;
        CheckpointError when it is one but truncated or corrupted."""
        if self._zip is False:
            self._zip = None
            if self._reopen is not None and self.head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
                try:
                    with self._reopen() as handle, zipfile.ZipFile(handle) as z:
                        self._zip = z.namelist()
                except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
                    raise CheckpointError(f"cannot read {self.path} (extension {self.ext}): a zip archive that is "
                                          f"truncated or corrupted ({first_line(exc)})") from None
        return self._zip  # type: ignore[return-value]


@dataclass(frozen=True)
class FileFormat:
    """One file format of a backend: how it is recognised, read and written.

    - ``label``: what ``inspect`` prints and errors name ("torch state dict").
    - ``container``: the name the adapter's ``file_info``/``read_file``/``file_views`` receive for a
      file read as this format ("torch-zip"); None for a format only written.
    - ``sniff(probe) -> Match``: does this file hold this format (content first: magic numbers,
      zip members, safetensors metadata; an extension only where the format has no magic).
    - ``extensions``: name endings, lower case (".pt", ".weights.h5"); an output whose name ends so
      is written as ``write_kind`` (the kind ``write_file``/``file_layout`` receive), through a
      temporary ending in ``temp_suffix`` (what the framework's writer insists on).
    - ``safetensors``: the core opens the file itself (single, or sharded with an index, whose
      container is then ``container + "-index"``); ``sniff`` sees its metadata and tensor names.
    - ``carries_model``: the file holds a whole model, structure included (``.keras``): it is read
      without a template and its spec is read from the model.
    - ``stores_metadata``: ``file_info``'s metadata may hold the spec dense_bridge stored there.
    """

    label: str
    container: str | None = None
    sniff: Callable[[Probe], int] | None = None
    extensions: tuple[str, ...] = ()
    write_kind: str | None = None
    temp_suffix: str = ""
    safetensors: bool = False
    carries_model: bool = False
    stores_metadata: bool = False


@dataclass(frozen=True)
class ModelDir:
    """A quantized model directory of a backend's ecosystem: a weights file beside a JSON config
    that says how its layers are quantized (mlx-lm's). The core opens such a directory as its
    weights file read as this backend's (``checkpoints._model_dir.QuantizedDirectory``) and
    hands ``settings`` to the adapter's ``model_dir_layers`` verb, which names its quantized layers.

    - ``label``: what ``inspect`` prints ("mlx-lm quantized model directory").
    - ``config``: the config file's name in the directory ("config.json"), a JSON object.
    - ``weights``: the weights file's possible names, the first present wins (a safetensors
      file or its index, opened by the core).
    - ``settings(config) -> object | None``: what in the parsed config makes the directory this
      format (handed to the adapter as it is, checked there); None: not this format.
    """

    label: str
    config: str
    weights: tuple[str, ...]
    settings: Callable[[dict], object]


@dataclass(frozen=True)
class FileNames:
    """How a framework's plain weights files name a linear layer's tensors, for ``inspect`` on a
    file without a spec: ``<layer><sep><kernel>`` of rank 2 stored ``layout`` ("out_in": (units,
    in); "in_out": (in, units)), its bias ``<layer><sep><bias>``; ``why`` says it in words (the
    file cannot say: the layout is assumed from the format)."""

    kernel: str = "weight"
    bias: str = "bias"
    sep: str = "."
    layout: str = "out_in"
    why: str = "a 'weight' is (out, in) by the most common convention"


#: What the module an :class:`AdapterFormat` names offers (importing no framework: numpy, json, re and
#: ``dense_bridge.adapter_kit`` only, so a directory is read and converted where the framework is absent):
#:
#: - ``lora_from_files(tensors, config, where) -> (layers, extra)``: the directory's safetensors
#:   ``tensors`` {key: array} and JSON ``config`` (checked against each other as the format's own
#:   library would; ``where`` names the directory in errors) as canonical adapters
#:   ``{layer path: {"lora_a" (in, r), "lora_b" (r, units), "lora_scale" 0-d float64[, "lora_magnitude" (units,)]}}``
#:   keyed by the base model's layer paths, and ``extra`` {"dropout": float, ...};
#: - ``lora_to_files(layers, extra, *, num_layers) -> (tensors, config, metadata)``: the same, written
#:   (``num_layers``: the base model's block count, None when unknown; ``metadata``: the safetensors
#:   header's string metadata or None). What the format cannot hold is a ConversionError naming it.
LORA_FILE_VERBS = ("lora_from_files", "lora_to_files")


@dataclass(frozen=True)
class AdapterFormat:
    """A LoRA adapter file format of the ecosystem that runs it (``db.load_adapter``,
    ``db.save_adapter``, ``db.convert_adapter``), declared by the backend of that framework.

    - ``name``: the ``format=`` name ("peft").
    - A directory format: ``files`` = (its safetensors weights file, its JSON config file); a
      directory holding ``files[0]`` is of this format. ``module``: the adapter package's module
      (named relative to it, "_lora_files") offering :data:`LORA_FILE_VERBS`, loaded without the
      package's ``__init__``. ``refuse(names) -> str | None``: why a directory holding ``names`` (a
      frozenset) that lacks ``files[0]`` is still refused (a pickled adapter), None if it is not
      this format at all.
    - A single-file format whose file names layers of one model (keras-hub, by index): ``suffix``
      (how its name ends) and the adapter package's verbs ``load_verb(model, path, *,
      allow_nonfinite) -> {layer path: rank}`` and ``save_verb(model, path, *, allow_nonfinite)``.
    """

    name: str
    files: tuple[str, ...] = ()
    module: str | None = None
    refuse: Callable[[frozenset], str | None] | None = None
    suffix: str | None = None
    load_verb: str | None = None
    save_verb: str | None = None


@dataclass(frozen=True)
class Manifest:
    """A backend's declarations (see the module docstring). Every field has a default, so an
    adapter declares only what it has.

    - ``requires``: top-level packages that must be importable (default: the adapter's own
      top-level package); ``runtime_requires()``: more, decided at call time without importing
      anything (Keras 3: the package its ``KERAS_BACKEND`` names).
    - ``install``: what to run when they are missing (``register_backend(install_hint=)`` wins).
    - ``display``: the framework's name in messages ("Keras"; default the backend name).
    - ``owner_priority``: asked first when two adapters own one object (a Keras layer on the
      torch engine is a ``torch.nn.Module`` too): higher first, then registry order.
    - ``capabilities``: optional abilities, :data:`GRADIENTS` by default.
    - ``formats``: its :class:`FileFormat` s, tried by ``Match`` across every backend.
    - ``model_dirs``: its :class:`ModelDir` s, tried in order for a directory given as a checkpoint.
    - ``layout_note``: its native layout in words, for errors about files that do not match.
    - ``file_names``: :class:`FileNames` of its plain weights files (None: the common convention).
    - ``model_files``: name endings of whole-model files its ``load_model`` verb reads.
    - ``adapter_formats``: the :class:`AdapterFormat` s of LoRA adapter files this framework's
      ecosystem writes (PEFT for torch, mlx-lm for MLX, keras-hub for Keras).
    - ``linear_layouts``: linear classes of the framework's ecosystem that dense_bridge does not
      build, by dotted name, as ``(class, kernel attribute, bias attribute or None, "in_out" or
      "out_in")``: what ``db.register_layout`` would declare (``models/_layouts.py``), read on
      first use without importing the class.
    - ``port_formats``: the model-directory formats (``db.port``'s ``to=`` names) its adapter reads and
      writes with the verbs of the :data:`PORTS` capability (``_ports.py``).
    - ``quiet_import``: importing the framework writes C++ log lines to file descriptor 2
      (TensorFlow): the command line imports it with that descriptor silenced.
    """

    requires: tuple[str, ...] = ()
    runtime_requires: Callable[[], tuple[str, ...]] | None = None
    install: str | None = None
    display: str | None = None
    owner_priority: int = 0
    capabilities: frozenset[str] = field(default_factory=lambda: frozenset({GRADIENTS}))
    formats: tuple[FileFormat, ...] = ()
    model_dirs: tuple[ModelDir, ...] = ()
    layout_note: str = ""
    file_names: FileNames | None = None
    model_files: tuple[str, ...] = ()
    adapter_formats: tuple[AdapterFormat, ...] = ()
    linear_layouts: tuple[tuple[str, str, str | None, str], ...] = ()
    quiet_import: bool = False
    port_formats: tuple[str, ...] = ()
