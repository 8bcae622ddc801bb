"""Each policy once on the embedded SmolLM2-135M with very small budgets."""

import pytest

from configs.policies import policy_config
from o1jax.controller import Controller, ContiguousLlama, build_policy

QUESTION = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does "
                                        "he have now? Answer step by step."}]


@pytest.fixture(scope="module")
def controller(embedded_checkpoint):
  from o1jax.model import Llama

  ck = embedded_checkpoint
  return Controller(ContiguousLlama(Llama(ck.config, ck.params)), ck.tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["greedy_cot", "self_consistency", "best_of_n", "deepconf",
                                  "think_verify_backtrack", "budget_forcing"])
def test_policy_smoke(controller, name):
  cfg = policy_config(name, smoke=True, step_delimiter="\n")
  res, = controller.run([QUESTION], build_policy(cfg))
  assert res.policy == name and res.traces and res.wall_time_s > 0
  for t in res.traces:
    assert t.tokens.thinking <= cfg.max_thinking_tokens
    assert t.tokens.answer - t.tokens.prefix <= cfg.max_answer_tokens
    assert t.tokens.generated == len(t.token_ids) + t.tokens.discarded
    assert t.steps and t.text
  if name == "greedy_cot":
    # Greedy SmolLM2 gets this one right within 24 thinking tokens.
    assert res.answer == "7", res.answer_text
  if name == "think_verify_backtrack":
    assert res.tokens.probe > 0  # the self-verification probe ran
  if name == "budget_forcing":
    assert res.traces[0].tokens.thinking >= min(cfg.min_thinking_tokens, cfg.max_thinking_tokens)


def test_a_forced_answer_reads_as_running_text(controller):
  """Thinking cut mid-sentence gets "\n\n" before the forced prefix, tokenized as the
  tokenizer reads it in running text (SmolLM2: two "\n" tokens, not its "\n\n" token,
  which the model hardly sees before a word); after a token ending in whitespace the
  separator is skipped."""
  from o1jax.controller import LoopSettings, ReasoningRequest

  tok = controller.tokenizer
  running = tok.encode("got on\n\nThe answer is")
  forced = tok.encode("\n\nThe answer is")
  assert running[len(running) - len(forced):] == forced
  st = LoopSettings(max_thinking_tokens=5, max_answer_tokens=2)
  t, = controller.generate([ReasoningRequest(QUESTION, request_id=0)], st, 1).traces[0]
  kept = t.token_ids[:t.tokens.thinking]
  assert not tok.decode(kept)[-1:].isspace()
  assert t.token_ids[t.tokens.thinking:t.tokens.thinking + len(forced)] == forced
  assert t.text.startswith(tok.decode(kept) + "\n\nThe answer is")
  assert t.answer_text.startswith("The answer is") and t.tokens.prefix == len(forced)
