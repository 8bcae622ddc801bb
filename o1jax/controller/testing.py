"""A hand-computable decode model and tokenizer for controller tests.

MockDecodeModel: "bigram + counters". The logits for the token after a
prefix x_0..x_p are

    logits = table[x_p] + sum_k count(x_j == trigger_k, j <= p) * boost_k

so greedy continuations are chains through `table`, and counters let later
text depend on what came before (e.g. each delimiter seen raises the logit of
the answer digit; each "bad" token raises the logit of " No" after the
verification probe). Its cache is the token buffer itself ([B, S] int32);
positions past the query are masked, exactly like a causal KV cache, so
truncation is free and copying a row copies its tokens.

Worked example (tests/o1jax/controller use this vocabulary): table[A] puts
logit 3 on B and 0 elsewhere in a 16-token vocabulary, so
P(B | A) = e^3 / (e^3 + 15) = 20.09 / 35.09 = 0.5725 and log P = -0.5578.

MockTokenizer: a fixed list of token strings; encode is greedy longest
match, decode concatenates.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from o1jax.controller.decode_model import (CachePlan, copy_batch_major_rows,
                                           prefill_batch_major_rows)


@flax.struct.dataclass
class MockCache:
  tokens: jax.Array  # [B, S] int32 token written at each position

  def check_fits(self, tokens_shape) -> None:
    b, t = tokens_shape
    if b != self.tokens.shape[0] or t > self.tokens.shape[1]:
      raise ValueError(f"tokens {tuple(tokens_shape)} do not fit a mock cache {self.tokens.shape}")


class MockDecodeModel:
  """params = {"table": [V, V] f32, "triggers": [K] i32, "boosts": [K, V] f32}."""

  def __init__(self, table, triggers=(), boosts=()):
    table = np.asarray(table, np.float32)
    self.vocab_size = table.shape[0]
    boosts = np.asarray(boosts, np.float32).reshape(-1, self.vocab_size)
    self.params = {"table": jnp.asarray(table),
                   "triggers": jnp.asarray(np.asarray(triggers, np.int32).reshape(-1)),
                   "boosts": jnp.asarray(boosts)}

  def init_cache(self, batch: int, length: int, plan: CachePlan | None = None) -> MockCache:
    del plan
    return MockCache(tokens=jnp.zeros((batch, length), jnp.int32))

  def forward(self, params, cache: MockCache, tokens, starts, logits_at):
    """1. write tokens [B, T] at starts[b]..; 2. query position q = starts + logits_at;
    3. logits = table[buf[q]] + counts(triggers in buf[:q+1]) @ boosts."""
    cache.check_fits(tokens.shape)
    buf = jax.vmap(lambda row, t, s: jax.lax.dynamic_update_slice(row, t, (s,)))(
        cache.tokens, tokens.astype(jnp.int32), starts.astype(jnp.int32))
    return self._logits(params, buf, (starts + logits_at).astype(jnp.int32)), MockCache(tokens=buf)

  def forward_all(self, params, cache: MockCache, tokens, starts, counts):
    """forward's logits at every position of the T tokens: [B, T, V]."""
    del counts
    _, cache = self.forward(params, cache, tokens, starts, jnp.zeros_like(starts))
    at = starts.astype(jnp.int32)[:, None] + jnp.arange(tokens.shape[1])[None, :]
    per_position = jax.vmap(lambda q: self._logits(params, cache.tokens, q), in_axes=1, out_axes=1)
    return per_position(at), cache

  @staticmethod
  def _logits(params, buf, q):
    last = jnp.take_along_axis(buf, q[:, None], axis=1)[:, 0]
    visible = jnp.arange(buf.shape[1])[None, :] <= q[:, None]  # [B, S]
    hits = (buf[:, :, None] == params["triggers"][None, None, :]) & visible[:, :, None]
    counts = jnp.sum(hits, axis=1).astype(jnp.float32)  # [B, K]
    return (params["table"][last] + counts @ params["boosts"]).astype(jnp.float32)

  def prefill_rows(self, params, cache, rows, tokens, last, starts):
    return prefill_batch_major_rows(self.forward, params, cache, rows, tokens, last, starts)

  def copy_rows(self, cache, dst, src):
    return copy_batch_major_rows(cache, dst, src)

  def truncate(self, cache, lengths):
    del lengths
    return cache

  def check(self, cache):
    del cache


class MockTokenizer:
  """Fixed vocabulary of strings; id 2 is the end of sequence by default; `add_bos`: encode
  puts `bos_id` first unless told not to (as a Gemma 3 or Llama 3 tokenizer does)."""

  def __init__(self, vocab: Sequence[str], eos_ids=(2,), bos_id: int | None = None,
               add_bos: bool = False):
    self.vocab = list(vocab)
    self.eos_ids = tuple(eos_ids)
    self.bos_id = bos_id
    self.add_bos = add_bos
    self._by_len = sorted(((s, i) for i, s in enumerate(self.vocab) if s), key=lambda x: -len(x[0]))

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    ids, i = [], 0
    while i < len(text):
      for s, tid in self._by_len:
        if text.startswith(s, i):
          ids.append(tid)
          i += len(s)
          break
      else:
        raise ValueError(f"mock tokenizer cannot encode {text[i:]!r}")
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids, *, skip_special: bool = False) -> str:
    return "".join("" if (skip_special and i in self.eos_ids) else self.vocab[i] for i in ids)

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
    return "".join(m["content"] for m in messages)

  def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
    return self.encode(self.apply_chat_template(messages))
