"""Benchmark the Pallas kernels against plain XLA and the chip's peak.

For every kernel and shape: median time, achieved bytes/s and FLOP/s, speedup
over the same op done densely in bf16 XLA (`jnp.dot` / contiguous-KV attention),
and the fraction of the chip's HBM bandwidth / bf16 peak. On GPU the op runs
the Pallas kernel; elsewhere (CPU) it runs the XLA reference, so the numbers
only say the reference path is usable.

  python scripts/bench_kernels.py [--quick] [--out results.json] [--only qmm,decode,prefill]
                                  [--formats q4_0,q4_1]
"""

from __future__ import annotations

import pathlib
import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ops
from pallas_kernels.paged_attention import decode_bytes_and_flops
from pallas_kernels.prefill_attention import prefill_bytes_and_flops
from pallas_kernels.quantized_matmul import flops_and_bytes
from pallas_kernels.quantized_tensor import QuantizedTensor
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import output_file  # noqa: E402

# Dense (no sparsity) peaks: HBM bytes/s, bf16 FLOP/s.
PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100 SXM": (3.35e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),
}

LLAMA8B_QMM = [(4096, 4096), (4096, 14336), (14336, 4096)]
SMOL_QMM = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
# (name, bits, group, asymmetric (a minimum per group), scale dtype, K's block): the GGUF
# formats as the loader hands them to the kernels (legacy formats keep f16 scales;
# K-quants f32, in super-blocks of 256 rows).
WEIGHT_FORMATS = [("q4_0", 4, 32, False, jnp.float16, 32), ("q4_1", 4, 32, True, jnp.float16, 32),
                  ("q8_0", 8, 32, False, jnp.float16, 32), ("q4_k", 4, 32, True, jnp.float32, 256),
                  ("q6_k", 8, 16, False, jnp.float32, 256), ("q8_k", 8, 256, False, jnp.float32, 256)]
FORMAT_NAMES = [f[0] for f in WEIGHT_FORMATS]
# (name, heads, kv_heads, head_dim)
LLAMA8B_ATTN = ("llama3-8b", 32, 8, 128)
SMOL_ATTN = ("smollm2-135m", 9, 3, 64)


def chip_peaks():
  dev = jax.devices()[0]
  kind = getattr(dev, "device_kind", dev.platform)
  for name, peaks in PEAKS.items():
    if name.lower() in kind.lower():
      return kind, peaks
  return kind, None


# Last-level cache of the GPUs above (H100/H200: 50-60 MB); weights and KV pools are
# replicated until the copies one timed program cycles through exceed 3x this, so
# each call reads its operands from HBM rather than from the L2.
L2_BYTES = 60 * 2 ** 20


