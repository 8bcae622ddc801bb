"""The while_loop and its Python twin agree token for token; batch size never matters."""

import dataclasses

import numpy as np
import pytest

from o1jax.controller import Controller, LoopSettings, ReasoningRequest, SelfVerify
from o1jax.controller.testing import MockDecodeModel, MockTokenizer
from tests.o1jax.controller.conftest import VOCAB


def _same(a, b):
  assert a.token_ids == b.token_ids
  assert [(s.start, s.end, s.action) for s in a.steps] == [(s.start, s.end, s.action) for s in b.steps]
  # Scores to f32 rounding of the model's sums: XLA's CPU dot adds in another order at
  # batch 1 than at 16 on some CPUs (measured: 1.04e-6 relative on a 0.003 score, on a
  # CPU without AVX-512); tokens, steps and decisions above are exact.
  np.testing.assert_allclose([s.score for s in a.steps], [s.score for s in b.steps], rtol=1e-5)
  assert a.tokens == b.tokens and a.exit_reason == b.exit_reason


SAMPLED = LoopSettings(temperature=0.9, temp_bump=0.5, backtrack_threshold=0.3,
                       max_step_backtracks=2, max_backtracks=4, step_max_tokens=6,
                       max_thinking_tokens=30, max_answer_tokens=4, max_steps=6,
                       min_thinking_tokens=8, answer_on_eos=True)


def _random_mock(seed=0):
  rng = np.random.default_rng(seed)
  table = rng.normal(0, 2.0, (len(VOCAB), len(VOCAB))).astype(np.float32)
  return MockDecodeModel(table, [8], rng.normal(0, 1, (1, len(VOCAB))))


def test_twin_matches_while_loop_on_mock():
  requests = [ReasoningRequest(prompt="Q", request_id=r, seed=3) for r in range(3)]
  model, tok = _random_mock(), MockTokenizer(VOCAB)
  fast = Controller(model, tok).generate(requests, SAMPLED, 2)
  twin = Controller(model, tok, python_twin=True).generate(requests, SAMPLED, 2)
  assert fast.iterations == twin.iterations
  assert sum(t.backtracks for ts in fast.traces for t in ts) > 0  # decisions were exercised
  for fa, tw in zip(fast.traces, twin.traces):
    for a, b in zip(fa, tw):
      _same(a, b)


def test_twin_matches_while_loop_on_tiny_llama(tiny_llama):
  model, tok = tiny_llama
  st = LoopSettings(temperature=0.8, temp_bump=0.3, backtrack_threshold=0.5,
                    max_step_backtracks=1, max_backtracks=2, step_delimiter="a", step_max_tokens=5,
                    max_thinking_tokens=16, max_answer_tokens=3, max_steps=4,
                    verifier=SelfVerify(probe=" ok?", yes="y", no="n"))
  requests = [ReasoningRequest(prompt="hello there", request_id=7, seed=1)]
  fast = Controller(model, tok).generate(requests, st, 2).traces[0]
  twin = Controller(model, tok, python_twin=True).generate(requests, st, 2).traces[0]
  for a, b in zip(fast, twin):
    _same(a, b)
  assert all(t.tokens.probe > 0 for t in fast)


def test_batch_1_equals_batch_16(tiny_llama):
  model, tok = tiny_llama
  st = LoopSettings(temperature=1.0, step_delimiter="e", step_max_tokens=4, max_thinking_tokens=12,
                    max_answer_tokens=2, backtrack_threshold=0.05, max_step_backtracks=1,
                    max_backtracks=2, temp_bump=0.5)
  requests = [ReasoningRequest(prompt=p, request_id=10 + i, seed=2)
              for i, p in enumerate(["ab", "a longer prompt", "xyz", "0123456789"])]
  ctl = Controller(model, tok, max_rows=16)
  big = ctl.generate(requests, st, 4)  # one batch of 16 rows
  for i, req in enumerate(requests):
    for j in range(4):
      alone = ctl.generate([req], st, 1, sample_offset=j).traces[0][0]  # batch of 1
      _same(big.traces[i][j], alone)
  texts = {tuple(t.token_ids) for ts in big.traces for t in ts}
  assert len(texts) > 4  # samples of one request differ (keys by sample index)


