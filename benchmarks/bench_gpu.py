"""Moves and comparisons of models on a CUDA GPU against the device's own limits (issue 45).

Run where torch sees a CUDA device: ``python benchmarks/bench_gpu.py [--repeats 5] [--layers 8]`` (on a lent GPU
machine: ``benchmarks/gpu_session.sh``, the CUDA tests and this in one call).
Without one it prints "no CUDA: not measured" and exits 0, measuring nothing. In one run, each
number a median over ``--repeats`` rounds, every variant once per round:

1. ``db.transfer`` between two Llamas on the same GPU (>= 2 GB of float32 each) against
   ``load_state_dict`` of one into the other: copy throughput (GB/s, and the ratio; target >= 0.5)
   and the fixed cost per tensor on a 24-layer tiny Llama (planning, checks; target <= 2x
   ``load_state_dict``'s per tensor).
2. CUDA torch -> Flax and Equinox on the same GPU (8 x 4096^2 float32 Linear layers): ``db.convert``
   and ``db.transfer`` into an existing model, against DLPack plus a device transpose of each
   kernel (target >= 0.5).
3. ``db.get_params`` of the CUDA model against a device transpose plus one ``.cpu()`` per kernel
   (target >= 0.8).
4. ``db.testing.compare_models`` of a CUDA Llama pair against two forward and backward passes
   (target <= 3x); and with ``grads=False, judge="carried"`` (the check of ``transfer(mapping="auto")``
   and of the port) against two forward passes.

The table goes to stdout and to ``benchmarks/results/gpu.md`` (with the card's name). ``--cpu``
measures on the CPU (no GPU needed), transfer against ``load_state_dict``: the fixed cost per
tensor on a 24-layer tiny Llama, and the copy throughput between two Llamas of 1.13 GB of float32
each (``--cpu-layers 3``; the CPU's memory bandwidth bounds both, so their ratio means what it
means on a GPU; two models and no more: a transfer allocates nothing the size of a model).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "gpu.md"


def _median(fn, repeats: int, sync=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _medians(fns, repeats: int, sync=lambda: None) -> list[float]:
    """The median time of each of ``fns``, run in rounds (each once per round, in turn): on a shared
    machine a change of load then falls on all of them alike, and their ratio keeps its meaning."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _llama(transformers, torch, seed, device, layers, hidden, inter, vocab, heads=16, kv=16):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).eval()


def fixed_cost_rows(torch, transformers, db, device, repeats: int, sync) -> list[tuple[str, str, str, str]]:
    """The per-tensor cost of a transfer on a 24-layer tiny Llama (tensors of a few KB: planning
    and checks dominate) against load_state_dict's."""
    a = _llama(transformers, torch, 0, device, 24, 64, 128, 256, heads=4, kv=2)
    b = _llama(transformers, torch, 1, device, 24, 64, 128, 256, heads=4, kv=2)
    n = len(list(b.parameters()))
    db.transfer(a, b)  # first-use imports and caches
    t_tr, t_sd = _medians([lambda: db.transfer(a, b), lambda: b.load_state_dict(a.state_dict())], repeats, sync)
    return [(f"fixed cost per tensor, 24-layer tiny Llama ({n} tensors, {device})",
             f"{t_tr / n * 1e6:.0f} us ({t_tr * 1e3:.1f} ms)", f"{t_sd / n * 1e6:.0f} us ({t_sd * 1e3:.1f} ms)",
             f"{t_tr / t_sd:.2f}x (target <= 2x)")]


def throughput_row(torch, transformers, db, device, layers: int, big: dict, repeats: int, sync,
                   where: str) -> tuple[str, str, str, str]:
    """The copy throughput of a transfer between two Llamas on one device (``layers`` layers of
    ``big``'s widths, float32) against ``load_state_dict`` of one into the other: both bounded by
    the device's memory bandwidth (a transfer reads src once more, for its NaN/Inf test)."""
    a = _llama(transformers, torch, 0, device, layers, big["hidden"], big["inter"], big["vocab"])
    b = _llama(transformers, torch, 1, device, layers, big["hidden"], big["inter"], big["vocab"])
    nbytes = sum(p.numel() * p.element_size() for p in a.parameters())
    db.transfer(a, b)
    t_tr, t_sd = _medians([lambda: db.transfer(a, b), lambda: b.load_state_dict(a.state_dict())], repeats, sync)
    return (f"transfer, two Llamas {where} ({nbytes / 1e9:.2f} GB float32)",
            f"{t_tr * 1e3:.1f} ms, {nbytes / t_tr / 1e9:.1f} GB/s",
            f"load_state_dict {t_sd * 1e3:.1f} ms, {nbytes / t_sd / 1e9:.1f} GB/s",
            f"{t_sd / t_tr:.2f} (target >= 0.5)")


def _row(rows: list, row: tuple) -> None:
    """Keep ``row`` and print it at once: a run cut short still shows what it measured."""
    rows.append(row)
    print(" | ".join(row), flush=True)


