#!/bin/bash
# Everything a lent GPU machine is for, in one call (it has torch, JAX, Flax, Equinox, transformers,
# no Keras, MLX or mlx-lm, and nothing can be installed there): the CUDA tests, then
# benchmarks/bench_gpu.py. Run from the repository root; logs and gpu.md go to $OUT (or ./gpu-out).
#   T1/T2: seconds for the tests / the benchmark; TESTS: the test paths; REPEATS: benchmark rounds.
# dense_bridge is used from the checkout, uninstalled: the install maps backends/ to
# dense_bridge.backends (pyproject's package-dir), so the checkout gets that link first.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
[ -e dense_bridge/backends ] || ln -s ../backends dense_bridge/backends
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=3
nvidia-smi -L
python3 -c "import sys, torch, jax; print(sys.version.split()[0], 'torch', torch.__version__, 'jax', jax.__version__, jax.devices())"
timeout "${T1:-170}" python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/gpu tests/core/test_devices.py tests/core/test_devices_cli.py tests/testing/test_judge_device.py tests/models/test_transfer_in_place.py} 2>&1 | tee "$OUT/pytest.log" | grep -v "^  " | tail -60
timeout "${T2:-200}" python3 benchmarks/bench_gpu.py --repeats "${REPEATS:-5}" 2>&1 | tee "$OUT/bench.log" | tail -30
cp benchmarks/results/gpu.md "$OUT/" 2>/dev/null
