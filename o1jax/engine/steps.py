"""The engine's jittable steps: chunked prefill, one batched decode step, and
the device-resident decode loop that runs several decode steps per call.

All are pure functions of (model graphdef, model state, paged cache, batch
arrays), so the reasoning controller can call `decode_step` inside its own
`jax.lax.while_loop`; the engine jits `prefill_step` and `decode_loop` with the
graphdef static and the cache donated (updated in place).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from o1jax.engine.kv_cache import PagedKVCache
from o1jax.model.sampling import first_argmax, sample


@flax.struct.dataclass
class DecodeBatch:
  """Per-slot inputs of one decode step (B slots; inactive slots are padding).

  Token `steps[b]` of a sample draws with key fold_in(keys[b], steps[b]), where
  keys[b] = sequence_key(seed, request_id, sample_index): the draw never
  depends on the slot or on the other rows."""

  tokens: jax.Array  # [B] int32: last token of each row (its K/V is written this step)
  positions: jax.Array  # [B] int32: position of that token
  active: jax.Array  # [B] bool
  block_tables: jax.Array  # [B, MB] int32
  keys: jax.Array  # [B, 2] uint32 base key of each sample
  steps: jax.Array  # [B] int32 index of the token being sampled (0 = first generated)
  temperature: jax.Array  # [B] f32 (0 = greedy)
  top_k: jax.Array  # [B] int32 (0 = off)
  top_p: jax.Array  # [B] f32 (1 = off)
  min_p: jax.Array  # [B] f32 (0 = off)


@flax.struct.dataclass
class DecodeOutput:
  tokens: jax.Array  # [B] int32 sampled next tokens
  logprobs: jax.Array  # [B] f32 log p(token) under the model (temperature 1, unfiltered)
  top_ids: jax.Array  # [B, K] int32 most likely alternatives (K = top_logprobs, may be 0)
  top_logprobs: jax.Array  # [B, K] f32


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int):
  """log-softmax of logits [B, V] at tokens [B]; plus the top_n best (ids, logprobs)."""
  if top_n:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, top_n)
  else:
    # The same operations as log_softmax, at one token per row instead of all V.
    shifted = logits.astype(jnp.float32)
    shifted = shifted - jnp.max(shifted, axis=-1, keepdims=True)
    log_norm = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - log_norm
    top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
  return chosen, top_ids.astype(jnp.int32), top_lp


def forward(model, tokens: jax.Array, starts: jax.Array, cache, logits_at: jax.Array | None,
            head_t: jax.Array | None = None, num_layers: int | None = None):
  """`Llama.__call__`, optionally with a faster output head.

  head_t: None -> the model's own call. Else the dense head pre-transposed to
  [vocab, d_model]: logits = x @ head_t^T. XLA's CPU dot of [B, 576] by the
  stored [576, 49152] head ran ~1.6x slower at B >= 8 than against the
  transposed copy (measured 34 vs 21 ms at B=32). Same layers, same values.
  num_layers: an early exit after the first layers (`Llama.hidden_states`).
  Returns (logits [B, V] at logits_at, or [B, T, V] for logits_at None; cache)."""
  x, cache = model.hidden_states(tokens, starts, cache, logits_at, num_layers)
  if head_t is None:
    return model.output_logits(x), cache
  logits = jnp.einsum("...k,nk->...n", x, head_t.astype(x.dtype),
                      precision=jax.lax.Precision.HIGHEST)
  return logits.astype(jnp.float32), cache


def decode_step(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, batch: DecodeBatch,
                top_logprobs: int = 0, head_t: jax.Array | None = None):
  """One token for every active row.

  1. point the cache at this batch (block tables; inactive rows write nothing);
  2. model forward on T=1: writes K/V at `positions`, logits [B, V];
  3. sample with per-sample keys fold_in(keys, steps) and per-row params;
  4. log-probs of the sampled tokens (+ top-K alternatives).
  head_t: optional [V, d] transposed dense head (see `forward`).
  Returns (DecodeOutput, cache with placeholder tables: `pools_only`)."""
  model = nnx.merge(graphdef, state)
  active = batch.active
  cache = cache.for_batch(batch.block_tables, active.astype(jnp.int32))
  starts = jnp.where(active, batch.positions, 0).astype(jnp.int32)
  logits, cache = forward(model, batch.tokens[:, None].astype(jnp.int32), starts, cache,
                          jnp.zeros_like(starts), head_t)
  keys = jax.vmap(jax.random.fold_in)(batch.keys, batch.steps)
  next_ids = sample(logits, keys, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
  chosen, top_ids, top_lp = token_logprobs(logits, next_ids, top_logprobs)
  out = DecodeOutput(tokens=next_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)
  return out, cache.pools_only()


def prefill_step(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, tokens: jax.Array,
                 starts: jax.Array, chunk_lens: jax.Array, block_tables: jax.Array) -> PagedKVCache:
  """Writes the K/V of one prompt chunk per row; no sampling.

  tokens [B, T] int32 at positions starts[b] + t; only t < chunk_lens[b] are
  real (chunk_lens 0 = padding row). The engine samples every first token in
  the decode step, so prefill never needs logits (the model still returns one
  row per sequence, which is cheap). Returns the updated cache (`pools_only`)."""
  model = nnx.merge(graphdef, state)
  cache = cache.for_batch(block_tables, chunk_lens)
  last = jnp.maximum(chunk_lens - 1, 0).astype(jnp.int32)
  _, cache = model(tokens.astype(jnp.int32), starts.astype(jnp.int32), cache, logits_at=last)
  return cache.pools_only()


@flax.struct.dataclass
class LoopOutput:
  """Tokens of up to `num_steps` decode steps; row b's real ones are [:counts[b]]."""

  tokens: jax.Array  # [K, B] int32
  logprobs: jax.Array  # [K, B] f32
  top_ids: jax.Array  # [K, B, N] int32
  top_logprobs: jax.Array  # [K, B, N] f32
  counts: jax.Array  # [B] int32 tokens sampled per row (0 for inactive rows)
  iterations: jax.Array  # [] int32 decode steps the call ran


