"""Shared record helpers: harness-style normalization and GSM8K answer splitting."""

import pytest

from pipelines.datasets.records import (Example, RecordError, content_id, is_number,
                                        normalize_answer, split_gsm8k_answer)


@pytest.mark.parametrize("raw, want", [
    ("1,234", "1234"),
    ("$1,234.50", "1234.50"),     # string-level, like the harness: no float parsing
    ("42.", "42"),                 # one trailing period removed
    (" 7 ", "7"),
    ("-5", "-5"),
    ("blah\n#### 18", "18"),      # everything up to '#### ' dropped
    ("$", ""),
])
def test_normalize_answer(raw, want):
  assert normalize_answer(raw) == want


def test_is_number():
  assert is_number("12") and is_number("-3.5") and is_number(".5")
  assert not is_number("") and not is_number("1.2.3") and not is_number("five")
  # Digits of other scripts: answers are read from the model's text as ASCII digits, so
  # such a reference could never be matched (it was accepted and scored wrong every time).
  assert not is_number("５") and not is_number("1٢") and not is_number("٣.٥")


def test_split_gsm8k_answer():
  sol, final = split_gsm8k_answer("A is 3.\nB is <<3*2=6>>6.\n#### 6")
  assert sol == "A is 3.\nB is <<3*2=6>>6." and final == "6"
  assert split_gsm8k_answer("x\n#### $1,000")[1] == "1000"
  assert split_gsm8k_answer("x\n####-2")[1] == "-2"
  with pytest.raises(RecordError, match="no '#### N'"):
    split_gsm8k_answer("the answer is 6")
  with pytest.raises(RecordError, match="not a number"):
    split_gsm8k_answer("#### ")


def test_example_round_trip_and_alias():
  ex = Example("d/1", "d", "What?", "3", {"level": 1})
  assert Example.from_dict(ex.to_dict()) == ex
  assert ex.prompt == "What?"


def test_content_id_is_stable_and_sensitive():
  a = content_id("c", "q", "a")
  assert a == content_id("c", "q", "a") and a.startswith("c/")
  assert a != content_id("c", "qa", "")  # field boundaries matter
