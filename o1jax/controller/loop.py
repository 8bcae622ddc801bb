"""The reasoning loop: think / verify / backtrack as one jitted `jax.lax.while_loop` (a
loop of fixed trips on a GPU, `ReasoningLoop.trips`).

It is the engine's decode loop (`o1jax.engine.steps.run_rows`) with a row program
of its own, `ReasoningRows`. `ReasoningLoop` is a frozen dataclass holding only
static configuration (the decode model, the verifier class, the probe switch);
everything a policy varies is an array in `ReasoningState.knobs`. One iteration =
one token for every row, with step-boundary decisions applied by masks:

  1. feed token length-1 of every row at its position (one T=1 forward);
  2. draw the next token with key fold_in(fold_in(base, attempt), position)
     and temperature + bump * (backtracks of this step); forced tokens
     ("Wait", the answer prefix) replace the draw while a force queue is open;
  3. budget forcing: end of sequence while thinking below `min_think` becomes
     "Wait"; above it, the sequence ends (or the answer is forced);
  4. append the token, update counters and the DeepConf confidence window;
  5. step boundary (delimiter, step cap, or the end of thinking written by the
     model: the answer prefix, or with a thinking span its close marker, after
     which the prefix is forced): run the probes if any row needs them, score the step, and
     decide: backtrack (length = step start, attempt + 1) / early exit /
     answer (step budget) / continue; one record per event;
  6. token budgets: thinking tokens reaching `max_think` force the answer
     prefix; `max_answer` tokens after the prefix end the row; DeepConf stops a
     row whose full-window group confidence falls below its threshold;
  7. with `vote`: answer tokens feed a per-row answer key (answers.py), and the
     running rows of a request stop as soon as its confidence-weighted vote is
     decided (consensus share reached, or the rows still running could not
     change the winner).

`run` loops until every row is done, `state.stop_at` iterations have run, or
(with `return_on_free`) a request's rows are all done while another request
waits; the host then adapts budgets or admits the waiting request into the
freed slot and calls again. `run_python`
is the debugging twin that calls the same `_step` one iteration at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from o1jax import compilation_cache
from o1jax.controller import answers
from o1jax.controller import state as S
from o1jax.controller.decode_model import DecodeModel
from o1jax.controller.state import Knobs, ReasoningState
from o1jax.controller.verifiers import MeanLogprob, StepStats, Verifier
from o1jax.engine import steps


def tail_match(tokens: jax.Array, length: jax.Array, seqs: jax.Array, lens: jax.Array,
               available: jax.Array) -> jax.Array:
  """Length of the pattern variant that tokens[b, :length[b]] ends with (0 = none).

  tokens [B, L]; seqs [M, D] padded variants with lens [M] (0 = unused);
  only the last `available[b]` tokens may take part."""
  b, l = tokens.shape
  m, d = seqs.shape
  j = jnp.arange(d)
  # pos[b, m, j]: where pattern token j of variant m must sit.
  pos = length[:, None, None] - lens[None, :, None] + j[None, None, :]
  got = jnp.take_along_axis(tokens, jnp.clip(pos, 0, l - 1).reshape(b, m * d), axis=1)
  got = got.reshape(b, m, d)
  used = j[None, None, :] < lens[None, :, None]
  ok = jnp.all(jnp.where(used, got == seqs[None], True), axis=-1)
  ok &= (lens[None, :] > 0) & (lens[None, :] <= available[:, None])
  return jnp.max(jnp.where(ok, lens[None, :], 0), axis=1)


# Speculation's estimate per row: drafts a verify call accepts for it, a decayed mean
# over its calls (a call with no drafts accepts 0). Verify calls observe it; plain
# iterations run "shadow calls": a row takes drafts, follows them against the tokens
# it draws, and at its first differing token (or the last draft) records what a verify
# call made then would have accepted. So the estimate stays current while the loop does
# not verify, and it is model-free: copying accepts in long runs, which a per-draft
# geometric model would underrate.
CALL_DECAY = 0.9  # weight of the past per (real or shadow) call

# Fields the loop never changes per row (or that are shared by all rows).
_SHARED = ("iteration", "stop_at", "slot", "slot_live", "return_on_free", "knobs", "cache",
           "spec_calls")


def _select_rows(on: jax.Array, new: ReasoningState, old: ReasoningState) -> ReasoningState:
  """Per-row fields from `new` where `on`, else from `old`; shared fields from `new`."""
  pick = lambda a, b: jnp.where(on.reshape(on.shape + (1,) * (a.ndim - 1)), a, b)
  return new.replace(**{f.name: pick(getattr(new, f.name), getattr(old, f.name))
                        for f in dataclasses.fields(ReasoningState) if f.name not in _SHARED})


def _set_row(buf: jax.Array, index: jax.Array, value: jax.Array, mask: jax.Array) -> jax.Array:
  """buf[b, index[b]] = value[b] where mask[b]; indices past the end are dropped."""
  rows = jnp.arange(buf.shape[0])
  idx = jnp.where(mask, index, buf.shape[1])
  return buf.at[rows, idx].set(value.astype(buf.dtype), mode="drop")


def _rolled_back(rollback, length, prompt_len, conf_pos, lp_run, conf_run, low_run, current):
  """(lp_total, conf_sum, lowest_conf, conf_count, conf_ring, group_conf) of the rows after
  their last `rollback` tokens are removed (rows with none keep `current`): the running
  values the last kept token left (by position, so exactly as they were), the count less
  the removed tokens, the window rebuilt from the kept tokens' confidences."""
  # (Gathers of B and B x W values, no branch: a GPU runs a `cond` by waiting for its
  # predicate on the host.)
  b, l = conf_pos.shape
  w = current[4].shape[1]
  rows = jnp.arange(b)
  last = jnp.clip(length - 1, 0, l - 1)
  kept_any = length > prompt_len
  at = lambda run, start: jnp.where(kept_any, run[rows, last], start)
  count = current[3] - rollback
  # The window's slot i holds the c-th confidence, the latest c < count with c % w == i.
  c = count[:, None] - 1 - jnp.mod(count[:, None] - 1 - jnp.arange(w)[None, :], w)
  pos = jnp.clip(length[:, None] - (count[:, None] - c), 0, l - 1)
  ring = jnp.where(c >= 0, conf_pos[rows[:, None], pos], 0.0)
  n_win = jnp.minimum(count, w)
  group = jnp.where(n_win > 0, jnp.sum(ring, axis=1) / jnp.maximum(n_win, 1), jnp.inf)
  new = (at(lp_run, 0.0), at(conf_run, 0.0), at(low_run, jnp.inf), count, ring, group)
  rolled = rollback > 0
  return tuple(jnp.where(rolled.reshape((b,) + (1,) * (x.ndim - 1)), y, x)
               for x, y in zip(current, new))


