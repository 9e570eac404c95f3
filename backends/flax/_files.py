"""Flax NNX's own checkpoint files, in the formats Flax documents; the ``file_info``/``read_file``/``write_file`` verbs.

- ``"msgpack"``: ``flax.serialization.msgpack_serialize`` of ``nnx.to_pure_dict(nnx.state(model))``
  (every variable, the Mask included, under Flax's own nested names: "layers" -> 0 -> "kernel").
  Read back with ``msgpack_restore`` and ``nnx.replace_by_pure_dict`` into the template's state.

Names in ``file_info`` are Flax's dotted paths ("layers.0.kernel"), shapes Flax's own (kernel
(in, out), the canonical layout). The format has no slot for string metadata: ``metadata`` is
not written, and a spec must come from the caller (``spec=``/``like=``). Orbax checkpoint
directories are not read: no format the manifest declares reaches them, and Orbax would pull
tensorstore into the ``flax`` extra.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

import numpy as np
from flax import nnx, serialization

from dense_bridge._errors import CheckpointError, first_line
from dense_bridge.checkpoints._native import FileViews, layer_file_plan, planned_file_tensors
from dense_bridge.checkpoints._guard import open_input

Entries = dict  # name -> (native shape, dtype name)
KINDS = ("msgpack",)


#: Deepest nesting of a state tree (an NNX state of nested modules is a few levels deep).
MAX_DEPTH = 64


def _flat(tree, path: str = "") -> dict[str, np.ndarray]:
    """Dotted name -> array of a nested state dict, walked without recursion. A name reached
    twice (msgpack keys ``0`` and ``"0"``, or a key ``"a.b"`` beside ``{"a": {"b": ...}}``) is
    refused as ambiguous: which value would load is otherwise decided by dictionary order."""
    out: dict[str, np.ndarray] = {}
    stack = [("", tree, 0)]
    while stack:
        prefix, node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path}: its state nests more than {MAX_DEPTH} levels deep")
        for k, v in node.items():
            name = f"{prefix}{k}"
            if isinstance(v, Mapping):
                stack.append((name + ".", v, depth + 1))
                continue
            if name in out:
                raise CheckpointError(f"{path}: two entries flatten to the name {name!r} (keys such as 0 and \"0\", "
                                      "or \"a.b\" beside a.b): ambiguous, refused")
            try:
                out[name] = np.asarray(v)
            except Exception as exc:  # noqa: BLE001 - a value numpy cannot hold as an array
                raise CheckpointError(f"{path}: entry {name!r} is not an array ({first_line(exc)})") from None
            if out[name].dtype.kind not in "fiub" and out[name].dtype.name != "bfloat16":
                raise CheckpointError(f"{path}: entry {name!r} holds {out[name].dtype}, not numbers")
    prefixes = {n.rsplit(".", 1)[0] for n in out if "." in n}
    if clash := sorted(prefixes & set(out))[:3]:
        raise CheckpointError(f"{path}: {clash} name both a value and a group of values: ambiguous, refused")
    return out


def _entries(tree, path: str = "") -> Entries:
    return {n: (tuple(a.shape), a.dtype.name) for n, a in _flat(tree, path).items()}


def _read_tree(path: str, container: str):
    try:
        fd = open_input(path, what="Flax msgpack checkpoint", whole=True)  # a FIFO or a device is refused
        with os.fdopen(fd, "rb") as f:
            return serialization.msgpack_restore(f.read())
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read {path} as a Flax checkpoint: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types for damaged files
        raise CheckpointError(f"cannot read {path} as a Flax msgpack checkpoint: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None


def file_info(path: str, container: str, *, files=None) -> tuple[Entries, dict[str, str]]:
    """(Flax dotted name -> (shape, dtype name), {}) of a msgpack file."""
    tree = _read_tree(path, container)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"cannot read {path}: it holds a {type(tree).__name__}, not a Flax state")
    return _entries(tree, path), {}


def read_file(path: str, container: str, template, *, files=None, check: Callable[[Entries, Entries], None],
              borrow: bool = False):
    """``template`` (an NNX model built for the file's spec) holding the file's variables."""
    if template is None:
        raise CheckpointError(f"{path}: Flax state files need the model's structure (spec= or like=)")
    tree = _read_tree(path, container)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"cannot read {path}: it holds a {type(tree).__name__}, not a Flax state")
    state = nnx.state(template)
    check(_entries(tree, path), _entries(nnx.to_pure_dict(state)))
    try:
        nnx.replace_by_pure_dict(state, tree)
        nnx.update(template, state)
    except Exception as exc:  # noqa: BLE001 - structure errors from flax
        raise CheckpointError(f"cannot load {path} into the Flax model: {first_line(exc)}") from None
    return template


def file_views(path: str, container: str, spec, *, files=None, check: Callable[[Entries, Entries], None]):
    """Canonical views of a msgpack file for ``spec``, no Flax model built (a load onto Flax builds
    its model from them layer by layer, as from a canonical file).

    Names are those of the model :func:`compile` builds (:func:`_plan`); ``check(got, expected)``
    compares the file's names, shapes and dtypes with them first. None for a spec holding a
    layer those rules do not describe.
    """
    plan = _plan(spec)
    expected = planned_file_tensors(plan, spec)
    if expected is None:
        return None
    tree = _read_tree(path, container)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"cannot read {path}: it holds a {type(tree).__name__}, not a Flax state")
    flat = _flat(tree, path)
    check({n: (tuple(a.shape), a.dtype.name) for n, a in flat.items()}, expected)
    return FileViews(plan, flat.__getitem__)


def _plan(spec) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """canonical name -> (Flax dotted name, axes) of the model :func:`compile` builds for ``spec``;
    None for a layer these rules do not describe.

    A Sequential is an ``nnx.Sequential``: position ``i``'s variables are ``"layers.<i>.kernel"``,
    ``.bias``, ``.mask`` (a lone layer: no prefix); activations, Identity and Flatten hold none.
    Flax's layouts are the canonical ones (kernel (in, units), a Bilinear kernel (units, in1,
    in2)): every ``axes`` is the identity.
    """
    return layer_file_plan(spec, container="layers.", kernel="kernel", dense_axes=(0, 1), bilinear_axes=(0, 1, 2))


def write_file(model, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``model``'s state into ``temp`` (renamed to ``path`` by the core) as ``kind``."""
    pure = nnx.to_pure_dict(nnx.state(model))
    if kind == "msgpack":
        with open(temp, "wb") as f:
            f.write(serialization.msgpack_serialize(pure))
    else:
        raise CheckpointError(f"cannot write {path}: Flax writes msgpack (.msgpack), not {kind!r}")
