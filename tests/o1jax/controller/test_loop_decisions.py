"""Each loop decision driven by the hand-computable mock (see conftest for the arithmetic)."""

import math

import pytest

from o1jax.controller import Controller, LoopSettings, ReasoningRequest, SelfVerify
from o1jax.controller.testing import MockTokenizer
from tests.o1jax.controller.conftest import ID, VOCAB, MockWorld, p_edge

CHAIN = [("Q", " A", 5), (" A", " B", 5), (" B", "\n\n", 5), ("\n\n", " C", 5), (" C", " D", 5),
         (" D", "\n\n", 5), ("The answer is", " 7", 5), (" 7", "</s>", 5)]
REQ = [ReasoningRequest(prompt="Q", request_id=0)]


def one(world, settings, n=1, **kw):
  return world.controller().generate(REQ, settings, n, **kw).traces[0]


def test_steps_scores_and_step_budget():
  # Every token follows an x=5 edge: each step's mean-logprob score is p_edge(5) = 0.88650.
  t, = one(MockWorld(CHAIN), LoopSettings(max_steps=2))
  assert t.text == " A B\n\n C D\n\nThe answer is 7"
  assert [(s.start, s.end, s.action) for s in t.steps] == [(0, 3, "continue"), (3, 6, "answer_steps")]
  assert [s.score for s in t.steps] == pytest.approx([p_edge(5)] * 2, rel=1e-5)
  assert (t.tokens.thinking, t.tokens.answer, t.tokens.discarded) == (6, 2, 0)
  assert t.answer == "7" and t.exit_reason == "answer_eos"
  # 7 tokens on x=5 edges plus the forced prefix, a 0-logit entry of the "\n\n" row.
  forced = -math.log(math.exp(5) + 19)
  assert t.mean_logprob == pytest.approx((7 * math.log(p_edge(5)) + forced) / 8, rel=1e-5)


WEAK = [e if e[:2] != ("\n\n", " C") else ("\n\n", " C", 1.0) for e in CHAIN]
# Step "C D \n\n" after a blank line: (P(C|\n\n) P(D|C) P(\n\n|D))^(1/3) with P(C|\n\n) = e/(e+19).
WEAK_SCORE = (p_edge(1) * p_edge(5) ** 2) ** (1 / 3)  # = 0.4616


def test_backtrack_exactly_below_threshold_and_within_limits():
  st = LoopSettings(max_steps=4, backtrack_threshold=0.6, max_step_backtracks=2, max_backtracks=3)
  t, = one(MockWorld(WEAK), st)
  # Greedy resampling reproduces the weak step: 2 retries for step 2 (per-step limit),
  # 1 for step 3 (total limit 3 reached), none for step 4.
  assert [s.action for s in t.steps] == ["continue", "backtrack", "backtrack", "continue",
                                         "backtrack", "continue", "answer_steps"]
  assert [s.score for s in t.steps] == pytest.approx([p_edge(5)] + [WEAK_SCORE] * 6, rel=1e-5)
  assert t.backtracks == 3
  assert (t.tokens.thinking, t.tokens.discarded, t.tokens.answer) == (12, 9, 2)
  assert t.tokens.generated == 23
  assert t.text == " A B\n\n C D\n\n C D\n\n C D\n\nThe answer is 7"
  # The discarded spans point at the rolled-back positions.
  assert [(s.start, s.end) for s in t.steps if s.action == "backtrack"] == [(3, 6), (3, 6), (6, 9)]


@pytest.mark.parametrize("delta, backtracks", [(-1e-4, 0), (1e-4, 2)])
def test_threshold_edge(delta, backtracks):
  st = LoopSettings(max_steps=2, backtrack_threshold=WEAK_SCORE + delta, max_step_backtracks=2,
                    max_backtracks=10)
  t, = one(MockWorld(WEAK), st)
  assert t.backtracks == backtracks


# Chain edges are 12 so the " No" boosts (3 per " bad", at most 9 here) never win in the text.
BAD = [(a, b, 12) for a, b in [("Q", " A"), (" A", " B"), (" B", "\n\n"), ("\n\n", " C"),
                               (" C", " bad"), (" bad", "\n\n"), ("The answer is", " 7"),
                               (" 7", "</s>")]] + [(" check:", " Yes", 2)]


def p_yes(bad: int) -> float:
  """Probe " check:": logits Yes 2, No 0 + 3 per " bad" before it; P(Yes | Yes or No)."""
  return math.exp(2) / (math.exp(2) + math.exp(3 * bad))  # 0 -> 0.8808, 1 -> 0.2689


