"""Atomic file writes and checkpoint paths for dense_bridge.checkpoints (``_save``, ``_canonical_write``).

Every file is written to ``<target>.tmp-<random>`` beside its target (same directory, so the
final ``os.replace`` is an atomic rename on one filesystem), flushed and fsynced, and only then
renamed. On any error the temporaries are removed and the targets are untouched. Several files
(shards + index) commit together: all temporaries first, renames after, the index last.

``directory_lock`` serialises the short commit step (read the previous index, rename, remove
what it referenced) of dense_bridge saves into one directory, so two processes saving to the
same path cannot delete each other's files; it is an advisory ``flock`` on the directory
itself (no lock file is left behind), and a no-op where the platform has none.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import struct
import time

from .._errors import CheckpointError, SpecError, received

__all__ = ["AtomicFiles", "write_text", "path_arg", "check_writable", "check_room", "WRITER_OVERHEAD", "write_limit_cause", "describe_os_error", "directory_lock", "parse_size",
           "shard_names", "shard_pattern", "new_save_id", "temp_name", "temp_pattern", "reclaim_temporaries",
           "RECLAIM_MIN_AGE_S", "replace_directory"]


def describe_os_error(exc: OSError) -> str:
    """A short reason for an OSError (its strerror, or the text when it has none)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EFBIG:
        reason = "file too large for this filesystem or process limit"
    elif exc.errno == errno.ENOSPC:
        reason = "no space left on device"
    return reason


#: Free space below this on an output's filesystem is named as a likely cause of a failed write.
LOW_SPACE = 64 << 20


def write_limit_cause(path: str) -> str:
    """Words for what may have stopped a write to ``path``, or "": the process's file-size limit
    (RLIMIT_FSIZE) when it has one, free space on the filesystem when it is low. The frameworks'
    writers lose the errno on the way (torch says "unexpected pos", HDF5 "file write failed"),
    so a failed native write asks the system instead."""
    causes = []
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY:
            causes.append(f"this process may write files of at most {soft:,} bytes (RLIMIT_FSIZE)")
    except (ImportError, OSError, ValueError):  # pragma: no cover - platforms without rlimits
        pass
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
        free = st.f_bavail * st.f_frsize
        if free < LOW_SPACE:
            causes.append(f"its filesystem has {free:,} bytes free")
    except (AttributeError, OSError):  # pragma: no cover - no statvfs (Windows)
        pass
    return "; ".join(causes)


#: Room asked for beyond a file's tensor bytes before a framework's own writer starts: headers,
#: HDF5 metadata, alignment padding.
WRITER_OVERHEAD = 1 << 20


def check_room(path: str, nbytes: int) -> None:
    """CheckpointError naming ``path`` when a file of about ``nbytes`` bytes cannot be written
    there: this process's file-size limit (RLIMIT_FSIZE) or its filesystem's free space is below it.

    Frameworks' own writers do not all fail cleanly when the system refuses a write mid-file (HDF5
    under a file-size limit or on a full disk crashes the process: exit -11), so a write that
    hands ``path`` to one asks first, with :data:`WRITER_OVERHEAD` added to ``nbytes``.

    Args:
        path: the file to be written (its directory's filesystem is asked).
        nbytes: the bytes of the tensors it will hold.
    """
    need = int(nbytes) + WRITER_OVERHEAD
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY and soft < need:
            raise CheckpointError(f"cannot write {path}: it needs about {need:,} bytes and this process may write "
                                  f"files of at most {soft:,} bytes (RLIMIT_FSIZE); nothing was changed on disk")
    except (ImportError, OSError, ValueError):  # pragma: no cover - platforms without rlimits
        pass
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
    except (AttributeError, OSError):  # pragma: no cover - no statvfs (Windows)
        return
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise CheckpointError(f"cannot write {path}: it needs about {need:,} bytes and its filesystem has {free:,} "
                              f"bytes free; nothing was changed on disk")


