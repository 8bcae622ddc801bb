"""Speculative decoding: drafters, the planner, and exactness against plain decoding."""

import numpy as np
import pytest
import scipy.stats

from o1jax.engine import (Engine, EngineConfig, GenerationParams, SpeculationPlanner,
                          SpeculativeConfig, expected_tokens, prompt_lookup)

# --- prompt lookup -------------------------------------------------------------------------


def test_prompt_lookup_takes_the_longest_suffix_match():
  #         0  1  2  3  4  5  6  7  8  9
  tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
  # The 2-gram (6, 7) occurs at 1 and 5; the most recent (5) continues with 9, 2.
  assert prompt_lookup(tokens, 2, ngram_max=3) == [9, 2]
  # A 3-gram match (1, 6, 7 ... no; 2, 6, 7 is new) is absent, so 2 is the longest.
  tokens = [4, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7]
  # (4, 6, 7) occurs at 0: the 3-gram wins over the more recent 2-gram at 5.
  assert prompt_lookup(tokens, 3, ngram_max=3) == [8, 1, 6]


def test_prompt_lookup_limits_and_misses():
  assert prompt_lookup([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # runs to the end of the sequence
  assert prompt_lookup([1, 2, 3, 4], 5) == []  # the last token never occurred before
  assert prompt_lookup([1, 2, 3, 1], 0) == []
  assert prompt_lookup([7], 4) == []
  assert prompt_lookup([1, 2, 3, 2], 4, ngram_min=2) == []  # only a 1-gram would match
  assert prompt_lookup([3, 3, 3, 3], 2) == [3]  # the match just before the suffix


# --- the planner ---------------------------------------------------------------------------


def test_expected_tokens_is_a_truncated_geometric_sum():
  assert expected_tokens(3, 0.0) == 1.0
  assert expected_tokens(3, 1.0) == 4.0
  assert expected_tokens(2, 0.5) == pytest.approx(1.75)


def test_acceptance_estimates_start_from_the_engine_and_recover():
  from o1jax.engine.speculative import Acceptance

  planner = SpeculationPlanner(SpeculativeConfig())
  seq = Acceptance()
  assert planner.rate(seq) == pytest.approx(0.5)  # nothing seen anywhere yet
  other = Acceptance()
  for _ in range(6):
    planner.record(other, 4, 4)  # another sequence's drafts are all accepted
  assert planner.rate(seq) > 0.8  # a new sequence starts from the engine-wide estimate
  fresh = planner.rate(seq)
  planner.record(seq, 4, 0)  # its first draft is rejected
  low = planner.rate(seq)
  assert low < fresh - 0.2
  for _ in range(40):
    seq.idle()  # calls without drafts: back toward the engine-wide estimate
  assert planner.rate(seq) == pytest.approx(planner.acceptance.rate(), abs=0.05)
  assert planner.rate(seq) > low + 0.2
  # An engine whose drafts were all rejected: a new sequence starts from that
  # (realistic), or at OPTIMISTIC_RATE when the planner explores (optimistic).
  gloomy = SpeculationPlanner(SpeculativeConfig())
  for _ in range(20):
    gloomy.record(Acceptance(), 4, 0)
  assert gloomy.acceptance.rate() < 0.1
  assert gloomy.rate(Acceptance()) == pytest.approx(gloomy.acceptance.rate())
  assert gloomy.rate(Acceptance(), optimistic=True) == pytest.approx(gloomy.OPTIMISTIC_RATE)
  assert gloomy.rate(seq, optimistic=True) == gloomy.rate(seq)  # evidence of its own


def test_config_checks_and_buckets():
  assert SpeculativeConfig(max_drafts=5).k_buckets == (1, 3, 5)
  assert SpeculativeConfig(max_drafts=1).k_buckets == (1,)
  assert SpeculativeConfig(max_drafts=7).k_buckets == (1, 3, 7)
  for bad in (dict(drafter="oracle"), dict(max_drafts=0), dict(ngram_min=3, ngram_max=2),
              dict(exit_layer=-1)):
    with pytest.raises(ValueError, match="speculative"):
      SpeculativeConfig(**bad)
  with pytest.raises(ValueError, match="no keys"):
    SpeculativeConfig.from_dict({"drafter": "prompt_lookup", "k": 4})
  assert SpeculativeConfig(drafter="early_exit").resolved_exit_layer(30) == 7
  with pytest.raises(ValueError, match="exit_layer"):
    SpeculativeConfig(exit_layer=30).resolved_exit_layer(30)


def test_planner_speculates_only_where_it_pays():
  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=7))
  assert planner.choose(8, [0, 0], [0.9, 0.9]) == 0  # nothing drafted
  assert planner.choose(8, [7, 7], [0.9, 0.9]) == 0  # plain decoding not timed yet
  planner.observe(8, 0, 0.010)
  # Unmeasured shapes: 10 ms x (1 + 0.15 K); at acceptance 0.9, K=7 emits ~5.7 tokens.
  assert planner.choose(8, [7, 7], [0.9, 0.9]) == 7
  assert planner.choose(8, [7, 7], [0.05, 0.05]) == 0  # drafts rarely accepted
  assert planner.choose(8, [1, 0], [0.9, 0.9]) == 1  # the largest K any row can fill
  # Measured: K=7 costs 8 plain steps -> not worth it; K=3 at 1.5 steps is.
  planner.observe(8, 7, 0.080)
  planner.observe(8, 3, 0.015)
  assert planner.choose(8, [7, 7], [0.9, 0.9]) == 3
  planner.observe(8, 3, 0.015)
  planner.observe(8, 3, 0.200)  # a slow outlier: the median of recent timings counts
  assert planner.cost(8, 3) == 0.015
  for _ in range(SpeculationPlanner.KEEP):  # K=3 got slow for good
    planner.observe(8, 3, 0.200)
  assert planner.choose(8, [7, 7], [0.9, 0.9]) in (0, 1)
  # Shapes untimed for STALE decisions are tried once more (the best whose prior beats
  # plain: exploring), plain decoding first ...
  for _ in range(SpeculationPlanner.STALE):
    planner.choose(8, [1, 1], [0.9, 0.9])
  assert planner.choose(8, [7, 7], [0.9, 0.9]) == 0
  planner.observe(8, 0, 0.010)
  assert planner.choose(8, [7, 7], [0.9, 0.9]) == 7  # 20.5 ms at its prior
  planner.observe(8, 7, 0.080)  # ... and, still slow, dropped again
  assert planner.explored_seconds == pytest.approx(0.070)  # beyond a plain step
  # K=3 is stale too, but the exploring budget is spent: 70 ms against 0.5% of the ~2 s
  # of decoding seen (the floor: no verify call has saved anything).
  assert planner.explore_share() == planner.EXPLORE_FLOOR
  assert planner.choose(8, [7, 7], [0.9, 0.9]) in (0, 1)
  while planner.seen_seconds < 0.070 / planner.EXPLORE_FLOOR:
    planner.observe(8, 0, 0.010, steps=8)  # plain calls of 8 steps
  assert planner.choose(8, [7, 7], [0.9, 0.9]) == 3
  fixed = SpeculationPlanner(SpeculativeConfig(max_drafts=7, adaptive=False))
  assert fixed.choose(8, [5, 2], [0.0, 0.0]) == 3  # the largest bucket the drafts fill


