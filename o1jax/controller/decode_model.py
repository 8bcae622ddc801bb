"""The narrow decode interface the controller runs on.

A `DecodeModel` is what the reasoning loop needs from a model, and nothing more:

  params                                   pytree passed into jit (never closed over)
  vocab_size                               int
  init_cache(batch, length) -> cache       empty cache pytree for `batch` rows
  forward(params, cache, tokens [B, T], starts [B], logits_at [B])
      -> (logits [B, V] f32 at token logits_at[b], cache)
                                           writes the T tokens at positions starts[b]..;
                                           attends causally (key s visible iff s <= query)
  fork(cache, parents [B']) -> cache       row i of the result is a copy of row parents[i]
  truncate(cache, lengths [B]) -> cache    forget positions >= lengths[b]

`forward` serves prefill (T = prompt bucket), decode (T = 1) and scratch
probes (T = 1 + probe). With a causal cache whose key s is visible only to
queries at positions >= s, truncation is free (stale entries are rewritten
before they are visible), which is what `ContiguousLlama.truncate` relies on;
a paged cache would release blocks there instead (see docs/controller.md).

Implementations: `ContiguousLlama` (o1jax Llama + contiguous KVCache) and
`o1jax.controller.testing.MockDecodeModel` (hand-computable logits).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from o1jax.model.llama import KVCache, Llama


@runtime_checkable
class DecodeModel(Protocol):
  params: Any
  vocab_size: int

  def init_cache(self, batch: int, length: int) -> Any:
    ...

  def forward(self, params, cache, tokens: jax.Array, starts: jax.Array, logits_at: jax.Array):
    ...

  def fork(self, cache, parents: jax.Array) -> Any:
    ...

  def truncate(self, cache, lengths: jax.Array) -> Any:
    ...


def fork_rows(cache, parents: jax.Array):
  """Gathers rows of every batch-major leaf (all leaves of a contiguous cache)."""
  return jax.tree.map(lambda x: jnp.take(x, parents, axis=0), cache)


class ContiguousLlama:
  """`Llama` over the contiguous `KVCache` ([B, KVH, S, D] per layer).

  The model is split once (graphdef static, `params` = its nnx.State passed
  into every jitted call). Hash and equality are by identity, so a loop
  object holding this model is a valid static jit argument."""

  def __init__(self, model: Llama, cache_dtype=jnp.float32):
    self.graphdef, self.params = nnx.split(model)
    self.config = model.config
    self.vocab_size = model.config.vocab_size
    self.cache_dtype = cache_dtype

  def init_cache(self, batch: int, length: int) -> KVCache:
    return KVCache.zeros(self.config, batch, length, self.cache_dtype)

  def forward(self, params, cache, tokens, starts, logits_at):
    model = nnx.merge(self.graphdef, params)
    return model(tokens.astype(jnp.int32), starts.astype(jnp.int32), cache,
                 logits_at=logits_at.astype(jnp.int32))

  def fork(self, cache, parents):
    return fork_rows(cache, parents)

  def truncate(self, cache, lengths):
    del lengths  # causal visibility by position makes stale entries harmless
    return cache
