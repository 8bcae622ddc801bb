"""Speculative decoding with a draft model (drafter "draft_model"): a separate model
that shares the tokenizer drafts greedy tokens from its own KV pool, and the
outputs stay those of decoding without speculation, token for token."""

import dataclasses

import numpy as np
import pytest

from o1jax.checkpoint import load_checkpoint
from o1jax.engine import Engine, EngineConfig, GenerationParams, Request, SpeculativeConfig
from o1jax.model import Llama
from o1jax.testing import tiny_config, write_hf_checkpoint

SPEC = SpeculativeConfig(drafter="draft_model", adaptive=False, max_drafts=3)  # always drafts
CONFIG = EngineConfig(max_slots=8, num_blocks=128)
GREEDY = GenerationParams(max_new_tokens=24, ignore_eos=True)
SAMPLED = GenerationParams(max_new_tokens=16, temperature=0.8, top_p=0.9, n=2, seed=4,
                           logprobs=True)


def _write_draft(path, **overrides):
  """A tiny random draft checkpoint at path: 1 layer, another seed, the target's vocabulary."""
  config = tiny_config(**{"max_context": 256, "n_layers": 1, **overrides})
  write_hf_checkpoint(path, config, seed=11)
  return path


def _load(path) -> Llama:
  ck = load_checkpoint(path)
  return Llama(ck.config, ck.params)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
  return _load(_write_draft(tmp_path_factory.mktemp("draft")))


@pytest.fixture(scope="module")
def plain(tiny):
  """The reference: the same engine settings without speculation."""
  return Engine(tiny.model, tiny.tokenizer, CONFIG)


def _same(a, b):
  for ra, rb in zip(a, b, strict=True):
    for sa, sb in zip(ra.samples, rb.samples, strict=True):
      assert sa.token_ids == sb.token_ids
      assert sa.finish_reason == sb.finish_reason
      if sa.logprobs is not None:
        np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=1e-5, atol=1e-5)


def _speculative(engine) -> dict:
  return engine.metrics.summary()["speculative"]


def test_random_draft_model_gives_the_outputs_of_plain_decoding(tiny, plain, draft, make_prompts):
  """Greedy and sampled (n=2) requests; the random draft's drafts are mostly rejected."""
  spec = Engine(tiny.model, tiny.tokenizer, CONFIG, speculative=SPEC, draft_model=draft)
  prompts = make_prompts(7, seed=50, low=3, high=60)
  for params in (GREEDY, SAMPLED):
    requests = [Request(p, params, request_id=i) for i, p in enumerate(prompts)]
    _same(plain.generate(requests), spec.generate(requests))
  assert _speculative(spec)["verify_calls"] > 0


def test_target_as_its_own_draft_accepts_every_greedy_draft(tiny, plain, make_prompts):
  """The draft K/V it catches up over (prompts, prefix-cached blocks, forks, accepted
  and rejected drafts) must be the target's own: any position wrong would reject a draft."""
  spec = Engine(tiny.model, tiny.tokenizer, CONFIG, speculative=SPEC, draft_model=tiny.model)
  shared = make_prompts(1, seed=53, low=40, high=41)[0]
  prompts = make_prompts(5, seed=51, low=3, high=60) + [shared, shared[:34] + [7, 8, 9]]
  requests = [Request(p, GREEDY, request_id=i) for i, p in enumerate(prompts)]
  results = spec.generate(requests)
  _same(plain.generate(requests), results)
  assert results[-1].metrics.prompt_tokens_computed < len(prompts[-1]) - 1  # a cached prefix
  stats = _speculative(spec)
  assert stats["verify_calls"] > 0 and stats["drafted"] > 0
  assert stats["acceptance_rate"] == 1.0
  # Sampled rows accept a greedy draft only where their draw equals it.
  requests = [Request(p, SAMPLED, request_id=i) for i, p in enumerate(prompts[:4])]
  _same(plain.generate(requests), spec.generate(requests))
  assert 0 < _speculative(spec)["acceptance_rate"] < 1.0


