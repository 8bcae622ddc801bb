"""Speculation inside the reasoning loop: prompt-lookup drafts verified in one forward.

The rows must get the tokens, steps and decisions of plain decoding (greedy and
sampled: draws use the same per-position keys); the device-side drafter must
propose what the engine's host-side `prompt_lookup` proposes.
"""

import numpy as np
import pytest

from o1jax.controller import (Controller, LoopSettings, PagedLlama, ReasoningRequest,
                              SelfVerify)
from o1jax.controller.loop import ReasoningLoop
from o1jax.controller.testing import MockDecodeModel, MockTokenizer
from o1jax.engine.speculative import SpeculativeConfig, prompt_lookup
from tests.o1jax.controller.conftest import ID, VOCAB
from tests.o1jax.controller.test_twin_and_batch import SAMPLED, _same

ALWAYS = SpeculativeConfig(max_drafts=4, adaptive=False)  # verify whenever a row has drafts


def _cyclic_mock(seed=0, strength=4.0):
  """Random logits plus a strong cycle A -> B -> C -> D -> A: the text repeats itself,
  so prompt lookup finds drafts that are often (not always) right."""
  rng = np.random.default_rng(seed)
  table = rng.normal(0, 1.0, (len(VOCAB), len(VOCAB))).astype(np.float32)
  for a, b in ((" A", " B"), (" B", " C"), (" C", " D"), (" D", " A"), ("Q", " A")):
    table[ID[a], ID[b]] += strength
  return MockDecodeModel(table, [ID[" bad"]], rng.normal(0, 1, (1, len(VOCAB))))


def _run(model, tok, settings, n, speculative, requests, **kw):
  return Controller(model, tok, speculative=speculative, **kw).generate(requests, settings, n)


def _check_same(plain, spec):
  for fa, tw in zip(plain.traces, spec.traces):
    for a, b in zip(fa, tw):
      _same(a, b)
      assert b.mean_logprob == pytest.approx(a.mean_logprob, abs=1e-5)


@pytest.mark.parametrize("python_twin", [False, True])
def test_sampled_traces_with_backtracks_equal_plain_decoding(python_twin):
  model, tok = _cyclic_mock(), MockTokenizer(VOCAB)
  requests = [ReasoningRequest(prompt="Q", request_id=r, seed=5) for r in range(3)]
  plain = _run(model, tok, SAMPLED, 2, None, requests)
  spec = _run(model, tok, SAMPLED, 2, ALWAYS, requests, python_twin=python_twin)
  _check_same(plain, spec)
  traces = [t for ts in spec.traces for t in ts]
  assert sum(t.backtracks for t in traces) > 0  # rollbacks happened inside verify calls
  drafted = sum(t.speculative["drafted"] for t in traces)
  accepted = sum(t.speculative["accepted"] for t in traces)
  assert spec.verify_calls > 0 and 0 < accepted < drafted
  assert spec.iterations < plain.iterations  # accepted drafts saved iterations
  assert all(t.speculative is None for ts in plain.traces for t in ts)


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_greedy_and_forced_runs_on_the_tiny_llama(tiny_llama, cache):
  """Greedy rows, a self-verification probe at every step boundary (it writes past the
  rows' ends, over the drafts) and forced answer prefixes (drafted exactly), on both
  caches: the same traces as plain decoding."""
  model, tok = tiny_llama
  decode_model = PagedLlama(_llama(model), block_size=4) if cache == "paged" else model
  st = LoopSettings(temperature=0.0, step_delimiter="a", step_max_tokens=6,
                    max_thinking_tokens=24, max_answer_tokens=4, max_steps=3,
                    verifier=SelfVerify(probe=" ok?", yes="y", no="n"),
                    backtrack_threshold=0.4, max_step_backtracks=1, max_backtracks=2)
  requests = [ReasoningRequest(prompt=p, request_id=i, seed=1)
              for i, p in enumerate(["abcabcabc", "hello hello hello", "xyz"])]
  plain = _run(decode_model, tok, st, 1, None, requests)
  spec = _run(decode_model, tok, st, 1, SpeculativeConfig(max_drafts=3, adaptive=False), requests)
  _check_same(plain, spec)
  # Bit for bit: a paged verify call attends each query as a decode row
  # (`decode_queries`); the contiguous cache's one attention serves any number of queries.
  numbers = lambda batch: [(t.mean_logprob, [s.score for s in t.steps])
                           for ts in batch.traces for t in ts]
  assert numbers(spec) == numbers(plain)
  assert spec.verify_calls > 0
  assert all(t.tokens.probe > 0 for ts in spec.traces for t in ts)


def _llama(decode_model):
  from flax import nnx
  return nnx.merge(decode_model.graphdef, decode_model.params)


