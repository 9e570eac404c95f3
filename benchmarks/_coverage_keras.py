"""keras-hub rows of the coverage table (issue 44): every text architecture keras-hub's own
transformers importer accepts, ported into keras-hub and back with ``db.port``.

The model types are read from keras-hub's importer (``TransformersPresetLoader``, through the
keras-hub adapter's registry reader), never listed here. One is skipped, with the reason shown,
when keras-hub declares no text task for its backbone (``CausalLM``, ``TextClassifier``,
``MaskedLM``, ``Seq2SeqLM``, ``TextEmbedder``: DeiT and DINOv2 are image models) or transformers does
not implement it. For every other one, in its own subprocess with a timeout:

1. ``T``: a tiny random transformers model from transformers' own config class (the text part of a
   multimodal one), shrunk by coverage.py's ``_tiny_config``; the transformers class is the one for
   the first text task keras-hub declares that transformers also has (causal LM, else sequence
   classifier with 3 labels, else masked LM, else sequence-to-sequence LM); every parameter random
   and then rounded to a float16-representable value: some of keras-hub's converters round weights
   through float16 (Mistral's), so keras-hub's own import of ``T`` is exact and comparable bit for bit;
   ``save_pretrained``;
2. ``transformers -> keras-hub``: ``db.port(T, K, to="keras-hub")``; the task class the port wrote
   (``task.json``) loaded by keras-hub's own ``from_preset(K)`` must hold, variable for variable,
   bit for bit, what keras-hub's own importer makes of ``T`` (the same task class's
   ``from_preset(T)``): the backbone's variables, and the task's own (a head) where keras-hub's
   importer reads them (found by loading the reference under two random seeds: a head it leaves
   random differs, and is then judged by the round trip only, as the row says); then
   ``db.port(K, B, to="transformers")`` must give back ``T``'s tensors bit for bit;
3. ``mlx-lm -> keras-hub`` (model types mlx-lm also implements): ``M`` = mlx-lm's own load of ``T``
   written by its own ``save_model``; ``db.port(M, K2, to="keras-hub")`` judged against the same
   reference; ``db.port(K2, M2, to="mlx-lm")`` must give back ``M``'s tensors bit for bit.

Classes as in coverage.py: pass / pass-rounded / discrepancy / refused / fails / no-reference.

Run alone: ``python benchmarks/coverage.py --keras-only`` (or ``--only llama`` with it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TO_KERAS = "transformers->keras-hub"
MLX_TO_KERAS = "mlx-lm->keras-hub"
DIRECTIONS = (TO_KERAS, MLX_TO_KERAS)


# ------------------------------------------------------------------------------ the model types
def _text_tasks():
    """keras-hub's text task base classes, in the order a transformers class is chosen."""
    import keras_hub

    m = keras_hub.models
    return [m.CausalLM, m.TextClassifier, m.MaskedLM, m.Seq2SeqLM, m.TextEmbedder]


def model_types() -> list[tuple[str, str | None]]:
    """(model_type, None) for every text architecture keras-hub's transformers importer accepts,
    (model_type, reason) for those it accepts that are skipped."""
    import transformers

    from dense_bridge.backends.keras import _ports as kp

    text = _text_tasks()
    out = []
    for mt in kp._registry():
        try:
            cls = kp._converter(mt).backbone_cls
        except Exception as exc:  # noqa: BLE001 - keras-hub cannot import its own converter
            out.append((mt, f"keras-hub's converter module cannot be imported: {type(exc).__name__}: {exc}"))
            continue
        tasks = kp._tasks_of(cls)
        if not any(issubclass(t, k) for t in tasks for k in text):
            kinds = sorted({b.__name__ for t in tasks for b in t.__mro__[1:2]})
            out.append((mt, f"not a text model: keras-hub declares {'only ' + ', '.join(kinds) if kinds else 'no'} "
                            f"task(s) for {cls.__name__}"))
        elif mt not in transformers.CONFIG_MAPPING:
            out.append((mt, f"transformers {transformers.__version__} does not implement it"))
        else:
            out.append((mt, None))
    return out


