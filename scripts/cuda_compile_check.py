"""Compile every Pallas kernel at the GPU benchmark's shapes for an H200, on a host with no
GPU: XLA's deviceless compilation (the CUDA plugin and a GpuTargetConfigProto,
scripts/gpu_targets/), so Triton builds each kernel for sm_90 as the GPU check would. The
kernels' tilings depend on the shapes (a 4096x14336 weight, 256 sequences), which the
lowering tests' small cases do not reach: a tiling past the shared memory or an op Triton
cannot lower fails here, before device time is spent.

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=.:scripts python scripts/cuda_compile_check.py \
      [--target scripts/gpu_targets/h200.txtpb] [--out compile.json] [--quick]

Needs jax, jaxlib and jax-cuda12-plugin / -pjrt of one version (scripts/device_jax_lowering.sh
--compile makes such a venv). No arrays are made: the arguments are shapes on the target.
Prints a line per case and a JSON summary; exits 1 when any case does not compile."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from pallas_kernels import ops
from pallas_kernels.quantized_matmul import GEMV_ROW_LIMIT
from pallas_kernels.quantized_tensor import QuantizedTensor

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # (sibling modules)
from bench_kernels import (  # noqa: E402
    LLAMA8B_ATTN, LLAMA8B_QMM, SMOL_ATTN, SMOL_QMM, WEIGHT_FORMATS)
from script_args import output_file  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
# The model's fused quantized q/k/v and gate/up (o1jax/model/llama.py): SmolLM2's and
# Llama-3-8B's.
FUSED_QMM = [(576, 960), (576, 3072), (4096, 6144), (4096, 28672)]
TRITON_CALL = re.compile(r'@__gpu\$xla\.gpu\.triton\(.*?\bname = "([^"]*)"')
BATCHES = (1, 8, 64, 256)


def target_device(path: str):
  """The compile-only device of the GPU that `path` describes; SystemExit in one line where
  this JAX cannot compile for CUDA."""
  config = pathlib.Path(path).read_text()
  try:
    topology = topologies.get_topology_desc(platform="cuda", topology_name="",
                                            target_config=config, topology="1x1x1")
  except Exception as e:  # no CUDA plugin, or its version check
    raise SystemExit(f"cuda_compile_check: this JAX cannot compile for CUDA ({str(e).splitlines()[0]}"
                     f"): install jax-cuda12-plugin and jax-cuda12-pjrt of jax's version and "
                     f"set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (CUDA_COMPILE=1 "
                     f"scripts/device_jax_lowering.sh does)") from None
  return topology.devices[0]


def qmm_cases(quick: bool):
  shapes = SMOL_QMM[:2] + LLAMA8B_QMM[1:2] if quick else LLAMA8B_QMM + SMOL_QMM + FUSED_QMM
  formats = WEIGHT_FORMATS[:2] if quick else WEIGHT_FORMATS
  for name, bits, group, asym, sdt, block in formats:
    for k, n in shapes:
      if k % block:  # no such weight (SmolLM2's K = 576 has no K-quant)
        continue
      for m in ((1, 16, 64) if quick else ROWS):
        # Both kernels where both take M rows: which one `auto` runs is the GPU check's
        # measurement (qmm.GEMV_MAX_ROWS).
        for kernel in ("dot", "gemv") if m <= GEMV_ROW_LIMIT else ("dot",):
          for x_dtype in ("bfloat16", "float8_e4m3fn"):
            yield (f"qmm {name} {kernel} M={m} {k}x{n} x={x_dtype}",
                   dict(kind="qmm", bits=bits, group=group, asym=asym, scale_dtype=sdt,
                        m=m, k=k, n=n, x_dtype=x_dtype, kernel=kernel))


def attention_cases(quick: bool):
  models = [SMOL_ATTN] if quick else [SMOL_ATTN, LLAMA8B_ATTN]
  for name, h, kvh, d in models:
    for batch in ((1, 64) if quick else BATCHES):
      for kv in ("bfloat16", "float8_e4m3fn"):
        for window in (None, 512):
          yield (f"decode {name} B={batch} ctx=4096 kv={kv} window={window}",
                 dict(kind="decode", h=h, kvh=kvh, d=d, batch=batch, ctx=4096, kv=kv,
                      window=window))
    for batch, chunk, start in ((1, 2048, 0), (1, 512, 2048), (4, 512, 0), (64, 32, 1024)):
      for kv in ("bfloat16", "float8_e4m3fn"):
        yield (f"prefill {name} B={batch} T={chunk} start={start} kv={kv}",
               dict(kind="prefill", h=h, kvh=kvh, d=d, batch=batch, chunk=chunk,
                    start=start, kv=kv))


def triton_kernels(lowered) -> list[str]:
  """The Pallas (Triton) kernels a lowered program calls, by name."""
  return sorted(set(TRITON_CALL.findall(lowered.as_text())))


def program(case: dict, spec):
  """(function, argument shapes) of one case."""
  if case["kind"] == "qmm":
    k, n, g = case["k"], case["n"], case["group"]
    packed = spec((k // 2, n), jnp.uint8) if case["bits"] == 4 else spec((k, n), jnp.int8)
    w = QuantizedTensor(packed=packed, scale=spec((k // g, n), case["scale_dtype"]),
                        minimum=spec((k // g, n), case["scale_dtype"]) if case["asym"] else None,
                        bits=case["bits"], group_size=g)
    x = spec((case["m"], k), case["x_dtype"])
    kernel = case["kernel"]
    if case["x_dtype"] == "float8_e4m3fn":
      return (lambda x, w, xs: ops.quantized_matmul(x, w, x_scale=xs, backend="pallas",
                                                    kernel=kernel),
              (x, w, spec((case["m"],), jnp.float32)))
    return lambda x, w: ops.quantized_matmul(x, w, backend="pallas", kernel=kernel), (x, w)
  b, h, kvh, d = case["batch"], case["h"], case["kvh"], case["d"]
  ctx = case.get("ctx") or case["start"] + case["chunk"]
  blocks = -(-ctx // 16)
  pool = spec((b * blocks + 1, 16, kvh, d), case["kv"])
  scale = spec((b * blocks + 1, 16, kvh), jnp.float32) if case["kv"] != "bfloat16" else None
  tables = spec((b, blocks), jnp.int32)
  if case["kind"] == "decode":
    return (lambda q, kp, vp, bt, n, ks, vs: ops.paged_decode_attention(
        q, kp, vp, bt, n, k_scale=ks, v_scale=vs, sliding_window=case["window"],
        backend="pallas"),
        (spec((b, h, d), jnp.bfloat16), pool, pool, tables, spec((b,), jnp.int32), scale, scale))
  return (lambda q, kp, vp, bt, s, c, ks, vs: ops.paged_prefill_attention(
      q, kp, vp, bt, s, c, k_scale=ks, v_scale=vs, backend="pallas"),
      (spec((b, case["chunk"], h, d), jnp.bfloat16), pool, pool, tables,
       spec((b,), jnp.int32), spec((b,), jnp.int32), scale, scale))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default=str(HERE / "gpu_targets" / "h200.txtpb"))
  p.add_argument("--out", default="", type=output_file)
  p.add_argument("--quick", action="store_true", help="a few shapes of each kernel")
  args = p.parse_args(argv)
  import pretend_gpu_kind  # noqa: F401  (Pallas asks the default device for the GPU's kind)
  device = target_device(args.target)
  sharding = SingleDeviceSharding(device)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
  rows = []
  for label, case in [*qmm_cases(args.quick), *attention_cases(args.quick)]:
    start = time.perf_counter()
    try:
      fn, fn_args = program(case, spec)
      lowered = jax.jit(fn).trace(*fn_args).lower()
      kernels = triton_kernels(lowered)
      if not kernels:  # every case is a kernel's: XLA's fallback would compile anything
        raise RuntimeError("no Pallas kernel in the program")
      lowered.compile()
      row = dict(case=label, ok=True, kernels=kernels)
    except Exception as e:  # the compiler's error is the finding
      row = dict(case=label, ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    row["seconds"] = round(time.perf_counter() - start, 2)
    rows.append(row)
    print(f"{'ok ' if row['ok'] else 'ERR'} {label:60s} {row['seconds']:6.2f} s "
          f"{','.join(row.get('kernels', [])) or row.get('error', '')}", flush=True)
  failed = [r for r in rows if not r["ok"]]
  summary = dict(target=pathlib.Path(args.target).name, device_kind=device.device_kind,
                 jax=jax.__version__, cases=len(rows), failed=len(failed), rows=rows)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
  print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
