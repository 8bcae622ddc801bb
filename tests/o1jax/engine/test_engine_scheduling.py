"""Engine behaviour on the tiny model: correctness vs the contiguous Generator,
determinism across batch sizes, fork / prefix reuse / preemption, compilation
counts, stop rules, streaming and bad input."""

import dataclasses
import re
import types

import numpy as np
import pytest

from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
from o1jax.model import Generator, Llama

SAMPLED = [GenerationParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
           GenerationParams(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                            seed=1, ignore_eos=True)]
GREEDY = GenerationParams(max_new_tokens=12, ignore_eos=True)


def test_greedy_matches_contiguous_generator(tiny, engine32, make_prompts):
  prompts = make_prompts(5, seed=0, low=2, high=70)
  got = engine32.generate([Request(p, GREEDY) for p in prompts])
  want = Generator(tiny.model, tiny.tokenizer).generate(prompts, max_new_tokens=12)
  for g, w in zip(got, want):
    assert g.token_ids == w.token_ids[:len(g.token_ids)]
    assert len(g.token_ids) == 12 and g.finish_reason == "length"


@pytest.mark.parametrize("params", [GREEDY] + SAMPLED, ids=["greedy", "temperature", "filtered"])
@pytest.mark.parametrize("variant", ["f32", "bf16", "bf16kv", "int8"])
def test_same_tokens_at_batch_1_7_and_32(request, make_prompts, params, variant):
  """A fixed request (id 1234) alone, among 6 and among 31 other requests, in
  different slots: identical tokens (its keys come from seed, id, sample index).
  Also with bf16 matmuls, whose rows are padded to stay batch-invariant, and
  with bf16 KV pools (written and read by the native CPU kernels), and with
  int8 activations (each row quantized on its own)."""
  engine32 = request.getfixturevalue({"f32": "engine32", "bf16": "engine32_bf16",
                                      "bf16kv": "engine32_bf16kv", "int8": "engine32_int8"}[variant])
  target = Request(make_prompts(1, seed=99, low=20, high=21)[0], params, request_id=1234)
  alone = engine32.generate([target])[0].token_ids
  fillers = make_prompts(31, seed=5)
  batch7 = [Request(p, SAMPLED[0]) for p in fillers[:3]] + [target] + \
           [Request(p, GREEDY) for p in fillers[3:6]]
  batch32 = [Request(p, SAMPLED[i % 2]) for i, p in enumerate(fillers)] + [target]
  assert engine32.generate(batch7)[3].token_ids == alone
  assert engine32.generate(batch32)[31].token_ids == alone
  assert len(alone) == 12


def test_steady_state_does_not_recompile(tiny, make_prompts):
  """After one run, a new workload with the same length profile (different
  tokens, so nothing comes from the prefix cache) compiles nothing new."""
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=8, num_blocks=256,
                                                           prefill_chunk=32))
  params = GenerationParams(max_new_tokens=10, ignore_eos=True)
  warmup = make_prompts(12, seed=1)
  engine.generate([Request(p, params) for p in warmup])
  warm = dict(engine.trace_counts)
  assert warm["decode"] >= 1 and warm["prefill"] >= 1
  rng = np.random.default_rng(2)
  fresh = [rng.integers(3, 259, size=len(p)).tolist() for p in warmup]
  engine.generate([Request(p, params) for p in fresh])
  assert dict(engine.trace_counts) == warm
  assert sum(warm.values()) <= 12  # a small fixed set of bucketed programs


def test_alternating_workloads_do_not_recompile(tiny, make_prompts):
  """A long run then a prompt-only run, repeated: the second round compiles
  nothing (the cache a step returns carries its block tables; their width must
  not leak into the next call's signature)."""
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=1, num_blocks=64,
                                                           prefill_chunk=64, prefix_caching=False))
  prompt = make_prompts(1, seed=4, low=40, high=41)[0]
  long_run = [Request(prompt, GenerationParams(max_new_tokens=150, ignore_eos=True))]
  prompt_only = [Request(prompt, GenerationParams(max_new_tokens=1, ignore_eos=True))]
  engine.generate(long_run)
  engine.generate(prompt_only)
  warm = dict(engine.trace_counts)
  engine.generate(long_run)
  engine.generate(prompt_only)
  assert dict(engine.trace_counts) == warm


def test_fork_prefills_prompt_once_and_frees_everything(engine32, make_prompts):
  prompt = make_prompts(1, seed=3, low=37, high=38)[0]
  params = GenerationParams(max_new_tokens=8, temperature=1.0, n=4, seed=3, ignore_eos=True,
                            logprobs=True, top_logprobs=3)
  res = engine32.generate([Request(prompt, params, request_id=5)])[0]
  assert res.metrics.prompt_tokens_computed <= len(prompt) - 1  # once, not 4 times
  assert len(res.samples) == 4 and len({tuple(s.token_ids) for s in res.samples}) > 1
  for s in res.samples:
    assert len(s.logprobs) == 8 and all(lp <= 0 for lp in s.logprobs)
    assert len(s.top_logprobs) == 8 and len(s.top_logprobs[0]) == 3
    # the best alternative is at least as likely as the sampled token
    assert all(top[0][1] >= lp - 1e-5 for top, lp in zip(s.top_logprobs, s.logprobs))
  assert engine32.allocator.refcounts.sum() == 0
  # Each sample equals the same request run as sample j of a fresh n-sample run.
  again = engine32.generate([Request(prompt, params, request_id=5)])[0]
  assert [s.token_ids for s in again.samples] == [s.token_ids for s in res.samples]


def test_prefix_reuse_computes_only_the_suffix(tiny, make_prompts):
  shared = make_prompts(1, seed=4, low=50, high=51)[0]  # 3 full blocks of 16 + 2
  a, b = (shared + s for s in make_prompts(2, seed=6, low=5, high=9))
  cfg = EngineConfig(max_slots=4, num_blocks=64)
  engine = Engine(tiny.model, tiny.tokenizer, cfg)
  first = engine.generate([Request(a, GREEDY)])[0]
  second = engine.generate([Request(b, GREEDY)])[0]
  assert first.metrics.prompt_tokens_computed == len(a) - 1
  assert second.metrics.prompt_tokens_computed == len(b) - 1 - 48
  cold = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=64,
                                                         prefix_caching=False))
  assert cold.generate([Request(b, GREEDY)])[0].token_ids == second.token_ids


def test_out_of_blocks_preempts_and_recomputes(tiny, engine32, make_prompts):
  prompts = make_prompts(8, seed=8, low=20, high=40)
  params = GenerationParams(max_new_tokens=24, ignore_eos=True)
  small = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=8, num_blocks=10,
                                                          prefill_chunk=64))
  got = small.generate([Request(p, params) for p in prompts])
  want = engine32.generate([Request(p, params) for p in prompts])
  assert small.metrics.preemptions > 0
  assert [g.token_ids for g in got] == [w.token_ids for w in want]
  # every re-admission recomputes at least one token; only preempted requests recompute
  recomputed = [g.metrics.recomputed_tokens for g in got]
  assert small.metrics.summary()["recomputed_tokens"] == sum(recomputed) >= small.metrics.preemptions
  preempted = [sum(s.preemptions for s in g.samples) > 0 for g in got]
  assert [r > 0 for r in recomputed] == preempted
  assert small.allocator.refcounts.sum() == 0 and small.metrics.kv_blocks_peak <= 10


