"""The native int8 matmul per weight format, side by side: Q4_0, Q8_0, and 16-level codes
(GGUF IQ4_NL / IQ4_XS) as 4-bit indices with a lut against the same values in the 8-bit
layout they took before.

  python scripts/bench_int8_matmul.py [--rows 1,8,32] [--rounds 3] [--layers 30]

The embedded model's matrices (SmolLM2-135M: --layers layers of q, k, v, o, gate, up,
down; random values, each layer its own, so the weights stream from memory as in a
decode step), one jitted program per format and row count (`pallas_kernels.ops.int8_matmul`).
Per round and row count: the median ms per program over its timed calls, and the ratio
of the lut layout to the 8-bit one (below 1: the lut is faster).
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native, ops
from pallas_kernels import vnni_matmul as vm
from pallas_kernels.quantized_tensor import QuantizedTensor, quantize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_f32_matmul import (SHAPES, bench_args, median_ms, print_summary,  # noqa: E402
                              program)  # (same matrices, timing, flags and summary)
# ggml's kvalues_iq4nl: the 16 levels of an IQ4_NL / IQ4_XS nibble.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.int8)


def _iq4(rng, k, n) -> QuantizedTensor:
  codes = IQ4_LEVELS[rng.integers(0, 16, (k, n))]
  scale = (rng.random((k // 32, n)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
  return QuantizedTensor(packed=codes, scale=scale, minimum=None, bits=8, group_size=32)


def _weights(fmt: str, layers: int, rng) -> list:
  out = []
  for _ in range(layers):
    for k, n in SHAPES:
      if fmt == "q4_0":
        w = vm.pack(quantize(rng.standard_normal((k, n)).astype(np.float32), bits=4,
                             group_size=32, symmetric=True))
      elif fmt == "q8_0":
        w = vm.pack(quantize(rng.standard_normal((k, n)).astype(np.float32), bits=8, group_size=32))
      else:
        w = vm.pack(_iq4(rng, k, n))
        assert w.lut is not None
        if fmt == "iq4_8bit":
          w = vm.widened(w)
      out.append(jax.tree.map(jnp.asarray, w))
  return out


def main(argv=None):
  args = bench_args(argv, __doc__, "1,8,32", 30)
  if not native.int8_matmul_available():
    raise SystemExit(f"the native int8 matmul does not run here: "
                     f"{native.unavailable_reason() or 'this CPU has neither AVX512-VNNI nor AVX2'}")
  rng = np.random.default_rng(0)
  formats = ["q4_0", "q8_0", "iq4_lut", "iq4_8bit"]
  weights = {f: _weights(f, args.layers, rng) for f in formats}

  run = program(ops.int8_matmul)
  rows = args.rows
  results = []
  print(f"build {native.int8_matmul_build()}")
  print(f"{'rows':>5} {'round':>5} " + " ".join(f"{f + ' ms':>12}" for f in formats)
        + f" {'lut/8bit':>9}")
  for round_ in range(args.rounds):
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, 1536), np.float32))
      calls = 10 if m <= 8 else 5
      ms = {f: median_ms(run, x, [weights[f]], calls=calls) for f in formats}
      ratio = ms["iq4_lut"] / ms["iq4_8bit"]
      results.append({"rows": m, "round": round_, **{f"{f}_ms": v for f, v in ms.items()},
                      "lut_over_8bit": ratio})
      print(f"{m:5d} {round_:5d} " + " ".join(f"{ms[f]:12.2f}" for f in formats)
            + f" {ratio:9.2f}", flush=True)
  print_summary(results, rows, "lut_over_8bit", "lut/8bit")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "build": native.int8_matmul_build(), "results": results},
                f, indent=1)
  return results


if __name__ == "__main__":
  main()
