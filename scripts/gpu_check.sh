#!/usr/bin/env bash
# Kernel check on a machine with one NVIDIA GPU and JAX (with CUDA) already
# installed; needs no network. Runs the kernel tests in compiled (non-interpret)
# mode, then the benchmark; about 8 minutes at most.
#   scripts/gpu_check.sh OUTDIR
# OUTDIR gets env.txt, tests.log, tests.rc, bench.log, bench.json, bench.rc.
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Leave room for the dense bf16 comparators of the benchmark.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())" 2>&1
} > "$OUT/env.txt"

# Compiled-mode classes only: the *Interpret twins are covered on CPU.
timeout 270 python -m pytest tests/pallas_kernels -q -rA -k "not Interpret" -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
echo $? > "$OUT/tests.rc"

timeout 200 python scripts/bench_kernels.py --iters 10 --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo $? > "$OUT/bench.rc"

echo "tests rc=$(cat "$OUT/tests.rc") bench rc=$(cat "$OUT/bench.rc")"
tail -n 3 "$OUT/tests.log"
cat "$OUT/bench.log"