def test_consensus_traces_agree_where_both_ran(tiny_llama):
  """With a consensus stop the rows of a request advance at different rates inside a
  verify call, so a row may stop at another token than in plain decoding; every
  token both runs wrote is the same."""
  model, tok = tiny_llama
  st = LoopSettings(temperature=0.9, step_delimiter="a", step_max_tokens=6,
                    max_thinking_tokens=20, max_answer_tokens=4, answer_vote=True,
                    consensus_share=0.6)
  requests = [ReasoningRequest(prompt="abab abab", request_id=0, seed=3)]
  plain = _run(model, tok, st, 4, None, requests)
  spec = _run(model, tok, st, 4, ALWAYS, requests)
  for a, b in zip(plain.traces[0], spec.traces[0]):
    n = min(len(a.token_ids), len(b.token_ids))
    assert n > 0 and a.token_ids[:n] == b.token_ids[:n]


def test_device_drafts_equal_the_host_prompt_lookup():
  """`ReasoningLoop._drafts` against the engine's numpy `prompt_lookup` on random
  low-entropy rows (many repeated n-grams), rows of different lengths."""
  import jax.numpy as jnp

  rng = np.random.default_rng(0)
  b, l, kd = 16, 40, 5
  tokens = rng.integers(0, 4, (b, l)).astype(np.int32)
  length = rng.integers(1, l - 1, b).astype(np.int32)
  loop = ReasoningLoop(model=None, draft_k=kd, ngram_max=3, ngram_min=1)

  class _S:  # the fields `_drafts` reads
    pass

  s = _S()
  s.tokens, s.length = jnp.asarray(tokens), jnp.asarray(length)
  s.phase = jnp.zeros((b,), jnp.int32)
  s.force_buf = jnp.zeros((b, 4), jnp.int32)
  s.force_pos = s.force_len = jnp.zeros((b,), jnp.int32)
  drafts, available = map(np.asarray, loop._drafts(s))
  for r in range(b):
    want = prompt_lookup(tokens[r, :length[r]].tolist(), kd, ngram_max=3, ngram_min=1)
    assert available[r] == len(want), r
    assert drafts[r, :available[r]].tolist() == want, r


def test_controller_refuses_other_drafters(tiny_llama):
  model, tok = tiny_llama
  with pytest.raises(ValueError, match="drafts by 'prompt_lookup' only"):
    Controller(model, tok, speculative=SpeculativeConfig(drafter="early_exit"))


def test_adaptive_cost_is_measured_once_per_shape(tiny_llama):
  model, tok = tiny_llama
  ctl = Controller(model, tok, speculative=SpeculativeConfig(max_drafts=3))
  timed = []
  measure = ctl._timed_iterations
  ctl._timed_iterations = lambda run, state: timed.append(1) or measure(run, state)
  st = LoopSettings(temperature=0.0, max_thinking_tokens=8, max_answer_tokens=2)
  reqs = [ReasoningRequest(prompt="abcabc", request_id=0)]
  a = ctl.generate(reqs, st, 1)
  assert len(timed) == 8  # 2 compiling runs + 3 x (plain, verify)
  (shape,) = {k[:2] for k in ctl._call_times}
  assert set(ctl._call_times) == {shape + (False,), shape + (True,)}
  state = ctl.empty_state(st, 1, 1, shape[1])
  assert state.tokens.shape == shape and ctl.cost_ratio(state) > 0
  b = ctl.generate(reqs, st, 1)
  assert len(timed) == 8  # the same shape: not measured again
  assert a.traces[0][0].token_ids == b.traces[0][0].token_ids


@pytest.mark.parametrize("cost, verifies", [(1.2, True), (100.0, False)])
def test_adaptive_calls_verify_only_where_drafts_pay(cost, verifies):
  """The host picks a verifying or a plain call every SPEC_INTERVAL iterations from the
  rows' acceptance, learned on plain iterations too (shadow calls): on a text that
  repeats itself it verifies at a low cost ratio, never at a prohibitive one; either
  way the traces are plain decoding's."""
  model, tok = _cyclic_mock(strength=9.0), MockTokenizer(VOCAB)
  st = LoopSettings(temperature=0.0, step_max_tokens=60, max_thinking_tokens=120,
                    max_answer_tokens=2, step_delimiter="\n\n")
  requests = [ReasoningRequest(prompt="Q", request_id=r) for r in range(2)]
  plain = _run(model, tok, st, 1, None, requests)
  ctl = Controller(model, tok, speculative=SpeculativeConfig(max_drafts=4))
  ctl.measure_call_costs = lambda state, settings: None
  ctl.cost_ratio = lambda state: cost
  spec = ctl.generate(requests, st, 1)
  _check_same(plain, spec)
  assert (spec.verify_calls > 0) == verifies
  assert spec.invocations[0] > 1  # the host re-decided between calls


