"""Looking inside a model: its walk (every layer holding parameters of its own), its linear layers,
and :class:`Side`, one model's walk indexed for a transfer or a comparison.

Everything framework-specific is the adapters' ``walk`` verb: it lists every layer that holds
parameters of its own, with its path in the framework's naming, its kind ("linear",
"quantized", "other") and readers/writers for its own parameters (``_layouts.Entry``).

A :class:`Side` resolves its model's backend once and keeps the adapter: the layers of one model
belong to its framework, so every read and write of them goes through that adapter, and each
layer's parameters are read at most once per side (``linear_params``, ``native``).
"""
from __future__ import annotations

import difflib
from typing import Any

from .._errors import ConversionError, SpecError, received
from ..registry._backends import backend_of, get_adapter
from ._layouts import Entry

__all__ = ["walk", "linear_layers", "LINEAR_KINDS", "Side", "sides", "suggest"]

_PLAIN = frozenset(("kernel", "bias", "mask"))  # canonical keys of a layer without an adapter
_UNREAD = object()  # a read not made yet (None is a reading: "not on the device path")

#: Entry kinds that are linear layers: "quantized" ones read and write through dense_bridge/quant.
LINEAR_KINDS = ("linear", "quantized")


def walk(model: Any, argument: str = "model", adapter: Any = None) -> list[Entry]:
    """Every layer of ``model`` holding parameters of its own, in definition order (adapter ``walk``).

    ``adapter``: the model's adapter module when the caller resolved it already."""
    if adapter is None:
        adapter = get_adapter(backend_of(model, argument))
    verb = getattr(adapter, "walk", None)
    if verb is None:
        name = adapter.__name__.rsplit(".", 1)[-1]
        raise ConversionError(f"the {name!r} backend cannot look inside models (it has no walk verb). "
                              f"{received(argument, model)}")
    return verb(model)


def refuse_quantized(entries: list[Entry], argument: str) -> None:
    """ConversionError naming every quantized linear layer no adapter reads."""
    if not any(e.kind == "quantized" for e in entries):
        return
    from ..quant import unreadable

    bad = unreadable(entries)
    if bad:
        listed = "; ".join(f"{e.where()}{': ' + e.note if e.note else ''}" for e in bad)
        raise ConversionError(
            f"{argument} holds quantized linear layers dense_bridge cannot read: "
            f"{listed}. Dequantize the model first (load it in float16/float32, or with its library's own dequantization), "
            f"then list or transfer its layers")


def linear_layers(model: Any) -> dict[str, Any]:
    """Every linear-family layer inside ``model``, keyed by its path, in definition order.

    Linear-family: torch ``nn.Linear``/``LazyLinear``/``nn.Bilinear``, Keras ``Dense`` and
    ``EinsumDense`` whose equation is a linear map, MLX ``nn.Linear``/``nn.Bilinear``, Flax
    ``nnx.Linear``, Equinox ``nn.Linear``, the linear nodes of an ONNX graph (backends/onnx/_graph.py),
    and classes declared with ``register_layout`` (transformers' ``Conv1D`` built in). Each value is the
    native layer itself and works with ``to_spec``, ``get_params`` (canonical kernel
    (in_features, units)), ``set_params``, ``convert`` and ``testing.compare`` like a lone layer.
    Quantized linear layers (MLX ``QuantizedLinear``, Keras int8/int4, torchao weight-only) are
    listed too (``get_params`` gives the float kernel they stand for, ``get_params(layer,
    quantized=True)`` their codes: dense_bridge/quant); quantized layers of other kinds raise
    ConversionError naming them. A model that is itself a linear layer comes back under the path "".
    """
    entries = walk(model)
    refuse_quantized(entries, "model")
    return {e.path: e.layer for e in entries if e.kind in LINEAR_KINDS}


def sides(src: Any, dst: Any, arguments: tuple[str, str] = ("src", "dst")) -> tuple[Side, Side]:
    """Both models' walks indexed by layer and parameter path, ties resolved (what a mapping is
    resolved against; ``_infer`` pairs their layers); ``arguments``: the names errors give them."""
    return Side(src, arguments[0]), Side(dst, arguments[1])