def _mlx_types() -> set[str]:
    sys.path.insert(0, HERE)
    import coverage

    return {mt for mt, _ in coverage.model_types()}


# ------------------------------------------------------------------------------ one row (child)
def _auto_class(text_type: str, backbone_cls):
    """(transformers auto class, its mapping's class name, keras-hub task base) for the first text
    task keras-hub declares for ``backbone_cls`` that transformers also has for ``text_type``."""
    import transformers
    from transformers.models.auto import modeling_auto as ma

    from dense_bridge.backends.keras import _ports as kp

    tasks = kp._tasks_of(backbone_cls)
    autos = [("CausalLM", ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForCausalLM),
             ("TextClassifier", ma.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
              transformers.AutoModelForSequenceClassification),
             ("MaskedLM", ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES, transformers.AutoModelForMaskedLM),
             ("Seq2SeqLM", ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, transformers.AutoModelForSeq2SeqLM)]
    # a task's kind is the most specific of these it derives from (keras-hub's Seq2SeqLM is a CausalLM)
    order = ["Seq2SeqLM", "CausalLM", "TextClassifier", "MaskedLM"]
    declared = {next((k for k in order if k in {b.__name__ for b in t.__mro__}), None) for t in tasks}
    for kind, mapping, auto in sorted(autos, key=lambda a: order.index(a[0]) if a[0] != "CausalLM" else 0.5):
        if kind in declared and text_type in mapping:
            return auto, mapping[text_type], kind
    raise LookupError(f"keras-hub declares only {sorted(k for k in declared if k)} for {backbone_cls.__name__}, "
                      f"and transformers has no such model class for its text part {text_type!r} (the whole "
                      "encoder-decoder is not built here): not attempted")


