#!/usr/bin/env bash
# The CUDA-lowering and kernel tests under the GPU machine's JAX, on this CPU: an API change
# between the JAX here (pyproject.toml, Python 3.11) and the device's (0.11.2, which needs
# Python >= 3.12) shows up before device time is spent on it.
#   scripts/device_jax_lowering.sh [PYTHON>=3.12] [JAX_VERSION] [FLAX_VERSION] [PYTEST ARGS...]
# Makes .venv-devicejax once (jax, jaxlib, flax, orbax and the test dependencies; no Beam:
# the tests run are the model's, the engine's, the controller's, the kernels' and tensor
# parallelism's on 8 forced CPU devices).
#
# CUDA_COMPILE=1 also compiles, for an H200 without one (XLA's deviceless compilation:
# scripts/cuda_aot_compile.py, scripts/gpu_targets/h200.txtpb): every program the tests
# lower, then every Pallas kernel at the GPU benchmark's shapes (scripts/cuda_compile_check.py),
# so Triton builds each kernel for sm_90 here. Its venv, .venv-devicejax-cuda, adds the CUDA
# plugin of the same JAX version (no CUDA libraries: nothing runs on a GPU).
set -eu
PY=${1:-python3.12}
JAX=${2:-0.11.2}
FLAX=${3:-0.12.10}
cd "$(dirname "$0")/.."
COMPILE=${CUDA_COMPILE:-0}
VENV=.venv-devicejax
PLUGINS=()
if [ "$COMPILE" = 1 ]; then
  VENV=.venv-devicejax-cuda
  PLUGINS=("jax-cuda12-plugin==$JAX" "jax-cuda12-pjrt==$JAX")
  export JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 O1JAX_CUDA_TARGET="$PWD/scripts/gpu_targets/h200.txtpb"
fi
CHECK="import jax, sys; sys.exit(jax.__version__ != '$JAX')"
[ "$COMPILE" = 1 ] && CHECK="import jax, jax_cuda12_plugin, sys; sys.exit(jax.__version__ != '$JAX')"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "jax==$JAX" "jaxlib==$JAX" "flax==$FLAX" ${PLUGINS[@]+"${PLUGINS[@]}"} \
    orbax-checkpoint pytest pytest-xdist hypothesis gguf tokenizers safetensors ml-collections \
    absl-py jinja2 "numpy<2.5" scipy
fi
"$VENV/bin/python" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
EXTRA=()
[ "$COMPILE" = 1 ] && EXTRA=(-p cuda_aot_compile)
PYTHONPATH="$PWD:$PWD/scripts" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p pretend_gpu_kind \
  ${EXTRA[@]+"${EXTRA[@]}"} tests/o1jax/engine/test_cuda_lowering.py tests/o1jax/controller/test_cuda_lowering.py \
  tests/pallas_kernels tests/o1jax/model/test_sampling.py \
  tests/o1jax/sharding/test_tensor_parallel.py "${@:4}"
if [ "$COMPILE" = 1 ]; then
  PYTHONPATH="$PWD:$PWD/scripts" "$VENV/bin/python" scripts/cuda_compile_check.py
  # The small-M kernel's layout keeps its tiles in place (docs/measurements/
  # 2026-12-06_gemv_structure.md): a Triton or kernel change that converts them again fails.
  for m in 1 4; do
    PYTHONPATH="$PWD:$PWD/scripts" "$VENV/bin/python" scripts/triton_structure.py \
      --match "gemv M=$m 4096x14336 x=bfloat16" --max-big-conversions 0
  done
fi
