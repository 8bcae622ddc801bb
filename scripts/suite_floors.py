"""What replies that read no prompt score on the standardized suite: the floor a model's
headline should be read against. Scored with the suite's own scoring on its items (v2,
seed 0, 200 a category); no model runs.

  python scripts/suite_floors.py [--seed 0] [--out floors.json]

Instruction following: many prompts only forbid things or cap a length (no commas, fewer
than N words), so a fixed short reply follows them, as with IFEval's own checkers.
Summarization: key-fact recall has no precision or length term, so a copy of the document
finds every fact (ROUGE-L does not reward it); the default budget of 128 tokens holds the
document's first ~100 words only. Math and QA: a fixed answer and a copy of the question.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # (sibling modules)
from script_args import count, output_file  # noqa: E402
from pipelines.suite import instructions, math_reasoning, multihop_qa, summarization  # noqa: E402


def _mean(values) -> float:
  values = list(values)
  return sum(values) / len(values) if values else float("nan")


def floors(seed: int, n: int) -> list[dict]:
  rows = []
  items = instructions.generate(n, seed)
  for reply in ("", "ok", "<<t>>\nok"):
    scores = [instructions.score(ex, reply)["metrics"] for ex in items]
    rows.append(dict(category="instructions", reply=repr(reply),
                     prompt_strict=_mean(s["prompt_strict"] for s in scores),
                     instruction_strict=sum(s["instructions_strict"] for s in scores)
                     / sum(s["instructions_total"] for s in scores)))
  scores = [instructions.score(ex, ex.question)["metrics"] for ex in items]
  rows.append(dict(category="instructions", reply="the prompt, copied",
                   prompt_strict=_mean(s["prompt_strict"] for s in scores),
                   instruction_strict=sum(s["instructions_strict"] for s in scores)
                   / sum(s["instructions_total"] for s in scores)))
  items = summarization.generate(n, seed)
  document = lambda ex: ex.question.split("\n\nSummarize", 1)[0]
  for name, reply in (("the document, copied", document),
                      ("its first 100 words", lambda ex: " ".join(document(ex).split()[:100]))):
    scores = [summarization.score(ex, reply(ex)) for ex in items]
    rows.append(dict(category="summarization", reply=name,
                     key_fact_recall=_mean(s["key_fact_recall"] for s in scores),
                     rouge_l=_mean(s["rouge_l"] for s in scores)))
  items = math_reasoning.generate(n, seed)
  for reply in ("The answer is 0.", "The answer is 1."):
    rows.append(dict(category="math", reply=repr(reply), strict=_mean(
        math_reasoning.score(ex, reply)["metrics"]["strict"] for ex in items)))
  items = multihop_qa.generate(n, seed)
  scores = [multihop_qa.score(ex, ex.question)["metrics"] for ex in items]
  rows.append(dict(category="qa", reply="the question, copied",
                   exact_match=_mean(s["exact_match"] for s in scores),
                   f1=_mean(s["f1"] for s in scores)))
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--n", type=count(1), default=200, help="items per category")
  parser.add_argument("--out", type=output_file, default="",
                      help="also write the rows as JSON here")
  args = parser.parse_args()
  rows = floors(args.seed, args.n)
  print("| category | reply | metrics |\n|---|---|---|")
  for row in rows:
    metrics = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k not in ("category", "reply"))
    print(f"| {row['category']} | {row['reply']} | {metrics} |")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
