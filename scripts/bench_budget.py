"""Fixed vs adaptive compute budget, FIFO vs remaining-steps priority, under open-loop load.

  python scripts/bench_budget.py                       # embedded model, int8 matmuls, bf16 KV
  python scripts/bench_budget.py --requests 24 --loads 0.5,1.5 --json out.json --png out.png

1. GSM-style problems (the pipeline's generator and prompts), greedy, one engine
   with `--slots` decode slots, reused by every run (compiled once).
2. Calibration: `--slots` requests at once (the slots full, nothing queued) give the
   service latency S (median end-to-end); all `--requests` at once give the capacity C
   (requests/s with a full queue). The SLO is `--slo` seconds, or S x `--slo-factor`.
3. For each offered load L (multiples of C): Poisson arrivals at rate L x C, the same
   arrival times for every variant (paired), open loop (a request arrives whether or not
   the engine keeps up). Variants: budget fixed (max_new_tokens) | adaptive (the live
   budget of o1jax/engine/budget.py: measured load and P95 against the SLO, every
   `--interval-ms`), and scheduler priority fifo | shortest_budget (remaining steps).
4. Per run: latency from the scheduled arrival to the last token (each request's kept in
   the JSON, request_latency_s), P5/P50/P95/P99;
   variation = (P95 - P5) / 2 / P50 (the half-width of the central 90%, as a share of
   the median: comparable to a "±x%" figure) and the coefficient of variation
   (std / mean); accuracy (strict exact match); tokens per request; and for adaptive
   runs the budget over time. Adaptive vs fixed accuracy: the paired difference per
   problem, mean ± 1.96 standard errors.
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
from o1jax.engine.budget import BudgetConfig, BudgetLoop
from o1jax.engine.kv_cache import KV_DTYPES
from o1jax.model import Llama
from o1jax.model.layers import MATMUL_DTYPES
from pipelines.datasets import Example
from pipelines.task_specs import GSM_PROMPT_STYLES as PROMPT_STYLES, GSMTask
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import (count, non_negative, output_file, positive,  # noqa: E402
                         positive_numbers, run_as_script, user_errors)


def percentiles(values, qs=(5, 50, 95, 99)) -> dict:
  return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def run_open_loop(engine: Engine, prompts, arrivals, params: GenerationParams):
  """Adds request i at arrivals[i] (seconds after start), steps the engine meanwhile;
  returns (results, latencies from the scheduled arrival, seconds of the run)."""
  t0 = time.perf_counter()
  handles = {}
  nxt = 0
  while nxt < len(prompts) or engine.has_work():
    now = time.perf_counter() - t0
    while nxt < len(prompts) and arrivals[nxt] <= now:
      handles[nxt] = engine.add_request(Request(prompts[nxt], params, request_id=nxt), index=nxt)
      nxt += 1
    if engine.has_work():
      engine.step()
    elif nxt < len(prompts):
      time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
  results = [engine.result(handles[i]) for i in range(len(prompts))]
  latencies = [r.metrics.finish - (t0 + arrivals[i]) for i, r in enumerate(results)]
  return results, latencies, time.perf_counter() - t0


@user_errors
def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--source", default="embedded")
  ap.add_argument("--requests", type=count(1), default=48, help="requests per run")
  ap.add_argument("--loads", type=positive_numbers, default="0.6,1.0,1.4",
                  help="offered loads, multiples of capacity")
  ap.add_argument("--slots", type=count(1), default=8)
  ap.add_argument("--max-new-tokens", type=count(1), default=96)
  # zero_shot + tutor: the model reasons at length, so a token limit binds (with shortshot
  # it answers in ~30 tokens and no budget above ~40 steps changes anything).
  ap.add_argument("--prompt-style", default="zero_shot", choices=PROMPT_STYLES)
  ap.add_argument("--system", default="tutor")
  ap.add_argument("--matmul-dtype", default="int8", choices=MATMUL_DTYPES)
  ap.add_argument("--kv-dtype", default="bfloat16", choices=tuple(KV_DTYPES))
  ap.add_argument("--slo", type=non_negative, default=0.0, help="seconds; 0 = S x --slo-factor")
  ap.add_argument("--slo-factor", type=positive, default=1.5)
  ap.add_argument("--interval-ms", type=positive, default=200.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", type=output_file, default="")
  ap.add_argument("--png", type=output_file, default="")
  args = ap.parse_args(argv)

  enable_compilation_cache()
  ck = load_checkpoint(args.source)
  model = Llama(ck.config, ck.params, matmul_dtype=args.matmul_dtype)
  task = GSMTask(dataset={"name": "gsm_synthetic", "n": args.requests, "seed": args.seed,
                          "levels": (1,)},
                 prompt_cfg={"style": args.prompt_style, "system": args.system})
  examples = [e for e in task.load() if isinstance(e, Example)]
  prompts = [task.prompt(e)[0] for e in examples]
  params = GenerationParams(max_new_tokens=args.max_new_tokens)
  # Timed after warm-up: every bucket compiled (no renting, which could compile mid-run).
  base = EngineConfig(max_slots=args.slots, kv_dtype=args.kv_dtype, decode_steps=8,
                      reuse_compiled_shapes=False)
  engine = Engine(model, ck.tokenizer, base)

  for n in (len(prompts), args.slots, 1):  # compile every shape the runs use, once
    engine.generate([Request(p, params) for p in prompts[:n]])
  calib = engine.generate([Request(p, params) for p in prompts[:args.slots]])
  service = float(np.median([r.metrics.e2e for r in calib]))
  t = time.perf_counter()
  engine.generate([Request(p, params) for p in prompts])
  capacity = len(prompts) / (time.perf_counter() - t)
  slo = args.slo or service * args.slo_factor
  print(f"service latency (slots full, no queue) {service:.2f} s; capacity {capacity:.2f} req/s; "
        f"SLO {slo:.2f} s")

  rng = np.random.default_rng(args.seed)
  gaps = rng.exponential(1.0, size=len(prompts))  # unit-rate gaps, scaled per load
  runs = []
  for load in args.loads:
    arrivals = np.cumsum(gaps) / (load * capacity)
    arrivals -= arrivals[0]
    for mode in ("fixed", "adaptive"):
      for policy in ("fifo", "shortest_budget"):
        engine.config = dataclasses.replace(base, policy=policy)
        budget = (BudgetLoop(BudgetConfig(mode="adaptive", latency_slo_s=slo,
                                          interval_ms=args.interval_ms))
                  if mode == "adaptive" else None)
        engine.budget = budget
        results, lat, wall = run_open_loop(engine, prompts, arrivals, params)
        scores = task.score_batch([(e, r.text, ()) for e, r in zip(examples, results)])
        lat = np.asarray(lat)
        p = percentiles(lat)
        t_start = budget.decisions[0].at_s if budget and budget.decisions else 0.0
        run = {"load": load, "mode": mode, "policy": policy, "wall_s": wall,
               "latency_s": {**p, "mean": float(lat.mean())},
               "request_latency_s": [round(float(v), 6) for v in lat],  # (in request order)
               "variation": (p["p95"] - p["p5"]) / 2 / p["p50"],
               "cv": float(lat.std() / lat.mean()),
               "slo_met": float((lat <= slo).mean()),
               "accuracy": float(np.mean([s["correct"] for s in scores])),
               "correct": [bool(s["correct"]) for s in scores],
               "tokens": float(np.mean([len(r.token_ids) for r in results])),
               "budget": [(round(d.at_s - t_start, 3), d.steps) for d in budget.decisions]
                         if budget else []}
        runs.append(run)
        steps = [s for _, s in run["budget"]]
        print(f"load {load:.1f} {mode:8s} {policy:15s} P50 {p['p50']:.2f} P95 {p['p95']:.2f} "
              f"P99 {p['p99']:.2f} s  variation ±{run['variation']:.0%} CV {run['cv']:.2f}  "
              f"SLO met {run['slo_met']:.0%}  acc {run['accuracy']:.2f}  tokens {run['tokens']:.1f}"
              + (f"  budget {min(steps)}-{max(steps)} steps" if steps else ""), flush=True)
  print()
  print("| load | budget | priority | P50 s | P95 s | P99 s | variation | CV | SLO met | "
        "accuracy | Δacc vs fixed (paired, 95%) | tokens |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for run in runs:
    fixed = next(r for r in runs if r["load"] == run["load"] and r["policy"] == run["policy"]
                 and r["mode"] == "fixed")
    d = np.asarray(run["correct"], float) - np.asarray(fixed["correct"], float)
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else 0.0
    run["delta_accuracy"] = [float(d.mean()), float(half)]
    delta = "—" if run is fixed else f"{d.mean():+.3f} ± {half:.3f}"
    l = run["latency_s"]
    print(f"| {run['load']:.1f} | {run['mode']} | {run['policy']} | {l['p50']:.2f} | "
          f"{l['p95']:.2f} | {l['p99']:.2f} | ±{run['variation']:.0%} | {run['cv']:.2f} | "
          f"{run['slo_met']:.0%} | {run['accuracy']:.2f} | {delta} | {run['tokens']:.1f} |")
  out = {"args": vars(args), "service_latency_s": service, "capacity_req_s": capacity,
         "slo_s": slo, "runs": runs}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  if args.png:
    plot(runs, slo, args.png)
  return out


def plot(runs, slo, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  loads = sorted({r["load"] for r in runs})
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for mode, marker in (("fixed", "o"), ("adaptive", "s")):
    for policy, ls in (("fifo", "-"), ("shortest_budget", "--")):
      sel = [next(r for r in runs if r["load"] == l and r["mode"] == mode and r["policy"] == policy)
             for l in loads]
      axes[0].plot(loads, [r["latency_s"]["p95"] for r in sel], ls, marker=marker,
                   label=f"{mode}, {policy}")
  axes[0].axhline(slo, color="gray", lw=0.8)
  axes[0].set(xlabel="offered load (x capacity)", ylabel="P95 latency (s)",
              title="P95 latency; gray: SLO")
  axes[0].legend(fontsize=8)
  for r in runs:
    if r["mode"] == "adaptive" and r["policy"] == "fifo" and r["budget"]:
      t, s = zip(*r["budget"])
      axes[1].step(t, s, where="post", label=f"load {r['load']:.1f}")
  axes[1].set(xlabel="seconds into the run", ylabel="budget (steps)",
              title="adaptive budget over time (fifo)")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  run_as_script(main)
