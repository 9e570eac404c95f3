"""keras-hub preset directories (``config.json``, ``model.weights.h5``, ``metadata.json``,
``task.json``, as ``Task.save_to_preset`` writes them), the model-directory verbs of ``db.port``
(see dense_bridge/ports/_dirs.py).

Everything about keras-hub presets lives here:

- which models: the ``model_type`` values keras-hub's own transformers importer accepts, read from
  its registry (``TransformersPresetLoader``), each with its converter module;
- configs: the interchange form is transformers' ``config.json`` dictionary; into keras-hub it is
  translated by the importer's own ``convert_backbone_config``; out of keras-hub the translation
  is inverted by probing the importer (each transformers number changed alone, the keras-hub key
  that follows it found by value), then checked by running the importer on the result: a preset
  whose config the importer cannot give back is refused naming the key;
- weights: ``model.weights.h5`` holds the backbone's variables at the paths Keras' own saver
  (``keras.src.saving.saving_lib._save_state``) gives them: ``layers/<snake class name>[_<n>]/...
  /vars/<i>``. The port names a tensor by that path with dots, the per-class counter of a repeated
  layer written as an index (``layers.llama_transformer_decoder.1._self_attention_layer._query_dense:0``,
  the first one ``.0``), so the port's rules generalise over layers; :func:`h5_key` gives the path
  back. The paths and shapes of a real model are recorded by running Keras' saver on the backbone
  built in a ``keras.StatelessScope`` (no variable is allocated), and the file is written one
  dataset at a time (:func:`port_write_weights`): streamed, never the whole model in memory.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import json
import math
import os
import re

import numpy as np

from dense_bridge.adapter_kit import BackendUnavailableError, CheckpointError, ConversionError, Match, received
from dense_bridge.checkpoints._safetensors import read_json_file

FORMAT = "keras-hub"
CONFIG = "config.json"
TASK = "task.json"
WEIGHTS = "model.weights.h5"
TASK_WEIGHTS = "task.weights.h5"
#: The shard map of a sharded preset (Keras' ``ShardedH5IOStore``: group path -> shard file(s)).
SHARD_MAP = "model.weights.json"
METADATA = "metadata.json"
#: keras-hub's own tokenizer and preprocessor files (keras-hub serialisations, not transformers').
TOKENIZER_FILES = ("tokenizer.json", "preprocessor.json")
#: transformers' tokenizer files, which keras-hub's importer translates (``convert_tokenizer``).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
_SUFFIX = re.compile(r"^(.*)_(\d+)$")
#: The port names of a task's own variables (``task.weights.h5``) begin with this.
TASK_PREFIX = "task."


def _keras_hub():
    try:
        import keras_hub
    except ImportError:
        raise BackendUnavailableError("keras-hub presets need the keras-hub package: pip install keras-hub") from None
    return keras_hub


# ------------------------------------------------------------------------------ the importer's registry
def _registry() -> dict[str, str]:
    """model_type -> converter module name, read from keras-hub's ``TransformersPresetLoader``
    (its constructor compares ``model_type`` with each string it accepts, in order)."""
    _keras_hub()
    from keras_hub.src.utils.transformers import preset_loader

    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(preset_loader.TransformersPresetLoader.__init__)))
    out: dict[str, str] = {}

    def visit(node):
        if isinstance(node, ast.If):
            types: list[str] = []
            test = node.test
            if isinstance(test, ast.Compare) and len(test.comparators) == 1:
                c = test.comparators[0]
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    types = [c.value]
                elif isinstance(c, (ast.Tuple, ast.List)):
                    types = [e.value for e in c.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            module = next((s.value.id for s in node.body if isinstance(s, ast.Assign)
                           and isinstance(s.value, ast.Name)), None)
            if module is not None:
                for t in types:
                    out.setdefault(t, module)
            for s in node.orelse:
                visit(s)
        elif hasattr(node, "body"):
            for s in node.body:
                visit(s)

    visit(tree)
    if not out:
        raise ConversionError("keras-hub's transformers importer (TransformersPresetLoader) lists no model_type "
                              "that this version of dense_bridge can read")
    return out


def _converter(model_type):
    import importlib

    registry = _registry()
    if model_type not in registry:
        raise ConversionError(f"keras-hub {_keras_hub().__version__} has no importer for model_type {model_type!r} "
                              f"(its transformers importer accepts {len(registry)}: {', '.join(sorted(registry))})")
    return importlib.import_module(f"keras_hub.src.utils.transformers.{registry[model_type]}")


def _classifier(config: dict) -> bool:
    """Whether the transformers config names a sequence classifier (transformers' own mapping)."""
    from transformers.models.auto import modeling_auto

    arch = (config.get("architectures") or [None])[0]
    return arch in set(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())


def _task_class(backbone_cls, config: dict):
    """The keras-hub task whose backbone is ``backbone_cls`` for the transformers ``config``: a text
    classifier for a sequence classifier, else a causal LM."""
    keras_hub = _keras_hub()
    from keras_hub.src.models.task import Task
    from keras_hub.src.utils.preset_utils import list_subclasses

    tasks = [t for t in list_subclasses(Task) if t.backbone_cls is backbone_cls]
    kind = keras_hub.models.TextClassifier if _classifier(config) else keras_hub.models.CausalLM
    found = [t for t in tasks if issubclass(t, kind)]
    if found:
        return sorted(found, key=lambda t: t.__name__)[0]
    raise ConversionError(f"keras-hub declares no {kind.__name__} for {backbone_cls.__name__} (its tasks: "
                          f"{sorted(t.__name__ for t in tasks)})")


# ------------------------------------------------------------------------------ names
def port_name(h5_path: str, families: set[str]) -> str:
    """The port's name of the dataset ``h5_path`` (``layers/x_1/vars/0``): groups joined by dots, a
    group of ``families`` (``parent/base``, a class saved more than once under one parent) written
    ``base.<counter>``, the variable index after a colon."""
    parts = h5_path.split("/")
    if len(parts) < 2 or parts[-2] != "vars":
        raise CheckpointError(f"{h5_path!r} is not a Keras variable path (…/vars/<index>)")
    out, parent = [], ""
    for comp in parts[:-2]:
        m = _SUFFIX.match(comp)
        base, n = (m.group(1), int(m.group(2))) if m else (comp, 0)
        if f"{parent}/{base}" in families:
            out += [base, str(n)]
        else:
            out.append(comp)
        parent = f"{parent}/{comp}"
    return ".".join(out) + ":" + parts[-1]


def h5_key(name: str) -> str:
    """The dataset path of the port name ``name`` (the inverse of :func:`port_name`)."""
    group, _, index = name.rpartition(":")
    comps, out = group.split(".") if group else [], []
    i = 0
    while i < len(comps):
        if i + 1 < len(comps) and comps[i + 1].isdigit():
            n = int(comps[i + 1])
            out.append(comps[i] if n == 0 else f"{comps[i]}_{n}")
            i += 2
        else:
            out.append(comps[i])
            i += 1
    return "/".join(out + ["vars", index])


def families(paths) -> set[str]:
    """``parent/base`` of every layer class saved more than once under one parent (``base`` and
    ``base_1`` both present): their counters are layer indices."""
    children: dict[str, set[str]] = {}
    for p in paths:
        parts = p.split("/")[:-2]
        parent = ""
        for comp in parts:
            children.setdefault(parent, set()).add(comp)
            parent = f"{parent}/{comp}"
    out = set()
    for parent, names in children.items():
        for comp in names:
            if f"{comp}_1" in names:
                out.add(f"{parent}/{comp}")
    return out


# ------------------------------------------------------------------------------ reading h5 files
class _Info:
    __slots__ = ("shape", "numpy_dtype")

    def __init__(self, shape, numpy_dtype) -> None:
        self.shape, self.numpy_dtype = shape, numpy_dtype


class H5Weights:
    """One keras-hub ``*.weights.h5`` read as the port reads a safetensors file (``tensors``: port
    name -> info with ``shape`` and ``numpy_dtype``; ``get(name)``; ``keys``; ``close``). A preset's
    ``model.weights.h5`` is read with the ``task.weights.h5`` beside it, if any (a classifier's head,
    which keras-hub saves apart): its tensors' names begin with :data:`TASK_PREFIX`.

    The file's structure is checked first by the Keras adapter's own reader (no external or soft
    links, no virtual or external datasets, every dataset's bytes inside the file, numeric types);
    values are read one dataset at a time (a contiguous one memory-mapped), bounded by the file's
    size or, compressed, by the memory available."""

    def __init__(self, path: str) -> None:
        from dense_bridge._dtypes import numpy_dtype

        from ._files import DatasetReader, h5_structure

        self.path, self.metadata = path, {}
        self._keys: dict[str, tuple[object, str]] = {}
        self.tensors: dict[str, _Info] = {}
        directory, base = os.path.split(path)
        files = [(path, "")]
        # one shard of a sharded preset: layer counters read over every shard (the shard map)
        sharded = base not in (WEIGHTS, TASK_WEIGHTS) and os.path.isfile(os.path.join(directory, SHARD_MAP))
        shard_map = _shard_map(directory) if sharded else {}
        task = os.path.join(directory, TASK_WEIGHTS)
        first = base == WEIGHTS or (sharded and base == min(n for v in shard_map.values() for n in v))
        if first and os.path.isfile(task):
            files.append((task, TASK_PREFIX))  # a task head, saved beside the backbone
        for file, prefix in files:
            entries = h5_structure(file)
            reader = DatasetReader(file, entries)
            fam = families(list(entries) + ([k.strip("/") + "/0" for k in shard_map] if not prefix else []))
            for h5, (shape, dtype) in entries.items():
                if _own(h5):
                    continue
                name = prefix + port_name(h5, fam)
                self._keys[name] = (reader, h5)
                self.tensors[name] = _Info(tuple(shape), np.dtype(numpy_dtype(dtype)))

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        reader, key = self._keys[name]
        return reader.read(key)

    def close(self) -> None:
        self.tensors = {}

    def __enter__(self) -> "H5Weights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shard_map(path: str) -> dict[str, list[str]]:
    """The shard map of the sharded preset ``path``: group path -> shard file names, checked."""
    data = read_json_file(os.path.join(path, SHARD_MAP), "Keras shard map")
    wm = data.get("weight_map") if isinstance(data, dict) else None
    out: dict[str, list[str]] = {}
    if isinstance(wm, dict):
        for key, value in wm.items():
            names = value if isinstance(value, list) else [value]
            if not isinstance(key, str) or not all(isinstance(n, str) and n == os.path.basename(n)
                                                    and n not in ("", ".", "..") for n in names):
                wm = None
                break
            out[key] = names
    if not isinstance(wm, dict):
        raise CheckpointError(f"{os.path.join(path, SHARD_MAP)}: 'weight_map' is not an object of group path -> "
                              f"shard file name(s) in the preset's directory. {received('weight_map', str(wm)[:200])}")
    return out


def _shards(path: str) -> list[str]:
    return sorted({n for names in _shard_map(path).values() for n in names})


def port_open(fmt: str, path: str) -> H5Weights:
    """A keras-hub weights file opened for streaming (:class:`H5Weights`)."""
    return H5Weights(path)


# ------------------------------------------------------------------------------ detection, contents
def _serialized(path: str, name: str) -> dict:
    data = read_json_file(os.path.join(path, name), f"keras-hub {name}")
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) or "class_name" not in data:
        raise CheckpointError(f"{os.path.join(path, name)} is no keras-hub serialized object (no class_name/config). "
                              f"{received(name, str(data)[:120])}")
    return data


