"""The engine's jittable steps: chunked prefill, the device-resident decode loop that
runs several decode steps per call, and speculative verification.

The decode loop is one for the engine and the reasoning controller: `run_rows`
iterates `decode_iteration` (feed each row's last token -> forward on the paged
cache -> draw -> advance) over a `RowProgram`, which says what the rows do with
their tokens: `PlainRows` is the engine's (stop ids, token limits), the
controller's reasoning loop (`o1jax.controller.loop`) the other. All steps are pure
functions of (model graphdef, model state, paged cache, batch arrays); the engine
jits them with the graphdef static and the cache donated (updated in place).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from o1jax.engine.kv_cache import PagedKVCache
from o1jax.model.sampling import first_argmax, sample, token_logprobs


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
  draw_kind: str = flax.struct.field(pytree_node=False, default="any")  # see `Draw`


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


# --- the decode loop: one for the engine and the controller ------------------------------


# What the host knows of a batch's sampling params (a static part of the program):
# "greedy" every row takes the argmax; "sampled" every row samples without top-k /
# top-p / min-p; "filtered" every row samples and some filter; "any" otherwise (the
# sampler tests the batch's values on the device).
DRAW_KINDS = ("greedy", "sampled", "filtered", "any")


def draw_kind(temperature, top_k, top_p, min_p, vocab_size: int) -> str:
  """The `DRAW_KINDS` entry of rows with these (host) sampling params."""
  t, k = np.asarray(temperature, np.float32), np.asarray(top_k)
  if not np.any(t > 0):
    return "greedy"
  if not np.all(t > 0):
    return "any"
  filters = ((k > 0) & (k < vocab_size)) | (np.asarray(top_p) < 1.0) | (np.asarray(min_p) > 0)
  return "filtered" if np.any(filters) else "sampled"


@flax.struct.dataclass
class Draw:
  """How each row draws its next token: with key fold_in(keys[b], steps[b]) and its
  own sampling params (`o1jax.model.sampling.sample`); `kind` (static, `DRAW_KINDS`)
  leaves out the sampler's branches the host knows are not taken."""

  keys: jax.Array  # [B, 2] uint32
  steps: jax.Array  # [B] int32
  temperature: jax.Array  # [B] f32 (0 = greedy)
  top_k: jax.Array  # [B] int32 (0 = off)
  top_p: jax.Array  # [B] f32 (1 = off)
  min_p: jax.Array  # [B] f32 (0 = off)
  kind: str = flax.struct.field(pytree_node=False, default="any")


def draw_tokens(logits: jax.Array, draw: Draw) -> jax.Array:
  """[B] next tokens drawn from logits [B, V] as `draw` says (the same tokens
  whatever its kind, where the kind is true of the rows)."""
  if draw.kind not in DRAW_KINDS:
    raise ValueError(f"draw kind {draw.kind!r} not in {DRAW_KINDS}")
  if draw.kind == "greedy":
    return first_argmax(logits)
  keys = jax.vmap(jax.random.fold_in)(draw.keys, draw.steps)
  return sample(logits, keys, draw.temperature, draw.top_k, draw.top_p, draw.min_p,
                all_sampled=draw.kind != "any",
                filters={"sampled": False, "filtered": True}.get(draw.kind))


class RowProgram(Protocol):
  """What the rows of a decode loop do with their tokens. The engine's rows
  (`PlainRows`: stop ids and token limits) and the controller's reasoning rows
  (`o1jax.controller.loop`: steps, verifiers, backtracking, budgets, votes) are the
  two programs of the one loop, `run_rows`; the carry is the program's own
  pytree and holds the KV cache."""

  def more(self, carry) -> jax.Array:
    """[] bool: run another iteration."""

  def feed(self, carry) -> tuple[jax.Array, jax.Array, jax.Array, Draw]:
    """(tokens [B], positions [B], live [B], draw): each row's last token and its
    position, the rows that take a token this iteration, and how they draw it."""

  def forward(self, carry, tokens: jax.Array, positions: jax.Array, live: jax.Array):
    """The model over tokens [B, 1] at `positions` on the carry's cache (K/V
    written); returns (logits [B, V] f32, carry)."""

  def advance(self, carry, logits: jax.Array, drawn: jax.Array):
    """Takes each live row's drawn token [B] (or what the program puts in its
    place) and decides what the row does next; returns the carry."""


def decode_iteration(program: RowProgram, carry):
  """One token for every live row: feed -> forward -> draw -> advance."""
  tokens, positions, live, draw = program.feed(carry)
  logits, carry = program.forward(carry, tokens, positions, live)
  return program.advance(carry, logits, draw_tokens(logits, draw))


