"""Sweep the quantized matmul kernels' tiling on a GPU for the small-M (decode) shapes.

For each M, kernel ("dot": tensor-core tiles; "gemv": the small-M kernel, M <= 4)
and tiling (block_n, k_splits, num_warps, num_stages; groups per iteration for
gemv): time per call (timed like scripts/bench_kernels.py: 16 calls in one
program, dispatch subtracted, weights cycled through copies larger than the L2),
speed-up over bf16 `jnp.dot`, and the largest error against the XLA reference,
so a faster tiling is also checked to be right. Prints the best per M and
kernel, the dispatch threshold the rows support (`GEMV_MAX_ROWS` in
pallas_kernels/quantized_matmul.py: the largest M up to which gemv's default
tiling beats dot's at every measured M; dispatch runs the defaults) and writes all rows as JSON
(after each row: a run cut short keeps what it measured).

  python scripts/tune_qmm.py [--shape 4096x14336] [--ms 1,16] [--kernels dot,gemv]
                             [--format q4_0] [--group 32] [--defaults-only]
                             [--out tune.json]

On a CPU it runs the kernel in interpret mode at a tiny size (a smoke test of
the script only; timings mean nothing there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_kernels import FORMAT_NAMES, bench, copies_for, random_weight  # noqa: E402
from pallas_kernels.quantized_matmul import (  # noqa: E402
    GEMV_ROW_LIMIT, GEMV_WARPS, choose_config, choose_gemv_config, quantized_gemv_pallas,
    quantized_matmul_pallas, quantized_matmul_reference)
from script_args import output_file  # noqa: E402


def tilings(kernel, m, k, n, w, a):
  """(label, kwargs, is_default) per tiling of `kernel` at this M."""
  ints = lambda v: [int(x) for x in v.split(",")]
  if kernel == "dot":
    _, bn0, ks0 = choose_config(m, k, n, w)
    yield (f"bn={bn0:4d} ks={ks0:2d} w=4 s=3 (default)", dict(block_n=bn0, k_splits=ks0), True)
    if a.defaults_only:
      return
    for bn, ks, warps, stages in itertools.product(ints(a.block_n), ints(a.k_splits),
                                                   ints(a.warps), ints(a.stages)):
      if (bn, ks, warps, stages) != (bn0, ks0, 4, 3):
        yield (f"bn={bn:4d} ks={ks:2d} w={warps} s={stages}",
               dict(block_n=bn, k_splits=ks, num_warps=warps, num_stages=stages), False)
  else:
    bn0, gpi0, ks0 = choose_gemv_config(k, n, w)
    yield (f"bn={bn0:4d} gpi={gpi0:2d} ks={ks0:2d} w={GEMV_WARPS} s=3 (default)",
           dict(block_n=bn0, groups_per_iter=gpi0, k_splits=ks0), True)
    if a.defaults_only:
      return
    for bn, gpi, ks, warps, stages in itertools.product(
        ints(a.gemv_block_n), ints(a.groups_per_iter), ints(a.gemv_k_splits),
        ints(a.gemv_warps), ints(a.stages)):
      if (bn, gpi, ks, warps, stages) != (bn0, gpi0, ks0, GEMV_WARPS, 3):
        yield (f"bn={bn:4d} gpi={gpi:2d} ks={ks:2d} w={warps} s={stages}",
               dict(block_n=bn, groups_per_iter=gpi, k_splits=ks, num_warps=warps,
                    num_stages=stages), False)


def write(path, k, n, fmt, group, gemv_max_rows, rows) -> None:
  """The JSON of the rows so far (gemv_max_rows: None until the sweep is done)."""
  pathlib.Path(path).write_text(json.dumps(dict(shape=[k, n], format=fmt, group=group,
                                                device=str(jax.devices()[0]),
                                                gemv_max_rows=gemv_max_rows, rows=rows),
                                           indent=1))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="4096x14336")
  p.add_argument("--ms", default="1,16")
  p.add_argument("--format", default="q4_0", choices=FORMAT_NAMES, help="weight format")
  p.add_argument("--group", type=int, default=None,
                 help="group size (default: the format's; e.g. 128: GPTQ/AWQ)")
  p.add_argument("--block-n", default="128,256")
  p.add_argument("--k-splits", default="4,8,16")
  p.add_argument("--warps", default="4,8")
  p.add_argument("--stages", default="3,4")
  p.add_argument("--kernels", default="dot", help="dot,gemv")
  p.add_argument("--gemv-block-n", default="256,512")
  p.add_argument("--groups-per-iter", default="1")
  p.add_argument("--gemv-k-splits", default="16,32")
  p.add_argument("--gemv-warps", default="1,2")
  p.add_argument("--defaults-only", action="store_true",
                 help="each kernel's default tiling only (what dispatch runs: the threshold)")
  p.add_argument("--calls", type=int, default=16)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--out", type=output_file)
  a = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  k, n = (int(x) for x in a.shape.split("x"))
  calls = a.calls if on_gpu else 1
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * calls + 2)
  w0 = random_weight(keys[0], k, n, a.format, a.group)
  ws = [w0] + [random_weight(keys[i], k, n, a.format, a.group)
               for i in range(1, copies_for(w0.nbytes, calls))]
  wds = [jax.random.normal(keys[calls + i], (k, n), jnp.bfloat16)
         for i in range(copies_for(2 * k * n, calls))]
  rows = []
  for m in (int(x) for x in a.ms.split(",")):
    xs = [jax.random.normal(kx, (m, k), jnp.bfloat16) for kx in jax.random.split(keys[-1], calls)]
    want = np.asarray(quantized_matmul_reference(xs[0], ws[0]), np.float32)
    scale = float(np.abs(want).max())
    t_dense = bench(jnp.dot, [(x, wds[i % len(wds)]) for i, x in enumerate(xs)], iters=a.iters)
    for kernel in a.kernels.split(","):
      if kernel == "gemv" and m > GEMV_ROW_LIMIT:
        continue
      run = quantized_matmul_pallas if kernel == "dot" else quantized_gemv_pallas
      for label, kw, is_default in tilings(kernel, m, k, n, w0, a):
        fn = lambda x, w, kw=kw, run=run: run(x, w, interpret=not on_gpu, **kw)
        try:
          got = np.asarray(jax.jit(fn)(xs[0], ws[0]), np.float32)
          t = bench(fn, [(x, ws[i % len(ws)]) for i, x in enumerate(xs)], iters=a.iters)
        except Exception as e:  # a tiling the kernel or the compiler rejects
          print(f"M={m} {kernel} {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
          continue
        err = float(np.abs(got - want).max()) / scale
        row = dict(m=m, kernel=kernel, **{key: v for key, v in kw.items()}, us=t * 1e6,
                   dense_us=t_dense * 1e6, speedup=t_dense / t, rel_err=err, default=is_default)
        rows.append(row)
        if a.out:
          write(a.out, k, n, a.format, w0.group_size, None, rows)
        print(f"M={m} {kernel:4s} {label}: {t * 1e6:8.1f} us (dense {t_dense * 1e6:.1f}) "
              f"x{t_dense / t:5.2f} err {err:.1e}{'  <- default' if is_default else ''}",
              flush=True)
  best = {}
  for m in sorted({r["m"] for r in rows}):
    for kernel in a.kernels.split(","):
      ok = [r for r in rows if r["m"] == m and r["kernel"] == kernel and r["rel_err"] < 2e-2]
      if ok:
        best[m, kernel] = min(ok, key=lambda r: r["us"])
        print(f"best M={m} {kernel}: {json.dumps(best[m, kernel])}")
  # Dispatch runs the default tilings, so the threshold compares those.
  default = {(r["m"], r["kernel"]): r for r in rows if r["default"] and r["rel_err"] < 2e-2}
  gemv_max_rows = 0
  for m in sorted({m for m, _ in default}):
    if (m, "gemv") in default and (m, "dot") in default and \
        default[m, "gemv"]["us"] < default[m, "dot"]["us"]:
      gemv_max_rows = m
    else:
      break
  if "gemv" in a.kernels and "dot" in a.kernels:
    print(f"GEMV_MAX_ROWS supported by these rows: {gemv_max_rows}" + (
        "" if on_gpu else " (interpret-mode times: a smoke test, no setting to take)"))
  if a.out:
    write(a.out, k, n, a.format, w0.group_size, gemv_max_rows, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
