"""Every policy by name, in one namespace: the controller's reasoning policies and plain sampling.

  build_policy({"name": "sample_n", "n": 8, "temperature": 0.7})   # plain: the engine samples
  build_policy({"name": "deepconf", "n": 16})                      # reasoning: Controller.run
  policy_names(), policy_names(controller=True)

Two kinds share the root class `BasePolicy` and the registry `POLICIES`:
  * plain sampling (`sampling_policies.py`: greedy, sample_n): `num_samples` independent
    samples per example, each drawn with the `SamplingSpec` that `sampling` returns; run
    one sample per work item by the engine or the generator;
  * reasoning (`policies.py`: greedy_cot, self_consistency, deepconf, ...): one work item
    per example; `run(controller, requests)` draws and aggregates its traces itself.
A researcher's own policy is a subclass of either, added with `@register` in a module that
a config names in `imports` (docs/controller.md, "Adding a policy").

This module imports no other policy module (policies.py and controller.py both import it),
so the controller and its policies do not import each other.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping, Optional

from o1jax.registry import Registry

# Samples (traces) per example a policy takes (pass@k studies use up to ~1,000; a
# million took the launcher minutes to plan, or a worker to find the loop cannot hold it).
MAX_SAMPLES = 100_000


class BasePolicy(abc.ABC):
  """What the pipeline asks every policy: how many work items an example gets, each
  one's sampling, whether samples are voted on, and who runs it."""

  name: ClassVar[str]
  controller: ClassVar[bool] = False  # run by the reasoning controller (`run`), not per sample
  vote: ClassVar[bool] = False  # aggregate GSM-style answers of the samples by majority vote
  # The traces of a request stop each other (a consensus stop in the loop): speculation,
  # which advances rows at different rates, may then move where they stop.
  cross_row_stops: ClassVar[bool] = False
  # The config's sampling fields the policy replaces with its own (the pipeline refuses
  # a config that sets them: they would be ignored).
  own_sampling: ClassVar[tuple[str, ...]] = ()

  @property
  @abc.abstractmethod
  def num_samples(self) -> int:
    """Work items per example (sample indices 0 .. num_samples - 1)."""

  def sampling(self, base, sample_index: int):
    """Decoding settings (`SamplingSpec`) of one sample; defaults to the config's."""
    del sample_index
    return base

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, **dataclasses.asdict(self)}

  def sample_identity(self) -> dict[str, Any]:
    """What of the policy can change one sample's output (its content key): all of it,
    unless a policy says otherwise (sample_n: not `n`)."""
    return self.to_dict()


POLICIES: dict[str, type[BasePolicy]] = Registry("policy")


def register(cls: type[BasePolicy]) -> type[BasePolicy]:
  """Class decorator: adds a policy under its `name` (a name taken by another class is
  refused: `o1jax.registry`)."""
  POLICIES[cls.name] = cls
  return cls


def policy_names(controller: Optional[bool] = None) -> list[str]:
  """Registered names, sorted; `controller` True / False: only reasoning / plain ones."""
  return sorted(name for name, cls in POLICIES.items()
                if controller is None or cls.controller == controller)


def policy_class(name: str) -> type[BasePolicy]:
  """The class registered as `name`; an unknown name lists the valid ones by kind."""
  if not isinstance(name, str) or name not in POLICIES:  # (a list was a TypeError: unhashable)
    raise ValueError(f"unknown policy {name!r}; valid policies: {policy_names()} "
                     f"(plain sampling: {policy_names(controller=False)}; reasoning controller: "
                     f"{policy_names(controller=True)})")
  return POLICIES[name]


def get_policy(name: str, **params) -> BasePolicy:
  """A registered policy by name; unknown names or params list the valid ones."""
  cls = policy_class(name)
  valid = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(params) - valid)
  if unknown:
    raise ValueError(f"policy {name!r} has no params {unknown}; valid: {sorted(valid) or 'none'}")
  return cls(**params)


def build_policy(section: Mapping[str, Any]) -> BasePolicy:
  """{"name": ..., **params} (a dict or an ml_collections.ConfigDict) -> policy."""
  if hasattr(section, "to_dict"):
    section = section.to_dict()
  if not isinstance(section, Mapping) or "name" not in section:
    raise ValueError(f"a policy is a name or {{'name': ..., **params}}, got {section!r}; "
                     f"valid policies: {policy_names()}")
  params = dict(section)
  return get_policy(params.pop("name"), **params)


def policy_defaults(name: str) -> dict[str, Any]:
  """Every param of policy `name` with its class default, after its name."""
  return get_policy(name).to_dict()