@pytest.mark.parametrize("settings, kind", [
    (SAMPLED, "sampled"),  # temperature > 0 on every row, no filters
    (dataclasses.replace(SAMPLED, temperature=0.0, temp_bump=0.0), "greedy"),
    (dataclasses.replace(SAMPLED, temperature=0.0), "any"),  # a backtrack samples
    (dataclasses.replace(SAMPLED, top_p=0.9), "filtered"),
])
def test_the_loop_draws_by_the_settings_kind_with_the_same_traces(settings, kind, monkeypatch):
  """The loop leaves out the sampler's branches its settings cannot take
  (`steps.draw_kind`); the traces equal those of the general draw."""
  requests = [ReasoningRequest(prompt="Q", request_id=r, seed=5) for r in range(2)]
  model, tok = _random_mock(1), MockTokenizer(VOCAB)
  ctl = Controller(model, tok)
  assert ctl.loop(settings).draw_kind == kind
  fast = ctl.generate(requests, settings, 2)
  general = Controller.loop
  monkeypatch.setattr(Controller, "loop", lambda self, st, verify=False, trips=0: (
      dataclasses.replace(general(self, st, verify, trips), draw_kind="any")))
  slow = Controller(model, tok).generate(requests, settings, 2)
  assert fast.iterations == slow.iterations
  for fa, sl in zip(fast.traces, slow.traces):
    for a, b in zip(fa, sl):
      _same(a, b)


@pytest.mark.parametrize("speculate, per_call", [(False, 0), (False, 5), (True, 0)])
def test_fixed_trip_calls_give_the_same_traces(speculate, per_call, monkeypatch):
  """What a GPU runs (`steps.fixed_trip_loops`: 8 iterations a call, idle past the
  rows' end, a freed slot or stop_at) gives the traces, decisions and iteration count
  of the while loop: backtracks, forced "Wait"s, requests waiting for slots, and with
  speculation the shadow calls (plain calls) and verify calls (still while loops)."""
  from o1jax.engine import steps
  from o1jax.engine.speculative import SpeculativeConfig

  requests = [ReasoningRequest(prompt="Q", request_id=r, seed=7) for r in range(5)]
  model, tok = _random_mock(3), MockTokenizer(VOCAB)
  kw = dict(max_rows=4, speculative=SpeculativeConfig(max_drafts=3) if speculate else None,
            iterations_per_call=per_call)  # 5: calls of 4 trips (a power of two)
  want = Controller(model, tok, **kw).generate(requests, SAMPLED, 2)
  monkeypatch.setattr(steps, "fixed_trip_loops", lambda: True)
  ctl = Controller(model, tok, **kw)
  assert ctl.loop(SAMPLED).trips == 8
  got = ctl.generate(requests, SAMPLED, 2)
  if not speculate:  # (speculation picks verify or plain calls from their measured times)
    assert got.iterations == want.iterations
  if per_call:
    assert got.loop_seconds > 0 and max(got.invocations) > max(want.invocations)
  assert sum(t.backtracks for ts in got.traces for t in ts) > 0
  for fa, sl in zip(want.traces, got.traces):
    for a, b in zip(fa, sl):
      _same(a, b)


def test_sampled_kind_on_a_vocabulary_past_the_candidates(tiny_llama, monkeypatch):
  """The unfiltered draw over the whole vocabulary (259 tokens, past the sampler's 256
  candidates) gives the general draw's traces."""
  model, tok = tiny_llama
  st = LoopSettings(temperature=0.8, max_thinking_tokens=12, max_answer_tokens=3)
  requests = [ReasoningRequest(prompt="hello there", request_id=3, seed=2)]
  ctl = Controller(model, tok)
  assert ctl.loop(st).draw_kind == "sampled" and model.vocab_size > 256
  fast = ctl.generate(requests, st, 3).traces[0]
  general = Controller.loop
  monkeypatch.setattr(Controller, "loop", lambda self, s, verify=False, trips=0: (
      dataclasses.replace(general(self, s, verify, trips), draw_kind="any")))
  slow = Controller(model, tok).generate(requests, st, 3).traces[0]
  for a, b in zip(fast, slow):
    _same(a, b)


