"""The loop's carried state: one `ReasoningState` pytree for a batch of B sequences.

Every field is a device array with a fixed shape, so the whole state is the
carry of one `jax.lax.while_loop`. Per-row policy settings live in `Knobs`
(also arrays), so policies that differ only in numbers share one compiled
program; only the verifier class and the probe switch are static.

Shapes: B rows (request x sample), L cache/token length, W confidence window,
F forced-token capacity, P probe capacity, M pattern variants, D pattern
capacity, R step records, V vocabulary, C character classes per token, A
answer-key capacity, Q prior votes, G request slots (the n rows of slot g are
rows g * n .. g * n + n - 1).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

# Answer-key automaton states: answers.py owns the automaton; the loop reads them here.
from o1jax.controller.answers import (KEY_DONE, KEY_DOT, KEY_FRAC, KEY_INT,  # noqa: F401
                                      KEY_NEG, KEY_NEG_DOLLAR, KEY_SEARCH)

# Phases of a sequence.
THINK, ANSWER, DONE = 0, 1, 2

# Actions recorded at step boundaries and other events (rec_action).
CONTINUE = 0  # step accepted, keep thinking
BACKTRACK = 1  # step rolled back and resampled
ANSWER_STEPS = 2  # step accepted, step budget reached: answer forced
EARLY_EXIT = 3  # step accepted, answer confidence >= tau: answer forced
MODEL_ANSWER = 4  # the model wrote the answer prefix itself
THINK_BUDGET = 5  # thinking-token budget reached (mid-step): answer forced
WAIT = 6  # end of thinking below the minimum: "Wait" forced (budget forcing)
LOW_CONF_STOP = 7  # DeepConf: group confidence fell below the trace threshold
END = 8  # end of sequence during thinking (no answer phase)
CONSENSUS_STOP = 9  # the request's vote was decided: the row stops (DeepConf consensus)
ACTION_NAMES = ("continue", "backtrack", "answer_steps", "early_exit", "model_answer",
                "think_budget", "wait", "low_conf_stop", "end", "consensus_stop")

# Why a sequence finished (exit_reason).
# EXIT_PRUNED: stopped from the host by the latency-aware budget (engine/budget.py).
(RUNNING, EXIT_EOS, EXIT_ANSWER_EOS, EXIT_ANSWER_BUDGET, EXIT_LOW_CONF, EXIT_LENGTH,
 EXIT_CONSENSUS, EXIT_PRUNED) = range(8)
EXIT_NAMES = ("running", "eos", "answer_eos", "answer_budget", "low_confidence", "length",
              "consensus", "pruned")



@flax.struct.dataclass
class Knobs:
  """Policy settings as arrays: per row [B] unless noted. Passed into jit, never static."""

  temperature: jax.Array  # [B] f32 base temperature (0 = greedy)
  top_k: jax.Array  # [B] i32
  top_p: jax.Array  # [B] f32
  min_p: jax.Array  # [B] f32
  temp_bump: jax.Array  # [B] f32 added per backtrack of the current step
  bt_threshold: jax.Array  # [B] f32 backtrack when step score < this
  max_step_bt: jax.Array  # [B] i32 backtracks allowed per step
  max_bt: jax.Array  # [B] i32 backtracks allowed per sequence
  step_cap: jax.Array  # [B] i32 tokens per step before a forced boundary
  max_steps: jax.Array  # [B] i32 accepted steps before the answer is forced
  min_think: jax.Array  # [B] i32 budget forcing: "Wait" while below
  max_think: jax.Array  # [B] i32 thinking tokens before the answer is forced
  max_answer: jax.Array  # [B] i32 answer tokens after the answer prefix
  max_generated: jax.Array  # [B] i32 all tokens incl. discarded ones
  exit_tau: jax.Array  # [B] f32 early exit when answer confidence >= tau (> 1 = off)
  conf_stop: jax.Array  # [B] f32 DeepConf stop threshold (-inf = off)
  answer_on_eos: jax.Array  # [B] bool end of sequence while thinking -> force the answer
  eos_mask: jax.Array  # [V] bool
  delim_mask: jax.Array  # [V] bool tokens whose text contains the step delimiter
  delim_seqs: jax.Array  # [M, D] i32 delimiter tokenizations (tail match)
  delim_lens: jax.Array  # [M] i32 (0 = unused variant)
  # The end of thinking the model may write: the answer prefix, or with a thinking span
  # its close marker (o1jax/model/thinking.py).
  prefix_seqs: jax.Array  # [M, D] i32 its tokenizations (tail match)
  prefix_lens: jax.Array  # [M] i32
  restart_seqs: jax.Array  # [M, D] i32 answer-prefix tokenizations: restart the answer key
  restart_lens: jax.Array  # [M] i32
  answer_ids: jax.Array  # [F] i32 forced end of thinking (the answer prefix, or close + prefix)
  answer_len: jax.Array  # [] i32
  answer_separator_len: jax.Array  # [] i32 leading separator of answer_ids ("\n\n"), skipped
  ends_in_space: jax.Array  # [V] bool ... after these tokens (their text ends in whitespace)
  blank: jax.Array  # [V] bool tokens whose text is whitespace only
  after_close_ids: jax.Array  # [F] i32 forced after the model closed a thinking span itself
  after_close_len: jax.Array  # [] i32 (0 = nothing)
  wait_ids: jax.Array  # [F] i32 forced "Wait"
  wait_len: jax.Array  # [] i32
  probe_ids: jax.Array  # [P] i32 self-verification probe
  probe_len: jax.Array  # [] i32
  yes_id: jax.Array  # [] i32
  no_id: jax.Array  # [] i32
  answer_probe_ids: jax.Array  # [P] i32 answer-confidence probe (the answer prefix)
  answer_probe_len: jax.Array  # [] i32
  # Vote (compiled only with ReasoningLoop.vote): answer keys and the consensus stop.
  key_classes: jax.Array  # [V, C] i32 character classes of each token's text (-1 = none)
  key_overflow: jax.Array  # [V] bool the token has more than C classes (key unknown)
  group: jax.Array  # [B] i32 request of the row within the batch (-1 = not voting)
  vote_floor: jax.Array  # [B] f32 a finished row votes only with confidence >= this
  consensus: jax.Array  # [B] f32 stop once the leader holds this share of the votes (> 1 = off)
  consensus_min: jax.Array  # [B] i32 ... and at least this many rows have voted
  stop_decided: jax.Array  # [B] bool stop once unfinished rows cannot change the winner
  prior_group: jax.Array  # [Q] i32 votes cast before this call (e.g. warm-up traces), -1 = none
  prior_key: jax.Array  # [Q, A] i32 their answer keys
  prior_key_len: jax.Array  # [Q] i32
  prior_known: jax.Array  # [Q] bool False: the answer is unknown (a wildcard vote)
  prior_weight: jax.Array  # [Q] f32


@flax.struct.dataclass
class ReasoningState:
  """Per-row reasoning state; `tokens[b, :length[b]]` is row b's sequence.

  The cache holds K/V for positions < length - 1: each iteration feeds
  token length-1 and samples token `length`, so truncating to a step start
  is just `length = step_start` (stale cache entries are rewritten before
  any query can see them)."""

  tokens: jax.Array  # [B, L] i32 prompt + generated tokens
  length: jax.Array  # [B] i32
  prompt_len: jax.Array  # [B] i32
  phase: jax.Array  # [B] i32 THINK / ANSWER / DONE
  step_index: jax.Array  # [B] i32 accepted steps
  step_start: jax.Array  # [B] i32 position of the current step's first token
  step_len: jax.Array  # [B] i32 tokens in the current step
  step_lp: jax.Array  # [B] f32 sum of log p of the current step's tokens
  step_bt: jax.Array  # [B] i32 backtracks of the current step
  backtracks: jax.Array  # [B] i32 total backtracks (= sampling attempt)
  think_tokens: jax.Array  # [B] i32 thinking tokens kept in the sequence
  answer_tokens: jax.Array  # [B] i32 answer-phase tokens (the answer prefix included)
  prefix_tokens: jax.Array  # [B] i32 of answer_tokens: the answer prefix (forced or model-written)
  probe_tokens: jax.Array  # [B] i32 tokens run through verification / answer probes
  discarded: jax.Array  # [B] i32 tokens rolled back by backtracking
  waits: jax.Array  # [B] i32 "Wait" insertions
  generated: jax.Array  # [B] i32 every appended token (incl. discarded)
  lp_total: jax.Array  # [B] f32 sum of log p of the tokens kept in the sequence
  answer_start: jax.Array  # [B] i32 position where the answer phase began (-1 = none)
  conf_ring: jax.Array  # [B, W] f32 last W token confidences
  conf_count: jax.Array  # [B] i32 token confidences seen
  conf_sum: jax.Array  # [B] f32 their sum (mean trace confidence)
  lowest_conf: jax.Array  # [B] f32 lowest full-window group confidence (+inf = none yet)
  # By position of each generated token (as `tokens`): its confidence, and lp_total,
  # conf_sum and lowest_conf after it (a rollback restores them; `loop._rolled_back`).
  conf_pos: jax.Array  # [B, L] f32
  lp_run: jax.Array  # [B, L] f32
  conf_run: jax.Array  # [B, L] f32
  low_run: jax.Array  # [B, L] f32
  exit_reason: jax.Array  # [B] i32
  key_state: jax.Array  # [B] i32 answer-key automaton state (KEY_*)
  key: jax.Array  # [B, A] i32 answer key codes (0-9 digits, 10 ".", 12 "-"; a zero integer part left out: answers.key_text)
  key_len: jax.Array  # [B] i32 characters written
  key_commit: jax.Array  # [B] i32 characters that count (trailing fraction zeros do not)
  key_unknown: jax.Array  # [B] bool the key could not be followed (too long, odd token)
  early_exit: jax.Array  # [B] bool
  force_buf: jax.Array  # [B, F] i32 tokens to emit instead of sampling
  force_pos: jax.Array  # [B] i32
  force_len: jax.Array  # [B] i32
  rec_start: jax.Array  # [B, R] i32 step records: token span [start, end)
  rec_end: jax.Array  # [B, R] i32
  rec_score: jax.Array  # [B, R] f32 (nan = not scored)
  rec_conf: jax.Array  # [B, R] f32 the answer-confidence probe's value (nan = not probed)
  rec_action: jax.Array  # [B, R] i32
  n_rec: jax.Array  # [B] i32 records written (may exceed R; extra ones are dropped)
  keys: jax.Array  # [B, 2] u32 base key of each sample: sequence_key(seed, request, sample)
  # Speculation (ReasoningLoop.draft_k > 0), per row: decayed sums of drafts accepted per
  # (real or shadow) verify call and of calls, the shadow call in progress on plain
  # iterations (its drafts, how many, the next one to check; 0 = none), and the drafts
  # verified / accepted in all.
  spec_acc: jax.Array  # [B] f32
  spec_calls_row: jax.Array  # [B] f32
  shadow_draft: jax.Array  # [B, K] i32 (K = draft_k, at least 1)
  shadow_len: jax.Array  # [B] i32
  shadow_pos: jax.Array  # [B] i32
  spec_drafted: jax.Array  # [B] i32
  spec_accepted: jax.Array  # [B] i32
  spec_calls: jax.Array  # [] i32 verify calls so far (all invocations)
  iteration: jax.Array  # [] i32 iterations run so far (all invocations)
  stop_at: jax.Array  # [] i32 this invocation returns to the host at this iteration
  # Request slots (the host admits a new request into a slot whose rows are all done).
  slot: jax.Array  # [B] i32 slot of each row (-1 = padding)
  slot_live: jax.Array  # [G] bool the slot holds a request the host has not collected
  return_on_free: jax.Array  # [] bool return as soon as a live slot's rows are all done
  knobs: Knobs
  cache: object  # the decode model's cache pytree (batch B)

  @property
  def done(self) -> jax.Array:
    return self.phase == DONE

  def slot_done(self) -> jax.Array:
    """[G] every row of the slot is done (a slot without rows counts as done)."""
    g = self.slot_live.shape[0]
    seg = jnp.where(self.slot >= 0, self.slot, g)
    running = jax.ops.segment_max((~self.done).astype(jnp.int32), seg, num_segments=g + 1)
    return running[:g] <= 0

  @property
  def window(self) -> int:
    return self.conf_ring.shape[1]

  @property
  def group_conf(self) -> jax.Array:
    """[B] DeepConf group confidence: mean token confidence over the last
    min(W, seen) tokens (+inf before any token)."""
    n = jnp.minimum(self.conf_count, self.window)
    return jnp.where(n > 0, jnp.sum(self.conf_ring, axis=1) / jnp.maximum(n, 1), jnp.inf)


def row_start_values(rows: int, *, window: int, records: int, key_capacity: int,
                     force_capacity: int, draft_capacity: int = 1) -> dict[str, jax.Array]:
  """The start value of every per-row field a fresh row resets, for `rows` rows (the
  prompt-dependent ones, tokens, lengths and keys, come from the controller's `admit`).
  Each field gets a buffer of its own: the loop's state is donated."""
  zi = lambda: jnp.zeros((rows,), jnp.int32)
  zf = lambda: jnp.zeros((rows,), jnp.float32)
  no = lambda: jnp.zeros((rows,), bool)
  return dict(
      step_index=zi(), step_len=zi(), step_lp=zf(), step_bt=zi(), backtracks=zi(),
      think_tokens=zi(), answer_tokens=zi(), prefix_tokens=zi(), probe_tokens=zi(),
      discarded=zi(), waits=zi(), generated=zi(), lp_total=zf(),
      answer_start=jnp.full((rows,), -1, jnp.int32), conf_ring=jnp.zeros((rows, window)),
      conf_count=zi(), conf_sum=zf(), lowest_conf=jnp.full((rows,), jnp.inf), exit_reason=zi(),
      key_state=zi(), key=jnp.zeros((rows, key_capacity), jnp.int32), key_len=zi(),
      key_commit=zi(), key_unknown=no(), early_exit=no(),
      force_buf=jnp.zeros((rows, force_capacity), jnp.int32), force_pos=zi(), force_len=zi(),
      rec_start=jnp.zeros((rows, records), jnp.int32),
      rec_end=jnp.zeros((rows, records), jnp.int32),
      rec_score=jnp.full((rows, records), jnp.nan),
      rec_conf=jnp.full((rows, records), jnp.nan),
      rec_action=jnp.zeros((rows, records), jnp.int32), n_rec=zi(),
      spec_acc=zf(), spec_calls_row=zf(),
      shadow_draft=jnp.zeros((rows, max(1, draft_capacity)), jnp.int32), shadow_len=zi(),
      shadow_pos=zi(), spec_drafted=zi(), spec_accepted=zi())
