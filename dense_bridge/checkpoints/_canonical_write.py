"""Writing a canonical checkpoint (``_canonical``'s format), single or sharded, atomically.

Concurrency (several processes saving and loading one path):

- the index is the single commit point of a sharded save: its shards get names no other save
  uses and are complete on disk before the index is renamed over the old one, so a reader
  sees the old checkpoint or the new one, never a mix, and no save ever overwrites a file
  another save (or a reader's index) refers to;
- a save removes only files it can prove an earlier dense_bridge save of the same path wrote:
  shards named ``<stem>-<save id>-NNNNN-of-NNNNN.safetensors`` whose own metadata names the
  same index and save id, an index whose metadata says ``format: dense_bridge``, and
  temporaries ``<name>.tmp-<id>`` that no process holds locked (every save flocks its
  temporaries until they are renamed). Never a file an index merely lists, never a hub's own
  index or shards, never the files being written. Orphans of killed saves (temporaries,
  shards renamed before their index) are reclaimed by the next save to the path; the
  commit and the shard sweep happen under ``directory_lock`` (an flock on the directory),
  so concurrent saves to one path leave exactly the last one;
- readers take no lock (``_load``): every safetensors file is opened once and mapped from that
  descriptor (``_safetensors.SafetensorsFile``), an index is read once, and when a save
  removes a shard (or the file) between reading the index and opening it, the read starts
  over (a few times) from the then current index.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from .._errors import CheckpointError
from ._canonical import FORMAT, FORMAT_VERSION, Progress, check_tensor_name
from ._io import (AtomicFiles, directory_lock, index_and_stem, new_save_id, reclaim_temporaries, shard_names, shard_pattern, temp_pattern)
from ._safetensors import (MAX_HEADER, PendingTensor, SafetensorsFile, open_readonly, parse_json_object, read_at, write_safetensors)

__all__ = ["write_canonical", "reclaim_leftovers"]


def _plan_shards(tensors: Mapping[str, PendingTensor], limit: int | None) -> list[list[str]]:
    """Greedy, in order: a new shard starts when the next tensor would overflow the limit."""
    if limit is None:
        return [list(tensors)]
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += t.nbytes
    return groups


# ---------------------------------------------------------------------- what a save may remove
# A save removes only files it can prove an earlier dense_bridge save of the same path wrote:
# names of this library's scheme for that path (shard_pattern, temp_pattern) AND, for finished
# files, this library's metadata naming the same index and save id. Never the files being
# written, never an index or file another tool wrote, never anything an index merely lists.
def _our_index(index_path: str) -> bool:
    """Is ``index_path`` an index a dense_bridge save wrote (a hub's own index is not)?"""
    try:
        fd = open_readonly(index_path)
    except (OSError, CheckpointError):
        return False
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER:
            return False
        index = parse_json_object(read_at(fd, size, 0), CheckpointError, "index")
    except (OSError, CheckpointError):
        return False
    finally:
        os.close(fd)
    meta = index.get("metadata")
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _our_file_meta(path: str) -> dict[str, str] | None:
    """The metadata of ``path`` when it is a dense_bridge canonical safetensors file, else None."""
    try:
        with SafetensorsFile(path) as f:
            meta = f.metadata
    except (OSError, CheckpointError):
        return None
    return meta if meta.get("format") == FORMAT else None


def _our_shard(path: str, index_name: str, save_id: str) -> bool:
    """A shard written by a dense_bridge save for the index ``index_name`` with ``save_id``
    (a shard whose metadata holds no save id, as earlier dense_bridge versions wrote them,
    carries the id in its name only)."""
    meta = _our_file_meta(path)
    return (meta is not None and meta.get("index") == index_name
            and meta.get("save_id", save_id) == save_id)


def _temporaries_pattern(path: str):
    """Base names of every temporary a canonical save to ``path`` creates (file, index, shards)."""
    index, _ = index_and_stem(path)
    shards = shard_pattern(path).pattern.rstrip("$")
    parts = [temp_pattern(path).pattern.strip("^$"), temp_pattern(index).pattern.strip("^$"),
             shards.lstrip("^") + r"\.tmp-[0-9a-f]{8}"]
    return re.compile("^(?:" + "|".join(parts) + ")$")


def reclaim_leftovers(path: str) -> list[str]:
    """Remove what killed saves to ``path`` left behind: unlocked temporaries of this library's
    naming scheme. Orphan shards are removed by the next successful save (under its lock)."""
    return reclaim_temporaries(os.path.dirname(os.path.abspath(path)), _temporaries_pattern(path))


def _sweep_shards(path: str, keep: list[str]) -> list[str]:
    """Under the directory lock, after a commit: remove every shard of an earlier dense_bridge
    save to ``path`` (the replaced checkpoint's, and orphans of killed saves) except ``keep``."""
    directory = os.path.dirname(os.path.abspath(path))
    index, _ = index_and_stem(path)
    pattern = shard_pattern(path)
    kept = {os.path.abspath(k) for k in keep}
    doomed = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        match = pattern.match(name)
        full = os.path.join(directory, name)
        if match and os.path.abspath(full) not in kept and _our_shard(full, os.path.basename(index), match["id"]):
            doomed.append(full)
    _remove_quietly(doomed)
    return doomed


def _remove_quietly(paths) -> None:
    for p in paths:
        try:
            os.remove(p)
        except OSError:
            pass


def write_canonical(path: str, tensors: Mapping[str, PendingTensor], meta: Mapping[str, str],
                    max_shard_size: int | None = None, progress: Progress | None = None,
                    check_finite: bool = False) -> list[str]:
    """Write a canonical checkpoint atomically (sharded when asked); return the files written.

    See the module docstring for how concurrent saves and loads of one path stay consistent,
    and the section above for what a save removes.
    """
    for name in tensors:
        check_tensor_name(name, path)
    groups = _plan_shards(tensors, max_shard_size)
    total = sum(t.nbytes for t in tensors.values())
    done = [0]

    def tick(name: str, nbytes: int) -> None:
        done[0] += nbytes
        if progress is not None:
            progress(done[0], total)

    directory = os.path.dirname(os.path.abspath(path))
    reclaim_leftovers(path)
    if len(groups) == 1 and not path.endswith(".index.json"):
        stale_index, _ = index_and_stem(path)
        with AtomicFiles(path) as tx:
            tmp = tx.temp_for(path)
            with open(tmp, "wb") as f:
                write_safetensors(f, tensors, meta, tick, check_finite)
            tx.sync()
            with directory_lock(directory):
                tx.commit()
                # a sharded checkpoint saved earlier under this name would confuse its readers:
                # its index first, so a reader never finds an index whose shards are gone for good
                if _our_index(stale_index):
                    _remove_quietly([stale_index])
                _sweep_shards(path, keep=[])
        return [path]

    save_id = new_save_id()
    shards, index_path = shard_names(path, len(groups), save_id)
    shadow = path if path != index_path and os.path.lexists(path) else None
    # a concurrent sharded save may remove our own earlier single file between the two looks:
    # only a file still there after the metadata read failed is foreign
    if shadow is not None and _our_file_meta(path) is None and os.path.lexists(path):
        raise CheckpointError(f"cannot save {path} sharded: {path} exists and is not a dense_bridge checkpoint, "
                              f"so it would shadow the new index {index_path}; remove it or choose another path "
                              "(nothing was changed on disk)")
    index_meta: dict[str, Any] = dict(meta)
    index_meta["total_size"] = total
    index_meta["save_id"] = save_id
    weight_map = {}
    with AtomicFiles(path) as tx:
        for i, (names, shard) in enumerate(zip(groups, shards), start=1):
            tmp = tx.temp_for(shard, fresh=True)  # a name no other save uses
            shard_meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "shard": f"{i}/{len(groups)}",
                          "index": os.path.basename(index_path), "save_id": save_id}
            with open(tmp, "wb") as f:
                write_safetensors(f, {n: tensors[n] for n in names}, shard_meta, tick, check_finite)
            weight_map.update({n: os.path.basename(shard) for n in names})
        tmp = tx.temp_for(index_path)  # renamed last: the single commit point
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"metadata": index_meta, "weight_map": {n: weight_map[n] for n in tensors}}, f, indent=2)
            f.write("\n")
        tx.sync()
        with directory_lock(directory):
            tx.commit()
            if shadow is not None and _our_file_meta(path) is not None:
                _remove_quietly([path])  # an earlier single-file save here would shadow the new index
            _sweep_shards(path, keep=shards)
    return shards + [index_path]

