"""Policy settings: the values a config's `policy` section starts from.

  from configs.policies import policy_config
  cfg = policy_config("deepconf", smoke=True)   # every param; then cfg.n = 16
  policy = o1jax.controller.build_policy(cfg)

A section holds every parameter of the policy class (its class defaults, the one place
they are kept, < the smoke variant < overrides), so `--config.policy.n=16` works and an unknown
key fails in `build_policy` with the list of valid ones. The smoke variant
shrinks the reasoning policies' samples and token budgets for a quick local run.
"""

from __future__ import annotations

import typing
from typing import Any

import ml_collections

from o1jax.controller.registry import POLICIES, policy_class, policy_defaults

# The smoke variant of a reasoning policy (plain policies take the config's own).
SMOKE = dict(max_thinking_tokens=24, max_answer_tokens=8, step_max_tokens=16)
SMOKE_SAMPLES = dict(n=2)
SMOKE_WARMUP = 1
SMOKE_MIN_THINKING = 8


def policy_config(name: str, smoke: bool = False, **overrides) -> ml_collections.ConfigDict:
  """Every param of policy `name` (class defaults < smoke < overrides); smoke
  shrinks the reasoning policies only (a plain policy's samples are the config's)."""
  values = policy_defaults(name)
  if smoke and policy_class(name).controller:
    values.update(SMOKE)
    if "n" in values:
      values.update(SMOKE_SAMPLES)
    if "warmup" in values:
      values["warmup"] = SMOKE_WARMUP
    if "min_thinking_tokens" in values:
      values["min_thinking_tokens"] = SMOKE_MIN_THINKING
  values.update(overrides)
  # An unset optional param (None) becomes a typed placeholder, so the command
  # line can still set it (`--config.policy.threshold=3.1`).
  for key, value in values.items():
    if value is None:
      values[key] = ml_collections.config_dict.placeholder(_optional_type(name, key))
  return ml_collections.ConfigDict(values)


def policy_params(name: str, smoke: bool = False) -> dict[str, Any]:
  """A pipeline config's `policy` section after its name: `policy_config(name, smoke)`,
  unset optional params kept as typed placeholders (settable from the command line)."""
  cfg = policy_config(name, smoke=smoke)
  return {k: cfg.get_ref(k) if cfg[k] is None else cfg[k] for k in cfg.keys() if k != "name"}


def _optional_type(name: str, field: str) -> type:
  """The X of a policy field annotated `X | None` (object if it is not that simple)."""
  hint = typing.get_type_hints(POLICIES[name])[field]
  types = [t for t in typing.get_args(hint) if t is not type(None)]
  return types[0] if len(types) == 1 and isinstance(types[0], type) else object
