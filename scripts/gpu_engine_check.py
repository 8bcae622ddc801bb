"""The serving engine on a GPU: Pallas kernels against the XLA reference, and throughput.

No checkpoint travels to the GPU machine (the embedded GGUF is larger than what
one device call may carry), so the model is SmolLM2-135M-*shaped* (576 wide, 9/3
heads of 64, FFN 1536, vocab 49152, tied head) with random weights quantized
like Q4_1 (4-bit, group 32, scale + minimum). Values do not change the work done
per token, so throughput is that of the real model; the correctness check
compares two backends on the same weights, which is what it needs.

  correctness: the engine with backend "pallas" (quantized matmul, paged prefill
    and decode attention kernels) and with backend "reference" (XLA; dense f32
    weights dequantized from the same 4-bit values), random prompts of 5 tokens
    up to --max-prompt,
    greedy, new tokens with logprobs: share of identical tokens (common prefix
    per sequence) and the largest |log p| difference on the common prefix.
  throughput: aggregate generated tok/s at each concurrency, both backends (a
    warm-up run compiles every program the timed run needs first).

  python scripts/gpu_engine_check.py correctness [--layers 2] [--sequences 8] [--max-prompt 120]
      [--new-tokens 16] [--interpret] [--out F]
  python scripts/gpu_engine_check.py throughput [--layers 30] [--concurrency 1,64]
      [--new-tokens 128] [--backends pallas,reference] [--out F]

On a CPU, correctness with --interpret runs the kernels in Pallas interpret
mode (slow; use --layers 1); throughput runs the reference path only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

SMOLLM2_SHAPE = dict(d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                     vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5)


def random_model_params(n_layers: int, seed: int = 0, max_context: int = 2048):
  """(ModelConfig, params) of a SmolLM2-shaped model with 4-bit random weights."""
  from o1jax.model.config import ModelConfig
  from pallas_kernels.quantized_tensor import quantize

  c = ModelConfig(n_layers=n_layers, max_context=max_context, tie_embeddings=True, bos_id=1,
                  eos_ids=(2,), architecture="llama", name="smollm2-shaped-random",
                  **SMOLLM2_SHAPE)
  rng = np.random.default_rng(seed)

  def q4(k, n):  # [K, N] with unit-variance outputs
    return quantize(rng.standard_normal((k, n), np.float32) / np.sqrt(k), bits=4, group_size=32,
                    symmetric=False)

  def norm(n):
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

  d, f, hd = c.d_model, c.ffn_dim, c.head_dim
  layers = [{"attn_norm": norm(d), "wq": q4(d, c.n_heads * hd), "wk": q4(d, c.n_kv_heads * hd),
             "wv": q4(d, c.n_kv_heads * hd), "wo": q4(c.n_heads * hd, d), "ffn_norm": norm(d),
             "w_gate": q4(d, f), "w_up": q4(d, f), "w_down": q4(f, d)} for _ in range(n_layers)]
  # embed is [d_model, vocab] like the GGUF loader's; std 0.15 puts the tied
  # head's logits at std ~3.5 (RMS-normed inputs have norm ~24): log p of the
  # chosen tokens is far from 0, and the top two are rarely near-ties.
  embed = quantize(0.15 * rng.standard_normal((d, c.vocab_size), np.float32), bits=4,
                   group_size=32, symmetric=False)
  return c, {"embed": embed, "layers": layers, "final_norm": norm(d)}


def byte_tokenizer():
  from o1jax.testing import _tiny_tokenizer

  return _tiny_tokenizer()  # ids past its 259 decode to "": only ids are compared here


def make_engine(config, params, backend: str, max_slots: int, interpret: bool = False,
                num_blocks: int = 2048):
  from o1jax.engine import Engine, EngineConfig
  from o1jax.model import Llama

  weight_mode = "dense" if backend == "reference" else "quantized"
  model = Llama(config, params, backend=backend, interpret=interpret, weight_mode=weight_mode)
  cfg = EngineConfig(max_slots=max_slots, num_blocks=num_blocks, prefill_chunk=256,
                     max_prefill_seqs=8, prefix_caching=False, backend=backend,
                     interpret=interpret)
  return Engine(model, byte_tokenizer(), cfg)


def prompts(n: int, seed: int, low: int, high: int, vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, size=int(rng.integers(low, high))).tolist() for _ in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def correctness(args) -> dict:
  from o1jax.engine import GenerationParams, Request

  config, params = random_model_params(args.layers)
  ps = prompts(args.sequences, seed=1, low=5, high=args.max_prompt, vocab=config.vocab_size)
  gp = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=True)
  runs = {}
  for backend in ("reference", "pallas"):
    engine = make_engine(config, params, backend, max_slots=len(ps), interpret=args.interpret)
    t0 = time.perf_counter()
    runs[backend] = engine.generate([Request(p, gp) for p in ps])
    print(f"{backend}: {time.perf_counter() - t0:.1f} s, {sum(engine.trace_counts.values())} "
          f"programs compiled", flush=True)
  same, total, worst = 0, 0, 0.0
  for ref, got in zip(runs["reference"], runs["pallas"]):
    n = common_prefix(ref.token_ids, got.token_ids)
    same += n
    total += len(ref.token_ids)
    if n:
      worst = max(worst, float(np.max(np.abs(np.subtract(ref.logprobs[:n], got.logprobs[:n])))))
  out = {"layers": args.layers, "sequences": len(ps), "new_tokens": args.new_tokens,
         "identical_token_share": same / total, "max_abs_logprob_diff": worst,
         "first_tokens_equal": sum(r.token_ids[0] == g.token_ids[0]
                                   for r, g in zip(runs["reference"], runs["pallas"]))}
  print(f"pallas vs reference: {100 * out['identical_token_share']:.1f}% identical tokens "
        f"(common prefix), first token equal in {out['first_tokens_equal']}/{len(ps)}, "
        f"max |log p diff| {worst:.2e}", flush=True)
  return out


def throughput(args) -> dict:
  from o1jax.engine import GenerationParams, Request

  config, params = random_model_params(args.layers)
  concurrency = [int(c) for c in args.concurrency.split(",")]
  ps = prompts(max(concurrency), seed=2, low=30, high=40, vocab=config.vocab_size)
  gp = GenerationParams(max_new_tokens=args.new_tokens, ignore_eos=True)
  out = {"layers": args.layers, "new_tokens": args.new_tokens, "rows": []}
  for backend in args.backends.split(","):
    for c in concurrency:
      engine = make_engine(config, params, backend, max_slots=c,
                           num_blocks=max(256, c * (args.new_tokens // 16 + 4)))
      batch = [Request(p, gp) for p in ps[:c]]
      t0 = time.perf_counter()
      engine.generate(batch)
      warm = time.perf_counter() - t0
      programs = sum(engine.trace_counts.values())
      t0 = time.perf_counter()
      results = engine.generate(batch)
      wall = time.perf_counter() - t0
      generated = sum(len(r.token_ids) for r in results)
      row = {"backend": backend, "concurrency": c, "gen_tok_s": generated / wall,
             "ms_per_step": 1e3 * wall / args.new_tokens, "warmup_s": warm, "programs": programs,
             "recompiled": sum(engine.trace_counts.values()) - programs}
      out["rows"].append(row)
      print(f"{backend:9s} c={c:4d}: {row['gen_tok_s']:9.1f} gen tok/s, {row['ms_per_step']:.2f} "
            f"ms per decode step (prefill included), warm-up {warm:.0f} s, {programs} programs",
            flush=True)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("mode", choices=("correctness", "throughput"))
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--sequences", type=int, default=8)
  ap.add_argument("--max-prompt", type=int, default=120)
  ap.add_argument("--concurrency", default="1,64")
  ap.add_argument("--backends", default="pallas,reference")
  ap.add_argument("--out")
  args = ap.parse_args(argv)
  import jax

  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  if args.mode == "correctness":
    args.layers = args.layers or 2
    args.new_tokens = args.new_tokens or 16
    result = correctness(args)
  else:
    args.layers = args.layers or 30
    args.new_tokens = args.new_tokens or 128
    result = throughput(args)
  result["device"] = jax.devices()[0].device_kind
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