def check_writable(path: str) -> None:
    """CheckpointError naming ``path`` when a file can clearly not be created there."""
    if os.path.isdir(path):
        raise CheckpointError(f"cannot write {path}: it is a directory; give a file name inside it, "
                              f"e.g. {os.path.join(path, 'model.safetensors')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        # walk up to say which component is wrong (a file where a directory should be)
        probe = parent
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if probe and not os.path.isdir(probe):
            raise CheckpointError(f"cannot write {path}: {probe} is a file, not a directory")
        raise CheckpointError(f"cannot write {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"cannot write {path}: permission denied for directory {parent}")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def directory_lock(directory: str):
    """Hold an exclusive advisory lock on ``directory`` (flock; a no-op where unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - a directory we may write but not open
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # pragma: no cover - filesystems without flock: commit unlocked
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def new_save_id() -> str:
    """A short random id naming one save's shard files (unique per save)."""
    return secrets.token_hex(4)


class AtomicFiles:
    """Temporaries that become their targets together on ``commit``, or vanish on ``abort``.

    Use as a context manager: leaving with an exception aborts (removes every temporary, and
    every ``fresh`` target already renamed), turns OSError into CheckpointError naming the
    target, and re-raises the rest unchanged.
    """

    def __init__(self, label: str) -> None:
        self.label = label  # the path named in error messages
        self.pending: list[tuple[str, str]] = []
        self.fresh: set[str] = set()  # targets that did not exist before: removed again on abort
        self.renamed: list[str] = []
        self.synced = False
        self.committed = False
        self._locks: list[int] = []  # descriptors holding each temporary's lock

    def _release(self) -> None:
        for fd in self._locks:
            try:
                os.close(fd)  # drops the lock
            except OSError:  # pragma: no cover
                pass
        self._locks.clear()

    def temp_for(self, final: str, suffix: str = "", fresh: bool = False) -> str:
        """A fresh temporary path beside ``final``; ``suffix`` keeps an extension a writer needs.

        The file is created here (exclusively) and locked (an OFD write lock) until commit or abort, so
        a later save's ``reclaim_temporaries`` can tell a leftover of a killed save (unlocked)
        from one a running save is still writing (locked). ``fresh``: ``final`` is a new,
        unique name (a shard of this save), so an abort after its rename removes it again
        instead of leaving an orphan.
        """
        check_writable(final)
        if not fresh:  # a killed earlier write of this target left its temporary behind (unlocked): reclaim it
            reclaim_temporaries(os.path.dirname(os.path.abspath(final)), temp_pattern(final, suffix))
        tmp = temp_name(final, secrets.token_hex(4), suffix)
        self._locks.append(_create_locked(tmp))
        self.pending.append((tmp, final))
        if fresh:
            self.fresh.add(final)
        return tmp

    def sync(self) -> None:
        """fsync every temporary (slow for big files: done before any lock is taken)."""
        for tmp, _ in self.pending:
            _fsync_path(tmp)
        self.synced = True

    def commit(self) -> None:
        """fsync every temporary, rename each onto its target in order, fsync the directories."""
        if not self.synced:
            self.sync()
        for tmp, final in self.pending:
            os.replace(tmp, final)
            self.renamed.append(final)
        for d in {os.path.dirname(os.path.abspath(f)) for _, f in self.pending}:
            _fsync_dir(d)
        self.committed = True
        self._release()

    def abort(self) -> None:
        leftovers = [tmp for tmp, _ in self.pending] + [f for f in self.renamed if f in self.fresh]
        for path in leftovers:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError:  # pragma: no cover - nothing more we can do; the target is intact anyway
                pass
        self._release()

    def __enter__(self) -> "AtomicFiles":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            if not self.committed:
                self.commit()
            return False
        self.abort()
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            cause = write_limit_cause(self.label)
            raise CheckpointError(f"cannot write {self.label}: {describe_os_error(exc)}"
                                  f"{f' ({cause})' if cause else ''} (nothing was changed on disk)") from None
        return False


def write_text(path: str, text: str, *, make_parent: bool = False) -> None:
    """``text`` (UTF-8) written to ``path`` atomically (:class:`AtomicFiles`): a reader finds the
    old file or the whole new one, never half of it. ``make_parent``: create the missing
    directories first (a report written into a fresh folder)."""
    if make_parent:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with AtomicFiles(path) as tx:
        with open(tx.temp_for(path), "w", encoding="utf-8") as f:
            f.write(text)


# ------------------------------------------------------------------ temporaries and leftovers
#: The random part of every temporary and shard name a save writes (secrets.token_hex(4)).
_TOKEN = r"[0-9a-f]{8}"
#: A temporary younger than this is never reclaimed: it covers the instant between creating a
#: temporary and locking it (a leftover is reclaimed by a later save anyway).
RECLAIM_MIN_AGE_S = 2.0


def temp_name(final: str, token: str, suffix: str = "") -> str:
    """``<final>.tmp-<token>``, or ``<stem>.tmp-<token><suffix>`` to keep an extension a writer needs."""
    if suffix and final.endswith(suffix):
        return f"{final[:-len(suffix)]}.tmp-{token}{suffix}"
    return f"{final}.tmp-{token}"


def temp_pattern(final: str, suffix: str = "") -> re.Pattern:
    """Matches the base names of every temporary ``temp_name(final, *, suffix)`` can produce."""
    base = os.path.basename(final)
    names = [re.escape(base) + r"\.tmp-" + _TOKEN]
    if suffix and base.endswith(suffix):
        names.append(re.escape(base[:-len(suffix)]) + r"\.tmp-" + _TOKEN + re.escape(suffix))
    return re.compile("^(?:" + "|".join(names) + ")$")


def _record_lock(fd: int, kind: int) -> bool:
    """Try an open-file-description lock of ``kind`` (F_WRLCK/F_RDLCK) on all of ``fd``'s file.

    Why OFD locks and not flock: HDF5 (Keras .weights.h5 through h5py) flocks the files it
    writes, and a plain POSIX record lock is dropped when the writer closes any other
    descriptor of the file. An OFD lock conflicts with neither and lives exactly as long as
    this descriptor. True when taken; False when another holder has a conflicting lock.
    """
    import fcntl

    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padded to 32 bytes
    request = struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _can_lock() -> bool:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return False
    return hasattr(fcntl, "F_OFD_SETLK")


def _create_locked(path: str) -> int:
    """Create ``path`` exclusively and hold a write lock on it; the descriptor keeps the lock."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    if _can_lock():
        import fcntl

        try:
            _record_lock(fd, fcntl.F_WRLCK)
        except OSError:  # pragma: no cover - filesystems without locks: the age rule still protects it
            pass
    return fd


def reclaim_temporaries(directory: str, pattern: re.Pattern) -> list[str]:
    """Remove leftover temporaries in ``directory`` whose base name matches ``pattern``.

    A temporary is a leftover of a killed save when no process holds its lock (a running save
    holds it from creation to rename) and it is older than RECLAIM_MIN_AGE_S. Only regular
    files are touched, and only names of this library's scheme (the caller's ``pattern``).
    Returns the paths removed. Where OFD locks do not exist (not Linux) nothing is reclaimed.
    """
    if not _can_lock():  # pragma: no cover - no way to tell a running save's file from a leftover
        return []
    import fcntl

    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    now = time.time()
    for name in names:
        if not pattern.match(name):
            continue
        full = os.path.join(directory, name)
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < RECLAIM_MIN_AGE_S:
                continue
            try:
                if not _record_lock(fd, fcntl.F_RDLCK):
                    continue  # a save is writing it right now
            except OSError:
                continue
            try:
                same = os.stat(full, follow_symlinks=False)
            except OSError:
                continue
            if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
                os.remove(full)
                removed.append(full)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def path_arg(path: object, argument: str = "path") -> str:
    """``path`` (a str or os.PathLike naming a file) as a str; a TypeError naming ``argument`` otherwise."""
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if isinstance(text, str) and text:
            return text
    raise TypeError(f"{argument} must be a file path (str or os.PathLike). {received(argument, path)}")


def parse_size(value: object, argument: str = "max_shard_size") -> int | None:
    """Bytes from an int or a string such as "10MB" (10**6), "4MiB" (2**20), "1GB"; None stays None."""
    from .._errors import check_type, received

    if value is None:
        return None
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m or (m.group(2) or "").lower() not in _UNITS:
            raise SpecError(f"{argument} must be a byte count such as 10000000, '10MB', '4MiB' or '1GB'. "
                             f"{received(argument, value)}")
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    else:
        import numbers

        check_type(argument, value, numbers.Integral, "a byte count (int) or a string such as '10MB'")
        size = int(value)
    if size <= 0:
        raise SpecError(f"{argument} must be positive. {received(argument, value)}")
    return size


def index_and_stem(path: str) -> tuple[str, str]:
    """(index path, shard stem) of a sharded save to ``path``.

    ``dir/model.safetensors`` -> (``dir/model.safetensors.index.json``, ``dir/model``); a path
    ending in ``.index.json`` names the index itself.
    """
    if path.endswith(".index.json"):
        index = path
        base = path[: -len(".index.json")]
    else:
        base = path
        index = path + ".index.json"
    stem = base[: -len(".safetensors")] if base.endswith(".safetensors") else base
    return index, stem


def shard_names(path: str, count: int, save_id: str | None = None) -> tuple[list[str], str]:
    """Shard file paths and the index path for a sharded save to ``path`` (hub-like naming).

    ``dir/model.safetensors`` -> ``dir/model-<save_id>-00001-of-00003.safetensors`` ... and
    ``dir/model.safetensors.index.json``; a path ending in ``.index.json`` names the index.
    Without ``save_id`` the hub's own ``model-00001-of-00003.safetensors``.
    """
    index, stem = index_and_stem(path)
    width = max(5, len(str(count)))
    if save_id:
        stem = f"{stem}-{save_id}"
    shards = [f"{stem}-{i:0{width}d}-of-{count:0{width}d}.safetensors" for i in range(1, count + 1)]
    return shards, index


def shard_pattern(path: str) -> re.Pattern:
    """Matches the base name of a shard any dense_bridge save to ``path`` writes; group "id" is its
    save id. The hub's own names (no save id) never match."""
    _, stem = index_and_stem(path)
    return re.compile("^" + re.escape(os.path.basename(stem)) + "-(?P<id>" + _TOKEN + r")-\d{5,}-of-\d{5,}\.safetensors$")


def replace_directory(tmp: str, final: str, *, previous: str | None = None) -> None:
    """Move the finished directory ``tmp`` onto ``final`` (same filesystem: one rename), after
    moving an existing ``final`` to ``previous`` when given (the caller removes it afterwards);
    the parent directory is fsynced. A whole model directory written file by file through
    :class:`AtomicFiles` into ``tmp`` appears at ``final`` at once, or not at all."""
    if previous is not None:
        os.replace(final, previous)
    try:
        os.replace(tmp, final)
    except OSError:
        if previous is not None:
            os.replace(previous, final)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(final)))


def replace_files(moves: list[tuple[str, str]]) -> None:
    """Move each finished file ``(tmp, final)`` onto ``final`` (same filesystem: one rename each),
    in order; when one fails, those already moved are removed again (a one-file port and its
    certificate appear together or not at all). The parent directories are fsynced."""
    done = []
    try:
        for tmp, final in moves:
            os.replace(tmp, final)
            done.append(final)
    except OSError:
        for final in done:
            try:
                os.remove(final)
            except OSError:
                pass
        raise
    for final in {os.path.dirname(os.path.abspath(f)) for _, f in moves}:
        _fsync_dir(final)