def port_detect(fmt: str, path: str) -> int:
    """CERTAIN for a ``config.json`` registered by keras-hub beside ``model.weights.h5`` (or the shard
    map ``model.weights.json`` of a sharded preset), else NO."""
    if not os.path.isfile(os.path.join(path, CONFIG)) or not any(
            os.path.isfile(os.path.join(path, n)) for n in (WEIGHTS, SHARD_MAP)):
        return Match.NO
    try:
        data = read_json_file(os.path.join(path, CONFIG), "keras-hub config")
    except CheckpointError:
        return Match.NO
    reg = data.get("registered_name") if isinstance(data, dict) else None
    return Match.CERTAIN if isinstance(reg, str) and reg.startswith("keras_hub>") else Match.NO


def port_contents(fmt: str, path: str, text_only: bool = False) -> dict:
    """``{"config": {"backbone", "task"}, "weights": {port name: "model.weights.h5"}, "extras": []}``
    (a classifier head's tensors, from ``task.weights.h5``, named with :data:`TASK_PREFIX`).

    Refused naming the file: keras-hub's own tokenizer files, which no installed code translates
    into transformers' (keras-hub's exporters write whole models only)."""
    backbone = _serialized(path, CONFIG)
    task = _serialized(path, TASK) if os.path.isfile(os.path.join(path, TASK)) else None
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(path, name)):
            raise ConversionError(f"{os.path.join(path, name)}: a keras-hub tokenizer, which no installed code "
                                  "translates into another library's tokenizer: refused (nothing was written)")
    files = [WEIGHTS] if os.path.isfile(os.path.join(path, WEIGHTS)) else _shards(path)
    weights: dict[str, str] = {}
    for name in files:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"{os.path.join(path, SHARD_MAP)} names the shard {name!r}, which does not exist "
                                  "(nothing was written)")
        with H5Weights(full) as f:
            weights.update({k: name for k in f.keys()})
    if not weights:
        raise CheckpointError(f"{os.path.join(path, files[0])} holds no variables")
    return {"config": {"backbone": backbone, "task": task}, "weights": weights, "extras": []}


