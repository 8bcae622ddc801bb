"""Pieces shared by the config files: variant parsing and the common sections.

A config file's `get_config(arg)` reads variants after the colon
(`configs/gsm8k.py:policy=sample_n,smoke=True`), builds its sections with the
helpers here, then locks the config so a mistyped override is an error.
"""

from __future__ import annotations

from typing import Any, Mapping

import ml_collections

from configs.policies import policy_params
from o1jax.controller import policy_names

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")  # ("": the default, unset)


def parse_arg(arg: str, known: Mapping[str, str]) -> dict[str, str]:
  """"smoke=True,policy=sample_n" -> {"smoke": "True", "policy": "sample_n"}.

  Keys not in `known` are an error that lists the valid ones; missing keys
  keep the defaults in `known`.
  """
  values = dict(known)
  if not arg:
    return values
  given = set()
  for part in arg.split(","):
    key, sep, value = part.partition("=")
    key = key.strip()
    if not sep and given:  # "category=math,qa": a second value for the key before it
      raise ValueError(f"config variant {part!r}: expected key=value with key in "
                       f"{sorted(known)} (a variant takes one value)")
    if not sep or key not in known:
      raise ValueError(f"config variant {part!r}: expected key=value with key in {sorted(known)}")
    if key in given:  # the last one won without a word
      raise ValueError(f"config variant {key!r} is given twice: it takes one value")
    given.add(key)
    values[key] = value.strip()
  return values


def is_true(value: str, name: str) -> bool:
  """A true/false variant's value; any other spelling is an error naming the variant (a
  typo such as smoke=Ture ran the other job)."""
  spelled = str(value).strip().lower()
  if spelled not in TRUE + FALSE:
    raise ValueError(f"config variant {name}={value!r}: expected true or false "
                     f"(one of {', '.join(TRUE + FALSE[:-1])})")
  return spelled in TRUE


def section(**fields: Any) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(fields)


def model_section(predictor: str = "engine") -> ml_collections.ConfigDict:
  return section(
      # registry in pipelines/predictors.py: engine | generator | controller | fake.
      # A controller policy switches engine/generator to controller by itself.
      predictor=predictor,
      source="embedded",  # 'embedded', 'gemma3-270m', a .gguf file, an HF or orbax directory
      backend="auto",  # auto | pallas | reference
      # float32 (exact) | bfloat16 (bf16 matmul inputs, f32 accumulation: ~1.5x
      # faster batched decode on CPUs with AVX512-BF16; logits move ~1e-2) | int8
      # (4-bit weights as stored, two int8 levels per block of activations, native
      # VNNI/AMX or AVX2 kernel: ~2.3-2.5x faster batch-1 decode; logits move ~1e-3) | float8
      # (decoder-layer matmul inputs rounded to FP8 e4m3 per row; README "FP8 activations")
      matmul_dtype="float32",
      # Reasoning models' thinking span (o1jax/model/thinking.py): auto = the markers the
      # chat template names (none: no span), on, off, or "<open> <close>". With a span every
      # predictor scores the answer after it (the thinking goes into the record's trace).
      thinking="auto",
      fake_delay_s=0.0,  # predictor=fake only: seconds per predicted batch
  )


VARIANTS = {"smoke": "False", "policy": "greedy", "fast": "False"}


def fast_numerics(config: ml_collections.ConfigDict, fast: bool) -> None:
  """The `fast=True` variant: the fastest matmuls this machine runs
  (`pallas_kernels.ops.fastest_matmul_dtype`: int8 with the native int8 kernel, else
  float32 on a CPU) and bf16 KV. Both enter the content hash, so its results never mix with
  exact-f32 ones or with another machine's int8 ones."""
  if fast:
    from pallas_kernels.ops import fastest_matmul_dtype
    config.model.matmul_dtype = fastest_matmul_dtype()
    config.engine.kv_dtype = "bfloat16"


def sampling_section(max_new_tokens: int, seed: int = 0) -> ml_collections.ConfigDict:
  # Policies may override temperature/top_p/top_k per sample (see
  # o1jax/controller/sampling_policies.py).
  return section(max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=seed)


def engine_section(smoke: bool = False) -> ml_collections.ConfigDict:
  """`o1jax.engine.EngineConfig` knobs for predictor=engine (and the controller's row count)."""
  return section(
      # decode slots; 0 = runner.batch_size x the DirectRunner workers sharing the model
      # (every batch in flight fills its own slots; one batch's slots otherwise)
      max_slots=0,
      # KV pool in blocks; 0 = from kv_cache_bytes, grown so every slot holds the job's
      # longest prompt + max_new_tokens (up to half the device's memory)
      num_blocks=0,
      kv_cache_bytes=(32 if smoke else 64) << 20,
      block_size=16,
      kv_dtype="float32",  # or bfloat16 (half the KV bytes) / float8_e4m3fn (a scale per token)
      prefill_chunk=128,  # prompt tokens per prefill call
      max_prefill_seqs=4,
      prefix_caching=True,  # the shared few-shot prefix is prefilled once
      decode_steps=8,  # decode steps per device call (1 = a host round trip per token)
      # Which waiting request gets a slot (and, in the engine, which running one is preempted
      # first): fifo | shortest_budget (priority by remaining steps) | length_groups (engine
      # only). Controller policies admit by it too (fifo | shortest_budget).
      policy="fifo",
      tensor_parallel=1,  # devices one model is split over by heads (placed by topology)
      data_parallel=1,  # engine replicas in one worker, each on its own tensor_parallel devices
  )