@pytest.mark.parametrize("seed, policy, num_blocks, decode_steps", [
    (6, "fifo", 13, 1), (21, "shortest_budget", 11, 4)])
def test_a_copy_on_write_destination_is_written_once(tiny, engine32, seed, policy,
                                                    num_blocks, decode_steps):
  """A row's planned copy-on-write can be undone by a later row's allocation in the same
  call (the row preempted, its destination freed and handed out again as the later row's
  copy destination): the copy runs once per destination, the live row's (two copies to
  one destination were scattered together, in an order a GPU does not define)."""
  rng = np.random.default_rng(seed)
  small = Engine(tiny.model, tiny.tokenizer, EngineConfig(
      max_slots=8, num_blocks=num_blocks, block_size=4, prefill_chunk=16, policy=policy,
      decode_steps=decode_steps))
  planned, ran = [], []
  run_copies, copy_jit = small._run_copies, small._copy_jit
  small._run_copies = lambda copies: (planned.append(list(copies)), run_copies(copies))[1]

  def copy(cache, src, dst):
    dst = np.asarray(dst)
    ran.append(dst[dst < small.num_blocks].tolist())
    return copy_jit(cache, src, dst)

  small._copy_jit = copy
  requests = [Request(rng.integers(3, 259, size=int(rng.integers(2, 12))).tolist(),
                      GenerationParams(max_new_tokens=int(rng.integers(4, 30)),
                                       n=int(rng.integers(1, 4)), temperature=0.8, seed=seed),
                      request_id=f"r{i}") for i in range(6)]
  got = small.generate(requests)
  assert any(len({b for _, b in c}) < len(c) for c in planned)  # (the case arises here)
  assert all(len(set(d)) == len(d) for d in ran)
  want = engine32.generate(requests)
  assert [[s.token_ids for s in g.samples] for g in got] == [
      [s.token_ids for s in w.samples] for w in want]
  assert small.allocator.refcounts.sum() == 0


def test_shortest_budget_policy_runs_short_requests_first(tiny):
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=1, num_blocks=32,
                                                           policy="shortest_budget"))
  budgets = [9, 2, 5]
  res = engine.generate([Request([5, 6, 7], GenerationParams(max_new_tokens=b, ignore_eos=True))
                         for b in budgets])
  finish = [r.metrics.finish for r in res]
  # all three wait at the first step; one slot: budgets 2, 5, 9 run in that order
  assert finish[1] < finish[2] < finish[0]


def test_stop_ids_stop_strings_and_stream(tiny, engine32, make_prompts):
  prompt = make_prompts(1, seed=10)[0]
  free = engine32.generate([Request(prompt, GenerationParams(max_new_tokens=16, ignore_eos=True))])[0]
  stop_id = free.token_ids[5]
  first = free.token_ids.index(stop_id)
  by_id = engine32.generate([Request(prompt, GenerationParams(max_new_tokens=16, ignore_eos=True,
                                                              stop_token_ids=(stop_id,)))])[0]
  assert by_id.token_ids == free.token_ids[:first] and by_id.finish_reason == "stop"
  stop_text = tiny.tokenizer.decode(free.token_ids[6:8])
  by_text = engine32.generate([Request(prompt, GenerationParams(max_new_tokens=16, ignore_eos=True,
                                                                stop=(stop_text,)))])[0]
  assert stop_text not in by_text.text and by_text.finish_reason == "stop"
  assert free.text.startswith(by_text.text)
  events = list(engine32.stream(Request(prompt, GenerationParams(max_new_tokens=16, ignore_eos=True),
                                        request_id=0)))
  assert [e.token_id for e in events if e.token_id is not None] == free.token_ids
  assert "".join(e.text for e in events) == free.text and events[-1].finish_reason == "length"


def test_bad_input_gives_clear_errors(engine32):
  with pytest.raises(ValueError, match="empty"):
    engine32.generate([Request("")])
  with pytest.raises(ValueError, match="context"):
    engine32.generate([Request(list(range(3, 259)) + [5])])
  with pytest.raises(ValueError, match="unknown generation parameter.*temprature"):
    engine32.generate([Request("hi", {"temprature": 0.5})])
  with pytest.raises(ValueError, match="unknown request field"):
    engine32.generate([{"prompt": "hi", "max_tokens": 3}])
  # (was Request's TypeError, naming neither the request nor its id)
  with pytest.raises(ValueError, match=r"^request 1 \(request_id='q7'\): a request dict needs a "
                                       r"'prompt'$"):
    engine32.generate([{"prompt": "a"}, {"request_id": "q7"}])
  with pytest.raises(ValueError, match="decode slots"):
    engine32.generate([Request("hi", GenerationParams(n=64))])
  with pytest.raises(ValueError, match="temperature"):
    GenerationParams(temperature=-1)
  with pytest.raises(ValueError, match="vocabulary"):
    engine32.generate([Request([1, 2, 999999])])
  assert not engine32.has_work()  # nothing was queued by the failed calls


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("fields, match", [
    (dict(temperature=NAN), r"^temperature must be finite, got nan$"),  # was: greedy, silently
    (dict(temperature=INF), r"^temperature must be finite, got inf$"),  # was: uniform sampling
    (dict(temperature="0.5"), r"^temperature must be a number, got '0.5'$"),
    (dict(top_k=2.5), r"^top_k must be an int in \[0, 2147483647\], got 2.5$"),  # was: cut to 2 on the device
    (dict(top_k=NAN), r"^top_k must be an int in \[0, 2147483647\], got nan$"),  # was: a crash inside step
    (dict(top_k=2**70), r"^top_k must be an int in \[0, 2147483647\], got 1180591620717411303424$"),  # was: int32 overflow inside step
    (dict(seed=2**63), r"^seed must be an int in \[-2\*\*63, 2\*\*63\)"),  # was: overflow in step
    (dict(seed=1.5), r"^seed must be an int"),
    (dict(seed=None), r"^seed must be an int"),
    (dict(max_new_tokens=2.5), r"^max_new_tokens must be an int >= 1, got 2.5$"),
    (dict(max_new_tokens=NAN), r"^max_new_tokens must be an int >= 1, got nan$"),
    (dict(max_new_tokens=True), r"^max_new_tokens must be an int >= 1, got True$"),
    (dict(n=2.5), r"^n must be an int >= 1, got 2.5$"),
    (dict(top_logprobs=2.5), r"^top_logprobs must be an int >= 0, got 2.5$"),  # was: crash in step
    (dict(stop=[1]), r"^stop strings must be non-empty str, got 1$"),  # was: crash in step
    (dict(stop=[""]), r"^stop strings must be non-empty str, got ''$"),
    (dict(stop=None), r"^stop must be a str or a list of str, got None$"),
    (dict(stop_token_ids=[-1]), r"^stop_token_ids must be token ids \(ints >= 0\), got -1$"),
    (dict(stop_token_ids=[1.5]), r"^stop_token_ids must be token ids"),  # was: cut to 1
    (dict(stop_token_ids="12"), r"^stop_token_ids must be a list of token ids, got '12'$"),
    (dict(ignore_eos="no"), r"^ignore_eos must be a bool, got 'no'$"),  # was: truthy
])
def test_bad_generation_params_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    GenerationParams(**fields)