# ------------------------------------------------------------------------------ configs
def _backbone_class(config: dict):
    import keras

    _keras_hub()
    cls = keras.saving.get_registered_object(config.get("registered_name")) \
        if isinstance(config.get("registered_name"), str) else None
    if cls is None:
        raise ConversionError(f"the keras-hub config names no backbone class keras-hub registers. "
                              f"{received('registered_name', config.get('registered_name'))}")
    return cls


def _converters_for_backbone(cls) -> list[tuple[str, object]]:
    """(model_type, converter) of every importer whose backbone class is ``cls`` (several model
    types can share one backbone class: Gemma and Gemma 2), those whose transformers config is a
    text model's first (a multimodal config's importer also makes the text backbone), then in the
    importer's own order."""
    import transformers

    registry = _registry()
    found = []
    for model_type in registry:
        try:
            conv = _converter(model_type)
        except ImportError:
            continue
        if getattr(conv, "backbone_cls", None) is cls:
            found.append((model_type, conv))
    if not found:
        raise ConversionError(f"keras-hub's transformers importer makes no {cls.__name__}: only presets of the "
                              f"backbones it imports can be ported (model types {', '.join(sorted(registry))})")

    def multimodal(model_type):
        cfg_cls = transformers.CONFIG_MAPPING.get(model_type)
        return cfg_cls is not None and "text_config" in getattr(cfg_cls, "sub_configs", {})

    return sorted(found, key=lambda f: multimodal(f[0]))


def _converter_for_backbone(cls) -> tuple[str, object]:
    """(model_type, converter) of the first importer whose backbone class is ``cls``."""
    return _converters_for_backbone(cls)[0]


