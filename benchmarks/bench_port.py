"""db.port on a large directory (issue 46): a sharded float32 transformers Llama of >= 2 GB made in
a temporary folder, ported to mlx-lm; peak memory, and throughput against ``cp`` and ``mlx_lm.convert``.

- Memory: the port runs in a child process that first imports everything and ports a tiny model
  (twins, verification and all code paths warmed), then resets its peak-RSS mark (VmHWM, Linux
  ``clear_refs`` 5) and ports the large directory with ``verify="twins"``. The growth of VmHWM
  over the RSS at that point is compared with the bound: the largest tensor group (one destination
  tensor and its sources) + 256 MB. An address-space limit cannot be used: mapped files count.
- Throughput: the same bytes copied by ``cp -r`` (target: port / cp >= 0.7 in speed) and converted
  by ``mlx_lm.convert`` on the same directory (target: faster), each in a fresh process, the source
  pages warm for all three (each run reads the directory first).

- GGUF (``--to gguf``): the same directory (with a SentencePiece tokenizer, which llama.cpp needs)
  ported to one GGUF file (``--outtype``, f32 by default), peak memory measured the same way, and
  throughput against llama.cpp's own ``convert_hf_to_gguf.py`` (``DENSE_BRIDGE_LLAMA_CPP`` names its
  source tree) writing the same outtype; ``--runs`` fresh processes each, medians reported.

Run:  python benchmarks/bench_port.py [--gb 2.0] [--dir /tmp] [--skip-convert] [--to gguf --runs 3]
Writes benchmarks/results/port.md (--out); ``--to gguf`` writes its "## GGUF" section only.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {here!r})
from _memory import reset_peak, status_bytes
import dense_bridge as db
import transformers, {warm_import}  # imports counted before the mark
db.port({tiny!r}, {tiny_out!r}, to={to!r}, verify="twins", progress=False, **{kw!r})  # warm every code path
base = status_bytes("VmRSS")
reset_peak()
t = time.perf_counter()
report = db.port({src!r}, {out!r}, to={to!r}, verify="twins", progress=False, **{kw!r})
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds, "base_rss": base, "peak": status_bytes("VmHWM"), "bytes": report.bytes,
                  "tensors": report.tensors}}))
"""


