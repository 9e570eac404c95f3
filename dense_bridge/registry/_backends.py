"""Backend registry: names -> adapter modules, imported on first use.

A backend is one adapter package plus one entry here, from one of three sources, in this order:

- the built-in adapters (:data:`BUILTIN`: ``dense_bridge.backends.<name>``);
- the ``dense_bridge.backends`` entry-point group of installed packages, read by name only the
  first time the whole table is needed (listing the backends, identifying a file, finding an
  object's owner, a name not found among the others: ``importlib.metadata``, about 0.1 s once;
  compiling on a built-in backend by name never pays it), and nothing is imported until used;
- :func:`register_backend` calls (a dotted module name, imported on first use, or a module).

What the core may know of a backend before its framework is imported (the packages it needs,
its install hint, its file formats, which adapter wins an object two of them own) is its
manifest (``dense_bridge.registry._manifest``), loaded from the adapter package's ``_manifest.py``
without running the package itself. Nothing here imports a framework: availability is checked
with ``importlib.util.find_spec``, and a native object's backend is found among the frameworks
already in ``sys.modules`` (an object of a framework that was never imported cannot exist).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import weakref
from dataclasses import dataclass, field
from types import ModuleType

from .._errors import BackendUnavailableError, SpecError, check_flag, received, suggest
from ._manifest import FileFormat, Manifest

__all__ = ["BUILTIN", "file_format_backends", "available_file_formats", "port_adapter", "ENTRY_POINT_GROUP", "BackendInfo", "register_backend", "names", "backends", "manifest",
           "has_capability", "available_backends", "check_backend_name", "get_adapter", "backend_of",
           "array_adapter", "adapter_for", "formats", "optional_verb", "offers", "require"]

#: The built-in backends: name -> adapter package (one line per framework).
BUILTIN: dict[str, str] = {name: f"dense_bridge.backends.{name}"
                           for name in ("numpy", "torch", "keras", "mlx", "flax", "equinox", "onnx")}
ENTRY_POINT_GROUP = "dense_bridge.backends"
#: Names the command line and convert_file use for the canonical format, never a backend's.
RESERVED = ("canonical", "dense_bridge")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class BackendInfo:
    """One registry entry. ``module``: the adapter's dotted name, or the module itself;
    ``attr``: an attribute of that module holding the adapter (entry points written
    ``pkg.mod:attr``), else None; ``source``: "built-in", "entry point" or "register_backend"."""

    name: str
    module: str | ModuleType
    install_hint: str | None = None
    source: str = "built-in"
    attr: str | None = None
    _manifest: Manifest | None = field(default=None, repr=False)

    @property
    def module_name(self) -> str:
        return self.module.__name__ if isinstance(self.module, ModuleType) else self.module

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            found = _load_manifest(self.module)
            if found is None:  # a plain module not imported yet: defaults until it is
                return Manifest()
            self._manifest = found
        return self._manifest

    @property
    def requires(self) -> tuple[str, ...]:
        return self.manifest.requires or (self.module_name.split(".")[0],)

    def all_requires(self) -> tuple[str, ...]:
        runtime = self.manifest.runtime_requires
        extra = runtime() if runtime is not None else ()
        return self.requires + tuple(m for m in extra if m not in self.requires)

    @property
    def install(self) -> str:
        return self.install_hint or self.manifest.install or f"pip install {self.requires[0]}"

    @property
    def display(self) -> str:
        return self.manifest.display or self.name


def _load_manifest(module: str | ModuleType) -> Manifest | None:
    """The MANIFEST of an adapter package's ``_manifest.py``, read without running the package
    (its ``__init__`` imports the framework); a plain module's ``MANIFEST`` attribute once it is
    imported (None before); an empty Manifest when there is none."""
    name = module.__name__ if isinstance(module, ModuleType) else module
    loaded = module if isinstance(module, ModuleType) else sys.modules.get(name)
    if loaded is not None and not hasattr(loaded, "__path__"):
        return _checked_manifest(getattr(loaded, "MANIFEST", Manifest()), name)
    full = name + "._manifest"
    if full in sys.modules:
        return _checked_manifest(sys.modules[full].MANIFEST, name)
    if loaded is not None:
        locations = list(loaded.__path__)
    else:
        try:
            spec = importlib.util.find_spec(name)  # imports the parent packages only
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return Manifest()  # not installed: get_adapter says so
        if spec.submodule_search_locations is None:
            return None
        locations = list(spec.submodule_search_locations)
    path = next((p for p in (os.path.join(loc, "_manifest.py") for loc in locations) if os.path.isfile(p)), None)
    if path is None:
        return Manifest()
    spec = importlib.util.spec_from_file_location(full, path)
    mod = importlib.util.module_from_spec(spec)
    # kept out of sys.modules: a submodule there without its package would confuse a later
    # ``import <package>._manifest``; the package's own import of it makes a second, equal copy
    spec.loader.exec_module(mod)
    return _checked_manifest(getattr(mod, "MANIFEST", None), name)


def _checked_manifest(found: object, name: str) -> Manifest:
    if not isinstance(found, Manifest):
        raise TypeError(f"the adapter {name} declares MANIFEST = {type(found).__name__}, not a "
                        "dense_bridge.adapter_kit.Manifest")
    return found


# ----------------------------------------------------------------------------- the table
BACKENDS: dict[str, BackendInfo] = {name: BackendInfo(name, module) for name, module in BUILTIN.items()}
_entry_points_read = False
#: type -> the BackendInfo whose adapter owns its objects. The contract has ``owns`` decide by
#: type alone, so one answer serves every later object of the type; an entry whose backend was
#: replaced or removed is not used, and register_backend empties the table (a new backend may
#: win a type by its priority). Weak keys: a class defined on the fly does not live on here.
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Names of the outside backends whose adapters passed the contract check once imported.
_CHECKED: set[str] = set()


def _read_entry_points() -> None:
    """Add the ``dense_bridge.backends`` entry points (by name: nothing is imported). A name
    already taken (a built-in, a register_backend call) keeps its entry."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    from importlib.metadata import entry_points

    try:
        found = entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # noqa: BLE001 - a broken distribution's metadata must not break dense_bridge
        return
    for ep in found:
        name = ep.name.lower()
        if name in BACKENDS or not _NAME.match(name) or name in RESERVED or not _DOTTED.match(ep.module or ""):
            continue
        BACKENDS[name] = BackendInfo(name, ep.module, source="entry point", attr=ep.attr or None)


