"""Reasoning policies by name: how many samples an example gets and how each is drawn.

One namespace over two registries:
  * plain sampling policies, run by the `generator` / `engine` predictors:
    `greedy`, `sample_n` (`POLICIES` here);
  * the reasoning controller's policies (`o1jax.controller.POLICIES`: greedy_cot,
    self_consistency, best_of_n, deepconf, think_verify_backtrack, budget_forcing),
    wrapped as `ControllerPolicy` and run by the `controller` predictor.
  A controller name wins a clash: `self_consistency` is the controller's
  (n traces sharing the prompt cache + majority vote inside the controller).

  policy = build_policy({"name": "sample_n", "n": 8, "temperature": 0.7})
  policy.num_samples            # 8
  policy.sampling(base, 3)      # the SamplingSpec of sample 3
  build_policy({"name": "deepconf", "n": 4}).controller_section()   # for Controller.run

Data flow: 1. a config's `policy` section (name + params) is checked against the
registered class's fields (unknown names or keys list the valid ones); 2. the
pipeline asks the policy for `num_samples` work items per example and the
`SamplingSpec` of each (a controller policy: one item, sample index 0, the
controller samples inside); 3. after scoring, `vote` says whether samples are
aggregated by majority vote (GSM-style tasks; HumanEval always reports pass@k
for every k <= n; controller policies have voted already).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
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
  controller: ClassVar[bool] = False  # run by the reasoning controller (predictor "controller")

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
class ControllerPolicy(Policy):
  """A policy of `o1jax.controller`, by name + params; one work item per example.

  `params` holds every field of the controller's policy class (sorted items,
  so the policy hashes and pickles); the controller itself validates them.
  """
  policy_name: str = "greedy_cot"
  params: tuple[tuple[str, Any], ...] = ()
  controller: ClassVar[bool] = True

  @property
  def name(self) -> str:  # type: ignore[override]
    return self.policy_name

  @property
  def num_samples(self) -> int:
    return 1  # the controller draws its n traces itself, sharing the prompt's cache

  def controller_section(self) -> dict[str, Any]:
    """`{"name", **params}` for `Controller.run` / `o1jax.controller.build_policy`."""
    return {"name": self.policy_name, **dict(self.params)}

  def to_dict(self) -> dict[str, Any]:
    return self.controller_section()


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
  """Adds a policy class under its `name` (later registrations replace earlier ones)."""
  POLICIES[cls.name] = cls
  return cls


for _cls in (Greedy, SampleN):
  register(_cls)


@functools.lru_cache(maxsize=1)
def controller_policy_names() -> tuple[str, ...]:
  """Names registered in `o1jax.controller` (imported lazily: it pulls in jax)."""
  from o1jax.controller import POLICIES as CONTROLLER_POLICIES
  return tuple(sorted(CONTROLLER_POLICIES))


def all_policy_names() -> list[str]:
  return sorted(set(POLICIES) | set(controller_policy_names()))


def is_controller_policy(name: str) -> bool:
  return name in controller_policy_names()


def policy_defaults(name: str, smoke: bool = False) -> dict[str, Any]:
  """The params of policy `name` with their defaults (what a config's policy section holds).

  Controller policies take `o1jax.controller.configs.policy_config(name, smoke)`.
  """
  if is_controller_policy(name):
    from o1jax.controller.configs import policy_config
    cfg = policy_config(name, smoke=smoke)
    # Unset optional params stay typed placeholders (settable from the command line).
    values = {k: cfg.get_ref(k) if cfg[k] is None else cfg[k] for k in cfg.keys()}
    values.pop("name", None)
    return values
  cls = _lookup(name)
  return {f.name: f.default for f in dataclasses.fields(cls)}


def build_policy(section: Mapping[str, Any]) -> Policy:
  """`{"name": ..., **params}` -> Policy; unknown names or params list the valid ones.

  1. a controller name: the controller's own class checks the params (building
     it once here, so a bad value fails at plan time, not in a worker), and
     the pipeline keeps name + params; 2. a plain name: its dataclass fields.
  """
  params = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  name = params.pop("name", "greedy")
  if is_controller_policy(name):
    from o1jax.controller import build_policy as build_controller_policy
    built = build_controller_policy({"name": name, **params})
    full = built.to_dict()
    full.pop("name", None)
    return ControllerPolicy(policy_name=name, params=tuple(sorted(full.items())))
  cls = _lookup(name)
  valid = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(params) - valid)
  if unknown:
    raise ValueError(f"policy {cls.name!r} has no params {unknown}; valid: {sorted(valid) or 'none'}")
  return cls(**params)


def _lookup(name: str) -> type[Policy]:
  if name not in POLICIES:
    raise ValueError(f"unknown policy {name!r}; valid policies: {all_policy_names()} "
                     f"(plain sampling: {sorted(POLICIES)}; reasoning controller: "
                     f"{list(controller_policy_names())})")
  return POLICIES[name]