@pytest.mark.parametrize("fields, match", [
    (dict(max_slots=2.5), r"^max_slots must be an int >= 1, got 2.5$"),
    (dict(max_slots=True), r"^max_slots must be an int >= 1, got True$"),
    (dict(num_blocks=0), r"^num_blocks must be an int >= 1 or None \(the default\), got 0$"),
    (dict(kv_cache_bytes=0), r"^kv_cache_bytes must be an int >= 1 or None \(the default\), got 0$"),  # was: 256 MiB
    (dict(max_context=0), r"^max_context must be an int >= 1 or None \(the default\), got 0$"),  # was: the model's
    (dict(min_table_blocks=0), r"^min_table_blocks must be an int >= 1, got 0$"),
    (dict(max_top_logprobs=-1), r"^max_top_logprobs must be an int >= 0, got -1$"),
    (dict(decode_buckets=(8, 0)), r"^decode_buckets=\(8, 0\) must be batch sizes"),
    (dict(decode_buckets=(2.5,)), r"^decode_buckets=\(2.5,\) must be batch sizes"),
    (dict(prefix_caching="no"), r"^prefix_caching='no' must be a bool$"),
])
def test_bad_engine_config_names_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig(**fields)


def test_engine_config_edge_values(tiny):
  assert EngineConfig(decode_buckets=[8, 1]).decode_buckets == (8, 1)  # a list: hashable tuple
  assert hash(EngineConfig(decode_buckets=[]))
  # Checked against the model before any program is built.
  with pytest.raises(ValueError, match=r"^max_top_logprobs=1000 exceeds the model's vocabulary"):
    Engine(tiny.model, tiny.tokenizer, EngineConfig(max_top_logprobs=1000, num_blocks=8))
  # Past what the context can use (before: a program that never finished compiling, a host
  # loop of ~1e8 turns, a 30 GB table, each at the first generate).
  # The bound is named with the settings it comes from (was "<= 16 (prefill_chunk)" for a
  # prefill_chunk of 4).
  for field, value, message in [
      ("decode_steps", 10**9, r"<= 256 \(the context's tokens, max_context=256\)$"),
      ("min_chunk_bucket", 10**9, r"<= 128 \(max\(prefill_chunk=128, 16\)\)$"),
      ("min_table_blocks", 10**9, r"<= 16 \(max\(the 16 blocks of one context, 8\)\)$")]:
    with pytest.raises(ValueError, match=rf"^{field}={value} must be " + message):
      Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=8, **{field: value}))
  with pytest.raises(ValueError, match=r"^min_chunk_bucket=64 must be <= 16 \(max\(prefill_chunk=4, "
                                       r"16\)\)$"):
    Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=8, prefill_chunk=4,
                                                    min_chunk_bucket=64))
  Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=8, decode_steps=256))
  # A context past the model's was cut to it silently.
  with pytest.raises(ValueError, match=r"^max_context=257 exceeds the model's context of 256 "
                                       r"tokens$"):
    Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=8, max_context=257))
  assert Engine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=8, max_context=256)).max_context == 256
  pallas = Llama(tiny.config, tiny.params, backend="pallas")
  with pytest.raises(ValueError, match=r"^block_size=12 must be a power of two in \[8, 128\]"):
    Engine(pallas, tiny.tokenizer, EngineConfig(block_size=12, num_blocks=8))
  # 'auto' on a GPU takes XLA's attention for such pages (it was refused there).
  from o1jax.testing import as_if_on_gpu
  assert tiny.model.backend == "auto"
  with as_if_on_gpu():
    Engine(tiny.model, tiny.tokenizer, EngineConfig(block_size=12, num_blocks=8))


def test_refused_requests_leave_the_engine_serving(engine32):
  """Each bad request is refused before any work (it used to fail inside `step`, keeping
  its blocks, so that every later call failed too); a good one then runs as before."""
  good = Request([5, 6, 7, 8], GenerationParams(max_new_tokens=3, ignore_eos=True),
                 request_id="good")
  before = engine32.generate([good])[0].token_ids
  bad = [
      (Request([5, 1.5]), r"^prompt token ids must be ints, got 1.5$"),  # was: cut to 1
      (Request([True, 5]), r"^prompt token ids must be ints, got True$"),
      (Request(np.array([5.7, 6.2])), r"^prompt token ids must be ints"),
      (Request([5], GenerationParams(stop_token_ids=[259])),
       r"^stop_token_ids outside the vocabulary \[0, 259\): \[259\]$"),
      (Request([5], request_id=-1), r"^request_id=-1 must be in \[0, 2\*\*64\)"),  # was: crash
      (Request([5], request_id=2**64), r"^request_id=18446744073709551616 must be in \[0, 2\*\*64\)"),
      (Request([5], request_id=1.0), r"^request_id must be an int, a str or None, got 1.0$"),
      (Request([5], request_id=True), r"^request_id must be an int, a str or None, got True$"),
      (Request("x" * 400), r"^prompt has 400 tokens but the context is 256 tokens \(room for "),
      (5, r"^request must be a Request, a dict or a prompt str, got int$"),
      (None, r"^request must be a Request, a dict or a prompt str, got NoneType$"),
  ]
  for request, match in bad:
    # One bad request of several is named by its position (and id): a batch of 1,000
    # prompts said which was at fault only by its message.
    rid = getattr(request, "request_id", None)
    named = "" if rid is None else re.escape(f" (request_id={rid!r})")
    with pytest.raises(ValueError, match=rf"^request 1{named}: " + match[1:]):
      engine32.generate([good, request])
    with pytest.raises(ValueError, match=match):
      engine32.check_requests([request])
  with pytest.raises(ValueError, match=r"^requests must be a list of requests, got one str$"):
    engine32.generate("hello")  # was: one request per character
  assert not engine32.has_work() and engine32.allocator.num_used == 0
  assert engine32.generate([good])[0].token_ids == before


def test_valid_edge_cases_run(engine32):
  one = engine32.generate([Request([5, 6, 7], GenerationParams(max_new_tokens=1, stop=[]))])[0]
  assert len(one.token_ids) <= 1 and one.finish_reason in ("stop", "length")
  slots = engine32.config.max_slots
  full = engine32.generate([Request([5, 6, 7], GenerationParams(
      n=slots, temperature=1.0, max_new_tokens=2, ignore_eos=True, seed=-1))])[0]
  assert len(full.samples) == slots and all(len(s.token_ids) == 2 for s in full.samples)
  greedy = GenerationParams(max_new_tokens=3, temperature=0, ignore_eos=True, top_k=10**6)
  assert engine32.generate([Request([5, 6, 7], greedy)])[0].token_ids == engine32.generate(
      [Request([5, 6, 7], GenerationParams(max_new_tokens=3, ignore_eos=True))])[0].token_ids
  # A str id holding a lone surrogate names a stream too (was a UnicodeEncodeError).
  sampled = GenerationParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
  odd = [engine32.generate([Request([5, 6, 7], sampled, request_id="q\ud800")])[0].token_ids
         for _ in range(2)]
  assert odd[0] == odd[1] and len(odd[0]) == 3


