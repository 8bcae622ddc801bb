"""IFEval-style instructions: each checker on hand-made right and wrong responses; strict/loose."""

import json

import pytest

from pipelines.suite import instructions as ins


@pytest.mark.parametrize("instruction, right, wrong", [
    (ins.MaxWords(5), "one two three four", "one two three four five"),  # < 5 words
    (ins.MinWords(3), "one two three", "one two"),
    (ins.MaxSentences(2), "First one. Second one!", "One. Two. Three?"),
    (ins.IncludeKeywords(("water", "light")), "Water and LIGHT.", "Only water here."),
    (ins.ForbiddenWords(("quiet",)), "The quietest street.", "A quiet street."),  # whole word
    (ins.JsonFormat(), '```json\n{"a": 1}\n```', "{'a': 1}"),
    (ins.Bullets(2), "* one\n- two", "* one\n* two\n* three"),
    (ins.Title(), "<<my title>>\ntext", "<<>> no title"),
    (ins.Lowercase(), "all lower, 42.", "Not lower."),
    (ins.Uppercase(), "ALL UPPER 42.", "ALL Upper."),
    (ins.EndPhrase("Thanks for reading."), "Hello.\nthanks for reading.  ", "Thanks for reading. Bye."),
    (ins.NoComma(), "No commas here.", "One, two."),
    # As IFEval (before: "12345 67." was lowercase and uppercase; a quoted ending failed)
    (ins.Lowercase(), "x = 12345.", "12345 67."),
    (ins.Uppercase(), "X = 12345.", "12345 67."),
    (ins.EndPhrase("Thanks for reading."), 'He said: "Thanks for reading."', '"Thanks." for reading.'),
    # IFEval removes every fence prefix in turn (before: only the first that matched)
    (ins.JsonFormat(), '```json```{"a": 1}```', '```json```{"a": 1'),
])
def test_each_checker_on_a_right_and_a_wrong_response(instruction, right, wrong):
  assert instruction.check(right)
  assert not instruction.check(wrong)
  assert ins.from_dict(json.loads(json.dumps(instruction.to_dict()))) == instruction


def test_loose_accepts_a_response_whose_first_or_last_line_breaks_the_rule():
  # Strict fails on the markdown intro line; IFEval's loose drops the first line.
  response = "Sure! Here it is:\n{\"note\": \"tide pools\"}"
  assert ins.follows(ins.JsonFormat(), response) == (False, True)
  # '*' removed: "**Thanks for reading.**" ends with the phrase once the stars go.
  assert ins.follows(ins.EndPhrase("Thanks for reading."), "Text.\n**Thanks for reading.**") == (False, True)
  # Nothing rescues a comma in every line; an empty response follows nothing.
  assert ins.follows(ins.NoComma(), "a, b\nc, d\ne, f") == (False, False)
  assert ins.follows(ins.Lowercase(), "  ") == (False, False)
  assert len(ins.loose_variants("a*\nb\nc")) == 8


def test_prompt_and_instruction_level_accuracy_strict_and_loose():
  ex = ins.generate_item(0, 2)  # 1 + 2 % 3 = 3 instructions
  assert len(ex.metadata["instructions"]) == 3
  example = ex.__class__(id=ex.id, dataset=ex.dataset, question=ex.question, reference="",
                         metadata={**ex.metadata, "instructions": [
                             ins.NoComma().to_dict(), ins.MaxWords(20).to_dict(),
                             ins.EndPhrase("That is all for now.").to_dict()]})
  good = ins.score(example, "short note. That is all for now.")
  assert good["correct"] and good["metrics"]["prompt_loose"] == 1.0
  half = ins.score(example, "Intro line, with a comma\nshort note. That is all for now.")
  # Strict: the comma breaks no_comma; loose drops the first line and passes all three.
  assert half["followed_strict"] == [False, True, True] and half["followed_loose"] == [True, True, True]
  # What the suite's instruction-level accuracy sums (pipelines/suite/metrics.py): 5 / 6, 6 / 6.
  assert [(s["metrics"]["instructions_strict"], s["metrics"]["instructions_loose"],
           s["metrics"]["instructions_total"]) for s in (good, half)] == [(3, 3, 3), (2, 3, 3)]


def test_generated_prompts_have_one_to_three_compatible_instructions():
  items = ins.generate(60, seed=0)
  counts = [len(ex.metadata["instructions"]) for ex in items]
  assert counts[:3] == [1, 2, 3] and set(counts) == {1, 2, 3}
  for ex in items:
    kinds = [d["id"] for d in ex.metadata["instructions"]]
    assert len(set(kinds)) == len(kinds)
    assert not any(frozenset((a, b)) in ins.CONFLICTS for a in kinds for b in kinds if a != b)
    for d in ex.metadata["instructions"]:
      assert ins.from_dict(d).describe() in ex.question


@pytest.mark.parametrize("text, sentences", [
    # Before: 3 and 1 (a "." after "Dr" ended a sentence; "Hello.World." was one).
    ("Dr. Smith visited. He left.", 2), ("Hello.World.", 2),
    ("Pi is 3.14 today.", 1), ("J. R. R. Tolkien wrote it. Yes.", 2),
    ('He said "Go." Then left.', 2), ("No. I disagree.", 2), ("No end", 1), ("", 0),
])
def test_sentences_are_counted_as_ifeval_splits_them(text, sentences):
  assert ins._sentences(text) == sentences


@pytest.mark.parametrize("text, sentences", [
    # Before: 3 and 1 (a mark before closing emphasis never ended a sentence), 3 (an
    # ellipsis before a lowercase word ended one; Punkt reads on).
    ("**Tide pools are small.** They hold crabs. They are fun. **Go at low tide.** Bring boots.", 5),
    ("*One.* Two.", 2), ("_One!_ Two.", 2), ("Hi... there. Bye.", 2), ("Wait... Then go.", 2),
    ("Fine\u2026 ok.", 1),
])
def test_sentences_end_before_closing_emphasis_and_not_at_a_continued_ellipsis(text, sentences):
  assert ins._sentences(text) == sentences


def test_sentence_counting_is_linear_and_json_nested_past_the_limit_is_not_json():
  """30,000 "Dr. " took 73 s (each stop copied the text's tail); JSON nested 1,000 levels
  raised RecursionError, which made the item a dead letter (left out of accuracy)."""
  import time
  start = time.perf_counter()
  assert ins._sentences("Dr. " * 30000) == 1 and ins._sentences("a... b " * 20000) == 1
  assert ins._sentences("One. " * 20000) == 20000
  assert time.perf_counter() - start < 5
  assert ins.JsonFormat().check("[" * 100000 + "]" * 100000) is False


def test_generated_prompts_are_distinct_and_the_first_n_do_not_depend_on_n():
  items = ins.generate(200, 0)
  assert len({ex.question for ex in items}) == 200  # before: items 72 and 126 were one prompt
  assert [ex.question for ex in ins.generate(80, 0)] == [ex.question for ex in items[:80]]
