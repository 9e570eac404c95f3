"""Refuse an output that is one of the inputs: no command writes over what it reads.

A path is compared by what it resolves to, so ``out``, ``./out``, a symlink to it and a hard
link to it (same device and inode) are all the same file. An input is expanded to every file it
stands for: a directory (a sharded or DCP checkpoint) to its files, an index (``*.index.json``)
to the shard files its ``weight_map`` names. An output is expanded to every file writing it may
replace or remove: a canonical save to ``out`` also writes ``out``'s index and sweeps the shard
files of earlier saves to ``out`` (``_io.shard_pattern``).

Everything here only looks (``lstat``/``stat``, a bounded read of an index): it runs before
anything is written, so a refused command leaves every file as it was.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping

from ._io import index_and_stem, shard_pattern
from .._errors import CheckpointError
from ._safetensors import open_readonly, parse_json_object, read_at

__all__ = ["input_files", "canonical_outputs", "refuse_overwrite"]

#: An index read here to learn its shard names is at most this large (bigger: only itself counts).
_INDEX_LIMIT = 1 << 26


def _identity(path: str) -> tuple:
    """What ``path`` resolves to: (device, inode) when it exists, else its resolved name."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except (OSError, ValueError):
        return ("name", os.path.realpath(path))


def _index_shards(path: str) -> list[str]:
    """The shard files an index names (beside it), or [] when it cannot be read as one."""
    try:
        fd = open_readonly(path)
    except (OSError, CheckpointError):
        return []
    try:
        raw = read_at(fd, min(_INDEX_LIMIT, os.fstat(fd).st_size) + 1, 0)  # pread allocates what it is asked
    except OSError:
        return []
    finally:
        os.close(fd)
    if len(raw) > _INDEX_LIMIT:
        return []
    try:
        index = parse_json_object(raw, CheckpointError, "index")
    except CheckpointError:
        return []
    names = index.get("weight_map")
    if not isinstance(names, dict):
        return []
    directory = os.path.dirname(path)
    return sorted({os.path.join(directory, n) for n in names.values() if isinstance(n, str) and n})


def input_files(path: str) -> list[str]:
    """``path`` and every file it stands for (a directory's files, an index's shards)."""
    out = [path]
    if os.path.isdir(path):
        try:
            out += [os.path.join(path, n) for n in sorted(os.listdir(path))]
        except OSError:
            pass
    elif path.endswith(".json"):
        out += _index_shards(path)
    return out


def canonical_outputs(out: str) -> list[str]:
    """Every file a canonical save to ``out`` may write or remove: ``out``, its index, and the
    shard files of earlier dense_bridge saves to ``out`` that it sweeps."""
    index, _ = index_and_stem(out)
    found = [out, index]
    directory = os.path.dirname(os.path.abspath(out))
    pattern = shard_pattern(out)
    try:
        found += [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if pattern.match(n)]
    except OSError:
        pass
    return found


def refuse_overwrite(outputs: Mapping[str, Iterable[str]], inputs: Mapping[str, Iterable[str]]) -> None:
    """CheckpointError when any output file is any input file.

    ``outputs``/``inputs``: a label naming the argument (``"-o"``, ``"--html"``, ``"SRC"``) ->
    the files it stands for (``input_files``/``canonical_outputs``). The message names both
    arguments and the file."""
    seen: dict[tuple, tuple[str, str]] = {}
    for label, files in inputs.items():
        for f in files:
            if f:
                seen.setdefault(_identity(os.fspath(f)), (label, os.fspath(f)))
    for label, files in outputs.items():
        for f in files:
            if not f:
                continue
            hit = seen.get(_identity(os.fspath(f)))
            if hit is not None:
                in_label, in_path = hit
                same = "" if os.path.abspath(in_path) == os.path.abspath(f) else f" (the same file as {in_path})"
                raise CheckpointError(f"{label} {f} would overwrite the input {in_label}{same}: choose another "
                                      "output path (nothing was written)")