def test_a_numpy_int_request_id_is_the_same_id(engine32):
  """np.int64(7) keys the same random stream as 7 (it was hashed as the text "7"), and
  is range-checked like a Python int."""
  params = GenerationParams(max_new_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
  tokens = lambda rid: engine32.generate([Request([3, 4, 5], params, request_id=rid)])[0].token_ids
  assert tokens(np.int64(7)) == tokens(np.uint32(7)) == tokens(7) != tokens("7")
  # 64-bit ids: apart from their low word (the pipelines' ids are 64 bits of sha256)
  assert tokens(np.uint64(2**40 + 7)) == tokens(2**40 + 7) != tokens(7)
  with pytest.raises(ValueError, match=r"^request_id=-1 must be in \[0, 2\*\*64\)"):
    tokens(np.int64(-1))


def test_str_request_ids_key_streams_of_their_own(engine32):
  # A 32-bit CRC of the id keyed the stream: "plumless" and "buckeroo" (one CRC) drew the
  # same samples, and so did "" and the int id 0, "hello" and the int crc32("hello").
  params = GenerationParams(max_new_tokens=12, temperature=1.0, seed=4, ignore_eos=True)
  tokens = lambda rid: tuple(engine32.generate([Request([3, 4, 5], params, request_id=rid)])[0]
                             .token_ids)
  drawn = [tokens(rid) for rid in ("plumless", "buckeroo", "", 0, "hello", 907060870)]
  assert len(set(drawn)) == len(drawn)
  assert tokens("plumless") == drawn[0]  # (a str id still names one stream)


def test_add_request_index_and_handles_of_another_engine_are_refused(tiny, engine32):
  # An index of -5 (the id of a request without one) failed the next step for every
  # request and lost its KV blocks; another engine's handle given to cancel() was marked
  # finished here while its own engine still decoded it.
  request = Request([3, 4, 5], GenerationParams(max_new_tokens=2, ignore_eos=True))
  for index in (-5, 2**64, 1.5, "x"):
    with pytest.raises(ValueError, match=r"^index \(a request without a request_id is numbered "
                                         r"by it\) must be an int in \[0, 2\*\*64\), got "):
      engine32.add_request(request, index=index)
  other = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=2, num_blocks=32))
  handle = other.add_request(request)
  for call in (engine32.cancel, engine32.result):
    with pytest.raises(ValueError, match=r"^request 0 was queued on another Engine$"):
      call(handle)
  other.run_until_idle()
  assert len(other.result(handle).samples[0].token_ids) == 2
  assert engine32.allocator.num_used == 0
  assert engine32.generate([request])[0].token_ids  # still serving


def test_an_error_inside_generate_cancels_its_requests(engine32, monkeypatch):
  good = Request([9, 8, 7], GenerationParams(max_new_tokens=3, ignore_eos=True))
  before = engine32.generate([good])[0].token_ids

  def boom():
    raise RuntimeError("device lost")

  monkeypatch.setattr(engine32, "_decode_once", boom)
  with pytest.raises(RuntimeError, match="device lost"):
    engine32.generate([good])
  monkeypatch.undo()
  # Its prefilled request left with its blocks: the next call runs only its own.
  assert not engine32.has_work() and not engine32._groups and engine32.allocator.num_used == 0
  assert engine32.generate([good])[0].token_ids == before


@pytest.mark.parametrize("call", ["decode", "prefill"])
def test_a_device_call_that_loses_the_pool_leaves_a_working_engine(tiny, make_prompts, call):
  """A device call that fails after taking its donated KV pool (as an out-of-memory error
  on a GPU does) deletes the pool's buffers. The engine rebuilds the pool and requeues
  every sequence that held blocks: the request whose caller gives up is cancelled, the
  others finish with the tokens they get alone, and a prefix cached before the failure is
  not reused from the lost pool."""
  import jax
  prefix = make_prompts(1, seed=41, low=40, high=41)[0]
  a, b, c = (prefix + tail for tail in make_prompts(3, seed=42, low=3, high=9))
  config = EngineConfig(max_slots=4, num_blocks=64, block_size=4, prefill_chunk=16,
                        decode_steps=2)
  params = GenerationParams(max_new_tokens=10, temperature=0.9, seed=3, ignore_eos=True)
  alone = lambda p: Engine(tiny.model, tiny.tokenizer, config).generate(
      [Request(p, params, request_id=7)])[0].token_ids
  engine = Engine(tiny.model, tiny.tokenizer, config)
  doomed = engine.add_request(Request(a, params, request_id=5))
  survivor = engine.add_request(Request(b, params, request_id=7))
  real = getattr(engine, call)
  calls = []

  def fails_after_taking_the_pool(cache, *args, **kwargs):
    calls.append(call)
    if len(calls) == 2:  # a later call: the sequences hold blocks and tokens by then
      for leaf in jax.tree.leaves(cache):
        leaf.delete()
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    return real(cache, *args, **kwargs)

  engine.__dict__[call] = fails_after_taking_the_pool
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
    while True:
      engine.step()
  del engine.__dict__[call]
  engine.cancel(doomed)  # what a caller does with its own requests when a step raises
  assert engine.metrics.pool_rebuilds == 1 and engine.allocator.num_used == 0
  latecomer = engine.add_request(Request(c, params, request_id=7))  # shares the prefix
  engine.run_until_idle()
  assert engine.result(survivor).token_ids == alone(b)
  assert engine.result(latecomer).token_ids == alone(c)
  assert engine.metrics.preemptions >= 1 and engine.allocator.num_used == 0


def test_concurrent_requests_share_a_prefix_being_computed(tiny, make_prompts):
  """Four requests with one 64-token prefix arrive together: the first computes
  it, the others wait for its blocks and compute only their suffixes."""
  shared = make_prompts(1, seed=11, low=64, high=65)[0]
  prompts = [shared + s for s in make_prompts(4, seed=12, low=4, high=12)]
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=64,
                                                           prefill_chunk=32))
  res = engine.generate([Request(p, GREEDY) for p in prompts])
  computed = [r.metrics.prompt_tokens_computed for r in res]
  assert computed[0] == len(prompts[0]) - 1
  assert computed[1:] == [len(p) - 1 - 64 for p in prompts[1:]]
  cold = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=64,
                                                         prefix_caching=False))
  assert [r.token_ids for r in cold.generate([Request(p, GREEDY) for p in prompts])] == \
         [r.token_ids for r in res]


