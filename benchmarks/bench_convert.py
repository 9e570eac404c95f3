"""db.convert speed: an 8-layer 4096x4096 float32 MLP (537 MB) between every ordered pair.

For each ordered pair of installed backends (torch, keras, mlx, flax, equinox) it measures, in one run and
round-robin so that load on the machine hits every variant alike (median of --repeats runs):

  convert     db.convert(model, to=target): GB/s = parameter bytes / seconds
  limits      the same bytes made in the target's layout in NEW memory (what any conversion must
              create), the fastest way known on this machine:
                1-thread: same layout np.copy; transposing the best of torch's
                  torch.empty().copy_(W.t()), np.ascontiguousarray(W.T) and dense_bridge's
                  cache-blocked transpose
                all-core: dense_bridge's kernels split over every core, or (transposing)
                  torch's copy_ with its intra-op threads on every core, whichever is faster
              (into MLX also: a plain copy into malloc'ed memory, what mx.array gets)
  prealloc    the pair's copy into memory allocated and touched before timing: for scale only
  naive       the port a user writes by hand into an already built target model
              (set_weights / load_weights / lin.weight.data = torch.tensor(...) / load_state_dict)
  peak extra  the RSS high-water mark during convert, beyond the memory held before it and
              the output model's parameters, in a fresh subprocess per pair (VmHWM reset
              through /proc/self/clear_refs); one layer's worth is width*(width+1)*4 bytes

Every sample starts from the same state of free memory (--pages, see settle_pages): on this
Firecracker VM a page freed long enough ago has been handed back to the host and costs 5-10x
more to touch again, which made which variant met which pages chance.

Prints a markdown table and writes it, with the command and the machine load, to
benchmarks/results/convert.md (--out). MLX's Linux CPU build is slow only at matmul, not at
copies, so the full size is fine for every backend.

--plain times what a user sees instead: every variant called in a plain loop (no page preparation),
convert against the user's own port (into MLX: a new nn.Sequential of nn.Linear and load_weights of
mx.array copies), against the all-core limit, and with allow_nonfinite=True (the NaN/Inf scan's
share), over --runs separate runs; written to benchmarks/results/convert_plain.md.

Run:  python benchmarks/bench_convert.py [--layers 8] [--width 4096] [--repeats 7]
                                         [--frameworks torch,keras,mlx,flax,equinox] [--no-memory]
                                         [--pages warm|cold|as-is]
                                         [--keras-backend tensorflow|jax|torch]
      python benchmarks/bench_convert.py --plain [--runs 3] [--layers 6 --width 2048]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import dense_bridge as db  # noqa: E402
from _memory import reset_peak, status_bytes  # noqa: E402
from _timing import table  # noqa: E402

FRAMEWORKS = ("torch", "keras", "mlx", "flax", "equinox")
# torch, MLX and Equinox store Dense weights (out, in); Keras and Flax store the canonical (in, out)
_LAYOUT = {"torch": "out_in", "mlx": "out_in", "keras": "in_out", "flax": "in_out", "equinox": "out_in"}
TARGET_RATIO = 0.8

# Why a pair stays under the limit on its best supported path, keyed by target: the target's
# allocation decides (the source side is always a zero-copy view). The limits copy and nothing
# else; a conversion must also scan every value for NaN/Inf (API.md: convert raises on them) and
# build the target's objects.
_CHECK = ("the NaN/Inf scan the API requires, fused into the copy (each 1 MiB of source rows summed while "
          "in cache), adds 20-30% to a 2-thread transposing copy (prealloc, 8 x 4096^2: 82-99 ms without, "
          "109-125 ms with; a separate pass after the copy measured no better)")
_GAP_REASONS = {
    "mlx": "MLX allocates and fills every new array itself (mx.array copies; mx.from_dlpack refuses a "
           "zero-copy CPU import: 'Cannot import a CPU array without a copy'): one thread, holding the GIL, "
           "into malloc'd 4 KiB pages, with no API to hand it huge-page memory or to copy on more cores: "
           "the plain malloc copy column is its limit",
    "torch": f"{_CHECK}; torch adopts the filled buffers (torch.from_numpy) at no cost",
    "flax": f"JAX makes every array itself (jnp.asarray copies a numpy buffer into XLA's own allocation); {_CHECK}",
    "equinox": f"JAX makes every array itself (jnp.asarray copies a numpy buffer into XLA's own allocation); {_CHECK}",
    "keras": f"{_CHECK}; building the Keras layers and TF variables (which adopt the buffers through DLPack) "
             "takes the 'target's own work' column of the table above, about what plain keras.layers.Dense "
             "built around adopted buffers costs ('native build')",
}


# ------------------------------------------------------------------ models
def model_spec(layers: int, width: int):
    return db.Sequential([db.Dense(width) for _ in range(layers)], in_features=width)


def random_params(layers: int, width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Canonical float32 params, drawn fast (float32 normals, no float64 detour)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(layers):
        out[f"{i}.kernel"] = rng.standard_normal((width, width), dtype=np.float32) * np.float32(0.01)
        out[f"{i}.bias"] = rng.standard_normal(width, dtype=np.float32)
    return out


def build(framework: str, layers: int, width: int, seed: int = 0):
    """The model as a user of ``framework`` has it: native layers, weights in native layout."""
    params = random_params(layers, width, seed)
    if framework != "mlx":
        return db.compile(model_spec(layers, width), framework, params=params)
    import mlx.core as mx
    import mlx.nn as nn

    # by hand, not db.compile: mx.array keeps a transposed view's strides, so a compiled model's
    # weights would be column-major in memory; a user's nn.Linear weights are row-major
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model.load_weights([(f"layers.{i}.{name}", mx.array(np.ascontiguousarray(
        params[f"{i}.kernel"].T if name == "weight" else params[f"{i}.bias"])))
        for i in range(layers) for name in ("weight", "bias")])
    mx.eval(model.parameters())
    return model


def param_bytes(layers: int, width: int) -> int:
    return layers * (width * width + width) * 4


# ------------------------------------------------------------------ native weight access
def native_weights(model, framework: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(weight, bias) per layer as zero-copy numpy views in the framework's own layout."""
    if framework == "torch":
        return [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in model]
    if framework == "mlx":
        return [(np.asarray(m.weight), np.asarray(m.bias)) for m in model.layers]
    if framework == "flax":
        return [(np.asarray(l.kernel[...]), np.asarray(l.bias[...])) for l in model.layers]
    if framework == "equinox":
        return [(np.asarray(l.weight), np.asarray(l.bias)) for l in model.layers]
    import keras

    if keras.backend.backend() != "tensorflow":  # Keras on JAX/torch: the adapter's own numpy read
        from dense_bridge.backends.keras import to_numpy

        return [(to_numpy(l.kernel), to_numpy(l.bias)) for l in model.layers]
    import tensorflow as tf

    return [(np.asarray(tf.convert_to_tensor(l.kernel.value)), np.asarray(tf.convert_to_tensor(l.bias.value)))
            for l in model.layers]