def fixed_trip_loops() -> bool:
  """Whether decode loops here run a static number of iterations (`run_rows`'
  `trips`). A GPU runs a `while_loop` whose condition depends on the data by copying
  the condition to the host after every iteration and waiting for the device (XLA's
  WhileThunk; one with a trip count known at compile time runs without): the host
  cannot queue the next iteration's kernels while the device runs this one, so every
  kernel launch of a step is paid in full. On a CPU the loop's test costs nothing and
  the loop stops as soon as it can. O1JAX_FIXED_TRIP_LOOPS=0 / 1 forces either (the
  GPU check's `loops` stage measures both)."""
  forced = os.environ.get("O1JAX_FIXED_TRIP_LOOPS", "")
  if forced in ("0", "1"):
    return forced == "1"
  return jax.default_backend() == "gpu"


def run_rows(program: RowProgram, carry, iteration=decode_iteration, trips: int | None = None):
  """The device-resident decode loop, one device call with no host in between:
  `iteration` while `program.more` (a `jax.lax.while_loop`), or with `trips` exactly
  that many iterations (a loop of static trip count, `fixed_trip_loops`): the
  program then must idle its rows once it has no more to do (`PlainRows` does).
  `iteration`: the plain one token per row, or a program's own (the controller's
  verify calls)."""
  step = functools.partial(iteration, program)
  if trips is None:
    return jax.lax.while_loop(program.more, step, carry)
  return jax.lax.fori_loop(0, trips, lambda _, c: step(c), carry)


@flax.struct.dataclass
class LoopOutput:
  """Tokens of up to `num_steps` decode steps; row b's real ones are [:counts[b]]."""

  tokens: jax.Array  # [K, B] int32
  logprobs: jax.Array  # [K, B] f32 log p(token) under the model (temperature 1, unfiltered)
  top_ids: jax.Array  # [K, B, N] int32 most likely alternatives (N = top_logprobs, may be 0)
  top_logprobs: jax.Array  # [K, B, N] f32
  counts: jax.Array  # [B] int32 tokens sampled per row (0 for inactive rows)
  iterations: jax.Array  # [] int32 decode steps the call ran (in which some row took a token)


@flax.struct.dataclass
class PlainCarry:
  iteration: jax.Array  # [] int32 iterations so far (the output row of the next one)
  ran: jax.Array  # [] int32 those in which some row took a token
  cache: PagedKVCache
  running: jax.Array  # [B] bool
  counts: jax.Array  # [B] int32
  tokens: jax.Array  # [B] int32 last token of each row
  positions: jax.Array  # [B] int32 its position
  steps: jax.Array  # [B] int32 index of the token being sampled (0 = first generated)
  out: LoopOutput


@dataclasses.dataclass(frozen=True)
class PlainRows:
  """The engine's row program: a row emits what it draws (with its log-prob and top-N
  alternatives) until `limits[b]` tokens or a token in its `stop_ids[b]` row; no row
  takes a token after `max_iterations` iterations (the loop ends there, or when every
  row stopped; a loop of fixed trips idles on). Built inside a trace (`decode_loop`):
  its fields are that call's arrays."""

  model: nnx.Module
  batch: DecodeBatch
  limits: jax.Array  # [B] int32
  stop_ids: jax.Array  # [B, S] int32 (-1 pads)
  max_iterations: jax.Array  # [] int32
  top_logprobs: int
  head_t: jax.Array | None

  def start(self, cache: PagedKVCache, num_steps: int) -> PlainCarry:
    rows, n = self.batch.tokens.shape[0], self.top_logprobs
    out = LoopOutput(
        tokens=jnp.zeros((num_steps, rows), jnp.int32),
        logprobs=jnp.zeros((num_steps, rows), jnp.float32),
        top_ids=jnp.zeros((num_steps, rows, n), jnp.int32),
        top_logprobs=jnp.zeros((num_steps, rows, n), jnp.float32),
        counts=jnp.zeros(rows, jnp.int32), iterations=jnp.int32(0))
    b = self.batch
    return PlainCarry(iteration=jnp.int32(0), ran=jnp.int32(0), cache=cache.pools_only(),
                      running=b.active & (self.limits > 0), counts=jnp.zeros(rows, jnp.int32),
                      tokens=b.tokens.astype(jnp.int32), positions=b.positions.astype(jnp.int32),
                      steps=b.steps.astype(jnp.int32), out=out)

  def more(self, c: PlainCarry) -> jax.Array:
    return (c.iteration < self.max_iterations) & jnp.any(c.running)

  def _live(self, c: PlainCarry) -> jax.Array:
    return c.running & (c.iteration < self.max_iterations)

  def feed(self, c: PlainCarry):
    b = self.batch
    draw = Draw(keys=b.keys, steps=c.steps, temperature=b.temperature, top_k=b.top_k,
                top_p=b.top_p, min_p=b.min_p, kind=b.draw_kind)
    return c.tokens, c.positions, self._live(c), draw

  def forward(self, c: PlainCarry, tokens, positions, live):
    # Block tables point the cache at this batch; rows not live write nothing.
    cache = c.cache.for_batch(self.batch.block_tables, live.astype(jnp.int32))
    starts = jnp.where(live, positions, 0).astype(jnp.int32)
    logits, cache = forward(self.model, tokens[:, None].astype(jnp.int32), starts, cache,
                            jnp.zeros_like(starts), self.head_t)
    return logits, c.replace(cache=cache.pools_only())

  def advance(self, c: PlainCarry, logits, drawn) -> PlainCarry:
    i, live = c.iteration, self._live(c)
    chosen, top_ids, top_lp = token_logprobs(logits, drawn, self.top_logprobs)
    out = c.out.replace(tokens=c.out.tokens.at[i].set(drawn),
                        logprobs=c.out.logprobs.at[i].set(chosen),
                        top_ids=c.out.top_ids.at[i].set(top_ids),
                        top_logprobs=c.out.top_logprobs.at[i].set(top_lp))
    counts = c.counts + live.astype(jnp.int32)
    stopped = jnp.any(drawn[:, None] == self.stop_ids, axis=1) | (counts >= self.limits)
    advance = live.astype(jnp.int32)
    return c.replace(iteration=i + 1, ran=c.ran + jnp.any(live).astype(jnp.int32),
                     running=c.running & ~(live & stopped), counts=counts,
                     tokens=jnp.where(live, drawn, c.tokens), positions=c.positions + advance,
                     steps=c.steps + advance, out=out)