def test_requests_sharing_a_cached_prefix_are_admitted_together(tiny, make_prompts):
  """A prefix already in the cache is computed by nobody: requests sharing it do not
  wait for one another (before, one of them was admitted per step: at batch 32 on a
  chat template the batch could not refill as fast as rows ended)."""
  shared = make_prompts(1, seed=13, low=64, high=65)[0]
  prompts = [shared + s for s in make_prompts(4, seed=14, low=20, high=30)]
  config = EngineConfig(max_slots=4, num_blocks=128, prefill_chunk=128, max_prefill_seqs=4)
  engine = Engine(tiny.model, tiny.tokenizer, config)
  engine.generate([Request(shared + [5, 6, 7], GREEDY)])  # the shared blocks get cached
  groups = [engine.add_request(Request(p, GREEDY)) for p in prompts]
  engine.step()
  assert not engine._waiting and not engine._prefilling  # all four prefilled in one step
  engine.run_until_idle()
  res = [engine.result(g) for g in groups]
  assert [r.metrics.prompt_tokens_computed for r in res] == [len(p) - 1 - 64 for p in prompts]
  cold = Engine(tiny.model, tiny.tokenizer, dataclasses.replace(config, prefix_caching=False))
  assert [r.token_ids for r in cold.generate([Request(p, GREEDY) for p in prompts])] == \
         [r.token_ids for r in res]


def test_prefill_calls_pack_rows_by_tokens_per_cost(tiny, make_prompts):
  """Rows of a prefill call are padded to max_prefill_seqs rows of the longest: a call
  takes the first sequences whole, or all cut to pieces that keep it within one chunk's
  positions, whichever computes the most prompt tokens per cost (positions + a fixed
  overhead); a call never takes more than one chunk of tokens. Before, a
  second row could only join with pieces of chunk / max_prefill_seqs tokens, so prompts
  longer than that (most chat prompts) prefilled one per call: 3x slower at 64 requests
  of 40 tokens with bf16 matmuls (scripts/bench_engine.py)."""
  def run(config, prompts):
    engine = Engine(tiny.model, tiny.tokenizer, config)
    calls, prefill = [], engine.prefill

    def recording(cache, tokens, starts, lens, *args):
      calls.append((tokens.shape, int(np.sum(lens))))
      return prefill(cache, tokens, starts, lens, *args)

    engine.prefill = recording
    res = engine.generate([Request(p, GREEDY) for p in prompts])
    alone = Engine(tiny.model, tiny.tokenizer, dataclasses.replace(config, max_slots=1))
    assert [r.token_ids for r in res] == \
           [r.token_ids for r in alone.generate([Request(p, GREEDY) for p in prompts])]
    assert all(tokens <= config.prefill_chunk for _, tokens in calls), calls
    return calls

  # 16 prompts of 40-41 tokens, chunk 256 over 8 rows: 8 rows of 32 tokens, then their
  # 8-9 token rests (before: 16 calls of one row). The shapes the packing wants: no
  # renting of bigger compiled ones (test_shape_plan.py).
  calls = run(EngineConfig(max_slots=16, num_blocks=256, prefill_chunk=256, max_prefill_seqs=8,
                           prefix_caching=False, reuse_compiled_shapes=False),
              make_prompts(16, seed=16, low=40, high=42))
  assert [shape for shape, _ in calls] == [(8, 32), (8, 16), (8, 32), (8, 16)], calls
  # Prompts of 5-90 tokens: long rows go alone, short pieces still share a call.
  calls = run(EngineConfig(max_slots=8, num_blocks=256, prefill_chunk=64, max_prefill_seqs=4,
                           prefix_caching=False), make_prompts(8, seed=15, low=5, high=90))
  assert any(rows > 1 for (rows, _), _ in calls) and any(rows == 1 for (rows, _), _ in calls)


def test_cancel_frees_a_request_and_the_others_run_as_alone(tiny, make_prompts):
  """A request cancelled while running (and one cancelled while waiting) leave the queues
  and give their blocks back; the remaining request's tokens are the ones it gets alone.
  A stream the caller stops reading early is cancelled too."""
  from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
  prompts = make_prompts(3, seed=21, low=20, high=30)
  params = GenerationParams(max_new_tokens=24, ignore_eos=True)
  config = EngineConfig(max_slots=2, num_blocks=64, block_size=4, decode_steps=2,
                        prefix_caching=False)
  alone = Engine(tiny.model, tiny.tokenizer, config).generate([Request(prompts[0], params)])[0]
  engine = Engine(tiny.model, tiny.tokenizer, config)
  keep, running, waiting = (engine.add_request(Request(p, params)) for p in prompts)
  for _ in range(6):
    engine.step()
  assert running.samples[0] is not None and running.samples[0].blocks  # it holds blocks
  engine.cancel(running)
  engine.cancel(waiting)  # never admitted (2 slots)
  assert running.samples[0].finish_reason == "cancelled" and not running.samples[0].blocks
  engine.run_until_idle()
  assert engine.result(keep).token_ids == alone.token_ids
  assert engine.allocator.num_used == 0 and not engine.has_work() and not engine._groups
  events = engine.stream(Request(prompts[1], params))
  next(events), next(events)
  assert engine.allocator.num_used > 0
  events.close()
  assert engine.allocator.num_used == 0 and not engine.has_work() and not engine._groups


def test_a_stream_closed_by_the_garbage_collector_inside_a_step_breaks_no_step(tiny, make_prompts,
                                                                             monkeypatch):
  """An abandoned stream in a reference cycle is closed by the cycle collector at whatever
  allocation runs it: inside another request's step, in the thread that steps (the lock
  lets it in). Its cancel removed rows the step was decoding ("list.remove(x): x not in
  list" from that caller's run_until_idle). The cancel now waits for the step's end."""
  import gc
  from o1jax.engine import Engine, EngineConfig, GenerationParams, Request
  prompts = make_prompts(2, seed=23, low=20, high=40)
  params = GenerationParams(max_new_tokens=30, ignore_eos=True)
  # (a pool of its own size: programs of its own, none that later tests count as theirs)
  config = EngineConfig(max_slots=8, num_blocks=96, prefill_chunk=64)
  alone = Engine(tiny.model, tiny.tokenizer, config).generate([Request(prompts[0], params)])[0]
  engine = Engine(tiny.model, tiny.tokenizer, config)
  keep = engine.add_request(Request(prompts[0], params))

  class Holder:  # holder -> itself: only the cycle collector frees it
    pass

  def abandon():
    holder = Holder()
    holder.me = holder
    holder.events = engine.stream(Request(prompts[1], GenerationParams(max_new_tokens=9,
                                                                       ignore_eos=True)))
    next(holder.events)  # its request runs beside `keep`
  abandon()
  real_append, collected = engine._append, []

  def append(*args, **kwargs):  # the collector runs while the step decodes its rows
    if not collected:
      collected.append(gc.collect())
    return real_append(*args, **kwargs)
  gc.disable()
  try:
    monkeypatch.setattr(engine, "_append", append)
    engine.run_until_idle()
  finally:
    gc.enable()
  assert collected and collected[0] > 0
  assert engine.result(keep).token_ids == alone.token_ids
  assert engine.allocator.num_used == 0 and not engine.has_work() and not engine._groups


