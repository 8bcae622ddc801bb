"""pytest plugin (`-p cuda_aot_compile`, scripts/ on PYTHONPATH): every program a test
lowers for CUDA (`.lower(lowering_platforms=("cuda",))`) is also compiled by XLA's GPU
compiler for the GPU that O1JAX_CUDA_TARGET describes (a GpuTargetConfigProto text file,
scripts/gpu_targets/), on a host with no GPU: XLA's deviceless compilation through the
CUDA plugin (jax-cuda12-plugin; run with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1). Triton then
compiles each Pallas kernel for that chip, so what lowering alone cannot show fails here:
a tiling past the shared memory or the registers, an op Triton cannot lower for sm_90.
Used by scripts/device_jax_lowering.sh --compile, with pretend_gpu_kind.

`compile_for_target(lowered)` is the one compile; the session's summary line counts them."""

from __future__ import annotations

import os
import time

import numpy as np

_COMPILED: list[tuple[str, float]] = []
_TARGET = {}


def target_devices(count: int = 1) -> list:
  """`count` compile-only devices of O1JAX_CUDA_TARGET's GPU, one host's (made once)."""
  if count not in _TARGET:
    from jax.experimental import topologies
    path = os.environ["O1JAX_CUDA_TARGET"]
    with open(path) as f:
      config = f.read()
    topology = topologies.get_topology_desc(platform="cuda", topology_name="",
                                            target_config=config, topology=f"1x1x{count}")
    _TARGET[count] = list(topology.devices[:count])
  return _TARGET[count]


def target_device():
  """The compile-only device of O1JAX_CUDA_TARGET's GPU."""
  return target_devices(1)[0]


def compile_for_target(lowered, name: str = "", devices: int = 1):
  """XLA's GPU compile of a Lowered (lowered for "cuda") for the target GPU, or for
  `devices` of them (a program over a mesh of that many: XLA's SPMD partitioner places its
  collectives as on such a machine); raises what the compiler raises."""
  import jax
  from jax._src import compiler
  from jax._src.lib import xla_client as xc
  targets = target_devices(devices)
  options = compiler.get_compile_options(num_replicas=1, num_partitions=devices,
                                         device_assignment=np.array(targets).reshape(1, -1))
  if devices > 1:
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = jax.config.jax_use_shardy_partitioner
  start = time.perf_counter()
  executable = targets[0].client.compile(lowered.compiler_ir("stablehlo"),
                                         executable_devices=xc.DeviceList(tuple(targets)),
                                         compile_options=options)
  _COMPILED.append((name, time.perf_counter() - start))
  return executable


def pytest_configure(config):
  if not os.environ.get("O1JAX_CUDA_TARGET"):
    raise RuntimeError("cuda_aot_compile: set O1JAX_CUDA_TARGET to a GpuTargetConfigProto "
                       "text file (scripts/gpu_targets/h200.txtpb)")
  from jax._src import stages
  lower = stages.Traced.lower

  def lower_and_compile(self, *, lowering_platforms=None, **kwargs):
    lowered = lower(self, lowering_platforms=lowering_platforms, **kwargs)
    if lowering_platforms == ("cuda",):
      compile_for_target(lowered, self.fun_name)
    return lowered

  stages.Traced.lower = lower_and_compile


def pytest_terminal_summary(terminalreporter):
  total = sum(t for _, t in _COMPILED)
  terminalreporter.write_line(
      f"cuda_aot_compile: {len(_COMPILED)} programs compiled for "
      f"{os.path.basename(os.environ.get('O1JAX_CUDA_TARGET', ''))} in {total:.1f} s")
