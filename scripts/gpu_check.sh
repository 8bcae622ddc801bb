#!/usr/bin/env bash
# GPU check on a machine with one NVIDIA GPU and JAX (with CUDA) already
# installed; needs no network and no checkpoint. Stages (default: engine, speculative,
# bench: the GPU items of issues 20 and 18 and the kernels' table for 15 and 14; their
# limits add up to 10.5 minutes, a deadline cuts them; compiling dominates: an engine's
# warm-up took 32-111 s on an H200, 2026-12-04):
#   tests       the kernel tests in compiled (non-interpret) mode, and the sampler's
#               tests (its GPU branch: one threshold search over the batch)
#   engine      the engine through the Pallas kernels vs the XLA reference
#               (scripts/gpu_engine_check.py correctness)
#   bench       scripts/bench_kernels.py
#   qmm         the quantized matmul's two kernels (dot, gemv): their default tilings for
#               Q4_1 (the embedded model's) and Q8_0 on 4096x14336, then every tiling at
#               M = 1, 2, 4, 16 on 4096x14336 and 1, 4 on 14336x4096, Q4_0 groups of 32
#               (scripts/tune_qmm.py; each run prints the GEMV_MAX_ROWS its rows support:
#               set the smallest by hand in pallas_kernels/quantized_matmul.py; issue 15)
#   fp8         FP8 activations (matmul_dtype float8) through the Pallas kernels vs the
#               reference, and their decode throughput at concurrency 1/64 (issue 15)
#   throughput  engine decode throughput, Pallas vs reference backend, 8 decode
#               steps per device call, concurrency 1/64/256
#   hoststeps   the reference backend at 1 decode step per call (the host's share)
#   hf          HF transformers bf16 `generate`, same shape, same run
#   ablate      the Pallas path with one op at a time on XLA (what is slow; XLA fuses the
#               4-bit dequantization into an f32 GEMM that costs like the kernel did)
#   loops       the engine's decode loop as a while loop vs a loop of fixed trips (what
#               a GPU runs by default: no host sync per step; o1jax/engine/steps.py
#               fixed_trip_loops), and the while loop under XLA command buffers with
#               WHILE/CONDITIONAL (CUDA graphs' conditional nodes); 8 layers, 1 and 64 rows
#   profile     one warm engine run at concurrency 64 (8 layers) under jax.profiler: the
#               device's busy time against the wall time, the kernels and modules that take it
#   controller  self-consistency n=8 through the controller's loop vs the engine at the
#               same rows (64; issue 14's controller target), both at top-p 0.95 (the
#               policy's default; a random model's flat rows take the threshold search)
#   llama8b     Llama-3-8B shape: int4 engine vs bf16 engine vs HF bf16
#   speculative speculative decoding vs plain at concurrency 1 and 64 (prompt
#               lookup, early exit, a same-weights draft model; issue 18)
#   scripts/gpu_check.sh OUTDIR [STAGES] [SECONDS]
#   STAGES: comma-separated, run in the order listed (default engine,speculative,bench)
#   SECONDS: the whole run's deadline; a stage gets at most what is left less 15 s, and
#   none starts with under 20 s left (default: none)
# OUTDIR gets env.txt and STAGE.log + STAGE.rc (+ STAGE.json) per stage, and
# gpu_check.tar.gz of all of them (or $GPU_CHECK_ARCHIVE), rewritten after each stage (a
# device call brings back a few files only; a call cut at its limit keeps the archive).
# Exit status: 2 without a GPU (nothing run), 1 when a stage failed or was skipped at the
# deadline (its rc is not 0), else 0.
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR [STAGES] [SECONDS]}
STAGES=${2:-engine,speculative,bench}
DEADLINE=$((SECONDS + ${3:-1000000}))
KNOWN=,tests,engine,bench,qmm,fp8,throughput,hoststeps,hf,ablate,loops,profile,controller,llama8b,speculative,
for name in ${STAGES//,/ }; do
  [[ $KNOWN == *,$name,* ]] || { echo "gpu_check.sh: unknown stage '$name' (known: ${KNOWN:1:-1})" >&2; exit 2; }
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Leave room for the dense bf16 comparators of the benchmark.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Stages compile some of the same programs (throughput, ablate, profile): compile once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/o1jax_gpu_check_jax_cache}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__); print(jax.devices())" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"
# (each stage measures a GPU: on a CPU they failed one by one, and the script said 0)
if ! python -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2> /dev/null; then
  echo "gpu_check.sh: no GPU: jax's default backend is not gpu (see $OUT/env.txt)" >&2
  exit 2
fi

