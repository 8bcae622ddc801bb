"""GSM8K answer extraction and scoring, following lm-evaluation-harness conventions."""

import pytest

from pipelines.tasks.gsm8k import (COMPLETION_STOP_SEQUENCES, answer_key, answers_match,
                                   extract_flexible, extract_strict, score_gsm8k, value_key,
                                   values_match)

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


# Real-data conventions end to end: GSM8K-style references ("<worked solution> #### N",
# calculator annotations included) against common ways models state an answer. Matching
# is the harness's string match after normalization, not a numeric one: "1,234", "$1,234"
# and "1234." equal 1234, "1234.0" and "1,234.00" do not (the harness scores them wrong).
REF_1234 = "Each box holds 2 * 617 = <<2*617=1234>>1234 pens.\n#### 1,234"
VERDICTS = [
    # (completion, reference, strict_correct, flexible_correct)
    ("So 617 * 2 = 1234.\n#### 1234", REF_1234, True, True),
    ("The answer is 1,234.", REF_1234, True, True),
    ("The answer is $1,234.", REF_1234, False, True),     # "$" is outside the strict pattern
    ("The answer is $1,234.00.", REF_1234, False, False),  # "1234.00" != "1234": string match
    ("The answer is 1234.0.", REF_1234, False, False),
    ("That makes \\boxed{1234}.", REF_1234, False, True),   # only the flexible match sees it
    ("The answer is 1234 pens.", REF_1234, True, True),     # a unit after the number
    ("He pays 18 dollars.", "x\n#### 18", False, True),
    ("The answer is -3.", "It falls by 3 degrees.\n#### -3", True, True),
    ("The answer is 3.", "x\n#### -3", False, False),
    ("The answer is 0.5.", "x\n#### 0.5", True, True),
    ("The answer is .5.", "x\n#### 0.5", False, False),      # string match: ".5" != "0.5"
    ("The answer is 25%.", "x\n#### 25", True, True),
    ("The answer is \\frac{1}{2}.", "x\n#### 0.5", False, False),
    # Never a number inside a longer one for the flexible match, nor for "####".
    ("The answer is 123.", "x\n#### 12", False, False),
    ("#### 123", "x\n#### 12", False, False),
    ("She has 1,234 pens.", "x\n#### 234", False, False),
    ("It costs 12.5 dollars.", "x\n#### 12", False, False),
    # The harness quirk (extract_strict's doc): at the very end, the strict "." eats a digit.
    ("The answer is 123", "x\n#### 12", True, False),
    ("The answer is 3/4.", "x\n#### 3", True, False),
    # Several numbers: strict takes the first "#### N" (else the first "The answer is N."),
    # flexible the last number-like span in the text.
    ("The answer is 5. Wait, 3 + 3 = 6. The answer is 6.", "x\n#### 6", False, True),
    ("#### 6\nCheck: 2 * 3 = 6, so 6 - 1 = 5", "x\n#### 6", True, False),
    # No answer is never right, whatever the reference normalizes to.
    ("", "x\n#### 0", False, False),
    ("I am not sure...", "x\n#### 0", False, False),
    ("The answer is ,.", "x\n#### 0", False, False),
]


@pytest.mark.parametrize("text, reference, strict_ok, flexible_ok", VERDICTS)
def test_verdicts_on_real_data_conventions(text, reference, strict_ok, flexible_ok):
  s = score_gsm8k(text, reference)
  assert (s.strict_correct, s.flexible_correct) == (strict_ok, flexible_ok), s


@pytest.mark.parametrize("pred", ["...", "$", ",", ".", "$$", ",,", "", "   "])
def test_a_prediction_without_a_digit_never_matches(pred):
  # The flexible pattern extracts "..." or "$$"; after normalization some are "" or "."
  # and would equal a reference that normalizes the same way.
  for reference in (pred, "", ".", "$", "0"):
    assert not answers_match(pred, reference)
  assert answer_key(pred) is None
  assert answer_key("$1,234.") == "1234" and answer_key("-0.5") == "-0.5" and answer_key(None) is None