def decode_loop(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, batch: DecodeBatch,
                limits: jax.Array, stop_ids: jax.Array, max_iterations: jax.Array,
                num_steps: int = 1, top_logprobs: int = 0, head_t: jax.Array | None = None,
                fixed_trips: bool = False):
  """Up to `num_steps` decode steps in one device call, without the host in between
  (`run_rows` over `PlainRows`; `num_steps` fixed trips if `fixed_trips`: the host's
  `fixed_trip_loops`, a static argument like the controller's `trips`).

  Each iteration writes the K/V of every running row's last token and draws its
  next one: a row feeds back the token it drew, its position and step advance, and
  it stops after `limits[b]` tokens (budget, context and the blocks the host
  reserved) or on a token in its `stop_ids[b]` row (eos and stop ids; -1 pads).
  The loop ends after `max_iterations` (<= num_steps; dynamic, so on a CPU one
  program serves single steps too) or when every row stopped; with fixed trips it
  runs `num_steps`, idle past either. Token `steps[b]` draws with
  fold_in(keys[b], steps[b]), so a sequence gets the same tokens whatever the
  number of steps per call. Stop strings are the host's: it drops what a row
  sampled past a match. head_t: optional [V, d] transposed dense head (`forward`).
  Returns (LoopOutput, cache with placeholder tables: `pools_only`)."""
  program = PlainRows(model=nnx.merge(graphdef, state), batch=batch, limits=limits,
                      stop_ids=stop_ids, max_iterations=max_iterations,
                      top_logprobs=top_logprobs, head_t=head_t)
  trips = num_steps if fixed_trips else None
  c = run_rows(program, program.start(cache, num_steps), trips=trips)
  return c.out.replace(counts=c.counts, iterations=c.ran), c.cache


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
  2. at every position the target draws its token exactly as the decode loop
     would at that step: `draw_tokens` with key fold_in(keys, steps + j);
  3. drafts are accepted while they equal those tokens; the row emits its
     accepted drafts and then the target's token at the first mismatch (or after
     the last draft). So the emitted tokens are the ones one-token decoding would
     produce, greedy or sampled, token for token (drafts only decide how many
     come out of one call: for a drafter that proposes one token, accepting it
     when the target's draw equals it is the accept/reject rule for a point-mass
     draft distribution). K/V written past the accepted ones is garbage the host
     rolls back by position: later writes overwrite it and nothing attends to it.
  Numerically a position sees what a decode step sees except that the matmuls run
  over B * (K + 1) rows instead of B: the native f32 and int8 CPU kernels give every row
  the same bits whatever the row count (measured); XLA's bf16 dot does at the embedded
  model's shapes (1-160 rows) but picks another kernel at some shapes and row counts (a
  576 x 64 matrix at 65 rows; the tiny test model's 64-wide layers from ~51 rows), where
  a row's log p moves up to ~2e-3 and a near-tie may fork (pipelines hash the
  speculative section with bf16 matmuls).
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
  target = draw_tokens(logits, Draw(keys=rep(batch.keys), steps=steps_,
                                    temperature=rep(batch.temperature), top_k=rep(batch.top_k),
                                    top_p=rep(batch.top_p), min_p=rep(batch.min_p),
                                    kind=batch.draw_kind))
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
