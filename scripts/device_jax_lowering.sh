#!/usr/bin/env bash
# The CUDA-lowering and kernel tests under the GPU machine's JAX, on this CPU: an API change
# between the JAX here (pyproject.toml, Python 3.11) and the device's (0.11.2, which needs
# Python >= 3.12) shows up before device time is spent on it.
#   scripts/device_jax_lowering.sh [PYTHON>=3.12] [JAX_VERSION] [FLAX_VERSION]
# Makes .venv-devicejax once (jax, jaxlib, flax, orbax and the test dependencies; no Beam:
# the tests run are the model's, the engine's, the controller's and the kernels').
set -eu
PY=${1:-python3.12}
JAX=${2:-0.11.2}
FLAX=${3:-0.12.10}
cd "$(dirname "$0")/.."
VENV=.venv-devicejax
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import jax, sys; sys.exit(jax.__version__ != '$JAX')" 2>/dev/null; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "jax==$JAX" "jaxlib==$JAX" "flax==$FLAX" orbax-checkpoint pytest \
    pytest-xdist hypothesis gguf tokenizers safetensors ml-collections absl-py jinja2 "numpy<2.5" scipy
fi
"$VENV/bin/python" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"
PYTHONPATH="$PWD:$PWD/scripts" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p pretend_gpu_kind \
  tests/o1jax/engine/test_cuda_lowering.py tests/o1jax/controller/test_cuda_lowering.py \
  tests/pallas_kernels tests/o1jax/model/test_sampling.py "${@:4}"