def test_drafts_past_a_stop_are_not_counted_accepted(tiny, plain, make_prompts):
  """A verify call whose drafts all match but whose sample stops inside them counted every
  match as accepted: a record showed 7 drafts accepted for 3 tokens generated."""
  spec = Engine(tiny.model, tiny.tokenizer, CONFIG, draft_model=tiny.model,
                speculative=dataclasses.replace(SPEC, max_drafts=7))
  prompt = make_prompts(1, seed=57, low=20, high=21)[0]
  free = plain.generate([Request(prompt, GREEDY)])[0].samples[0].token_ids
  stop = free[2]
  params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
  want = plain.generate([Request(prompt, params)])
  got = spec.generate([Request(prompt, params)])
  _same(want, got)
  assert got[0].samples[0].finish_reason == "stop"
  m = got[0].metrics  # generated_tokens: the stop token too
  assert 0 < m.spec_accepted <= m.generated_tokens <= 3 < m.spec_drafted
  assert _speculative(spec)["accepted"] == m.spec_accepted


def test_draft_model_must_share_the_vocabulary_and_be_given(tiny, tmp_path):
  other = _load(_write_draft(tmp_path, vocab_size=tiny.config.vocab_size + 8))
  with pytest.raises(ValueError, match="vocab_size"):
    Engine(tiny.model, tiny.tokenizer, CONFIG, speculative=SPEC, draft_model=other)
  with pytest.raises(ValueError, match="draft_source"):
    Engine(tiny.model, tiny.tokenizer, CONFIG, speculative=SPEC)
  with pytest.raises(ValueError, match="draft_model"):
    Engine(tiny.model, tiny.tokenizer, CONFIG, speculative=SpeculativeConfig(), draft_model=other)
  with pytest.raises(ValueError, match="draft_source"):
    SpeculativeConfig(drafter="early_exit", draft_source=str(tmp_path))


def test_a_refused_set_speculative_leaves_the_engine_as_it_was(tiny, plain, tmp_path,
                                                               make_prompts):
  # The engine took the new drafter before its draft model was checked: after the refusal
  # every run failed (AttributeError: no '_draft_context').
  other = _load(_write_draft(tmp_path, vocab_size=tiny.config.vocab_size + 8))
  engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
  requests = [Request(p, GREEDY, request_id=i) for i, p in enumerate(make_prompts(2, seed=53))]
  with pytest.raises(ValueError, match="vocab_size"):
    engine.set_speculative(SPEC, other)
  with pytest.raises(ValueError):
    engine.set_speculative(SpeculativeConfig(drafter="early_exit", exit_layer=99))
  assert engine.speculative is None and engine.draft_model is None
  _same(plain.generate(requests), engine.generate(requests))


def test_draft_source_is_loaded_by_path(tiny, plain, tmp_path, make_prompts):
  source = SpeculativeConfig(drafter="draft_model", adaptive=False, max_drafts=3,
                             draft_source=str(_write_draft(tmp_path)))
  spec = Engine(tiny.model, tiny.tokenizer, CONFIG, speculative=source)
  assert spec.draft_model.config.n_layers == 1
  requests = [Request(p, GREEDY, request_id=i) for i, p in enumerate(make_prompts(3, seed=52))]
  _same(plain.generate(requests), spec.generate(requests))
  assert _speculative(spec)["verify_calls"] > 0


def test_preemption_and_a_shorter_draft_context_keep_the_outputs(tiny, make_prompts):
  """A pool too small for all rows (preempted rows catch their draft K/V up again
  from scratch) and a draft model whose context (72) ends before the engine's (96):
  rows draft only below it. The draft is the target's weights, so every greedy
  draft on a correctly caught-up draft pool is accepted."""
  draft = Llama(dataclasses.replace(tiny.config, max_context=72), tiny.params)
  prompts = make_prompts(6, seed=40, low=20, high=60)
  params = GenerationParams(max_new_tokens=400, ignore_eos=True)
  config = EngineConfig(max_slots=6, num_blocks=24, max_context=96, prefill_chunk=32)
  spec = Engine(tiny.model, tiny.tokenizer, config, speculative=SPEC, draft_model=draft)
  requests = [Request(p, params, request_id=i) for i, p in enumerate(prompts)]
  _same(Engine(tiny.model, tiny.tokenizer, config).generate(requests), spec.generate(requests))
  assert spec.metrics.preemptions > 0
  stats = _speculative(spec)
  assert stats["verify_calls"] > 0 and stats["acceptance_rate"] == 1.0
  # Every draft was accepted, i.e. became the token at its position: all below 72.
  assert stats["drafted"] <= sum(72 - len(p) for p in prompts)
  assert not spec.has_work()


