"""Example policy configs: one `ml_collections.ConfigDict` per registered policy.

  from o1jax.controller import configs, build_policy
  cfg = configs.get_config("deepconf")          # or "deepconf,smoke"
  cfg.n = 16                                    # override like --config.policy.n=16
  policy = build_policy(cfg)

`get_config(arg)` follows the project's `configs/` convention
(`name[,smoke]`): the smoke variant shrinks samples and token budgets for a
quick local run. The sections hold every parameter of the policy class, so
an unknown key fails in `build_policy` with the list of valid ones.

The KV cache behind the loop is not a policy setting but the controller's:

  section = configs.cache_config(cache="paged")  # contiguous | paged
  ctl = Controller(configs.build_decode_model(llama, section), tokenizer)
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import ml_collections

from o1jax.controller.registry import POLICIES, policy_class, policy_defaults

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
  """Every param of policy `name` (class defaults < EXAMPLES < smoke < overrides); smoke
  shrinks the reasoning policies only (a plain policy's samples are the config's)."""
  values = policy_defaults(name)
  values.update(EXAMPLES.get(name, {}))
  if smoke and policy_class(name).controller:
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


def policy_params(name: str, smoke: bool = False) -> dict[str, Any]:
  """A pipeline config's `policy` section after its name: `policy_config(name, smoke)`,
  unset optional params kept as typed placeholders (settable from the command line)."""
  cfg = policy_config(name, smoke=smoke)
  return {k: cfg.get_ref(k) if cfg[k] is None else cfg[k] for k in cfg.keys() if k != "name"}


def _optional_type(name: str, field: str) -> type:
  """The X of a policy field annotated `X | None` (object if it is not that simple)."""
  import typing

  hint = typing.get_type_hints(POLICIES[name])[field]
  types = [t for t in typing.get_args(hint) if t is not type(None)]
  return types[0] if len(types) == 1 and isinstance(types[0], type) else object


def get_config(arg: str = "greedy_cot") -> ml_collections.ConfigDict:
  """`name` or `name,smoke`."""
  parts = [p for p in (arg or "greedy_cot").split(",") if p]
  return policy_config(parts[0], smoke="smoke" in parts[1:])


# -- the decode model's KV cache ----------------------------------------------------------

CACHES = ("contiguous", "paged")
CACHE_DEFAULTS = dict(
    # paged: PagedLlama, samples share the prompt's blocks (measured faster on CPU too, see
    # docs/controller.md); contiguous: ContiguousLlama, every row holds all its positions
    cache="paged",
    block_size=16,  # paged: tokens per block
    num_blocks=0,  # paged: pool size; 0 = sized from the controller's plan (never runs out)
)


def check_cache_config(section: Mapping[str, Any]) -> dict[str, Any]:
  """The cache section as a dict (defaults filled in); an unknown key, cache name or
  size raises ValueError naming the bad value."""
  values = dict(section.to_dict() if hasattr(section, "to_dict") else section)
  unknown = sorted(set(values) - set(CACHE_DEFAULTS))
  if unknown:
    raise ValueError(f"controller cache section has no keys {unknown}; valid: "
                     f"{sorted(CACHE_DEFAULTS)}")
  values = {**CACHE_DEFAULTS, **values}
  if values["cache"] not in CACHES:
    raise ValueError(f"controller cache={values['cache']!r}: valid caches are {list(CACHES)}")
  if int(values["block_size"]) < 1 or int(values["num_blocks"]) < 0:
    raise ValueError(f"controller cache block_size={values['block_size']} must be >= 1 and "
                     f"num_blocks={values['num_blocks']} >= 0 (0 = sized from the plan)")
  return values


def cache_config(**overrides) -> ml_collections.ConfigDict:
  """The controller's cache section: CACHE_DEFAULTS < overrides (checked)."""
  return ml_collections.ConfigDict(check_cache_config({**CACHE_DEFAULTS, **overrides}))


def build_decode_model(model, section: Mapping[str, Any] | None = None,
                       kv_dtype: str = "float32"):
  """The DecodeModel for a `Llama` as the cache section says (None: CACHE_DEFAULTS).

  contiguous -> ContiguousLlama; paged -> PagedLlama(block_size, num_blocks or None).
  kv_dtype (the engine section's): float32 or bfloat16 for either cache,
  float8_e4m3fn (per-block scales) for the paged one only."""
  from o1jax.controller.decode_model import ContiguousLlama
  from o1jax.controller.paged_model import PagedLlama

  values = check_cache_config(section or {})
  if values["cache"] == "paged":
    return PagedLlama(model, block_size=int(values["block_size"]),
                      num_blocks=int(values["num_blocks"]) or None, kv_dtype=kv_dtype)
  dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
  if kv_dtype not in dtypes:
    raise ValueError(f"kv_dtype={kv_dtype!r}: the contiguous controller cache stores "
                     f"{sorted(dtypes)} (float8_e4m3fn needs cache='paged')")
  return ContiguousLlama(model, cache_dtype=dtypes[kv_dtype])
