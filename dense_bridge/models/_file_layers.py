"""Linear layers recognised by name in a plain weights file (``dense-bridge inspect``), where no
model says which tensors are linear kernels nor in which layout they are stored."""
from __future__ import annotations

__all__ = ["file_linear_layers", "format_file_linear_layers"]


def _file_names(framework: str | None):
    """How ``framework``'s plain weights files name a linear kernel (its manifest's ``file_names``:
    what ``inspect`` assumes when a file carries no spec; the file cannot say, GPT-2's Conv1D stores
    its "weight" as (in, out) in a torch file, for one), else the common (out, in) "weight"."""
    from ..registry._manifest import FileNames
    from ..registry._backends import backends

    info = backends().get(framework) if framework else None
    names = info.manifest.file_names if info is not None else None
    return names if names is not None else FileNames()


_EMBEDDING_HINTS = ("embed", "wte", "wpe", "token_type", "position_embeddings", "shared")


def file_linear_layers(entries: list[tuple[str, tuple, str]], framework: str | None) -> list[dict]:
    """Linear layers recognised by name in a plain weights file: ``<layer><sep><kernel>`` as the
    framework's manifest declares (``FileNames``: ``<layer>.weight`` by default) of rank 2, with a
    rank-1 bias beside it or not.

    ``entries``: (tensor name, shape, dtype) as a checkpoint lists them. Each row has the layer
    path, in_features, units, bias (bool), dtype, ``layout`` and ``layout_source``: a file stores
    no layout, so the orientation is decided by evidence where the file holds some (a bias's
    length names the output axis: GPT-2's Conv1D weight (in, out) with its (out,) bias reads
    ``in_out`` in a torch file), else assumed from the framework's convention for a non-square
    kernel, and ``"unknown"`` for a square kernel without a bias (in_features and units are then
    equal and only the orientation is unknown; a bias cannot orient a square kernel either). 2-D
    tensors of embedding-like names are left out.
    ``tensors``: the names of the tensors the row reads (kernel, and bias when present).
    """
    convention = _file_names(framework)
    name, layout, why = convention.kernel, convention.layout, convention.why
    shapes = {n: (tuple(s), d) for n, s, d in entries}
    rows = []
    sep, bias_name = convention.sep, convention.bias
    for tensor, (shape, dtype) in shapes.items():
        if not tensor.endswith(sep + name) and tensor != name or len(shape) != 2:
            continue
        path = tensor[: -len(name) - 1] if tensor != name else ""
        if any(h in path.lower() for h in _EMBEDDING_HINTS):
            continue
        bias_tensor = (path + sep if path else "") + bias_name
        bias = shapes.get(bias_tensor)
        length = bias[0][0] if bias is not None and len(bias[0]) == 1 else None
        this, source = layout, f"assumed from the file format ({why})"
        if length is not None and shape[0] != shape[1] and length in shape:
            this = "out_in" if length == shape[0] else "in_out"
            source = f"from its bias's length ({length}: the output axis)"
        elif shape[0] == shape[1]:
            this, source = "unknown", ("unknown: a square kernel" + (" without a bias" if length is None else
                                       ", which a bias cannot orient") + " (nothing in the file decides)")
        units, in_features = (shape[0], shape[1]) if this == "out_in" else (shape[1], shape[0])
        has_bias = length is not None and length == units
        rows.append({"layer": path, "in_features": int(in_features), "units": int(units), "bias": has_bias,
                     "dtype": dtype, "layout": this, "layout_source": source,
                     "tensors": [tensor] + ([bias_tensor] if has_bias else [])})
    return rows


def format_file_linear_layers(rows: list[dict]) -> str:
    """The `dense-bridge inspect` section for :func:`file_linear_layers` rows (plain text)."""
    if not rows:
        return "linear layers: none recognised by name"
    width = max(len(r["layer"]) for r in rows)
    sources = sorted({r["layout_source"] for r in rows if r["layout_source"].startswith("assumed")})
    lines = [f"linear layers recognised by name ({len(rows)}; layout from a bias's length where one decides"
             + (f", else {sources[0]}" if sources else "") + "):"]
    for r in rows:
        source = r["layout_source"]
        note = "(assumed)" if source.startswith("assumed") else "(from its bias)" if source.startswith("from") \
            else "(square, no bias)" if "without" in source else "(square)"
        lines.append(f"  {r['layer']:<{width}}  in={r['in_features']:<6} units={r['units']:<6} "
                     f"bias={'yes' if r['bias'] else 'no ':<3}  {r['dtype']}  layout {r['layout']} {note}")
    return "\n".join(lines)