def decode_loop(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, batch: DecodeBatch,
                limits: jax.Array, stop_ids: jax.Array, max_iterations: jax.Array,
                num_steps: int = 1, top_logprobs: int = 0, head_t: jax.Array | None = None):
  """Up to `num_steps` decode steps in one device call, without the host in between.

  Each iteration is `decode_step` on the rows still running: a row feeds back the
  token it sampled, its position and step advance, and it stops after `limits[b]`
  tokens (budget, context and the blocks the host reserved) or on a token in its
  `stop_ids[b]` row (eos and stop ids; -1 pads). The loop ends after
  `max_iterations` (<= num_steps; dynamic, so one program serves single steps
  too) or when every row stopped. Draws use fold_in(keys, steps) as in one step,
  so a sequence gets the same tokens whatever the number of steps per call.
  Stop strings are the host's: it drops what a row sampled past a match.
  Returns (LoopOutput, cache with placeholder tables)."""
  rows = batch.tokens.shape[0]
  n = top_logprobs

  def cond(carry):
    i, running = carry[0], carry[2]
    return (i < max_iterations) & jnp.any(running)

  def body(carry):
    i, cache, running, counts, tokens, positions, steps_, out = carry
    step_batch = batch.replace(tokens=tokens, positions=positions, steps=steps_, active=running)
    result, cache = decode_step(graphdef, state, cache, step_batch, n, head_t)
    out = (out[0].at[i].set(result.tokens), out[1].at[i].set(result.logprobs),
           out[2].at[i].set(result.top_ids), out[3].at[i].set(result.top_logprobs))
    counts = counts + running.astype(jnp.int32)
    stopped = jnp.any(result.tokens[:, None] == stop_ids, axis=1) | (counts >= limits)
    advance = running.astype(jnp.int32)
    tokens = jnp.where(running, result.tokens, tokens)
    return (i + 1, cache, running & ~stopped, counts, tokens, positions + advance,
            steps_ + advance, out)

  out = (jnp.zeros((num_steps, rows), jnp.int32), jnp.zeros((num_steps, rows), jnp.float32),
         jnp.zeros((num_steps, rows, n), jnp.int32), jnp.zeros((num_steps, rows, n), jnp.float32))
  running = batch.active & (limits > 0)
  carry = (jnp.int32(0), cache.pools_only(), running, jnp.zeros(rows, jnp.int32),
           batch.tokens.astype(jnp.int32), batch.positions.astype(jnp.int32),
           batch.steps.astype(jnp.int32), out)
  iterations, cache, _, counts, _, _, _, out = jax.lax.while_loop(cond, body, carry)
  return LoopOutput(tokens=out[0], logprobs=out[1], top_ids=out[2], top_logprobs=out[3],
                    counts=counts, iterations=iterations), cache


