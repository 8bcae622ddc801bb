"""Prefill/decode consistency, batching with padding, sampling determinism, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from o1jax import testing
from o1jax.checkpoint import load_checkpoint
from o1jax.model import Generator, KVCache, Llama, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
  testing.write_gguf_checkpoint(path, testing.tiny_config(max_context=64), seed=4)
  ck = load_checkpoint(path)
  return ck, Generator(Llama(ck.config, ck.params), ck.tokenizer)


def test_incremental_decode_equals_full_forward(tiny):
  ck, _ = tiny
  model = Llama(ck.config, ck.params)
  tokens = jnp.array([[9, 30, 41, 77, 120, 3, 201, 58, 99]])
  full, _ = model(tokens, jnp.zeros((1,), jnp.int32), KVCache.zeros(ck.config, 1, 16))
  # Prefill 4 tokens, then feed the rest one at a time.
  cache = KVCache.zeros(ck.config, 1, 16)
  first, cache = model(tokens[:, :4], jnp.zeros((1,), jnp.int32), cache)
  steps = [first[0]]
  for i in range(4, tokens.shape[1]):
    out, cache = model(tokens[:, i:i + 1], jnp.array([i]), cache)
    steps.append(out[0])
  np.testing.assert_allclose(np.concatenate([np.asarray(s) for s in steps]), np.asarray(full[0]),
                             atol=1e-4, rtol=0)  # logits ~40: f32 summation order


def test_batch_with_padding_equals_single(tiny):
  _, gen = tiny
  prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100]]
  batched = gen.generate(prompts, max_new_tokens=8)
  for p, b in zip(prompts, batched):
    single = gen.generate([p], max_new_tokens=8)[0]
    assert single.token_ids == b.token_ids
    assert b.prompt_tokens == len(p)


def test_each_prompt_keeps_its_own_room_in_the_context(tiny):
  """A prompt near the context (64) beside a short one: each gets the tokens it gets alone
  (the batch used to cut every output to the room its longest prompt left)."""
  _, gen = tiny
  prompts = [[5, 6, 7], list(range(10, 68))]  # 3 and 58 tokens: 61 and 6 left
  batched = gen.generate(prompts, max_new_tokens=20)
  alone = [gen.generate([p], max_new_tokens=20)[0] for p in prompts]
  for a, b in zip(alone, batched):
    assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
  assert len(alone[0].token_ids) > 6  # past the long prompt's room
  assert len(alone[1].token_ids) <= 6
  assert list(gen.stream(prompts[0], max_new_tokens=20)) == alone[0].token_ids


def test_sampling_is_seeded_and_independent_of_batch(tiny):
  _, gen = tiny
  # The random tiny model's logits are peaked (~40): a high temperature makes sampling matter.
  params = SamplingParams(temperature=8.0, top_p=0.95, seed=7)
  alone = gen.generate([[5, 6, 7]], max_new_tokens=10, params=params, request_ids=[3])[0].token_ids
  again = gen.generate([[5, 6, 7]], max_new_tokens=10, params=params, request_ids=[3])[0].token_ids
  in_batch = gen.generate([[9, 9], [5, 6, 7]], max_new_tokens=10, params=params, request_ids=[0, 3])[1].token_ids
  other_seed = gen.generate([[5, 6, 7]], max_new_tokens=10, params=SamplingParams(temperature=8.0, top_p=0.95, seed=8),
                            request_ids=[3])[0].token_ids
  assert alone == again == in_batch
  assert alone != other_seed  # 10 tokens over a 259-token vocabulary: a collision is ~impossible


def test_stream_yields_the_generated_tokens(tiny):
  _, gen = tiny
  streamed = list(gen.stream([5, 6, 7], max_new_tokens=6))
  assert streamed == gen.generate([[5, 6, 7]], max_new_tokens=6)[0].token_ids


def test_stop_string_cuts_text(tiny):
  ck, gen = tiny
  out = gen.generate([[5, 6, 7]], max_new_tokens=12)[0]
  assert len(out.text) > 2
  stop = out.text[2:4]
  cut = gen.generate([[5, 6, 7]], max_new_tokens=12, stop=[stop])[0]
  assert cut.text == out.text[:out.text.find(stop)]
  assert cut.finish_reason == "stop"


def _reference_cut(tok, free, stop, max_new):
  """(token_ids, text, finish_reason) of the free run `free` (no stop strings) cut at the
  first token that completes a stop string in the decoded text (special tokens skipped; a
  character still unfinished at its end, U+FFFD, completes none)."""
  visible = lambda ids: tok.decode(ids, skip_special=True)
  out = []
  for t in free.token_ids[:max_new]:
    out.append(t)
    text = visible(out)
    seen = text.rstrip("\ufffd")  # a character still unfinished at the end is no text yet
    hits = [seen.find(s) for s in stop if s in seen]
    if hits:
      return out, text[:min(hits)], "stop"
  done = len(out) == len(free.token_ids)  # (an eos after them ended the free run)
  text = visible(out)  # finished: what it ended on is text (a U+FFFD too)
  text = text[:min([text.find(s) for s in stop if s in text], default=len(text))]
  return out, text, free.finish_reason if done else "length"


def _partial_char_pair(text_of, ids):
  """The last two characters of the first prefix ending with a completed multi-byte one."""
  for k in range(2, 60):
    text = text_of(k)
    if len(text) >= 2 and ord(text[-1]) > 127 and text[-1] != "\ufffd":
      return [text[-2:]]
  raise AssertionError("no multi-byte character")


# name -> stop strings from the free run (text_of(k): the visible text of its first k tokens;
# ids: its tokens)
GENERATOR_STOPS = {
    "one_char": lambda text_of, ids: [text_of(12)[-1]],
    "longer_than_32_tokens": lambda text_of, ids: [text_of(45)[1:]],  # was: never matched
    # the special token is not in the text (was: the check decoded it, the text skips it)
    "across_special_token": lambda text_of, ids: [text_of(ids.index(1) + 2)[-3:]],
    "through_partial_char": _partial_char_pair,
    "prefix_of_another": lambda text_of, ids: [text_of(20)[-4:], text_of(20)[-4:-2]],
    "later_listed_first": lambda text_of, ids: [text_of(30)[-2:], text_of(9)[-2:]],
    "only_in_prompt": lambda text_of, ids: ["\x05\x06\x07"],  # the prompt's bytes
}


@pytest.mark.parametrize("kind", list(GENERATOR_STOPS))
def test_stop_strings_cut_like_the_reference(tiny, kind):
  ck, gen = tiny
  tok = ck.tokenizer
  # Varied bytes: partial characters, a special token (id 1), no eos in 60 tokens.
  flat = SamplingParams(temperature=1e4, seed=3)
  prompt = [5, 6, 7]
  free = gen.generate([prompt], 60, flat, request_ids=[3])[0]
  assert len(free.token_ids) == 60 and 1 in free.token_ids
  stop = GENERATOR_STOPS[kind](lambda k: tok.decode(free.token_ids[:k], skip_special=True),
                               free.token_ids)
  want = _reference_cut(tok, free, stop, 60)
  got = gen.generate([prompt], 60, flat, request_ids=[3], stop=stop)[0]
  assert (got.token_ids, got.text, got.finish_reason) == want
  # max_new_tokens ending at the token that completes the match: "stop" too
  k = len(want[0])
  got = gen.generate([prompt], k, flat, request_ids=[3], stop=stop)[0]
  assert (got.token_ids, got.text, got.finish_reason) == _reference_cut(tok, free, stop, k)
  assert list(gen.stream(prompt, k, flat, 3, stop)) == got.token_ids


def test_bad_prompts_get_clear_errors(tiny):
  _, gen = tiny
  with pytest.raises(ValueError, match="prompt is empty"):
    gen.generate([""])
  with pytest.raises(ValueError, match="prompt has 64 tokens but the model's context is 64 tokens"):
    gen.generate([[5] * 64])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    gen.generate([[5, 100000]])
  with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
    gen.generate([[5]], max_new_tokens=0)
  with pytest.raises(ValueError, match="chat message 0 must be a dict with 'role' and 'content'"):
    gen.generate([[{"content": "hi"}]])
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    SamplingParams(temperature=-1)


def test_bad_call_arguments_are_refused_before_the_prefill(tiny):
  _, gen = tiny
  p = [5, 6, 7]
  for kw, match in [
      (dict(max_new_tokens=2.5), r"^max_new_tokens must be an int >= 1, got 2.5$"),  # was: crash
      (dict(max_new_tokens=float("inf")), r"^max_new_tokens must be an int >= 1, got inf$"),
      (dict(stop="ab"), r"^stop must be a list of non-empty str, got 'ab'$"),  # was: 'a' or 'b'
      (dict(stop=[""]), r"^stop must be a list of non-empty str, got \[''\]$"),  # was: at once
      (dict(params=[SamplingParams()] * 2), r"^params must have one entry per prompt \(1\)"),
      (dict(params=None), r"^params must have one entry per prompt \(1\), got None$"),
      (dict(request_ids=[0, 1]), r"^request_ids must have one entry per prompt \(1\)"),
      (dict(request_ids=[-1]), r"^request_ids entry must be an int in \[0, 2\*\*64\), got -1$"),
  ]:
    with pytest.raises(ValueError, match=match):
      gen.generate([p], **{"max_new_tokens": 2, **kw})
  with pytest.raises(ValueError, match=r"^request_id must be an int in \[0, 2\*\*64\), got -1$"):
    next(gen.stream(p, 2, request_id=-1))  # (was named as generate's request_ids entry)
  with pytest.raises(ValueError, match=r"^prompt token ids must be ints, got 1.5$"):
    gen.generate([[5, 1.5]], 2)  # was: read as 1
  with pytest.raises(ValueError, match=r"^prompts must be a list of prompts, got one str$"):
    gen.generate("hi", 2)  # was: one prompt per character
  assert gen.generate([], 2) == []


def test_prompts_params_and_chat_messages_of_the_wrong_type_are_named(tiny):
  _, gen = tiny
  # Before: TypeError: 'NoneType' object is not iterable.
  with pytest.raises(ValueError, match=r"^prompts must be a list of prompts, got NoneType$"):
    gen.generate(None, 2)
  # Before: "params must be SamplingParams, got 'temperature'" (the dict read as its keys).
  with pytest.raises(ValueError, match=r"^params must be SamplingParams, got \{'temperature': 1.0\}$"):
    gen.generate([[5]], 2, params={"temperature": 1.0})
  # Before: TypeError from inside the jinja template ("can only concatenate str (not "int") to str").
  with pytest.raises(ValueError, match=r"^chat message 0's content must be a str, got 5$"):
    gen.generate([[{"role": "user", "content": 5}]], 2)
  with pytest.raises(ValueError, match=r"^chat message 1's role must be a str, got None$"):
    gen.generate([[{"role": "user", "content": "a"}, {"role": None, "content": "b"}]], 2)
  assert len(gen.generate([[{"role": "user", "content": "hi"}]], 2)[0].token_ids) <= 2


def test_params_whose_own_settings_the_generator_would_ignore_are_refused(tiny):
  # The engine's GenerationParams is a SamplingParams: its max_new_tokens / stop / n were
  # silently ignored here (the call's own max_new_tokens ran).
  from o1jax.engine import GenerationParams

  _, tiny_gen = tiny
  with pytest.raises(ValueError, match=r"^params: the Generator reads SamplingParams' fields "
                                       r"only; GenerationParams's max_new_tokens, n would be"):
    tiny_gen.generate([[5, 6, 7]], max_new_tokens=3,
                      params=GenerationParams(max_new_tokens=5, n=2))
  # Left at their defaults, nothing is lost: it runs as the SamplingParams it carries.
  out = tiny_gen.generate([[5, 6, 7]], max_new_tokens=3,
                          params=GenerationParams(temperature=0.0, seed=3))
  assert len(out[0].token_ids) <= 3


def test_generators_on_equal_models_share_programs_and_a_dropped_one_is_freed(tiny):
  """The jitted steps hold the model's graph, not the Generator or its weights: a second
  Generator on an equal model compiles nothing and gives the same tokens, and a dropped
  Generator is freed with its params (static `self` kept both for the process' life)."""
  import gc
  import weakref

  from o1jax.model import generation

  ck, _ = tiny
  params = [SamplingParams(temperature=0.8, seed=3), SamplingParams()]
  first = Generator(Llama(ck.config, ck.params), ck.tokenizer)
  want = [o.token_ids for o in first.generate(["ab", "xyz"], max_new_tokens=6, params=params)]
  prefill, decode = generation._jitted_steps(nnx.graphdef(first.model))
  sizes = (prefill._cache_size(), decode._cache_size())
  second = Generator(Llama(ck.config, ck.params), ck.tokenizer)
  got = [o.token_ids for o in second.generate(["ab", "xyz"], max_new_tokens=6, params=params)]
  assert got == want and (prefill._cache_size(), decode._cache_size()) == sizes
  dropped, weights = weakref.ref(first), weakref.ref(first.model)
  del first
  gc.collect()
  assert dropped() is None and weights() is None




class _NaNLogitsOnRow0(Llama):
  """Row 0's logits are NaN once it feeds position 5 (as weights or activations that
  overflow make them; RMSNorm keeps a single huge weight from doing it on a tiny model)."""

  def __call__(self, tokens, starts, cache, logits_at=None):
    logits, cache = super().__call__(tokens, starts, cache, logits_at)
    bad = (jnp.arange(logits.shape[0]) == 0) & (starts >= 5)
    return jnp.where(bad[:, None], jnp.nan, logits), cache


def test_non_finite_logits_end_the_sample_marked_error(tiny, caplog):
  """NaN logits drew an arbitrary token (greedy: the last id over and over) and the sample
  went on: it ends where they appear with finish reason "error", warned once, and the
  other rows of the batch go on unchanged."""
  ck, gen = tiny
  prompts = [[5, 6, 7], [40, 41, 42, 43]]
  clean = gen.generate(prompts, max_new_tokens=6)
  assert len(clean[0].token_ids) >= 3  # (the tiny model does not stop before)
  broken_gen = Generator(_NaNLogitsOnRow0(ck.config, ck.params), ck.tokenizer)
  with caplog.at_level("WARNING", logger="o1jax.model.generation"):
    broken, other = broken_gen.generate(prompts, max_new_tokens=6)
  # Row 0 fed positions 3 and 4 (its first two tokens) and drew a third before position 5.
  assert (broken.finish_reason, broken.token_ids) == ("error", clean[0].token_ids[:3])
  assert (other.finish_reason, other.token_ids) == (clean[1].finish_reason, clean[1].token_ids)
  assert any("logits were not finite" in r.getMessage() for r in caplog.records)
