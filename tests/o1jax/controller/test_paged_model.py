"""PagedLlama: the controller over the engine's paged KV cache gives ContiguousLlama's
traces, shares a prompt's blocks across its samples, and frees blocks on truncate.

Tolerance: paged and contiguous attention add the same f32 products in another
order (~1e-6 relative on logits), so tokens and decisions are compared exactly,
scores to rtol 1e-5, and every test asserts its verifier scores stay clear of
the backtrack threshold (no decision hangs on that rounding).
Block size 4, so prompts span several blocks, probes cross block boundaries and
"0123456789abcdef" (16 tokens) ends on a full block that the first decode step
rewrites (copy-on-write of a full shared block).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from o1jax.controller import (Controller, LoopSettings, PagedCacheOverflow, PagedLlama,
                              ReasoningRequest, SelfVerify, build_decode_model, CacheConfig,
                              get_policy)
from o1jax.controller.testing import MockDecodeModel, MockTokenizer
from tests.o1jax.controller.conftest import VOCAB

BS = 4
PROMPTS = ["hello there", "a longer prompt!", "xyz", "0123456789abcdef"]  # 11, 16, 3, 16 tokens
COMMON = dict(max_thinking_tokens=16, max_answer_tokens=3, step_delimiter="a", step_max_tokens=5)
PROBE = SelfVerify(probe=" ok?", yes="y", no="n")


@pytest.fixture(scope="module")
def models(tiny_llama):
  contiguous, tok = tiny_llama
  llama = nnx.merge(contiguous.graphdef, contiguous.params)
  return contiguous, PagedLlama(llama, block_size=BS), tok


@pytest.fixture(scope="module")
def controllers(models):
  contiguous, paged, tok = models
  return Controller(contiguous, tok), Controller(paged, tok)


def _requests(prompts=PROMPTS):
  return [ReasoningRequest(p, request_id=20 + i, seed=4) for i, p in enumerate(prompts)]


def _same_trace(a, b):
  assert a.token_ids == b.token_ids
  span = lambda t: [(s.start, s.end, s.action) for s in t.steps]
  assert span(a) == span(b)
  np.testing.assert_allclose([s.score for s in a.steps], [s.score for s in b.steps], rtol=1e-5)
  assert (a.tokens, a.exit_reason, a.backtracks, a.early_exit) == (
      b.tokens, b.exit_reason, b.backtracks, b.early_exit)
  assert a.answer_key == b.answer_key


def _same_results(contiguous, paged):
  for a, b in zip(contiguous, paged, strict=True):
    summary = lambda r: (r.answer, r.chosen, r.steps, r.backtracks)
    assert summary(a) == summary(b)
    assert a.votes == pytest.approx(b.votes, rel=1e-5)
    for ta, tb in zip(a.traces, b.traces, strict=True):
      _same_trace(ta, tb)


def _clear_of(results, threshold, margin=1e-4):
  scores = [s.score for r in results for t in r.traces for s in t.steps if not math.isnan(s.score)]
  assert scores and all(abs(s - threshold) > margin for s in scores)


# One compiled loop per verifier / vote setting: every case has 4 rows.
CASES = {
    "greedy_cot": (PROMPTS, dict(name="greedy_cot")),
    "self_consistency": (PROMPTS[:1], dict(name="self_consistency", n=4, temperature=0.8)),
    "backtrack": (PROMPTS, dict(name="think_verify_backtrack", verifier="mean_logprob",
                                backtrack_threshold=0.0045, max_step_backtracks=1, max_backtracks=3,
                                temperature=0.8, exit_tau=2.0, max_steps=4)),
    "self_verify": (PROMPTS, dict(name="think_verify_backtrack", verifier=PROBE,
                                  backtrack_threshold=0.5, max_step_backtracks=1, max_backtracks=2,
                                  temperature=0.8, exit_tau=0.9, max_steps=4)),
    "deepconf": (PROMPTS[3:], dict(name="deepconf", n=4, warmup=1, threshold=4.59, window=4,
                                   consensus=0.6, consensus_min_votes=2, temperature=0.8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_policy_gives_the_contiguous_traces(controllers, case):
  prompts, policy = CASES[case]
  policy = get_policy(**{**COMMON, **policy})
  contiguous, paged = (ctl.run(_requests(prompts), policy) for ctl in controllers)
  _same_results(contiguous, paged)
  if case == "self_verify":  # the Python twin on the paged cache: the same traces again
    paged_ctl = controllers[1]
    twin = Controller(paged_ctl.model, paged_ctl.tokenizer, python_twin=True)
    _same_results(paged, twin.run(_requests(prompts), policy))
  if case == "backtrack":
    assert sum(r.backtracks for r in paged) > 0
    _clear_of(paged, 0.0045, margin=1e-6)
  if case == "deepconf":
    assert any(t.stopped_low_confidence for r in paged for t in r.traces)
  if case == "self_verify":
    assert all(r.tokens.probe > 0 for r in paged) and sum(r.backtracks for r in paged) > 0
    _clear_of(paged, 0.5)


def _refs_match_tables(blocks) -> bool:
  """Every block's count = the rows holding it (the device bookkeeping is consistent)."""
  tables, used = np.asarray(blocks.tables), np.asarray(blocks.used)
  counts = np.zeros(blocks.num_blocks, np.int64)
  for row, n in zip(tables, used):
    np.add.at(counts, row[:n], 1)
  return bool(np.array_equal(counts, np.asarray(blocks.refcounts)))


