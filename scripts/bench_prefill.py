"""Engine prefill of long prompts: prefill attention implementations side by side (CPU).

Prompts of --prompt-words shuffled words (different in every run, so no prefix is shared),
2 new tokens each, --prompts of them per run; per (backend, prefill_chunk): two warm-up runs,
then --runs timed runs, in alternating order so drift hits every row alike. Backends:
  auto       what the engine uses on a CPU: the blocked XLA prefill attention (key blocks up
             to the chunk's last key, online softmax)
  reference  the whole-width XLA reference (scores over the table's whole width)
Prints prompt tok/s per run and the ratio of each row's mean to the first row's.

  python scripts/bench_prefill.py [--chunks 128,256] [--backends auto,reference]
      [--prompt-words 1300] [--prompts 2] [--runs 2] [--matmul-dtype float32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from o1jax.checkpoint import load_checkpoint
from o1jax.compilation_cache import enable_compilation_cache
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import Llama

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (sibling modules)
from script_args import run_as_script, user_errors  # noqa: E402

WORDS = ("the report says that the committee met on tuesday and agreed to fund the new bridge "
         "over the river while the council asked for a second study of traffic costs").split()


def prompts(rng: random.Random, count: int, words: int) -> list[str]:
  return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


@user_errors
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--source", default="embedded")
  ap.add_argument("--chunks", default="128,256")
  ap.add_argument("--backends", default="auto,reference")
  ap.add_argument("--prompt-words", type=int, default=1300)
  ap.add_argument("--prompts", type=int, default=2)
  ap.add_argument("--runs", type=int, default=2)
  ap.add_argument("--matmul-dtype", default="float32")
  ap.add_argument("--kv-dtype", default="bfloat16")
  args = ap.parse_args(argv)

  enable_compilation_cache()
  ck = load_checkpoint(args.source)
  backends = args.backends.split(",")
  # The model's backend picks its ops' implementations (attention included).
  models = {b: Llama(ck.config, ck.params, backend=b, matmul_dtype=args.matmul_dtype)
            for b in backends}
  rng = random.Random(0)
  rows = [(b, int(c)) for b in backends for c in args.chunks.split(",")]
  engines = {row: Engine(models[row[0]], ck.tokenizer, EngineConfig(
      max_slots=max(args.prompts, 1), prefill_chunk=row[1], kv_cache_bytes=512 << 20,
      kv_dtype=args.kv_dtype, reuse_compiled_shapes=False)) for row in rows}  # timed warm

  def run(row) -> float:
    texts = prompts(rng, args.prompts, args.prompt_words)
    requests = [Request(prompt=t, request_id=i, params=GenerationParams(max_new_tokens=2))
                for i, t in enumerate(texts)]
    tokens = sum(len(ck.tokenizer.encode(t)) for t in texts)
    start = time.perf_counter()
    engines[row].generate(requests)
    return tokens / (time.perf_counter() - start)

  for row in rows:
    run(row), run(row)  # compile every bucket a run uses
  rates = {row: [] for row in rows}
  for i in range(args.runs):
    for row in (rows if i % 2 == 0 else rows[::-1]):
      rates[row].append(run(row))
  base = statistics.mean(rates[rows[0]])
  print(f"{'backend':10} {'chunk':>5}  prompt tok/s per run        mean  x {rows[0][0]}/{rows[0][1]}")
  for row in rows:
    r = rates[row]
    print(f"{row[0]:10} {row[1]:5d}  {' '.join(f'{x:7.1f}' for x in r):26} {statistics.mean(r):6.1f} "
          f"{statistics.mean(r) / base:6.2f}")
  return {row: rates[row] for row in rows}


if __name__ == "__main__":
  run_as_script(main)