def _tiny_config(mt: str) -> tuple[dict, list[str]]:
    """coverage.py's tiny config for ``mt``, then two harness-only adjustments, each shown in the
    row's notes: a vocabulary the default leaves unset (None) set to 96, and an equality between two
    numbers of the default config that the shrink broke (one changed, the other kept) restored: a
    value keras-hub's importer compares with another (Gemma's query scale is "normalize by head_dim"
    exactly when ``query_pre_attn_scalar == head_dim``) must keep the relation the default has."""
    import transformers

    sys.path.insert(0, HERE)
    import coverage
    from dense_bridge.backends.keras import _ports as kp

    small, notes = coverage._tiny_config(mt)
    text_cls = transformers.CONFIG_MAPPING[small["model_type"]]
    amap = dict(getattr(text_cls, "attribute_map", {}) or {})
    vk = amap.get("vocab_size", "vocab_size")
    if vk in small and small[vk] is None:
        small[vk] = 96
        notes.append(f"{vk}=96 (None by default)")
    default = text_cls().to_dict()
    ints = {k: v for k, v in default.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    try:
        conv = kp._converter(small["model_type"])
        before = kp._import_config(conv, small)
    except Exception:  # noqa: BLE001 - keras-hub's importer does not take the text part: nothing to keep
        return small, notes
    for a, va in ints.items():
        if small.get(a) == va or not isinstance(small.get(a), int):
            continue  # not changed by the shrink
        for b, vb in ints.items():
            if b == a or vb != va or small.get(b) != vb:
                continue
            try:  # equal by default, one shrunk: restored where the importer turns the comparison into a flag
                after = kp._import_config(conv, {**small, b: small[a]})
            except Exception:  # noqa: BLE001
                continue
            changed = [k for k in after if after[k] != before.get(k)]
            if changed and all(isinstance(after[k], bool) for k in changed):
                small[b] = small[a]
                notes.append(f"{b}={small[a]} (= {a} as in the default config: keras-hub's importer "
                             f"derives {', '.join(changed)} from the comparison)")
    return small, notes


def _keras_vars(model) -> list[tuple[str, object]]:
    """(path, value) of every variable; in the path, the counters Keras appends to layers it names
    itself ("mixtral_sparse_moe_block_12") dropped: they count the layers made earlier in the process."""
    import re

    import keras
    import numpy as np

    return [(re.sub(r"_\d+(?=/|$)", "", v.path), np.asarray(keras.ops.convert_to_numpy(v))) for v in model.weights]


def _task_from_preset(path: str, task_json: dict, seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    cls = keras.saving.get_registered_object(task_json["registered_name"])
    extra = {k: v for k, v in task_json["config"].items() if k == "num_classes"}
    return cls.from_preset(path, preprocessor=None, **extra)


def _compare_keras(k_dir: str, t_dir: str) -> tuple[str | None, str]:
    """(first difference or None, note) between keras-hub's ``from_preset`` of the port's preset
    ``k_dir`` and keras-hub's own import of the transformers directory ``t_dir``, every variable of
    the task class the port wrote."""
    import numpy as np

    with open(os.path.join(k_dir, "task.json")) as f:
        task_json = json.load(f)
    mine = _task_from_preset(k_dir, task_json, 0)
    try:
        ref_a = _task_from_preset(t_dir, task_json, 1)
        ref_b = _task_from_preset(t_dir, task_json, 2)
    except Exception as exc:  # noqa: BLE001 - keras-hub's importer cannot read the source itself
        raise _NoReference(f"keras-hub's own importer cannot read the transformers directory: {_short(exc)}")
    backbone_ids = {id(v) for v in mine.backbone.weights}
    got, want, want_b = _keras_vars(mine), _keras_vars(ref_a), _keras_vars(ref_b)
    if [k for k, _ in got] != [k for k, _ in want]:
        a, b = [k for k, _ in got], [k for k, _ in want]
        return f"variables differ: port {sorted(set(a) - set(b))[:4]}, keras-hub's import {sorted(set(b) - set(a))[:4]}", ""
    # a head keras-hub's importer does not read is left at its initial values: random ones differ
    # between the two seeds (the importer reads a head whole or not at all, zero biases included)
    own = [id(v) not in backbone_ids for v in mine.weights]
    head_unread = any(o and y.tobytes() != z.tobytes() for o, (_, y), (_, z) in zip(own, want, want_b))
    unread = []
    for (k, x), (_, y), o in zip(got, want, own):
        if o and head_unread:
            unread.append(k)
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{k}: {x.shape} {x.dtype} vs keras-hub's import {y.shape} {y.dtype}", ""
        if x.tobytes() != y.tobytes():
            err = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
            return f"{k} differs from keras-hub's own import (max abs {err:.3g})", ""
    note = (f"{type(mine).__name__}: {len(got) - len(unread)} variables bit-identical to keras-hub's import")
    if unread:
        note += f"; head {unread} not read by keras-hub's importer (random there): judged by the round trip"
    return None, note


class _NoReference(Exception):
    pass


def _short(exc):
    sys.path.insert(0, HERE)
    import coverage

    return coverage._short(exc)


def _judge(src, k_dir, back_dir, back_to, t_dir, want_back, back_what):
    """One direction into keras-hub and back: (class, detail)."""
    sys.path.insert(0, HERE)
    import coverage

    from dense_bridge import DenseBridgeError

    try:
        r1 = coverage._port(src, k_dir, "keras-hub")
    except DenseBridgeError as exc:
        return "refused", f"keras-hub: {_short(exc)}"
    except Exception as exc:  # noqa: BLE001
        return "fails", f"keras-hub: {_short(exc)}"
    try:
        diff, note = _compare_keras(k_dir, t_dir)
    except _NoReference as exc:
        diff, note = None, f"{exc}; judged by the round trip only"
        ref = False
    except Exception as exc:  # noqa: BLE001
        return "fails", f"keras-hub's from_preset cannot read the port's preset: {_short(exc)}"
    else:
        ref = True
    if diff:
        return "fails", diff
    try:
        r2 = coverage._port(k_dir, back_dir, back_to)
    except DenseBridgeError as exc:
        return ("refused" if ref else "no-reference"), f"round trip to {back_to}: {_short(exc)} [{note}]"
    except Exception as exc:  # noqa: BLE001
        return "fails", f"round trip to {back_to}: {_short(exc)}"
    diff = coverage._first_difference(coverage._files(back_dir), want_back, back_what)
    if diff:
        return "fails", "round trip: " + diff
    disc = list(r1.discrepancies) + list(r2.discrepancies)
    rounded = coverage._rounded(r1) + coverage._rounded(r2)
    if disc:
        return "discrepancy", "; ".join(d[:300] for d in disc) + f" [{note}]"
    if rounded:
        return "pass-rounded", f"inexact: {rounded[:4]} [{note}]"
    return ("pass" if ref else "no-reference"), note


def run_row(mt: str, with_mlx: bool) -> list[dict]:
    """The rows of ``mt`` (see the module docstring)."""
    import shutil
    from pathlib import Path

    import torch

    sys.path.insert(0, HERE)
    import coverage
    from dense_bridge.backends.keras import _ports as kp
    from dense_bridge.backends.torch import _ports as tp

    tmp = tempfile.mkdtemp(prefix=f"coverage-keras-{mt}-")
    rows = []
    try:
        t = os.path.join(tmp, "T")
        t0 = time.perf_counter()
        try:
            cfg, notes = _tiny_config(mt)
            auto, arch, kind = _auto_class(cfg["model_type"], kp._converter(mt).backbone_cls)
            cfg["architectures"] = [arch]
            if kind == "TextClassifier":
                cfg["num_labels"] = 3
            if kind != "CausalLM":
                notes.append(f"{arch} (keras-hub {kind})")
            with tp._quiet():
                model = auto.from_config(tp._config(cfg), dtype=torch.float32).eval()
            tp._randomize(model, seed=7)
            with torch.no_grad():  # float16-representable values: see the module docstring
                for p in model.parameters():
                    p.copy_(p.half().float())
            with tp._quiet():
                model.save_pretrained(t)
        except Exception as exc:  # noqa: BLE001 - a library failure is a row
            what = "" if isinstance(exc, LookupError) else "transformers cannot build the tiny model: "
            return [{"model_type": mt, "direction": TO_KERAS, "class": "no-reference", "notes": [],
                     "detail": what + _short(exc),
                     "seconds": round(time.perf_counter() - t0, 1)}]
        cls, detail = _judge(t, os.path.join(tmp, "K"), os.path.join(tmp, "B"), "transformers", t,
                             coverage._files(t), "round trip vs the source")
        rows.append({"model_type": mt, "direction": TO_KERAS, "notes": notes, "class": cls, "detail": detail,
                     "seconds": round(time.perf_counter() - t0, 1)})
        if with_mlx:
            t0 = time.perf_counter()
            m = os.path.join(tmp, "M")
            m_note = ""
            try:
                import mlx_lm.utils as mu

                try:
                    ref_model, ref_cfg = mu.load_model(Path(t))
                except Exception as exc:  # noqa: BLE001 - then M is mlx-lm's load of the port's mlx-lm directory
                    import dense_bridge as db

                    unread = f"mlx-lm's own loader cannot read the transformers directory: {_short(exc)}"
                    try:
                        db.port(t, os.path.join(tmp, "P"), to="mlx-lm", verify="twins", progress=False)
                        ref_model, ref_cfg = mu.load_model(Path(tmp) / "P")
                    except Exception as exc2:  # noqa: BLE001
                        raise RuntimeError(f"{unread}; nor from the port's mlx-lm directory: {_short(exc2)}") from None
                    m_note = f" (M: mlx-lm's load of the port's mlx-lm directory, since {unread})"
                mu.save_model(m, ref_model)
                ref_cfg = dict(ref_cfg)
                ref_cfg.pop("quantization_config", None)
                with open(os.path.join(m, "config.json"), "w") as f:
                    json.dump(ref_cfg, f)
            except Exception as exc:  # noqa: BLE001
                text = str(exc) if isinstance(exc, RuntimeError) and "cannot read the transformers" in str(exc) \
                    else f"mlx-lm's own loader cannot read the transformers directory: {_short(exc)}"
                cls, detail = "no-reference", text
            else:
                cls, detail = _judge(m, os.path.join(tmp, "K2"), os.path.join(tmp, "M2"), "mlx-lm", t,
                                     coverage._files(m), "round trip vs mlx-lm's own files")
            rows.append({"model_type": mt, "direction": MLX_TO_KERAS, "notes": notes, "class": cls,
                         "detail": detail + m_note, "seconds": round(time.perf_counter() - t0, 1)})
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------ the table (parent)
def _child(mt: str, with_mlx: bool, timeout: float) -> list[dict]:
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--row", mt] + (["--mlx"] if with_mlx else [])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return [{"model_type": mt, "direction": TO_KERAS, "class": "fails", "notes": [],
                 "detail": f"timeout after {timeout:.0f} s", "seconds": round(time.perf_counter() - t0, 1)}]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    tail = [s for s in (proc.stderr or "").strip().splitlines() if s.strip()][-1:] or ["(no output)"]
    return [{"model_type": mt, "direction": TO_KERAS, "class": "fails", "notes": [],
             "detail": f"the row's process crashed (exit {proc.returncode}): {tail[0][:300]}",
             "seconds": round(time.perf_counter() - t0, 1)}]