def test_min_tokens_per_slot_sizes_the_pool_up_to_the_memory_limit(tiny, make_prompts, monkeypatch,
                                                                     caplog):
  """min_tokens_per_slot: the pool holds max_slots sequences of that many tokens (no
  preemption; the same tokens as a roomy pool), but never more than the device's limit
  (logged); a fixed num_blocks is kept."""
  from o1jax.engine import engine as engine_module
  prompts = make_prompts(4, seed=41, low=20, high=21)
  params = GenerationParams(max_new_tokens=20, ignore_eos=True)
  tiny_pool = EngineConfig(max_slots=4, kv_cache_bytes=1, prefill_chunk=64)
  sized = Engine(tiny.model, tiny.tokenizer,
                 dataclasses.replace(tiny_pool, min_tokens_per_slot=40))
  assert sized.num_blocks == 12  # 4 slots x 40 tokens in blocks of 16 (a bucket: 12)
  got = [r.token_ids for r in sized.generate([Request(p, params) for p in prompts])]
  assert sized.metrics.preemptions == 0
  roomy = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=4, num_blocks=64))
  assert got == [r.token_ids for r in roomy.generate([Request(p, params) for p in prompts])]
  odd = Engine(tiny.model, tiny.tokenizer, dataclasses.replace(tiny_pool, min_tokens_per_slot=70))
  assert odd.num_blocks == 24  # 4 x 5 = 20 blocks rounded up to the bucket
  per_block = sized.kv_bytes // sized.num_blocks
  monkeypatch.setattr(engine_module, "pool_memory_limit", lambda device: 5 * per_block)
  with caplog.at_level("WARNING"):
    capped = Engine(tiny.model, tiny.tokenizer,
                    dataclasses.replace(tiny_pool, min_tokens_per_slot=40))
  assert capped.num_blocks == 5 and "need 12 KV blocks" in caplog.text
  fixed = Engine(tiny.model, tiny.tokenizer, dataclasses.replace(
      tiny_pool, num_blocks=9, min_tokens_per_slot=40))
  assert fixed.num_blocks == 9
  with pytest.raises(ValueError, match="min_tokens_per_slot must be an int >= 1 or None"):
    EngineConfig(min_tokens_per_slot=0)


@pytest.mark.parametrize("fields, what", [
    (dict(num_blocks=10**9), r"the KV pool \(1000000000 blocks of 16 tokens, float32\)"),
    (dict(kv_cache_bytes=10**15), r"the KV pool \(\d+ blocks of 16 tokens, float32\)"),
    (dict(block_size=10**9, num_blocks=1), r"the KV pool \(1 blocks of 1000000000 tokens, float32\)"),
])
def test_a_kv_pool_larger_than_the_device_is_refused_before_allocating(tiny, fields, what):
  # Before: XLA's "RESOURCE_EXHAUSTED: Out of memory allocating ... bytes" from the pool's
  # (or, for a huge block_size, the size probe's) jnp.zeros.
  with pytest.raises(ValueError, match=rf"^{what} needs [\d,.]+ GiB but the device has [\d,.]+ GiB: "
                                       r"lower num_blocks, kv_cache_bytes or block_size$"):
    Engine(tiny.model, tiny.tokenizer, EngineConfig(**fields))


def test_requests_that_are_no_list_are_named(engine32):
  # Before: TypeError: 'NoneType' object is not iterable.
  for requests in (None, 5):
    with pytest.raises(ValueError, match=rf"^requests must be a list of requests, got "
                                         rf"{type(requests).__name__}$"):
      engine32.generate(requests)
  assert not engine32.has_work()


def test_engine_arguments_of_the_wrong_type_are_named(tiny):
  from o1jax.engine import SpeculativeConfig
  from o1jax.engine.budget import BudgetConfig, BudgetLoop
  config = EngineConfig(max_slots=2, num_blocks=8)
  # Before: AttributeError ('dict' object has no attribute 'data_parallel' / 'drafter'), or
  # (a str budget) an engine that kept it.
  for kwargs, match in [
      (dict(config={"max_slots": 2}), r"^config must be an EngineConfig, got dict$"),
      (dict(config=None), r"^config must be an EngineConfig, got NoneType$"),
      (dict(config=config, budget="adaptive"), r"^budget must be a BudgetLoop or None, got str$"),
      (dict(config=config, speculative={"drafter": "prompt_lookup"}),
       r"^speculative must be a SpeculativeConfig or None, got dict$"),
  ]:
    with pytest.raises(ValueError, match=match):
      Engine(tiny.model, tiny.tokenizer, **kwargs)
  Engine(tiny.model, tiny.tokenizer, config, budget=BudgetLoop(BudgetConfig()),
         speculative=SpeculativeConfig())
  # Before: AttributeError ('LoadedCheckpoint' object has no attribute 'head_weight';
  # 'NoneType' object has no attribute 'eos_ids') at the first use.
  loaded = types.SimpleNamespace(config=tiny.config, params=tiny.params)
  with pytest.raises(ValueError, match=r"^Engine takes an o1jax\.model\.Llama, got "
                                       r"SimpleNamespace \(build it: Llama\(ck\.config, ck\.params\)\)$"):
    Engine(loaded, tiny.tokenizer, config)
  with pytest.raises(ValueError, match=r"^tokenizer must be the checkpoint's tokenizer "
                                       r"\(ck\.tokenizer\), got NoneType$"):
    Engine(tiny.model, None, config)


def test_threads_sharing_an_engine_take_turns_and_get_their_tokens(tiny, make_prompts):
  # Before: concurrent generate calls failed ("Buffer has been deleted or donated", "block
  # freed twice") and left an engine whose later greedy tokens were wrong, without an error.
  import concurrent.futures
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=8, num_blocks=256))
  prompts = make_prompts(8, seed=11)
  params = [GREEDY, *SAMPLED]
  requests = lambda: [Request(p, params[i % 3], request_id=i) for i, p in enumerate(prompts)]
  alone = [r.samples[0].token_ids for r in engine.generate(requests())]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    futures = [pool.submit(engine.generate, [r]) for r in requests()]
    threaded = [f.result()[0].samples[0].token_ids for f in futures]
  assert threaded == alone
  assert not engine.has_work() and engine.allocator.num_used == 0
  assert [r.samples[0].token_ids for r in engine.generate(requests())] == alone