def test_a_new_controller_on_the_same_model_compiles_nothing_new():
  """Compiled programs are keyed on the decode model, not the controller: a process that
  makes many controllers (a sweep of policies, a notebook) reuses them rather than
  compiling and keeping a copy per controller (each held ~225 memory maps on a CPU)."""
  from o1jax.controller import controller as controller_lib
  from o1jax.controller.loop import ReasoningLoop

  requests = [ReasoningRequest(prompt="Q", request_id=1, seed=1)]
  model, tok = _random_mock(4), MockTokenizer(VOCAB)
  first = Controller(model, tok).generate(requests, SAMPLED, 2)
  programs = (controller_lib._admit_rows._cache_size(), ReasoningLoop.run._cache_size())
  again = Controller(model, tok).generate(requests, SAMPLED, 2)
  assert (controller_lib._admit_rows._cache_size(), ReasoningLoop.run._cache_size()) == programs
  for a, b in zip(first.traces[0], again.traces[0]):
    _same(a, b)


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_equal_decode_models_share_programs_and_none_is_kept_alive(cache, tmp_path):
  """A decode model is keyed by what its programs read (graphdef, config, cache settings),
  and the compiled programs hold a copy without its params: a second decode model of the
  same checkpoint compiles nothing, and a dropped one is freed with its weights (the jit
  caches kept every decode model ever used, ~1,000 memory maps and the weights each)."""
  import gc
  import weakref

  from o1jax.checkpoint import load_checkpoint
  from o1jax.controller import build_decode_model
  from o1jax.controller import controller as controller_lib
  from o1jax.controller.decode_model import program_view
  from o1jax.controller.loop import ReasoningLoop
  from o1jax.model import Llama
  from o1jax.testing import tiny_config, write_hf_checkpoint

  write_hf_checkpoint(tmp_path, tiny_config(max_context=128), seed=2)
  ck = load_checkpoint(tmp_path)
  st = LoopSettings(temperature=0.7, max_thinking_tokens=6, step_max_tokens=3)
  requests = [ReasoningRequest(prompt="hi", request_id=3, seed=1)]
  make = lambda **kw: build_decode_model(Llama(ck.config, ck.params, **kw), {"cache": cache})
  first, second = make(), make()
  assert first == second and hash(first) == hash(second) and first != make(
      matmul_dtype="bfloat16")
  assert program_view(first) == first and program_view(first).params is None
  # One view for equal models: the jit finds the static argument by identity.
  assert program_view(first) is program_view(second)
  want = Controller(first, ck.tokenizer).generate(requests, st, 2)
  programs = (controller_lib._admit_rows._cache_size(), ReasoningLoop.run._cache_size())
  got = Controller(second, ck.tokenizer).generate(requests, st, 2)
  assert (controller_lib._admit_rows._cache_size(), ReasoningLoop.run._cache_size()) == programs
  for a, b in zip(want.traces[0], got.traces[0]):
    _same(a, b)
  dropped = weakref.ref(first)
  del first, want
  gc.collect()
  assert dropped() is None


def test_programs_released_between_loop_calls_give_the_same_traces(tiny_llama, monkeypatch,
                                                                   caplog):
  """Past the memory-map bound (checked before each loop call) JAX's programs are
  dropped and compiled again mid-generate: the traces do not change."""
  import logging

  from o1jax import compilation_cache
  from o1jax.controller.loop import ReasoningLoop

  model, tokenizer = tiny_llama
  st = LoopSettings(temperature=0.8, max_thinking_tokens=12, step_max_tokens=4)
  requests = [ReasoningRequest(prompt=p, request_id=i, seed=3)
              for i, p in enumerate(["ab", "cde", "f"])]
  want = Controller(model, tokenizer, max_rows=4).generate(requests, st, 2)
  monkeypatch.setattr(compilation_cache, "map_limit", lambda: 2)
  with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
    got = Controller(model, tokenizer, max_rows=4).generate(requests, st, 2)
  assert "released JAX's compiled programs" in caplog.text
  assert ReasoningLoop.run._cache_size() >= 1  # compiled again after the release
  for w, g in zip(want.traces, got.traces):
    for a, b in zip(w, g):
      _same(a, b)


def test_embedded_model_traces_do_not_depend_on_the_batch(embedded_checkpoint):
  """Three requests, self_consistency-style sampling (n=2), in one batch and each alone,
  int8 matmuls + bf16 KV on the paged cache: bit-identical traces and log-probs. (Before
  the model's programs were compiled with `compilation_cache.compiler_options`, XLA:CPU's
  YNNPACK fusions moved the log-probs ~2e-3 and 5 of 16 such traces forked.)"""
  from o1jax.controller import build_decode_model
  from o1jax.model import Llama
  from pallas_kernels import native

  if not native.int8_matmul_available():
    pytest.skip("no native int8 kernel on this CPU")
  ck = embedded_checkpoint
  model = build_decode_model(Llama(ck.config, ck.params, matmul_dtype="int8"),
                             {"cache": "paged", "block_size": 16, "kv_dtype": "bfloat16"})
  settings = LoopSettings(temperature=0.7, max_thinking_tokens=16, max_answer_tokens=4,
                          step_delimiter="\n")
  questions = ["Tom has 12 apples and gives 5 to Ann. How many are left?",
               "What is 17 times 23?", "Sam buys 3 pens at 4 dollars each. What does he pay?"]
  requests = [ReasoningRequest(prompt=[{"role": "user", "content": q}], request_id=i, seed=0)
              for i, q in enumerate(questions)]
  together = Controller(model, ck.tokenizer, max_rows=6, share_prefixes=False).generate(
      requests, settings, 2)
  narrow = Controller(model, ck.tokenizer, max_rows=2, share_prefixes=False)
  for request, traces in zip(requests, together.traces):
    alone = narrow.generate([request], settings, 2).traces[0]
    assert [t.token_ids for t in alone] == [t.token_ids for t in traces]
    assert [t.mean_logprob for t in alone] == [t.mean_logprob for t in traces]