def _table(rows, title: str) -> str:
    out = [f"## {title}", "", "| measurement | dense_bridge | device's own limit | ratio |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8, help="layers of the >= 2 GB Llama pair")
    ap.add_argument("--cpu", action="store_true",
                    help="only the CPU rows (no GPU needed): the fixed cost per tensor and the copy throughput")
    ap.add_argument("--cpu-layers", type=int, default=3,
                    help="layers of the CPU throughput pair (3: 1.13 GB of float32 each; 0: no throughput row)")
    ap.add_argument("--smoke", action="store_true",
                    help="every step on small models on the CPU, to check the script runs (numbers meaningless)")
    args = ap.parse_args(argv)
    import torch

    import dense_bridge as db

    transformers = __import__("transformers")
    if args.cpu:
        rows = fixed_cost_rows(torch, transformers, db, "cpu", args.repeats, lambda: None)
        if args.cpu_layers:  # >= 1 GB of float32 per model: 3 layers of the GPU pair's widths, 1.13 GB
            cpu_big = dict(hidden=2048, inter=5504, vocab=32000)
            rows.append(throughput_row(torch, transformers, db, "cpu", args.cpu_layers, cpu_big, args.repeats,
                                       lambda: None, "on the CPU"))
        print(_table(rows, f"CPU, torch {torch.__version__}"))
        return 0
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA: not measured (torch sees no CUDA device; benchmarks/bench_gpu.py measures only on a GPU)")
        return 0
    dev = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    sync = (lambda: None) if args.smoke else torch.cuda.synchronize
    card = "smoke run on the CPU" if args.smoke else torch.cuda.get_device_name(dev)
    big = dict(hidden=256, inter=512, vocab=1000, width=256) if args.smoke else dict(hidden=2048, inter=5504, vocab=32000,
                                                                                      width=4096)
    rows: list = []

    # 1. two same-device Llamas, >= 2 GB of float32 each
    _row(rows, throughput_row(torch, transformers, db, dev, args.layers, big, args.repeats, sync, "on the GPU"))
    if not args.smoke:
        torch.cuda.empty_cache()
    for row in fixed_cost_rows(torch, transformers, db, dev, args.repeats, sync):
        _row(rows, row)

    # 2./3. 8 x 4096^2 float32 on the GPU: into Flax/Equinox, and get_params
    m = torch.nn.Sequential(*[torch.nn.Linear(big["width"], big["width"]) for _ in range(8)]).to(dev)
    kernels = [layer.weight for layer in m]
    try:
        import jax
        import jax.numpy as jnp

        gpus = jax.devices() if args.smoke else [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    except ImportError:
        gpus = []
    if gpus:
        def dlpack_transpose():
            out = [jnp.array(jax.dlpack.from_dlpack(w.detach()).T) for w in kernels]
            jax.block_until_ready(out)
        t_ref = _median(dlpack_transpose, args.repeats, sync)
        for target in ("flax", "equinox"):
            if target not in db.available_backends():
                continue
            def ready(model):  # JAX dispatches asynchronously: wait for every array of the model
                if target == "flax":
                    from flax import nnx

                    model = nnx.state(model)
                jax.block_until_ready([x for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.Array)])

            out = db.convert(m, target)
            t_cv = _median(lambda: ready(db.convert(m, target)), args.repeats, sync)
            t_tf = _median(lambda: (db.transfer(m, out), ready(out)), args.repeats, sync)
            _row(rows, (f"convert CUDA torch -> {target}, same GPU (8 x 4096^2 float32)", f"{t_cv * 1e3:.1f} ms",
                         f"DLPack + device transpose {t_ref * 1e3:.1f} ms", f"{t_ref / t_cv:.2f} (target >= 0.5)"))
            _row(rows, (f"transfer CUDA torch -> existing {target} model, same GPU", f"{t_tf * 1e3:.1f} ms",
                         f"DLPack + device transpose {t_ref * 1e3:.1f} ms", f"{t_ref / t_tf:.2f} (target >= 0.5)"))
    else:
        _row(rows, ("CUDA torch -> Flax/Equinox", "not measured: JAX sees no GPU here", "", ""))
    t_gp = _median(lambda: db.get_params(m), args.repeats, sync)
    t_host = _median(lambda: [w.detach().t().contiguous().cpu() for w in kernels], args.repeats, sync)
    _row(rows, ("get_params of the CUDA model (8 x 4096^2 float32)", f"{t_gp * 1e3:.1f} ms",
                 f"device transpose + one .cpu() {t_host * 1e3:.1f} ms", f"{t_host / t_gp:.2f} (target >= 0.8)"))
    del m, kernels

    # 4. compare_models of a CUDA Llama pair against two forward + backward passes
    a = _llama(transformers, torch, 0, dev, 4, big["hidden"] // 2, big["inter"] // 2, big["vocab"])
    b = _llama(transformers, torch, 0, dev, 4, big["hidden"] // 2, big["inter"] // 2, big["vocab"])
    ids = np.random.default_rng(0).integers(0, big["vocab"], (2, 128))
    tids = torch.as_tensor(ids, device=dev)

    def passes():
        for model in (a, b):
            out = model(tids).logits
            out.backward(torch.ones_like(out))
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
    def forwards():
        with torch.no_grad():
            for model in (a, b):
                model(tids)
    passes()
    db.testing.compare_models(a, b, [ids])
    t_cm = _median(lambda: db.testing.compare_models(a, b, [ids]), args.repeats, sync)
    t_fb = _median(passes, args.repeats, sync)
    _row(rows, ("compare_models, CUDA Llama pair (4 layers, 1024 wide, 2 x 128 tokens)", f"{t_cm * 1e3:.1f} ms",
                 f"two forward + backward {t_fb * 1e3:.1f} ms", f"{t_cm / t_fb:.2f}x (target <= 3x)"))
    # what transfer(mapping="auto") and the port verify with: outputs only, each value judged as carried
    carried = lambda: db.testing.compare_models(a, b, [ids], grads=False, judge="carried")  # noqa: E731
    carried()
    t_cc = _median(carried, args.repeats, sync)
    t_f = _median(forwards, args.repeats, sync)
    _row(rows, ("compare_models(grads=False, judge='carried'), the same pair", f"{t_cc * 1e3:.1f} ms",
                 f"two forward passes {t_f * 1e3:.1f} ms", f"{t_cc / t_f:.2f}x"))

    text = _table(rows, f"{card}, torch {torch.__version__}")
    print(text)
    if args.smoke:
        return 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("# benchmarks/bench_gpu.py\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
