"""What mapping="auto" costs: transfer(mapping="auto", inputs=..., verify=True) against warm forward
passes of both models plus the explicit transfer (the inferred rules given as mapping=).

The bound it checks: auto = one recording forward of each model (inference) + one forward of each
(verification) + the transfer itself, so at most 3 warm forward passes of each model plus the
transfer. Per pair (tiny random configs, no downloads) it prints the medians of --repeats
interleaved runs, the ratio auto / (3 x (forward src + forward dst) + explicit transfer), and the
number of forward passes src made during one auto transfer (a forward hook on its root module).

Run:  python benchmarks/bench_auto_mapping.py [--repeats 5] [--pairs gpt2-mlx,llama-mlx,gpt2-keras]
                                             [--width 64] [--seq 16]
At tiny widths the fixed costs (walks, hooks, copying each call's arrays to numpy, the float64
judging) outweigh the forward passes; the count of forward passes is the size-free measure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import dense_bridge as db  # noqa: E402
from _timing import fmt_time, table  # noqa: E402

V, H, HEADS, KV, FF, LAYERS, POS = 64, 64, 4, 2, 128, 2, 32
IDS = np.random.default_rng(0).integers(0, V, (2, 16))


def _gpt2_torch(transformers):
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_ctx=POS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval(), cfg


def _pair(name: str):
    """(src, make_dst, inputs, forward_src, forward_dst) for one named pair."""
    import torch
    import transformers

    if name == "gpt2-mlx":
        import mlx.core as mx
        from mlx_lm.models import gpt2

        src, _ = _gpt2_torch(transformers)
        args = gpt2.ModelArgs(model_type="gpt2", n_ctx=POS, n_embd=H, n_head=HEADS, n_layer=LAYERS, n_positions=POS,
                              layer_norm_epsilon=1e-5, vocab_size=V)
        make = lambda: gpt2.Model(args)  # noqa: E731
        fwd_dst = lambda m: mx.eval(m(mx.array(IDS)))  # noqa: E731
        inputs = [IDS]
    elif name == "llama-mlx":
        import mlx.core as mx
        from mlx_lm.models import llama

        kw = dict(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=POS, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, pad_token_id=None)
        src = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
        args = llama.ModelArgs(model_type="llama", hidden_size=H, num_hidden_layers=LAYERS, intermediate_size=FF,
                               num_attention_heads=HEADS, num_key_value_heads=KV, rms_norm_eps=1e-5, vocab_size=V,
                               tie_word_embeddings=False)
        make = lambda: llama.Model(args)  # noqa: E731
        fwd_dst = lambda m: mx.eval(m(mx.array(IDS)))  # noqa: E731
        inputs = [IDS]
    elif name == "gpt2-keras":
        import keras_hub

        cfg = transformers.GPT2Config(vocab_size=V, n_positions=POS, n_embd=H, n_layer=LAYERS, n_head=HEADS,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        src = transformers.GPT2Model(cfg).eval()
        make = lambda: keras_hub.models.GPT2Backbone(  # noqa: E731
            vocabulary_size=V, num_layers=LAYERS, num_heads=HEADS, hidden_dim=H, intermediate_dim=4 * H,
            max_sequence_length=POS, dropout=0.0)
        keras_in = {"token_ids": IDS, "padding_mask": np.ones_like(IDS)}
        fwd_dst = lambda m: np.asarray(m(keras_in, training=False))  # noqa: E731
        inputs = ([IDS], keras_in)
    else:
        raise SystemExit(f"unknown pair {name!r}")

    def fwd_src(m):
        with torch.no_grad():
            m(torch.tensor(IDS))
    return src, make, inputs, fwd_src, fwd_dst


def _median(fn, repeats: int) -> float:
    fn()  # warm
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", default="gpt2-mlx,llama-mlx,gpt2-keras")
    parser.add_argument("--width", type=int, default=64, help="hidden size (the MLP is twice as wide)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (batch 2)")
    args = parser.parse_args()
    global H, FF, POS, IDS
    H, FF, POS = args.width, 2 * args.width, max(POS, args.seq)
    IDS = np.random.default_rng(0).integers(0, V, (2, args.seq))
    rows = []
    for name in args.pairs.split(","):
        src, make, inputs, fwd_src, fwd_dst = _pair(name)
        dst = make()
        rules = db.transfer(src, dst, mapping="auto", inputs=inputs).rules
        count = [0]
        handle = src.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        db.transfer(src, make(), mapping="auto", inputs=inputs)
        handle.remove()
        t_src = _median(lambda: fwd_src(src), args.repeats)
        t_dst = _median(lambda: fwd_dst(dst), args.repeats)
        t_rules = _median(lambda: db.transfer(src, dst, mapping=rules), args.repeats)
        t_auto = _median(lambda: db.transfer(src, dst, mapping="auto", inputs=inputs), args.repeats)
        bound = 3 * (t_src + t_dst) + t_rules
        rows.append([name, fmt_time(t_src), fmt_time(t_dst), fmt_time(t_rules), fmt_time(t_auto),
                     f"{t_auto / bound:.2f}", str(count[0])])
    print(table(rows, ["pair", "forward src", "forward dst", "transfer (rules)", "transfer (auto)",
                       "auto / (3 fwd each + transfer)", "src forwards per auto"]))


if __name__ == "__main__":
    main()
