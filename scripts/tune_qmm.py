"""Sweep the quantized matmul kernel's tiling on a GPU for the small-M (decode) shapes.

For each M and each (block_n, k_splits, num_warps, num_stages): time per call
(timed like scripts/bench_kernels.py: 16 calls in one program, dispatch
subtracted, weights cycled through copies larger than the L2), speed-up over
bf16 `jnp.dot`, and the largest error against the XLA reference, so a faster
tiling is also checked to be right. Prints the best per M and writes all rows
as JSON.

  python scripts/tune_qmm.py [--shape 4096x14336] [--ms 1,16] [--out tune.json]

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

from bench_kernels import bench, copies_for, random_q4  # noqa: E402
from pallas_kernels.quantized_matmul import (choose_config, quantized_matmul_pallas,  # noqa: E402
                                              quantized_matmul_reference)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="4096x14336")
  p.add_argument("--ms", default="1,16")
  p.add_argument("--block-n", default="128,256")
  p.add_argument("--k-splits", default="4,8,16")
  p.add_argument("--warps", default="4,8")
  p.add_argument("--stages", default="3,4")
  p.add_argument("--calls", type=int, default=16)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--out")
  a = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  k, n = (int(x) for x in a.shape.split("x"))
  calls = a.calls if on_gpu else 1
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * calls + 2)
  w0 = random_q4(keys[0], k, n)
  ws = [w0] + [random_q4(keys[i], k, n) for i in range(1, copies_for(w0.nbytes, calls))]
  wds = [jax.random.normal(keys[calls + i], (k, n), jnp.bfloat16)
         for i in range(copies_for(2 * k * n, calls))]
  rows = []
  for m in (int(x) for x in a.ms.split(",")):
    xs = [jax.random.normal(kx, (m, k), jnp.bfloat16) for kx in jax.random.split(keys[-1], calls)]
    want = np.asarray(quantized_matmul_reference(xs[0], ws[0]), np.float32)
    scale = float(np.abs(want).max())
    t_dense = bench(jnp.dot, [(x, wds[i % len(wds)]) for i, x in enumerate(xs)], iters=a.iters)
    default = choose_config(m, k, n, w0)
    grid = itertools.product(*(map(int, v.split(",")) for v in (a.block_n, a.k_splits, a.warps,
                                                                  a.stages)))
    for block_n, k_splits, warps, stages in grid:
      kw = dict(block_n=block_n, k_splits=k_splits, num_warps=warps, num_stages=stages,
                interpret=not on_gpu)
      fn = lambda x, w, kw=kw: quantized_matmul_pallas(x, w, **kw)
      try:
        got = np.asarray(jax.jit(fn)(xs[0], ws[0]), np.float32)
        t = bench(fn, [(x, ws[i % len(ws)]) for i, x in enumerate(xs)], iters=a.iters)
      except Exception as e:  # a tiling the kernel or the compiler rejects
        print(f"M={m} bn={block_n} ks={k_splits} w={warps} s={stages}: {type(e).__name__}: "
              f"{str(e)[:120]}", flush=True)
        continue
      err = float(np.abs(got - want).max()) / scale
      row = dict(m=m, block_n=block_n, k_splits=k_splits, warps=warps, stages=stages,
                 us=t * 1e6, dense_us=t_dense * 1e6, speedup=t_dense / t, rel_err=err,
                 default=(block_n, k_splits, warps, stages) == (default[1], default[2], 4, 3))
      rows.append(row)
      print(f"M={m} bn={block_n:4d} ks={k_splits:2d} w={warps} s={stages}: {t * 1e6:8.1f} us "
            f"(dense {t_dense * 1e6:.1f}) x{t_dense / t:5.2f} err {err:.1e}"
            f"{'  <- default' if row['default'] else ''}", flush=True)
  for m in sorted({r["m"] for r in rows}):
    ok = [r for r in rows if r["m"] == m and r["rel_err"] < 2e-2]
    if ok:
      best = min(ok, key=lambda r: r["us"])
      print(f"best M={m}: {json.dumps(best)}")
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps(dict(shape=[k, n], device=str(jax.devices()[0]),
                                                   rows=rows), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