def test_self_verify_probe_backtracks_and_leaves_sequence_untouched():
  world = MockWorld(BAD, triggers=[(" bad", {" No": 3.0})])
  verifier = SelfVerify(probe=" check:", yes=" Yes", no=" No")
  st = LoopSettings(max_steps=4, verifier=verifier, backtrack_threshold=0.5, max_step_backtracks=2,
                    max_backtracks=3)
  t, = one(world, st)
  assert [s.action for s in t.steps] == ["continue", "backtrack", "backtrack", "continue",
                                         "backtrack", "continue", "answer_steps"]
  # Accepted bad steps stay in the context: steps 2, 3, 4 see 1, 2, 3 " bad" tokens.
  expected = [p_yes(0)] + [p_yes(1)] * 3 + [p_yes(2)] * 2 + [p_yes(3)]
  assert [s.score for s in t.steps] == pytest.approx(expected, rel=1e-4)
  assert t.tokens.probe == 7  # one probe token per step boundary
  # Same tokens as without any probe: the scratch region never leaks into the sequence.
  plain, = one(world, LoopSettings(max_steps=4))
  assert t.token_ids == plain.token_ids
  assert t.text == " A B\n\n C bad\n\n C bad\n\n C bad\n\nThe answer is 7"


def test_early_exit_at_tau():
  # Each "\n\n" seen adds 1 to the logit of " 7"; after the answer prefix (a zero row) the
  # answer confidence after k blank lines is e^k / (e^k + 19): k=4 -> 0.742, k=5 -> 0.8865.
  edges = [(a, b, 8.0) for a, b, _ in CHAIN if a != "The answer is"]
  world = MockWorld(edges, triggers=[("\n\n", {" 7": 1.0})])
  st = LoopSettings(exit_tau=0.85, answer_probe=True)
  t, = one(world, st)
  assert [s.action for s in t.steps] == ["continue"] * 4 + ["early_exit"]
  assert t.early_exit
  assert t.tokens.probe == 5  # the 1-token answer prefix, once per boundary
  assert t.answer == "7"
  # Each step records the confidence it read (an early exit's was not in the record).
  conf = [math.exp(k) / (math.exp(k) + 19) for k in range(1, 6)]
  assert [s.answer_confidence for s in t.steps] == pytest.approx(conf, rel=1e-4)
  plain, = one(world, LoopSettings(max_steps=4))  # no probe: nothing read
  assert all(math.isnan(s.answer_confidence) for s in plain.steps)
  # As JSON: null, not NaN (a trace's dict is written to JSON lines by the benchmarks).
  import json
  steps = json.loads(json.dumps(plain.to_dict(), allow_nan=False))["steps"]
  assert [s["answer_confidence"] for s in steps] == [None] * len(plain.steps)
  assert [s["answer_confidence"] for s in t.to_dict()["steps"]] == pytest.approx(conf, rel=1e-4)
  # tau 0.89 sits between k=5 (0.8865) and k=6 (0.9550): one more step.
  t_hi, = one(world, LoopSettings(exit_tau=0.89, answer_probe=True))
  assert [s.action for s in t_hi.steps] == ["continue"] * 5 + ["early_exit"]
  # A step budget of 5 ends thinking first: no early exit.
  t_cap, = one(world, LoopSettings(exit_tau=0.89, answer_probe=True, max_steps=5))
  assert not t_cap.early_exit and t_cap.steps[-1].action == "answer_steps"


def test_early_exit_reads_the_answer_past_a_whitespace_token():
  """SmolLM2 writes a lone " " before a number's digits: the answer confidence was that
  space's ~0.95-0.99 after every step, so exit_tau 0.85 ended thinking at the first step
  boundary. It is the probability of the answer's first token past the space (times the
  space's): as in test_early_exit_at_tau, P(" 7" | " ") after k blank lines is
  e^k / (e^k + 19), times P(" " | prefix) = e^10 / (e^10 + e^k + 18): k=4 -> 0.740, k=5 ->
  0.880."""
  edges = [(a, b, 8.0) for a, b, _ in CHAIN if a != "The answer is"] + [("The answer is", " ", 10.0)]
  world = MockWorld(edges, triggers=[("\n\n", {" 7": 1.0})])
  t, = one(world, LoopSettings(exit_tau=0.85, answer_probe=True))
  assert [s.action for s in t.steps] == ["continue"] * 4 + ["early_exit"]
  assert t.tokens.probe == 10  # the prefix and the space, once per boundary
  assert t.answer == "7" and t.text.endswith("The answer is  7")
  p_space = lambda k: math.exp(10) / (math.exp(10) + math.exp(k) + 18)
  assert p_space(1) > 0.99 and p_space(5) * p_edge(5) == pytest.approx(0.880, abs=1e-3)


def test_think_and_answer_budgets_to_the_token():
  edges = CHAIN[:-1] + [(" 7", " 3", 5), (" 3", " 7", 5)]
  t, = one(MockWorld(edges), LoopSettings(max_thinking_tokens=10, max_answer_tokens=3))
  # The answer budget counts the 3 tokens after the 2-token prefix: thinking was cut
  # after " C", so the forced prefix starts with its separator "\n\n" (after a
  # delimiter it does not: test_steps_scores_and_step_budget).
  assert (t.tokens.thinking, t.tokens.answer, t.tokens.prefix) == (10, 5, 2)
  assert t.thinking_text == " A B\n\n C D\n\n C D\n\n C"
  assert t.text == t.thinking_text + "\n\nThe answer is 7 3 7"
  assert t.answer_text == "The answer is 7 3 7"
  assert t.steps[-1].action == "think_budget" and t.exit_reason == "answer_budget"


