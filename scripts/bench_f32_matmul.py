"""f32 matmuls of a few rows: XLA's CPU dot against the native tiled kernel, side by side.

  python scripts/bench_f32_matmul.py [--rows 1,2,4,8,16,32,128,512] [--rounds 3] [--layers 30]

The embedded model's matrices (SmolLM2-135M: 30 layers (--layers) of q, k, v, o,
gate, up, down, and the 576 x 49152 head), random f32 values, in one jitted program per
path and row count: `jnp.dot` on the [K, N] arrays (precision HIGHEST, what the
model ran before) and `pallas_kernels.ops.tiled_f32_matmul` on the same values in
column tiles. Per row count: the median ms per program over the timed calls of
each round, and the ratio native / XLA (below 1: the kernel is faster); with
--rounds R, every round's ratio and their range. The rows are what a decode
step (batch), a verify call (batch x (K + 1)) or a prefill chunk multiplies.
"""

from __future__ import annotations

import sys
import pathlib
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import f32_matmul as f32m
from pallas_kernels import native, ops
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import count, counts, output_file  # noqa: E402

LAYERS = 30
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
HEAD = (576, 49152)


def median_ms(fn, *args, calls: int) -> float:
  """Median wall ms of `calls` calls of fn(*args), after one call that compiles."""
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def program(matmul):
  """A jitted run(x, weights) that multiplies x's first K columns by every matrix of
  `weights` (a list of lists) once; the sums keep each product alive."""
  def run(x, weights):
    total = jnp.float32(0)
    for layer in weights:
      for w in layer:
        total = total + matmul(x[:, :w.shape[0]], w).sum()
    return total
  return jax.jit(run)


def bench_args(argv, description: str, rows: str, layers: int) -> argparse.Namespace:
  """The flags of the matmul benches: row counts, rounds, layers, a JSON output."""
  ap = argparse.ArgumentParser(description=description.split("\n")[0])
  ap.add_argument("--rows", type=counts(1), default=rows)
  ap.add_argument("--rounds", type=count(1), default=3)
  ap.add_argument("--layers", type=count(1), default=layers)
  ap.add_argument("--json", type=output_file, default="")
  return ap.parse_args(argv)


def print_summary(results: list[dict], rows: list[int], key: str, label: str) -> None:
  """Per row count: the median of `key` over the rounds and its range (every run shown)."""
  print(f"\nrows  {label} median (range over rounds)")
  for m in rows:
    r = [x[key] for x in results if x["rows"] == m]
    print(f"{m:4d}  {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")


def main(argv=None):
  args = bench_args(argv, __doc__, "1,2,4,8,16,32,128,512", LAYERS)
  if not native.f32_matmul_available():
    raise SystemExit(f"the native f32 matmul does not run here: "
                     f"{native.unavailable_reason() or 'this CPU has no fused multiply-add'}")
  rng = np.random.default_rng(0)
  dense = [[jnp.asarray(rng.standard_normal(s, np.float32)) for s in SHAPES]
           for _ in range(args.layers)] + [[jnp.asarray(rng.standard_normal(HEAD, np.float32))]]
  tiled = [[f32m.pack(w) for w in layer] for layer in dense]

  xla = program(lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
  kernel = program(ops.tiled_f32_matmul)
  rows = args.rows
  results = []
  print(f"{'rows':>5} {'round':>5} {'xla ms':>8} {'native ms':>9} {'native/xla':>10}")
  for round_ in range(args.rounds):
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, 1536), np.float32))
      calls = 10 if m <= 32 else 3
      a = median_ms(xla, x, dense, calls=calls)
      b = median_ms(kernel, x, tiled, calls=calls)
      results.append({"rows": m, "round": round_, "xla_ms": a, "native_ms": b, "ratio": b / a})
      print(f"{m:5d} {round_:5d} {a:8.1f} {b:9.1f} {b / a:10.2f}", flush=True)
  print_summary(results, rows, "ratio", "native/xla")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "results": results}, f, indent=1)
  return results


if __name__ == "__main__":
  main()