def test_programs_released_mid_run_give_the_same_tokens(tiny, make_prompts, monkeypatch, caplog):
  """Past the memory-map bound (`compilation_cache.release_programs_near_map_limit`,
  checked before each step) JAX's programs are dropped between steps and compiled
  again: the tokens do not change."""
  import logging

  from o1jax import compilation_cache

  config = EngineConfig(max_slots=4, num_blocks=128, prefill_chunk=16)
  requests = [Request(p, SAMPLED[i % 2]) for i, p in enumerate(make_prompts(6, seed=11))]
  want = Engine(tiny.model, tiny.tokenizer, config).generate(requests)
  monkeypatch.setattr(compilation_cache, "map_limit", lambda: 2)
  with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
    engine = Engine(tiny.model, tiny.tokenizer, config)
    got = engine.generate(requests)
  assert caplog.text.count("released JAX's compiled programs") >= 2
  assert engine.trace_counts["decode"] >= 2  # compiled again after a release
  assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_engines_on_equal_models_share_programs_and_count_their_own_traces(tiny, make_prompts):
  """A second engine on the same model (or an equal one: the same checkpoint loaded
  again) compiles nothing the first compiled, and gives the same tokens; traces are
  counted by the engine whose call compiled; another matmul dtype compiles its own. A
  dropped engine is freed (programs hold no params and no engine)."""
  import gc
  import weakref

  from o1jax.model import Llama

  # (Every bucket compiled: renting a compiled shape depends on measured times.)
  config = EngineConfig(max_slots=4, num_blocks=128, prefill_chunk=32,
                        reuse_compiled_shapes=False)
  requests = [Request(p, SAMPLED[i % 2]) for i, p in enumerate(make_prompts(5, seed=21))]
  first = Engine(tiny.model, tiny.tokenizer, config)
  want = [r.token_ids for r in first.generate(requests)]
  assert first.trace_counts["decode"] >= 1 and first.trace_counts["prefill"] >= 1
  equal_model = Llama(tiny.config, tiny.params)
  second = Engine(equal_model, tiny.tokenizer, config)
  assert [r.token_ids for r in second.generate(requests)] == want
  assert sum(second.trace_counts.values()) == 0
  other = Engine(Llama(tiny.config, tiny.params, matmul_dtype="bfloat16"), tiny.tokenizer, config)
  other.generate(requests[:1])
  assert other.trace_counts["decode"] >= 1
  dropped = weakref.ref(first)
  del first
  gc.collect()
  assert dropped() is None


@pytest.mark.parametrize("matmul_dtype,kv_dtype", [("float32", "float32"), ("int8", "bfloat16"),
                                                   ("bfloat16", "bfloat16")])
def test_embedded_model_log_probs_do_not_depend_on_the_batch(embedded_checkpoint, matmul_dtype,
                                                             kv_dtype):
  """Eight chat prompts each alone and all together: the same tokens and bit-identical
  log-probs. (The tiny model's ops are too small to show it: XLA:CPU's YNNPACK fusions
  put the embedded model's log-probs 1e-6..4e-2 apart until the model's programs were
  compiled with `compilation_cache.compiler_options`.)"""
  from o1jax.model import Llama
  from pallas_kernels import native

  # Without the native kernels (f32: a CPU without a fused multiply-add; int8: without
  # AVX512-VNNI or AVX2) the products run on XLA's dot, whose sums change with the row count.
  kernel = {"float32": native.f32_matmul_available, "int8": native.int8_matmul_available}
  if matmul_dtype in kernel and not kernel[matmul_dtype]():
    pytest.skip(f"no native {matmul_dtype} kernel on this CPU")
  ck = embedded_checkpoint
  model = Llama(ck.config, ck.params, matmul_dtype=matmul_dtype)
  questions = ["Tom has 12 apples and gives 5 to Ann. How many are left?",
               "Write a Python function that reverses a string.",
               "Name three rivers in Europe.", "What is 17 times 23?",
               "Summarise: the bakery opened early and sold out of bread by noon.",
               "List two prime numbers above 50.", "Why is the sky blue?",
               "Translate 'good morning' into French."]
  params = GenerationParams(max_new_tokens=3, ignore_eos=True, logprobs=True)
  requests = [Request([{"role": "user", "content": q}], params, request_id=i)
              for i, q in enumerate(questions)]
  engine = Engine(model, ck.tokenizer, EngineConfig(max_slots=8, num_blocks=128,
                                                    kv_dtype=kv_dtype, prefix_caching=False))
  alone = [engine.generate([r])[0] for r in requests]
  together = engine.generate(requests)
  for a, t in zip(alone, together):
    assert a.token_ids == t.token_ids
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(t.logprobs))


def test_non_finite_logits_end_the_sample_marked_error(tiny, caplog):
  """A finite weight that overflows (3e38 in the final norm) makes the logits NaN: greedy
  took the last token id over and over with NaN log-probs, finish reason "length"."""
  params = dict(tiny.params)
  params["final_norm"] = np.full_like(np.asarray(params["final_norm"]), 3e38)
  engine = Engine(Llama(tiny.config, params), tiny.tokenizer,
                  EngineConfig(max_slots=2, num_blocks=32))
  with caplog.at_level("WARNING", logger="o1jax.engine.engine"):
    out, = engine.generate([Request([5, 6, 7], GenerationParams(max_new_tokens=4, logprobs=True))])
  assert (out.finish_reason, out.token_ids, out.text) == ("error", [], "")
  assert any("logits were not finite" in r.getMessage() for r in caplog.records)
  assert not engine.has_work() and engine.allocator.num_used == 0


@pytest.mark.parametrize("config", [
    # 13 blocks of 5 for a 65-token chunk padded to 96 (a width of 16 holds 80).
    dict(block_size=5, prefill_chunk=128),
    # A chunk bucket above the rows' blocks (8 blocks of 4 hold 32 of 64 tokens).
    dict(block_size=4, prefill_chunk=64, min_chunk_bucket=64),
])
def test_a_prefill_chunk_padded_past_its_rows_blocks_fits_its_table(tiny, engine32, make_prompts,
                                                                    config):
  """Both configs are accepted; every prefill whose padded chunk outgrew the rows' blocks
  failed ("96 tokens do not fit 16 blocks of 5")."""
  lengths = (6, 39, 40, 66, 70, 97, 120)
  prompts = [make_prompts(1, seed=60 + n, low=n, high=n + 1)[0] for n in lengths]
  params = GenerationParams(max_new_tokens=4, ignore_eos=True)
  engine = Engine(tiny.model, tiny.tokenizer, EngineConfig(max_slots=2, num_blocks=128, **config))
  want = [r.token_ids for r in engine32.generate([Request(p, params) for p in prompts])]
  assert [engine.generate([Request(p, params)])[0].token_ids for p in prompts] == want
  assert engine.allocator.num_used == 0


def test_requests_added_without_an_id_get_streams_of_their_own(engine32):
  """add_request numbered a request by the requests in flight: A and B queued (0, 1), A
  collected, then C got 1, B's number, and the two sampled identical tokens. Also: the
  result of a cancelled or already collected request is one line (was list.remove's)."""
  prompt = [40, 41, 42, 43, 44]
  sampled = GenerationParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
  a = engine32.add_request(Request([7, 8, 9], GenerationParams(max_new_tokens=1)))
  b = engine32.add_request(Request(prompt, sampled))
  while a.unfinished:
    engine32.step()
  engine32.result(a)
  c = engine32.add_request(Request(prompt, sampled))
  engine32.run_until_idle()
  assert b.key_id != c.key_id
  rb, rc = engine32.result(b), engine32.result(c)
  assert rb.token_ids != rc.token_ids and rb.top_logprobs is None
  with pytest.raises(ValueError, match=r"^request .* was cancelled or its result was already "
                                       r"collected$"):
    engine32.result(c)
  d = engine32.add_request(Request(prompt, sampled))
  engine32.cancel(d)
  with pytest.raises(ValueError, match=r"was cancelled or its result was already collected"):
    engine32.result(d)


