"""GSM-style math evaluation; with no flags, the embedded default job (< 10 min on 2 cores).

  python -m pipelines.eval                                          # embedded default
  python -m pipelines.eval --config=configs/gsm8k.py:smoke=True
  python -m pipelines.eval --config=configs/gsm8k.py:policy=self_consistency \
      --config.policy.n=8 --output_dir=runs/sc8
  python -m pipelines.eval --config.dataset.name=gsm8k_jsonl --config.dataset.path=test.jsonl \
      --config.dataset.n=0 --config.prompt.style=fewshot

Variants after the colon (comma-separated key=value): smoke=True|False,
fast=True|False (the fastest matmuls here, int8 with the native kernel, + bf16 KV; README),
policy=<name>: plain sampling (greedy, sample_n; run by model.predictor=engine or
generator) or a reasoning-controller policy (greedy_cot, self_consistency,
best_of_n, deepconf, think_verify_backtrack, budget_forcing; run by the controller,
params from configs.policies.policy_config(name, smoke), each settable as
--config.policy.<param>=...).
"""

from configs import common

# gsm_synthetic's choice of problems: the generator's seed and difficulty levels (the
# 135M model is near zero beyond level 1). A file (gsm8k_jsonl) is read as it is: other
# values there are refused (pipelines.task_specs.check_gsm_config), not ignored.
SYNTHETIC_DEFAULTS = {"seed": 0, "levels": (1,)}

def get_config(arg: str = ""):
  variant = common.parse_arg(arg, common.VARIANTS)
  smoke = common.is_true(variant["smoke"], "smoke")

  config = common.section()
  config.task = "gsm8k"  # registry in pipelines/task_specs.py
  config.model = common.model_section()
  config.dataset = common.section(
      name="gsm_synthetic",  # gsm_synthetic | gsm8k_jsonl
      path="",  # gsm8k_jsonl: official GSM8K JSONL (local, gs://, s3://; a pattern: shards)
      n=8 if smoke else 48,  # examples (0 = all, for files)
      **SYNTHETIC_DEFAULTS,
  )
  # Few short worked examples, then one short sentence ending "The answer is N.":
  # the verbose 135M model otherwise spends its budget before answering.
  config.prompt = common.section(style="shortshot", system="short_answer")
  config.sampling = common.sampling_section(max_new_tokens=32 if smoke else 48)
  config.policy = common.policy_section(variant["policy"], smoke=smoke)
  config.engine = common.engine_section(smoke)
  config.budget = common.budget_section()
  config.speculative = common.speculative_section()
  config.controller = common.controller_section()
  config.runner = common.runner_section(batch_size=8)
  common.fast_numerics(config, common.is_true(variant["fast"], "fast"))
  return common.finish(config)
