"""Temperature -> reasoning path length, on the embedded model (one command).

  python scripts/study_temperature.py [--temperatures 0.3,0.7,1.2] [--problems 48]
      [--max-new-tokens 384] [--json out.json] [--png out.png]

GSM-style problems (the pipeline's generator, levels 1-2), the zero-shot "tutor" prompt
(the model reasons in prose before answering), one sampled path per problem and
temperature (keys from (seed, problem), so the paths differ only by temperature),
top_p 1, through the engine. Per temperature: mean and std of the path length in
generated tokens, the share of paths longer than 256 tokens, the share that hit the
token limit, and accuracy (strict exact match, as the pipeline scores it).
"""

from __future__ import annotations

import sys
import pathlib
import argparse
import json

import numpy as np

from o1jax.checkpoint import load_checkpoint
from o1jax.compilation_cache import enable_compilation_cache
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import Llama
from pipelines.datasets import Example
from pipelines.task_specs import GSMTask
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import count, numbers, output_file, run_as_script, user_errors


@user_errors
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--source", default="embedded")
  ap.add_argument("--temperatures", type=numbers, default="0.3,0.7,1.2")
  ap.add_argument("--problems", type=count(1), default=48)
  ap.add_argument("--max-new-tokens", type=count(1), default=384)
  ap.add_argument("--long", type=count(0), default=256, help="a path longer than this is long")
  ap.add_argument("--slots", type=count(1), default=16)
  ap.add_argument("--matmul-dtype", default="int8")
  ap.add_argument("--kv-dtype", default="bfloat16")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", type=output_file, default="")
  ap.add_argument("--png", type=output_file, default="")
  args = ap.parse_args(argv)

  enable_compilation_cache()
  ck = load_checkpoint(args.source)
  engine = Engine(Llama(ck.config, ck.params, matmul_dtype=args.matmul_dtype), ck.tokenizer,
                  EngineConfig(max_slots=args.slots, kv_dtype=args.kv_dtype,
                               kv_cache_bytes=256 << 20, reuse_compiled_shapes=False))
  task = GSMTask(dataset={"name": "gsm_synthetic", "n": args.problems, "seed": args.seed,
                          "levels": (1, 2)},
                 prompt_cfg={"style": "zero_shot", "system": "tutor"})
  examples = [e for e in task.load() if isinstance(e, Example)]
  rows = []
  for t in args.temperatures:
    params = GenerationParams(temperature=t, max_new_tokens=args.max_new_tokens, seed=args.seed)
    results = engine.generate([Request(task.prompt(e)[0], params, request_id=i)
                               for i, e in enumerate(examples)])
    lengths = np.asarray([len(r.token_ids) for r in results], float)
    scores = task.score_batch([(e, r.text, ()) for e, r in zip(examples, results)])
    row = {"temperature": t, "mean_tokens": float(lengths.mean()),
           "std_tokens": float(lengths.std()), "long_share": float((lengths > args.long).mean()),
           "limit_share": float(np.mean([r.finish_reason == "length" for r in results])),
           "accuracy": float(np.mean([s["correct"] for s in scores])),
           "lengths": lengths.astype(int).tolist()}
    rows.append(row)
    print(f"T={t:g}: {row['mean_tokens']:.1f} ± {row['std_tokens']:.1f} tokens, "
          f"> {args.long}: {row['long_share']:.0%}, at the limit: {row['limit_share']:.0%}, "
          f"accuracy {row['accuracy']:.2f}", flush=True)
  print()
  print(f"| temperature | path tokens (mean ± std) | > {args.long} tokens | hit the "
        f"{args.max_new_tokens}-token limit | accuracy |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['temperature']:g} | {r['mean_tokens']:.1f} ± {r['std_tokens']:.1f} | "
          f"{r['long_share']:.0%} | {r['limit_share']:.0%} | {r['accuracy']:.2f} |")
  out = {"args": vars(args), "rows": rows}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  if args.png:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([r["lengths"] for r in rows])
    ax.set_xticks(range(1, len(rows) + 1), [f"T={r['temperature']:g}" for r in rows])
    ax.axhline(args.long, color="gray", lw=0.8)
    ax.set(ylabel="reasoning path (generated tokens)",
           title=f"path length by temperature ({len(examples)} problems; gray: {args.long})")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
  return out


if __name__ == "__main__":
  run_as_script(main)