def backends() -> dict[str, BackendInfo]:
    """Every registered backend, in registry order (built-ins, entry points, register_backend)."""
    _read_entry_points()
    return BACKENDS


_FILE_FORMAT_INFOS: dict[str, BackendInfo] = {}
_file_formats_read = False


def file_format_backends() -> dict[str, BackendInfo]:
    """The file-format backends: packages of ``dense_bridge.backends`` that are no built-in
    framework adapter and whose manifest declares the ``ports`` capability alone (a file format
    no framework runs here, offering the port verbs only: no layers, nothing owned or compiled,
    so no REQUIRED_VERBS). Kept out of :data:`BACKENDS`; found once, by their manifests (nothing
    is imported)."""
    global _file_formats_read
    if not _file_formats_read:
        _file_formats_read = True
        try:
            spec = importlib.util.find_spec(BUILTIN["numpy"].rsplit(".", 1)[0])
        except (ImportError, ValueError):
            spec = None
        for root in list(spec.submodule_search_locations or []) if spec else []:
            for name in sorted(os.listdir(root)):
                if name in BUILTIN or name.startswith("_") or not _NAME.match(name) \
                        or not os.path.isfile(os.path.join(root, name, "_manifest.py")):
                    continue
                info = BackendInfo(name, f"{spec.name}.{name}")
                if "ports" in info.manifest.capabilities and info.manifest.port_formats:
                    _FILE_FORMAT_INFOS.setdefault(name, info)
    return _FILE_FORMAT_INFOS


def available_file_formats() -> list[str]:
    """Names of the file-format backends whose packages are installed."""
    return [n for n, info in file_format_backends().items() if all(_installed(m) for m in info.all_requires())]


def port_adapter(name: str) -> ModuleType:
    """The adapter module of backend ``name``, a framework's or a file format's, imported now;
    BackendUnavailableError naming what to install when its packages are missing."""
    info = file_format_backends().get(name)
    if info is None:
        return get_adapter(name)
    missing = [m for m in info.all_requires() if not _installed(m)]
    if missing:
        raise BackendUnavailableError(f"{info.display} files need {', '.join(missing)}, which is not installed. "
                                      f"Install it with: {info.install}")
    return importlib.import_module(info.module_name)


def names() -> tuple[str, ...]:
    return tuple(backends())


