"""Simple batched generation over a contiguous KV cache.

This is the foundation path (one static batch, prefill then decode); the
engine package adds paging, continuous batching and metrics on top of the
same model call. Shapes are bucketed (prompt length, cache length, batch) so
repeated calls reuse compiled programs.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import logging
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from o1jax import compilation_cache
from o1jax.checkpoint.tokenizer import Tokenizer, continuation_text
from o1jax.model.llama import KVCache, Llama, check_llama
from o1jax.model.sampling import (SamplingParams, check_int, check_key_id, is_int, sample,
                                  sequence_key, token_logprobs)
from o1jax.model import thinking as thinking_lib
from o1jax.model.shapes import pow2_bucket
from o1jax.model.thinking import SpanReader, ThinkingSpan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerationOutput:
  token_ids: list[int]
  text: str
  # "stop" (eos / stop string), "length", or "error": the model's logits were not finite
  # (NaN or inf: weights or activations that overflow) where the next token was drawn
  finish_reason: str
  prompt_tokens: int
  seconds: float
  # With a thinking span (Generator(thinking=...)): `text` is the answer after it; this is
  # the thinking, markers removed ("" when the sample did not think), and its token count.
  thinking: str | None = None
  thinking_tokens: int = 0


def encode_prompt(tokenizer, prompt, vocab_size: int, chat_kwargs=None) -> list[int]:
  """Text, chat messages [{"role", "content"}] (the chat template applied, with the
  variables `chat_kwargs`: `thinking.template_kwargs`) or token ids -> token ids, checked:
  ints, not empty, inside the vocabulary (the embedding lookup would clamp others to other
  tokens, silently). The one reading of a prompt for the Generator, the engine, the
  controller and the pipelines."""
  if isinstance(prompt, str):
    ids = tokenizer.encode(prompt)
  elif not isinstance(prompt, (list, tuple, np.ndarray)):  # bytes would read as token ids
    raise ValueError(f"prompt must be text, chat messages or token ids, got "
                     f"{type(prompt).__name__}")
  elif len(prompt) and isinstance(prompt[0], collections.abc.Mapping):
    ids = tokenizer.encode_chat(list(prompt), **(chat_kwargs or {}))
  else:
    bad = [i for i in prompt if not is_int(i)]
    if bad:  # int() would cut 1.5 to 1 and read True as 1
      raise ValueError(f"prompt token ids must be ints, got {bad[0]!r}")
    ids = [int(i) for i in prompt]
  if not ids:
    raise ValueError("prompt is empty: nothing to condition generation on")
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
  return ids


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _is_default(value, field: dataclasses.Field) -> bool:
  default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
             else field.default)
  try:
    return value is default or bool(value == default)
  except (TypeError, ValueError):  # e.g. an array: not comparable as one bool
    return False


@functools.lru_cache(maxsize=None)
def _jitted_steps(graphdef):
  """(prefill, decode) of a model graph, jitted with the graph bound: shared by every
  Generator on an equal model, and holding no weights (params are the calls' argument,
  STYLE.md #4), so a dropped Generator frees its model. (Static `self` made each
  Generator compile again and kept it, weights and all, in the jit caches for good.)"""

  def prefill(state, tokens, starts, cache, last_index):
    return nnx.merge(graphdef, state)(tokens, starts, cache, logits_at=last_index)

  def decode(state, tokens, positions, cache, base_keys, step, temperature, top_k, top_p,
             min_p):
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens[:, None], positions, cache, logits_at=jnp.zeros_like(positions))
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(base_keys, step)
    return _sample_checked(logits, keys, temperature, top_k, top_p, min_p), cache

  return (compilation_cache.jit(prefill, donate_argnums=(3,)),
          compilation_cache.jit(decode, donate_argnums=(3,)))


def _sample_checked(logits, keys, temperature, top_k, top_p, min_p):
  """(tokens [B], finite [B]): the drawn tokens, and whether each one's log-prob is finite
  (the engine's rule: NaN/inf logits draw an arbitrary token, e.g. greedy the last id)."""
  ids = sample(logits, keys, temperature, top_k, top_p, min_p)
  return ids, jnp.isfinite(token_logprobs(logits, ids, 0)[0])


_sample_first = compilation_cache.jit(_sample_checked)


class Generator:
  """Greedy / sampled generation for a batch of prompts with one model."""

  def __init__(self, model: Llama, tokenizer: Tokenizer,
               thinking: str | ThinkingSpan | None = "auto"):
    """thinking: a reasoning model's thinking span, as `o1jax.engine.Engine` reads it
    (o1jax/model/thinking.py): texts are the answers after it, stop strings apply there."""
    check_llama(model, "Generator")
    self.model = model
    self.tokenizer = tokenizer
    self.thinking = thinking_lib.resolve(thinking, tokenizer)
    self._chat_kwargs = thinking_lib.template_kwargs(thinking, tokenizer)
    self.config = model.config
    graphdef, self._state = nnx.split(model)
    self._prefill, self._decode = _jitted_steps(graphdef)
    self._eos = np.array(sorted(set(tokenizer.eos_ids) | set(model.config.eos_ids)) or [-1])
    self._warned_nonfinite = False

  # -- helpers --------------------------------------------------------------------

  def encode_prompt(self, prompt: str | Sequence[int] | Sequence[dict]) -> list[int]:
    return encode_prompt(self.tokenizer, prompt, self.config.vocab_size, self._chat_kwargs)

  def _visible(self, ids: Sequence[int], before: int | None = None) -> str:
    """Text of `ids` without special tokens (stop strings are looked for in it); with
    `before`, as the continuation of that token (`Tokenizer.continuation`)."""
    return continuation_text(self.tokenizer, ids, before, skip_special=True)

  def _check_call(self, ids, max_new_tokens, params, request_ids, stop) -> None:
    """Everything a call reads, before the prefill (one entry of params / request_ids per
    prompt: a short list would be broadcast over the batch)."""
    limit = self.config.max_context
    n_prompt = max(map(len, ids))
    if n_prompt >= limit:
      raise ValueError(f"prompt has {n_prompt} tokens but the model's context is {limit} tokens")
    check_int(max_new_tokens, "max_new_tokens", 1)
    for name, values in (("params", params), ("request_ids", request_ids)):
      if not isinstance(values, list) or len(values) != len(ids):
        raise ValueError(f"{name} must have one entry per prompt ({len(ids)}), got {values!r}")
    bad = [p for p in params if not isinstance(p, SamplingParams)]
    if bad:
      raise ValueError(f"params must be SamplingParams, got {bad[0]!r}")
    for p in params:  # a subclass's own settings (e.g. the engine's n, stop) would be ignored
      ignored = [f.name for f in dataclasses.fields(p)
                 if f.name not in _SAMPLING_FIELDS and not _is_default(getattr(p, f.name), f)]
      if ignored:
        raise ValueError(f"params: the Generator reads SamplingParams' fields only; "
                         f"{type(p).__name__}'s {', '.join(ignored)} would be ignored (pass "
                         f"max_new_tokens and stop to generate(), or use the Engine)")
    for r in request_ids:
      check_key_id(r, "request_ids entry")
    if (isinstance(stop, str) or not isinstance(stop, collections.abc.Iterable)
        or not all(isinstance(s, str) and s for s in stop)):
      # (a bare str would stop at any of its characters, "" at once)
      raise ValueError(f"stop must be a list of non-empty str, got {stop!r}")

  @staticmethod
  def _base_keys(params: Sequence[SamplingParams], request_ids: Sequence[int]) -> jax.Array:
    """[B, 2] per-sequence keys, computed once per call; the step is folded in under jit."""
    return jnp.stack([sequence_key(p.seed, r, 0) for p, r in zip(params, request_ids)])

  # -- public API -----------------------------------------------------------------

  def stream(self, prompt, max_new_tokens: int = 256, params: SamplingParams = SamplingParams(),
             request_id: int = 0, stop: Sequence[str] = ()) -> Iterator[int]:
    """Yields generated token ids one at a time (batch of one)."""
    check_key_id(request_id, "request_id")  # (else named as generate's request_ids entry)
    yield from self._run([self.encode_prompt(prompt)], max_new_tokens, [params], [request_id],
                         stop, stream=True)

  def generate(self, prompts: Sequence, max_new_tokens: int = 256,
               params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               request_ids: Sequence[int] | None = None, stop: Sequence[str] = ()) -> list[GenerationOutput]:
    """Generates for every prompt (text, ids or chat messages) in one static batch."""
    t0 = time.perf_counter()
    if isinstance(prompts, (str, bytes)):  # else one prompt per character
      raise ValueError(f"prompts must be a list of prompts, got one {type(prompts).__name__}")
    if (not isinstance(prompts, collections.abc.Iterable)
        or isinstance(prompts, collections.abc.Mapping)):
      raise ValueError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    ids = [self.encode_prompt(p) for p in prompts]
    if not ids:
      return []
    if isinstance(params, collections.abc.Mapping):  # (listed, it would be its keys)
      raise ValueError(f"params must be SamplingParams, got {params!r}")
    if isinstance(params, SamplingParams):
      params = [params] * len(ids)
    iterable = lambda x: list(x) if isinstance(x, collections.abc.Iterable) else x
    params = iterable(params)
    request_ids = list(range(len(ids))) if request_ids is None else iterable(request_ids)
    tokens, reasons, spans = next(self._run(ids, max_new_tokens, params, request_ids, stop,
                                            stream=False))
    elapsed = time.perf_counter() - t0
    outputs = []
    for t, r, p, span in zip(tokens, reasons, ids, spans):
      if span is not None:
        span.finish(t)
      text = thinking_lib.answer_text(span, t, self._visible, before=p[-1])
      outputs.append(GenerationOutput(
          token_ids=t, text=thinking_lib.cut_at_stop(text, stop, final=True),
          finish_reason=r, prompt_tokens=len(p), seconds=elapsed,
          thinking=None if span is None else span.thinking_text(t),
          thinking_tokens=0 if span is None else span.thinking_tokens(t)))
    return outputs

  def _run(self, ids, max_new_tokens, params, request_ids, stop, stream):
    n = len(ids)
    longest = max(len(p) for p in ids)
    self._check_call(ids, max_new_tokens, params, request_ids, stop)
    # Each prompt's own room in the context (one limit for the batch cut every output to
    # the room its longest prompt left).
    room = [min(max_new_tokens, self.config.max_context - len(p)) for p in ids]
    max_new_tokens = max(room)
    b = pow2_bucket(n)
    t = pow2_bucket(longest, 16)
    cache_len = pow2_bucket(t + max_new_tokens, 256)
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(ids):
      tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in ids] + [1] * (b - n), np.int32)
    params = list(params) + [SamplingParams()] * (b - n)
    request_ids = list(request_ids) + [0] * (b - n)
    arr = lambda f, dt: jnp.asarray(np.array([f(p) for p in params], dt))
    sampling = (arr(lambda p: p.temperature, np.float32), arr(lambda p: p.top_k, np.int32),
                arr(lambda p: p.top_p, np.float32), arr(lambda p: p.min_p, np.float32))

    cache = KVCache.zeros(self.config, b, cache_len)
    logits, cache = self._prefill(self._state, jnp.asarray(tokens), jnp.zeros((b,), jnp.int32),
                                  cache, jnp.asarray(lengths - 1))
    base_keys = self._base_keys(params, request_ids)
    first_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(base_keys, 0)
    next_ids, finite = _sample_first(logits, first_keys, *sampling)
    out = [[] for _ in range(n)]
    spans = [None if self.thinking is None else
             SpanReader(self.thinking, self.tokenizer.decode, p) for p in ids]
    reasons = ["length"] * n
    done = np.zeros(n, bool)
    positions = lengths.copy()
    # Stop strings are looked for in the text the output shows (`generate`'s `text`).
    for step in range(max_new_tokens):
      host_ids, host_finite = np.asarray(next_ids), np.asarray(finite)
      for i in range(n):
        if done[i]:
          continue
        tok = int(host_ids[i])
        if not host_finite[i]:
          done[i], reasons[i] = True, "error"
          if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("generator: the model's logits were not finite (NaN or inf) for "
                        "request %r after %d tokens: its weights or activations overflow; "
                        "such samples end with finish_reason 'error'", request_ids[i],
                        len(out[i]))
          continue
        if tok in self._eos:
          done[i], reasons[i] = True, "stop"
          continue
        out[i].append(tok)
        if stream:
          yield tok
        if spans[i] is not None:
          spans[i].update(out[i])
        if stop and thinking_lib.hits_stop(spans[i], out[i], stop, self._visible,
                                           self.tokenizer.decode, before=ids[i][-1]):
          done[i], reasons[i] = True, "stop"
        elif len(out[i]) >= room[i]:
          done[i] = True  # (reason "length")
      if done.all() or step == max_new_tokens - 1:
        break
      (next_ids, finite), cache = self._decode(self._state, next_ids, jnp.asarray(positions), cache,
                                     base_keys, jnp.int32(step + 1), *sampling)
      positions += 1
    if not stream:
      yield out, reasons, spans