def _hf_defaults(model_type: str) -> dict:
    import transformers

    try:
        cls = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ConversionError(f"transformers {transformers.__version__} does not implement model_type "
                              f"{model_type!r}, which keras-hub's importer reads") from None
    out = cls().to_dict()
    out.pop("transformers_version", None)
    out["model_type"] = model_type
    return out


def _hf_config(model_type: str, kwargs: dict) -> dict:
    import transformers

    out = transformers.CONFIG_MAPPING[model_type](**kwargs).to_dict()
    out.pop("transformers_version", None)
    out["model_type"] = model_type
    return out


@contextlib.contextmanager
def _unallocated():
    """A ``keras.StatelessScope`` whose variables stay declared, never allocated: Keras' own scope
    allocates every variable declared in it when it is left (``initialize_variables``), and keeps
    those it does not in a process-wide list that the next scope's exit allocates; both are undone."""
    import keras
    from keras.src.backend.common import global_state

    before = list(global_state.get_global_attribute("uninitialized_variables", None) or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        global_state.set_global_attribute("uninitialized_variables", before)


def _import_config(conv, hf: dict) -> dict:
    """keras-hub's own translation of the transformers config ``hf`` (its importer's
    ``convert_backbone_config``), with the backbone's defaults for what it leaves out. Run in a
    ``keras.StatelessScope``: an importer that builds a sub-model while translating (a vision
    encoder handed to the backbone) declares its variables without allocating them (probing a
    multimodal config's numbers would otherwise allocate encoders of thousands of layers)."""
    with _unallocated():
        kw = conv.convert_backbone_config(hf) if len(inspect.signature(conv.convert_backbone_config).parameters) \
            == 1 else conv.convert_backbone_config(hf, conv.backbone_cls)
    return dict(kw)


def _defaults(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty and k not in ("self", "dtype", "name")}


_SKIP = ("name", "trainable", "dtype")


def _numbers(d: dict, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict) and not prefix:
            yield from _numbers(v, (k,))
        elif isinstance(v, (bool, int, float)) and v is not None:
            yield prefix + (k,), v


def _get(d: dict, path: tuple):
    for k in path:
        d = d[k]
    return d


def _set(d: dict, path: tuple, value) -> dict:
    out = json.loads(json.dumps(d))
    target = out
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return out


def port_common_config(fmt: str, config: dict) -> dict:
    """The transformers config whose import by keras-hub's own importer gives the preset's backbone
    config: learnt by changing each number of transformers' default config alone and seeing which
    keras-hub key follows it, then checked by importing the result. Where several model types'
    importers make the preset's backbone class (Gemma and Gemma 2 both make a GemmaBackbone), the
    first that gives the preset's config back. ConversionError naming every key the importer does
    not give back (for the model type that gets closest)."""
    cls = _backbone_class(config["backbone"])
    errors = []
    for model_type, conv in _converters_for_backbone(cls):
        try:
            return _common_config(config, cls, model_type, conv)
        except _NotGivenBack as exc:
            errors.append((exc.count, str(exc)))
        except Exception as exc:  # noqa: BLE001  this importer cannot read its own (transformers' strict
            # validation of a sub-config raises its own error class)
            errors.append((math.inf, f"{model_type!r}: {type(exc).__name__}: {exc}"))  # default config
    raise ConversionError(min(errors, key=lambda e: e[0])[1])


class _NotGivenBack(ConversionError):
    def __init__(self, message: str, count: int) -> None:
        super().__init__(message)
        self.count = count


def _common_config(config: dict, cls, model_type: str, conv) -> dict:
    """:func:`port_common_config` for one candidate model type; _NotGivenBack when its importer
    does not give the preset's config back."""
    backbone = config["backbone"]
    base = _hf_defaults(model_type)
    declared = set(base)
    k0 = _read_unwritten(conv, base)
    unwritten = [k for k in base if k not in declared]  # read by the importer, not written by transformers
    follows: dict[str, tuple] = {}  # keras-hub key -> (transformers key path, factor)
    for n, (path, value) in enumerate(_numbers(base)):
        if isinstance(value, bool):
            probes = [not value]
        else:  # two values: a keras-hub key that follows both by one factor is that key times it
            probes = [1009 + 2 * n, 2027 + 2 * n] if isinstance(value, int) else [0.125 + n, 0.375 + n]
        try:
            got = [_import_config(conv, _set(base, path, p)) for p in probes]
        except Exception:  # noqa: BLE001 - a probe the importer cannot compute with says nothing
            continue
        for key, v in got[0].items():
            if key in follows or k0.get(key) == v:
                continue
            if isinstance(value, bool):
                if v is probes[0]:
                    follows[key] = (path, None)
                continue
            vs = [g.get(key) for g in got]
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vs):
                factors = {x / p for x, p in zip(vs, probes)}
                if len(factors) == 1 and next(iter(factors)) != 0:
                    follows[key] = (path, next(iter(factors)))
    preset = {k: v for k, v in backbone["config"].items() if k not in _SKIP}
    kwargs: dict = {}
    for key, (path, factor) in follows.items():
        if key not in preset:
            continue
        value = preset[key]
        if factor not in (None, 1, 1.0) and isinstance(value, (int, float)) and not isinstance(value, bool):
            exact = value / factor
            value = int(exact) if isinstance(_get(base, path), int) and float(exact).is_integer() else exact
        if len(path) == 1:
            kwargs[path[0]] = value
        else:  # a nested entry (rope settings): the rest of it as transformers has it by default
            kwargs.setdefault(path[0], dict(base[path[0]]))[path[1]] = value
    from transformers.models.auto import modeling_auto

    task = config.get("task") or {}
    classes = (task.get("config") or {}).get("num_classes")
    if isinstance(classes, int):  # a text classifier: transformers' sequence classifier of the model type
        arch = modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
        kwargs["num_labels"] = classes
    else:
        arch = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if arch:
        kwargs["architectures"] = [arch]
    def given_back(kw):
        hf = _hf_config(model_type, kw)  # what follows from these (a head width) recomputed by transformers
        hf.update({k: kw[k] for k in unwritten if k in kw and k not in hf})  # kept as the importer reads them
        again = {**_defaults(cls), **_import_config(conv, hf)}
        wrong = sorted(k for k in preset if k in again and _differs(again[k], preset[k]))
        return hf, again, wrong + sorted(k for k in preset if k not in again)

    hf, again, wrong = given_back(kwargs)
    # a keras-hub value the importer computes by comparing two transformers numbers (a query scale
    # flag: head_dim == query_pre_attn_scalar) follows no number alone: two numbers equal in
    # transformers' default config are kept equal where that gives more of the preset back
    while wrong:
        better = None
        for p, pv in [(k, v) for k, v in kwargs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]:
            for q, qv in base.items():
                if q in kwargs or isinstance(qv, bool) or not isinstance(qv, (int, float)) or qv != base.get(p):
                    continue
                try:
                    got = given_back({**kwargs, q: pv})
                except Exception:  # noqa: BLE001 - a value the importer cannot compute with says nothing
                    continue
                if len(got[2]) < len(better[2] if better else wrong):
                    better = (*got, q, pv)
        if better is None:
            break
        hf, again, wrong, q, pv = better
        kwargs[q] = pv
    if wrong:
        raise _NotGivenBack(f"the keras-hub preset's {cls.__name__} config cannot be written as a transformers "
                              f"{model_type!r} config that keras-hub's importer gives back: "
                              + ", ".join(f"{k}={preset[k]!r} (imported back as {again.get(k, 'nothing')!r})"
                                          for k in wrong), len(wrong))
    return hf


