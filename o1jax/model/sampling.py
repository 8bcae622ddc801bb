"""Token sampling: greedy, temperature, top-k, top-p, min-p — per row of a batch.

Randomness is derived, never positional: the key of token `step` of sample `j`
of request `r` is fold_in(fold_in(fold_in(PRNGKey(seed), r), j), step), so a
sequence samples the same tokens whatever batch or slot it runs in.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0  # 0 -> greedy
  top_k: int = 0  # 0 -> off
  top_p: float = 1.0  # 1 -> off
  min_p: float = 0.0  # 0 -> off
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 <= self.min_p < 1.0:
      raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def sequence_key(seed: int, request_id: int, sample_index: int) -> jax.Array:
  """Base key of one sample of one request (uint32 key data [2])."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), request_id)
  return jax.random.fold_in(key, sample_index)


def _filtered_logits(logits, temperature, top_k, top_p, min_p):
  """Scaled logits with tokens outside top-k / top-p / min-p set to -inf. [B, V]."""
  v = logits.shape[-1]
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  sorted_desc = -jnp.sort(-scaled, axis=-1)
  # top-k: threshold at the k-th largest value (ties at the threshold are kept).
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
  keep = scaled >= kth
  # top-p: keep the smallest prefix of sorted tokens whose mass reaches p.
  probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
  n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
  pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
  keep &= scaled >= pth
  # min-p: drop tokens whose probability is below min_p * max probability.
  logp = jax.nn.log_softmax(scaled, axis=-1)
  keep &= logp >= (jnp.max(logp, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))[:, None])
  return jnp.where(keep, scaled, -jnp.inf)


def first_argmax(logits: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first index of the maximum) as a max, a
  compare and a min: XLA's CPU argmax (a variadic reduce) took 2.9 ms on [32,
  49152] logits, this 1.5 ms. [..., V] -> [...] int32 (all-NaN rows -> V - 1)."""
  v = logits.shape[-1]
  top = jnp.max(logits, axis=-1, keepdims=True)
  index = jnp.arange(v, dtype=jnp.int32)
  first = jnp.min(jnp.where(logits == top, index, v), axis=-1)
  return jnp.minimum(first, v - 1)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, min_p: jax.Array) -> jax.Array:
  """Samples one token per row. logits: [B, V]; keys: [B, 2]; params: [B]. Returns [B] int32.

  Rows with temperature 0 take the argmax; the sort for filtering runs only
  if some row samples."""
  greedy_ids = first_argmax(logits)

  def sampled(_):
    filtered = _filtered_logits(logits.astype(jnp.float32), temperature, top_k, top_p, min_p)
    ids = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, ids, greedy_ids)

  return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy_ids, None)