WAITING = [("Q", " A", 5), (" A", " B", 5), (" B", " C", 5), (" C", "</s>", 5),
           (" Wait", " A", 5), ("The answer is", " 7", 5), (" 7", "</s>", 5)]


@pytest.mark.parametrize("minimum, waits, thinking", [(0, 0, 3), (3, 0, 3), (4, 1, 7), (7, 1, 7),
                                                      (8, 2, 11)])
def test_budget_forcing_waits_exactly_while_below_minimum(minimum, waits, thinking):
  st = LoopSettings(min_thinking_tokens=minimum, max_thinking_tokens=40, answer_on_eos=True)
  t, = one(MockWorld(WAITING), st)
  assert t.tokens.waits == waits
  assert t.tokens.thinking == thinking
  assert t.thinking_text == " A B C" + " Wait A B C" * waits
  assert t.text == t.thinking_text + "\n\nThe answer is 7"  # the forced prefix's separator
  assert t.answer_text == "The answer is 7"
  assert [s.action for s in t.steps].count("wait") == waits


def test_end_of_sequence_without_answer_phase():
  t, = one(MockWorld(WAITING), LoopSettings())
  assert t.text == " A B C" and t.exit_reason == "eos" and t.tokens.answer == 0
  assert t.steps[-1].action == "end"


def test_deepconf_confidence_and_stop():
  # Every step of the chain follows an x=5 edge; top-5 log-probs of such a row are
  # 5 - ln S and 4 x (-ln S), S = e^5 + 19, so the token confidence is ln S - 1 = 4.1205.
  conf = math.log(math.exp(5) + 19) - 1
  t, = one(MockWorld(CHAIN), LoopSettings(max_steps=3, conf_window=4))
  assert t.lowest_group_confidence == pytest.approx(conf, rel=1e-5)
  assert t.tail_confidence == pytest.approx(conf, rel=1e-5)
  stopped, = one(MockWorld(CHAIN), LoopSettings(max_steps=3, conf_window=4),
                 conf_stop=[conf + 1e-3])
  assert stopped.stopped_low_confidence and stopped.tokens.thinking == 4
  assert stopped.steps[-1].action == "low_conf_stop"
  kept, = one(MockWorld(CHAIN), LoopSettings(max_steps=3, conf_window=4), conf_stop=[conf - 1e-3])
  assert not kept.stopped_low_confidence and kept.token_ids == t.token_ids


@pytest.mark.parametrize("case", ["verify_probe", "budget_forcing", "answer_probe", "budgets"])
def test_a_tokenizer_that_adds_bos_to_prompts_adds_none_mid_sequence(case):
  """Gemma 3's and Llama 3's tokenizers put BOS before a prompt: the controller's forced
  text (the answer prefix, "Wait", a verify probe) and its step patterns were encoded with
  it (a BOS fed to the model before each, and step patterns starting with BOS that the
  text never matched). The same traces as a tokenizer without BOS, no BOS among them."""
  world, st = {
      "verify_probe": (MockWorld(BAD, triggers=[(" bad", {" No": 3.0})]), LoopSettings(
          max_steps=4, verifier=SelfVerify(probe=" check:", yes=" Yes", no=" No"),
          backtrack_threshold=0.5, max_step_backtracks=2, max_backtracks=3)),
      "budget_forcing": (MockWorld(WAITING), LoopSettings(
          min_thinking_tokens=7, max_thinking_tokens=40, answer_on_eos=True)),
      "answer_probe": (MockWorld([(a, b, 8.0) for a, b, _ in CHAIN if a != "The answer is"],
                                 triggers=[("\n\n", {" 7": 1.0})]),
                       LoopSettings(exit_tau=0.85, answer_probe=True)),
      "budgets": (MockWorld(CHAIN[:-1] + [(" 7", " 3", 5), (" 3", " 7", 5)]),
                  LoopSettings(max_thinking_tokens=10, max_answer_tokens=3)),
  }[case]
  plain, = Controller(world.model(), MockTokenizer(VOCAB)).generate(REQ, st, 1).traces[0]
  bos = MockTokenizer(VOCAB, bos_id=ID["<s>"], add_bos=True)
  assert bos.encode("Q") == [ID["<s>"], ID["Q"]]
  t, = Controller(world.model(), bos).generate(REQ, st, 1).traces[0]
  assert ID["<s>"] not in t.token_ids
  assert (t.token_ids, t.text, [s.action for s in t.steps], t.answer, t.tokens) == (
      plain.token_ids, plain.text, [s.action for s in plain.steps], plain.answer, plain.tokens)
