"""The tensor-parallel engine against one device, on forced CPU devices, in one run.

  python scripts/bench_tensor_parallel.py [--model embedded] [--tp 3] [--dp 2] [--devices 8]
      [--prompts 8] [--new-tokens 32] [--repeats 2]

For each of one device, a TP group of --tp devices (`Engine(mesh=...)`) and --dp engine
replicas of one device each (`EngineReplicas`, data parallelism; 0 = skip): greedy
generation of the same chat prompts (warm-up until nothing compiles, then --repeats
timed runs), generated tok/s, whether the tokens equal the one-device ones (and where
the first fork is, with the one-device top-2 logit gap there: a near-tie), and the
compiled decode step's collective ops (two all-reduces per layer expected, no
all-gather). On one CPU the split is expected to be slower: the forced devices share
its cores and add collectives; the point is correctness and what moves per step.
The SmolLM2 embedded model has 9 heads / 3 KV heads, so --tp 3 by default.
"""

from __future__ import annotations

import pathlib
import argparse
import dataclasses
import json
import os
import sys
import time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import output_file, run_as_script, user_errors  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="embedded")
  p.add_argument("--tp", type=int, default=3)
  p.add_argument("--dp", type=int, default=2)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--json", type=output_file, default="", help="also write the results here")
  return p.parse_args(argv)


@user_errors
def main(argv=None):
  a = parse_args(argv)
  # Before jax is imported: the forced host devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.devices}").strip()
  import jax
  import numpy as np

  from o1jax.checkpoint import load_checkpoint
  from o1jax.compilation_cache import enable_compilation_cache
  from o1jax.engine import Engine, EngineConfig, EngineReplicas, GenerationParams, Request
  from o1jax.model import Llama
  from o1jax.sharding import DecodeCollectives

  enable_compilation_cache()
  sys.path.insert(0, os.path.dirname(__file__))
  from bench_engine import chat_prompts

  ck = load_checkpoint(a.model)
  model = Llama(ck.config, ck.params)
  prompts = chat_prompts(ck.tokenizer, a.prompts)
  params = GenerationParams(max_new_tokens=a.new_tokens, ignore_eos=True)
  rows = {}
  config = EngineConfig(max_slots=a.prompts, kv_cache_bytes=64 << 20,
                        reuse_compiled_shapes=False)  # timed warm: every bucket compiled
  runs = [("1 device", lambda: Engine(model, ck.tokenizer, config)),
          (f"TP={a.tp}", lambda: Engine(model, ck.tokenizer, config, mesh=jax.make_mesh(
              (1, a.tp), ("data", "model"), devices=jax.devices()[:a.tp])))]
  if a.dp > 1:
    runs.append((f"DP={a.dp}", lambda: EngineReplicas(
        model, ck.tokenizer, dataclasses.replace(config, data_parallel=a.dp))))
  compiled = lambda e: sum(e.trace_counts.values())
  for label, build in runs:
    engine = build()
    collectives = DecodeCollectives(engine) if label.startswith("TP") else None
    requests = [Request(p, params, i) for i, p in enumerate(prompts)]
    while True:  # warm up until a run compiles nothing new
      before = compiled(engine)
      engine.generate(requests)
      if compiled(engine) == before:
        break
    walls, out = [], None
    for _ in range(a.repeats):
      start = time.perf_counter()
      out = engine.generate(requests)
      walls.append(time.perf_counter() - start)
    tokens = [r.samples[0].token_ids for r in out]
    ops = None
    if collectives is not None:
      counts = collectives.counts()
      ops = {op: counts[op] for op in ("all-reduce", "all-gather")}
    rows[label] = dict(tok_s=[a.prompts * a.new_tokens / w for w in walls], tokens=tokens,
                       collectives=ops)
  base = rows["1 device"]
  for r in rows.values():
    r["forks"] = [(i, next(j for j, (u, v) in enumerate(zip(x, y)) if u != v))
                  for i, (x, y) in enumerate(zip(base["tokens"], r["tokens"])) if x != y]
  forks = sorted({f for r in rows.values() for f in r["forks"]})
  gaps = []
  for i, at in forks:  # the one-device top-2 gap where they fork
    ids = prompts[i] + base["tokens"][i][:at]
    from o1jax.model import KVCache
    logits, _ = model(np.asarray([ids], np.int32), np.zeros((1,), np.int32),
                      KVCache.zeros(model.config, 1, len(ids)))
    top = np.sort(np.asarray(logits[0, -1]))[-2:]
    gaps.append(float(top[1] - top[0]))
  print(f"| run | generated tok/s ({a.repeats} runs) | same tokens as 1 device | "
        f"collectives per decode step |")
  print("|---|---|---|---|")
  for label, r in rows.items():
    same = "-" if r is base else f"{len(prompts) - len(r['forks'])}/{len(prompts)}"
    print(f"| {label} | {' / '.join(f'{t:.1f}' for t in r['tok_s'])} | {same} | "
          f"{r['collectives'] or '-'} |")
  print(f"layers: {model.config.n_layers}; forks (prompt, position): {forks}; "
        f"top-2 logit gaps there: {gaps}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(rows={k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                           for k, v in rows.items()}, forks=forks, gaps=gaps,
                     layers=model.config.n_layers), f, indent=1)


if __name__ == "__main__":
  run_as_script(main)
