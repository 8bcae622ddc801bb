"""pytest plugin (`-p pretend_gpu_kind`, scripts/ on PYTHONPATH): Pallas' Triton lowering
asks the default device for the GPU's kind from JAX 0.11 on, so a CPU-only host cannot
lower a kernel for CUDA; this answers an H200 (the GPU machine's) where there is no GPU.
Used by scripts/device_jax_lowering.sh only; the suite itself runs on the JAX of
pyproject.toml, which does not ask."""

from jax._src.pallas.triton import gpu_info

_device_info = gpu_info.get_gpu_info


def _info_or_h200():
  try:
    return _device_info()
  except ValueError:  # no GPU here: the device this lowering is for
    return gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)


gpu_info.get_gpu_info = _info_or_h200
