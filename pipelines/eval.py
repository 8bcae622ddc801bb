"""Evaluate a model on a dataset and write results: `python -m pipelines.eval`.

  python -m pipelines.eval --output_dir=runs/default
  python -m pipelines.eval --config=configs/gsm8k.py:smoke=True --config.dataset.n=4

Steps: 1. read the config and the dataset (bad records go to dead_letters.jsonl);
2. load the model once; 3. build prompts and generate in batches; 4. extract and
score answers; 5. write results.jsonl (one record per example) and summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time

from absl import app, flags
from ml_collections import config_flags

import configs
from o1jax.checkpoint import CheckpointError
from o1jax.compilation_cache import enable_compilation_cache
from o1jax.generate import build_generator
from o1jax.model import SamplingParams
from pipelines.datasets import DeadLetter, Example, read_gsm8k_jsonl, synthetic_examples
from pipelines.tasks import COMPLETION_STOP_SEQUENCES, fewshot_prompt, score_gsm8k, zero_shot_messages

DEFAULT_CONFIG = str(pathlib.Path(configs.__file__).parent / "gsm8k.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "evaluation config file",
                                          lock_config=True)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/default", "where results are written")


def load_examples(cfg) -> tuple[list[Example], list[DeadLetter]]:
  ds = cfg.dataset
  if ds.name == "gsm_synthetic":
    return list(synthetic_examples(ds.n, seed=ds.seed, levels=tuple(ds.levels))), []
  if ds.name == "gsm8k_jsonl":
    if not ds.path:
      raise ValueError("dataset.name=gsm8k_jsonl needs --config.dataset.path=FILE.jsonl")
    good, bad = [], []
    for rec in read_gsm8k_jsonl(ds.path):
      (bad if isinstance(rec, DeadLetter) else good).append(rec)
    return (good[: ds.n] if ds.n else good), bad
  raise ValueError(f"dataset.name={ds.name!r}: expected one of gsm_synthetic, gsm8k_jsonl")


def build_prompt(cfg, example: Example):
  if cfg.prompt == "zero_shot":
    return zero_shot_messages(example.question), ()
  if cfg.prompt == "fewshot":
    return fewshot_prompt(example.question), COMPLETION_STOP_SEQUENCES
  raise ValueError(f"prompt={cfg.prompt!r}: expected zero_shot or fewshot")


def run(cfg, output_dir: str) -> dict:
  out = pathlib.Path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  examples, dead = load_examples(cfg)
  with open(out / "dead_letters.jsonl", "w") as f:
    for d in dead:
      f.write(json.dumps(dataclasses.asdict(d)) + "\n")
  t0 = time.perf_counter()
  gen = build_generator(cfg.model.source, cfg.model.backend)
  load_s = time.perf_counter() - t0
  params = SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                          top_k=cfg.sampling.top_k, seed=cfg.sampling.seed)
  records, generated = [], 0
  t_gen = time.perf_counter()
  with open(out / "results.jsonl", "w") as f:
    for start in range(0, len(examples), cfg.batch_size):
      batch = examples[start:start + cfg.batch_size]
      prompts, stops = zip(*(build_prompt(cfg, e) for e in batch))
      outputs = gen.generate(list(prompts), cfg.sampling.max_new_tokens, params,
                             request_ids=range(start, start + len(batch)), stop=stops[0])
      for e, o in zip(batch, outputs):
        score = score_gsm8k(o.text, e.reference, stop_sequences=stops[0])
        rec = {"id": e.id, "dataset": e.dataset, "level": e.metadata.get("level"),
               "output": o.text, "reference": e.reference, **score.to_dict(),
               "generated_tokens": len(o.token_ids), "prompt_tokens": o.prompt_tokens,
               "finish_reason": o.finish_reason}
        f.write(json.dumps(rec) + "\n")
        records.append(rec)
        generated += len(o.token_ids)
      done = start + len(batch)
      print(f"[{done}/{len(examples)}] strict {sum(r['strict_correct'] for r in records)}/{done}, "
            f"flexible {sum(r['flexible_correct'] for r in records)}/{done}", file=sys.stderr)
  gen_s = time.perf_counter() - t_gen
  n = max(len(records), 1)
  summary = {
      "examples": len(records), "dead_letters": len(dead),
      "accuracy_strict": sum(r["strict_correct"] for r in records) / n,
      "accuracy_flexible": sum(r["flexible_correct"] for r in records) / n,
      "generated_tokens": generated, "generation_seconds": round(gen_s, 2),
      "generated_tokens_per_second": round(generated / gen_s, 2) if gen_s else None,
      "model_load_seconds": round(load_s, 2), "config": cfg.to_dict(),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=2, default=list))
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  enable_compilation_cache()
  try:
    summary = run(_CONFIG.value, _OUTPUT_DIR.value)
  except (CheckpointError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  keys = ("examples", "dead_letters", "accuracy_strict", "accuracy_flexible", "generated_tokens",
          "generated_tokens_per_second")
  print(json.dumps({k: summary[k] for k in keys}, indent=2))
  print(f"wrote {os.path.join(_OUTPUT_DIR.value, 'results.jsonl')} and summary.json")
  return 0


if __name__ == "__main__":
  app.run(main)
