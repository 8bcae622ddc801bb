"""Accuracy versus tokens for every reasoning policy on an offline GSM-style set.

  python scripts/bench_policies.py --problems 16 --n 8 --out /tmp/bench_policies

On the embedded SmolLM2-135M and `synthetic_examples` (levels 1-2 by default):
  1. controller overhead: seconds per decode iteration of the jitted loop
     (greedy, batch B) versus the plain `Generator` decoding the same number of
     tokens at the same batch, both warm, measured in this run;
  2. every policy on every problem: accuracy, generated tokens per problem
     (mean / median; thinking + answer + discarded, probes listed apart), P50 /
     P95 latency of a problem (the wall time of the batch it ran in), backtracks,
     early exits, host round trips (jitted loop calls) per problem;
  3. deepconf versus self_consistency at the same n: token savings and the
     accuracy difference (deepconf's settings come from configs/policies.py);
     the row `deepconf_calibrated` is deepconf with a fixed stop threshold from
     `DeepConf.calibrate` on --calibration-problems held-out problems (another
     seed; their tokens are not counted) instead of each problem's warm-up traces;
  4. with --speculative: each policy again on a controller that speculates in its
     loop (prompt lookup, adaptive: `o1jax.controller.Controller(speculative=)`),
     rows named `<policy>+spec`, with drafts verified / accepted and verify calls;
  5. writes results.json, table.md and pareto.png (accuracy vs mean tokens and vs
     seconds per problem, Pareto frontiers marked; speculation moves only the
     seconds) to --out (default: bench_policies under the temporary directory, never
     the working directory: a run from the repo's root wrote into the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)

from o1jax.compilation_cache import enable_compilation_cache  # noqa: E402
from script_args import count, levels as level_list  # noqa: E402

# What each policy row runs (`policy_params`); deepconf_calibrated is deepconf with a
# calibrated threshold.
POLICY_ROWS = ("greedy_cot", "self_consistency", "best_of_n", "deepconf", "deepconf_calibrated",
               "think_verify_backtrack", "budget_forcing")


def policy_list(text: str) -> list[str]:
  """Comma-separated POLICY_ROWS (a typo ended the run when its turn came, the rows
  before it unwritten)."""
  names = [x.strip() for x in text.split(",") if x.strip()]
  unknown = [x for x in names if x not in POLICY_ROWS]
  if not names or unknown:
    raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)}: expected "
                                     f"comma-separated policies of {', '.join(POLICY_ROWS)}")
  return names


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--problems", type=count(1), default=16)
  p.add_argument("--levels", type=level_list, default=[1, 2])
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--n", type=count(1), default=8,
                 help="samples for self_consistency / deepconf / best_of_n")
  p.add_argument("--warmup", type=count(1), default=2, help="deepconf warm-up traces")
  p.add_argument("--max-thinking", type=count(1), default=96)
  p.add_argument("--max-answer", type=count(1), default=12)
  p.add_argument("--max-rows", type=count(1), default=16)
  p.add_argument("--cache", default="contiguous", choices=("contiguous", "paged"),
                 help="the controller's KV cache (the README's tables used contiguous)")
  p.add_argument("--matmul-dtype", default="float32", choices=("float32", "bfloat16", "int8"),
                 help="the model's matmul numerics (int8: the engine's fast CPU path)")
  p.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16"),
                 help="the controller's KV cache dtype")
  p.add_argument("--bootstrap", type=count(1), default=10000,
                 help="paired bootstrap resamples for the accuracy-difference interval")
  p.add_argument("--policies", type=policy_list,
                 default="greedy_cot,self_consistency,deepconf,deepconf_calibrated,best_of_n,"
                         "think_verify_backtrack,budget_forcing")
  p.add_argument("--calibration-problems", type=count(1), default=8,
                 help="held-out problems (seed + 1000) that calibrate deepconf_calibrated")
  p.add_argument("--overhead-tokens", type=count(0), default=64, help="0 skips the overhead row")
  p.add_argument("--speculative", action="store_true",
                 help="also run every policy with prompt-lookup speculation in the loop")
  p.add_argument("--max-drafts", type=count(1), default=7,
                 help="drafts per verify call (--speculative)")
  p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_policies"),
                 help="directory of the results (default: %(default)s)")
  return p.parse_args(argv)


def policy_params(name: str, a) -> dict:
  common = dict(max_thinking_tokens=a.max_thinking, max_answer_tokens=a.max_answer,
                step_delimiter="\n", step_max_tokens=48)
  extra = {
      "greedy_cot": {},
      "self_consistency": dict(n=a.n, temperature=0.7),
      "best_of_n": dict(n=a.n, temperature=0.7, score="mean_logprob"),
      # (its other settings: the class defaults, chosen in docs/controller.md)
      "deepconf": dict(n=a.n, warmup=a.warmup, temperature=0.7),
      "think_verify_backtrack": dict(verifier="self_verify", backtrack_threshold=0.5,
                                     max_step_backtracks=1, max_backtracks=3, exit_tau=0.85),
      "budget_forcing": dict(min_thinking_tokens=a.max_thinking // 2),
  }[name]
  return {**common, **extra}


def measure_overhead(ctl, generator, prompts, tokens: int, rows: int) -> dict:
  """Seconds per decode step: jitted controller loop vs the plain Generator, same batch."""
  from o1jax.controller import LoopSettings, ReasoningRequest
  from o1jax.model import SamplingParams

  reqs = [ReasoningRequest(prompt=p, request_id=i) for i, p in enumerate(prompts[:rows])]
  # min_thinking = max_thinking: every row decodes exactly `tokens` thinking tokens.
  st = LoopSettings(max_thinking_tokens=tokens, min_thinking_tokens=tokens, max_answer_tokens=1,
                    step_delimiter="\n", step_max_tokens=48, answer_prefix=" so", wait_text=" Wait")
  ctl.generate(reqs, st, 1)  # compile
  runs = [ctl.generate(reqs, st, 1) for _ in range(3)]
  ctl_step = min(b.loop_seconds / b.iterations for b in runs)
  msgs = [r.prompt for r in reqs]
  greedy = SamplingParams()
  generator.generate(msgs, max_new_tokens=tokens, params=greedy)  # compile
  generator.generate(msgs, max_new_tokens=1, params=greedy)
  t_full, t_prefill = [], []
  for _ in range(3):
    t0 = time.perf_counter()
    out = generator.generate(msgs, max_new_tokens=tokens, params=greedy)
    t_full.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    generator.generate(msgs, max_new_tokens=1, params=greedy)
    t_prefill.append(time.perf_counter() - t0)
  steps = max(len(o.token_ids) for o in out)
  gen_step = (min(t_full) - min(t_prefill)) / max(steps - 1, 1)
  return {"rows": len(reqs), "tokens": tokens, "controller_s_per_step": ctl_step,
          "generator_s_per_step": gen_step, "generator_steps": steps,
          "overhead": ctl_step / gen_step - 1.0}


def gsm_requests(problems: int, seed: int, levels: list[int]):
  """(examples, zero-shot ReasoningRequests) of `problems` synthetic GSM problems of `seed`."""
  from o1jax.controller import ReasoningRequest
  from pipelines.datasets import gsm_synthetic
  from pipelines.tasks.gsm8k import zero_shot_messages

  examples = list(gsm_synthetic.synthetic_examples(problems, seed, levels))
  return examples, [ReasoningRequest(prompt=zero_shot_messages(e.question), request_id=i, seed=seed)
                    for i, e in enumerate(examples)]


def paired_interval(a_correct, b_correct, resamples: int, seed: int):
  """95% percentile bootstrap interval of accuracy(a) - accuracy(b) in points, resampling
  problems (both policies ran on the same problems, so their results are paired); None
  below 2 problems (nothing to resample). A percentile interval covers less than 95% on
  few problems (92% in a simulation at 16): read it as a rough range there."""
  if len(a_correct) < 2:
    return None
  from scipy import stats
  points = lambda a, b, axis: 100.0 * np.mean(a - b, axis=axis)
  ci = stats.bootstrap((a_correct.astype(np.float64), b_correct.astype(np.float64)), points,
                       paired=True, vectorized=True, n_resamples=resamples,
                       method="percentile", rng=seed).confidence_interval
  return float(ci.low), float(ci.high)


def main(argv=None) -> int:
  a = parse_args(argv)
  enable_compilation_cache()
  from o1jax.checkpoint import load_checkpoint
  from o1jax.controller import Controller, build_decode_model, get_policy
  from o1jax.model import Generator, Llama
  from o1jax.engine.speculative import SpeculativeConfig
  from pipelines.report import pareto_front
  from pipelines.tasks.gsm8k import answers_match

  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  t_start = time.perf_counter()
  load_start = os.getloadavg()  # the machine may be shared: recorded with the results
  ck = load_checkpoint("embedded")
  llama = Llama(ck.config, ck.params, matmul_dtype=a.matmul_dtype)
  decode_model = build_decode_model(llama, {"cache": a.cache, "kv_dtype": a.kv_dtype})
  ctl = Controller(decode_model, ck.tokenizer, max_rows=a.max_rows)
  spec_ctl = (Controller(decode_model, ck.tokenizer, max_rows=a.max_rows,
                         speculative=SpeculativeConfig(max_drafts=a.max_drafts))
              if a.speculative else None)
  levels = a.levels
  examples, requests = gsm_requests(a.problems, a.seed, levels)
  prompts = [r.prompt for r in requests]

  overhead = None
  if a.overhead_tokens:
    # The Generator keeps an f32 contiguous cache: compare with the same cache.
    same_cache = Controller(build_decode_model(llama, {"cache": "contiguous"}),
                            ck.tokenizer, max_rows=a.max_rows)
    overhead = measure_overhead(same_cache, Generator(llama, ck.tokenizer), prompts,
                                a.overhead_tokens, min(8, len(prompts)))
    print(f"overhead: {json.dumps(overhead)}", flush=True)

  rows = []
  correct_by = {}
  calibration = None
  runs = [(name, False) for name in a.policies]
  if a.speculative:
    runs += [(name, True) for name in a.policies]
  for name, speculate in runs:
    row_name = name + ("+spec" if speculate else "")
    ctl_used = spec_ctl if speculate else ctl
    if name == "deepconf_calibrated" and calibration is not None:
      policy = get_policy("deepconf", **policy_params("deepconf", a),
                          threshold=calibration["threshold"])
    elif name == "deepconf_calibrated":
      policy = get_policy("deepconf", **policy_params("deepconf", a))
      _, held_out = gsm_requests(a.calibration_problems, a.seed + 1000, levels)
      t0 = time.perf_counter()
      threshold = policy.calibrate(ctl, held_out)
      calibration = {"problems": len(held_out), "seed": a.seed + 1000, "threshold": threshold,
                     "seconds": time.perf_counter() - t0}
      print(f"calibration: {json.dumps(calibration)}", flush=True)
      policy = get_policy("deepconf", **policy_params("deepconf", a), threshold=threshold)
    else:
      policy = get_policy(name, **policy_params(name, a))
    # Compile the full-batch programs outside the timing: the widest call of a
    # policy is its warm-up call (deepconf's per-request mode) or its n samples.
    widest = getattr(policy, "warmup", None) if getattr(policy, "threshold", 0) is None else None
    per_chunk = max(1, a.max_rows // (widest or getattr(policy, "n", 1)))
    ctl_used.run(requests[:per_chunk], policy)
    t0 = time.perf_counter()
    results = ctl_used.run(requests, policy)
    total = time.perf_counter() - t0
    correct = [answers_match(r.answer, e.reference) for r, e in zip(results, examples)]
    correct_by[row_name] = np.array(correct, bool)
    gen = np.array([r.tokens.generated for r in results])
    lat = np.array([r.wall_time_s for r in results])
    row = {"policy": row_name, "params": policy.to_dict(), "problems": len(results),
           "speculative": speculate, "seconds_per_problem": total / len(results),
           "accuracy": float(np.mean(correct)), "tokens_mean": float(gen.mean()),
           "tokens_median": float(np.median(gen)),
           "probe_tokens_mean": float(np.mean([r.tokens.probe for r in results])),
           "discarded_mean": float(np.mean([r.tokens.discarded for r in results])),
           "latency_p50_s": float(np.percentile(lat, 50)),
           "latency_p95_s": float(np.percentile(lat, 95)),
           "backtracks_mean": float(np.mean([r.backtracks for r in results])),
           "early_exits": int(sum(r.early_exit for r in results)),
           "round_trips_per_problem": float(np.mean([r.loop_invocations for r in results])),
           "total_s": total}
    if speculate:
      spec = [t.speculative for r in results for t in r.traces if t.speculative]
      row["drafted"] = int(sum(d["drafted"] for d in spec))
      row["accepted"] = int(sum(d["accepted"] for d in spec))
    if name.startswith("deepconf"):
      row["threshold_mean"] = float(np.mean([r.info["threshold"] for r in results]))
      row["stopped_traces"] = int(sum(r.info.get("stopped", 0) for r in results))
      row["consensus_stopped_traces"] = int(sum(r.info.get("consensus_stopped", 0)
                                                for r in results))
      row["decided_problems"] = int(sum(r.info.get("consensus_stopped", 0) > 0 for r in results))
      row["key_mismatches"] = int(sum(r.info.get("key_mismatches", 0) for r in results))
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "params"}), flush=True)
    with open(out / f"traces_{row_name}.jsonl", "w") as f:
      for r, ok in zip(results, correct):
        f.write(json.dumps({**r.to_dict(), "correct": ok}) + "\n")

  by = {r["policy"]: r for r in rows}
  summary = {"overhead": overhead, "policies": rows, "problems": len(examples), "n": a.n,
             "cache": a.cache, "kv_dtype": a.kv_dtype, "matmul_dtype": a.matmul_dtype,
             "total_s": time.perf_counter() - t_start,
             "load_average_1m": {"start": load_start[0], "end": os.getloadavg()[0]},
             "cpus": os.cpu_count()}
  if calibration:
    summary["deepconf_calibration"] = calibration
  for variant in ("deepconf", "deepconf_calibrated"):
    if variant in by and "self_consistency" in by:
      sc, dc = by["self_consistency"], by[variant]
      savings = 1.0 - dc["tokens_mean"] / sc["tokens_mean"]
      delta = 100.0 * (dc["accuracy"] - sc["accuracy"])
      interval = paired_interval(correct_by[variant], correct_by["self_consistency"],
                                 a.bootstrap, a.seed)
      both = correct_by[variant] == correct_by["self_consistency"]
      summary[f"{variant}_vs_self_consistency"] = {
          "n": a.n, "token_savings": savings, "accuracy_delta_points": delta,
          "accuracy_delta_95ci_points": list(interval) if interval else None,
          "problems_disagreeing": int((~both).sum()),
          "target_savings_met": savings >= 0.40, "target_accuracy_met": delta >= -2.0}
  front = pareto_front([(r["tokens_mean"], r["accuracy"]) for r in rows])
  front_s = pareto_front([(r["seconds_per_problem"], r["accuracy"]) for r in rows])
  for i, r in enumerate(rows):
    r["pareto"] = i in front
    r["pareto_seconds"] = i in front_s
  (out / "results.json").write_text(json.dumps(summary, indent=1))

  levels_text = ",".join(map(str, a.levels))
  lines = [f"{len(examples)} synthetic GSM problems (levels {levels_text}), embedded SmolLM2-135M, "
           f"n={a.n}, max thinking {a.max_thinking} tokens, max answer {a.max_answer} tokens "
           f"after the prefix, {a.cache} KV cache ({a.kv_dtype}), {a.matmul_dtype} matmuls; "
           f"{summary['total_s'] / 60:.0f} min on {os.cpu_count()} CPUs, "
           f"1-min load average {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end",
           "",
           "| policy | accuracy | tokens mean | tokens median | probe tokens | s/problem | P50 s | "
           "P95 s | backtracks | early exits | round trips | drafts accepted | Pareto |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['policy']} | {r['accuracy']:.3f} | {r['tokens_mean']:.1f} | "
                 f"{r['tokens_median']:.0f} | {r['probe_tokens_mean']:.1f} | "
                 f"{r['seconds_per_problem']:.2f} | "
                 f"{r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | "
                 f"{r['backtracks_mean']:.2f} | {r['early_exits']} | "
                 f"{r['round_trips_per_problem']:.1f} | "
                 f"{(str(r['accepted']) + '/' + str(r['drafted'])) if r['speculative'] else ''} | "
                 f"{'/'.join(k for k, on in (('tokens', r['pareto']), ('seconds', r['pareto_seconds'])) if on)} |")
  o = overhead
  lines.append("")
  if o:
    lines.append(f"controller overhead: {o['controller_s_per_step'] * 1e3:.1f} ms/step vs plain "
                 f"Generator {o['generator_s_per_step'] * 1e3:.1f} ms/step at batch {o['rows']} "
                 f"({100 * o['overhead']:+.1f}%)")
  if calibration:
    lines.append(f"deepconf_calibrated: threshold {calibration['threshold']:.3f} from "
                 f"{calibration['problems']} held-out problems (seed {calibration['seed']}, "
                 f"{a.n} unstopped traces each, {calibration['seconds']:.0f} s, not counted above)")
  for variant in ("deepconf", "deepconf_calibrated"):
    if f"{variant}_vs_self_consistency" not in summary:
      continue
    d = summary[f"{variant}_vs_self_consistency"]
    dc = by[variant]
    ci = d["accuracy_delta_95ci_points"]
    ci = f"interval {ci[0]:+.1f} .. {ci[1]:+.1f}" if ci else "no interval below 2 problems"
    lines.append(f"{variant} vs self_consistency (n={a.n}): {100 * d['token_savings']:.1f}% fewer "
                 f"tokens (target >= 40%: {'met' if d['target_savings_met'] else 'missed'}), "
                 f"accuracy {d['accuracy_delta_points']:+.1f} points (target within 2: "
                 f"{'met' if d['target_accuracy_met'] else 'missed'}; paired bootstrap 95% "
                 f"{ci}, {d['problems_disagreeing']} "
                 f"problems answered right by one policy only); stopped "
                 f"{dc['stopped_traces']} traces for low confidence (mean threshold "
                 f"{dc['threshold_mean']:.3f}) and {dc['consensus_stopped_traces']} by consensus "
                 f"({dc['decided_problems']} problems decided early), {dc['key_mismatches']} "
                 f"loop/host answer mismatches")
  (out / "table.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, key, flag, idx, label in (
      (axes[0], "tokens_mean", "pareto", front, "generated tokens per problem (mean)"),
      (axes[1], "seconds_per_problem", "pareto_seconds", front_s, "wall seconds per problem")):
    for r in rows:
      ax.scatter(r[key], r["accuracy"], marker="o" if r[flag] else "x")
      ax.annotate(r["policy"], (r[key], r["accuracy"]), fontsize=7)
    pts = sorted((rows[i][key], rows[i]["accuracy"]) for i in idx)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "--", lw=1)
    ax.set_xlabel(label)
    ax.set_ylabel("accuracy")
    ax.set_title(f"{len(examples)} synthetic GSM problems, SmolLM2-135M", fontsize=9)
  fig.tight_layout()
  fig.savefig(out / "pareto.png", dpi=120)
  print(f"wrote results.json, table.md and pareto.png to {out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
