"""Math: the GSM generator across levels 1-4, scored by the harness's strict/flexible extraction."""

from pipelines.suite import math_reasoning as math_cat


def test_items_cycle_levels_and_score_right_and_wrong_answers():
  items = math_cat.generate(8, seed=0)
  assert [ex.metadata["level"] for ex in items] == [1, 2, 3, 4] * 2
  ex = items[2]
  right = math_cat.score(ex, f"So it is {ex.reference}. The answer is {ex.reference}.")
  assert right["correct"] and right["metrics"] == {"strict": 1.0, "flexible": 1.0}
  # No "The answer is": strict finds nothing, flexible takes the last number.
  flexible_only = math_cat.score(ex, f"I think {ex.reference}")
  assert not flexible_only["correct"] and flexible_only["metrics"] == {"strict": 0.0, "flexible": 1.0}
  wrong = math_cat.score(ex, f"The answer is {int(ex.reference) + 1}.")
  assert wrong["metrics"] == {"strict": 0.0, "flexible": 0.0}
  messages, stop = math_cat.prompt(ex)
  assert messages[-1] == {"role": "user", "content": ex.question} and stop == ()
