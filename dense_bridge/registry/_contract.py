"""The contract every adapter package in ``dense_bridge.backends`` fulfils, as data a test checks.

An adapter is a package ``backends/<framework>/`` (installed as ``dense_bridge.backends.<fw>``)
whose ``__init__.py`` exposes the verbs below as module-level functions. The registry imports it
by name; the core calls these verbs and never the framework. ``tests/architecture/test_architecture.py`` checks
that every registered adapter whose framework is installed has every verb in :data:`REQUIRED_VERBS`
and that every adapter package has exactly the files of :data:`REQUIRED_FILES` (plus those of
:data:`OPTIONAL_FILES`).

Canonical parameters follow ``dense_bridge.params._source``: Dense ``kernel`` (in_features, units),
``bias`` (units,), ``mask`` (in_features, units); Bilinear ``kernel`` (units, in1, in2); in a
Sequential every key is prefixed with the layer's position ("0.kernel").

- ``owns(obj) -> bool``: is ``obj`` a layer/model of this framework that the adapter handles.
  Decided without importing anything new (an object of a framework exists only once it is imported).
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
- ``to_numpy(array) -> np.ndarray``: a framework array (tensor, variable) as numpy, dtype kept
  (bfloat16 as ``ml_dtypes.bfloat16``); may be a read-only view of the framework's memory.
- ``from_numpy(array) -> framework array``: a numpy array as the framework's array, dtype kept
  (bfloat16 included); may share memory with ``array`` where the framework allows it (torch).

The manifest (``_manifest.py``, framework-free, ``MANIFEST = dense_bridge.adapter_kit.Manifest(...)``)
declares what the core may know before the framework is imported: packages required and the
install hint, owner priority, capabilities (``gradients``), and the file formats with their
sniffing, extensions, labels and temporary suffixes (``dense_bridge.registry._manifest``).

Optional verbs (:data:`OPTIONAL_VERBS`: offered by some adapters, used where present; whatever
needs one asks ``dense_bridge.registry._backends.optional_verb``, which names the backend and the verb in
its error when the adapter lacks it):

- ``train_sgd(native, inputs, labels, *, steps, lr) -> (probs_before, probs_after)``: plain SGD
  with the framework's autograd on L = mean(-log p[label]) for a model whose output p is
  probabilities (the demo: torch, and numpy's reference backward).
- ``inference(native) -> context manager``: a scope in which masked layers may reuse kernel *
  mask without a change signal (Keras on TensorFlow), behind ``db.inference``.
- ``load_model(path, *, trust_pickle=False) -> native``: a whole native model from the
  framework's own whole-model file (torch: a pickled ``nn.Module``, only with ``trust_pickle``;
  Keras: ``.keras``), for ``dense-bridge check A B --mapping`` (``_capture.py``).

- ``quant_layer(layer) -> handle | None``: the layer's quantized-linear handle (codes, the
  framework's own dequantization and quantizer), None for a layer that is not quantized;
  a ConversionError naming the mode for a quantized layer it cannot read (``dense_bridge/quant.py``).
- ``quant_build(layer, quant) -> native``: the float linear ``layer`` quantized by the framework's
  own quantizer with ``quant``'s bits, groups and scheme (in place or as another object, returned);
  a ConversionError where the framework has no such scheme (``db.convert(..., quant=)``).

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
- ``file_views(path, container, spec, *, files=None, check) -> Mapping | None`` (optional):
  the file's canonical parameters (a ``checkpoints._native.FileViews``: {canonical name: array},
  each read when first asked for) without building a model of the file's framework: a load
  onto that framework builds its model from them layer by layer (``ParamSource(stream=)``, as
  from a canonical file), a conversion to another framework copies one layer at a time. The
  adapter knows the names its framework gives the model it compiles for ``spec``; ``check``
  as for ``read_file``. None where the adapter cannot serve this file so: the core falls back
  to ``read_file``. torch (zip, legacy pickle, safetensors), MLX (safetensors, ``.npz``) and
  Keras (``.weights.h5``) offer it.
- ``file_layout(spec, path, kind, *, temp, metadata=None) -> FileLayout | None`` (optional):
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

Tensor-parallel verbs (:data:`PARALLEL_VERBS`, in ``_parallel.py``): offered, all of them, by
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

Distributed-checkpoint verbs (:data:`DCP_VERBS`): offered by an adapter whose manifest declares
the ``dcp`` capability (``dense_bridge.registry._manifest.DCP``), for ``db.save(..., format="dcp")`` and
``db.load`` of a directory holding a ``.metadata`` file (``dense_bridge/parallel/_dcp.py``):

- ``save_dcp(native, path)``: the model's state written into the directory ``path`` by the
  framework's distributed checkpoint (collective on a parallel model: each rank its own shards).
- ``load_dcp(native, path)``: ``native`` (parallel or not, built for the directory's spec) filled
  from the directory ``path``, saved at any world size; no code stored in the directory runs.
"""
from __future__ import annotations

