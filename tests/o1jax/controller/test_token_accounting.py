"""The token split (thinking / answer / prefix / probe / discarded / waits) is exact.

Every case is small enough to count by hand; generated = thinking + answer +
discarded must equal the kept sequence plus the rolled-back tokens, and the
answer budget counts only the tokens after the answer prefix."""

import pytest

from o1jax.controller import LoopSettings, ReasoningRequest, SelfVerify, TokenCounts
from tests.o1jax.controller.conftest import MockWorld

REQ = [ReasoningRequest(prompt="Q", request_id=0)]
CHAIN = [("Q", " A", 5), (" A", " B", 5), (" B", "\n\n", 5), ("\n\n", " C", 5), (" C", " D", 5),
         (" D", "\n\n", 5), ("The answer is", " 7", 5), (" 7", " 3", 5), (" 3", " 7", 5)]
WAITING = [("Q", " A", 5), (" A", " B", 5), (" B", " C", 5), (" C", "</s>", 5),
           (" Wait", " A", 5), (".", " A", 5), ("The answer is", " 7", 5), (" 7", "</s>", 5)]
BAD = [(a, b, 12) for a, b in [("Q", " A"), (" A", " B"), (" B", "\n\n"), ("\n\n", " C"),
                               (" C", " bad"), (" bad", "\n\n"), ("The answer is", " 7"),
                               (" 7", "</s>")]] + [(" check:", " Yes", 2)]


def one(world, settings):
  t, = world.controller().generate(REQ, settings, 1).traces[0]
  assert t.tokens.generated == t.tokens.thinking + t.tokens.answer + t.tokens.discarded
  assert t.tokens.generated == len(t.token_ids) + t.tokens.discarded
  return t


def test_multi_token_forced_prefix_is_not_budgeted_as_answer():
  # ". The answer is" is 3 tokens (".", " ", "The answer is"); max_answer_tokens=2 leaves
  # exactly two tokens after it (" 7 3") instead of letting the prefix use the budget up.
  st = LoopSettings(max_thinking_tokens=5, max_answer_tokens=2, answer_prefix=". The answer is")
  t = one(MockWorld(CHAIN), st)
  assert t.tokens == TokenCounts(thinking=5, answer=5, prefix=3)
  assert t.thinking_text == " A B\n\n C D" and t.answer_text == ". The answer is 7 3"
  assert t.exit_reason == "answer_budget"


def test_model_written_prefix_moves_from_thinking_to_answer():
  edges = [("Q", " A", 5), (" A", " B", 5), (" B", "The answer is", 5), ("The answer is", " 7", 5),
           (" 7", " 3", 5), (" 3", " 7", 5)]
  t = one(MockWorld(edges), LoopSettings(max_answer_tokens=3))
  assert t.tokens == TokenCounts(thinking=2, answer=4, prefix=1)
  assert t.answer_text == "The answer is 7 3 7" and t.steps[-1].action == "model_answer"


def test_backtracks_and_probes_are_split_exactly():
  # 3 backtracks of 3-token steps (" C bad\n\n") are discarded; the probe " check:" is one
  # token per step boundary (7 boundaries) and never enters the sequence.
  st = LoopSettings(max_steps=4, verifier=SelfVerify(probe=" check:", yes=" Yes", no=" No"),
                    backtrack_threshold=0.5, max_step_backtracks=2, max_backtracks=3)
  t = one(MockWorld(BAD, triggers=[(" bad", {" No": 3.0})]), st)
  assert t.tokens == TokenCounts(thinking=12, answer=2, prefix=1, probe=7, discarded=9)


@pytest.mark.parametrize("wait_text, minimum, maximum, counts", [
    # " Wait" (1 token): 3 thought, eos -> Wait, 3 more = 7 >= 4 -> answer ("\n\n" and
    # the prefix forced after " C").
    (" Wait", 4, 40, TokenCounts(thinking=7, answer=3, prefix=2, waits=1)),
    # " Wait." (2 tokens): 3 + 2 + 3 = 8 < 9, but another " Wait." would make 10 > 9:
    # the thinking budget wins and the answer is forced at 8.
    (" Wait.", 9, 9, TokenCounts(thinking=8, answer=3, prefix=2, waits=1)),
])
def test_budget_forcing_waits_never_overrun_the_thinking_budget(wait_text, minimum, maximum,
                                                                counts):
  st = LoopSettings(min_thinking_tokens=minimum, max_thinking_tokens=maximum, wait_text=wait_text,
                    answer_on_eos=True)
  t = one(MockWorld(WAITING), st)
  assert t.tokens == counts
  assert t.tokens.thinking <= maximum and t.answer_text == "The answer is 7"


def test_tiny_llama_byte_prefix_leaves_the_answer_budget(tiny_llama):
  # Byte tokenizer: "The answer is" is 13 tokens (15 with the "\n\n" forced after a byte
  # that is not whitespace). It used to be counted against max_answer_tokens=4 (answer =
  # 13, nothing after the prefix); now 4 tokens follow it.
  model, tok = tiny_llama
  from o1jax.controller import Controller

  st = LoopSettings(temperature=0.8, step_delimiter="a", step_max_tokens=5, max_thinking_tokens=16,
                    max_answer_tokens=4, max_steps=4)
  traces = Controller(model, tok).generate([ReasoningRequest("hello there", 7, 1)], st, 4).traces[0]
  budgeted = [t for t in traces if t.exit_reason == "answer_budget"]
  assert budgeted
  for t in traces:
    assert t.tokens.generated == len(t.token_ids) + t.tokens.discarded
    assert t.tokens.thinking <= 16 and t.tokens.answer - t.tokens.prefix <= 4
  for t in budgeted:
    spaced = t.thinking_text[-1:].isspace()
    assert t.tokens.prefix == (13 if spaced else 15)
    assert t.tokens.answer == t.tokens.prefix + 4
    assert t.text[len(t.thinking_text):].startswith("The answer is" if spaced else "\n\nThe answer is")
    assert t.answer_text.startswith("The answer is")
    assert len(t.token_ids) == t.tokens.thinking + t.tokens.answer