# --- speculative decoding: drafts checked in one forward -----------------------------------


@flax.struct.dataclass
class VerifyOutput:
  """The target's tokens at the K + 1 positions of a verify call; row b emits
  tokens[b, :counts[b]] (its accepted drafts, then the target's own token)."""

  tokens: jax.Array  # [B, K+1] int32
  logprobs: jax.Array  # [B, K+1] f32
  top_ids: jax.Array  # [B, K+1, N] int32
  top_logprobs: jax.Array  # [B, K+1, N] f32
  counts: jax.Array  # [B] int32: accepted drafts + 1 (0 for inactive rows)


def verify_step(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, batch: DecodeBatch,
                drafts: jax.Array, num_drafts: jax.Array, top_logprobs: int = 0,
                head_t: jax.Array | None = None):
  """Checks up to K drafted tokens per row in one forward over K + 1 positions.

  1. the row's last token and its drafts [B, K] run as one T = K + 1 call from
     `positions` (K/V written for the first num_drafts[b] + 1; each query attends
     through the decode kernel, `PagedKVCache.decode_queries`);
  2. at every position the target draws its token exactly as `decode_step`
     would at that step: `sample` with key fold_in(keys, steps + j);
  3. drafts are accepted while they equal those tokens; the row emits its
     accepted drafts and then the target's token at the first mismatch (or after
     the last draft). So the emitted tokens are the ones one-token decoding would
     produce, greedy or sampled, token for token (drafts only decide how many
     come out of one call: for a drafter that proposes one token, accepting it
     when the target's draw equals it is the accept/reject rule for a point-mass
     draft distribution). K/V written past the accepted ones is garbage the host
     rolls back by position: later writes overwrite it and nothing attends to it.
  Numerically a position sees what a decode step sees except that the matmuls run
  over B * (K + 1) rows instead of B: the int8 and bf16 CPU matmuls give every row the
  same bits whatever the row count (measured), XLA's f32 dot differs by ~1e-5 between
  one row and several, which can flip a near-tie the way batch composition already can.
  Returns (VerifyOutput, cache with placeholder tables)."""
  model = nnx.merge(graphdef, state)
  b, k = drafts.shape
  t = k + 1
  active = batch.active
  tokens = jnp.concatenate([batch.tokens[:, None], drafts], axis=1).astype(jnp.int32)
  write_lens = jnp.where(active, num_drafts + 1, 0).astype(jnp.int32)
  cache = cache.for_batch(batch.block_tables, write_lens, decode_queries=True)
  starts = jnp.where(active, batch.positions, 0).astype(jnp.int32)
  logits, cache = forward(model, tokens, starts, cache, None, head_t)
  logits = logits.reshape(b * t, -1)
  rep = lambda x: jnp.repeat(x, t, axis=0)
  steps_ = (batch.steps[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]).reshape(-1)
  keys = jax.vmap(jax.random.fold_in)(rep(batch.keys), steps_)
  target = sample(logits, keys, rep(batch.temperature), rep(batch.top_k), rep(batch.top_p),
                  rep(batch.min_p))
  chosen, top_ids, top_lp = token_logprobs(logits, target, top_logprobs)
  target = target.reshape(b, t)
  match = (drafts == target[:, :k]) & (jnp.arange(k)[None, :] < num_drafts[:, None])
  accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
  out = VerifyOutput(tokens=target, logprobs=chosen.reshape(b, t),
                     top_ids=top_ids.reshape(b, t, -1), top_logprobs=top_lp.reshape(b, t, -1),
                     counts=jnp.where(active, accepted + 1, 0).astype(jnp.int32))
  return out, cache.pools_only()