# By value (the custom task's answer_format=number): the same extractions, compared as
# numbers; exact decimals (no float rounding), so a different value stays wrong.
@pytest.mark.parametrize("pred, ref, ok", [
    ("4", "4.0", True), ("4.", "4.0", True), ("04", "4.0", True), ("$4.00", "4", True),
    ("1000", "1,000.00", True), ("1,000", "1000.00", True), ("$1,000.", "1000", True),
    ("-.5", "-0.50", True), ("-0.5", "-.5", True), ("0.5", "-0.50", False),
    ("3.00", "$3", True), ("3", "$3", True),
    ("-0", "0.0", True), ("0", "-0.00", True),
    ("4.01", "4", False), ("4", "4.01", False), ("40", "4.0", False), ("1234.50", "1234.5", True),
    # Exact decimal text: a float would round these two to one value.
    ("0.10000000000000001", "0.1", False), ("0.1", "0.100", True),
    ("5...", "5", False),  # not a plain decimal after the harness normalization: no value
    (None, "4", False), ("...", "0", False), ("$", "0", False),
])
def test_values_match_compares_numbers_by_value(pred, ref, ok):
  assert values_match(pred, ref) is ok


def test_value_key_is_the_controllers_vote_key():
  from o1jax.controller.answers import normalize_number
  for raw in ("4.0", "04", "-.5", "1,000.00", "$3", "-0.0", "0.250"):
    assert value_key(raw) == normalize_number(raw)
  assert [value_key(a) for a in ("4", "4.0", "4.", "$4.00", "1,000.00")] == ["4", "4", "4", "4", "1000"]
  assert value_key("1.2.3") == "1.2.3" and value_key("...") is None and value_key(None) is None


@pytest.mark.parametrize("text, reference, strict_ok, flexible_ok", [
    ("The answer is 4.", "4.0", True, True),
    ("The answer is 1,000.", "1000.00", True, True),
    ("The answer is -.5.", "-0.50", True, True),
    ("It costs $3.00 in all. The answer is 3.", "3", True, True),
    ("The answer is 4.01.", "4", False, False),
    ("The answer is 1234.0.", REF_1234, True, True),  # the harness says False, False
    ("The answer is 42", "42", False, True),  # the harness's strict quirk is kept: "4"
])
def test_score_by_value_reads_like_the_harness_and_compares_numbers(text, reference, strict_ok,
                                                                     flexible_ok):
  s = score_gsm8k(text, reference, by_value=True)
  assert (s.strict_correct, s.flexible_correct) == (strict_ok, flexible_ok), s
  harness = score_gsm8k(text, reference)
  assert (s.strict_answer, s.flexible_answer) == (harness.strict_answer, harness.flexible_answer)


def test_the_harness_match_stays_a_string_match():
  assert not answers_match("1234.0", "1234") and not answers_match("4", "4.0")
  s = score_gsm8k("The answer is 1234.0.", "1234")
  assert not s.strict_correct and not s.flexible_correct


@pytest.mark.parametrize("text, key, reads", [
    ("The answer is 18.", "18", True),
    ("The answer is 1,200.", "1200", True),  # the harness drops commas
    ("The answer is -5.", "-5", True),
    ("The answer is 0.5.", "0.5", True),
    ("The answer is 18.00.", "18", True),  # by value: the reference may be "18.00"
    ("The answer is 3.50.", "3.5", True),
    ("The answer is 5. No: The answer is 7.", "7", False),  # strict reads the first: 5
    ("The answer is 18", "18", False),  # at the end strict's "." eats the 8: "1"
    ("The answer is $18.", "18", False),  # strict allows no "$"
    ("The answer is: 18.", "18", False),
    ("#### 3\nThe answer is 18.", "18", False),  # "####" is read first
    ("#### 18", "18", True),
    ("The answer is below.\nThe answer is 18.", "18", True),
    ("The answer is 7, 3 more than 4.", "7", False),  # flexible reads the last number: 4.
])
def test_reads_as_is_both_harness_readings_of_the_vote_key(text, key, reads):
  """Which of a vote's traces the eval job scores (`o1jax.controller.Controller.reads_as`):
  one whose strict and flexible readings both give the voted key's value, from its text
  alone; cut at the stop sequences first, as the score cuts it."""
  from pipelines.tasks.gsm8k import reads_as
  assert reads_as(text, key) is reads
  assert reads_as(text + "\n\nQ: Tom has 12 apples.", key, COMPLETION_STOP_SEQUENCES) is reads