def controller_section() -> ml_collections.ConfigDict:
  """The reasoning controller's KV cache (controller policies only; see docs/controller.md).

  Checked by `o1jax.controller.CacheConfig` (with the engine section's kv_dtype) when the
  plan is built."""
  return section(
      # paged: the engine's paged cache, samples share the prompt's blocks (less KV memory,
      # and faster on CPU); contiguous: every row holds all its positions. Not contiguous:
      # part of the content hash (other attention kernels, other rounding).
      cache="paged",
      block_size=16,  # paged: tokens per block
      num_blocks=0,  # paged: pool size; 0 = sized from the controller's plan (never runs out)
  )


def budget_section() -> ml_collections.ConfigDict:
  """The latency-aware compute budget (o1jax/engine/budget.py; `o1jax.engine.BudgetConfig`).

  fixed: no live budget (engine requests run sampling.max_new_tokens, controller
  policies their own step limits). adaptive: the budget is re-evaluated every
  interval_ms from the measured load and the P95 of the last `window` request
  latencies (none older than window_s) against latency_slo_s, and applied to running requests; it enters the
  content hash (outputs then depend on timing)."""
  return section(mode="fixed", latency_slo_s=0.5, interval_ms=200.0, window=64, window_s=10.0,
                 kv_limit=0.85)


def speculative_section() -> ml_collections.ConfigDict:
  """Speculative decoding (o1jax/engine/speculative.py; `o1jax.engine.SpeculativeConfig`):
  drafted tokens checked in one forward, by the engine or inside the controller's loop.

  Outputs are plain decoding's, token for token (greedy and sampled), so the section
  is not part of the content hash, except for a controller policy whose traces stop
  each other (deepconf's consensus stop). drafter: prompt_lookup (model-free: copies
  from the prompt and the text so far; the only drafter of the controller's loop) |
  early_exit (the model's first exit_layer layers; 0 = a quarter) | draft_model
  (draft_source: a checkpoint with the same vocabulary). adaptive: speculate only where
  it pays, from acceptance and measured call times (the engine: drafts per call; the
  controller: a verifying or a plain loop call)."""
  return section(enabled=False, drafter="prompt_lookup", max_drafts=7, ngram_max=4, ngram_min=1,
                 exit_layer=0, draft_source="", adaptive=True)


def policy_section(name: str, smoke: bool = False, **overrides: Any) -> ml_collections.ConfigDict:
  """name + the policy's params with their defaults (so `--config.policy.n=8` works).

  Controller policies (greedy_cot, self_consistency, deepconf, ...) take
  `configs.policies.policy_config(name, smoke)`; plain ones their fields.
  """
  if name not in policy_names():
    raise ValueError(f"config variant policy={name!r}: valid policies are {policy_names()} "
                     f"(one of your own: --config.imports=the.module.defining.it)")
  params = policy_params(name, smoke=smoke)
  params.update(overrides)
  return section(name=name, **params)


def runner_section(batch_size: int, workers: int = 2) -> ml_collections.ConfigDict:
  return section(
      # DirectRunner | dask (a dask.distributed cluster: pipelines/beam/dask_runner.py) |
      # DataflowRunner / FlinkRunner / SparkRunner (+ flags after --)
      name="DirectRunner",
      address="",  # dask: the scheduler, tcp://host:8786; empty = a LocalCluster here
      local_workers=workers,  # dask without an address: worker processes of the LocalCluster
      partitions=0,  # dask: partitions the work items are spread over; 0 = 2 x worker threads + 1
      direct_num_workers=workers,
      direct_running_mode="multi_processing",  # in_memory | multi_threading | multi_processing
      batch_size=batch_size,  # RunInference batch; engine.max_slots=0 gives each batch in flight its slots
      share_model=True,  # one model per machine, shared by the worker processes
      progress=True,  # progress bar with ETA on stderr (local output dirs only)
  )


def sandbox_section() -> ml_collections.ConfigDict:
  return section(timeout_s=3.0, memory_mb=1024, workers=2)


def finish(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  if "imports" not in config:
    # Modules imported first, by the launcher and every worker: your own policies,
    # verifiers, scorers or tasks (`--config.imports=mypkg.policies`; several: a,b).
    config.imports = ()
  config.lock()
  return config
