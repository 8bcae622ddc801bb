"""Thinking spans (<think> ... </think>): budgets inside the span, "Wait" inside it, the close
forced at the budget, answers read after it; on the hand-computable mock and on a tiny
random Qwen3-shaped GGUF with a Qwen3-style chat template."""

import numpy as np
import pytest

from o1jax.controller import ContiguousLlama, Controller, LoopSettings, ReasoningRequest
from o1jax.model import ThinkingSpan, thinking
from o1jax.controller.answers import extract_number
from o1jax.controller.testing import MockDecodeModel, MockTokenizer
from tests.o1jax.controller.conftest import MockWorld

VOCAB = ["", "<s>", "</s>", "<think>", "</think>", "\n", "\n\n", " A", " B", " 7", " 3",
         "The answer is", " Wait", "Q"]
ID = {s: i for i, s in enumerate(VOCAB)}
SPAN = ThinkingSpan("<think>", "</think>")


def controller(edges, span=SPAN, **kw) -> Controller:
  """Greedy chains a -> b (logit 8; 0 elsewhere) over this file's VOCAB."""
  return MockWorld([(a, b, 8.0) for a, b in edges], vocab=VOCAB).controller(thinking=span, **kw)


def run(ctl, settings=None, prompt="Q", **kw):
  settings = settings or LoopSettings(**kw)
  return ctl.generate([ReasoningRequest(prompt=prompt)], settings, 1).traces[0][0]


def test_model_closes_the_span_and_the_answer_is_read_after_it():
  # The thinking holds a 7; the answer after </think> is 3.
  ctl = controller([("\n", " A"), (" A", " 7"), (" 7", "</think>"), ("The answer is", " 3"),
                    (" 3", "</s>")])
  t = run(ctl)
  assert t.text == " A 7</think>\n\nThe answer is 3"
  assert (t.thinking_text, t.answer_text) == (" A 7", "The answer is 3")
  assert t.answer == "3" and t.exit_reason == "answer_eos"
  # Thinking counts the tokens inside the span; the close and the forced "\n\n" +
  # prefix are the answer's prefix.
  assert (t.tokens.thinking, t.tokens.answer, t.tokens.prefix) == (2, 4, 3)
  assert [s.action for s in t.steps] == ["model_answer"]
  assert ctl.final_text(t) == "The answer is 3"


def test_close_below_the_minimum_becomes_wait_inside_the_span():
  ctl = controller([("\n", " A"), (" A", "</think>"), (" Wait", " A"), ("The answer is", " 3"),
                    (" 3", "</s>")])
  t = run(ctl, min_thinking_tokens=5, max_thinking_tokens=40)
  # </think> after 1 and 3 thinking tokens is rolled back and " Wait" forced; at 5 it stands.
  assert t.thinking_text == " A Wait A Wait A"
  assert t.tokens.waits == 2 and t.tokens.thinking == 5
  assert t.answer_text == "The answer is 3" and t.answer == "3"
  assert t.text.count("</think>") == 1


def test_budget_closes_the_span():
  ctl = controller([("\n", " A"), (" A", " B"), (" B", " A"), ("The answer is", " 3"),
                    (" 3", "</s>")])
  t = run(ctl, max_thinking_tokens=4)
  assert t.text == " A B A B</think>\n\nThe answer is 3"
  assert t.tokens.thinking == 4 and t.tokens.prefix == 3
  assert [s.action for s in t.steps] == ["think_budget"]
  assert t.answer == "3"


@pytest.mark.parametrize("answer_on_eos", [True, False])
def test_end_of_sequence_inside_the_span(answer_on_eos):
  ctl = controller([("\n", " 7"), (" 7", "</s>"), ("The answer is", " 3"), (" 3", "</s>")])
  t = run(ctl, answer_on_eos=answer_on_eos)
  if answer_on_eos:  # the controller closes the span, and the answer follows
    assert t.text == " 7</think>\n\nThe answer is 3" and t.answer == "3"
  else:  # the span never closed: no answer, although the thinking holds a number
    assert (t.thinking_text, t.answer_text, t.answer) == (" 7", "", None)
    assert ctl.final_text(t) == ""


def test_no_answer_prefix_forces_only_the_close():
  ctl = controller([("\n", " A"), (" A", "</think>"), ("</think>", " 3"), (" 3", "</s>"),
                    (" B", " A")])
  t = run(ctl, answer_prefix="")
  assert t.text == " A</think> 3" and t.answer_text == " 3" and t.answer == "3"
  assert t.tokens.prefix == 1  # the close only


def test_the_vote_key_reads_after_the_span():
  ctl = controller([("\n", " 7"), (" 7", "</think>"), ("The answer is", " 3"), (" 3", "</s>")])
  t = run(ctl, answer_vote=True)
  assert t.answer_key == "3" == t.answer