def test_planner_explores_new_sequences_within_its_budget():
  """A drafter whose drafts are almost never accepted: new sequences are tried at the
  optimistic OPTIMISTIC_RATE only while such calls cost at most EXPLORE_FLOOR of the
  decoding seen (speculation has saved nothing), EXPLORE_SHARE once it has saved what
  exploring cost."""
  from o1jax.engine.speculative import Acceptance

  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=3))
  planner.observe(8, 0, 0.010)
  planner.observe(8, 3, 0.018, emitted=1.0)
  assert planner.saved_seconds == pytest.approx(-0.008)  # one token per row in 18 ms, not 10
  for _ in range(20):
    planner.record(Acceptance(), 3, 0)  # every draft so far rejected
  old = Acceptance()
  planner.record(old, 3, 0)

  def choose():
    seqs = [old, Acceptance()]  # and a sequence just admitted
    return planner.choose(8, [3, 3], [planner.rate(q) for q in seqs],
                          optimistic=[planner.rate(q, optimistic=True) for q in seqs])

  assert planner.choose(8, [3, 3], [planner.rate(q) for q in (old, Acceptance())]) == 0
  # Exploring: the new row at 0.9; K=3 takes 18 ms for ~4.5 tokens (plain: 2 per 10 ms).
  assert choose() == 3  # the first one is free
  planner.observe(8, 3, 0.018, emitted=1.0)  # 8 ms beyond a plain step, nothing accepted
  assert planner.explored_seconds == pytest.approx(0.008)
  assert planner.explore_share() == planner.EXPLORE_FLOOR
  assert choose() == 0  # budget spent: 8 ms > 0.5% of 36 ms seen
  while planner.seen_seconds < 0.008 / planner.EXPLORE_FLOOR:
    assert choose() == 0
    planner.observe(8, 0, 0.010, steps=8)
  assert choose() == 3 and planner.explorations == 2
  planner.observe(8, 0, 0.010)  # a call of another shape is not charged
  assert planner.explored_seconds == pytest.approx(0.008)
  # The exploring call's drafts are accepted: 4 tokens per row in 18 ms (22 ms saved);
  # 6 ms saved in all against 16 ms explored: the share rises in proportion ...
  planner.observe(8, 3, 0.018, emitted=4.0)
  assert planner.explored_seconds == pytest.approx(0.016)
  assert planner.saved_seconds == pytest.approx(-0.016 + 0.022)
  assert planner.explore_share() == pytest.approx(
      planner.EXPLORE_FLOOR + (planner.EXPLORE_SHARE - planner.EXPLORE_FLOOR) * 0.006 / 0.016)
  planner.observe(8, 3, 0.018, emitted=3.0)  # ... to the full share once 16 ms are saved
  assert planner.explore_share() == planner.EXPLORE_SHARE
  # A draft model's catch-up, timed apart from the call, is an exploring cost too.
  while planner.seen_seconds < 0.010 / planner.EXPLORE_SHARE:
    planner.observe(8, 0, 0.010, steps=8)
  assert choose() == 3
  planner.observe(8, 3, 0.018, one_off=0.050)
  assert planner.explored_seconds == pytest.approx(0.016 + 0.008 + 0.050)


