"""KV memory and wall time of the controller's two caches, on one long prompt.

  python scripts/bench_controller_cache.py [--model embedded] [--n 8] [--max-thinking 64]

self_consistency (n samples, temperature 0.7) of one few-shot GSM prompt (the
8 worked examples of pipelines/tasks/gsm8k.py as chat turns: ~820 tokens on
SmolLM2), the same settings on ContiguousLlama and on PagedLlama:
  1. KV bytes: contiguous = the forked cache (n rows x the cache length, every
     row holding its copy of the prompt); paged = the pool allocated (sized
     from the controller's plan) and the most blocks in use at once (the
     prompt's blocks once, plus each sample's own);
  2. wall time of `Controller.generate` (prefill, fork, the jitted loop,
     decoding the traces), best of --repeats warm runs, the two caches
     interleaved so a busy machine slows both alike; loop ms per iteration;
  3. whether the two give token-for-token the same traces.
--prompt zero_shot runs the question alone (~60 tokens) instead.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from o1jax.compilation_cache import enable_compilation_cache  # noqa: E402
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import output_file, run_as_script, user_errors  # noqa: E402

QUESTION = ("Tom has 3 boxes with 12 apples each. He gives away 7 apples and buys 5 more. "
            "How many apples does he have now?")
CACHES = ("contiguous", "paged")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="embedded", help="checkpoint source (load_checkpoint)")
  p.add_argument("--n", type=int, default=8, help="self-consistency samples")
  p.add_argument("--prompt", default="fewshot", choices=("fewshot", "zero_shot"),
                 help="zero_shot: the question alone (~60 tokens), for the short-prompt case")
  p.add_argument("--max-thinking", type=int, default=64)
  p.add_argument("--max-answer", type=int, default=12)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--json", type=output_file, default="", help="also write the numbers here")
  return p.parse_args(argv)


def tree_bytes(tree) -> int:
  import jax
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def memory(ctl, request, settings, n: int) -> dict:
  """One run through initial_state + the loop, keeping the cache (also the warm-up)."""
  import jax

  prompts = [ctl.encode(request.prompt)]
  state = ctl.initial_state([request], prompts, settings, n, 0, [-math.inf])
  out = {"prompt_tokens": len(prompts[0]), "cache_length": int(state.tokens.shape[1])}
  if ctl.model.__class__.__name__ == "PagedLlama":
    per_block = ctl.model.bytes_per_block()
    out["prompt_blocks"] = int(state.cache.blocks_in_use)
    state = ctl.loop(settings).run(ctl.model.params, state)
    peak = int(state.cache.peak_blocks)
    out.update(kv_allocated=tree_bytes((state.cache.pages.k_pages, state.cache.pages.v_pages)),
               kv_peak=peak * per_block, pool_blocks=state.cache.blocks.num_blocks,
               peak_blocks=peak)
  else:
    out["kv_allocated"] = out["kv_peak"] = tree_bytes(state.cache)
    state = ctl.loop(settings).run(ctl.model.params, state)
  jax.block_until_ready(state.length)
  return out


@user_errors
def main(argv=None) -> int:
  a = parse_args(argv)
  enable_compilation_cache()
  from o1jax.checkpoint import load_checkpoint
  from o1jax.controller import (Controller, ReasoningRequest, build_decode_model,
                                get_policy)
  from o1jax.model import Llama
  from pipelines.tasks.gsm8k import fewshot_messages, zero_shot_messages

  ck = load_checkpoint(a.model)
  llama = Llama(ck.config, ck.params)
  messages = fewshot_messages if a.prompt == "fewshot" else zero_shot_messages
  request = ReasoningRequest(prompt=messages(QUESTION), request_id=1, seed=0)
  policy = get_policy("self_consistency", n=a.n, temperature=0.7,
                      max_thinking_tokens=a.max_thinking, max_answer_tokens=a.max_answer,
                      step_delimiter="\n")
  settings = policy.settings()
  ctls = {kind: Controller(build_decode_model(llama, {"cache": kind,
                                                            "block_size": a.block_size}),
                           ck.tokenizer, max_rows=a.n) for kind in CACHES}
  rows = {kind: memory(ctl, request, settings, a.n) for kind, ctl in ctls.items()}
  walls = {kind: [] for kind in CACHES}
  batches = {}
  for _ in range(a.repeats):
    for kind, ctl in ctls.items():
      t0 = time.perf_counter()
      batches[kind] = ctl.generate([request], settings, a.n)
      walls[kind].append(time.perf_counter() - t0)
  for kind, b in batches.items():
    rows[kind].update(wall_s=min(walls[kind]), iterations=b.iterations,
                      loop_ms_per_iteration=1e3 * b.loop_seconds / max(b.iterations, 1),
                      generated=sum(t.tokens.generated for t in b.traces[0]))
  same = sum(x.token_ids == y.token_ids
             for x, y in zip(batches["contiguous"].traces[0], batches["paged"].traces[0]))

  c, p = rows["contiguous"], rows["paged"]
  mib = lambda x: f"{x / 2**20:.1f} MiB"
  print(f"self_consistency n={a.n} on {c['prompt_tokens']} prompt tokens, max thinking "
        f"{a.max_thinking}, cache length {c['cache_length']}, block size {a.block_size}; "
        f"paged: {p['prompt_blocks']} prompt blocks, peak {p['peak_blocks']} of a "
        f"{p['pool_blocks']}-block pool")
  print(f"{'cache':<11} {'KV allocated':>13} {'KV peak in use':>15} {'wall s':>8} "
        f"{'loop ms/iter':>13} {'iterations':>11} {'tokens':>7}")
  for kind in CACHES:
    r = rows[kind]
    print(f"{kind:<11} {mib(r['kv_allocated']):>13} {mib(r['kv_peak']):>15} {r['wall_s']:>8.2f} "
          f"{r['loop_ms_per_iteration']:>13.1f} {r['iterations']:>11} {r['generated']:>7}")
  print(f"paged / contiguous: KV allocated {p['kv_allocated'] / c['kv_allocated']:.2f}x, "
        f"peak {p['kv_peak'] / c['kv_peak']:.2f}x, wall {p['wall_s'] / c['wall_s']:.2f}x; "
        f"identical traces: {same}/{a.n}")
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows,
                                                "identical_traces": same}, indent=2))
  return 0


if __name__ == "__main__":
  run_as_script(main)
