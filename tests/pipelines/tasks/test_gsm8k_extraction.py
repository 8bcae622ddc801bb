"""GSM8K answer extraction and scoring, following lm-evaluation-harness conventions."""

import pytest

from pipelines.tasks.gsm8k import (COMPLETION_STOP_SEQUENCES, answers_match,
                                   extract_flexible, extract_strict, score_gsm8k)

# (completion, strict extraction, flexible extraction); None means "[invalid]".
CASES = [
    ("Tom has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
    ("The answer is 42.", "42", "42."),
    # Harness quirk: the pattern's final "." is any char, so without a period
    # at the very end it eats the last digit.
    ("The answer is 42", "4", "42"),
    ("It drops to -17 degrees. The answer is -17.", "-17", "-17."),
    # "$" is not allowed by the strict patterns, but is by the flexible one.
    ("She pays $1,234.50. The answer is $1,234.50.", None, "$1,234.50."),
    ("#### $18", None, "$18"),
    ("#### 1,234", "1,234", "1,234"),
    ("The answer is 1,000,000.", "1,000,000", "1,000,000."),
    ("The answer is 3.5.", "3.5", "3.5."),
    ("I do not know.", None, None),
    ("", None, None),
    ("a - b", None, None),                       # a lone minus is not a number
    ("#### 5\nThen again, #### 6", "5", "6"),    # strict: first; flexible: last
    ("Step 1: 2*3=6. Step 2: 6+1=7", None, "7"),
    # The question restated after the answer fools only the flexible match.
    # Mid-text, the greedy group keeps the period and "." eats the space.
    ("The answer is 12. Recall that Tom had 5 apples.", "12.", "5"),
    # The strict pattern is case-sensitive: lower-case "the answer is" is skipped.
    ("So the answer is 8. The answer is 9.", "9", "9."),
    ("#### 4\nThe answer is 5.", "4", "5."),     # "####" is tried first
    ("Total: -3", None, "-3"),
    ("I think 5...", None, "5..."),
]


@pytest.mark.parametrize("text, strict, flexible", CASES)
def test_extraction(text, strict, flexible):
  assert extract_strict(text) == strict
  assert extract_flexible(text) == flexible


@pytest.mark.parametrize("pred, ref, ok", [
    ("42.", "42", True),               # trailing period dropped
    ("$1,234", "1234", True),          # "$" and commas dropped
    ("1,234", "#### 1,234", True),     # raw GSM8K answer as reference also works
    ("1234.50", "1234.5", False),      # string match, as in the harness
    ("5...", "5", False),              # only one trailing period is removed
    ("-7", "7", False),
    (None, "7", False),
    ("7", "7", True),
])
def test_answers_match(pred, ref, ok):
  assert answers_match(pred, ref) is ok


def test_score_reports_both_metrics():
  s = score_gsm8k("The answer is 12. Recall that Tom had 5 apples.", "12")
  assert (s.strict_answer, s.flexible_answer) == ("12.", "5")
  assert s.strict_correct and not s.flexible_correct

  s = score_gsm8k("She earns 6 * 4 = 24 dollars, so $24 in total.", "24")
  assert not s.strict_correct and s.flexible_correct

  s = score_gsm8k("The answer is 42", "42")  # quirk: strict sees "4"
  assert not s.strict_correct and s.flexible_correct

  s = score_gsm8k("2 + 3 = 5\n#### 5", "5")
  assert s.strict_correct and s.flexible_correct
  assert s.to_dict() == {"strict_answer": "5", "flexible_answer": "5",
                         "strict_correct": True, "flexible_correct": True}

  s = score_gsm8k("no idea", "5")
  assert s.strict_answer is None and not s.strict_correct and not s.flexible_correct


def test_stop_sequences_hide_text_about_an_invented_next_question():
  completion = "3 + 4 = 7. The answer is 7.\n\nQ: Sam has 9 pens. How many?\nA: The answer is 9."
  with_stop = score_gsm8k(completion, "7", COMPLETION_STOP_SEQUENCES)
  assert with_stop.strict_correct and with_stop.flexible_correct
  without = score_gsm8k(completion, "7")
  assert without.strict_correct and not without.flexible_correct