def test_planner_tries_a_drafter_that_pays_only_at_high_acceptance():
  """Draft steps estimated at 0.4 of a step each (an int8 draft model of the same model,
  by weight bytes): at 0.5 no K pays, so a drafter never tried must be tried
  optimistically; its drafts are then accepted and the realistic choice follows."""
  from o1jax.engine.speculative import Acceptance

  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=7), draft_step_share=0.4)
  planner.observe(1, 0, 0.020)
  seq = Acceptance()
  assert planner.choose(1, [7], [planner.rate(seq)]) == 0  # 0.5: K=1 is 1.5 tokens / 31 ms
  k = planner.choose(1, [7], [planner.rate(seq)], optimistic=[planner.rate(seq, optimistic=True)])
  assert k == 3 and planner.explorations == 1  # 0.9: ~3.4 tokens / 53 ms
  planner.observe(1, 3, 0.040)  # cheaper than estimated
  planner.record(seq, 3, 3)
  # K=7 from what a draft added at K=3: 20 + 7 x 6.7 ms = 67 ms for ~8 tokens.
  assert planner.cost(1, 7) == pytest.approx(0.020 + 7 * 0.020 / 3)
  assert planner.choose(1, [7], [planner.rate(seq)]) == 7


def test_planner_estimates_unmeasured_shapes_from_measured_ones():
  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=3), draft_step_share=0.25)
  planner.observe(8, 0, 0.010)
  planner.observe(32, 0, 0.020)
  # Nothing measured at K=3: a plain step x (1 + 3 x (0.15 + 0.25)).
  assert planner.cost(32, 3) == pytest.approx(0.020 * 2.2)
  planner.observe(8, 3, 0.030)  # 3x plain at 8 rows
  assert planner.cost(32, 3) == pytest.approx(0.060)  # the same ratio at 32
  # Another K at the same rows: what one draft added there (20 ms / 3), per draft.
  assert planner.cost(8, 1) == pytest.approx(0.010 + 0.020 / 3)
  assert planner.cost(8, 1, single=True) == pytest.approx(0.010 + 0.020 / 3)  # other phase
  planner.observe(4, 0, 0.008)
  planner.observe(4, 3, 0.012)  # 1.5x at 4 rows: 8 is nearer 32
  assert planner.cost(32, 3) == pytest.approx(0.060)
  assert planner.cost(2, 3) is None  # no plain step at 2 rows yet
  planner.observe(2, 0, 0.006)
  assert planner.cost(2, 3) == pytest.approx(0.009)  # 4 rows is nearest
  # A ratio from the same phase comes first.
  planner.observe(16, 0, 0.010, single=True)
  planner.observe(16, 3, 0.040, single=True)
  assert planner.cost(32, 3) == pytest.approx(0.060)  # after the fill: 8 rows' ratio
  assert planner.cost(32, 3, single=True) == pytest.approx(0.080)  # while filling: 16 rows'


