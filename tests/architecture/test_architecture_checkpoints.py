"""The checkpoint flows, checked: no hooks, no patched objects.

- No module-global hook: no ``dense_bridge.checkpoints._extensions`` where a feature registers
  itself so that the flows call it without importing it (an import circle hidden behind a
  global). Each flow imports what it uses (``_load`` imports ``_quantized`` and ``_model_dir``).
- No object is changed from outside its class: in ``dense_bridge/checkpoints/`` an attribute is
  assigned only on ``self`` inside its own class, never on another object (``ckpt.params =
  lambda: ...`` would turn a NativeCheckpoint into something its class does not describe) nor on
  a module, and never through ``setattr``. A checkpoint that behaves differently is a subclass
  (``QuantizedCheckpoint``, ``QuantizedDirectory``).

Like tests/architecture/test_architecture.py, the second check reads source files with ``ast``.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import dense_bridge

CHECKPOINTS = Path(dense_bridge.__file__).parent / "checkpoints"


def test_the_checkpoint_flows_have_no_hook_module():
    assert importlib.util.find_spec("dense_bridge.checkpoints._extensions") is None
    assert not (CHECKPOINTS / "_extensions.py").exists()


def outside_assignments(source: str) -> list[str]:
    """``line: target`` of every attribute assigned on anything but ``self`` (another object, a
    module, a class) and every ``setattr``/``delattr`` call in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)) \
                        and not (isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    found.append((node.lineno, ast.unparse(sub)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            found.append((node.lineno, f"{node.func.id}(...)"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_no_checkpoint_module_changes_an_object_from_outside_its_class():
    offenders = [f"{path.name}:{hit}" for path in sorted(CHECKPOINTS.glob("*.py"))
                 for hit in outside_assignments(path.read_text())]
    assert not offenders, ("give the class the behaviour (a method, a subclass) instead of assigning it from "
                           "outside:\n" + "\n".join(offenders))


def test_the_assignment_check_sees_patches_and_hooks():
    source = ("import sys\nfrom . import _hooks\n"
              "def open_dir(ckpt):\n    ckpt.kind = 'x'\n    ckpt.params = lambda: {}\n    setattr(ckpt, 'q', 1)\n"
              "_hooks.quantized = sys.modules[__name__]\n"
              "class C:\n    def __init__(self):\n        self.kind = 'mine'\n        self.info.size = 1\n")
    assert outside_assignments(source) == ["4: ckpt.kind", "5: ckpt.params", "6: setattr(...)",
                                           "7: _hooks.quantized", "11: self.info.size"]
