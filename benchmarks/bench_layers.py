"""Compiled layers vs hand-built native ones: forward and one training step.

For each installed framework, times (median of interleaved samples):
  native      the framework's own layer built by hand (nn.Linear / keras Dense / mlx nn.Linear /
              nnx.Linear / eqx.nn.Linear; Flax and Equinox run under nnx.jit / eqx.filter_jit)
  compiled    db.compile(Dense(units, in_features)) -- exactly the native class
  +relu       compiled with activation="relu" vs native Linear followed by the native ReLU
  masked      compiled with a 50% random mask (the kernel is multiplied by the mask each call)
at batch 1 and 64, for Linear(1024->4096) and Linear(16->16), and prints ratios to native.

Run:  python benchmarks/bench_layers.py [--frameworks torch,keras,mlx,flax,equinox] [--repeats 15]
      python benchmarks/bench_layers.py --keras-backend jax|torch|tensorflow   (keras rows on that engine)
      python benchmarks/bench_layers.py --masked [--repeats 30]   (inference only: masked / unmasked,
      the masked-kernel cache of issue 18; writes benchmarks/results/masked.md)
MLX's Linux CPU matmul is 50-70x slower than the others (docs/FACTS.md): its large shape uses fewer repeats.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))


import dense_bridge as db  # noqa: E402
from _timing import compare_medians, fmt_time, table  # noqa: E402

SHAPES = [(1024, 4096), (16, 16)]
BATCHES = [1, 64]


def torch_cases(fan_in, units, batch):
    import torch

    torch.set_grad_enabled(True)
    x = torch.randn(batch, fan_in)
    mask = db.wiring.random(fan_in, units, 0.5, seed=0)
    layers = {
        "native": torch.nn.Linear(fan_in, units),
        "compiled": db.compile(db.Dense(units, in_features=fan_in), "torch", seed=0),
        "native+relu": torch.nn.Sequential(torch.nn.Linear(fan_in, units), torch.nn.ReLU()),
        "compiled+relu": db.compile(db.Dense(units, in_features=fan_in, activation="relu"), "torch", seed=0),
        "masked": db.compile(db.Dense(units, in_features=fan_in, mask=mask), "torch", seed=0),
    }

    def forward(layer):
        def run():
            with torch.no_grad():
                layer(x)
        return run

    def train(layer):
        opt = torch.optim.SGD(layer.parameters(), lr=1e-3)

        def run():
            opt.zero_grad(set_to_none=True)
            layer(x).square().mean().backward()
            opt.step()
        return run

    return layers, forward, train


def keras_cases(fan_in, units, batch):
    import keras

    engine = keras.backend.backend()
    x = keras.random.normal((batch, fan_in))
    mask = db.wiring.random(fan_in, units, 0.5, seed=0)
    native = keras.layers.Dense(units)
    native.build((None, fan_in))
    native_relu = keras.layers.Dense(units, activation="relu")
    native_relu.build((None, fan_in))
    layers = {
        "native": native,
        "compiled": db.compile(db.Dense(units, in_features=fan_in), "keras", seed=0),
        "native+relu": native_relu,
        "compiled+relu": db.compile(db.Dense(units, in_features=fan_in, activation="relu"), "keras", seed=0),
        "masked": db.compile(db.Dense(units, in_features=fan_in, mask=mask), "keras", seed=0),
    }

    def forward(layer):
        if engine == "jax":  # JAX dispatches asynchronously: wait for the result
            return lambda: layer(x).block_until_ready()
        if engine == "torch":  # inference as predict runs it: autograd off
            import torch

            def run():
                with torch.no_grad():
                    return layer(x)
            return run
        return lambda: layer(x)

    def train(layer):  # one SGD step through the engine's own autograd
        opt = keras.optimizers.SGD(1e-3)
        variables = layer.trainable_variables
        if engine == "tensorflow":
            import tensorflow as tf

            def run():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(layer(x)))
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        elif engine == "torch":
            import torch

            def run():
                loss = torch.mean(torch.square(layer(x)))
                grads = torch.autograd.grad(loss, [v.value for v in variables])
                with torch.no_grad():
                    opt.apply_gradients(zip(grads, variables))
        else:
            import jax

            frozen = [v.value for v in layer.non_trainable_variables]
            grad = jax.jit(jax.grad(lambda tv: jax.numpy.mean(jax.numpy.square(layer.stateless_call(tv, frozen, x)[0]))))

            def run():
                g = grad([v.value for v in variables])
                opt.apply_gradients(zip(g, variables))
                variables[0].value.block_until_ready()
        return run

    return layers, forward, train


def mlx_cases(fan_in, units, batch):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    x = mx.random.normal((batch, fan_in))
    mask = db.wiring.random(fan_in, units, 0.5, seed=0)
    layers = {
        "native": nn.Linear(fan_in, units),
        "compiled": db.compile(db.Dense(units, in_features=fan_in), "mlx", seed=0),
        "native+relu": nn.Sequential(nn.Linear(fan_in, units), nn.ReLU()),
        "compiled+relu": db.compile(db.Dense(units, in_features=fan_in, activation="relu"), "mlx", seed=0),
        "masked": db.compile(db.Dense(units, in_features=fan_in, mask=mask), "mlx", seed=0),
    }

    def forward(layer):
        return lambda: mx.eval(layer(x))

    def train(layer):
        opt = optim.SGD(learning_rate=1e-3)
        loss_and_grad = nn.value_and_grad(layer, lambda m, v: mx.mean(mx.square(m(v))))

        def run():
            loss, grads = loss_and_grad(layer, x)
            opt.update(layer, grads)
            mx.eval(layer.parameters(), opt.state)
        return run

    return layers, forward, train


def flax_cases(fan_in, units, batch):
    """Flax NNX: nnx.Linear by hand vs compiled, forward and an optax SGD step, both under nnx.jit
    (how NNX models run; eager JAX compiles each op)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    x = jax.random.normal(jax.random.PRNGKey(0), (batch, fan_in))
    mask = db.wiring.random(fan_in, units, 0.5, seed=0)
    rngs = nnx.Rngs(0)
    layers = {
        "native": nnx.Linear(fan_in, units, rngs=rngs),
        "compiled": db.compile(db.Dense(units, in_features=fan_in), "flax", seed=0),
        "native+relu": nnx.Sequential(nnx.Linear(fan_in, units, rngs=rngs), nnx.relu),
        "compiled+relu": db.compile(db.Dense(units, in_features=fan_in, activation="relu"), "flax", seed=0),
        "masked": db.compile(db.Dense(units, in_features=fan_in, mask=mask), "flax", seed=0),
    }
    apply = nnx.jit(lambda m, v: m(v))

    def forward(layer):
        return lambda: apply(layer, x).block_until_ready()

    def train(layer):
        opt = nnx.Optimizer(layer, optax.sgd(1e-3), wrt=nnx.Param)

        @nnx.jit
        def step(m, o):
            loss, grads = nnx.value_and_grad(lambda mm: jnp.mean(jnp.square(mm(x))))(m)
            o.update(m, grads)
            return loss

        return lambda: step(layer, opt).block_until_ready()

    return layers, forward, train


