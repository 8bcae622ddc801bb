"""Answer extraction and voting (host side; no dependency on pipelines).

`extract_number` reads the final numeric answer of a GSM-style trace: the
first number after the answer prefix if the prefix is present, else the last
number in the text; commas, "$" and trailing zeros of decimals are removed so
"1,200.00" and "1200" vote together.
"""

from __future__ import annotations

import collections
import re
from typing import Callable, Optional, Sequence

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")

AnswerExtractor = Callable[[str], Optional[str]]


def normalize_number(raw: str) -> str:
  s = raw.replace(",", "").replace("$", "")
  if "." in s:
    s = s.rstrip("0").rstrip(".")
  return s or "0"


def extract_number(text: str, prefix: str = "The answer is") -> Optional[str]:
  """The answer after `prefix` (first number), else the last number; None if none."""
  at = text.rfind(prefix) if prefix else -1
  if at >= 0:
    found = _NUMBER.search(text, at + len(prefix))
    if found:
      return normalize_number(found.group())
  found = _NUMBER.findall(text)
  return normalize_number(found[-1]) if found else None


def weighted_vote(answers: Sequence[Optional[str]],
                  weights: Sequence[float] | None = None) -> tuple[Optional[str], dict[str, float]]:
  """Answer with the largest total weight (ties: the one seen first); None answers abstain.

  Returns (winner, {answer: total weight})."""
  weights = [1.0] * len(answers) if weights is None else list(weights)
  totals: dict[str, float] = collections.OrderedDict()
  for a, w in zip(answers, weights):
    if a is not None:
      totals[a] = totals.get(a, 0.0) + float(w)
  if not totals:
    return None, {}
  best = max(totals.values())
  winner = next(a for a, v in totals.items() if v == best)
  return winner, dict(totals)


def majority_vote(answers: Sequence[Optional[str]]) -> tuple[Optional[str], dict[str, float]]:
  return weighted_vote(answers, None)