class Side:
    """One model's walk, indexed by layer path and parameter path, with ties resolved.

    ``backend``/``adapter``: resolved once, here. ``params``: parameter path -> (entry, name).
    ``tied_to``: parameter path -> the first path of the same storage. ``stable``/``alias``:
    Keras' paths with automatic names renumbered per model (the walk's ``stable_path``), both ways.
    """

    def __init__(self, model: Any, argument: str) -> None:
        self.model, self.argument = model, argument
        self.backend = backend_of(model, argument)
        self.adapter = get_adapter(self.backend)
        self.entries = walk(model, argument, self.adapter)
        refuse_quantized(self.entries, argument)
        self.layers = {e.path: e for e in self.entries}
        self.params: dict[str, tuple[Entry, str]] = {}
        self.tied_to: dict[str, str] = {}
        self.stable: dict[str, str] = {}
        self.alias: dict[str, str] = {}
        self._linear: dict[int, dict] = {}  # id(entry) -> canonical params, read once
        self._native: dict[int, dict] = {}  # id(entry) -> native arrays, read once
        self._device: dict[int, dict | None] = {}  # id(entry) -> canonical params on the device, read once
        self._device_reader = getattr(self.adapter, "device_params", None)
        # the adapter's LoRA test (``lora_base``, a context manager), looked up once for every layer
        self._lora_base = getattr(self.adapter, "lora_base", None)
        #: parameter path -> an adapter's update to add to it as it is read (``lora="merge"`` of an
        #: adapter on a raw parameter: ``lora._moves.LoraMoves.prepare``), float64 in its own layout
        self.updates: dict[str, Any] = {}
        self._paths: dict[int, list[str]] = {}  # id(entry) -> its parameter paths, by name order
        first: dict[Any, str] = {}
        for e in self.entries:
            extra = e.extra
            stable = extra.get("stable_path")
            if stable is not None and stable != e.path:
                self._alias(e.path, stable)
            given = extra.get("param_paths") or {}  # Entry.param_path, its two lookups made once per layer
            prefix = e.path + e.sep if e.path else ""
            paths = self._paths[id(e)] = []
            for n in e.names:
                p = given.get(n)
                if p is None:
                    p = prefix + n
                paths.append(p)
                if stable is not None and stable != e.path and p.startswith(e.path):
                    self._alias(p, stable + p[len(e.path):])
                self.params[p] = (e, n)
                key = e.ident[n]
                if key in first:
                    self.tied_to[p] = first[key]
                else:
                    first[key] = p

    def _alias(self, path: str, stable: str) -> None:
        self.stable[path] = stable
        self.alias.setdefault(stable, path)

    def layer(self, path: str) -> Entry | None:
        """The layer at ``path``, or at the path its stable form (Keras' renumbered names) stands for."""
        e = self.layers.get(path)
        return e if e is not None else self.layers.get(self.alias.get(path, ""))

    def param(self, path: str) -> str | None:
        """The parameter path ``path`` names (itself, or what its stable form stands for)."""
        if path in self.params:
            return path
        actual = self.alias.get(path)
        return actual if actual in self.params else None

    def param_paths(self, e: Entry) -> list[str]:
        """The paths of ``e``'s parameters (``Entry.param_path`` of each name, in order), found once."""
        found = self._paths.get(id(e))
        return found if found is not None else [e.param_path(n) for n in e.names]

    def linear(self) -> list[Entry]:
        return [e for e in self.entries if e.kind in LINEAR_KINDS]

    def fully_tied(self, e: Entry) -> bool:
        """A layer all of whose parameters are another layer's (GPT-2's lm_head is wte's weight)."""
        return bool(self.tied_to) and bool(e.names) and all(e.param_path(n) in self.tied_to for n in e.names)

    def unknown(self, path: str, what: str) -> str:
        known = list(self.layers) + list(self.params)
        return f"{path!r} is not a {what} of {self.argument}.{suggest(path, known)}"

    def linear_params(self, e: Entry) -> dict:
        """Canonical params of linear entry ``e`` (adapter keys included where it holds a LoRA
        adapter), read once through this side's adapter; zero-copy views where the adapter gives
        them (copy before mutating). ConversionError for an unbuilt lazy layer."""
        found = self._linear.get(id(e))
        if found is None:
            from ..lora import read_params

            try:
                found = read_params(self.adapter, e.layer)  # a LoRA-wrapped layer: its own + lora_* keys
                if found is None:
                    found = self.adapter.get_params(e.layer)
            except SpecError as exc:
                raise ConversionError(str(exc)) from None
            self._linear[id(e)] = found
        return found

    def device_params(self, e: Entry) -> dict | None:
        """Canonical params of linear ``e`` as the framework's arrays where they live (the adapter's
        ``device_params``, ``devices`` capability: nothing copied), read once; None where the
        adapter has no such reading or ``e`` holds a LoRA adapter (then :meth:`linear_params`)."""
        found = self._device.get(id(e), _UNREAD)
        if found is _UNREAD:
            found = self._device[id(e)] = self._read_device(e)
        return found

    def _read_device(self, e: Entry) -> dict | None:
        reader = self._device_reader
        if reader is None:
            return None
        try:
            wrapped = e.extra.get("holds_lora")  # the walk's answer where it gives one, else the adapter's test
            if wrapped:
                return None
            if wrapped is None and self._lora_base is not None:
                with self._lora_base(e.layer) as base:
                    if base is not None:
                        return None
            found = reader(e.layer)
        except Exception:  # noqa: BLE001 - an unbuilt lazy layer: linear_params says why
            return None
        if found is not None and not found.keys() <= _PLAIN and any(k.startswith("lora_") for k in found):
            return None
        return found

    def kernel_shape(self, e: Entry) -> tuple[int, ...]:
        """The canonical kernel's shape of linear ``e``, read as metadata: from
        :meth:`device_params` where the adapter offers them (no copy to the host), else from
        :meth:`linear_params`."""
        arrays = self.device_params(e)
        if arrays and "kernel" in arrays:
            return tuple(map(int, arrays["kernel"].shape))
        return tuple(self.linear_params(e)["kernel"].shape)

    def native(self, e: Entry) -> dict:
        """``e.read()`` (its parameters in the framework's layout, by name), read once; a parameter
        with an update in :attr:`updates` comes with it added in float64 and rounded once to the
        parameter's dtype."""
        found = self._native.get(id(e))
        if found is None:
            found = e.read()
            if self.merges(e):
                import numpy as np

                found = dict(found)
                for n in e.names:
                    delta = self.updates.get(e.param_path(n))
                    if delta is not None:
                        value = np.asarray(found[n])
                        found[n] = (value.astype(np.float64) + delta).astype(value.dtype)
            self._native[id(e)] = found
        return found

    def merges(self, e: Entry) -> bool:
        """Does a parameter of ``e`` take an update as it is read (:attr:`updates`)?"""
        return bool(self.updates) and any(e.param_path(n) in self.updates for n in e.names)

    def set_linear(self, e: Entry, arrays: dict) -> None:
        """Write canonical params into linear entry ``e`` through this side's adapter."""
        self.adapter.set_params(e.layer, arrays)

    def snapshot(self) -> list[tuple[Entry, dict]]:
        """Copies of every parameter of the model, by entry (what :meth:`restore` puts back): on
        the model's device where the walk offers it (``_device.snapshot``), else host numpy."""
        from ._device import snapshot

        return [(e, snapshot(e)) for e in self.entries if e.names]

    @staticmethod
    def restore(saved: list[tuple[Entry, dict]]) -> None:
        """Put back a :meth:`snapshot`, as much of it as can be written (the first error is the caller's)."""
        for e, arrays in saved:
            try:
                e.write(arrays)
            except Exception:  # noqa: BLE001 - restoring as much as possible
                pass


def suggest(path: str, known: list[str]) -> str:
    """" Did you mean 'x'?" for the closest known path (case kept, unlike _errors.suggest)."""
    close = difflib.get_close_matches(path, known, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
