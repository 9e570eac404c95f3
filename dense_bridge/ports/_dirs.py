"""The model-directory formats, as the backends' manifests declare them, and their adapters' verbs.

A backend whose manifest declares the ``ports`` capability names its formats in
``Manifest.port_formats`` and offers every verb of ``dense_bridge.registry._contract.PORTS``
(in its ``_ports.py``); each verb takes the format name first:

- ``port_detect(fmt, path) -> Match``: how sure it is that the directory ``path`` is one of its;
- ``port_contents(fmt, path) -> {"config", "weights": {tensor: relative file}, "extras"}``,
  refusing configs that ask for code from outside the installed libraries;
- ``port_common_config(fmt, config)`` / ``port_own_config(fmt, common)``: its config to
  and from the interchange form (one key table per library);
- ``port_shrink(fmt, common)``: the interchange config of the tiny twin (offered by one
  library at least; the others raise ConversionError);
- ``port_twin(fmt, config, seed)``: the library's own model for ``config``, every parameter
  random; ``port_save(fmt, model, path)``: written by the library's own saver;
- ``port_shapes(fmt, config) -> {parameter: shape}`` of the model for ``config`` built
  without memory (meta device, lazy arrays);
- ``port_layout(fmt, count) -> {"shards", "index", "metadata", "config", "extras"}``: file names;
- ``port_load(fmt, path)``: the library's own loader; ``port_logits(fmt, model, ids)``;
- ``port_describe(fmt, config) -> {"architecture", "kind", "vocab_size", "max_positions", "window", "fields"}``:
  what the port reports and sizes its inputs by (None where the config does not say; ``window``: the
  sliding-window length of attention, optional; ``fields``: the settings the library's config for
  this architecture takes, optional, which names the settings a destination drops, ``_differ``);
- ``port_open(fmt, path)`` (optional): one of its weight files opened for streaming, an object
  read like :class:`~dense_bridge.checkpoints._safetensors.SafetensorsFile` (``tensors``: name ->
  ``shape``, ``numpy_dtype``; ``get``, ``keys``, ``close``); without it files are read as safetensors;
- ``port_parse_quantize(fmt, value)``, ``port_quantize(fmt, path, value, source_config, dtype)``,
  ``port_keep_codes(fmt, path, layers, requantize)``, ``port_recompute_codes(fmt, recipe, value,
  codes)`` (optional): codes written by the library's own quantized layout, and recomputed (``_codes``);
- ``port_example(fmt, path, seed)``: a tiny random model saved into ``path`` (the demo's
  source; ConversionError where the library offers none).

Optional verbs, for a destination whose files are not safetensors beside one JSON config:

- ``port_inputs(fmt, ids, model)``: ``model``'s inputs for the token ids ``ids`` (batch, positions), where
  they are not ``[ids]`` (a dict of named inputs); the twins and full models are run on them;
- ``port_write_weights(fmt, path, tensors, config, on_tensor) -> bytes``: one weight file of the
  layout written in its own format (the destination is still a directory) (``tensors``: destination name -> ``PendingTensor``, each made by its
  ``produce()`` when written; ``config``: as ``port_own_config`` gave it; ``on_tensor(name,
  nbytes)`` after each); without it the weights are written as safetensors;
- ``port_complete_config(fmt, config, shapes) -> config``: its own config with the fields its library
  requires and the source's config leaves unset filled from the source's weights (``shapes``: name ->
  shape), applied to the destination's config and its twin's;
- ``port_as_loaded(fmt, model, names) -> {parameter names}`` (optional): a twin made what its loader
  makes of files holding only the tensors ``names`` (a head it ties when the files hold none), see
  ``ports/_tying.py``; without it twins are as built;
- ``port_source_form(fmt, config, real, stored) -> config`` (optional): the source twin's ``config`` in
  the form the source directory's own config ``real`` takes for its weights ``stored`` (a text model
  its library builds both alone and inside a composite);
- ``port_write_config(fmt, directory, config, src) -> [names]``: its non-weight files (several
  configs, metadata) written into ``directory`` for ``config``, ``src`` the source directory
  (whose files it may translate, or refuse naming them); without it ``config`` is written as
  JSON under the layout's ``config`` name.
- ``port_write(fmt, path, config, tensors, *, outtype, extras, on_tensor)`` (optional): the format
  writes its own files, and its destination is ONE file: ``out`` is that file (the certificate
  beside it, ``<out>.port_certificate.json``), written as ``path`` inside a directory beside
  ``out`` and renamed into place when everything has passed. ``config`` is the format's own config,
  ``tensors`` {name: PendingTensor} the logical destination tensors (the format applies its own
  encoding), ``outtype`` the format's storage type (None: its default), ``extras`` {name: path}
  of the source's extra files (tokenizers), ``on_tensor(name, nbytes)`` after each; it returns
  {name: {"codes", ...}} merged into the certificate's tensor entries. Its ``port_detect`` and
  ``port_contents`` then take a file as well (the source may be one file).

- ``port_write_extras(fmt, src, directory, names)`` (optional, a one-file source): the files of the
  destination's layout ``names`` (tokenizer files) that the source carries inside itself, written
  into the destination ``directory`` by the libraries that read them; returns the names written.

A format may also belong to a file-format backend (``registry._backends.FILE_FORMATS``): a
package offering these verbs alone, for a file format that no framework runs here.
"""
from __future__ import annotations

