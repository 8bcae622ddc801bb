"""The batch-size latency jump: per-step decode latency, TTFT and bandwidth at batch 1 ... 128.

  python scripts/study_batch_latency.py [--batches 1,2,4,8,16,32,64,128] [--new-tokens 48]
      [--matmul-dtype int8] [--kv-dtype bfloat16] [--json out.json] [--png out.png]

For each batch size b, an engine with b decode slots runs b distinct chat prompts
(30-40 tokens) to `--new-tokens` greedy tokens, eos ignored (a warm-up run compiles
first). Per b: the decode step time (mean gap between a sample's tokens, from the
engine's per-token times), the time to first token (mean over requests: the b
prompts are prefilled in chunks, so it grows with b), the compiled decode batch
(the engine pads b up to its next decode bucket), the bytes one step reads
(every weight once, plus each row's K and V at its mean context), and the achieved
read bandwidth against the machine's peak, measured in the same run as the time of
an XLA sum over a 512 MiB array. The jump: the largest increase of step time from
one batch to the next, and whether it crosses a decode bucket.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from o1jax.checkpoint import load_checkpoint
from o1jax.compilation_cache import enable_compilation_cache
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import Llama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_engine import chat_prompts  # noqa: E402
from o1jax.engine.kv_cache import KV_DTYPES  # noqa: E402
from o1jax.model.layers import MATMUL_DTYPES  # noqa: E402
from script_args import count, counts, output_file, run_as_script, user_errors  # noqa: E402


def peak_read_gb_s(mib: int = 512, repeats: int = 5) -> float:
  """Best of `repeats` XLA sums over `mib` MiB (all cores): the machine's read bandwidth."""
  x = jnp.ones((mib << 20) // 4, jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return x.nbytes / best / 1e9


def weight_bytes(model) -> int:
  """Bytes of weights one decode step reads: every parameter, except the embedding table
  when a separate output head exists (then only the batch's rows of it are read)."""
  from flax import nnx
  _, state = nnx.split(model)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  names = [jax.tree_util.keystr(path) for path, _ in leaves]
  untied = any("lm_head" in n for n in names)
  return int(sum(np.asarray(leaf).nbytes for n, (_, leaf) in zip(names, leaves)
                 if not (untied and n.startswith("['embed']"))))


@user_errors
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--source", default="embedded")
  ap.add_argument("--batches", type=counts(1), default="1,2,4,8,16,32,64,128")
  ap.add_argument("--new-tokens", type=count(1), default=48)
  ap.add_argument("--matmul-dtype", default="int8", choices=MATMUL_DTYPES)
  ap.add_argument("--kv-dtype", default="bfloat16", choices=tuple(KV_DTYPES))
  ap.add_argument("--json", type=output_file, default="")
  ap.add_argument("--png", type=output_file, default="")
  args = ap.parse_args(argv)

  enable_compilation_cache()
  ck = load_checkpoint(args.source)
  model = Llama(ck.config, ck.params, matmul_dtype=args.matmul_dtype)
  mc = model.config
  weights = weight_bytes(model)
  kv_item = jnp.dtype(args.kv_dtype).itemsize
  kv_per_token = mc.n_layers * 2 * mc.n_kv_heads * mc.head_dim * kv_item
  peak = peak_read_gb_s()
  print(f"weights {weights / 2**20:.1f} MiB; KV {kv_per_token} B per token; "
        f"measured peak read {peak:.1f} GB/s")
  batches = args.batches
  prompts = chat_prompts(ck.tokenizer, max(batches))
  params = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  rows = []
  for b in batches:
    engine = Engine(model, ck.tokenizer, EngineConfig(
        max_slots=b, num_blocks=max(256, b * 16), prefill_chunk=256, max_prefill_seqs=8,
        prefix_caching=False, kv_dtype=args.kv_dtype, reuse_compiled_shapes=False))  # timed warm
    requests = [Request(p, params) for p in prompts[:b]]
    engine.generate(requests)  # compile
    results = engine.generate(requests)
    gaps = [t1 - t0 for r in results for times in r.metrics.token_times
            for t0, t1 in zip(times, times[1:])]
    step_s = float(np.mean(gaps))
    ttft_s = float(np.mean([r.metrics.ttft for r in results]))
    context = float(np.mean([len(r.prompt_token_ids) + args.new_tokens / 2 for r in results]))
    step_bytes = weights + b * (context * kv_per_token + mc.d_model * 4)  # + embedding rows
    row = {"batch": b, "decode_batch": engine._decode_rows(b), "step_ms": step_s * 1e3,
           "ttft_ms": ttft_s * 1e3, "tok_s": b / step_s, "bytes_per_step": step_bytes,
           "gb_s": step_bytes / step_s / 1e9, "share_of_peak": step_bytes / step_s / 1e9 / peak}
    rows.append(row)
    print(f"batch {b:3d} (runs as {row['decode_batch']:3d}): step {row['step_ms']:7.1f} ms, "
          f"TTFT {row['ttft_ms']:7.1f} ms, {row['tok_s']:6.1f} tok/s, "
          f"{row['bytes_per_step'] / 2**20:6.1f} MiB/step = {row['gb_s']:5.2f} GB/s "
          f"({row['share_of_peak']:.0%} of peak)", flush=True)
  jumps = [(rows[i + 1]["step_ms"] / rows[i]["step_ms"], i) for i in range(len(rows) - 1)]
  ratio, i = max(jumps) if jumps else (1.0, 0)
  a, c = rows[i], rows[min(i + 1, len(rows) - 1)]
  crosses = a["decode_batch"] != c["decode_batch"]
  jump = {"from": a["batch"], "to": c["batch"], "ratio": ratio, "crosses_bucket": crosses}
  print()
  print("| batch | compiled batch | step ms | TTFT ms | tok/s | MiB read / step | GB/s | of peak |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch']} | {r['decode_batch']} | {r['step_ms']:.1f} | {r['ttft_ms']:.1f} | "
          f"{r['tok_s']:.1f} | {r['bytes_per_step'] / 2**20:.1f} | {r['gb_s']:.2f} | "
          f"{r['share_of_peak']:.0%} |")
  print(f"\nlargest step-time jump: batch {jump['from']} -> {jump['to']}: x{ratio:.2f}"
        + (f" (decode bucket {a['decode_batch']} -> {c['decode_batch']})" if crosses else
           " (same decode bucket)"))
  out = {"args": vars(args), "peak_read_gb_s": peak, "weight_bytes": weights,
         "kv_bytes_per_token": kv_per_token, "rows": rows, "jump": jump}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  if args.png:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    bs = [r["batch"] for r in rows]
    axes[0].plot(bs, [r["step_ms"] for r in rows], "o-", label="decode step")
    axes[0].plot(bs, [r["ttft_ms"] for r in rows], "s--", label="time to first token")
    axes[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="ms",
                title="latency by batch size")
    axes[0].legend()
    axes[1].plot(bs, [r["share_of_peak"] for r in rows], "o-")
    axes[1].set(xscale="log", xlabel="batch", ylabel="share of measured peak read bandwidth",
                title=f"bandwidth (peak {peak:.1f} GB/s)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
  return out


if __name__ == "__main__":
  run_as_script(main)