def test_python_twin_and_batch_agree():
  edges = [("\n", " A"), (" A", " 7"), (" 7", "</think>"), ("The answer is", " 3"), (" 3", "</s>")]
  st = LoopSettings(temperature=0.8, max_thinking_tokens=12)
  reqs = [ReasoningRequest(prompt="Q", request_id=i, seed=1) for i in range(3)]
  a = controller(edges).generate(reqs, st, 2)
  b = controller(edges, python_twin=True).generate(reqs, st, 2)
  assert [[t.token_ids for t in ts] for ts in a.traces] == [[t.token_ids for t in ts]
                                                            for ts in b.traces]


def test_prompt_ends_inside_the_span():
  ctl = controller([])
  assert ctl.encode("Q") == [ID["Q"], ID["<think>"], ID["\n"]]
  assert ctl.encode("Q<think>\n") == [ID["Q"], ID["<think>"], ID["\n"]]  # not opened twice
  assert ctl.encode([ID["Q"], ID["<think>"]]) == [ID["Q"], ID["<think>"]]
  with pytest.raises(ValueError, match="ends with a closed thinking span"):
    ctl.encode("Q<think>\n\n</think>\n\n")  # a template's "thinking off"
  off = controller([], span=None)
  assert off.thinking is None and off.encode("Q") == [ID["Q"]]


def test_settings_and_detection():
  class Tok:
    has_chat_template = True
    chat_template = "{{ '<think>\\n' }}...{{ '</think>' }}"

  class Plain(Tok):
    chat_template = "{{ messages }}"

  assert thinking.resolve("auto", Tok()) == SPAN
  assert thinking.resolve("auto", Plain()) is None
  assert thinking.resolve("off", Tok()) is None
  assert thinking.resolve("[THINK] [/THINK]", Plain()) == ThinkingSpan("[THINK]", "[/THINK]")
  with pytest.raises(ValueError, match="names no known thinking markers"):
    thinking.resolve("on", Plain())
  for bad in ("maybe", "<think>", "a a", "x y z"):
    with pytest.raises(ValueError, match="thinking"):
      thinking.check_setting(bad)
  with pytest.raises(ValueError, match="thinking marker '<think>' cannot be encoded"):
    Controller(MockDecodeModel(np.zeros((3, 3), np.float32)), MockTokenizer(["", "a", "b"]),
               thinking=SPAN)


def test_tiny_qwen3_gguf_with_a_qwen3_style_template(tiny_qwen3):
  llama, tok = tiny_qwen3
  ctl = Controller(ContiguousLlama(llama), tok)  # thinking="auto": read from the template
  assert ctl.thinking == SPAN
  open_id, close_id = tok.token_to_id("<think>"), tok.token_to_id("</think>")
  assert tok.encode("<think>\n</think>")[::2] == [open_id, close_id]  # one token each
  messages = [{"role": "user", "content": "What is 2+3?"}]
  prompt = ctl.encode(messages)
  assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
  st = LoopSettings(max_thinking_tokens=12, max_answer_tokens=6, min_thinking_tokens=4,
                    answer_on_eos=True)
  reqs = [ReasoningRequest(prompt=messages, request_id=i) for i in range(2)]
  traces = [ts[0] for ts in ctl.generate(reqs, st, 1).traces]
  tail = tok.encode("\n\nThe answer is")
  for t in traces:
    ids = t.token_ids
    assert ids.count(close_id) == 1 and open_id not in ids
    k = ids.index(close_id)
    assert k == t.tokens.thinking and 4 <= k <= 12  # the budget counts the span's tokens
    assert ids[k + 1:k + 1 + len(tail)] == tail and t.tokens.prefix == 1 + len(tail)
    assert t.thinking_text == tok.decode(ids[:k], skip_special=True)
    assert t.answer_text == tok.decode(ids[k + 1:], skip_special=True).lstrip("\n")
    assert t.answer == extract_number(t.answer_text)
  # The same tokens as a controller without a span whose forced answer is the close plus
  # the prefix, on a prompt that opens the span (while the model writes no </think>).
  off = Controller(ContiguousLlama(llama), tok, thinking="off")
  plain = off.generate([ReasoningRequest(prompt=prompt, request_id=i) for i in range(2)],
                       LoopSettings(max_thinking_tokens=12, max_answer_tokens=6,
                                    min_thinking_tokens=4, answer_on_eos=True,
                                    answer_prefix="</think>\n\nThe answer is"), 1)
  assert [ts[0].token_ids for ts in plain.traces] == [t.token_ids for t in traces]