# ------------------------------------------------------------------ limits
def memcpy_limit(weights, fresh: bool) -> Callable[[], object]:
    """np.copyto of every weight and bias: into preallocated memory, or into new memory."""
    srcs = [a for pair in weights for a in pair]
    if fresh:
        return lambda: [np.copy(s) for s in srcs]
    dsts = [np.ones_like(s) for s in srcs]  # touched: every page is mapped before timing

    def run():
        for d, s in zip(dsts, srcs):
            np.copyto(d, s)
    return run


def transpose_limit(weights, fresh: bool) -> Callable[[], object]:
    """torch's transposing copy out.copy_(W.t()) of every weight (biases copied plainly)."""
    import torch

    with warnings.catch_warnings():  # read-only views of the source: only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        srcs = [(torch.from_numpy(w), torch.from_numpy(b)) for w, b in weights]
    if fresh:
        return lambda: [(torch.empty(w.t().shape).copy_(w.t()), torch.empty_like(b).copy_(b)) for w, b in srcs]
    outs = [(torch.ones(w.t().shape), torch.ones_like(b)) for w, b in srcs]

    def run():
        for (ow, ob), (w, b) in zip(outs, srcs):
            ow.copy_(w.t())
            ob.copy_(b)
    return run


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _threaded_copy_jobs(out: np.ndarray, a: np.ndarray, transposing: bool, pieces: int) -> list[Callable[[], object]]:
    """out = a.T (transposing, with dense_bridge's transpose: the C kernel's AVX2 blocks where
    built, else numpy's cache-blocked tiles) or out = a, split into ``pieces`` column strips /
    flat chunks for a thread pool."""
    from dense_bridge.params import _copy as _transfer

    if transposing and a.ndim == 2:  # dense_bridge's fastest transpose here: the C kernel's where built
        step = -(-a.shape[1] // pieces)
        return [lambda j=j: _transfer._transpose_rows(out, a, j, min(step, a.shape[1] - j), False)
                for j in range(0, a.shape[1], step)]
    fo, fa = out.reshape(-1), a.reshape(-1)
    step = -(-fa.size // pieces)
    return [lambda j=j: np.copyto(fo[j:j + step], fa[j:j + step]) for j in range(0, fa.size, step)]


def fresh_limits(weights, transposing: bool) -> dict[str, Callable[[], object]]:
    """Every known way to make the same bytes in the target's layout in NEW memory, one thread
    each: the fastest of them (taken after the run) is the single-thread limit. Same layout: a
    plain copy (numpy asks for transparent huge pages). Transposing: torch's
    ``torch.empty(...).copy_(W.t())``, numpy's ``np.ascontiguousarray(W.T)`` and dense_bridge's
    cache-blocked transpose into ``np.empty``."""
    from dense_bridge.params import _copy as _transfer

    srcs = [a for pair in weights for a in pair]
    if not transposing:
        return {"fresh:np.copy": lambda: [np.copy(a) for a in srcs]}
    import torch

    with warnings.catch_warnings():  # read-only views of the source: only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tsrcs = [torch.from_numpy(a) for a in srcs]

    def blocked():
        out = []
        for a in srcs:
            if a.ndim == 2:
                o = np.empty(a.T.shape, a.dtype)
                _transfer._transpose_rows(o, a, 0, a.shape[1], False)
            else:
                o = np.copy(a)
            out.append(o)
        return out
    return {
        "fresh:torch copy_": lambda: [torch.empty(t.t().shape if t.ndim == 2 else t.shape, dtype=t.dtype).copy_(
            t.t() if t.ndim == 2 else t) for t in tsrcs],
        "fresh:np.ascontiguousarray": lambda: [np.ascontiguousarray(a.T) for a in srcs],
        "fresh:blocked transpose": blocked,
    }


def fresh_threaded_limit(weights, transposing: bool) -> Callable[[], object]:
    """The all-core limit: new memory for every array, filled on every core with dense_bridge's
    kernels (column strips of the cache-blocked transpose, or flat chunks of a plain copy)."""
    from concurrent.futures import ThreadPoolExecutor

    cores = _cores()
    pool = ThreadPoolExecutor(cores)
    srcs = [a for pair in weights for a in pair]

    def run():
        outs, jobs = [], []
        for a in srcs:
            out = np.empty(a.T.shape if transposing and a.ndim == 2 else a.shape, a.dtype)
            outs.append(out)
            jobs += _threaded_copy_jobs(out, a, transposing, cores)
        list(pool.map(lambda job: job(), jobs))
        return outs
    return run


def fresh_threaded_torch_limit(weights, transposing: bool) -> Callable[[], object] | None:
    """The other all-core candidate for transposing pairs: torch's ``copy_`` of ``W.t()`` into
    ``torch.empty`` with torch's intra-op threads on every core (None for same-layout pairs)."""
    if not transposing:
        return None
    import torch

    with warnings.catch_warnings():  # read-only views of the source: only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        srcs = [torch.from_numpy(a) for pair in weights for a in pair]
    cores = _cores()

    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(cores)
        try:
            return [torch.empty(t.t().shape if t.ndim == 2 else t.shape, dtype=t.dtype).copy_(
                t.t() if t.ndim == 2 else t) for t in srcs]
        finally:
            torch.set_num_threads(before)
    return run


def plain_malloc_copy(weights) -> Callable[[], object]:
    """A copy into plain malloc'ed memory WITHOUT huge pages: what ``mx.array`` gets (MLX's
    allocator does not ask for them, and a library cannot make it)."""
    from numpy._core.multiarray import _set_madvise_hugepage

    srcs = [a for pair in weights for a in pair]

    def run():
        before = _set_madvise_hugepage(False)
        try:
            return [np.copy(a) for a in srcs]
        finally:
            _set_madvise_hugepage(before)
    return run


# ------------------------------------------------------------------ naive ports
def naive_port(source, src: str, dst: str, layers: int, width: int) -> Callable[[], object]:
    """What a user writes by hand, loading into an already built ``dst`` model."""
    target = build(dst, layers, width, seed=1)
    if src == "torch":
        pairs = lambda: [(m.weight.detach().numpy().T, m.bias.detach().numpy()) for m in source]  # noqa: E731
    elif src == "keras":
        pairs = lambda: [(l.kernel.numpy(), l.bias.numpy()) for l in source.layers]  # noqa: E731
    elif src == "flax":
        pairs = lambda: [(np.asarray(l.kernel[...]), np.asarray(l.bias[...])) for l in source.layers]  # noqa: E731
    else:  # mlx, equinox: weight (out, in)
        pairs = lambda: [(np.array(m.weight).T, np.array(m.bias)) for m in source.layers]  # noqa: E731
    if dst in ("flax", "equinox"):
        import jax.numpy as jnp

        def run():  # Flax: Variable.set_value; Equinox: eqx.tree_at into a new model
            for layer, (k, b) in zip(target.layers, pairs()):
                if dst == "flax":
                    layer.kernel.set_value(jnp.asarray(k))
                    layer.bias.set_value(jnp.asarray(b))
                else:
                    object.__setattr__(layer, "weight", jnp.asarray(np.ascontiguousarray(k.T)))
                    object.__setattr__(layer, "bias", jnp.asarray(b))
            jnp.zeros(()).block_until_ready()
        return run
    if dst == "keras":
        def run():
            for layer, (k, b) in zip(target.layers, pairs()):
                layer.set_weights([k, b])
    elif dst == "torch":
        import torch

        if src == "mlx":
            def run():  # load_state_dict from MLX arrays, the MLX->torch recipe
                target.load_state_dict({f"{i}.{n}": torch.tensor(np.array(getattr(m, n)))
                                        for i, m in enumerate(source.layers) for n in ("weight", "bias")})
        else:
            def run():
                for lin, (k, b) in zip(target, pairs()):
                    lin.weight.data = torch.tensor(k.T)
                    lin.bias.data = torch.tensor(b)
    else:
        import mlx.core as mx

        def run():
            weights = []
            for i, (k, b) in enumerate(pairs()):
                weights += [(f"layers.{i}.weight", mx.array(k.T)), (f"layers.{i}.bias", mx.array(b))]
            target.load_weights(weights)
            mx.eval(target.parameters())
    return run


# ------------------------------------------------------------------ timing
#: What new memory costs in each sample (--pages): see ``settle_pages``.
PAGES = {"mode": "warm", "bytes": 0}
_REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def _reported_kib() -> int | None:
    try:
        with open(_REPORTED) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def settle_pages() -> None:
    """Put the kernel's free memory in the same state before every sample of every variant.

    This Firecracker VM reports freed 2 MiB blocks to its host (virtio-balloon free page
    reporting, ``/sys/module/page_reporting``); a reported page costs a host fault when it is
    used again, a 5-10x slower first touch (fresh np.copy of 537 MB: 9.5 GB/s right after a free,
    0.8-1.4 GB/s 3 s later). Which variant meets which pages was chance; now:

    - warm: just before the sample, touch and free 1.5x the output's bytes, so the pages it gets
      are ones the guest just freed (a long-running process that has just freed memory);
    - cold: wait until the host has taken back what was freed (``reported_kib`` still for 1 s,
      at least 3 s): a process whose free memory has gone back to the host;
    - as-is: neither (the state left by the previous sample).
    """
    if PAGES["mode"] == "warm":
        scratch = np.empty(int(PAGES["bytes"] * 1.5), np.uint8)
        scratch[::4096] = 1
        del scratch
    elif PAGES["mode"] == "cold":
        time.sleep(2.0)
        last, still = _reported_kib(), 0.0
        while still < 1.0:
            time.sleep(0.25)
            now = _reported_kib()
            still = still + 0.25 if now == last else 0.0
            last = now


def timed(fn: Callable[[], object]) -> float:
    """Seconds for one call on settled pages; the result is dropped (and garbage collected) outside the timing."""
    gc.collect()
    settle_pages()
    return plain_timed(fn)


def measure_pair(source, src: str, dst: str, layers: int, width: int, repeats: int) -> dict:
    weights = native_weights(source, src)
    same = _LAYOUT[src] == _LAYOUT[dst]
    limit = memcpy_limit if same else transpose_limit
    fns = {
        "convert": lambda: db.convert(source, to=dst),
        "limit": limit(weights, fresh=False),
        "naive": naive_port(source, src, dst, layers, width),
        **fresh_limits(weights, transposing=not same),
        "fresh:all cores": fresh_threaded_limit(weights, transposing=not same),
    }
    if not same:
        fns["fresh:all cores torch"] = fresh_threaded_torch_limit(weights, transposing=True)
    if dst == "mlx":
        fns["malloc"] = plain_malloc_copy(weights)
    # where convert's time goes (timed round-robin with the rest): the same convert without the
    # NaN/Inf scan, and (targets that adopt dense_bridge's buffers) with no copy at all
    fns["convert, no scan"] = _decomposed(lambda: db.convert(source, to=dst), "no scan")
    if dst in _ADOPTS_BUFFERS:
        fns["convert, no copy"] = _decomposed(lambda: db.convert(source, to=dst), "no copy")
        fns["native build"] = native_build(dst, layers, width)
    for fn in fns.values():  # warm-up: imports, lazy tracing, first-touch of preallocated memory
        timed(fn)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k].append(timed(fn))
    nbytes = param_bytes(layers, width)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in samples.items()}
    singles = {k: v for k, v in gbps.items() if k.startswith("fresh:") and not k.startswith("fresh:all cores")}
    best = max(singles, key=singles.get)
    alls = {k: v for k, v in gbps.items() if k.startswith("fresh:all cores")}
    best_all = max(alls, key=alls.get)
    gbps["fresh1"], gbps["fresh_all"] = singles[best], alls[best_all]
    ms = {k: statistics.median(samples[k]) * 1e3
          for k in ("convert", "convert, no scan", "convert, no copy", "native build") if k in samples}
    ms["all-core limit"] = nbytes / gbps["fresh_all"] / 1e6
    # the scan's cost as the median of per-round differences: both variants ran back to back in
    # each round, so the machine's drift between rounds cancels (a difference of medians here
    # came out negative on this VM)
    ms["scan"] = statistics.median(c - n for c, n in zip(samples["convert"], samples["convert, no scan"])) * 1e3
    return {"pair": f"{src} -> {dst}", "src": src, "dst": dst, "best_single": best[len("fresh:"):],
            "best_all": "torch copy_" if best_all.endswith("torch") else "dense_bridge kernels",
            "limit_kind": "memcpy" if same else "transposing copy", "gbps": gbps, "ms": ms}