@dataclasses.dataclass(frozen=True)
class ReasoningLoop:
  """Static configuration of the compiled loop (hashable; jitted with static self).

  model: a DecodeModel (its `program_view`: hashed by what the programs read of it, no
    params; params are the calls' argument). verifier: scores steps.
  answer_probe: compile the answer-confidence probe used for early exit.
  top_k: log-probs averaged into one token confidence (DeepConf).
  vote: compile the answer keys and the consensus stop (DeepConf).
  draft_k: speculation: drafts per row and iteration (0 = off); verify: this loop's
    iterations check them (a verify call each), else they are only observed
    (shadow acceptance; the host picks the loop per call); ngram_max / ngram_min:
    the prompt-lookup n-gram sizes (see `_drafts`).
  draw_kind: what the policy's settings say of every row's draws (`steps.DRAW_KINDS`:
    "greedy" at temperature 0 without a bump, "sampled" without filters): the
    sampler's branches that cannot be taken are left out of the program.
  trips: plain iterations run as a loop of this many (static; `steps.fixed_trip_loops`:
    a GPU) rather than while `_cond` holds: the iterations after it fails idle every
    row, so a call returns after `trips` whatever happened (None: the while loop)."""

  model: DecodeModel
  verifier: Verifier = MeanLogprob()
  answer_probe: bool = False
  top_k: int = 5
  vote: bool = False
  draft_k: int = 0
  verify: bool = False
  ngram_max: int = 4
  ngram_min: int = 1
  draw_kind: str = "any"
  trips: int | None = None

  @property
  def fixed_trips(self) -> int | None:
    """Iterations every call of this loop runs (idle past `_cond`), or None: its plain
    loop under `trips`; verify calls keep the while loop."""
    return None if self.verify else self.trips

  # -- one iteration --------------------------------------------------------------

  def _cond(self, s: ReasoningState) -> jax.Array:
    freed = s.return_on_free & jnp.any(s.slot_live & s.slot_done())
    return (jnp.any(s.phase != S.DONE)  # some row still thinking or answering
            & (s.iteration < s.stop_at)  # this invocation's share of iterations is left
            & ~freed)  # no request finished while another one waits for its slot

  def _probe(self, params, cache, tokens, length, ids, n, skip=None):
    """Runs [last token, probe ids[skip:n]] past the sequence end (skip: [B], default 0);
    returns (probs [B, V] after the probe's last token, cache).

    The probe's K/V land at positions >= length, which the sequence rewrites
    before it can attend to them: the sequence itself is untouched."""
    b, p = tokens.shape[0], ids.shape[0]
    skip = jnp.zeros((b,), jnp.int32) if skip is None else skip
    last = tokens[jnp.arange(b), length - 1]
    rows = jnp.take(ids, jnp.clip(skip[:, None] + jnp.arange(p)[None, :], 0, p - 1))
    seq = jnp.concatenate([last[:, None], rows], axis=1)
    logits, cache = self.model.forward(params, cache, seq, length - 1, n - skip)
    return jax.nn.softmax(logits, axis=-1), cache

  def _read_key(self, k: Knobs, s: ReasoningState, tok, feed, restart):
    """Advances the answer-key automaton over the characters of `tok` where `feed`;
    `restart` (the answer prefix again) starts it over, as extract_number reads
    after the last prefix. Returns (state, key, key_len, key_commit, unknown)."""
    nxt, pre = jnp.asarray(answers.KEY_NEXT), jnp.asarray(answers.KEY_PRE)
    write, commit_t = jnp.asarray(answers.KEY_WRITE), jnp.asarray(answers.KEY_COMMIT)
    st, key, n, commit, unknown = s.key_state, s.key, s.key_len, s.key_commit, s.key_unknown
    cls = k.key_classes[tok]  # [B, C]
    unknown |= feed & k.key_overflow[tok] & (st != S.KEY_DONE)
    for i in range(cls.shape[1]):
      c = cls[:, i]
      on = feed & (c >= 0)
      cc = jnp.maximum(c, 0)
      for j in range(pre.shape[2]):  # codes written before the character's own
        p = pre[st, cc, j]
        key = _set_row(key, n, p, on & (p >= 0))
        n = n + (on & (p >= 0))
      w = on & write[st, cc]
      key = _set_row(key, n, cc, w)
      n = n + w
      commit = jnp.where(w & commit_t[st, cc], n, commit)
      st = jnp.where(on, nxt[st, cc], st)
    unknown |= n > key.shape[1]  # longer than the key capacity
    st = jnp.where(restart, S.KEY_SEARCH, st)
    n = jnp.where(restart, 0, n)
    commit = jnp.where(restart, 0, commit)
    unknown = jnp.where(restart, False, unknown)
    return st, key, n, commit, unknown

  def _decided(self, k: Knobs, s: ReasoningState, phase, exit_reason, known, weight,
               lowest_conf):
    """[B] rows whose request's confidence-weighted vote is decided (see DeepConf).

    Candidates are this batch's rows plus the prior votes of the host. A finished
    row votes (weight = its confidence) unless it was stopped, is below the vote
    floor, kept no token or has a log p that is not finite (the host's "error"; `s`
    holds this iteration's conf_count and lp_total); a running row may still add at
    most its current lowest group confidence (min only falls; +inf before a full
    window), 0 if that is below the floor. Decided: the leader's lead over the runner-up exceeds what the
    running rows and the unknown-key votes could add (stop_decided), or the
    leader holds `consensus` of the cast votes with >= consensus_min voters."""
    b = phase.shape[0]
    done = phase == S.DONE
    voting = k.group >= 0
    voter = (voting & done & (exit_reason != S.EXIT_LOW_CONF)
             & (exit_reason != S.EXIT_CONSENSUS) & (exit_reason != S.EXIT_PRUNED)
             & (weight >= k.vote_floor)
             # A row that kept no token (an end of sequence first) has no text, so no
             # answer on the host (it abstains), and no confidence (+inf: as a wildcard
             # it would block every decision of its request); a row whose log p is not
             # finite is an "error" trace there, with no answer either.
             & (s.conf_count > 0) & jnp.isfinite(s.lp_total))
    bound = jnp.where(jnp.isfinite(lowest_conf), lowest_conf, jnp.inf)
    bound = jnp.where(voting & ~done & (bound >= k.vote_floor), bound, 0.0)
    q = k.prior_group.shape[0]
    group = jnp.concatenate([k.group, k.prior_group])
    f = jnp.concatenate([voter, (k.prior_group >= 0) & (k.prior_weight > 0)])
    w = jnp.where(f, jnp.concatenate([weight, k.prior_weight]), 0.0)
    kn = f & jnp.concatenate([known, k.prior_known])
    width = max(s.key.shape[1], k.prior_key.shape[1])
    pad = lambda x: jnp.pad(x, ((0, 0), (0, width - x.shape[1])))
    ln = jnp.concatenate([s.key_commit, k.prior_key_len])
    keys = jnp.concatenate([pad(s.key), pad(k.prior_key)])
    keys = jnp.where(jnp.arange(width)[None, :] < ln[:, None], keys, -1)
    same = (group[:, None] == group[None, :]) & (group[:, None] >= 0)
    agree = (same & kn[:, None] & kn[None, :]
             & jnp.all(keys[:, None, :] == keys[None, :, :], axis=-1))
    votes = jnp.sum(jnp.where(agree, w[None, :], 0.0), axis=1)  # for candidate i's answer
    rival = jnp.max(jnp.where(same & ~agree & kn[None, :], votes[None, :], 0.0), axis=1)
    running = jnp.concatenate([bound, jnp.zeros((q,))])
    wild = jnp.where(f & ~kn, w, 0.0)
    slack = jnp.sum(jnp.where(same, (running + wild)[None, :], 0.0), axis=1)
    total = jnp.sum(jnp.where(same, w[None, :], 0.0), axis=1)
    count = jnp.sum(same & f[None, :], axis=1)
    # A request's settings, read from its rows (priors have none of their own).
    of_rows = same[:, :b]
    stop_decided = jnp.any(of_rows & k.stop_decided[None, :], axis=1)
    tau = jnp.min(jnp.where(of_rows, k.consensus[None, :], jnp.inf), axis=1)
    min_votes = jnp.max(jnp.where(of_rows, k.consensus_min[None, :], 0), axis=1)
    # The lead must beat every rival even if all the slack went to it (strict: no ties).
    sure = stop_decided & (votes - rival > slack)
    share = (votes >= tau * total) & (count >= min_votes)
    decided = kn & (votes > 0) & (sure | share)
    row_decided = jnp.any(same & decided[None, :], axis=1)[:b]
    return voting & row_decided

  def _step(self, params, s: ReasoningState) -> ReasoningState:
    """One iteration: plain (the decode loop's: one token per running row), or with
    `verify` a verify call. The host picks the loop per call: a `lax.cond` between the
    two inside the loop made XLA copy the KV cache every iteration (+30% per step on a
    CPU)."""
    return self._iteration(ReasoningRows(self, params), s)

  def _iteration(self, rows: "ReasoningRows", s: ReasoningState) -> ReasoningState:
    if self.verify:
      return self._verify(rows.params, s, *self._drafts(s))
    return steps.decode_iteration(rows, s)

  def _draw(self, s: ReasoningState) -> steps.Draw:
    """How each row draws token `length`: key fold_in(fold_in(base, attempt), position),
    temperature + bump x (backtracks of this step), its policy's filters."""
    k = s.knobs
    return steps.Draw(keys=jax.vmap(jax.random.fold_in)(s.keys, s.backtracks), steps=s.length,
                      temperature=k.temperature + k.temp_bump * s.step_bt.astype(jnp.float32),
                      top_k=k.top_k, top_p=k.top_p, min_p=k.min_p, kind=self.draw_kind)

  def _shadow(self, s: ReasoningState, new: ReasoningState, drafts, available,
              running: jax.Array):
    """Advances the shadow call of each `running` row by the token it just drew."""
    kd = self.draft_k
    rows = jnp.arange(s.tokens.shape[0])
    fresh = running & (s.shadow_len == 0)
    draft = jnp.where(fresh[:, None], drafts, s.shadow_draft)
    count = jnp.where(fresh, available, s.shadow_len)
    pos = jnp.where(fresh, 0, s.shadow_pos)
    drawn = new.tokens[rows, jnp.clip(s.length, 0, s.tokens.shape[1] - 1)]
    moved = new.length == s.length + 1
    hit = running & moved & (pos < count) & (
        drawn == jnp.take_along_axis(draft, jnp.clip(pos, 0, kd - 1)[:, None], axis=1)[:, 0])
    pos = pos + hit
    ends = running & (~hit | (pos >= count))  # the call would end at this token
    return new.replace(
        shadow_draft=draft, shadow_len=jnp.where(ends, 0, count),
        shadow_pos=jnp.where(ends, 0, pos),
        spec_acc=jnp.where(ends, CALL_DECAY * s.spec_acc + pos, s.spec_acc),
        spec_calls_row=jnp.where(ends, CALL_DECAY * s.spec_calls_row + 1.0, s.spec_calls_row))

  # -- speculation (prompt lookup, verified in one forward) ------------------------

  def _drafts(self, s: ReasoningState) -> tuple[jax.Array, jax.Array]:
    """(drafts [B, K], available [B]): a row inside a forced run drafts the rest of
    it (exact); any other running row drafts by prompt lookup over its own tokens
    (prompt and generated): the continuation of the most recent earlier occurrence
    of its longest matching suffix n-gram (ngram_max .. ngram_min), as the engine's
    `prompt_lookup` on the host."""
    kd = self.draft_k
    b, l = s.tokens.shape
    rows = jnp.arange(b)
    pos = jnp.arange(l)[None, :]
    length = s.length[:, None]
    match = jnp.ones((b, l), bool)  # window ending at e equals the suffix so far
    end = jnp.full((b,), -1, jnp.int32)  # end of the chosen earlier occurrence
    for j in range(self.ngram_max):
      shifted = jnp.pad(s.tokens, ((0, 0), (j, 0)), constant_values=-1)[:, :l]  # tokens[e - j]
      match &= shifted == s.tokens[rows, jnp.maximum(s.length - 1 - j, 0)][:, None]
      if j + 1 >= self.ngram_min:
        ok = match & (pos >= j) & (pos < length - 1)  # strictly earlier, a continuation after
        at = jnp.max(jnp.where(ok, pos, -1), axis=1)
        end = jnp.where(at >= 0, at, end)  # a longer n-gram overrides a shorter one
    start = end + 1
    available = jnp.where(end >= 0, jnp.minimum(kd, s.length - start), 0)
    drafts = jnp.take_along_axis(s.tokens, jnp.clip(start[:, None] + jnp.arange(kd), 0, l - 1),
                                 axis=1)
    f = s.force_buf.shape[1]
    forcing = s.force_pos < s.force_len
    forced = jnp.take_along_axis(s.force_buf,
                                 jnp.clip(s.force_pos[:, None] + jnp.arange(kd), 0, f - 1), axis=1)
    drafts = jnp.where(forcing[:, None], forced, drafts)
    available = jnp.where(forcing, jnp.minimum(kd, s.force_len - s.force_pos), available)
    return drafts, jnp.where(s.phase != S.DONE, available, 0)

  def _verify(self, params, s: ReasoningState, drafts: jax.Array,
              available: jax.Array) -> ReasoningState:
    """One forward over [last token, drafts] of every row, then `_advance` once per
    position while a row's token equals its draft there. A row leaves the run at
    its first token that differs from its draft (that token is still the one plain
    decoding draws: its logits came from the tokens before it), at a rollback or an
    end, and every row leaves after a probe (it writes past the sequence ends,
    where the drafts' K/V are). Draws use the same per-position keys as plain
    steps, so the rows get the tokens plain decoding gives them."""
    kd = self.draft_k
    b, l = s.tokens.shape
    rows = jnp.arange(b)
    live = s.phase != S.DONE
    last = s.tokens[rows, s.length - 1]
    seq = jnp.concatenate([last[:, None], drafts], axis=1)
    logits_all, cache = self.model.forward_all(params, s.cache, seq, s.length - 1,
                                               1 + jnp.where(live, available, 0))

    def cond(c):
      j, _, on, _ = c
      return (j <= kd) & jnp.any(on)

    def body(c):
      j, st, on, accepted = c
      logits = jnp.take(logits_all, j, axis=1)
      new, probed = self._advance(params, st, logits, on,
                                  steps.draw_tokens(logits, self._draw(st)), truncate=False)
      emitted = new.tokens[rows, jnp.clip(st.length, 0, l - 1)]
      draft = jnp.take(drafts, jnp.minimum(j, kd - 1), axis=1)
      matched = on & (new.length == st.length + 1) & (j < available) & (emitted == draft)
      st = _select_rows(on, new, st)
      return j + 1, st, matched & (st.phase != S.DONE) & ~probed, accepted + matched

    _, st, _, accepted = jax.lax.while_loop(
        cond, body, (jnp.int32(0), s.replace(cache=cache), live, jnp.zeros((b,), jnp.int32)))
    drafted = jnp.where(live, available, 0)
    return st.replace(
        cache=self.model.truncate(st.cache, st.length), iteration=s.iteration + 1,
        spec_calls=s.spec_calls + 1, spec_drafted=s.spec_drafted + drafted,
        spec_accepted=s.spec_accepted + accepted,
        spec_acc=jnp.where(live, CALL_DECAY * s.spec_acc + accepted, s.spec_acc),
        spec_calls_row=jnp.where(live, CALL_DECAY * s.spec_calls_row + 1.0, s.spec_calls_row),
        shadow_len=jnp.zeros_like(s.shadow_len))  # a plain call starts its shadows afresh

  # -- one token ------------------------------------------------------------------

  def _advance(self, params, s: ReasoningState, logits: jax.Array, live: jax.Array,
               drawn: jax.Array, truncate: bool = True) -> tuple[ReasoningState, jax.Array]:
    """Steps 2-7 for the rows in `live` given the logits of their next token and
    the token each row drew from them (`_draw`).
    Returns (state, whether a probe ran: it writes past every row's end).
    truncate=False leaves the cache's truncation to the caller (a verify call
    keeps its drafts' K/V until it knows its final lengths)."""
    k: Knobs = s.knobs
    b, l = s.tokens.shape
    rows = jnp.arange(b)
    f = s.force_buf.shape[1]
    active = (s.phase != S.DONE) & live
    think = active & (s.phase == S.THINK)
    answer = active & (s.phase == S.ANSWER)
    cache = s.cache
    logp = jax.nn.log_softmax(logits, axis=-1)

    # 2. an open force queue overrides the draw.
    forcing = active & (s.force_pos < s.force_len)  # a row outside `live` keeps its queue
    tok = jnp.where(forcing, s.force_buf[rows, jnp.clip(s.force_pos, 0, f - 1)], drawn)
    force_buf, force_pos, force_len = s.force_buf, s.force_pos + forcing, s.force_len

    def start_forcing(mask, ids, n, tok, buf, pos, ln, first_now, skip=0):
      """Opens a force queue of ids[skip:n] (skip: [B] or a scalar); first_now emits
      ids[skip] in this iteration."""
      tok = jnp.where(mask & first_now, jnp.take(ids, skip), tok)
      buf = jnp.where(mask[:, None], ids[None, :], buf)
      pos = jnp.where(mask, skip + jnp.where(first_now, 1, 0), pos)
      ln = jnp.where(mask, n, ln)
      return tok, buf, pos, ln

    def answer_skip(tokens, length):
      """The forced answer's separator is skipped after a token ending in whitespace."""
      last = tokens[rows, jnp.maximum(length - 1, 0)]
      return jnp.where(k.ends_in_space[last], k.answer_separator_len, 0)

    # A thinking budget spent before this token (max_thinking_tokens 0, or a request's room
    # cut to 0): the answer is forced now, not after one more thinking token (step 6).
    spent = think & ~forcing & (s.think_tokens >= k.max_think)
    tok, force_buf, force_pos, force_len = start_forcing(
        spent, k.answer_ids, k.answer_len, tok, force_buf, force_pos, force_len, True,
        answer_skip(s.tokens, s.length))
    is_eos = k.eos_mask[tok] & ~forcing & ~spent

    # 3. end of sequence while thinking: "Wait" below the minimum (if the whole "Wait"
    # still fits the thinking budget), else end / answer.
    wait_fits = s.think_tokens + k.wait_len <= k.max_think
    wait_now = think & is_eos & (s.think_tokens < k.min_think) & wait_fits
    tok, force_buf, force_pos, force_len = start_forcing(
        wait_now, k.wait_ids, k.wait_len, tok, force_buf, force_pos, force_len, True)
    eos_think = think & is_eos & ~wait_now
    eos_to_answer = eos_think & k.answer_on_eos
    tok, force_buf, force_pos, force_len = start_forcing(
        eos_to_answer, k.answer_ids, k.answer_len, tok, force_buf, force_pos, force_len, True,
        answer_skip(s.tokens, s.length))
    finish_eos = (eos_think & ~k.answer_on_eos) | (answer & is_eos)
    to_answer = eos_to_answer | spent  # the answer prefix's first token is this one

    # 4. append and count.
    append = active & ~finish_eos
    tokens = _set_row(s.tokens, s.length, tok, append)
    length = s.length + append
    in_think = append & think & ~to_answer
    in_answer = append & (answer | to_answer)
    tok_lp = logp[rows, tok]
    step_len = s.step_len + in_think
    step_lp = s.step_lp + jnp.where(in_think, tok_lp, 0.0)
    think_tokens = s.think_tokens + in_think
    answer_tokens = s.answer_tokens + in_answer
    # Forced tokens in the answer phase are always the answer prefix ("Wait" is only
    # forced while thinking); eos_to_answer emits its first prefix token right now.
    prefix_now = in_answer & (forcing | to_answer)
    prefix_tokens = s.prefix_tokens + prefix_now
    generated = s.generated + append
    lp_total = s.lp_total + jnp.where(append, tok_lp, 0.0)
    answer_start = jnp.where(to_answer, s.length, s.answer_start)
    phase = jnp.where(to_answer, S.ANSWER, s.phase)
    # DeepConf token confidence: -mean of the top-k log-probs.
    conf = -jnp.mean(jax.lax.top_k(logp, self.top_k)[0], axis=-1)
    w = s.conf_ring.shape[1]
    conf_ring = _set_row(s.conf_ring, s.conf_count % w, conf, append)
    conf_count = s.conf_count + append
    conf_sum = s.conf_sum + jnp.where(append, conf, 0.0)
    n_win = jnp.minimum(conf_count, w)
    group_conf = jnp.where(n_win > 0, jnp.sum(conf_ring, axis=1) / jnp.maximum(n_win, 1), jnp.inf)
    full = append & (conf_count >= w)
    lowest_conf = jnp.where(full, jnp.minimum(s.lowest_conf, group_conf), s.lowest_conf)
    # Each appended token's confidence and the running values after it, by position: a
    # rollback restores them as they were before its first removed token (`_rolled_back`).
    conf_pos = _set_row(s.conf_pos, s.length, conf, append)
    lp_run = _set_row(s.lp_run, s.length, lp_total, append)
    conf_run = _set_row(s.conf_run, s.length, conf_sum, append)
    low_run = _set_row(s.low_run, s.length, lowest_conf, append)

    # 5. step boundary (never inside a forced run such as "Wait").
    pending = force_pos < force_len
    can_end = in_think & ~pending
    delim = tail_match(tokens, length, k.delim_seqs, k.delim_lens, step_len) > 0
    delim |= k.delim_mask[tok]
    prefix_n = tail_match(tokens, length, k.prefix_seqs, k.prefix_lens, think_tokens)
    prefix_hit = can_end & (prefix_n > 0)
    # The model wrote the answer prefix below the thinking minimum: roll it back, "Wait"
    # (unless "Wait" would overrun the thinking budget: then the answer stands).
    kept_think = think_tokens - prefix_n
    prefix_early = (prefix_hit & (kept_think < k.min_think)
                    & (kept_think + k.wait_len <= k.max_think))
    model_answer = prefix_hit & ~prefix_early
    boundary = can_end & (delim | (step_len >= k.step_cap)) & ~prefix_hit
    # The step the model ends by writing the answer prefix is a step like the others
    # (docs/controller.md, step 3), where a rejection could still send it back: its prefix
    # goes, the step is scored as it stood before it (a probe reads it there), an accepted
    # step gets the answer prefix forced (as at the step limit) and a rejected one is
    # backtracked. (It went to the answer unscored: on the embedded model 3 of 8 GSM
    # traces verified no step at all.)
    final = (model_answer & (step_len > prefix_n)  # (a step of its own before the prefix)
             & (k.bt_threshold > 0) & (s.step_bt < k.max_step_bt) & (s.backtracks < k.max_bt))
    model_answer = model_answer & ~final
    final_prefix = jnp.where(final, prefix_n, 0)
    lp_with_prefix = lp_total
    length = length - final_prefix
    think_tokens = think_tokens - final_prefix
    lp_total, conf_sum, lowest_conf, conf_count, conf_ring, group_conf = _rolled_back(
        final_prefix, length, s.prompt_len, conf_pos, lp_run, conf_run, low_run,
        (lp_total, conf_sum, lowest_conf, conf_count, conf_ring, group_conf))
    step_len = step_len - final_prefix
    step_lp = step_lp - (lp_with_prefix - lp_total)
    boundary = boundary | final

    p_yes = jnp.full((b,), jnp.nan)
    answer_conf = jnp.zeros((b,))
    probed_conf = jnp.full((b,), jnp.nan)  # recorded with the step: what an early exit read
    probe_tokens = s.probe_tokens
    probing = boundary & ~final & (s.step_index + 1 < k.max_steps)
    probed = jnp.zeros((), bool)
    if self.verifier.needs_probe:
      probed |= jnp.any(boundary)
      def verify(c):
        probs, c = self._probe(params, c, tokens, length, k.probe_ids, k.probe_len)
        return probs[:, k.yes_id] / (probs[:, k.yes_id] + probs[:, k.no_id] + 1e-30), c
      p_yes, cache = jax.lax.cond(jnp.any(boundary), verify, lambda c: (p_yes, c), cache)
      probe_tokens += jnp.where(boundary, k.probe_len, 0)
    if self.answer_probe:
      wants = probing & (k.exit_tau <= 1.0)
      probed |= jnp.any(wants)
      skip = answer_skip(tokens, length)  # the probe reads what forcing would write
      def confidence(c):
        """The probability of the answer's first token (of the greedy answer): past the
        prefix, and past a whitespace token there (SmolLM2 writes " " before a number's
        digits: its ~0.95 was the "confidence" of every half-done step)."""
        probs, c = self._probe(params, c, tokens, length, k.answer_probe_ids, k.answer_probe_len,
                               skip)
        first, p_first = jnp.argmax(probs, axis=-1), jnp.max(probs, axis=-1)
        blank = wants & k.blank[first]

        def past_blank(c):
          after = length + k.answer_probe_len - skip  # the position after the probe's last
          logits, c = self.model.forward(params, c, first[:, None], after, jnp.zeros_like(after))
          return p_first * jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1), c
        conf, c = jax.lax.cond(jnp.any(blank), past_blank, lambda c: (p_first, c), c)
        return jnp.where(blank, conf, p_first), blank, c
      answer_conf, blank, cache = jax.lax.cond(
          jnp.any(wants), confidence, lambda c: (answer_conf, jnp.zeros((b,), bool), c), cache)
      answer_conf = jnp.where(wants, answer_conf, 0.0)
      probed_conf = jnp.where(wants, answer_conf, jnp.nan)
      probe_tokens += jnp.where(wants, k.answer_probe_len - skip + blank, 0)
    score = self.verifier.score(StepStats(lp_sum=step_lp, n_tokens=step_len, group_conf=group_conf,
                                          lowest_conf=lowest_conf, p_yes=p_yes))
    score = score.astype(jnp.float32)

    backtrack = (boundary
                 & (score < k.bt_threshold)  # the verifier rejects the step
                 & (s.step_bt < k.max_step_bt)  # this step may still be retried
                 & (s.backtracks < k.max_bt))  # and the sequence's total allows it
    accept = boundary & ~backtrack
    # (only where the answer probe ran: with exit_tau <= 0 an unprobed step's 0 read as
    # an early exit)
    exit_early = accept & probing & (k.exit_tau <= 1.0) & (answer_conf >= k.exit_tau)
    out_of_steps = accept & ~exit_early & (s.step_index + 1 >= k.max_steps)

    # Backtrack: roll the row back to its step start; the attempt counter gives a fresh key.
    rollback = jnp.where(backtrack, step_len, 0) + jnp.where(prefix_early, prefix_n, 0)
    length = length - rollback
    think_tokens = think_tokens - rollback
    discarded = s.discarded + rollback + final_prefix
    # The removed tokens leave the log p and the confidences too (they stayed in the
    # trace's mean log p and confidences, and a retried step was scored with the rejected
    # attempt's window).
    lp_kept = lp_total
    lp_total, conf_sum, lowest_conf, conf_count, conf_ring, group_conf = _rolled_back(
        rollback, length, s.prompt_len, conf_pos, lp_run, conf_run, low_run,
        (lp_total, conf_sum, lowest_conf, conf_count, conf_ring, group_conf))
    if truncate:
      cache = self.model.truncate(cache, length)
    step_bt = jnp.where(backtrack, s.step_bt + 1, jnp.where(accept, 0, s.step_bt))
    backtracks = s.backtracks + backtrack
    step_len = jnp.where(backtrack | accept, 0, step_len - jnp.where(prefix_early, prefix_n, 0))
    step_len = jnp.maximum(step_len, 0)
    step_lp = jnp.where(backtrack | accept, 0.0, step_lp - jnp.where(prefix_early,
                                                                     lp_kept - lp_total, 0.0))
    step_index = s.step_index + accept
    step_end = length  # after a rollback: the new end
    rec_start_val = s.step_start
    step_start = jnp.where(accept, length, s.step_start)
    # Model-written prefix: its tokens belong to the answer.
    think_tokens = think_tokens - jnp.where(model_answer, prefix_n, 0)
    answer_tokens = answer_tokens + jnp.where(model_answer, prefix_n, 0)
    prefix_tokens = prefix_tokens + jnp.where(model_answer, prefix_n, 0)
    answer_start = jnp.where(model_answer, length - prefix_n, answer_start)
    phase = jnp.where(model_answer, S.ANSWER, phase)
    # The model closed its thinking span itself: the answer prefix follows it (forced).
    _, force_buf, force_pos, force_len = start_forcing(
        model_answer & (k.after_close_len > 0), k.after_close_ids, k.after_close_len, tok,
        force_buf, force_pos, force_len, False)
    waits = s.waits + wait_now + prefix_early
    _, force_buf, force_pos, force_len = start_forcing(
        prefix_early, k.wait_ids, k.wait_len, tok, force_buf, force_pos, force_len, False)

    key_fields = {}
    if self.vote:
      # The answer key reads every answer token after the prefix; the prefix again
      # (written by the model inside its answer) restarts it.
      body = in_answer & ~prefix_now
      again = body & (tail_match(tokens, length, k.restart_seqs, k.restart_lens,
                                 answer_tokens - prefix_tokens) > 0)
      key_fields = dict(zip(("key_state", "key", "key_len", "key_commit", "key_unknown"),
                            self._read_key(k, s, tok, body, again)))

    # 6. budgets.
    thinking_now = active & (phase == S.THINK)  # (a window ending here is a thinking one)
    still_thinking = thinking_now & ~pending & ~prefix_early
    over_think = still_thinking & (think_tokens >= k.max_think) & ~exit_early & ~out_of_steps
    force_answer = exit_early | out_of_steps | over_think | (final & accept)
    _, force_buf, force_pos, force_len = start_forcing(
        force_answer, k.answer_ids, k.answer_len, tok, force_buf, force_pos, force_len, False,
        answer_skip(tokens, length))
    answer_start = jnp.where(force_answer, length, answer_start)
    phase = jnp.where(force_answer, S.ANSWER, phase)
    low_conf = (thinking_now  # only thinking is cut short (its last window too)
                & (conf_count >= w)  # a full window was seen
                & (group_conf < k.conf_stop))  # below this trace's threshold
    # The answer budget counts only what follows the prefix, so a long prefix (13 byte
    # tokens for "The answer is") cannot eat the answer.
    answer_full = append & (phase == S.ANSWER) & (answer_tokens - prefix_tokens >= k.max_answer)
    answer_full &= ~(force_len > force_pos)  # the forced prefix always completes
    # Room for a probe (and a verify call's drafts) past the end: the controller sizes
    # the rows for both, so this is a safety net, not a budget.
    too_long = active & ((length + s.knobs.probe_ids.shape[0] + 2 + self.draft_k >= l)
                         | (generated >= k.max_generated))
    exit_reason = s.exit_reason
    for cond, code in ((too_long, S.EXIT_LENGTH), (answer_full, S.EXIT_ANSWER_BUDGET),
                       (low_conf, S.EXIT_LOW_CONF), (finish_eos & think, S.EXIT_EOS),
                       (finish_eos & answer, S.EXIT_ANSWER_EOS)):
      exit_reason = jnp.where(cond & (exit_reason == S.RUNNING), code, exit_reason)
    finished = active & (exit_reason != S.RUNNING)
    phase = jnp.where(finished, S.DONE, phase)

    # 7. consensus (DeepConf): stop the running rows of a request whose vote is decided.
    consensus = jnp.zeros((b,), bool)
    if self.vote:
      known = (answer_start >= 0) & (key_fields["key_state"] >= S.KEY_INT)
      known &= ~key_fields["key_unknown"]
      weight = jnp.where(jnp.isfinite(lowest_conf), lowest_conf, group_conf)
      decided = self._decided(k, s.replace(conf_count=conf_count, lp_total=lp_total,
                                           **key_fields), phase,
                              exit_reason, known, weight, lowest_conf)
      consensus = decided & active & (phase != S.DONE)
      exit_reason = jnp.where(consensus, S.EXIT_CONSENSUS, exit_reason)
      phase = jnp.where(consensus, S.DONE, phase)

    # One record per event, highest priority first.
    action = jnp.full((b,), -1, jnp.int32)
    for cond, code in ((finish_eos & think, S.END), (low_conf, S.LOW_CONF_STOP),
                       (consensus, S.CONSENSUS_STOP),
                       (over_think & ~boundary, S.THINK_BUDGET), (wait_now | prefix_early, S.WAIT),
                       (model_answer | (final & accept), S.MODEL_ANSWER),
                       (accept & over_think, S.THINK_BUDGET),
                       (exit_early, S.EARLY_EXIT), (out_of_steps, S.ANSWER_STEPS),
                       (backtrack, S.BACKTRACK), (accept, S.CONTINUE)):
      action = jnp.where(cond & (action < 0), code, action)
    record = action >= 0
    scored = boundary
    rec_end_val = jnp.where(backtrack, s.length + 1, step_end)  # backtrack: the discarded span
    rec_end_val = jnp.where(finish_eos, s.length, rec_end_val)
    return s.replace(
        tokens=tokens, length=length, phase=phase, step_index=step_index, step_start=step_start,
        step_len=step_len, step_lp=step_lp, step_bt=step_bt, backtracks=backtracks,
        think_tokens=think_tokens, answer_tokens=answer_tokens, prefix_tokens=prefix_tokens,
        probe_tokens=probe_tokens,
        discarded=discarded, waits=waits, generated=generated, lp_total=lp_total, answer_start=answer_start,
        conf_ring=conf_ring, conf_count=conf_count, conf_sum=conf_sum, lowest_conf=lowest_conf,
        conf_pos=conf_pos, lp_run=lp_run, conf_run=conf_run, low_run=low_run,
        exit_reason=exit_reason, early_exit=s.early_exit | exit_early, force_buf=force_buf,
        force_pos=force_pos, force_len=force_len,
        rec_start=_set_row(s.rec_start, s.n_rec, rec_start_val, record),
        rec_end=_set_row(s.rec_end, s.n_rec, rec_end_val, record),
        rec_score=_set_row(s.rec_score, s.n_rec, jnp.where(scored, score, jnp.nan), record),
        rec_conf=_set_row(s.rec_conf, s.n_rec, probed_conf, record),
        rec_action=_set_row(s.rec_action, s.n_rec, action, record),
        n_rec=s.n_rec + record, cache=cache, **key_fields), probed

  # -- drivers --------------------------------------------------------------------

  @compilation_cache.jit(static_argnames=("self",), donate_argnames=("state",))
  def run(self, params, state: ReasoningState) -> ReasoningState:
    """The decode loop (`steps.run_rows`) over these rows until all are done or stop_at
    (or `trips` iterations, the later ones idle)."""
    return steps.run_rows(ReasoningRows(self, params), state, self._iteration,
                          trips=self.fixed_trips)

  @compilation_cache.jit(static_argnames=("self",))
  def step(self, params, state: ReasoningState) -> ReasoningState:
    return self._step(params, state)

  def run_python(self, params, state: ReasoningState,
                 on_step: Callable[[ReasoningState], None] | None = None) -> ReasoningState:
    """Debugging twin of `run`: the same `_step`, one jitted iteration per host call."""
    while bool(self._cond(state)):
      state = self.step(params, state)
      if on_step is not None:
        on_step(state)
    return state


