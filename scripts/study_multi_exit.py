"""Multi-exit inference on the embedded model: accuracy and per-token latency when the
answer is produced at an early layer (the early-exit drafter's exits) or at full depth.

  python scripts/study_multi_exit.py [--exits 8,16,0] [--problems 200]
      [--max-new-tokens 160] [--slots 32] [--json out.json]

An exit at layer L is the model's first L layers followed by its own final norm and
output head (no extra training: what `SpeculativeConfig(drafter="early_exit",
exit_layer=L)` drafts with); 0 = full depth. GSM-style problems (the pipeline's
generator, levels 1-2, zero-shot tutor prompt), greedy, through the engine; accuracy is
the pipeline's strict exact match. Per exit: accuracy, mean generated tokens, decode
tokens per second and the mean time between tokens (TPOT) over the run, timed on a
second pass of the same requests (the first compiles every shape it takes).
"""

from __future__ import annotations

import sys
import pathlib
import argparse
import dataclasses
import json
import time

import numpy as np

from o1jax.checkpoint import load_checkpoint
from o1jax.compilation_cache import enable_compilation_cache
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.engine.metrics import MetricsCollector
from o1jax.model import Llama
from pipelines.datasets import Example
from pipelines.task_specs import GSMTask
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from o1jax.engine.kv_cache import KV_DTYPES  # noqa: E402
from o1jax.model.layers import MATMUL_DTYPES  # noqa: E402
from script_args import count, counts, output_file, run_as_script, user_errors  # noqa: E402


def truncated(ck, exit_layer: int, matmul_dtype: str) -> Llama:
  """The first `exit_layer` layers with the model's own final norm and head (0: all)."""
  if not exit_layer:
    return Llama(ck.config, ck.params, matmul_dtype=matmul_dtype)
  params = dict(ck.params)
  params["layers"] = list(ck.params["layers"])[:exit_layer]
  config = dataclasses.replace(ck.config, n_layers=exit_layer)
  return Llama(config, params, matmul_dtype=matmul_dtype)


@user_errors
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--source", default="embedded")
  ap.add_argument("--exits", type=counts(0), default="8,16,0",
                  help="layers of each exit; 0 = full depth")
  ap.add_argument("--problems", type=count(1), default=200)
  ap.add_argument("--max-new-tokens", type=count(1), default=160)
  ap.add_argument("--slots", type=count(1), default=32)
  ap.add_argument("--matmul-dtype", default="int8", choices=MATMUL_DTYPES)
  ap.add_argument("--kv-dtype", default="bfloat16", choices=tuple(KV_DTYPES))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", type=output_file, default="")
  args = ap.parse_args(argv)

  enable_compilation_cache()
  ck = load_checkpoint(args.source)
  deeper = [e for e in args.exits if e > ck.config.n_layers]
  if deeper:  # (it ran every layer and labelled the row with the number asked for)
    print(f"error: --exits {deeper[0]}: the model has {ck.config.n_layers} layers",
          file=sys.stderr)
    return 2
  task = GSMTask(dataset={"name": "gsm_synthetic", "n": args.problems, "seed": args.seed,
                          "levels": (1, 2)},
                 prompt_cfg={"style": "zero_shot", "system": "tutor"})
  examples = [e for e in task.load() if isinstance(e, Example)]
  rows = []
  for exit_layer in args.exits:
    model = truncated(ck, exit_layer, args.matmul_dtype)
    engine = Engine(model, ck.tokenizer, EngineConfig(max_slots=args.slots, kv_dtype=args.kv_dtype,
                                                      kv_cache_bytes=256 << 20,
                                                      reuse_compiled_shapes=False))  # timed
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    requests = [Request(task.prompt(e)[0], params, request_id=i) for i, e in enumerate(examples)]
    # A warm-up pass compiles every shape the timed pass takes (each exit is its own
    # model): timed cold, an exit's first pass paid its compilations as decode time.
    engine.generate(requests)
    engine.metrics = MetricsCollector()
    start = time.perf_counter()
    results = engine.generate(requests)
    wall = time.perf_counter() - start
    summary = engine.metrics.summary()
    scores = task.score_batch([(e, r.text, ()) for e, r in zip(examples, results)])
    tokens = sum(len(r.token_ids) for r in results)
    row = {"exit_layer": exit_layer or ck.config.n_layers, "full_depth": not exit_layer,
           "accuracy": float(np.mean([s["correct"] for s in scores])),
           "mean_tokens": tokens / len(results),
           "decode_tok_s": tokens / summary["decode_seconds"],
           "tpot_ms": 1e3 * summary["tpot"]["mean"], "wall_s": wall,
           "sample_text": results[0].text[:200]}
    rows.append(row)
    print(f"exit {row['exit_layer']:2d}: accuracy {row['accuracy']:.3f}, "
          f"{row['mean_tokens']:.0f} tokens, {row['decode_tok_s']:.0f} tok/s, "
          f"TPOT {row['tpot_ms']:.1f} ms ({wall:.0f} s)", flush=True)
  print()
  print("| exit | accuracy (strict) | generated tokens | decode tok/s | TPOT (ms) |")
  print("|---|---|---|---|---|")
  for r in rows:
    name = f"full ({r['exit_layer']} layers)" if r["full_depth"] else f"layer {r['exit_layer']}"
    print(f"| {name} | {r['accuracy']:.3f} | {r['mean_tokens']:.0f} | {r['decode_tok_s']:.0f} | "
          f"{r['tpot_ms']:.1f} |")
  out = {"args": vars(args), "rows": rows}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  run_as_script(main)
