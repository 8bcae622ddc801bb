"""Prompts that share a long prefix (a few-shot prompt) compute it once per admission.

`plan_shared_prefixes` picks, per admitted prompt, a donor whose prompt it extends (an
earlier prompt of the admission, or one a running slot holds); the admission then
prefills the roots whole and each other prompt only past the shared whole blocks. The
traces must be those of every prompt computing its own prefix."""

import math

import numpy as np
import pytest
from flax import nnx

from o1jax.controller import Controller, LoopSettings, PagedLlama, ReasoningRequest
from o1jax.controller import controller as controller_lib
from o1jax.controller.controller import SHARED_PREFIX_MIN_TOKENS, plan_shared_prefixes
from o1jax.controller.testing import MockTokenizer
from tests.o1jax.controller.conftest import VOCAB
from tests.o1jax.controller.test_admission import _same_scores
from tests.o1jax.controller.test_twin_and_batch import SAMPLED, _random_mock, _same


def test_plan_takes_the_longest_whole_block_prefix_and_computes_the_last_token():
  shared = list(range(100, 164))  # 64 tokens
  prompts = [shared + [1, 2, 3], shared + [4], shared[:40] + [9] * 30, shared]
  plan = plan_shared_prefixes(prompts, {}, unit=16)
  assert plan[0] is None  # the first computes all of its own
  assert plan[1] == (("root", 0), 64)
  # 40 shared tokens are 2 whole blocks (32) but under half of its 70: a root of its own.
  assert plan[2] is None
  # A prompt that is the prefix itself still computes its last token (63 -> 48 tokens).
  assert plan[3] == (("root", 0), 48)


def test_plan_prefers_the_longest_donor_and_lends_from_running_slots():
  a, b = list(range(200, 300)), list(range(200, 250)) + list(range(400, 450))
  held = {3: a}
  # b shares 48 tokens (whole blocks of 8) with the held a: under half of its 101, so a
  # root; a + [8] takes 96 from the held a rather than 48 from the root b.
  assert plan_shared_prefixes([b + [7], a + [8]], held, unit=8) == [None, (("held", 3), 96)]
  # A root of the admission beats a held prompt when it shares more.
  assert plan_shared_prefixes([b + [1], b + [2]], held, unit=8) == [None, (("root", 0), 96)]
  assert plan_shared_prefixes([a[:96] + [5]], held, unit=8) == [(("held", 3), 96)]


def test_plan_needs_the_minimum_and_whole_units():
  short = list(range(10, 10 + SHARED_PREFIX_MIN_TOKENS - 1))
  assert plan_shared_prefixes([short + [1], short + [2]], {}, unit=1) == [None, None]
  prefix = list(range(10, 10 + SHARED_PREFIX_MIN_TOKENS))
  assert plan_shared_prefixes([prefix + [1], prefix + [2]], {}, unit=1)[1] == (
      ("root", 0), SHARED_PREFIX_MIN_TOKENS)
  # unit larger than the minimum: at least one whole unit.
  assert plan_shared_prefixes([prefix + [1], prefix + [2]], {}, unit=64) == [None, None]


SETTINGS = LoopSettings(temperature=0.8, temp_bump=0.3, backtrack_threshold=0.5,
                        max_step_backtracks=1, max_backtracks=2, step_delimiter="a",
                        step_max_tokens=5, max_thinking_tokens=14, max_answer_tokens=3,
                        max_steps=4)
FEWSHOT = "Q: two plus two? A: four.\nQ: three plus one? A: four.\nQ: "  # 55 byte tokens
QUESTIONS = ["one plus one?", "five plus five?", "six?", "seven plus eight plus nine?"]


@pytest.fixture(scope="module")
def models(tiny_llama):
  contiguous, tok = tiny_llama
  llama = nnx.merge(contiguous.graphdef, contiguous.params)
  return contiguous, PagedLlama(llama, block_size=4), tok


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_shared_prefixes_give_the_traces_of_whole_prompts(models, cache):
  contiguous, paged, tok = models
  model = paged if cache == "paged" else contiguous
  requests = [ReasoningRequest(FEWSHOT + q, request_id=70 + i, seed=4)
              for i, q in enumerate(QUESTIONS)]
  shared = Controller(model, tok, max_rows=8).generate(requests, SETTINGS, 2)
  whole = Controller(model, tok, max_rows=8, share_prefixes=False).generate(requests, SETTINGS, 2)
  for a, b in zip(shared.traces, whole.traces, strict=True):
    for x, y in zip(a, b, strict=True):
      _same_scores(x, y, 1e-5)
      # Bit for bit: a row's sums do not depend on its batch (compilation_cache.jit), and
      # the suffix's attention over the donor's blocks adds what the whole prompt's does.
      np.testing.assert_array_equal([x.mean_logprob] + [s.score for s in x.steps],
                                    [y.mean_logprob] + [s.score for s in y.steps])


def test_the_prefix_blocks_are_held_once(models):
  _, paged, tok = models
  requests = [ReasoningRequest(FEWSHOT + q, request_id=i, seed=0)
              for i, q in enumerate(QUESTIONS)]
  ctl = {s: Controller(paged, tok, max_rows=8, share_prefixes=s) for s in (True, False)}
  ids = [ctl[True].encode(r.prompt) for r in requests]
  common = min(next((j for j, (x, y) in enumerate(zip(ids[0], p)) if x != y), len(p))
               for p in ids[1:])
  assert common >= SHARED_PREFIX_MIN_TOKENS
  bs = paged.block_size
  in_use = {s: int(c.initial_state(requests, ids, SETTINGS, 1, 0, [-math.inf] * 4)
                   .cache.blocks_in_use) for s, c in ctl.items()}
  assert in_use[False] == sum(math.ceil(len(p) / bs) for p in ids)
  kept = common // bs * bs
  assert in_use[True] == (math.ceil(len(ids[0]) / bs)
                          + sum(math.ceil((len(p) - kept) / bs) for p in ids[1:]))


def test_a_prompt_admitted_beside_a_running_one_takes_its_prefix(monkeypatch):
  """Two slots, requests of different lengths: later requests are admitted into a freed
  slot while the other slot still runs, and take the prefix from it. Every request's
  traces equal those it gets alone (the mock's logits are exact sums)."""
  model, tok = _random_mock(3), MockTokenizer(VOCAB)
  prefix = " A B C D" * 5 + " E" * 14  # 34 tokens
  tails = [" 7", " B", " D D", " 3", " C", " A A A"]
  requests = [ReasoningRequest(prefix + t, request_id=90 + i, seed=5) for i, t in enumerate(tails)]
  plans = []
  plan = controller_lib.plan_shared_prefixes

  def spy(prompts, held, unit):
    out = plan(prompts, held, unit)
    plans.append(out)
    return out

  monkeypatch.setattr(controller_lib, "plan_shared_prefixes", spy)
  streamed = Controller(model, tok, max_rows=4).generate(requests, SAMPLED, 2)
  assert any(p and p[0][0] == "held" for step in plans[1:] for p in step)
  monkeypatch.setattr(controller_lib, "plan_shared_prefixes", plan)
  alone = [Controller(model, tok).generate([r], SAMPLED, 2).traces[0] for r in requests]
  for a, b in zip(streamed.traces, alone, strict=True):
    for x, y in zip(a, b, strict=True):
      _same(x, y)


def test_share_prefixes_must_be_a_bool(models):
  contiguous, _, tok = models
  with pytest.raises(ValueError, match="share_prefixes must be a bool"):
    Controller(contiguous, tok, share_prefixes="no")
