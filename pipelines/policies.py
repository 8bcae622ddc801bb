"""Reasoning policies by name: how many samples an example gets and how each is drawn.

Today only plain sampling policies exist; the reasoning controller adds its own
(greedy_cot, best_of_n, deepconf, ...) to `POLICIES` with `register`.

  policy = build_policy({"name": "sample_n", "n": 8, "temperature": 0.7})
  policy.num_samples            # 8
  policy.sampling(base, 3)      # the SamplingSpec of sample 3

Data flow: 1. a config's `policy` section (name + params) is checked against the
registered class's fields (unknown keys list the valid ones); 2. the pipeline asks
the policy for `num_samples` work items per example and the `SamplingSpec` of
each; 3. after scoring, `vote` says whether samples are aggregated by majority
vote (GSM-style tasks; HumanEval always reports pass@k for every k <= n).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """Decoding settings of one sample; `seed` and the work key fix its random stream."""
  max_new_tokens: int = 256
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class Policy(abc.ABC):
  """A test-time-compute policy: one abstract method, tiny frozen implementations."""
  name: ClassVar[str]
  vote: ClassVar[bool] = False  # aggregate GSM-style answers by majority vote

  @property
  @abc.abstractmethod
  def num_samples(self) -> int:
    """Work items per example (sample indices 0 .. num_samples - 1)."""

  def sampling(self, base: SamplingSpec, sample_index: int) -> SamplingSpec:
    """Decoding settings of one sample; defaults to the config's `sampling` section."""
    del sample_index
    return base

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Greedy(Policy):
  """One sample per example with the config's sampling (temperature 0 by default)."""
  name: ClassVar[str] = "greedy"

  @property
  def num_samples(self) -> int:
    return 1


@dataclasses.dataclass(frozen=True)
class SampleN(Policy):
  """`n` independent samples at `temperature`; every k <= n is scored (pass@k, vote)."""
  name: ClassVar[str] = "sample_n"
  vote: ClassVar[bool] = True
  n: int = 4
  temperature: float = 0.7
  top_p: float = 0.95
  top_k: int = 0

  def __post_init__(self):
    if self.n < 1:
      raise ValueError(f"policy {self.name}: n must be >= 1, got {self.n}")
    if self.temperature <= 0 and self.n > 1:
      # n greedy samples would be n copies of the same text.
      raise ValueError(f"policy {self.name}: n={self.n} samples need temperature > 0")

  @property
  def num_samples(self) -> int:
    return self.n

  def sampling(self, base: SamplingSpec, sample_index: int) -> SamplingSpec:
    del sample_index  # the work key, not the seed, separates samples
    return dataclasses.replace(base, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k)


@dataclasses.dataclass(frozen=True)
class SelfConsistency(SampleN):
  """Self-consistency as plain sampling + majority vote (Wang et al., 2022).

  The controller issue may replace this with its own implementation (early
  stopping once the vote is decided); the name and params stay.
  """
  name: ClassVar[str] = "self_consistency"
  n: int = 8


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
  """Adds a policy class under its `name` (later registrations replace earlier ones)."""
  POLICIES[cls.name] = cls
  return cls


for _cls in (Greedy, SampleN, SelfConsistency):
  register(_cls)


def policy_defaults(name: str) -> dict[str, Any]:
  """The params of policy `name` with their defaults (what a config's policy section holds)."""
  cls = _lookup(name)
  return {f.name: f.default for f in dataclasses.fields(cls)}


def build_policy(section: Mapping[str, Any]) -> Policy:
  """`{"name": ..., **params}` -> Policy; unknown names or params list the valid ones."""
  params = dict(section)
  cls = _lookup(params.pop("name", "greedy"))
  valid = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(params) - valid)
  if unknown:
    raise ValueError(f"policy {cls.name!r} has no params {unknown}; valid: {sorted(valid) or 'none'}")
  return cls(**params)


def _lookup(name: str) -> type[Policy]:
  if name not in POLICIES:
    raise ValueError(f"unknown policy {name!r}; registered: {sorted(POLICIES)}")
  return POLICIES[name]