#: a number the importer reads under a key transformers' config class does not write (a head width
#: it computes from others): put into the defaults so the importer runs, then probed as any other
_UNWRITTEN = 64


def _read_unwritten(conv, base: dict, limit: int = 8) -> dict:
    """keras-hub's import of transformers' default config ``base``; where the importer reads a key
    the config class does not write (KeyError), that key added to ``base`` (in place) as the number
    :data:`_UNWRITTEN`, so that the probes learn which keras-hub key follows it and the transformers
    config written carries it (a config class keeps a key it does not declare)."""
    for _ in range(limit):
        try:
            return _import_config(conv, base)
        except KeyError as exc:
            key = exc.args[0] if exc.args else None
            if not isinstance(key, str) or key in base:
                raise
            base[key] = _UNWRITTEN
    return _import_config(conv, base)


def _differs(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) != float(b)
        except (TypeError, ValueError):
            return True
    return a != b


def port_own_config(fmt: str, common: dict) -> dict:
    """``{"backbone": the serialized backbone config keras-hub's importer makes of ``common``,
    "task": the serialized causal-LM task around it (no preprocessor)}``; ConversionError naming a
    model_type keras-hub's importer does not accept, with those it does."""
    import keras

    conv = _converter(common.get("model_type"))
    cls = conv.backbone_cls
    kwargs = _import_config(conv, common)
    try:
        sig = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        sig = {}
    unknown = [k for k in kwargs if sig and k not in sig and not any(p.kind == p.VAR_KEYWORD for p in sig.values())]
    if unknown:
        raise ConversionError(f"keras-hub's importer gives {cls.__name__} arguments it does not take: {unknown}")
    config = {**_defaults(cls), **kwargs, "name": None, "trainable": True}
    config.pop("name")
    reg = keras.saving.get_registered_name(cls)
    backbone = {"module": cls.__module__, "class_name": cls.__name__, "config": config, "registered_name": reg}
    task_cls = _task_class(cls, common)
    task_config = {"backbone": backbone, "preprocessor": None}
    if issubclass(task_cls, _keras_hub().models.TextClassifier):
        labels = common.get("id2label")
        task_config["num_classes"] = len(labels) if isinstance(labels, dict) else int(common.get("num_labels", 2))
    task = {"module": task_cls.__module__, "class_name": task_cls.__name__, "config": task_config,
            "registered_name": keras.saving.get_registered_name(task_cls)}
    return json.loads(json.dumps({"backbone": backbone, "task": task}, default=_jsonable))


