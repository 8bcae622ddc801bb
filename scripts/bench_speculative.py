"""Speculative decoding on the embedded model: speed and acceptance per drafter and task.

  python scripts/bench_speculative.py [--tasks copy,gsm,code] [--batches 1,8,32]
      [--drafters prompt_lookup,early_exit:8,early_exit:16,draft_model:int8]
      [--max-new-tokens 96] [--matmul-dtype float32] [--rounds 3] [--json out.json]

Tasks (chat prompts, greedy):
  copy: copy-heavy editing — a passage of a generated town report (~150-250 words)
        with a few letters swapped, to be rewritten with the spelling fixed;
  gsm:  GSM-style math (the pipeline's generator, levels 1-2, zero-shot tutor prompt);
  code: HumanEval problems as completion prompts (the pipeline's stop sequences).
Drafters: prompt_lookup; early_exit:L (the first L layers and the model's head);
draft_model:int8 (the same checkpoint with int8 matmuls as the draft: same
tokenizer, ~2.5x cheaper per token on AVX-512 VNNI CPUs).

For every batch size one engine (`max_slots` = batch; compiled programs are shared by
the configurations, `Engine.set_speculative`); per task, plain decoding, each drafter,
and plain decoding again: for a drafter, first one run per K bucket with K fixed (so
every bucket's programs are compiled), then the requests run until a run compiles
nothing new (at most 3 runs; the planner times the shapes meanwhile), then once more,
timed (the programs it still compiled are reported). The baseline is the mean of the two plain runs
(their ratio to it shows the noise). Per configuration: decode tokens per second
(generated tokens / wall time of the decode and verify calls, drafting included),
end-to-end tokens per second (prefill included), the ratio of each to plain decoding
in the same run, the acceptance rate (accepted / drafted), accepted drafts per verify
call (over all its rows: the mean accepted length at batch 1),
the share of decode calls that verified, and whether the tokens equal plain
decoding's. --rounds R measures every configuration R times (round after round, each
with its own two plain runs; a drafter's later rounds skip the K-bucket compile runs)
and ends with the median ratio over the rounds and its range: on a noisy machine a
single run's ratio moves by ~15%. Requests at batch b: max(b, 4) of the task's items (batch 1 runs 4
requests one after the other).

--controller: the same tasks through the reasoning controller's loop instead
(`Controller(speculative=...)`, paged cache, `max_rows` = batch; greedy, thinking
budget = --max-new-tokens, 8 answer tokens, "\n" steps): plain, prompt lookup
with the host choosing verifying or plain calls (`adaptive`), prompt lookup
verifying every call, plain again; decode tok/s = generated tokens / time inside
the loop calls, end-to-end = generated tokens / the timed `generate` call (prefill and
admissions included), after one warm-up run of each configuration.
"""

from __future__ import annotations

import sys
import pathlib
import argparse
import dataclasses
import json
import random
import statistics
import time

from o1jax.compilation_cache import enable_compilation_cache
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request, SpeculativeConfig
from o1jax.engine.kv_cache import KV_DTYPES
from o1jax.model import Llama
from o1jax.model.layers import MATMUL_DTYPES
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import count, counts, output_file, run_as_script, user_errors  # noqa: E402