def register_backend(name: str, module: str | ModuleType, *, install_hint: str | None = None,
                     replace: bool = False) -> None:
    """Register an adapter under ``name``: ``module`` is its dotted name (imported on first use,
    like the built-ins) or the module itself. A name already registered (a built-in, an entry
    point, an earlier call with another module) is replaced only with ``replace=True``.
    ``install_hint``: what the error tells the user to run when the framework is missing.

    The adapter is checked against the contract (``dense_bridge.registry._contract.problems``: the
    required verbs, each capability's verbs all or none): a module given itself now (TypeError
    naming what it breaks), a dotted name when it is first imported (BackendUnavailableError)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a backend name (a str). {received('name', name)}")
    key = name.lower()
    if not _NAME.match(key) or key in RESERVED:
        raise SpecError("name must be lower-case letters, digits and underscores, starting with a letter, and "
                        f"not {' or '.join(map(repr, RESERVED))}. {received('name', name)}")
    if isinstance(module, str):
        if not _DOTTED.match(module):
            raise SpecError(f"module must be a dotted module name such as 'my_pkg.adapter'. {received('module', module)}")
    elif not isinstance(module, ModuleType):
        raise TypeError(f"module must be a dotted module name (str) or a module. {received('module', module)}")
    if install_hint is not None and not isinstance(install_hint, str):
        raise TypeError(f"install_hint must be a str or None. {received('install_hint', install_hint)}")
    check_flag("replace", replace)
    table = backends()
    old = table.get(key)
    if old is not None and not replace:
        same = (old.module is module) or (isinstance(module, str) and old.module == module)
        if old.source == "built-in" or not same:
            raise SpecError(f"{key!r} is already registered ({old.source}: {old.module_name}); pass replace=True to "
                            f"replace it. {received('name', name)}")
    if isinstance(module, ModuleType):
        broken = _contract_problems(module, _load_manifest(module) or Manifest())
        if broken:
            raise TypeError(f"module {module.__name__} is not a dense_bridge adapter: {'; '.join(broken)} (see "
                            f"dense_bridge.adapter_kit.REQUIRED_VERBS and CAPABILITIES). {received('module', module)}")
    table[key] = BackendInfo(key, module, install_hint, source="register_backend")
    _OWNERS.clear()  # the new backend may own, by a higher priority, types another one answered for
    _CHECKED.discard(key)


def _contract_problems(adapter: object, declared: Manifest) -> list[str]:
    """What ``adapter`` breaks of the contract (``dense_bridge.registry._contract.problems``)."""
    from ._contract import problems

    return problems(adapter, declared.capabilities, bool(declared.formats))


def manifest(name: str) -> Manifest:
    return backends()[name].manifest


def has_capability(name: str, capability: str) -> bool:
    """Whether backend ``name`` declares ``capability`` (``dense_bridge.registry._manifest.GRADIENTS``)."""
    return capability in manifest(name).capabilities


def formats() -> list[tuple[str, FileFormat]]:
    """(backend, format) of every registered backend's declared file formats, in registry order."""
    return [(n, f) for n, info in backends().items() for f in info.manifest.formats]


