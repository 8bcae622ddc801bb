"""Markdown report and plots for one run, or a comparison of several: `python -m pipelines.report`.

  python -m pipelines.report runs/default             # (re)writes runs/default/report.md + PNGs
  python -m pipelines.report runs/*                   # each run's report + runs/comparison.md

Data flow: 1. read each run's summary.json and results.jsonl; 2. plot with matplotlib's
Agg backend (no display): latency histogram over the fixed buckets 0/10/50/100/200/500/1000
ms (request latency and latency per generated token), a heatmap of per-token latency
buckets over time since the run started, and reasoning-path statistics when the
traces carry them; 3. write report.md with the tables and the plots; 4. with several
runs, plot accuracy against completion tokens and against wall seconds per
example (Pareto frontiers drawn; speculation moves only the seconds), one point per
run labelled by policy (and drafter when it speculated), and write comparison.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import traceback
from typing import Optional, Sequence

from pipelines.summary import (LATENCY_BUCKETS_MS, bucket_index, bucket_label, is_time,
                               per_token_latencies, suite_missing_categories, timed_records,
                               token_gaps_ms)

HEATMAP_TIME_BINS = 20



def recomputed_line(summary: dict) -> str:
  """The work the engine lost to preemptions this run ('' when none, or when the run
  computed nothing and its throughput is an earlier run's)."""
  throughput = summary.get("throughput") or {}
  if "measured_in_run_started_ms" in throughput:
    return ""
  n = int(throughput.get("recomputed_tokens") or 0)
  return (f"The engine recomputed {n} tokens of preempted sequences: its KV pool was too small "
          f"for the running sequences (raise engine.kv_cache_bytes or engine.num_blocks)") if n else ""

def unscored_line(summary: dict) -> str:
  """What the accuracy leaves out ('' when nothing): it is over the scored samples, and a
  sample without a verdict (a dead letter, a sandbox error) is not counted wrong."""
  lost = summary.get("unscored") or {}
  samples, examples = int(lost.get("samples") or 0), int(lost.get("examples") or 0)
  unknown = int(lost.get("unidentified") or 0)
  errors = int(summary.get("sandbox_errors") or 0)
  missing = _missing_categories(summary)
  if not (samples or examples or unknown or errors or missing):
    return ""
  parts = ([f"{samples} samples went to dead letters (dead_letters.jsonl)"] if samples else []) + (
      [f"{unknown} failures of unknown work items (dead_letters.jsonl)"] if unknown else []) + (
      [f"{errors} samples were sandbox errors (their records' score.detail)"] if errors else []) + (
      [f"no record of the suite categories {', '.join(missing)} (no headline accuracy "
       "without them)"] if missing else [])
  return (f"Left out of accuracy (not counted wrong): {'; '.join(parts)}; {examples} examples "
          f"with no scored sample")


def _plt():
  import matplotlib
  matplotlib.use("Agg")  # files only; never needs a display
  import matplotlib.pyplot as plt
  return plt


class ReportError(ValueError):
  """A run directory whose files cannot be read; the message names the file (and line)."""


def _not_json(constant: str):
  raise ValueError(f"{constant} is not JSON")  # (a run writes strict JSON: NaN was edited in)


def _json(path: pathlib.Path, text: str, line: Optional[int] = None):
  try:
    return json.loads(text, parse_constant=_not_json)
  except ValueError as e:  # JSONDecodeError: an edited, cut or foreign file
    where = f" line {line}" if line else ""
    raise ReportError(f"{path}{where}: not valid JSON ({e})") from e


def load_summary(run_dir: str | os.PathLike) -> dict:
  """summary.json (what a comparison reads); `ReportError` names a file that is not one."""
  path = pathlib.Path(run_dir) / "summary.json"
  summary = _json(path, _read(path))
  if not isinstance(summary, dict):
    raise ReportError(f"{path}: expected a JSON object, got {type(summary).__name__}")
  return summary


def load_run(run_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
  """(summary.json, results.jsonl's records); `ReportError` names a file that is not theirs."""
  run_dir = pathlib.Path(run_dir)
  summary = load_summary(run_dir)
  records = []
  path = run_dir / "results.jsonl"
  if path.exists():
    for i, line in enumerate(_read(path).split("\n"), start=1):  # ("\n" only: U+2028 is text)
      if line.strip():
        record = _json(path, line, i)
        if not isinstance(record, dict):
          raise ReportError(f"{path} line {i}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
  return summary, records


def _read(path: pathlib.Path) -> str:
  try:
    return path.read_text(encoding="utf-8", errors="replace")
  except OSError as e:  # a directory, unreadable
    raise ReportError(f"cannot read {path}: {e.strerror or e}") from e


def _per_token_ms(r: dict) -> Optional[float]:
  """Mean ms per generated token of one sample: the engine's real per-token times when
  present (those after the first token); None for a sample that generated no token, or
  whose times leave none (as `per_token_latencies` leaves it out: its whole latency, or
  its TTFT, is no token's time)."""
  if int((r.get("tokens") or {}).get("completion", 0)) <= 0:
    return None
  if isinstance(r["timing"].get("token_ms"), list):
    times = [v for v in token_gaps_ms(r["timing"]) if is_time(v)]
    return sum(times) / len(times) if times else None
  return r["timing"]["latency_ms"] / int(r["tokens"]["completion"])


def plot_latency(records: Sequence[dict], path: pathlib.Path) -> None:
  plt = _plt()
  labels = [bucket_label(i) for i in range(len(LATENCY_BUCKETS_MS))]
  timed = timed_records(records)
  per_token, source = per_token_latencies(timed)
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for ax, values, title, unit in (
      (axes[0], [r["timing"]["latency_ms"] for r in timed], "request latency", "samples"),
      (axes[1], per_token, "latency per generated token" + (" (measured)" if source == "tokens" else
                                                             " (request / tokens)"),
       "tokens" if source == "tokens" else "samples")):
    counts = [0] * len(labels)
    for v in values:
      counts[bucket_index(v)] += 1
    ax.bar(range(len(labels)), counts, color="#4c72b0")
    ax.set_xticks(range(len(labels)), labels, rotation=30)
    ax.set_xlabel("ms")
    ax.set_ylabel(unit)
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_heatmap(records: Sequence[dict], path: pathlib.Path) -> None:
  """Samples per (time bin since the first batch started, per-token latency bucket)."""
  plt = _plt()
  import numpy as np
  timed = timed_records(records)
  grid = np.zeros((len(LATENCY_BUCKETS_MS), HEATMAP_TIME_BINS), int)
  t0 = min((r["timing"]["start_ms"] for r in timed), default=0.0)
  t1 = max((r["timing"]["end_ms"] for r in timed), default=1.0)
  width = max(t1 - t0, 1e-3) / HEATMAP_TIME_BINS
  for r in timed:
    if (per_token := _per_token_ms(r)) is None:
      continue
    col = min(int((r["timing"]["end_ms"] - t0) / width), HEATMAP_TIME_BINS - 1)
    grid[bucket_index(per_token), col] += 1
  fig, ax = plt.subplots(figsize=(8, 3.6))
  im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis",
                 extent=(0, (t1 - t0) / 1e3, -0.5, len(LATENCY_BUCKETS_MS) - 0.5))
  ax.set_yticks(range(len(LATENCY_BUCKETS_MS)), [bucket_label(i) for i in range(len(LATENCY_BUCKETS_MS))])
  ax.set_xlabel("seconds since the first batch started (by finish time)")
  ax.set_ylabel("ms per token")
  fig.colorbar(im, ax=ax, label="samples")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_reasoning(records: Sequence[dict], path: pathlib.Path) -> bool:
  """Histograms of steps / backtracks per sample and early-exit share; False when no traces."""
  traced = [r["trace"] for r in records if any(k in (r.get("trace") or {}) for k in ("steps", "backtracks"))]
  if not traced:
    return False
  plt = _plt()
  fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
  for ax, key in zip(axes[:2], ("steps", "backtracks")):
    ax.hist([float(t.get(key, 0) or 0) for t in traced], bins=20, color="#55a868")
    ax.set_title(key)
  exits = sum(bool(t.get("early_exit")) for t in traced)
  axes[2].bar(["early exit", "full"], [exits, len(traced) - exits], color="#c44e52")
  axes[2].set_title("early exits")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


# The metric of each task's per-sample `correct`, so the comparison and its Pareto plot
# rank runs by what their records call right: GSM8K's strict match (lm-evaluation-harness's
# strict-match), a custom task's number match (flexible) or text match (exact), HumanEval's
# pass@1. (The flexible match ranked GSM8K runs while their records scored strict.)
HEADLINE_METRICS = {"gsm8k": ("strict",), "custom": ("flexible", "exact"),
                    "humaneval": ("pass@1",)}


def _answer_key(answer: str) -> Optional[str]:
  """The controller's key of a scored answer (its first number), for comparing the two."""
  from o1jax.controller.answers import extract_number
  return extract_number(str(answer), prefix="")


def _headline_metric(summary: dict) -> Optional[str]:
  """The accuracy metric a (non-suite) run is ranked by (`HEADLINE_METRICS`), if it has it."""
  acc = summary.get("accuracy") or {}
  for k in HEADLINE_METRICS.get(summary.get("task"), ("pass@1", "strict", "flexible", "exact")):
    if acc.get(k) is not None:
      return k
  return None


def _missing_categories(summary: dict) -> list[str]:
  """The suite categories a run asked for and has no accuracy of: as its summary says, or
  (a summary written before 2026-12-06) read from its accuracy and config."""
  if summary.get("task") != "suite":
    return []
  if summary.get("missing_categories") or not summary.get("config"):  # (no config: not known)
    return summary.get("missing_categories") or []
  return suite_missing_categories(summary.get("accuracy") or {}, summary["config"])


def accuracy_value(summary: dict) -> Optional[float]:
  """Headline accuracy (`HEADLINE_METRICS`); the suite's is the mean of its categories'
  headlines (None while one has none)."""
  acc = summary.get("accuracy") or {}
  if summary.get("task") == "suite":
    values = list(acc.values())
    if not values or None in values or _missing_categories(summary):
      return None
    return round(sum(values) / len(values), 4)
  k = _headline_metric(summary)
  return None if k is None else acc[k]


def accuracy_interval(summary: dict) -> Optional[list[float]]:
  """The 95% interval of the headline accuracy where the summary has one (one 0/1 result
  per example: summary.json's `accuracy_ci95`; none for the suite's mean)."""
  k = None if summary.get("task") == "suite" else _headline_metric(summary)
  return None if k is None else (summary.get("accuracy_ci95") or {}).get(k)


def dataset_section(summary: dict) -> tuple:
  """(task, the config's `dataset` section as JSON, a file named by its base name:
  `data.jsonl`, `./data.jsonl` and `gs://b/data.jsonl` are one dataset); without its
  config: (task, None)."""
  data = (summary.get("config") or {}).get("dataset")
  if data is None:
    return summary.get("task"), None
  data = {k: os.path.basename(str(v).rstrip("/")) if k.endswith("path") and v else v
          for k, v in dict(data).items()}
  return summary.get("task"), json.dumps(data, sort_keys=True, default=str)


def comparison_groups(summaries: Sequence[dict]) -> list[tuple]:
  """What each run's accuracy is comparable within: its task and its data, by what its
  examples ask and expect (summary.json's `data_sha256`: one file under two paths is one
  dataset, and two datasets whose files share a name, as a Hub dataset's
  `test-00000-of-00001.parquet` do, are two). A summary written before that hash joins
  the one hash seen with its `dataset_section`, else that section is its group.
  Accuracies on other data do not compare: an easier dataset's run took a harder one's
  off the frontier."""
  sections = [dataset_section(s) for s in summaries]
  hashes_of = {}
  for section, s in zip(sections, summaries):
    if s.get("data_sha256"):
      hashes_of.setdefault(section, set()).add(s["data_sha256"])
  groups = []
  for section, s in zip(sections, summaries):
    known = s.get("data_sha256") or (
        next(iter(hashes_of[section])) if len(hashes_of.get(section, ())) == 1 else None)
    groups.append((s.get("task"), known) if known else section)
  return groups


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
  """Indices of the (cost, accuracy) points no other point dominates (no more cost and
  at least the accuracy, one of them strictly better)."""
  return [i for i, (c, a) in enumerate(points)
          if not any(c2 <= c and a2 >= a and (c2 < c or a2 > a) for c2, a2 in points)]


def front_members(costs: Sequence[Optional[float]], accuracies: Sequence[Optional[float]],
                  groups: Optional[Sequence] = None) -> set[int]:
  """Indices of the runs on the Pareto frontier of their group (their task and data,
  `comparison_groups`: accuracies of two tasks do not compare, and one task's runs
  dominated the other's) among those with both values."""
  groups = list(groups) if groups is not None else [None] * len(costs)
  members = set()
  for group in dict.fromkeys(groups):
    kept = [i for i, (c, a) in enumerate(zip(costs, accuracies))
            if groups[i] == group and c is not None and a is not None]
    members |= {kept[j] for j in pareto_front([(costs[i], accuracies[i]) for i in kept])}
  return members


def run_label(name: str, summary: dict) -> str:
  """policy, "+spec <drafter>" when the run speculated, and the run's directory name."""
  spec = (summary.get("config") or {}).get("speculative") or {}
  extra = f" +spec {spec.get('drafter', 'prompt_lookup')}" if spec.get("enabled") else ""
  return f"{summary.get('policy')}{extra} ({name})"


def seconds_per_example(summary: dict) -> Optional[float]:
  """Wall seconds per example of the samples this run computed (resumed ones excluded)."""
  t = summary.get("throughput") or {}
  done, span = t.get("samples_computed") or 0, t.get("span_s") or 0.0
  if not done or not span:
    return None
  return span / done * (summary.get("samples_per_example") or 1)


def plot_accuracy_vs_cost(runs: Sequence[tuple[str, dict]], path: pathlib.Path) -> None:
  """Accuracy against completion tokens and against wall seconds per example, one point
  per run, the Pareto frontier of each panel drawn. Speculation changes seconds, not
  tokens: its runs stand apart in the second panel only."""
  plt = _plt()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  # (a run without its token count is off the frontier, not one of no cost)
  costs = ((lambda s: s["tokens"].get("completion_per_example"), "completion tokens per example"),
           (seconds_per_example, "wall seconds per example"))
  accuracies = [accuracy_value(s) for _, s in runs]
  tasks = comparison_groups([s for _, s in runs])  # (task, data)
  for ax, (cost, label) in zip(axes, costs):
    xs = [cost(s) for _, s in runs]
    front = front_members(xs, accuracies, tasks)
    for i, (name, s) in enumerate(runs):
      x, y = xs[i], accuracies[i]
      if x is None or y is None:
        continue
      ax.scatter([x], [y], s=40, marker="o" if i in front else "x")
      ax.annotate(run_label(name, s), (x, y), textcoords="offset points", xytext=(4, 4),
                  fontsize=7)
    for task in dict.fromkeys(tasks):  # one frontier per task and data
      line = sorted((xs[i], accuracies[i]) for i in front if tasks[i] == task)
      ax.plot([p[0] for p in line], [p[1] for p in line], "--", lw=1)
    ax.set_xlabel(label)
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _stability_lines(summary: dict) -> list[str]:
  """Latency stability against the reference thresholds, one pass/fail line each."""
  num = fmt_number
  st = summary.get("latency_stability")
  if not st:
    return []
  values = {"per_token_cv": num(st.get("per_token_cv"), 3),
            "ttft_p95_ms": num(st.get("ttft_p95_ms"))}
  verdict = {True: "PASS", False: "FAIL", None: "not measured"}
  return ["Latency stability against the reference system's serving thresholds (a GPU "
          "server under steady load; an offline batch job on a CPU, whose first calls of "
          "each program shape load or compile it, is not expected to meet them):", ""] + [
      f"- {verdict[ok]}: {rule} (measured: {values[rule.split(' ')[0]]})"
      for rule, ok in st["pass"].items()]


# What a record's text could do to report.md: end the line (any of Python's line breaks,
# "\r" and U+2028 too, start blocks there), open HTML (a "<!--" hid the rest of the file),
# a code span, a link, an entity, emphasis, a table cell.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>&|])")


def _one_line(value, limit: Optional[int] = None) -> str:
  """`value` on one line (every line break a space: "\\r" and U+2028 end lines too), cut."""
  text = " ".join(str(value).splitlines())
  return text[:limit] if limit else text


def _fence(text: str, least: int) -> str:
  """Backticks that no run of backticks in `text` closes early."""
  return "`" * max(least, max(map(len, re.findall("`+", text)), default=0) + 1)


def md_text(value, limit: Optional[int] = None) -> str:
  """`value` as inline markdown text that reads as it is: on one line, its markup escaped."""
  return _MD_SPECIAL.sub(r"\\\1", _one_line(value, limit))


def md_code(value, limit: Optional[int] = None) -> str:
  """`value` as an inline code span on one line."""
  text = _one_line(value, limit)
  fence = _fence(text, 1)
  pad = " " if text.startswith("`") or text.endswith("`") else ""
  return f"{fence}{pad}{text}{pad}{fence}"


def md_block(value, lang: str = "", indent: str = "") -> str:
  """`value` as a fenced code block, each line indented by `indent`."""
  lines = str(value).splitlines()  # (every line break: a bare CR ended the block too)
  while lines and not lines[-1].strip():
    lines.pop()
  fence = _fence("\n".join(lines), 3)
  return "\n".join(indent + line for line in [fence + lang, *lines, fence])


def markdown_table(rows: Sequence[Sequence], header: Sequence[str]) -> str:
  """A markdown table (None shows as an empty cell; a cell's text is one escaped line)."""
  cell = lambda v: "" if v is None else _one_line(v).replace("|", "\\|")
  lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
  return "\n".join(lines)


def fmt_number(x, nd=1) -> str:
  """x with nd decimals if a float; "n/a" for None."""
  return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write_run_report(run_dir: str | os.PathLike) -> pathlib.Path:
  """report.md + latency_histogram.png + latency_heatmap.png (+ reasoning.png) in `run_dir`."""
  table, num = markdown_table, fmt_number
  run_dir = pathlib.Path(run_dir)
  summary, records = load_run(run_dir)
  # (a report that fails below leaves none, not the last one beside this time's plots)
  (run_dir / "report.md").unlink(missing_ok=True)
  plot_latency(records, run_dir / "latency_histogram.png")
  plot_heatmap(records, run_dir / "latency_heatmap.png")
  has_reasoning = plot_reasoning(records, run_dir / "reasoning.png")
  cfg = summary.get("config") or {}
  model = summary.get("model") or {}
  out = [f"# Evaluation report: {summary['task']} / {summary.get('policy')}", ""]
  out.append(f"Model {md_code(model.get('source', '?'))} ({md_text(model.get('predictor', '?'))}), "
             f"dataset {md_code((cfg.get('dataset') or {}).get('name', '?'))}: {summary['examples']} examples, "
             f"{summary['samples']} samples ({num(summary['samples_per_example'], 2)} per example).")
  out += ["", "## Accuracy", ""]
  ci = summary.get("accuracy_ci95") or {}
  interval = lambda k: f"{num(ci[k][0], 4)} .. {num(ci[k][1], 4)}" if ci.get(k) else ""
  # (a suite's samples are "correct" by their category's own rule, e.g. every key fact of a
  # summary found: their mean is not the categories' headline)
  per_sample = ("per-sample `correct` (mean over categories' samples)" if summary["task"] == "suite"
                else "per-sample (mean)")
  out.append(table([[k, num(v, 4), interval(k)] for k, v in (summary.get("accuracy") or {}).items()]
                   + [[per_sample, num(summary.get("sample_accuracy"), 4), ""]],
                   ["metric", "value", "95% interval (Wilson, over examples)"]))
  if summary.get("pass_at_k"):
    out += ["", "### pass@k", "", table([[f"pass@{k}", num(v, 4)] for k, v in summary["pass_at_k"].items()],
                                         ["k", "value"])]
    if cap := summary.get("pass_at_k_capped"):
      out += ["", f"pass@k stops at k = {cap['k_max']}: {cap['examples_with_fewer']} examples kept "
                  f"fewer than {cap['samples_most']} scored samples (dead letters or sandbox "
                  "errors), and pass@k needs k of every example."]
  if summary.get("sample_accuracy_by_level"):
    out += ["", "Per-sample accuracy by level: " + ", ".join(
        f"level {k}: {num(v, 3)}" for k, v in summary["sample_accuracy_by_level"].items())]
  tok = summary["tokens"]
  out += ["", "## Tokens", "", table([[k, v] for k, v in tok.items()], ["kind", "value"])]
  lat, ptl, thr = summary["latency_ms"], summary["latency_ms_per_token"], summary["throughput"]
  # (a rerun that resumed every sample keeps the throughput of the run that computed them)
  computed = (f"Computed this run: {thr['samples_computed']} samples in {num(thr['span_s'])} s ("
              if "measured_in_run_started_ms" not in thr else
              f"Computed this run: 0 samples (an earlier run computed {thr['samples_computed']} in "
              f"{num(thr['span_s'])} s: ")
  out += ["", "## Latency and throughput", "",
          table([[name, *(num(d.get(f"p{p}")) for p in (50, 90, 95, 99)), num(d.get("mean")), num(d.get("max"))]
                  for name, d in (("request (ms)", lat), ("per token (ms)", ptl),
                                  *((("time to first token (ms)", summary["ttft_ms"]),)
                                    if summary.get("ttft_ms") else ()))],
                 ["", "P50", "P90", "P95", "P99", "mean", "max"]), "",
          computed + f"{num(thr['samples_per_s'], 3)} samples/s, "
          f"{num(thr['completion_tokens_per_s'])} completion tok/s); "
          f"resumed from the store: {num((summary.get('run') or {}).get('resumed'))}; "
          f"wall time {num((summary.get('run') or {}).get('wall_s'))} s."
          + "".join(f" {line}." for line in [recomputed_line(summary)] if line), "",
          f"Per-token latency source: {ptl.get('source', 'request_latency/completion')} "
          f"({num(ptl.get('count'))} values).", "", *_stability_lines(summary), "",
          "![latency histogram](latency_histogram.png)", "", "![latency heatmap](latency_heatmap.png)"]
  from pipelines.suite.report import report_section
  out += report_section(summary, run_dir)  # the suite's table across categories, if any
  out += ["", "## Reasoning paths", ""]
  if has_reasoning:
    r = summary.get("reasoning") or {}
    out += [table([[k, num(v.get("total")), num(v.get("mean"), 2)] for k, v in r.items() if isinstance(v, dict)],
                   ["", "total", "mean per sample"]), "", "![reasoning](reasoning.png)", ""]
    out += ["First reasoning paths (traces, steps, backtracks, early exit, exit reasons, votes):", ""]
    for rec in [x for x in records if "steps" in (x.get("trace") or {})][:5]:
      t = rec["trace"]
      # The vote's key reads the number after the last answer prefix, the task's score its
      # own rule (GSM8K strict: the first): where they differ, the scored answer is shown.
      scored = rec.get("answer")
      shown = (f"{md_code(t.get('answer'))} (voted; scored {md_code(scored)}, "
               if scored is not None and _answer_key(scored) != t.get("answer") else
               f"{md_code(t.get('answer'))} (")
      out.append(f"- {md_code(rec['example_id'])}: answer {shown}"
                 f"{'correct' if rec['correct'] else 'wrong'}); {len(t.get('traces') or [])} traces, "
                 f"{t.get('steps')} steps, {t.get('backtracks')} backtracks, early exit "
                 f"{bool(t.get('early_exit'))}; exits {t.get('exit_reasons')}; "
                 f"votes {md_code(t.get('votes'))}")
  else:
    out.append("No step/backtrack/early-exit traces: plain sampling policies do not produce them "
               "(run a controller policy, e.g. policy=self_consistency or deepconf).")
  dead = summary["dead_letters"]
  out += ["", "## Dead letters", "", f"{dead['total']} total; by stage: {dead['by_stage'] or 'none'}."]
  if left_out := unscored_line(summary):  # accuracy is over the scored samples
    out.append(left_out + ".")
  dl_path = run_dir / "dead_letters.jsonl"
  if dead["total"] and dl_path.exists():
    lines = dl_path.read_text(encoding="utf-8", errors="replace").split("\n")
    for i, line in [(i, line) for i, line in enumerate(lines, 1) if line.strip()][:10]:
      d = _json(dl_path, line, i)
      where = f"{d.get('source')}:{d.get('line_number')}" if d.get("source") else f"{d.get('example_id')}#{d.get('sample_index')}"
      out.append(f"- {md_code(where)} ({md_text(d['stage'])}): {md_text(d['reason'], 160)}")
  out += ["", "## Sample outputs", ""]
  for r in records[:3]:
    verdict = "correct" if r["correct"] else "wrong"
    if r.get("reference") is not None:  # (HumanEval's records have none: the tests decide)
      verdict += f"; reference {md_code(r['reference'], 300)}"
    answer = "" if r["answer"] is None else str(r["answer"])
    if "\n" in answer.strip():  # code: as a block inside the item, not the output again
      out.append(f"- {md_code(r['example_id'])} #{r['sample_index']} ({verdict}): answer\n\n"
                 + md_block(answer, "python" if summary["task"] == "humaneval" else "", "  "))
      continue
    out.append(f"- {md_code(r['example_id'])} #{r['sample_index']}: answer {md_code(answer)} "
               f"({verdict}): {md_text(r['output'].strip(), 300)}")
  out += ["", "## Config", "", "```json", json.dumps(cfg, indent=2, default=list), "```", ""]
  path = run_dir / "report.md"
  path.write_text("\n".join(out), encoding="utf-8", errors="backslashreplace")  # even a lone surrogate
  return path


def record_mismatches(summary: dict, records: Sequence[dict]) -> list[str]:
  """What in results.jsonl does not belong to summary.json: records of another task or
  policy, a sample recorded twice (the count alone let a swapped or doubled file pass)."""
  out = []
  for field in ("task", "policy"):
    want = summary.get(field)
    other = sorted({str(r[field]) for r in records if field in r and r[field] != want})
    if want is not None and other:
      out.append(f"records of {field} {', '.join(other)} where summary.json's is {want}")
  seen, twice = set(), 0
  for r in records:
    key = r.get("key") or (r.get("example_id"), r.get("sample_index"))
    twice += key in seen
    seen.add(key)
  if twice:
    out.append(f"{twice} samples recorded twice")
  return out


def comparison_inputs(name: str, summary: dict) -> dict:
  """One run's row of the comparison, its values checked: a summary.json of valid JSON
  whose fields are of other types raises ValueError naming the field (the comparison
  ended in a traceback)."""
  try:
    data = summary.get("data_sha256")
    if data is not None and not isinstance(data, str):
      raise ValueError(f"data_sha256 is {data!r}, not a string")
    row = {"label": run_label(name, summary), "task": summary["task"],
           "examples": summary["examples"], "samples": summary["samples"],
           # examples with no scored sample (dead letters): the accuracy is over the others,
           # so a run that lost its hard examples could stand above one that kept them
           "unscored": int((summary.get("unscored") or {}).get("examples") or 0),
           "accuracy": accuracy_value(summary), "interval": accuracy_interval(summary),
           "tokens": summary["tokens"].get("completion_per_example"),
           "probe": probe_per_example(summary), "seconds": seconds_per_example(summary),
           "p50": summary["latency_ms"].get("p50"),
           "tok_s": summary["throughput"].get("completion_tokens_per_s")}
    for key in ("examples", "samples", "accuracy", "tokens", "probe", "seconds", "p50", "tok_s"):
      if row[key] is not None and (isinstance(row[key], bool) or not isinstance(row[key], (int, float))):
        raise ValueError(f"its {key} is {row[key]!r}, not a number")
    if row["interval"] is not None and not (
        isinstance(row["interval"], list) and len(row["interval"]) == 2
        and all(isinstance(x, (int, float)) for x in row["interval"])):
      raise ValueError(f"its accuracy interval is {row['interval']!r}, not two numbers")
    return row
  except (KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{type(e).__name__}: {e}") from e


def probe_per_example(summary: dict) -> float | None:
  """Probe tokens per example (0 for a policy without probes; None without examples)."""
  examples = summary.get("examples") or 0
  return (int(summary["tokens"].get("probe", 0)) / examples) if examples else None


def distinct_names(dirs: Sequence[pathlib.Path]) -> list[str]:
  """Each directory by its shortest trailing path that no other one ends with: `a/g1` and
  `b/g1` (both labelled "g1" before: two points, one label) are told apart."""
  names = []
  for d in dirs:
    parts = d.parts
    k = 1
    while k < len(parts) and any(o != d and o.parts[-k:] == parts[-k:] for o in dirs):
      k += 1
    names.append(str(pathlib.PurePath(*parts[-k:])))  # ("/", "g1"): "/g1", not "//g1"
  return names


def write_comparison(run_dirs: Sequence[str | os.PathLike], output_dir: str | os.PathLike) -> pathlib.Path:
  """comparison.md + accuracy_vs_cost.png over several runs."""
  table, num = markdown_table, fmt_number
  output_dir = pathlib.Path(output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  dirs = dict.fromkeys(pathlib.Path(d).resolve() for d in run_dirs)  # a run named twice: once
  runs = [(name, load_summary(d)) for name, d in zip(distinct_names(list(dirs)), dirs)]
  values = [comparison_inputs(name, s) for name, s in runs]
  plot_accuracy_vs_cost(runs, output_dir / "accuracy_vs_cost.png")
  groups = comparison_groups([s for _, s in runs])
  accuracies = [v["accuracy"] for v in values]
  on_front = [front_members([v[cost] for v in values], accuracies, groups)
              for cost in ("tokens", "seconds")]
  # Runs of one task on different data are on frontiers of their own: number the data.
  data_sets = {}
  for task, data in groups:
    data_sets.setdefault(task, {}).setdefault(data, len(data_sets.get(task, {})) + 1)
  task_label = lambda v, g: (f"{g[0]} [data {data_sets[g[0]][g[1]]}]" if len(data_sets[g[0]]) > 1
                             else v["task"])
  described = {}  # a group's data as its first run's config names it (and its hash)
  hashed = {s["data_sha256"] for _, s in runs if s.get("data_sha256")}
  for (_, s), g in zip(runs, groups):
    if g not in described:
      section = dataset_section(s)[1]
      described[g] = ((md_code(section) if section else "no config in its summary")
                      + (f", examples sha256 {g[1][:12]}" if g[1] in hashed else ""))
  legend = [f"- {task} [data {k}]: {described[(task, data)]}"
            for task, ds in data_sets.items() if len(ds) > 1 for data, k in ds.items()]
  interval = lambda v: (f"{num(v['interval'][0], 3)} .. {num(v['interval'][1], 3)}"
                        if v["interval"] else "")
  rows = [[v["label"], task_label(v, groups[i]), v["examples"], v["unscored"],
           v["samples"], num(v["accuracy"], 4), interval(v),
           num(runs[i][1]["tokens"].get("completion_per_example")), num(v["probe"]),
           num(v["seconds"], 2), num(v["p50"]), num(v["tok_s"]),
           "/".join(k for k, f in zip(("tokens", "seconds"), on_front) if i in f)]
          for i, v in enumerate(values)]
  text = "\n".join(["# Run comparison", "",
                    table(rows, ["run", "task", "examples", "unscored", "samples", "accuracy",
                                  "95% interval",
                                  "tokens/example", "probe tokens/example", "s/example",
                                  "P50 ms", "tok/s", "Pareto"]), "",
                    "Unscored: examples with no scored sample (dead letters), left out of "
                    "that run's accuracy.", "",
                    "Pareto: the run is on its task's accuracy-vs-cost frontier by tokens "
                    "and/or by wall seconds per example (runs of a task on different data, "
                    "named below, are on frontiers of their own). Tokens are generated "
                    "tokens; probe tokens (a verifier's or an answer probe's, run through "
                    "the model but not generated) are not on that axis but are in the "
                    "seconds.", "", *legend,
                    *([""] if legend else []),
                    "![accuracy vs cost](accuracy_vs_cost.png)", ""])
  path = output_dir / "comparison.md"
  path.write_text(text, encoding="utf-8", errors="backslashreplace")
  return path


def _unfinished_note(skipped: Sequence[str]) -> str:
  """Why directories without summary.json have none: a run still going (its lock is held),
  or one stopped before its end."""
  unfinished = [d for d in skipped if (pathlib.Path(d) / "store").is_dir()]
  if not unfinished:
    return ""
  from pipelines.eval import lock_held_elsewhere  # (absl and the configs: only here)
  running = [d for d in unfinished if lock_held_elsewhere(d)]
  return "".join([
      f" ({', '.join(running)}: a run still going; report it when it ends)" if running else "",
      " (a run stopped before its end: run pipelines.eval on it again to finish)"
      if len(running) < len(unfinished) else ""])


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("runs", nargs="+", help="run directories (each with summary.json)")
  parser.add_argument("--output_dir", default=None,
                      help="where comparison.md goes with several runs (default: the runs' common parent)")
  args = parser.parse_args(argv)
  # A run named twice (`a a`, `a a/`, through a link) is reported once: two copies made a
  # "comparison" of one run inside its own directory.
  named = list({os.path.realpath(d): d for d in reversed(args.runs)}.values())[::-1]
  runs = [d for d in named if (pathlib.Path(d) / "summary.json").exists()]
  missing = sorted(d for d in set(named) - set(runs) if not os.path.exists(d))
  skipped = sorted(set(named) - set(runs) - set(missing))
  if missing:
    print(f"skipping (not found): {missing}", file=sys.stderr)
  if skipped:
    print(f"skipping (no summary.json): {skipped}" + _unfinished_note(skipped), file=sys.stderr)
  for d in runs:  # (a summary.json that cannot be read is an error below)
    run_dir = pathlib.Path(d)
    if (run_dir / "summary.json").is_file() and not (run_dir / "results.jsonl").exists():
      print(f"warning: {d}/results.jsonl is missing: its report has the summary only (no "
            f"per-sample sections)", file=sys.stderr)
  if not runs:
    print("error: no run directory with a summary.json", file=sys.stderr)
    return 2
  failed = []
  for d in runs:
    try:
      summary, records = load_run(d)
      counted = summary.get("samples")
      if (run_dir := pathlib.Path(d) / "results.jsonl").exists():
        problems = ([f"{len(records)} records where summary.json counts {counted}"]
                    if isinstance(counted, int) and len(records) != counted else [])
        problems += record_mismatches(summary, records)
        if problems:
          print(f"warning: {run_dir} holds {'; '.join(problems)}: the file was cut or changed "
                f"since the run (pipelines.eval on the directory writes both again from its "
                f"store)", file=sys.stderr)
      print(write_run_report(d))
    except ReportError as e:  # one bad run: the others are still reported
      print(f"error: {e}", file=sys.stderr)
      failed.append(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # valid JSON, other fields
      # (or a bug here: where it was raised goes with it)
      frame = traceback.extract_tb(e.__traceback__)[-1]
      print(f"error: {d}: cannot report it ({type(e).__name__}: {e}, at "
            f"{os.path.basename(frame.filename)}:{frame.lineno}): summary.json or results.jsonl "
            f"is not what a run wrote", file=sys.stderr)
      failed.append(d)
    except OSError as e:  # report.md or a plot cannot be written
      print(f"error: cannot write the report under {d}: {e.strerror or e}", file=sys.stderr)
      failed.append(d)
  runs = [d for d in runs if d not in failed]
  for d in list(runs) if len(runs) > 1 else ():
    try:
      comparison_inputs(pathlib.Path(d).name, load_summary(d))
    except ValueError as e:  # its report was written; the comparison leaves it out
      print(f"error: {d}: cannot compare it ({e}): summary.json is not what a run wrote",
            file=sys.stderr)
      failed.append(d)
      runs.remove(d)
  if len(runs) > 1:
    out = args.output_dir or os.path.commonpath([os.path.abspath(d) for d in runs])
    try:
      print(write_comparison(runs, out))
    except OSError as e:  # --output_dir is a file, not writable, ...
      print(f"error: cannot write the comparison under {out}: {e.strerror or e}", file=sys.stderr)
      return 2
  return 2 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
