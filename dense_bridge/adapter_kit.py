"""The public adapter kit: everything an adapter package needs from dense_bridge, in the tree or
outside it.

An adapter is a package (say ``my_adapter``) whose ``__init__`` exposes, as module-level
functions, the verbs of :data:`REQUIRED_VERBS` and those of the capabilities it has
(:data:`CAPABILITIES`: each group all or none, checked when the backend is registered as a
module or first imported by name), and whose ``_manifest.py`` imports no framework and defines
``MANIFEST = Manifest(...)`` (what the core may know before the framework is imported: packages
needed, install hint, capabilities, file formats with their sniffing, owner priority). Register it with
``dense_bridge.register_backend("mine", "my_adapter")`` or, from an installed distribution, an
entry point ``[project.entry-points."dense_bridge.backends"] mine = "my_adapter"``. Check it with
the conformance suite, :mod:`dense_bridge.testing.conformance`.

Names, by role (loaded on first use, so importing this module costs nothing):

- the contract: ``CONTRACT_VERSION``, ``REQUIRED_VERBS``, ``CAPABILITIES`` (each a ``Capability``:
  a group of verbs offered all or none, extras only beside them; ``RUNNING``, ``FILES``, ``LORA``,
  ``QUANT``, ``QUANT_LORA``, ``QUANT_FILES``, and the manifest-declared ``parallel``/``dcp`` with
  ``PARALLEL_VERBS``, ``DCP_VERBS``), ``OPTIONAL_VERBS`` (every capability's verbs);
- declarations: ``Manifest``, ``FileFormat``, ``ModelDir``, ``FileNames``, ``AdapterFormat``, ``Probe``, ``Match``, ``GRADIENTS``, ``PARALLEL``, ``DCP``;
- building: ``ParamSource`` (``for_layer``/``native_layer``: a layer's canonical parameters),
  ``initial_layer_params``, ``remember_spec``/``remembered_spec``, ``native_copy``;
- tracing: ``Trace``/``LayerTrace`` (the ``trace`` verb), ``Capture``/``Call``/``select_output``
  (the ``capture`` verb);
- layouts: ``Entry`` (the ``walk`` verb's record), ``Layout``, ``declared``, ``warn_dropout``;
- files: ``FileViews``, ``FileLayout``, ``canonical_shapes``, ``planned_file_tensors``,
  ``structure_twin``, ``SafetensorsFile``, ``PendingTensor``, ``write_safetensors``;
- dtypes: ``DTYPE_NAMES``, ``numpy_dtype``, ``compute_dtype``, ``dtype_name``;
- errors: ``DenseBridgeError``, ``SpecError``, ``ConversionError``, ``CheckpointError``,
  ``StateError``, ``BackendUnavailableError``, ``received``.

``CONTRACT_VERSION`` is raised when a verb's signature or meaning changes in a way an adapter
written for the earlier version would get wrong; an adapter may compare it with the version it
was written for.
"""
from __future__ import annotations

import importlib

#: The version of the adapter contract these names and ``dense_bridge.registry._contract`` describe.
CONTRACT_VERSION = 2

_LAZY: dict[str, str] = {
    "REQUIRED_VERBS": ".registry._contract", "OPTIONAL_VERBS": ".registry._contract", "PARALLEL_VERBS": ".registry._contract", "DCP_VERBS": ".registry._contract",
    "Capability": ".registry._contract", "CAPABILITIES": ".registry._contract", "RUNNING": ".registry._contract",
    "FILES": ".registry._contract", "LORA": ".registry._contract", "QUANT": ".registry._contract",
    "QUANT_LORA": ".registry._contract", "QUANT_FILES": ".registry._contract",
    "Manifest": ".registry._manifest", "FileFormat": ".registry._manifest", "ModelDir": ".registry._manifest", "FileNames": ".registry._manifest", "Probe": ".registry._manifest",
    "AdapterFormat": ".registry._manifest", "Match": ".registry._manifest", "GRADIENTS": ".registry._manifest", "PARALLEL": ".registry._manifest", "DCP": ".registry._manifest", "PORTS": ".registry._manifest",
    "ParamSource": ".params._source", "initial_layer_params": ".params._source",
    "remember_spec": ".registry._remembered_spec", "remembered_spec": ".registry._remembered_spec",
    "native_copy": ".params._copy",
    "Trace": ".registry._trace", "LayerTrace": ".registry._trace",
    "Capture": ".registry._captures", "Call": ".registry._captures", "select_output": ".registry._captures",
    "Entry": ".models._layouts", "Layout": ".models._layouts", "declared": ".models._layouts", "warn_dropout": ".models._layouts",
    "FileViews": ".checkpoints._native", "canonical_shapes": ".checkpoints._native",
    "planned_file_tensors": ".checkpoints._native", "structure_twin": ".checkpoints._native",
    "FileLayout": ".checkpoints._native_stream",
    "SafetensorsFile": ".checkpoints._safetensors", "PendingTensor": ".checkpoints._safetensors", "write_safetensors": ".checkpoints._safetensors",
    "DTYPE_NAMES": "._dtypes", "numpy_dtype": "._dtypes", "compute_dtype": "._dtypes", "dtype_name": "._dtypes",
    "DenseBridgeError": "._errors", "SpecError": "._errors", "ConversionError": "._errors",
    "CheckpointError": "._errors", "StateError": "._errors", "BackendUnavailableError": "._errors",
    "received": "._errors", "file_number": "._errors",
    "bounded_pattern": ".models._patterns", "PATTERN_LIMIT": ".models._patterns", "PATH_LIMIT": ".models._patterns",
}

__all__ = ["CONTRACT_VERSION", *_LAZY]


def __getattr__(name: str):
    try:
        module_name = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'dense_bridge.adapter_kit' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name, "dense_bridge"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