def test_planner_times_one_step_and_multi_step_plain_calls_apart():
  """While the batch fills, a plain call is one step and carries the host's work per
  call alone; the choice compares verifying with the plain call that would run."""
  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=3))
  planner.observe(8, 0, 0.030, single=True)
  planner.observe(8, 1, 0.030)
  planner.observe(8, 3, 0.040)
  rates = [0.9] * 8  # K=3: 27.5 tokens per call, K=1: 15.2
  assert planner.choose(8, [3] * 8, rates, single=True) == 3  # 688 against 267 tok/s
  assert planner.choose(8, [3] * 8, rates) == 0  # multi-step plain: time it first
  planner.observe(8, 0, 0.010)
  assert planner.cost(8, 0) == 0.010 and planner.cost(8, 0, single=True) == 0.030
  assert planner.choose(8, [3] * 8, rates) == 0  # 800 tok/s plain wins
  assert planner.choose(8, [3] * 8, rates, single=True) == 3


def test_planner_while_draining_waits_for_the_last_row():
  """With requests waiting, tokens per second over all rows count; once none waits,
  the batch ends with its last row, and a verify call slows a row without drafts."""
  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=3))
  planner.observe(8, 0, 0.010)
  planner.observe(8, 3, 0.015)
  one_drafts = ([3, 0], [0.9, 0.9], [0, 0], [64, 64])
  assert planner.choose(8, *one_drafts) == 3  # 4.4 tokens per 15 ms against 2 per 10 ms
  assert planner.choose(8, *one_drafts, draining=True) == 0  # its last row: 960 vs 640 ms
  both_draft = ([3, 3], [0.9, 0.9], [0, 0], [64, 64])
  assert planner.choose(8, *both_draft, draining=True) == 3  # 279 vs 640 ms
  # The row without drafts ends soon: the drafting row decides the end.
  assert planner.choose(8, [3, 0], [0.9, 0.9], [0, 0], [64, 4], draining=True) == 3


def test_planner_times_verify_calls_apart_while_the_batch_fills():
  """While the batch fills every call also waits for a prefill chunk: a verify call
  timed after the fill is not set against a one-step plain call timed during it."""
  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=3))
  planner.observe(8, 0, 0.030, single=True)  # a plain step and a prefill chunk
  planner.observe(8, 3, 0.040)  # a verify call after the fill
  rates = [0.9] * 8
  assert planner.cost(8, 3, single=True) == 0.040  # unmeasured while filling: the other phase
  assert planner.choose(8, [3] * 8, rates, single=True) == 3  # so it is tried
  planner.observe(8, 3, 0.100, single=True)  # and costs the chunk too
  planner.observe(8, 1, 0.090, single=True)
  assert planner.cost(8, 3, single=True) == 0.100 and planner.cost(8, 3) == 0.040
  # 27.5 tokens per 100 ms against 8 per 30 ms: it still pays for the running rows ...
  assert planner.choose(8, [3] * 8, rates, single=True) == 3
  # ... but not when nothing waits and a row still prefilling ends the batch: every
  # call delays its chunks (100 calls ahead of it at 100 against 30 ms).
  remaining = [64] * 8
  assert planner.choose(8, [3] * 8, rates, [0] * 8, remaining, single=True, draining=True,
                        pending=[100]) == 0
  # With no row prefilling, the running rows decide (64 tokens: 18 calls against 64).
  assert planner.choose(8, [3] * 8, rates, [0] * 8, remaining, single=True, draining=True) == 3
  # A prefilling row that ends before the running rows does not stop them verifying.
  assert planner.choose(8, [3] * 8, rates, [0] * 8, [640] * 8, single=True, draining=True,
                        pending=[20]) == 3


def test_planner_starts_no_catch_up_while_the_batch_fills():
  planner = SpeculationPlanner(SpeculativeConfig(drafter="draft_model", max_drafts=7))
  planner.observe(2, 0, 0.010, single=True)
  planner.observe(2, 0, 0.010)
  planner.observe(2, 7, 0.012, single=True)
  planner.observe(2, 7, 0.012)
  planner.observe_catch_up(100, 0.001)
  args = ([7, 7], [1.0, 1.0], [50, 0], [512, 512])
  assert planner.choose(2, [7, 0], [1.0, 1.0], [50, 0], [512, 512], single=True) == 0
  assert planner.choose(2, [7, 0], [1.0, 1.0], [50, 0], [512, 512]) == 7
  assert planner.choose(2, *args, single=True) == 7  # the row caught up drafts
  assert planner.drafting(2, 7, [50, 0], single=True) == [False, True]
  assert planner.drafting(2, 7, [50, 0]) == [True, True]
  fixed = SpeculationPlanner(SpeculativeConfig(drafter="draft_model", adaptive=False))
  assert fixed.drafting(2, 7, [50, 0], single=True) == [True, True]