def test_samples_share_the_prompt_blocks(models):
  _, paged, tok = models
  ctl = Controller(paged, tok)
  st = LoopSettings(temperature=0.8, **COMMON)
  prompt = PROMPTS[0]  # 11 tokens: blocks 0, 1 full, block 2 holds 3 positions
  state = ctl.initial_state(_requests([prompt]), [ctl.encode(prompt)], st, 4, 0, [-math.inf])
  cache = state.cache
  assert int(cache.blocks_in_use) == 3  # the prompt's blocks, once for 4 samples
  assert (np.asarray(cache.blocks.refcounts)[np.asarray(cache.blocks.tables)[0, :3]] == 4).all()
  out = ctl.loop(st).run(paged.params, state)
  blocks = out.cache.blocks
  assert _refs_match_tables(blocks)
  tables, used = np.asarray(blocks.tables), np.asarray(blocks.used)
  # Positions 0..9 stay shared; each sample rewrote position 10 (its first decode step),
  # so it owns block 2 (a copy) onwards: prompt_blocks + per-sample blocks, not 4 copies.
  shared = (11 - 1) // BS
  assert (tables[:, :shared] == tables[0, :shared]).all()
  own = used - shared
  assert int(out.cache.blocks_in_use) == shared + own.sum() < used.sum()
  private = [b for row, n in zip(tables, used) for b in row[shared:n]]
  assert len(set(private)) == len(private) == own.sum()  # no block of one sample in another
  lengths = np.asarray(out.length)
  assert (used <= -(-lengths // BS)).all() and int(out.cache.peak_blocks) <= blocks.num_blocks


def test_truncate_frees_blocks_and_rewrites_read_right(models):
  """Prefill 10 tokens into row 0, share them with row 1 (`copy_rows`, as the controller
  does), decode 8 each; roll row 0 back to 12 and write other tokens there. Logits match a
  contiguous run over each row's final sequence."""
  contiguous, paged, _ = models
  rng = np.random.default_rng(3)
  prompt = rng.integers(3, 259, 10).astype(np.int32)
  fwd = jax.jit(paged.forward)
  cache = jax.jit(paged.prefill_rows)(paged.params, paged.init_cache(2, 32), jnp.array([0]),
                                      jnp.asarray(prompt[None]), jnp.array([9]), jnp.array([0]))
  cache = jax.jit(paged.copy_rows)(cache, jnp.array([1]), jnp.array([0]))
  seqs = [list(prompt), list(prompt)]
  step = lambda cache, toks, pos: fwd(paged.params, cache, jnp.asarray(toks)[:, None],
                                      jnp.asarray(pos, jnp.int32), jnp.zeros(2, jnp.int32))
  for p in range(10, 18):
    toks = rng.integers(3, 259, 2)
    _, cache = step(cache, toks, [p, p])
    for s, t in zip(seqs, toks):
      s.append(int(t))
  assert _refs_match_tables(cache.blocks)
  # 18 positions: blocks 0, 1 shared; 2 (a copy of the partial prompt block), 3, 4 per row.
  assert int(cache.blocks_in_use) == 2 + 2 * 3
  cache = jax.jit(paged.truncate)(cache, jnp.array([12, 18]))
  assert np.asarray(cache.blocks.used).tolist() == [3, 5]
  assert int(cache.blocks_in_use) == 2 + 1 + 3 and _refs_match_tables(cache.blocks)
  seqs[0] = seqs[0][:12]
  for p in range(12, 16):  # row 0 writes past its new end, row 1 rewrites its last position
    tok = int(rng.integers(3, 259))
    logits, cache = step(cache, [tok, seqs[1][17]], [p, 17])
    seqs[0].append(tok)
  assert _refs_match_tables(cache.blocks)
  padded = np.zeros((2, 18), np.int32)
  for row, seq in enumerate(seqs):
    padded[row, :len(seq)] = seq
  ref, _ = jax.jit(contiguous.forward)(contiguous.params, contiguous.init_cache(2, 32),
                                       jnp.asarray(padded), jnp.zeros(2, jnp.int32),
                                       jnp.array([len(s) - 1 for s in seqs]))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-4)


def test_a_pool_that_runs_out_raises_and_spares_the_other_rows(models):
  """Row 0 (8 tokens, 2 blocks) fits a 3-block pool; row 1 (12 tokens) does not."""
  contiguous, paged, _ = models
  small = PagedLlama(nnx.merge(paged.graphdef, paged.params), block_size=BS, num_blocks=3)
  tokens = np.random.default_rng(1).integers(3, 259, (2, 12)).astype(np.int32)
  logits, cache = jax.jit(small.forward)(small.params, small.init_cache(2, 16),
                                         jnp.asarray(tokens), jnp.zeros(2, jnp.int32),
                                         jnp.array([7, 11]))
  assert bool(cache.overflow)
  with pytest.raises(PagedCacheOverflow, match="ran out of blocks: a pool of 3 blocks"):
    small.check(cache)
  ref, _ = jax.jit(contiguous.forward)(contiguous.params, contiguous.init_cache(1, 16),
                                       jnp.asarray(tokens[:1]), jnp.zeros(1, jnp.int32),
                                       jnp.array([7]))
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref[0]), atol=2e-4)


