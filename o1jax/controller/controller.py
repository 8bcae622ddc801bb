"""Host side of the controller: requests in, reasoning traces out.

`Controller.generate` is the primitive every policy uses:

  1. encode the prompts; an empty `ReasoningState` of G = max(1, max_rows // n)
     request slots of n rows (sample j of the request in slot g is row g * n + j;
     rows are padded to a power of two so programs are reused);
  2. `admit` the first G requests: each prompt is prefilled once into its
     slot's first row and shared by the slot's other rows; the rows start fresh
     (knobs from `LoopSettings`, keys from (seed, request id, sample index));
  3. call the jitted while_loop. It returns when every row is done, after
     `iterations_per_call` iterations (adaptive step budget), or, while
     requests wait, as soon as one request's rows are all done: the host reads
     the state once, decodes that request's rows into `Trace`s (steps, scores,
     actions, token accounting, confidences) and admits the next request into
     the freed slot; repeat until every request is done.

`Controller.run(requests, policy)` hands the requests to a policy (see
policies.py), which calls `generate` one or more times and aggregates.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from o1jax.checkpoint.tokenizer import continuation_text, token_texts
from o1jax import compilation_cache
from o1jax.compilation_cache import release_programs_near_map_limit
from o1jax.controller import answers
from o1jax.controller import state as S
from o1jax.model import thinking as thinking_lib
from o1jax.controller.answers import extract_number
from o1jax.controller.decode_model import (CachePlan, DecodeModel, check_pool_holds_request,
                                         program_view)
from o1jax.controller.loop import ReasoningLoop
from o1jax.controller.registry import BasePolicy, build_policy, policy_names
from o1jax.controller.results import (ReasoningRequest, ReasoningResult, StepRecord, TokenCounts,
                                      Trace)
from o1jax.controller.state import Knobs, ReasoningState
from o1jax.model.thinking import ThinkingSpan
from o1jax.sharding import tensor_parallel
from o1jax.controller.verifiers import (MeanLogprob, SelfVerify, Verifier,
                                       check_backtrack_threshold)
from o1jax.engine import steps
from o1jax.engine.budget import BudgetLoop
from o1jax.engine.engine import check_fits_device
from o1jax.engine.speculative import SpeculativeConfig
from o1jax.model.generation import encode_prompt
from o1jax.model.llama import Llama
from o1jax.model.sampling import (INT32_MAX, MAX_TEMPERATURE, MIN_TEMPERATURE, Sampling, check_int,
                                  check_sample_index, is_real, sequence_key)
from o1jax.model.shapes import pow2_bucket

log = logging.getLogger(__name__)

NEVER = 1 << 30
# Loop iterations per call while the host chooses verifying or plain calls: 16 after a
# change of mind, doubling while the choice stays the same (each call costs a host
# round trip; on a CPU, ~25 ms measured at batch 8, against ~30 ms per iteration).
# Plain calls of fixed trips (a GPU) run FIXED_TRIPS at most.
SPEC_INTERVAL, SPEC_INTERVAL_MAX = 16, 128
# Plain iterations per call where loops run fixed trips (a GPU: `steps.fixed_trip_loops`):
# the iterations after the rows' call ends (done, a freed slot, stop_at) still run, idle;
# 8 bounds that waste to what a first budgeted call runs anyway.
FIXED_TRIPS = 8


ADMISSIONS = ("fifo", "shortest_budget")  # Controller(admission=...)
# LoopSettings' counts and their least values.
_LOOP_INTS = {"max_step_backtracks": 0, "max_backtracks": 0, "step_max_tokens": 1, "max_steps": 1,
              "min_thinking_tokens": 0, "max_thinking_tokens": 0, "max_answer_tokens": 1,
              "conf_window": 1, "consensus_min_votes": 1}


# The log-probs a token confidence averages (DeepConf's top-k), unless a controller is
# given another.
CONFIDENCE_TOP_K = 5


@dataclasses.dataclass(frozen=True)
class LoopSettings(Sampling):
  """Everything one `generate` call varies; policies build these from their params.
  Sampling (temperature, top_k, top_p, min_p) is `o1jax.model.sampling.Sampling`'s,
  checked there; seeds are per request (`ReasoningRequest.seed`)."""

  temp_bump: float = 0.0  # added to the temperature per backtrack of the current step
  backtrack_threshold: float = -math.inf  # backtrack a step whose score is below
  max_step_backtracks: int = 0
  max_backtracks: int = 0
  step_delimiter: str = "\n\n"
  step_max_tokens: int = 64
  max_steps: int = NEVER
  min_thinking_tokens: int = 0
  max_thinking_tokens: int = 256
  max_answer_tokens: int = 16
  answer_prefix: str = "The answer is"
  wait_text: str = " Wait"
  answer_on_eos: bool = False  # end of sequence while thinking -> force the answer prefix
  exit_tau: float = 2.0  # > 1 disables early exit
  conf_window: int = 16  # DeepConf group window (a shape: changing it recompiles)
  verifier: Verifier = MeanLogprob()
  answer_probe: bool = False  # compile the answer-confidence probe (needed for exit_tau)
  # Vote inside the loop (DeepConf): answer keys per row, and the consensus stop.
  answer_vote: bool = False  # compile the answer keys and the consensus stop
  consensus_share: float = 2.0  # stop a request's rows once its leader holds this share (> 1 off)
  consensus_min_votes: int = 1  # ... of at least this many votes
  stop_when_decided: bool = False  # stop once the running rows cannot change the winner

  def __post_init__(self):
    super().__post_init__()
    # Every knob is checked here, once, for every policy: a float count or a str flag
    # failed inside the jitted loop's setup, a NaN threshold silently turned a rule off.
    for name, low in _LOOP_INTS.items():
      check_int(getattr(self, name), name, low)
      if getattr(self, name) > INT32_MAX:  # (an int32 knob on the device: it wrapped around)
        raise ValueError(f"{name}={getattr(self, name)} exceeds the loop's int32 counters "
                         f"({INT32_MAX})")
    for name in ("temp_bump", "backtrack_threshold", "exit_tau", "consensus_share"):
      value = getattr(self, name)
      if not is_real(value) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not 0 <= self.temp_bump < math.inf:  # a negative bump would reach greedy on a retry
      raise ValueError(f"temp_bump must be finite and >= 0, got {self.temp_bump}")
    retries = min(self.max_step_backtracks, self.max_backtracks)  # a step's, at most
    if self.temp_bump and retries:
      # A retry draws at temperature + bump x (backtracks of the step): that, too, must be
      # a temperature the device can use (see Sampling's range).
      hottest = self.temperature + self.temp_bump * retries
      if self.temperature + self.temp_bump < MIN_TEMPERATURE or hottest > MAX_TEMPERATURE:
        raise ValueError(f"temp_bump={self.temp_bump} gives retry temperatures outside "
                         f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (temperature "
                         f"{self.temperature}, up to {retries} backtracks a step)")
    for name in ("step_delimiter", "answer_prefix", "wait_text"):
      if not isinstance(getattr(self, name), str):
        raise ValueError(f"{name} must be a str, got {getattr(self, name)!r}")
    for name in ("answer_on_eos", "answer_probe", "answer_vote", "stop_when_decided"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if not isinstance(self.verifier, Verifier):
      raise ValueError(f"verifier must be a Verifier, got {self.verifier!r}")
    if self.min_thinking_tokens > self.max_thinking_tokens:
      raise ValueError(f"min_thinking_tokens {self.min_thinking_tokens} > max_thinking_tokens "
                       f"{self.max_thinking_tokens}")
    if self.min_thinking_tokens and not self.wait_text:
      # Nothing would replace an early end of thinking: the trace runs to its token limit.
      raise ValueError("min_thinking_tokens > 0 needs a non-empty wait_text")
    if self.exit_tau <= 1.0 and not self.answer_probe:
      raise ValueError("exit_tau <= 1 needs answer_probe=True (the confidence comes from it)")
    consensus = self.consensus_share <= 1.0 or self.stop_when_decided
    if consensus and not self.answer_vote:
      raise ValueError("a consensus stop needs answer_vote=True (the answer keys come from it)")
    if self.consensus_share <= 0.5:
      raise ValueError("consensus_share must be > 0.5 (a share <= 1/2 can be tied)")


@dataclasses.dataclass
class Batch:
  """What `generate` returns: traces per request plus host-side accounting."""

  traces: list[list[Trace]]
  wall_time_s: list[float]  # per request: from its admission to the call that finished it
  invocations: list[int]  # per request: jitted loop calls it was in (host round trips)
  iterations: int = 0
  loop_seconds: float = 0.0  # time inside the jitted loop calls (no prefill, no decoding)
  # Per request, seen from the host (it sees only loop-call boundaries): one latency per
  # kept token, each the wall time of its loop call / the iterations that call ran (an
  # iteration writes one token per running row); and the time from its admission
  # (prefill included) to the end of the first iteration that gave it a token.
  token_ms: list[list[float]] = dataclasses.field(default_factory=list)
  ttft_s: list[Optional[float]] = dataclasses.field(default_factory=list)
  verify_calls: int = 0  # iterations that verified drafts (speculative)


# A prompt takes a prefix of another row's prompt (instead of computing it) when they share
# at least this many tokens, and at least half of its own: a shared few-shot prompt is
# computed once per admission, and a prompt that would share little computes its own and
# can lend it to the prompts after it.
SHARED_PREFIX_MIN_TOKENS = 32


def plan_shared_prefixes(prompts: Sequence[Sequence[int]],
                         held: Mapping[Any, Sequence[int]], unit: int) -> list[Optional[tuple]]:
  """Per prompt being admitted: None (it computes its whole prompt: a root), or (donor,
  shared tokens) where donor is ("root", j) for an earlier root of this admission or
  ("held", key) for a row of `held` (key -> the prompt that row still holds). The shared
  tokens are whole multiples of `unit` (a paged cache's block), at most the prompt's
  length - 1 (its last token is computed: the loop starts from its logits), and the
  longest such prefix over the donors (the first donor on a tie)."""
  donors = [(("held", k), np.asarray(p, np.int64)) for k, p in held.items()]
  plan: list[Optional[tuple]] = []
  for i, ids in enumerate(prompts):
    ids = np.asarray(ids, np.int64)
    best = None
    for name, other in donors:
      m = min(len(ids) - 1, len(other))
      differ = np.flatnonzero(ids[:m] != other[:m])
      shared = (int(differ[0]) if differ.size else m) // unit * unit
      if best is None or shared > best[1]:
        best = (name, shared)
    if (best is not None and best[1] >= max(SHARED_PREFIX_MIN_TOKENS, unit)
        and 2 * best[1] >= len(ids)):
      plan.append(best)
    else:
      plan.append(None)
      donors.append((("root", i), ids))
  return plan


@compilation_cache.jit(static_argnums=0, donate_argnums=2)
def _admit_rows(model, params, state, leaders, tokens, last, sharers, donors, suffixes,
                suffix_last, shared, children, parents, rows, fresh, knobs, prior_at, priors):
  """`Controller.admit`'s device part. Static on the decode model's program view
  (`decode_model.program_view`), not on the controller: every controller of a model
  shares its compiled programs (keyed on the controller, each new one compiled them again
  and kept them: ~225 memory maps a controller on a CPU, and a process past ~290
  controllers failed in LLVM's allocator)."""
  b = state.tokens.shape[0]
  cache = state.cache
  # Release everything the slots' rows held, then prefill and share the prompts: the
  # roots whole, then the others from their donors' prefixes (`plan_shared_prefixes`).
  held = jnp.full((b,), jnp.iinfo(jnp.int32).max, jnp.int32).at[rows].set(0, mode="drop")
  cache = model.truncate(cache, held)
  if leaders.shape[0]:
    cache = model.prefill_rows(params, cache, leaders, tokens, last, jnp.zeros_like(last))
  if sharers.shape[0]:
    cache = model.copy_rows(cache, sharers, donors)
    cache = model.prefill_rows(params, cache, sharers, suffixes, suffix_last, shared)
  if children.shape[0]:
    cache = model.copy_rows(cache, children, parents)
  # Every per-row field at its start value (one row, broadcast to the admitted rows).
  blank = S.row_start_values(1, window=state.conf_ring.shape[1],
                             records=state.rec_start.shape[1], key_capacity=state.key.shape[1],
                             force_capacity=state.force_buf.shape[1],
                             draft_capacity=state.shadow_draft.shape[1])
  put = lambda x, v: x.at[rows].set(jnp.asarray(v, x.dtype), mode="drop")
  updates = {f: put(getattr(state, f), jnp.broadcast_to(v, (rows.shape[0],) + v.shape[1:]))
             for f, v in blank.items()}
  updates.update({f: put(getattr(state, f), v) for f, v in fresh.items()})
  updates["phase"] = put(state.phase, jnp.full(rows.shape, S.THINK, jnp.int32))
  k = state.knobs
  k = k.replace(**{f: put(getattr(k, f), v) for f, v in knobs.items()},
                **{f: getattr(k, f).at[prior_at].set(v, mode="drop") for f, v in priors.items()})
  return state.replace(**updates, knobs=k, cache=cache)


class Controller:
  """Runs reasoning policies on a DecodeModel.

  Args:
    model: a DecodeModel (ContiguousLlama, MockDecodeModel, ...).
    tokenizer: encode / encode_chat / decode / eos_ids / apply_chat_template.
    max_rows: most rows (request x sample) in one compiled batch.
    top_k: log-probs averaged into a DeepConf token confidence.
    max_records: step records kept per trace, at least (a call sizes them for its settings:
      `record_capacity`).
    force_capacity / probe_capacity / pattern_capacity: array sizes of forced
      texts, probe texts and delimiter / prefix tokenizations (a call whose texts are
      longer runs with the next power of two: `capacities`).
    iterations_per_call: loop iterations per invocation (0 = until done).
    budget: a live latency-aware budget (engine/budget.py) applied to every
      `generate` call: the step limit of running rows is re-evaluated on its
      clock between loop calls (each call then lasts about its interval), and
      it prunes traces when latency or KV use is over its limits.
    extract_answer: text -> answer string (GSM-style number by default).
    reads_as: (final text, voted answer) -> whether the task that scores a trace reads
      that answer in its text; a vote's chosen trace (whose text a task scores) is the
      first of the voted answer's traces it accepts, else the first of them. The eval job
      sets the GSM harness's readings per batch (`pipelines.tasks.gsm8k.reads_as`): a first
      trace writing "The answer is 5. ... The answer is 7." was scored wrong (strict reads
      the first statement) where the vote (7) was right. None: the first of them.
    python_twin: run the debugging twin (one jitted `_step` per host call)
      instead of the while_loop; results must be identical.
    key_capacity / key_classes: answer-key characters kept per row, and
      character classes read per token (LoopSettings.answer_vote).
    thinking: the model's thinking span (thinking.py): "auto" (the markers its chat
      template names, if any), "on", "off", "<open> <close>", or a ThinkingSpan.
    admission: which waiting request gets a freed slot: "fifo" (the order of the
      requests) or "shortest_budget" (priority by remaining steps, as the engine's
      scheduler: the fewest steps to its limit, min(request.max_steps, the policy's),
      first; ties in request order). The loop never preempts a running request (its
      KV is planned for every slot up front), so the priority acts on admission.
    speculative: a `SpeculativeConfig` (drafter "prompt_lookup": the loop drafts on
      the device; see `ReasoningLoop._verify`), or None. Rows get the tokens plain
      decoding gives them. With `adaptive` the host picks, every SPEC_INTERVAL
      iterations (longer while its choice stays the same), a verifying or a plain
      loop call (`verify_next`): verify when the rows' expected tokens per call beat
      plain steps at the measured cost ratio (`cost_ratio`); without it every call
      verifies.
    share_prefixes: a prompt sharing a long prefix with another one in the cache (a
      few-shot prompt) computes only what follows it (`plan_shared_prefixes`; the same
      tokens up to f32 rounding at a near-tie. False: every prompt computes all of its own)."""

  def __init__(self, model: DecodeModel, tokenizer, *, max_rows: int = 32,
               top_k: int = CONFIDENCE_TOP_K,
               max_records: int = 64, force_capacity: int = 20, probe_capacity: int = 16,
               pattern_capacity: int = 8, iterations_per_call: int = 0,
               extract_answer: Callable[[str], Optional[str]] | None = None,
               reads_as: Callable[[str, str], bool] | None = None,
               python_twin: bool = False, key_capacity: int = 24, key_classes: int = 8,
               budget: BudgetLoop | None = None,
               thinking: str | ThinkingSpan | None = "auto", admission: str = "fifo",
               speculative: SpeculativeConfig | None = None, share_prefixes: bool = True):
    # (a Llama or no tokenizer was an AttributeError at the first use)
    if isinstance(model, Llama):
      raise ValueError("model must be a decode model: wrap the Llama, ContiguousLlama(llama) "
                       "or PagedLlama(llama) (shared prompt blocks)")
    if not hasattr(model, "vocab_size") or not callable(getattr(model, "forward", None)):
      raise ValueError(f"model must be a decode model (ContiguousLlama, PagedLlama), got "
                       f"{type(model).__name__}")
    if not all(callable(getattr(tokenizer, a, None)) for a in ("encode", "decode")):
      raise ValueError(f"tokenizer must be the checkpoint's tokenizer (ck.tokenizer), got "
                       f"{type(tokenizer).__name__}")
    # Sizes of the loop's arrays: a float or a 0 failed inside the first jitted call.
    for name, value, low in (("max_rows", max_rows, 1), ("top_k", top_k, 1),
                             ("max_records", max_records, 1),
                             ("force_capacity", force_capacity, 1),
                             ("probe_capacity", probe_capacity, 1),
                             ("pattern_capacity", pattern_capacity, 1),
                             ("iterations_per_call", iterations_per_call, 0),
                             ("key_capacity", key_capacity, 1), ("key_classes", key_classes, 1)):
      check_int(value, name, low)
    for name, value in (("python_twin", python_twin), ("share_prefixes", share_prefixes)):
      if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    if extract_answer is not None and not callable(extract_answer):
      raise ValueError(f"extract_answer must be a function of the text, got {extract_answer!r}")
    if reads_as is not None and not callable(reads_as):
      raise ValueError(f"reads_as must be a function of (text, answer), got {reads_as!r}")
    if budget is not None and not isinstance(budget, BudgetLoop):
      raise ValueError(f"budget must be a BudgetLoop or None, got {type(budget).__name__}")
    if speculative is not None and not isinstance(speculative, SpeculativeConfig):
      raise ValueError(f"speculative must be a SpeculativeConfig or None, got "
                       f"{type(speculative).__name__}")
    if admission not in ADMISSIONS:
      raise ValueError(f"admission={admission!r}: the controller admits by {list(ADMISSIONS)}")
    if speculative is not None and speculative.drafter != "prompt_lookup":
      raise ValueError(f"speculative.drafter={speculative.drafter!r}: the controller's loop "
                       f"drafts by 'prompt_lookup' only (the engine runs every drafter)")
    self.speculative = speculative
    # (rows, length, verify) -> seconds per iteration of recent loop calls (a shape's
    # first call compiles and is not timed: `_seen_calls` holds the shapes seen);
    # `measure_call_costs` seeds both kinds of a shape before its first adaptive call.
    self._call_times: dict[tuple, collections.deque] = {}
    self._seen_calls: set[tuple] = set()
    # Drafts accepted per verify call over the rows seen last: (mean, lowest row). The
    # prior of a fresh row: the mean while requests wait, the lowest row when draining.
    self._spec_prior = (0.5, 0.5)
    self.admission = admission
    self.model = model
    # What the compiled programs hold of the model (static arguments): no params, so the
    # jit caches keep no weights alive, and equal models share the programs.
    self._program_model = program_view(model)
    self.budget = budget
    # Per request id, until `result` attaches them: budget decisions while it ran, and
    # its host-side token latencies (see Batch), summed over the policy's calls.
    # Kept only inside `run` (cleared when it starts), so direct `generate` calls leave none.
    self._budget_log: dict[Any, list[dict]] = collections.defaultdict(list)
    self._latency_log: dict[Any, dict] = {}
    self._thinking_limits: dict[Any, int] = {}  # budgets lowered to fit the context
    self._warned_thinking_limit = False  # a warning the first time a budget is lowered
    self._warned_nonfinite = False
    self._logging = False
    # When the running `run` call started: its requests' arrival, from which the live
    # budget measures their end-to-end latency (over all of a policy's calls).
    self._run_started: float | None = None
    # One run at a time: the logs above and the calls' timings are the running one's
    # (threads sharing a controller take turns, a run each).
    self._run_lock = threading.RLock()
    self.tokenizer = tokenizer
    self.max_rows = max_rows
    self.top_k = min(int(top_k), model.vocab_size)  # (every token, in a tiny vocabulary)
    self.max_records = max_records
    self.force_capacity = force_capacity
    self.probe_capacity = probe_capacity
    self.pattern_capacity = pattern_capacity
    self.iterations_per_call = iterations_per_call
    self.extract_answer = extract_answer
    self.reads_as = reads_as
    self.python_twin = python_twin
    self.share_prefixes = bool(share_prefixes)
    self.key_capacity = key_capacity
    self.key_classes = key_classes
    self._key_tables: tuple[np.ndarray, np.ndarray] | None = None
    eos = set(getattr(tokenizer, "eos_ids", ()) or ())
    eos |= set(getattr(getattr(model, "config", None), "eos_ids", ()) or ())
    self.eos_ids = tuple(sorted(eos))
    self._masks: dict[str, np.ndarray] = {}
    self._spaced: tuple[np.ndarray, np.ndarray] | None = None
    self._texts: dict[bool, list[str]] = {}
    self.thinking = thinking_lib.resolve(thinking, tokenizer)
    self._chat_kwargs = thinking_lib.template_kwargs(thinking, tokenizer)
    if self.thinking is not None:  # checked once, here, rather than at the first request
      for marker in (self.thinking.open, self.thinking.close):
        try:
          n = len(tokenizer.encode(marker, add_bos=False))
        except ValueError as e:
          raise ValueError(f"thinking marker {marker!r} cannot be encoded: {e}") from None
        if not 0 < n <= pattern_capacity:
          raise ValueError(f"thinking marker {marker!r} is {n} tokens; pattern_capacity is "
                           f"{pattern_capacity}")

  def __hash__(self):
    return id(self)

  def __eq__(self, other):
    return self is other

  # -- public API -------------------------------------------------------------------

  def run(self, requests: Sequence[ReasoningRequest | Any], policy) -> list[ReasoningResult]:
    """Runs `policy` (a Policy, a registered name, or {"name": ..., **params})."""
    if isinstance(policy, type):  # (build_policy failed on it: to_dict() missing 'self')
      raise ValueError(f"policy must be a Policy, a registered name or a dict, got the class "
                       f"{policy.__name__} (make one: {policy.__name__}(...))")
    if isinstance(policy, str):
      policy = build_policy({"name": policy})
    elif not isinstance(policy, BasePolicy):
      policy = build_policy(policy)  # (names what a section lacks, or that it is none)
    if not policy.controller:
      raise ValueError(f"policy {policy.name!r} samples plainly (the engine runs it); the "
                       f"controller runs {policy_names(controller=True)}")
    if isinstance(requests, (str, bytes, Mapping, ReasoningRequest)):
      # (a str would run one request per character)
      raise ValueError(f"requests must be a list of requests or prompts, got one "
                       f"{type(requests).__name__}")
    if not isinstance(requests, collections.abc.Iterable):
      raise ValueError(f"requests must be a list of requests or prompts, got "
                       f"{type(requests).__name__}")
    reqs = [r if isinstance(r, ReasoningRequest) else ReasoningRequest(prompt=r, request_id=i)
            for i, r in enumerate(requests)]
    twice = [i for i, k in collections.Counter(r.request_id for r in reqs).items() if k > 1]
    if twice:  # an id keys its request's sampling stream, and its logs until `result`
      raise ValueError(f"request ids must be unique in one run, got {twice[:5]} more than once "
                       f"(a prompt given bare takes its position in the list as id, and a "
                       f"ReasoningRequest's request_id defaults to 0)")
    if not reqs:
      return []
    with self._run_lock:
      self._budget_log.clear()
      self._latency_log.clear()
      self._thinking_limits.clear()
      self._logging = True
      self._run_started = time.perf_counter()
      try:
        return policy.run(self, reqs)
      finally:
        self._logging = False
        self._run_started = None

  def generate(self, requests: Sequence[ReasoningRequest], settings: LoopSettings, n: int = 1, *,
               sample_offset: int = 0, conf_stop: Sequence[float] | float | None = None,
               budget: BudgetLoop | None = None,
               vote_floor: Sequence[float] | float | None = None,
               prior_votes: Sequence[Sequence[tuple[Optional[str], float]]] | None = None,
               unstopped_samples: int = 0, finishes_requests: bool = True) -> Batch:
    """n traces per request (sample indices sample_offset ..); see the module doc.

    conf_stop: DeepConf stop threshold per request; the first `unstopped_samples`
    traces of each request ignore it (DeepConf's warm-up traces, when they run in
    the same call as the others). With settings.answer_vote:
    vote_floor (a finished row votes only with confidence >= it) and prior_votes
    (per request, (answer key or None, weight) of votes cast before this call,
    e.g. DeepConf's warm-up traces) feed the consensus stop. budget: a live budget for
    this call (default: the controller's). finishes_requests=False: the requests go on in
    a later call (a warm-up), so their latency is not yet observed by the budget (the
    policy calls `observe_finished` for those that end there)."""
    # What a policy of one's own may pass wrong (each was an AttributeError, a TypeError or
    # an OverflowError inside the batch's setup, or a NaN threshold that silently stopped
    # nothing), checked before anything runs.
    if not isinstance(settings, LoopSettings):
      raise ValueError(f"settings must be LoopSettings, got {type(settings).__name__}")
    bad = [r for r in requests if not isinstance(r, ReasoningRequest)]
    if bad:
      raise ValueError(f"requests must be ReasoningRequests (Controller.run also takes prompts), "
                       f"got {type(bad[0]).__name__}")
    check_int(n, "n", 1)
    check_int(sample_offset, "sample_offset")
    check_int(unstopped_samples, "unstopped_samples")
    check_sample_index(sample_offset + n - 1, "the last sample index (sample_offset + n - 1)")
    check_backtrack_threshold(settings.verifier, settings.backtrack_threshold, self.top_k)
    generated = self.max_generated(settings)
    if generated > INT32_MAX:  # (each fits; their sum is the loop's int32 token limit)
      raise ValueError(f"a trace may generate {generated} tokens (max_thinking_tokens + "
                       f"max_answer_tokens + (max_backtracks + 1) x step_max_tokens + forced "
                       f"text), more than the loop's int32 counters hold ({INT32_MAX})")
    per_request = lambda x, fill: [fill] * len(requests) if x is None else (
        [x] * len(requests) if np.isscalar(x) else list(x))
    stops = per_request(conf_stop, -math.inf)
    floors = per_request(vote_floor, -math.inf)
    priors = [list(p) for p in prior_votes] if prior_votes is not None else [[]] * len(requests)
    for name, values in (("conf_stop", stops), ("vote_floor", floors), ("prior_votes", priors)):
      if len(values) != len(requests):
        raise ValueError(f"{name} has {len(values)} entries for {len(requests)} requests")
    for name, values in (("conf_stop", stops), ("vote_floor", floors)):
      bad = [v for v in values if not is_real(v) or math.isnan(v)]
      if bad:  # (-inf: off)
        raise ValueError(f"{name} entries must be numbers (not NaN), got {bad[0]!r}")
    stops, floors = [float(v) for v in stops], [float(v) for v in floors]
    for votes in priors:
      for vote in votes:
        if (not isinstance(vote, (tuple, list)) or len(vote) != 2
            or not (vote[0] is None or isinstance(vote[0], str))
            or not is_real(vote[1]) or math.isnan(vote[1])):
          raise ValueError(f"prior_votes entries must be (answer key or None, weight) pairs, "
                           f"got {vote!r}")
    if not requests:
      return Batch(traces=[], wall_time_s=[], invocations=[])
    if (vote_floor is not None or prior_votes is not None) and not settings.answer_vote:
      raise ValueError("vote_floor / prior_votes need settings.answer_vote=True")
    with self._run_lock:  # (a policy's own calls inside `run` hold it already)
      return self._generate_slots(requests, settings, n, sample_offset, stops,
                                budget or self.budget, floors, priors, unstopped_samples,
                                finishes_requests)

  def observe_finished(self, count: int = 1) -> None:
    """Tells the live budget that `count` requests of the running `run` end now (their
    end-to-end latency), for a policy whose last call for them did not finish them
    (`generate(finishes_requests=False)`)."""
    if self.budget is not None:
      since = self._run_started if self._run_started is not None else time.perf_counter()
      for _ in range(count):
        self.budget.observe_request(time.perf_counter() - since)

  def result(self, request: ReasoningRequest, policy: str, traces: list[Trace],
             chosen: Optional[int], answer: Optional[str], wall_time_s: float, invocations: int,
             votes: Mapping[str, float] | None = None, **info) -> ReasoningResult:
    """Assembles a ReasoningResult; token counts are summed over every trace."""
    tokens = TokenCounts()
    for t in traces:
      tokens = tokens + t.tokens
    pick = traces[chosen] if chosen is not None else None
    if request.request_id in self._budget_log:  # the step limits it ran under, and why
      info = {**info, "budget": self._budget_log.pop(request.request_id)}
    if request.request_id in self._latency_log:
      info = {**info, **self._latency_log.pop(request.request_id)}
    if request.request_id in self._thinking_limits:  # its thinking budget, lowered to fit
      info = {**info, "thinking_limit": self._thinking_limits.pop(request.request_id)}
    return ReasoningResult(
        request_id=request.request_id, policy=policy,
        answer_text=self.final_text(pick) if pick else "",
        answer=answer, traces=traces, chosen=chosen, tokens=tokens,
        steps=sum(t.n_steps for t in traces), backtracks=sum(t.backtracks for t in traces),
        early_exit=any(t.early_exit for t in traces), wall_time_s=wall_time_s,
        loop_invocations=invocations, votes=dict(votes or {}), info=info)

  def encode(self, prompt) -> list[int]:
    """Text, chat messages [{"role", "content"}] or token ids -> token ids (checked), the
    thinking span opened when the prompt does not open it."""
    ids = encode_prompt(self.tokenizer, prompt, self.model.vocab_size, self._chat_kwargs)
    if self.thinking is not None and not self._opens_thinking(ids):
      ids = ids + self._ids(self.thinking.open + "\n")
    # A longer prompt ran silently past the context, as the engine and the Generator refuse to.
    limit = self._context()
    if limit is not None and len(ids) >= limit:
      raise ValueError(f"prompt has {len(ids)} tokens but the model's context is {limit} tokens")
    return ids

  def _ids(self, text: str) -> list[int]:
    """The ids of text written mid-sequence (forced text, probes, markers, patterns): no
    BOS, which a tokenizer that adds one to a prompt (Gemma 3, Llama 3) put before each
    forced "Wait" and answer prefix, and before every step pattern (never matched)."""
    return self.tokenizer.encode(text, add_bos=False)

  def _context(self) -> int | None:
    """The model's context (a Llama's config; a DecodeModel without one has none)."""
    return getattr(getattr(self.model, "config", None), "max_context", None)

  def check_prompt_fits(self, settings: LoopSettings, prompt_tokens: int) -> int:
    """Room for thinking beside a prompt of `prompt_tokens` and what a trace keeps after
    its thinking; ValueError when there is none (checked for every request of a call
    before any runs: found at its turn, the earlier requests' traces were lost)."""
    limit = self._context()
    if limit is None:
      return settings.max_thinking_tokens
    room = limit - prompt_tokens - (self._kept_tokens(settings) - settings.max_thinking_tokens)
    if room < 0:
      raise ValueError(f"prompt has {prompt_tokens} tokens: with max_answer_tokens="
                       f"{settings.max_answer_tokens} and the forced text it does not fit the "
                       f"model's context of {limit} tokens")
    probe = self._verify_probe(settings)
    if probe:
      # A self-verify probe is written after a thinking step (a forced "Wait" may precede
      # it) and its verdict read there: inside the context too (it was read past it).
      # Without room for one, the trace thinks no step and answers. (The answer probe
      # reads the forced end of thinking, which the room above holds.)
      wait = self._ids(settings.wait_text)
      room = max(0, min(room, limit - prompt_tokens - len(probe) - len(wait)))
    return room

  def thinking_limit(self, settings: LoopSettings, request: ReasoningRequest,
                     prompt_tokens: int) -> int:
    """A request's thinking budget in this call: the policy's, lowered so that the prompt
    and everything a trace may keep (thinking, forced text, answer) fit the model's
    context, as the engine ends a sequence at the context (the loop has no stop there of
    its own: traces ran on at positions the model never saw). Other requests keep theirs."""
    limit = self._context()
    if limit is None:
      return settings.max_thinking_tokens
    room = self.check_prompt_fits(settings, prompt_tokens)
    if room < settings.max_thinking_tokens:  # reported in the request's result info
      self._thinking_limits[request.request_id] = room
      if not self._warned_thinking_limit:  # once: a job's console shows it (not per request)
        self._warned_thinking_limit = True
        log.warning("controller: max_thinking_tokens=%d does not fit the model's context of %d "
                    "tokens beside the prompt and the answer budget (or a verifier's probe); "
                    "lowered per request "
                    "(first: %d tokens for a %d-token prompt), reported as thinking_limit in "
                    "the result info and the record's trace", settings.max_thinking_tokens,
                    limit, room, prompt_tokens)
    return min(settings.max_thinking_tokens, room)

  def _opens_thinking(self, ids: Sequence[int]) -> bool:
    """The prompt already ends inside the thinking span (its open marker, then spaces).
    A prompt ending with a closed span (a template's "thinking off") is refused: the loop
    would read its answer as thinking."""
    tail = self.tokenizer.decode(list(ids[-(2 * self.pattern_capacity + 4):])).rstrip()
    if tail.endswith(self.thinking.close):
      raise ValueError(f"the prompt ends with a closed thinking span ({self.thinking.close!r}): "
                       f"thinking is off for it; use model.thinking='off'")
    return tail.endswith(self.thinking.open)

  def final_text(self, trace: Trace) -> str:
    """What a task scores of a trace: its text, or with a thinking span the answer after it
    (empty when the span never closed)."""
    return trace.text if self.thinking is None else trace.answer_text

  def extract(self, text: str, settings: LoopSettings) -> Optional[str]:
    """The answer in `text` (a trace's final text: see `final_text`)."""
    if self.extract_answer is not None:
      return self.extract_answer(text)
    return extract_number(text, settings.answer_prefix.strip())

  # -- knobs ------------------------------------------------------------------------

  def _pad(self, ids: Sequence[int], size: int, what: str) -> np.ndarray:
    if len(ids) > size:
      raise ValueError(f"{what} is {len(ids)} tokens; capacity is {size}")
    out = np.zeros(size, np.int32)
    out[:len(ids)] = ids
    return out

  def _variants(self, text: str) -> list[list[int]]:
    """Tokenizations of `text` as it may appear inside generated text."""
    out = []
    for cand in (text, " " + text if not text.startswith(" ") else text.lstrip()):
      try:
        out.append(self._ids(cand))
      except ValueError:
        pass
    try:  # character by character (e.g. "\n\n" as two "\n" tokens)
      out.append([i for c in text for i in self._ids(c)])
    except ValueError:
      pass
    seen, uniq = set(), []
    for v in out:
      if v and tuple(v) not in seen and len(v) <= self.pattern_capacity:
        seen.add(tuple(v))
        uniq.append(v)
    return uniq[:4]

  def _patterns(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    seqs = np.zeros((4, self.pattern_capacity), np.int32)
    lens = np.zeros(4, np.int32)
    for i, v in enumerate(self._variants(text) if text else []):
      seqs[i, :len(v)] = v
      lens[i] = len(v)
    return seqs, lens

  def _token_texts(self, *, skip_special: bool) -> list[str]:
    """Each token's text as it reads inside the text (cached; see `token_texts`)."""
    if skip_special not in self._texts:
      self._texts[skip_special] = token_texts(self.tokenizer, skip_special=skip_special)
    return self._texts[skip_special]

  def _delim_mask(self, delim: str) -> np.ndarray:
    """[V] tokens whose own text contains the delimiter (e.g. "\\n\\n", ".\\n\\n")."""
    if delim not in self._masks:
      v = self.model.vocab_size
      mask = np.zeros(v, bool)
      if delim:
        for i, text in enumerate(self._token_texts(skip_special=False)[:v]):
          mask[i] = delim in text
      self._masks[delim] = mask
    return self._masks[delim]

  def _space_masks(self) -> tuple[np.ndarray, np.ndarray]:
    """[V] tokens whose text ends in whitespace (a forced answer prefix after them needs
    no separator; after a special token, whose text is empty, it gets one), and [V] tokens
    whose text is whitespace only (the answer's confidence reads past one)."""
    if self._spaced is None:
      v = self.model.vocab_size
      texts = self._token_texts(skip_special=True)[:v]
      ends, blank = np.zeros(v, bool), np.zeros(v, bool)
      ends[:len(texts)] = [t[-1:].isspace() for t in texts]
      blank[:len(texts)] = [t.isspace() for t in texts]
      self._spaced = ends, blank
    return self._spaced

  def key_tables(self) -> tuple[np.ndarray, np.ndarray]:
    """[V, C] character classes of every token's text (-1 = none) and [V] overflow
    (more than C classes, or text the automaton cannot read: a non-ASCII digit, or
    U+FFFD, a token holding part of a character such as one byte of "−")."""
    if self._key_tables is None:
      v, c = self.model.vocab_size, self.key_classes
      classes = np.full((v, c), -1, np.int32)
      overflow = np.zeros(v, bool)
      special = set(self.eos_ids)
      for i, text in enumerate(self._token_texts(skip_special=True)[:v]):
        seq = [] if i in special else answers.char_classes(text)
        if seq is None or len(seq) > c:
          overflow[i] = True
          seq = (seq or [])[:c]
        classes[i, :len(seq)] = seq
      self._key_tables = (classes, overflow)
    return self._key_tables

  def knobs(self, settings: LoopSettings, b: int, conf_stop: np.ndarray,
            group: np.ndarray | None = None, vote_floor: np.ndarray | None = None,
            prior_votes: Sequence[Sequence[tuple[Optional[str], float]]] = (),
            priors_per_group: int = 0) -> Knobs:
    """Per-row arrays for `b` rows from one LoopSettings (conf_stop, group, vote_floor:
    [b]; prior_votes: per group, (answer key or None, weight); priors_per_group > 0:
    group g's prior votes sit at g * priors_per_group .. (room for admitted requests))."""
    st = settings
    v = self.model.vocab_size
    full = lambda x, dt: jnp.full((b,), x, dt)
    eos = np.zeros(v, bool)
    eos[list(self.eos_ids)] = True
    answer, separator_len, after_close = self._end_of_thinking(st)
    wait = self._ids(st.wait_text)
    force_capacity, probe_capacity = self.capacities(st)
    probe = yes = no = [0]
    if isinstance(st.verifier, SelfVerify):
      probe = self._verify_probe(st)
      yes, no = self._ids(st.verifier.yes), self._ids(st.verifier.no)
    delim_seqs, delim_lens = self._patterns(st.step_delimiter)
    restart_seqs, restart_lens = self._patterns(st.answer_prefix.strip())
    prefix_seqs, prefix_lens = (restart_seqs, restart_lens) if self.thinking is None else (
        self._patterns(self.thinking.close))
    max_answer = st.max_answer_tokens  # tokens after the prefix (the prefix is not budgeted)
    return Knobs(
        temperature=full(st.temperature, jnp.float32), top_k=full(st.top_k, jnp.int32),
        top_p=full(st.top_p, jnp.float32), min_p=full(st.min_p, jnp.float32),
        temp_bump=full(st.temp_bump, jnp.float32),
        bt_threshold=full(st.backtrack_threshold, jnp.float32),
        max_step_bt=full(st.max_step_backtracks, jnp.int32),
        max_bt=full(st.max_backtracks, jnp.int32), step_cap=full(st.step_max_tokens, jnp.int32),
        max_steps=full(min(st.max_steps, NEVER), jnp.int32),
        min_think=full(st.min_thinking_tokens, jnp.int32),
        max_think=full(st.max_thinking_tokens, jnp.int32), max_answer=full(max_answer, jnp.int32),
        max_generated=full(self.max_generated(st), jnp.int32),
        exit_tau=full(st.exit_tau, jnp.float32),
        conf_stop=jnp.asarray(conf_stop, jnp.float32),
        answer_on_eos=full(st.answer_on_eos, jnp.bool_),
        eos_mask=jnp.asarray(eos), delim_mask=jnp.asarray(self._delim_mask(st.step_delimiter)),
        delim_seqs=jnp.asarray(delim_seqs), delim_lens=jnp.asarray(delim_lens),
        prefix_seqs=jnp.asarray(prefix_seqs), prefix_lens=jnp.asarray(prefix_lens),
        restart_seqs=jnp.asarray(restart_seqs), restart_lens=jnp.asarray(restart_lens),
        answer_ids=jnp.asarray(self._pad(answer, force_capacity, "answer_prefix")),
        answer_len=jnp.int32(len(answer)), answer_separator_len=jnp.int32(separator_len),
        ends_in_space=jnp.asarray(self._space_masks()[0]),
        blank=jnp.asarray(self._space_masks()[1]),
        after_close_ids=jnp.asarray(self._pad(after_close, force_capacity,
                                              "answer_prefix after the thinking span")),
        after_close_len=jnp.int32(len(after_close)),
        wait_ids=jnp.asarray(self._pad(wait, force_capacity, "wait_text")),
        wait_len=jnp.int32(len(wait)),
        probe_ids=jnp.asarray(self._pad(probe, probe_capacity, "verifier probe")),
        probe_len=jnp.int32(len(probe)), yes_id=jnp.int32(yes[-1]), no_id=jnp.int32(no[-1]),
        # The probe reads what forcing would write (the separator skipped as there).
        answer_probe_ids=jnp.asarray(self._pad(answer, probe_capacity, "answer_prefix")),
        answer_probe_len=jnp.int32(len(answer)),
        **self._vote_knobs(st, b, group, vote_floor, prior_votes, priors_per_group))

  def _end_of_thinking(self, settings: LoopSettings) -> tuple[list[int], int, list[int]]:
    """(forced end of thinking, its leading separator tokens, forced after a close the
    model wrote).

    Without a thinking span: "\n\n" + the answer prefix as the tokenizer reads it in
    running text, the separator's token count, and nothing. The loop skips the
    separator after a token that ends in whitespace; without it the prefix glued onto
    a cut-off word ("got onThe answer is"). Only a prefix that starts with a letter or
    a digit gets one: others continue the text as written (" The answer is",
    ". The answer is", "</think>...").
    With a thinking span: close + "\n\n" + prefix, 0, and "\n\n" + prefix (nothing
    without a prefix)."""
    prefix = settings.answer_prefix
    if self.thinking is None and not prefix.strip():
      # (nothing would end thinking: the "answer" was more thinking, its number the last one
      # written anywhere, e.g. "... and 6 of them get off at" answered 6)
      raise ValueError(f"answer_prefix={prefix!r}: without a thinking span the answer is read "
                       f"after the answer prefix; give one (e.g. 'The answer is')")
    if self.thinking is None:
      plain = self._ids(prefix)
      if not prefix[:1].isalnum():
        return plain, 0, []
      full = self._ids("\n\n" + prefix)  # "\n\n" reads as 2 tokens on SmolLM2
      if full[len(full) - len(plain):] != plain:  # merged across the seam: keep them apart
        full = self._ids("\n\n") + plain
      return full, len(full) - len(plain), []
    after = self._ids("\n\n" + prefix)
    return self._ids(self.thinking.close) + after, 0, after if prefix.strip() else []

  def key_codes(self, answer: Optional[str]) -> Optional[list[int]]:
    """The loop's key codes of an answer, None where it cannot hold them (no number, or
    longer than `key_capacity`): such a vote is unknown there (a wildcard)."""
    codes = None if answer is None else answers.text_key(answer)
    return codes if codes is not None and len(codes) <= self.key_capacity else None

  def prior_entries(self, votes, q: int, group: int, at: Sequence[int] | None = None):
    """Arrays (group, key, key_len, known, weight) of [q] prior-vote entries holding
    `votes` ((answer key or None, weight)) of `group` at positions `at` (default
    0..); the other entries are empty (group -1)."""
    a = self.key_capacity
    prior_group = np.full(q, -1, np.int32)
    prior_key = np.zeros((q, a), np.int32)
    prior_len = np.zeros(q, np.int32)
    prior_known = np.zeros(q, bool)
    prior_weight = np.zeros(q, np.float32)
    for i, (key, weight) in zip(range(q) if at is None else at, votes):
      codes = self.key_codes(key)
      known = codes is not None
      prior_group[i], prior_known[i], prior_weight[i] = group, known, weight
      if known:
        prior_key[i, :len(codes)] = codes
        prior_len[i] = len(codes)
    return prior_group, prior_key, prior_len, prior_known, prior_weight

  def _vote_knobs(self, st: LoopSettings, b, group, vote_floor, prior_votes,
                  priors_per_group: int = 0) -> dict:
    """The vote knobs (1-element placeholders when the vote is not compiled)."""
    a = self.key_capacity
    if priors_per_group:
      q = pow2_bucket(max(1, priors_per_group * len(prior_votes)), 8)
    else:
      q = pow2_bucket(max(1, sum(len(p) for p in prior_votes)), 8)
    prior_group = np.full(q, -1, np.int32)
    prior_key = np.zeros((q, a), np.int32)
    prior_len = np.zeros(q, np.int32)
    prior_known = np.zeros(q, bool)
    prior_weight = np.zeros(q, np.float32)
    i = 0
    for g, votes in enumerate(prior_votes):
      if priors_per_group:
        if len(votes) > priors_per_group:
          raise ValueError(f"{len(votes)} prior votes for group {g}; room for {priors_per_group}")
        i = g * priors_per_group
      entry = self.prior_entries(votes, len(votes), g)
      for arr, val in zip((prior_group, prior_key, prior_len, prior_known, prior_weight), entry):
        arr[i:i + len(votes)] = val
      i += len(votes)
    if st.answer_vote:
      classes, overflow = self.key_tables()
    else:
      classes, overflow = np.full((1, 1), -1, np.int32), np.zeros(1, bool)
    full = lambda x, dt: jnp.full((b,), x, dt)
    return dict(
        key_classes=jnp.asarray(classes), key_overflow=jnp.asarray(overflow),
        group=jnp.asarray(np.full(b, -1, np.int32) if group is None else group, jnp.int32),
        vote_floor=jnp.asarray(np.full(b, -np.inf) if vote_floor is None else vote_floor,
                               jnp.float32),
        consensus=full(st.consensus_share, jnp.float32),
        consensus_min=full(st.consensus_min_votes, jnp.int32),
        stop_decided=full(st.stop_when_decided, jnp.bool_),
        prior_group=jnp.asarray(prior_group), prior_key=jnp.asarray(prior_key),
        prior_key_len=jnp.asarray(prior_len), prior_known=jnp.asarray(prior_known),
        prior_weight=jnp.asarray(prior_weight))

  # -- the batch --------------------------------------------------------------------

  def _kept_tokens(self, settings: LoopSettings) -> int:
    """Most tokens a row's sequence holds past its prompt: thinking, answer prefix,
    answer, and a "Wait" that may be forced at the thinking budget."""
    st = settings
    return (st.max_thinking_tokens + len(self._end_of_thinking(st)[0])
            + st.max_answer_tokens + len(self._ids(st.wait_text)))

  def max_generated(self, settings: LoopSettings) -> int:
    """Tokens a row may append in all, discarded ones included (the loop ends it there):
    what it keeps, a step per backtrack, and the answer prefixes it may write and lose: one
    per "Wait" forced below min_thinking_tokens (each adds at least the Wait's tokens to the
    thinking kept) and a verified last step's (budget_forcing's rolled-back prefixes ran a
    trace into this limit with no answer)."""
    st = settings
    prefix = len(self._end_of_thinking(st)[0])
    return (self._kept_tokens(st) + (self._backtracks_bound(st) + 1) * st.step_max_tokens
            + (self._early_waits(st) + 1) * prefix + 8)

  @staticmethod
  def _steps_bound(st: LoopSettings) -> int:
    """Steps a row may take: max_steps, and one token each at least."""
    return min(st.max_steps, st.max_thinking_tokens + 1)

  def _backtracks_bound(self, st: LoopSettings) -> int:
    """Backtracks a row may make: max_backtracks, and max_step_backtracks per step."""
    return min(st.max_backtracks, self._steps_bound(st) * st.max_step_backtracks)

  def _early_waits(self, st: LoopSettings) -> int:
    """"Wait"s a row may be forced below min_thinking_tokens (each adds the Wait's tokens
    to the thinking kept), one more for an end of sequence."""
    if st.min_thinking_tokens <= 0:
      return 0
    wait = max(len(self._ids(st.wait_text)), 1) if st.wait_text else 1
    return -(-st.min_thinking_tokens // wait) + 1

  def record_capacity(self, settings: LoopSettings) -> int:
    """Step records a row of a call with `settings` may write (the controller's
    `max_records` at least): one per step (a step has a token at least, and at most
    max_steps are accepted), per backtrack and per "Wait", and its end events. A fixed 64
    dropped the records past it: a 100-step trace reported 64 steps and lost its end."""
    st = settings
    need = (self._steps_bound(st) + self._backtracks_bound(st) + 2 * self._early_waits(st)
            + 4)
    return max(self.max_records, pow2_bucket(need))

  def _verify_probe(self, settings: LoopSettings) -> list[int]:
    """The self-verify probe's tokens ([] without a SelfVerify verifier)."""
    if not isinstance(settings.verifier, SelfVerify):
      return []
    return self._ids(settings.verifier.probe)

  def capacities(self, settings: LoopSettings) -> tuple[int, int]:
    """(force, probe) array sizes for a call with `settings`: the controller's, or the
    next power of two of the longest forced text (answer prefix, "Wait") / probe
    (verifier probe, answer prefix) where that is longer. A longer text then runs in
    other program shapes (a config's 19-token answer_prefix sent every sample to dead
    letters: "answer_prefix is 19 tokens; capacity is 16")."""
    def tokens(encode) -> int:
      try:
        return len(encode())
      except ValueError:  # (a tokenizer that cannot: the call that uses the text says so)
        return 0

    answer, _, after_close = self._end_of_thinking(settings)
    forced = max(len(answer), len(after_close),
                 tokens(lambda: self._ids(settings.wait_text)))
    probed = max(len(answer), tokens(lambda: self._verify_probe(settings)))
    fit = lambda need, size: size if need <= size else pow2_bucket(need)
    return fit(forced, self.force_capacity), fit(probed, self.probe_capacity)

  def cache_plan(self, settings: LoopSettings, rows: int, longest_prompt: int,
                 prompts: int | None = None) -> CachePlan:
    """What the rows will do with the cache: a row writes from its last prompt token
    up to max_generated past the prompt, plus a probe past that end; `prompts`
    requests are in flight at once."""
    return CachePlan(rows=rows, prompt_tokens=longest_prompt,
                     new_tokens=self.max_generated(settings) + self._probe_reach(settings)
                     + self.draft_k, prompts=prompts)

  def cache_length(self, settings: LoopSettings, longest_prompt: int) -> int:
    """Positions per row: the longest prompt, what a row keeps, and a probe (or a
    verify call's drafts) past it."""
    return pow2_bucket(longest_prompt + self._kept_tokens(settings) + self._probe_reach(settings)
                       + self.draft_k + 8, 64)

  def _probe_reach(self, settings: LoopSettings) -> int:
    """Positions a probe writes past a row's end: its tokens, and one more where the
    answer's confidence reads past a whitespace token."""
    return self.capacities(settings)[1] + 1

  @property
  def draft_k(self) -> int:
    """Drafts per verify call (0: no speculation)."""
    return self.speculative.max_drafts if self.speculative is not None else 0

  @property
  def adaptive(self) -> bool:
    """The host chooses verifying or plain calls (else every call verifies)."""
    return self.draft_k > 0 and self.speculative.adaptive

  def verify_next(self, phase, accepted, calls, cost: float, prior: float = 0.5,
                  draining: bool = False) -> bool:
    """Whether the next loop call verifies. A row's tokens per verify call: 1 + its
    drafts accepted per call (a decayed mean over its real and shadow calls, starting
    from `prior` with the weight of one call), against `cost`, a verify call's time
    over a plain step's. The controller passes as `prior` the mean of the rows seen
    last, or when draining their lowest (the slowest row decides then).

    While requests wait for a slot, a freed slot is refilled, so what counts is the
    tokens per second of all running rows: verify when their sum beats cost x their
    number. Once the queue is empty (`draining`) the batch lasts as long as its
    slowest row, so verify only when every running row gains: 1 + its accepted
    drafts per call > cost. (One row that rarely has a draft accepted would
    otherwise finish alone, at a plain step's cost per token, long after the others.)"""
    running = phase != S.DONE
    if not running.any():
      return False
    per_row = 1.0 + (accepted + prior) / (calls + 1.0)
    if draining:
      return bool(per_row[running].min() > cost)
    return bool(per_row[running].sum() > cost * running.sum())

  def cost_ratio(self, state: ReasoningState) -> float:
    """A verify iteration's time over a plain one's at this shape: the medians of
    recent loop calls of each kind (drafting, verifying and the per-position steps
    included; seeded by `measure_call_costs`)."""
    b, length = state.tokens.shape
    plain, verify = (self._call_times[(b, length, v)] for v in (False, True))
    return float(np.median(verify) / np.median(plain))

  def _time_call(self, key: tuple, seconds_per_iteration: float) -> None:
    if key in self._seen_calls:
      self._call_times.setdefault(key, collections.deque(maxlen=8)).append(seconds_per_iteration)
    self._seen_calls.add(key)

  def measure_call_costs(self, state: ReasoningState, settings: LoopSettings) -> None:
    """Seeds the loop-call timings of this batch shape, once per shape: both loop
    programs run 2 iterations on copies of the admitted state (after one compiling
    run each; 3 alternating runs). The loop programs themselves are timed, so
    drafting and the per-position steps count (on a CPU at batch 8 they cost more
    than the wider forward)."""
    b, length = state.tokens.shape
    if (b, length, True) in self._call_times:
      return
    loops = {verify: self.loop(settings, verify=verify) for verify in (False, True)}
    for loop in loops.values():
      self._timed_iterations(loop, state)  # compiles
    for _ in range(3):
      for verify, loop in loops.items():
        self._call_times.setdefault((b, length, verify), collections.deque(maxlen=8)).append(
            self._timed_iterations(loop, state))
    self._seen_calls.update((b, length, v) for v in loops)

  @staticmethod
  def _trips_run(loop: ReasoningLoop, iterations: int) -> int:
    """Iterations the device ran in a call that took `iterations`: a loop of fixed trips
    runs all of them (the idle ones cost as much)."""
    return loop.fixed_trips or iterations

  def _timed_iterations(self, loop: ReasoningLoop, state: ReasoningState,
                        iterations: int = 2) -> float:
    """Seconds per iteration of `loop` for `iterations` iterations (its trips, if fixed)
    on a copy of `state` (the loop donates its state)."""
    iterations = self._trips_run(loop, iterations)
    copy = jax.tree.map(jnp.copy, state.replace(stop_at=state.iteration + iterations))
    jax.block_until_ready(copy)
    t0 = time.perf_counter()
    with self._on_mesh():
      out = (loop.run_python if self.python_twin else loop.run)(self.model.params, copy)
    jax.block_until_ready(out.length)
    return (time.perf_counter() - t0) / iterations

  def check_policy_fits(self, policy) -> None:
    """ValueError when `policy`'s largest loop call cannot fit the device even for one
    request of one prompt token: checked once where the policy is chosen (a pipeline
    worker's load) rather than found per request; so is a fixed paged pool too small for
    any request."""
    # PagedLlama's fixed pool (None: sized from the plan; other caches have none)
    check_pool_holds_request(getattr(self.model, "num_blocks", None), policy.traces_per_call)
    self._loop_shape(policy.loop_settings(), policy.traces_per_call, 1, 1)

  def _loop_shape(self, settings: LoopSettings, n: int, slots: int,
                  longest_prompt: int) -> tuple[int, int, CachePlan]:
    """Rows, positions per row and cache plan of a loop call with `slots` request slots of
    n traces, checked against the device's memory."""
    b = pow2_bucket(slots * n)
    length = self.cache_length(settings, longest_prompt)
    plan = self.cache_plan(settings, b, longest_prompt, slots)
    self._check_state_fits(settings, n, b, length, plan)
    return b, length, plan

  def _check_state_fits(self, settings: LoopSettings, n: int, rows: int, length: int,
                        plan: CachePlan) -> None:
    """The loop's largest buffers (the cache, tokens [rows, length], the confidence ring
    [rows, conf_window]) against the device's memory, from their shapes alone: a huge n,
    token budget or window was an out-of-memory error from inside numpy or XLA."""
    try:
      cache = jax.eval_shape(lambda: self.model.init_cache(rows, length, plan))
      cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    except Exception:  # a DecodeModel whose cache cannot be traced: the rows alone
      cache_bytes = 0
    mesh = getattr(self.model, "mesh", None)  # the cache is split by KV heads over its devices
    if mesh is not None:
      cache_bytes //= dict(mesh.shape).get(tensor_parallel.MODEL_AXIS, 1)
    check_fits_device(
        # the tokens (i32) and the four f32 position arrays (conf_pos, lp_run, conf_run,
        # low_run) per position, the window per row
        cache_bytes + 4 * rows * (5 * length + settings.conf_window),
        f"the reasoning loop ({rows} rows for n={n}, {length} positions each, conf_window "
        f"{settings.conf_window})",
        "n, max_rows, the token budgets (max_thinking_tokens, max_answer_tokens, "
        "step_max_tokens, max_backtracks) or conf_window")

  def empty_state(self, settings: LoopSettings, n: int, slots: int, length: int,
                  plan: CachePlan | None = None, priors_per_slot: int = 1) -> ReasoningState:
    """`slots` request slots of n rows each (padded to a power of two), all done and
    empty; `admit` puts requests into them."""
    b = pow2_bucket(slots * n)
    ones = lambda: jnp.ones((b,), jnp.int32)  # an empty row holds one token so it can be fed
    slot = np.full(b, -1, np.int32)
    slot[:slots * n] = np.repeat(np.arange(slots), n)
    knobs = self.knobs(settings, b, np.full(b, -np.inf, np.float32),
                       prior_votes=[[]] * slots, priors_per_group=max(1, priors_per_slot))
    return ReasoningState(
        tokens=jnp.zeros((b, length), jnp.int32), length=ones(), prompt_len=ones(),
        **{f: jnp.zeros((b, length), jnp.float32)
           for f in ("conf_pos", "lp_run", "conf_run", "low_run")},
        phase=jnp.full((b,), S.DONE, jnp.int32), step_start=ones(),
        keys=jnp.zeros((b, 2), jnp.uint32), iteration=jnp.int32(0), stop_at=jnp.int32(NEVER),
        spec_calls=jnp.int32(0),
        slot=jnp.asarray(slot), slot_live=jnp.zeros((slots,), bool),
        return_on_free=jnp.asarray(False), knobs=knobs,
        cache=self.model.init_cache(b, length, plan),
        **S.row_start_values(b, window=settings.conf_window, records=self.record_capacity(settings),
                             key_capacity=self.key_capacity,
                             force_capacity=self.capacities(settings)[0],
                             draft_capacity=self.draft_k))

  def admit(self, state: ReasoningState, settings: LoopSettings, n: int,
            admissions: Sequence[tuple[int, ReasoningRequest, Sequence[int]]], *,
            sample_offset: int = 0, conf_stop: Sequence[float] | None = None,
            vote_floor: Sequence[float] | None = None,
            prior_votes: Sequence[Sequence[tuple[Optional[str], float]]] | None = None,
            unstopped_samples: int = 0,
            held_prompts: Mapping[int, Sequence[int]] | None = None) -> ReasoningState:
    """Puts requests into slots: admissions = (slot, request, prompt ids) each, with
    per-admission conf_stop / vote_floor / prior_votes. The slots' rows are released,
    each prompt is prefilled once into the slot's first row and shared by its other
    rows, and the rows start fresh (sample j of the request is row slot * n + j).
    A prompt that shares a long prefix with an earlier one of the admission, or with the
    prompt a slot not being admitted still holds (held_prompts: slot -> its prompt ids),
    computes only what follows that prefix (`plan_shared_prefixes`): the prefix's K/V
    are the donor's (on a CPU the traces came out bit-identical to whole prompts'
    in every check: tests/o1jax/controller/test_shared_prefixes.py, 128/128 on the
    embedded model)."""
    b, length = state.tokens.shape
    m = len(admissions)
    if m == 0:
      return state
    for _, req, ids in admissions:
      if len(ids) > length:
        raise ValueError(f"prompt of request {req.request_id} is {len(ids)} tokens; the cache "
                         f"holds {length}")
    slots_in = {slot for slot, _, _ in admissions}
    held = {g: p for g, p in (held_prompts or {}).items() if g not in slots_in}
    sharing = (plan_shared_prefixes([p for _, _, p in admissions], held,
                                    int(getattr(self.model, "block_size", 1)))
               if self.share_prefixes else [None] * m)
    roots = [i for i in range(m) if sharing[i] is None]
    sharers = [i for i in range(m) if sharing[i] is not None]
    bucket = lambda count: pow2_bucket(count) if count else 0
    width = lambda longest: min(pow2_bucket(longest, 16), length)
    rp, rs = bucket(len(roots)), bucket(len(sharers))
    t = width(max([len(admissions[i][2]) for i in roots], default=1))
    leaders = np.full(rp, b, np.int32)  # padding: row b (dropped)
    tok = np.zeros((rp, t), np.int32)
    last = np.zeros(rp, np.int32)
    ts = width(max([len(admissions[i][2]) - sharing[i][1] for i in sharers], default=1))
    sharer_rows = np.full(rs, b, np.int32)
    donor_rows = np.full(rs, b - 1, np.int32)
    suffixes = np.zeros((rs, ts), np.int32)
    suffix_last = np.zeros(rs, np.int32)
    shared = np.zeros(rs, np.int32)
    for at, i in enumerate(roots):
      slot, _, ids = admissions[i]
      leaders[at] = slot * n
      tok[at, :len(ids)] = ids
      last[at] = len(ids) - 1
    for at, i in enumerate(sharers):
      slot, _, ids = admissions[i]
      (kind, key), count = sharing[i]
      sharer_rows[at] = slot * n
      donor_rows[at] = (admissions[key][0] if kind == "root" else key) * n
      suffixes[at, :len(ids) - count] = ids[count:]
      suffix_last[at] = len(ids) - 1 - count
      shared[at] = count
    ra = pow2_bucket(m)  # admissions (per-row fields, rows, priors)
    first_rows = np.full(ra, b, np.int32)  # each admission's first row (padding: b)
    rows = np.full(ra * n, b, np.int32)
    fresh_tokens = np.zeros((ra * n, length), np.int32)
    prompt_len = np.ones(ra * n, np.int32)
    keys = np.zeros((ra * n, 2), np.uint32)
    stops = np.full(ra * n, -np.inf, np.float32)
    steps = np.full(ra * n, NEVER, np.int32)
    think = np.full(ra * n, settings.max_thinking_tokens, np.int32)
    floors = np.full(ra * n, -np.inf, np.float32)
    group = np.full(ra * n, -1, np.int32)
    q = state.knobs.prior_group.shape[0]
    per_slot = q // max(1, state.slot_live.shape[0])
    prior_at = np.full(ra * per_slot, q, np.int32)  # padding: entry q (dropped)
    prior = [np.zeros((ra * per_slot,) + a.shape[1:], a.dtype)
             for a in self.prior_entries([], 1, -1)]
    prior[0][:] = -1
    for i, (slot, req, ids) in enumerate(admissions):
      first_rows[i] = slot * n
      span = slice(i * n, (i + 1) * n)
      rows[span] = np.arange(slot * n, slot * n + n)
      fresh_tokens[span, :len(ids)] = ids
      prompt_len[span] = len(ids)
      for j in range(n):
        keys[i * n + j] = np.asarray(sequence_key(req.seed, req.request_id, sample_offset + j))
      stops[span] = -np.inf if conf_stop is None else conf_stop[i]
      steps[span] = self.step_limit(settings, req)
      think[span] = self.thinking_limit(settings, req, len(ids))
      stops[i * n:i * n + min(unstopped_samples, n)] = -np.inf  # warm-up samples: never stopped
      if settings.answer_vote:  # every row votes in its slot's group
        group[span] = slot
        if vote_floor is not None:
          floors[span] = vote_floor[i]
      votes = list(prior_votes[i]) if prior_votes is not None else []
      if len(votes) > per_slot:
        raise ValueError(f"{len(votes)} prior votes for request {req.request_id}; room for "
                         f"{per_slot}")
      prior_at[i * per_slot:(i + 1) * per_slot] = np.arange(slot * per_slot,
                                                            (slot + 1) * per_slot)
      entry = self.prior_entries(votes, per_slot, slot)
      for arr, val in zip(prior, entry):
        arr[i * per_slot:(i + 1) * per_slot] = val
    children = np.array([[first_rows[i] + j for j in range(1, n)] if i < m else [b] * (n - 1)
                         for i in range(ra)], np.int32).reshape(-1)
    parents = np.repeat(np.minimum(first_rows, b - 1), n - 1)
    fresh = dict(tokens=fresh_tokens, length=prompt_len, prompt_len=prompt_len,
                 step_start=prompt_len, keys=keys)
    knobs = dict(conf_stop=stops, vote_floor=floors, group=group, max_steps=steps,
                 max_think=think, min_think=np.minimum(think, settings.min_thinking_tokens))
    priors = dict(zip(("prior_group", "prior_key", "prior_key_len", "prior_known",
                       "prior_weight"), prior))
    with self._on_mesh():
      return _admit_rows(self._program_model, self.model.params, state, jnp.asarray(leaders),
                         jnp.asarray(tok), jnp.asarray(last), jnp.asarray(sharer_rows),
                         jnp.asarray(donor_rows), jnp.asarray(suffixes),
                         jnp.asarray(suffix_last), jnp.asarray(shared), jnp.asarray(children),
                         jnp.asarray(parents), jnp.asarray(rows), fresh, knobs,
                         jnp.asarray(prior_at), priors)

  @staticmethod
  def step_limit(settings: LoopSettings, request: ReasoningRequest) -> int:
    """A request's step limit in this call: its own and the policy's, whichever is lower."""
    return min(settings.max_steps, request.max_steps or NEVER, NEVER)

  def _on_mesh(self):
    """The decode model's mesh set for a device call (tensor parallelism), else nothing."""
    mesh = getattr(self.model, "mesh", None)
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)

  def initial_state(self, requests, prompts, settings, n, sample_offset, conf_stop,
                    vote_floor=None, prior_votes=(), unstopped_samples: int = 0) -> ReasoningState:
    """len(requests) x n rows: request i in slot i (an empty state + `admit`)."""
    r = len(requests)
    longest = max(len(p) for p in prompts)
    per_slot = max([1] + [len(p) for p in prior_votes or ()])
    state = self.empty_state(settings, n, r, self.cache_length(settings, longest),
                             self.cache_plan(settings, pow2_bucket(r * n), longest, r), per_slot)
    return self.admit(state, settings, n, list(zip(range(r), requests, prompts)),
                      sample_offset=sample_offset, conf_stop=list(conf_stop),
                      vote_floor=None if vote_floor is None else list(vote_floor),
                      prior_votes=list(prior_votes) if prior_votes else None,
                      unstopped_samples=unstopped_samples)

  def loop(self, settings: LoopSettings, verify: bool = False,
           trips: int = 0) -> ReasoningLoop:
    """The compiled loop for these settings (`verify`: of verify calls). Where loops run
    fixed trips (`steps.fixed_trip_loops`) a plain loop runs `trips` (default
    FIXED_TRIPS) iterations a call."""
    spec = self.speculative
    kind = steps.draw_kind([settings.temperature], [settings.top_k], [settings.top_p],
                           [settings.min_p], self.model.vocab_size)
    if kind == "greedy" and settings.temp_bump > 0:
      kind = "any"  # a backtracked step is drawn at temperature > 0
    return ReasoningLoop(self._program_model, settings.verifier, settings.answer_probe,
                         self.top_k, settings.answer_vote, draft_k=self.draft_k, verify=verify,
                         ngram_max=spec.ngram_max if spec else 4,
                         ngram_min=spec.ngram_min if spec else 1, draw_kind=kind,
                         trips=(trips or FIXED_TRIPS) if steps.fixed_trip_loops() else None)

  def _generate_slots(self, requests, settings, n, sample_offset, conf_stop, budget,
                      vote_floor, prior_votes, unstopped_samples: int = 0,
                      finishes_requests: bool = True) -> Batch:
    """Streams the requests through max(1, max_rows // n) slots of n rows: each loop
    call returns when a request's rows are all done while others wait; the host
    collects its traces and admits the next request into the freed slot."""
    prompts = []
    for i, request in enumerate(requests):  # checked before any work: which one is at fault
      try:
        prompts.append(self.encode(request.prompt))
        self.check_prompt_fits(settings, len(prompts[-1]))
        if getattr(self.model, "num_blocks", None) is not None:  # (a fixed paged pool)
          check_pool_holds_request(self.model.num_blocks, n, prompt_blocks=-(
              -len(prompts[-1]) // self.model.block_size))
      except ValueError as e:
        if len(requests) == 1:
          raise
        raise ValueError(f"request {i} (request_id={request.request_id!r}): {e}") from e
    r = len(requests)
    slots = max(1, min(self.max_rows // n, r))
    longest = max(len(p) for p in prompts)  # of all requests: the rows are reused
    b, length, plan = self._loop_shape(settings, n, slots, longest)
    per_slot = max([1] + [len(p) for p in prior_votes])
    state = self.empty_state(settings, n, slots, length, plan, per_slot)
    # A live budget's limit replaces the policy's (`_apply_budget`): the order is by the
    # limits the rows run under (with the policy's, requests between the two tied in FIFO).
    limits = [self.step_limit(settings, q) if budget is None else
              min(budget.steps, q.max_steps or NEVER) for q in requests]
    # Every request is known up front, so the priority order is fixed: one sort.
    order = range(r) if self.admission == "fifo" else sorted(range(r), key=lambda i: (limits[i], i))
    waiting = collections.deque(order)
    in_slot: dict[int, list] = {}  # slot -> [request index, admitted at, loop calls]
    # Every request is known (waiting) from the start of its `run` (of this call alone).
    arrived = self._run_started if self._run_started is not None else time.perf_counter()

    def fill(state, free):
      picked = [(g, waiting.popleft()) for g in free[:len(waiting)]]
      # Running slots keep their prompts: a new prompt may take a prefix from them.
      held = {g: prompts[entry[0]] for g, entry in in_slot.items()}
      for g, i in picked:
        in_slot[g] = [i, time.perf_counter(), 0]
      return self.admit(state, settings, n, [(g, requests[i], prompts[i]) for g, i in picked],
                        sample_offset=sample_offset, conf_stop=[conf_stop[i] for _, i in picked],
                        vote_floor=[vote_floor[i] for _, i in picked],
                        prior_votes=[prior_votes[i] for _, i in picked],
                        unstopped_samples=unstopped_samples, held_prompts=held)

    state = fill(state, list(range(slots)))
    lengths = np.asarray(state.length)  # read again only after an admission changes them
    adaptive = self.adaptive
    if adaptive:
      self.measure_call_costs(state, settings)
    verify = bool(self.draft_k) and not adaptive  # not adaptive: every call verifies
    loops = {v: self.loop(settings, verify=v) for v in {False, bool(self.draft_k)}}
    traces: list = [None] * r
    wall = [0.0] * r
    calls_of = [0] * r
    token_ms: list[list[float]] = [[] for _ in range(r)]
    ttft: list[Optional[float]] = [None] * r
    loop_seconds = 0.0
    per_call = self.iterations_per_call or NEVER
    if budget is not None:  # the first call is short: the budget has nothing measured yet
      per_call = min(per_call, 8)
    spec_interval = SPEC_INTERVAL if adaptive else NEVER
    admitted_now = True  # the rows changed since the last choice
    seen_rows = None  # (state.phase it was read from, phase, spec_acc, spec_calls_row)
    iteration = int(state.iteration)
    while in_slot:
      live = np.zeros(slots, bool)
      live[list(in_slot)] = True
      if budget is not None:
        state = self._apply_budget(budget, state, n, live, len(waiting), requests, in_slot)
      if adaptive:  # choose this call's loop from the rows as they are now
        if seen_rows is None or seen_rows[0] is not state.phase:  # admitted or pruned since
          seen_rows = (state.phase, *jax.device_get(
              (state.phase, state.spec_acc, state.spec_calls_row)))
        _, phase, accepted, spec_calls = seen_rows
        seen = spec_calls > 0.5  # rows with evidence: the priors of fresh ones
        if seen.any():
          per_row = accepted[seen] / spec_calls[seen]
          self._spec_prior = (float(per_row.mean()), float(per_row.min()))
        again = verify
        verify = self.verify_next(phase, accepted, spec_calls, self.cost_ratio(state),
                                  self._spec_prior[1 if not waiting else 0],
                                  draining=not waiting)
        spec_interval = (min(2 * spec_interval, SPEC_INTERVAL_MAX)
                         if verify == again and not admitted_now else SPEC_INTERVAL)
        admitted_now = False
      start_iter = iteration
      call_iterations = min(per_call, spec_interval)
      loop = loops[verify]
      if loop.fixed_trips and call_iterations < loop.fixed_trips:
        # Fixed trips: the call's own (a power of two: 1/2/4/8 programs), none idle by plan.
        loop = self.loop(settings, trips=1 << (call_iterations.bit_length() - 1))
      state = state.replace(
          stop_at=jnp.int32(min(start_iter + call_iterations, NEVER)),
          slot_live=jnp.asarray(live), return_on_free=jnp.asarray(bool(waiting)))
      release_programs_near_map_limit()
      t_call = time.perf_counter()
      with self._on_mesh():
        state = (loop.run_python if self.python_twin else loop.run)(self.model.params, state)
      # One sync per invocation (adaptive: the next choice reads these rows too).
      spec = (state.spec_acc, state.spec_calls_row) if adaptive else ()
      phase, after, iteration, *spec = jax.device_get(
          (state.phase, state.length, state.iteration, *spec))
      iteration = int(iteration)
      if adaptive:
        seen_rows = (state.phase, phase, *spec)
      done = phase == S.DONE
      dt = time.perf_counter() - t_call
      self.model.check(state.cache)  # a paged pool that ran out raises here
      loop_seconds += dt
      ran = max(1, iteration - start_iter)
      trips = self._trips_run(loop, ran)  # what the call's time paid for
      if adaptive:
        self._time_call((b, length, verify), dt / trips)
      grown = np.clip(after - lengths, 0, ran * (self.draft_k + 1))
      lengths = after
      for g, entry in in_slot.items():
        entry[2] += 1
        i, tokens = entry[0], int(grown[g * n:(g + 1) * n].max())
        per_token = dt / max(trips, tokens)  # a verify call gives a row several tokens
        token_ms[i] += [per_token * 1e3] * tokens
        if ttft[i] is None and tokens:
          ttft[i] = t_call - entry[1] + per_token
      if budget is not None:  # a loop call lasts about the budget's interval
        budget.observe_step(dt / trips)
        # (min before int: an interval of 1e308 ms made inf, an OverflowError per batch)
        per_call = min(self.iterations_per_call or NEVER,
                       max(1, int(min(budget.interval_s / max(dt / trips, 1e-6), NEVER))))
      finished = [g for g in sorted(in_slot) if done[g * n:(g + 1) * n].all()]
      if finished:
        host = jax.device_get(state.replace(cache=None, knobs=None))
        now = time.perf_counter()
        for g in finished:
          i, admitted, calls = in_slot.pop(g)
          traces[i] = [self._trace(host, g * n + j, sample_offset + j, settings)
                       for j in range(n)]
          wall[i], calls_of[i] = now - admitted, calls
          if self._logging:
            log = self._latency_log.setdefault(requests[i].request_id,
                                               {"token_ms": [], "ttft_s": ttft[i]})
            log["token_ms"] += token_ms[i]
          if budget is not None and finishes_requests:
            # End to end, as the engine's: the wait for a slot and earlier calls too.
            budget.observe_request(now - arrived)
        if waiting:
          state = fill(state, finished)
          lengths = np.asarray(state.length)
          admitted_now = True
    return Batch(traces=traces, wall_time_s=wall, invocations=calls_of,
                 iterations=int(state.iteration), loop_seconds=loop_seconds, token_ms=token_ms,
                 ttft_s=ttft, verify_calls=int(state.spec_calls))

  def _apply_budget(self, budget: BudgetLoop, state: ReasoningState, n: int, live: np.ndarray,
                    queued: int, requests, in_slot: dict) -> ReasoningState:
    """Before a loop call: re-evaluates the budget (on its clock), gives every row its step
    limit, the budget's in place of the policy's but never above its request's own
    `max_steps` (a row past it answers at its next step boundary), logs the limit per request,
    and when the budget says prune, stops the lowest-confidence running trace of every
    slot with two or more running traces (exit "pruned"; it does not vote)."""
    cache = state.cache
    # Paged: the share of the block pool held. A contiguous cache is allocated whole up
    # front, so pruning cannot relieve it: its use reads 0.
    kv_use = (float(cache.blocks_in_use) / cache.blocks.num_blocks
              if hasattr(cache, "blocks_in_use") else 0.0)
    # Load against the controller's capacity (max_rows // n slots), not this call's slots.
    ticked = time.perf_counter()
    decision = budget.tick(busy=int(live.sum()), queued=queued,
                           slots=max(len(live), self.max_rows // n), kv_use=kv_use)
    last = decision or (budget.decisions[-1] if budget.decisions else None)
    for g, (i, admitted, _) in in_slot.items():
      log = self._budget_log[requests[i].request_id] if self._logging else []
      if last is not None and (decision is not None or not log):
        # Times since the request's admission on the controller's clock (the budget's may
        # be another). A decision made before the admission is the budget the request
        # starts under: at 0 ms (it read -20 ms), as the engine's "budget at arrival".
        log.append(last.to_dict((ticked - admitted) * 1e3 if decision is not None else 0.0))
    steps = np.full(state.knobs.max_steps.shape, budget.steps, np.int32)
    for g, (i, _, _) in in_slot.items():
      steps[g * n:(g + 1) * n] = min(budget.steps, requests[i].max_steps or NEVER)
    state = state.replace(knobs=state.knobs.replace(max_steps=jnp.asarray(steps)))
    if decision is None or not decision.prune or n < 2:
      return state
    phase = np.array(state.phase)
    exit_reason = np.array(state.exit_reason)
    conf = np.asarray(state.conf_sum) / np.maximum(np.asarray(state.conf_count), 1)
    for g in in_slot:
      rows = [g * n + j for j in range(n) if phase[g * n + j] != S.DONE]
      if len(rows) >= 2:
        weakest = min(rows, key=lambda row: (conf[row], -row))
        phase[weakest], exit_reason[weakest] = S.DONE, S.EXIT_PRUNED
    return state.replace(phase=jnp.asarray(phase), exit_reason=jnp.asarray(exit_reason))

  def _trace(self, h: ReasoningState, row: int, sample_index: int, settings: LoopSettings) -> Trace:
    row_tokens = np.asarray(h.tokens[row])

    def dec(lo: int, hi: int) -> str:  # what tokens lo..hi add to the text before them
      before = int(row_tokens[lo - 1]) if lo > 0 else None
      return continuation_text(self.tokenizer, [int(i) for i in row_tokens[lo:hi]], before,
                               skip_special=True)
    pl, ln = int(h.prompt_len[row]), int(h.length[row])
    gen = row_tokens[pl:ln]
    a0 = int(h.answer_start[row])
    a0 = ln if a0 < 0 else a0
    steps = []
    for i in range(min(int(h.n_rec[row]), h.rec_start.shape[1])):
      start, end = int(h.rec_start[row, i]), int(h.rec_end[row, i])
      action = S.ACTION_NAMES[int(h.rec_action[row, i])]
      text = "" if action == "backtrack" else dec(start, end)
      steps.append(StepRecord(start=start - pl, end=end - pl, score=float(h.rec_score[row, i]),
                              action=action, text=text,
                              answer_confidence=float(h.rec_conf[row, i])))
    kept = int(h.think_tokens[row]) + int(h.answer_tokens[row])
    w = h.conf_ring.shape[1]
    nw = min(int(h.conf_count[row]), w)
    tail = float(h.conf_ring[row].sum() / nw) if nw else math.inf
    lowest = float(h.lowest_conf[row])
    text = dec(pl, ln)
    thinking_text, answer_text = dec(pl, a0), dec(a0, ln)
    if self.thinking is not None:  # the answer is what follows the close marker
      close = answer_text.find(self.thinking.close)
      answer_text = answer_text[close + len(self.thinking.close):] if close >= 0 else answer_text
    answer_text = answer_text.lstrip("\n")  # the forced prefix's separator
    reason = S.EXIT_NAMES[int(h.exit_reason[row])]
    if kept and not math.isfinite(float(h.lp_total[row])):
      # Drawn from NaN/inf logits (weights or activations that overflow): no answer.
      reason = "error"
      if not self._warned_nonfinite:
        self._warned_nonfinite = True
        log.warning("controller: the model's logits were not finite (NaN or inf) in a trace: "
                    "its weights or activations overflow; such traces exit 'error' without "
                    "an answer")
    key = None
    if (reason != "error" and settings.answer_vote and int(h.answer_start[row]) >= 0
        and int(h.key_state[row]) >= S.KEY_INT and not bool(h.key_unknown[row])):
      key = answers.key_text(h.key[row, :int(h.key_commit[row])])
    return Trace(
        sample_index=sample_index, token_ids=[int(x) for x in gen], text=text,
        thinking_text=thinking_text, answer_text=answer_text,
        answer=None if reason in ("pruned", "error") else self.extract(
            text if self.thinking is None else answer_text, settings), steps=steps,
        tokens=TokenCounts(thinking=int(h.think_tokens[row]), answer=int(h.answer_tokens[row]),
                           prefix=int(h.prefix_tokens[row]), probe=int(h.probe_tokens[row]), discarded=int(h.discarded[row]),
                           waits=int(h.waits[row])),
        backtracks=int(h.backtracks[row]), early_exit=bool(h.early_exit[row]), exit_reason=reason,
        mean_logprob=float(h.lp_total[row]) / max(kept, 1),
        mean_confidence=float(h.conf_sum[row]) / max(int(h.conf_count[row]), 1),
        lowest_group_confidence=lowest if math.isfinite(lowest) else tail,
        tail_confidence=tail, stopped_low_confidence=reason == "low_confidence",
        stopped_consensus=reason == "consensus", answer_key=key,
        speculative={"drafted": int(h.spec_drafted[row]), "accepted": int(h.spec_accepted[row])}
        if self.draft_k else None)
