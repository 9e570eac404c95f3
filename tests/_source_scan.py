"""The package's Python sources and the AST helpers the architecture tests scan them with."""
from __future__ import annotations

import ast
from pathlib import Path

import dense_bridge

CORE = Path(dense_bridge.__file__).parent
ROOT = CORE.parent
ADAPTERS = ROOT / "backends"


def sources() -> list[Path]:
    """Every module of the core and of the adapters, sorted."""
    return sorted(CORE.rglob("*.py")) + sorted(ADAPTERS.rglob("*.py"))


def rel(path: Path) -> str:
    """``path`` relative to the repository root, with forward slashes."""
    return path.relative_to(ROOT).as_posix()


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a name or attribute chain, None for anything else (a call, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None
