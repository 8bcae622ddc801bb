"""What Triton makes of a Pallas kernel for an H200, counted without one: layout conversions,
barriers, global loads by width and async copies in the code it generates.

A conversion between two register layouts of a big tile goes through shared memory with
barriers; inside a loop that streams weights it stalls the stream. Counting them needs no
GPU: XLA compiles each case for the GPU described by scripts/gpu_targets/ (as
scripts/cuda_compile_check.py, whose cases this takes) and dumps Triton's passes.

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=.:scripts python scripts/triton_structure.py \
      [--match 'gemv M=1 4096x14336 x=bfloat16'] [--out structure.json] [--max-big-conversions 0]

Needs the CUDA plugin of jax's version (CUDA_COMPILE=1 scripts/device_jax_lowering.sh).
Per kernel: `conversions` (ttg.convert_layout ops before software pipelining; `big`: of
tiles of 1024 values or more), `barriers` and `global_loads` (by PTX form) in the final
code, `async_copies` (cp.async / TMA: loads the pipeliner overlaps with compute)."""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # (sibling modules)
from script_args import output_file  # noqa: E402

DUMP_MARK = "// -----// IR Dump Before "
# A conversion's source tensor shape ("%50#0" operands, any element type).
CONVERT = re.compile(r'"ttg\.convert_layout"\([^)]*\) : \(tensor<((?:\d+x)+)')
# Copies that load global memory into shared memory without the registers (the pipeliner's
# async copies, TMA), not their commit / wait instructions.
ASYNC_COPY = re.compile(r"cp\.async\.(?:ca|cg)\.shared\.global|cp\.async\.bulk\.tensor")


def structure(dump_text: str) -> dict:
  """Counts of one kernel's Triton dump (every pass's IR, the last one final)."""
  pipeline = dump_text.find(DUMP_MARK + "TritonGPUPipeline")
  if pipeline < 0:
    raise RuntimeError("no TritonGPUPipeline pass in the dump")
  end = dump_text.find(DUMP_MARK, pipeline + 1)
  ttgir = dump_text[pipeline:end if end > 0 else len(dump_text)]
  final = dump_text[dump_text.rfind(DUMP_MARK):]
  sizes = [math.prod(int(d) for d in shape.rstrip("x").split("x"))
           for shape in CONVERT.findall(ttgir)]
  loads = collections.Counter(re.findall(r"ld\.global[a-z0-9.]*", final))
  return dict(conversions=len(sizes), big_conversions=sum(s >= 1024 for s in sizes),
              barriers=final.count("nvvm.barrier") + final.count("bar.sync"),
              global_loads=dict(sorted(loads.items())),
              async_copies=len(ASYNC_COPY.findall(final)))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default=str(HERE / "gpu_targets" / "h200.txtpb"))
  p.add_argument("--match", default="gemv M=1 4096x14336 x=bfloat16",
                 help="cases of cuda_compile_check.py whose label contains this")
  p.add_argument("--out", default="", type=output_file)
  p.add_argument("--max-big-conversions", type=int, default=None,
                 help="exit 1 when a kernel converts more tiles of >= 1024 values than this "
                      "(a guard: the small-M kernel's layout has none)")
  args = p.parse_args(argv)
  if not pathlib.Path(args.target).is_file():
    raise SystemExit(f"triton_structure: --target {args.target} is not a file")
  with tempfile.TemporaryDirectory(prefix="triton_structure_") as dump:  # (10-700 MB a case)
    # Before jax starts: XLA reads its flags once.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_emitter_re=triton.*")
    return _run(args, pathlib.Path(dump))


def _run(args, dump: pathlib.Path) -> int:
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  import cuda_compile_check as ccc
  import pretend_gpu_kind  # noqa: F401  (Pallas asks the default device for the GPU's kind)
  device = ccc.target_device(args.target)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                                   sharding=SingleDeviceSharding(device))
  cases = [(label, case) for label, case in [*ccc.qmm_cases(False), *ccc.attention_cases(False)]
           if args.match in label]
  if not cases:
    raise SystemExit(f"triton_structure: no case matches {args.match!r}")
  rows = []
  for label, case in cases:
    for old in dump.iterdir():  # the previous case's leftovers
      old.unlink()
    start = time.perf_counter()
    try:
      fn, fn_args = ccc.program(case, spec)
      jax.jit(fn).trace(*fn_args).lower().compile()
      # One dump per kernel of the program (`case_compile_s`: the whole program's compile).
      found = [dict(case=label, kernel=path.name.split(".")[1],
                    case_compile_s=round(time.perf_counter() - start, 1),
                    **structure(path.read_text()))
               for path in sorted(dump.glob("*triton-to-llvm.txt"))]
      if not found:
        raise RuntimeError("no Triton kernel was compiled")
    except Exception as e:  # the compiler's error is the finding; the other cases go on
      found = [dict(case=label, error=f"{type(e).__name__}: {str(e)[:300]}")]
    jax.clear_caches()  # the next case's kernels compile (and dump) anew
    for row in found:
      rows.append(row)
      print(json.dumps(row), flush=True)
    if args.out:  # written as measured
      pathlib.Path(args.out).write_text(json.dumps(dict(
          target=pathlib.Path(args.target).name, jax=jax.__version__, rows=rows), indent=1)
          + "\n")
  over = over_limit(rows, args.max_big_conversions)
  for row in over:
    print(f"triton_structure: {row['case']} ({row['kernel']}): {row['big_conversions']} big "
          f"layout conversions, more than {args.max_big_conversions}", flush=True)
  return 1 if over or any("error" in r for r in rows) else 0


def over_limit(rows: list[dict], most: int | None) -> list[dict]:
  """The kernels' rows with more big conversions than `most` (none when it is None)."""
  if most is None:
    return []
  return [r for r in rows if r.get("big_conversions", 0) > most]


if __name__ == "__main__":
  sys.exit(main())
