"""``device=`` of the front-door verbs (compile, convert, load, port): read by the model's framework.

A device is the framework's own device object or a name: "cpu", "cuda", "cuda:N", "gpu", "gpu:N"
(the adapter's ``parse_device``). Backends without the ``devices`` capability
(``registry._contract.DEVICES``) hold their arrays where their framework puts them: ``device=``
on them is refused, naming the backend.
"""
from __future__ import annotations

from typing import Any

from .._errors import DenseBridgeError, SpecError, received
from ._backends import adapter_for, get_adapter

__all__ = ["device_for", "place", "place_for_run", "source_device", "where"]


def _devices_adapter(backend: str, device: Any, argument: str) -> Any:
    adapter = get_adapter(backend)
    if not callable(getattr(adapter, "place", None)):
        raise SpecError(f"{argument}= needs a backend that places models on devices; {backend!r} does not "
                        f"(its arrays live where its framework puts them). {received(argument, device)}")
    return adapter


def device_for(backend: str, device: Any, argument: str = "device") -> Any:
    """``device`` as ``backend``'s framework device (checked before anything is built)."""
    return _devices_adapter(backend, device, argument).parse_device(device, argument)


def place(native: Any, backend: str, device: Any) -> Any:
    """``native`` moved to the framework ``device`` (from :func:`device_for`); the model returned
    (untouched when it is there already: nothing is copied)."""
    adapter = get_adapter(backend)
    here = adapter.device_of(native)
    try:
        if here is not None and adapter.parse_device(here, "device") == device:
            return native
    except (SpecError, TypeError):
        pass
    return adapter.place(native, device)


def source_device(native: Any, target: str) -> Any:
    """The default ``device`` of ``convert``: ``native``'s device when ``target``'s framework can
    hold arrays there, else None (the target framework's default device)."""
    try:
        src = getattr(adapter_for(native, "native"), "device_of", None)
    except (DenseBridgeError, TypeError):  # not a native object: convert's own reading says why
        return None
    dst = get_adapter(target)
    if src is None or not callable(getattr(dst, "place", None)):
        return None
    name = src(native)
    if name is None:
        return None
    try:
        return dst.parse_device(name, "device")
    except (SpecError, TypeError):
        if name.startswith("cpu"):  # another framework's host device: host memory all the same
            try:
                return dst.parse_device("cpu", "device")
            except (SpecError, TypeError):
                return None
        return None


def check_device_value(device: Any, argument: str = "device") -> None:
    """The framework-free check of a ``device=`` given before any framework reads it: None, a
    device name of the forms the adapters read, or a framework's own device object (anything
    else that is not a string); the framework checks the rest where the model is placed."""
    if device is None or not isinstance(device, (str, bytes, int, float, bool)):
        return
    if isinstance(device, str):
        kind, _, index = device.strip().lower().partition(":")
        if kind in ("cpu", "cuda", "gpu") and (not index or index.isdigit()):
            return
        raise SpecError(f"{argument} must be 'cpu', 'cuda', 'cuda:N', 'gpu', 'gpu:N' or a framework's device object. "
                        f"{received(argument, device)}")
    raise TypeError(f"{argument} must be a device name (str) or a framework's device object. {received(argument, device)}")


def place_model(native: Any, device: Any, argument: str = "device", strict: bool = True) -> Any:
    """``native`` on ``device`` (None: as it is), read by its own framework; the model returned.
    ``strict=False`` (a port's verification, whose two sides may be of frameworks that cannot
    both use the device): a backend without the ``devices`` capability keeps its model where its
    framework put it; a device the framework cannot use here is still an error."""
    if device is None:
        return native
    from ._backends import backend_of

    backend = backend_of(native, argument)
    if not strict and not callable(getattr(get_adapter(backend), "place", None)):
        return native
    return place(native, backend, device_for(backend, device, argument))


def place_for_run(native: Any, device: Any = None, argument: str = "device") -> Any:
    """``native`` where a verb that runs it (a port's verification, ``check`` of two model
    directories) runs it: on ``device`` when one is given (a framework that places nothing keeps
    its model where it put it, as :func:`place_model` with ``strict=False``), else on its
    framework's GPU when that framework has the ``devices`` capability and sees one ("gpu" read
    by its own ``parse_device``), else where it is (the CPU). The model returned.

    Raises:
        SpecError: ``device`` names a device the model's framework cannot use here (naming
            ``argument`` and echoing the value).
    """
    if device is not None:
        check_device_value(device, argument)
        return place_model(native, device, argument, strict=False)
    from ._backends import backend_of

    backend = backend_of(native, argument)
    adapter = get_adapter(backend)
    if not callable(getattr(adapter, "place", None)):
        return native
    try:
        target = adapter.parse_device("gpu", argument)
    except (SpecError, TypeError):  # no GPU this framework can use: the CPU
        return native
    return place(native, backend, target)


def where(native: Any) -> str | None:
    """The device ``native`` keeps its parameters on ("cpu", "cuda:0", "cpu:1"), as its adapter
    names it; None for a framework without the ``devices`` capability."""
    from ._backends import backend_of

    try:
        device_of = getattr(get_adapter(backend_of(native, "model")), "device_of", None)
    except (DenseBridgeError, TypeError):
        return None
    return device_of(native) if callable(device_of) else None
