"""Coverage of ``db.port`` (issue 44): every architecture transformers and mlx-lm both implement,
ported both ways, each weight judged against the destination library's own loader.

For every ``model_type`` in transformers' ``CONFIG_MAPPING`` that mlx-lm implements (a module of
``mlx_lm.models`` of that name, or through mlx-lm's own ``MODEL_REMAPPING``), in its own subprocess
with a timeout (a crash or a hang is a row, not the end of the table):

1. a tiny random model from transformers' own config class (the text sub-config of a multimodal
   one, ``get_text_config``): the default config shrunk by transformers' shrink of the port
   (``port_shrink``: widths, 2 layers, vocabulary; structure kept), the expert count capped at 4
   and the vocabulary set to 96 (so the real model differs from the port's twins), plus the
   overrides of :data:`OVERRIDES` (defaults that cannot run; each one counted and shown);
   ``AutoModelForCausalLM.from_config``, every parameter random, ``save_pretrained`` -> ``T``. Where
   transformers builds that text model only inside its multimodal composite (no causal language model
   for the text config's class), ``T`` is the whole composite (``AutoModelForImageTextToText``, its
   other towers' default configs shrunk too), as a user's checkpoint holds it, ported with
   ``text_only=True``: its text part is judged, the towers dropped are listed by the port; such a text
   model cannot come back into transformers without its towers, which the port refuses by name;
2. ``transformers -> mlx-lm``: ``db.port(T, P, to="mlx-lm")``; every parameter of mlx-lm's model
   loaded from ``P`` (``mlx_lm.utils.load_model``) must be bit-identical to mlx-lm's own loader on
   ``T``'s files (``load_model(T)`` with the config the port wrote: its ``sanitize`` does
   mlx-lm's own conversion); then ``db.port(P, to="transformers")`` must give back ``T``'s tensors
   bit for bit;
3. ``mlx-lm -> transformers``: ``M`` = the model mlx-lm's own loader made of ``T``, written by its
   own ``save_model``; ``db.port(M, Q, to="transformers")``; transformers' ``from_pretrained(Q)``
   must hold ``from_pretrained(T)``'s state bit for bit; ``db.port(Q, to="mlx-lm")`` must give
   back ``M``'s tensors bit for bit.

Each row is judged: ``pass`` / ``pass-rounded`` (a tensor the certificate marks inexact, named) /
``refused`` (the port raised a DenseBridgeError: its first line) / ``fails`` (the first
disagreeing weight, or an exception that is not the port's own) / ``discrepancy`` (the weights
agree, the libraries compute differently, as the port reports) / ``no-reference`` (a library
cannot make the tiny model or the reference: the library's own message).

keras-hub rows: benchmarks/_coverage_keras.py (every text architecture keras-hub's importer accepts,
judged against keras-hub's own import), run after these rows; ``--keras-only`` runs only them.

Run:  nice python benchmarks/coverage.py [--only llama,mixtral] [--timeout 300] [--jobs 2] [--no-keras] [--out PATH]
Writes benchmarks/results/coverage.md (and coverage.json beside it). The table in the repository is a
composite (each row with the commit it ran at): run some rows with ``--out /tmp/run.md``, then
``python benchmarks/coverage.py --merge /tmp/run.json --at COMMIT`` puts them in place and recomputes
the summary from the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Config values a default config needs before it can build and run at all, per model_type. Only
#: for the harness (never in dense_bridge); every entry is shown in the table.
OVERRIDES: dict[str, dict] = {
    # transformers' default config leaves the key-value head count None, which its own attention divides by
    "nemotron": {"num_key_value_heads": 8},
    # transformers' default config has no experts (None counts), no rope base and no clipping bound in its
    # attention config, which both libraries read
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # transformers' default config makes every layer attention (no convolution), which mlx-lm's model cannot
    # run: the released LFM2 layout (convolutions, attention at six layers)
    "lfm2": {"num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14],
             "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]},
    # the same for LFM2-MoE (transformers' default sets no layer_types at all): the released LFM2-8B-A1B layout
    "lfm2_moe": {"num_hidden_layers": 24,
                 "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]},
    # transformers' default config leaves head_dim None, which its own attention raises to a power
    "hunyuan_v1_dense": {"head_dim": 128},
    # mlx-lm's DeepSeek-V2 always runs YaRN rope (it reads rope_scaling's factor): the released models' setting;
    # transformers' default config routes to None experts per token
    # the default places attention at one layer in eight (from the fifth), so the 2-layer model has none,
    # which mlx-lm's model requires (it looks the first one up): one attention and one expert layer in two
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "deepseek_v2": {"num_experts_per_tok": 2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                        "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}},
    # transformers' Step3p7 text model always builds a sliding-window mask, which its default config (no window)
    # cannot: the window and the alternating sliding layers mlx-lm's model assumes when the config names none
    "step3p5": {"sliding_window": 512,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(45)]},
    # transformers' default config makes every layer state-space, which its own model cannot run with its cache
    # (get_seq_length needs an attention layer): one state-space and one attention layer, as the released models mix
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
    # transformers' default configs leave the multimodal rope's sections unset, which its model code then takes
    # for a 128-wide head (the released models' setting, written out so the port's shrink scales it with the head)
    "qwen2_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
    "qwen3_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [24, 20, 20]}},
    "qwen3_vl_moe": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                         "mrope_section": [24, 20, 20]}},
    # transformers' default ESM config leaves the padding id None, which its own position ids compare tokens
    # with (the released ESM-2 models' padding id)
    "esm": {"pad_token_id": 1},
}
#: The most parameters a tiny model may have (a multimodal composite whose towers the shrink cannot reach).
MAX_TINY = 150_000_000
CLASSES = ("pass", "pass-rounded", "discrepancy", "refused", "fails", "no-reference")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_layer")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k")
#: Grouped routing and dense-first layers, set so the 2-layer model still routes through experts.
ONE_KEYS = ("n_group", "topk_group", "num_expert_group", "first_k_dense_replace")


# ------------------------------------------------------------------------------ the model types
def model_types() -> list[tuple[str, str]]:
    """(transformers model_type, mlx-lm module) for every model type both implement."""
    import pkgutil

    import mlx_lm.models
    import mlx_lm.utils
    import transformers

    mods = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if not m.name.startswith("_")}
    remap = getattr(mlx_lm.utils, "MODEL_REMAPPING", {})
    out = []
    for mt in sorted(transformers.CONFIG_MAPPING.keys()):
        if mt in mods:
            out.append((mt, mt))
        elif remap.get(mt) in mods:
            out.append((mt, remap[mt]))
    return out


# ------------------------------------------------------------------------------ one row (child)
def _plain_shrink(text, d: dict) -> dict:
    """Sizes for a config the port's shrink does not take (no attention heads): every width key the
    config class declares set small, derived widths left for the class to recompute."""
    amap = dict(getattr(type(text), "attribute_map", {}) or {})
    small = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 96, "state_size": 8, "ssm_state_size": 8,
             "intermediate_size": 128, "time_step_rank": 8, "n_groups": 1, "max_position_embeddings": 512}
    out = dict(d)
    for k, v in small.items():
        k = amap.get(k, k)
        if isinstance(out.get(k), int):
            out[k] = v
    if "expand" in out:  # widths computed from hidden_size * expand
        out.pop("intermediate_size", None)
        if isinstance(out.get("num_heads"), int) and isinstance(out.get("head_dim"), int):
            out["num_heads"] = int(out.get("expand", 2) * 64) // out["head_dim"]
    ids = [k for k, v in out.items() if k.endswith("_token_id") and isinstance(v, int)]
    for n, k in enumerate(sorted(ids)):
        out[k] = min(out[k], 95 - n)
    out["dtype"] = "float32"
    return out


def _tiny_config(mt: str) -> tuple[dict, list[str]]:
    """The tiny interchange config for ``mt`` and the notes on what was changed beyond sizes."""
    import transformers

    from dense_bridge.backends.torch import _ports as tp

    notes = []
    cfg = transformers.CONFIG_MAPPING[mt]()
    text = cfg.get_text_config()
    if text is not cfg:
        notes.append(f"text part: {text.model_type}")
    d = {k: v for k, v in tp._plain_floats(text.to_dict()).items() if k != "transformers_version"}
    d["model_type"] = text.model_type
    d.update(OVERRIDES.get(mt, {}))
    if OVERRIDES.get(mt):
        notes.append("override " + ", ".join(f"{k}={v!r}" for k, v in OVERRIDES[mt].items()))
    try:
        small = tp.port_shrink("transformers", d)
    except Exception as exc:  # noqa: BLE001 - no attention heads (state-space models): the harness's own sizes
        small = _plain_shrink(text, d)
        notes.append(f"sizes by the harness ({type(exc).__name__} from the port's shrink)")
    for k in EXPERT_KEYS:
        if isinstance(small.get(k), int) and small[k] > 4:
            small[k] = 4
    for k in TOPK_KEYS:
        if isinstance(small.get(k), int) and small[k] > 2:
            small[k] = 2
    for k in ONE_KEYS:
        if isinstance(small.get(k), int) and small[k] > 1:
            small[k] = 1
    amap = dict(getattr(transformers.CONFIG_MAPPING[text.model_type], "attribute_map", {}) or {})
    vk = amap.get("vocab_size", "vocab_size")
    if isinstance(small.get(vk), int) and small[vk] == tp.TWIN_VOCAB:
        for k in [k for k in small if k.startswith("vocab_size") and small[k] == tp.TWIN_VOCAB]:
            small[k] = 96  # with the tables of the same vocabulary (per-layer inputs)
        small[vk] = 96
    return small, notes


def _tiny_model(cfg: dict, notes: list[str]):
    """transformers' own model for the tiny text config ``cfg``, as a user's checkpoint holds it:
    its causal language model; or, where transformers builds that text model only inside a
    multimodal composite (no causal language model for its class), the whole composite
    (``AutoModelForImageTextToText``) with ``cfg`` as its text part and its other towers' default
    configs shrunk the same way (noted). ValueError (a no-reference row) where it has neither, saying
    what transformers does build for the config."""
    import torch
    import transformers

    from dense_bridge.backends.torch import _ports as tp

    found = tp._composite(cfg)
    if found is not None:
        whole_cls, key = found
        whole = whole_cls(**tp._towers_shrunk(whole_cls, key, cfg))
        with torch.device("meta"):  # sized before it is built: a tower the shrink cannot reach stays released-size
            meta = transformers.AutoModelForImageTextToText.from_config(whole)
        sizes: dict[str, int] = {}
        for name, p in meta.named_parameters():
            part = ".".join(name.split(".")[:3])
            sizes[part] = sizes.get(part, 0) + p.numel()
        if sum(sizes.values()) > MAX_TINY:
            big = sorted(sizes.items(), key=lambda x: -x[1])[:3]
            raise ValueError(f"transformers' {type(meta).__name__} cannot be made tiny: {sum(sizes.values()):,} "
                             "parameters after the port's shrink, widths it does not reach keeping their released sizes ("
                             + ", ".join(f"{k} {v:,}" for k, v in big) + ")")
        model = transformers.AutoModelForImageTextToText.from_config(whole, dtype=torch.float32).eval()
        notes.append(f"whole model {type(model).__name__} (model_type {whole_cls.model_type}, other towers tiny): "
                     "ported with text_only=True, its text part judged")
        return model
    try:
        return tp._auto(cfg).from_config(tp._config(cfg), dtype=torch.float32).eval()
    except ValueError:
        cls = tp._config_class(cfg)
        from transformers.models.auto import modeling_auto as ma
        built = sorted({getattr(ma, n)[cfg["model_type"]] for n in dir(ma)
                        if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")
                        and isinstance(getattr(ma, n), dict) and cfg["model_type"] in getattr(ma, n)})
        if built and not any(k.startswith("vocab_size") for k in cfg) and "text_config" not in cfg:
            raise ValueError(f"transformers' {cfg['model_type']!r} config ({cls.__name__}) is a model without a "
                             f"vocabulary (it builds {', '.join(built)} only): no text model; mlx-lm's module of this "
                             "name reads the text part of another checkpoint layout, which transformers does not "
                             "write under this model_type") from None
        raise


def _params_mlx(model) -> dict:
    import numpy as np
    from mlx.utils import tree_flatten

    import mlx.core as mx

    out = {}
    for k, v in tree_flatten(model.parameters()):
        if v.dtype == mx.bfloat16:
            v = v.astype(mx.float32)
        out[k] = np.array(v)
    return out


def _files(path: str) -> dict:
    import glob

    from safetensors.numpy import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "model*.safetensors"))):
        out.update(load_file(f))
    return out


def _first_difference(got: dict, want: dict, what: str, rounded: dict | None = None) -> str | None:
    """The first tensor of ``want`` that ``got`` lacks or holds otherwise, or None. ``rounded``:
    tensor -> (offset, ULPs) of a sum the forward port rounded (its certificate says so): such a
    tensor may differ by that rounding of ``want + offset`` and no more."""
    import numpy as np

    rounded = rounded or {}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        return f"{what}: missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
    for k in want:  # in the library's own order: the first layer that disagrees
        a, b = np.asarray(got[k]), np.asarray(want[k])
        if a.shape != b.shape:
            return f"{what}: {k} shape {a.shape} vs {b.shape}"
        if a.dtype != b.dtype:
            return f"{what}: {k} dtype {a.dtype} vs {b.dtype}"
        if a.tobytes() != b.tobytes():
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            if k in rounded:
                offset, ulps = rounded[k]
                mid = (np.abs(b.astype(np.float64)) + abs(offset)).astype(b.dtype)
                if np.all(diff <= ulps * np.abs(np.spacing(mid)).astype(np.float64)):
                    continue
            return f"{what}: {k} differs (max abs {float(np.max(diff)):.3g})"
    return None


def _rounded_back(r1, r2) -> dict:
    """Round-trip tensors (``r2``'s targets) made from a tensor ``r1`` wrote rounded (an offset
    added: a norm's scale stored as ``1 + w`` by one library): target -> (offset, ULPs)."""
    out = {}
    first = r1.certificate["tensors"]
    for k, entry in r2.certificate["tensors"].items():
        for s in entry.get("sources", []):
            e = first.get(s["tensor"])
            if e is not None and e.get("offset") and not e.get("exact", True):
                out[k] = (float(e["offset"]), int(e.get("max_ulp") or 1))
    return out


def _short(exc: BaseException) -> str:
    lines = [s for s in str(exc).splitlines() if s.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and text.rstrip().endswith(":"):
        text += " " + lines[1].strip()
    return f"{type(exc).__name__}: {text[:400]}"


def _port(src, out, to):
    """``db.port`` with the twins' verification; a multimodal transformers source (a config naming
    another tower) is ported with ``text_only=True``, as a user asks for its text model."""
    import dense_bridge as db

    text_only = False
    try:
        with open(os.path.join(src, "config.json")) as f:
            c = json.load(f)
        from dense_bridge.backends.torch import _ports as tp
        from dense_bridge.ports import _dirs
        text_only = any(c.get(k) for k in tp.MULTIMODAL_KEYS) and _dirs.detect(src).name == "transformers"
    except (OSError, ValueError):
        pass
    return db.port(src, out, to=to, verify="twins", progress=False, text_only=text_only)


def _rounded(report) -> list[str]:
    return sorted(k for k, t in report.certificate["tensors"].items() if not t.get("exact", True))


def _judge_port(src, out, to, back_out, back_to, want_dst, want_back, what_dst, what_back):
    """Port ``src`` -> ``out`` and back; returns (class, detail)."""
    from dense_bridge import DenseBridgeError

    try:
        r1 = _port(src, out, to)
    except DenseBridgeError as exc:
        return "refused", f"{to}: {_short(exc)}"
    got = want_dst[0](out) if want_dst else None
    if want_dst and want_dst[1] is not None:
        diff = _first_difference(got, want_dst[1], what_dst)
        if diff:
            return "fails", diff
    try:
        r2 = _port(out, back_out, back_to)
    except DenseBridgeError as exc:
        return "refused", f"round trip to {back_to}: {_short(exc)}"
    diff = _first_difference(_files(back_out), want_back, what_back, _rounded_back(r1, r2))
    if diff:
        return "fails", "round trip: " + diff
    rounded = _rounded(r1) + _rounded(r2)
    disc = list(r1.discrepancies) + list(r2.discrepancies)
    note = "" if want_dst and want_dst[1] is not None else " (no reference from the destination library's loader)"
    if disc:
        return "discrepancy", "; ".join(d[:300] for d in disc) + note
    if rounded:
        return "pass-rounded", f"inexact: {rounded[:4]}" + note
    return "pass", note.strip()


def run_row(mt: str) -> list[dict]:
    import shutil
    from pathlib import Path

    import numpy as np
    import torch
    import transformers

    import mlx_lm.utils as mu
    from dense_bridge.backends.torch import _ports as tp

    rows = []
    tmp = tempfile.mkdtemp(prefix=f"coverage-{mt}-")
    try:
        t = os.path.join(tmp, "T")
        try:
            cfg, notes = _tiny_config(mt)
            with tp._quiet():
                model = _tiny_model(cfg, notes)
            tp._randomize(model, seed=7)
            with tp._quiet():
                model.save_pretrained(t)
        except Exception as exc:  # noqa: BLE001 - a library failure is a row
            detail = f"transformers cannot build the tiny model: {_short(exc)}"
            return [{"model_type": mt, "direction": d, "class": "no-reference", "detail": detail, "notes": []}
                    for d in ("transformers->mlx-lm", "mlx-lm->transformers")]
        with open(os.path.join(t, "config.json")) as f:
            t_config = json.load(f)

        # the reference: mlx-lm's own loader on T's files (with the config the port writes, when it writes one)
        def mlx_reference(config_dir):
            cfg_over = None
            if config_dir:
                with open(os.path.join(config_dir, "config.json")) as f:
                    cfg_over = json.load(f)
            m, c = mu.load_model(Path(t), model_config=cfg_over)
            return m, c

        p, pb = os.path.join(tmp, "P"), os.path.join(tmp, "PB")
        ref_err = None

        def load_port_mlx(path):
            m, _ = mu.load_model(Path(path))
            return _params_mlx(m)

        from dense_bridge import DenseBridgeError
        t0 = time.perf_counter()
        try:
            r1 = _port(t, p, "mlx-lm")
            err1 = None
        except DenseBridgeError as exc:
            r1, err1 = None, exc
        except Exception as exc:  # noqa: BLE001
            r1, err1 = None, exc
        ref_model = None
        try:
            ref_model, ref_cfg = mlx_reference(p if r1 is not None else None)
            ref = _params_mlx(ref_model)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a module of mlx-lm may exit the process
            ref, ref_err = None, f"mlx-lm's own loader cannot read the transformers directory: {_short(exc)}"
        if err1 is not None:
            cls = "refused" if isinstance(err1, DenseBridgeError) else "fails"
            row = {"class": cls, "detail": f"mlx-lm: {_short(err1)}"}
            if ref is None and cls == "fails":
                row = {"class": "no-reference", "detail": ref_err + f" (port: {_short(err1)})"}
        else:
            row = {}
            try:
                got = load_port_mlx(p)
            except Exception as exc:  # noqa: BLE001
                row = {"class": "fails", "detail": f"mlx-lm's loader cannot read the port's output: {_short(exc)}"}
            if not row and ref is not None:
                diff = _first_difference(got, ref, "vs mlx-lm's own load of the source")
                if diff:
                    row = {"class": "fails", "detail": diff}
            if not row:
                try:
                    r2 = _port(p, pb, "transformers")
                    diff = _first_difference(_files(pb), _files(t), "round trip vs the source", _rounded_back(r1, r2))
                    row = {"class": "fails", "detail": diff} if diff else {}
                except DenseBridgeError as exc:
                    before = ""
                    if r1.dropped:  # the text part of a multimodal source: judged, then refused back
                        judged = "bit-identical to mlx-lm's own load of the source" if ref is not None \
                            else f"verified on the twins only ({ref_err})"
                        before = (f"the text part ported ({len(r1.dropped)} tensors of the other towers dropped, "
                                  f"listed in the certificate) {judged}; ")
                    r2, row = None, {"class": "refused", "detail": f"{before}round trip to transformers: {_short(exc)}"}
                except Exception as exc:  # noqa: BLE001
                    r2, row = None, {"class": "fails", "detail": f"round trip to transformers: {_short(exc)}"}
            if not row:
                disc = list(r1.discrepancies) + list(r2.discrepancies)
                rounded = _rounded(r1) + _rounded(r2)
                note = "" if ref is not None else f" ({ref_err}; judged by the round trip only)"
                if disc:
                    row = {"class": "discrepancy", "detail": "; ".join(d[:240] for d in disc) + note}
                elif rounded:
                    row = {"class": "pass-rounded", "detail": f"inexact: {rounded[:4]}" + note}
                else:
                    row = {"class": "pass", "detail": note.strip()}
        rows.append({"model_type": mt, "direction": "transformers->mlx-lm", "notes": notes,
                     "seconds": round(time.perf_counter() - t0, 1), **row})

        # mlx-lm -> transformers: M is what mlx-lm's own loader made of T, written by its own saver
        t0 = time.perf_counter()
        m = os.path.join(tmp, "M")
        q, qb = os.path.join(tmp, "Q"), os.path.join(tmp, "QB")
        m_note = ""
        text_part = r1 is not None and bool(r1.dropped)  # the text part of a multimodal source, verified on the twins
        if ref_model is None and (rows[0]["class"] in ("pass", "pass-rounded", "discrepancy") or text_part):
            # mlx-lm's loader cannot read T, but the port's own mlx-lm directory passed its round trip (its
            # weights; a discrepancy is the two libraries' code, stated), or is the text part of a multimodal
            # T (whose round trip needs the other towers): M is
            # mlx-lm's load of that (the transformers side is still judged against from_pretrained(T))
            try:
                ref_model, ref_cfg = mu.load_model(Path(p))
                m_note = " (M: mlx-lm's load of the port's mlx-lm directory, since " + ref_err + ")"
            except Exception:  # noqa: BLE001
                ref_model = None
        if ref_model is None:
            row = {"class": "no-reference", "detail": ref_err}
        else:
            mu.save_model(m, ref_model)
            cfg_m = dict(ref_cfg)
            cfg_m.pop("quantization_config", None)
            with open(os.path.join(m, "config.json"), "w") as f:
                json.dump(cfg_m, f)
            row = {}
            lossy: dict = {}  # tensors mlx-lm's own load of T rounded (w + 1): Q's are M's minus 1, exactly
            try:
                r3 = _port(m, q, "transformers")
                lossy = {k: (float(e["offset"]), 1) for k, e in r3.certificate["tensors"].items() if e.get("offset")}
            except DenseBridgeError as exc:
                row = {"class": "refused", "detail": f"transformers: {_short(exc)}"}
            except Exception as exc:  # noqa: BLE001
                row = {"class": "fails", "detail": f"transformers: {_short(exc)}"}
            if not row:
                try:
                    with tp._quiet():
                        want = {k: v.detach().float().numpy() for k, v in
                                tp._auto(t_config).from_pretrained(t).state_dict().items()}
                        got = {k: v.detach().float().numpy() for k, v in
                               tp._auto(t_config).from_pretrained(q).state_dict().items()}
                    diff = _first_difference(got, want, "vs transformers' own load of the source", lossy)
                    if diff:
                        row = {"class": "fails", "detail": diff}
                except Exception as exc:  # noqa: BLE001
                    row = {"class": "fails", "detail": f"transformers cannot load the port's output: {_short(exc)}"}
            if not row:
                try:
                    r4 = _port(q, qb, "mlx-lm")
                    diff = _first_difference(_files(qb), _files(m), "round trip vs mlx-lm's own files")
                    row = {"class": "fails", "detail": diff} if diff else {}
                except DenseBridgeError as exc:
                    r4, row = None, {"class": "refused", "detail": f"round trip to mlx-lm: {_short(exc)}"}
                except Exception as exc:  # noqa: BLE001
                    r4, row = None, {"class": "fails", "detail": f"round trip to mlx-lm: {_short(exc)}"}
            if not row:
                row = {"class": "discrepancy", "detail": "; ".join(d[:240] for d in r4.discrepancies)} \
                    if r4.discrepancies else {"class": "pass", "detail": ""}
                if row["class"] == "pass" and lossy:
                    row = {"class": "pass-rounded", "detail": f"M holds w + 1 as mlx-lm's loader rounded it: "
                                                              f"{sorted(lossy)[:3]}"}
            row["detail"] = (row.get("detail") or "") + m_note
        rows.append({"model_type": mt, "direction": "mlx-lm->transformers", "notes": notes,
                     "seconds": round(time.perf_counter() - t0, 1), **row})

        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------ the table (parent)
def _child(mt: str, timeout: float) -> list[dict]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--row", mt], capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return [{"model_type": mt, "direction": "both", "class": "fails", "notes": [],
                 "detail": f"timeout after {timeout:.0f} s", "seconds": round(time.perf_counter() - t0, 1)}]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    tail = [s for s in (proc.stderr or "").strip().splitlines() if s.strip()][-1:] or ["(no output)"]
    return [{"model_type": mt, "direction": "both", "class": "fails", "notes": [],
             "detail": f"the row's process crashed (exit {proc.returncode}): {tail[0][:300]}",
             "seconds": round(time.perf_counter() - t0, 1)}]


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("transformers", "mlx-lm", "mlx", "torch", "keras-hub", "dense-bridge"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        dirs = ["transformers->mlx-lm", "mlx-lm->transformers"] if r["direction"] == "both" else [r["direction"]]
        for d in dirs:
            c = out.setdefault(d, {k: 0 for k in CLASSES})
            c[r["class"]] = c.get(r["class"], 0) + 1
    return out


def write_md(rows: list[dict], pairs: list[tuple[str, str]], path: str, wall: float, command: str,
             before: dict | None = None) -> None:
    c = counts(rows)
    lines = ["# Port coverage: every architecture transformers and mlx-lm share", "",
             "## Summary (for the README)", "",
             "| direction | " + " | ".join(CLASSES) + " | total |", "|---" * (len(CLASSES) + 2) + "|"]
    for d, k in c.items():
        lines.append(f"| {d} | " + " | ".join(str(k.get(x, 0)) for x in CLASSES) + f" | {sum(k.values())} |")
    if before:
        lines += ["", "Before this session's fixes (same harness):", "",
                  "| direction | " + " | ".join(CLASSES) + " |", "|---" * (len(CLASSES) + 1) + "|"]
        for d, k in before.items():
            lines.append(f"| {d} | " + " | ".join(str(k.get(x, 0)) for x in CLASSES) + " |")
    v = versions()
    overrides = sum(1 for mt, _ in pairs if OVERRIDES.get(mt))
    lines += ["", f"{len(pairs)} model types ({sum(1 for a, b in pairs if a == b)} under the same name, "
              f"{sum(1 for a, b in pairs if a != b)} through mlx-lm's MODEL_REMAPPING); "
              f"{overrides} with harness overrides of their default config.",
              "Libraries: " + ", ".join(f"{k} {x}" for k, x in v.items() if x), "",
              f"Command: `{command}` — wall time {wall / 60:.1f} min (2 shared CPU cores, one row at a time).", "",
              "Classes: **pass** every weight written bit-identical to the destination library's own loader on the "
              "same source, and the round trip bit-identical to the source; **pass-rounded** the same with "
              "tensors the certificate marks inexact (named); **discrepancy** the weights agree but the two "
              "libraries' own code computes differently (the port names where); **refused** the port raised, "
              "its reason shown; **fails** the first disagreeing weight, or an error that is not the port's; "
              "**no-reference** a library cannot build the tiny model or read the source itself.", "",
              "## Rows", "", "| model_type | mlx-lm module | direction | class | s | detail |", "|---|---|---|---|---|---|"]
    mod = dict(pairs)
    import _coverage_keras as ck  # the keras-hub rows: their own section
    for r in [r for r in rows if not ck.is_keras(r)]:
        detail = str(r.get("detail") or "").replace("|", "\\|").replace("\n", " ")
        notes = "; ".join(r.get("notes") or [])
        if notes:
            detail = f"[{notes}] {detail}"
        lines.append(f"| {r['model_type']} | {mod.get(r['model_type'], '')} | {r['direction']} | {r['class']} | "
                     f"{r.get('seconds', '')} | {detail[:600]} |")
    lines += ck.section([r for r in rows if ck.is_keras(r)], CLASSES)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


MLX_DIRS = ("transformers->mlx-lm", "mlx-lm->transformers")
TABLE_CLASSES = CLASSES + ("skipped",)


def merge(composite: dict, run: dict, at: str) -> dict:
    """``composite`` (the table as last measured per row, each row with the commit it ran at,
    ``at``) with every row of ``run`` (one run of this harness) put in place of the row of the
    same model type and direction, marked as measured at ``at``; a row of a whole model type
    (``"both"``: a timeout, a crash) stands for both of its directions. Returns a new dict."""
    new = {}
    for r in run["rows"]:
        for d in (MLX_DIRS if r["direction"] == "both" else (r["direction"],)):
            new[(r["model_type"], d)] = {**r, "direction": d, "at": at}
    rows = [r for r in composite["rows"] if (r["model_type"], r["direction"]) not in new] + list(new.values())
    rows.sort(key=lambda r: (r["model_type"], r["direction"]))
    return {**composite, "composite": True, "versions": run.get("versions", composite.get("versions")), "rows": rows}


def both_ways(rows: list[dict], ok=("pass", "pass-rounded")) -> list[str]:
    """The model types whose two transformers/mlx-lm rows are both of a class in ``ok``."""
    by: dict[str, dict] = {}
    for r in rows:
        if r["direction"] in MLX_DIRS:
            by.setdefault(r["model_type"], {})[r["direction"]] = r["class"]
    return sorted(t for t, c in by.items() if all(c.get(d) in ok for d in MLX_DIRS))


def write_composite_md(data: dict, path: str) -> None:
    """The composite table (:func:`merge`) as markdown: summary counts recomputed from the rows,
    per direction, the both-ways count, and every row with the commit it ran at."""
    rows = data["rows"]
    v = data.get("versions") or versions()
    counts_ = {}
    for r in rows:
        c = counts_.setdefault(r["direction"], {k: 0 for k in TABLE_CLASSES})
        c[r["class"]] = c.get(r["class"], 0) + 1
    order = list(MLX_DIRS) + sorted(d for d in counts_ if d not in MLX_DIRS)
    ats = {}
    for r in rows:
        ats[r.get("at", "?")] = ats.get(r.get("at", "?"), 0) + 1
    mlx_types = {r["model_type"] for r in rows if r["direction"] in MLX_DIRS}
    passing = both_ways(rows)
    lenient = both_ways(rows, ("pass", "pass-rounded", "discrepancy"))
    head = "| direction | " + " | ".join(TABLE_CLASSES) + " | rows |"
    rule = "|---" * (len(TABLE_CLASSES) + 2) + "|"
    lines = ["# Port coverage: every architecture transformers and mlx-lm share, and every text architecture "
             "keras-hub imports", "", "## Summary (for the README)", "",
             f"{len(mlx_types)} model types shared by transformers {v.get('transformers')} and mlx-lm "
             f"{v.get('mlx-lm')} are in the table (92 under the same name, 7 through mlx-lm's MODEL_REMAPPING), "
             "with the text architectures keras-hub's transformers importer accepts. One row per model type and "
             "direction, each in its own process: `python benchmarks/coverage.py --jobs 2` (`--only a,b` for some "
             "rows, `--no-keras` / `--keras-only`; `--merge RUN.json --at COMMIT` puts a run's rows into this "
             "table).", "",
             "**Not one run at one commit**: on this machine (2 CPU cores shared with other work) a row takes 10 s "
             "to 5 min, and the whole table does not fit in one session. Each row below is the last measurement of "
             "it, with the commit or branch it ran at (`at`): " + ", ".join(f"{a} ({n} rows)" for a, n in
                                                                          sorted(ats.items(), key=lambda x: -x[1]))
             + ".", "", head, rule]
    for d in order:
        k = counts_[d]
        lines.append(f"| {d} | " + " | ".join(str(k.get(x, 0)) for x in TABLE_CLASSES) + f" | {sum(k.values())} |")
    lines += ["", f"Both ways (transformers->mlx-lm and back): **{len(passing)} model types pass** (bit for bit, or "
              f"with the roundings the certificate states), {len(lenient)} pass or port with a library discrepancy "
              "the port states; the issue's target is 85 of the 92.", ""]
    start = data.get("session_start")
    if start:
        lines += [f"At the session's start ({start['at']}, same harness, {start['types']} types):", "", head, rule]
        for d, k in start["counts"].items():
            lines.append(f"| {d} | " + " | ".join(str(k.get(x, 0)) for x in TABLE_CLASSES) + f" | {sum(k.values())} |")
        lines.append("")
    lines += ["Libraries: " + ", ".join(f"{k} {x}" for k, x in v.items() if x and k != "dense-bridge")
              + " (pinned in the `test` extra).", "",
              "Classes: **pass** every weight written bit-identical to the destination library's own loader on the "
              "same source (transformers -> mlx-lm: mlx-lm's `load_model` on the transformers directory; mlx-lm -> "
              "transformers: `from_pretrained` of the original; -> keras-hub: keras-hub's own `from_preset` of the "
              "transformers directory), and the round trip bit-identical to the source; **pass-rounded** the same "
              "with tensors the certificate marks inexact; **discrepancy** the weights agree, the two libraries' own "
              "code computes differently (the port says where); **refused** the port raised, its reason shown; "
              "**fails** the first disagreeing weight, an error that is not the port's, or the row's timeout; "
              "**no-reference** a library cannot build the tiny model or read the source itself; **skipped** not a "
              "text model.", "",
              "Harness overrides of default configs that cannot run as they are (OVERRIDES in "
              "benchmarks/coverage.py, each shown in its row's notes): " + ", ".join(OVERRIDES) + ".", "",
              "## Rows", "", "| model_type | direction | class | at | s | detail |", "|---|---|---|---|---|---|"]
    for r in rows:
        detail = str(r.get("detail") or "").replace("|", "\\|").replace("\n", " ")
        notes = "; ".join(r.get("notes") or [])
        if notes:
            detail = f"{detail} [{notes}]".strip()
        lines.append(f"| {r['model_type']} | {r['direction']} | {r['class']} | {r.get('at', '')} | "
                     f"{r.get('seconds', '')} | {detail[:600]} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated model types (default: all shared)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per row")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "coverage.md"))
    ap.add_argument("--before", default=None, help="a coverage.json whose counts are shown as 'before'")
    ap.add_argument("--keras-only", action="store_true", help="only the keras-hub rows (_coverage_keras.py)")
    ap.add_argument("--no-keras", action="store_true", help="only the transformers/mlx-lm rows")
    ap.add_argument("--jobs", type=int, default=1, help="rows run at once (each in its own process)")
    ap.add_argument("--merge", default=None, metavar="RUN_JSON",
                    help="put the rows of RUN_JSON (a run's coverage.json) into the composite table at --out")
    ap.add_argument("--at", default=None, help="with --merge: the commit the run was made at")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.merge:
        if not args.at:
            ap.error("--merge needs --at COMMIT (the commit the run was made at)")
        json_path = os.path.splitext(args.out)[0] + ".json"
        with open(json_path) as f:
            composite = json.load(f)
        with open(args.merge) as f:
            run = json.load(f)
        data = merge(composite, run, args.at)
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
        write_composite_md(data, args.out)
        print(f"{len(run['rows'])} rows merged at {args.at}; both ways pass: {len(both_ways(data['rows']))}")
        return 0
    if args.row:
        sys.path.insert(0, ROOT)
        rows = run_row(args.row)
        print("ROWS " + json.dumps(rows))
        return 0
    pairs = model_types()
    if args.only:
        wanted = set(args.only.split(","))
        pairs = [p for p in pairs if p[0] in wanted]
    rows: list[dict] = []
    t0 = time.perf_counter()
    json_path = os.path.splitext(args.out)[0] + ".json"
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)["counts"]
    command = "python benchmarks/coverage.py" + (f" --only {args.only}" if args.only else "") \
        + (" --keras-only" if args.keras_only else "")
    from concurrent.futures import ThreadPoolExecutor

    todo = [] if args.keras_only else pairs
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # threads wait on child processes
        # results are taken in table order, so the table reads the same whatever the number of jobs
        for i, got in enumerate(pool.map(lambda pair: _child(pair[0], args.timeout), todo)):
            rows += got
            print(f"[{i + 1}/{len(pairs)}] {todo[i][0]}: " + ", ".join(f"{r['direction']} {r['class']}" for r in got),
                  flush=True)
            wall = time.perf_counter() - t0
            write_md(rows, pairs[:i + 1], args.out, wall, command, before)
            with open(json_path, "w") as f:
                json.dump({"versions": versions(), "wall_s": wall, "counts": counts(rows), "rows": rows}, f, indent=1)
    if args.no_keras:
        return 0
    import _coverage_keras as ck  # the keras-hub rows, written as they come

    def keras_rows(got, done=len(rows)):
        rows[done:] = got
        write_md(rows, [] if args.keras_only else pairs, args.out, time.perf_counter() - t0, command, before)
        with open(json_path, "w") as f:
            json.dump({"versions": versions(), "wall_s": time.perf_counter() - t0, "counts": counts(rows),
                       "rows": rows}, f, indent=1)
    ck.rows(args.timeout, args.only.split(",") if args.only else None, keras_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
