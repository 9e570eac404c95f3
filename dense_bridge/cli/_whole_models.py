"""``dense-bridge check A B --mapping MAP.json --inputs X.npz``: compare_models on two model files.

The CLI's ``check`` compares checkpoints of Dense/MLP models layer by layer. Given ``--mapping``
or ``--inputs`` it compares two WHOLE native models instead, linear layer by linear layer
(:func:`~dense_bridge.testing.compare_models`):

- A and B: a torch ``.pt``/``.pth`` holding a whole pickled ``nn.Module`` (``torch.save(model)``;
  unpickling runs code from the file, so only ``--trust-pickle`` opens it) or a Keras ``.keras``
  model (keras-hub's classes are registered first when keras-hub is installed). MLX saves weights
  only: build the model in Python and call ``compare_models``.
- ``--mapping``: a JSON file, an object {"path in A": "path in B"} or a list of
  ["regex", "replacement"] rules (as ``db.transfer`` takes them); absent: by order.
- ``--inputs``: an ``.npz`` of numpy arrays: keyword arguments by name, or positional ones when
  saved unnamed (``np.savez(f, ids)``: ``arr_0``, ``arr_1``...); ``--inputs-b`` for B when the two
  models take different arguments (transformers' ``input_ids`` vs keras-hub's ``token_ids``).

The loading is the adapters' (``load_model`` in backends/<fw>/_capture.py): the core imports no
framework. ``_main.build_parser`` calls :func:`add_arguments`, which routes ``check`` here when
``--mapping`` or ``--inputs`` is given.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import numpy as np

from .. import checkpoints
from .._errors import CheckpointError, ConversionError, SpecError

__all__ = ["add_arguments", "load_model", "read_mapping", "read_inputs", "check_models"]


def _model_file_backends() -> dict[str, str]:
    """Name ending -> backend, for whole-model files (each manifest's ``model_files``)."""
    from ..registry._backends import backends

    return {ending: name for name, info in backends().items() for ending in info.manifest.model_files}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the whole-model options to ``check``'s parser and route to :func:`check_models` when given."""
    parser.add_argument("--mapping", metavar="MAP.json",
                        help="whole models: JSON {path in A: path in B} or [[regex, replacement], ...] pairing "
                             "their linear layers (A and B are whole-model files: "
                             + ", ".join(f"{e} ({b})" for e, b in _model_file_backends().items()) + ")")
    parser.add_argument("--inputs", metavar="X.npz", help="whole models: the inputs, an .npz (named arrays are "
                                                          "keyword arguments, arr_0, arr_1... positional)")
    parser.add_argument("--inputs-b", metavar="X.npz", help="whole models: B's inputs when they differ from A's")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="whole models: allow unpickling model files that are pickles (runs code from the file)")
    checkpoints = parser.get_default("func")

    def route(args) -> int:
        if args.mapping is None and args.inputs is None:
            return checkpoints(args)
        return check_models(args)

    parser.set_defaults(func=route)


def load_model(path: str, *, trust_pickle: bool = False) -> Any:
    """A whole native model from a file, by its suffix (see the module docstring)."""
    from ..registry._backends import optional_verb

    readers = _model_file_backends()
    backend = next((b for ending, b in readers.items() if path.lower().endswith(ending)), None)
    if backend is None:
        known = ", ".join(f"{ending} ({b})" for ending, b in readers.items())
        raise CheckpointError(f"{path}: not a whole-model file; the backends read whole models from {known}")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    checkpoints.read_head(path, 0)  # a FIFO or device is refused here, never waited on by the framework
    return optional_verb(backend, "load_model", f"reading the whole model {path}")(path, trust_pickle=trust_pickle)


def read_mapping(path: str | None):
    """A mapping from a JSON file: a dict of paths or a list of [regex, replacement] rules."""
    if path is None:
        return None
    if not os.path.lexists(path):
        raise CheckpointError(f"--mapping {path}: no such file")
    doc = checkpoints.read_json_file(path, "--mapping file", top_level=None)
    if isinstance(doc, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        return doc
    if isinstance(doc, list) and all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)
                                     for r in doc):
        for rx, _ in doc:
            try:
                re.compile(rx)
            except re.error as exc:
                raise SpecError(f"--mapping {path}: {rx!r} is not a regular expression ({exc})") from None
        return [tuple(r) for r in doc]
    raise SpecError(f"--mapping {path}: expected an object {{\"path in A\": \"path in B\"}} or a list of "
                    f"[\"regex\", \"replacement\"] pairs")


def read_inputs(path: str | None, option: str = "--inputs"):
    """An .npz as a list (arr_0, arr_1, ... positional) or a dict (named: keyword arguments)."""
    if path is None:
        return None
    if not os.path.lexists(path):
        raise CheckpointError(f"{option} {path}: no such file")
    arrays = checkpoints.read_npz(path, lambda reason: CheckpointError(f"{option} {path}: {reason}"))
    if arrays and all(re.fullmatch(r"arr_\d+", k) for k in arrays):
        return [arrays[f"arr_{i}"] for i in range(len(arrays))]
    return arrays


def check_models(args) -> int:
    """Run compare_models on two model files; print the report (or JSON); 0 equivalent, 1 not."""
    from ..testing import compare_models

    if args.inputs is None:
        raise SpecError("whole models need --inputs X.npz (what to feed them)")
    if getattr(args, "device", None) is not None:  # a whole-model file loads where its framework puts it
        raise SpecError(f"--device applies to two model directories (or one-file models), not to whole-model files "
                        f"(place the models in Python and call compare_models). Received: --device={args.device!r}")
    a = load_model(args.a, trust_pickle=args.trust_pickle)
    b = load_model(args.b, trust_pickle=args.trust_pickle)
    inputs_a = read_inputs(args.inputs)
    inputs = inputs_a if args.inputs_b is None else (inputs_a, read_inputs(args.inputs_b, "--inputs-b"))
    mapping = read_mapping(args.mapping)
    try:
        report = compare_models(a, b, inputs, mapping=mapping, grads=not args.no_grads, seed=args.seed,
                                isolated=args.isolated)
    except ConversionError as exc:
        if args.mapping is None:
            raise
        # the rules come from a file: say which, so a wrong rule can be found in it
        raise ConversionError(f"comparing {args.a} and {args.b} with --mapping {args.mapping}: {exc}") from None
    if args.html:
        report.to_html(args.html)
    if args.json:
        doc = {"a": {"path": args.a}, "b": {"path": args.b}, "equivalent": report.passed,
               "report": report.to_dict()}
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        print(f"a: {args.a}")
        print(f"b: {args.b}")
        print(str(report))
        print("equivalent" if report.passed else "NOT equivalent")
    sys.stdout.flush()
    return 0 if report.passed else 1
