"""The suite's part of a run report: one table across categories and a latency heatmap.

  lines = report_section(summary, run_dir)   # markdown lines; writes suite_latency_heatmap.png

The heatmap has one row per category and one column per fixed latency bucket
(0/10/50/100/200/500/1000 ms); a cell is the share of that category's per-token latencies
in the bucket, annotated with the count.
"""

from __future__ import annotations

import pathlib

from pipelines.report import fmt_number, markdown_table
from pipelines.summary import LATENCY_BUCKETS_MS, bucket_label

HEATMAP_FILE = "suite_latency_heatmap.png"


def category_table(categories: dict) -> str:
  """Accuracy, tokens, TTFT P50/P95, per-token P50/P90/P95 and CV, one row per category."""
  f = fmt_number
  rows = []
  for name, c in categories.items():
    others = ", ".join(f"{k} {f(v, 3)}" for k, v in c["metrics"].items() if k != c["headline"])
    t, p = c["ttft_ms"], c["per_token_ms"]
    vote = " (majority vote)" if c.get("majority_vote") else ""
    rows.append([name, f"{c['headline']}{vote} {f(c['accuracy'], 3)}", others or "-", c["samples"],
                 f(c["tokens"]["completion_per_sample"]), f(t["p50"]), f(t["p95"]), f(p["p50"]),
                 f(p["p90"]), f(p["p95"]), f(p["cv"], 3)])
  return markdown_table(rows, ["category", "accuracy", "other metrics", "samples",
                               "tokens/sample", "TTFT P50 ms", "TTFT P95 ms", "tok P50 ms",
                               "tok P90 ms", "tok P95 ms", "tok CV"])


def histogram_table(categories: dict) -> str:
  labels = [bucket_label(i) for i in range(len(LATENCY_BUCKETS_MS))]
  rows = [[name, *(c["per_token_ms"]["histogram"].get(label, 0) for label in labels)]
          for name, c in categories.items()]
  return markdown_table(rows, ["per-token ms", *labels])


def plot_category_heatmap(categories: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")  # files only
  import matplotlib.pyplot as plt
  import numpy as np
  labels = [bucket_label(i) for i in range(len(LATENCY_BUCKETS_MS))]
  names = list(categories)
  counts = np.array([[categories[n]["per_token_ms"]["histogram"].get(label, 0) for label in labels]
                     for n in names], float).reshape(len(names), len(labels))
  share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
  fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 1.6))
  im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=1)
  ax.set_xticks(range(len(labels)), labels)
  ax.set_yticks(range(len(names)), names)
  ax.set_xlabel("per-token latency (ms)")
  for i in range(len(names)):
    for j in range(len(labels)):
      ax.text(j, i, str(int(counts[i, j])), ha="center", va="center",
              color="white" if share[i, j] < 0.6 else "black", fontsize=8)
  fig.colorbar(im, ax=ax, label="share of the category's tokens")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def report_section(summary: dict, run_dir: pathlib.Path) -> list[str]:
  categories = summary.get("categories") or {}
  if not categories:
    return []
  plot_category_heatmap(categories, pathlib.Path(run_dir) / HEATMAP_FILE)
  data = summary.get("data") or {}
  notes = [f"{name}: pass@k stops at k = {cap['k_max']}: {cap['examples_with_fewer']} items kept "
           f"fewer than {cap['samples_most']} scored samples (dead letters, sandbox errors)."
           for name, c in categories.items() if (cap := c.get("pass_at_k_capped"))]
  return ["", "## Suite: per category", "",
          f"Items: suite v{data.get('suite_version')}, seed {data.get('seed')}, "
          f"`{data.get('cache_file')}` (content sha256 `{data.get('content_sha256')}`); this run's "
          f"items sha256 `{data.get('items_sha256')}`.", "",
          category_table(categories), "", *([*notes, ""] if notes else []),
          "Per-token latency histogram (counts of tokens; samples where the predictor measures no "
          "per-token times):", "", histogram_table(categories), "",
          f"![per-category latency heatmap]({HEATMAP_FILE})"]