def equinox_cases(fan_in, units, batch):
    """Equinox: eqx.nn.Linear by hand vs compiled, vmapped over the batch, forward and an optax SGD
    step under eqx.filter_jit."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    x = jax.random.normal(jax.random.PRNGKey(0), (batch, fan_in))
    mask = db.wiring.random(fan_in, units, 0.5, seed=0)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    layers = {
        "native": eqx.nn.Linear(fan_in, units, key=k1),
        "compiled": db.compile(db.Dense(units, in_features=fan_in), "equinox", seed=0),
        "native+relu": eqx.nn.Sequential([eqx.nn.Linear(fan_in, units, key=k2), eqx.nn.Lambda(jax.nn.relu)]),
        "compiled+relu": db.compile(db.Dense(units, in_features=fan_in, activation="relu"), "equinox", seed=0),
        "masked": db.compile(db.Dense(units, in_features=fan_in, mask=mask), "equinox", seed=0),
    }
    apply = eqx.filter_jit(lambda m, v: jax.vmap(m)(v))

    def forward(layer):
        return lambda: apply(layer, x).block_until_ready()

    def train(layer):
        opt = optax.sgd(1e-3)
        box = [layer, opt.init(eqx.filter(layer, eqx.is_inexact_array))]

        @eqx.filter_jit
        def step(m, state):
            loss, grads = eqx.filter_value_and_grad(lambda mm: jnp.mean(jnp.square(jax.vmap(mm)(x))))(m)
            updates, state = opt.update(grads, state, eqx.filter(m, eqx.is_inexact_array))
            return eqx.apply_updates(m, updates), state, loss

        def run():
            box[0], box[1], loss = step(box[0], box[1])
            loss.block_until_ready()
        return run

    return layers, forward, train


CASES = {"torch": torch_cases, "keras": keras_cases, "mlx": mlx_cases, "flax": flax_cases,
         "equinox": equinox_cases}


def masked_only(args) -> int:
    """Inference of a compiled masked Dense vs the unmasked one, interleaved rounds, medians."""
    repeats = max(30, args.repeats or 30)
    load_before = os.getloadavg()
    rows = []
    for name in args.frameworks.split(","):
        for fan_in, units in SHAPES:
            for batch in BATCHES:
                layers, forward, _ = CASES[name](fan_in, units, batch)
                big = name == "mlx" and fan_in * units > 1e5
                # db.inference: Keras on TensorFlow caches only inside it (no change counter);
                # a no-op scope for the others, which see changes by themselves
                with db.inference(layers["masked"]):
                    t = compare_medians({k: forward(layers[k]) for k in ("compiled", "masked")}, repeats=repeats,
                                        target_s=0.05 if big else 0.02)
                label = name if name != "keras" else f"keras ({keras_engine_name()})"
                rows.append([label, f"{fan_in}->{units}", batch, fmt_time(t["compiled"]), fmt_time(t["masked"]),
                             f"{t['masked'] / t['compiled']:.2f}"])
                print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    text = table(rows, ["framework", "layer", "batch", "unmasked (median)", "masked (median)", "masked / unmasked"])
    print(text)
    command = "python benchmarks/bench_layers.py --masked " + " ".join(
        f"--{k} {v}" for k, v in (("frameworks", args.frameworks), ("repeats", repeats), ("out", args.out)) if v)
    if "keras" in args.frameworks.split(","):
        command = f"KERAS_BACKEND={keras_engine_name()} {command}"
    report = ["# Masked Dense inference (the masked-kernel cache)", "",
              f"Command: `{command}`", "",
              f"Machine: {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
              f"medians of {repeats} interleaved rounds, forward only (torch under no_grad), the masked "
              "layer inside `db.inference(layer)`.", "", text, ""]
    with open(args.out or os.path.join(os.path.dirname(__file__), "results", "masked.md"), "w") as f:
        f.write("\n".join(report))
    return 0


def keras_engine_name() -> str:
    import keras

    return keras.backend.backend()


def keras_engine(args) -> int:
    """The keras rows with Keras on ``args.keras_backend``: this script again in a subprocess
    (Keras fixes its engine at import), its table written to results/layers_keras_<engine>.md."""
    import subprocess

    engine = args.keras_backend
    cmd = [sys.executable, __file__, "--frameworks", "keras", "--repeats", str(args.repeats or 15)]
    load_before = os.getloadavg()
    done = subprocess.run(cmd, env={**os.environ, "KERAS_BACKEND": engine}, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-3000:] if done.returncode else "")
    if done.returncode:
        return done.returncode
    text = done.stdout.replace("| keras ", f"| keras ({engine}) ")
    print(text)
    report = [f"# Compiled layers vs native, Keras on {engine}", "",
              f"Command: `python benchmarks/bench_layers.py --keras-backend {engine} --repeats {args.repeats or 15}`", "",
              f"Machine: {os.cpu_count()} CPUs, shared; load average {load_before[0]:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after (noisy: ratios matter, not absolute times).", "", text, ""]
    with open(os.path.join(os.path.dirname(__file__), "results", f"layers_keras_{engine}.md"), "w") as f:
        f.write("\n".join(report))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", default=",".join(b for b in CASES if b in db.available_backends()))
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (15; 30 with --masked)")
    parser.add_argument("--masked", action="store_true",
                        help="only inference, compiled masked vs unmasked Dense (issue 18 target <= 1.10)")
    parser.add_argument("--out", default=None, help="with --masked: the results file (results/masked.md)")
    parser.add_argument("--keras-backend", choices=("tensorflow", "jax", "torch"), default=None,
                        help="run the keras rows with Keras on this engine (in a subprocess with KERAS_BACKEND set); "
                             "writes benchmarks/results/layers_keras_<engine>.md")
    args = parser.parse_args(argv)
    if args.keras_backend:
        return keras_engine(args)
    if args.masked:
        return masked_only(args)
    args.repeats = args.repeats or 15
    rows = []
    for name in args.frameworks.split(","):
        for fan_in, units in SHAPES:
            for batch in BATCHES:
                layers, forward, train = CASES[name](fan_in, units, batch)
                big = name == "mlx" and fan_in * units > 1e5
                repeats = 5 if big else args.repeats
                for mode, make in (("forward", forward), ("train step", train)):
                    t = compare_medians({k: make(l) for k, l in layers.items()}, repeats=repeats,
                                        target_s=0.05 if big else 0.02)
                    rows.append([name, f"{fan_in}->{units}", batch, mode, fmt_time(t["native"]),
                                 f"{t['compiled'] / t['native']:.3f}",
                                 f"{t['compiled+relu'] / t['native+relu']:.3f}",
                                 f"{t['masked'] / t['compiled']:.2f}"])
                    print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(table(rows, ["framework", "layer", "batch", "mode", "native (median)", "compiled / native",
                       "compiled+relu / native+relu", "masked / unmasked"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