def copies_for(nbytes: int, calls: int) -> int:
  """How many distinct copies of an operand of nbytes the calls rotate through."""
  return max(1, min(calls, -(-3 * L2_BYTES // max(nbytes, 1))))


def bench(fn, calls: list[tuple], iters: int = 10, warmup: int = 2) -> float:
  """Median seconds per call of fn(*args) over `calls`, a list of argument tuples.

  All calls run inside one jitted program, and the time of a program that takes
  the same arguments but does next to nothing (one tiny kernel) is subtracted:
  on a GPU the host's dispatch (~0.1 ms) would otherwise swamp kernels of a few
  microseconds. The calls' activations are distinct arrays, so XLA cannot merge
  the calls."""

  def median_time(f):
    for _ in range(warmup):
      jax.block_until_ready(f(calls))
    times = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(f(calls))
      times.append(time.perf_counter() - t0)
    return float(np.median(times))

  t = median_time(jax.jit(lambda calls: [fn(*a) for a in calls]))
  overhead = median_time(jax.jit(lambda calls: calls[0][0] + 1))
  return max(t - overhead, 1e-9) / len(calls)


def report(rows, name, t, t_dense, nbytes, flops, peaks, extra="", **fields):
  row = dict(name=name, ms=t * 1e3, dense_ms=t_dense * 1e3, speedup_vs_dense=t_dense / t,
             gbytes_per_s=nbytes / t / 1e9, tflops=flops / t / 1e12, **fields)
  line = (f"{name:<44s} {t * 1e3:9.3f} ms  dense {t_dense * 1e3:9.3f} ms  x{t_dense / t:5.2f}  "
          f"{nbytes / t / 1e9:8.1f} GB/s  {flops / t / 1e12:7.2f} TFLOP/s")
  if peaks:
    row["hbm_frac"] = nbytes / t / peaks[0]
    row["flop_frac"] = flops / t / peaks[1]
    line += f"  {100 * row['hbm_frac']:5.1f}% HBM  {100 * row['flop_frac']:5.1f}% bf16"
  print(line + extra, flush=True)
  rows.append(row)
  if CHECKPOINT is not None:  # each row written as it is measured (a cut stage keeps it)
    CHECKPOINT(rows)


CHECKPOINT = None  # main(): writes the rows so far to --out


def failed_case(rows, name: str, e: Exception) -> None:
  """An error row for one shape; the sweep goes on (one exception ended the rest of its
  kernel's shapes)."""
  print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
  rows.append(dict(name=name, error=f"{type(e).__name__}: {e}"))
  if CHECKPOINT is not None:
    CHECKPOINT(rows)


def random_weight(key, k, n, fmt="q4_0", group=None):
  """A random weight of one of WEIGHT_FORMATS built on the device (no host quantization of
  big matrices): uniform codes, scales in [0.001, 0.01), an asymmetric format's minimum
  -2^(bits-1) x scale (the values of its symmetric twin; the kernel reads it all the same).
  `group` overrides the format's (e.g. 128: GPTQ/AWQ)."""
  name, bits, default_group, asym, scale_dtype, block = WEIGHT_FORMATS[FORMAT_NAMES.index(fmt)]
  group = group or default_group
  if k % max(group, block):
    raise ValueError(f"random_weight: K={k} is not a multiple of {fmt}'s block "
                     f"{max(group, block)}")
  k1, k2 = jax.random.split(key)
  if bits == 4:
    packed = jax.random.randint(k1, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
  else:
    packed = jax.random.randint(k1, (k, n), -128, 128, jnp.int32).astype(jnp.int8)
  scale = jax.random.uniform(k2, (k // group, n), jnp.float32, 0.001, 0.01)
  minimum = (-(2 ** (bits - 1)) * scale).astype(scale_dtype) if asym else None
  return QuantizedTensor(packed=packed, scale=scale.astype(scale_dtype), minimum=minimum,
                         bits=bits, group_size=group)


def bench_qmm(rows, peaks, backend, quick, iters, calls, fmt="q4_0", targets_only=False):
  """One format's rows: every shape, or (targets_only) the Llama-3-8B FFN shapes the
  targets name (quick: the first shape)."""
  shapes = SMOL_QMM[:3] if quick else LLAMA8B_QMM + SMOL_QMM
  if targets_only:
    shapes = shapes[:1] if quick else LLAMA8B_QMM[1:]
  ms = (1, 8) if quick else (1, 8, 16, 64, 256)
  for k, n in shapes:
    try:
      _bench_qmm_shape(rows, peaks, backend, iters, calls, ms, k, n, fmt)
    except Exception as e:  # noqa: BLE001
      failed_case(rows, f"qmm {fmt} {k}x{n}", e)


def _bench_qmm_shape(rows, peaks, backend, iters, calls, ms, k, n, fmt):
  """The rows of one weight shape and format (`bench_qmm`)."""
  keys = jax.random.split(jax.random.PRNGKey(k * 7 + n), 2 * calls + 1)
  w0 = random_weight(keys[0], k, n, fmt)
  ws = [w0] + [random_weight(keys[i], k, n, fmt)
               for i in range(1, copies_for(w0.nbytes, calls))]
  wds = [jax.random.normal(keys[calls + i], (k, n), jnp.bfloat16)
         for i in range(copies_for(2 * k * n, calls))]
  for m in ms:
    xs = [jax.random.normal(kx, (m, k), jnp.bfloat16)
          for kx in jax.random.split(keys[-1] + m, calls)]
    quantized = [(x, ws[i % len(ws)]) for i, x in enumerate(xs)]
    t = bench(lambda x, w: ops.quantized_matmul(x, w, backend=backend), quantized, iters=iters)
    td = bench(jnp.dot, [(x, wds[i % len(wds)]) for i, x in enumerate(xs)], iters=iters)
    # What dispatch could take instead on the same weights: XLA's dequantize + dot
    # (it fuses the dequantization into the product).
    tx = t if backend == "reference" else bench(
        lambda x, w: ops.quantized_matmul(x, w, backend="reference"), quantized, iters=iters)
    flops, nbytes = flops_and_bytes(m, k, n, w0)
    report(rows, f"qmm {fmt} g{w0.group_size} M={m} {k}x{n}", t, td, nbytes, flops, peaks,
           extra=f"  xla dequant {tx * 1e3:9.3f} ms  x{tx / t:5.2f}",
           xla_dequant_ms=tx * 1e3, speedup_vs_xla_dequant=tx / t)
  del ws, wds


def make_cache(key, batch, ctx, kvh, d, bs=16, dtype=jnp.bfloat16):
  nbp = -(-ctx // bs)
  nb = batch * nbp
  k1, k2, k3 = jax.random.split(key, 3)
  kp = jax.random.normal(k1, (nb, bs, kvh, d), dtype)
  vp = jax.random.normal(k2, (nb, bs, kvh, d), dtype)
  bt = jax.random.permutation(k3, nb).reshape(batch, nbp).astype(jnp.int32)
  return kp, vp, bt


def dense_decode(q, k, v):
  """Contiguous-KV bf16 attention of one query per sequence: q [B,H,D], k/v [B,L,KVH,D]."""
  b, h, d = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, kvh, h // kvh, d)
  s = jnp.einsum("bgrd,blgd->bgrl", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("bgrl,blgd->bgrd", p, v).reshape(b, h, d)


def bench_decode(rows, peaks, backend, quick, iters, calls):
  if quick:
    cases = [(SMOL_ATTN, 2, 256)]
  else:
    cases = [(LLAMA8B_ATTN, b, c) for b in (1, 8, 64) for c in (1024, 4096)]
    cases += [(SMOL_ATTN, 8, 2048)]
  for (name, h, kvh, d), batch, ctx in cases:
    try:
      keys = jax.random.split(jax.random.PRNGKey(batch * 31 + ctx), 3 * calls)
      nbytes, flops = decode_bytes_and_flops(batch, h, kvh, d, ctx)
      c = copies_for(nbytes, calls)
      caches = [make_cache(keys[i], batch, ctx, kvh, d) for i in range(c)]
      dense = [jax.random.normal(keys[calls + i], (batch, ctx, kvh, d), jnp.bfloat16)
               for i in range(c)]
      qs = [jax.random.normal(keys[2 * calls + i], (batch, h, d), jnp.bfloat16)
            for i in range(calls)]
      lengths = jnp.full((batch,), ctx, jnp.int32)
      t = bench(lambda *a: ops.paged_decode_attention(*a, backend=backend),
                [(q, *caches[i % c], lengths) for i, q in enumerate(qs)], iters=iters)
      td = bench(dense_decode, [(q, dense[i % c], dense[i % c]) for i, q in enumerate(qs)],
                 iters=iters)
      report(rows, f"decode {name} B={batch} ctx={ctx}", t, td, nbytes, flops, peaks)
      if not quick and ctx == 4096 and batch > 1:
        # FP8 pools (a scale per token and KV head, as the engine's): half the KV bytes
        # plus 4 per token and head; the "dense" column here is the bf16 pool's paged
        # time, so x is FP8's speed-up over bf16 KV.
        f8 = lambda p: p.astype(jnp.float8_e4m3fn)
        caches8 = [(f8(kp), f8(vp), bt, jnp.ones(kp.shape[:3], jnp.float32))
                   for kp, vp, bt in caches]
        t8 = bench(lambda q, kp, vp, bt, sc, lengths: ops.paged_decode_attention(
            q, kp, vp, bt, lengths, k_scale=sc, v_scale=sc, backend=backend),
            [(q, *caches8[i % c], lengths) for i, q in enumerate(qs)], iters=iters)
        nbytes8, _ = decode_bytes_and_flops(batch, h, kvh, d, ctx, kv_itemsize=1)
        nbytes8 += 2 * batch * ctx * kvh * 4  # the scales
        report(rows, f"decode fp8 KV {name} B={batch} ctx={ctx}", t8, t, nbytes8, flops, peaks)
        del caches8
      del caches, dense
    except Exception as e:  # noqa: BLE001  (the next case runs)
      failed_case(rows, f"decode {name} B={batch} ctx={ctx}", e)


def dense_prefill(q, k, v, start):
  """Contiguous-KV causal attention: q [B,T,H,D], k/v [B,L,KVH,D] with L = start + T."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d)
  s = jnp.einsum("btgrd,blgd->bgrtl", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
  mask = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(t)[:, None]
  s = jnp.where(mask, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("bgrtl,blgd->btgrd", p, v).reshape(b, t, h, d)


def bench_prefill(rows, peaks, backend, quick, iters, calls):
  if quick:
    cases = [(SMOL_ATTN, 1, 64, 0)]
  else:
    cases = [(LLAMA8B_ATTN, 1, 2048, 0), (LLAMA8B_ATTN, 1, 512, 2048), (LLAMA8B_ATTN, 4, 512, 0),
             (SMOL_ATTN, 4, 256, 256)]
  for (name, h, kvh, d), batch, chunk, start in cases:
    try:
      ctx = start + chunk
      keys = jax.random.split(jax.random.PRNGKey(batch * 31 + ctx + start), 3 * calls)
      nbytes, flops = prefill_bytes_and_flops(batch, chunk, h, kvh, d, start)
      c = copies_for(nbytes, calls)
      caches = [make_cache(keys[i], batch, ctx, kvh, d) for i in range(c)]
      dense = [jax.random.normal(keys[calls + i], (batch, ctx, kvh, d), jnp.bfloat16)
               for i in range(c)]
      qs = [jax.random.normal(keys[2 * calls + i], (batch, chunk, h, d), jnp.bfloat16)
            for i in range(calls)]
      starts = jnp.full((batch,), start, jnp.int32)
      clens = jnp.full((batch,), chunk, jnp.int32)
      t = bench(lambda *a: ops.paged_prefill_attention(*a, backend=backend),
                [(q, *caches[i % c], starts, clens) for i, q in enumerate(qs)], iters=iters)
      td = bench(lambda q, k, v: dense_prefill(q, k, v, start),
                 [(q, dense[i % c], dense[i % c]) for i, q in enumerate(qs)], iters=iters)
      report(rows, f"prefill {name} B={batch} T={chunk} start={start}", t, td, nbytes, flops, peaks)
      del caches, dense
    except Exception as e:  # noqa: BLE001  (the next case runs)
      failed_case(rows, f"prefill {name} B={batch} T={chunk} start={start}", e)


def check_targets(rows) -> list[dict]:
  """The kernels issue's H200 targets, from the rows measured (skips absent rows)."""
  by_name = {r["name"]: r for r in rows if "error" not in r}
  out = []
  # Issue 15's: the 4-bit formats on the Llama-3-8B FFN shapes.
  for fmt in ("q4_0", "q4_1"):
    for shape in ("4096x14336", "14336x4096"):
      for m, least in ((1, 3.0), (8, 3.0), (16, 3.0), (64, 1.0)):
        r = by_name.get(f"qmm {fmt} g32 M={m} {shape}")
        if r:
          out.append(dict(target=f"qmm {fmt} M={m} {shape} >= {least:g}x bf16 jnp.dot",
                          value=r["speedup_vs_dense"], met=r["speedup_vs_dense"] >= least))
    r = by_name.get(f"qmm {fmt} g32 M=1 4096x14336")
    if r and "hbm_frac" in r:
      out.append(dict(target=f"qmm {fmt} M=1 4096x14336 >= 70% of HBM peak",
                      value=r["hbm_frac"], met=r["hbm_frac"] >= 0.70))
  r = by_name.get("decode llama3-8b B=64 ctx=4096")
  if r and "hbm_frac" in r:
    out.append(dict(target="paged decode B=64 ctx=4096 >= 70% of HBM peak", value=r["hbm_frac"],
                    met=r["hbm_frac"] >= 0.70))
  # Dispatch (`backend="auto"`) must never take the slower of the kernel and XLA's
  # dequantize + dot: the largest M from which XLA is faster on every shape measured.
  qmm = [r for r in by_name.values() if r["name"].startswith("qmm ") and
         "speedup_vs_xla_dequant" in r]
  for r in qmm:
    if r["speedup_vs_xla_dequant"] < 1.0:
      print(f"dispatch: {r['name']}: the kernel is {r['speedup_vs_xla_dequant']:.2f}x XLA's "
            f"dequantize + dot")
  if qmm:
    m_of = lambda r: int(r["name"].split("M=")[1].split()[0])
    ms = sorted({m_of(r) for r in qmm})
    ok = {m: all(r["speedup_vs_xla_dequant"] >= 1.0 for r in qmm if m_of(r) == m) for m in ms}
    # The kernel up to the largest M before its first loss (every shape), XLA above it.
    limit = None if all(ok.values()) else max([0] + [m for i, m in enumerate(ms)
                                                    if all(ok[x] for x in ms[:i + 1])])
    print(f"dispatch: set quantized_matmul.PALLAS_MAX_ROWS = {limit} (None: the kernel won at "
          f"every M measured)")
    out.append(dict(target="4-bit matmul never slower than XLA's dequantize + dot",
                    value=min(r["speedup_vs_xla_dequant"] for r in qmm), met=all(ok.values()),
                    pallas_max_rows=limit))
  for t in out:
    print(f"target: {t['target']}: {t['value']:.2f} -> {'met' if t['met'] else 'NOT met'}")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="a few small shapes (CPU smoke run)")
  p.add_argument("--out", type=output_file, help="write the rows as JSON here")
  p.add_argument("--only", default="qmm,decode,prefill", help="comma-separated kernels")
  p.add_argument("--formats", default="q4_0,q4_1",
                 help=f"weight formats of the quantized matmul ({', '.join(FORMAT_NAMES)}): "
                      f"the first on every shape, the others on the Llama-3-8B FFN shapes")
  p.add_argument("--iters", type=int, default=None)
  p.add_argument("--calls", type=int, default=None,
                 help="calls of the op per timed program (default 16 on GPU, 2 elsewhere)")
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  backend = "pallas" if on_gpu else "reference"
  iters = args.iters or (20 if on_gpu else 3)
  calls = args.calls or (16 if on_gpu else 2)
  kind, peaks = chip_peaks()
  print(f"jax {jax.__version__} on {kind} ({jax.default_backend()}); op backend={backend}; "
        f"peaks={peaks}", flush=True)
  rows = []
  global CHECKPOINT

  def write(rows, targets=None):  # (the targets are read once, at the end)
    with open(args.out, "w") as f:
      json.dump(dict(jax=jax.__version__, device=kind, backend=backend, calls=calls, rows=rows,
                     targets=targets), f, indent=1)

  CHECKPOINT = write if args.out else None
  only = set(args.only.split(","))
  if not only <= {"qmm", "decode", "prefill"}:  # (a typo ran nothing and said 0)
    p.error(f"--only {args.only!r}: expected comma-separated kernels of qmm, decode, prefill")
  formats = tuple(args.formats.split(","))
  for fmt in formats:
    if fmt not in FORMAT_NAMES:
      p.error(f"--formats: unknown format {fmt!r} (known: {', '.join(FORMAT_NAMES)})")
  # The first format on every shape, then the attention kernels, then the other formats on
  # the targets' shapes (rows are written as measured: a stage cut short keeps the first
  # three tables whole).
  kernels = [("qmm", functools.partial(bench_qmm, fmt=formats[0])), ("decode", bench_decode),
             ("prefill", bench_prefill)]
  kernels += [("qmm", functools.partial(bench_qmm, fmt=f, targets_only=True))
              for f in formats[1:]]
  for name, fn in kernels:
    if name in only:
      try:
        fn(rows, peaks, backend, args.quick, iters, calls)
      except Exception as e:  # keep the other kernels' numbers when one fails
        print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
        rows.append(dict(name=name, error=f"{type(e).__name__}: {e}"))
  # The targets and the dispatch rule compare the Pallas kernels with XLA: off a GPU the
  # op is XLA's on both sides (a "met" by construction).
  targets = check_targets(rows) if backend == "pallas" else None
  if targets is None:
    print(f"targets and dispatch: not judged (op backend {backend}: the kernels run on a GPU)")
  if args.out:
    write(rows, targets)
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
