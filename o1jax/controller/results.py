"""Per-request output: the reasoning-path trace and token accounting."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

from o1jax.model.sampling import check_key_id, check_seed


@dataclasses.dataclass(frozen=True)
class ReasoningRequest:
  """One problem. prompt: text, chat messages [{"role", "content"}] or token ids.

  request_id and seed fix every random draw: sample j of this request uses
  sequence_key(seed, request_id, j), then the attempt and the position. request_id: an
  int in [0, 2**64) or a str (64 bits of its sha256, as the engine's `Request` takes it).
  max_steps: this request's own step limit (None: the policy's); a trace runs
  min(it, the policy's) steps, or under a live budget min(it, the budget's) (the budget's
  replaces the policy's). The controller's `shortest_budget`
  admission admits the request with the fewest steps first."""

  prompt: Any
  request_id: int | str = 0
  seed: int = 0
  max_steps: Optional[int] = None

  def __post_init__(self):
    # Both fix the sampling keys (`sequence_key`): checked here, not inside the first call.
    if not isinstance(self.request_id, str):  # (the engine's ids: a str was refused here)
      try:
        check_key_id(self.request_id)
      except ValueError:
        raise ValueError(f"request_id must be an int in [0, 2**64) or a str, got "
                         f"{self.request_id!r}") from None
    check_seed(self.seed, f"request {self.request_id}: seed")
    if self.max_steps is None:
      return
    steps = self.max_steps  # ints of any kind (numpy's too), not floats or bools
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
      raise ValueError(f"request {self.request_id}: max_steps must be an int >= 1 or None, got "
                       f"{steps!r}")
    object.__setattr__(self, "max_steps", int(steps))


@dataclasses.dataclass
class StepRecord:
  """One event of a trace: token span [start, end) relative to the first
  generated token, the verifier score (nan if not scored) and the action;
  answer_confidence: the answer-confidence probe's value at this step boundary (an
  early exit when >= exit_tau; nan where the probe did not run)."""

  start: int
  end: int
  score: float
  action: str
  text: str = ""
  answer_confidence: float = math.nan


@dataclasses.dataclass
class TokenCounts:
  """Token split of a trace: thinking + answer + discarded = generated (every
  token appended, = len(token_ids) + discarded); probe tokens ran in scratch
  and are not part of the sequence; prefix and waits are breakdowns."""

  thinking: int = 0  # kept thinking tokens (incl. forced "Wait")
  answer: int = 0  # kept answer-phase tokens: the answer prefix + what follows it
  prefix: int = 0  # of `answer`: the answer prefix; answer - prefix <= max_answer_tokens
  probe: int = 0  # tokens run through verification / answer-confidence probes
  # generated, then rolled back: backtracked steps (their `backtrack` records span them) and
  # answer prefixes the model wrote too early (budget forcing's "Wait", a step scored before
  # its prefix: no record spans those)
  discarded: int = 0
  waits: int = 0  # "Wait" insertions (budget forcing)

  @property
  def generated(self) -> int:
    """Every token the model produced for this trace (kept + discarded)."""
    return self.thinking + self.answer + self.discarded

  def __add__(self, other: "TokenCounts") -> "TokenCounts":
    return TokenCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                          for f in dataclasses.fields(self)})

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "generated": self.generated}


@dataclasses.dataclass
class Trace:
  """One sampled reasoning path."""

  sample_index: int
  token_ids: list[int]  # generated tokens kept in the sequence
  text: str
  thinking_text: str
  answer_text: str
  answer: Optional[str]  # extracted
  steps: list[StepRecord]
  tokens: TokenCounts
  backtracks: int
  early_exit: bool
  exit_reason: str  # state.EXIT_NAMES, or "error": drawn from logits that were not finite
  mean_logprob: float  # mean log p of the kept tokens
  mean_confidence: float  # DeepConf mean token confidence of the trace
  lowest_group_confidence: float  # lowest full-window group confidence (tail if none)
  tail_confidence: float  # group confidence of the last window
  stopped_low_confidence: bool = False
  stopped_consensus: bool = False  # stopped because its request's vote was decided
  answer_key: Optional[str] = None  # the loop's reading of the answer (LoopSettings.answer_vote)
  score: Optional[float] = None  # set by best_of_n's scorer
  # With speculation: drafts verified for this trace and accepted ({"drafted", "accepted"}).
  speculative: Optional[dict] = None

  @property
  def n_steps(self) -> int:
    return sum(1 for s in self.steps if s.action not in ("backtrack", "wait"))

  @classmethod
  def unstarted(cls, sample_index: int) -> "Trace":
    """A trace its request's vote had decided before it started (DeepConf: the warm-up
    traces' votes): no token, exit `consensus`, as the loop stops a running one."""
    return cls(sample_index=sample_index, token_ids=[], text="", thinking_text="",
               answer_text="", answer=None, steps=[], tokens=TokenCounts(), backtracks=0,
               early_exit=False, exit_reason="consensus", mean_logprob=0.0,
               mean_confidence=0.0, lowest_group_confidence=math.inf,
               tail_confidence=math.inf, stopped_consensus=True)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["tokens"] = self.tokens.to_dict()
    if d["speculative"] is None:  # traces without speculation keep their keys
      del d["speculative"]
    for key in ("mean_logprob", "mean_confidence", "lowest_group_confidence", "tail_confidence"):
      if not math.isfinite(d[key]):
        d[key] = None
    for step in d["steps"]:  # (not scored / not probed: NaN, which strict JSON has no word for)
      for key in ("score", "answer_confidence"):
        if not math.isfinite(step[key]):
          step[key] = None
    return d


@dataclasses.dataclass
class ReasoningResult:
  """What `Controller.run` returns per request (the "reasoning path trace")."""

  request_id: int | str
  policy: str
  answer_text: str  # final text of the chosen trace (or the winning answer's first trace)
  answer: Optional[str]  # extracted final answer
  traces: list[Trace]
  chosen: Optional[int]  # index into traces
  tokens: TokenCounts
  steps: int
  backtracks: int
  early_exit: bool
  wall_time_s: float  # wall time of the batch this request ran in
  loop_invocations: int  # host round trips (jitted loop calls) for this request
  votes: dict[str, float] = dataclasses.field(default_factory=dict)
  info: dict = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["tokens"] = self.tokens.to_dict()
    d["traces"] = [t.to_dict() for t in self.traces]
    return d