def test_a_fixed_pool_no_request_fits_is_found_before_any_request(models):
  """Each trace writes a block of its own beside the prompt's: a 3-block pool holds a
  request of 2 traces at best, never one of 3 (was: every request overflowed)."""
  _, paged, tok = models
  small = Controller(PagedLlama(nnx.merge(paged.graphdef, paged.params), block_size=BS,
                                num_blocks=3), tok)
  small.check_policy_fits(get_policy("self_consistency", n=2))
  with pytest.raises(ValueError, match=r"^num_blocks=3: a request of 3 trace\(s\) needs at "
                                       r"least 4 blocks"):
    small.check_policy_fits(get_policy("self_consistency", n=3))


def test_a_prompt_a_fixed_pool_cannot_hold_is_named_before_any_request_runs(models):
  """Before: the batch ran, then overflowed with no request named and every request's
  traces lost (the short ones fit)."""
  _, paged, tok = models
  ctl = Controller(PagedLlama(nnx.merge(paged.graphdef, paged.params), block_size=BS,
                              num_blocks=6), tok)
  policy = get_policy("greedy_cot", max_thinking_tokens=4, max_answer_tokens=2)
  ctl.check_policy_fits(policy)
  long = ReasoningRequest("y" * (5 * BS + 1), request_id="long")  # 6 prompt blocks
  with pytest.raises(ValueError, match=r"^request 1 \(request_id='long'\): num_blocks=6: a "
                                       r"request of 1 trace\(s\) needs at least 7 blocks "
                                       r"\(each trace writes a block of its own beside the "
                                       r"prompt's 6\)"):
    ctl.run([ReasoningRequest("hi", request_id="a"), long], policy)
  assert ctl.run([ReasoningRequest("hi", request_id="a")], policy)[0].traces[0].token_ids