def rows(timeout: float = 300.0, only=None, on_row=None) -> list[dict]:
    """Every keras-hub row (skipped model types included, class ``refused`` with the reason);
    ``on_row(rows so far)`` after each model type."""
    out: list[dict] = []
    types = model_types()
    if only:
        types = [t for t in types if t[0] in set(only)]
    mlx = _mlx_types()
    for i, (mt, skip) in enumerate(types):
        if skip:
            got = [{"model_type": mt, "direction": TO_KERAS, "class": "skipped", "notes": [], "detail": skip,
                    "seconds": 0.0}]
        else:
            got = _child(mt, mt in mlx, timeout)
        out += got
        print(f"[keras-hub {i + 1}/{len(types)}] {mt}: " + ", ".join(f"{r['direction']} {r['class']}" for r in got),
              flush=True)
        if on_row is not None:
            on_row(out)
    return out


def is_keras(row: dict) -> bool:
    return row.get("direction") in DIRECTIONS


def section(krows: list[dict], classes) -> list[str]:
    """The markdown section of the keras-hub rows."""
    if not krows:
        return []
    lines = ["", "## keras-hub rows", "",
             "Every architecture keras-hub's transformers importer (`TransformersPresetLoader`) accepts; "
             "those that are not text models (keras-hub declares no text task for their backbone) are listed "
             "as skipped. Judged against keras-hub's own `from_preset` of the same transformers directory "
             "(every variable of the task, bit for bit), and the round trip against the source files. "
             "Sources hold float16-representable values (keras-hub's Mistral converter rounds through float16).",
             "", "| direction | " + " | ".join(classes) + " | skipped |", "|---" * (len(classes) + 2) + "|"]
    for d in DIRECTIONS:
        got = [r for r in krows if r["direction"] == d]
        if got:
            lines.append(f"| {d} | " + " | ".join(str(sum(r["class"] == c for r in got)) for c in classes)
                         + f" | {sum(r['class'] == 'skipped' for r in got)} |")
    lines += ["", "| model_type | direction | class | s | detail |", "|---|---|---|---|---|"]
    for r in krows:
        detail = str(r.get("detail") or "").replace("|", "\\|").replace("\n", " ")
        notes = "; ".join(r.get("notes") or [])
        if notes:
            detail = f"[{notes}] {detail}"
        lines.append(f"| {r['model_type']} | {r['direction']} | {r['class']} | {r.get('seconds', '')} | {detail[:700]} |")
    return lines


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    if len(sys.argv) >= 3 and sys.argv[1] == "--row":
        print("ROWS " + json.dumps(run_row(sys.argv[2], "--mlx" in sys.argv[3:])))
        sys.exit(0)
    print(json.dumps(model_types(), indent=1))