def make_source(path: str, gb: float, shards: int) -> dict:
    """A Llama-shaped float32 transformers directory of about ``gb`` GB (config by transformers,
    tensors random, ``shards`` files with an index); returns its tensor sizes."""
    import transformers
    from safetensors.numpy import save_file

    hidden, inter, heads, kv, vocab = 2048, 5632, 32, 8, 32000
    per_layer = 4 * (2 * hidden * hidden + 2 * hidden * (hidden * kv // heads) + 3 * hidden * inter + 2 * hidden)
    layers = max(1, int((gb * 1e9 - 4 * 2 * vocab * hidden) // per_layer) + 1)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False)
    os.makedirs(path)
    cfg.architectures = ["LlamaForCausalLM"]  # as save_pretrained of the model writes it (converters read it)
    cfg.save_pretrained(path)
    with __import__("torch").device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    rng = np.random.default_rng(0)
    names = list(shapes)
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    per_shard, groups, size = total / shards, [[]], 0
    for n in names:
        b = 4 * int(np.prod(shapes[n]))
        if size and size + b > per_shard and len(groups) < shards:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += b
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (rng.standard_normal(shapes[n], dtype=np.float32) * 0.02) for n in group}
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    _tokenizer(path, vocab)  # mlx_lm.convert loads a tokenizer; db.port carries its files
    return {"bytes": total, "largest": max(4 * int(np.prod(s)) for s in shapes.values()), "layers": layers,
            "shards": len(groups)}


def _tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer of ``vocab`` entries built offline (tokenizers), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["<unk>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def _spm_tokenizer(path: str) -> None:
    """A SentencePiece tokenizer trained offline on a few sentences (llama.cpp's "llama" vocabulary;
    both writers pad it to the config's vocab_size)."""
    import io

    import sentencepiece as spm

    text = ["The quick brown fox jumps over the lazy dog.", "A port moves every tensor exactly.",
            "llama.cpp runs GGUF files on laptops.", "Numbers 123 456 and symbols !?"] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=320, model_type="bpe",
                                   character_coverage=1.0, byte_fallback=True, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, minloglevel=2)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(buf.getvalue())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>"}, f)


def warm(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(16 << 20):
                pass


def timed(cmd: list[str], env=None) -> tuple[float, str]:
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"{cmd[:4]} failed: {out.stderr[-2000:]}")
    return seconds, out.stdout


def _port_child(to: str, kw: dict, tiny: str, work: str, src: str, out: str, env) -> tuple[dict, float]:
    code = CHILD.format(here=HERE, tiny=tiny, tiny_out=os.path.join(work, "tiny-out" + (".gguf" if to == "gguf" else "")),
                        src=src, out=out, to=to, kw=kw,
                        warm_import="gguf" if to == "gguf" else "mlx_lm.utils")
    for p in (os.path.join(work, "tiny-out"), os.path.join(work, "tiny-out.gguf")):
        _remove(p)
        _remove(p + ".port_certificate.json")
    wall, stdout = timed([sys.executable, "-c", code], env)
    return json.loads(stdout.strip().splitlines()[-1]), wall


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _section(path: str, title: str, text: str) -> None:
    """``text`` as the section ``title`` of the markdown file ``path`` (replaced where present)."""
    old = open(path).read() if os.path.isfile(path) else ""
    head, sep, rest = old.partition(title + "\n")
    if sep:
        nxt = rest.find("\n## ")
        old = head + (rest[nxt + 1:] if nxt >= 0 else "")
    with open(path, "w") as f:
        f.write(old.rstrip("\n") + "\n\n" + text if old.strip() else text)


def main_gguf(args, env, work: str, src: str, facts: dict, made: float, tiny: str) -> None:
    """``--to gguf``: db.port and llama.cpp's converter, ``args.runs`` fresh processes each."""
    import statistics

    sys.path.insert(0, ROOT)
    from dense_bridge.backends.gguf._tokenizer import llama_cpp_dir

    _spm_tokenizer(src)
    _spm_tokenizer(tiny)
    out = os.path.join(work, "out.gguf")
    ports, walls, growths = [], [], []
    for _ in range(args.runs):
        _remove(out)
        _remove(out + ".port_certificate.json")
        warm(src)
        child, wall = _port_child("gguf", {"outtype": args.outtype}, tiny, work, src, out, env)
        ports.append(child["seconds"])
        walls.append(wall)
        growths.append(child["peak"] - child["base_rss"])
        print(f"port {child['seconds']:.2f} s (wall {wall:.2f} s); growth {growths[-1] / 1e6:.0f} MB", flush=True)
    size = os.path.getsize(out)
    _remove(out)
    _remove(out + ".port_certificate.json")
    convs = []
    root = llama_cpp_dir()
    if not args.skip_convert and root:
        cenv = dict(env, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(root, "gguf-py"))
        for _ in range(args.runs):
            _remove(os.path.join(work, "conv.gguf"))
            warm(src)
            seconds, _ = timed([sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), src, "--outfile",
                                os.path.join(work, "conv.gguf"), "--outtype", args.outtype], cenv)
            convs.append(seconds)
            print(f"convert_hf_to_gguf.py {seconds:.2f} s", flush=True)
        _remove(os.path.join(work, "conv.gguf"))
    gbytes = facts["bytes"] / 1e9
    med = statistics.median
    bound = facts["largest"] + (256 << 20)
    growth = max(growths)
    lines = [
        "## GGUF", "",
        f"Source: the float32 transformers Llama above ({facts['layers']} layers, {facts['shards']} shards, "
        f"{facts['bytes']:,} bytes, made in {made:.0f} s) with a SentencePiece tokenizer. Destination: one GGUF "
        f"file, outtype {args.outtype} ({size:,} bytes), verify='twins'. Medians of {args.runs} fresh processes "
        f"each; machine: {os.cpu_count()} CPUs shared with other work, the source pages warm before each run.", "",
        "| run | seconds (median) | runs | GB/s |", "|---|---:|---|---:|",
        f"| db.port (in-process: twins + stream + hashes + fsync) | {med(ports):.2f} | "
        f"{', '.join(f'{x:.1f}' for x in ports)} | {gbytes / med(ports):.2f} |",
        f"| db.port (child process wall, imports and warm-up included) | {med(walls):.2f} | "
        f"{', '.join(f'{x:.1f}' for x in walls)} | {gbytes / med(walls):.2f} |",
    ]
    if convs:
        lines.append(f"| python convert_hf_to_gguf.py --outtype {args.outtype} (llama.cpp) | {med(convs):.2f} | "
                     f"{', '.join(f'{x:.1f}' for x in convs)} | {gbytes / med(convs):.2f} |")
        lines += ["", f"- db.port (wall) vs convert_hf_to_gguf.py: {med(convs) / med(walls):.2f}x as fast"]
    lines += ["", f"- peak RSS growth (VmHWM after the mark - VmRSS at it; largest of the runs): {growth / 1e6:.0f} MB; "
              f"bound: largest tensor group {facts['largest'] / 1e6:.0f} MB + 256 MB = {bound / 1e6:.0f} MB: "
              f"{'within' if growth <= bound else 'OVER'}"]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    _section(args.out, "## GGUF", text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--skip-convert", action="store_true", help="do not time mlx_lm.convert / convert_hf_to_gguf.py")
    ap.add_argument("--to", choices=("mlx-lm", "gguf"), default="mlx-lm")
    ap.add_argument("--outtype", default="f32", help="GGUF outtype (--to gguf)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each (--to gguf)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "port.md"))
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    work = tempfile.mkdtemp(prefix="bench-port-", dir=args.dir)
    try:
        src = os.path.join(work, "src")
        t = time.perf_counter()
        facts = make_source(src, args.gb, args.shards)
        made = time.perf_counter() - t
        tiny = os.path.join(work, "tiny")
        import transformers

        tcfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)
        transformers.LlamaForCausalLM(tcfg).save_pretrained(tiny)
        if args.to == "gguf":
            return main_gguf(args, env, work, src, facts, made, tiny)

        warm(src)
        cp_s, _ = timed(["cp", "-r", src, os.path.join(work, "cp")])
        shutil.rmtree(os.path.join(work, "cp"))

        warm(src)
        child, wall = _port_child("mlx-lm", {}, tiny, work, src, os.path.join(work, "out"), env)
        growth = child["peak"] - child["base_rss"]
        print(f"cp {cp_s:.2f} s; port {child['seconds']:.2f} s (wall {wall:.2f} s); growth {growth / 1e6:.0f} MB",
              flush=True)
        # every destination tensor of this port is a copy of one source tensor: its group is that tensor
        bound = facts["largest"] + (256 << 20)

        conv_s = None
        if not args.skip_convert:
            warm(src)
            conv_s, _ = timed([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", src, "--mlx-path",
                               os.path.join(work, "conv")], env)

        gbytes = facts["bytes"] / 1e9
        lines = [
            "# db.port on a large directory (benchmarks/bench_port.py)", "",
            f"Source: float32 transformers Llama, {facts['layers']} layers, {facts['shards']} shards, "
            f"{facts['bytes']:,} bytes (made in {made:.0f} s). Destination: mlx-lm, verify='twins'. "
            f"Machine: {os.cpu_count()} CPUs; the source pages warm before each run.", "",
            "| run | seconds | GB/s |", "|---|---:|---:|",
            f"| cp -r (same bytes) | {cp_s:.2f} | {gbytes / cp_s:.2f} |",
            f"| db.port (in-process, twins + stream + hashes + fsync) | {child['seconds']:.2f} | "
            f"{gbytes / child['seconds']:.2f} |",
            f"| db.port (child process wall, imports and warm-up included) | {wall:.2f} | {gbytes / wall:.2f} |",
        ]
        if conv_s is not None:
            lines.append(f"| python -m mlx_lm convert | {conv_s:.2f} | {gbytes / conv_s:.2f} |")
        lines += ["", f"- port / cp speed: {cp_s / child['seconds']:.2f} (target >= 0.7)"]
        if conv_s is not None:
            lines.append(f"- port vs mlx_lm.convert: {conv_s / child['seconds']:.2f}x as fast (target > 1)")
        lines += [f"- peak RSS growth (VmHWM after the mark - VmRSS at it): {growth / 1e6:.0f} MB; bound: largest "
                  f"tensor group {facts['largest'] / 1e6:.0f} MB + 256 MB = {bound / 1e6:.0f} MB: "
                  f"{'within' if growth <= bound else 'OVER'}"]
        text = "\n".join(lines) + "\n"
        print(text)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        kept = open(args.out).read() if os.path.isfile(args.out) else ""
        kept = kept[kept.index("## GGUF"):] if "## GGUF" in kept else ""  # written by --to gguf
        with open(args.out, "w") as f:
            f.write(text + ("\n" + kept if kept else ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
