"""The library as it was at a git revision, importable beside the working tree (``--baseline-rev``).

``baseline_tree(rev)`` extracts ``dense_bridge/`` and ``backends/`` of ``rev`` (``git archive``)
into a temporary directory laid out as the installed package (``backends/`` as
``dense_bridge/backends``, what pyproject's package-dir mapping does), and ``baseline_env(tree)``
is the environment whose ``PYTHONPATH`` makes a subprocess import that copy instead of the
working tree (``PYTHONPATH`` comes before site-packages, where the editable install's finder
lives). A benchmark runs the same case in two subprocesses, one per environment, in one session:
before and after on the same machine under the same load.

``checkpoint_module()`` is the module holding ``convert_file``/``open_checkpoint`` in whichever
tree is imported (``dense_bridge.checkpoints``, or ``dense_bridge.checkpoint`` before the package).
"""
from __future__ import annotations

import atexit
import io
import os
import shutil
import subprocess
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def baseline_tree(rev: str) -> str:
    """A directory holding ``dense_bridge`` as it was at ``rev`` (removed when the process exits)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "dense_bridge", "backends"], cwd=REPO,
                             capture_output=True, check=True).stdout
    root = tempfile.mkdtemp(prefix=f"dense_bridge-{rev[:12]}-".replace("/", "_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    shutil.move(os.path.join(root, "backends"), os.path.join(root, "dense_bridge", "backends"))
    return root


def baseline_env(tree: str | None) -> dict[str, str]:
    """``os.environ`` with ``tree`` first on ``PYTHONPATH`` (None: the working tree, unchanged)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    return env


def checkpoint_module():
    """The imported tree's module with ``convert_file`` and ``open_checkpoint``."""
    try:
        from dense_bridge import checkpoints as module
    except ImportError:
        from dense_bridge import checkpoint as module  # a tree from before the checkpoints package
    return module


def import_quietly(names=None) -> None:
    """The command line's quiet framework import, from whichever tree is imported."""
    try:
        from dense_bridge.cli._main import import_quietly as quiet
    except ImportError:
        from dense_bridge.cli import import_quietly as quiet  # a tree from before the cli package
    quiet(names) if names is not None else quiet()
