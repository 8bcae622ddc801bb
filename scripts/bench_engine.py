"""Engine throughput vs llama.cpp and HF transformers on the embedded SmolLM2-135M (CPU).

Same prompts (chat-templated token ids), same number of new tokens (greedy,
eos ignored), same thread count for every system:
  1. o1jax engine at each concurrency (default 1, 8, 32, 64): a warm-up run
     compiles the bucketed programs, then a timed run; aggregate generated
     tok/s = concurrency * new tokens / wall time (prefill included), prompt
     tok/s from a separate one-new-token run, peak RSS so far;
  2. llama.cpp (llama-cpp-python, optional) single stream: prompt tok/s and
     decode tok/s (tokens after the first / their time);
  3. HF transformers + torch (optional) batched `generate` at 1, 8, 32;
  4. shared 8-shot prefix (~800 tokens) + unique questions: prompt tokens
     actually computed per request (target: the unique suffix only).
Prints a table and the ratios o1jax / llama.cpp and o1jax / transformers.

  python scripts/bench_engine.py [--new-tokens 128] [--concurrency 1,8,32,64]
      [--hf-batches 1,8,32] [--matmul-dtypes float32,bfloat16,int8] [--kv-dtypes float32]
      [--decode-steps 8] [--threads 2] [--skip-llamacpp] [--skip-hf]

--decode-steps 1,8 adds a row per value (decode steps per device call; 1 = one
host round trip per token): the ratio between them is the host's share per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (sibling modules)
from script_args import run_as_script, user_errors  # noqa: E402


def peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


TOPICS = ["apples", "trains", "rivers", "stars", "bread", "cats", "clocks", "bridges", "rain",
          "music", "chess", "coffee", "forests", "glass", "honey", "ice"]
ASKS = ["Explain how {} work in two short paragraphs.", "Write a short story about {}.",
        "List five facts about {} and explain each.", "Why do people like {}? Answer in detail."]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
  """n distinct chat prompts as token ids (about 30-40 tokens each); plain text for a base
  model without a chat template (e.g. gemma3-270m)."""
  out = []
  for i in range(n):
    ask = ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])
    if i >= len(ASKS) * len(TOPICS):
      ask += f" (variant {i})"
    try:
      out.append(tokenizer.encode_chat([{"role": "user", "content": ask}]))
    except ValueError:  # no chat template
      out.append(tokenizer.encode(ask))
  return out


def few_shot_prefix() -> str:
  shots = []
  for i in range(8):
    a, b, c = 12 + 7 * i, 5 + 3 * i, 4 + i
    shots.append(
        f"Question: A farmer has {a} baskets. Each basket holds {b} apples, and the farmer sells "
        f"{c} baskets at the market on Monday and gives away two more baskets to a neighbour on "
        f"Tuesday. How many apples does the farmer have left at the end of the week?\n"
        f"Answer: The farmer starts with {a} baskets. After selling {c} baskets there are {a - c} "
        f"baskets left, and after giving away two there are {a - c - 2} baskets. Each basket "
        f"holds {b} apples, so the farmer has {a - c - 2} * {b} = {(a - c - 2) * b} apples. "
        f"The answer is {(a - c - 2) * b}.\n\n")
  return "".join(shots)


# --- o1jax -------------------------------------------------------------------------


def bench_o1jax(ck, prompts, concurrency: list[int], new_tokens: int,
                matmul_dtype: str = "float32", kv_dtype: str = "float32",
                decode_steps: int = 8, temperature: float = 0.0, top_p: float = 1.0) -> dict:
  from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
  from o1jax.model import Llama

  model = Llama(ck.config, ck.params, matmul_dtype=matmul_dtype)
  out = {}
  for c in concurrency:
    cfg = EngineConfig(max_slots=c, num_blocks=max(256, c * 16), prefill_chunk=256,
                       max_prefill_seqs=8, prefix_caching=False, kv_dtype=kv_dtype,
                       decode_steps=decode_steps,
                       # steady state: every bucket compiled in the warm-up (renting a
                       # bigger program could compile during the timed run)
                       reuse_compiled_shapes=False)
    engine = Engine(model, ck.tokenizer, cfg)
    params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True,
                              temperature=temperature, top_p=top_p, seed=0)
    batch = [Request(p, params) for p in prompts[:c]]
    one = GenerationParams(max_new_tokens=1, ignore_eos=True)
    prompt_only = [Request(p, one) for p in prompts[:c]]
    t0 = time.perf_counter()
    engine.generate(batch)  # compiles every bucket both timed runs need
    engine.generate(prompt_only)
    warm = time.perf_counter() - t0
    traces = sum(engine.trace_counts.values())
    calls_before = engine.metrics.decode_calls
    t0 = time.perf_counter()
    results = engine.generate(batch)
    wall = time.perf_counter() - t0
    calls = engine.metrics.decode_calls - calls_before
    generated = sum(len(r.token_ids) for r in results)
    t0 = time.perf_counter()
    engine.generate(prompt_only)
    prompt_wall = time.perf_counter() - t0
    prompt_tokens = sum(len(p) for p in prompts[:c])
    out[c] = {"gen_tok_s": generated / wall, "prompt_tok_s": prompt_tokens / prompt_wall,
              "wall_s": wall, "warmup_s": warm, "programs": traces,
              "new_traces_after_warmup": sum(engine.trace_counts.values()) - traces,
              "rss_mib": peak_rss_mib(), "first_text": results[0].text[:60],
              "ms_per_step": 1e3 * wall / new_tokens,
              "decode_calls": calls,
              "token_ids": [r.token_ids for r in results]}
    print(f"o1jax {matmul_dtype} kv {kv_dtype} steps {decode_steps} c={c}: "
          f"{out[c]['gen_tok_s']:.1f} gen tok/s, {out[c]['prompt_tok_s']:.1f} "
          f"prompt tok/s (warm-up {warm:.0f} s, {traces} programs)", flush=True)
  return out


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
  """Mean over sequences of (common prefix length / length of want)."""
  shares = []
  for g, w in zip(got, want):
    same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    shares.append(same / max(len(w), 1))
  return sum(shares) / max(len(shares), 1)


def bench_prefix(ck, new_tokens: int = 16) -> list[tuple[int, int]]:
  from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
  from o1jax.model import Llama

  engine = Engine(Llama(ck.config, ck.params), ck.tokenizer,
                  EngineConfig(max_slots=8, num_blocks=1024, prefill_chunk=256,
                               prefix_caching=True, reuse_compiled_shapes=False))
  prefix = few_shot_prefix()
  questions = [f"Question: A baker makes {10 + i} loaves each hour for {3 + i} hours and sells "
               f"{7 + i} loaves. How many are left?\nAnswer:" for i in range(8)]
  params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True)
  results = engine.generate([Request(prefix + q, params) for q in questions])
  n_prefix = len(ck.tokenizer.encode(prefix))
  return n_prefix, [(len(r.prompt_token_ids), r.metrics.prompt_tokens_computed) for r in results]


# --- references ----------------------------------------------------------------------


def bench_llamacpp(gguf_path, prompt: list[int], new_tokens: int, threads: int) -> dict | None:
  try:
    import llama_cpp
  except ImportError as e:
    print(f"llama.cpp: skipped (llama-cpp-python not importable: {e})")
    return None
  from llamacpp_common import disable_extra_buffer_types
  disable_extra_buffer_types()
  llm = llama_cpp.Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads,
                        n_ctx=2048, n_batch=512, verbose=False)
  best = None
  for _ in range(2):  # first run warms caches
    llm.reset()
    t0 = time.perf_counter()
    first = None
    count = 0
    for _tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
      count += 1
      if first is None:
        first = time.perf_counter()
      if count == new_tokens:
        break
    end = time.perf_counter()
    run = {"prompt_tok_s": len(prompt) / (first - t0),
           "decode_tok_s": (count - 1) / (end - first), "gen_tok_s": count / (end - t0)}
    best = run if best is None or run["decode_tok_s"] > best["decode_tok_s"] else best
  best["rss_mib"] = peak_rss_mib()
  print(f"llama.cpp: {best['decode_tok_s']:.1f} decode tok/s, {best['prompt_tok_s']:.1f} prompt tok/s",
        flush=True)
  return best


def bench_transformers(gguf_path, prompts, batches: list[int], new_tokens: int,
                       threads: int) -> dict | None:
  try:
    import torch
    import transformers
  except ImportError as e:
    print(f"transformers: skipped (not importable: {e})")
    return None
  torch.set_num_threads(threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
  model.eval()
  out = {}
  for b in batches:
    rows = prompts[:b]
    width = max(len(p) for p in rows)
    ids = torch.full((b, width), 2, dtype=torch.long)  # left padding
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(rows):
      ids[i, width - len(p):] = torch.tensor(p)
      mask[i, width - len(p):] = 1
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, pad_token_id=2)
    with torch.inference_mode():
      model.generate(ids[:, :], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
      t0 = time.perf_counter()
      gen = model.generate(ids, **kw)
      wall = time.perf_counter() - t0
    generated = (gen.shape[1] - width) * b
    out[b] = {"gen_tok_s": generated / wall, "wall_s": wall, "rss_mib": peak_rss_mib()}
    print(f"transformers b={b}: {out[b]['gen_tok_s']:.1f} gen tok/s", flush=True)
  return out


def run_reference(which: str, args, gguf, prompts) -> dict | None:
  """Runs one reference in a child process: llama.cpp segfaults when it
  generates in a process that has JAX's CPU runtime loaded (and each system's
  peak RSS is then its own). The child prints its result as JSON last."""
  import tempfile

  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump({"gguf": str(gguf), "prompts": prompts}, f)
  cmd = [sys.executable, __file__, "--only", which, "--inputs", f.name, "--new-tokens",
         str(args.new_tokens), "--threads", str(args.threads), "--hf-batches", args.hf_batches]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  os.unlink(f.name)
  lines = [l for l in proc.stdout.splitlines() if l.strip()]
  for line in lines[:-1]:
    print(line)
  if proc.returncode != 0 or not lines:
    print(f"{which}: failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return None
  result = json.loads(lines[-1])
  return {int(k) if k.isdigit() else k: v for k, v in result.items()} if result else None


# --- main ------------------------------------------------------------------------------


@user_errors
def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="embedded",
                  help="a named model (embedded, gemma3-270m) or a .gguf file")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--concurrency", default="1,8,32,64")
  ap.add_argument("--hf-batches", default="1,8,32")
  ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                  help="cores for every system: llama.cpp's and torch's thread count, and the "
                       "CPUs this process (o1jax: XLA's threads, the native kernels) may run on")
  ap.add_argument("--matmul-dtypes", default="float32,bfloat16,int8",
                  help="o1jax rows for each Llama matmul_dtype (float32 = exact reference)")
  ap.add_argument("--kv-dtypes", default="float32",
                  help="o1jax rows for each KV cache dtype (EngineConfig.kv_dtype)")
  ap.add_argument("--decode-steps", default="8", help="decode steps per device call (comma list)")
  ap.add_argument("--skip-llamacpp", action="store_true")
  ap.add_argument("--skip-hf", action="store_true")
  ap.add_argument("--skip-prefix", action="store_true")
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="o1jax rows sample at this temperature (seeded; references stay greedy, "
                       "so a sampled run needs --skip-llamacpp --skip-hf)")
  ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
  ap.add_argument("--only", choices=("llamacpp", "transformers"), help=argparse.SUPPRESS)
  ap.add_argument("--inputs", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.top_p != 1.0 and args.temperature <= 0:
    ap.error("--top-p filters sampled tokens: add --temperature (greedy decoding ignores it)")
  if args.temperature > 0 and not (args.skip_llamacpp and args.skip_hf):
    ap.error("--temperature measures the engine's sampled decode alone: the references "
             "decode greedily; add --skip-llamacpp --skip-hf")
  hf_batches = [int(x) for x in args.hf_batches.split(",") if x]
  cpus = sorted(os.sched_getaffinity(0))
  if not 1 <= args.threads <= len(cpus):
    ap.error(f"--threads {args.threads}: this process may run on {len(cpus)} CPUs")
  if args.threads < len(cpus):  # (before JAX starts; o1jax had used every core regardless)
    os.sched_setaffinity(0, cpus[:args.threads])
  if args.only:  # child process: no JAX here (see run_reference)
    import pathlib

    inputs = json.loads(pathlib.Path(args.inputs).read_text())
    gguf, prompts = pathlib.Path(inputs["gguf"]), inputs["prompts"]
    if args.only == "llamacpp":
      print(json.dumps(bench_llamacpp(gguf, prompts[0], args.new_tokens, args.threads)))
    else:
      print(json.dumps(bench_transformers(gguf, prompts, hf_batches, args.new_tokens, args.threads)))
    return 0

  from o1jax.checkpoint import load_checkpoint
  from o1jax.checkpoint.embedded import resolve_source
  from o1jax.compilation_cache import enable_compilation_cache

  enable_compilation_cache()
  ck = load_checkpoint(args.model)
  gguf = resolve_source(args.model)
  concurrency = [int(x) for x in args.concurrency.split(",") if x]
  prompts = chat_prompts(ck.tokenizer, max(concurrency + hf_batches))
  how = (f"sampled (temperature {args.temperature}, top-p {args.top_p})" if args.temperature > 0
         else "greedy")
  print(f"model {ck.config.name}; {args.new_tokens} new tokens {how}; {args.threads} threads; "
        f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens", flush=True)

  lcpp = None if args.skip_llamacpp else run_reference("llamacpp", args, gguf, prompts)
  hf = None if args.skip_hf else run_reference("transformers", args, gguf, prompts)
  dtypes = [d for d in args.matmul_dtypes.split(",") if d]
  kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
  step_counts = [int(x) for x in args.decode_steps.split(",") if x]
  ours = {}  # row label -> results; the label names the KV dtype when it is not f32
  exact = None  # the first f32-matmul, f32-KV row: the others' tokens are compared with it
  for d in dtypes:
    for kv in kv_dtypes:
      for k in step_counts:
        label = d if kv == "float32" else f"{d}, kv {kv}"
        label += f", {k} steps/call" if len(step_counts) > 1 else ""
        ours[label] = bench_o1jax(ck, prompts, concurrency, args.new_tokens, d, kv, k,
                                  args.temperature, args.top_p)
        if exact is None and d == kv == "float32":
          exact = label

  print("\n| system | matmuls | concurrency | gen tok/s | prompt tok/s | peak RSS MiB | x llama.cpp "
        "| x transformers |")
  print("|---|---|---|---|---|---|---|---|")
  for d, rows in ours.items():
    for c, r in rows.items():
      vs_l = f"{r['gen_tok_s'] / lcpp['decode_tok_s']:.2f}" if lcpp else "-"
      vs_h = f"{r['gen_tok_s'] / hf[c]['gen_tok_s']:.2f}" if hf and c in hf else "-"
      print(f"| o1jax | {d} | {c} | {r['gen_tok_s']:.1f} | {r['prompt_tok_s']:.1f} | "
            f"{r['rss_mib']:.0f} | {vs_l} | {vs_h} |")
  if lcpp:
    print(f"| llama.cpp (decode only) | q8 act. | 1 | {lcpp['decode_tok_s']:.1f} | "
          f"{lcpp['prompt_tok_s']:.1f} | {lcpp['rss_mib']:.0f} | 1.00 | - |")
  for b, r in (hf or {}).items():
    print(f"| transformers | float32 | {b} | {r['gen_tok_s']:.1f} | - | {r['rss_mib']:.0f} | - | 1.00 |")
  for d, rows in ours.items():
    print(f"o1jax {d} steady state: new traces after warm-up per concurrency: "
          f"{ {c: r['new_traces_after_warmup'] for c, r in rows.items()} }")
  if len(step_counts) > 1:
    print("\nms per decode step (wall / new tokens) by decode steps per call:")
    for d, rows in ours.items():
      print(f"  {d}: " + ", ".join(f"c={c}: {r['ms_per_step']:.2f} ms ({r['decode_calls']} calls)"
                                   for c, r in rows.items()))
  if exact is not None:  # (named "float32" only with one steps/call value and f32 KV)
    for d, rows in ours.items():
      if d != exact:
        shares = {c: round(agreement(r["token_ids"], ours[exact][c]["token_ids"]), 3)
                  for c, r in rows.items()}
        print(f"{'sampled' if args.temperature > 0 else 'greedy'} tokens of {d} equal to "
              f"{exact} (share of each sequence before the first difference, mean over "
              f"requests): {shares}")

  if not args.skip_prefix:
    n_prefix, rows = bench_prefix(ck)
    print(f"\nshared 8-shot prefix: {n_prefix} tokens; per request (prompt tokens, computed):")
    for i, (n, computed) in enumerate(rows):
      print(f"  request {i}: prompt {n}, computed {computed}, unique suffix {n - n_prefix}")
  return 0


if __name__ == "__main__":
  run_as_script(main)