import os

from .._errors import ConversionError, DenseBridgeError, received
from ..registry._backends import available_backends, available_file_formats, backends, file_format_backends, port_adapter
from ..registry._manifest import PORTS

_PURPOSE = "a model-directory port"


def formats() -> dict[str, str]:
    """Every declared model-directory format -> its backend, in registry order."""
    out: dict[str, str] = {}
    for name, info in list(backends().items()) + list(file_format_backends().items()):
        if PORTS in info.manifest.capabilities:
            for fmt in info.manifest.port_formats:
                out.setdefault(fmt, name)
    return out


def _installed_backends() -> set[str]:
    return set(available_backends()) | set(available_file_formats())


class Format:
    """One model-directory format and its adapter's verbs (``self.verb(...)`` passes the format name)."""

    def __init__(self, name: str) -> None:
        known = formats()
        if name not in known:
            raise ConversionError(f"unknown model-directory format: {received('to', name)} (known: {sorted(known)})")
        self.name, self.backend = name, known[name]

    def __getattr__(self, verb: str):
        if not verb.startswith("port_"):
            raise AttributeError(verb)
        fn = getattr(port_adapter(self.backend), verb, None)
        if not callable(fn):
            raise ConversionError(f"{_PURPOSE} needs the {verb!r} verb, which the {self.backend!r} backend's adapter "
                                  "does not offer")
        return lambda *args, **kw: fn(self.name, *args, **kw)

    def offers(self, verb: str) -> bool:
        """Whether its adapter offers the optional ``verb`` (``port_open``, ``port_write``)."""
        return callable(getattr(port_adapter(self.backend), verb, None))

    def __repr__(self) -> str:
        return f"Format({self.name!r})"


def optional(fmt: "Format", verb: str):
    """``fmt``'s optional verb ``verb`` bound to its name, or None where its adapter offers none."""
    fn = getattr(port_adapter(fmt.backend), verb, None)
    return (lambda *args, **kw: fn(fmt.name, *args, **kw)) if callable(fn) else None


def complete(fmt: "Format", config: dict, shapes: dict) -> dict:
    """``config`` (``fmt``'s own) with what its library requires and the config leaves unset filled
    from the source's weights ``shapes`` ({name: shape}) by ``port_complete_config``; as it is
    where the format offers none."""
    fn = optional(fmt, "port_complete_config")
    return config if fn is None else fn(config, shapes)


def writer(fmt: "Format", config: dict):
    """``(path, tensors, on_tensor) -> bytes`` writing one weight file in ``fmt``'s own format
    (``port_write_weights``), or None where it writes safetensors."""
    fn = optional(fmt, "port_write_weights")
    return None if fn is None else (lambda path, tensors, on_tensor=None: fn(path, tensors, config, on_tensor))


def open_weights(fmt: "Format", path: str):
    """The weight file ``path`` of a ``fmt`` directory opened for streaming: by its adapter's
    ``port_open`` where it offers one, else as a safetensors file (headers checked)."""
    from ..checkpoints._safetensors import SafetensorsFile

    opener = getattr(port_adapter(fmt.backend), "port_open", None)
    return opener(fmt.name, path) if callable(opener) else SafetensorsFile(path)


def detect(path: str, argument: str = "src") -> Format:
    """The format of the model directory (or one-file model) ``path``, asked of every installed
    adapter that reads them; CheckpointError/ConversionError naming what was found otherwise."""
    from .._errors import CheckpointError

    if not os.path.exists(path):
        raise CheckpointError(f"{argument} must be a model directory or file: {received(argument, path)} "
                              "(does not exist)")
    best, score = None, 0
    installed = _installed_backends()
    # a file is asked only of the file-format backends: a framework's adapter reads directories, and
    # importing it (a whole framework) to hear no would cost seconds and its start-up chatter
    one_file = set(file_format_backends()) if not os.path.isdir(path) else None
    for fmt, backend in formats().items():
        if backend not in installed or (one_file is not None and backend not in one_file):
            continue
        try:
            s = int(Format(fmt).port_detect(path))
        except DenseBridgeError:
            continue
        if s > score:
            best, score = fmt, s
    if best is None and not os.path.isdir(path):
        raise CheckpointError(f"{argument} must be a model directory or a model file some installed library reads "
                              f"(known formats: {sorted(formats())}): {received(argument, path)}")
    if best is None:
        try:
            listing = sorted(os.listdir(path))[:12]
        except OSError:
            listing = []
        raise CheckpointError(f"{path} is no model directory any installed library reads (known formats: "
                              f"{sorted(formats())}; it holds {listing})")
    return Format(best)


def shrink(common: dict, *sides: Format) -> dict:
    """The twin's interchange config, from the first side whose library shrinks configs."""
    errors = []
    installed = set(available_backends())
    others = [Format(f) for f, b in formats().items() if b in installed and f not in {x.name for x in sides}]
    for side in list(sides) + others:  # the interchange form's own library, where neither side shrinks
        try:
            return side.port_shrink(common)
        except ConversionError as exc:
            errors.append(str(exc))
    raise ConversionError("no installed library can shrink this config into a twin: " + "; ".join(errors))
