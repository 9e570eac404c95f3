"""``device=`` of the front-door verbs (compile, convert, load, port): read by the model's framework.

A device is the framework's own device object or a name: "cpu", "cuda", "cuda:N", "gpu", "gpu:N"
(the adapter's ``parse_device``). Backends without the ``devices`` capability
(``registry._contract.DEVICES``) hold their arrays where their framework puts them: ``device=``
on them is refused, naming the backend.
"""
from __future__ import annotations

from typing import Any

from ._errors import DenseBridgeError, SpecError, received
from .registry._backends import adapter_for, get_adapter

__all__ = ["device_for", "place", "source_device"]


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