class _OutOfBlocks(MockDecodeModel):
  def check(self, cache):
    raise PagedCacheOverflow("the paged KV cache ran out of blocks")


def test_the_controller_checks_the_cache_after_each_loop_call():
  model = _OutOfBlocks(np.zeros((len(VOCAB), len(VOCAB)), np.float32))
  with pytest.raises(PagedCacheOverflow):  # the loop call's results are never returned
    Controller(model, MockTokenizer(VOCAB)).run(["Q"], {"name": "greedy_cot",
                                                        "max_thinking_tokens": 2})


def test_plan_sized_pool_is_smaller_than_the_contiguous_cache(models):
  _, paged, tok = models
  ctl = Controller(paged, tok)
  st = LoopSettings(**COMMON)
  length = ctl.cache_length(st, 16)
  plan = ctl.cache_plan(st, 4, 16)
  pool = paged.pool_blocks(1, length, plan)
  assert pool == 16 // BS + 4 * (math.ceil(plan.new_tokens / BS) + 1)
  assert pool * BS < 4 * length


def test_cache_config_selects_the_model_and_names_bad_values(models):
  contiguous, paged, _ = models
  llama = nnx.merge(paged.graphdef, paged.params)
  assert isinstance(build_decode_model(llama), PagedLlama)  # the default
  assert type(build_decode_model(llama, {"cache": "contiguous"})).__name__ == "ContiguousLlama"
  built = build_decode_model(llama, CacheConfig(cache="paged", block_size=8, num_blocks=64))
  assert isinstance(built, PagedLlama) and (built.block_size, built.num_blocks) == (8, 64)
  assert build_decode_model(llama, {"cache": "paged"}).num_blocks is None  # 0 = from the plan
  with pytest.raises(ValueError, match=r"cache='pagd': valid caches are \['contiguous', 'paged'\]"):
    CacheConfig.from_dict({"cache": "pagd"})
  with pytest.raises(ValueError, match=r"no keys \['blocks'\]"):
    CacheConfig.from_dict({"blocks": 4})
  with pytest.raises(ValueError, match="block_size=0"):
    CacheConfig.from_dict({"cache": "paged", "block_size": 0})




def test_fp8_pool_samples_read_the_shared_prompt_as_the_f32_pool_does(tmp_path):
  """An FP8 paged pool (one scale per token and head) under sampling's prompt sharing:
  the samples share a prompt's blocks and copy its partly filled last block on their
  first write, codes with their scales. On a tiny model with sharp logits (its embedding
  as written) at temperature 1e-6 the FP8 pool gives the f32 pool's tokens, and a mean
  log p within 0.1 (measured: 0.02); with the scales left behind by the copy, positions
  8-10 read other scales and every trace moved (log p -10.1 against -16.5)."""
  from o1jax.checkpoint import load_checkpoint
  from o1jax.model import Llama
  from o1jax.testing import tiny_config, write_hf_checkpoint

  write_hf_checkpoint(tmp_path, tiny_config(max_context=512), seed=5)
  ck = load_checkpoint(tmp_path)
  llama = Llama(ck.config, ck.params)
  fp8 = PagedLlama(llama, block_size=BS, kv_dtype="float8_e4m3fn")
  f32 = PagedLlama(llama, block_size=BS)
  policy = get_policy(**{**COMMON, "name": "self_consistency", "n": 3, "temperature": 1e-6})
  requests = _requests(PROMPTS[:3])  # "hello there", 11 tokens: block 2 holds 3 positions
  quantized = Controller(fp8, ck.tokenizer).run(requests, policy)
  exact = Controller(f32, ck.tokenizer).run(requests, policy)
  for q, e in zip(quantized, exact, strict=True):
    assert [t.token_ids for t in q.traces] == [t.token_ids for t in e.traces]
    np.testing.assert_allclose([t.mean_logprob for t in q.traces],
                               [t.mean_logprob for t in e.traces], atol=0.1)
