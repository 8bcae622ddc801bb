"""Suite category `math`: GSM-style word problems from `pipelines.datasets.gsm_synthetic`.

Items cycle over the generator's difficulty levels 1-4 (50 of each in the full suite),
prompted like the GSM task's default (`shortshot`: a short system instruction and four
worked one-line examples). Scoring is the GSM task's: the lm-evaluation-harness strict
("The answer is N." / "#### N") and flexible (last number) extractions, exact match after
normalization. The headline is strict; with a voting policy the summary also votes.
"""

from __future__ import annotations

from pipelines.datasets import gsm_synthetic
from pipelines.datasets.records import Example
from pipelines.tasks import score_gsm8k

CATEGORY = "math"


def generate(n: int, seed: int) -> list[Example]:
  """Problem i has level LEVELS[i % 4]; the generator's own stream (no question twice)."""
  out = []
  for i, problem in enumerate(gsm_synthetic.generate(n, seed, gsm_synthetic.LEVELS)):
    ex = problem.to_example()
    out.append(Example(id=f"suite/math/{i}", dataset="suite", question=ex.question,
                       reference=ex.reference, metadata={**ex.metadata, "category": CATEGORY}))
  return out


def prompt(example: Example):
  from pipelines.task_specs import SHORT_ANSWER_SYSTEM, shortshot_messages
  return shortshot_messages(example.question, SHORT_ANSWER_SYSTEM), ()


def score(example: Example, text: str, stop: tuple[str, ...] = ()) -> dict:
  s = score_gsm8k(text, example.reference, stop_sequences=tuple(stop))
  return {"answer": s.strict_answer if s.strict_answer is not None else s.flexible_answer,
          "correct": s.strict_correct, **s.to_dict(),
          "metrics": {"strict": float(s.strict_correct), "flexible": float(s.flexible_correct)}}