#: Targets that adopt the buffers dense_bridge fills (torch.from_numpy, TF DLPack): for them a
#: convert with the copies replaced by unfilled buffers times everything but the copy.
_ADOPTS_BUFFERS = ("torch", "keras")


def native_build(framework: str, layers: int, width: int) -> Callable[[], object]:
    """The target framework's own floor: its plain Dense model built, with the framework's usual
    calls, around unfilled 64-byte aligned buffers it adopts without a copy (Keras: Dense layers
    whose initializers return the DLPack-imported buffer, then Sequential; torch: nn.Linear
    made on the meta device, given Parameters over torch.from_numpy)."""
    from dense_bridge.params import _copy as _transfer

    def buffers():
        return [(_transfer.empty((width, width), np.float32), _transfer.empty((width,), np.float32))
                for _ in range(layers)]
    if framework == "torch":
        import torch

        def run():
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width, device="meta") for _ in range(layers)])
            for m, (w, b) in zip(model, buffers()):
                m.weight = torch.nn.Parameter(torch.from_numpy(w))
                m.bias = torch.nn.Parameter(torch.from_numpy(b))
            return model
        return run
    import keras

    class Adopt(keras.initializers.Initializer):
        def __init__(self, array):
            self.array = array

        def __call__(self, shape, dtype=None):
            if keras.backend.backend() != "tensorflow":  # JAX/torch engines: their usual import
                return keras.ops.convert_to_tensor(self.array)
            import tensorflow as tf

            return tf.experimental.dlpack.from_dlpack(self.array.__dlpack__())

    def run():
        dense = [keras.layers.Dense(width, kernel_initializer=Adopt(w), bias_initializer=Adopt(b))
                 for w, b in buffers()]
        for layer in dense:
            layer.build((None, width))
        return keras.Sequential([keras.Input((width,))] + dense)
    return run