def _jsonable(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    raise TypeError(f"not JSON: {v!r}")


def port_shrink(fmt: str, common: dict) -> dict:
    """The twin's interchange config: shrunk by the interchange form's own library (transformers'
    config classes, through its format's ``port_shrink``), then with every flag keras-hub's importer
    derives by comparing two numbers kept as the real config has it (:func:`_keep_flags`)."""
    from dense_bridge.ports._dirs import Format

    return _keep_flags(common, Format("transformers").port_shrink(common))


def _keep_flags(common: dict, small: dict) -> dict:
    """``small`` (the shrunk ``common``) where two numbers equal in ``common`` and only one of them
    shrunk are made equal again when keras-hub's importer turns their comparison into a flag (Gemma 2
    normalizes queries by head_dim exactly when ``query_pre_attn_scalar == head_dim``): the twins then
    have the real model's flags. ``small`` unchanged where the importer does not read the config."""
    try:
        conv = _converter(common.get("model_type"))
        before = _import_config(conv, small)
    except Exception:  # noqa: BLE001 - no importer for it: nothing of keras-hub's to keep
        return small
    out = dict(small)
    ints = {k: v for k, v in common.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    for a, va in ints.items():
        if not isinstance(out.get(a), int) or out[a] == va:
            continue  # not changed by the shrink
        for b in [b for b, vb in ints.items() if b != a and vb == va and out.get(b) == vb]:
            try:
                after = _import_config(conv, {**out, b: out[a]})
            except Exception:  # noqa: BLE001 - a value the importer cannot compute with says nothing
                continue
            changed = [k for k in after if after[k] != before.get(k)]
            if changed and all(isinstance(after[k], bool) for k in changed):
                out[b] = out[a]
                before = after
    return out


# ------------------------------------------------------------------------------ models
def _build(config: dict, stateless: bool = False):
    """The backbone for ``config`` (``{"backbone", "task"}``); in a ``keras.StatelessScope`` its
    variables are declared, never allocated."""
    import keras

    _keras_hub()
    if stateless:
        with _unallocated():
            return keras.saving.deserialize_keras_object(config["backbone"])
    return keras.saving.deserialize_keras_object(config["backbone"])


def _record(model, skip=()) -> tuple[list[tuple[str, dict | None]], list[tuple[str, str, tuple, str]]]:
    """What Keras' own saver writes for ``model`` without reading a value: the groups it makes
    (path, metadata) and the variables it stores (group path, key, shape, dtype); ``skip``: ids of
    objects left out (``objects_to_skip``)."""
    from keras.src.saving import saving_lib

    class _Recorder(saving_lib.H5IOStore):
        def __init__(self) -> None:  # no file: only the paths and shapes are kept
            self.groups, self.vars, self._path = [], [], None

        def __bool__(self) -> bool:
            return True

        def make(self, path, metadata=None):
            self._path = path
            self.groups.append((path, metadata))
            return self

        def __setitem__(self, key, value):
            self.vars.append((self._path, str(key), tuple(int(d) for d in value.shape), value))

    rec = _Recorder()
    saving_lib._save_state(model, weights_store=rec, assets_store=None, inner_path="", visited_saveables=set(skip))
    return rec.groups, rec.vars


def _var_path(group: str, key: str) -> str:
    return f"{group}/vars/{key}" if group else f"vars/{key}"


#: :func:`_structure`'s answers for the last few configs (by their JSON text): one port asks for the
#: same config's structure several times (shapes, completion, the writer), and each answer builds the
#: whole backbone (seconds for a model with many layer kinds).
_STRUCTURES: dict[str, list] = {}
_STRUCTURES_KEPT = 4


def _structure(config: dict) -> list[tuple[str, list, list, list[str], list[str]]]:
    """:func:`_built_structure` of ``config``, remembered for the last few configs (the answer is
    read, never changed, by its callers)."""
    key = json.dumps(config, sort_keys=True, default=repr)
    if key not in _STRUCTURES:
        while len(_STRUCTURES) >= _STRUCTURES_KEPT:
            _STRUCTURES.pop(next(iter(_STRUCTURES)))
        _STRUCTURES[key] = _built_structure(config)
    return _STRUCTURES[key]


def _built_structure(config: dict) -> list[tuple[str, list, list, list[str], list[str]]]:
    """Per weights file of the preset for ``config``: (file name, groups, variables, their dataset
    paths, their port names, the variables not ported (:func:`_own`)), as Keras' saver writes them: the backbone (built in a
    ``keras.StatelessScope``, nothing allocated) into ``model.weights.h5``, and a task with weights
    of its own (a classifier's head, small) into ``task.weights.h5``."""
    backbone = _build(config, stateless=True)
    out = []
    parts = [(WEIGHTS, backbone, set(), "")]
    task = _task(backbone, config)
    if task.has_task_weights():
        parts.append((TASK_WEIGHTS, task, {id(layer) for layer in backbone._flatten_layers()}, TASK_PREFIX))
    for file, model, skip, prefix in parts:
        groups, recorded = _record(model, skip)
        variables = [v for v in recorded if not _own(_var_path(v[0], v[1]))]
        own = [v for v in recorded if _own(_var_path(v[0], v[1]))]
        paths = [_var_path(g, k) for g, k, _, _ in variables]
        fam = families(paths)
        out.append((file, groups, variables, paths, [prefix + port_name(p, fam) for p in paths], own))
    return out


def _own(h5_path: str) -> bool:
    """A variable Keras saves beside a task's weights that belongs to no layer (its optimizer's
    step count and slots): not ported, written as the task's saver writes it."""
    return h5_path.startswith("optimizer/")


def port_shapes(fmt: str, config: dict) -> dict[str, tuple[int, ...]]:
    """Every variable of keras-hub's model for ``config`` by port name, with its shape, from the
    model built without allocating its backbone and walked by Keras' saver (:func:`_structure`)."""
    return {name: v[2] for _, _, variables, _, names, _ in _structure(config) for name, v in zip(names, variables)}


def _task(backbone, config: dict):
    import keras

    cls = keras.saving.get_registered_object(config["task"]["registered_name"])
    rest = {k: v for k, v in config["task"]["config"].items() if k not in ("backbone", "preprocessor", "name")}
    return cls(backbone=backbone, preprocessor=None, **rest)


def port_twin(fmt: str, config: dict, seed: int = 0):
    """keras-hub's own causal LM for ``config`` (backbone from the serialized config, task around
    it, no preprocessor), every variable random (seeded) but the state layers compute from their
    configuration (a rotary embedding's frequencies: ``_models.computed_state``)."""
    from ._models import computed_state

    model = _task(_build(config), config)
    rng = np.random.default_rng(seed)
    seen = {id(v) for layer in model._flatten_layers(include_self=True, recursive=True)
            if computed_state(layer) for v in layer._non_trainable_variables}
    for v in model.weights:
        if id(v) in seen:
            continue
        seen.add(id(v))
        shape = tuple(v.shape)
        value = 1.0 + 0.2 * rng.standard_normal(shape) if len(shape) == 1 else \
            rng.standard_normal(shape) / math.sqrt(shape[-1] or 1)
        v.assign(value.astype(np.float32))
    return model


def port_save(fmt: str, model, path: str) -> None:
    """``model`` written into the directory ``path`` by keras-hub's own ``save_to_preset``."""
    model.save_to_preset(path)


def port_layout(fmt: str, count: int) -> dict:
    """One weights file always (``model.weights.h5``; keras-hub's sharded layout is not written)."""
    return {"shards": [WEIGHTS], "index": None, "metadata": {}, "config": CONFIG, "extras": ()}


def port_write_weights(fmt: str, path: str, tensors: dict, config: dict, on_tensor=None) -> int:
    """The backbone's weights file written at ``path`` one dataset at a time, each made when its
    turn comes (``tensors``: port name -> object with ``dtype``, ``shape``, ``produce()``), with
    the groups and attributes Keras' own saver writes for ``config``'s backbone (recorded without
    allocating it). Returns the bytes written; ConversionError naming tensors missing or extra."""
    import h5py

    structure = _structure(config)
    names = [n for part in structure for n in part[4]]
    missing, extra = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    if missing or extra:
        raise ConversionError(f"the keras-hub weights file for this config needs {missing[:8]} and does not hold "
                              f"{extra[:8]} (nothing was written)")
    written = 0
    for file, groups, variables, paths, part_names, own in structure:
        with_vars = {g for g, _, _, _ in variables} | {g for g, _, _, _ in own}
        target = path if file == WEIGHTS else os.path.join(os.path.dirname(path), file)
        with h5py.File(target, "w") as f:
            for group, metadata in groups:
                if not metadata and group not in with_vars:
                    continue  # Keras defers such a group until a variable is stored: it never makes it
                where = f"{group}/vars" if group else "vars"
                if where in f:
                    continue
                g = f.require_group(where)
                for k, v in (metadata or {}).items():
                    g.attrs[k] = v
            import keras

            for group, key, _, variable in own:  # as Keras' saver writes them (initial values)
                f.create_dataset(_var_path(group, key), data=np.asarray(keras.ops.convert_to_numpy(variable)))
            for name, p in zip(part_names, paths):
                pending = tensors[name]
                value = np.ascontiguousarray(pending.produce())
                if tuple(value.shape) != tuple(pending.shape):
                    raise ConversionError(f"tensor {name!r} was made with shape {value.shape}, not {pending.shape}")
                if value.dtype.name == "bfloat16":
                    ds = f.create_dataset(p, data=value.view(np.uint16).view("V2"))
                    ds.attrs["dtype"] = "bfloat16"
                else:
                    f.create_dataset(p, data=value)
                written += value.nbytes
                if on_tensor is not None:
                    on_tensor(name, value.nbytes)
                del value
    return written


def port_write_config(fmt: str, directory: str, config: dict, src: str | None = None) -> list[str]:
    """keras-hub's own non-weight files of a preset for ``config`` written into ``directory``:
    ``config.json`` (the backbone), ``task.json`` (the causal LM), ``metadata.json``, and, where
    ``src`` holds a transformers tokenizer, keras-hub's translation of it by its own importer
    (``convert_tokenizer``) saved by its own preset saver (``tokenizer.json``, ``assets/``,
    ``preprocessor.json``, the preprocessor in ``task.json``). A tokenizer the importer cannot
    translate is refused naming its file. Returns the names written."""
    import keras

    from dense_bridge.checkpoints._port_files import write_json

    cls = _backbone_class(config["backbone"])
    task = json.loads(json.dumps(config["task"]))
    written = [CONFIG, TASK, METADATA]
    found = [n for n in HF_TOKENIZER_FILES if src is not None and os.path.isfile(os.path.join(src, n))]
    if found:
        from keras_hub.src.utils.preset_utils import KerasPresetSaver

        _, conv = _converter_for_backbone(cls)
        task_cls = keras.saving.get_registered_object(task["registered_name"])
        try:
            tokenizer = conv.convert_tokenizer(task_cls.preprocessor_cls.tokenizer_cls, src)
            preprocessor = task_cls.preprocessor_cls(tokenizer=tokenizer)
        except Exception as exc:  # noqa: BLE001 - the importer's own failure, named with the file
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise ConversionError(f"{os.path.join(src, found[0])}: keras-hub's importer cannot translate this "
                                  f"tokenizer ({type(exc).__name__}: {first}): refused (nothing was written)") from None
        saver = KerasPresetSaver(directory)
        saver.save_tokenizer(tokenizer)
        saver.save_preprocessor(preprocessor)
        serialized = keras.saving.serialize_keras_object(preprocessor)
        for key in ("compile_config", "build_config"):
            saver._recursive_pop(serialized, key)
        task["config"]["preprocessor"] = serialized
        written += sorted(n for n in os.listdir(directory) if n not in written and n != WEIGHTS)
    write_json(os.path.join(directory, CONFIG), config["backbone"])
    write_json(os.path.join(directory, TASK), task)
    count = sum(math.prod(s) for s in port_shapes(fmt, config).values())
    from keras_hub.src.version import __version__ as hub_version

    write_json(os.path.join(directory, METADATA), {
        "keras_version": keras.version(), "keras_hub_version": hub_version, "parameter_count": int(count),
        "tasks": sorted({t.__base__.__name__ for t in _tasks_of(cls)})})
    return written


def _tasks_of(cls):
    from keras_hub.src.models.task import Task
    from keras_hub.src.utils.preset_utils import list_subclasses

    return [t for t in list_subclasses(Task) if t.backbone_cls is cls]


def port_load(fmt: str, path: str):
    """The task model as keras-hub's own ``from_preset`` reads the directory (no preprocessor)."""
    keras_hub = _keras_hub()
    task = _serialized(path, TASK) if os.path.isfile(os.path.join(path, TASK)) else None
    cls = keras_hub.models.CausalLM
    if task is not None:
        import keras

        cls = keras.saving.get_registered_object(task.get("registered_name")) or cls
    return cls.from_preset(path, preprocessor=None)


def port_inputs(fmt: str, ids: np.ndarray, model=None) -> dict:
    """keras-hub's inputs for the token ids ``ids`` (batch, positions): the ids, a full padding
    mask, and segment ids 0 where ``model``'s backbone takes them (transformers' default); an
    encoder-decoder backbone gets the ids on both sides, as the transformers side does
    (``port_inputs`` of the transformers adapter)."""
    ids = np.asarray(ids)
    out = {"token_ids": ids.astype(np.int32), "padding_mask": np.ones_like(ids, dtype=np.int32)}
    wanted = getattr(getattr(model, "backbone", model), "input", None)
    if isinstance(wanted, dict) and "encoder_token_ids" in wanted and "decoder_token_ids" in wanted:
        return {f"{side}_{k}": v for side in ("encoder", "decoder") for k, v in out.items()}
    if isinstance(wanted, dict) and "segment_ids" in wanted:
        out["segment_ids"] = np.zeros_like(ids, dtype=np.int32)
    return out


def port_logits(fmt: str, model, ids: np.ndarray) -> np.ndarray:
    """Float32 outputs of the task ``model`` for ``ids``: a causal LM's logits (batch, positions,
    vocab), a classifier's (batch, classes)."""
    import keras

    return np.asarray(keras.ops.convert_to_numpy(model(port_inputs(fmt, ids, model), training=False)), np.float32)


def port_example(fmt: str, path: str, seed: int = 0) -> None:
    raise ConversionError("keras-hub presets offer no example model of their own")


def port_describe(fmt: str, config: dict) -> dict:
    """``{"architecture", "kind", "vocab_size", "max_positions"}`` of a keras-hub config."""
    if "backbone" not in config:  # the interchange (transformers) form
        vocab, limit = config.get("vocab_size"), config.get("max_position_embeddings", config.get("n_positions"))
        backbone = {"class_name": config.get("model_type")}
    else:
        backbone = config.get("backbone") or {}
        inner = backbone.get("config") or {}
        vocab, limit = inner.get("vocabulary_size"), inner.get("max_sequence_length")
    return {"architecture": [backbone.get("class_name")], "kind": backbone.get("class_name"),
            "vocab_size": vocab if isinstance(vocab, int) else None,
            "max_positions": limit if isinstance(limit, int) else None}
