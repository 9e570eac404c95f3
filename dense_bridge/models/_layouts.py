"""Layout declarations for linear layers dense_bridge does not build, and the walk record.

Pure data, no framework: adapters look a native layer's class up here (by the dotted name of
each class in its MRO, so a third-party class is declared without importing it) and read its
parameters in the declared layout. The canonical layout is numpy's y = x @ kernel + bias:
kernel (in_features, units). Declared layouts:

- ``"in_out"``: the stored kernel is (in_features, units) already (transformers' ``Conv1D``).
- ``"out_in"``: the stored kernel is (units, in_features) (``nn.Linear``'s layout).

A declaration says the layer computes ``x @ kernel + bias`` over the last axis of inputs of
any rank; dense_bridge cannot check the forward, so only declare classes that do exactly that.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .._errors import DenseBridgeError, SpecError, check_type, received

LAYOUTS = ("in_out", "out_in")


@dataclass(frozen=True)
class Layout:
    """Where a linear class keeps its parameters and how its kernel maps to the canonical one."""

    cls: str  # dotted name: "<module>.<qualname>"
    kernel: str  # attribute holding the kernel
    bias: str | None  # attribute holding the bias (None: the class has none)
    layout: str  # "in_out" or "out_in"

    @property
    def transposed(self) -> bool:
        """Is the stored kernel the canonical one transposed (units, in_features)?"""
        return self.layout == "out_in"


_lock = threading.Lock()
_DECLARED: dict[str, Layout] = {}


def _dotted(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cls: Any, *, kernel: str, bias: str | None = None, layout: str) -> Layout:
    """Record a declaration (see ``dense_bridge.register_layout``); returns it."""
    if isinstance(cls, type):
        name = _dotted(cls)
    elif isinstance(cls, str) and "." in cls and not cls.startswith(".") and not cls.endswith("."):
        name = cls
    else:
        raise TypeError(f"cls must be a class or its dotted name ('package.module.Class'). {received('cls', cls)}")
    check_type("kernel", kernel, str, "an attribute name (str)")
    if not kernel.isidentifier():
        raise SpecError(f"kernel must be an attribute name such as 'weight'. {received('kernel', kernel)}")
    if bias is not None:
        check_type("bias", bias, str, "an attribute name (str) or None")
        if not bias.isidentifier():
            raise SpecError(f"bias must be an attribute name such as 'bias', or None. {received('bias', bias)}")
    if bias == kernel:  # one tensor read as both: the bias would be the kernel's bytes
        raise SpecError(f"kernel and bias must name two different attributes. Received: kernel={kernel!r}, "
                        f"bias={bias!r}")
    if layout not in LAYOUTS:
        raise SpecError(f"layout must be 'in_out' (kernel stored as (in_features, units)) or 'out_in' "
                        f"(stored as (units, in_features)). {received('layout', layout)}")
    decl = Layout(name, kernel, bias, layout)
    with _lock:
        _DECLARED[name] = decl
    return decl


_read_from: set[str] = set()  # backends whose manifests' layouts are in _DECLARED


def _read_manifests() -> None:
    """Add the layouts the registered backends' manifests declare (``Manifest.linear_layouts``),
    each backend's once (one registered later is read at the next lookup); a user's own
    declaration of the same class wins."""
    from ..registry._backends import manifest, names

    new = [name for name in names() if name not in _read_from]
    if not new:
        return
    found = []
    for name in new:
        try:
            found += manifest(name).linear_layouts
        except DenseBridgeError:  # a backend whose manifest cannot load declares nothing usable
            pass
    with _lock:
        for cls, kernel, bias, layout in found:
            _DECLARED.setdefault(cls, Layout(cls, kernel, bias, layout))
        _read_from.update(new)


def declared(obj: Any) -> Layout | None:
    """The declaration for ``obj``'s own class (exact class: a subclass may change the forward)."""
    _read_manifests()
    return _DECLARED.get(_dotted(type(obj)))


def declarations() -> dict[str, Layout]:
    """A snapshot of every declaration, by dotted class name."""
    _read_manifests()
    with _lock:
        return dict(_DECLARED)


@dataclass
class Entry:
    """One layer holding parameters directly, as an adapter's ``walk`` reports it.

    ``path``: the layer's path in the framework's own naming ("" for the root itself).
    ``kind``: ``"linear"`` (works with get_params/set_params/to_spec/convert/compare as a lone
    layer), ``"quantized"`` (a quantized linear layer: read and written through the adapter's
    ``quant_layer`` handle, dense_bridge/quant.py; refused where it has none) or ``"other"``
    (norms, embeddings, anything else). ``names``: the layer's own parameter names (not its
    children's), in definition order. ``ident``: name -> an identity shared by tied parameters
    (the same storage under two layers). ``read()`` -> name -> numpy array in the framework's
    layout (views allowed: copy before mutating); ``write(arrays)`` writes some of them, already
    checked for names and shapes by the core.
    """

    path: str
    layer: Any
    kind: str
    names: tuple[str, ...]
    ident: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[], dict[str, Any]]
    write: Callable[[dict[str, Any]], None]
    note: str = ""  # why a layer is quantized/other, for error messages
    sep: str = "."  # between a layer path and its parameter names ("/" in Keras)
    extra: dict[str, Any] = field(default_factory=dict)

    def param_path(self, name: str) -> str:
        """The path of one of this layer's parameters ("encoder.dense.weight", "dense/kernel");
        ``extra["param_paths"]`` overrides it (a head reported apart from its layer keeps its
        variable's own path)."""
        given = self.extra.get("param_paths", {}).get(name)
        if given is not None:
            return given
        return f"{self.path}{self.sep}{name}" if self.path else name

    def where(self) -> str:
        t = type(self.layer)
        return f"{self.path or '<root>'} ({t.__module__}.{t.__qualname__})"


def warn_dropout(where: str, rate: Any = None) -> None:
    """Warn that a Dropout was read as the identity: its inference function, alike on every backend.

    Training-time dropout is not part of a spec, so a converted model does not drop; say so once
    per call site rather than refusing the model (alike on every backend whose walk meets one).
    """
    import warnings

    p = "" if rate is None else f" (rate {float(rate):g})"
    warnings.warn(f"{where}: Dropout{p} read as the identity (its function at inference); training-time "
                  f"dropout is not carried over to the spec or a converted model", UserWarning, stacklevel=3)
