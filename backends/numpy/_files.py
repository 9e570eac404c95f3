"""The reference backend has no file format of its own: its checkpoints are canonical ones
(``db.save``, written and read by the core). The ``file_info``/``read_file``/``write_file`` verbs
exist so that every adapter fulfils the same contract; they say so when called."""
from __future__ import annotations

from typing import Any, Mapping

from dense_bridge.adapter_kit import CheckpointError

_WHY = ("the numpy reference backend has no native file format: its checkpoints are canonical "
        "dense_bridge safetensors files (db.save / --to canonical)")


def file_info(path: str, container: str, *, files: Any = None) -> tuple[dict, dict]:
    raise CheckpointError(f"cannot read {path} as a numpy file: {_WHY}")


def read_file(path: str, container: str, template: Any, *, files: Any = None, check: Any = None,
              borrow: bool = False) -> Any:
    raise CheckpointError(f"cannot read {path} as a numpy file: {_WHY}")


def write_file(model: Any, path: str, kind: str, *, temp: str, metadata: Mapping[str, str] | None = None) -> None:
    raise CheckpointError(f"cannot write {path} as a numpy file: {_WHY}")
