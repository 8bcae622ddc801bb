"""Step scores (verifiers): small frozen classes with one method, `score`.

A verifier reads `StepStats` (arrays the loop maintains at every step
boundary) and returns one score per row; the loop backtracks a step whose
score is below the policy's threshold. Verifiers are static parts of the
compiled loop, so each class is a separate program; their settings that are
token ids (the probe text) travel as arrays in `Knobs`.

  MeanLogprob      exp(mean log p) of the step's tokens, in (0, 1]
  GroupConfidence  DeepConf group confidence: mean over the last W tokens of
                   -mean(top-k log p); larger = more confident, not in [0, 1]
  LowestGroupConfidence  the lowest group confidence of the trace so far
  SelfVerify       P(Yes) / (P(Yes) + P(No)) after a fixed probe appended past
                   the sequence end (scratch; the sequence is untouched)

External scorers (`ExternalScorer`) run on the host after the loop, e.g. for
best-of-N over finished traces (run code against the docstring examples).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Callable, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from o1jax.registry import Registry


@flax.struct.dataclass
class StepStats:
  """What a verifier may read at a step boundary (all [B])."""

  lp_sum: jax.Array  # f32 sum of log p of the step's tokens
  n_tokens: jax.Array  # i32 tokens in the step
  group_conf: jax.Array  # f32 current group confidence
  lowest_conf: jax.Array  # f32 lowest full-window group confidence (+inf if none)
  p_yes: jax.Array  # f32 self-verification probe P(Yes | Yes or No) (nan without a probe)


class Verifier(abc.ABC):
  """Scores the step that just ended. Subclasses are frozen dataclasses."""

  name: ClassVar[str]
  needs_probe: ClassVar[bool] = False  # the loop runs the yes/no probe forward pass

  @abc.abstractmethod
  def score(self, stats: StepStats) -> jax.Array:
    """[B] f32 score of each row's current step."""

  def score_floor(self, top_k: int) -> float:
    """A score no step goes below (`top_k`: the log-probs a token confidence averages), so
    a backtrack threshold at or under it never backtracks. 0 where none is known."""
    del top_k
    return 0.0


def check_backtrack_threshold(verifier: Verifier, threshold: float, top_k: int) -> None:
  """ValueError for a positive threshold at or under the verifier's lowest score, which
  never backtracks (0 or less means "no backtracking" and stays allowed)."""
  floor = verifier.score_floor(top_k)
  if 0 < threshold <= floor:
    raise ValueError(f"backtrack_threshold={threshold:g} never backtracks with verifier "
                     f"{verifier.name}: its scores are at least {floor:.4f} (ln {top_k}); set "
                     f"a threshold above that, or 0 for none")


@dataclasses.dataclass(frozen=True)
class MeanLogprob(Verifier):
  """Geometric-mean token probability of the step: exp(lp_sum / n)."""

  name: ClassVar[str] = "mean_logprob"

  def score(self, stats: StepStats) -> jax.Array:
    return jnp.exp(stats.lp_sum / jnp.maximum(stats.n_tokens, 1))


@dataclasses.dataclass(frozen=True)
class GroupConfidence(Verifier):
  """DeepConf group confidence at the step's end (sliding window, see state.py)."""

  name: ClassVar[str] = "group_confidence"

  def score_floor(self, top_k: int) -> float:
    # The top-k probabilities sum to <= 1, so their mean log p is <= ln(1/k) (Jensen).
    return math.log(top_k)

  def score(self, stats: StepStats) -> jax.Array:
    return stats.group_conf


@dataclasses.dataclass(frozen=True)
class LowestGroupConfidence(Verifier):
  """The lowest full-window group confidence so far (group_conf until a window fills)."""

  name: ClassVar[str] = "lowest_group_confidence"

  def score_floor(self, top_k: int) -> float:
    return math.log(top_k)  # (a lowest of group confidences: the same floor)

  def score(self, stats: StepStats) -> jax.Array:
    return jnp.where(jnp.isfinite(stats.lowest_conf), stats.lowest_conf, stats.group_conf)


@dataclasses.dataclass(frozen=True)
class SelfVerify(Verifier):
  """Self-verification: the model's P(Yes) after the probe text.

  The probe text and the Yes / No words are tokenized by the controller
  (`Controller.knobs`) and passed as arrays; the probe runs in a scratch
  region past the sequence end and its tokens are counted as probe tokens."""

  name: ClassVar[str] = "self_verify"
  needs_probe: ClassVar[bool] = True
  probe: str = "\nIs this step correct? Answer Yes or No:"
  yes: str = " Yes"
  no: str = " No"

  def score(self, stats: StepStats) -> jax.Array:
    return stats.p_yes


VERIFIERS: dict[str, type[Verifier]] = Registry("verifier")


def register_verifier(cls: type[Verifier]) -> type[Verifier]:
  VERIFIERS[cls.name] = cls
  return cls


for _cls in (MeanLogprob, GroupConfidence, LowestGroupConfidence, SelfVerify):
  register_verifier(_cls)


def get_verifier(name: str | Verifier, **params) -> Verifier:
  """A verifier by registered name (or pass an instance through)."""
  if isinstance(name, Verifier):
    return name
  if name not in VERIFIERS:
    raise ValueError(f"unknown verifier {name!r}; registered: {sorted(VERIFIERS)}")
  return VERIFIERS[name](**params)


# --- host-side scorers (outside the jit loop) ----------------------------------------

# (request, trace) -> float; larger is better. `trace` is a results.Trace.
ExternalScorer = Callable[[Any, Any], float]
SCORERS: dict[str, ExternalScorer] = Registry("scorer")


def register_scorer(name: str, fn: ExternalScorer) -> ExternalScorer:
  """Names a host scorer so configs can pick it (e.g. best_of_n score="my_tests")."""
  SCORERS[name] = fn
  return fn


def _trace_attr(attr: str) -> ExternalScorer:
  return lambda request, trace: float(getattr(trace, attr))


register_scorer("mean_logprob", _trace_attr("mean_logprob"))
register_scorer("mean_confidence", _trace_attr("mean_confidence"))
register_scorer("lowest_group_confidence", _trace_attr("lowest_group_confidence"))
register_scorer("tail_confidence", _trace_attr("tail_confidence"))