def test_planner_weighs_a_draft_models_catch_up():
  """A row must first show the draft model the tokens it has not seen: a one-off
  cost per token, spread over the verify calls the row's budget has left."""
  planner = SpeculationPlanner(SpeculativeConfig(drafter="draft_model", max_drafts=7))
  planner.observe(1, 0, 0.010)
  planner.observe(1, 7, 0.020)  # 8 tokens for 2 plain steps' time when all are accepted
  assert planner.choose(1, [7], [1.0], [300], [64]) == 7  # nothing measured: no charge yet
  planner.observe_catch_up(300, 0.300)  # 1 ms per token
  # 300 ms over the 8 calls 64 tokens leave: 57.5 ms per 8 tokens, against 80 ms plain.
  assert planner.choose(1, [7], [1.0], [300], [64]) == 7
  # With 16 tokens left it would not pay back (170 ms per 8 tokens) ...
  assert planner.choose(1, [7], [1.0], [300], [16]) == 0
  # ... unless the row has caught up already.
  assert planner.choose(1, [7], [1.0], [0], [16]) == 7


def test_planner_tries_an_unmeasured_shape_with_one_row_that_catches_up():
  planner = SpeculationPlanner(SpeculativeConfig(drafter="draft_model", max_drafts=7))
  behind = [300, 0, 120, 200]
  # Neither the shape nor the catch-up is measured: the caught-up row and the one
  # least behind draft (the call still times the whole shape).
  assert planner.drafting(8, 7, behind) == [False, True, True, False]
  planner.observe(8, 7, 0.050)
  assert planner.drafting(8, 7, behind) == [False, True, True, False]  # catch-up unmeasured
  planner.observe_catch_up(120, 0.100)
  assert planner.drafting(8, 7, behind) == [True] * 4
  assert planner.drafting(8, 3, behind) == [False, True, True, False]  # K=3 unmeasured
  assert planner.drafting(8, 3, [0, 5, 0]) == [True] * 3  # one row to catch up: it drafts
  fixed = SpeculationPlanner(SpeculativeConfig(drafter="draft_model", adaptive=False))
  assert fixed.drafting(8, 7, behind) == [True] * 4  # always drafts, every row


# --- exactness on the tiny model -----------------------------------------------------------


def _repetitive_prompts(make_prompts, n, seed):
  """Prompts that repeat their own text, so prompt lookup finds drafts."""
  out = []
  for p in make_prompts(n, seed, low=4, high=20):
    out.append(p + p[: len(p) // 2] + p)
  return out


def _run(tiny, prompts, params, speculative=None, **config):
  cfg = dict(max_slots=32, num_blocks=512, prefill_chunk=64)
  cfg.update(config)
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(**cfg), speculative=speculative)
  results = engine.generate([{"prompt": p, "params": params} for p in prompts])
  return results, engine.metrics.summary()["speculative"]


def test_verify_calls_are_timed_in_the_phase_they_ran(tiny, make_prompts):
  """A verify call while the batch fills (one-step plain calls, prefill chunks
  between) is timed under that phase, apart from those after."""
  spec = SpeculativeConfig(max_drafts=3, adaptive=False)
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=256,
                                                           prefill_chunk=16, max_prefill_seqs=1),
                  speculative=spec)
  chosen, timed = [], []
  choose, observe = engine._planner.choose, engine._planner.observe

  def recording_choose(*args, single=False, **kwargs):
    k = choose(*args, single=single, **kwargs)
    chosen.append((k, single))
    return k

  def recording_observe(rows, k, seconds, single=False, **kwargs):
    timed.append((k, single))
    if k:
      emitted.append((k, kwargs["emitted"]))
    observe(rows, k, seconds, single=single, **kwargs)

  emitted = []

  engine._planner.choose, engine._planner.observe = recording_choose, recording_observe
  engine.generate([{"prompt": p, "params": GenerationParams(max_new_tokens=16, ignore_eos=True)}
                   for p in _repetitive_prompts(make_prompts, 8, seed=17)])
  verify = [c for c in chosen if c[0]]
  assert {single for _, single in verify} == {False, True}  # both phases verified
  timed_verify = [t for t in timed if t[0]]
  assert timed_verify and set(timed_verify) <= set(verify)  # each under its own phase
  assert any(single for _, single in timed_verify)
  # Each verify call reports its tokens per running row (what it saved is weighed).
  assert all(1.0 <= e <= k + 1 for k, e in emitted)
  assert engine.metrics.spec_accepted > 0 and max(e for _, e in emitted) > 1.0