@dataclasses.dataclass(frozen=True)
class ReasoningRows:
  """The controller's row program for the decode loop (`steps.RowProgram`): every row
  feeds its last token (rows that are done too: their write lands past their end,
  where nothing reads it), the live rows draw and `_advance` (steps 2-7); with
  speculation the drawn tokens also advance the shadow calls (`_shadow`)."""

  loop: ReasoningLoop
  params: object

  def more(self, s: ReasoningState) -> jax.Array:
    return self.loop._cond(s)

  def _going(self, s: ReasoningState):
    """Under fixed trips: whether this iteration is a real one ([] bool); else None
    (the while loop runs only those)."""
    return self.loop._cond(s) if self.loop.fixed_trips else None

  def _live(self, s: ReasoningState, going) -> jax.Array:
    live = s.phase != S.DONE
    return live if going is None else live & going

  def feed(self, s: ReasoningState):
    last = s.tokens[jnp.arange(s.tokens.shape[0]), s.length - 1]
    return last, s.length - 1, self._live(s, self._going(s)), self.loop._draw(s)

  def forward(self, s: ReasoningState, tokens, positions, live):
    logits, cache = self.loop.model.forward(self.params, s.cache, tokens[:, None], positions,
                                            jnp.zeros_like(positions))
    return logits, s.replace(cache=cache)

  def advance(self, s: ReasoningState, logits, drawn) -> ReasoningState:
    going = self._going(s)
    live = self._live(s, going)
    new, _ = self.loop._advance(self.params, s, logits, live, drawn)
    if self.loop.draft_k:  # (an idle iteration's rows draw nothing to check)
      new = self.loop._shadow(s, new, *self.loop._drafts(s), live)
    step = 1 if going is None else going.astype(jnp.int32)
    return new.replace(iteration=s.iteration + step)