def test_a_verify_call_leaves_no_catch_up_behind(tiny, make_prompts):
  """The draft call's first step feeds a row's last two tokens, so after a verify
  call (every draft accepted, or some rejected) the draft model needs no catch-up
  call: over a whole run it catches up over each prompt once, nothing more."""
  spec = Engine(tiny.model, tiny.tokenizer, CONFIG, speculative=SPEC, draft_model=tiny.model)
  caught_up = []
  catch_up = spec._catch_up_draft
  spec._catch_up_draft = lambda seqs: caught_up.append(catch_up(seqs)[0]) or (caught_up[-1], 0.0)
  prompts = make_prompts(5, seed=54, low=3, high=60)
  requests = [Request(p, GREEDY, request_id=i) for i, p in enumerate(prompts)]
  _same(Engine(tiny.model, tiny.tokenizer, CONFIG).generate(requests), spec.generate(requests))
  stats = _speculative(spec)
  assert stats["verify_calls"] >= 24 // 4 and stats["acceptance_rate"] == 1.0
  assert sum(caught_up) == sum(max(len(p) - 2, 0) for p in prompts)


def test_no_catch_up_starts_while_the_batch_fills(tiny, make_prompts):
  """While requests prefill or wait for a free slot, rows that would have to catch
  up do not draft (the full batch decides whether speculation pays), so no catch-up
  runs then; the outputs stay plain decoding's."""
  adaptive = dataclasses.replace(SPEC, adaptive=True)
  config = EngineConfig(max_slots=4, num_blocks=128, prefill_chunk=16, max_prefill_seqs=1)
  spec = Engine(tiny.model, tiny.tokenizer, config, speculative=adaptive, draft_model=tiny.model)
  # Timings as if verifying were almost free (and they stay so: this CPU's own timings
  # would make the run's decisions depend on its load), so only the rule holds it back.
  planner = spec._planner
  for rows in {spec._decode_rows(n) for n in range(1, 5)}:
    for k in (0,) + adaptive.k_buckets:
      for single in (False, True):
        planner.observe(rows, k, 0.010 if k == 0 else 0.011, single=single)
  planner.observe_catch_up(1000, 0.001)
  planner.observe = lambda *args, **kwargs: None
  decisions, catch_ups = [], []
  drafting, catch_up = spec._planner.drafting, spec._catch_up_draft

  def recording_drafting(rows, k, behind, single=False):
    chosen = drafting(rows, k, behind, single)
    decisions.append((spec._filling(), k, list(behind), chosen))
    return chosen

  def recording_catch_up(seqs):
    tokens, seconds = catch_up(seqs)
    catch_ups.append((spec._filling(), tokens))
    return tokens, seconds

  spec._planner.drafting, spec._catch_up_draft = recording_drafting, recording_catch_up
  prompts = make_prompts(8, seed=55, low=20, high=60)
  requests = [Request(p, GREEDY, request_id=i) for i, p in enumerate(prompts)]
  _same(Engine(tiny.model, tiny.tokenizer, config).generate(requests), spec.generate(requests))
  filling = [(k, b, d) for f, k, b, d in decisions if f]
  assert any(any(b) for _, b, _ in filling)  # decisions while filling, with rows behind
  assert all(not d[i] for k, b, d in filling if k for i, c in enumerate(b) if c > 0)
  assert all(tokens == 0 for f, tokens in catch_ups if f)
  assert any(tokens > 0 for f, tokens in catch_ups if not f)