@pytest.fixture(scope="module")
def greedy_baseline(tiny, make_prompts):
  prompts = _repetitive_prompts(make_prompts, 32, seed=11)
  params = GenerationParams(max_new_tokens=24, logprobs=True, top_logprobs=2)
  return prompts, params, _run(tiny, prompts, params)[0]


@pytest.mark.parametrize("batch", [1, 7, 32])
@pytest.mark.parametrize("drafter", ["prompt_lookup", "early_exit"])
def test_greedy_tokens_equal_plain_decoding(tiny, greedy_baseline, batch, drafter):
  prompts, params, baseline = greedy_baseline
  spec = SpeculativeConfig(drafter=drafter, max_drafts=3, adaptive=False, exit_layer=1)
  results, stats = _run(tiny, prompts[:batch], params, spec, max_slots=max(batch, 1))
  assert stats["verify_calls"] > 0 and stats["drafted"] > 0
  if drafter == "prompt_lookup":
    assert stats["accepted"] > 0
  for got, want in zip(results, baseline[:batch]):
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    assert [[i for i, _ in top] for top in got.samples[0].top_logprobs] == \
        [[i for i, _ in top] for top in want.samples[0].top_logprobs]


@pytest.mark.parametrize("drafter", ["prompt_lookup", "early_exit"])
def test_sampled_tokens_equal_plain_decoding(tiny, make_prompts, drafter):
  """Drafts are checked against the target's own draw at each step, so sampled
  outputs are the plain engine's, token for token (same keys)."""
  prompts = _repetitive_prompts(make_prompts, 6, seed=12)
  params = GenerationParams(max_new_tokens=20, temperature=0.7, top_p=0.95, top_k=40, n=3, seed=5)
  want, _ = _run(tiny, prompts, params)
  spec = SpeculativeConfig(drafter=drafter, max_drafts=3, adaptive=False, exit_layer=1)
  got, stats = _run(tiny, prompts, params, spec, max_slots=8)
  assert stats["verify_calls"] > 0
  for g, w in zip(got, want):
    assert [s.token_ids for s in g.samples] == [s.token_ids for s in w.samples]


def test_stops_budget_and_preemption_match_plain_decoding(tiny, make_prompts):
  prompts = _repetitive_prompts(make_prompts, 12, seed=13)
  # Stop ids and strings inside accepted drafts, limits that end mid-call, and a pool
  # so small that sequences are preempted and recomputed.
  text = tiny.tokenizer.decode(prompts[0][:3])
  params = [GenerationParams(max_new_tokens=5 + 3 * i, stop_token_ids=(prompts[i][2],),
                             stop=(text,) if i % 3 == 0 else ()) for i in range(12)]
  requests = [{"prompt": p, "params": q} for p, q in zip(prompts, params)]
  config = dict(max_slots=8, num_blocks=14, block_size=8, prefill_chunk=32)
  plain = Engine(tiny.model, tiny.tokenizer, EngineConfig(**config)).generate(requests)
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(**config),
                  speculative=SpeculativeConfig(max_drafts=7, adaptive=False))
  got = engine.generate(requests)
  assert engine.metrics.summary()["speculative"]["verify_calls"] > 0
  assert engine.metrics.preemptions > 0
  for g, w in zip(got, plain):
    assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)
  assert engine.allocator.num_used == 0  # every block, rolled-back tails included, freed


def test_stream_events_match_the_tokens(tiny, make_prompts):
  prompt = _repetitive_prompts(make_prompts, 1, seed=14)[0]
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=64),
                  speculative=SpeculativeConfig(max_drafts=3, adaptive=False))
  events = list(engine.stream({"prompt": prompt, "params": {"max_new_tokens": 16}}))
  want = _run(tiny, [prompt], GenerationParams(max_new_tokens=16))[0][0]
  assert [e.token_id for e in events if e.token_id is not None] == want.token_ids
  assert "".join(e.text for e in events) == want.text