def test_a_byte_fallback_tokenizers_stream_is_its_text(tiny, make_prompts):
  """A SentencePiece vocabulary's byte tokens (<0xF0>; Gemma, Llama-2, Mistral): the
  library read a run with one invalid byte as U+FFFD per byte, so the engine had streamed
  characters the final text no longer held (224 of 300 sampled requests differed)."""
  from o1jax.checkpoint import Tokenizer
  from o1jax.testing import SPECIAL_TOKENS
  tokens = list(SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(256)]  # the tiny model's 259
  spm = Tokenizer.from_gguf_metadata({
      "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": [3] * 3 + [6] * 256,
      "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
      "tokenizer.ggml.add_space_prefix": False})
  engine = Engine(tiny.model, spm, EngineConfig(max_slots=8, num_blocks=256, prefill_chunk=64))
  differed = 0
  for seed, prompt in enumerate(make_prompts(24, seed=31)):
    params = GenerationParams(max_new_tokens=24, temperature=3.0, seed=seed, ignore_eos=True,
                              stop=("\u20ac",) if seed % 2 else ())
    final = engine.generate([Request(prompt, params, request_id=seed)])[0]
    events = list(engine.stream(Request(prompt, params, request_id=seed)))
    streamed = "".join(e.text for e in events)
    assert streamed == final.text, seed
    data = bytes(t - 3 for t in final.token_ids if t >= 3)
    if not seed % 2:  # (no stop: the text is the bytes' own reading)
      assert final.text == data.decode("utf-8", "replace"), seed
    differed += "\ufffd" in final.text
  assert differed  # (the sampled bytes include invalid runs: the case is exercised)


def test_a_sentencepiece_continuation_keeps_the_space_its_first_token_spells(tmp_path):
  """Llama-2 style vocabularies drop a text's first space when decoding (the prefix's
  Strip): decoded alone, the generated tokens lost it, so a completion's first line was
  one space short of its indentation. The engine's and the Generator's text is what the
  tokens add to the prompt's text, as decoding the whole and taking the prompt off reads
  it; the stream is the same text."""
  from o1jax.checkpoint import Tokenizer, load_checkpoint
  from o1jax.model import Generator, Llama, SamplingParams
  from o1jax.testing import tiny_config, write_hf_checkpoint
  from tests.o1jax.checkpoint.test_tokenizer_spm import _tiny_meta

  write_hf_checkpoint(tmp_path, tiny_config(vocab_size=300, max_context=128), seed=5)
  ck = load_checkpoint(tmp_path)
  model = Llama(ck.config, dict(ck.params, embed=np.asarray(ck.params["embed"]) * 0.05))
  meta = _tiny_meta(True)
  spm = Tokenizer.from_gguf_metadata(meta)
  pieces = [i for i, k in enumerate(meta["tokenizer.ggml.token_type"]) if k == 1]
  engine = Engine(model, spm, EngineConfig(max_slots=64, num_blocks=256, prefill_chunk=64))
  rng = np.random.default_rng(7)
  prompts = [[int(i) for i in rng.choice(pieces, size=8)] for _ in range(96)]
  params = GenerationParams(max_new_tokens=4, temperature=3.0, ignore_eos=True)
  results = engine.generate([Request(p, params, request_id=i) for i, p in enumerate(prompts)])
  spaced = []
  for i, (prompt, result) in enumerate(zip(prompts, results)):
    head = spm.decode(prompt, skip_special=True)
    whole = spm.decode(prompt + result.token_ids, skip_special=True)
    assert whole.startswith(head) and result.text == whole[len(head):], i
    if result.text != spm.decode(result.token_ids, skip_special=True):
      spaced.append(i)  # its first token spells a space, which decoding alone dropped
  assert spaced  # (the case is exercised)
  for i in spaced[:3]:
    events = engine.stream(Request(prompts[i], params, request_id=i))
    assert "".join(e.text for e in events) == results[i].text
  generator = Generator(model, spm)
  outs = generator.generate([prompts[i] for i in spaced[:3]], max_new_tokens=4,
                            params=SamplingParams(temperature=3.0), request_ids=spaced[:3])
  for i, out in zip(spaced[:3], outs):
    head = spm.decode(prompts[i], skip_special=True)
    assert out.text == spm.decode(prompts[i] + out.token_ids, skip_special=True)[len(head):]
  # A stop string the first visible token's space begins ends the sample at that token
  # (the stop check read the tokens alone: the sample ran to max_new_tokens, its text
  # cut to "").
  stop = GenerationParams(max_new_tokens=4, temperature=3.0, ignore_eos=True, stop=(" ",))
  ended_at_first = lambda o: (o.finish_reason == "stop" and o.text == ""
                              and spm.decode(o.token_ids[:-1], skip_special=True) == "")
  for i in spaced[:3]:
    assert ended_at_first(engine.generate([Request(prompts[i], stop, request_id=i)])[0])
  outs = generator.generate([prompts[i] for i in spaced[:3]], max_new_tokens=4,
                            params=SamplingParams(temperature=3.0), request_ids=spaced[:3],
                            stop=(" ",))
  assert all(ended_at_first(o) for o in outs)


def test_stop_strings_the_stream_cannot_hold_are_refused():
  """A dict gave its keys; a lone surrogate never matched decoded text; a 200,000-character
  stop string took 0.4 s a token in the stream's hold-back scan (under the engine lock)."""
  from o1jax.engine.engine import MAX_STOP_CHARS
  with pytest.raises(ValueError, match=r"^stop must be a str or a list of str, got \{'ab': 1\}$"):
    GenerationParams(stop={"ab": 1})
  with pytest.raises(ValueError, match=r"must be at most 4096 characters of valid Unicode"):
    GenerationParams(stop=["x\ud800"])
  with pytest.raises(ValueError, match=r"^stop string 'aaaa.*\.\.\. \(4097 characters\) must be"):
    GenerationParams(stop=["a" * (MAX_STOP_CHARS + 1)])
  assert GenerationParams(stop=["a" * MAX_STOP_CHARS]).stop == ("a" * MAX_STOP_CHARS,)


def test_the_streams_hold_back_is_the_longest_stop_prefix_at_the_end():
  import random

  from o1jax.engine.engine import _stop_prefix_at_end
  by_hand = lambda t, s: max((k for k in range(1, len(s)) if t.endswith(s[:k])), default=0)
  rng = random.Random(0)
  for _ in range(20000):
    t = "".join(rng.choice("ab€") for _ in range(rng.randint(0, 8)))
    s = "".join(rng.choice("ab€") for _ in range(rng.randint(1, 8)))
    assert _stop_prefix_at_end(t, s) == by_hand(t, s), (t, s)