# ----------------------------------------------------------------------------- lookups
def _installed(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_backends() -> list[str]:
    """Names of the backends whose packages are installed, in registry order.

    Decided by package lookup, importing no framework not yet imported (for keras: Keras plus
    the package its ``KERAS_BACKEND`` names). ``dense_bridge.available_backends(check=True)``
    also tries each one.
    """
    return [n for n, info in backends().items() if all(_installed(m) for m in info.all_requires())]


def check_backend_name(name: object, argument: str = "backend") -> str:
    if isinstance(name, str) and name.lower() in BACKENDS:
        return name.lower()  # a built-in or registered name: no need to read the entry points yet
    known = names()
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a backend name ({', '.join(known)}). {received(argument, name)}")
    key = name.lower()
    if key not in known:
        raise SpecError(f"Unknown backend {name!r}.{suggest(name, known)} Known: {', '.join(known)}. "
                        f"{received(argument, name)}")
    return key


def get_adapter(name: object, argument: str = "backend") -> ModuleType:
    """The adapter module for a backend name, imported now; BackendUnavailableError if missing."""
    info = BACKENDS[check_backend_name(name, argument)]
    if isinstance(info.module, ModuleType):
        return info.module
    missing = [m for m in info.all_requires() if not _installed(m)]
    if missing:
        raise BackendUnavailableError(
            f"Backend {info.name!r} needs {', '.join(missing)}, which is not installed. Install it with: "
            f"{info.install}"
        )
    adapter = importlib.import_module(info.module)
    if info.attr:
        adapter = getattr(adapter, info.attr)
    if info.source != "built-in" and info.name not in _CHECKED:  # the built-ins: tests/architecture
        broken = _contract_problems(adapter, info.manifest)
        if broken:
            raise BackendUnavailableError(f"Backend {info.name!r} ({info.source}: {info.module_name}) is not a "
                                          f"dense_bridge adapter: {'; '.join(broken)}")
        _CHECKED.add(info.name)
    return adapter


def _imported(info: BackendInfo) -> bool:
    """Could an object of this backend exist: its framework (or its adapter) is imported."""
    return (isinstance(info.module, ModuleType) or info.module_name in sys.modules
            or info.requires[0] in sys.modules)


def backend_of(native: object, argument: str = "native") -> str:
    """Name of the backend that owns ``native``; TypeError naming ``argument`` if none does.

    Asked in the order of their declared ``owner_priority`` (then registry order): on its torch
    engine a Keras layer is also a ``torch.nn.Module``, and the adapter declaring the higher
    priority reads it as the layer it is. The answer is kept per type (:data:`_OWNERS`).
    """
    table = backends()
    kind = type(native)
    known = _OWNERS.get(kind)
    if known is not None and table.get(known.name) is known:
        return known.name
    order = sorted(table, key=lambda n: -table[n].manifest.owner_priority)
    for name in order:
        if not _imported(table[name]):  # only frameworks already imported can have made this object
            continue
        try:
            adapter = get_adapter(name)
        except BackendUnavailableError:
            continue
        if adapter.owns(native):
            _OWNERS[kind] = table[name]
            return name
    raise TypeError(
        f"{argument} must be a layer or model of a registered backend ({', '.join(table)}), got "
        f"{type(native).__module__}.{type(native).__name__}. {received(argument, native)}"
    )


def array_adapter(value: object) -> ModuleType | None:
    """The adapter of the framework that made the array ``value`` (tensor, variable), or None.

    Found by the top-level module of its type among the frameworks already imported; None for
    numpy and other array-likes, and when that adapter cannot load (``np.asarray`` serves then).
    """
    root = (getattr(type(value), "__module__", None) or "").split(".")[0]
    if not root or root == "numpy" or root not in sys.modules:
        return None
    for name, info in backends().items():
        if root in info.requires:
            try:
                return get_adapter(name)
            except BackendUnavailableError:
                return None
    return None


def optional_verb(name: str, verb: str, purpose: str):
    """Backend ``name``'s optional ``verb`` (``dense_bridge.registry._contract.OPTIONAL_VERBS``), or a
    ConversionError saying that ``purpose`` needs it and this adapter does not offer it."""
    from .._errors import ConversionError

    fn = getattr(get_adapter(name), verb, None)
    if not callable(fn):
        raise ConversionError(f"{purpose} needs the {verb!r} verb, which the {name!r} backend's adapter "
                              f"({backends()[name].module_name}) does not offer")
    return fn


def offers(name: str, capability: str) -> bool:
    """Whether backend ``name`` has ``capability`` (a name of ``dense_bridge.registry._contract.CAPABILITIES``,
    or ``gradients``). Manifest capabilities (``gradients``, ``parallel``, ``dcp``) are read from
    the manifest without importing anything; the others from the adapter's verbs (imported now)."""
    from ._contract import CAPABILITIES

    group = CAPABILITIES.get(capability)
    if group is None or group.manifest:
        return has_capability(name, capability)
    from ._contract import offered

    return capability in offered(get_adapter(name))


def require(name: str, capability: str, purpose: str) -> None:
    """A ConversionError unless backend ``name`` has ``capability``: it names the backend, the
    capability with its verbs, and ``purpose`` (what needed it)."""
    if offers(name, capability):
        return
    from .._errors import ConversionError
    from ._contract import CAPABILITIES

    group = CAPABILITIES[capability]
    raise ConversionError(f"{purpose} needs the {capability!r} capability ({group.purpose}: the verbs "
                          f"{', '.join(group.verbs)}), which the {name!r} backend's adapter "
                          f"({backends()[name].module_name}) does not offer")


def adapter_for(native: object, argument: str = "native") -> ModuleType:
    """The adapter module that owns ``native``."""
    return get_adapter(backend_of(native, argument))