def _markov_model(tiny, scale):
  """The tiny model with every layer's output projections zeroed: each layer adds
  nothing, so the next-token distribution depends on the last token alone,
  softmax(norm(E[:, t]) @ E) (tied head) — a Markov chain known in closed form."""
  from o1jax.model import Llama

  params = dict(tiny.params)
  params["embed"] = np.asarray(params["embed"]) * scale
  params["layers"] = [dict(layer, wo=np.zeros_like(layer["wo"]),
                           w_down=np.zeros_like(layer["w_down"])) for layer in params["layers"]]
  model = Llama(tiny.config, params)
  table = params["embed"].astype(np.float64)  # [d, V]
  x = table / np.sqrt(np.mean(table ** 2, axis=0, keepdims=True) + tiny.config.rms_eps)
  logits = (x * np.asarray(params["final_norm"], np.float64)[:, None]).T @ table  # [V(from), V]
  return model, logits


def test_sampled_tokens_follow_the_target_distribution(tiny):
  """Sampled speculative decoding draws from the model's distribution: on a model
  whose next-token distribution is known in closed form (a Markov chain), the
  transitions emitted by verify calls — accepted drafts and the tokens after
  them — match it (chi-square over each frequent state's likeliest successors).
  The prompt follows the chain's likeliest path, so prompt lookup drafts are
  often accepted."""
  temperature = 0.7
  model, logits = _markov_model(tiny, scale=1.2)
  probs = np.exp((logits - logits.max(1, keepdims=True)) / temperature)
  probs /= probs.sum(1, keepdims=True)
  path = [40]
  for _ in range(24):
    path.append(int(np.argmax(probs[path[-1]])))
  params = [GenerationParams(max_new_tokens=8, temperature=temperature, seed=s, ignore_eos=True)
            for s in range(256)]
  engine = Engine(model, tiny.tokenizer, EngineConfig(max_slots=32, num_blocks=512),
                  speculative=SpeculativeConfig(max_drafts=3, adaptive=False))
  results = engine.generate([{"prompt": path, "params": p} for p in params])
  stats = engine.metrics.summary()["speculative"]
  assert stats["verify_calls"] > 0 and stats["acceptance_rate"] > 0.2
  transitions: dict[int, list[int]] = {}
  for r in results:
    seq = [path[-1]] + r.token_ids
    for a, b in zip(seq, seq[1:]):
      transitions.setdefault(a, []).append(b)
  states = sorted(transitions, key=lambda a: -len(transitions[a]))[:3]
  assert len(transitions[states[0]]) >= 200
  for a in states:
    seen = transitions[a]
    if len(seen) < 50:
      continue
    top = list(np.argsort(-probs[a])[:3])
    observed = [seen.count(t) for t in top] + [sum(t not in top for t in seen)]
    expected = np.asarray([probs[a, t] for t in top] + [1 - probs[a, top].sum()]) * len(seen)
    keep = expected > 0.5  # bins the chain practically never visits carry no information
    observed, expected = np.asarray(observed)[keep], expected[keep]
    expected *= sum(observed) / expected.sum()
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3, (a, observed, expected)


# --- exactness on the embedded model -------------------------------------------------------

_PASSAGE = ("The river Elm runs from the northern hills through the town of Marlow, where the old "
            "mill still turns. In 1852 the mill's owner, Ada Finch, built a second wheel and a "
            "bakery beside it.")
_QUESTIONS = [f"Copy this text exactly:\n{_PASSAGE}",
              "Tom has 12 apples and gives 5 to Ann. How many apples does Tom have left?",
              "Write a Python function that returns the sum of a list of numbers.",
              f"Summarise in one sentence: {_PASSAGE}",
              "A train travels 60 km in 1.5 hours. What is its average speed in km/h?",
              f"Repeat the passage twice.\n{_PASSAGE}",
              "List three prime numbers greater than 10."]


@pytest.fixture(scope="module")
def embedded_plain(embedded_checkpoint):
  """The embedded model, its 32 chat prompts, and the plain engine's greedy outputs."""
  from o1jax.model import Llama

  model = Llama(embedded_checkpoint.config, embedded_checkpoint.params)
  requests = [{"prompt": [{"role": "user", "content": q}],
               "params": GenerationParams(max_new_tokens=24, logprobs=True)}
              for q in (_QUESTIONS * 5)[:32]]
  want = Engine(model, embedded_checkpoint.tokenizer,
                EngineConfig(max_slots=32, num_blocks=256)).generate(requests)
  return model, requests, want


