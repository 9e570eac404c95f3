"""``convert_file`` (``dense-bridge convert``, ``db.convert`` of a file): a checkpoint into a
backend's file format or a canonical checkpoint, file to file, no model built where the source
can be streamed: canonical -> canonical tensor by tensor, a mapped source -> a native file through
the target adapter's file layout (``_native_stream``), else one native model built and written.
Codes of quantized layers are kept where the target holds them (``_quantized``).
"""
from __future__ import annotations

from .._errors import CheckpointError, DenseBridgeError, SpecError, received
from ._canonical import Progress, metadata
from ._canonical_write import write_canonical
from ._io import check_writable, parse_size, path_arg, write_limit_cause
from ._load import open_checkpoint
from ._native import write_native
from ._native_stream import stream_native
from ._path_guard import canonical_outputs, input_files, refuse_overwrite
from ._quantized import canonical_codes, convert_codes

__all__ = ["CANONICAL_TARGETS", "convert_file"]

CANONICAL_TARGETS = ("canonical", "dense_bridge", "numpy")


def convert_file(src: str, to: str, out: str, *, spec=None, like=None, format: str | None = None,
                 max_shard_size: int | str | None = None, progress: Progress | None = None,
                 allow_nonfinite: bool = False) -> dict:
    """Convert checkpoint ``src`` to backend ``to``'s file format at ``out``; return a summary.

    ``to`` is a backend ("torch", "keras", "mlx") or "canonical" (also "numpy": the reference
    backend's format is the canonical checkpoint). Canonical -> canonical streams tensor by
    tensor; canonical -> native builds the native model one mapped tensor at a time. NaN/Inf
    parameters are refused (CheckpointError, nothing written) unless ``allow_nonfinite=True``.
    An ``out`` that is (or resolves to) one of the source's files is refused before anything is written.
    """
    from ..registry._backends import check_backend_name

    src = path_arg(src, "src")
    out = path_arg(out, "out")
    target = to.lower() if isinstance(to, str) else to
    if target not in CANONICAL_TARGETS:
        target = check_backend_name(to, "to")
    limit = parse_size(max_shard_size)
    if limit is not None and target not in CANONICAL_TARGETS:
        raise SpecError(f"max_shard_size applies to canonical checkpoints only (--to canonical), not to "
                         f"{target} files. {received('max_shard_size', max_shard_size)}")
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"allow_nonfinite must be True or False. {received('allow_nonfinite', allow_nonfinite)}")
    outputs = {"out": canonical_outputs(out) if target in CANONICAL_TARGETS else [out]}
    refuse_overwrite(outputs, {"src": input_files(src)})
    check_writable(out)
    ckpt = open_checkpoint(src, spec=spec, like=like, format=format)
    try:  # the files the source turned out to stand for (an index's shards), before anything is written
        refuse_overwrite(outputs, {"src": [f.path for f in getattr(ckpt, "files", None) or []]})
        return _convert(ckpt, src, target, out, limit, progress, allow_nonfinite)
    except CheckpointError as exc:
        if "NaN/Inf" in str(exc) and src not in str(exc):  # the writer's scan knows the tensor, not the file
            what = str(exc).split(" (pass allow_nonfinite")[0]
            raise CheckpointError(f"cannot convert {src}: {what} (allow_nonfinite=True, on the command line "
                                  "--allow-nonfinite, writes them)") from None
        raise
    finally:
        ckpt.close()


def _convert(ckpt, src: str, target: str, out: str, limit: int | None, progress: Progress | None,
             allow_nonfinite: bool = False) -> dict:
    """Write ``ckpt`` (opened from ``src``) as ``target``'s file at ``out``; the summary."""
    coded = canonical_codes(ckpt)  # codes of quantized layers are kept
    if target in CANONICAL_TARGETS:
        if coded is not None:
            tensors, meta = coded
        else:
            # each tensor read from the source only when its turn to be written comes: mapped from a
            # canonical file, served by the adapter's file_views, or a view of a loaded native model
            tensors = ckpt.pending()
            meta = metadata(ckpt.spec, tensors, ckpt.source_backend)
        try:
            files = write_canonical(out, tensors, meta, limit, progress, check_finite=not allow_nonfinite)
        except DenseBridgeError:
            raise
        except Exception as exc:
            cause = write_limit_cause(out)
            raise CheckpointError(f"cannot write {out}: {type(exc).__name__}: {exc}{f' ({cause})' if cause else ''} "
                                  "(nothing was changed on disk)") from exc
        return {"src": src, "out": files, "to": "canonical", "spec": ckpt.spec is not None,
                "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values())}
    if coded is not None:
        return convert_codes(ckpt, src, target, out, progress, allow_nonfinite)
    if ckpt.spec is not None:  # straight from the source's mapped views into the target's file layout
        files = stream_native(ckpt.pending(), ckpt.spec, target, out, progress=progress,
                              allow_nonfinite=allow_nonfinite)
        if files is not None:
            return {"src": src, "out": files, "to": target, "spec": True, "tensors": len(ckpt.entries()),
                    "bytes": ckpt.total_bytes}
    model = ckpt.native(target, progress, allow_nonfinite=allow_nonfinite)
    files = write_native(model, target, out, spec=ckpt.spec)
    return {"src": src, "out": files, "to": target, "spec": True, "tensors": len(ckpt.entries()),
            "bytes": ckpt.total_bytes}
