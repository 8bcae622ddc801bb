"""The controller on few-shot prompts, with and without shared prefixes, side by side.

  python scripts/bench_shared_prefix.py [--model embedded] [--requests 16] [--batch 8]
      [--n 8] [--max-thinking 96] [--matmul-dtype int8] [--kv-dtype bfloat16]
      [--rounds 3] [--prompt chat|text] [--json out.json]

GSM-style questions behind the 8 worked examples of pipelines/tasks/gsm8k.py (chat
turns, ~830 tokens on SmolLM2; --prompt text: the plain-text few-shot form), run by
self_consistency (n samples at temperature 0.7) on the paged cache with `--batch`
requests in the loop at once (max_rows = batch x n, as `pipelines.eval` sizes it). Two
controllers on one model: `share_prefixes=True` (an admission computes the shared
few-shot prefix once: `plan_shared_prefixes`) and False (every prompt computes all of
its own). One warm-up round, then --rounds rounds, the two alternating within a round
so a busy machine slows both alike. Per run: the wall time of `generate`, the time
inside the loop calls (decoding), the rest (admissions: prefill, fork; traces), and
generated tok/s; at the end the ratio of walls per round and how many traces are the
same token for token (a difference is a near-tie: the suffix's attention sums its
keys in another order, as a different batch's prompt width already does).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from o1jax.compilation_cache import enable_compilation_cache  # noqa: E402
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import output_file, run_as_script, user_errors  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="embedded", help="checkpoint source (load_checkpoint)")
  p.add_argument("--requests", type=int, default=16)
  p.add_argument("--batch", type=int, default=8, help="requests in the loop at once")
  p.add_argument("--n", type=int, default=8, help="self-consistency samples")
  p.add_argument("--max-thinking", type=int, default=96)
  p.add_argument("--max-answer", type=int, default=12)
  p.add_argument("--matmul-dtype", default="int8")
  p.add_argument("--kv-dtype", default="bfloat16")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--prompt", default="chat", choices=("chat", "text"))
  p.add_argument("--json", type=output_file, default="", help="also write the runs here")
  return p.parse_args(argv)


def questions(count: int) -> list[str]:
  return [f"A farmer has {3 + i} fields with {12 + i} cows in each field. He sells {7 + i} "
          f"cows. How many cows does he have left?" for i in range(count)]


@user_errors
def main(argv=None) -> dict:
  a = parse_args(argv)
  enable_compilation_cache()
  from o1jax.checkpoint import load_checkpoint
  from o1jax.controller import Controller, ReasoningRequest, build_decode_model, get_policy
  from o1jax.model import Llama
  from pipelines.tasks.gsm8k import fewshot_messages, fewshot_prompt

  ck = load_checkpoint(a.model)
  llama = Llama(ck.config, ck.params, matmul_dtype=a.matmul_dtype)
  make = fewshot_messages if a.prompt == "chat" else fewshot_prompt
  requests = [ReasoningRequest(prompt=make(q), request_id=i, seed=0)
              for i, q in enumerate(questions(a.requests))]
  settings = get_policy("self_consistency", n=a.n, temperature=0.7,
                        max_thinking_tokens=a.max_thinking, max_answer_tokens=a.max_answer,
                        step_delimiter="\n").settings()
  decode_model = build_decode_model(llama, {"cache": "paged", "block_size": 16,
                                            "kv_dtype": a.kv_dtype})
  ctls = {share: Controller(decode_model, ck.tokenizer, max_rows=a.batch * a.n,
                            share_prefixes=share) for share in (True, False)}
  prompt_tokens = [len(ctls[True].encode(r.prompt)) for r in requests]
  print(f"{a.requests} requests of {min(prompt_tokens)}-{max(prompt_tokens)} prompt tokens, "
        f"self_consistency n={a.n}, {a.batch} requests at once, {a.matmul_dtype} matmuls, "
        f"{a.kv_dtype} KV", flush=True)
  runs, last = [], {}
  for round_ in range(a.rounds + 1):  # round 0: warm-up (compiles)
    for share, ctl in (ctls.items() if round_ % 2 else reversed(ctls.items())):
      t0 = time.perf_counter()
      batch = ctl.generate(requests, settings, a.n)
      wall = time.perf_counter() - t0
      last[share] = batch
      generated = sum(t.tokens.generated for ts in batch.traces for t in ts)
      run = dict(round=round_, share_prefixes=share, wall_s=wall, loop_s=batch.loop_seconds,
                 outside_loop_s=wall - batch.loop_seconds, generated=generated,
                 tok_s=generated / wall)
      runs.append(run)
      print(f"{'warm-up' if round_ == 0 else f'round {round_}'} share_prefixes={share!s:<5}: "
            f"wall {wall:6.2f} s, loop {batch.loop_seconds:6.2f} s, outside the loop "
            f"{run['outside_loop_s']:6.2f} s, {generated} tokens, {run['tok_s']:6.1f} tok/s",
            flush=True)
  ratios = []
  for round_ in range(1, a.rounds + 1):
    wall = {r["share_prefixes"]: r["wall_s"] for r in runs if r["round"] == round_}
    ratios.append(wall[False] / wall[True])
  same = sum(x.token_ids == y.token_ids
             for xs, ys in zip(last[True].traces, last[False].traces) for x, y in zip(xs, ys))
  total = sum(len(ts) for ts in last[True].traces)
  if ratios:
    print(f"speed-up of shared prefixes (wall without / with), per round: "
          f"{', '.join(f'{r:.2f}x' for r in ratios)}")
  print(f"identical traces: {same} of {total}")
  out = dict(args=vars(a), prompt_tokens=prompt_tokens, runs=runs, speedups=ratios,
             identical_traces=same, traces=total)
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  run_as_script(main)