def draft_greedy(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, batch: DecodeBatch,
                 num_drafts: jax.Array, max_drafts: int, num_layers: int | None = None,
                 head_t: jax.Array | None = None, prev_tokens: jax.Array | None = None):
  """Up to `max_drafts` greedy tokens per row, one decode step of the drafting model
  at a time from each row's last token (`batch.tokens` at `batch.positions`).

  The drafting model is the target's first `num_layers` layers with its own final
  norm and head (early exit: their K/V goes into the target's own pools, which the
  verify call rewrites for every layer), or a separate draft model over all its
  layers (num_layers None) and its own pools. Row b drafts num_drafts[b] tokens
  and writes nothing after them (its blocks end there): K/V at positions
  positions[b] .. + num_drafts[b] - 1, of its last token and its first drafts.
  prev_tokens [B] (a draft model's own pools only): the token before each row's
  last one. The first step then runs over both (K/V at positions[b] - 1 too), so a
  row whose draft K/V stops one token short of its last token (what a verify call
  that accepted every draft leaves: the last draft was never fed) needs no
  catch-up call. Rows at position 0 run the last token alone.
  Greedy drafts make the verify rule exact for sampled rows too (see `verify_step`).
  Returns (drafts [B, max_drafts] int32, cache with placeholder tables)."""
  model = nnx.merge(graphdef, state)
  rows = batch.tokens.shape[0]

  def body(i, carry):
    cache, tokens, drafts = carry
    live = batch.active & (i < num_drafts)
    step_cache = cache.for_batch(batch.block_tables, live.astype(jnp.int32))
    starts = jnp.where(live, batch.positions + i, 0).astype(jnp.int32)
    logits, step_cache = forward(model, tokens[:, None], starts, step_cache,
                                 jnp.zeros(rows, jnp.int32), head_t, num_layers)
    nxt = first_argmax(logits).astype(jnp.int32)
    return step_cache.pools_only(), nxt, drafts.at[:, i].set(nxt)

  carry = (cache.pools_only(), batch.tokens.astype(jnp.int32),
           jnp.zeros((rows, max_drafts), jnp.int32))
  first = 0
  if prev_tokens is not None:
    live = batch.active & (num_drafts > 0)
    lead = (batch.positions > 0).astype(jnp.int32)
    lens = jnp.where(live, 1 + lead, 0).astype(jnp.int32)
    last = batch.tokens.astype(jnp.int32)
    pair = jnp.where(lead[:, None] > 0, jnp.stack([prev_tokens.astype(jnp.int32), last], 1),
                     jnp.stack([last, last], 1))
    starts = jnp.where(live, batch.positions - lead, 0).astype(jnp.int32)
    logits, step_cache = forward(model, pair, starts, cache.for_batch(batch.block_tables, lens),
                                 jnp.maximum(lens - 1, 0), head_t, num_layers)
    nxt = first_argmax(logits).astype(jnp.int32)
    carry, first = (step_cache.pools_only(), nxt, carry[2].at[:, 0].set(nxt)), 1
  cache, _, drafts = jax.lax.fori_loop(first, max_drafts, body, carry)
  return drafts, cache