def test_verify_next_weighs_accepted_drafts_per_call_against_cost():
  from o1jax.controller import state as S
  ctl = Controller(_cyclic_mock(), MockTokenizer(VOCAB), speculative=SpeculativeConfig(max_drafts=3))
  running = np.array([S.THINK, S.THINK, S.DONE])
  calls = np.array([9.5, 9.5, 9.5])
  # ~3 accepted per call: ~4 tokens per row and call.
  sure = np.array([30.0, 30.0, 30.0])
  assert ctl.verify_next(running, sure, calls, cost=3.5)
  assert not ctl.verify_next(running, sure, calls, cost=4.5)
  # A done row's estimate does not count.
  assert not ctl.verify_next(running, np.array([0.0, 0.0, 300.0]), calls, cost=1.1)
  # No evidence yet: the prior (0.5 accepted per call, or what other rows showed).
  assert ctl.verify_next(running, np.zeros(3), np.zeros(3), cost=1.4)
  assert not ctl.verify_next(running, np.zeros(3), np.zeros(3), cost=1.6)
  assert ctl.verify_next(running, np.zeros(3), np.zeros(3), cost=2.5, prior=2.0)
  assert not ctl.verify_next(np.full(3, S.DONE), sure, calls, cost=0.5)
  # Draining (no request waits): the slowest row decides. One row with nothing accepted
  # keeps the batch plain although the sum would pay.
  mixed = np.array([60.0, 0.0, 0.0])
  assert ctl.verify_next(running, mixed, calls, cost=2.5)
  assert not ctl.verify_next(running, mixed, calls, cost=2.5, draining=True)
  assert ctl.verify_next(running, sure, calls, cost=2.5, draining=True)


def test_shadow_calls_record_what_a_verify_call_would_accept():
  """On plain iterations a row follows its drafts: `_shadow` against hand-made tokens."""
  import jax.numpy as jnp
  from o1jax.controller.loop import CALL_DECAY

  loop = ReasoningLoop(model=None, draft_k=3)

  class _S:
    def __init__(self, **kw):
      self.__dict__.update(kw)

    def replace(self, **kw):
      return _S(**{**self.__dict__, **kw})

  zeros = lambda: jnp.zeros((2,), jnp.int32)
  s = _S(tokens=jnp.array([[1, 2, 3, 0, 0, 0], [1, 2, 3, 0, 0, 0]]), length=jnp.array([3, 3]),
         phase=zeros(), shadow_draft=jnp.zeros((2, 3), jnp.int32), shadow_len=zeros(),
         shadow_pos=zeros(), spec_acc=jnp.zeros(2), spec_calls_row=jnp.zeros(2))
  drafts, available = jnp.array([[7, 8, 9], [7, 8, 9]]), jnp.array([3, 3])
  # Row 0 draws 7 (= draft 0), row 1 draws 5 (differs: its call would accept 0).
  new = s.replace(tokens=jnp.array([[1, 2, 3, 7, 0, 0], [1, 2, 3, 5, 0, 0]]),
                  length=jnp.array([4, 4]))
  running = jnp.ones((2,), bool)  # no row is done
  out = loop._shadow(s, new, drafts, available, running)
  assert out.shadow_len.tolist() == [3, 0] and out.shadow_pos.tolist() == [1, 0]
  assert out.spec_calls_row.tolist() == [0.0, 1.0] and out.spec_acc.tolist() == [0.0, 0.0]
  # Row 0 then draws 8 and 9: all three drafts match, its call ends having accepted 3.
  s2 = out.replace(length=jnp.array([4, 4]))
  out2 = loop._shadow(s2, s2.replace(tokens=jnp.array([[1, 2, 3, 7, 8, 0], [1, 2, 3, 5, 0, 0]]),
                                     length=jnp.array([5, 4])), drafts * 0, available * 0, running)
  assert out2.shadow_pos.tolist()[0] == 2
  s3 = out2.replace(length=jnp.array([5, 4]))
  out3 = loop._shadow(s3, s3.replace(tokens=jnp.array([[1, 2, 3, 7, 8, 9], [1, 2, 3, 5, 0, 0]]),
                                     length=jnp.array([6, 4])), drafts * 0, available * 0, running)
  assert out3.shadow_len.tolist()[0] == 0 and float(out3.spec_acc[0]) == 3.0
  assert float(out3.spec_calls_row[0]) == 1.0
  # Row 1 made no progress (length unchanged) with no drafts: calls accepting 0.
  assert float(out3.spec_calls_row[1]) == pytest.approx(1 + CALL_DECAY * (1 + CALL_DECAY))
  # Rows not running (an idle iteration of a loop of fixed trips) keep their shadow calls.
  idle = loop._shadow(s2, s2.replace(length=jnp.array([5, 4])), drafts, available,
                      jnp.zeros((2,), bool))
  for f in ("shadow_draft", "shadow_len", "shadow_pos", "spec_acc", "spec_calls_row"):
    assert getattr(idle, f).tolist() == getattr(s2, f).tolist(), f