pack() {  # the archive of OUTDIR, built beside the archive and renamed over it
  local archive=${GPU_CHECK_ARCHIVE:-$OUT/gpu_check.tar.gz} part
  part=$(mktemp "$(dirname "$archive")/.gpu_check.XXXXXX") || return 1
  if tar -czf "$part" -C "$OUT" --exclude=gpu_check.tar.gz --exclude='.gpu_check.*' \
      --exclude="$(basename "$archive")" .; then
    mv "$part" "$archive"
  else
    rm -f "$part"
  fi
}

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  rm -f "$OUT/$name.rc" "$OUT/$name.json" "$OUT/$name"_*.json  # (an earlier run's in OUTDIR)
  local left=$((DEADLINE - SECONDS - 15))  # 15 s for the log's tail and the archive
  if ((left < 20)); then
    echo "== $name: skipped, $left s left of the deadline" | tee "$OUT/$name.log"
    echo skipped > "$OUT/$name.rc"
    pack
    return 0
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo $? > "$OUT/$name.rc"
  echo "== $name: rc=$(cat "$OUT/$name.rc") in $((SECONDS - t0)) s (limit $limit s)"
  tail -n 25 "$OUT/$name.log"
  pack
}
run_stage() {  # run_stage NAME
  case $1 in
  # Compiled-mode classes only: the *Interpret twins are covered on CPU.
  tests) stage tests 260 python -m pytest tests/pallas_kernels tests/o1jax/model/test_sampling.py \
    -q -rA -k "not Interpret" -p no:cacheprovider ;;
  # No gemm autotuning: the check compiles a dozen programs and only compares results.
  engine) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    stage engine 150 python scripts/gpu_engine_check.py correctness --out "$OUT/engine.json" ;;
  bench) stage bench 240 python scripts/bench_kernels.py --iters 10 --out "$OUT/bench.json" ;;
  # The default tilings of Q4_1 and Q8_0 first (16 programs each: the threshold), then the
  # Q4_0 sweep (~2 compiles of 3-8 s a tiling in deviceless compiles, 2026-12-06: 39
  # tilings on the first shape, 24 on the second; each JSON is written row by row).
  qmm) stage qmm 390 bash -c "for f in q4_1 q8_0; do python scripts/tune_qmm.py --shape 4096x14336 \
    --ms 1,2,4,16 --format \$f --kernels dot,gemv --defaults-only --out '$OUT/qmm_'\$f.json \
    || exit 1; done; for ms in '4096x14336 1,2,4,16' '14336x4096 1,4'; do set -- \$ms; \
    python scripts/tune_qmm.py --shape \$1 --ms \$2 --kernels dot,gemv --block-n 128 \
    --k-splits 8 --warps 4,8 --stages 3 --gemv-block-n 256,512 --groups-per-iter 1 \
    --gemv-k-splits 16,32 --gemv-warps 1,2 --out '$OUT/qmm_'\$1.json || exit 1; done" ;;
  fp8) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    stage fp8 200 bash -c "python scripts/gpu_engine_check.py correctness --matmul-dtype float8 \
    --out '$OUT/fp8_engine.json' && python scripts/gpu_engine_check.py throughput \
    --matmul-dtype float8 --backends pallas --layers 8 --new-tokens 64 --concurrency 1,64 \
    --out '$OUT/fp8_throughput.json'" ;;
  # Six engines (two backends x three concurrencies), compiled at once on threads (one
  # engine's warm-up took 32-111 s alone), then timed one at a time: 300 s.
  throughput) stage throughput 300 python scripts/gpu_engine_check.py throughput \
    --concurrency 1,64,256 --decode-steps 8 --out "$OUT/throughput.json" ;;
  hoststeps) stage hoststeps 90 python scripts/gpu_engine_check.py throughput --concurrency 1,64 \
    --backends reference --decode-steps 1 --out "$OUT/hoststeps.json" ;;
  hf) stage hf 90 python scripts/gpu_engine_check.py hf --concurrency 1,64,256 --out "$OUT/hf.json" ;;
  # 8 layers: each variant compiles its own programs (2026-12-04's 30 layers gave two rows).
  ablate) stage ablate 120 python scripts/gpu_engine_check.py ablate --concurrency 64 \
    --layers 8 --new-tokens 64 --out "$OUT/ablate.json" ;;
  loops) stage loops 240 bash -c "for variant in while fixed while_cmdbuf; do flags=''; \
    [ \$variant = while_cmdbuf ] && flags='--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL'; \
    trips=1; [ \${variant%%_*} = while ] && trips=0; \
    O1JAX_FIXED_TRIP_LOOPS=\$trips XLA_FLAGS=\"\${XLA_FLAGS:-} \$flags\" python \
    scripts/gpu_engine_check.py throughput --layers 8 --new-tokens 64 --concurrency 1,64 \
    --backends pallas --out '$OUT/loops_'\$variant.json || exit 1; done" ;;
  # 8 layers, 64 tokens: the per-layer picture of the 30-layer run at a quarter of its
  # compile time (2026-12-04: 36 s to compile and warm up, 6.8 s traced).
  profile) stage profile 90 python scripts/gpu_engine_check.py profile --layers 8 \
    --new-tokens 64 --concurrency 64 --backends pallas --out "$OUT/profile.json" ;;
  # 8 layers: the controller's and the engine's programs (2026-12-04's 30 layers: no row).
  controller) stage controller 150 python scripts/gpu_engine_check.py controller --concurrency 64 \
    --top-p 0.95 --layers 8 --new-tokens 128 --backends pallas --out "$OUT/controller.json" ;;
  # The peer first (a minute): the engines' compiles may use up the rest.
  llama8b) stage llama8b 240 bash -c "python scripts/gpu_engine_check.py hf --shape llama3-8b \
    --concurrency 1,64 --new-tokens 64 --out '$OUT/llama8b_hf.json'; python \
    scripts/gpu_engine_check.py throughput --shape llama3-8b --concurrency 1,64 \
    --new-tokens 64 --out '$OUT/llama8b.json'" ;;
  # 8 layers, drafts of 1 and 3: every drafter at each K compiles its own programs (47 of
  # them at 2 layers and two concurrencies); 30 layers would not reach 64 sequences.
  speculative) stage speculative 240 python scripts/gpu_engine_check.py speculative \
    --concurrency 1,64 --layers 8 --new-tokens 64 --max-drafts 3 --backends pallas \
    --out "$OUT/speculative.json" ;;
  *) return 1 ;;
  esac
}

failed=()
for name in ${STAGES//,/ }; do
  run_stage "$name"
  [[ -f $OUT/$name.rc && $(cat "$OUT/$name.rc") != 0 ]] && failed+=("$name")
done
if ((${#failed[@]})); then
  echo "gpu_check.sh: stages that failed or were skipped: ${failed[*]} (their logs: $OUT)" >&2
  exit 1
fi