@pytest.mark.parametrize("drafter,batches", [("prompt_lookup", (1, 7, 32)), ("early_exit", (7,))])
def test_embedded_model_greedy_tokens_equal_plain_decoding(embedded_checkpoint, embedded_plain,
                                                           drafter, batches):
  """Batches of 1, 7 and 32 requests (chat prompts: copying, math, code) give the
  plain engine's greedy tokens with speculation forced on (every call verifies), and
  bit-identical log-probs: a position's numbers do not depend on how many positions its
  call verifies (`compilation_cache.jit`; before, 5e-6..2e-5 apart in f32)."""
  model, requests, want = embedded_plain
  spec = SpeculativeConfig(drafter=drafter, max_drafts=3, adaptive=False)
  for batch in batches:
    engine = Engine(model, embedded_checkpoint.tokenizer,
                    EngineConfig(max_slots=32, num_blocks=256), speculative=spec)
    got = engine.generate(requests[:batch])
    stats = engine.metrics.summary()["speculative"]
    assert stats["verify_calls"] > 0
    if drafter == "prompt_lookup":
      assert stats["accepted"] > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want[:batch]], batch
    assert [g.logprobs for g in got] == [w.logprobs for w in want[:batch]], batch


@pytest.mark.parametrize("fields, match", [
    # Before: TypeError ("slice indices must be integers") inside the engine's first step.
    (dict(max_drafts=2.5), r"^speculative.max_drafts must be an int, got 2.5$"),
    (dict(ngram_max="4"), r"^speculative.ngram_max must be an int, got '4'$"),
    (dict(exit_layer=None), r"^speculative.exit_layer must be an int, got None$"),
    # Before: accepted (a non-empty str is truthy).
    (dict(adaptive="no"), r"^speculative.adaptive must be a bool, got 'no'$"),
    # Before: accepted, then failed inside the checkpoint loader.
    (dict(drafter="draft_model", draft_source=5),
     r"^speculative.draft_source must be a path or a model name \(a str\), got 5$"),
])
def test_speculative_config_values_of_the_wrong_type_are_named(fields, match):
  with pytest.raises(ValueError, match=match):
    SpeculativeConfig(**fields)


def test_planner_judges_exploring_by_its_recent_history():
  """The exploring totals cover the last HISTORY_SECONDS of decode time: after a long
  stretch in which speculation paid (ten histories: the full share, and kept forever if
  every second counted), a stretch of explorations that only lose brings the share down
  to the floor; and a long stretch without exploring banks at most a share of
  HISTORY_SECONDS, not of all the time seen. (Slow calls, so that few make hours.)"""
  history = SpeculationPlanner.HISTORY_SECONDS

  def explore(planner, emitted):
    planner._exploring = planner._key(8, 3, False)
    planner.observe(8, 3, 1.8, emitted=emitted)  # 0.8 s beyond a plain step of 1 s

  planner = SpeculationPlanner(SpeculativeConfig(max_drafts=3))
  planner.observe(8, 0, 1.0)
  explore(planner, 1.0)
  for _ in range(int(10 * history / 1.8)):  # copying: each verify call saves 2.2 s
    planner.observe(8, 3, 1.8, emitted=4.0)
  assert planner.explore_share() == planner.EXPLORE_SHARE
  assert planner.seen_seconds == pytest.approx(history)
  for _ in range(int(3 * history / 1.8)):  # free text: each exploration loses 0.8 s
    explore(planner, 1.0)
  # (With every second kept: 3,667 s saved against 1,333 s explored, the full share.)
  assert planner.saved_seconds < 0
  assert planner.explore_share() == planner.EXPLORE_FLOOR
  # An hour of plain decoding, then explorations: the budget is a share of the history.
  idle = SpeculationPlanner(SpeculativeConfig(max_drafts=3))
  for _ in range(3600 // 8):
    idle.observe(8, 0, 1.0, steps=8)
  assert idle.seen_seconds == pytest.approx(history)
  explorations = 0
  while idle.explored_seconds <= idle.explore_share() * idle.seen_seconds:
    explore(idle, 1.0)
    explorations += 1
  # 6 s of exploring budget (2% of 300 s), not 72 s (2% of the hour)
  assert explorations <= idle.EXPLORE_SHARE * history / 0.8 + 1