def copy_prompts(n: int, seed: int = 0) -> list:
  """Passages of the suite's generated reports with swapped letters, to rewrite fixed."""
  from pipelines.suite import summarization

  rng = random.Random(seed)
  out = []
  for ex in summarization.generate(n, seed):
    body = ex.question.split("\n\n")[1:3]
    words = " ".join(body).split()[:180]
    for _ in range(6):  # a few typos: swap two inner letters of a longer word
      i = rng.randrange(len(words))
      w = words[i]
      if len(w) > 4 and w.isalpha():
        j = rng.randrange(1, len(w) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    text = " ".join(words)
    out.append(([{"role": "user", "content": "Rewrite the following text exactly, fixing only "
                  f"the spelling mistakes.\n\n{text}"}], ()))
  return out


# The task imports are local: scripts/gpu_engine_check.py uses `measure` on a GPU
# machine without the pipelines' dependencies.
def gsm_prompts(n: int, seed: int = 0) -> list:
  from pipelines.datasets import Example
  from pipelines.task_specs import GSMTask

  task = GSMTask(dataset={"name": "gsm_synthetic", "n": n, "seed": seed, "levels": (1, 2)},
                 prompt_cfg={"style": "zero_shot", "system": "tutor"})
  return [task.prompt(e) for e in task.load() if isinstance(e, Example)]


def code_prompts(n: int, seed: int = 0) -> list:
  from pipelines.datasets import Example
  from pipelines.task_specs import HumanEvalTask

  task = HumanEvalTask(dataset={"path": "", "n": n}, prompt_cfg={"style": "completion"},
                      sandbox_cfg={})
  return [task.prompt(e) for e in task.load() if isinstance(e, Example)]


TASKS = {"copy": copy_prompts, "gsm": gsm_prompts, "code": code_prompts}
DRAFTER_KINDS = ("prompt_lookup", "early_exit", "draft_model")
DEFAULT_DRAFTERS = "prompt_lookup,early_exit:8,early_exit:16,draft_model:int8"


def task_list(text: str) -> list[str]:
  names = [t for t in text.split(",") if t]
  if not names or any(t not in TASKS for t in names):
    raise argparse.ArgumentTypeError(f"expected comma-separated tasks of {', '.join(TASKS)}, "
                                     f"got {text!r}")
  return names


def drafter_list(text: str) -> list[str]:
  """prompt_lookup, early_exit:L (L >= 1), draft_model[:matmul dtype] (a typo failed after
  the plain run)."""
  names = [d for d in text.split(",") if d]
  for name in names:
    kind, _, arg = name.partition(":")
    if (kind not in DRAFTER_KINDS or (kind == "early_exit" and not (arg.isdigit() and int(arg)))
        or (kind == "draft_model" and arg and arg not in MATMUL_DTYPES)
        or (kind == "prompt_lookup" and arg)):
      raise argparse.ArgumentTypeError(
          f"expected drafters of prompt_lookup, early_exit:L (L >= 1), draft_model[:DTYPE] "
          f"(DTYPE one of {', '.join(MATMUL_DTYPES)}), got {name!r}")
  return names


def drafter_config(name: str, args, ck, drafts: dict):
  """(SpeculativeConfig, draft model or None) for a --drafters entry; draft models are
  built once (`drafts` caches them)."""
  kind, _, arg = name.partition(":")
  if kind == "early_exit":
    return SpeculativeConfig(drafter="early_exit", exit_layer=int(arg or 0),
                             max_drafts=args.max_drafts), None
  if kind == "draft_model":
    if name not in drafts:
      drafts[name] = Llama(ck.config, ck.params, matmul_dtype=arg or "int8")
    return SpeculativeConfig(drafter="draft_model", max_drafts=args.max_drafts), drafts[name]
  return SpeculativeConfig(drafter=kind, max_drafts=args.max_drafts), None


def measure(engine, prompts, args, speculative=None, draft_model=None,
            compile_buckets: bool = True) -> dict:
  """One configuration on `engine` (idle; its compiled programs are reused): a warm-up
  run of the requests, then the same requests timed. compile_buckets=False: every K
  bucket's programs were compiled already (a later round)."""
  engine.set_speculative(speculative, draft_model)

  def requests():
    return [Request(p, GenerationParams(max_new_tokens=args.max_new_tokens, stop=stop),
                    request_id=i) for i, (p, stop) in enumerate(prompts)]

  # Compile every K bucket's programs first: one run per bucket with K fixed (an adaptive
  # planner that tries a bucket only in the timed run would time its compilation).
  if compile_buckets and speculative is not None and speculative.adaptive:
    for k in speculative.k_buckets:
      engine.set_speculative(dataclasses.replace(speculative, max_drafts=k, adaptive=False),
                             draft_model)
      engine.generate(requests())
    engine.set_speculative(speculative, draft_model)
  # Warm up until a run compiles nothing new (at most 3 runs): the timed run then shows
  # the steady state, not compilation (which K and table widths a run uses varies).
  for _ in range(3):
    traces = sum(engine.trace_counts.values())
    engine.generate(requests())
    if sum(engine.trace_counts.values()) == traces:
      break
  traces = sum(engine.trace_counts.values())
  before = engine.metrics.summary()
  start = time.perf_counter()
  results = engine.generate(requests())
  wall = time.perf_counter() - start
  after = engine.metrics.summary()
  delta = lambda key: after[key] - before[key]
  spec = {k: after["speculative"][k] - before["speculative"][k]
          for k in ("verify_calls", "drafted", "accepted")}
  tokens = sum(len(r.token_ids) for r in results)
  return {"tokens": [r.token_ids for r in results], "generated_tokens": tokens,
          "decode_tok_s": tokens / delta("decode_seconds"), "e2e_tok_s": tokens / wall,
          "decode_calls": delta("decode_calls"), **spec,
          "compiled_in_timed_run": sum(engine.trace_counts.values()) - traces,
          "acceptance_rate": spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0,
          # Mean accepted length: accepted drafts per verify call (over all its rows).
          "accepted_per_verify": (spec["accepted"] / spec["verify_calls"]
                                  if spec["verify_calls"] else 0.0),
          "verify_share": spec["verify_calls"] / max(delta("decode_calls"), 1)}


def measure_controller(ctl, prompts, args) -> dict:
  """One controller configuration: a warm-up run of the requests, then the same timed.
  An adaptive controller's warm-up may never verify, so a controller on the same decode
  model that verifies every call runs first: both loop programs are compiled before the
  timed run (`compiled_in_timed_run` counts what it still compiled)."""
  from o1jax.controller import Controller, LoopSettings, ReasoningRequest
  from o1jax.controller.loop import ReasoningLoop

  st = LoopSettings(max_thinking_tokens=args.max_new_tokens, max_answer_tokens=8,
                    step_delimiter="\n", step_max_tokens=48)
  reqs = [ReasoningRequest(prompt=p, request_id=i) for i, (p, _) in enumerate(prompts)]
  if ctl.speculative is not None and ctl.speculative.adaptive:
    Controller(ctl.model, ctl.tokenizer, max_rows=ctl.max_rows,
               speculative=dataclasses.replace(ctl.speculative, adaptive=False)).generate(
                   reqs, st, 1)
  ctl.generate(reqs, st, 1)
  compiled = ReasoningLoop.run._cache_size()
  start = time.perf_counter()
  batch = ctl.generate(reqs, st, 1)
  wall = time.perf_counter() - start
  compiled = ReasoningLoop.run._cache_size() - compiled
  traces = [ts[0] for ts in batch.traces]
  spec = [t.speculative or {"drafted": 0, "accepted": 0} for t in traces]
  drafted, accepted = sum(d["drafted"] for d in spec), sum(d["accepted"] for d in spec)
  tokens = sum(t.tokens.generated for t in traces)
  return {"tokens": [t.token_ids for t in traces], "generated_tokens": tokens,
          "decode_tok_s": tokens / batch.loop_seconds, "e2e_tok_s": tokens / wall,
          "decode_calls": batch.iterations, "verify_calls": batch.verify_calls,
          "drafted": drafted, "accepted": accepted, "compiled_in_timed_run": compiled,
          "acceptance_rate": accepted / drafted if drafted else 0.0,
          "accepted_per_verify": accepted / batch.verify_calls if batch.verify_calls else 0.0,
          "verify_share": batch.verify_calls / max(batch.iterations, 1)}


def controller_configs(model, ck, batch, args):
  """(name, Controller) per configuration of --controller: plain first and last."""
  from o1jax.controller import Controller, build_decode_model

  decode_model = build_decode_model(model, {"cache": "paged", "kv_dtype": args.kv_dtype})
  make = lambda spec: Controller(decode_model, ck.tokenizer, max_rows=batch, speculative=spec)
  lookup = SpeculativeConfig(max_drafts=args.max_drafts)
  return [("plain", make(None)), ("loop:prompt_lookup", make(lookup)),
          ("loop:lookup always", make(dataclasses.replace(lookup, adaptive=False))),
          ("plain (again)", make(None))]


@user_errors
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--source", default="embedded")
  ap.add_argument("--tasks", type=task_list, default="copy,gsm,code")
  ap.add_argument("--batches", type=counts(1), default="1,8,32")
  ap.add_argument("--drafters", type=drafter_list, default=None,
                  help=f"the engine's drafters (default {DEFAULT_DRAFTERS}); --controller "
                       f"drafts by prompt lookup only")
  ap.add_argument("--max-new-tokens", type=count(1), default=96)
  ap.add_argument("--max-drafts", type=count(1), default=7)
  ap.add_argument("--matmul-dtype", default="float32", choices=MATMUL_DTYPES)
  ap.add_argument("--kv-dtype", default="float32", choices=tuple(KV_DTYPES))
  ap.add_argument("--controller", action="store_true",
                  help="speculation in the reasoning controller's loop instead of the engine")
  ap.add_argument("--rounds", type=count(1), default=1,
                  help="measure every configuration this many times, in rounds (each with "
                       "its own plain baseline); the summary gives the median ratio and range")
  ap.add_argument("--json", type=output_file, default="")
  args = ap.parse_args(argv)
  if args.controller and args.drafters is not None:  # (it was ignored without a word)
    ap.error("--drafters: the controller's loop drafts by prompt lookup only (leave it out)")
  if args.drafters is None:
    args.drafters = drafter_list(DEFAULT_DRAFTERS)

  from o1jax.checkpoint import load_checkpoint

  enable_compilation_cache()
  ck = load_checkpoint(args.source)
  model = Llama(ck.config, ck.params, matmul_dtype=args.matmul_dtype)
  drafters = args.drafters
  for name in drafters if not args.controller else ():  # (before any run: the depth is known)
    kind, _, arg = name.partition(":")
    if kind == "early_exit" and int(arg) >= ck.config.n_layers:
      ap.error(f"--drafters {name}: the model has {ck.config.n_layers} layers (exit below)")
  rows = []
  print(f"{'task':5} {'batch':>5} {'config':18} {'dec tok/s':>9} {'x plain':>7} {'e2e x':>6} "
        f"{'accept':>6} {'acc/verify':>10} {'verify%':>7} same compiled")
  drafts = {}
  for batch in args.batches:
    if not args.controller:
      engine = Engine(model, ck.tokenizer, EngineConfig(max_slots=batch, kv_cache_bytes=256 << 20,
                                                        kv_dtype=args.kv_dtype,
                                                        reuse_compiled_shapes=False))  # timed warm
    for task in args.tasks:
      prompts = TASKS[task](max(batch, 4))
      controllers = controller_configs(model, ck, batch, args) if args.controller else None
      for round_ in range(args.rounds):
        rows += measure_round(engine if not args.controller else None, controllers, prompts,
                              args, ck, drafts, drafters, task, batch, round_)
  if args.rounds > 1:
    print_summary(rows)
  out = {"args": vars(args), "rows": rows}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


def measure_round(engine, controllers, prompts, args, ck, drafts, drafters, task, batch,
                  round_) -> list[dict]:
  """Every configuration once, plain decoding first and last: the baseline is their
  mean, their gap the noise. Prints and returns one row per configuration."""
  rows = []
  if controllers is not None:
    configs = [(name, measure_controller(ctl, prompts, args)) for name, ctl in controllers]
  else:
    configs = [("plain", measure(engine, prompts, args))]
    for name in drafters:
      spec, draft = drafter_config(name, args, ck, drafts)
      configs.append((name, measure(engine, prompts, args, spec, draft,
                                    compile_buckets=round_ == 0)))
    configs.append(("plain (again)", measure(engine, prompts, args)))
  plain = {k: (configs[0][1][k] + configs[-1][1][k]) / 2 for k in ("decode_tok_s", "e2e_tok_s")}
  for name, r in configs:
    row = {"task": task, "batch": batch, "config": name, "round": round_,
           **{k: v for k, v in r.items() if k != "tokens"},
           "decode_ratio": r["decode_tok_s"] / plain["decode_tok_s"],
           "e2e_ratio": r["e2e_tok_s"] / plain["e2e_tok_s"],
           "same_tokens": r["tokens"] == configs[0][1]["tokens"]}
    rows.append(row)
    print(f"{task:5} {batch:5d} {name:18} {row['decode_tok_s']:9.1f} "
          f"{row['decode_ratio']:7.2f} {row['e2e_ratio']:6.2f} {row['acceptance_rate']:6.2f} "
          f"{row['accepted_per_verify']:10.2f} {100 * row['verify_share']:6.0f}% "
          f"{str(row['same_tokens']):5} {row['compiled_in_timed_run']}", flush=True)
  return rows


def print_summary(rows: list[dict]) -> None:
  """Per task, batch and configuration over the rounds: the median decode and
  end-to-end ratios to plain decoding with their range, the mean verify share,
  and whether every round's tokens equalled plain decoding's."""
  print(f"\n{'task':5} {'batch':>5} {'config':18} {'rounds':>6} {'x plain (median, range)':>24} "
        f"{'e2e x (median, range)':>22} {'verify%':>7} same")
  groups: dict = {}
  for r in rows:
    groups.setdefault((r["task"], r["batch"], r["config"]), []).append(r)
  for (task, batch, name), rs in groups.items():
    dec = sorted(r["decode_ratio"] for r in rs)
    e2e = sorted(r["e2e_ratio"] for r in rs)
    verify = sum(r["verify_share"] for r in rs) / len(rs)
    print(f"{task:5} {batch:5d} {name:18} {len(rs):6d} "
          f"{statistics.median(dec):8.2f} ({dec[0]:.2f}-{dec[-1]:.2f})    "
          f"{statistics.median(e2e):8.2f} ({e2e[0]:.2f}-{e2e[-1]:.2f}) {100 * verify:6.0f}% "
          f"{all(r['same_tokens'] for r in rs)}", flush=True)


if __name__ == "__main__":
  run_as_script(main)