def _decomposed(convert: Callable[[], object], without: str) -> Callable[[], object]:
    """``convert`` with one part of its work taken out, to see what that part costs:

    - "no scan": every NaN/Inf count returns 0 without reading (the fused scan in the transposes,
      the background scans of the MLX/JAX targets);
    - "no copy": ParamSource hands out unfilled 64-byte aligned buffers instead of copies, so
      what is left is planning, the target's own layer and variable creation and the adoption.
    """
    from dense_bridge.params import _source as params_mod
    from dense_bridge.params import _copy as _transfer

    def no_copy(src, perm=None, *, check_finite=False):
        shape = np.shape(src) if perm is None else tuple(np.shape(src)[p] for p in perm)
        return _transfer.empty(shape, np.asarray(src).dtype), 0

    def run():
        saved = _transfer.count_nonfinite, params_mod.count_nonfinite, params_mod.native_copy
        if without == "no scan":
            _transfer.count_nonfinite = params_mod.count_nonfinite = lambda value: 0
        else:
            params_mod.native_copy = no_copy
        try:
            return convert()
        finally:
            _transfer.count_nonfinite, params_mod.count_nonfinite, params_mod.native_copy = saved
    return run


# ------------------------------------------------------------------ peak memory (child process)
def memory_child(src: str, dst: str, layers: int, width: int) -> dict:
    """Peak extra RSS of one db.convert in this (fresh) process."""
    import resource

    source = build(src, layers, width)
    db.convert(build(src, 2, 8), to=dst)  # warm-up: imports and first-call setup are not the convert's
    gc.collect()
    reset = reset_peak()
    before_kb = (status_bytes("VmRSS") // 1024)
    if not reset:  # fall back to the process-wide high-water mark
        before_kb = max(before_kb, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    out = db.convert(source, to=dst)
    peak_kb = (status_bytes("VmHWM") // 1024) if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    extra = peak_kb * 1024 - before_kb * 1024 - param_bytes(layers, width)
    del out
    return {"extra_bytes": extra, "hwm_reset": reset}


def measure_memory(src: str, dst: str, layers: int, width: int) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", f"{src},{dst}", "--layers", str(layers),
           "--width", str(width)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {src}->{dst} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ ablation: does each piece of
# dense_bridge.params._copy pay? db.convert with one piece replaced by the plain alternative, on one
# thread and on every core, round-robin in the same run.
def _plain_native_copy(src, perm=None, *, check_finite=False):
    """The simplest correct native_copy: a 64-byte aligned buffer, numpy's own (strided) copy,
    then numpy's own NaN/Inf count over the result."""
    from dense_bridge.params import _copy as _transfer

    src = np.asarray(src)
    view = src if perm is None else src.transpose(tuple(perm))
    nbytes = view.nbytes
    raw = np.empty(nbytes + _transfer.ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _transfer.ALIGN
    out = raw[start:start + nbytes].view(view.dtype).reshape(view.shape)
    np.copyto(_transfer._raw(out), _transfer._raw(view))
    if not check_finite:
        return out, 0
    return out, int(out.size - np.count_nonzero(np.isfinite(out)))


_BASELINE = {}


def _load_baseline(rev: str):
    """dense_bridge/params/_copy.py as it was at git revision ``rev``, as a module of its own."""
    import types

    src = subprocess.run(["git", "show", f"{rev}:dense_bridge/params/_copy.py"], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    module = types.ModuleType(f"_transfer_{rev}")
    exec(compile(src, f"{rev}:dense_bridge/params/_copy.py", "exec"), module.__dict__)
    _BASELINE[f"_transfer at {rev}"] = module
    return f"_transfer at {rev}"


def _variant(name: str):
    """A context manager patching dense_bridge.params._copy / _params for one variant."""
    import contextlib

    from dense_bridge.params import _source as params_mod
    from dense_bridge.params import _copy as _transfer

    @contextlib.contextmanager
    def patched():
        saved = {k: getattr(_transfer, k) for k in ("native_copy", "blocked_transpose", "COPY_KERNELS")}
        saved_params_copy = params_mod.native_copy
        try:
            copy = None
            if name != "full":  # the numpy kernels' variants: the C kernel would bypass what they change
                _transfer.COPY_KERNELS = None
            if name == "plain copy (np.copyto + np.isfinite)":
                copy = _plain_native_copy
            elif name == "no cache-blocked transpose":
                def strided(out, swapped, check):
                    np.copyto(_transfer._raw(out), _transfer._raw(swapped.swapaxes(-1, -2)))
                    return _transfer.count_nonfinite(out) if check else 0
                _transfer.blocked_transpose = strided
            elif name == "check after copy (not fused)":
                def separate(src, perm=None, *, check_finite=False, fused=saved["native_copy"]):
                    out, _ = fused(src, perm, check_finite=False)
                    return out, (_transfer.count_nonfinite(out) if check_finite else 0)
                copy = separate
            if name in _BASELINE:
                copy = _BASELINE[name].native_copy
            if copy is not None:
                _transfer.native_copy = copy
                params_mod.native_copy = copy
            yield
        finally:
            for k, v in saved.items():
                setattr(_transfer, k, v)
            params_mod.native_copy = saved_params_copy
    return patched


VARIANTS = ("full", "plain copy (np.copyto + np.isfinite)",
            "no cache-blocked transpose", "check after copy (not fused)")


def ablation(sources: dict, pairs, layers: int, width: int, repeats: int,
             baseline: str | None = None) -> tuple[list[list[str]], list[str]]:
    nbytes = param_bytes(layers, width)
    variants = VARIANTS + ((_load_baseline(baseline),) if baseline else ())
    rows, header = [], ["pair"] + list(variants)
    for src, dst in pairs:
        source = sources[src]
        fns = {}
        for v in variants:
            ctx = _variant(v)

            def fn(ctx=ctx):
                with ctx():
                    return db.convert(source, to=dst)
            fns[v] = fn
        for fn in fns.values():
            timed(fn)
        samples = {k: [] for k in fns}
        for _ in range(repeats):
            for k, fn in fns.items():
                samples[k].append(timed(fn))
        full = statistics.median(samples["full"])
        cells = []
        for v in variants:
            med = statistics.median(samples[v])
            cells.append(f"{nbytes / med / 1e9:.2f}" + ("" if v == "full" else f" ({med / full - 1:+.0%})"))
        rows.append([f"{src} -> {dst}"] + cells)
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows, header


# ------------------------------------------------------------------ --plain: what a user sees
def user_port(source, src: str, dst: str, layers: int, width: int) -> Callable[[], object]:
    """The port a user writes by hand, timed as the user runs it. Into MLX the whole of it: a
    new ``nn.Sequential`` of ``nn.Linear`` (MLX draws its initial weights lazily, so nothing is
    computed for them) and ``load_weights`` of ``mx.array`` copies of the source's weights in
    MLX's (out, in) layout. Into the other targets: :func:`naive_port` (into a model built
    once, outside the timing)."""
    if dst != "mlx":
        return naive_port(source, src, dst, layers, width)
    import mlx.core as mx
    import mlx.nn as nn

    weights = native_weights(source, src)
    out_in = _LAYOUT[src] == "out_in"

    def run():
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        model.load_weights([(f"layers.{i}.{name}", mx.array(array)) for i, (w, b) in enumerate(weights)
                            for name, array in (("weight", w if out_in else w.T), ("bias", b))])
        mx.eval(model.parameters())
        return model
    return run


def plain_timed(fn: Callable[[], object]) -> float:
    """Seconds for one call as a user's loop makes it: no page preparation; the result is dropped
    (and garbage collected) outside the timing."""
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    del out
    gc.collect()
    return elapsed


def measure_plain(source, src: str, dst: str, layers: int, width: int, repeats: int) -> dict[str, float]:
    """One run for one pair: medians of ``repeats`` rounds of convert, convert without the scan,
    the user's port and the all-core limit, called round-robin in a plain loop. Ratios are
    medians of per-round ratios (each round's variants ran back to back, so drift cancels)."""
    weights = native_weights(source, src)
    transposing = _LAYOUT[src] != _LAYOUT[dst]
    limits = {"all-core": fresh_threaded_limit(weights, transposing)}
    if transposing:
        limits["all-core torch"] = fresh_threaded_torch_limit(weights, True)
    fns = {"convert": lambda: db.convert(source, to=dst),
           "convert, allow_nonfinite": lambda: db.convert(source, to=dst, allow_nonfinite=True),
           "port": user_port(source, src, dst, layers, width), **limits}
    if dst not in _ADOPTS_BUFFERS:  # the framework copies: its scans beside the copies, or inline
        fns["convert, scans inline"] = _scans_inline(lambda: db.convert(source, to=dst))
    for fn in fns.values():  # warm-up: imports, first calls
        plain_timed(fn)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k].append(plain_timed(fn))
    # the faster all-core limit of the two, sample by sample
    limit = [min(ts) for ts in zip(*(samples[k] for k in limits))]
    conv, no_scan, port = samples["convert"], samples["convert, allow_nonfinite"], samples["port"]
    med = statistics.median
    out = {"convert ms": med(conv) * 1e3, "port ms": med(port) * 1e3, "all-core ms": med(limit) * 1e3,
           "convert / port": med(p / c for p, c in zip(port, conv)),
           "convert / all-core": med(lim / c for lim, c in zip(limit, conv)),
           "scan share": med(1 - n / c for n, c in zip(no_scan, conv))}
    if "convert, scans inline" in samples:
        out["inline / beside"] = med(i / c for i, c in zip(samples["convert, scans inline"], conv))
    return out


def _scans_inline(convert: Callable[[], object]) -> Callable[[], object]:
    """``convert`` with every NaN/Inf scan of ``ParamSource.for_layer`` on the calling thread, after
    the framework's copy, instead of beside it on a second core."""
    from dense_bridge.params import _source as params_mod

    def run():
        saved = params_mod._SCAN_AHEAD_BYTES
        params_mod._SCAN_AHEAD_BYTES = 1 << 62
        try:
            return convert()
        finally:
            params_mod._SCAN_AHEAD_BYTES = saved
    return run


def once_child(src: str, dst: str, variant: str, layers: int, width: int, loop: int = 7) -> dict[str, float]:
    """One process, one variant ("convert" or "port"): the milliseconds of its first call (the
    frameworks and dense_bridge imported and warmed up on a tiny model first, so only the
    conversion's own work is timed, on memory no earlier call touched), then the median of
    ``loop`` more calls in a plain loop, each result dropped before the next: a user's loop, with
    no other variant sharing the process's allocators."""
    def call(n_layers: int, n_width: int) -> Callable[[], object]:
        source = build(src, n_layers, n_width)
        if variant == "convert":
            return lambda: db.convert(source, to=dst)
        return user_port(source, src, dst, n_layers, n_width)
    call(1, 8)()  # imports, first calls
    run = call(layers, width)
    times = [plain_timed(run) for _ in range(loop + 1)]
    return {"first": times[0] * 1e3, "loop": statistics.median(times[1:]) * 1e3}


def measure_once(pairs, layers: int, width: int, processes: int) -> dict[str, dict[str, list[dict]]]:
    """pair -> {"convert": [child results...], "port": [...]}: each from its own process (see
    :func:`once_child`), the two variants alternating so that drift hits both alike."""
    out: dict[str, dict[str, list[dict]]] = {}
    for src, dst in pairs:
        results: dict[str, list[dict]] = {"convert": [], "port": []}
        for _ in range(processes):
            for variant in results:
                done = subprocess.run([sys.executable, __file__, "--once-child", f"{src},{dst},{variant}",
                                       "--layers", str(layers), "--width", str(width)],
                                      capture_output=True, text=True, check=True)
                results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
        out[f"{src} -> {dst}"] = results
        print(f"once: {src} -> {dst}: " + ", ".join(
            f"{k} first {statistics.median(r['first'] for r in v):.1f} ms, loop {statistics.median(r['loop'] for r in v):.1f} ms"
            for k, v in results.items()), file=sys.stderr, flush=True)
    return out


def once_rows(results: dict[str, dict[str, list[dict]]]) -> list[list[str]]:
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({', '.join(f'{x:.1f}' for x in values)})"
    rows = []
    for pair, r in results.items():
        row = [pair]
        for key in ("first", "loop"):
            c, p = [x[key] for x in r["convert"]], [x[key] for x in r["port"]]
            row += [cell(c), cell(p), f"{statistics.median(b / a for a, b in zip(c, p)):.2f}x"]
        rows.append(row)
    return rows


ONCE_HEADER = ["pair", "convert ms, first call", "port ms, first call", "port / convert, first call",
               "convert ms, own loop", "port ms, own loop", "port / convert, own loop"]


PLAIN_HEADER = ["pair", "convert ms", "user's port ms", "convert / port (into MLX >= 0.95x)",
                "all-core limit ms", "convert / all-core (>= 0.8)", "scan's share of convert (<= 10%)",
                "scans inline / beside the copy (time)"]


def plain_row(pair: str, runs: list[dict[str, float]]) -> list[str]:
    """One table row: medians over the runs, each run's own value after them."""
    def cell(key: str, fmt: str) -> str:
        values = [r[key] for r in runs]
        each = ", ".join(fmt.format(v) for v in values)
        return fmt.format(statistics.median(values)) + (f" ({each})" if len(values) > 1 else "")
    return [pair, cell("convert ms", "{:.1f}"), cell("port ms", "{:.1f}"), cell("convert / port", "{:.2f}x"),
            cell("all-core ms", "{:.1f}"), cell("convert / all-core", "{:.2f}"), cell("scan share", "{:.0%}"),
            cell("inline / beside", "{:.2f}") if "inline / beside" in runs[0] else "-"]


def plain_main(args, pairs, argv) -> int:
    """--plain: every pair measured in ``args.runs`` separate runs (all pairs, then again)."""
    sources = {src: build(src, args.layers, args.width) for src in {s for s, _ in pairs}}
    load_before = os.getloadavg()
    results: dict[str, list[dict[str, float]]] = {f"{s} -> {d}": [] for s, d in pairs}
    for run in range(args.runs):
        for src, dst in pairs:
            r = measure_plain(sources[src], src, dst, args.layers, args.width, args.repeats)
            results[f"{src} -> {dst}"].append(r)
            print(f"run {run + 1}: {src} -> {dst}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()),
                  file=sys.stderr, flush=True)
    once = measure_once(pairs, args.layers, args.width, args.once) if args.once else {}
    load_after = os.getloadavg()
    text = table([plain_row(pair, runs) for pair, runs in results.items()], PLAIN_HEADER)
    print(text)
    once_text = table(once_rows(once), ONCE_HEADER) if once else ""
    if once_text:
        print("\n" + once_text)
    command = "python benchmarks/bench_convert.py " + " ".join(argv if argv is not None else sys.argv[1:])
    mb = param_bytes(args.layers, args.width) / 1e6
    report = [
        "# db.convert as a user runs it (--plain)", "",
        f"{args.layers} Dense layers {args.width}x{args.width} float32 with bias ({mb:.0f} MB), every ordered pair; "
        f"{args.runs} runs, each the median of {args.repeats} rounds in which every variant is called once, "
        "in a plain loop: no page preparation (whatever memory the previous call freed), the result "
        "dropped and garbage collected outside the timing. Cells: the median over the runs, then each run's.", "",
        f"Command: `{command.strip()}`", "",
        f"Machine: {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after.", "",
        text, "",
        "- convert: `db.convert(model, to=target)`, NaN/Inf scan included (the API's promise).",
        "- user's port: into MLX, what a user writes: a new `nn.Sequential` of `nn.Linear` and `load_weights` of "
        "`mx.array` copies of the source weights in (out, in) layout; into torch and Keras, the hand-written "
        "port into a model built once beforehand (`lin.weight.data = torch.tensor(k.T)`, `set_weights([k, b])`, "
        "`load_state_dict`). Ratio = port time / convert time, the median of per-round ratios.",
        "- all-core limit: the same bytes made in the target's layout in new memory on every core, the faster of "
        "dense_bridge's kernels (the C extension's AVX2 transpose where built) and (transposing) torch's `copy_` "
        "with its intra-op threads, per round.",
        "- scan's share: 1 - (convert with `allow_nonfinite=True`) / convert, the median of per-round values.",
        "- scans inline / beside (targets that copy with their own framework): convert with every NaN/Inf scan on "
        "the calling thread after the framework's copy, over convert as shipped (each big array's scan started "
        "on a second thread just before `mx.array` copies it): > 1 means the second core pays.", "",
    ]
    if once_text:
        report += [f"## Each variant in its own process (`--once {args.once}`)", "",
                   "Every cell from its own process per run (processes alternate convert, port): the first call "
                   "(imports and first calls warmed up on a 1 x 8 model), which is a model ported once, on memory "
                   "no earlier call touched; then the median of 7 more calls in a plain loop, which is a user's "
                   "loop with no other variant sharing the process's allocators (the round-robin table above "
                   "interleaves convert and the port in one process, so each inherits the memory the other "
                   "freed). Into torch and Keras the port loads into a model built before the timing.", "",
                   once_text, ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(report))
    print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ report
def row(r: dict, layer_bytes: int) -> list[str]:
    g = r["gbps"]
    mem = r.get("memory")
    extra = "-" if mem is None else f"{mem['extra_bytes'] / 1e6:.0f} MB"
    malloc = "-" if "malloc" not in g else f"{g['malloc']:.2f}"
    vs_malloc = "-" if "malloc" not in g else f"**{g['convert'] / g['malloc']:.2f}**"
    return [r["pair"], f"{g['convert']:.2f}", f"{g['fresh1']:.2f} ({r['best_single']})",
            f"{g['convert'] / g['fresh1']:.2f}", f"{g['fresh_all']:.2f} ({r['best_all']})", f"**{g['convert'] / g['fresh_all']:.2f}**",
            malloc, vs_malloc, f"{g['naive']:.2f}", f"**{g['convert'] / g['naive']:.2f}x**",
            f"{g['limit']:.2f}", extra]


HEADER = ["pair", "convert GB/s", "1-thread limit GB/s (fastest copy)", "convert / 1-thread",
          "all-core limit GB/s (fastest copy)", "convert / all-core (>= 0.8)", "plain malloc copy GB/s",
          "convert / malloc (>= 0.9)", "naive GB/s", "convert / naive (>= 1.0)", "prealloc copy GB/s", "peak extra"]


DECOMPOSITION_HEADER = ["pair", "convert ms", "all-core limit ms", "NaN/Inf scan ms (median of per-round convert - convert without it)",
                        "target's own work ms (convert with unfilled buffers)", "native build ms (floor)",
                        "copy ms (the rest)", "copy / all-core limit"]


def decomposition_row(r: dict) -> list[str]:
    """Where one pair's convert time goes, from variants timed in the same round-robin."""
    ms = r["ms"]
    scan = ms["scan"]
    if "convert, no copy" not in ms:  # the target copies with its own framework: no split
        return [r["pair"], f"{ms['convert']:.0f}", f"{ms['all-core limit']:.0f}", f"{scan:.0f}", "-", "-", "-", "-"]
    own = ms["convert, no copy"]
    copy = ms["convert"] - scan - own
    return [r["pair"], f"{ms['convert']:.0f}", f"{ms['all-core limit']:.0f}", f"{scan:.0f}", f"{own:.0f}",
            f"{ms['native build']:.0f}", f"{copy:.0f}", f"{ms['all-core limit'] / copy:.2f}"]


def gaps(results: list[dict]) -> list[str]:
    """A line per pair under a target: convert >= 0.8 of the all-core fresh-memory limit and >=
    1.0x naive; into MLX >= 0.9 of the plain malloc copy."""
    lines = []
    for r in results:
        g = r["gbps"]
        misses = []
        if g["convert"] / g["fresh_all"] < TARGET_RATIO:
            misses.append(f"{g['convert'] / g['fresh_all']:.2f} of the all-core limit ({g['fresh_all']:.2f} GB/s)")
        if g["convert"] / g["naive"] < 1.0:
            misses.append(f"{g['convert'] / g['naive']:.2f}x naive")
        if "malloc" in g and g["convert"] / g["malloc"] < 0.9:
            misses.append(f"{g['convert'] / g['malloc']:.2f} of the plain malloc copy")
        if misses:
            lines.append(f"- {r['pair']}: {'; '.join(misses)}. Why: {_GAP_REASONS[r['dst']]}.")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant (median; at least 5)")
    parser.add_argument("--frameworks", default=",".join(f for f in FRAMEWORKS if f in db.available_backends()))
    parser.add_argument("--pairs", default=None, help="only these pairs, e.g. torch-keras,mlx-torch")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "convert.md"))
    parser.add_argument("--ablation", action="store_true",
                        help="instead: db.convert with each piece of dense_bridge.params._copy replaced by the plain "
                             "alternative, or with the transposes split over every core (GB/s; in brackets the variant's extra time "
                             "over 'full': + means the piece pays)")
    parser.add_argument("--baseline-rev", default=None,
                        help="with --ablation: also time native_copy from dense_bridge/params/_copy.py at this git "
                             "revision (e.g. 9aaefc2, before issue 11), in the same run")
    parser.add_argument("--pages", choices=("warm", "cold", "as-is"), default="warm",
                        help="state of free memory before every sample (see settle_pages): warm = just freed by this "
                             "process, cold = already returned to the VM's host, as-is = whatever the last sample left")
    parser.add_argument("--plain", action="store_true",
                        help="instead: convert as a user's loop runs it (no page preparation) against the user's own "
                             "port, the all-core limit and convert with allow_nonfinite=True (the scan's share), "
                             "over --runs runs; default output benchmarks/results/convert_plain.md")
    parser.add_argument("--runs", type=int, default=3, help="with --plain: separate runs of every pair (>= 3)")
    parser.add_argument("--once", type=int, default=0,
                        help="with --plain: also time convert and the user's port each in its own process, this many "
                             "processes each: the first call (a model ported once) and a plain loop after it")
    parser.add_argument("--once-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keras-backend", choices=("tensorflow", "jax", "torch"), default=None,
                        help="Keras on this engine (the run is repeated in a subprocess with KERAS_BACKEND set); "
                             "default output benchmarks/results/convert_keras_<engine>.md")
    args = parser.parse_args(argv)
    if args.keras_backend and os.environ.get("KERAS_BACKEND") != args.keras_backend:
        rest = list(argv if argv is not None else sys.argv[1:])
        if "--out" not in rest:
            rest += ["--out", os.path.join(os.path.dirname(__file__), "results", f"convert_keras_{args.keras_backend}.md")]
        return subprocess.run([sys.executable, __file__, *rest],
                              env={**os.environ, "KERAS_BACKEND": args.keras_backend}).returncode

    if args.once_child:
        src, dst, variant = args.once_child.split(",")
        print(json.dumps(once_child(src, dst, variant, args.layers, args.width)))
        return 0
    if args.memory_child:
        src, dst = args.memory_child.split(",")
        print(json.dumps(memory_child(src, dst, args.layers, args.width)))
        return 0
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (the median of 5 runs or more is reported)")

    frameworks = [f for f in args.frameworks.split(",") if f]
    pairs = [(s, d) for s in frameworks for d in frameworks if s != d]
    if args.pairs:
        wanted = {tuple(p.split("-")) for p in args.pairs.split(",")}
        pairs = [p for p in pairs if p in wanted]
    if args.plain:
        if args.runs < 3:
            parser.error("--runs must be at least 3")
        if "--out" not in (argv if argv is not None else sys.argv[1:]):
            args.out = os.path.join(os.path.dirname(__file__), "results", "convert_plain.md")
        return plain_main(args, pairs, argv)
    PAGES["mode"], PAGES["bytes"] = args.pages, param_bytes(args.layers, args.width)
    load_before = os.getloadavg()
    if args.ablation:
        sources = {src: build(src, args.layers, args.width) for src in {s for s, _ in pairs}}
        rows, header = ablation(sources, pairs, args.layers, args.width, args.repeats, args.baseline_rev)
        load_after = os.getloadavg()
        text = table(rows, header)
        command = "python benchmarks/bench_convert.py " + " ".join(argv if argv is not None else sys.argv[1:])
        report = ["# dense_bridge.params._copy ablation", "",
                  f"db.convert of {args.layers} Dense layers {args.width}x{args.width} float32; GB/s, medians of "
                  f"{args.repeats} runs round-robin; (+x%) = the variant's extra time over 'full' (+ means the piece of machinery pays).", "",
                  f"Command: `{command.strip()}`", "",
                  f"Machine: {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
                  "", text, ""]
        print(text)
        with open(args.out, "w") as f:
            f.write("\n".join(report))
        return 0
    results = []
    sources = {}
    for src, dst in pairs:
        if src not in sources:
            sources[src] = build(src, args.layers, args.width)
        r = measure_pair(sources[src], src, dst, args.layers, args.width, args.repeats)
        if not args.no_memory:
            r["memory"] = measure_memory(src, dst, args.layers, args.width)
        results.append(r)
        print(" | ".join(row(r, 4 * args.width * (args.width + 1))), file=sys.stderr, flush=True)
    load_after = os.getloadavg()

    layer_bytes = 4 * args.width * (args.width + 1)
    text = table([row(r, layer_bytes) for r in results], HEADER)
    print(text)
    command = "python benchmarks/bench_convert.py " + " ".join(argv if argv is not None else sys.argv[1:])
    mb = param_bytes(args.layers, args.width) / 1e6
    report = [
        "# db.convert speed" + (f" (Keras on {os.environ.get('KERAS_BACKEND')})" if args.keras_backend else ""), "",
        f"{args.layers} Dense layers {args.width}x{args.width} float32 with bias ({mb:.0f} MB), every ordered pair; "
        f"medians of {args.repeats} runs, measured round-robin in one run.", "",
        f"Command: `{command.strip()}`", "",
        f"Machine: {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        "(a shared machine: compare the ratios, measured side by side, rather than absolute GB/s). "
        f"Free memory before every sample: **{args.pages}** (`--pages`): this Firecracker VM hands freed pages "
        "back to its host (virtio-balloon free page reporting), and a page it has taken back costs 5-10x more "
        "to touch again; warm = each sample first touches and frees 1.5x the output's bytes, so every variant "
        "meets pages the guest has just freed; cold = each sample waits until the host has taken them back.", "",
        text, "",
        "- 1-thread limit: the fastest way measured, in the same run, to make the same bytes in the target's "
        "layout in NEW memory on one thread (same layout: np.copy; transposing: the best of torch "
        "`torch.empty().copy_(W.t())`, `np.ascontiguousarray(W.T)` and dense_bridge's cache-blocked transpose).",
        "- all-core limit: the same into new memory on every core, the faster of dense_bridge's kernels (column "
        "strips of the blocked transpose, flat chunks of a copy) and, for transposing pairs, torch's `copy_` with "
        "its intra-op threads: the yardstick of the issue (target convert >= 0.8 of it).",
        "- plain malloc copy (into MLX only): np.copy with numpy's huge-page advice off, i.e. what `mx.array` "
        "gets from MLX's allocator (target >= 0.9).",
        "- prealloc copy: the pair's copy into memory allocated and touched before timing (no page faults): not "
        "a limit for a conversion, which must create its output; shown for scale.",
        "- convert: source views are zero-copy; each layer is copied once, in the target's layout, into fresh "
        "64-byte aligned buffers (cache-blocked transpose in 16-row tiles, row strips on every core for 8 MiB and "
        "more) with the NaN/Inf check fused into the copy, then adopted by the target (torch.from_numpy, TF "
        "DLPack); MLX copies with mx.array while a background thread scans the source for NaN/Inf.",
        "- naive: a hand-written port into an already built model (`set_weights([w.T, b])`, `load_weights`, "
        "`lin.weight.data = torch.tensor(k.T)`, `load_state_dict`).",
        f"- peak extra: RSS high-water mark during convert beyond RSS before it and the output's {mb:.0f} MB "
        f"(fresh process per pair); layers' worth = / {layer_bytes / 1e6:.0f} MB.", "",
    ]
    report += [
        "## Where convert's time goes", "",
        "Medians of the same round-robin as the table above: convert, convert with every NaN/Inf count "
        "returning 0 unread, and (torch and Keras targets, which adopt dense_bridge's buffers) convert with "
        "the copies replaced by unfilled aligned buffers: planning plus the target framework's own layer "
        "and variable creation. Native build: the framework's own plain Dense model made around unfilled "
        "buffers it adopts (`native_build`), the floor of that work. Into MLX, Flax and Equinox the framework makes the copy itself, so there "
        "is no split.", "",
        table([decomposition_row(r) for r in results], DECOMPOSITION_HEADER), "",
    ]
    below = gaps(results)
    if below:
        report += ["## Pairs that miss a target", ""] + below + [""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(report))
    print(f"\nwritten to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
