"""The engine's programs as an H200 would run them, compiled here without one: what each
decode step launches (Triton kernels, XLA fusions by kind) and what its buffers take. At
concurrency 1 a decode step is bound by kernel launches (issue 14: a step reads 15-60 us
of weights), so the kernels per step are a CPU-side measure of that overhead.

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=.:scripts python scripts/cuda_program_report.py \
      [--layers 30] [--slots 1,64] [--kv-dtype float32] [--tensor-parallel 3] [--out report.json]

--tensor-parallel N: the engine on a mesh of N devices (N forced CPU devices here), its
programs compiled for N H200s; each row also counts the collectives (SmolLM2's 3 KV heads
split 3 ways, not 2).

Needs the CUDA plugin of jax's version (CUDA_COMPILE=1 scripts/device_jax_lowering.sh makes
.venv-devicejax-cuda) and scripts/gpu_targets/h200.txtpb. The model is the GPU check's
SmolLM2-shaped one (random Q4_1 weights, scripts/gpu_engine_check.py); the engine runs
each program on this CPU with XLA's kernels and compiles its twin with the Pallas kernels
for the H200 (`o1jax.testing.cuda_lowering_engine`, as the CUDA-lowering tests)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # (sibling modules)
from script_args import output_file  # noqa: E402

FUSION = re.compile(r" fusion\(.*?calls=%fused_([a-z_]+)")
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
TRITON = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"')


def program_row(name: str, executable, seconds: float) -> dict:
  """Launch and memory figures of one compiled program (its HLO after optimization)."""
  hlo = executable.hlo_modules()[0].to_string()
  stats = executable.get_compiled_memory_stats()
  mib = lambda b: round(b / 2**20, 1)
  fusions = collections.Counter(FUSION.findall(hlo))
  return dict(program=name, compile_s=round(seconds, 1), triton_kernels=len(TRITON.findall(hlo)),
              xla_fusions=sum(fusions.values()), fusions_by_kind=dict(fusions.most_common()),
              while_loops=hlo.count(" while("), copies=hlo.count(" copy("),
              argument_mib=mib(stats.argument_size_in_bytes),
              aliased_mib=mib(stats.alias_size_in_bytes), temp_mib=mib(stats.temp_size_in_bytes),
              # (an async one: its -start; a computation called per layer counts once)
              collectives={op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(")
                           for op in COLLECTIVES})


def report(layers: int, slots: int, kv_dtype: str, tensor_parallel: int = 1) -> list[dict]:
  import time

  import jax
  import numpy as np
  from flax import nnx

  import cuda_aot_compile
  from gpu_engine_check import byte_tokenizer, random_model_params
  from o1jax.engine import EngineConfig, GenerationParams, Request
  from o1jax.model import Llama
  from o1jax.testing import as_if_on_gpu, cuda_lowering_engine

  rows: list[dict] = []

  class CompilingEngine(cuda_lowering_engine()):
    """Compiles each decode / prefill program it lowered for the target GPU."""

    def on_lowered(self, name, lowered):
      if name in ("decode", "prefill"):
        start = time.perf_counter()
        executable = cuda_aot_compile.compile_for_target(lowered, name, tensor_parallel)
        rows.append(dict(program_row(name, executable, time.perf_counter() - start),
                         slots=slots, tensor_parallel=tensor_parallel))

  config, params = random_model_params(layers)
  mesh = None
  with as_if_on_gpu():
    cuda_model = Llama(config, params, backend="pallas", interpret=False,
                       weight_mode="quantized")
    if tensor_parallel > 1:  # (the engine splits its model so; the twin the same way)
      from o1jax.sharding import tensor_parallel as tp
      mesh = jax.make_mesh((1, tensor_parallel), ("data", "model"),
                           devices=jax.devices()[:tensor_parallel])
      cuda_model = tp.shard_model(cuda_model, tp.auto_mesh(mesh))
    cuda_graphdef, _ = nnx.split(cuda_model)
  model = Llama(config, params, backend="reference", weight_mode="quantized")
  engine = CompilingEngine(model, byte_tokenizer(), EngineConfig(
      max_slots=slots, num_blocks=2048, prefill_chunk=256, kv_dtype=kv_dtype,
      max_prefill_seqs=8, prefix_caching=False, decode_steps=8, reuse_compiled_shapes=False),
      mesh=mesh)
  engine.cuda_graphdef = cuda_graphdef
  rng = np.random.default_rng(2)
  prompts = [rng.integers(3, 259, int(rng.integers(30, 40))).tolist() for _ in range(slots)]
  engine.generate([Request(p, GenerationParams(max_new_tokens=9, ignore_eos=True))
                   for p in prompts])
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=30)
  p.add_argument("--slots", default="1,64", help="comma-separated engine slot counts")
  p.add_argument("--kv-dtype", default="float32")
  p.add_argument("--tensor-parallel", type=int, default=1,
                  help="devices the engine's mesh splits the model over (1: one device)")
  p.add_argument("--out", default="", type=output_file)
  args = p.parse_args(argv)
  if args.tensor_parallel < 1:
    p.error(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
  if args.tensor_parallel > 1:  # (before JAX starts: CPU devices to place the mesh on)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={args.tensor_parallel}").strip()
  os.environ.setdefault("O1JAX_CUDA_TARGET", str(HERE / "gpu_targets" / "h200.txtpb"))
  import pretend_gpu_kind  # noqa: F401  (Pallas asks the default device for the GPU's kind)
  rows = []
  from o1jax.sharding import ShardingError
  for slots in (int(s) for s in args.slots.split(",")):
    try:
      program_rows = report(args.layers, slots, args.kv_dtype, args.tensor_parallel)
    except ShardingError as e:  # (SmolLM2's 9 heads and 3 KV heads: 3 ways, not 2)
      p.error(f"--tensor-parallel {args.tensor_parallel}: {e}")
    for row in program_rows:
      rows.append(row)
      collectives = {op: n for op, n in row["collectives"].items() if n}
      print(f"{row['program']:8s} slots={slots:4d} triton={row['triton_kernels']:4d} "
            f"fusions={row['xla_fusions']:4d} (pad {row['fusions_by_kind'].get('pad', 0)}) "
            f"while={row['while_loops']} temp={row['temp_mib']} MiB "
            f"aliased={row['aliased_mib']} MiB compile={row['compile_s']} s"
            + (f" collectives={collectives}" if args.tensor_parallel > 1 else ""), flush=True)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(dict(
        layers=args.layers, kv_dtype=args.kv_dtype, tensor_parallel=args.tensor_parallel,
        rows=rows), indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
