"""The contract every adapter package in ``dense_bridge.backends`` fulfils, as data a test checks.

An adapter is a package ``backends/<framework>/`` (installed as ``dense_bridge.backends.<fw>``)
whose ``__init__.py`` exposes the verbs below as module-level functions. The registry imports it
by name; the core calls these verbs and never the framework.

The contract in one breath: seven required verbs (:data:`REQUIRED_VERBS`: own, compile, read and
write parameters and the spec, move arrays); everything else comes in capabilities
(:data:`CAPABILITIES`), each a group of verbs offered all together or not at all, plus a few
extras that may come only with their group. A backend offering one verb of a group offers every
verb of it; ``parallel`` and ``dcp`` are also declared in the manifest, because the core asks
about them before importing the framework. :func:`problems` says what an adapter breaks; the
registry refuses such an adapter when it is registered as a module or first imported by name,
and ``tests/architecture/test_architecture.py`` checks the built-in ones. A backend without a
capability still works for everything that does not need it; what needs it raises an error
naming the capability (``dense_bridge.registry._backends.require``).

| capability | verbs (all or none) | extras (only with the group) | behind |
|---|---|---|---|
| ``running`` | trace, capture, walk, run_layer | train_sgd, inference | compare, compare_models, linear_layers, transfer |
| ``files`` | file_info, read_file, write_file | file_views, file_layout, load_model | the framework's own checkpoint files |
| ``lora`` | lora_base, read_lora, write_lora, lora_heads, attach_lora, detach_lora, lora_dora | lora_folds_scale, lora_leftovers, lora_raw_updates, save_lora_h5, load_lora_h5 | LoRA-wrapped layers, adapter files |
| ``quant`` | quant_layer, quant_build, quant_positions, quant_position_build | | quantized codes |
| ``quant_lora`` (needs lora, quant) | lora_quantized, lora_dequantize, lora_requantize, replace_lora | | merging LoRA into a quantized base |
| ``quant_files`` (needs quant, files) | quant_file_layers, quant_file_template | | quantized checkpoint files |
| ``parallel`` (manifest) | PARALLEL_VERBS | | db.compile(parallel=) and parallel models |
| ``dcp`` (manifest) | save_dcp, load_dcp | | distributed checkpoint directories |
| ``devices`` | device_of, parse_device, place, device_params, nonfinite_flags | in_place_copies | device=, inputs placed on the model's device, device-to-device moves |

Files: every adapter package has exactly the files of :data:`REQUIRED_FILES` (plus any of
:data:`OPTIONAL_FILES`).

Canonical parameters follow ``dense_bridge.params._source``: Dense ``kernel`` (in_features, units),
``bias`` (units,), ``mask`` (in_features, units); Bilinear ``kernel`` (units, in1, in2); in a
Sequential every key is prefixed with the layer's position ("0.kernel").

Required verbs (:data:`REQUIRED_VERBS`):

- ``owns(obj) -> bool``: is ``obj`` a layer/model of this framework that the adapter handles.
  Decided by ``type(obj)`` alone (the registry keeps the answer per type) and without importing
  anything new (an object of a framework exists only once it is imported).
- ``compile(spec, source: ParamSource) -> native``: the framework's own object for ``spec``
  (Dense, Bilinear, Identity, Activation or Sequential). Parameters come from
  ``source.for_layer(index, layer_spec)`` (index = position in the Sequential, 0 for a lone
  layer), called when the input width is known (at build time for lazy layers). The adapter
  copies them into storage it owns; masks become non-trainable state. Where the framework can
  adopt memory (``torch.from_numpy``, DLPack), ``source.native_layer(index, layer_spec, perms)``
  returns fresh, aligned copies already in the framework's layout (one fast pass, NaN/Inf
  checked on the way) for the adapter to hand over without another copy. The core calls it
  only through ``dense_bridge._api.build`` (the one compile path).
- ``get_params(native) -> dict[str, np.ndarray]``: canonical names, layout and dtype.
  Arrays may be read-only views of the framework's memory: callers copy before mutating.
- ``set_params(native, params)``: ``params`` were validated by the core (names, shapes, dtypes,
  finiteness) against ``to_spec(native)``; write them all. Partial dicts (strict=False) write
  only the keys present.
- ``to_spec(native) -> spec``: the backend-neutral spec, activation parameters read exactly.
- ``to_numpy(array) -> np.ndarray``: a framework array (tensor, variable) as numpy, dtype kept
  (bfloat16 as ``ml_dtypes.bfloat16``); may be a read-only view of the framework's memory.
- ``from_numpy(array) -> framework array``: a numpy array as the framework's array, dtype kept
  (bfloat16 included); may share memory with ``array`` where the framework allows it (torch).

The manifest (``_manifest.py``, framework-free, ``MANIFEST = dense_bridge.adapter_kit.Manifest(...)``)
declares what the core may know before the framework is imported: packages required and the
install hint, owner priority, capabilities (``gradients``, ``parallel``, ``dcp``), and the file formats with their
sniffing, extensions, labels and temporary suffixes (``dense_bridge.registry._manifest``).

Capability ``running`` (:data:`RUNNING`): running models and looking inside them. Without it a
backend still compiles, converts, reads and writes parameters; ``compare`` and ``compare_models``
on it name the missing capability, ``linear_layers`` and ``transfer`` the missing ``walk``. The manifest's
``gradients`` capability refines it (a backend that runs but has no autograd leaves it out).

- ``trace(native, inputs: list[np.ndarray], grad_out: np.ndarray | None) -> Trace``: run forward and
  backward with the framework's own autograd for L = sum(y * grad_out); report every layer
  (``dense_bridge.registry._trace``). An adapter whose manifest does not declare the ``gradients``
  capability (an engine without autograd) is called with ``grad_out=None`` and returns the
  outputs only (empty ``input_grads`` and ``param_grads``); ``compare``/``compare_models`` then
  run with ``grads=False`` only, and their reports say gradients were not compared.
- ``walk(model) -> list[dense_bridge.models._layouts.Entry]``: every layer inside any model tree that
  holds parameters of its own (and every linear-family layer), in definition order, with its
  path in the framework's naming, its kind ("linear": works with get/set_params, to_spec and
  trace as a lone layer; "quantized"; "other": norms, embeddings, ...) and readers/writers of its
  own parameters in the framework's layout (``_models.py``). Behind ``db.linear_layers``,
  ``db.transfer`` and ``testing.compare_models``.
- ``capture(model, inputs, layers, *, cotangent, select=None, grads=True) -> Capture``: one forward
  and (with ``grads``) one backward pass of a whole native ``model`` with the framework's own
  autograd for L = sum(out * cotangent(out.shape)), ``out`` the selected output (the first
  floating one unless ``select``), recording for every layer of ``layers`` (path -> native layer,
  as ``walk`` gives them) each call's inputs, output and dL/d(output), in execution order, and
  each layer's parameter gradients in the canonical layout. ``inputs``: a list of numpy arrays
  (positional) or a dict (keyword); integer arrays stay integers. Layers are hooked or wrapped
  only for the pass and ALWAYS restored (``dense_bridge.registry._captures``): the model is left as it was.
- ``run_layer(layer, x, grad_out) -> (y, dL/dx, canonical grads)``: one layer alone on given input and
  cotangent, the output as ``capture`` records it (teacher forcing in ``compare_models``).
- extra ``train_sgd(native, inputs, labels, *, steps, lr) -> (probs_before, probs_after)``: plain SGD
  with the framework's autograd on L = mean(-log p[label]) for a model whose output p is
  probabilities (the demo: torch, and numpy's reference backward).
- extra ``inference(native) -> context manager``: a scope in which masked layers may reuse kernel *
  mask without a change signal (Keras on TensorFlow), behind ``db.inference``.
- extra ``array_namespace(model) -> namespace | None`` (``_namespace.py``): the operations
  ``compare_models`` judges with (``dense_bridge/testing/_namespace.py`` lists them; numpy's is the
  reference), float64 on the model's own device, so whole activations never cross to the host.
  An adapter offering it also takes ``capture(..., native=True)``: the recorded arrays (inputs,
  outputs, dL/d(output), the model output; parameter gradients where it can) stay the
  framework's own, on the model's device.

Capability ``files`` (:data:`FILES`): the framework's own checkpoint files. A manifest that
declares file formats needs it.

- ``model_dir_layers(entries, path, settings) -> {layer name: (Quant, in_features, units)}``: the
  quantized layers of the model directory ``path`` whose manifest ``ModelDir`` the core matched:
  ``entries`` as ``file_info`` gives them for its weights file, ``settings`` what ``ModelDir.settings``
  took from its config; every layer checked against both (a CheckpointError naming the tensor).

- ``file_info(path, container, *, files=None) -> (entries, metadata)``: a native checkpoint file
  of this framework read without a spec: ``{name: (native shape, dtype name)}`` in the file's own
  names, and its string metadata (the spec dense_bridge stored there, if any). ``container`` is
  what the core sniffed ("torch-zip", "torch-legacy", "h5", "keras-model", "npz", "safetensors",
  "safetensors-index"); ``files`` are the safetensors files the core already opened
  (``dense_bridge.checkpoints._safetensors.SafetensorsFile``), else None (``_files.py``): read from those, never reopened by path.
- ``read_file(path, container, template, *, files=None, check) -> native``: ``template`` (the
  user's ``like``, or, where the adapter offers no ``file_views`` for the file, a model of this
  framework the core built for the file's spec through ``_api.build``; None for files that
  carry their own model, ``.keras``) holding the file's tensors.
  ``check(got, expected)`` (both ``{name: (shape, dtype)}``) raises a CheckpointError listing
  every difference; the adapter calls it before loading. Every failure is a CheckpointError
  naming ``path``.
- extra ``file_views(path, container, spec, *, files=None, check) -> Mapping | None`` (optional):
  the file's canonical parameters (a ``checkpoints._native.FileViews``: {canonical name: array},
  each read when first asked for) without building a model of the file's framework: a load
  onto that framework builds its model from them layer by layer (``ParamSource(stream=)``, as
  from a canonical file), a conversion to another framework copies one layer at a time. The
  adapter knows the names its framework gives the model it compiles for ``spec``; ``check``
  as for ``read_file``. None where the adapter cannot serve this file so: the core falls back
  to ``read_file``. torch (zip, legacy pickle, safetensors), MLX (safetensors, ``.npz``) and
  Keras (``.weights.h5``) offer it.
- extra ``file_layout(spec, path, kind, *, temp, metadata=None) -> FileLayout | None`` (optional):
  the skeleton of a ``kind`` file (final name ``path``, for messages) for ``spec`` written into ``temp`` with the framework's own writer,
  every tensor's bytes left to fill, and where each canonical tensor goes
  (``_native_stream.FileLayout``: offset, axes as ``file_views``', an optional ``finish`` given
  the CRC-32s). The core fills the bytes straight from the source file's mapped views, so a
  file-to-file conversion builds no model (large files near the disk's speed).
  None where the adapter cannot lay out this kind.
- ``write_file(model, path, kind, *, temp, metadata=None)``: write ``model`` in this framework's
  format ``kind`` (from ``checkpoints._native.output_kind``: "torch-pickle", "safetensors", "npz",
  "keras-weights", "keras-model") into ``temp``, which the core renames to ``path`` atomically;
  ``metadata`` (strings: the spec, the backend) goes where the format keeps metadata.
- extra ``load_model(path, *, trust_pickle=False) -> native``: a whole native model from the
  framework's own whole-model file (torch: a pickled ``nn.Module``, only with ``trust_pickle``;
  Keras: ``.keras``), for ``dense-bridge check A B --mapping`` (``_capture.py``).

Capability ``devices`` (:data:`DEVICES`): models that live on a device (a GPU, one of JAX's
devices). Without it every array crosses through host numpy (correct, slower on a GPU).

- ``device_of(native) -> str | None``: where the model keeps its parameters, as dense_bridge names
  devices ("cpu", "cpu:1" for a second JAX host device, "cuda:0"); None when it holds no array.
- ``parse_device(value, argument="device") -> device``: a user's ``device=`` (the framework's own
  device object, or "cpu", "cuda", "cuda:N", "gpu", "gpu:N") as the framework's device; a
  TypeError for another type, a SpecError naming ``argument`` and echoing the value for a
  device the framework cannot place arrays on here. ``from_numpy(array, device=None)`` then
  places an array there (one host-to-device copy).
- ``place(native, device) -> native``: the model with its arrays on ``device`` (as
  ``parse_device`` gives it), one transfer per array; the same object where the framework moves
  in place (torch, Flax), a new one where modules are immutable (Equinox).
- ``device_params(native) -> dict | None``: canonical parameters as the framework's own arrays
  where the model keeps them (views; the canonical layout may be a transposed view): nothing
  copied, no device left. None where they are computed on the host (quantized layers). A walk's
  ``Entry.extra["read_device"]`` gives a layer's native arrays the same way, and
  ``Entry.extra["snapshot_device"]`` a copy of them on the device (JAX's immutable arrays
  themselves), which a failed transfer writes back.
- ``nonfinite_flags(arrays) -> list[bool]``: which arrays hold NaN/Inf: one reduction per array
  on its device and one host synchronisation for the verdict.
- extra ``in_place_copies(writes) -> (taken, commit)``: of a transfer's checked writes
  (``(layer, "canonical" | "native", src arrays)``), those that are plain in-place copies of
  one shape on one device that can neither fail nor allocate, and one ``commit()`` doing them
  all at once, done after every other write: they need no undo snapshot (``models/_execute.py``).
- With the capability, ``set_params`` and a walk's ``Entry.write`` also take arrays of any
  framework that speaks DLPack (``__dlpack__``), moved into the model device to device: the
  transpose and the cast done there, one transfer per array when the devices differ.
- extra ``COMPILES_FROM_DEVICE_ARRAYS = True``: ``compile`` takes a ``ParamSource`` holding such
  arrays (``keep_device=True``) and builds the model around copies made on their device, so
  ``db.convert`` of a model on an accelerator never passes through host memory (JAX adapters;
  torch builds its layers from host buffers, and a convert into torch reads the source once).

Capability ``lora`` (:data:`LORA`, in ``_lora.py``; the verbs are described in
``dense_bridge/lora/__init__.py``): LoRA-wrapped layers read and written as the wrapped layer's
params plus canonical ``lora_*`` keys. Extras: ``lora_folds_scale`` (the framework keeps no
scale of its own), ``lora_leftovers``, ``lora_raw_updates`` (the updates of LoRA on raw parameters, for ``lora="merge"``), ``save_lora_h5``/``load_lora_h5`` (adapter files of
the framework's own). Capability ``quant_lora`` (:data:`QUANT_LORA`): merging an adapter into
a quantized base (``dense_bridge/lora/_merge.py``).

Capability ``quant`` (:data:`QUANT`): quantized linear layers in the canonical quantized form
(``dense_bridge/quant/__init__.py``); ``quant_positions``/``quant_position_build`` give a chain's
quantized positions for checkpoints holding codes, and capability ``quant_files``
(:data:`QUANT_FILES`) the framework's quantized checkpoint files (``checkpoints/_quantized.py``).

- ``quant_layer(layer) -> handle | None``: the layer's quantized-linear handle (codes, the
  framework's own dequantization and quantizer), None for a layer that is not quantized;
  a ConversionError naming the mode for a quantized layer it cannot read (``dense_bridge/quant.py``).
- ``quant_build(layer, quant) -> native``: the float linear ``layer`` quantized by the framework's
  own quantizer with ``quant``'s bits, groups and scheme (in place or as another object, returned);
  a ConversionError where the framework has no such scheme (``db.convert(..., quant=)``).

Capability ``parallel`` (:data:`PARALLEL_VERBS`, in ``_parallel.py``): offered, all of them, by
every adapter whose manifest declares the ``parallel`` capability (``dense_bridge.registry._manifest.PARALLEL``)
and by no other. The core calls them from one module, ``dense_bridge/parallel/_dispatch.py``: a
parallel model's get_params/set_params/to_spec/trace go to the ``parallel_*`` versions there, so
the plain verbs never check whether a model is parallel. The plan they build from (which layer is
column, row or replicated, which block each rank holds) is ``dense_bridge.parallel._plan``; every
one of them but ``parallel_compile`` and ``parallel_agree_seed`` takes a model ``parallel_compile``
made, and every one but ``parallel_state`` is collective (every rank of the group calls it).

- ``parallel_compile(spec, block, parallel, group) -> native``: the framework's tensor-parallel
  model for ``spec`` over ``group`` (the framework's own group or mesh; None: its default one),
  planned by ``resolve_plan(spec, parallel, world_size)``. ``block(position, name, index)`` gives
  the canonical block ``index`` (a tuple of slices) of parameter ``name`` of the layer at
  ``position``: an engine with one process per rank asks for its own blocks only, so a load never
  materialises a whole tensor; a single-controller engine (JAX) asks for whole tensors and places
  the shards itself.
- ``parallel_state(native) -> dict | None``: ``{"plan", "rank", "world_size", ...}`` of a model
  ``parallel_compile`` made, None for any other object (never collective, never raises).
- ``parallel_get_params(native, local) -> dict``: full canonical arrays on every rank, or with
  ``local`` this rank's blocks as ``dense_bridge.parallel._plan.Shard(array, index)``.
- ``parallel_set_params(native, params)``: full canonical ``params`` (validated by the core, a
  subset with strict=False); each rank keeps its own block.
- ``parallel_to_spec(native) -> spec``: the full (unsharded) spec.
- ``parallel_trace(native, inputs, grad_out) -> Trace``: as ``trace``, every output and gradient
  gathered whole on every rank (``db.testing.compare`` holds it against a one-process model).
- ``parallel_barrier(native)``: every rank of the model's group reaches this point.
- ``parallel_agree_seed(group, seed) -> int``: rank 0's ``seed`` on every rank of ``group``
  (``compile(seed=None, parallel=...)``: every rank keeps its block of one random model).

Capability ``dcp`` (:data:`DCP_VERBS`), declared in the manifest too: distributed-checkpoint
directories, for ``db.save(..., format="dcp")`` and ``db.load`` of a directory holding a
``.metadata`` file (``dense_bridge/parallel/_dcp.py``):

- ``save_dcp(native, path)``: the model's state written into the directory ``path`` by the
  framework's distributed checkpoint (collective on a parallel model: each rank its own shards).
- ``load_dcp(native, path)``: ``native`` (parallel or not, built for the directory's spec) filled
  from the directory ``path``, saved at any world size; no code stored in the directory runs.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REQUIRED_VERBS", "OPTIONAL_VERBS", "Capability", "CAPABILITIES", "RUNNING", "FILES", "LORA", "QUANT",
           "QUANT_LORA", "QUANT_FILES", "PORTS", "DEVICES", "PARALLEL_VERBS", "DCP_VERBS", "capability", "offered", "problems",
           "REQUIRED_FILES", "OPTIONAL_FILES"]

#: Module-level functions every adapter package's ``__init__`` exposes.
REQUIRED_VERBS: tuple[str, ...] = ("owns", "compile", "get_params", "set_params", "to_spec", "to_numpy", "from_numpy")


@dataclass(frozen=True)
class Capability:
    """One optional ability of a backend: ``verbs``, offered all together or not at all;
    ``extras``, each optional but only beside the verbs; ``needs``, capabilities it builds on;
    ``manifest``: it is also declared in the manifest's ``capabilities`` (the core asks about it
    before the framework is imported); ``purpose``: what it is for, in words, for errors."""

    name: str
    verbs: tuple[str, ...]
    purpose: str
    extras: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    manifest: bool = False


RUNNING = Capability("running", ("trace", "capture", "walk", "run_layer"),
                     "running models and looking inside them (compare, compare_models, linear_layers, transfer)",
                     extras=("train_sgd", "inference", "array_namespace"))
FILES = Capability("files", ("file_info", "read_file", "write_file"), "the framework's own checkpoint files",
                   extras=("file_views", "file_layout", "load_model"))
LORA = Capability("lora", ("lora_base", "read_lora", "write_lora", "lora_heads", "attach_lora", "detach_lora",
                           "lora_dora"), "LoRA-wrapped layers and adapter files",
                  extras=("lora_folds_scale", "lora_leftovers", "lora_raw_updates", "save_lora_h5", "load_lora_h5",
                          "lora_root"))  # lora_root: the path prefix under which a wrapper holds its base model
QUANT = Capability("quant", ("quant_layer", "quant_build", "quant_positions", "quant_position_build"),
                   "quantized linear layers (codes)")
QUANT_LORA = Capability("quant_lora", ("lora_quantized", "lora_dequantize", "lora_requantize", "replace_lora"),
                        "merging a LoRA adapter into a quantized base", needs=("lora", "quant"))
QUANT_FILES = Capability("quant_files", ("quant_file_layers", "quant_file_template"),
                         "the framework's quantized checkpoint files", needs=("quant", "files"),
                         extras=("model_dir_layers",))  # the layers of a quantized model directory (ModelDir)
#: Tensor-parallel verbs: all of them in every adapter whose manifest declares ``parallel``, none elsewhere.
PARALLEL_VERBS: tuple[str, ...] = ("parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params",
                                   "parallel_to_spec", "parallel_trace", "parallel_barrier", "parallel_agree_seed")
#: Distributed-checkpoint verbs: both in every adapter whose manifest declares ``dcp``.
DCP_VERBS: tuple[str, ...] = ("save_dcp", "load_dcp")
_PARALLEL = Capability("parallel", PARALLEL_VERBS, "tensor parallelism (parallel=)", manifest=True)
_DCP = Capability("dcp", DCP_VERBS, "distributed checkpoint directories (format='dcp')", manifest=True)
#: Whole model directories of the libraries built on the framework (``_ports.py``; the verbs are
#: described in dense_bridge/ports/_dirs.py), declared with the formats in ``Manifest.port_formats``.
PORTS = Capability("ports", ("port_detect", "port_contents", "port_common_config", "port_own_config", "port_shrink", "port_twin", "port_save",
                             "port_shapes", "port_layout", "port_load", "port_logits", "port_example", "port_describe"),
                   "whole model directories of the libraries built on the framework (db.port)", manifest=True,
                   # a weight file opened for streaming (else read as safetensors); a one-file destination
                   # written by its format (port_write) and a one-file model described (port_inspect); a destination's own
                   # inputs, weight-file writer and config files (ports/_dirs.py)
                   extras=("port_open", "port_write", "port_inspect", "port_inputs", "port_write_weights", "port_write_config",
                           "port_complete_config", "port_as_loaded", "port_source_form",
                           # codes: ports/_codes.py
                           "port_parse_quantize", "port_quantize", "port_keep_codes", "port_recompute_codes",
                           # a one-file source's tokenizer written as the destination directory's files
                           "port_write_extras"))

#: Models on accelerators (``dense_bridge/models/_device.py``): where a model lives, placing arrays
#: there, and moves between two models that never leave the device.
DEVICES = Capability("devices", ("device_of", "parse_device", "place", "device_params", "nonfinite_flags"),
                     "models on devices: placement (device=) and moves that stay on the device",
                     extras=("in_place_copies",))

#: Every capability, by name. The names of the manifest-declared ones are
#: ``dense_bridge.registry._manifest.PARALLEL`` and ``DCP``.
CAPABILITIES: dict[str, Capability] = {c.name: c for c in (RUNNING, FILES, LORA, QUANT, QUANT_LORA, QUANT_FILES,
                                                           _PARALLEL, _DCP, PORTS, DEVICES)}

#: Every verb of every capability, extras included: an adapter may offer any of them (by the rules
#: above); whatever needs one asks ``dense_bridge.registry._backends.optional_verb`` or ``require``.
OPTIONAL_VERBS: tuple[str, ...] = tuple(v for c in CAPABILITIES.values() for v in c.verbs + c.extras)


def capability(name: str) -> Capability:
    return CAPABILITIES[name]


def _has(adapter: object, verb: str) -> bool:
    return callable(getattr(adapter, verb, None))


def offered(adapter: object) -> frozenset[str]:
    """The capabilities ``adapter`` offers: those with at least one of their verbs (a complete
    group, once :func:`problems` finds nothing)."""
    return frozenset(c.name for c in CAPABILITIES.values() if any(_has(adapter, v) for v in c.verbs))


def problems(adapter: object, declared: frozenset[str] = frozenset(), formats: bool = False) -> list[str]:
    """What ``adapter`` breaks of the contract, one sentence each (empty: it conforms).

    ``declared``: its manifest's capabilities; ``formats``: its manifest declares file formats.
    Checked: every required verb; every capability's verbs all or none; extras only beside their
    group; a group's ``needs`` offered too; a manifest capability declared exactly when offered;
    file formats only with the ``files`` capability.
    """
    out = []
    missing = [v for v in REQUIRED_VERBS if not _has(adapter, v)]
    if missing:
        out.append(f"it lacks {', '.join(missing)} (every adapter offers {', '.join(REQUIRED_VERBS)})")
    has = offered(adapter)
    for c in CAPABILITIES.values():
        present = [v for v in c.verbs if _has(adapter, v)]
        if present and len(present) < len(c.verbs):
            lacking = [v for v in c.verbs if v not in present]
            out.append(f"it offers part of the {c.name!r} capability ({', '.join(present)}) but lacks "
                       f"{', '.join(lacking)}: offer every verb of the group or none")
        stray = [v for v in c.extras if _has(adapter, v)]
        if stray and not present:
            out.append(f"it offers {', '.join(stray)} without the {c.name!r} capability ({', '.join(c.verbs)})")
        if present:
            out += [f"its {c.name!r} capability needs the {n!r} capability ({', '.join(CAPABILITIES[n].verbs)})"
                    for n in c.needs if n not in has]
        if c.manifest and bool(present) != (c.name in declared):
            out.append(f"its manifest {'declares' if c.name in declared else 'does not declare'} the {c.name!r} "
                       f"capability but it offers {'none' if not present else 'the verbs'} of it "
                       f"({', '.join(c.verbs)})")
    if formats and FILES.name not in has:
        out.append(f"its manifest declares file formats but it lacks the 'files' capability ({', '.join(FILES.verbs)})")
    return out


#: Files every adapter package has, one role each (the same names in every package).
REQUIRED_FILES: tuple[str, ...] = (
    "__init__.py",      # the verbs, re-exported; the package docstring gives the layouts
    "_arrays.py",       # to_numpy/from_numpy, dtype names, bfloat16 across the boundary
    "_activations.py",  # dense_bridge Activation <-> the framework's activations
    "_layers.py",       # compile/owns and dense_bridge's own native layer classes
    "_params.py",       # get_params/set_params and the layout table (every transpose)
    "_to_spec.py",      # to_spec: a native layer or chain -> its spec
    "_trace.py",        # trace: forward and backward with the framework's autograd
    "_models.py",       # walk: every layer with parameters inside any model, by path
    "_files.py",        # file_info/read_file/write_file: native checkpoint formats
    "_manifest.py",     # MANIFEST: what the core knows without importing the framework (formats, needs)
)

#: Files an adapter package may have besides the required ones (one that every adapter has belongs
#: in REQUIRED_FILES).
OPTIONAL_FILES: tuple[str, ...] = (
    "_capture.py",   # capture: per-layer inputs/outputs/gradients inside a whole model
    "_namespace.py",  # array_namespace: compare_models' judge computing on the captures' own device
    "_parallel.py",  # PARALLEL_VERBS: tensor parallelism on the framework's own machinery (dense_bridge/parallel/)
    "_engine.py",    # a framework that runs on several engines (Keras 3): what differs per engine
    "_graph.py",     # a framework whose models are graphs (ONNX): the graph index and node patterns
    "_lora.py",      # LoRA adapters: the framework's adapter classes as canonical lora_* params
    "_lora_files.py",  # its ecosystem's LoRA adapter directories, framework-free (registry._manifest.AdapterFormat)
    "_quant.py",     # quant_layer: quantized linear layers in the canonical quantized form (dense_bridge/quant.py)
    "_ports.py",     # PORTS: the whole model directories of the libraries built on it (db.port)
    "_port_quant.py",  # PORTS extras: quantized codes in ports (ports/_codes.py: keep_codes, quantize=)
    "_port_kinds.py",  # PORTS extras: config settings one library writes in another form (a pattern, renamed kinds)
    "_quant_files.py",  # quant_file_template: the framework's quantized checkpoint files (checkpoints/_quantized.py)
)