__all__ = ["REQUIRED_VERBS", "OPTIONAL_VERBS", "PARALLEL_VERBS", "DCP_VERBS", "REQUIRED_FILES", "OPTIONAL_FILES"]

#: Module-level functions every adapter package's ``__init__`` exposes.
REQUIRED_VERBS: tuple[str, ...] = (
    "owns", "compile", "get_params", "set_params", "to_spec", "trace", "to_numpy", "from_numpy",
    "capture",  # per-layer values inside a whole model (testing.compare_models)
    "walk",  # every layer with parameters inside any model, by path
    "file_info", "read_file", "write_file",  # the framework's native checkpoint files
)

#: Tensor-parallel verbs: all of them in every adapter whose manifest declares ``parallel``, none elsewhere.
PARALLEL_VERBS: tuple[str, ...] = ("parallel_compile", "parallel_state", "parallel_get_params", "parallel_set_params",
                                   "parallel_to_spec", "parallel_trace", "parallel_barrier", "parallel_agree_seed")

#: Distributed-checkpoint verbs: both in every adapter whose manifest declares ``dcp``.
DCP_VERBS: tuple[str, ...] = ("save_dcp", "load_dcp")

#: Module-level functions some adapters offer; callers check with ``hasattr`` first (the
#: parallel and DCP ones with the manifest's capability: ``dense_bridge/parallel/_dispatch.py``).
OPTIONAL_VERBS: tuple[str, ...] = PARALLEL_VERBS + DCP_VERBS + ("train_sgd", "load_model", "file_views", "file_layout", "inference",
                                   "run_layer",  # one layer alone on given x, grad_out: (y, dL/dx, canonical grads)
                                   # LoRA adapters (``_lora.py``; the verbs are described in dense_bridge/lora.py)
                                   "lora_base", "read_lora", "write_lora", "lora_heads", "attach_lora", "detach_lora",
                                   "lora_folds_scale", "save_lora_h5", "load_lora_h5",
                                   "lora_quantized", "lora_dequantize", "lora_requantize", "replace_lora", "lora_leftovers", "lora_dora",
                                   "quant_layer", "quant_build",
                                   # a chain's quantized positions, for checkpoints holding codes (checkpoints/_quantized.py)
                                   "quant_positions", "quant_position_build", "quant_file_layers", "quant_file_template",
                                   # a quantized model directory the manifest declares (ModelDir): its layers
                                   "model_dir_layers")

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
    "_parallel.py",  # PARALLEL_VERBS: tensor parallelism on the framework's own machinery (dense_bridge/parallel/)
    "_engine.py",    # a framework that runs on several engines (Keras 3): what differs per engine
    "_graph.py",     # a framework whose models are graphs (ONNX): the graph index and node patterns
    "_lora.py",      # LoRA adapters: the framework's adapter classes as canonical lora_* params
    "_quant.py",     # quant_layer: quantized linear layers in the canonical quantized form (dense_bridge/quant.py)
    "_quant_files.py",  # quant_file_template: the framework's quantized checkpoint files (checkpoints/_quantized.py)
)

