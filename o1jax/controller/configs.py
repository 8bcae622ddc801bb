"""Example policy configs: one `ml_collections.ConfigDict` per registered policy.

  from o1jax.controller import configs, build_policy
  cfg = configs.get_config("deepconf")          # or "deepconf,smoke"
  cfg.n = 16                                    # override like --config.policy.n=16
  policy = build_policy(cfg)

`get_config(arg)` follows the project's `configs/` convention
(`name[,smoke]`): the smoke variant shrinks samples and token budgets for a
quick local run. The sections hold every parameter of the policy class, so
an unknown key fails in `build_policy` with the list of valid ones.
"""

from __future__ import annotations

import ml_collections

from o1jax.controller.policies import policy_defaults

# Values that differ from the class defaults, per policy.
EXAMPLES: dict[str, dict] = {
    "greedy_cot": dict(max_thinking_tokens=256),
    "self_consistency": dict(n=8, temperature=0.7),
    "best_of_n": dict(n=4, score="mean_logprob"),
    # Chosen on 48 synthetic problems of seed 1 (the benchmark uses seed 0): see
    # docs/controller.md, "DeepConf settings".
    "deepconf": dict(n=8, warmup=2, keep_percent=10.0, window=8, consensus=0.95,
                     consensus_min_votes=2, stop_when_decided=True),
    "think_verify_backtrack": dict(verifier="self_verify", backtrack_threshold=0.5,
                                   max_step_backtracks=2, max_backtracks=6, exit_tau=0.85,
                                   latency_slo_s=0.5, load=0.8),
    "budget_forcing": dict(min_thinking_tokens=64, max_thinking_tokens=256),
}

SMOKE = dict(max_thinking_tokens=24, max_answer_tokens=8, step_max_tokens=16)
SMOKE_SAMPLES = dict(n=2)


def policy_config(name: str, smoke: bool = False, **overrides) -> ml_collections.ConfigDict:
  """Every param of policy `name` (class defaults < EXAMPLES < smoke < overrides)."""
  values = policy_defaults(name)
  values.update(EXAMPLES.get(name, {}))
  if smoke:
    values.update(SMOKE)
    if "n" in values:
      values.update(SMOKE_SAMPLES)
    if "warmup" in values:
      values["warmup"] = 1
    if "min_thinking_tokens" in values:
      values["min_thinking_tokens"] = 8
  values.update(overrides)
  # An unset optional param (None) becomes a typed placeholder, so the command
  # line can still set it (`--config.policy.threshold=3.1`).
  for key, value in values.items():
    if value is None:
      values[key] = ml_collections.config_dict.placeholder(_optional_type(name, key))
  return ml_collections.ConfigDict(values)


def _optional_type(name: str, field: str) -> type:
  """The X of a policy field annotated `X | None` (object if it is not that simple)."""
  import typing

  from o1jax.controller.policies import POLICIES

  hint = typing.get_type_hints(POLICIES[name])[field]
  types = [t for t in typing.get_args(hint) if t is not type(None)]
  return types[0] if len(types) == 1 and isinstance(types[0], type) else object


def get_config(arg: str = "greedy_cot") -> ml_collections.ConfigDict:
  """`name` or `name,smoke`."""
  parts = [p for p in (arg or "greedy_cot").split(",") if p]
  return policy_config(parts[0], smoke="smoke" in parts[1:])
